"""Peer discovery state, sans-IO.

A node learns peers from tower beacons ``(address, endpoint)``.  The first
beacon of a peer means "connect your data SUB to its endpoint"; a peer whose
beacons stop for ``timeout`` seconds is dropped ("disconnect").  Times are
passed in by the caller, so the table can be driven deterministically.

A beacon may say what the peer is (an interest beacon, :mod:`dafka.core.beacon`);
the table then connects only when the node's own :class:`Interest` wants that
peer.  A plain ``B`` beacon says nothing: that peer (a C node) is connected as
in the reference, unless the same address sent an interest beacon lately.

The tower is not trusted to be honest about peers (a hostile one named 20,000
made-up producers and a consumer tried some 48,000 TCP connections a second).
:class:`PeerLimits` bounds what beacons make a node do: how many peers it
holds, how many connections it has in flight that no peer answered yet
(*unverified*: no ZeroMQ handshake completed), how many new connections it
makes a second that no peer answers (a token bucket: a completed handshake
gives its token back), and how many failed attempts an unverified
peer gets before it is dropped and *benched* (not connected again for a
while).  A peer whose handshake completed is *verified* and is never evicted
for a newcomer.  Peers heard beyond these bounds *wait* (bounded, the least
recently heard forgotten first) and are connected as room and budget allow,
the most recently heard first: a live peer beacons again, a made-up one
relayed once does not.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dafka.core.beacon import EVERYTHING, UNKNOWN, Interest

MAX_TYPED = 100_000  # addresses remembered as dafka nodes (bounds what beacons can make us hold)


@dataclass(frozen=True, slots=True)
class PeerLimits:
    """What a tower's beacons can make a node do (see the module)."""

    max_peers: int = 10_000  # peers held (connected), verified or not
    max_unverified: int = 256  # connections in flight that no peer answered yet
    # New connections a second on average, and at once; a connection whose handshake
    # completes gives its token back, so only unanswered ones count (a store joining a
    # 1,000-node mesh connects as fast as its peers answer, 256 in flight).
    connect_rate: float = 50.0
    connect_burst: int = 256
    max_failures: int = 3  # failed attempts of an unverified peer before it is dropped while others wait...
    max_failures_alone: int = 20  # ...and while none waits (backoff: about a minute; a 0.1 s accept-and-close: 2 s)
    verify_within: float = 10.0  # seconds an unverified peer may hold a slot others wait for
    bench: float = 30.0  # seconds a dropped unverified peer is not connected again
    max_waiting: int = 10_000  # peers heard but not connected yet (least recently heard forgotten)


@dataclass(frozen=True, slots=True)
class Connect:
    endpoint: str
    address: str


@dataclass(frozen=True, slots=True)
class Disconnect:
    endpoint: str
    address: str


PeerAction = Connect | Disconnect


