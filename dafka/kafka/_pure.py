"""The per-record loops of Kafka record batches v2, in pure Python.

The twin of the compiled :mod:`dafka.kafka._compiled` (same functions, same
results, same errors); :mod:`dafka.kafka.records` picks one at import.  Both
work on 64-bit integers as Kafka does: a varint is at most 10 bytes and
never above 64 bits, timestamps are signed 64-bit.

* :func:`decode_records`: the records of one (uncompressed) batch body, with
  a summary the server needs without another pass (the largest stored key
  slot, the smallest timestamp);
* :func:`encode_batch`: one uncompressed batch from the store's values;
* :func:`walk_records`: check the records of one batch body without building
  anything per record (a batch stored as sent, :mod:`dafka.store.block`).
"""

from __future__ import annotations

import struct
from typing import Any

from crc32c import crc32c

from dafka.errors import ProtocolError

IMPLEMENTATION = "pure"
#: The functions' signatures and results (the compiled twin must give the same to be used).
RECORDS_ABI = 3

_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1
_U64 = (1 << 64) - 1
_FLAG_KEY = 0x01  # dafka.store.layout.FLAG_KEY
_FLAG_KAFKA = 0x04  # dafka.store.layout.FLAG_KAFKA
_FLAG_NULL = 0x08  # dafka.store.layout.FLAG_NULL
_NO_HEADERS = b"\x00"
_new = tuple.__new__


def zigzag(n: int) -> bytes:
    """The zigzag varint of ``n`` (Kafka's signed varint / varlong, 64-bit)."""
    v = ((n << 1) ^ (n >> 63)) & _U64
    if v < 0x80:
        return _SMALL[v]
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


_SMALL = tuple(bytes((i,)) for i in range(128))
# Zigzag varints of 0..8191, the offset deltas and lengths of most records.
_ZZ = tuple(zigzag(i) for i in range(1 << 13))


def varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """A zigzag varint at ``pos``: ``(value, next pos)``; at most 10 bytes, 64 bits."""
    if pos >= end:
        raise ProtocolError("record truncated inside a varint")
    b = buf[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    v = b & 0x7F
    shift = 7
    pos += 1
    while True:
        if pos >= end:
            raise ProtocolError("malformed varint in a record")
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise ProtocolError("malformed varint in a record")
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return (v >> 1) ^ -(v & 1), pos
        shift += 7


def check_headers(buf: bytes, p: int, end: int) -> None:
    """The header section ``buf[p:end]`` must parse exactly (count, then key/value pairs)."""
    n, p = varint(buf, p, end)
    if n < 0:
        raise ProtocolError("negative header count")
    for _ in range(n):
        klen, p = varint(buf, p, end)
        if klen < 0 or klen > end - p:
            raise ProtocolError("header key overruns its record")
        p += klen
        vlen, p = varint(buf, p, end)
        if vlen > 0:
            if vlen > end - p:
                raise ProtocolError("header value overruns its record")
            p += vlen
    if p != end:
        raise ProtocolError("stray bytes after a record's headers")


def decode_records(
    body: bytes, start: int, end: int, count: int, base_ts: int, fixed_ts: int | None, rtype: Any
) -> tuple[list[Any], int, int, int]:
    """``(records, largest key slot, smallest timestamp, null values)`` of ``count`` records
    in ``body[start:end]``.

    Each record is ``rtype((timestamp, key, value, headers))``: key None for
    a null key, value None for a null value (a tombstone), headers the record's header
    section as sent (``b"\\x00"``: none).  The key slot is what the store
    keeps beside the content: the key, or with headers the key and headers
    in record form (:func:`dafka.kafka.records.make_ext`).  ``fixed_ts``
    (log-append time) replaces every record's own timestamp.
    """
    if not 0 <= start <= end <= len(body):
        raise ValueError("record range outside the buffer")
    out: list[Any] = []
    app = out.append
    max_slot = 0
    min_ts = _I64_MAX
    nulls = 0
    p = start
    for _ in range(count):
        rlen, p = varint(body, p, end)
        if rlen < 6 or rlen > end - p:
            raise ProtocolError("record length overruns its batch")
        rend = p + rlen
        p += 1  # record attributes (unused)
        tsd, p = varint(body, p, rend)
        _od, p = varint(body, p, rend)
        klen, p = varint(body, p, rend)
        if klen < 0:
            key = None
            kslot = 1  # the null key's varint
        else:
            if klen > rend - p:
                raise ProtocolError("record key overruns its record")
            key = body[p : p + klen]
            p += klen
            kslot = len(_ZZ[klen]) + klen if klen < 8192 else len(zigzag(klen)) + klen
        vlen, p = varint(body, p, rend)
        if vlen < 0:
            value = None
            nulls += 1
        else:
            if vlen > rend - p:
                raise ProtocolError("record value overruns its record")
            value = body[p : p + vlen]
            p += vlen
        if p == rend or (rend - p == 1 and body[p] == 0):
            headers = _NO_HEADERS
            slot = klen if klen > 0 else 0
        else:
            check_headers(body, p, rend)
            headers = body[p:rend]
            slot = kslot + rend - p
        if slot > max_slot:
            max_slot = slot
        if fixed_ts is not None:
            ts = fixed_ts
        else:
            ts = base_ts + tsd
            if ts > _I64_MAX or ts < _I64_MIN:
                raise ProtocolError("record timestamp out of range")
        if ts < min_ts:
            min_ts = ts
        app(_new(rtype, (ts, key, value, headers)))
        p = rend
    if p != end:
        raise ProtocolError(f"{end - p} stray bytes after the records of a batch")
    return out, max_slot, min_ts, nulls


def _key_parts(v: bytes, size: int) -> tuple[bytes, bytes, int]:
    """``(key part, header part, content start)`` of a stored value, in record form."""
    flags = v[8]
    if not flags & _FLAG_KEY:
        return b"\x01", _NO_HEADERS, 9
    if size < 10 or 10 + v[9] > size:
        raise ValueError("malformed stored value (its key overruns it)")
    kl = v[9]
    cstart = 10 + kl
    if flags & _FLAG_KAFKA:
        # The slot holds zigzag(keyLength) key headers, as the record carried them.
        try:
            klen, p = varint(v, 10, cstart)
        except ProtocolError:
            klen, p = -2, 0
        if klen == -1 or 0 <= klen <= cstart - p:
            kend = p + max(klen, 0)
            return v[10:kend], (v[kend:cstart] or _NO_HEADERS), cstart
        # A slot that does not parse: hand it over as the key, whole.
    return (_ZZ[kl] + v[10:cstart]), _NO_HEADERS, cstart


_TAIL = struct.Struct(">hiqqqhii")
_HEAD = struct.Struct(">qiibI")
_TS = struct.Struct(">q")


def encode_batch(base_offset: int, values: list[bytes], limit: int | None = None) -> bytes:
    """One uncompressed v2 batch of stored values (``ts:u64 flags:u8 [klen key] content``)
    at offsets ``base_offset, base_offset + 1, ...``.

    With ``limit``, only the first values that fit are encoded (at least
    one): those whose sizes plus 8 bytes each, plus the batch's 61-byte
    header, come to at most ``limit`` (a record costs about its stored size
    plus a few varints); the values past them are not looked at.

    Timestamps are read as signed 64-bit (Kafka's type); a value shorter than
    its header or whose key overruns it raises ValueError.
    """
    n = len(values)
    if not n:
        return b""
    if limit is not None:
        room = limit - 61
        cost = 0
        for i, v in enumerate(values):
            if type(v) is not bytes:
                raise TypeError("stored values must be bytes")
            cost += len(v) + 8
            if cost > room and i > 0:
                values = values[:i]
                n = i
                break
    zz = _ZZ
    parts: list[bytes] = []
    app = parts.append
    extend = parts.extend
    unpack_ts = _TS.unpack_from
    if len(values[0]) < 9:
        raise ValueError("stored value shorter than its header")
    # Negative stored timestamps (a u64 past 2^63 from a Tank client) as 0, as the
    # compiled twin does: every delta and base + delta then fit int64.
    base_ts = max_ts = max(unpack_ts(values[0])[0], 0)
    last_ts = b""
    ts_part = b"\x00\x00"
    for i, v in enumerate(values):
        size = len(v)
        if size < 9:
            raise ValueError("stored value shorter than its header")
        tsb = v[:8]
        if tsb != last_ts:
            ts = max(unpack_ts(v)[0], 0)
            if ts > max_ts:
                max_ts = ts
            d = ts - base_ts
            if d > _I64_MAX or d < _I64_MIN:  # wraps as 64-bit arithmetic does
                d = ((d - _I64_MIN) & _U64) + _I64_MIN
            ts_part = b"\x00" + (zz[d] if 0 <= d < 8192 else zigzag(d))  # attributes, timestamp delta
            last_ts = tsb
        od = zz[i] if i < 8192 else zigzag(i)
        if not v[8] & _FLAG_KEY:
            vl = size - 9
            vlb = zz[vl] if vl < 8192 else zigzag(vl)
            if vl == 0 and v[8] & _FLAG_NULL:
                vlb = b"\x01"  # zigzag(-1): a null value
            body_size = len(ts_part) + len(od) + 1 + len(vlb) + vl + 1
            app(zz[body_size] if body_size < 8192 else zigzag(body_size))
            extend((ts_part, od, b"\x01", vlb, v[9:], _NO_HEADERS))
            continue
        kpart, hpart, cstart = _key_parts(v, size)
        vl = size - cstart
        vlb = zz[vl] if vl < 8192 else zigzag(vl)
        if vl == 0 and v[8] & _FLAG_NULL:
            vlb = b"\x01"
        body_size = len(ts_part) + len(od) + len(kpart) + len(vlb) + vl + len(hpart)
        app(zz[body_size] if body_size < 8192 else zigzag(body_size))
        extend((ts_part, od, kpart, vlb, v[cstart:], hpart))
    tail = _TAIL.pack(0, n - 1, base_ts, max_ts, -1, -1, -1, n) + b"".join(parts)
    return _HEAD.pack(base_offset, len(tail) + 9, -1, 2, crc32c(tail)) + tail


_VALUE_HEADER = struct.Struct(">QB")  # dafka.store.layout.VALUE_HEADER
_RECORD_KEY = struct.Struct(">IQ")  # dafka.store.layout.RECORD_KEY
_FLAG_PRODUCER_TS = 0x02  # dafka.store.layout.FLAG_PRODUCER_TS
_MAX_SLOT = 255


def store_pairs(records: list[Any], pid: int, first: int) -> tuple[list[tuple[bytes, bytes]], int]:
    """The store's LMDB ``(key, value)`` pairs of decoded records at offsets ``first, ...``
    of partition ``pid``, and their payload bytes (content plus key slot).

    The values are the ones :meth:`dafka.store.db.RecordDB.append` writes for
    the gateway's record tuples: a record without key or headers is
    ``ts flags=0 content``; with a key ``ts FLAG_KEY|FLAG_PRODUCER_TS klen key
    content``; with headers the key slot holds the key and headers in record
    form, flagged FLAG_KAFKA too.  A null value (None) is stored empty, flagged
    FLAG_NULL (and FLAG_PRODUCER_TS).  A timestamp outside 0..2**64-1 or a slot
    over 255 bytes raises ValueError (the caller checks both first).
    """
    if not 0 <= pid <= 0xFFFFFFFF:
        raise ValueError("partition id out of range")
    pairs: list[tuple[bytes, bytes]] = []
    app = pairs.append
    pack_key = _RECORD_KEY.pack
    pack_hdr = _VALUE_HEADER.pack
    nbytes = 0
    off = first
    last_ts = None
    plain = b""
    for ts, key, value, headers in records:
        if ts != last_ts:
            if not 0 <= ts <= _U64:
                raise ValueError("record field out of range: timestamp")
            plain = pack_hdr(ts, 0)
            last_ts = ts
        null = 0
        if value is None:
            value = b""
            null = _FLAG_NULL | _FLAG_PRODUCER_TS
        if headers == _NO_HEADERS:
            if key is None:
                v = plain + value if not null else pack_hdr(ts, null)
            else:
                if len(key) > _MAX_SLOT:
                    raise ValueError(f"record key of {len(key)} bytes, at most {_MAX_SLOT}")
                v = pack_hdr(ts, _FLAG_KEY | _FLAG_PRODUCER_TS | null) + _SMALL_LEN[len(key)] + key + value
                nbytes += len(key)
        else:
            if key is None:
                slot = b"\x01" + headers
            else:
                klen = len(key)
                slot = (_ZZ[klen] if klen < 8192 else zigzag(klen)) + key + headers
            if len(slot) > _MAX_SLOT:
                raise ValueError(f"record key and headers of {len(slot)} bytes, at most {_MAX_SLOT}")
            v = pack_hdr(ts, _FLAG_KEY | _FLAG_PRODUCER_TS | _FLAG_KAFKA | null) + _SMALL_LEN[len(slot)] + slot + value
            nbytes += len(slot)
        nbytes += len(value)
        app((pack_key(pid, off), v))
        off += 1
    return pairs, nbytes


_SMALL_LEN = tuple(bytes((i,)) for i in range(256))


def walk_records(buf: bytes, pos: int, end: int, count: int, base_ts: int) -> tuple[int, int, int, int, int]:
    """Check the framing of ``count`` records from ``buf[pos:end]`` (an inflated batch body)
    building nothing per record: ``(first_ts, min_ts, max_ts, biggest, end of the last record)``.

    Refused (ProtocolError): a length, key, value or header running outside its record
    or fields not ending where the record's length says, record attributes other than 0
    (unused; kafka-python reads the byte as a varint, the Java client as int8), offset
    deltas other than 0, 1, 2, ..., negative lengths other than a null key or value (-1)
    or a null header value, a negative header count, a timestamp outside int64.
    ``biggest`` is the largest record's key + value + header bytes (what
    ``max_record_bytes`` bounds); the timestamps are ``base_ts`` for no record.  Trailing bytes after the last record are the caller's to refuse.
    """
    if not 0 <= pos <= end <= len(buf):
        raise ValueError("record range outside the buffer")
    first_ts = min_ts = max_ts = base_ts
    biggest = 0
    for i in range(count):
        rlen, pos = varint(buf, pos, end)
        if rlen < 6 or rlen > end - pos:
            raise ProtocolError("a record's length runs outside the batch")
        rend = pos + rlen
        if buf[pos]:
            raise ProtocolError(f"record {i} has attributes 0x{buf[pos]:02x}")
        tsd, p = varint(buf, pos + 1, rend)
        od, p = varint(buf, p, rend)
        if od != i:
            raise ProtocolError(f"record {i} has offset delta {od}")
        ts = base_ts + tsd
        if ts > _I64_MAX or ts < _I64_MIN:
            raise ProtocolError("record timestamp out of range")
        if not i:
            first_ts = min_ts = max_ts = ts
        elif ts > max_ts:
            max_ts = ts
        elif ts < min_ts:
            min_ts = ts
        klen, p = varint(buf, p, rend)
        if klen < -1 or klen > rend - p:
            raise ProtocolError("a record's key runs outside it")
        if klen > 0:
            p += klen
        vlen, p = varint(buf, p, rend)
        if vlen < -1 or vlen > rend - p:
            raise ProtocolError("a record's value runs outside it")
        if vlen > 0:
            p += vlen
        hstart = p
        hcount, p = varint(buf, p, rend)
        if hcount < 0 or hcount > (rend - p) // 2:
            raise ProtocolError("a record's header count is out of range")
        for _ in range(hcount):
            hk, p = varint(buf, p, rend)
            if hk < 0 or hk > rend - p:
                raise ProtocolError("a header key runs outside its record")
            p += hk
            hv, p = varint(buf, p, rend)
            if hv < -1 or hv > rend - p:
                raise ProtocolError("a header value runs outside its record")
            if hv > 0:
                p += hv
        if p != rend:
            raise ProtocolError("a record's fields disagree with its length")
        size = (klen if klen > 0 else 0) + (vlen if vlen > 0 else 0) + rend - hstart - 1
        if size > biggest:
            biggest = size
        pos = rend
    return first_ts, min_ts, max_ts, biggest, pos
