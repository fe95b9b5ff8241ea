"""Tank requests and responses: one typed class per message, both directions.

Each class encodes itself with ``encode()`` (a complete frame) or
``encode_payload()`` (the bytes after the 5-byte frame header), and decodes a
payload with the ``decode(payload)`` classmethod.  A client encodes requests
and decodes responses; a server (the gateway) decodes requests and encodes
responses, with the same classes.  :func:`decode_request`,
:func:`decode_response` and :func:`response_request_id` dispatch on msgId.

Layouts follow ``tank_current.md``.  Decoders raise ProtocolError for any
malformed payload, including trailing bytes.  Encoders raise ProtocolError
for values the layout cannot carry and for codes a real Tank client would
choke on: only the flag and error values listed in ``tank_current.md`` exist
here (the C++ client aborts on consume flags 0x02..0xfa).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, NamedTuple, Self

from dafka.errors import ProtocolError
from dafka.tank.bundle import ChunkResult, decode_chunk
from dafka.tank.codec import (
    U8,
    U16,
    U32,
    U64,
    UINT64_MAX,
    Reader,
    decode_varint,
    encode_str8,
    encode_varint,
    frame_header,
)

__all__ = [
    "CONSUME_OP_FLAGS_MIN_VERSION",
    "CONSUME_VERSION",
    "PRODUCE_PARTITION_ERRORS",
    "PRODUCE_TOPIC_ERRORS",
    "PRODUCE_VERSION",
    "SEQ_FIRST_AVAILABLE",
    "SEQ_TAIL",
    "STANDALONE_TOPOLOGY",
    "UNKNOWN_TOPIC_MARK",
    "ConsumeFlag",
    "ConsumePartition",
    "ConsumePartitionResult",
    "ConsumeRequest",
    "ConsumeResponse",
    "ConsumeTopic",
    "ConsumeTopicResult",
    "CreateTopicError",
    "CreateTopicRequest",
    "CreateTopicResponse",
    "DiscoverPartitionsRequest",
    "DiscoverPartitionsResponse",
    "DiscoverTopicsRequest",
    "DiscoverTopicsResponse",
    "DiscoverTopologyRequest",
    "DiscoverTopologyResponse",
    "MsgId",
    "PartitionBounds",
    "Ping",
    "ProduceError",
    "ProducePartition",
    "ProducePartitionResult",
    "ProduceRequest",
    "ProduceResponse",
    "ProduceTopic",
    "ProduceTopicResult",
    "ProduceWithSeqnumRequest",
    "ReloadConfRequest",
    "ReloadConfResponse",
    "Request",
    "Response",
    "StatusRequest",
    "StatusResponse",
    "TopicInfo",
    "decode_request",
    "decode_response",
    "error_name",
    "response_msg_id",
    "response_request_id",
]


# ---------------------------------------------------------------- constants


class MsgId(IntEnum):
    """Frame msgId values."""

    PRODUCE = 0x01
    CONSUME = 0x02
    PING = 0x03
    OBSOLETE_REPLICA_ID = 0x04  # the broker closes a connection that sends it
    PRODUCE_WITH_SEQNUM = 0x05  # answered with a PRODUCE (0x01) response
    DISCOVER_PARTITIONS = 0x06
    CREATE_TOPIC = 0x07
    RELOAD_CONF = 0x08
    CONSUME_PEER = 0x09  # broker-to-broker replication; not implemented here
    STATUS = 0x0A
    DISCOVER_TOPICS = 0x0B
    DISCOVER_TOPOLOGY = 0x0C


class ProduceError(IntEnum):
    """Produce response error bytes."""

    OK = 0
    UNKNOWN_PARTITION = 1
    SYSTEM = 2  # I/O or system fault
    ACK_TIMEOUT = 3
    INSUFFICIENT_REPLICAS = 4
    INVALID_SEQNUM = 10  # first seq <= high-water mark
    OTHER_LEADER = 0xFC  # followed by the leader's addr:u32, port:u16
    NO_LEADER = 0xFD
    READ_ONLY = 0xFE  # topic-level: written once for the whole topic
    UNKNOWN_TOPIC = 0xFF  # topic-level: written once for the whole topic


PRODUCE_TOPIC_ERRORS = frozenset({ProduceError.READ_ONLY, ProduceError.UNKNOWN_TOPIC})
PRODUCE_PARTITION_ERRORS = frozenset(ProduceError) - PRODUCE_TOPIC_ERRORS


class ConsumeFlag(IntEnum):
    """Consume response per-partition flags; no other value may be sent."""

    OK = 0
    BOUNDARY_CHECK = 1  # seq outside [first available, hwm + 1]; carries first_avail
    SYSTEM_ERROR = 0xFB
    OTHER_LEADER = 0xFC  # carries the leader's addr:u32, port:u16
    NO_LEADER = 0xFD
    SPARSE_FIRST_BUNDLE = 0xFE  # base seq omitted: the first bundle is sparse
    UNKNOWN_PARTITION = 0xFF


_CONSUME_FLAGS = frozenset(ConsumeFlag)
_CONSUME_NOTHING_FOLLOWS = frozenset(
    {ConsumeFlag.SYSTEM_ERROR, ConsumeFlag.NO_LEADER, ConsumeFlag.UNKNOWN_PARTITION}
)


class CreateTopicError(IntEnum):
    """CreateTopic response error bytes."""

    OK = 0
    EXISTS = 1
    SYSTEM = 2
    INVALID_CONFIG = 4
    READ_ONLY = 5
    INVALID = 10  # invalid name or 0 partitions
    UNSUPPORTED = 11


_CREATE_TOPIC_ERRORS = frozenset(CreateTopicError)

#: In a consume response an unknown topic's partitions are replaced by this u16.
UNKNOWN_TOPIC_MARK = 0xFFFF
#: DiscoverTopology's answer from a standalone broker.
STANDALONE_TOPOLOGY = 0xFFFF
#: Consume from the first available message.
SEQ_FIRST_AVAILABLE = 0
#: Consume from the end (hwm + 1): the request parks until data arrives.
SEQ_TAIL = UINT64_MAX
PRODUCE_VERSION = 2
CONSUME_VERSION = 2
#: Consume requests carry an ``op_flags`` byte from this version on.
CONSUME_OP_FLAGS_MIN_VERSION = 3

_ERROR_NAMES: dict[int, dict[int, str]] = {
    MsgId.PRODUCE: {e.value: e.name for e in ProduceError},
    MsgId.CONSUME: {e.value: e.name for e in ConsumeFlag},
    MsgId.CREATE_TOPIC: {e.value: e.name for e in CreateTopicError},
}


def error_name(msg_id: int, code: int) -> str:
    """A readable name for an error or flag byte of response ``msg_id``."""
    name = _ERROR_NAMES.get(msg_id, {}).get(code)
    return name if name is not None else f"error 0x{code:02x}"


_BYTE = tuple(bytes((i,)) for i in range(256))
_VER_REQ = struct.Struct("<HI")  # version, request id
_ACKS = struct.Struct("<BI")  # acks, ack timeout
_PRODUCE_START = struct.Struct("<HIB")  # version, request id, client id length
_PRODUCE_ACKS = struct.Struct("<BIB")  # acks, ack timeout, topic count
_PRODUCE_PART = struct.Struct("<HB")  # partition id, the bundle length's first byte
_WAIT = struct.Struct("<QI")  # max wait ms, min bytes
_CONSUME_PART = struct.Struct("<HQI")  # partition, seq, fetch size
_LEADER = struct.Struct("<IH")  # addr, port
_BOUNDS = struct.Struct("<QQ")
_STATUS = struct.Struct("<IBBIIIIII")
_TOPIC_INFO = struct.Struct("<BH")


def _u8_count(n: int, what: str) -> bytes:
    if n > 255:
        raise ProtocolError(f"{n} {what} do not fit a u8 count")
    return _BYTE[n]


class _Message:
    """Frame encoding shared by every message class."""

    __slots__ = ()
    MSG_ID: ClassVar[int]

    def _payload_parts(self) -> list[bytes]:
        raise NotImplementedError

    def encode_parts(self) -> list[bytes]:
        """The frame as a list of buffers (for ``sendmsg``): header first."""
        try:
            parts = self._payload_parts()
        except struct.error as exc:
            raise ProtocolError(f"{type(self).__name__}: value out of range: {exc}") from exc
        size = 0
        for p in parts:
            size += len(p)
        return [frame_header(self.MSG_ID, size), *parts]

    def encode_payload(self) -> bytes:
        """The payload only (no frame header)."""
        return b"".join(self.encode_parts()[1:])

    def encode(self) -> bytes:
        """The complete frame: ``msgId:u8, length:u32, payload``."""
        return b"".join(self.encode_parts())


# ---------------------------------------------------------------- ping


@dataclass(slots=True)
class Ping(_Message):
    """Ping (0x3), no payload: the broker's greeting and heartbeat."""

    MSG_ID: ClassVar[int] = MsgId.PING

    def _payload_parts(self) -> list[bytes]:
        return []

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        if payload:
            raise ProtocolError(f"ping with a {len(payload)}-byte payload")
        return cls()


