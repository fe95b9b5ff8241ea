"""``dafka status``: a read-only view of the mesh.

:class:`MeshView` is the sans-IO part: it is told what arrived (tower beacons,
peers' messages with their sender, subscriptions seen on our publisher) and
keeps what is known of every peer and partition.  :class:`StatusProbe` is the
thin I/O shell: one beacon SUB per tower (so we know which towers answer), one
data SUB per peer (so every message's sender is known: a HEAD's address field
names the partition, not the sender), and an XPUB it announces in beacons, so
that stores connect and answer GET-HEADS and peers' subscriptions reveal their
kind.  It only ever sends beacons, GET-HEADS and GET-POSITIONS.

In secure mode (``config.security``) the probe is a CURVE node like any other:
it needs an allow-listed key (any role; ``consumer`` is the natural one), sends
its public key in beacons, connects only to allow-listed peers, and takes a
peer's kind from its key's role in the allow-list.  Heads that only stores may
tell (ACK, DIRECT-HEAD, another partition's HEAD) count only from store-role
keys, as in the nodes.

What the protocol shows of a peer's kind:

* a HEAD or DIRECT-HEAD for its own address: a producer (the partition is it);
* an ACK, a STORE-HELLO, or a HEAD / DIRECT-HEAD for another partition: a store
  (Python stores re-announce every head when a subscriber to ``H`` connects,
  C and Python stores answer GET-HEADS with DIRECT-HEADs);
* subscriptions on our XPUB carrying an address: ``K``/``F`` + X (X is a
  producer), ``W`` + X (a store), ``L`` + X (a consumer).

A store's STORE-STATUS to its producers says when it cannot acknowledge and
why (a full disk, refused records): the view keeps those, for the alerts.

Consumer groups: members' MEMBER heartbeats name the group, the member, its
topics and claims; the probe asks the stores for each group's committed
positions (GET-POSITIONS, as a member does) and a group's lag per partition is
the records after its position: ``store head + 1 - position``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from dafka.cli.args import add_node_flags, positive_seconds_arg, seconds_arg
from dafka.cli.common import node_config
from dafka.config import NodeConfig, Settings
from dafka.core import wire
from dafka.errors import ProtocolError
from dafka.nodes import security
from dafka.nodes.node import RETRY_REFUSED, new_address, read_subscriptions

log = logging.getLogger("dafka.status")

KIND_ORDER = ("store", "producer", "consumer")  # strongest evidence first
# Secure mode: the kind a key's allow-list role shows (a gateway stores and produces).
ROLE_KINDS = {"store": "store", "gateway": "store", "producer": "producer", "consumer": "consumer"}


@dataclass
class PeerInfo:
    """One node seen through the towers."""

    address: str
    endpoint: str
    last_beacon: float
    alive: bool = True


@dataclass
class PartitionInfo:
    """What is known of one (topic, partition)."""

    topic: str
    partition: str
    producer_head: int | None = None  # from the producer's own HEAD / DIRECT-HEAD
    stores: dict[str, int] = field(default_factory=dict)  # store address -> head
    told: float = 0.0  # when a head of it last came

    def lag(self) -> dict[str, int]:
        """Per store: how many records it is behind the newest head known."""
        top = self.producer_head
        if self.stores:
            top = max(top if top is not None else -1, *self.stores.values())
        return {s: (top - h if top is not None else 0) for s, h in self.stores.items()}


MAX_GROUPS = 1000  # groups tracked (heartbeats naming more are counted, not kept)
MAX_MEMBERS = 1000  # members tracked per group
MAX_GROUP_POSITIONS = 10_000  # committed positions kept per group
MAX_NOT_WRITING = 10_000  # (store, topic, partition)s kept that a store said it cannot acknowledge
NOT_WRITING_FOR = 10.0  # seconds a store's "not writing" counts without being said again
# A --watch (or the console) runs for days over a mesh whose nodes come and go:
# what it keeps of the gone ones is bounded in time, what it keeps at all in size.
GONE_KEPT = 60.0  # seconds a node that stopped beaconing is still listed (down), then forgotten
PARTITION_KEPT = 60.0  # seconds a partition nobody tells a head of is kept (stores tell every 2 s when asked)
MAX_PARTITIONS = 100_000  # partitions tracked (heads of more are counted, not kept)
MAX_EVIDENCE = 100_000  # addresses whose kind is remembered


@dataclass
class MemberInfo:
    """One group member, from its MEMBER heartbeats."""

    address: str
    topics: tuple[str, ...]
    claims: tuple[tuple[str, str], ...]
    last_seen: float


@dataclass
class GroupInfo:
    """What is known of one consumer group."""

    group: str
    members: dict[str, MemberInfo] = field(default_factory=dict)
    positions: dict[tuple[str, str], int] = field(default_factory=dict)  # committed next offsets
    last_seen: float = 0.0


class MeshView:
    """Sans-IO aggregation of what a status probe learns (times passed in)."""

    def __init__(self, own_address: str, towers: list[str], timeout: float = 4.0) -> None:
        self.own_address = own_address
        self.timeout = timeout
        self.towers: dict[str, float | None] = dict.fromkeys(towers)  # endpoint -> last heard
        self.peers: dict[str, PeerInfo] = {}
        self.evidence: dict[str, set[str]] = {}  # address -> kinds it showed
        self.partitions: dict[tuple[str, str], PartitionInfo] = {}
        self.groups: dict[str, GroupInfo] = {}
        # STORE-STATUS saying a store cannot acknowledge: (store, topic, partition) -> (reason, when).
        self.not_writing: dict[tuple[str, str, str], tuple[str, float]] = {}
        self.malformed = 0
        self.forged = 0  # secure mode: store-only heads from keys without a store role
        self.dropped_groups = 0  # heartbeats of groups or members beyond the bounds
        self.dropped_partitions = 0  # heads of partitions beyond MAX_PARTITIONS

    # ---------------------------------------------------------------- input

    def on_tower(self, tower: str, now: float) -> None:
        """A tower sent us something (welcome or beacon): it is reachable."""
        self.towers[tower] = now

    def on_beacon(self, address: str, endpoint: str, now: float) -> str | None:
        """A tower relayed a beacon; returns an endpoint to connect to, if new."""
        if address == self.own_address:
            return None
        peer = self.peers.get(address)
        if peer is None or not peer.alive or peer.endpoint != endpoint:
            self.peers[address] = PeerInfo(address, endpoint, now)
            return endpoint
        peer.last_beacon = now
        return None

    def expire(self, now: float) -> list[str]:
        """Mark peers silent for ``timeout`` as gone; returns their addresses."""
        gone = []
        for peer in list(self.peers.values()):
            if peer.alive and now - peer.last_beacon >= self.timeout:
                peer.alive = False
                gone.append(peer.address)
            elif not peer.alive and now - peer.last_beacon >= self.timeout + GONE_KEPT:
                del self.peers[peer.address]  # gone a while: forgotten (a new beacon brings it back)
                self.evidence.pop(peer.address, None)
        for key, info in list(self.partitions.items()):
            if now - info.told >= PARTITION_KEPT:
                del self.partitions[key]  # nobody tells of it any more (no store holds it, its producer is gone)
        for key, (_, when) in list(self.not_writing.items()):
            if now - when >= NOT_WRITING_FOR:
                del self.not_writing[key]  # not said again: it recovered, or went away
        for name, group in list(self.groups.items()):
            for address, member in list(group.members.items()):
                if now - member.last_seen >= self.timeout:
                    del group.members[address]
            if not group.members and now - group.last_seen >= 10 * self.timeout:
                del self.groups[name]  # no member for a while: forget it (and its positions)
        return gone

    def on_role(self, address: str, role: str) -> None:
        """Secure mode: the allow-list gives this peer's key ``role``."""
        kind = ROLE_KINDS.get(role)
        if kind is not None:
            self._seen_as(address, kind)

    def _seen_as(self, address: str, kind: str) -> None:
        seen = self.evidence.get(address)
        if seen is None:
            if len(self.evidence) >= MAX_EVIDENCE and address not in self.peers:
                return
            seen = self.evidence[address] = set()
        seen.add(kind)

    def _partition(self, topic: str, partition: str, now: float) -> PartitionInfo | None:
        key = (topic, partition)
        info = self.partitions.get(key)
        if info is None:
            if len(self.partitions) >= MAX_PARTITIONS:
                self.dropped_partitions += 1
                return None
            info = self.partitions[key] = PartitionInfo(topic, partition)
        info.told = now
        return info

    def on_message(self, sender: str, msg: wire.Message, now: float = 0.0) -> None:
        """A message arrived from the peer ``sender`` (at ``now``: group heartbeats)."""
        if isinstance(msg, wire.Head | wire.DirectHead):
            if isinstance(msg, wire.Head) and msg.topic != msg.subject:
                return  # a prefix match of another topic's subscription
            info = self._partition(msg.subject, msg.address, now)
            if info is None:
                return
            if msg.address == sender:
                self._seen_as(sender, "producer")
                info.producer_head = msg.sequence
            else:
                self._seen_as(sender, "store")
                info.stores[sender] = msg.sequence
        elif isinstance(msg, wire.Ack):
            # ACK's zmq topic is the producer (the partition) it acknowledges.
            self._seen_as(sender, "store")
            acked = self._partition(msg.subject, msg.topic, now)
            if acked is not None:
                acked.stores[sender] = msg.sequence
        elif isinstance(msg, wire.StoreHello):
            self._seen_as(msg.address, "store")
        elif isinstance(msg, wire.StoreStatus):
            if msg.address != sender:
                return  # a store speaks for itself only
            self._seen_as(sender, "store")
            key = (sender, msg.subject, msg.topic)  # zmq topic: the producer (the partition)
            if msg.writing:
                self.not_writing.pop(key, None)
            elif key in self.not_writing or len(self.not_writing) < MAX_NOT_WRITING:
                self.not_writing[key] = (msg.reason, now)
        elif isinstance(msg, wire.Member):
            self._on_member(sender, msg, now)
        elif isinstance(msg, wire.Positions):
            if msg.topic != self.own_address:
                return  # an answer to a member, not to us
            self._seen_as(sender, "store")
            group = self.groups.get(msg.group)
            if group is None:
                return  # we asked for groups we know only
            for topic, partition, offset in msg.positions:
                key = (topic, partition)
                if key in group.positions or len(group.positions) < MAX_GROUP_POSITIONS:
                    # Stores may lag each other: the furthest commit is the group's.
                    group.positions[key] = max(offset, group.positions.get(key, 0))

    def _on_member(self, sender: str, msg: wire.Member, now: float) -> None:
        if msg.address != sender:
            return  # a member speaks for itself only
        self._seen_as(sender, "consumer")
        group = self.groups.get(msg.topic)
        if group is None:
            if msg.leaving:
                return
            if len(self.groups) >= MAX_GROUPS:
                self.dropped_groups += 1
                return
            group = self.groups[msg.topic] = GroupInfo(msg.topic)
        group.last_seen = now
        if msg.leaving:
            group.members.pop(sender, None)
            return
        if sender not in group.members and len(group.members) >= MAX_MEMBERS:
            self.dropped_groups += 1
            return
        group.members[sender] = MemberInfo(sender, tuple(msg.topics), tuple(msg.claims), now)

    def on_subscription(self, prefix: bytes) -> None:
        """A peer subscribed ``prefix`` on our publisher."""
        if len(prefix) < 2:
            return
        try:
            address = prefix[1:].decode()
        except UnicodeDecodeError:
            return
        kind = {
            wire.P_ACK: "producer",
            wire.P_FETCH: "producer",
            wire.P_CONSUMER_HELLO: "store",
            wire.P_STORE_HELLO: "consumer",
        }.get(prefix[:1])
        if kind is not None and address != self.own_address:
            self._seen_as(address, kind)

    # ---------------------------------------------------------------- output

    def kind(self, address: str) -> str | None:
        seen = self.evidence.get(address, set())
        return next((k for k in KIND_ORDER if k in seen), None)

    def topics(self) -> list[str]:
        """Topics with a partition seen, and those group members consume."""
        names = {topic for topic, _ in self.partitions}
        for group in self.groups.values():
            for member in group.members.values():
                names.update(member.topics)
        return sorted(names)

    def store_head(self, topic: str, partition: str) -> int | None:
        """The newest head a store told of the partition (else the producer's), or None."""
        info = self.partitions.get((topic, partition))
        if info is None:
            return None
        if info.stores:
            return max(info.stores.values())
        return info.producer_head

    def not_writing_rows(self) -> list[dict[str, Any]]:
        """Per store and reason: the partitions it said it cannot acknowledge."""
        by: dict[tuple[str, str], list[list[str]]] = {}
        for (store, topic, partition), (reason, _) in sorted(self.not_writing.items()):
            by.setdefault((store, reason), []).append([topic, partition])
        return [{"store": s, "reason": r, "partitions": p} for (s, r), p in sorted(by.items())]

    def group_rows(self) -> list[dict[str, Any]]:
        """Each group: members, claims, and per partition the committed position and lag."""
        rows = []
        for name, group in sorted(self.groups.items()):
            topics = {t for m in group.members.values() for t in m.topics}
            keys = set(group.positions) | {k for k in self.partitions if k[0] in topics}
            owners = {c: m.address for m in group.members.values() for c in m.claims}
            parts = []
            total = 0
            for topic, partition in sorted(keys):
                head = self.store_head(topic, partition)
                committed = group.positions.get((topic, partition))
                # Nothing committed: every stored record is still to be read.
                lag = None if head is None else max(0, head + 1 - (committed or 0))
                total += lag or 0
                parts.append(
                    {
                        "topic": topic,
                        "partition": partition,
                        "head": head,
                        "committed": committed,
                        "lag": lag,
                        "owner": owners.get((topic, partition)),
                    }
                )
            rows.append(
                {
                    "group": name,
                    "members": [
                        {"address": m.address, "topics": list(m.topics), "claims": [list(c) for c in m.claims]}
                        for m in sorted(group.members.values(), key=lambda m: m.address)
                    ],
                    "partitions": parts,
                    "lag": total,
                }
            )
        return rows

    def snapshot(self, now: float) -> dict[str, Any]:
        """Everything known, as plain data (what ``--json`` prints)."""
        nodes = [
            {
                "address": p.address,
                "kind": self.kind(p.address),
                "endpoint": p.endpoint,
                "last_beacon_age": round(now - p.last_beacon, 3),
                "alive": p.alive,
            }
            for p in sorted(
                self.peers.values(), key=lambda p: (self.kind(p.address) or "~", p.address)
            )
        ]
        partitions = []
        for (topic, partition), info in sorted(self.partitions.items()):
            lag = info.lag()
            partitions.append(
                {
                    "topic": topic,
                    "partition": partition,
                    "producer_head": info.producer_head,
                    "producer_alive": partition in self.peers and self.peers[partition].alive,
                    "stores": [
                        {"address": s, "head": h, "lag": lag[s]}
                        for s, h in sorted(info.stores.items())
                    ],
                }
            )
        return {
            "towers": [
                {"endpoint": t, "reached": seen is not None} for t, seen in self.towers.items()
            ],
            "nodes": nodes,
            "partitions": partitions,
            "groups": self.group_rows(),
            "not_writing": self.not_writing_rows(),
            "malformed": self.malformed,
            "forged": self.forged,
            "dropped_partitions": self.dropped_partitions,
        }


