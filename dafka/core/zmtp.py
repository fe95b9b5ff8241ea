"""The publishing side of ZMTP 3.0 / 3.1 with the NULL mechanism, and bounded subscriptions (sans-IO).

ZeroMQ's XPUB keeps every subscription a subscriber sends, in a trie of about
50 bytes per byte of a random prefix, before the application reads any: it has
no option that bounds their number (measured: ``ZMQ_XPUB_MANUAL``,
``ZMQ_XPUB_MANUAL_LAST_VALUE``, ``ZMQ_ONLY_FIRST_SUBSCRIBE`` and
``ZMQ_RCVHWM`` leave 20 MB of random subscriptions at 0.9-1 GB;
``ZMQ_MAXMSGSIZE`` bounds each one's size only).  A plain tower therefore
speaks ZMTP itself on its beacon-out port (:mod:`dafka.nodes.tower_front`):
:class:`Session` is one connection as a libzmq XPUB speaks it, byte for byte,
and :class:`SubscriptionBook` holds who subscribed what, within bounds.

What goes over the wire (RFC 23 / ZMTP 3.0 and RFC 37 / ZMTP 3.1), as libzmq
4.3 sends it:

* greeting, 64 bytes: ``FF``, 8 bytes of padding (libzmq: 1 as a big-endian
  64-bit number), ``7F``, version ``03 01``, mechanism ``NULL`` padded to 20
  bytes with NULs, as-server ``00``, 31 NULs.  libzmq sends the signature (10
  bytes) first and the rest once it has read the peer's signature; so do we;
* then each side a READY command with its ``Socket-Type`` (``XPUB`` here; a
  peer must be a ``SUB`` or an ``XSUB``);
* a frame: flags (1 MORE, 2 LONG, 4 COMMAND), size (1 byte, or 8 bytes
  big-endian when LONG; libzmq uses LONG above 255 only), body.  A command's
  body is the name's length (1 byte), the name, the data;
* subscriptions: a message frame ``01`` + prefix (``00`` + prefix cancels) from
  a ZMTP 3.0 peer; from a 3.1 peer the commands ``SUBSCRIBE`` / ``CANCEL`` +
  prefix (libzmq's SUB sends these to a 3.1 XPUB);
* 3.1 heartbeats: ``PING`` (TTL, 2 bytes, and a context of up to 16 bytes) is
  answered ``PONG`` + the context.  libzmq pings only with ``ZMQ_HEARTBEAT_IVL``.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from dafka.errors import ProtocolError

SIGNATURE = b"\xff" + (1).to_bytes(8, "big") + b"\x7f"  # as libzmq pads it
MECHANISM_NULL = b"NULL".ljust(20, b"\x00")
GREETING_SIZE = 64
MORE = 0x01
LONG = 0x02
COMMAND = 0x04
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
PUBLISHER_PEERS = frozenset((b"SUB", b"XSUB"))  # who may connect to an XPUB (as libzmq checks)

# Bounds of a publishing port (see SubscriptionBook and Session).
MAX_SUBSCRIPTION = 1024  # bytes of one prefix; a longer one cuts its connection
MAX_HANDSHAKE_FRAME = 8192  # bytes of a READY command (properties: Socket-Type, Identity, user metadata)
# ZMQ_MAXMSGSIZE of the libzmq sockets that take nothing but subscriptions
# (nodes' data publishers and beacon PUBs): a longer frame cuts its connection.
# It holds any subscription nodes make (at most 258 bytes) and, in secure mode,
# the CURVE handshake commands (INITIATE is about 300 bytes) and a CURVE
# MESSAGE's 41 bytes around a subscription.
SUBSCRIPTION_FRAME_MAX = MAX_SUBSCRIPTION
# What a subscription is taken to cost in memory, besides its bytes: a Python
# bytes object and its place in the book's index (ENTRY_COST), once per
# distinct prefix, and its place in its connection's set (HOLDING_COST) once
# per connection holding it.  Measured with tracemalloc: 266 bytes a random
# 64-byte prefix (counted 416), 160 a subscription of a fleet whose nodes share
# most of theirs (counted 165).
ENTRY_COST = 256
HOLDING_COST = 96
PEER_SUBSCRIPTIONS = 10_000  # per connection (a node holds a few, plus one per topic it reads)
PEER_BYTES = 4 * 1024 * 1024  # per connection, each counted as its length + ENTRY_COST
# All connections, counted as above: about 50,000 nodes of 8 subscriptions
# each; a flood that fills it holds about 41 MB.
TOTAL_BYTES = 64 * 1024 * 1024


def greeting_rest(minor: int = 1) -> bytes:
    """The 54 bytes of a NULL-mechanism greeting after the signature (as-server 0, as libzmq)."""
    return bytes((3, minor)) + MECHANISM_NULL + b"\x00" + bytes(31)


def greeting(minor: int = 1) -> bytes:
    """A whole 64-byte ZMTP 3.x NULL greeting."""
    return SIGNATURE + greeting_rest(minor)


def frame(body: bytes, flags: int = 0) -> bytes:
    """One frame: flags, short or (above 255 bytes) long size, body."""
    n = len(body)
    if n > 255:
        return bytes((flags | LONG,)) + _U64.pack(n) + body
    return bytes((flags, n)) + body


def message(frames: Sequence[bytes]) -> bytes:
    """A message's bytes on the wire (MORE on every frame but the last)."""
    last = len(frames) - 1
    return b"".join(frame(f, MORE if i < last else 0) for i, f in enumerate(frames))


