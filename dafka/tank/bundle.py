"""Tank bundles: the unit in which messages are produced, stored and fetched.

Layout (``tank_current.md``)::

    flags:u8          bits 0-1 codec (0 none, 1 snappy), bits 2-5 count when
                      1..15 (0: a varint count follows), bit 6 sparse,
                      bit 7 reserved (rejected)
    [count:varint]
    [first_seq:u64, [varint(last - first - 1) when count != 1]]   sparse only
    message set       raw-snappy compressed as a whole when codec = 1

    message: flags:u8 (1 key, 2 use last timestamp, 4 seq = prev + 1)
             [varint(seq - prev - 1)]   sparse middle messages without flag 4
             [ts_ms:u64]                unless flag 2
             [key_len:u8, key]          if flag 1
             length:varint, content

A decoded message is a plain tuple ``(seq, timestamp_ms, key, value)``: seq
is None for a non-sparse bundle decoded without a base sequence, key is None
when the message has none.  Tuples, not objects, because the gateway decodes
and encodes bundles of thousands of messages on its hot path.

A consume chunk (and a segment log) is a run of ``varint length + bundle``
whose last bundle may be cut short; :func:`decode_chunk` turns one into
messages with absolute sequence numbers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import NamedTuple

import snappy

from dafka.errors import ProtocolError
from dafka.tank.codec import (
    U64,
    UINT64_MAX,
    decode_varint,
    encode_varint,
    varint_is_truncated,
)

__all__ = [
    "BUNDLE_CODEC_MASK",
    "BUNDLE_COUNT_MASK",
    "BUNDLE_COUNT_SHIFT",
    "BUNDLE_EXTRA_FLAGS",
    "BUNDLE_SPARSE",
    "CODEC_NONE",
    "CODEC_SNAPPY",
    "COMPRESS_MIN_BYTES",
    "COMPRESS_MIN_MESSAGES",
    "MAX_INLINE_COUNT",
    "MAX_KEY_SIZE",
    "MSG_HAS_KEY",
    "MSG_SEQ_PREV_PLUS_ONE",
    "MSG_USE_LAST_TS",
    "BundleHeader",
    "ChunkResult",
    "Record",
    "choose_codec",
    "decode_bundle",
    "decode_chunk",
    "encode_bundle",
    "encode_chunk",
    "parse_bundle_header",
    "should_compress",
    "split_chunk",
]

# Bundle flags byte.
CODEC_NONE = 0
CODEC_SNAPPY = 1
BUNDLE_CODEC_MASK = 0x03
BUNDLE_COUNT_SHIFT = 2
BUNDLE_COUNT_MASK = 0x0F
BUNDLE_SPARSE = 0x40
#: Reserved "extra flags" bit: no broker or client sets it, so it is rejected.
BUNDLE_EXTRA_FLAGS = 0x80
MAX_INLINE_COUNT = 15

# Message flags byte.
MSG_HAS_KEY = 0x01
MSG_USE_LAST_TS = 0x02
MSG_SEQ_PREV_PLUS_ONE = 0x04
_MSG_KNOWN_FLAGS = 0x07

MAX_KEY_SIZE = 255
#: The C++ client compresses a bundle with more than this many messages ...
COMPRESS_MIN_MESSAGES = 512
#: ... or more than this many bytes of content + keys.
COMPRESS_MIN_BYTES = 1024

#: ``(seq or None, timestamp_ms, key or None, value)``
Record = tuple[int | None, int, bytes | None, bytes]

# A snappy block cannot expand more than ~21x (a 3-byte copy emits at most 64
# bytes); a larger claimed size is garbage and must not drive an allocation.
_SNAPPY_MAX_RATIO = 24

_FLAGS_TS = struct.Struct("<BQ")  # message flags followed by its timestamp
_BYTE = tuple(bytes((i,)) for i in range(256))
# The overwhelmingly common message header: no key, same timestamp, short value.
_SAME_TS_SHORT = tuple(bytes((MSG_USE_LAST_TS, n)) for n in range(128))
_SAME_TS = _BYTE[MSG_USE_LAST_TS]
_SAME_TS_KEY = _BYTE[MSG_USE_LAST_TS | MSG_HAS_KEY]
_NO_TS = object()  # "no timestamp yet": never equal to a caller's value


class BundleHeader(NamedTuple):
    """A parsed bundle header; ``msgset_start`` is where the message set begins."""

    codec: int
    count: int
    sparse: bool
    first_seq: int | None  # sparse bundles only
    last_seq: int | None  # sparse bundles only
    msgset_start: int
    end: int


class ChunkResult(NamedTuple):
    """What :func:`decode_chunk` found in one partition's chunk."""

    records: list[Record]
    #: Sequence number after the last complete bundle (None: no bundle and no base).
    next_seq: int | None
    #: Complete bundles decoded or skipped.
    bundles: int
    #: Trailing bytes of a cut-short last bundle, ignored (0 when none).
    partial_bytes: int
    #: Full size (length prefix + bundle) of that cut bundle, when its length
    #: prefix was readable: a fetch at least this large returns it whole.
    partial_size: int | None


