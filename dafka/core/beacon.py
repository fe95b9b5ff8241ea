"""Interest beacons: who a node is, so that nodes meet only the peers they need.

The reference mesh connects every node to every other one, and its tower
relays every beacon to every node: both cost N^2.  Dafka nodes add, beside the
standard ``B`` beacon, *interest beacons* whose first frame says what the node
is and for which topic; towers relay them by ZeroMQ prefix subscription, so a
node receives only the beacons of the peers it may talk to, and connects only
to the peers that can send it something or need something from it.

Bytes (everything here is dafka-only; C nodes subscribe ``W`` and ``B`` and
never receive any of it, C towers relay it as they relay ``B``):

* interest beacon, node -> tower, 4 frames, shaped as a node beacon whose first
  frame is ``X`` + kind + key instead of ``B``::

      X P <topic> NUL   a producer of <topic>
      X C <topic> NUL   a consumer of <topic> (one beacon per topic; X C NUL: none yet)
      X G <group> NUL   a member of consumer group <group>
      X S               a store (or a gateway): everyone talks to stores
      X A               any other dafka node: connected like a C node

  then the node address, the host (may be empty) and the port, as in ``B``;
* tower -> nodes, 3 frames: the same first frame, address, ``tcp://host:port``;
* a *batch*: a dafka tower that relays many beacons of one first frame within
  ``BATCH_WINDOW`` sends them as one message, the first frame once and then
  each beacon's address and endpoint (and key, in secure mode)::

      X P <topic> NUL, address1, endpoint1, address2, endpoint2, ...

  (one beacon is the 3-frame form above; a tower sends at most ``RELAY_BATCH``
  in one, a node takes up to ``MAX_BATCH``).  A
  store hears every producer's beacon each second: a thousand messages a
  second, each a wake-up of its I/O thread and of ZeroMQ's, become a few;
* ``X U``, address, ``tcp://host:port`` (3 frames): a dafka tower's copy of a
  ``B`` beacon from an address that sent no interest beacon lately (a C node),
  or sent it from another endpoint (a second process with that identity);
* ``X T`` + tower id (one frame, 32 hex): a dafka tower's hello, every
  ``HELLO_INTERVAL`` and at once when a new node subscribes (its reflection
  topic, see :mod:`dafka.core.reach`; at most one extra hello per ``HELLO_ANSWER``);
* the *probe*, node -> tower, 4 frames: ``R`` + node address (its reflection
  topic), then address, host, port as in ``B``.  A dafka tower keeps
  reflection subscriptions to itself, so the node's PUB never sends the probe
  to it; a C tower forwards every subscription but ``W`` to the nodes' PUBs and
  relays whatever they send, so it relays the probe back, to that node only, as
  ``R`` + address, address, ``tcp://host:port`` (3 frames; a reflection has 4):
  the *echo*, proof that this tower is no dafka tower.

A node subscribes its beacon SUB to ``W``, ``X T``, ``X U``, ``X S``, ``X A``
and to the kinds/topics it needs (a store to all of ``X``).  It subscribes
``B`` too (and then meets every peer as today) as soon as an echo comes back
(behind a C tower it cannot see C nodes otherwise: it probes with each beacon
and a few times just after a tower's welcome, so it knows within about a beacon
interval), and, failing any echo, while fewer dafka towers greet it than it has
towers configured once a grace has passed (a tower that neither echoes nor
greets).  Its ``B`` beacon still goes out on every interval; the beacon PUB
filters it away while no one (no C node, no status probe) subscribes ``B``.

Everything here is sans-IO: frames and times in, decisions out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dafka.core import wire
from dafka.errors import ProtocolError

PREFIX = b"X"
PRODUCER = b"P"
CONSUMER = b"C"
GROUP = b"G"
STORE = b"S"
ANY = b"A"
UNKNOWN = b"U"  # relayed by a tower for a node that sent no interest beacon
# A region export (dafka.core.bridge): a crossing interest beacon with this before its first frame.
EXPORT = b"Y"
HELLO = PREFIX + b"T"
# High-water mark of a node's beacon SUB (and a tower's XSUB), in messages.
# ZeroMQ's default (1,000) is one second of a 1,000-node mesh's beacons for a
# store: a store busy for two seconds lost beacons at the tower and dropped
# live producers.  Ten seconds' worth of single beacons; the tower's own queue
# for each subscriber is TOWER_HWM, below.
BEACON_HWM = 10_000
KINDS = frozenset((PRODUCER, CONSUMER, GROUP, STORE, ANY, UNKNOWN))
KEYED = frozenset((PRODUCER, CONSUMER, GROUP))
END = b"\x00"
MAX_HEAD = 2 + wire.MAX_STRING + 1
# Seconds between a tower's hellos.  Every node hears each one (a thousand
# deliveries a second at 1 s, about a tenth of a 1,000-device mesh's producer
# work); two seconds still puts two in a census grace and five in a tower's memory.
HELLO_INTERVAL = 2.0
# A tower answers new nodes with a hello at once, but at most once in this many
# seconds (a thousand nodes joining, or a flood of subscriptions, cost a few hellos).
HELLO_ANSWER = 0.1
# After a tower's welcome a node probes again this long after, doubling, up to
# a beacon interval (its reflection subscription may reach the tower's nodes'
# PUBs, its own included, a little after the welcome).
PROBE_FIRST = 0.02
ECHO = b"R"  # (dafka.core.reach.REFLECTION) the probe's first byte
# A tower relays the beacons of one first frame that come within this many
# seconds of each other as one message of at most RELAY_BATCH (see RelayBatcher).
# Nodes accept batches of up to MAX_BATCH (what towers of any version send).
BATCH_WINDOW = 0.05
MAX_BATCH = 128
# Small enough that a subscriber who stops reading costs the tower little (the
# high-water mark counts messages, whatever their size): TOWER_HWM batches of
# 16 are about 4 MB (batches of 128 under a mark of 10,000 were about 140 MB).
# A busy store still has its own 10,000 (BEACON_HWM) and the kernel's buffers
# of slack before the tower's.
RELAY_BATCH = 16
TOWER_HWM = 2_000
TOWER_MEMORY = 10.0  # a tower not heard of for this long is no longer counted as a dafka tower
CENSUS_GRACE = 5.0  # seconds after start (and after the first welcome) before B is subscribed


def head(kind: bytes, key: bytes = b"") -> bytes:
    """The first frame of an interest beacon (``X`` + kind + key + NUL for keyed kinds)."""
    return PREFIX + kind + (key + END if kind in KEYED else b"")


def parse_head(frame: bytes) -> tuple[bytes, bytes]:
    """(kind, key) of an interest beacon's first frame; ProtocolError if malformed."""
    frame = bytes(frame)
    if len(frame) < 2 or len(frame) > MAX_HEAD or frame[:1] != PREFIX:
        raise ProtocolError("interest beacon head must be X + kind (+ key NUL)")
    kind = frame[1:2]
    if kind not in KINDS:
        raise ProtocolError(f"unknown interest beacon kind {kind!r}")
    if kind in KEYED:
        key = frame[2:]
        if not key.endswith(END) or END in key[:-1]:
            raise ProtocolError("interest beacon key must end with its only NUL")
        return kind, key[:-1]
    if len(frame) != 2:
        raise ProtocolError("interest beacon kind takes no key")
    return kind, b""


