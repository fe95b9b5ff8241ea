"""The store's reader: find the block holding an offset and slice the records a reader asked for.

Functions over a read transaction the caller owns (:class:`dafka.store.db.RecordDB` opens it);
no threads, no environment of their own.  A partition's blocks are one key range of the
``blocks`` table, keyed ``pid:u32 first_offset:u64`` (:mod:`dafka.store.block`), so the block
holding an offset is one cursor seek away (and one step back when the seek lands on the block
after it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from dafka.fastio import block_slice, fetch_blocks, tank_values
from dafka.kafka._codec import kafka_values
from dafka.store.block import (
    BLOCK_KEY,
    CODEC_KAFKA,
    CODEC_STORE,
    CODEC_TANK,
    HEADER_SIZE,
    BlockHeader,
    decode_header,
    records,
    store_payload,
)
from dafka.store.layout import (
    FLAG_KAFKA,
    FLAG_KEY,
    FLAG_NULL,
    FLAG_PRODUCER_TS,
    MAX_NAME,
    VALUE_HEADER,
)

__all__ = [
    "InGap", "block_after", "block_payload", "block_reads", "block_run", "block_values", "convert_block", "fetch_blocks_past_gaps",
    "fetch_values", "kafka_batches", "seek", "values_from",
]

#: Bytes an encoder of stored values (``encode``) counts a record at least: its stored
#: value's 9-byte header and 8 more (:func:`dafka.kafka.records.encode_batch`).
_MIN_RECORD_COST = 17

_pack = BLOCK_KEY.pack
_unpack = BLOCK_KEY.unpack


def block_payload(hdr: BlockHeader, value: bytes | memoryview) -> int:
    """The bytes a block adds to its partition's ``bytes`` total (content plus keys)."""
    if hdr.codec == CODEC_STORE:
        return store_payload(value)
    return hdr.body_size  # a client's block: its body as sent


def _zz_varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _as_value(codec: int, ts: int, key: bytes | None, content: bytes | None, headers: bytes | None) -> bytes:
    """A record of a client's block as the format-1 value readers of stored values take."""
    flags = FLAG_PRODUCER_TS if codec == CODEC_TANK else 0
    if content is None:
        flags |= FLAG_NULL
        content = b""
    if codec == CODEC_KAFKA:
        slot = _zz_varint(-1 if key is None else len(key)) + (key or b"") + (headers or b"\x00")
        if len(slot) <= MAX_NAME:
            return VALUE_HEADER.pack(ts, flags | FLAG_KEY | FLAG_KAFKA) + bytes((len(slot),)) + slot + content
        if key is not None and len(key) > MAX_NAME:
            key = None  # a reader of format-1 values cannot take it
    if key is None:
        return VALUE_HEADER.pack(ts, flags) + content
    return VALUE_HEADER.pack(ts, flags | FLAG_KEY) + bytes((len(key),)) + key + content


class InGap(Exception):
    """``offset`` lies in a gap inside a sparse Tank bundle's block (no record there):
    ``next`` is the offset of the block's next record (:func:`block_values`)."""

    def __init__(self, next_offset: int) -> None:
        super().__init__(next_offset)
        self.next = next_offset


