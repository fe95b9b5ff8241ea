"""Kafka record batches (magic v2), sans-IO: decode what producers send, encode what fetches get.

Layout (facts from the Kafka documentation, "Message format")::

    baseOffset:i64 batchLength:i32 partitionLeaderEpoch:i32 magic:i8 crc:u32
    attributes:i16 lastOffsetDelta:i32 baseTimestamp:i64 maxTimestamp:i64
    producerId:i64 producerEpoch:i16 baseSequence:i32 recordCount:i32 records...

``crc`` is CRC-32C of everything from ``attributes`` to the end.  Attribute
bits 0-2 are the codec (0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd), bit 3 the
timestamp type, bit 4 transactional, bit 5 control.  A record is::

    length:varint attributes:i8 timestampDelta:varlong offsetDelta:varint
    keyLength:varint key valueLength:varint value headerCount:varint
    (headerKeyLength:varint headerKey headerValueLength:varint headerValue)*

Varints are zigzag-encoded (signed).  Older message sets (magic 0 and 1) are
decoded too, for clients that still send them.

Every decoder raises :class:`~dafka.errors.ProtocolError` on malformed or
oversized input, and decompression is bounded (:data:`MAX_DECOMPRESSED`).
"""

from __future__ import annotations

import operator
import struct
import zlib
from dataclasses import dataclass, field

from crc32c import crc32c

from dafka.errors import ProtocolError
from dafka.kafka import _pure

# The implementation (compiled or pure) and bounded decompression, shared with dafka.store.
from dafka.kafka._codec import IMPLEMENTATION as IMPLEMENTATION
from dafka.kafka._codec import REASON as REASON
from dafka.kafka._codec import Record as Record
from dafka.kafka._codec import _decode_records
from dafka.kafka._codec import _decompress as _decompress
from dafka.kafka._codec import encode_batch as encode_batch
from dafka.kafka._codec import kafka_values as kafka_values
from dafka.kafka._codec import store_pairs as store_pairs
from dafka.kafka._codec import walk_records as walk_records
from dafka.store.block import HEADER_SIZE, KafkaScan, scan_kafka
from dafka.store.layout import FLAG_CONTROL, FLAG_KAFKA, FLAG_NULL

__all__ = [
    "CODEC_GZIP",
    "CODEC_LZ4",
    "CODEC_NONE",
    "CODEC_SNAPPY",
    "CODEC_ZSTD",
    "MAX_DECOMPRESSED",
    "Batch",
    "Record",
    "TooManyRecords",
    "decode_batches",
    "encode_batch",
    "split_ext",
    "zigzag",
]

CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD = 0, 1, 2, 3, 4
ATTR_CODEC = 0x07
ATTR_LOG_APPEND_TIME = 0x08
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20

#: A compressed batch may not inflate past this many bytes.
MAX_DECOMPRESSED = 64 << 20

BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")  # 61 bytes
BATCH_HEADER_SIZE = BATCH_HEADER.size
_CRC_START = 21  # attributes start here
_LEGACY_HEADER = struct.Struct(">qiIbb")  # offset, size, crc, magic, attributes
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")


@dataclass(slots=True)
class Batch:
    """One decoded batch: producer identity for idempotence, and its records."""

    base_offset: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    attributes: int
    magic: int = 2
    records: list[Record] = field(default_factory=list)
    #: The largest key slot the store needs for a record (see :func:`make_ext`).
    max_slot: int = 0
    #: The smallest record timestamp (Kafka's "no timestamp" is -1).
    min_ts: int = 0
    #: Bytes of the (inflated) records: no record's value is longer.
    body_size: int = 0
    #: Records with a null value (None: a tombstone).
    nulls: int = 0
    #: A v2 batch kept as sent (:func:`split_batches`): its bytes, and what validating it
    #: found (:class:`dafka.store.block.KafkaScan`); ``records`` is then empty.
    raw: bytes | None = None
    scan: KafkaScan | None = None

    @property
    def record_count(self) -> int:
        return self.scan.record_count if self.scan is not None else len(self.records)

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)


zigzag = _pure.zigzag
_varint = _pure.varint
_ZZ = _pure._ZZ


def _zz(n: int) -> bytes:
    return _ZZ[n] if 0 <= n < 8192 else zigzag(n)


# ---------------------------------------------------------------- decode