class PeerTable:
    """Known peers keyed by node address, each with its endpoint and expiry time."""

    def __init__(
        self, own_address: str, timeout: float, interest: Interest = EVERYTHING, limits: PeerLimits | None = None
    ) -> None:
        self.own_address = own_address
        self.timeout = timeout
        self.interest = interest
        self.limits = limits or PeerLimits()
        self._peers: dict[str, tuple[str, float]] = {}  # address -> (endpoint, expires)
        # Addresses that sent interest beacons lately -> expiry: their plain B
        # beacons (heard while subscribed to B) do not make them C nodes.
        self._typed: dict[str, float] = {}
        self.ignored = 0  # beacons of peers this node does not need
        # Bounds (see PeerLimits): connected peers no handshake answered yet ->
        # when connected (oldest first); who is at an endpoint; peers waiting for
        # room or budget -> (endpoint, expires) (least recently heard first);
        # dropped unverified peers -> until when they stay out.
        self._unverified: OrderedDict[str, float] = OrderedDict()
        self._at: dict[str, set[str]] = {}  # endpoint -> addresses connected there
        self._up: set[str] = set()  # endpoints whose handshake completed (and did not fail since)
        self._waiting: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._benched: OrderedDict[str, float] = OrderedDict()
        self._tokens = float(self.limits.connect_burst)
        self._tokens_at: float | None = None
        self.refused = 0  # new peers left waiting (no room or no budget), ever
        self.dropped_unverified = 0  # unverified peers dropped (failing, or too slow to answer)
        self.benched_beacons = 0  # beacons of benched peers, ignored

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, address: object) -> bool:
        return address in self._peers

    def endpoints(self) -> list[str]:
        return [endpoint for endpoint, _ in self._peers.values()]

    def items(self) -> list[tuple[str, str]]:
        """(address, endpoint) of every known peer (a copy)."""
        return [(address, endpoint) for address, (endpoint, _) in list(self._peers.items())]

    def on_beacon(
        self, address: str, endpoint: str, now: float, kind: bytes | None = None, key: bytes = b""
    ) -> list[PeerAction]:
        """A tower relayed a beacon (``kind``/``key`` of an interest beacon, None
        for a plain ``B``); return what to do with the data SUB."""
        if address == self.own_address:
            return []
        known = self._peers.get(address)
        if kind is not None and kind != UNKNOWN:
            if address in self._typed or len(self._typed) < MAX_TYPED:
                self._typed[address] = now + self.timeout
        elif address in self._typed:
            if self._typed[address] > now:
                return []  # its interest beacons decide
            del self._typed[address]
        if known is None and not self.interest.wants(kind, key):
            self.ignored += 1
            return []
        if known is None:
            return self._admit(address, endpoint, now)
        self._peers[address] = (endpoint, now + self.timeout)
        if known[0] != endpoint:
            # Same node, new endpoint (it restarted with a persistent identity).
            self._unlink(address, known[0])
            self._link(address, endpoint, now)
            return [Disconnect(known[0], address), Connect(endpoint, address)]
        return []

    # ---------------------------------------------------------------- bounds

    @property
    def waiting(self) -> int:
        """Peers heard but not connected yet (no room, or no budget)."""
        return len(self._waiting)

    @property
    def benched(self) -> int:
        """Peers dropped after failing while others waited, kept out for a while (see PeerLimits)."""
        return len(self._benched)

    @property
    def unverified(self) -> int:
        """Connected peers whose handshake has not completed yet."""
        return len(self._unverified)

    def _admit(self, address: str, endpoint: str, now: float) -> list[PeerAction]:
        """A new wanted peer: connect it now if room and budget allow, else let it wait."""
        until = self._benched.get(address)
        if until is not None:
            if until > now:
                self.benched_beacons += 1
                return []
            del self._benched[address]
        if self._room() and self._take_token(now):
            self._waiting.pop(address, None)
            return self._connect(address, endpoint, now)
        if address in self._waiting:
            self._waiting.move_to_end(address)
        else:
            self.refused += 1
            if len(self._waiting) >= self.limits.max_waiting:
                self._waiting.popitem(last=False)  # the least recently heard
        self._waiting[address] = (endpoint, now + self.timeout)
        return []

    def _room(self) -> bool:
        lim = self.limits
        return len(self._peers) < lim.max_peers and len(self._unverified) < lim.max_unverified

    def _take_token(self, now: float) -> bool:
        lim = self.limits
        if self._tokens_at is not None:
            self._tokens = min(float(lim.connect_burst), self._tokens + (now - self._tokens_at) * lim.connect_rate)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _connect(self, address: str, endpoint: str, now: float) -> list[PeerAction]:
        self._peers[address] = (endpoint, now + self.timeout)
        self._link(address, endpoint, now)
        return [Connect(endpoint, address)]

    def _link(self, address: str, endpoint: str, now: float) -> None:
        self._at.setdefault(endpoint, set()).add(address)
        if endpoint in self._up:
            self._refund()  # (ZeroMQ has one connection an endpoint: this one is up)
        else:
            self._unverified[address] = now

    def _unlink(self, address: str, endpoint: str) -> None:
        self._unverified.pop(address, None)
        there = self._at.get(endpoint)
        if there is not None:
            there.discard(address)
            if not there:
                del self._at[endpoint]
                self._up.discard(endpoint)

    def _refund(self) -> None:
        self._tokens = min(float(self.limits.connect_burst), self._tokens + 1.0)

    def on_verified(self, endpoint: str) -> None:
        """A handshake with the peer at ``endpoint`` completed: a ZeroMQ node does listen there."""
        there = self._at.get(endpoint)
        if not there:
            return
        self._up.add(endpoint)
        for address in there:
            if self._unverified.pop(address, None) is not None:
                self._refund()  # answered: it cost nothing

    def verified(self, address: str) -> bool:
        return address in self._peers and address not in self._unverified

    def on_failed(self, endpoint: str, failures: int, now: float) -> list[PeerAction]:
        """An attempt to reach ``endpoint`` failed (``failures`` in a row since its last
        handshake): its unverified peers are dropped and benched after ``max_failures``
        while other peers wait, after ``max_failures_alone`` otherwise."""
        self._up.discard(endpoint)
        limit = self.limits.max_failures if self._waiting else self.limits.max_failures_alone
        if failures < limit:
            return []
        actions: list[PeerAction] = []
        for address in list(self._at.get(endpoint, ())):
            if address in self._unverified:
                actions += self._drop_unverified(address, now)
        return actions

    def _drop_unverified(self, address: str, now: float) -> list[PeerAction]:
        known = self._peers.pop(address, None)
        if known is None:
            return []
        self._unlink(address, known[0])
        self.dropped_unverified += 1
        self._benched[address] = now + self.limits.bench
        self._benched.move_to_end(address)
        while len(self._benched) > self.limits.max_waiting:
            self._benched.popitem(last=False)
        return [Disconnect(known[0], address)]

    def admit_waiting(self, now: float) -> list[PeerAction]:
        """Connect waiting peers as room and budget allow (most recently heard first);
        while some wait, an unverified peer older than ``verify_within`` gives its slot up."""
        if not self._waiting:
            return []
        actions: list[PeerAction] = []
        for address, since in list(self._unverified.items()):
            if not self._waiting or self._room() or now - since < self.limits.verify_within:
                break
            actions += self._drop_unverified(address, now)
        while self._waiting and self._room() and self._take_token(now):
            address, (endpoint, expires) = self._waiting.popitem(last=True)
            if expires <= now or address in self._peers:
                self._tokens += 1.0  # (not spent)
                continue
            actions += self._connect(address, endpoint, now)
        return actions

    def forget(self, address: str) -> list[PeerAction]:
        """Drop a peer at once (its key was removed from the allow-list)."""
        self._waiting.pop(address, None)
        known = self._peers.pop(address, None)
        if known is None:
            return []
        self._unlink(address, known[0])
        return [Disconnect(known[0], address)]

    def postpone(self, now: float) -> None:
        """Nothing was heard lately (see :meth:`TowerWatch.quiet`): give every
        peer a whole timeout from ``now``, so none is dropped the moment
        beacons flow again, before its own had time to arrive."""
        floor = now + self.timeout
        peers = self._peers
        for address, (endpoint, expires) in peers.items():
            if expires < floor:
                peers[address] = (endpoint, floor)  # (a value replaced: no resize while iterating)

    def expire(self, now: float) -> list[PeerAction]:
        """Drop peers whose last beacon is older than the timeout."""
        dead = [(a, e) for a, (e, expires) in self._peers.items() if expires <= now]
        if self._typed:
            self._typed = {a: t for a, t in self._typed.items() if t > now}
        if self._waiting:
            self._waiting = OrderedDict((a, w) for a, w in self._waiting.items() if w[1] > now)
        if self._benched:
            self._benched = OrderedDict((a, t) for a, t in self._benched.items() if t > now)
        for address, endpoint in dead:
            del self._peers[address]
            self._unlink(address, endpoint)
        return [Disconnect(endpoint, address) for address, endpoint in dead]