def block_values(value: bytes | memoryview, hdr: BlockHeader, offset: int, n: int) -> list[bytes]:
    """Up to ``n`` format-1 values of consecutive offsets from ``offset`` (inside the block) on.

    A CODEC_STORE block is sliced (C-level passes), a Tank bundle without gaps walked once in
    the compiled extension (:func:`dafka.fastio.tank_values`); other client blocks (Kafka, a
    sparse bundle with gaps) are converted record by record.  In a sparse bundle with gaps
    the values stop at the next gap, and an ``offset`` in a gap raises :class:`InGap` (the
    caller goes on from the next record: :func:`values_from`), so that every value is read at
    its own offset.
    """
    if hdr.codec == CODEC_STORE:
        if offset < hdr.first_offset or n <= 0:
            return []
        sliced: list[bytes] = block_slice(value, offset, n)[2]  # (compiled: the checks of store_values)
        return sliced
    if hdr.codec == CODEC_TANK and hdr.record_count == hdr.last_offset - hdr.first_offset + 1:
        # A bundle without gaps (every one the gateway stores): one compiled walk.
        values: list[bytes] = tank_values(memoryview(value)[HEADER_SIZE:], max(0, offset - hdr.first_offset), n)
        return values
    if hdr.codec == CODEC_KAFKA:
        # The compiled decoder, when the records' keys and headers fit format 1's key slot.
        got = kafka_values(memoryview(value)[HEADER_SIZE:], hdr.first_offset, offset, n)
        if got is not None:
            return got
    out: list[bytes] = []
    expect = offset
    for rec in records(value, offset):
        if rec.offset != expect:
            if not out:
                raise InGap(rec.offset)  # labelled from ``offset``, it would be read at another
            break  # a gap: the next read starts past it
        if len(out) >= n:
            break
        out.append(_as_value(hdr.codec, rec.ts_ms, rec.key, rec.value, rec.headers))
        expect += 1
    return out


def values_from(value: bytes | memoryview, hdr: BlockHeader, offset: int, n: int,
                convert: Callable[[Any, int, int], list[bytes]] | None = None) -> tuple[int, list[bytes]]:
    """``(first offset, values)``: :func:`block_values` (or ``convert(value, offset, n)``) from
    the block's first record at or after ``offset``, which is ``offset`` itself unless it lies
    in a gap inside a sparse bundle."""
    try:
        return offset, block_values(value, hdr, offset, n) if convert is None else convert(value, offset, n)
    except InGap as gap:
        offset = gap.next
    return offset, block_values(value, hdr, offset, n) if convert is None else convert(value, offset, n)


def seek(cur: Any, pid: int, offset: int) -> tuple[BlockHeader, bytes | memoryview] | None:
    """Put ``cur`` on the block of ``pid`` holding ``offset``, else on its first block after
    ``offset``: ``(header, value)``, or None when ``pid`` has no block at or after it.

    One ``set_range``; one step back when it lands past ``offset``.
    """
    key = _pack(pid, offset)
    if cur.set_range(key):
        if cur.key() == key:
            value = cur.value()
            return decode_header(value), value
        if cur.prev():
            if _unpack(cur.key())[0] == pid:
                value = cur.value()
                hdr = decode_header(value)
                if hdr.last_offset >= offset:
                    return hdr, value
            cur.next()
        else:  # nothing keyed before (the table's first entry): back on the block it landed on
            cur.set_range(key)
        if _unpack(cur.key())[0] != pid:
            return None
        value = cur.value()
        return decode_header(value), value
    if not cur.last() or _unpack(cur.key())[0] != pid:
        return None
    value = cur.value()
    hdr = decode_header(value)
    return (hdr, value) if hdr.last_offset >= offset else None


def convert_block(value: bytes | memoryview, offset: int, n: int) -> list[bytes]:
    """Up to ``n`` format-1 values of a client's block (Tank, Kafka) from ``offset`` on."""
    return block_values(value, decode_header(value), offset, n)


def fetch_values(cur: Any, pid: int, start: int, last: int, n: int) -> tuple[int, list[bytes]]:
    """Format-1 values of ``pid`` from the first offset held at or after ``start``: up to
    ``n``, stopping at the next hole.  ``(first offset returned, values)``, or
    ``(last + 1, [])`` when nothing is held from ``start`` on.

    The block holding ``start`` is one ``set_range`` away (and one step back when it lands on
    the block after it); a read within one block is that seek and one slice, in the
    compiled extension (:func:`dafka.fastio.fetch_blocks`)."""
    return fetch_blocks_past_gaps(cur, pid, start, last, n, convert_block)


def fetch_blocks_past_gaps(cur: Any, pid: int, start: int, last: int, n: int,
                           convert: Callable[[Any, int, int], list[bytes]]) -> tuple[int, list[bytes]]:
    """:func:`dafka.fastio.fetch_blocks`, from the next record when ``start`` lies in a gap
    inside a sparse bundle (its ``convert`` raised :class:`InGap`: the values would have been
    labelled from ``start``).  Blocks without such gaps never raise it: no cost for them."""
    while True:
        try:
            got: tuple[int, list[bytes]] = fetch_blocks(cur, pid, start, last, n, convert)
            return got
        except InGap as gap:
            if gap.next <= start:
                raise  # (cannot happen: the next record is past the gap)
            start = gap.next