# ---------------------------------------------------------------- compression rule


def should_compress(message_count: int, content_bytes: int) -> bool:
    """The C++ client's rule: more than 512 messages or more than 1 KiB of content + keys."""
    return message_count > COMPRESS_MIN_MESSAGES or content_bytes > COMPRESS_MIN_BYTES


def choose_codec(records: Sequence[Record]) -> int:
    """CODEC_SNAPPY when :func:`should_compress` says so for ``records``, else CODEC_NONE."""
    if len(records) > COMPRESS_MIN_MESSAGES:
        return CODEC_SNAPPY
    total = 0
    for _seq, _ts, key, value in records:
        total += len(value)
        if key:
            total += len(key)
    return CODEC_SNAPPY if total > COMPRESS_MIN_BYTES else CODEC_NONE


# ---------------------------------------------------------------- encoding


def _encode_plain(records: Iterable[Record], parts: list[bytes]) -> None:
    app = parts.append
    pack_flags_ts = _FLAGS_TS.pack
    same_short = _SAME_TS_SHORT
    byte = _BYTE
    last_ts: object = _NO_TS
    for _seq, ts, key, value in records:
        n = len(value)
        if key is None:
            if ts == last_ts:
                app(same_short[n] if n < 128 else _SAME_TS + encode_varint(n))
            else:
                last_ts = ts
                app(pack_flags_ts(0, ts))
                app(byte[n] if n < 128 else encode_varint(n))
        else:
            kl = len(key)
            if kl > MAX_KEY_SIZE:
                raise ProtocolError(f"a key is {kl} bytes, more than {MAX_KEY_SIZE}")
            if ts == last_ts:
                app(_SAME_TS_KEY)
            else:
                last_ts = ts
                app(pack_flags_ts(MSG_HAS_KEY, ts))
            app(byte[kl])
            app(key)
            app(byte[n] if n < 128 else encode_varint(n))
        app(value)


def _encode_sparse(records: Sequence[Record], parts: list[bytes]) -> None:
    app = parts.append
    pack_ts = U64.pack
    byte = _BYTE
    last_ts: object = _NO_TS
    last_idx = len(records) - 1
    prev = -1
    for i, (seq, ts, key, value) in enumerate(records):
        if seq is None:
            raise ProtocolError("every message of a sparse bundle needs a sequence number")
        flags = 0
        delta = b""
        if i:
            if seq <= prev:
                raise ProtocolError("sparse sequence numbers must strictly increase")
            # First and last seqs live in the bundle header; like the C++
            # client, only middle messages carry flag 4 or a gap.
            if i != last_idx:
                gap = seq - prev - 1
                if gap:
                    delta = encode_varint(gap)
                else:
                    flags = MSG_SEQ_PREV_PLUS_ONE
        prev = seq
        if ts == last_ts:
            flags |= MSG_USE_LAST_TS
            tsb = b""
        else:
            last_ts = ts
            tsb = pack_ts(ts)
        if key is not None:
            kl = len(key)
            if kl > MAX_KEY_SIZE:
                raise ProtocolError(f"a key is {kl} bytes, more than {MAX_KEY_SIZE}")
            app(byte[flags | MSG_HAS_KEY] + delta + tsb + byte[kl])
            app(key)
        else:
            app(byte[flags] + delta + tsb)
        n = len(value)
        app(byte[n] if n < 128 else encode_varint(n))
        app(value)


