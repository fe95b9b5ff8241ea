"""Consumer groups, sans-IO: membership, assignment, hand-over and positions.

A group member knows the other live members from their MEMBER heartbeats
(each lists the member's topics and the partitions it *claims*: delivers or
still hands over), forgets a member whose heartbeats stop for ``timeout``
seconds or that said goodbye, and computes the same assignment as everyone
else from the same view (:func:`assign`).

Hand-over, so that two members never deliver one partition at the same time
while they can hear each other:

* a member that is no longer assigned a partition it owns stops delivering
  it at once, commits its position and keeps claiming it until a store
  confirmed the commit (or ``release_timeout`` passed), then drops the claim;
* a member takes a partition assigned to it only when no other live member
  claims it, and only after asking the stores for the group's committed
  positions (GET-POSITIONS), so it resumes where the previous owner stopped;
* a new member takes nothing during ``settle`` seconds after it starts, the
  time to hear the heartbeats of the members already there.

A killed member's claims vanish when it expires, after ``timeout``.

Nothing here touches a socket or reads a clock: times are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Key = tuple[str, str]  # (topic, partition)


def assign(members: Mapping[str, Iterable[str]], partitions: Iterable[Key]) -> dict[Key, str]:
    """The owner of each partition: per topic, the topic's partitions sorted
    and dealt round-robin over the sorted ids of the members consuming it.

    ``members`` maps a member id to its topics.  Every member that sees the
    same members and partitions computes the same result.
    """
    by_topic: dict[str, list[str]] = {}
    for member, topics in members.items():
        for topic in set(topics):
            by_topic.setdefault(topic, []).append(member)
    for ids in by_topic.values():
        ids.sort()
    owners: dict[Key, str] = {}
    per_topic: dict[str, list[str]] = {}
    for key in set(partitions):
        per_topic.setdefault(key[0], []).append(key[1])
    for topic, parts in per_topic.items():
        ids = by_topic.get(topic)
        if not ids:
            continue
        for i, partition in enumerate(sorted(parts)):
            owners[(topic, partition)] = ids[i % len(ids)]
    return owners


@dataclass(slots=True)
class _Peer:
    topics: frozenset[str]
    claims: frozenset[Key]
    expires: float


@dataclass(slots=True)
class Plan:
    """What the shell must do after :meth:`GroupState.rebalance`."""

    revoke: list[Key] = field(default_factory=list)  # stop delivering, commit, then release
    acquire: list[Key] = field(default_factory=list)  # ask the stores for positions, then own


class GroupState:
    """One member's view of its group and its own partitions."""

    def __init__(
        self,
        group: str,
        me: str,
        topics: Iterable[str],
        *,
        timeout: float,
        settle: float,
        release_timeout: float,
        now: float,
    ) -> None:
        self.group = group
        self.me = me
        self.topics: set[str] = set(topics)
        self.timeout = timeout
        self.release_timeout = release_timeout
        self.settle_until = now + settle
        self.peers: dict[str, _Peer] = {}
        self.partitions: set[Key] = set()
        self.owned: set[Key] = set()  # delivering
        self.releasing: dict[Key, float] = {}  # handing over: claim dropped at this time at the latest
        self.acquiring: set[Key] = set()  # waiting for committed positions

    # ---------------------------------------------------------------- view

    def members(self) -> list[str]:
        """Ids of the live members, this one included, sorted."""
        return sorted([self.me, *self.peers])

    def on_member(
        self,
        member: str,
        topics: Iterable[str],
        claims: Iterable[Key],
        leaving: bool,
        now: float,
    ) -> bool:
        """A MEMBER heartbeat; returns True when the view changed (rebalance)."""
        if member == self.me:
            return False
        if leaving:
            return self.peers.pop(member, None) is not None
        old = self.peers.get(member)
        peer = _Peer(frozenset(topics), frozenset(claims), now + self.timeout)
        self.peers[member] = peer
        return old is None or old.topics != peer.topics or old.claims != peer.claims

    def expire(self, now: float) -> list[str]:
        """Forget members whose heartbeats stopped; returns their ids."""
        dead = [m for m, p in self.peers.items() if p.expires <= now]
        for member in dead:
            del self.peers[member]
        return dead

    def keep_alive(self, now: float) -> None:
        """We are not reading (our queue is full): give every member a fresh timeout.

        Their heartbeats wait unread meanwhile; silence we cannot hear is no death.
        """
        for peer in self.peers.values():
            peer.expires = max(peer.expires, now + self.timeout)

    def add_partition(self, key: Key) -> bool:
        """A partition of one of our topics was seen; True if it is new."""
        if key in self.partitions or key[0] not in self.topics:
            return False
        self.partitions.add(key)
        return True

    def add_topic(self, topic: str) -> None:
        self.topics.add(topic)

    def target(self) -> set[Key]:
        """The partitions the assignment gives this member."""
        members: dict[str, Iterable[str]] = {m: p.topics for m, p in self.peers.items()}
        members[self.me] = self.topics
        return {k for k, owner in assign(members, self.partitions).items() if owner == self.me}

    def claimed_by_others(self, key: Key) -> bool:
        return any(key in p.claims for p in self.peers.values())

    def claims(self) -> list[Key]:
        """What this member's heartbeat claims: owned, being handed over, being taken."""
        return sorted(self.owned | set(self.releasing) | self.acquiring)

    # ---------------------------------------------------------------- hand-over

    def rebalance(self, now: float) -> Plan:
        """Compare what we own with what we are assigned (see the module docstring)."""
        plan = Plan()
        if now < self.settle_until:
            return plan
        target = self.target()
        for key in sorted(self.owned - target):
            self.owned.discard(key)
            self.releasing[key] = now + self.release_timeout
            plan.revoke.append(key)
        self.acquiring &= target  # an unfinished take that is no longer ours is dropped
        for key in sorted(target - self.owned - self.acquiring):
            if key in self.releasing or self.claimed_by_others(key):
                continue
            self.acquiring.add(key)
            plan.acquire.append(key)
        return plan

    def released(self, keys: Iterable[Key]) -> None:
        """The commit of handed-over partitions is durable: drop the claims."""
        for key in keys:
            self.releasing.pop(key, None)

    def release_overdue(self, now: float) -> list[Key]:
        """Hand-overs whose commit was not confirmed in time: drop them anyway."""
        late = [k for k, t in self.releasing.items() if t <= now]
        for key in late:
            del self.releasing[key]
        return late

    def acquired(self, keys: Iterable[Key]) -> list[Key]:
        """Positions arrived: the partitions still being taken are now owned."""
        done = [k for k in keys if k in self.acquiring]
        for key in done:
            self.acquiring.discard(key)
            self.owned.add(key)
        return done

    def leave(self) -> list[Key]:
        """Closing: give up everything; returns what was owned."""
        owned = sorted(self.owned)
        self.owned.clear()
        self.acquiring.clear()
        self.releasing.clear()
        return owned