def command(name: bytes, data: bytes = b"") -> bytes:
    """A command frame."""
    return frame(bytes((len(name),)) + name + data, COMMAND)


def ready(socket_type: bytes, properties: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """A READY command with ``Socket-Type`` first, then ``properties``."""
    props = b"".join(
        bytes((len(k),)) + k + _U32.pack(len(v)) + v for k, v in ((b"Socket-Type", socket_type), *properties)
    )
    return command(b"READY", props)


def parse_properties(data: bytes) -> dict[bytes, bytes]:
    """The properties of a READY command's data; ProtocolError if malformed."""
    props: dict[bytes, bytes] = {}
    i, n = 0, len(data)
    while i < n:
        size = data[i]
        name = data[i + 1 : i + 1 + size]
        i += 1 + size
        if size == 0 or len(name) != size or i + 4 > n:
            raise ProtocolError("malformed READY property")
        (length,) = _U32.unpack_from(data, i)
        i += 4
        if i + length > n:
            raise ProtocolError("READY property value runs past the command")
        props[name] = data[i : i + length]
        i += length
    return props


# Session states
_SIGNATURE, _GREETING, _READY, _OPEN, _CLOSED = range(5)


class Session:
    """One connection to a publishing socket (libzmq's XPUB), server side, NULL mechanism.

    Feed it what the peer sent (:meth:`receive`), which returns the
    ``(subscribe?, prefix)`` (un)subscriptions it carried, in order; send what
    :meth:`output` returns (the greeting, READY, PONGs) before any message.
    :attr:`open` turns true when the handshake is done; messages may go out
    from then on.  A ProtocolError says why the peer must be cut; the session
    is then closed and takes nothing more.
    """

    __slots__ = ("socket_type", "max_subscription", "minor", "peer_type", "_state", "_buf", "_out")

    def __init__(self, socket_type: bytes = b"XPUB", max_subscription: int = MAX_SUBSCRIPTION) -> None:
        self.socket_type = socket_type
        self.max_subscription = max_subscription
        self.minor = -1  # the peer's minor version, once its greeting came
        self.peer_type = b""
        self._state = _SIGNATURE
        self._buf = bytearray()
        self._out = bytearray(SIGNATURE)

    @property
    def open(self) -> bool:
        return self._state == _OPEN

    def output(self) -> bytes:
        """Bytes to send now (and forget)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive(self, data: bytes) -> list[tuple[bool, bytes]]:
        if self._state == _CLOSED:
            raise ProtocolError("session closed")
        self._buf += data
        try:
            return self._parse()
        except ProtocolError:
            self._state = _CLOSED
            self._buf.clear()
            raise

    def _parse(self) -> list[tuple[bool, bytes]]:
        buf = self._buf
        if self._state == _SIGNATURE:
            if len(buf) >= 1 and buf[0] != 0xFF:
                raise ProtocolError("not a ZMTP 3 peer (ZMTP 1.0 or not ZeroMQ)")
            if len(buf) < 10:
                return []
            if not buf[9] & 1:
                raise ProtocolError("not a ZMTP 3 peer (ZMTP 1.0 signature)")
            self._state = _GREETING
            self._out += greeting_rest()
        if self._state == _GREETING:
            if len(buf) < GREETING_SIZE:
                return []
            if buf[10] < 3:
                raise ProtocolError(f"ZMTP {buf[10]}.x peer: only ZMTP 3 is spoken here")
            if bytes(buf[12:32]) != MECHANISM_NULL:
                mechanism = bytes(buf[12:32]).rstrip(b"\x00").decode("ascii", "replace")
                raise ProtocolError(f"peer asks for the {mechanism!r} mechanism; this port speaks NULL only")
            self.minor = buf[11]
            del buf[:GREETING_SIZE]
            self._state = _READY
            self._out += ready(self.socket_type)
        events: list[tuple[bool, bytes]] = []
        pos = 0
        n = len(buf)
        limit = MAX_HANDSHAKE_FRAME if self._state == _READY else self.max_subscription + 16
        while pos + 2 <= n:
            flags = buf[pos]
            if flags & LONG:
                if pos + 9 > n:
                    break
                (size,) = _U64.unpack_from(buf, pos + 1)
                start = pos + 9
            else:
                size = buf[pos + 1]
                start = pos + 2
            if size > limit:
                raise ProtocolError(f"a frame of {size} bytes (at most {limit} here)")
            end = start + size
            if end > n:
                break
            body = bytes(buf[start:end])
            pos = end
            if self._state == _READY:
                self._on_ready(flags, body)
                limit = self.max_subscription + 16
                continue
            if flags & COMMAND:
                self._on_command(body, events)
            elif body and body[0] <= 1:  # 01 + prefix subscribes, 00 + prefix cancels
                self._check(len(body) - 1)
                events.append((body[0] == 1, body[1:]))
            # Any other message (an XSUB may send some): libzmq hands it to the
            # application; nothing here wants one, and it is dropped.
        if pos:
            del buf[:pos]
        return events

    def _check(self, size: int) -> None:
        if size > self.max_subscription:
            raise ProtocolError(f"a subscription of {size} bytes (at most {self.max_subscription})")

    def _on_ready(self, flags: int, body: bytes) -> None:
        name = body[1 : 1 + body[0]] if flags & COMMAND and body else b""
        if name == b"ERROR":
            raise ProtocolError(f"peer says ERROR: {body[7:].decode('utf-8', 'replace')[:80]!r}")
        if name != b"READY":
            raise ProtocolError("expected READY")
        props = parse_properties(body[1 + body[0] :])
        peer_type = props.get(b"Socket-Type", b"")
        if peer_type not in PUBLISHER_PEERS:
            raise ProtocolError(f"a {peer_type.decode('ascii', 'replace')[:20]!r} socket cannot talk to an XPUB")
        self.peer_type = peer_type
        self._state = _OPEN

    def _on_command(self, body: bytes, events: list[tuple[bool, bytes]]) -> None:
        if not body:
            raise ProtocolError("empty command")
        size = body[0]
        name = body[1 : 1 + size]
        if len(name) != size:
            raise ProtocolError("command name runs past the command")
        data = body[1 + size :]
        if name == b"SUBSCRIBE" or name == b"CANCEL":
            self._check(len(data))
            events.append((name == b"SUBSCRIBE", data))
        elif name == b"PING":
            if len(data) < 2:
                raise ProtocolError("PING without a TTL")
            self._out += command(b"PONG", data[2:18])
        elif name == b"ERROR":
            raise ProtocolError(f"peer says ERROR: {data[1:].decode('utf-8', 'replace')[:80]!r}")
        # PONG and commands of later versions: nothing to do, as libzmq.


P = TypeVar("P", bound=Hashable)


class SubscriptionLimit(ProtocolError):
    """A peer's subscriptions went past its bounds: it must be cut."""


class SubscriptionBook(Generic[P]):
    """Who subscribed which prefixes on a publishing port, within bounds (sans-IO).

    As an XPUB: a peer holds each prefix once (subscribing twice is one,
    one CANCEL takes it back); :meth:`subscribe` and :meth:`cancel` say when a
    prefix got its first holder or lost its last (what a non-verbose XPUB
    reports); :meth:`match` gives the peers a message's first frame goes to.

    Bounds: a peer holds at most ``peer_count`` prefixes and ``peer_bytes``
    (each prefix counted as its length + ``ENTRY_COST``); past either,
    :meth:`subscribe` raises SubscriptionLimit (cut the peer).  All peers hold
    at most ``total_bytes`` (:attr:`total`: each distinct prefix counted as its
    length + ``ENTRY_COST``, each holding of one ``HOLDING_COST``); past it
    :meth:`subscribe` names the peers to cut, those holding the most first,
    until the rest hold 90% of it (the subscriber may be one of them); the
    caller cuts them and closes them here (:meth:`close`).
    """

    def __init__(
        self, peer_count: int = PEER_SUBSCRIPTIONS, peer_bytes: int = PEER_BYTES, total_bytes: int = TOTAL_BYTES
    ) -> None:
        self.peer_count = peer_count
        self.peer_bytes = peer_bytes
        self.total_bytes = total_bytes
        self.total = 0
        self._held: dict[P, set[bytes]] = {}
        self._cost: dict[P, int] = {}
        self._holders: dict[bytes, list[P]] = {}
        self._lengths: dict[int, int] = {}  # prefix length -> how many distinct prefixes have it
        self._sorted_lengths: list[int] | None = []

    def __len__(self) -> int:
        """Distinct prefixes held."""
        return len(self._holders)

    def held(self, peer: P) -> int:
        return len(self._held.get(peer, ()))

    def cost(self, peer: P) -> int:
        return self._cost.get(peer, 0)

    def subscribe(self, peer: P, prefix: bytes) -> tuple[bool, list[P]]:
        """``(first holder?, peers to cut)``; SubscriptionLimit if ``peer`` went past its own bounds."""
        held = self._held.setdefault(peer, set())
        if prefix in held:
            return False, []
        cost = self._cost.get(peer, 0) + len(prefix) + ENTRY_COST
        if len(held) >= self.peer_count or cost > self.peer_bytes:
            raise SubscriptionLimit(
                f"more than {self.peer_count} subscriptions or {self.peer_bytes // 1024} KiB of them on one connection"
            )
        held.add(prefix)
        self._cost[peer] = cost
        self.total += HOLDING_COST
        holders = self._holders.get(prefix)
        first = holders is None
        if holders is None:
            self._holders[prefix] = [peer]
            self._count_length(len(prefix), 1)
            self.total += len(prefix) + ENTRY_COST
        else:
            holders.append(peer)
        return first, self._over_budget()

    def cancel(self, peer: P, prefix: bytes) -> bool:
        """Whether ``prefix`` lost its last holder (False also when ``peer`` did not hold it)."""
        held = self._held.get(peer)
        if held is None or prefix not in held:
            return False
        held.discard(prefix)
        self._cost[peer] -= len(prefix) + ENTRY_COST
        return self._release(peer, prefix)

    def close(self, peer: P) -> list[bytes]:
        """Forget ``peer``; the prefixes that lost their last holder (in order, as libzmq's trie gives them)."""
        held = self._held.pop(peer, set())
        self._cost.pop(peer, None)
        return [prefix for prefix in sorted(held) if self._release(peer, prefix)]

    def match(self, topic: bytes) -> list[P]:
        """The peers holding a prefix of ``topic``, each once."""
        lengths = self._sorted_lengths
        if lengths is None:
            lengths = self._sorted_lengths = sorted(self._lengths)
        holders = self._holders
        found: list[P] | None = None
        size = len(topic)
        for n in lengths:
            if n > size:
                break
            peers = holders.get(topic[:n])
            if peers is not None:
                if found is None:
                    found = list(peers)
                else:
                    found.extend(peers)
        if found is None:
            return []
        return found if len(found) == 1 else list(dict.fromkeys(found))

    def _release(self, peer: P, prefix: bytes) -> bool:
        holders = self._holders[prefix]
        holders.remove(peer)
        self.total -= HOLDING_COST
        if holders:
            return False
        del self._holders[prefix]
        self._count_length(len(prefix), -1)
        self.total -= len(prefix) + ENTRY_COST
        return True

    def _freed(self, peer: P) -> int:
        """How much :attr:`total` falls when ``peer`` is closed."""
        holders = self._holders
        return sum(
            HOLDING_COST + (len(p) + ENTRY_COST if len(holders[p]) == 1 else 0) for p in self._held.get(peer, ())
        )

    def _count_length(self, n: int, delta: int) -> None:
        count = self._lengths.get(n, 0) + delta
        if count:
            if n not in self._lengths:
                self._sorted_lengths = None
            self._lengths[n] = count
        else:
            del self._lengths[n]
            self._sorted_lengths = None

    def _over_budget(self) -> list[P]:
        if self.total <= self.total_bytes:
            return []
        # Down to 90%: the next cut is not due at the next subscription (each looks at every peer).
        over = self.total - self.total_bytes * 9 // 10
        cut: list[P] = []
        for peer in sorted(self._cost, key=self._cost.__getitem__, reverse=True):
            cut.append(peer)
            over -= self._freed(peer)
            if over <= 0:
                break
        return cut
