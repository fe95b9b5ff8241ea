"""The leaf connection's codec: the Dafka wire codec plus LEAF-HELLO and LEAF-WELCOME (pure).

A leaf device talks to its regional endpoint over one DEALER/ROUTER connection
(see ``docs/concepts/leaves.md``).  Records, heads, ACKs and STORE-STATUS go as
the Dafka wire codec (:mod:`dafka.core.wire`) encodes them on the mesh; two
messages are new, laid out as every Dafka message
(``[id][zmq topic][0x00][version 0x01][fields]``, big-endian):

``I`` LEAF-HELLO, zmq topic the partition address:
    ``subject:string, acked+1:8, next:8`` (``acked+1`` 0: nothing acknowledged).
``O`` LEAF-WELCOME, zmq topic the partition address:
    ``subject:string, held+1:8, window:4, max_record_bytes:4`` (``held+1`` 0: the
    endpoint holds nothing of the partition).

:func:`decode` takes any message a leaf connection carries and refuses the
rest (``ProtocolError``): the mesh's other commands have no place on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from dafka.core import wire
from dafka.errors import ProtocolError

LEAF_HELLO = ord("I")
LEAF_WELCOME = ord("O")
LEAF_NAMES = {LEAF_HELLO: "LEAF-HELLO", LEAF_WELCOME: "LEAF-WELCOME"}
_NONE = 0xFFFFFFFFFFFFFFFF  # largest offset: "acked+1" and "held+1" must stay below 2^64


class LeafHello(NamedTuple):
    """LEAF-HELLO: a leaf names its partition and what of it is acknowledged."""

    topic: str  # zmq topic: the partition address
    subject: str
    acked: int  # highest offset acknowledged by any endpoint (-1: none)
    next: int  # the offset the leaf assigns next


class LeafWelcome(NamedTuple):
    """LEAF-WELCOME: the endpoint takes the session."""

    topic: str  # zmq topic: the partition address
    subject: str
    held: int  # the endpoint's committed head of the partition (-1: none)
    window: int  # records the leaf may have unacknowledged on this connection
    max_record_bytes: int


LeafMessage = LeafHello | LeafWelcome | wire.Record | wire.RecordBatch | wire.Head | wire.Ack | wire.StoreStatus
# What each side may send.
FROM_LEAF = (LeafHello, wire.Record, wire.RecordBatch, wire.Head)
FROM_ENDPOINT = (LeafWelcome, wire.Ack, wire.StoreStatus)
_MESH_IDS = frozenset((wire.RECORD, wire.HEAD, wire.ACK, wire.STORE_STATUS))


def encode(msg: LeafMessage) -> list[bytes]:
    """The frames of ``msg``."""
    if isinstance(msg, LeafHello):
        if not -1 <= msg.acked < msg.next <= _NONE or msg.next < 0:
            raise ProtocolError("LEAF-HELLO needs -1 <= acked < next < 2^64")
        return [wire.header(LEAF_HELLO, msg.topic) + wire._s(msg.subject) + wire.pack_u64(msg.acked + 1)
                + wire.pack_u64(msg.next)]
    if isinstance(msg, LeafWelcome):
        if not -1 <= msg.held < _NONE or not 0 <= msg.window <= 0xFFFFFFFF or not 0 <= msg.max_record_bytes <= 0xFFFFFFFF:
            raise ProtocolError("LEAF-WELCOME field out of range")
        return [wire.header(LEAF_WELCOME, msg.topic) + wire._s(msg.subject) + wire.pack_u64(msg.held + 1)
                + wire._U32.pack(msg.window) + wire._U32.pack(msg.max_record_bytes)]
    return wire.encode(msg)


def decode(frames: Sequence[bytes]) -> LeafMessage:
    """Decode one message of a leaf connection; ProtocolError if it is malformed or has no place there."""
    if not frames:
        raise ProtocolError("empty message")
    first = bytes(frames[0])
    if not first:
        raise ProtocolError("empty frame")
    cmd = first[0]
    if cmd in _MESH_IDS:
        msg = wire.decode(frames)
        return msg  # type: ignore[return-value]
    if cmd not in LEAF_NAMES:
        raise ProtocolError(f"command id 0x{cmd:02x} has no place on a leaf connection")
    if len(frames) != 1:
        raise ProtocolError(f"{LEAF_NAMES[cmd]} has {len(frames)} frames, expected 1")
    nul = first.find(b"\x00", 1)
    if nul < 0 or nul + 1 >= len(first):
        raise ProtocolError("missing topic terminator or version")
    if first[nul + 1] != wire.VERSION:
        raise ProtocolError(f"unsupported version {first[nul + 1]}")
    topic = wire._text(first[1:nul])
    r = wire._Reader(first, nul + 2)
    subject = r.string()
    if cmd == LEAF_HELLO:
        acked, nxt = r.u64() - 1, r.u64()
        r.end()
        if acked >= nxt:
            raise ProtocolError(f"LEAF-HELLO acked {acked} is not below next {nxt}")
        return LeafHello(topic, subject, acked, nxt)
    held, window, limit = r.u64() - 1, r.u32(), r.u32()
    r.end()
    if held == _NONE - 1:
        raise ProtocolError("LEAF-WELCOME held is past the last offset")
    return LeafWelcome(topic, subject, held, window, limit)