# ---------------------------------------------------------------- produce


@dataclass(slots=True)
class ProducePartition:
    """One partition's bundle in a produce request (``first_seq``: 0x5 only)."""

    partition: int
    bundle: bytes | memoryview  # a view of the request's payload when it was received in place
    first_seq: int | None = None


@dataclass(slots=True)
class ProduceTopic:
    name: str
    partitions: list[ProducePartition] = field(default_factory=list)


@dataclass(slots=True)
class ProduceRequest(_Message):
    """Produce (0x1): bundles for (topic, partition)s.  Answered by :class:`ProduceResponse`."""

    MSG_ID: ClassVar[int] = MsgId.PRODUCE
    WITH_SEQNUM: ClassVar[bool] = False

    req_id: int
    topics: list[ProduceTopic] = field(default_factory=list)
    client_id: str = ""
    acks: int = 0
    ack_timeout: int = 0
    version: int = PRODUCE_VERSION

    def partition_counts(self) -> list[int]:
        """Partitions per topic, in order: what decoding the response needs."""
        return [len(t.partitions) for t in self.topics]

    def _payload_parts(self) -> list[bytes]:
        with_seq = self.WITH_SEQNUM
        parts = [
            _VER_REQ.pack(self.version, self.req_id),
            encode_str8(self.client_id),
            _ACKS.pack(self.acks, self.ack_timeout),
            _u8_count(len(self.topics), "topics"),
        ]
        app = parts.append
        for t in self.topics:
            app(encode_str8(t.name))
            app(_u8_count(len(t.partitions), "partitions"))
            for p in t.partitions:
                app(U16.pack(p.partition))
                app(encode_varint(len(p.bundle)))
                if with_seq:
                    if p.first_seq is None:
                        raise ProtocolError("ProduceWithSeqnum needs first_seq for every partition")
                    app(U64.pack(p.first_seq))
                elif p.first_seq is not None:
                    raise ProtocolError("first_seq needs a ProduceWithSeqnumRequest (0x5)")
                app(bytes(p.bundle))
        return parts

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> Self:
        # Every produce is decoded on the gateway's hot path: the common request (whole,
        # well formed) by plain unpacking first; anything it cannot take is decoded again
        # by the checked reader below, which raises what is wrong.
        try:
            return cls._decode_plain(payload)
        except (IndexError, ValueError, struct.error, ProtocolError):  # (UnicodeDecodeError: a ValueError)
            pass
        return cls._decode_checked(payload)

    @classmethod
    def _decode_plain(cls, payload: bytes | memoryview) -> Self:
        with_seq = cls.WITH_SEQNUM
        end = len(payload)
        version, req_id, n = _PRODUCE_START.unpack_from(payload, 0)
        pos = 7 + n
        client_id = bytes(payload[7:pos]).decode()
        acks, ack_timeout, topic_count = _PRODUCE_ACKS.unpack_from(payload, pos)
        pos += 6
        topics = []
        for _ in range(topic_count):
            n = payload[pos]
            name = bytes(payload[pos + 1 : pos + 1 + n]).decode()
            pos += 1 + n
            partitions = []
            count = payload[pos]
            pos += 1
            for _ in range(count):
                pid, size = _PRODUCE_PART.unpack_from(payload, pos)
                pos += 3
                if size & 0x80:  # a varint of more than one byte
                    size, pos = decode_varint(payload, pos - 1, end)
                first_seq = None
                if with_seq:
                    first_seq = U64.unpack_from(payload, pos)[0]
                    pos += 8
                if pos + size > end:
                    raise ValueError("truncated bundle")
                partitions.append(ProducePartition(pid, payload[pos : pos + size], first_seq))
                pos += size
            topics.append(ProduceTopic(name, partitions))
        if pos != end:
            raise ValueError("trailing bytes")
        return cls(req_id, topics, client_id, acks, ack_timeout, version)

    @classmethod
    def _decode_checked(cls, payload: bytes | memoryview) -> Self:
        with_seq = cls.WITH_SEQNUM
        r = Reader(payload)
        version = r.u16("version")
        req_id = r.u32("request id")
        client_id = r.str8("client id")
        acks = r.u8("acks")
        ack_timeout = r.u32("ack timeout")
        topics = []
        for _ in range(r.u8("topic count")):
            name = r.str8("topic name")
            partitions = []
            for _ in range(r.u8("partition count")):
                pid = r.u16("partition id")
                size = r.varint("bundle length")
                first_seq = r.u64("first seq") if with_seq else None
                partitions.append(ProducePartition(pid, r.view(size, "bundle"), first_seq))
            topics.append(ProduceTopic(name, partitions))
        r.expect_end("produce request")
        return cls(req_id, topics, client_id, acks, ack_timeout, version)


