"""Dafka wire codec, byte-exact with the reference C implementation.

One Dafka message is one ZeroMQ frame (plus a content frame for RECORD and
DIRECT-RECORD)::

    [command id:1][zmq topic bytes][0x00][version 0x01][fields...]

All numbers are big-endian.  Strings are a 1-byte length and bytes, "strings"
are a 4-byte count then 4-byte-length strings.  See ``shared/specs/dafka_wire.md``.

This module is pure: no sockets.  ``encode`` turns a message into frames,
``decode`` turns frames into a message or raises :class:`ProtocolError`.
The hot-path helpers (``record_prefix`` and friends) let nodes build and
recognise RECORD headers with one concatenation or one dict lookup.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dafka.errors import ProtocolError

VERSION = 1
# A RECORD or DIRECT-RECORD with version 2 carries a batch of consecutive
# records in its content frame (this implementation only: one message for many
# records costs libzmq, the readers and CURVE a fraction of one each).  C nodes
# drop it, so it goes only to readers that all subscribed its twin (below).
BATCH_VERSION = 2
BATCH_RECORDS = 128  # at most this many records in one batch message...
BATCH_BYTES = 16 * 1024  # ...and contents of at most this size (a bigger record goes alone);
# queues count messages, so this bounds what a full queue of batches holds

RECORD = ord("M")
DIRECT_RECORD = ord("D")
FETCH = ord("F")
ACK = ord("K")
HEAD = ord("H")
DIRECT_HEAD = ord("E")
GET_HEADS = ord("G")
CONSUMER_HELLO = ord("W")
STORE_HELLO = ord("L")
# Not in the RFC nor in the C nodes: only dafka producers subscribe to it (C nodes
# subscribe to exact prefixes of the ids above, so it never reaches them).
STORE_STATUS = ord("Y")
# Not in the RFC nor in the C nodes either: "nothing of these offsets here" (see
# Void); only dafka readers subscribe to it.
VOID = ord("V")
# Consumer groups (this implementation only; see "Consumer groups" below).
COMMIT = ord("C")
COMMITTED = ord("A")
GET_POSITIONS = ord("P")
POSITIONS = ord("Q")
MEMBER = ord("J")

COMMAND_NAMES = {
    RECORD: "RECORD",
    DIRECT_RECORD: "DIRECT-RECORD",
    FETCH: "FETCH",
    ACK: "ACK",
    HEAD: "HEAD",
    DIRECT_HEAD: "DIRECT-HEAD",
    GET_HEADS: "GET-HEADS",
    CONSUMER_HELLO: "CONSUMER-HELLO",
    STORE_HELLO: "STORE-HELLO",
    STORE_STATUS: "STORE-STATUS",
    VOID: "VOID",
    COMMIT: "COMMIT",
    COMMITTED: "COMMITTED",
    GET_POSITIONS: "GET-POSITIONS",
    POSITIONS: "POSITIONS",
    MEMBER: "MEMBER",
}

# Subscription prefixes are the command id followed by the zmq topic.
P_RECORD = b"M"
P_DIRECT_RECORD = b"D"
P_FETCH = b"F"
P_ACK = b"K"
P_HEAD = b"H"
P_DIRECT_HEAD = b"E"
P_GET_HEADS = b"G"
P_CONSUMER_HELLO = b"W"
P_STORE_HELLO = b"L"
P_STORE_STATUS = b"Y"
P_VOID = b"V"
P_COMMIT = b"C"
P_COMMITTED = b"A"
P_GET_POSITIONS = b"P"
P_POSITIONS = b"Q"
P_MEMBER = b"J"
# A reader that takes batches subscribes, beside each record subscription, the
# same prefix behind this byte (its batch twin; see dafka.core.audience).  No message
# starts with it, and a C node's XPUB ignores a subscription of an unknown id.
BATCH_CAPABLE = b"\x02"

# Beacon frames exchanged with towers.
BEACON = b"B"
WELCOME = b"W"

MAX_STRING = 255
MAX_STRINGS = 65536  # a sane bound on CONSUMER-HELLO subject lists

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_SEQ_COUNT = struct.Struct(">QI")
pack_u64 = _U64.pack
MAX_U64 = 0xFFFFFFFFFFFFFFFF


class Record(NamedTuple):
    """RECORD: a producer publishes ``content`` at ``sequence`` of its partition."""

    topic: str  # zmq topic: the subject
    address: str  # producer (partition) address
    subject: str
    sequence: int
    content: bytes


class DirectRecord(NamedTuple):
    """DIRECT-RECORD: a record sent to one requester in answer to FETCH."""

    topic: str  # zmq topic: the requester's address
    address: str  # partition address
    subject: str
    sequence: int
    content: bytes


class RecordBatch(NamedTuple):
    """RECORD, version 2: records ``sequence``, ``sequence + 1``... of a partition at once."""

    topic: str  # zmq topic: the subject
    address: str  # producer (partition) address
    subject: str
    sequence: int  # of the first record
    contents: tuple[bytes, ...]


class DirectRecordBatch(NamedTuple):
    """DIRECT-RECORD, version 2: consecutive records sent to one requester."""

    topic: str  # zmq topic: the requester's address
    address: str  # partition address
    subject: str
    sequence: int  # of the first record
    contents: tuple[bytes, ...]


class Fetch(NamedTuple):
    """FETCH: ask for ``count`` records of a partition from ``sequence`` on."""

    topic: str  # zmq topic: the partition (producer) address
    address: str  # sender's address (where DIRECT-RECORDs go)
    subject: str
    sequence: int
    count: int


class Ack(NamedTuple):
    """ACK: a store has durably stored the partition up to ``sequence``."""

    topic: str  # zmq topic: the producer's address
    subject: str
    sequence: int


class Head(NamedTuple):
    """HEAD: the producer's last published sequence."""

    topic: str  # zmq topic: the subject
    address: str  # producer address
    subject: str
    sequence: int