def encode_bundle(
    records: Sequence[Record], *, codec: int | None = None, sparse: bool = False
) -> bytes:
    """Encode ``records`` (``(seq, ts_ms, key, value)`` tuples) as one bundle.

    ``codec`` None applies :func:`choose_codec` (the C++ client's rule);
    CODEC_NONE or CODEC_SNAPPY force one.  A non-sparse bundle ignores the
    seqs (the broker assigns them); a sparse one needs strictly increasing
    seqs and stores them.  Raises ProtocolError for values the format cannot
    carry (no messages, key over 255 bytes, timestamp outside u64, ...).
    """
    count = len(records)
    if count == 0:
        raise ProtocolError("a bundle holds at least one message")
    if codec is None:
        codec = choose_codec(records)
    elif codec != CODEC_NONE and codec != CODEC_SNAPPY:
        raise ProtocolError(f"unknown bundle codec {codec}")
    flags = codec | (BUNDLE_SPARSE if sparse else 0)
    parts: list[bytes] = [b""]  # slot 0: the header, filled below
    try:
        if sparse:
            _encode_sparse(records, parts)
        else:
            _encode_plain(records, parts)
        if count <= MAX_INLINE_COUNT:
            head = _BYTE[flags | count << BUNDLE_COUNT_SHIFT]
        else:
            head = _BYTE[flags] + encode_varint(count)
        if sparse:
            first = records[0][0]
            head += U64.pack(first)
            if count != 1:
                head += encode_varint(records[-1][0] - first - 1)
    except struct.error as exc:
        raise ProtocolError(f"a message field is out of range: {exc}") from exc
    if codec == CODEC_SNAPPY:
        return head + snappy.compress(b"".join(parts))
    parts[0] = head
    return b"".join(parts)


def encode_chunk(bundles: Iterable[bytes]) -> bytes:
    """A chunk (or segment log run): each bundle prefixed by its varint length."""
    parts: list[bytes] = []
    for b in bundles:
        parts.append(encode_varint(len(b)))
        parts.append(b)
    return b"".join(parts)


# ---------------------------------------------------------------- decoding


def parse_bundle_header(buf: bytes, start: int = 0, end: int | None = None) -> BundleHeader:
    """Parse the header of the bundle at ``buf[start:end]`` (no message decoding)."""
    if end is None:
        end = len(buf)
    if start >= end:
        raise ProtocolError("empty bundle")
    flags = buf[start]
    pos = start + 1
    if flags & BUNDLE_EXTRA_FLAGS:
        raise ProtocolError("bundle flags bit 7 (extra flags) is set")
    codec = flags & BUNDLE_CODEC_MASK
    if codec > CODEC_SNAPPY:
        raise ProtocolError(f"unknown bundle codec {codec}")
    count = (flags >> BUNDLE_COUNT_SHIFT) & BUNDLE_COUNT_MASK
    if not count:
        count, pos = decode_varint(buf, pos, end)
        if not count:
            raise ProtocolError("bundle with no messages")
    sparse = bool(flags & BUNDLE_SPARSE)
    first = last = None
    if sparse:
        if pos + 8 > end:
            raise ProtocolError("truncated sparse bundle header")
        first = U64.unpack_from(buf, pos)[0]
        pos += 8
        if count != 1:
            gap, pos = decode_varint(buf, pos, end)
            last = first + gap + 1
            if last > UINT64_MAX:
                raise ProtocolError("sparse bundle's last sequence number exceeds 64 bits")
        else:
            last = first
    return BundleHeader(codec, count, sparse, first, last, pos, end)


