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

import io
import struct
import zlib
from dataclasses import dataclass, field

import snappy
from crc32c import crc32c

from dafka.errors import ProtocolError

try:  # optional codecs: produce batches using them are refused without the package
    import lz4.frame as _lz4f
except ImportError:  # pragma: no cover - lz4 is a dependency of the kafka extra
    _lz4f = None
try:
    import zstandard as _zstd
except ImportError:  # pragma: no cover
    _zstd = None

__all__ = [
    "CODEC_GZIP",
    "CODEC_LZ4",
    "CODEC_NONE",
    "CODEC_SNAPPY",
    "CODEC_ZSTD",
    "MAX_DECOMPRESSED",
    "Batch",
    "Record",
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
_XERIAL = b"\x82SNAPPY\x00"


@dataclass(slots=True)
class Record:
    """One record as a producer sent it."""

    timestamp: int
    key: bytes | None
    value: bytes
    headers: bytes  # the record's header section as sent (count varint + headers)


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

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)


# ---------------------------------------------------------------- varints


def zigzag(n: int) -> bytes:
    """The zigzag varint of ``n`` (Kafka's signed varint / varlong)."""
    v = (n << 1) ^ (n >> 63)
    if v < 0x80:
        return _SMALL[v]
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


_SMALL = tuple(bytes((i,)) for i in range(128))
# Zigzag varints of 0..16383, the offset deltas and lengths of most records.
_ZZ = tuple(zigzag(i) for i in range(1 << 13))