class DirectHead(NamedTuple):
    """DIRECT-HEAD: a partition's head sent to one consumer."""

    topic: str  # zmq topic: the consumer's address
    address: str  # partition address
    subject: str
    sequence: int


class GetHeads(NamedTuple):
    """GET-HEADS: a consumer asks for the heads of every partition of ``topic``."""

    topic: str  # zmq topic: the subject
    address: str  # consumer address


class ConsumerHello(NamedTuple):
    """CONSUMER-HELLO: a consumer tells a store which subjects it reads."""

    topic: str  # zmq topic: the store's address
    address: str  # consumer address
    subjects: tuple[str, ...]


class StoreHello(NamedTuple):
    """STORE-HELLO: a store greets a consumer that subscribed to it."""

    topic: str  # zmq topic: the consumer's address
    address: str  # store address


class StoreStatus(NamedTuple):
    """STORE-STATUS (dafka only): whether a store can acknowledge a producer's records.

    ``Y <producer address> 00 01 <store address:string> <subject:string>
    <writing:1> <reason:string>``.  A store sends it about once a second to
    each producer whose records it has received or is holding; ``writing``
    is 1 while its commits succeed, 0 while they fail (then ``reason`` says
    why, e.g. a full disk), so a producer without ACKs can say why.
    """

    topic: str  # zmq topic: the producer's address
    address: str  # store address
    subject: str
    writing: int  # 1: commits succeed; 0: they fail and ACKs have stopped
    reason: str  # why not writing ("" when writing)


VOID_STORE = 0  # a store holds none of the range (committed, being written, or held)
VOID_RESTART = 1  # the partition's producer: a restart hole, never published by this run
VOID_COMPACTED = 2  # a store compacted these offsets away (later records of their keys superseded them)


class Void(NamedTuple):
    """VOID (dafka only): "none of offsets ``first..last`` of the partition here".

    ``V <requester address> 00 01 <partition:string> <subject:string> <first:8>
    <last:8> <source:string> <kind:1>``, sent to a reader that FETCHed them.
    ``kind`` 0: the store ``source`` holds none of them (not committed, not
    being written, not held beyond a hole).  ``kind`` 1: the partition's
    producer (``source`` is its address) resumed after a crash past them: this
    run never publishes them, and a previous run's records there can only be
    in a store.  A reader passes such a restart hole as soon as every store it
    knows said kind 0 for it (see dafka.core.gaps).  ``kind`` 2: the store
    ``source`` compacted them away (a compacted topic: later records of their
    keys superseded them, see dafka.store.compaction); a consumer passes them at
    once.  C nodes never subscribe to ``V``, so it never reaches them.
    """

    topic: str  # zmq topic: the requester's address
    address: str  # partition address
    subject: str
    first: int
    last: int
    source: str  # the store's address, or the partition's (its producer)
    kind: int  # VOID_STORE, VOID_RESTART or VOID_COMPACTED
