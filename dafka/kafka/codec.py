"""Kafka wire glue, sans-IO: frames, request headers, and the message codec.

Message bodies are encoded and decoded by kafka-python's protocol module
(``kafka.protocol``), which is generated from Kafka's own JSON message
schemas and covers every version of every API we serve, down to version 0
(see the README for why it was chosen over ``kio``).  This module only adds
what a server needs around it: size-prefixed frames read with bounds, request
headers, the table of versions we serve, and error codes.

A frame is ``size:i32 payload``; a request payload starts with the header
``api_key:i16 api_version:i16 correlation_id:i32 client_id:nullable string``
(plus tagged fields for flexible versions).  A response has the v0 header,
``correlation_id:i32``, or for a flexible version the v1 header (the same
plus an empty tagged-field section), ApiVersions aside, whose response
header is v0 at every version (KIP-511).  Every request is served up to a
flexible version where current clients ask for one (Produce v9-v10, Fetch
v12, whose answer is written here, not by the generic encoder: see
docs/tutorials/kafka.md for the versions clients negotiate).

Tagged-field sections of requests are read by :func:`decode_tags` (unknown
tags skipped, every size checked against the request, at most
:data:`MAX_TAGS` per section) in place of kafka-python's own, which copied
the rest of the request for each section (quadratic) and took short reads.
"""

from __future__ import annotations

import io
import struct
from types import SimpleNamespace
from typing import Any, NamedTuple

from kafka.protocol.admin import (
    AlterConfigsRequest,
    AlterConfigsResponse,
    CreatePartitionsRequest,
    CreatePartitionsResponse,
    CreateTopicsRequest,
    CreateTopicsResponse,
    DeleteGroupsRequest,
    DeleteGroupsResponse,
    DeleteRecordsRequest,
    DeleteRecordsResponse,
    DeleteTopicsRequest,
    DeleteTopicsResponse,
    DescribeClusterRequest,
    DescribeClusterResponse,
    DescribeConfigsRequest,
    DescribeConfigsResponse,
    DescribeGroupsRequest,
    DescribeGroupsResponse,
    DescribeProducersRequest,
    DescribeProducersResponse,
    DescribeTransactionsRequest,
    DescribeTransactionsResponse,
    IncrementalAlterConfigsRequest,
    IncrementalAlterConfigsResponse,
    ListGroupsRequest,
    ListGroupsResponse,
    ListTransactionsRequest,
    ListTransactionsResponse,
)
from kafka.protocol.consumer import (
    FetchRequest,
    FetchResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinGroupRequest,
    JoinGroupResponse,
    LeaveGroupRequest,
    LeaveGroupResponse,
    ListOffsetsRequest,
    ListOffsetsResponse,
    OffsetCommitRequest,
    OffsetCommitResponse,
    OffsetDeleteRequest,
    OffsetDeleteResponse,
    OffsetFetchRequest,
    OffsetFetchResponse,
    SyncGroupRequest,
    SyncGroupResponse,
)
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    ApiVersionsResponse,
    FindCoordinatorRequest,
    FindCoordinatorResponse,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer import (
    AddOffsetsToTxnRequest,
    AddOffsetsToTxnResponse,
    AddPartitionsToTxnRequest,
    AddPartitionsToTxnResponse,
    EndTxnRequest,
    EndTxnResponse,
    InitProducerIdRequest,
    InitProducerIdResponse,
    ProduceRequest,
    ProduceResponse,
    TxnOffsetCommitRequest,
    TxnOffsetCommitResponse,
)
from kafka.protocol.schemas.fields.struct import StructField as _StructField

from dafka.errors import ProtocolError
from dafka.tank.codec import encode_varint

__all__ = [
    "API",
    "encode_produce_response",
    "DEFAULT_MAX_FRAME",
    "ApiSpec",
    "Err",
    "FrameReader",
    "RequestHeader",
    "decode_request",
    "encode_fetch_response",
    "encode_response",
    "N",
]

#: Nested response items: any object with the right attributes encodes.
N = SimpleNamespace

#: Requests larger than this close the connection (Kafka's socket.request.max.bytes).
DEFAULT_MAX_FRAME = 100 << 20

_I32 = struct.Struct(">i")
_HEADER = struct.Struct(">hhi")


