"""Peer discovery state, sans-IO.

A node learns peers from tower beacons ``(address, endpoint)``.  The first
beacon of a peer means "connect your data SUB to its endpoint"; a peer whose
beacons stop for ``timeout`` seconds is dropped ("disconnect").  Times are
passed in by the caller, so the table can be driven deterministically.

A beacon may say what the peer is (an interest beacon, :mod:`dafka.core.beacon`);
the table then connects only when the node's own :class:`Interest` wants that
peer.  A plain ``B`` beacon says nothing: that peer (a C node) is connected as
in the reference, unless the same address sent an interest beacon lately.
"""

from __future__ import annotations

from dataclasses import dataclass

from dafka.core.beacon import EVERYTHING, UNKNOWN, Interest

MAX_TYPED = 1_000_000  # addresses remembered as dafka nodes (bounds what beacons can make us hold)


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

    def __init__(self, own_address: str, timeout: float, interest: Interest = EVERYTHING) -> None:
        self.own_address = own_address
        self.timeout = timeout
        self.interest = interest
        self._peers: dict[str, tuple[str, float]] = {}  # address -> (endpoint, expires)
        # Addresses that sent interest beacons lately -> expiry: their plain B
        # beacons (heard while subscribed to B) do not make them C nodes.
        self._typed: dict[str, float] = {}
        self.ignored = 0  # beacons of peers this node does not need

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
        self._peers[address] = (endpoint, now + self.timeout)
        if known is None:
            return [Connect(endpoint, address)]
        if known[0] != endpoint:
            # Same node, new endpoint (it restarted with a persistent identity).
            return [Disconnect(known[0], address), Connect(endpoint, address)]
        return []

    def forget(self, address: str) -> list[PeerAction]:
        """Drop a peer at once (its key was removed from the allow-list)."""
        known = self._peers.pop(address, None)
        return [] if known is None else [Disconnect(known[0], address)]

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
        for address, _ in dead:
            del self._peers[address]
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