class TowerWatch:
    """Whether a node has reached a tower, and when to warn that it has not.

    A tower is reached when its welcome or any beacon arrives.  Until then a
    warning is due ``grace`` seconds after start and every ``repeat`` seconds
    after that (a node with an unreachable tower must not wait in silence).
    A tower that refused our handshake (:meth:`on_refused`: a secure tower,
    and we are a plain node) is named as such in :meth:`hint`.
    """

    def __init__(self, started: float, grace: float, repeat: float = 30.0) -> None:
        self.started = started
        self.grace = grace
        self.repeat = repeat
        self.reached_at: float | None = None
        self.heard_at: float | None = None  # the last beacon (or hello) of any tower
        self._warned_at: float | None = None
        self.refused: dict[str, float] = {}  # tower endpoint -> when it last refused our handshake

    def on_refused(self, endpoint: str, now: float) -> bool:
        """A tower at ``endpoint`` refused our handshake; True the first time (say so at once)."""
        first = endpoint not in self.refused
        self.refused[endpoint] = now
        return first

    def hint(self) -> str:
        """Why no tower may have been reached, for the warning."""
        if self.refused:
            return refused_hint(sorted(self.refused))
        return "is a tower running there?"

    @property
    def reached(self) -> bool:
        return self.reached_at is not None

    def on_heard(self, now: float) -> None:
        self.heard_at = now
        if self.reached_at is None:
            self.reached_at = now

    def quiet(self, now: float, limit: float) -> bool:
        """Whether no tower was heard for ``limit`` seconds (or ever).

        Then a peer's silence proves nothing: the tower may lag, or this node
        had no time to read it.  Peers are expired only while towers are heard.
        """
        return self.heard_at is None or now - self.heard_at > limit

    def warning_due(self, now: float) -> bool:
        """True when a "no tower reached" warning should be logged now."""
        if self.reached_at is not None or now < self.started + self.grace:
            return False
        if self._warned_at is not None and now < self._warned_at + self.repeat:
            return False
        self._warned_at = now
        return True


def refused_hint(endpoints: list[str]) -> str:
    """What a plain node says when towers refused its handshake."""
    return (
        f"the tower at {', '.join(endpoints)} refused the handshake: it is a secure (CURVE) tower and this"
        " node is plain; give the node a key, the allow-list and the tower's key (--key, --allow, --tower-key"
        " or [security])"
    )