def _zz(n: int) -> bytes:
    return _ZZ[n] if 0 <= n < 8192 else zigzag(n)


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """A zigzag varint at ``pos``: ``(value, next pos)``; at most 10 bytes."""
    if pos >= end:
        raise ProtocolError("record truncated inside a varint")
    b = buf[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    v = b & 0x7F
    shift = 7
    pos += 1
    while True:
        if pos >= end or shift > 63:
            raise ProtocolError("malformed varint in a record")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return (v >> 1) ^ -(v & 1), pos
        shift += 7


# ---------------------------------------------------------------- decode


def decode_batches(data: bytes | None, limit: int = MAX_DECOMPRESSED) -> list[Batch]:
    """Every batch in a produce request's ``records`` (v2 batches or a legacy message set)."""
    if not data:
        return []
    buf = bytes(data)
    end = len(buf)
    out: list[Batch] = []
    pos = 0
    budget = [limit]
    while pos < end:
        if end - pos < 17:
            raise ProtocolError("truncated record batch header")
        length = _I32.unpack_from(buf, pos + 8)[0]
        magic = buf[pos + 16]
        stop = pos + 12 + length
        if length < 0 or stop > end:
            raise ProtocolError(f"record batch of {length} bytes overruns the request")
        if magic == 2:
            out.append(_decode_v2(buf, pos, stop, budget))
        elif magic in (0, 1):
            out.extend(_decode_legacy(buf, pos, stop, budget))
        else:
            raise ProtocolError(f"unknown record batch magic {magic}")
        pos = stop
    return out


def _decode_v2(buf: bytes, pos: int, stop: int, budget: list[int]) -> Batch:
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
    if codec == CODEC_NONE:
        body, start, end = buf, body_start, stop
    else:
        body = _decompress(codec, buf[body_start:stop], budget)
        start, end = 0, len(body)
    # Every record takes at least 7 bytes: a count beyond that is a lie.
    if count > (end - start) // 7 + 1:
        raise ProtocolError(f"record count {count} does not fit the batch")
    batch = Batch(base_offset, pid, pepoch, base_seq, attrs)
    records = batch.records
    append = records.append
    log_append = bool(attrs & ATTR_LOG_APPEND_TIME)
    p = start
    for _ in range(count):
        rlen, p = _varint(body, p, end)
        rend = p + rlen
        if rlen < 6 or rend > end:
            raise ProtocolError("record length overruns its batch")
        p += 1  # record attributes (unused)
        tsd, p = _varint(body, p, rend)
        _od, p = _varint(body, p, rend)
        klen, p = _varint(body, p, rend)
        if klen < 0:
            key = None
        else:
            if p + klen > rend:
                raise ProtocolError("record key overruns its record")
            key = body[p : p + klen]
            p += klen
        vlen, p = _varint(body, p, rend)
        if vlen < 0:
            value = b""
        else:
            if p + vlen > rend:
                raise ProtocolError("record value overruns its record")
            value = body[p : p + vlen]
            p += vlen
        headers = body[p:rend] if p < rend else b"\x00"
        if headers != b"\x00":
            _check_headers(headers)
        append(Record(max_ts if log_append else base_ts + tsd, key, value, headers))
        p = rend
    if p != end:
        raise ProtocolError(f"{end - p} stray bytes after the records of a batch")
    return batch


def _check_headers(section: bytes) -> None:
    """The header section must parse exactly (count, then key/value pairs)."""
    end = len(section)
    n, p = _varint(section, 0, end)
    if n < 0:
        raise ProtocolError("negative header count")
    for _ in range(n):
        klen, p = _varint(section, p, end)
        if klen < 0 or p + klen > end:
            raise ProtocolError("header key overruns its record")
        p += klen
        vlen, p = _varint(section, p, end)
        if vlen > 0:
            p += vlen
        if p > end:
            raise ProtocolError("header value overruns its record")
    if p != end:
        raise ProtocolError("stray bytes after a record's headers")


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


def _decode_legacy(buf: bytes, pos: int, stop: int, budget: list[int], depth: int = 0) -> list[Batch]:
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
        if magic == 1:
            ts = _I64.unpack_from(buf, p)[0]
            p += 8
        klen = _I32.unpack_from(buf, p)[0]
        p += 4
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
            inner = _decompress(codec, value, budget)
            out.extend(_decode_legacy(inner, 0, len(inner), budget, depth + 1))
        else:
            b = Batch(-1, -1, -1, -1, 0, magic)
            b.records.append(Record(ts, key, value, b"\x00"))
            out.append(b)
        pos = mend
    return out


def _decompress(codec: int, data: bytes, budget: list[int]) -> bytes:
    """Inflate ``data``, never past the remaining ``budget`` bytes of this request."""
    limit = budget[0]
    try:
        if codec == CODEC_GZIP:
            d = zlib.decompressobj(47)
            out = d.decompress(data, limit + 1)
        elif codec == CODEC_SNAPPY:
            out = _snappy(data, limit)
        elif codec == CODEC_LZ4:
            if _lz4f is None:
                raise ProtocolError("lz4 batches need the lz4 package")
            out = _lz4f.LZ4FrameDecompressor().decompress(data, max_length=limit + 1)
        elif codec == CODEC_ZSTD:
            if _zstd is None:
                raise ProtocolError("zstd batches need the zstandard package")
            with _zstd.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
                out = r.read(limit + 1)
        else:
            raise ProtocolError(f"unknown compression codec {codec}")
    except ProtocolError:
        raise
    except Exception as exc:  # every codec has its own error types
        raise ProtocolError(f"cannot decompress a batch (codec {codec}): {exc}") from exc
    if len(out) > limit:
        raise ProtocolError(f"a batch inflates past {limit} bytes")
    budget[0] = limit - len(out)
    return bytes(out)


def _snappy(data: bytes, limit: int) -> bytes:
    if data.startswith(_XERIAL):  # the Java client's framing: 16-byte header, then blocks
        out = bytearray()
        p, end = 16, len(data)
        while p < end:
            if end - p < 4:
                raise ProtocolError("truncated xerial snappy block")
            n = _I32.unpack_from(data, p)[0]
            p += 4
            if n < 0 or p + n > end:
                raise ProtocolError("xerial snappy block overruns the batch")
            out += _snappy(data[p : p + n], limit - len(out))
            p += n
        return bytes(out)
    # Raw snappy starts with the uncompressed length: check it before inflating.
    size, p, shift = 0, 0, 0
    while True:
        if p >= len(data) or shift > 28:
            raise ProtocolError("malformed snappy length")
        b = data[p]
        size |= (b & 0x7F) << shift
        p += 1
        if b < 0x80:
            break
        shift += 7
    if size > limit:
        raise ProtocolError(f"a batch inflates past {limit} bytes")
    return snappy.uncompress(data)


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


def split_ext(ext: bytes) -> tuple[bytes, bytes]:
    """``(key part, header part)`` of stored extras, each already in record form."""
    klen, p = _varint(ext, 0, len(ext))
    if klen > 0:
        p += klen
    return ext[:p], ext[p:]


# ---------------------------------------------------------------- encode

_TS_FLAGS = struct.Struct(">QB")
_FLAG_KEY = 0x01
_FLAG_KAFKA = 0x04


def encode_batch(base_offset: int, values: list[bytes]) -> bytes:
    """One uncompressed v2 batch of stored values (``ts:u64 flags:u8 [klen key] content``)
    at offsets ``base_offset, base_offset + 1, ...``."""
    n = len(values)
    if not n:
        return b""
    zz = _ZZ
    parts: list[bytes] = []
    app = parts.append
    base_ts = _TS_FLAGS.unpack_from(values[0])[0]
    max_ts = base_ts
    last_hdr = b""
    ts_part = b"\x00"
    for i, v in enumerate(values):
        hdr = v[:9]
        if hdr != last_hdr:
            ts, flags = _TS_FLAGS.unpack_from(v)
            if ts > max_ts:
                max_ts = ts
            ts_part = b"\x00" + zigzag(ts - base_ts)  # record attributes, timestamp delta
            last_hdr = hdr
        flags = v[8]
        od = zz[i] if i < 8192 else zigzag(i)
        if not flags & _FLAG_KEY:
            content = v[9:]
            vl = len(content)
            body = (ts_part, od, b"\x01", zz[vl] if vl < 8192 else zigzag(vl), content, b"\x00")
        else:
            kl = v[9]
            content = v[10 + kl :]
            vl = len(content)
            vlb = zz[vl] if vl < 8192 else zigzag(vl)
            if flags & _FLAG_KAFKA:
                kpart, hpart = split_ext(v[10 : 10 + kl])
                body = (ts_part, od, kpart, vlb, content, hpart)
            else:
                body = (ts_part, od, zz[kl], v[10 : 10 + kl], vlb, content, b"\x00")
        size = sum(map(len, body))
        app(zz[size] if size < 8192 else zigzag(size))
        parts.extend(body)
    records = b"".join(parts)
    tail = struct.pack(">hiqqqhii", 0, n - 1, base_ts, max_ts, -1, -1, -1, n) + records
    crc = crc32c(tail)
    return struct.pack(">qiibI", base_offset, len(tail) + 9, -1, 2, crc) + tail


def batch_record_count(batch: bytes) -> int:
    """How many records an encoded batch holds (its header's count)."""
    return BATCH_HEADER.unpack_from(batch)[12]
