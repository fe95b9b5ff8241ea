"""The leaf connection's codec: the Dafka wire codec plus the leaf's own messages (pure).

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
``R`` LEAF-READ, zmq topic the reader's address:
    ``subject:string``: read every partition of the topic ``subject`` (a second
    session kind on the same connection, see :mod:`dafka.core.leafread`).
``S`` LEAF-READING, zmq topic the reader's address:
    ``subject:string, max_answer:4, count:4`` then ``count`` times
    ``partition:string, first:8, last+1:8`` (``last+1`` 0: holds none of it):
    the endpoint reads the topic for this reader; the partitions it holds and
    the most records it answers one FETCH with.

A reader's records, heads and FETCHes are the mesh's DIRECT-RECORD,
DIRECT-HEAD and FETCH, addressed to (and from) the reader's address.

A restarted leaf states its restart hole with the mesh's VOID, kind 1
(``VOID_RESTART``), zmq topic, partition and source all its partition address
(see :class:`dafka.core.leaf.LeafLink`).

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
LEAF_READ = ord("R")
LEAF_READING = ord("S")
LEAF_NAMES = {LEAF_HELLO: "LEAF-HELLO", LEAF_WELCOME: "LEAF-WELCOME", LEAF_READ: "LEAF-READ", LEAF_READING: "LEAF-READING"}
MAX_READING = 4096  # partitions one LEAF-READING may list (the endpoint lists far fewer)
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


class LeafRead(NamedTuple):
    """LEAF-READ: a reader on a leaf connection asks for every partition of a topic."""

    topic: str  # zmq topic: the reader's address (DIRECT-RECORDs and DIRECT-HEADs are addressed to it)
    subject: str


class ReadPartition(NamedTuple):
    """One partition a LEAF-READING lists."""

    partition: str
    first: int  # first offset held
    last: int  # last offset held (-1: none)


class LeafReading(NamedTuple):
    """LEAF-READING: the endpoint reads the topic for this reader (the answer to LEAF-READ)."""

    topic: str  # zmq topic: the reader's address
    subject: str
    max_answer: int  # most records one FETCH is answered with
    partitions: tuple[ReadPartition, ...]


LeafMessage = (
    LeafHello | LeafWelcome | LeafRead | LeafReading | wire.Record | wire.RecordBatch | wire.Head | wire.Ack
    | wire.StoreStatus | wire.Fetch | wire.DirectRecord | wire.DirectRecordBatch | wire.DirectHead | wire.Void
)
# What each side may send.
FROM_LEAF = (LeafHello, LeafRead, wire.Record, wire.RecordBatch, wire.Head, wire.Fetch, wire.Void)
FROM_ENDPOINT = (LeafWelcome, LeafReading, wire.Ack, wire.StoreStatus, wire.DirectRecord, wire.DirectRecordBatch,
                 wire.DirectHead)
_MESH_IDS = frozenset((wire.RECORD, wire.HEAD, wire.ACK, wire.STORE_STATUS, wire.FETCH, wire.DIRECT_RECORD,
                       wire.DIRECT_HEAD, wire.VOID))


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
    if isinstance(msg, LeafRead):
        return [wire.header(LEAF_READ, msg.topic) + wire._s(msg.subject)]
    if isinstance(msg, LeafReading):
        if not 0 <= msg.max_answer <= 0xFFFFFFFF or len(msg.partitions) > MAX_READING:
            raise ProtocolError("LEAF-READING field out of range")
        parts = [wire.header(LEAF_READING, msg.topic), wire._s(msg.subject), wire._U32.pack(msg.max_answer),
                 wire._U32.pack(len(msg.partitions))]
        for p in msg.partitions:
            if not 0 <= p.first <= wire.MAX_U64 or not -1 <= p.last < wire.MAX_U64:
                raise ProtocolError("LEAF-READING offset out of range")
            parts += (wire._s(p.partition), wire.pack_u64(p.first), wire.pack_u64(p.last + 1))
        return [b"".join(parts)]
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
    if cmd == LEAF_READ:
        r.end()
        return LeafRead(topic, subject)
    if cmd == LEAF_READING:
        max_answer, n = r.u32(), r.u32()
        if n > MAX_READING:
            raise ProtocolError(f"LEAF-READING lists {n} partitions, at most {MAX_READING}")
        partitions = []
        for _ in range(n):
            partition, held_from, held_to = r.string(), r.u64(), r.u64() - 1
            partitions.append(ReadPartition(partition, held_from, held_to))
        r.end()
        return LeafReading(topic, subject, max_answer, tuple(partitions))
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