def block_after(cur: Any, pid: int, start: int) -> int | None:
    """Where the next block of ``pid`` begins after the one a read from ``start`` reaches
    first (:func:`dafka.fastio.fetch_blocks`: the block holding ``start``, or in a hole the
    first block after it), or None when that block is the partition's last.

    For a reader going on past a block that cannot be read (a damaged store: blocks are
    checked when written): keys only, so a block whose header cannot be read either is
    passed too (its header is read only to tell whether it holds ``start``; one that cannot
    be read is taken to hold it, as the read that failed read it first).  One ``set_range``,
    at most a step back and two forward; no record is decoded.
    """
    key = _pack(pid, start)
    if not cur.set_range(key):
        return None  # nothing keyed from ``start`` on: the block reached is the partition's last
    if cur.key() != key and cur.prev():
        if _unpack(cur.key())[0] == pid:
            try:
                holds = decode_header(cur.value()).last_offset >= start
            except ValueError:
                holds = True  # the block that failed, read first (see above)
            if not holds:
                cur.next()  # ``start`` lies in a hole: the block reached is the one after it
        else:
            cur.next()
    elif cur.key() != key:
        cur.set_range(key)  # nothing keyed before (the table's first entry)
    if _unpack(cur.key())[0] != pid or not cur.next():
        return None
    npid, first = _unpack(cur.key())
    return first if npid == pid else None


def block_reads(cur: Any, pid: int, start: int) -> bool | None:
    """Whether the block a read from ``start`` reaches first (:func:`seek`: the one holding
    it, or in a hole the first after it) reads, its records from ``start`` on decoded as a
    read decodes them: False when its header or its records cannot be read (a damaged
    block), None when ``pid`` has no block there.

    A reader passes a block that cannot be read only once this says so in the transaction
    it takes the block's range from: a read that failed a moment ago, in another
    transaction, may have failed at a block retention or compaction has replaced since
    (the writer commits meanwhile), and the block found now may hold readable records.
    """
    try:
        found = seek(cur, pid, start)
        if found is None:
            return None
        hdr, value = found
        offset = start if start > hdr.first_offset else hdr.first_offset
        if block_slice(value, offset, hdr.record_count)[2] is None:
            values_from(value, hdr, offset, hdr.record_count)
    except (ValueError, struct.error, IndexError):  # (ProtocolError is a ValueError)
        return False
    return True


def block_run(cur: Any, pid: int, start: int, last: int, max_bytes: int,
              max_blocks: int) -> list[tuple[BlockHeader, bytes]]:
    """Whole blocks of ``pid`` from the one holding ``start`` (or the first after it), each
    ``(header, value)`` copied out of the map: the next ones while they continue without a
    hole and up to ``last``, until ``max_bytes`` of values are taken (the block that passes
    it included) or ``max_blocks``.  For readers that take whole blocks (a Tank consume:
    its clients skip what precedes their offset, as with the broker).  One seek, then one
    cursor step and one header a block; no record is decoded (nor its CRC checked: see
    :func:`dafka.store.block.crc_matches`).  A CODEC_STORE block never goes whole: the
    caller (the Tank gateway) slices it, and a damaged one is found there, which serves the
    blocks before it.
    """
    found = seek(cur, pid, start)
    if found is None:
        return []
    hdr, value = found
    out = [(hdr, bytes(value))]
    size = len(value)
    while size < max_bytes and len(out) < max_blocks and hdr.last_offset < last and cur.next():
        npid, nfirst = _unpack(cur.key())
        if npid != pid or nfirst != hdr.last_offset + 1:
            break  # another partition, or a hole: the next read starts past it
        value = cur.value()
        try:
            hdr = decode_header(value)
        except ValueError:
            break  # a damaged block's header (checked when written): the next read, starting at it, raises
        out.append((hdr, bytes(value)))
        size += len(value)
    return out