def _uncompress(data: bytes) -> bytes:
    try:
        size, _ = decode_varint(data)
    except ProtocolError as exc:
        raise ProtocolError(f"bad snappy block length: {exc}") from None
    if size > _SNAPPY_MAX_RATIO * len(data):
        raise ProtocolError("snappy block claims an impossible uncompressed size")
    try:
        return snappy.uncompress(data)
    except Exception as exc:  # snappy.UncompressError or whatever the backend raises
        raise ProtocolError(f"snappy decompression failed: {exc}") from exc


def _decode_plain(
    buf: bytes, pos: int, end: int, count: int, base: int | None, out: list[Record]
) -> int:
    # Bounds: buf[i] past the buffer raises IndexError and unpack_from raises
    # struct.error (caught by the caller); reads past ``end`` but inside a
    # larger buffer push pos beyond end, which the caller rejects.
    app = out.append
    unpack_ts = U64.unpack_from
    ts = None
    if buf[pos] & MSG_USE_LAST_TS:  # only the first message could lack one
        raise ProtocolError("the first message of a bundle has no timestamp")
    for seq in repeat(None, count) if base is None else range(base, base + count):
        f = buf[pos]
        if f == MSG_USE_LAST_TS:
            # Fast path, nearly every message: no key, same timestamp.
            n = buf[pos + 1]
            if n < 0x80:
                pos += 2
                app((seq, ts, None, buf[pos : pos + n]))
                pos += n
                continue
            pos += 1
            key = None
        else:
            if f > _MSG_KNOWN_FLAGS:
                raise ProtocolError(f"unknown message flags 0x{f:02x}")
            if f & MSG_USE_LAST_TS:
                pos += 1
            else:
                ts = unpack_ts(buf, pos + 1)[0]
                pos += 9
            if f & MSG_HAS_KEY:
                kl = buf[pos] + pos + 1
                key = buf[pos + 1 : kl]
                pos = kl
            else:
                key = None
        n = buf[pos]
        if n < 0x80:
            pos += 1
        else:
            n, pos = decode_varint(buf, pos, end)
        app((seq, ts, key, buf[pos : pos + n]))
        pos += n
    return pos


def _decode_sparse(
    buf: bytes, pos: int, end: int, count: int, first: int, last: int, out: list[Record]
) -> int:
    app = out.append
    unpack_ts = U64.unpack_from
    ts = None
    prev = first - 1
    last_idx = count - 1
    for i in range(count):
        f = buf[pos]
        pos += 1
        if f > _MSG_KNOWN_FLAGS:
            raise ProtocolError(f"unknown message flags 0x{f:02x}")
        if f & MSG_SEQ_PREV_PLUS_ONE:
            seq = prev + 1
        elif i == 0:
            seq = first
        elif i == last_idx:
            seq = last
        else:
            gap = buf[pos]
            if gap < 0x80:
                pos += 1
            else:
                gap, pos = decode_varint(buf, pos, end)
            seq = prev + 1 + gap
        if i == last_idx:
            if seq != last:
                raise ProtocolError("sparse message seqs disagree with the bundle header")
        elif seq >= last:
            raise ProtocolError("a sparse message seq reaches the bundle's last seq early")
        prev = seq
        if f & MSG_USE_LAST_TS:
            if ts is None:
                raise ProtocolError("the first message of a bundle has no timestamp")
        else:
            ts = unpack_ts(buf, pos)[0]
            pos += 8
        if f & MSG_HAS_KEY:
            kl = buf[pos] + pos + 1
            key = buf[pos + 1 : kl]
            pos = kl
        else:
            key = None
        n = buf[pos]
        if n < 0x80:
            pos += 1
        else:
            n, pos = decode_varint(buf, pos, end)
        app((seq, ts, key, buf[pos : pos + n]))
        pos += n
    return pos