@dataclass(slots=True)
class ProduceWithSeqnumRequest(ProduceRequest):
    """ProduceWithSeqnum (0x5): like Produce, each bundle preceded by its first seq."""

    MSG_ID: ClassVar[int] = MsgId.PRODUCE_WITH_SEQNUM
    WITH_SEQNUM: ClassVar[bool] = True


@dataclass(slots=True)
class ProducePartitionResult:
    """One partition's error byte; ``leader`` = (addr, port) for OTHER_LEADER."""

    error: int = ProduceError.OK
    leader: tuple[int, int] | None = None


@dataclass(slots=True)
class ProduceTopicResult:
    """One requested topic's results.

    A topic-level ``error`` (UNKNOWN_TOPIC or READ_ONLY) is written once and
    stands for all the topic's partitions; ``partitions`` is then empty.
    """

    partitions: list[ProducePartitionResult] = field(default_factory=list)
    error: int | None = None


@dataclass(slots=True)
class ProduceResponse(_Message):
    """Produce response (0x1, for 0x1 and 0x5 requests).

    It does not name topics or partitions: results follow the request's
    order, so decoding needs the request's ``partition_counts()``.
    """

    MSG_ID: ClassVar[int] = MsgId.PRODUCE

    req_id: int
    topics: list[ProduceTopicResult] = field(default_factory=list)

    def _payload_parts(self) -> list[bytes]:
        parts = [U32.pack(self.req_id)]
        app = parts.append
        for t in self.topics:
            if t.error is not None:
                if t.error not in PRODUCE_TOPIC_ERRORS:
                    raise ProtocolError(f"0x{t.error:02x} is not a topic-level produce error")
                app(_BYTE[t.error])
                continue
            for p in t.partitions:
                if p.error not in PRODUCE_PARTITION_ERRORS:
                    raise ProtocolError(f"0x{p.error:02x} is not a partition produce error")
                app(_BYTE[p.error])
                if p.error == ProduceError.OTHER_LEADER:
                    if p.leader is None:
                        raise ProtocolError("OTHER_LEADER needs the leader's (addr, port)")
                    app(_LEADER.pack(*p.leader))
        return parts

    @classmethod
    def decode(cls, payload: bytes, partition_counts: Sequence[int]) -> Self:
        r = Reader(payload)
        req_id = r.u32("request id")
        topics = []
        for count in partition_counts:
            if not count:  # the broker writes nothing for a topic with no partitions
                topics.append(ProduceTopicResult())
                continue
            code = r.u8("error")
            if code in PRODUCE_TOPIC_ERRORS:
                topics.append(ProduceTopicResult([], code))
                continue
            results = []
            for i in range(count):
                if i:
                    code = r.u8("error")
                leader = None
                if code == ProduceError.OTHER_LEADER:
                    leader = (r.u32("leader address"), r.u16("leader port"))
                results.append(ProducePartitionResult(code, leader))
            topics.append(ProduceTopicResult(results))
        r.expect_end("produce response")
        return cls(req_id, topics)

    def per_partition(
        self, request: ProduceRequest
    ) -> list[tuple[str, int, int, tuple[int, int] | None]]:
        """``(topic, partition, error, leader)`` for every partition of ``request``."""
        out = []
        for treq, tres in zip(request.topics, self.topics, strict=True):
            if tres.error is not None:
                out.extend((treq.name, p.partition, tres.error, None) for p in treq.partitions)
            else:
                for preq, pres in zip(treq.partitions, tres.partitions, strict=True):
                    out.append((treq.name, preq.partition, pres.error, pres.leader))
        return out