# ---------------------------------------------------------------- consumer groups
#
# Messages the C reference does not have.  Their command ids are letters no
# reference node subscribes to (it subscribes to exact prefixes of M D F K H E
# G W L), so they never reach C nodes.  A position is the next offset to
# deliver; positions travel as ``count:4`` then, per entry, ``subject string,
# partition string, offset:8``; claims as ``count:4`` then ``subject string,
# partition string``.
#
# | id | command       | ZeroMQ topic     | fields after the version byte                        |
# | C  | COMMIT        | group            | address (member), commit id:8, positions             |
# | A  | COMMITTED     | member address   | address (store), commit id:8                         |
# | P  | GET-POSITIONS | group            | address (member), request id:8                       |
# | Q  | POSITIONS     | member address   | address (store), group string, request id:8, positions |
# | J  | MEMBER        | group            | address (member), flags:1 (1 = leaving), strings (topics), claims |

Position = tuple[str, str, int]  # (subject, partition, next offset)
Claim = tuple[str, str]  # (subject, partition)


class Commit(NamedTuple):
    """COMMIT: a group member asks every store to record the group's positions."""

    topic: str  # zmq topic: the group
    address: str  # member address (where COMMITTED goes)
    commit_id: int
    positions: tuple[Position, ...]


class Committed(NamedTuple):
    """COMMITTED: a store has durably recorded commit ``commit_id``."""

    topic: str  # zmq topic: the member's address
    address: str  # store address
    commit_id: int


class GetPositions(NamedTuple):
    """GET-POSITIONS: a member asks the stores for the group's committed positions."""

    topic: str  # zmq topic: the group
    address: str  # member address
    request_id: int


class Positions(NamedTuple):
    """POSITIONS: a store's answer to GET-POSITIONS (every position of the group it holds)."""

    topic: str  # zmq topic: the member's address
    address: str  # store address
    group: str
    request_id: int
    positions: tuple[Position, ...]


class Member(NamedTuple):
    """MEMBER: a group member's heartbeat (or, with ``leaving``, its goodbye)."""

    topic: str  # zmq topic: the group
    address: str  # member address
    leaving: bool
    topics: tuple[str, ...]  # the subjects it consumes
    claims: tuple[Claim, ...]  # the partitions it delivers (or still hands over)


Message = (
    Record
    | DirectRecord
    | RecordBatch
    | DirectRecordBatch
    | Fetch
    | Ack
    | Head
    | DirectHead
    | GetHeads
    | ConsumerHello
    | StoreHello
    | StoreStatus
    | Void
    | Commit
    | Committed
    | GetPositions
    | Positions
    | Member
)

_IDS: dict[type, int] = {
    Record: RECORD,
    DirectRecord: DIRECT_RECORD,
    RecordBatch: RECORD,
    DirectRecordBatch: DIRECT_RECORD,
    Fetch: FETCH,
    Ack: ACK,
    Head: HEAD,
    DirectHead: DIRECT_HEAD,
    GetHeads: GET_HEADS,
    ConsumerHello: CONSUMER_HELLO,
    StoreHello: STORE_HELLO,
    StoreStatus: STORE_STATUS,
    Void: VOID,
    Commit: COMMIT,
    Committed: COMMITTED,
    GetPositions: GET_POSITIONS,
    Positions: POSITIONS,
    Member: MEMBER,
}


def reason_text(text: str) -> str:
    """``text`` as a string field may hold it: without NUL (which a decoder refuses
    in any string), cut to 255 bytes of whole UTF-8 characters."""
    return text.replace("\x00", "").encode()[:MAX_STRING].decode(errors="ignore")


def command_id(msg: Message) -> int:
    return _IDS[type(msg)]


# ---------------------------------------------------------------- encoding


def _s(value: str) -> bytes:
    b = value.encode()
    if len(b) > MAX_STRING:
        raise ProtocolError(f"string longer than {MAX_STRING} bytes")
    return bytes((len(b),)) + b


def _topic(value: str) -> bytes:
    b = value.encode()
    if b"\x00" in b:
        raise ProtocolError("a zmq topic must not contain NUL")
    return b


def header(cmd: int, topic: str, version: int = VERSION) -> bytes:
    """The frame start shared by every command: id, topic, NUL, version."""
    return bytes((cmd,)) + _topic(topic) + bytes((0, version))