def _decode_into(buf: bytes, hdr: BundleHeader, base: int | None, out: list[Record]) -> None:
    """Append the messages of the bundle described by ``hdr`` to ``out``."""
    if hdr.codec == CODEC_SNAPPY:
        buf = _uncompress(buf[hdr.msgset_start : hdr.end])
        pos, end = 0, len(buf)
    else:
        pos, end = hdr.msgset_start, hdr.end
    # Every message takes at least two bytes (flags, length): a cheap bound
    # that stops absurd counts before any work.
    if hdr.count * 2 > end - pos:
        raise ProtocolError(f"message set too short for {hdr.count} messages")
    try:
        if hdr.sparse:
            pos = _decode_sparse(buf, pos, end, hdr.count, hdr.first_seq, hdr.last_seq, out)  # type: ignore[arg-type]
        else:
            pos = _decode_plain(buf, pos, end, hdr.count, base, out)
    except (IndexError, struct.error):
        raise ProtocolError("truncated message set") from None
    if pos > end:
        raise ProtocolError("truncated message set (a message runs past the bundle)")
    if pos < end:
        raise ProtocolError(f"{end - pos} trailing bytes after the bundle's messages")


def decode_bundle(
    data: bytes, start: int = 0, end: int | None = None, *, base_seq: int | None = None
) -> list[Record]:
    """Decode the bundle at ``data[start:end]`` into ``(seq, ts, key, value)`` tuples.

    Sparse bundles carry their seqs.  For other bundles seq is
    ``base_seq + index`` when ``base_seq`` is given, else None.
    """
    buf = data if type(data) is bytes else bytes(data)
    hdr = parse_bundle_header(buf, start, end)
    out: list[Record] = []
    _decode_into(buf, hdr, base_seq, out)
    return out


def split_chunk(chunk: bytes) -> tuple[list[tuple[int, int]], int]:
    """``([(start, end) of each complete bundle], partial trailing bytes)``.

    The bundles are not decoded (the gateway relays them as stored).
    """
    buf = chunk if type(chunk) is bytes else bytes(chunk)
    end = len(buf)
    pos = 0
    spans: list[tuple[int, int]] = []
    while pos < end:
        if varint_is_truncated(buf, pos, end):
            break
        size, start = decode_varint(buf, pos, end)
        stop = start + size
        if stop > end:
            break
        spans.append((start, stop))
        pos = stop
    return spans, end - pos


def decode_chunk(chunk: bytes, base_seq: int | None, min_seq: int = 0) -> ChunkResult:
    """Decode a consume chunk into messages with absolute sequence numbers.

    ``base_seq`` is the partition's base from the response header: the seq of
    the chunk's first message.  It is None for flags 0xfe, when the first
    bundle is sparse and carries its own.  Each non-sparse bundle continues
    where the previous bundle ended; a sparse bundle restarts at its header's
    first seq.  Messages below ``min_seq`` are dropped (a chunk may begin
    before the requested seq) and bundles wholly below it are not decoded.
    A cut-short last bundle is ignored and reported in the result.
    """
    buf = chunk if type(chunk) is bytes else bytes(chunk)
    end = len(buf)
    pos = 0
    seq = base_seq
    out: list[Record] = []
    bundles = 0
    partial_size: int | None = None
    while pos < end:
        if varint_is_truncated(buf, pos, end):
            break
        size, start = decode_varint(buf, pos, end)
        stop = start + size
        if stop > end:
            partial_size = stop - pos
            break
        hdr = parse_bundle_header(buf, start, stop)
        if hdr.sparse:
            first: int = hdr.first_seq  # type: ignore[assignment]
            last: int = hdr.last_seq  # type: ignore[assignment]
        elif seq is None:
            raise ProtocolError("chunk starts with a non-sparse bundle but has no base seq")
        else:
            first = seq
            last = seq + hdr.count - 1
        if last >= min_seq:
            if first >= min_seq:
                _decode_into(buf, hdr, first, out)
            else:
                part: list[Record] = []
                _decode_into(buf, hdr, first, part)
                out.extend([r for r in part if r[0] >= min_seq])  # type: ignore[operator]
        seq = last + 1
        bundles += 1
        pos = stop
    return ChunkResult(out, seq, bundles, end - pos, partial_size)