# ---------------------------------------------------------------- consume


@dataclass(slots=True)
class ConsumePartition:
    partition: int
    seq: int
    fetch_size: int


@dataclass(slots=True)
class ConsumeTopic:
    name: str
    partitions: list[ConsumePartition] = field(default_factory=list)


@dataclass(slots=True)
class ConsumeRequest(_Message):
    """Consume (0x2).  ``op_flags`` exists on the wire only when version >= 3."""

    MSG_ID: ClassVar[int] = MsgId.CONSUME

    req_id: int
    topics: list[ConsumeTopic] = field(default_factory=list)
    client_id: str = ""
    max_wait_ms: int = 0
    min_bytes: int = 0
    version: int = CONSUME_VERSION
    op_flags: int = 0

    def _payload_parts(self) -> list[bytes]:
        parts = [
            _VER_REQ.pack(self.version, self.req_id),
            encode_str8(self.client_id),
            _WAIT.pack(self.max_wait_ms, self.min_bytes),
        ]
        if self.version >= CONSUME_OP_FLAGS_MIN_VERSION:
            parts.append(U8.pack(self.op_flags))
        elif self.op_flags:
            raise ProtocolError("op_flags need a consume request version >= 3")
        parts.append(_u8_count(len(self.topics), "topics"))
        app = parts.append
        pack = _CONSUME_PART.pack
        for t in self.topics:
            app(encode_str8(t.name))
            app(_u8_count(len(t.partitions), "partitions"))
            for p in t.partitions:
                app(pack(p.partition, p.seq, p.fetch_size))
        return parts

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        version = r.u16("version")
        req_id = r.u32("request id")
        client_id = r.str8("client id")
        max_wait_ms = r.u64("max wait")
        min_bytes = r.u32("min bytes")
        op_flags = r.u8("op flags") if version >= CONSUME_OP_FLAGS_MIN_VERSION else 0
        topics = []
        for _ in range(r.u8("topic count")):
            name = r.str8("topic name")
            partitions = [
                ConsumePartition(r.u16("partition id"), r.u64("seq"), r.u32("fetch size"))
                for _ in range(r.u8("partition count"))
            ]
            topics.append(ConsumeTopic(name, partitions))
        r.expect_end("consume request")
        return cls(req_id, topics, client_id, max_wait_ms, min_bytes, version, op_flags)


