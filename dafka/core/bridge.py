"""Region bridges: what crosses from one region's tower to another's (sans-IO).

A large fleet runs several *regions*, each with its own towers; a node lists
only its own region's towers.  A dafka tower may *bridge* to the towers of
other regions (``dafka tower --bridge HOST[:IN_PORT[:OUT_PORT]]``, or
``[tower] bridges``).  Only what must cross does: the interest beacons of
stores (``X S``), consumers (``X C``) and group members (``X G``).  Producer
beacons (``X P``), plain ``B`` beacons (C nodes), ``X U`` copies, ``X A``
nodes, hellos and reflections never leave their region, so a region's
devices cost another region's nodes nothing.

Bytes (dafka-only, on a tower's beacon-out port)::

    Y X S                    , address, tcp://host:port [, address, endpoint ...]
    Y X C <topic> NUL        , ...
    Y X G <group> NUL        , ...

An *export* is a relayed interest beacon (or batch) of one of the crossing
kinds, its first frame prefixed with ``Y``.  A tower publishes an export of
every crossing beacon that came from its **own** nodes (its beacons-in port),
never of one it imported; a bridge is a SUB connected to the other tower's
beacon-out port and subscribed to ``Y X S``, ``Y X C``, ``Y X G``: what it
takes is relayed to the bridging tower's nodes exactly as if its own nodes had
sent it.  Because imports are never exported again there are no loops (two
towers bridged both ways, or a tower bridged to itself, send each beacon at
most one hop); it also means bridges are not transitive: every pair of
regions that must meet is bridged (each side lists the other).

Nobody subscribes ``Y`` but bridges: nodes subscribe ``W``, ``B``, ``X...``
and ``R...``, so exports cost a tower nothing while no bridge listens
(``PlainXpub`` and libzmq's XPUB send nothing without a subscriber).  A C
tower never exports: bridged to a C tower, a dafka tower imports nothing and
the C tower's region works for its own nodes as before (its nodes' beacon PUBs
merely hold the bridge's ``Y`` subscription, which nothing they send matches).

An export's endpoint is the one its tower relays: where that tower saw the
node.  A node on the other tower's own host that bound all interfaces is seen
from loopback (``tcp://127.0.0.1:port``), which is no address in another
region: an import whose endpoint host is a loopback address is rewritten to
the address the bridge's connection sees the other tower at (when that is not
loopback itself).

Secure regions: a bridge is a CURVE client of the other tower's beacon-out
port, with this tower's key (which the other region's allow-list must hold) and
the other tower's public key (``--bridge-key`` / ``[tower] bridge_keys``, one
per bridge or one for all).  Exports then carry each node's key, as a secure
tower's relays do, and an import whose address is not bound to its key is
refused.  The nodes of both regions must allow each other's keys (one
allow-list for the regions that meet).

Bounds (see :class:`Import`): an import is decoded as a tower's batch (at most
``beacon.MAX_BATCH`` entries; a malformed entry costs its peer, not the batch),
of crossing kinds only; the bridge SUB's frames are at most the tower's
``BEACON_FRAME_MAX`` (a longer one cuts the connection) and its queue is
``beacon.BEACON_HWM`` messages; a tower has at most ``MAX_BRIDGES``.  A bridged
tower is trusted as a node trusts its own tower: what it exports reaches this
region's nodes, which bound what beacons make them do (``PeerLimits``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dafka.core import beacon
from dafka.errors import ProtocolError

EXPORT = beacon.EXPORT
CROSSING = frozenset((beacon.STORE, beacon.CONSUMER, beacon.GROUP))
# What a bridge SUB subscribes to on the other tower's beacon-out port: the
# exports, and the tower's hellos (every HELLO_INTERVAL: that the bridge is alive).
SUBSCRIPTIONS = (*(EXPORT + beacon.PREFIX + kind for kind in sorted(CROSSING)), beacon.HELLO)
MAX_BRIDGES = 64
# A bridge that heard nothing (no hello, no export) for this long is made anew:
# libzmq does not reconnect a connection it cut for a protocol error (a frame
# over the size limit), and a tower may have gone and come back.  Each silent
# round doubles the wait, up to SILENCE_MAX (a C tower never says hello).
SILENCE = 3 * beacon.HELLO_INTERVAL + 1.0
SILENCE_MAX = 120.0


def crosses(head: bytes) -> bool:
    """Whether beacons with this first frame cross to bridged regions."""
    return head[:1] == beacon.PREFIX and head[1:2] in CROSSING


def export(message: Sequence[bytes]) -> list[bytes] | None:
    """The export of a relayed beacon or batch (None when its kind stays in its region)."""
    head = bytes(message[0])
    if not crosses(head):
        return None
    return [EXPORT + head, *message[1:]]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rewrite_endpoint(endpoint: str, seen: str) -> str:
    """``endpoint`` with a loopback host replaced by ``seen`` (the other tower's address),
    unless ``seen`` is unknown or loopback too."""
    if not seen or is_loopback(seen):
        return endpoint
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not is_loopback(host):
        return endpoint
    if ":" in seen and not seen.startswith("["):
        seen = f"[{seen}]"
    return f"tcp://{seen}:{port}"


class Liveness:
    """When to make one bridge's connection anew (sans-IO): after ``SILENCE`` seconds
    of hearing nothing, then after twice as long each time it stays silent."""

    def __init__(self, now: float, silence: float = SILENCE, longest: float = SILENCE_MAX) -> None:
        self.silence = silence
        self.longest = longest
        self.wait = silence
        self.heard_at = now  # or when the connection was last made
        self.heard = False  # anything since the connection was made

    def on_heard(self, now: float) -> None:
        self.heard_at = now
        self.heard = True
        self.wait = self.silence

    def renew_due(self, now: float) -> bool:
        """Whether to make the connection anew now (then it counts as made now)."""
        if now - self.heard_at < self.wait:
            return False
        if not self.heard:
            self.wait = min(self.wait * 2, self.longest)
        self.heard = False
        self.heard_at = now
        return True


@dataclass
class Import:
    """Decodes what a bridge SUB takes from another region's tower (sans-IO).

    :meth:`on_message` gives the beacons to relay to this region's nodes, each
    ``[head, address, endpoint]`` as a tower relays a node's interest beacon,
    and counts what it left out.
    """

    imported: int = 0  # beacons taken
    refused: int = 0  # messages or entries left out
    errors: list[str] = field(default_factory=list)  # the last few reasons (at most 8)

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self.errors.append(reason)
        del self.errors[:-8]

    key_length: int = 0  # secure regions: each entry carries the node's public key (Z85, this long)
    bound: Callable[[str, bytes], bool] | None = None  # secure: whether an address is bound to a key

    def on_message(self, frames: Sequence[bytes], seen: str = "") -> list[list[bytes]]:
        """The beacons to relay for one message; ``seen`` is the other tower's address
        as the bridge's connection sees it (``Peer-Address``; "" if unknown).  In secure
        mode each is ``[head, address, endpoint, key]`` and its address is bound to its key."""
        if not frames:
            self._refuse("empty message")
            return []
        first = bytes(frames[0])
        if first[:1] != EXPORT:
            return []  # not an export (a welcome, a hello: nothing of ours)
        head = first[1:]
        if not crosses(head):
            self._refuse(f"export of a kind that does not cross: {head[:8]!r}")
            return []
        try:
            _kind, _key, entries, errors = beacon.decode_tower_relay([head, *frames[1:]], self.key_length)
        except ProtocolError as exc:
            self._refuse(str(exc))
            return []
        for error in errors:
            self._refuse(error)
        out = []
        for address, endpoint, public in entries:
            relayed = [head, address.encode(), rewrite_endpoint(endpoint, seen).encode()]
            if self.key_length:
                if self.bound is not None and not self.bound(address, public):
                    self._refuse(f"address {address[:40]!r} is not bound to the key it came with")
                    continue
                relayed.append(public)
            out.append(relayed)
        self.imported += len(out)
        return out