class Err:
    """Kafka error codes used by the gateway."""

    NONE = 0
    OFFSET_OUT_OF_RANGE = 1
    CORRUPT_MESSAGE = 2
    UNKNOWN_TOPIC_OR_PARTITION = 3
    LEADER_NOT_AVAILABLE = 5
    NOT_LEADER_OR_FOLLOWER = 6
    REQUEST_TIMED_OUT = 7
    MESSAGE_TOO_LARGE = 10
    COORDINATOR_NOT_AVAILABLE = 15
    NOT_COORDINATOR = 16
    INVALID_TOPIC_EXCEPTION = 17
    INVALID_REQUIRED_ACKS = 21
    ILLEGAL_GENERATION = 22
    INCONSISTENT_GROUP_PROTOCOL = 23
    INVALID_GROUP_ID = 24
    UNKNOWN_MEMBER_ID = 25
    INVALID_SESSION_TIMEOUT = 26
    REBALANCE_IN_PROGRESS = 27
    TOPIC_AUTHORIZATION_FAILED = 29
    UNSUPPORTED_VERSION = 35
    TOPIC_ALREADY_EXISTS = 36
    INVALID_PARTITIONS = 37
    INVALID_CONFIG = 40
    NOT_CONTROLLER = 41
    INVALID_REQUEST = 42
    POLICY_VIOLATION = 44
    OUT_OF_ORDER_SEQUENCE_NUMBER = 45
    DUPLICATE_SEQUENCE_NUMBER = 46
    INVALID_PRODUCER_EPOCH = 47
    INVALID_TXN_STATE = 48
    INVALID_PRODUCER_ID_MAPPING = 49
    INVALID_TRANSACTION_TIMEOUT = 50
    CONCURRENT_TRANSACTIONS = 51
    OPERATION_NOT_ATTEMPTED = 55
    KAFKA_STORAGE_ERROR = 56
    UNKNOWN_PRODUCER_ID = 59
    GROUP_ID_NOT_FOUND = 69
    NON_EMPTY_GROUP = 68
    TOPIC_DELETION_DISABLED = 73
    MEMBER_ID_REQUIRED = 79
    GROUP_SUBSCRIBED_TO_TOPIC = 86
    INVALID_RECORD = 87
    THROTTLING_QUOTA_EXCEEDED = 89
    PRODUCER_FENCED = 90


class ApiSpec(NamedTuple):
    key: int
    min_version: int
    max_version: int
    request: Any
    response: Any


#: What the gateway serves, and what ApiVersions advertises (nothing else).
API: dict[int, ApiSpec] = {
    s.key: s
    for s in (
        ApiSpec(0, 0, 10, ProduceRequest, ProduceResponse),
        ApiSpec(1, 4, 12, FetchRequest, FetchResponse),
        ApiSpec(2, 0, 7, ListOffsetsRequest, ListOffsetsResponse),
        ApiSpec(3, 0, 9, MetadataRequest, MetadataResponse),
        ApiSpec(8, 2, 8, OffsetCommitRequest, OffsetCommitResponse),
        ApiSpec(9, 1, 8, OffsetFetchRequest, OffsetFetchResponse),
        ApiSpec(10, 0, 4, FindCoordinatorRequest, FindCoordinatorResponse),
        ApiSpec(11, 0, 7, JoinGroupRequest, JoinGroupResponse),
        ApiSpec(12, 0, 4, HeartbeatRequest, HeartbeatResponse),
        ApiSpec(13, 0, 5, LeaveGroupRequest, LeaveGroupResponse),
        ApiSpec(14, 0, 5, SyncGroupRequest, SyncGroupResponse),
        ApiSpec(18, 0, 3, ApiVersionsRequest, ApiVersionsResponse),
        ApiSpec(15, 0, 5, DescribeGroupsRequest, DescribeGroupsResponse),
        ApiSpec(16, 0, 5, ListGroupsRequest, ListGroupsResponse),
        ApiSpec(19, 0, 6, CreateTopicsRequest, CreateTopicsResponse),
        ApiSpec(20, 0, 5, DeleteTopicsRequest, DeleteTopicsResponse),
        ApiSpec(21, 0, 2, DeleteRecordsRequest, DeleteRecordsResponse),
        ApiSpec(22, 0, 4, InitProducerIdRequest, InitProducerIdResponse),
        ApiSpec(24, 0, 3, AddPartitionsToTxnRequest, AddPartitionsToTxnResponse),
        ApiSpec(25, 0, 3, AddOffsetsToTxnRequest, AddOffsetsToTxnResponse),
        ApiSpec(26, 0, 3, EndTxnRequest, EndTxnResponse),
        ApiSpec(28, 0, 3, TxnOffsetCommitRequest, TxnOffsetCommitResponse),
        ApiSpec(32, 0, 4, DescribeConfigsRequest, DescribeConfigsResponse),
        ApiSpec(33, 0, 2, AlterConfigsRequest, AlterConfigsResponse),
        ApiSpec(37, 0, 3, CreatePartitionsRequest, CreatePartitionsResponse),
        ApiSpec(42, 0, 2, DeleteGroupsRequest, DeleteGroupsResponse),
        ApiSpec(44, 0, 1, IncrementalAlterConfigsRequest, IncrementalAlterConfigsResponse),
        ApiSpec(47, 0, 0, OffsetDeleteRequest, OffsetDeleteResponse),
        ApiSpec(60, 0, 1, DescribeClusterRequest, DescribeClusterResponse),
        ApiSpec(61, 0, 0, DescribeProducersRequest, DescribeProducersResponse),
        ApiSpec(65, 0, 0, DescribeTransactionsRequest, DescribeTransactionsResponse),
        ApiSpec(66, 0, 1, ListTransactionsRequest, ListTransactionsResponse),
    )
}
API_VERSIONS = 18
PRODUCE = 0