def pack_batch(contents: Sequence[bytes]) -> bytes:
    """A batch's content frame: ``count:4``, then ``length:4 bytes`` for each record."""
    if not 0 < len(contents) <= 0xFFFFFFFF:
        raise ProtocolError("a batch holds 1 to 2**32-1 records")
    parts = [_U32.pack(len(contents))]
    for content in contents:
        parts.append(_U32.pack(len(content)))
        parts.append(bytes(content))
    return b"".join(parts)


def unpack_batch(body: bytes, first: int) -> tuple[bytes, ...]:
    """The contents of a batch's content frame (see :func:`pack_batch`) starting at offset ``first``."""
    # A tight loop rather than _Reader: pure-Python readers call it per batch on their hot path.
    size = len(body)
    if size < 4:
        raise ProtocolError("truncated batch count")
    count = _U32.unpack_from(body)[0]
    if count == 0:
        raise ProtocolError("empty batch")
    if count > (size - 4) // 4:
        raise ProtocolError("batch count larger than its frame")
    if first + count - 1 > 0xFFFFFFFFFFFFFFFF:
        raise ProtocolError("batch runs past the last offset")
    length_at = _U32.unpack_from
    out = []
    pos = 4
    for _ in range(count):
        if pos + 4 > size:
            raise ProtocolError("truncated batch record length")
        end = pos + 4 + length_at(body, pos)[0]
        if end > size:
            raise ProtocolError("truncated batch record")
        out.append(body[pos + 4 : end])
        pos = end
    if pos != size:
        raise ProtocolError(f"{size - pos} trailing bytes after a batch")
    return tuple(out)


def batch_prefix(prefix: bytes) -> bytes:
    """The batch (version 2) form of a :func:`record_prefix`."""
    at = prefix.index(0, 1) + 1
    return prefix[:at] + bytes((BATCH_VERSION,)) + prefix[at + 1 :]


class FramePrefixes:
    """Frames of one-frame messages that end in their u64 sequence (ACK, HEAD), by a key (a
    partition): the frame up to the sequence is encoded once, by :func:`encode` (so it is
    byte-exact), and kept; ``make(key)`` gives the key's message, of sequence 0.  At most
    ``limit`` keys are kept (all are forgotten past it)."""

    __slots__ = ("_make", "_prefixes", "limit")

    def __init__(self, make: Callable[[Any], Message], limit: int = 10_000) -> None:
        self._make = make
        self._prefixes: dict[Any, bytes] = {}
        self.limit = limit

    def frame(self, key: Any, sequence: int) -> bytes:
        """The frame of ``key``'s message at ``sequence``."""
        prefix = self._prefixes.get(key)
        if prefix is None:
            frames = encode(self._make(key))
            if len(frames) != 1 or not frames[0].endswith(bytes(8)):
                raise ValueError("FramePrefixes: not a one-frame message ending in its sequence 0")
            if len(self._prefixes) >= self.limit:
                self._prefixes.clear()
            prefix = self._prefixes[key] = frames[0][:-8]
        return prefix + pack_u64(sequence)