class TooManyRecords(Exception):
    """A produce request carries more records than its budget (see :func:`decode_batches`).

    Not a :class:`ProtocolError`: the request is well formed, the partition
    is refused (MESSAGE_TOO_LARGE) and the connection stays open.
    """


def decode_batches(
    data: bytes | None, limit: int = MAX_DECOMPRESSED, shared: list[int] | None = None,
    records: list[int] | None = None,
) -> list[Batch]:
    """Every batch in a produce request's ``records`` (v2 batches or a legacy message set).

    Decompression inflates at most ``limit`` bytes, and at most ``shared[0]``
    when given: the budget of the whole request, which this call spends (one
    request may name many partitions, or one partition many times, each with
    a compression bomb of its own).

    ``records``: ``[how many records]`` the request may still carry, spent by
    this call.  A v2 batch's count is checked against it from its header,
    before the batch is decompressed or decoded (legacy messages count one by
    one); past it, :class:`TooManyRecords` is raised, and the budget spent by
    this call is given back (nothing of it is kept).
    """
    if not data:
        return []
    given = limit if shared is None else min(limit, shared[0])
    budget = [given]
    count = records if records is not None else [-1]
    before = count[0]
    try:
        return _decode_all(bytes(data), budget, count)
    except TooManyRecords:
        count[0] = before
        raise
    finally:
        if shared is not None:
            shared[0] -= given - budget[0]


def split_batches(
    data: bytes | None, limit: int = MAX_DECOMPRESSED, shared: list[int] | None = None,
    records: list[int] | None = None,
) -> list[Batch]:
    """The batches of a produce request's ``records``, a v2 batch validated but not decoded.

    As :func:`decode_batches` (the same budgets, spent the same way), except
    that each magic-2 batch is checked whole by :func:`dafka.store.block.scan_kafka`
    (header, CRC-32C, inflated size, every record's framing, building nothing
    per record) and kept as sent: :attr:`Batch.raw` and :attr:`Batch.scan`,
    its ``records`` empty.  Its largest record (key, value and headers) is
    ``scan.biggest``, for the caller to hold against its limit.  Legacy
    message sets (magic 0 and 1) are decoded as by :func:`decode_batches`.
    """
    if not data:
        return []
    given = limit if shared is None else min(limit, shared[0])
    budget = [given]
    count = records if records is not None else [-1]
    before = count[0]
    try:
        return _decode_all(bytes(data), budget, count, keep=True)
    except TooManyRecords:
        count[0] = before
        raise
    finally:
        if shared is not None:
            shared[0] -= given - budget[0]


def _keep_v2(buf: bytes, pos: int, stop: int, budget: list[int], records: list[int]) -> Batch:
    if stop - pos < BATCH_HEADER_SIZE:
        raise ProtocolError("record batch shorter than its header")
    (base_offset, _len, _epoch, _magic, _crc, attrs, _last_delta, _base_ts, _max_ts, pid, pepoch, base_seq, count) = (
        BATCH_HEADER.unpack_from(buf, pos)
    )
    if count <= 0:  # nothing to keep: checked and decoded as before (an empty batch stores nothing)
        return _decode_v2(buf, pos, stop, budget, records)
    _spend(records, count)  # before anything is inflated or walked
    raw = buf if pos == 0 and stop == len(buf) else buf[pos:stop]  # (the usual one batch: not copied)
    scan = scan_kafka(raw, 1 << 62, budget[0], control=True)
    if scan.compression:
        budget[0] -= len(scan.body)
    # The inflated records are not kept: a reader of another protocol inflates the stored batch.
    return Batch(base_offset, pid, pepoch, base_seq, attrs, raw=raw, scan=scan._replace(body=b""),
                 min_ts=scan.min_ts, body_size=len(raw))


def log_append_time(raw: bytes, now_ms: int) -> bytes:
    """A v2 batch stamped with log-append time ``now_ms``, as a Kafka broker stamps it for a
    LogAppendTime topic: attribute bit 3 set and ``maxTimestamp`` = ``now_ms`` (every
    record then reads as that time), the CRC-32C computed again."""
    out = bytearray(raw)
    attrs = struct.unpack_from(">h", out, _CRC_START)[0] | ATTR_LOG_APPEND_TIME
    struct.pack_into(">h", out, _CRC_START, attrs)
    struct.pack_into(">q", out, 35, now_ms)  # maxTimestamp
    struct.pack_into(">I", out, 17, crc32c(memoryview(out)[_CRC_START:]))
    return bytes(out)