class RequestHeader(NamedTuple):
    api_key: int
    version: int
    correlation_id: int
    client_id: str | None


class FrameReader:
    """Size-prefixed frames from a byte stream, with the size checked first.

    ``feed()`` raises ProtocolError as soon as a frame announces more than
    ``max_frame`` bytes (or a negative size), before its body is buffered.
    """

    __slots__ = ("_buf", "_pos", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self._pos = 0
        self.max_frame = max_frame

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        self._buf += data
        self._check()

    def _check(self) -> None:
        if len(self._buf) - self._pos >= 4:
            size = _I32.unpack_from(self._buf, self._pos)[0]
            if size < 0 or size > self.max_frame:
                raise ProtocolError(f"frame of {size} bytes (at most {self.max_frame})")

    def next_frame(self) -> bytes | None:
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 4:
            return None
        size = _I32.unpack_from(buf, pos)[0]
        stop = pos + 4 + size
        if stop > len(buf):
            return None
        frame = bytes(memoryview(buf)[pos + 4 : stop])  # one copy (a bytearray slice is a second)
        if stop == len(buf):
            buf.clear()
            self._pos = 0
        elif stop >= 1 << 16 and stop * 2 >= len(buf):
            del buf[:stop]
            self._pos = 0
        else:
            self._pos = stop
        self._check()
        return frame


def parse_header(frame: bytes) -> tuple[RequestHeader, int]:
    """The request header and where the body starts (non-flexible header v1)."""
    if len(frame) < 10:
        raise ProtocolError(f"request of {len(frame)} bytes is shorter than a header")
    api_key, version, corr = _HEADER.unpack_from(frame)
    n = struct.unpack_from(">h", frame, 8)[0]
    pos = 10
    client_id = None
    if n >= 0:
        if pos + n > len(frame):
            raise ProtocolError("client_id overruns the request")
        client_id = frame[pos : pos + n].decode("utf-8", "replace")
        pos += n
    return RequestHeader(api_key, version, corr, client_id), pos


#: Tagged fields one tag section of a request may carry.
MAX_TAGS = 64


def _uvarint(data: memoryview, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= len(data) or shift > 28:
            raise ProtocolError("malformed varint in a tagged-field section")
        b = data[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


def _skip_tags(frame: bytes, pos: int) -> int:
    """Skip a tagged-field section (flexible header v2), bounded as :func:`decode_tags`."""
    data = memoryview(frame)
    count, pos = _uvarint(data, pos)
    if count > MAX_TAGS:
        raise ProtocolError(f"{count} tagged fields (at most {MAX_TAGS})")
    for _ in range(count):
        _tag, pos = _uvarint(data, pos)
        size, pos = _uvarint(data, pos)
        pos += size
    if pos > len(frame):
        raise ProtocolError("tagged fields overrun the request")
    return pos


def decode_tags(fields: Any, data: memoryview, pos: int, version: int) -> tuple[dict[str, Any], int]:
    """One tagged-field section of a request from ``pos``: ``({name: value} of the known
    tags, where the section ends)``.  Unknown tags are skipped; every tag's announced size
    must lie within the request, and a known tag's value must take exactly that size
    (ProtocolError otherwise).  Nothing past the section is copied."""
    count, pos = _uvarint(data, pos)
    if count > MAX_TAGS:
        raise ProtocolError(f"{count} tagged fields (at most {MAX_TAGS})")
    out: dict[str, Any] = {}
    known = fields._tags
    for _ in range(count):
        tag, pos = _uvarint(data, pos)
        size, pos = _uvarint(data, pos)
        end = pos + size
        if end > len(data):
            raise ProtocolError(f"tagged field {tag} of {size} bytes overruns the request")
        field = known.get(tag)
        if field is not None:
            raw = io.BytesIO(bytes(data[pos:end]))
            out[field.name] = field.decode(raw, version=version, compact=True, tagged=None)
            if raw.tell() != size:
                raise ProtocolError(f"tagged field {tag} takes {raw.tell()} of its {size} bytes")
        pos = end
    return out, pos


def _emit_tagged_decode(self: Any, ctx: Any, var_name: str, indent: str, version: int) -> None:
    """kafka-python's generated decoders read a non-empty tag section from a copy of the rest
    of the request (quadratic in a request of many small structs each carrying a tag) and take
    a tag's short read as it comes: they call :func:`decode_tags` instead."""
    tf_var = ctx.next_var("tf")
    ctx.globs[tf_var] = self.tagged_fields(version)
    ctx.globs["_dafka_decode_tags"] = decode_tags
    ctx.emit(indent, f"_tfd, pos = _dafka_decode_tags({tf_var}, data, pos, {version:d})")
    ctx.emit(indent, "for _tk, _tv in _tfd.items():")
    ctx.emit(indent, f"    if {var_name}.tags is None: {var_name}.tags = set()")
    ctx.emit(indent, f"    {var_name}.tags.add(_tk)")
    ctx.emit(indent, f"    setattr({var_name}, _tk, _tv)")


if not callable(getattr(_StructField, "_emit_tagged_decode", None)):  # the hook replaced below
    raise ImportError("dafka's Kafka codec needs kafka-python 3.0.x (its tagged-field decoder hook is gone)")
_StructField._emit_tagged_decode = _emit_tagged_decode  # before anything is compiled


# A field plan: (attribute, schema name, whether null is allowed, plan of its struct or
# struct-array items (None: not a struct)); only fields that could hold a null, or hold such.
_Plan = tuple[tuple[str, str, bool, "_Plan | None", bool], ...]
_NULL_PLANS: dict[tuple[int, int], _Plan] = {}


def _plan_of(fields: dict[str, Any] | None, version: int) -> _Plan:
    out = []
    for attr, f in (fields or {}).items():
        if not f.for_version_q(version) or f.tagged_field_q(version):
            continue
        many, struct = f.is_struct_array(), f.is_struct()
        sub = _plan_of(f.fields, version) if many or struct else None
        nullable = bool(f.nullable_for_version_q(version))
        can_be_null = many or struct or f.is_array() or f.type_str in ("string", "bytes", "records")
        if (can_be_null and not nullable) or sub:
            out.append((attr, f.name, nullable, sub or None, many))
    return tuple(out)


def _null_plan(api_key: int, version: int, cls: Any) -> _Plan:
    plan = _NULL_PLANS.get((api_key, version))
    if plan is None:
        plan = _NULL_PLANS[(api_key, version)] = _plan_of(cls._struct.fields, version)
    return plan


def _refuse_nulls(plan: _Plan, obj: Any) -> None:
    """ProtocolError for a null (length -1) where the request's schema allows none at this
    version: the decoder takes one anywhere, and the handlers then failed on it (TypeError,
    logged as the gateway's own failure) instead of refusing bad input."""
    for attr, name, nullable, sub, many in plan:
        value = getattr(obj, attr, None)
        if value is None:
            if not nullable:
                raise ProtocolError(f"null {name}, which is not nullable")
            continue
        if sub is not None:
            for item in value if many else (value,):
                _refuse_nulls(sub, item)


def decode_request(frame: bytes) -> tuple[RequestHeader, Any]:
    """``(header, body)``; body is None for an API or version we do not serve.

    Raises ProtocolError for a malformed request (the connection closes).
    """
    header, pos = parse_header(frame)
    spec = API.get(header.api_key)
    if spec is None or not spec.min_version <= header.version <= spec.max_version:
        return header, None
    cls = spec.request
    flexible = cls.flexible_version_q(header.version)
    if flexible:
        pos = _skip_tags(frame, pos)
    try:
        decode = cls._struct.compiled_decode_from(header.version, compact=flexible, tagged=flexible,
                                                  data_class=cls[None])
        # Bytes after the request are left alone, as Kafka's brokers do: librdkafka 2.12's
        # Metadata v9 carries a stray byte.
        body, _end = decode(memoryview(frame), pos)
        _refuse_nulls(_null_plan(header.api_key, header.version, cls), body)
    except ProtocolError:
        raise
    except Exception as exc:  # the generated decoders raise many kinds
        raise ProtocolError(f"malformed {cls.__name__} v{header.version}: {exc!r}") from exc
    return header, body


def encode_response(correlation_id: int, api_key: int, version: int, **fields: Any) -> bytes:
    """A whole response frame: size, header (v1 for a flexible version, ApiVersions
    aside), body of ``version``."""
    cls = API[api_key].response
    body = cls[version](**fields).encode(version=version)
    if api_key != API_VERSIONS and cls.flexible_version_q(version):
        return _I32.pack(len(body) + 5) + _I32.pack(correlation_id) + b"\x00" + bytes(body)
    return _I32.pack(len(body) + 4) + _I32.pack(correlation_id) + bytes(body)


_PRODUCE_PART = {v: struct.Struct(">ihq" + ("q" if v >= 2 else "") + ("q" if v >= 5 else "")) for v in range(11)}
_PRODUCE_VERSIONS = range(11)
_I16_LEN = struct.Struct(">h")


def encode_produce_response(
    correlation_id: int, version: int, topics: list[tuple[str, list[tuple[int, int, int]]]]
) -> bytes:
    """A whole Produce response frame (versions 0-10), written here: the answer to every
    produce request, which the generic encoder took 10-45 us to build (flexible versions
    the most).  ``topics`` is ``[(name, [(partition, error code, base offset)])]``; every
    partition has log-append time and log start offset -1, no record errors, no error
    message (what the gateway answers), as :func:`encode_response` would write them."""
    if version not in _PRODUCE_VERSIONS:
        raise ProtocolError(f"Produce v{version} is not served")
    flexible = version >= 9
    part = _PRODUCE_PART[version]
    tail = b""
    if version >= 8:
        # record_errors (empty), error_message (null), then the partition's tagged fields
        tail = b"\x01\x00\x00" if flexible else b"\x00\x00\x00\x00\xff\xff"
    extra = (-1,) * ((version >= 2) + (version >= 5))
    # (Compact lengths are the unsigned LEB128 varint Tank uses too.)
    parts = [encode_varint(len(topics) + 1) if flexible else _I32.pack(len(topics))]
    app = parts.append
    for name, partitions in topics:
        raw = name.encode()
        app(encode_varint(len(raw) + 1) if flexible else _I16_LEN.pack(len(raw)))
        app(raw)
        app(encode_varint(len(partitions) + 1) if flexible else _I32.pack(len(partitions)))
        for index, code, base in partitions:
            app(part.pack(index, code, base, *extra))
            app(tail)
        if flexible:
            app(b"\x00")  # the topic's tagged fields
    if version >= 1:
        app(_I32.pack(0))  # throttle_time_ms
    if flexible:
        app(b"\x00")  # the response's tagged fields
    body = b"".join(parts)
    if flexible:
        return _I32.pack(len(body) + 5) + _I32.pack(correlation_id) + b"\x00" + body
    return _I32.pack(len(body) + 4) + _I32.pack(correlation_id) + body


_FETCH_HEAD = {v: struct.Struct(">i" + ("i" if v >= 1 else "") + ("hi" if v >= 7 else "")) for v in range(12)}
_FETCH_PART = {
    v: struct.Struct(">ihq" + ("q" if v >= 4 else "") + ("q" if v >= 5 else "") + ("i" if v >= 4 else "")
                     + ("i" if v >= 11 else "") + "i")
    for v in range(12)
}
_I16 = struct.Struct(">h")


#: A record set this big goes out as its own buffer (:func:`encode_fetch_parts`), not copied.
SCATTER_MIN = 64 << 10


def encode_fetch_response(
    correlation_id: int, version: int, topics: list[tuple[str, list[tuple[int, int, int, int, bytes]]]]
) -> bytes:
    """A whole Fetch response frame (versions 0-11, the non-flexible ones), written here.

    ``topics`` is ``[(name, [(partition, error code, high watermark, log
    start offset, record set[, last stable offset])])]``.  Each record set is
    copied once, into the frame; the generic encoder would copy it several
    times (Fetch answers carry megabytes).  The last stable offset is the high
    watermark unless given; no aborted transactions (a read_committed answer
    leaves aborted records out itself), no preferred read replica.
    """
    return b"".join(encode_fetch_parts(correlation_id, version, topics))


def encode_fetch_parts(
    correlation_id: int, version: int, topics: list[tuple[str, list[tuple[int, int, int, int, bytes]]]]
) -> list[bytes]:
    """:func:`encode_fetch_response` as byte strings that make the frame back to back.

    Record sets of at least :data:`SCATTER_MIN` bytes are items of their own,
    not copied (the gateway hands the list to one scatter send); everything
    between them is joined, so the list holds at most two items per such
    record set, plus one.
    """
    if version >= 12:
        return _fetch_parts_flexible(correlation_id, version, topics)
    if not 0 <= version <= 11:
        raise ValueError(f"Fetch v{version} is not written here")
    head = _FETCH_HEAD[version]
    fields = (correlation_id, 0, 0, 0)[: 1 + (version >= 1) + 2 * (version >= 7)]
    out: list[bytes] = []
    run: list[bytes] = [head.pack(*fields), _I32.pack(len(topics))]
    app = run.append
    pack = _FETCH_PART[version].pack
    total = 0
    for name, partitions in topics:
        raw = name.encode()
        app(_I16.pack(len(raw)))
        app(raw)
        app(_I32.pack(len(partitions)))
        for index, code, hwm, start, records, *lso in partitions:
            fields = [index, code, hwm]
            if version >= 4:
                fields.append(lso[0] if lso else hwm)  # last stable offset
            if version >= 5:
                fields.append(start)
            if version >= 4:
                fields.append(-1)  # aborted transactions: null
            if version >= 11:
                fields.append(-1)  # preferred read replica: none
            fields.append(len(records))
            app(pack(*fields))
            if len(records) >= SCATTER_MIN:
                joined = b"".join(run)
                out.append(joined)
                out.append(records)
                total += len(joined) + len(records)
                run.clear()
            else:
                app(records)
    joined = b"".join(run)
    total += len(joined)
    if joined:
        out.append(joined)
    out[0] = _I32.pack(total) + out[0]
    return out


def _uv(n: int) -> bytes:
    """An unsigned varint (the lengths of compact strings, arrays and bytes are n + 1)."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]
# Flexible Fetch (v12): response header v1 (correlation id, no tags), throttle, error, session id.
_FLEX_HEAD = struct.Struct(">ibihi")
_FLEX_PART = struct.Struct(">ihqqq")  # index, error, high watermark, last stable offset, log start
# aborted transactions: null; preferred read replica: none (-1)
_FLEX_MID = b"\x00\xff\xff\xff\xff"


def _fetch_parts_flexible(
    correlation_id: int, version: int, topics: list[tuple[str, list[tuple[int, int, int, int, bytes]]]]
) -> list[bytes]:
    """:func:`encode_fetch_parts` of Fetch v12, the first flexible version: compact strings,
    arrays and records, an empty tagged-field section after each partition, topic and the
    answer (no diverging epoch, leader or snapshot: the gateway is the one replica)."""
    if version != 12:
        raise ValueError(f"Fetch v{version} is not written here")
    out: list[bytes] = []
    run: list[bytes] = [_FLEX_HEAD.pack(correlation_id, 0, 0, 0, 0), _uv(len(topics) + 1)]
    app = run.append
    pack = _FLEX_PART.pack
    total = 0
    for name, partitions in topics:
        raw = name.encode()
        app(_uv(len(raw) + 1))
        app(raw)
        app(_uv(len(partitions) + 1))
        for index, code, hwm, start, records, *lso in partitions:
            app(pack(index, code, hwm, lso[0] if lso else hwm, start))
            app(_FLEX_MID)
            app(_uv(len(records) + 1))
            if len(records) >= SCATTER_MIN:
                joined = b"".join(run)
                out.append(joined)
                out.append(records)
                total += len(joined) + len(records)
                run.clear()
            else:
                app(records)
            app(b"\x00")  # the partition's tags
        app(b"\x00")  # the topic's tags
    app(b"\x00")  # the answer's tags
    joined = b"".join(run)
    total += len(joined)
    out.append(joined)
    out[0] = _I32.pack(total) + out[0]
    return out


def api_versions_error(correlation_id: int) -> bytes:
    """Error 35 in the v0 body format with the versions served (KIP-511)."""
    return encode_response(
        correlation_id, API_VERSIONS, 0, error_code=Err.UNSUPPORTED_VERSION, api_keys=api_keys()
    )


def api_keys() -> list[SimpleNamespace]:
    return [N(api_key=s.key, min_version=s.min_version, max_version=s.max_version) for s in API.values()]