def kafka_batches(
    cur: Any, pid: int, start: int, last: int, limit: int,
    encode: Callable[[int, list[bytes], int], bytes], count: Callable[[bytes], int], exact: bool = False,
    first: int = 0, convert: Callable[[Any, int, int], list[bytes]] | None = None,
) -> tuple[int, list[bytes | memoryview]]:
    """Kafka record batches of ``pid`` from the block holding ``start`` (or the next one
    held) up to offset ``last``: ``(next offset, batches)``, about ``limit`` bytes (a stored
    batch is a view of the cursor's value: valid while the transaction is).

    A Kafka block is sent whole, as stored (its batch from its first offset: the
    client skips the records before the one it asked for, as with a Kafka broker);
    a block of another codec is encoded (``encode(first offset, format-1 values,
    byte limit)``, ``count(batch)`` its records) from ``start`` on.  The first batch
    goes whatever its size (KIP-74), later ones only while they fit ``limit``; the
    read stops at the first batch that does not.  ``exact`` (the reader's own bound
    is tighter than one stored batch: a gateway's output budget): a first Kafka block
    larger than ``limit`` is sliced and encoded too, from ``start``, one record at
    least.  ``first``: the partition's first offset; a Kafka block beginning below it
    (the partial front block a DeleteRecords leaves) is sliced and encoded from
    ``start`` too, so no deleted record goes out (only the first block read can be
    one).  ``convert``: what takes a block's records from an offset instead of
    :func:`convert_block` (:meth:`dafka.store.db.RecordDB.fetch_kafka`'s keeps a window of
    them for the next fetches).  One ``set_range`` (and one step back), then a cursor walk.
    A block that cannot be converted (a damaged store: blocks are checked when written)
    raises what its conversion raised when it is the first one read; after others, the
    batches stop before it (the next read, starting at it, raises).
    """
    found = seek(cur, pid, start)
    out: list[bytes | memoryview] = []
    size = 0
    nxt = start
    while found is not None:
        hdr, value = found
        if hdr.first_offset > last:
            break
        room = limit - size
        # Records that can go in ``room``: converting more only to drop them cost the
        # whole rest of a block (millions of records in a large Tank bundle) per fetch.
        most = max(room, 1) // _MIN_RECORD_COST + 1
        values: list[bytes] | None = None
        whole = hdr.codec == CODEC_KAFKA and hdr.first_offset >= first  # not the partial front block
        if whole and hdr.body_size > room:
            if out:
                break
            if exact:
                off = max(nxt, hdr.first_offset)
                values = kafka_values(memoryview(value)[HEADER_SIZE:], hdr.first_offset, off,
                                      min(min(hdr.last_offset, last) - off + 1, most))
        if whole and values is None:
            out.append(memoryview(value)[HEADER_SIZE:])  # zero-copy in a buffers transaction
            size += hdr.body_size
            nxt = hdr.last_offset + 1
        else:
            off = max(nxt, hdr.first_offset)
            try:
                if values is None:
                    n = min(min(hdr.last_offset, last) - off + 1, most)
                    at, values = values_from(value, hdr, off, n, convert)
                    if at != off:  # off was in a gap inside a sparse bundle: its values begin at its next record
                        off = at
                        if off > last:
                            break
                        values = values[: min(hdr.last_offset, last) - off + 1]
                if not values:
                    break
                batch = encode(off, values, max(room, 1))
            except Exception:
                if out:
                    break  # a damaged block (checked when written): those before it go, the next read raises
                raise
            if out and len(batch) > room:
                break
            out.append(batch)
            size += len(batch)
            nxt = off + count(batch)
            if nxt <= min(hdr.last_offset, last):
                break  # the rest of the block did not fit
        if size >= limit or nxt > last or not cur.next():
            break
        key = cur.key()
        if _unpack(key)[0] != pid:
            break
        value = cur.value()
        try:
            found = decode_header(value), value
        except ValueError:
            break  # a damaged block's header (checked when written): the next read, starting at it, raises
    return nxt, out