SUMMARY_ROWS = 20  # rows of producers and of partitions shown without --all


def render_text(snap: dict[str, Any], limit: int | None = SUMMARY_ROWS) -> str:
    """The human-readable status tables; beyond ``limit`` producers or partitions
    (None: no limit), a summary: stores, consumers and lagging partitions first."""
    lines = ["TOWERS"]
    for t in snap["towers"]:
        lines.append(f"  {t['endpoint']:<40} {'reached' if t['reached'] else 'NOT REACHED'}")
    lines.append("")
    nodes = snap["nodes"]
    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[n["kind"] or "?"] = kinds.get(n["kind"] or "?", 0) + 1
    shown_nodes = nodes
    if limit is not None and len(nodes) > limit:
        others = [n for n in nodes if n["kind"] != "producer"]
        shown_nodes = others + [n for n in nodes if n["kind"] == "producer"][: max(0, limit - len(others))]
    lines.append(f"NODES ({len(nodes)}: " + ", ".join(f"{c} {k}" for k, c in sorted(kinds.items())) + ")")
    lines.append(f"  {'address':<34} {'kind':<9} {'endpoint':<28} {'beacon':>8}")
    for n in shown_nodes:
        age = f"{n['last_beacon_age']:.1f}s" if n["alive"] else "gone"
        lines.append(f"  {n['address']:<34} {n['kind'] or '?':<9} {n['endpoint']:<28} {age:>8}")
    if len(shown_nodes) < len(nodes):
        lines.append(f"  ... {len(nodes) - len(shown_nodes)} more producers (--all lists them)")
    lines.append("")
    partitions = snap["partitions"]
    shown = partitions
    if limit is not None and len(partitions) > limit:
        # Lagging partitions first (what needs a look), then those with a live producer.
        def rank(p: dict[str, Any]) -> tuple[bool, bool]:
            lagging = any(s["lag"] for s in p["stores"]) or not p["stores"]
            return (not lagging, not p["producer_alive"])

        shown = sorted(partitions, key=rank)[:limit]
    retired = sum(1 for p in partitions if not p["producer_alive"])
    lines.append(f"PARTITIONS ({len(partitions)}, {retired} without a live producer)")
    lines.append(f"  {'topic':<20} {'partition':<34} {'producer':>10}  stores (head/lag)")
    for p in shown:
        head = "-" if p["producer_head"] is None else str(p["producer_head"])
        if p["producer_head"] is not None and not p["producer_alive"]:
            head += "*"
        stores = (
            "  ".join(f"{s['address'][:8]}:{s['head']}/{s['lag']}" for s in p["stores"]) or "(none)"
        )
        lines.append(f"  {p['topic']:<20} {p['partition']:<34} {head:>10}  {stores}")
    if len(shown) < len(partitions):
        lines.append(f"  ... {len(partitions) - len(shown)} more partitions (--all lists them)")
    if any(p["producer_head"] is not None and not p["producer_alive"] for p in shown):
        lines.append("  (* producer no longer beaconing)")
    groups = snap.get("groups", [])
    if groups:
        lines.append("")
        lines.append(f"GROUPS ({len(groups)})")
        lines.append(f"  {'group':<20} {'members':>7} {'partitions':>10} {'lag':>10}")
        for g in groups[:limit] if limit is not None else groups:
            lines.append(f"  {g['group']:<20} {len(g['members']):>7} {len(g['partitions']):>10} {g['lag']:>10}")
    return "\n".join(lines)