def batch_values(batch: bytes | memoryview) -> list[bytes]:
    """The values of a v2 batch's records (a null value as b""), for readers of contents
    (the mesh): one inflation and the compiled decoder, no per-record Python statement."""
    raw = bytes(batch)
    count = BATCH_HEADER.unpack_from(raw)[12]
    base_ts = BATCH_HEADER.unpack_from(raw)[7]
    codec = BATCH_HEADER.unpack_from(raw)[5] & ATTR_CODEC
    if codec:
        body = _decompress(codec, raw[BATCH_HEADER_SIZE:], [MAX_DECOMPRESSED])  # checked when stored
        start = 0
    else:
        body, start = raw, BATCH_HEADER_SIZE
    recs = _decode_records(body, start, len(body), count, base_ts, None, Record)[0]
    return [b"" if v is None else v for v in map(_VALUE, recs)]


_VALUE = operator.itemgetter(2)


def block_contents(block: bytes) -> list[bytes]:
    """The contents of a stored block's records as the mesh carries them (a Kafka record's
    value, a null one as b""; keys and headers are not on the mesh)."""
    from dafka.store.block import CODEC_KAFKA, decode_header
    from dafka.store.layout import FLAG_KEY
    from dafka.store.reader import block_values

    hdr = decode_header(block)
    if hdr.codec == CODEC_KAFKA:
        return batch_values(memoryview(block)[HEADER_SIZE:])
    values = block_values(block, hdr, hdr.first_offset, hdr.record_count)
    return [v[9:] if not v[8] & FLAG_KEY else v[10 + v[9]:] for v in values]


def _spend(count: list[int], n: int) -> None:
    """Take ``n`` records from a request's record budget (``[-1]``: none)."""
    left = count[0]
    if left < 0:
        return
    if n > left:
        raise TooManyRecords(f"{n} more records than the {left} a produce request may still carry")
    count[0] = left - n


def _decode_all(buf: bytes, budget: list[int], count: list[int], keep: bool = False) -> list[Batch]:
    end = len(buf)
    out: list[Batch] = []
    pos = 0
    while pos < end:
        if end - pos < 17:
            raise ProtocolError("truncated record batch header")
        length = _I32.unpack_from(buf, pos + 8)[0]
        magic = buf[pos + 16]
        stop = pos + 12 + length
        if length < 0 or stop > end:
            raise ProtocolError(f"record batch of {length} bytes overruns the request")
        if magic == 2:
            out.append((_keep_v2 if keep else _decode_v2)(buf, pos, stop, budget, count))
        elif magic in (0, 1):
            out.extend(_decode_legacy(buf, pos, stop, budget, count))
        else:
            raise ProtocolError(f"unknown record batch magic {magic}")
        pos = stop
    return out


def _decode_v2(buf: bytes, pos: int, stop: int, budget: list[int], records: list[int]) -> Batch:
    if stop - pos < BATCH_HEADER_SIZE:
        raise ProtocolError("record batch shorter than its header")
    (base_offset, _len, _epoch, _magic, crc, attrs, _last_delta, base_ts, max_ts, pid, pepoch, base_seq, count) = (
        BATCH_HEADER.unpack_from(buf, pos)
    )
    if crc32c(memoryview(buf)[pos + _CRC_START : stop]) != crc:
        raise ProtocolError("record batch CRC-32C mismatch")
    codec = attrs & ATTR_CODEC
    body_start = pos + BATCH_HEADER_SIZE
    if count < 0:
        raise ProtocolError(f"negative record count {count}")
    _spend(records, count)  # before anything is inflated or decoded
    if codec == CODEC_NONE:
        body, start, end = buf, body_start, stop
    else:
        body = _decompress(codec, buf[body_start:stop], budget)
        start, end = 0, len(body)
    # Every record takes at least 7 bytes: a count beyond that is a lie.
    if count > (end - start) // 7 + 1:
        raise ProtocolError(f"record count {count} does not fit the batch")
    batch = Batch(base_offset, pid, pepoch, base_seq, attrs, body_size=end - start)
    fixed = max_ts if attrs & ATTR_LOG_APPEND_TIME else None
    batch.records, batch.max_slot, batch.min_ts, batch.nulls = _decode_records(
        body, start, end, count, base_ts, fixed, Record
    )
    return batch