def tower_hello(tower_id: str) -> list[bytes]:
    """A dafka tower's hello (one frame)."""
    return [HELLO + tower_id.encode()]


def parse_hello(frames: Sequence[bytes]) -> str | None:
    """The tower id of a hello, or None when these frames are not one."""
    if len(frames) != 1:
        return None
    frame = bytes(frames[0])
    if not frame.startswith(HELLO) or not 0 < len(frame) - 2 <= 64:
        return None
    try:
        return frame[2:].decode("ascii")
    except UnicodeDecodeError:
        return None


def probe(node_beacon: Sequence[bytes], address: str) -> list[bytes]:
    """The probe a node sends with its ``B`` beacon (see the module): its reflection topic first."""
    return [ECHO + address.encode(), *node_beacon[1:4]]


def is_echo(frames: Sequence[bytes], address: str) -> bool:
    """Whether these tower frames are this node's probe relayed as a C tower relays a beacon."""
    return (
        len(frames) == 3
        and bytes(frames[0]) == ECHO + address.encode()
        and bytes(frames[1]) == address.encode()
    )


def decode_node_beacon(frames: Sequence[bytes]) -> tuple[bytes, str, str, int]:
    """(head, address, host, port) of a ``B`` or interest node beacon (head ``B`` or ``X...``)."""
    if not frames:
        raise ProtocolError("empty node beacon")
    first = bytes(frames[0])
    if first != wire.BEACON:
        parse_head(first)
    address, host, port = wire.decode_node_beacon([wire.BEACON, *frames[1:]])
    return first, address, host, port