class StatusProbe:
    """The I/O shell around :class:`MeshView` (single-threaded: call :meth:`run`)."""

    GET_HEADS_INTERVAL = 2.0

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.ctx = zmq.Context.instance()
        sec = config.security
        self.guard = security.guard_for(sec) if sec else None
        self.keys = security.own_keys(sec) if sec else None
        # On a secure mesh an address is bound to the key (towers relay no other).
        self.address = security.bound_address(self.keys.public) if self.keys else new_address()
        if self.guard is not None:
            self.ctx = self.guard.ctx  # the context whose ZAP handler checks the allow-list
            self.guard.refresh()
        self.roles: dict[str, str] = {}  # secure: peer address -> its key's role
        self.refused: list[str] = []  # secure: endpoints that refused our handshake
        self._refusals: list[security.RefusalLog] = []
        self.view = MeshView(
            self.address, [t.beacon_out for t in config.towers], config.beacon_timeout
        )
        self.poller = zmq.Poller()
        self._readers: dict[zmq.Socket, Any] = {}
        self._refused_by: dict[zmq.Socket, security.RefusalLog] = {}
        self._server_keys: dict[tuple[zmq.Socket, str], bytes] = {}
        # --watch connects again where a handshake was refused.
        self._retries = security.Retries(RETRY_REFUSED)
        self.tower_subs: list[zmq.Socket] = []
        for i, tower in enumerate(config.towers):
            sub = self._socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, wire.WELCOME)
            sub.setsockopt(zmq.SUBSCRIBE, wire.BEACON)
            self._connect(sub, tower.beacon_out, sec.tower_key(i) if sec else None, "tower beacons")
            self.tower_subs.append(sub)
            self._watch(sub, lambda s=sub, t=tower.beacon_out: self._read_tower(s, t))
        self.publisher = self._socket(zmq.XPUB)
        self.publisher.setsockopt(zmq.XPUB_VERBOSE, 1)
        if self.keys is not None:
            security.make_server(self.publisher, self.keys)
        port = self.publisher.bind_to_random_port(f"tcp://{config.bind}")
        self._watch(self.publisher, self._read_subscriptions)
        self.beacon_pub = self._socket(zmq.PUB)
        for i, tower in enumerate(config.towers):
            self._connect(self.beacon_pub, tower.beacon_in, sec.tower_key(i) if sec else None, "beacons out")
        self._beacon = wire.node_beacon(self.address, config.advertise, port)
        if self.keys is not None:
            self._beacon = security.secure_node_beacon(self._beacon, self.keys.public)
        self.peer_subs: dict[str, zmq.Socket] = {}
        self._beacon_at = 0.0
        self._heads_at = 0.0
        self._request_id = 0

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _connect(self, sock: zmq.Socket, endpoint: str, server_key: bytes | None, what: str) -> None:
        """Connect, as a CURVE client logging refused handshakes when secure."""
        if self.keys is None or server_key is None:
            sock.connect(endpoint)
            return
        if sock not in self._refused_by:
            security.make_client(sock, self.keys)
            refusals = security.RefusalLog(
                sock, f"status {what}", log, lambda endpoint, s=sock: self._on_refused(s, endpoint)
            )
            self._refused_by[sock] = refusals
            self._watch(refusals.monitor, refusals.read)
        self._server_keys[(sock, endpoint)] = server_key
        security.connect(sock, endpoint, server_key)

    def _on_refused(self, sock: zmq.Socket, endpoint: str) -> None:
        if endpoint not in self.refused:  # --watch retries every second: list each once
            self.refused.append(endpoint)
        self._retries.add(sock, endpoint, time.monotonic())

    def _retry_refused(self, now: float) -> None:
        """Connect again where a handshake was refused, if the socket is still in use."""
        for sock, endpoint in self._retries.take_due(now):
            key = self._server_keys.get((sock, endpoint))
            if key is None or sock not in self._refused_by:
                continue  # the peer's socket was closed meanwhile
            security.reconnect(sock, endpoint, key, log)

    def _watch(self, sock: zmq.Socket, reader: Any) -> None:
        self._readers[sock] = reader
        self.poller.register(sock, zmq.POLLIN)

    def close(self) -> None:
        for refusals in self._refused_by.values():
            self._readers.pop(refusals.monitor, None)
            refusals.close()  # stopped before its socket closes
        for sock in list(self._readers):
            sock.close(0)
        self.beacon_pub.close(0)
        self._readers.clear()

    def __enter__(self) -> StatusProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- loop

    def run(self, seconds: float) -> dict[str, Any]:
        """Listen for ``seconds``; return the snapshot."""
        deadline = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            if now - self._beacon_at >= self.config.beacon_interval:
                self._beacon_at = now
                try:
                    self.beacon_pub.send_multipart(self._beacon, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # no tower connected yet
            if now - self._heads_at >= self.GET_HEADS_INTERVAL:
                self._heads_at = now
                self._ask_heads()
                if self.guard is not None:
                    self.guard.refresh()  # --watch: follow allow-list changes as the nodes do
            self._retry_refused(now)
            self.tick(now)
            for address in self.view.expire(now):
                sub = self.peer_subs.pop(address, None)
                if sub is not None:
                    self._close_sub(sub)
            wait = min(deadline - now, 0.1)
            for sock, _ in self.poller.poll(max(1, int(wait * 1000))):
                reader = self._readers.get(sock)
                if reader is not None:
                    reader()
        return self.view.snapshot(time.monotonic())

    def _ask_heads(self) -> None:
        # C stores only tell their heads in answer to GET-HEADS (or as ACKs).
        asks: list[wire.Message] = [wire.GetHeads(topic, self.address) for topic in self.view.topics()]
        # The groups' committed positions, as a member asks for them.
        self._request_id += 1
        asks += [wire.GetPositions(group, self.address, self._request_id) for group in self.view.groups]
        for msg in asks:
            try:
                self.publisher.send_multipart(wire.encode(msg), zmq.NOBLOCK)
            except (zmq.ZMQError, ProtocolError):
                pass

    def _read_tower(self, sock: zmq.Socket, tower: str) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            self.view.on_tower(tower, now)
            if frames == [wire.WELCOME]:
                continue
            key = None
            try:
                if self.keys is not None:
                    frames, key = security.split_key(frames, 3, "tower beacon")
                address, endpoint = wire.decode_tower_beacon(frames)
            except ProtocolError:
                self.view.malformed += 1
                continue
            if key is not None:
                # Secure: only allow-listed keys are peers; their role is their kind.
                role = self.guard.role(key) if self.guard is not None else None
                if role is None:
                    continue
                self.roles[address] = role
                self.view.on_role(address, role)
            if self.view.on_beacon(address, endpoint, now) is not None:
                self._connect_peer(address, endpoint, key)

    def _close_sub(self, sub: zmq.Socket) -> None:
        refusals = self._refused_by.pop(sub, None)
        self._server_keys = {k: v for k, v in self._server_keys.items() if k[0] is not sub}
        for sock in (sub, refusals.monitor if refusals is not None else None):
            if sock is not None and self._readers.pop(sock, None) is not None:
                self.poller.unregister(sock)
        if refusals is not None:
            refusals.close()  # before its socket closes
        sub.close(0)

    def _connect_peer(self, address: str, endpoint: str, key: bytes | None = None) -> None:
        old = self.peer_subs.pop(address, None)
        if old is not None:
            self._close_sub(old)
        sub = self._socket(zmq.SUB)
        own = self.address.encode()
        # Exactly "H" first: a Python store re-announces every head it holds
        # when a subscriber to exactly H connects.
        for prefix in (
            wire.P_HEAD,
            wire.P_ACK,
            wire.P_DIRECT_HEAD + own,
            wire.P_STORE_HELLO + own,
            wire.P_MEMBER,  # group heartbeats
            wire.P_STORE_STATUS,  # a store saying it cannot acknowledge, and why
            wire.P_POSITIONS + own,  # answers to our GET-POSITIONS
        ):
            sub.setsockopt(zmq.SUBSCRIBE, prefix)
        try:
            self._connect(sub, endpoint, key, f"peer {address[:8]}")
        except zmq.ZMQError:
            self.view.malformed += 1
            self._close_sub(sub)
            return
        self.peer_subs[address] = sub
        self._watch(sub, lambda: self._read_peer(sub, address))

    def _read_peer(self, sock: zmq.Socket, sender: str) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames)
            except ProtocolError:
                self.view.malformed += 1
                continue
            if isinstance(msg, wire.DirectHead | wire.StoreHello | wire.Positions) and msg.topic != self.address:
                continue
            if self.keys is not None and not self._may_tell(sender, msg):
                self.view.forged += 1
                continue
            self.on_peer_message(sender, msg)

    def tick(self, now: float) -> None:
        """Called once per turn of :meth:`run` (a subclass's timers: the console's record fetches)."""

    def on_peer_message(self, sender: str, msg: wire.Message) -> None:
        """A decoded message of the peer ``sender`` (a subclass may take some for itself)."""
        self.view.on_message(sender, msg, time.monotonic())

    def _may_tell(self, sender: str, msg: wire.Message) -> bool:
        """Secure: what only stores may say (another partition's head, ACK,
        DIRECT-HEAD, STORE-HELLO) counts only from a store-role key."""
        if isinstance(msg, wire.Head) and msg.address == sender:
            return True  # a producer's own head
        if isinstance(msg, wire.Member):
            return msg.address == sender  # a member's own heartbeat
        return self.roles.get(sender) in security.STORING_ROLES

    def _read_subscriptions(self) -> None:
        for subscribe, prefix in read_subscriptions(self.publisher, 1000):
            if subscribe:
                self.view.on_subscription(prefix)