def parse_headers(section: bytes) -> list[tuple[str, bytes | None]]:
    """A record's header section as ``(key, value)`` pairs (for tests and tools)."""
    end = len(section)
    n, p = _varint(section, 0, end)
    out = []
    for _ in range(n):
        klen, p = _varint(section, p, end)
        key = section[p : p + klen].decode("utf-8", "replace")
        p += klen
        vlen, p = _varint(section, p, end)
        if vlen < 0:
            out.append((key, None))
        else:
            out.append((key, section[p : p + vlen]))
            p += vlen
    return out


def _decode_legacy(
    buf: bytes, pos: int, stop: int, budget: list[int], records: list[int], depth: int = 0
) -> list[Batch]:
    """A magic 0/1 message set: each message is its own one-record batch."""
    out: list[Batch] = []
    while pos < stop:
        if stop - pos < _LEGACY_HEADER.size:
            raise ProtocolError("truncated legacy message")
        _off, size, crc, magic, attrs = _LEGACY_HEADER.unpack_from(buf, pos)
        mend = pos + 12 + size
        if size < 6 or mend > stop or magic not in (0, 1):
            raise ProtocolError("malformed legacy message")
        if zlib.crc32(memoryview(buf)[pos + 16 : mend]) != crc:
            raise ProtocolError("legacy message CRC mismatch")
        p = pos + 18
        ts = 0
        # Every field inside the message (its size lies otherwise): struct reads past the
        # buffer raised struct.error, taken for a bug of the gateway, not bad input.
        if mend - p < (8 if magic == 1 else 0) + 4:
            raise ProtocolError("legacy message fields overrun it")
        if magic == 1:
            ts = _I64.unpack_from(buf, p)[0]
            p += 8
        klen = _I32.unpack_from(buf, p)[0]
        p += 4
        if max(klen, 0) > mend - p - 4:
            raise ProtocolError("legacy message fields overrun it")
        key = None if klen < 0 else buf[p : p + klen]
        p += max(klen, 0)
        vlen = _I32.unpack_from(buf, p)[0]
        p += 4
        value = b"" if vlen < 0 else buf[p : p + vlen]
        if p + max(vlen, 0) != mend:
            raise ProtocolError("legacy message fields overrun it")
        codec = attrs & ATTR_CODEC
        if codec:
            if depth:
                raise ProtocolError("nested compressed legacy message")
            inner = _decompress(codec, value, budget)  # (a null value inflates to nothing)
            out.extend(_decode_legacy(inner, 0, len(inner), budget, records, depth + 1))
        else:
            _spend(records, 1)
            b = Batch(-1, -1, -1, -1, 0, magic, [Record(ts, key, None if vlen < 0 else value, b"\x00")],
                      len(key) if key else 0, ts, len(value), 1 if vlen < 0 else 0)
            out.append(b)
        pos = mend
    return out


# ---------------------------------------------------------------- stored extras

# A record with headers keeps its key and headers in the stored value's key
# slot (at most 255 bytes), flagged FLAG_KAFKA, in the record's own form:
#   zigzag(keyLength) key headerSection
# so a fetch copies them back, and readers that know only FLAG_KEY skip them.


def make_ext(key: bytes | None, headers: bytes) -> bytes:
    """The stored extras of a record with headers: its key and header section as sent."""
    if key is None:
        return b"\x01" + headers
    return _zz(len(key)) + key + headers


def record_tuples(topic: str, address: str, first: int, records: list[Record]) -> list[tuple[object, ...]]:
    """The store's record tuples (:meth:`dafka.store.db.RecordDB.append`) of decoded records at
    offsets ``first, ...``: the same values :func:`store_pairs` builds (for a partition whose
    id is not known yet)."""
    out: list[tuple[object, ...]] = []
    add = out.append
    n = first
    for ts, k, value, headers in records:
        if value is None:  # a null value: stored empty, flagged
            if headers == b"\x00":
                add((topic, address, n, b"", ts, k, True, FLAG_NULL))
            else:
                add((topic, address, n, b"", ts, make_ext(k, headers), True, FLAG_NULL | FLAG_KAFKA))
        elif headers == b"\x00":
            if k is None:
                add((topic, address, n, value, ts))
            else:
                add((topic, address, n, value, ts, k, True))
        else:
            add((topic, address, n, value, ts, make_ext(k, headers), True, FLAG_KAFKA))
        n += 1
    return out