def encode(msg: Message) -> list[bytes]:
    """Encode ``msg`` into its ZeroMQ frames."""
    cmd = command_id(msg)
    if isinstance(msg, RecordBatch | DirectRecordBatch):
        head = header(cmd, msg.topic, BATCH_VERSION)
        return [head + _s(msg.address) + _s(msg.subject) + pack_u64(msg.sequence), pack_batch(msg.contents)]
    head = header(cmd, msg.topic)
    if cmd == RECORD or cmd == DIRECT_RECORD:
        return [
            head + _s(msg.address) + _s(msg.subject) + pack_u64(msg.sequence),  # type: ignore[union-attr]
            bytes(msg.content),  # type: ignore[union-attr]
        ]
    if cmd == FETCH:
        return [head + _s(msg.address) + _s(msg.subject) + _SEQ_COUNT.pack(msg.sequence, msg.count)]  # type: ignore[union-attr]
    if cmd == ACK:
        return [head + _s(msg.subject) + pack_u64(msg.sequence)]  # type: ignore[union-attr]
    if cmd == HEAD or cmd == DIRECT_HEAD:
        return [head + _s(msg.address) + _s(msg.subject) + pack_u64(msg.sequence)]  # type: ignore[union-attr]
    if cmd == GET_HEADS or cmd == STORE_HELLO:
        return [head + _s(msg.address)]  # type: ignore[union-attr]
    if cmd == STORE_STATUS:
        writing = msg.writing  # type: ignore[union-attr]
        if writing not in (0, 1):
            raise ProtocolError("STORE-STATUS writing must be 0 or 1")
        return [head + _s(msg.address) + _s(msg.subject) + bytes((writing,)) + _s(msg.reason)]  # type: ignore[union-attr]
    if cmd == VOID:
        v: Void = msg  # type: ignore[assignment]
        if v.kind not in (VOID_STORE, VOID_RESTART, VOID_COMPACTED) or not 0 <= v.first <= v.last:
            raise ProtocolError("VOID needs kind 0, 1 or 2 and first <= last")
        return [head + _s(v.address) + _s(v.subject) + pack_u64(v.first) + pack_u64(v.last) + _s(v.source) + bytes((v.kind,))]
    if cmd in _GROUP_COMMANDS:
        return [head + _encode_group(cmd, msg)]
    # CONSUMER-HELLO
    subjects = msg.subjects  # type: ignore[union-attr]
    if len(subjects) > MAX_STRINGS:
        raise ProtocolError("too many subjects")
    parts = [head, _s(msg.address), _U32.pack(len(subjects))]  # type: ignore[union-attr]
    for subject in subjects:
        b = subject.encode()
        parts.append(_U32.pack(len(b)))
        parts.append(b)
    return [b"".join(parts)]


# ---------------------------------------------------------------- decoding