class PositionsQuery:
    """Collects the stores' POSITIONS answers to one GET-POSITIONS.

    Done ``grace`` seconds after the first answer (other stores answer at
    about the same time), or at ``deadline`` when no store answers.  Each
    store overwrites positions in place, and positions only move forward in
    normal operation, so the highest offset any store reports wins (a store
    that was down during a commit still holds an older one).
    """

    def __init__(self, request_id: int, now: float, timeout: float, grace: float) -> None:
        self.request_id = request_id
        self.deadline = now + timeout
        self.grace = grace
        self.first_answer: float | None = None
        self.answers = 0
        self.positions: dict[Key, int] = {}

    def on_answer(self, positions: Iterable[tuple[str, str, int]], now: float) -> None:
        if self.first_answer is None:
            self.first_answer = now
        self.answers += 1
        best = self.positions
        for topic, partition, offset in positions:
            key = (topic, partition)
            if offset > best.get(key, -1):
                best[key] = offset

    def done(self, now: float) -> bool:
        if self.first_answer is not None:
            return now >= self.first_answer + self.grace
        return now >= self.deadline


class PendingCommits:
    """Commits sent and not yet confirmed by a store, by commit id."""

    def __init__(self) -> None:
        self.next_id = 1
        self._pending: dict[int, tuple[dict[Key, int], float]] = {}

    def new(self, positions: Mapping[Key, int], now: float) -> int:
        commit_id = self.next_id
        self.next_id += 1
        self._pending[commit_id] = (dict(positions), now)
        return commit_id

    def confirmed(self, commit_id: int) -> dict[Key, int] | None:
        """A store confirmed ``commit_id``: its positions, or None if unknown or already confirmed."""
        entry = self._pending.pop(commit_id, None)
        return None if entry is None else entry[0]

    def forget_older(self, now: float, age: float) -> None:
        """Drop commits nobody confirmed within ``age`` seconds (bounded memory)."""
        for commit_id in [c for c, (_, t) in self._pending.items() if now - t > age]:
            del self._pending[commit_id]

    def __len__(self) -> int:
        return len(self._pending)