def split_ext(ext: bytes) -> tuple[bytes, bytes]:
    """``(key part, header part)`` of stored extras, each already in record form."""
    klen, p = _varint(ext, 0, len(ext))
    if klen > 0:
        p += klen
    return ext[:p], ext[p:]


# ---------------------------------------------------------------- encode

def batch_record_count(batch: bytes) -> int:
    """How many records an encoded batch holds (its header's count)."""
    return BATCH_HEADER.unpack_from(batch)[12]


#: A stored control record's key slot (see :data:`dafka.store.layout.FLAG_CONTROL`).
MARKER_SLOT = struct.Struct(">qhB")
_CONTROL_KEY = struct.Struct(">hh")  # version 0, type (0 abort, 1 commit)
_CONTROL_VALUE = struct.Struct(">hi")  # version 0, coordinator epoch


def control_batch(offset: int, value: bytes) -> bytes:
    """The control batch (a transaction marker) of a stored control record at ``offset``:
    attributes transactional and control, the marker's producer id and epoch, one record
    whose key is ``version:i16 type:i16`` and value ``version:i16 coordinatorEpoch:i32``."""
    ts = max(_I64.unpack_from(value, 0)[0], 0)
    klen = value[9]
    pid, epoch, kind = MARKER_SLOT.unpack_from(value, 10) if klen == MARKER_SLOT.size else (-1, -1, 0)
    key = _CONTROL_KEY.pack(0, kind)
    val = _CONTROL_VALUE.pack(0, 0)
    body = b"\x00" + _zz(0) + _zz(0) + _zz(len(key)) + key + _zz(len(val)) + val + b"\x00"
    record = _zz(len(body)) + body
    attrs = ATTR_TRANSACTIONAL | ATTR_CONTROL
    tail = struct.pack(">hiqqqhii", attrs, 0, ts, ts, pid, epoch, -1, 1) + record
    return struct.pack(">qiibI", offset, 9 + len(tail), -1, 2, crc32c(tail)) + tail


def empty_batch(base: int, last: int) -> bytes:
    """A v2 batch of no records spanning offsets ``base..last`` (as Kafka's compaction leaves):
    a reader moves past them.  For a read_committed answer whose records were all aborted."""
    tail = struct.pack(">hiqqqhii", 0, last - base, 0, 0, -1, -1, -1, 0)
    return struct.pack(">qiibI", base, 9 + len(tail), -1, 2, crc32c(tail)) + tail


def txn_encode(base: int, values: list[bytes], limit: int) -> bytes:
    """Stored values of a partition written by transactions as Kafka batches: each control
    record (FLAG_CONTROL) a control batch of its own, the runs between them one batch each
    (``limit`` bytes about, one record at least: the encoder of stored values otherwise)."""
    out: list[bytes] = []
    size = 0
    i, n = 0, len(values)
    while i < n:
        if values[i][8] & FLAG_CONTROL:
            b = control_batch(base + i, values[i])
            i += 1
        else:
            j = i + 1
            while j < n and not values[j][8] & FLAG_CONTROL:
                j += 1
            b = encode_batch(base + i, values[i:j], max(1, limit - size))
            i += batch_record_count(b)
            if i < j:  # the rest of the run did not fit
                out.append(b)
                break
        out.append(b)
        size += len(b)
        if size >= limit:
            break
    return b"".join(out)


def batch_spans(data: bytes) -> list[tuple[int, int, int, int]]:
    """``(start, stop, base offset, last offset)`` of each v2 batch in ``data`` (batches back
    to back, as a fetch's record set)."""
    out = []
    pos, end = 0, len(data)
    while pos + 61 <= end:
        base, length = struct.unpack_from(">qi", data, pos)
        stop = pos + 12 + length
        last_delta = _I32.unpack_from(data, pos + 23)[0]
        out.append((pos, stop, base, base + last_delta))
        pos = stop
    return out


def txn_count(data: bytes) -> int:
    """Records of the batches :func:`txn_encode` made (its offsets: it leaves no gap)."""
    spans = batch_spans(data)
    return spans[-1][3] - spans[0][2] + 1 if spans else 0