class _Reader:
    """A bounds-checked cursor over one frame."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def string(self) -> str:
        buf, pos = self.buf, self.pos
        if pos >= len(buf):
            raise ProtocolError("truncated string length")
        n = buf[pos]
        end = pos + 1 + n
        if end > len(buf):
            raise ProtocolError("truncated string")
        self.pos = end
        raw = buf[pos + 1 : end]
        if 0 in raw:
            # Strings are addresses and subjects, which answers use as ZeroMQ
            # topics: one with a NUL would make the node's own reply fail.
            raise ProtocolError("string contains NUL")
        return _text(raw)

    def u8(self) -> int:
        pos = self.pos
        if pos >= len(self.buf):
            raise ProtocolError("truncated number-1")
        self.pos = pos + 1
        return self.buf[pos]

    def u64(self) -> int:
        pos = self.pos
        if pos + 8 > len(self.buf):
            raise ProtocolError("truncated number-8")
        self.pos = pos + 8
        return _U64.unpack_from(self.buf, pos)[0]

    def u32(self) -> int:
        pos = self.pos
        if pos + 4 > len(self.buf):
            raise ProtocolError("truncated number-4")
        self.pos = pos + 4
        return _U32.unpack_from(self.buf, pos)[0]

    def longstr(self) -> str:
        n = self.u32()
        pos = self.pos
        if pos + n > len(self.buf):
            raise ProtocolError("truncated longstr")
        self.pos = pos + n
        raw = self.buf[pos : pos + n]
        if 0 in raw:
            raise ProtocolError("string contains NUL")
        return _text(raw)

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} trailing bytes")


def _text(b: bytes) -> str:
    try:
        return b.decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("string is not UTF-8") from exc


def decode(frames: Sequence[bytes]) -> Message:
    """Decode one Dafka message from its frames; raise ProtocolError if malformed."""
    if not frames:
        raise ProtocolError("empty message")
    frame = bytes(frames[0])
    if len(frame) < 3:
        raise ProtocolError("frame too short")
    cmd = frame[0]
    if cmd not in COMMAND_NAMES:
        raise ProtocolError(f"unknown command id 0x{cmd:02x}")
    nul = frame.find(b"\x00", 1)
    if nul < 0 or nul + 1 >= len(frame):
        raise ProtocolError("missing topic terminator or version")
    has_content = cmd == RECORD or cmd == DIRECT_RECORD
    version = frame[nul + 1]
    if version != VERSION and not (version == BATCH_VERSION and has_content):
        raise ProtocolError(f"unsupported version {version}")
    topic = _text(frame[1:nul])
    r = _Reader(frame, nul + 2)
    if len(frames) != (2 if has_content else 1):
        raise ProtocolError(
            f"{COMMAND_NAMES[cmd]} has {len(frames)} frames, expected {2 if has_content else 1}"
        )
    msg: Message
    if has_content:
        address, subject, seq = r.string(), r.string(), r.u64()
        if version == BATCH_VERSION:
            contents = unpack_batch(bytes(frames[1]), seq)
            msg = (RecordBatch if cmd == RECORD else DirectRecordBatch)(topic, address, subject, seq, contents)
        else:
            content = bytes(frames[1])
            msg = (Record if cmd == RECORD else DirectRecord)(topic, address, subject, seq, content)
    elif cmd == FETCH:
        address, subject, seq, count = r.string(), r.string(), r.u64(), r.u32()
        msg = Fetch(topic, address, subject, seq, count)
    elif cmd == ACK:
        subject, seq = r.string(), r.u64()
        msg = Ack(topic, subject, seq)
    elif cmd == HEAD or cmd == DIRECT_HEAD:
        address, subject, seq = r.string(), r.string(), r.u64()
        msg = (Head if cmd == HEAD else DirectHead)(topic, address, subject, seq)
    elif cmd == GET_HEADS:
        msg = GetHeads(topic, r.string())
    elif cmd == STORE_HELLO:
        msg = StoreHello(topic, r.string())
    elif cmd == STORE_STATUS:
        address, subject, writing = r.string(), r.string(), r.u8()
        if writing > 1:
            raise ProtocolError(f"STORE-STATUS writing {writing} is not 0 or 1")
        msg = StoreStatus(topic, address, subject, writing, r.string())
    elif cmd == VOID:
        address, subject, first, last, source, kind = r.string(), r.string(), r.u64(), r.u64(), r.string(), r.u8()
        if kind > VOID_COMPACTED or first > last:
            raise ProtocolError(f"VOID kind {kind} / range {first}..{last} is not valid")
        msg = Void(topic, address, subject, first, last, source, kind)
    elif cmd in _GROUP_COMMANDS:
        msg = _decode_group(cmd, topic, r)
    else:  # CONSUMER-HELLO
        address = r.string()
        n = r.u32()
        if n > MAX_STRINGS:
            raise ProtocolError(f"{n} subjects is more than {MAX_STRINGS}")
        subjects = tuple(r.longstr() for _ in range(n))
        msg = ConsumerHello(topic, address, subjects)
    r.end()
    return msg


def _strings(values: Sequence[str]) -> bytes:
    if len(values) > MAX_STRINGS:
        raise ProtocolError("too many strings")
    parts = [_U32.pack(len(values))]
    for value in values:
        b = value.encode()
        parts.append(_U32.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def _positions(positions: Sequence[Position]) -> bytes:
    if len(positions) > MAX_STRINGS:
        raise ProtocolError("too many positions")
    parts = [_U32.pack(len(positions))]
    for subject, partition, offset in positions:
        parts.append(_s(subject) + _s(partition) + pack_u64(offset))
    return b"".join(parts)


def _encode_group(cmd: int, msg: Message) -> bytes:
    """The fields of a consumer-group message (after the version byte)."""
    if cmd == COMMIT:
        return _s(msg.address) + pack_u64(msg.commit_id) + _positions(msg.positions)  # type: ignore[union-attr]
    if cmd == COMMITTED:
        return _s(msg.address) + pack_u64(msg.commit_id)  # type: ignore[union-attr]
    if cmd == GET_POSITIONS:
        return _s(msg.address) + pack_u64(msg.request_id)  # type: ignore[union-attr]
    if cmd == POSITIONS:
        return (
            _s(msg.address) + _s(msg.group) + pack_u64(msg.request_id) + _positions(msg.positions)  # type: ignore[union-attr]
        )
    # MEMBER
    claims = msg.claims  # type: ignore[union-attr]
    if len(claims) > MAX_STRINGS:
        raise ProtocolError("too many claims")
    parts = [
        _s(msg.address),  # type: ignore[union-attr]
        b"\x01" if msg.leaving else b"\x00",  # type: ignore[union-attr]
        _strings(msg.topics),  # type: ignore[union-attr]
        _U32.pack(len(claims)),
    ]
    for subject, partition in claims:
        parts.append(_s(subject) + _s(partition))
    return b"".join(parts)


def _read_positions(r: _Reader) -> tuple[Position, ...]:
    n = r.u32()
    if n > MAX_STRINGS:
        raise ProtocolError(f"{n} positions is more than {MAX_STRINGS}")
    return tuple((r.string(), r.string(), r.u64()) for _ in range(n))


def _decode_group(cmd: int, topic: str, r: _Reader) -> Message:
    if cmd == COMMIT:
        return Commit(topic, r.string(), r.u64(), _read_positions(r))
    if cmd == COMMITTED:
        return Committed(topic, r.string(), r.u64())
    if cmd == GET_POSITIONS:
        return GetPositions(topic, r.string(), r.u64())
    if cmd == POSITIONS:
        return Positions(topic, r.string(), r.string(), r.u64(), _read_positions(r))
    # MEMBER
    address = r.string()
    if r.pos >= len(r.buf):
        raise ProtocolError("truncated flags")
    flags = r.buf[r.pos]
    if flags > 1:
        raise ProtocolError(f"unknown MEMBER flags 0x{flags:02x}")
    r.pos += 1
    n = r.u32()
    if n > MAX_STRINGS:
        raise ProtocolError(f"{n} topics is more than {MAX_STRINGS}")
    topics = tuple(r.longstr() for _ in range(n))
    n = r.u32()
    if n > MAX_STRINGS:
        raise ProtocolError(f"{n} claims is more than {MAX_STRINGS}")
    claims = tuple((r.string(), r.string()) for _ in range(n))
    return Member(topic, address, bool(flags), topics, claims)


_GROUP_COMMANDS = frozenset((COMMIT, COMMITTED, GET_POSITIONS, POSITIONS, MEMBER))


# ---------------------------------------------------------------- hot path


def record_prefix(cmd: int, topic: str, address: str, subject: str) -> bytes:
    """Header bytes of a (DIRECT-)RECORD up to, not including, the sequence.

    ``record_prefix(...) + pack_u64(seq)`` is the complete first frame; a
    receiver can recognise a known partition by looking up ``frame[:-8]``.
    """
    return header(cmd, topic) + _s(address) + _s(subject)


def record_prefixes(cmd: int, topic: str, address: str, subject: str) -> tuple[bytes, bytes]:
    """The :func:`record_prefix` of single records and of batches (what a reader recognises)."""
    single = record_prefix(cmd, topic, address, subject)
    return single, batch_prefix(single)


def subscription(prefix: bytes, topic: str = "") -> bytes:
    """A SUB subscription for command ``prefix`` and zmq ``topic``."""
    return prefix + topic.encode()


def parse_subscription(frame: bytes) -> tuple[bool, bytes] | None:
    """An XPUB's received frame: (subscribe?, prefix) or None if not one."""
    if not frame or frame[0] > 1:
        return None
    return frame[0] == 1, bytes(frame[1:])