@dataclass(slots=True)
class ConsumePartitionResult:
    """One partition of a consume response.

    By ``flags``: OK -> base_seq, hwm, chunk; BOUNDARY_CHECK -> base_seq (0),
    hwm, chunk (empty), first_avail; SPARSE_FIRST_BUNDLE -> hwm, chunk (the
    base is in the first bundle); OTHER_LEADER -> leader (addr, port);
    SYSTEM_ERROR, NO_LEADER, UNKNOWN_PARTITION -> nothing.
    """

    partition: int
    flags: int = ConsumeFlag.OK
    base_seq: int | None = None
    hwm: int | None = None
    chunk: bytes = b""
    first_avail: int | None = None
    leader: tuple[int, int] | None = None

    def decode_chunk(self, min_seq: int = 0) -> ChunkResult:
        """The chunk's messages with absolute seqs (see :func:`bundle.decode_chunk`)."""
        return decode_chunk(self.chunk, self.base_seq, min_seq)


@dataclass(slots=True)
class ConsumeTopicResult:
    """One topic of a consume response.

    An unknown topic has ``unknown`` set and no partitions; the broker still
    writes the requested partition count, kept in ``requested_partitions``.
    """

    name: str
    partitions: list[ConsumePartitionResult] = field(default_factory=list)
    unknown: bool = False
    requested_partitions: int = 0


_HDR_LEN = struct.Struct("<I")
_TOPIC_UNKNOWN = U16.pack(UNKNOWN_TOPIC_MARK)


@dataclass(slots=True)
class ConsumeResponse(_Message):
    """Consume response (0x2): ``hdr_len:u32``, header, then every chunk in header order."""

    MSG_ID: ClassVar[int] = MsgId.CONSUME

    req_id: int
    topics: list[ConsumeTopicResult] = field(default_factory=list)

    def _payload_parts(self) -> list[bytes]:
        hdr = [U32.pack(self.req_id), _u8_count(len(self.topics), "topics")]
        app = hdr.append
        chunks: list[bytes] = []
        for t in self.topics:
            app(encode_str8(t.name))
            if t.unknown:
                app(_u8_count(t.requested_partitions, "partitions"))
                app(_TOPIC_UNKNOWN)
                continue
            app(_u8_count(len(t.partitions), "partitions"))
            for p in t.partitions:
                flags = p.flags
                if flags not in _CONSUME_FLAGS:
                    raise ProtocolError(f"consume flags 0x{flags:02x} would abort Tank clients")
                if p.partition == UNKNOWN_TOPIC_MARK:
                    raise ProtocolError("partition id 0xffff marks an unknown topic")
                app(U16.pack(p.partition) + _BYTE[flags])
                if flags in _CONSUME_NOTHING_FOLLOWS:
                    continue
                if flags == ConsumeFlag.OTHER_LEADER:
                    if p.leader is None:
                        raise ProtocolError("OTHER_LEADER needs the leader's (addr, port)")
                    app(_LEADER.pack(*p.leader))
                    continue
                if flags != ConsumeFlag.SPARSE_FIRST_BUNDLE:
                    app(U64.pack(p.base_seq))
                app(U64.pack(p.hwm) + U32.pack(len(p.chunk)))
                if flags == ConsumeFlag.BOUNDARY_CHECK:
                    if p.first_avail is None:
                        raise ProtocolError("BOUNDARY_CHECK needs first_avail")
                    app(U64.pack(p.first_avail))
                if p.chunk:
                    chunks.append(p.chunk)
        size = 0
        for h in hdr:
            size += len(h)
        return [_HDR_LEN.pack(size), *hdr, *chunks]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        if type(payload) is not bytes:
            payload = bytes(payload)  # chunks are sliced out as bytes
        total = len(payload)
        r = Reader(payload)
        hdr_end = r.u32("header length") + 4
        if hdr_end > total:
            raise ProtocolError("consume response header runs past the payload")
        h = Reader(payload, 4, hdr_end)
        req_id = h.u32("request id")
        topics = []
        with_chunk: list[tuple[ConsumePartitionResult, int]] = []
        for _ in range(h.u8("topic count")):
            name = h.str8("topic name")
            count = h.u8("partition count")
            if h.peek_u16() == UNKNOWN_TOPIC_MARK:
                h.pos += 2
                topics.append(ConsumeTopicResult(name, [], True, count))
                continue
            partitions = []
            for _ in range(count):
                res = ConsumePartitionResult(h.u16("partition id"), h.u8("partition flags"))
                flags = res.flags
                if flags in _CONSUME_NOTHING_FOLLOWS:
                    pass
                elif flags == ConsumeFlag.OTHER_LEADER:
                    res.leader = (h.u32("leader address"), h.u16("leader port"))
                elif flags in _CONSUME_FLAGS:
                    if flags != ConsumeFlag.SPARSE_FIRST_BUNDLE:
                        res.base_seq = h.u64("base seq")
                    res.hwm = h.u64("high-water mark")
                    size = h.u32("chunk length")
                    if flags == ConsumeFlag.BOUNDARY_CHECK:
                        res.first_avail = h.u64("first available seq")
                    if size:
                        with_chunk.append((res, size))
                else:
                    raise ProtocolError(f"undefined consume partition flags 0x{flags:02x}")
                partitions.append(res)
            topics.append(ConsumeTopicResult(name, partitions))
        h.expect_end("consume response header")
        pos = hdr_end
        for res, size in with_chunk:
            stop = pos + size
            if stop > total:
                raise ProtocolError("consume response chunk runs past the payload")
            res.chunk = payload[pos:stop]
            pos = stop
        if pos != total:
            raise ProtocolError(f"{total - pos} trailing bytes after the consume chunks")
        return cls(req_id, topics)