def outbox_rows(paths: list[str]) -> list[dict[str, Any]]:
    """What each local edge outbox holds (``dafka status --outbox``); errors as rows."""
    from dafka.errors import DafkaError
    from dafka.outbox import describe

    rows = []
    for path in paths:
        try:
            rows.append(describe(path))
        except DafkaError as exc:
            rows.append({"path": path, "error": str(exc)})
    return rows


def render_outboxes(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", f"OUTBOXES ({len(rows)})", f"  {'path':<30} {'partition':<34} {'records':>9} {'bytes':>11} {'oldest':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['path']:<30} error: {r['error']}")
            continue
        age = "-" if r["oldest_age"] is None else f"{r['oldest_age']:.1f}s"
        lines.append(f"  {r['path']:<30} {r['partition'] or '(unused)':<34} {r['records']:>9} {r['bytes']:>11} {age:>8}")
    return lines


def run_status(
    config: NodeConfig,
    *,
    wait: float,
    watch: bool,
    as_json: bool,
    interval: float,
    out: Any,
    outboxes: list[str] | None = None,
    show_all: bool = False,
) -> int:
    """The ``dafka status`` command: one snapshot after ``wait`` seconds, or a live view.

    ``outboxes``: local edge outbox directories to show as well (read-only).
    """
    tty = out.isatty() and not as_json
    with StatusProbe(config) as probe:
        snap = probe.run(wait)
        while True:
            if outboxes:
                snap["outboxes"] = outbox_rows(outboxes)
            if as_json:
                out.write(json.dumps(snap) + "\n")
            else:
                if watch and tty:
                    out.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
                text = render_text(snap, None if show_all else SUMMARY_ROWS)
                if outboxes:
                    text += "\n".join(render_outboxes(snap["outboxes"]))
                out.write(text + "\n")
                if watch and not tty:
                    out.write("\n")
            out.flush()
            if not watch:
                break
            snap = probe.run(interval)
    if snap["towers"] and not any(t["reached"] for t in snap["towers"]):
        why = "is one running? see --tower"
        if config.security is not None:
            why += "; secure: is our key in its allow-list, and is it a secure tower? see --key/--tower-key"
        print(f"error: no tower answered ({why})", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    try:
        return run_status(
            node_config(args, settings),
            wait=args.wait,
            watch=args.watch,
            as_json=args.json,
            interval=args.interval,
            out=sys.stdout,
            outboxes=args.outbox,
            show_all=args.all,
        )
    except KeyboardInterrupt:
        return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="join the mesh read-only and show nodes, heads and lag")
    add_node_flags(p)
    p.add_argument("--wait", type=seconds_arg, default=3.0, help="seconds to listen before the first view")
    p.add_argument("--watch", action="store_true", help="keep refreshing the view (Ctrl-C ends)")
    p.add_argument("--interval", type=positive_seconds_arg, default=1.0, help="--watch: seconds between views")
    p.add_argument("--json", action="store_true", help="print JSON (one object per view)")
    p.add_argument("--all", action="store_true", help="every node and partition (default: a summary beyond 20)")
    p.add_argument("--outbox", metavar="DIR", action="append", help="also show this local edge outbox (repeatable)")