# ---------------------------------------------------------------- beacons


def node_beacon(address: str, host: str, port: int) -> list[bytes]:
    """The 4-frame beacon a node sends to a tower's XSUB."""
    return [BEACON, address.encode(), host.encode(), str(port).encode()]


def tower_beacon(address: str, endpoint: str) -> list[bytes]:
    """The 3-frame beacon a tower publishes to nodes."""
    return [BEACON, address.encode(), endpoint.encode()]


def decode_node_beacon(frames: Sequence[bytes]) -> tuple[str, str, int]:
    """(address, host, port) from a node beacon; ProtocolError if malformed."""
    if len(frames) != 4 or bytes(frames[0]) != BEACON:
        raise ProtocolError("node beacon must be 4 frames starting with B")
    address = _text(bytes(frames[1]))
    host = _text(bytes(frames[2]))
    port_text = bytes(frames[3])
    if not port_text.isdigit() or len(port_text) > 5:
        raise ProtocolError("beacon port is not a decimal number")
    port = int(port_text)
    if not 0 < port < 65536 or not address or len(address) > MAX_STRING:
        raise ProtocolError("beacon port or address out of range")
    return address, host, port


def decode_tower_beacon(frames: Sequence[bytes]) -> tuple[str, str]:
    """(address, endpoint) from a tower beacon; ProtocolError if malformed."""
    if len(frames) != 3 or bytes(frames[0]) != BEACON:
        raise ProtocolError("tower beacon must be 3 frames starting with B")
    address = _text(bytes(frames[1]))
    endpoint = _text(bytes(frames[2]))
    if not endpoint.startswith("tcp://") or not address:
        raise ProtocolError("tower beacon endpoint must be tcp://host:port")
    return address, endpoint