# ---------------------------------------------------------------- discovery and admin


class PartitionBounds(NamedTuple):
    """A partition's first available seq and high-water mark (0/0 when empty)."""

    first_avail: int
    hwm: int


class TopicInfo(NamedTuple):
    name: str
    enabled: bool
    partitions: int


def _req_id_only(payload: bytes, what: str) -> int:
    r = Reader(payload)
    req_id = r.u32("request id")
    r.expect_end(what)
    return req_id


@dataclass(slots=True)
class DiscoverPartitionsRequest(_Message):
    """DiscoverPartitions (0x6): ``partitions`` empty means all of them."""

    MSG_ID: ClassVar[int] = MsgId.DISCOVER_PARTITIONS

    req_id: int
    topic: str
    partitions: list[int] = field(default_factory=list)

    def _payload_parts(self) -> list[bytes]:
        pids = struct.pack(f"<{len(self.partitions)}H", *self.partitions)
        return [U32.pack(self.req_id), encode_str8(self.topic), pids]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        req_id = r.u32("request id")
        topic = r.str8("topic")
        if r.remaining() % 2:
            raise ProtocolError("odd number of bytes in the partition id list")
        if r.remaining() // 2 > 0xFFFF:
            # The answer counts partitions in a u16: more could never be answered.
            raise ProtocolError(f"{r.remaining() // 2} partition ids, more than 65535")
        pids = [r.u16() for _ in range(r.remaining() // 2)]
        return cls(req_id, topic, pids)


@dataclass(slots=True)
class DiscoverPartitionsResponse(_Message):
    """DiscoverPartitions response: bounds in partition (or requested) order; none = unknown topic."""

    MSG_ID: ClassVar[int] = MsgId.DISCOVER_PARTITIONS

    req_id: int
    topic: str
    partitions: list[PartitionBounds] = field(default_factory=list)

    @property
    def unknown_topic(self) -> bool:
        return not self.partitions

    def _payload_parts(self) -> list[bytes]:
        parts = [U32.pack(self.req_id), encode_str8(self.topic), U16.pack(len(self.partitions))]
        parts.extend(_BOUNDS.pack(*b) for b in self.partitions)
        return parts

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        req_id = r.u32("request id")
        topic = r.str8("topic")
        count = r.u16("partition count")
        if r.remaining() != count * 16:
            raise ProtocolError(f"{count} partitions need {count * 16} bytes, got {r.remaining()}")
        bounds = [PartitionBounds(r.u64(), r.u64()) for _ in range(count)]
        return cls(req_id, topic, bounds)


@dataclass(slots=True)
class CreateTopicRequest(_Message):
    """CreateTopic (0x7); ``config`` is ``k=v`` lines."""

    MSG_ID: ClassVar[int] = MsgId.CREATE_TOPIC

    req_id: int
    topic: str
    partitions: int
    config: str = ""

    def _payload_parts(self) -> list[bytes]:
        cfg = self.config.encode()
        return [
            U32.pack(self.req_id),
            encode_str8(self.topic),
            U16.pack(self.partitions),
            encode_varint(len(cfg)),
            cfg,
        ]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        req_id = r.u32("request id")
        topic = r.str8("topic")
        partitions = r.u16("partition count")
        size = r.varint("config length")
        raw = r.raw(size, "config")
        r.expect_end("create topic request")
        try:
            config = raw.decode()
        except UnicodeDecodeError as exc:
            raise ProtocolError("topic config is not UTF-8") from exc
        return cls(req_id, topic, partitions, config)


@dataclass(slots=True)
class CreateTopicResponse(_Message):
    MSG_ID: ClassVar[int] = MsgId.CREATE_TOPIC

    req_id: int
    topic: str
    error: int = CreateTopicError.OK

    def _payload_parts(self) -> list[bytes]:
        if self.error not in _CREATE_TOPIC_ERRORS:
            raise ProtocolError(f"0x{self.error:02x} is not a CreateTopic error code")
        return [U32.pack(self.req_id), encode_str8(self.topic), U8.pack(self.error)]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        res = cls(r.u32("request id"), r.str8("topic"), r.u8("error"))
        r.expect_end("create topic response")
        return res


@dataclass(slots=True)
class ReloadConfRequest(_Message):
    """ReloadConf (0x8) of one partition."""

    MSG_ID: ClassVar[int] = MsgId.RELOAD_CONF

    req_id: int
    topic: str
    partition: int

    def _payload_parts(self) -> list[bytes]:
        return [U32.pack(self.req_id), encode_str8(self.topic), U16.pack(self.partition)]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        res = cls(r.u32("request id"), r.str8("topic"), r.u16("partition"))
        r.expect_end("reload conf request")
        return res


@dataclass(slots=True)
class ReloadConfResponse(_Message):
    """ReloadConf response; ``error`` 0 is success (other codes are not documented)."""

    MSG_ID: ClassVar[int] = MsgId.RELOAD_CONF

    req_id: int
    topic: str
    partition: int
    error: int = 0

    def _payload_parts(self) -> list[bytes]:
        return [
            U32.pack(self.req_id),
            encode_str8(self.topic),
            U16.pack(self.partition),
            U8.pack(self.error),
        ]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        res = cls(r.u32("request id"), r.str8("topic"), r.u16("partition"), r.u8("error"))
        r.expect_end("reload conf response")
        return res


@dataclass(slots=True)
class StatusRequest(_Message):
    MSG_ID: ClassVar[int] = MsgId.STATUS

    req_id: int

    def _payload_parts(self) -> list[bytes]:
        return [U32.pack(self.req_id)]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        return cls(_req_id_only(payload, "status request"))


@dataclass(slots=True)
class StatusResponse(_Message):
    """Status response of a standalone broker (``version`` 400 = v4.0)."""

    MSG_ID: ClassVar[int] = MsgId.STATUS

    req_id: int
    flags: int = 0
    cluster_aware: bool = False
    topics: int = 0
    partitions: int = 0
    open_partitions: int = 0
    open_time: int = 0
    startup_ts: int = 0
    version: int = 0

    def _payload_parts(self) -> list[bytes]:
        return [
            _STATUS.pack(
                self.req_id,
                self.flags,
                int(self.cluster_aware),
                self.topics,
                self.partitions,
                self.open_partitions,
                self.open_time,
                self.startup_ts,
                self.version,
            )
        ]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        if len(payload) != _STATUS.size:
            raise ProtocolError(f"status response is {len(payload)} bytes, not {_STATUS.size}")
        v = _STATUS.unpack(payload)
        return cls(v[0], v[1], bool(v[2]), *v[3:])


@dataclass(slots=True)
class _FlagsRequest(_Message):
    """A request of just ``req_id:u32, flags:u8`` (DiscoverTopics, DiscoverTopology)."""

    req_id: int
    flags: int = 0

    def _payload_parts(self) -> list[bytes]:
        return [U32.pack(self.req_id), U8.pack(self.flags)]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        res = cls(r.u32("request id"), r.u8("flags"))
        r.expect_end(cls.__name__)
        return res


@dataclass(slots=True)
class DiscoverTopicsRequest(_FlagsRequest):
    MSG_ID: ClassVar[int] = MsgId.DISCOVER_TOPICS


@dataclass(slots=True)
class DiscoverTopicsResponse(_Message):
    MSG_ID: ClassVar[int] = MsgId.DISCOVER_TOPICS

    req_id: int
    topics: list[TopicInfo] = field(default_factory=list)
    cluster_aware: bool = False

    def _payload_parts(self) -> list[bytes]:
        parts = [U32.pack(self.req_id), U32.pack(len(self.topics)), U8.pack(self.cluster_aware)]
        for t in self.topics:
            parts.append(encode_str8(t.name))
            parts.append(_TOPIC_INFO.pack(int(t.enabled), t.partitions))
        return parts

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        req_id = r.u32("request id")
        count = r.u32("topic count")
        cluster_aware = bool(r.u8("cluster aware"))
        # Each topic takes at least 4 bytes: bound the loop before trusting count.
        if count * 4 > r.remaining():
            raise ProtocolError(f"{count} topics cannot fit in {r.remaining()} bytes")
        topics = [
            TopicInfo(r.str8("topic name"), bool(r.u8("enabled")), r.u16("partitions"))
            for _ in range(count)
        ]
        r.expect_end("discover topics response")
        return cls(req_id, topics, cluster_aware)


@dataclass(slots=True)
class DiscoverTopologyRequest(_FlagsRequest):
    MSG_ID: ClassVar[int] = MsgId.DISCOVER_TOPOLOGY


@dataclass(slots=True)
class DiscoverTopologyResponse(_Message):
    """DiscoverTopology response: ``cluster`` None for a standalone broker (``0xFFFF``).

    The cluster layout is undocumented, so a cluster's answer is kept as the
    opaque bytes after the request id.
    """

    MSG_ID: ClassVar[int] = MsgId.DISCOVER_TOPOLOGY

    req_id: int
    cluster: bytes | None = None

    @property
    def standalone(self) -> bool:
        return self.cluster is None

    def _payload_parts(self) -> list[bytes]:
        if self.cluster is None:
            return [U32.pack(self.req_id), U16.pack(STANDALONE_TOPOLOGY)]
        if len(self.cluster) < 2 or U16.unpack_from(self.cluster)[0] == STANDALONE_TOPOLOGY:
            raise ProtocolError("cluster topology bytes must not look standalone")
        return [U32.pack(self.req_id), bytes(self.cluster)]

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        r = Reader(payload)
        req_id = r.u32("request id")
        mark = r.peek_u16()
        if mark is None:
            raise ProtocolError("truncated topology")
        if mark == STANDALONE_TOPOLOGY:
            r.pos += 2
            r.expect_end("standalone topology")
            return cls(req_id)
        return cls(req_id, r.rest())


# ---------------------------------------------------------------- dispatch

Request = (
    ProduceRequest
    | ProduceWithSeqnumRequest
    | ConsumeRequest
    | Ping
    | DiscoverPartitionsRequest
    | CreateTopicRequest
    | ReloadConfRequest
    | StatusRequest
    | DiscoverTopicsRequest
    | DiscoverTopologyRequest
)
Response = (
    ProduceResponse
    | ConsumeResponse
    | Ping
    | DiscoverPartitionsResponse
    | CreateTopicResponse
    | ReloadConfResponse
    | StatusResponse
    | DiscoverTopicsResponse
    | DiscoverTopologyResponse
)

REQUEST_TYPES: dict[int, type] = {
    cls.MSG_ID: cls
    for cls in (
        ProduceRequest,
        ProduceWithSeqnumRequest,
        ConsumeRequest,
        Ping,
        DiscoverPartitionsRequest,
        CreateTopicRequest,
        ReloadConfRequest,
        StatusRequest,
        DiscoverTopicsRequest,
        DiscoverTopologyRequest,
    )
}
RESPONSE_TYPES: dict[int, type] = {
    cls.MSG_ID: cls
    for cls in (
        ProduceResponse,
        ConsumeResponse,
        Ping,
        DiscoverPartitionsResponse,
        CreateTopicResponse,
        ReloadConfResponse,
        StatusResponse,
        DiscoverTopicsResponse,
        DiscoverTopologyResponse,
    )
}


def decode_request(msg_id: int, payload: bytes | memoryview) -> Request:
    """Server side: decode a request frame's payload by its msgId.

    Unknown, obsolete (0x4) and broker-only (0x9) ids raise ProtocolError:
    the broker closes such connections without a reply.
    """
    cls = REQUEST_TYPES.get(msg_id)
    if cls is None:
        raise ProtocolError(f"unsupported request msgId 0x{msg_id:02x}")
    return cls.decode(payload)


def response_msg_id(request: Request) -> int | None:
    """The msgId that answers ``request`` (None: Ping gets no answer)."""
    if isinstance(request, Ping):
        return None
    if isinstance(request, ProduceRequest):
        return MsgId.PRODUCE
    return request.MSG_ID


def decode_response(msg_id: int, payload: bytes, request: Request | None = None) -> Response:
    """Client side: decode a response frame's payload by its msgId.

    A produce response (0x1) is only meaningful against its request, which
    must then be passed.
    """
    if msg_id == MsgId.PRODUCE:
        if not isinstance(request, ProduceRequest):
            raise TypeError("decoding a produce response needs its ProduceRequest")
        return ProduceResponse.decode(payload, request.partition_counts())
    cls = RESPONSE_TYPES.get(msg_id)
    if cls is None:
        raise ProtocolError(f"unknown response msgId 0x{msg_id:02x}")
    return cls.decode(payload)


def response_request_id(msg_id: int, payload: bytes) -> int | None:
    """The request id a response frame answers, without decoding the rest.

    None for Ping.  Every response starts with the request id, except the
    consume response where it follows ``hdr_len:u32``.
    """
    if msg_id == MsgId.PING:
        return None
    if msg_id not in RESPONSE_TYPES:
        raise ProtocolError(f"unknown response msgId 0x{msg_id:02x}")
    offset = 4 if msg_id == MsgId.CONSUME else 0
    if len(payload) < offset + 4:
        raise ProtocolError("response too short for a request id")
    return U32.unpack_from(payload, offset)[0]