def decode_tower_relay(
    frames: Sequence[bytes], key_length: int = 0
) -> tuple[bytes | None, bytes, list[tuple[str, str, bytes]], list[str]]:
    """``(kind, key, entries, errors)`` of a tower beacon or batch (kind None for a plain ``B``).

    ``entries`` are ``(address, endpoint, public key)``; ``key_length`` > 0
    (secure mode) means each carries a key of that length, else the key is
    ``b""``.  An entry that is malformed is left out and said in ``errors``
    (a broken entry costs its peer, not the batch); ProtocolError when the
    message as a whole is not one (bad head, wrong frame count, too many).
    """
    if not frames:
        raise ProtocolError("empty tower beacon")
    first = bytes(frames[0])
    stride = 3 if key_length else 2
    count, rest = divmod(len(frames) - 1, stride)
    if first == wire.BEACON:
        kind: bytes | None = None
        key = b""
        if count != 1 or rest:
            raise ProtocolError(f"tower beacon must be {stride + 1} frames starting with B")
    else:
        kind, key = parse_head(first)
        if count < 1 or rest or count > MAX_BATCH:
            raise ProtocolError(f"interest beacon batch must be 1 + {stride} x (1..{MAX_BATCH}) frames")
    entries: list[tuple[str, str, bytes]] = []
    errors: list[str] = []
    for i in range(1, len(frames), stride):
        try:
            address, endpoint = wire.decode_tower_beacon([wire.BEACON, frames[i], frames[i + 1]])
        except ProtocolError as exc:
            errors.append(str(exc))
            continue
        public = b""
        if key_length:
            public = bytes(frames[i + 2])
            if len(public) != key_length:
                errors.append(f"secure tower beacon of {address[:40]!r} carries no public key")
                continue
        entries.append((address, endpoint, public))
    return kind, key, entries, errors


@dataclass(frozen=True, slots=True)
class Interest:
    """What a node is and which peers it needs.

    ``kind`` is PRODUCER (of ``topics``, one), CONSUMER (of ``topics``, in
    ``group`` if any), STORE, or ANY (any other node: wants everyone, and
    everyone connects to it).
    """

    kind: bytes
    topics: frozenset[bytes] = field(default_factory=frozenset)
    group: bytes | None = None
    watch_peers: bool = False  # hear beacons of own kind and topic (a resuming producer's twin check)

    @classmethod
    def producer(cls, topic: str, watch_peers: bool = False) -> Interest:
        return cls(PRODUCER, frozenset((topic.encode(),)), watch_peers=watch_peers)

    @classmethod
    def consumer(cls, topics: Iterable[str], group: str | None = None) -> Interest:
        return cls(CONSUMER, frozenset(t.encode() for t in topics), group.encode() if group else None)

    @property
    def everything(self) -> bool:
        """Whether this node talks to every peer (stores and unclassified nodes)."""
        return self.kind in (STORE, ANY)

    def heads(self) -> list[bytes]:
        """First frames of the interest beacons this node sends."""
        if self.kind == PRODUCER:
            return [head(PRODUCER, t) for t in sorted(self.topics)]
        if self.kind == CONSUMER:
            heads = [head(CONSUMER, t) for t in sorted(self.topics)] or [head(CONSUMER)]
            if self.group is not None:
                heads.append(head(GROUP, self.group))
            return heads
        return [head(self.kind)]

    def subscriptions(self) -> set[bytes]:
        """Beacon SUB prefixes: the beacons of every peer this node may want."""
        if self.everything:
            return {PREFIX}
        subs = {HELLO, PREFIX + UNKNOWN, PREFIX + STORE, PREFIX + ANY}
        other = CONSUMER if self.kind == PRODUCER else PRODUCER
        subs.update(head(other, t) for t in self.topics)
        if self.group is not None:
            subs.add(head(GROUP, self.group))
        if self.watch_peers:
            subs.update(head(self.kind, t) for t in self.topics)
        return subs

    def wants(self, kind: bytes | None, key: bytes) -> bool:
        """Whether to connect to a peer that beacons ``kind``/``key`` (None: a plain ``B``)."""
        if kind is None or kind in (UNKNOWN, STORE, ANY) or self.everything:
            return True
        if self.kind == PRODUCER:
            return kind == CONSUMER and key in self.topics
        if self.kind == CONSUMER:
            if kind == PRODUCER:
                return key in self.topics
            return kind == GROUP and key == self.group
        return False


