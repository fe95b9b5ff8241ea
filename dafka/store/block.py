"""Store format 2 blocks: one LMDB value holding a run of one partition's records (sans-IO).

The store writes ``CODEC_STORE`` blocks and the Kafka gateway ``CODEC_KAFKA`` ones (its
batches as produced); ``docs/concepts/store.md`` ("Format 2") says what is built and what is not.

A block is a fixed 52-byte header followed by the body, the records in one of
three encodings (the *codec*)::

    magic:2 = b"DB"  version:u8 = 2  codec:u8  compression:u8  flags:u8 = 0
    reserved:u16 = 0
    first_offset:u64  last_offset:u64  count:u32  body_size:u32
    first_ts:i64  max_ts:i64  crc:u32

Big-endian, like every key and value of the store.  ``crc`` is CRC-32C of the
header's first 48 bytes followed by the body, so a torn or altered block is
found without decoding it.  ``first_offset`` and ``last_offset`` are the
partition offsets of the block's first and last record; ``count`` records are
held, ``count == last_offset - first_offset + 1`` unless the block itself has
holes (a sparse Tank bundle).  ``first_ts`` is the first record's timestamp,
``max_ts`` the largest (retention by age removes a block when ``max_ts`` is past
the cutoff).  ``body_size`` is the length of the body, the value's length minus
the header.

Codecs, each body stored as the client sent it wherever its encoding allows:

``CODEC_TANK`` (2)
    One Tank bundle, byte for byte as produced (tank_current.md, "Bundles").
    ``compression`` is ``COMPRESSION_SNAPPY`` when the bundle's codec is snappy.
``CODEC_KAFKA`` (3)
    One Kafka record batch (magic 2) as produced, with ``baseOffset`` set to
    ``first_offset`` (and ``partitionLeaderEpoch`` to -1): both lie outside the
    batch's CRC, which stays valid.  ``compression`` is the batch's codec.
``CODEC_STORE`` (4)
    What the store's group commit writes for records that arrive one at a
    time (Dafka mesh records, C producers, hole repair, the upgrade of a
    format-1 store): ``payload:u64`` (content plus key bytes of the block's
    records, what retention by size counts), ``ends:u32 * count`` (where each
    record ends, counted from the block's first byte, header included), then the records,
    each a format-1 stored value (``ts_ms:u64 flags:u8 [key_len:u8 key]
    content``, :mod:`dafka.store.layout`), so every flag of format 1 (Tank
    key, producer timestamp, Kafka key and headers, null) is kept.  Building a
    block and slicing records out of it are C-level passes (no per-record
    Python statements); record ``i`` is found without walking the others.
``CODEC_DAFKA`` (1)
    A varint encoding designed for the same records (not written by the store
    today: it has no place for format-1 flags), for records that arrive one at a time (Dafka
    mesh records, C producers): per record ``length:varint`` (of the rest of
    the record), ``ts_delta:zigzag varint`` (from ``first_ts``),
    ``key_length:zigzag varint`` (-1: no key), key, then the content up to
    the record's end.  ``compression`` is 0.

Every block is validated before it is stored, without building a Python
object per record: the header against the body, the CRC, the record count
and framing (each record's lengths inside the block and the record count
exact), offsets (Kafka offset deltas 0..count-1, sparse Tank seqs inside the
header's range), timestamps (``first_ts``/``max_ts`` are computed, never
taken from the client), each record's size against ``max_record_bytes``, and
decompression against a byte budget checked before inflating.  A block that
lies is refused with :class:`~dafka.errors.ProtocolError` and nothing of it
is kept.  Readers check a CODEC_STORE block's whole ends table before they
slice it (:func:`store_values`), not the block's CRC (:func:`crc_matches`:
compaction checks it before it drops or rewrites anything).
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Iterator, Sequence
from itertools import accumulate, islice
from typing import Any, NamedTuple

import snappy
from crc32c import crc32c

from dafka.errors import ProtocolError
from dafka.kafka._codec import _decompress, walk_records

__all__ = [
    "CODEC_DAFKA",
    "CODEC_KAFKA",
    "CODEC_STORE",
    "CODEC_TANK",
    "COMPRESSION_NONE",
    "COMPRESSION_SNAPPY",
    "HEADER",
    "HEADER_SIZE",
    "KafkaScan",
    "RecordTooLarge",
    "MAGIC",
    "VERSION",
    "BlockHeader",
    "BlockRecord",
    "block_key",
    "crc_matches",
    "dafka_block",
    "decode_header",
    "kafka_block",
    "kafka_block_of",
    "scan_kafka",
    "records",
    "store_block",
    "slice_block",
    "store_values",
    "tank_block",
    "tank_seal",
    "tank_seqs_are_offsets",
    "tank_span",
    "unpack_block_key",
    "validate",
]

MAGIC = b"DB"
VERSION = 2
CODEC_DAFKA = 1
CODEC_TANK = 2
CODEC_KAFKA = 3
CODEC_STORE = 4
_CODECS = (CODEC_DAFKA, CODEC_TANK, CODEC_KAFKA, CODEC_STORE)
# Kafka's numbering (record batch attribute bits 0-2).
COMPRESSION_NONE, COMPRESSION_GZIP, COMPRESSION_SNAPPY, COMPRESSION_LZ4, COMPRESSION_ZSTD = 0, 1, 2, 3, 4

HEADER = struct.Struct(">2sBBBBHQQIIqqI")
HEADER_SIZE = HEADER.size  # 52
_CRC_AT = HEADER_SIZE - 4
_CRC = struct.Struct(">I")
BLOCK_KEY = struct.Struct(">IQ")  # pid:u32 first_offset:u64, like a format-1 record key
_U64_MAX = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_MAX_BODY = (1 << 32) - 1

# Default bounds (the callers pass their node's settings).
DEFAULT_MAX_RECORD_BYTES = 1 << 20
DEFAULT_BUDGET = 64 << 20  # bytes a compressed block may inflate to


class BlockHeader(NamedTuple):
    """The fixed header of a block: what readers need without decoding records."""

    codec: int
    compression: int
    first_offset: int
    last_offset: int
    record_count: int
    body_size: int
    first_ts: int
    max_ts: int
    crc: int


class BlockRecord(NamedTuple):
    """One record of a block, as :func:`records` yields it.

    ``headers`` is a Kafka record's header section as sent (``count:varint``
    then the headers), None for the other codecs; ``value`` is None for a
    Kafka record with a null value (a tombstone).
    """

    offset: int
    ts_ms: int
    key: bytes | None
    value: bytes | None
    headers: bytes | None


def block_key(pid: int, first_offset: int) -> bytes:
    """The LMDB key of a block: ``pid:u32 first_offset:u64`` (numeric order)."""
    return BLOCK_KEY.pack(pid, first_offset)


def unpack_block_key(key: bytes) -> tuple[int, int]:
    """``(pid, first_offset)`` of a block key."""
    pid, first = BLOCK_KEY.unpack(key)
    return pid, first


# ---------------------------------------------------------------- header


def _sealed_head(codec: int, compression: int, first: int, last: int, count: int,
                 first_ts: int, max_ts: int, body: bytes | memoryview) -> bytes:
    """The header of a block of ``body``, its CRC included."""
    if len(body) > _MAX_BODY:
        raise ProtocolError(f"a block body of {len(body)} bytes is over 4 GiB")
    if not 0 <= first <= last <= _U64_MAX:
        raise ProtocolError(f"block offsets {first}..{last} out of range")
    if not _I64_MIN <= first_ts <= _I64_MAX or not _I64_MIN <= max_ts <= _I64_MAX:
        raise ProtocolError("a block timestamp is outside 64 bits")
    head = HEADER.pack(MAGIC, VERSION, codec, compression, 0, 0, first, last, count, len(body),
                       first_ts, max_ts, 0)[:_CRC_AT]
    return head + _CRC.pack(crc32c(body, crc32c(head)))


def _seal(codec: int, compression: int, first: int, last: int, count: int,
          first_ts: int, max_ts: int, body: bytes | memoryview) -> bytes:
    return _sealed_head(codec, compression, first, last, count, first_ts, max_ts, body) + body


def crc_matches(value: bytes | memoryview) -> bool:
    """Whether a block's CRC-32C (of its header's first 48 bytes and its body) is the one its
    header holds: a block altered after it was sealed (bit rot) is found without decoding it
    (hardware CRC-32C: about 30 GB/s here, 35 us a MiB).  Compaction checks it; readers do
    not: at every read it cost a tenth of a bulk read and doubled a one-record read in the
    database layer (``dafka bench storedb``), and a block altered in a record's bytes but
    still well formed is served as stored, as a Kafka or Tank broker serves its log (a Kafka
    client's own CRC check finds a Kafka batch's)."""
    mv = memoryview(value)
    return bool(crc32c(mv[HEADER_SIZE:], crc32c(mv[:_CRC_AT])) == _CRC.unpack_from(mv, _CRC_AT)[0])


def decode_header(value: bytes | memoryview) -> BlockHeader:
    """The header of a stored block, checked for shape (magic, version, codec,
    sizes, offsets) but not against the body: see :func:`validate`."""
    if len(value) < HEADER_SIZE:
        raise ProtocolError(f"a block of {len(value)} bytes is shorter than its header")
    (magic, version, codec, compression, flags, reserved, first, last, count, body_size,
     first_ts, max_ts, crc) = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise ProtocolError(f"not a block (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(f"block version {version}, this code reads {VERSION}")
    if codec not in _CODECS:
        raise ProtocolError(f"unknown block codec {codec}")
    if flags or reserved:
        raise ProtocolError("reserved block header bits are set")
    if body_size != len(value) - HEADER_SIZE:
        raise ProtocolError(f"block header says {body_size} body bytes, the block holds {len(value) - HEADER_SIZE}")
    if count < 1 or last < first or last - first + 1 < count:
        raise ProtocolError(f"block of {count} records cannot span offsets {first}..{last}")
    if max_ts < first_ts:
        raise ProtocolError("block max_ts is before its first_ts")
    return BlockHeader(codec, compression, first, last, count, body_size, first_ts, max_ts, crc)


def validate(value: bytes | memoryview, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
             budget: int = DEFAULT_BUDGET) -> BlockHeader:
    """Check a whole stored block: header, CRC, and the body against the header.

    Raises ProtocolError on any disagreement; returns the header.
    """
    hdr = decode_header(value)
    mv = memoryview(value)
    if crc32c(mv[HEADER_SIZE:], crc32c(mv[:_CRC_AT])) != hdr.crc:
        raise ProtocolError("block CRC-32C mismatch")
    body = bytes(mv[HEADER_SIZE:])
    if hdr.codec == CODEC_TANK:
        s = _scan_tank(body, max_record_bytes, budget)
        span = hdr.record_count if s.first_seq is None else s.last_seq - s.first_seq + 1  # type: ignore[operator]
        got = (COMPRESSION_SNAPPY if s.snappy else 0, s.record_count, span, s.first_ts, s.max_ts)
    elif hdr.codec == CODEC_KAFKA:
        k = _scan_kafka(body, max_record_bytes, budget)
        if k.base_offset != hdr.first_offset:
            raise ProtocolError("a Kafka block's baseOffset is not its first offset")
        got = (k.compression, k.record_count, k.record_count, k.first_ts, k.max_ts)
    elif hdr.codec == CODEC_STORE:
        ts0, tsmax = _scan_store(body, hdr.record_count, max_record_bytes)
        got = (COMPRESSION_NONE, hdr.record_count, hdr.record_count, ts0, tsmax)
    else:
        d = _scan_dafka(body, hdr.record_count, hdr.first_ts, max_record_bytes)
        got = (COMPRESSION_NONE, hdr.record_count, hdr.record_count, hdr.first_ts, d)
    want = (hdr.compression, hdr.record_count, hdr.last_offset - hdr.first_offset + 1, hdr.first_ts, hdr.max_ts)
    if got != want:
        raise ProtocolError(f"block header disagrees with its records: header {want}, records {got}")
    return hdr


# ---------------------------------------------------------------- varints


def _uvarint(buf: bytes, pos: int, end: int, limit: int = 10) -> tuple[int, int]:
    """An unsigned LEB128 varint of at most ``limit`` bytes."""
    v = shift = 0
    stop = pos + limit
    while True:
        if pos >= end or pos >= stop:
            raise ProtocolError("malformed or truncated varint")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


def _zvarint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    v, pos = _uvarint(buf, pos, end)
    if v >> 64:
        raise ProtocolError("varint over 64 bits")
    return (v >> 1) ^ -(v & 1), pos


def _put_uvarint(n: int, out: bytearray) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zz(n: int) -> int:
    return (n << 1) ^ (n >> 63)


# ---------------------------------------------------------------- Tank bundles

_TANK_CODEC = 0x03
_TANK_COUNT_SHIFT = 2
_TANK_SPARSE = 0x40
_TANK_EXTRA = 0x80
_MSG_KEY, _MSG_LAST_TS, _MSG_SEQ_NEXT = 0x01, 0x02, 0x04
_SNAPPY_MAX_RATIO = 24  # a snappy block cannot expand more than ~21x
_TS = struct.Struct("<Q")


class _TankScan(NamedTuple):
    snappy: bool
    record_count: int
    first_seq: int | None  # sparse bundles only
    last_seq: int | None
    first_ts: int
    max_ts: int
    msgset: bytes  # the message set, inflated
    msgset_start: int


def _scan_tank(bundle: bytes, max_record_bytes: int, budget: int, contents: list[bytes] | None = None) -> _TankScan:
    """Walk a bundle's messages checking every length and the count; build nothing per message
    (but each message's content into ``contents``, when given).

    The pure-Python twin of the compiled walk (:func:`dafka.fastio.tank_scan`), which the
    ingest path uses."""
    end = len(bundle)
    if not end:
        raise ProtocolError("empty bundle")
    flags = bundle[0]
    if flags & _TANK_EXTRA:
        raise ProtocolError("bundle flags bit 7 (extra flags) is set")
    codec = flags & _TANK_CODEC
    if codec > 1:
        raise ProtocolError(f"unknown bundle codec {codec}")
    count = (flags >> _TANK_COUNT_SHIFT) & 0x0F
    pos = 1
    if not count:
        count, pos = _uvarint(bundle, pos, end, 5)
        if not count:
            raise ProtocolError("bundle with no messages")
    sparse = bool(flags & _TANK_SPARSE)
    first = last = None
    if sparse:
        if pos + 8 > end:
            raise ProtocolError("truncated sparse bundle header")
        first = _TS.unpack_from(bundle, pos)[0]
        pos += 8
        last = first
        if count != 1:
            gap, pos = _uvarint(bundle, pos, end, 5)
            last = first + gap + 1
        if last > _U64_MAX or last - first + 1 < count:
            raise ProtocolError("sparse bundle's seq range cannot hold its messages")
    msgset_start = pos
    if codec:
        data = bundle[pos:]
        size, _ = _uvarint(data, 0, len(data), 5)
        if size > budget or size > _SNAPPY_MAX_RATIO * len(data):
            raise ProtocolError(f"a snappy bundle claims {size} bytes, over the budget of {budget}")
        try:
            buf = snappy.uncompress(data)
        except Exception as exc:  # the backend's own error types
            raise ProtocolError(f"snappy decompression failed: {exc}") from exc
        pos, end = 0, len(buf)
    else:
        buf = bundle
    if count * 2 > end - pos:
        raise ProtocolError(f"message set too short for {count} messages")
    unpack_ts = _TS.unpack_from
    ts = first_ts = max_ts = -1
    prev = (first - 1) if first is not None else 0
    last_i = count - 1
    for i in range(count):
        if pos >= end:
            raise ProtocolError("truncated message set")
        f = buf[pos]
        pos += 1
        if f > 0x07:
            raise ProtocolError(f"unknown message flags 0x{f:02x}")
        if sparse:
            if f & _MSG_SEQ_NEXT:
                seq = prev + 1
            elif i == 0:
                seq = first
            elif i == last_i:
                seq = last
            else:
                gap, pos = _uvarint(buf, pos, end, 5)
                seq = prev + 1 + gap
            if (i == last_i and seq != last) or (i < last_i and seq >= last) or (i and seq <= prev):  # type: ignore[operator]
                raise ProtocolError("sparse message seqs disagree with the bundle header")
            prev = seq
        if f & _MSG_LAST_TS:
            if i == 0:
                raise ProtocolError("the first message of a bundle has no timestamp")
        else:
            if pos + 8 > end:
                raise ProtocolError("truncated message timestamp")
            ts = unpack_ts(buf, pos)[0]
            if ts > _I64_MAX:
                ts = _I64_MAX  # Tank timestamps are u64: kept in the bundle, counted as 2^63 - 1
            if i == 0:
                first_ts = max_ts = ts
            elif ts > max_ts:
                max_ts = ts
            pos += 8
        klen = 0
        if f & _MSG_KEY:
            if pos >= end:
                raise ProtocolError("truncated message key")
            klen = buf[pos]
            pos += 1 + klen
        n = buf[pos] if pos < end else 0x80
        if n < 0x80:
            pos += 1
        else:
            n, pos = _uvarint(buf, pos, end, 5)
        if n + klen > max_record_bytes:
            raise ProtocolError(f"a message of {n + klen} bytes is over max_record_bytes {max_record_bytes}")
        if contents is not None:
            contents.append(buf[pos:pos + n])
        pos += n
        if pos > end:
            raise ProtocolError("a message runs past the bundle")
    if pos != end:
        raise ProtocolError(f"{end - pos} trailing bytes after the bundle's messages")
    return _TankScan(bool(codec), count, first, last, first_ts, max_ts, buf, msgset_start)


def tank_block(bundle: bytes | memoryview, first_offset: int, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
               budget: int = DEFAULT_BUDGET) -> bytes:
    """A block holding ``bundle`` as received, its first message at ``first_offset``.

    A sparse bundle's messages keep their seq distances: the message with the
    bundle's first seq is at ``first_offset``.  Raises ProtocolError when the
    bundle is malformed or lies (count, lengths, seqs), a message is over
    ``max_record_bytes``, or a snappy bundle would inflate past ``budget``.
    The walk is the pure-Python :func:`_scan_tank` (this module is the format's
    reference and imports no compiled code: ``dafka.fastio``'s pure twins build on
    it); the gateway calls :func:`dafka.fastio.tank_scan` and :func:`tank_seal`.
    """
    return tank_seal(bundle, _scan_tank(bytes(bundle), max_record_bytes, budget), first_offset)


def tank_span(scan: Sequence[object]) -> int:
    """Offsets a bundle takes, from its :func:`dafka.fastio.tank_scan` result: its message
    count, or a sparse bundle's seq range (its header's first to last seq)."""
    if scan[2] is None:
        return scan[1]  # type: ignore[return-value]
    return scan[3] - scan[2] + 1  # type: ignore[operator,no-any-return]


def tank_seqs_continue(first: int | None, next_seq: int, scan: Sequence[object]) -> bool:
    """Whether a bundle (its :func:`dafka.fastio.tank_scan` result) continues a partition whose
    next seq is ``next_seq``, given the first seq its request names (a ProduceWithSeqnum's) or
    its own (a sparse bundle's); ``first`` None (neither): it always does.  It must start at
    that seq and, when sparse, also start there itself and span exactly its count: at or below
    the head is a resend, Dafka offsets have no gaps, and a block spanning more offsets than
    the partition moves on by was overlapped by the next produce's and dropped.  (The compiled
    ``tank_produce`` writes the same test.)"""
    if first is None:
        return True
    if first != next_seq:
        return False
    return scan[2] is None or (scan[2] == first and scan[3] == first + scan[1] - 1)  # type: ignore[operator]


def tank_seqs_are_offsets(value: bytes | memoryview, hdr: BlockHeader) -> bool:
    """Whether a stored Tank block's bundle, sent whole, shows a Tank client its records at
    their offsets + 1 (the seqs the store serves them at).  A plain bundle does (its seqs are
    given by the answer's base); a sparse one carries its own first seq, which must be its
    first offset + 1.  The gateway takes a sparse bundle only so today, but stored one at
    another offset before 29c6a24 (a ProduceWithSeqnum's sparse bundle beginning below the
    request's first seq: a bundle with gaps).  Reads the bundle's header only; one it cannot
    read (a damaged store: blocks are checked when written) is relayed as stored, as every
    bundle was before (the gateway does not walk what it relays)."""
    if len(value) <= HEADER_SIZE or not value[HEADER_SIZE] & _TANK_SPARSE:
        return True  # (a plain bundle: nothing copied)
    head = bytes(value[HEADER_SIZE : HEADER_SIZE + 14])  # flags, a count of 5 bytes at most, the first seq
    pos = 1
    if not (head[0] >> _TANK_COUNT_SHIFT) & 0x0F:
        try:
            _count, pos = _uvarint(head, pos, len(head), 5)
        except ProtocolError:
            return True
    if pos + 8 > len(head):
        return True
    return bool(_TS.unpack_from(head, pos)[0] == hdr.first_offset + 1)


def tank_seal(bundle: bytes | memoryview, scan: Sequence[object], first_offset: int) -> bytes:
    """The block of a bundle already walked by :func:`dafka.fastio.tank_scan` (``scan`` is its
    result), its first message at ``first_offset``: the header computed from the walk, the
    bundle copied once behind it."""
    return _seal(CODEC_TANK, COMPRESSION_SNAPPY if scan[0] else COMPRESSION_NONE, first_offset,
                 first_offset + tank_span(scan) - 1, scan[1], scan[4], scan[5], bundle)  # type: ignore[arg-type]


def tank_seal_in_place(bundle: memoryview, at: int, scan: Sequence[object], first_offset: int) -> memoryview:
    """As :func:`tank_seal`, without copying the bundle: ``bundle`` is a view of a bytearray
    from its byte ``at`` (:func:`dafka.fastio.view_start`), its header is written into the
    ``HEADER_SIZE`` bytes in front of it there, and the block is a view of the bytearray.

    The caller vouches that nothing it still reads lies in those bytes (the Tank gateway
    receives a produce request with room in front, and seals only its first bundle so: the
    bytes before it are the request's own fields, already decoded)."""
    whole = memoryview(bundle.obj)
    if at < HEADER_SIZE or at + len(bundle) > len(whole):
        raise ValueError(f"no room for a block header before a bundle at {at}")
    head = _sealed_head(CODEC_TANK, COMPRESSION_SNAPPY if scan[0] else COMPRESSION_NONE, first_offset,
                        first_offset + tank_span(scan) - 1, scan[1], scan[4], scan[5], bundle)  # type: ignore[arg-type]
    whole[at - HEADER_SIZE : at] = head
    return whole[at - HEADER_SIZE : at + len(bundle)]


# ---------------------------------------------------------------- Kafka record batches

_KAFKA_HEADER = struct.Struct(">qiibIhiqqqhii")  # 61 bytes
_KAFKA_CRC_START = 21
_ATTR_CODEC, _ATTR_LOG_APPEND_TIME, _ATTR_CONTROL = 0x07, 0x08, 0x20


class KafkaScan(NamedTuple):
    """What validating one magic-2 record batch found (:func:`scan_kafka`)."""

    base_offset: int
    compression: int
    record_count: int
    first_ts: int
    max_ts: int
    body: bytes  # the records, inflated
    start: int  # where the first record begins in body
    base_ts: int
    log_append_time: bool
    biggest: int  # the largest record's key + value + header bytes
    min_ts: int  # the smallest record timestamp (Kafka's "none" is -1)


class RecordTooLarge(ProtocolError):
    """A record is over ``max_record_bytes`` (a well-formed batch: the Kafka gateway answers
    MESSAGE_TOO_LARGE and keeps the connection)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a record of {size} bytes is over max_record_bytes {limit}")
        self.size = size
        self.limit = limit


def _inflate(codec: int, data: bytes, budget: int) -> bytes:
    if codec == COMPRESSION_SNAPPY and not data.startswith(b"\x82SNAPPY\x00"):
        size, _ = _uvarint(data, 0, len(data), 5)
        if size > budget:
            raise ProtocolError(f"a batch inflates past {budget} bytes")
        try:
            return bytes(snappy.uncompress(data))
        except Exception as exc:
            raise ProtocolError(f"snappy decompression failed: {exc}") from exc
    if codec == COMPRESSION_GZIP:
        try:
            d = zlib.decompressobj(47)
            out = d.decompress(data, budget + 1)
        except zlib.error as exc:
            raise ProtocolError(f"gzip decompression failed: {exc}") from exc
        if len(out) > budget:
            raise ProtocolError(f"a batch inflates past {budget} bytes")
        return out
    return _decompress(codec, data, [budget])  # the bounded decoders of lz4, zstd, xerial snappy


def scan_kafka(batch: bytes, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, budget: int = DEFAULT_BUDGET,
               *, control: bool = False) -> KafkaScan:
    """Validate one magic-2 record batch as a client sent it, building nothing per record.

    The header (length, magic, CRC-32C, count against ``lastOffsetDelta``,
    codec), the inflated body (at most ``budget`` bytes) and every record's
    framing (the compiled :func:`dafka.kafka.records.walk_records`).  Raises
    ProtocolError, :class:`RecordTooLarge` for a record over ``max_record_bytes``.
    Control batches are refused unless ``control``.
    """
    end = len(batch)
    if end < _KAFKA_HEADER.size:
        raise ProtocolError("record batch shorter than its header")
    (base, length, _epoch, magic, crc, attrs, last_delta, base_ts, max_ts_hdr, _pid, _pepoch, _bseq,
     count) = _KAFKA_HEADER.unpack_from(batch)
    if magic != 2:
        raise ProtocolError(f"record batch magic {magic}: only magic 2 is kept as a block")
    if length != end - 12:
        raise ProtocolError(f"record batch length {length} disagrees with its {end - 12} bytes")
    if crc32c(memoryview(batch)[_KAFKA_CRC_START:]) != crc:
        raise ProtocolError("record batch CRC-32C mismatch")
    if attrs & _ATTR_CONTROL and not control:
        raise ProtocolError("control batches are not stored")
    if count < 1 or last_delta != count - 1:
        raise ProtocolError(f"record count {count} disagrees with lastOffsetDelta {last_delta}")
    codec = attrs & _ATTR_CODEC
    if codec > COMPRESSION_ZSTD:
        raise ProtocolError(f"unknown compression codec {codec}")
    if codec:
        buf = _inflate(codec, batch[_KAFKA_HEADER.size:], budget)
        pos, bend = 0, len(buf)
    else:
        buf, pos, bend = bytes(batch), _KAFKA_HEADER.size, end
    start = pos
    if count > (bend - pos) // 7:  # a record takes at least 7 bytes
        raise ProtocolError(f"record count {count} does not fit the batch")
    first_ts, min_ts, max_ts, biggest, pos = walk_records(buf, pos, bend, count, base_ts)
    if pos != bend:
        raise ProtocolError(f"{bend - pos} trailing bytes after the batch's records")
    if biggest > max_record_bytes:
        raise RecordTooLarge(biggest, max_record_bytes)
    if attrs & _ATTR_LOG_APPEND_TIME:
        first_ts = min_ts = max_ts = max_ts_hdr
    return KafkaScan(base, codec, count, first_ts, max_ts, buf, start, base_ts,
                     bool(attrs & _ATTR_LOG_APPEND_TIME), biggest, min_ts)


_scan_kafka = scan_kafka


def kafka_block(batch: bytes, first_offset: int, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                budget: int = DEFAULT_BUDGET) -> bytes:
    """A block holding one magic-2 record batch as produced, its first record at ``first_offset``.

    The batch's ``baseOffset`` becomes ``first_offset`` and its
    ``partitionLeaderEpoch`` -1 (neither is under the batch CRC).  Raises
    ProtocolError when the batch is malformed or lies (length, CRC, count,
    offset deltas, record framing), a record is over ``max_record_bytes``, or
    it would inflate past ``budget``.  Control and transactional markers are
    refused (the gateway does not do transactions).
    """
    return kafka_block_of(batch, scan_kafka(batch, max_record_bytes, budget), first_offset)


def kafka_block_of(batch: bytes, k: KafkaScan, first_offset: int) -> bytes:
    """The block of a batch :func:`scan_kafka` validated (``k``), at ``first_offset``:
    a header, the batch's offset and epoch, and its bytes from its magic on (CRC and all)."""
    size = len(batch)
    if size > _MAX_BODY:
        raise ProtocolError(f"a block body of {size} bytes is over 4 GiB")
    last = first_offset + k.record_count - 1
    if not 0 <= first_offset <= last <= _U64_MAX:
        raise ProtocolError(f"block offsets {first_offset}..{last} out of range")
    head = HEADER.pack(MAGIC, VERSION, CODEC_KAFKA, k.compression, 0, 0, first_offset, last, k.record_count, size,
                       k.first_ts, k.max_ts, 0)[:_CRC_AT]
    lead = struct.pack(">qii", first_offset, size - 12, -1)
    rest = memoryview(batch)[16:]
    crc = crc32c(rest, crc32c(lead, crc32c(head)))
    return b"".join((head, struct.pack(">I", crc), lead, rest))  # one copy of the batch


# ---------------------------------------------------------------- the store's own codec


def dafka_block(recs: Sequence[tuple[int, bytes | None, bytes]], first_offset: int, *,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """A block of ``(ts_ms, key or None, content)`` records at consecutive offsets from ``first_offset``."""
    if not recs:
        raise ProtocolError("a block holds at least one record")
    first_ts = recs[0][0]
    max_ts = first_ts
    out = bytearray()
    part = bytearray()
    for ts, key, content in recs:
        if len(content) + (len(key) if key is not None else 0) > max_record_bytes:
            raise ProtocolError(f"a record is over max_record_bytes {max_record_bytes}")
        if not _I64_MIN <= ts - first_ts <= _I64_MAX:
            raise ProtocolError("a record timestamp is more than 2^63 ms from the block's first")
        if ts > max_ts:
            max_ts = ts
        part.clear()
        _put_uvarint(_zz(ts - first_ts), part)
        if key is None:
            part.append(1)  # zigzag(-1)
        else:
            _put_uvarint(_zz(len(key)), part)
            part += key
        _put_uvarint(len(part) + len(content), out)
        out += part
        out += content
    return _seal(CODEC_DAFKA, COMPRESSION_NONE, first_offset, first_offset + len(recs) - 1, len(recs),
                 first_ts, max_ts, bytes(out))


def _scan_dafka(body: bytes, count: int, first_ts: int, max_record_bytes: int) -> int:
    """Check the framing of a CODEC_DAFKA body of ``count`` records; returns the max timestamp."""
    pos, end = 0, len(body)
    if count > end // 3:  # a record takes at least 3 bytes
        raise ProtocolError(f"block body too short for {count} records")
    max_ts = first_ts
    for i in range(count):
        rlen, pos = _uvarint(body, pos, end)
        rend = pos + rlen
        if rend > end:
            raise ProtocolError("a record runs past the block")
        tsd, pos = _zvarint(body, pos, rend)
        if i == 0 and tsd:
            raise ProtocolError("the first record's timestamp is not the block's first_ts")
        klen, pos = _zvarint(body, pos, rend)
        if klen < -1 or pos + max(klen, 0) > rend:
            raise ProtocolError("a record's key runs outside it")
        if rend - pos > max_record_bytes:
            raise ProtocolError(f"a record is over max_record_bytes {max_record_bytes}")
        if first_ts + tsd > max_ts:
            max_ts = first_ts + tsd
        pos = rend
    if pos != end:
        raise ProtocolError(f"{end - pos} trailing bytes after the block's records")
    return max_ts


# ---------------------------------------------------------------- the store's block of format-1 values

_VALUE_HEADER = struct.Struct(">QB")  # a format-1 value's ts_ms:u64 flags:u8 (dafka.store.layout)
_FLAG_KEY = 0x01
_PAYLOAD = struct.Struct(">Q")
_STORE_BASE = HEADER_SIZE + 8  # where a CODEC_STORE block's ends table starts
_ENDS: dict[int, struct.Struct] = {}


def _ends(count: int) -> struct.Struct:
    """The struct of a ``count``-record ends table (cached for the common sizes)."""
    st = _ENDS.get(count)
    if st is None:
        st = struct.Struct(f">{count}I")
        if len(_ENDS) < 4096:
            _ENDS[count] = st
    return st


def store_block(first_offset: int, values: Sequence[bytes], payload: int, *, checked: bool = False) -> bytes:
    """A CODEC_STORE block of format-1 ``values`` at offsets ``first_offset, first_offset + 1, ...``.

    ``payload`` is their content plus key bytes (the writer knows it).  The
    timestamps come from the values: the first one's, and the largest (values
    begin with the big-endian timestamp, so the largest value bytewise has it).
    ``checked``: the caller built every value with its header (the writer), so
    their lengths are not checked again.
    """
    n = len(values)
    if not n:
        raise ProtocolError("a block holds at least one record")
    if not checked and min(map(len, values)) < _VALUE_HEADER.size:
        raise ProtocolError("a stored value is shorter than its header")
    # Where each record ends, counted from the block's first byte: a reader slices with no sums.
    ends = _ends(n).pack(*islice(accumulate(map(len, values), initial=_STORE_BASE + 4 * n), 1, None))
    # Format-1 timestamps are u64 (a Tank client may give any), the header's i64: one past
    # 2^63 - 1 is kept in the record and counts as 2^63 - 1 (never old enough to expire).
    first_ts = min(_PAYLOAD.unpack_from(values[0])[0], _I64_MAX)
    max_ts = min(_PAYLOAD.unpack_from(max(values))[0], _I64_MAX)
    body = b"".join((_PAYLOAD.pack(payload), ends, *values))
    return _seal(CODEC_STORE, COMPRESSION_NONE, first_offset, first_offset + n - 1, n, first_ts, max_ts, body)


def store_values(value: bytes | memoryview, hdr: BlockHeader, offset: int, n: int) -> list[bytes]:
    """Up to ``n`` format-1 values (bytes) of a CODEC_STORE block from ``offset`` (inside the block) on.

    Sliced by :func:`slice_block`, which checks the block's whole ends table first, whatever
    the slice: blocks are checked when written, not when read, and a damaged table (not
    increasing by a value's header at least, pointing outside the block, or whose last entry
    is not the block's end, as when the header's count is not the table's) raises
    ProtocolError rather than slicing wrong records.  (Readers on a hot path use the
    compiled twin, ``dafka.fastio.block_slice``: :func:`dafka.store.reader.block_values`.)
    """
    i = offset - hdr.first_offset
    if i < 0 or n <= 0 or i >= hdr.record_count:
        return []
    values = slice_block(value, offset, n)[2]
    if values is None:
        raise ProtocolError(f"a block of codec {hdr.codec} is not a CODEC_STORE block")
    return values


def slice_block(value: Any, offset: int, n: int) -> tuple[int, int, list[bytes] | None]:
    """``(first offset, last offset, values)`` of a stored block (bytes or a buffer), the pure-Python
    twin of the compiled ``dafka.fastio.block_slice`` (that twin is this function): its header
    checked for shape (:func:`decode_header`), and, for a CODEC_STORE block,
    up to ``n`` format-1 values from ``offset`` (clamped to the block's first) on; ``values``
    is None for the other codecs (their records need decoding).  Raises ProtocolError for a
    bad header or an ends table that points outside the block, backwards, or at a value
    shorter than its header, or whose last entry is not the block's end (a table of another
    count than the header's): the whole table is checked, whatever the slice (crossed
    entries inside the block bound wrong records that a check of the slice's own entries
    passes).  A block that ends before ``offset`` gives no values and is not checked further
    than its header: none of it is served (a read from a hole steps back onto the block
    before it only to see that; its damage raised from a read holding none of its offsets,
    and the callers refused the records after the hole, again and again).  The block's CRC
    is not checked on reads (see :func:`crc_matches`)."""
    hdr = decode_header(value)
    if offset > hdr.last_offset:
        return hdr.first_offset, hdr.last_offset, []
    first, count = hdr.first_offset, hdr.record_count
    if hdr.codec != CODEC_STORE:
        return first, hdr.last_offset, None
    i = offset - first if offset > first else 0
    j = i + n if i + n < count else count
    if n <= 0 or i >= j:
        return first, hdr.last_offset, []
    base = HEADER_SIZE + 8 + 4 * count  # payload:u64, then ends:u32 * count
    if base > len(value):
        raise ProtocolError("a CODEC_STORE block's ends table runs past its end")
    ends = struct.unpack_from(f">{count}I", value, HEADER_SIZE + 8)
    if ends[-1] != len(value):  # (the header's count is not the table's)
        raise ProtocolError("a CODEC_STORE block's ends table does not end at the block's end")
    if ends[0] < base + 9 or (count > 1 and min(map(operator.sub, ends[1:], ends)) < 9):
        # (9: a stored value's header, dafka.store.layout; the whole table, whatever the slice)
        raise ProtocolError("a CODEC_STORE block's ends table points outside it")
    bounds = ends[i - 1:j] if i else (base, *ends[:j])
    return first, hdr.last_offset, [bytes(value[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def store_payload(value: bytes | memoryview) -> int:
    """The payload bytes (content plus key) a CODEC_STORE block recorded."""
    return int(_PAYLOAD.unpack_from(value, HEADER_SIZE)[0])


def _scan_store(body: bytes, count: int, max_record_bytes: int) -> tuple[int, int]:
    """Check a CODEC_STORE body of ``count`` records; returns its first and max timestamps."""
    if len(body) < 8 + 4 * count + 9 * count:
        raise ProtocolError(f"block body too short for {count} records")
    ends = _ends(count).unpack_from(body, 8)
    base = 8 + 4 * count
    # The ends count from the block's first byte, the header included.
    if ends[-1] != len(body) + HEADER_SIZE:
        raise ProtocolError("a CODEC_STORE block's last record does not end at the block's end")
    prev = base + HEADER_SIZE
    payload = 0
    tss = []
    for e in ends:
        size = e - prev
        if size < 9:
            raise ProtocolError("a stored value is shorter than its header")
        at = prev - HEADER_SIZE
        ts, flags = _VALUE_HEADER.unpack_from(body, at)
        if flags & _FLAG_KEY:
            if size < 10 or 10 + body[at + 9] > size:
                raise ProtocolError("a stored value's key runs outside it")
            size -= 1
        if size - 9 > max_record_bytes:
            raise ProtocolError(f"a record is over max_record_bytes {max_record_bytes}")
        payload += size - 9
        tss.append(ts)
        prev = e
    if payload != _PAYLOAD.unpack_from(body)[0]:
        raise ProtocolError("a CODEC_STORE block's payload disagrees with its records")
    return min(tss[0], _I64_MAX), min(max(tss), _I64_MAX)


# ---------------------------------------------------------------- decoding records


def records(value: bytes | memoryview, start: int = 0) -> Iterator[BlockRecord]:
    """The records of a validated block at offsets >= ``start`` (per record: for tools, tests, slicing)."""
    hdr = decode_header(value)
    body = bytes(memoryview(value)[HEADER_SIZE:])
    if hdr.codec == CODEC_TANK:
        yield from _tank_records(body, hdr, start)
    elif hdr.codec == CODEC_STORE:
        off = max(start, hdr.first_offset)
        for v in store_values(bytes(value), hdr, off, hdr.record_count):
            ts, flags = _VALUE_HEADER.unpack_from(v)
            if flags & _FLAG_KEY:
                yield BlockRecord(off, ts, v[10:10 + v[9]], v[10 + v[9]:], None)
            else:
                yield BlockRecord(off, ts, None, v[9:], None)
            off += 1
    elif hdr.codec == CODEC_KAFKA:
        yield from _kafka_records(body, hdr, start)
    else:
        pos = 0
        for off in range(hdr.first_offset, hdr.last_offset + 1):
            rlen, p = _uvarint(body, pos, len(body))
            rend = p + rlen
            if off < start:
                pos = rend
                continue
            tsd, p = _zvarint(body, p, rend)
            klen, p = _zvarint(body, p, rend)
            key = None if klen < 0 else body[p:p + klen]
            p += max(klen, 0)
            yield BlockRecord(off, hdr.first_ts + tsd, key, body[p:rend], None)
            pos = rend


def _tank_records(body: bytes, hdr: BlockHeader, start: int) -> Iterator[BlockRecord]:
    from dafka.tank.bundle import CODEC_SNAPPY, decode_bundle, parse_bundle_header
    from dafka.tank.codec import decode_varint

    bundle = parse_bundle_header(body)
    if bundle.codec == CODEC_SNAPPY:
        # A stored bundle was checked against DEFAULT_BUDGET: a larger claim is a damaged
        # length, refused before inflating (decode_bundle bounds it at 24x the body only).
        size = decode_varint(body, bundle.msgset_start, bundle.end)[0]
        if size > DEFAULT_BUDGET:
            raise ProtocolError(f"a snappy bundle claims {size} bytes, over the budget of {DEFAULT_BUDGET}")
    msgs = decode_bundle(body, base_seq=0)
    first_seq = msgs[0][0] or 0
    for seq, ts, key, val in msgs:
        off = hdr.first_offset + (seq or 0) - first_seq
        if off >= start:
            yield BlockRecord(off, ts, None if key is None else bytes(key), bytes(val), None)


def _kafka_records(body: bytes, hdr: BlockHeader, start: int) -> Iterator[BlockRecord]:
    k = _scan_kafka(body, 1 << 31, DEFAULT_BUDGET)  # (what it was checked against when stored)
    buf, pos = k.body, k.start
    for i in range(k.record_count):
        rlen, pos = _zvarint(buf, pos, len(buf))
        rend = pos + rlen
        p = pos + 1
        tsd, p = _zvarint(buf, p, rend)
        _od, p = _zvarint(buf, p, rend)
        klen, p = _zvarint(buf, p, rend)
        key = None if klen < 0 else buf[p:p + klen]
        p += max(klen, 0)
        vlen, p = _zvarint(buf, p, rend)
        val = None if vlen < 0 else buf[p:p + vlen]
        p += max(vlen, 0)
        off = hdr.first_offset + i
        if off >= start:
            yield BlockRecord(off, k.max_ts if k.log_append_time else k.base_ts + tsd, key, val, buf[p:rend])
        pos = rend
