"""Kafka consumer groups (the classic protocol), sans-IO.

The gateway is the coordinator of every group.  It does not assign
partitions: the client leader does.  The coordinator

* collects JoinGroup requests; once every known member joined (or the
  rebalance timeout passed, dropping those that did not), it bumps the
  generation, picks the protocol every member supports (the leader's first
  choice among them), picks a leader, and answers every join: the leader gets
  the members and their metadata, the others an empty list;
* relays the leader's SyncGroup assignments to every member;
* answers heartbeats, telling members to rejoin (REBALANCE_IN_PROGRESS) while
  a rebalance runs, and drops members whose session timed out, or that left;
  either starts a rebalance.

Nothing here reads a clock or touches a socket: times come in as ``now``
(seconds), and answers go out as :class:`Answer` objects whose ``token`` the
shell gave with the request (its connection and response slot).  An answer
for a request that is still waiting comes out of a later call
(:meth:`Coordinator.tick` or another member's request).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from dafka.gateway.connections import LogLimiter
from dafka.kafka.codec import Err
from dafka.tank.mapping import shown

log = logging.getLogger("dafka.kafka")

#: Bounds a client cannot move (Kafka's group.min/max.session.timeout.ms).
MIN_SESSION_TIMEOUT = 0.1
MAX_SESSION_TIMEOUT = 300.0
#: A JoinGroup's rebalance timeout is cut to this (seconds; the gateway sets its limit): one
#: member asking for 2^31-1 ms would hold its group's rebalances for ~24 days.  Five minutes is
#: Kafka's default max.poll.interval.ms, which clients send as their rebalance timeout.
MAX_REBALANCE_TIMEOUT = 300.0
#: At most this many members per group and groups per gateway.
MAX_MEMBERS = 1000
MAX_GROUPS = 10_000
#: Member metadata and assignments larger than this are refused.
MAX_METADATA = 1 << 20
#: Bytes of member metadata, protocol names, ids and assignments held over every group:
#: a join past it is refused (COORDINATOR_NOT_AVAILABLE), so many groups cannot add up.
MAX_HELD = 256 << 20

EMPTY, PREPARING, COMPLETING, STABLE = "Empty", "PreparingRebalance", "CompletingRebalance", "Stable"


@dataclass(slots=True)
class Answer:
    """What to send for one request: ``token`` from the shell, ``fields`` of the response."""

    token: Any
    fields: dict[str, Any]


@dataclass(slots=True)
class Member:
    member_id: str
    client_id: str
    session_timeout: float
    rebalance_timeout: float
    protocol_type: str
    protocols: list[tuple[str, bytes]]
    last_seen: float
    join_token: Any = None  # a JoinGroup waiting for the rebalance to complete
    sync_token: Any = None  # a SyncGroup waiting for the leader's assignments
    assignment: bytes = b""
    client_host: str = ""  # where it connects from (DescribeGroups shows it)


@dataclass(slots=True)
class Group:
    group_id: str
    state: str = EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    rebalance_deadline: float = 0.0


class Coordinator:
    """Every group's state; one instance per gateway."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self._ids = itertools.count(1)
        self.max_held = MAX_HELD
        self.max_rebalance_timeout = MAX_REBALANCE_TIMEOUT
        #: Bytes members hold now (see :data:`MAX_HELD`).
        self.held = 0
        #: No session or rebalance can end before this: :meth:`tick` does nothing until then
        #: (an idle coordinator costs nothing, however many members came and went).
        self.next_due = float("inf")
        #: Members looked at by :meth:`tick` (its cost).
        self.scanned = 0
        self._limited = LogLimiter(log)

    # ---------------------------------------------------------------- requests

    def join(
        self,
        token: Any,
        now: float,
        group_id: str,
        member_id: str,
        client_id: str,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
        session_timeout: float,
        rebalance_timeout: float,
        client_host: str = "",
    ) -> list[Answer]:
        """A JoinGroup: answers now (errors) or once the rebalance completes."""

        def fail(code: int) -> list[Answer]:
            return [Answer(token, _join_fields(code, -1, "", "", member_id, []))]

        if not group_id:
            return fail(Err.INVALID_GROUP_ID)
        rebalance_timeout = min(max(rebalance_timeout, 0.0), self.max_rebalance_timeout)
        if not MIN_SESSION_TIMEOUT <= session_timeout <= MAX_SESSION_TIMEOUT:
            return fail(Err.INVALID_SESSION_TIMEOUT)
        if not protocols or sum(len(m) for _, m in protocols) > MAX_METADATA:
            return fail(Err.INCONSISTENT_GROUP_PROTOCOL)
        group = self.groups.get(group_id)
        if group is None:
            if len(self.groups) >= MAX_GROUPS:
                self._forget_empty()
                if len(self.groups) >= MAX_GROUPS:
                    return fail(Err.COORDINATOR_NOT_AVAILABLE)
            group = self.groups[group_id] = Group(group_id)
        if group.members and group.protocol_type not in (None, protocol_type):
            return fail(Err.INCONSISTENT_GROUP_PROTOCOL)
        names = {n for n, _ in protocols}
        if group.members and not any(names & {n for n, _ in m.protocols} for m in group.members.values()):
            return fail(Err.INCONSISTENT_GROUP_PROTOCOL)
        out: list[Answer] = []
        member = group.members.get(member_id) if member_id else None
        if member_id and member is None:
            return fail(Err.UNKNOWN_MEMBER_ID)
        cost = _cost(protocols) + (len(client_id) * 2 + 40) * 2 + 64
        if self.held + cost - (_held(member) if member is not None else 0) > self.max_held:
            self._limited.warning(
                "join-refused", "group %s: join refused, members of all groups hold %d bytes (at most %d)",
                shown(group_id), self.held, self.max_held,
            )
            if not group.members:
                del self.groups[group_id]
            return fail(Err.COORDINATOR_NOT_AVAILABLE)
        if member is None:
            if len(group.members) >= MAX_MEMBERS:
                return fail(Err.COORDINATOR_NOT_AVAILABLE)
            member_id = f"{client_id or 'member'}-{uuid.uuid4()}"
            member = Member(
                member_id, client_id, session_timeout, rebalance_timeout, protocol_type, protocols, now,
                client_host=client_host[:64],
            )
            group.members[member_id] = member
            self.held += _held(member)
            self.next_due = min(self.next_due, now + session_timeout)
            log.debug("group %s: member %s joins", shown(group_id), shown(member_id))
        else:
            self.held -= _held(member)
            member.protocols = protocols
            self.held += _held(member)
            member.session_timeout = session_timeout
            member.rebalance_timeout = rebalance_timeout
            member.last_seen = now
            if member.join_token is not None:  # a retried join: the old one is superseded
                out.append(Answer(member.join_token, _join_fields(Err.REBALANCE_IN_PROGRESS, -1, "", "", member_id, [])))
        member.join_token = token
        group.protocol_type = protocol_type
        if group.state != PREPARING:
            out.extend(self._prepare(group, now))
        out.extend(self._maybe_complete(group, now))
        return out

    def sync(
        self, token: Any, now: float, group_id: str, member_id: str, generation: int,
        assignments: list[tuple[str, bytes]],
    ) -> list[Answer]:
        group = self.groups.get(group_id)
        member = group.members.get(member_id) if group else None

        def answer(code: int, assignment: bytes = b"") -> list[Answer]:
            return [Answer(token, _sync_fields(code, group, assignment))]

        if group is None or member is None:
            return answer(Err.UNKNOWN_MEMBER_ID)
        member.last_seen = now
        if generation != group.generation:
            return answer(Err.ILLEGAL_GENERATION)
        if group.state == PREPARING:
            return answer(Err.REBALANCE_IN_PROGRESS)
        if group.state == STABLE:
            return answer(Err.NONE, member.assignment)
        # COMPLETING: wait for the leader's assignments.
        if sum(len(a) for _, a in assignments) > MAX_METADATA * 4:
            return answer(Err.INVALID_REQUEST)
        member.sync_token = token
        out: list[Answer] = []
        if member_id == group.leader:
            given = dict(assignments)
            more = sum(len(given.get(m.member_id, b"")) - len(m.assignment) for m in group.members.values())
            if self.held + more > self.max_held:
                self._limited.warning(
                    "sync-refused", "group %s: assignments refused, members of all groups hold %d bytes (at most %d)",
                    shown(group_id), self.held, self.max_held,
                )
                member.sync_token = None
                return answer(Err.COORDINATOR_NOT_AVAILABLE)
            for m in group.members.values():
                self.held -= len(m.assignment)
                m.assignment = given.get(m.member_id, b"")
                self.held += len(m.assignment)
            group.state = STABLE
            log.debug(
                "group %s: generation %d stable, %d members, protocol %s",
                shown(group_id), group.generation, len(group.members), group.protocol,
            )
            for m in group.members.values():
                if m.sync_token is not None:
                    out.append(Answer(m.sync_token, _sync_fields(Err.NONE, group, m.assignment)))
                    m.sync_token = None
        return out

    def heartbeat(self, now: float, group_id: str, member_id: str, generation: int) -> int:
        """The heartbeat's error code."""
        group = self.groups.get(group_id)
        member = group.members.get(member_id) if group else None
        if group is None or member is None:
            return Err.UNKNOWN_MEMBER_ID
        member.last_seen = now
        if group.state == PREPARING:
            return Err.REBALANCE_IN_PROGRESS
        if generation != group.generation:
            return Err.ILLEGAL_GENERATION
        return Err.NONE

    def leave(self, now: float, group_id: str, member_ids: list[str]) -> tuple[list[int], list[Answer]]:
        """Remove members: their error codes, and answers the rebalance released."""
        group = self.groups.get(group_id)
        codes: list[int] = []
        out: list[Answer] = []
        for mid in member_ids:
            if group is None or mid not in group.members:
                codes.append(Err.UNKNOWN_MEMBER_ID)
                continue
            codes.append(Err.NONE)
            log.debug("group %s: member %s leaves", shown(group_id), shown(mid))
            out.extend(self._remove(group, mid, now))
        return codes, out

    def check_member(self, group_id: str, member_id: str, generation: int) -> int:
        """Whether an OffsetCommit with this member and generation may commit."""
        group = self.groups.get(group_id)
        if generation < 0 and not member_id:
            if group is not None and group.members:
                return Err.ILLEGAL_GENERATION  # a simple commit into a live group
            return Err.NONE
        if group is None or member_id not in group.members:
            return Err.UNKNOWN_MEMBER_ID
        if generation != group.generation:
            return Err.ILLEGAL_GENERATION
        if group.state == PREPARING:
            return Err.REBALANCE_IN_PROGRESS
        return Err.NONE

    def forget_token(self, token_owner: Any) -> None:
        """A connection closed: requests of it that wait are not answered."""
        for group in self.groups.values():
            for m in group.members.values():
                if m.join_token is not None and getattr(m.join_token, "conn", None) is token_owner:
                    m.join_token = None
                if m.sync_token is not None and getattr(m.sync_token, "conn", None) is token_owner:
                    m.sync_token = None

    # ---------------------------------------------------------------- time

    def tick(self, now: float) -> list[Answer]:
        """Sessions and rebalances that ended by ``now``.  Looks at members only when one may
        have (:attr:`next_due`), and forgets empty groups then."""
        if now < self.next_due:
            return []
        out: list[Answer] = []
        due = float("inf")
        for group in list(self.groups.values()):
            for mid, m in list(group.members.items()):
                self.scanned += 1
                waiting = m.join_token is not None and group.state == PREPARING
                if waiting or m.sync_token is not None:
                    due = min(due, now + m.session_timeout)  # not judged while it waits: later
                elif now - m.last_seen > m.session_timeout:
                    log.debug("group %s: member %s session timed out", shown(group.group_id), shown(mid))
                    out.extend(self._remove(group, mid, now))
                else:
                    due = min(due, m.last_seen + m.session_timeout)
            if group.state == PREPARING and now >= group.rebalance_deadline:
                for mid, m in list(group.members.items()):
                    if m.join_token is None:
                        log.debug("group %s: member %s did not rejoin in time", shown(group.group_id), shown(mid))
                        self.held -= _held(group.members.pop(mid))
                out.extend(self._maybe_complete(group, now))
            if group.state == PREPARING:
                due = min(due, group.rebalance_deadline)
            if not group.members:
                del self.groups[group.group_id]  # its committed offsets live in the store
        # Whatever the answers above started (a rebalance) lowered next_due meanwhile.
        self.next_due = min(due, self.next_due) if self.next_due > now else due
        if self.next_due <= now:
            self.next_due = now + MIN_SESSION_TIMEOUT
        return out

    # ---------------------------------------------------------------- inside

    def _prepare(self, group: Group, now: float) -> list[Answer]:
        """Start a rebalance; syncs still waiting are told to rejoin."""
        group.state = PREPARING
        timeout = max((m.rebalance_timeout for m in group.members.values()), default=0.0)
        group.rebalance_deadline = now + timeout
        self.next_due = min(self.next_due, group.rebalance_deadline)
        out = []
        for m in group.members.values():
            if m.sync_token is not None:
                out.append(Answer(m.sync_token, _sync_fields(Err.REBALANCE_IN_PROGRESS, group, b"")))
                m.sync_token = None
        return out

    def _remove(self, group: Group, member_id: str, now: float) -> list[Answer]:
        member = group.members.pop(member_id)
        self.held -= _held(member)
        out: list[Answer] = []
        if member.sync_token is not None:
            out.append(Answer(member.sync_token, _sync_fields(Err.REBALANCE_IN_PROGRESS, group, b"")))
        if member.join_token is not None:
            out.append(Answer(member.join_token, _join_fields(Err.UNKNOWN_MEMBER_ID, -1, "", "", member_id, [])))
        if not group.members:
            group.state = EMPTY
            group.leader = None
            group.generation += 1
            return out
        if group.leader == member_id:
            group.leader = None
        if group.state != PREPARING:
            out.extend(self._prepare(group, now))
        out.extend(self._maybe_complete(group, now))
        return out

    def _maybe_complete(self, group: Group, now: float) -> list[Answer]:
        if group.state != PREPARING or not group.members:
            return []
        if any(m.join_token is None for m in group.members.values()):
            return []
        members = list(group.members.values())
        leader = group.leader if group.leader in group.members else members[0].member_id
        common = set.intersection(*({n for n, _ in m.protocols} for m in members))
        if not common:
            # Should not happen (joins are checked); drop the newest member's hopes.
            protocol = None
        else:
            protocol = next(n for n, _ in group.members[leader].protocols if n in common)
        group.generation += 1
        group.leader = leader
        group.protocol = protocol
        group.state = COMPLETING
        out = []
        listing = [
            (m.member_id, next((md for n, md in m.protocols if n == protocol), b"")) for m in members
        ]
        for m in members:
            code = Err.NONE if protocol is not None else Err.INCONSISTENT_GROUP_PROTOCOL
            out.append(
                Answer(
                    m.join_token,
                    _join_fields(
                        code, group.generation, protocol or "", leader, m.member_id,
                        listing if m.member_id == leader else [], group.protocol_type or "",
                    ),
                )
            )
            m.join_token = None
            m.last_seen = now
        log.debug("group %s: generation %d, leader %s, %d members", shown(group.group_id), group.generation,
                  shown(leader), len(members))
        return out

    def _forget_empty(self) -> None:
        for gid in [g for g, grp in self.groups.items() if not grp.members]:
            del self.groups[gid]


def _cost(protocols: list[tuple[str, bytes]]) -> int:
    return sum(len(n) + len(m) for n, m in protocols)


def _held(member: Member) -> int:
    """Bytes a member holds, about (strings counted twice for their Python overhead)."""
    return _cost(member.protocols) + len(member.assignment) + (len(member.member_id) + len(member.client_id)) * 2 + 64


def _join_fields(
    code: int, generation: int, protocol: str, leader: str, member_id: str,
    members: list[tuple[str, bytes]], protocol_type: str = "",
) -> dict[str, Any]:
    return {
        "error_code": code,
        "generation_id": generation,
        "protocol_type": protocol_type,
        "protocol_name": protocol,
        "leader": leader,
        "member_id": member_id,
        "members": members,
    }


def _sync_fields(code: int, group: Group | None, assignment: bytes) -> dict[str, Any]:
    return {
        "error_code": code,
        "protocol_type": group.protocol_type if group else None,
        "protocol_name": group.protocol if group else None,
        "assignment": assignment,
    }
