"""The implementation of Kafka record batches' per-record loops, and bounded decompression.

Chosen at import (:func:`_load`): the compiled :mod:`dafka.kafka._compiled` when built and
current, else its pure twin :mod:`dafka.kafka._pure` (``DAFKA_NO_EXTENSIONS=1`` forces it).
Shared by :mod:`dafka.kafka.records` and the store (:mod:`dafka.store.block` validates a
Kafka batch stored as sent, :mod:`dafka.store.reader` reads one for readers of format-1
values), so it imports nothing of either.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import zlib
from typing import NamedTuple

import snappy

from dafka.errors import ProtocolError
from dafka.kafka import _pure

try:  # optional codecs: produce batches using them are refused without the package
    import lz4.frame as _lz4f
except ImportError:  # pragma: no cover - lz4 is a dependency of the kafka extra
    _lz4f = None
try:
    import zstandard as _zstd
except ImportError:  # pragma: no cover
    _zstd = None

_XERIAL = b"\x82SNAPPY\x00"
_I32 = struct.Struct(">i")
BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")  # 61 bytes
BATCH_HEADER_SIZE = BATCH_HEADER.size
ATTR_CODEC = 0x07
ATTR_LOG_APPEND_TIME = 0x08
CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD = 1, 2, 3, 4


class Record(NamedTuple):
    """One record as a producer sent it."""

    timestamp: int
    key: bytes | None
    value: bytes | None  # None: a null value (a tombstone)
    headers: bytes  # the record's header section as sent (b"\x00": none)



def _load() -> tuple[object, str]:
    """The compiled per-record loops when built, else the pure twin (DAFKA_NO_EXTENSIONS=1 forces it)."""
    if os.environ.get("DAFKA_NO_EXTENSIONS", "").strip() not in ("", "0"):
        return _pure, "DAFKA_NO_EXTENSIONS is set"
    try:
        from dafka.kafka import _compiled  # type: ignore[attr-defined]
    except ImportError as exc:
        return _pure, f"the compiled record codec is not built ({exc})"
    if not all(hasattr(_compiled, f) for f in ("decode_records", "encode_batch", "store_pairs", "walk_records")) or (
        getattr(_compiled, "RECORDS_ABI", 1) != _pure.RECORDS_ABI
    ):
        return _pure, "the compiled record codec is out of date; rebuild it"
    try:
        _compiled.encode_batch(0, [bytes(9)], 100)  # a build from before encode_batch took a limit
    except TypeError:
        return _pure, "the compiled record codec is out of date; rebuild it"
    return _compiled, "compiled record codec loaded"


_impl, REASON = _load()
IMPLEMENTATION: str = _impl.IMPLEMENTATION  # type: ignore[attr-defined]
if IMPLEMENTATION != "compiled":
    logging.getLogger("dafka.kafka").debug("Kafka record codec: pure Python (%s)", REASON)
_decode_records = _impl.decode_records  # type: ignore[attr-defined]
#: One uncompressed v2 batch of stored values at offsets ``base_offset, ...``
#: (see :func:`dafka.kafka._pure.encode_batch`).
encode_batch = _impl.encode_batch  # type: ignore[attr-defined]
#: The store's LMDB pairs of decoded records (see :func:`dafka.kafka._pure.store_pairs`).
store_pairs = _impl.store_pairs  # type: ignore[attr-defined]
#: Check a batch body's records building nothing per record (see :func:`dafka.kafka._pure.walk_records`).
walk_records = _impl.walk_records  # type: ignore[attr-defined]


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
            if limit <= ONE_CALL:
                out = _lz4f.LZ4FrameDecompressor().decompress(data, max_length=limit + 1)
            else:
                out = _lz4(data, limit)
        elif codec == CODEC_ZSTD:
            if _zstd is None:
                raise ProtocolError("zstd batches need the zstandard package")
            if limit <= ONE_CALL:
                with _zstd.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
                    out = r.read(limit + 1)
            else:
                out = _zstd_read(data, limit)
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


# lz4 and zstd allocate the output size they are given at once (untouched pages: cheap up to
# ONE_CALL, the most a stored batch inflates to).  Past it a piece at a time, so that a larger
# limit costs what the batch inflates to, not the limit (readers gave 1 << 62: MemoryError,
# and lz4 and zstd batches were unreadable to Tank and mesh readers).
ONE_CALL = 64 << 20  # = dafka.kafka.records.MAX_DECOMPRESSED: a stored batch was checked against it
_PIECE = 256 << 10


def _lz4(data: bytes, limit: int) -> bytes:
    d = _lz4f.LZ4FrameDecompressor()
    parts = []
    total = 0
    chunk = data
    while total <= limit:
        piece = d.decompress(chunk, max_length=min(limit + 1 - total, _PIECE))
        chunk = b""
        parts.append(piece)
        total += len(piece)
        if d.eof or not piece:
            break
    return b"".join(parts)


def _zstd_read(data: bytes, limit: int) -> bytes:
    parts = []
    total = 0
    with _zstd.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
        while total <= limit:
            piece = r.read(min(limit + 1 - total, _PIECE))
            if not piece:
                break
            parts.append(piece)
            total += len(piece)
    return b"".join(parts)


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


def kafka_values(batch: bytes | memoryview, first_offset: int, offset: int, n: int) -> list[bytes] | None:
    """Up to ``n`` format-1 values (:mod:`dafka.store.layout`) of a stored Kafka batch's records
    (its first at ``first_offset``) from ``offset`` on, as the gateway stored Kafka records before blocks (:func:`store_pairs`),
    decoded by the compiled loops; None when a record's key and headers do not fit format 1's
    255-byte key slot or a timestamp is negative (the caller's per-record path then)."""
    raw = bytes(batch)
    (_b, _l, _e, _m, _c, attrs, _d, base_ts, max_ts, _p, _pe, _s, count) = BATCH_HEADER.unpack_from(raw)
    i = offset - first_offset
    if i < 0 or i >= count or n <= 0:
        return []
    codec = attrs & ATTR_CODEC
    if codec:
        body, start = _decompress(codec, raw[BATCH_HEADER_SIZE:], [ONE_CALL]), 0  # checked when stored
    else:
        body, start = raw, BATCH_HEADER_SIZE
    fixed = max_ts if attrs & ATTR_LOG_APPEND_TIME else None
    recs, max_slot, min_ts, _nulls = _decode_records(body, start, len(body), count, base_ts, fixed, Record)
    if max_slot > 255 or min_ts < 0:
        return None
    pairs = store_pairs(recs[i:i + n], 0, offset)[0]
    return [v for _k, v in pairs]