EVERYTHING = Interest(ANY)


class TowerCensus:
    """Whether every tower a node is given is a dafka tower (sans-IO).

    An echo of the node's probe (:func:`is_echo`) in the last ``memory``
    seconds proves a tower that is no dafka tower: the node needs the plain
    ``B`` beacons at once.  Failing that, a node counts the distinct towers
    whose hello it heard in the last ``memory`` seconds; while they are fewer
    than its configured towers, it needs ``B`` too -- but only once some tower
    welcomed it and ``grace`` seconds passed since then and since start (a
    tower that neither echoes nor greets).  Subscribing ``B`` on a large mesh
    means meeting every peer, so a node that is merely slow to read its hellos
    must not do it: the grace is several hellos long.
    """

    def __init__(self, expected: int, started: float, grace: float = CENSUS_GRACE, memory: float = TOWER_MEMORY) -> None:
        self.expected = expected
        self.grace = grace
        self.grace_until = started + grace
        self.memory = memory
        self.welcomed = False
        self.echoed_at: float | None = None  # the last echo of our probe (a C tower relayed it)
        self._heard: dict[str, float] = {}

    def on_welcome(self, now: float) -> None:
        """A tower welcomed us (the first welcome starts the grace anew)."""
        if not self.welcomed:
            self.welcomed = True
            self.grace_until = max(self.grace_until, now + self.grace)

    def on_hello(self, tower_id: str, now: float) -> None:
        if tower_id in self._heard or len(self._heard) < 64:  # bounded: a node has few towers
            self._heard[tower_id] = now

    def on_echo(self, now: float) -> None:
        """Our probe came back: some tower relays what nodes send, as the C tower."""
        self.echoed_at = now

    def echoed(self, now: float) -> bool:
        """Whether an echo came within the last ``memory`` seconds."""
        return self.echoed_at is not None and now - self.echoed_at <= self.memory

    def greeted(self, now: float) -> int:
        """How many dafka towers said hello within the last ``memory`` seconds."""
        for tower_id, heard in list(self._heard.items()):
            if now - heard > self.memory:
                del self._heard[tower_id]
        return len(self._heard)

    def kind(self, now: float) -> str:
        """What the node knows of its towers: ``"c"`` (one relays as the C tower does),
        ``"dafka"`` (as many dafka towers as configured greet it) or ``"unknown"``."""
        if self.echoed(now):
            return "c"
        return "dafka" if self.expected and self.greeted(now) >= self.expected else "unknown"

    def needs_plain(self, now: float) -> bool:
        """Whether to subscribe ``B`` (some tower is not a dafka tower, or is silent)."""
        greeted = self.greeted(now)
        if self.echoed(now):
            return True
        return self.welcomed and now >= self.grace_until and greeted < self.expected


class RelayBatcher:
    """A tower's batching of interest beacons by first frame (sans-IO).

    A beacon whose first frame was not relayed within the last ``window``
    seconds goes out at once (a lone node is announced without delay); the
    next ones of that frame wait for the window to end and go out together,
    at most ``max_entries`` in a message.  Memory is bounded: at most
    ``max_pending`` beacons wait (more flush everything at once), and heads
    relayed more than ``window`` ago are forgotten at each flush.
    """

    def __init__(
        self, window: float = BATCH_WINDOW, max_entries: int = RELAY_BATCH, max_pending: int = 20_000, max_heads: int = 4096
    ) -> None:
        self.window = window
        self.max_entries = max_entries
        self.max_pending = max_pending
        self.max_heads = max_heads  # first frames remembered (a flood of new ones forgets the rest)
        self._last: dict[bytes, float] = {}  # head -> when a message of it last went out
        self._pending: dict[bytes, list[bytes]] = {}  # head -> the entries' frames waiting
        self._counts: dict[bytes, int] = {}
        self._waiting = 0

    def add(self, frames: list[bytes], now: float, stride: int = 2) -> list[list[bytes]]:
        """Take one relayed beacon (``head`` + ``stride`` frames); what to send now."""
        head = frames[0]
        if head[:1] != PREFIX and head[:1] != EXPORT:
            return [frames]  # plain B (C nodes read exactly 3 frames): never batched
        if head not in self._pending and now - self._last.get(head, -1e18) >= self.window:
            self._last[head] = now
            if len(self._last) > self.max_heads:
                self._forget(now)
            return [frames]
        self._pending.setdefault(head, []).extend(frames[1 : 1 + stride])
        count = self._counts.get(head, 0) + 1
        self._counts[head] = count
        self._waiting += 1
        if count >= self.max_entries:
            return [self._take(head, now)]
        if self._waiting > self.max_pending:
            return self.flush(now, everything=True)
        return []

    def _take(self, head: bytes, now: float) -> list[bytes]:
        entries = self._pending.pop(head)
        self._waiting -= self._counts.pop(head)
        self._last[head] = now
        return [head, *entries]

    def due(self) -> float | None:
        """When the next batch is due (None: nothing waits)."""
        if not self._pending:
            return None
        return min(self._last.get(h, 0.0) for h in self._pending) + self.window

    def flush(self, now: float, everything: bool = False) -> list[list[bytes]]:
        """The batches due by ``now`` (all of them with ``everything``)."""
        out = [
            self._take(head, now)
            for head in list(self._pending)
            if everything or now - self._last.get(head, 0.0) >= self.window
        ]
        if len(self._last) > len(self._pending) + 64:
            self._forget(now)
        return out

    def _forget(self, now: float) -> None:
        """Drop the heads whose window is over; past ``max_heads``, all but those waiting
        (their next beacon then goes out at once: no batching lost for good, nothing held)."""
        self._last = {h: t for h, t in self._last.items() if h in self._pending or now - t < self.window}
        if len(self._last) > self.max_heads // 2:
            self._last = {h: t for h, t in self._last.items() if h in self._pending}


class RelayBook:
    """A tower's memory of which addresses sent interest beacons, from where (sans-IO).

    A ``B`` beacon from such an address and endpoint is relayed to ``B``
    subscribers only; from any other address (a C node), or from another
    endpoint than the interest beacons' (a second process with the same
    identity), it is relayed as ``X U`` too, so dafka nodes that subscribe no
    ``B`` still meet C nodes and notice twins.
    """

    def __init__(self, memory: float = 10.0, limit: int = 1_000_000) -> None:
        self.memory = memory
        self.limit = limit
        self._typed: dict[str, tuple[str, float]] = {}  # address -> (endpoint, last interest beacon)
        self._pruned_at = 0.0

    def __len__(self) -> int:
        return len(self._typed)

    def on_beacon(self, head: bytes, address: str, endpoint: str, now: float) -> list[list[bytes]]:
        """The tower beacons to publish for one node beacon (``head`` as received)."""
        if now - self._pruned_at > self.memory:
            self._pruned_at = now
            self._typed = {a: e for a, e in self._typed.items() if now - e[1] <= self.memory}
        plain = wire.tower_beacon(address, endpoint)
        if head != wire.BEACON:
            if address in self._typed or len(self._typed) < self.limit:
                self._typed[address] = (endpoint, now)
            return [[head, *plain[1:]]]
        seen = self._typed.get(address)
        if seen is not None and seen[0] == endpoint and now - seen[1] <= self.memory:
            return [plain]
        return [plain, [PREFIX + UNKNOWN, *plain[1:]]]
