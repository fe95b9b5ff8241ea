"""Compacted topics: keep the latest record per key, offsets keeping their numbers with gaps.

Three parts, as retention has them:

* :class:`CompactionPolicy`: which topics are compacted and how long a tombstone (a record
  with a key and a null value) stays (``delete.retention.ms``).
* :class:`Planner`, sans-IO: one *round* of one partition.  It is fed the partition's
  records (:class:`RecordInfo`: offset, key, tombstone, timestamp, transactional kind) in
  offset order from where the last completed round ended (the *dirty* part), building a map
  ``key digest -> latest offset`` bounded to ``max_keys`` keys; then it says of every record
  from the partition's start up to where the map ends (:attr:`Planner.map_end`) whether it
  survives (:meth:`Planner.keep`).  A record is dropped only when a later record of the same
  key below ``map_end`` supersedes it, or when it is a tombstone whose key has nothing later
  and ``delete_retention_ms`` passed its timestamp.  Never dropped: the partition's last
  record (its head), records without a key, control records (transaction markers), records
  at or past ``upto`` (the last stable offset: an unfinished transaction).  Aborted records
  (offsets in ``aborted``) never supersede anything.  When the caller does not know the
  partition's transactions (``aborted is None``: a store that is not the Kafka gateway that
  took them), the map stops at the first transactional record, so nothing from there on is
  compacted.
* The shell's transactions (:func:`scan_txn`, :func:`clean_txn`) over LMDB, run by
  :class:`Compactor` (the store's writer thread calls :meth:`Compactor.step`): each read
  or write transaction handles about ``step_bytes`` of blocks.  A block with records to
  drop is rewritten in the same write transaction that deletes it and updates its
  partition's ``count`` and ``bytes`` (not its ``first``: like Kafka's log start offset, it
  stays where retention left it, so a gap above it is compaction's and one below it
  retention's): after a crash either the old block or its rewrite is there, never both or
  neither.

How a block is rewritten: its surviving records become one block per run of consecutive
offsets, each stored under its own first offset, so every block stays dense (no reader
changes: the gaps between blocks are what readers already pass, as after a hole).  A Kafka
batch (``CODEC_KAFKA``) becomes one batch per run, compressed with its codec again (written
uncompressed only when this process lacks the codec's package: lz4, zstd), with the run's first offset
as ``baseOffset``, the records' bytes, timestamps, producer id, epoch and transactional bit
kept, ``baseSequence`` moved by the run's place and ``lastOffsetDelta`` the run's length - 1
(so a Kafka client's next fetch offset is the run's last offset + 1; the next run's batch
starts further on, a gap Kafka clients pass).  A Tank bundle and the store's own blocks become
``CODEC_STORE`` blocks (Tank keys and producer timestamps kept as format-1 flags; a Tank
consume re-encodes them into bundles, as for any block of another codec).  A block beginning
below the partition's ``first`` (the partial front block a DeleteRecords leaves) is left
alone until retention drops it.

Bounds: the map holds at most ``max_keys`` 16-byte BLAKE2b digests of keys (a key of any
size costs the same; 133 bytes of memory each in CPython (tracemalloc), 13 MB for 100,000 keys);
a round whose dirty part has more distinct keys stops its map there and cleans up to that
point, the next round going on from it (as Kafka's cleaner does with a full offset map).  A
step reads or rewrites about ``step_bytes`` of blocks (at least one block).  The planner
remembers in memory only where each partition's last complete round ended; after a restart
the first round of each compacted partition starts at its beginning.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import snappy
from crc32c import crc32c

from dafka.errors import ProtocolError
from dafka.gateway.connections import LogLimiter
from dafka.kafka import _codec
from dafka.store.block import (
    BLOCK_KEY,
    CODEC_KAFKA,
    CODEC_STORE,
    DEFAULT_BUDGET,
    HEADER_SIZE,
    BlockHeader,
    _zvarint,
    crc_matches,
    decode_header,
    kafka_block_of,
    records,
    scan_kafka,
    store_block,
    store_values,
)
from dafka.store.layout import (
    FLAG_CONTROL,
    FLAG_KAFKA,
    FLAG_KEY,
    FLAG_NULL,
    PARTITION_INFO,
    VALUE_HEADER,
)
from dafka.store.reader import _as_value, block_payload

__all__ = [
    "CONTROL",
    "DEFAULT_DELETE_RETENTION_MS",
    "DEFAULT_MAX_KEYS",
    "DEFAULT_STEP_BYTES",
    "PLAIN",
    "TXN",
    "CompactionPolicy",
    "Compactor",
    "Planner",
    "RecordInfo",
    "block_infos",
    "clean_txn",
    "rewrite_block",
    "scan_txn",
]

log = logging.getLogger("dafka.store.compaction")

#: Kafka's default ``delete.retention.ms``: a tombstone stays a day.
DEFAULT_DELETE_RETENTION_MS = 86_400_000
#: Keys one round's map holds at most (see the module's bounds).
DEFAULT_MAX_KEYS = 100_000
#: Bytes of blocks one step (one LMDB transaction) reads or rewrites, about.
DEFAULT_STEP_BYTES = 1 << 20
#: A partition's next round starts once its new records are at least this share of its count
#: (Kafka's ``min.cleanable.dirty.ratio``), or a kept tombstone is due.
DIRTY_RATIO = 0.5

#: Up to this many compacted topics, a look for a due partition reads theirs alone (a prefix
#: each); past it, the whole partitions table once.
FEW_TOPICS = 64

PLAIN, TXN, CONTROL = 0, 1, 2  # RecordInfo.kind: plain, a transaction's data, a marker

_KAFKA_ATTRS = struct.Struct(">h")  # a batch's attributes, at byte 21
_ATTR_CODEC, _ATTR_TXN, _ATTR_CONTROL = 0x07, 0x10, 0x20
_BATCH_HEAD = struct.Struct(">qiibIhiqqqhii")  # 61 bytes


@dataclass(frozen=True)
class CompactionPolicy:
    """The compacted topics and their tombstones' ``delete.retention.ms``
    (``delete_retention_ms[topic]`` if present, else ``default_delete_retention_ms``)."""

    topics: frozenset[str] = frozenset()
    delete_retention_ms: Mapping[str, int] = field(default_factory=dict)
    default_delete_retention_ms: int = DEFAULT_DELETE_RETENTION_MS

    def compacts(self, topic: str) -> bool:
        return topic in self.topics

    def tombstone_ms(self, topic: str) -> int:
        return self.delete_retention_ms.get(topic, self.default_delete_retention_ms)


class RecordInfo(NamedTuple):
    """What compaction needs of one record."""

    offset: int
    key: bytes | None  # None: no key (kept)
    tombstone: bool  # a key with a null value
    ts_ms: int
    kind: int = PLAIN  # PLAIN, TXN or CONTROL


def digest(key: bytes) -> bytes:
    """The 16-byte digest a planner's map keeps of a key (bounded memory for any key)."""
    return hashlib.blake2b(key, digest_size=16).digest()


class Planner:
    """One compaction round of one partition (sans-IO; see the module).

    ``start``: where the dirty part begins (the end of the last complete round, or the
    partition's start); ``upto``: the last offset the map may take (the head, or the last
    stable offset - 1); ``head``: the partition's last offset (never dropped);
    ``aborted``: aborted transactions' offset ranges, or None when unknown.
    """

    def __init__(self, *, start: int, upto: int, head: int, now_ms: int, delete_retention_ms: int,
                 aborted: Sequence[tuple[int, int]] | None = (), max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.start = start
        self.upto = min(upto, head)
        self.head = head
        self.now_ms = now_ms
        self.delete_retention_ms = delete_retention_ms
        self.aborted = None if aborted is None else sorted(aborted)
        self._aborted_starts = [a for a, _b in self.aborted or ()]
        self.max_keys = max_keys
        self.latest: dict[bytes, int] = {}
        self.map_end = start  # offsets below it are scanned: the map covers [start, map_end)
        self.scan_done = start > self.upto
        self.tombstone_due: int | None = None  # the earliest expiry of a tombstone kept

    def _is_aborted(self, offset: int) -> bool:
        if not self.aborted:
            return False
        i = bisect.bisect_right(self._aborted_starts, offset) - 1
        return i >= 0 and offset <= self.aborted[i][1]

    def feed(self, recs: Iterable[RecordInfo]) -> bool:
        """Records of the dirty part in offset order (from :attr:`map_end` on).  Returns
        False once the map is complete (past ``upto``, full, or at a transaction it cannot
        judge): the records after the one it stopped at are not taken."""
        if self.scan_done:
            return False
        latest = self.latest
        for r in recs:
            off = r.offset
            if off < self.map_end:
                continue
            if off > self.upto:
                self.scan_done = True
                self.map_end = self.upto + 1
                return False
            if r.kind == TXN and self.aborted is None:
                self.scan_done = True  # a transaction nobody told us the outcome of
                return False
            if r.key is not None and r.kind != CONTROL and not self._is_aborted(off):
                d = digest(r.key)
                if d not in latest and len(latest) >= self.max_keys:
                    self.scan_done = True  # full: clean up to here, the next round goes on
                    return False
                latest[d] = off
            self.map_end = off + 1
        return True

    def scanned_through(self, offset: int) -> None:
        """Everything up to ``offset`` was fed (the shell read past a gap or a block's end)."""
        if not self.scan_done:
            self.map_end = max(self.map_end, min(offset, self.upto) + 1)
            if self.map_end > self.upto:
                self.scan_done = True

    def keep(self, r: RecordInfo) -> bool:
        """Whether record ``r`` (below :attr:`map_end` or not) survives this round."""
        off = r.offset
        if off >= self.map_end or off >= self.head or r.key is None or r.kind == CONTROL:
            return True
        later = self.latest.get(digest(r.key))
        if later is not None and later > off:
            return False  # superseded
        if r.tombstone and not self._is_aborted(off):
            due = r.ts_ms + self.delete_retention_ms
            if due <= self.now_ms:
                return False
            if self.tombstone_due is None or due < self.tombstone_due:
                self.tombstone_due = due
        return True


# ---------------------------------------------------------------- blocks


def _kafka_slot_key(slot: bytes) -> bytes | None:
    klen, p = _zvarint(slot, 0, len(slot))
    return None if klen < 0 else slot[p:p + klen]


def _value_info(offset: int, v: bytes) -> RecordInfo:
    ts, flags = VALUE_HEADER.unpack_from(v)
    key: bytes | None = None
    kind = PLAIN
    if flags & FLAG_KEY:
        slot = v[10:10 + v[9]]
        if flags & FLAG_CONTROL:
            kind = CONTROL
            key = slot
        elif flags & FLAG_KAFKA:
            key = _kafka_slot_key(slot)
        else:
            key = slot
    return RecordInfo(offset, key, bool(flags & FLAG_NULL) and key is not None, ts, kind)


def _store_values_all(value: Any, hdr: BlockHeader) -> list[bytes]:
    return store_values(bytes(value), hdr, hdr.first_offset, hdr.record_count)


def block_infos(hdr: BlockHeader, value: bytes | memoryview) -> list[RecordInfo]:
    """The :class:`RecordInfo` of every record of a stored block."""
    if hdr.codec == CODEC_STORE:
        return [_value_info(hdr.first_offset + i, v) for i, v in enumerate(_store_values_all(value, hdr))]
    if hdr.codec == CODEC_KAFKA:
        attrs = _KAFKA_ATTRS.unpack_from(value, HEADER_SIZE + 21)[0]
        if attrs & _ATTR_CONTROL:  # never stored so today; kept whole if it were
            return [RecordInfo(off, None, False, hdr.max_ts, CONTROL)
                    for off in range(hdr.first_offset, hdr.last_offset + 1)]
        kind = TXN if attrs & _ATTR_TXN else PLAIN
        # The compiled record loop (no Python statement per record).
        raw = bytes(memoryview(value)[HEADER_SIZE:])
        (_b, _l, _e, _m, _c, _a, _d, base_ts, max_ts, _p, _pe, _s, count) = _BATCH_HEAD.unpack_from(raw)
        codec = attrs & _ATTR_CODEC
        if codec:
            body, start = _codec._decompress(codec, raw[_BATCH_HEAD.size:], [DEFAULT_BUDGET]), 0
        else:
            body, start = raw, _BATCH_HEAD.size
        fixed = max_ts if attrs & 0x08 else None
        recs = _codec._decode_records(body, start, len(body), count, base_ts, fixed, _codec.Record)[0]
        first = hdr.first_offset
        return [RecordInfo(first + i, r.key, r.value is None and r.key is not None, r.timestamp, kind)
                for i, r in enumerate(recs)]
    # Tank bundles (and the unused varint codec): keys, never null values.
    return [RecordInfo(r.offset, r.key, False, r.ts_ms, PLAIN) for r in records(value)]


def _runs(offsets: Sequence[int]) -> list[tuple[int, int]]:
    """``(index of first, count)`` of each run of consecutive offsets."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + 1:
            out.append((start, i - start))
            start = i
    return out


def _put_varint(n: int, out: bytearray) -> None:
    z = (n << 1) ^ (n >> 63)
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)


_XERIAL = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
_XERIAL_BLOCK = 32 << 10


def _compress(codec: int, data: bytes) -> tuple[int, bytes]:
    """``(codec used, data)``: the batch's own codec when this process has it (gzip, snappy
    in Kafka's xerial framing, lz4 and zstd with their packages), else none."""
    if codec == 1:
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
        return 1, c.compress(data) + c.flush()
    if codec == 2:
        out = [_XERIAL]
        for i in range(0, len(data), _XERIAL_BLOCK):
            chunk = snappy.compress(data[i:i + _XERIAL_BLOCK])
            out += [struct.pack(">i", len(chunk)), chunk]
        return 2, b"".join(out)
    lz4f: Any = getattr(_codec, "_lz4f", None)
    zstd: Any = getattr(_codec, "_zstd", None)
    if codec == 3 and lz4f is not None:
        return 3, bytes(lz4f.compress(data))
    if codec == 4 and zstd is not None:
        return 4, bytes(zstd.ZstdCompressor().compress(data))
    return 0, data


def _kafka_runs(value: bytes | memoryview, keep: Sequence[bool]) -> list[bytes]:
    """The blocks of a stored Kafka batch's kept records, one batch per run of consecutive offsets."""
    body = bytes(memoryview(value)[HEADER_SIZE:])
    (base, _length, _epoch, _magic, _crc, attrs, _last_delta, base_ts, max_ts_hdr, pid, pepoch, bseq,
     _count) = _BATCH_HEAD.unpack_from(body)
    # Inflated within the budget it was checked against when stored (block.DEFAULT_BUDGET),
    # as block_infos does: never more in the writer thread.  (Its records are not bounded
    # again: the gateway's max_record_bytes, whatever it was, passed them.)
    k = scan_kafka(body, 1 << 31, DEFAULT_BUDGET, control=True)
    buf, pos = k.body, k.start
    kept: list[tuple[int, int, bytes, bytes]] = []  # (offset, ts, attr+tsDelta bytes, the rest)
    for i in range(k.record_count):
        rlen, pos = _zvarint(buf, pos, len(buf))
        rend = pos + rlen
        p = pos + 1
        tsd, p = _zvarint(buf, p, rend)
        lead = buf[pos:p]
        _od, p = _zvarint(buf, p, rend)
        if keep[i]:
            kept.append((base + i, base_ts + tsd, lead, buf[p:rend]))
        pos = rend
    out = []
    offsets = [r[0] for r in kept]
    for first_i, n in _runs(offsets):
        run = kept[first_i:first_i + n]
        recs = bytearray()
        for j, (_off, _ts, lead, rest) in enumerate(run):
            rec = bytearray(lead)
            _put_varint(j, rec)
            rec += rest
            _put_varint(len(rec), recs)
            recs += rec
        first = run[0][0]
        if attrs & 0x08:  # LOG_APPEND_TIME: the batch's time stands for every record
            max_ts = max_ts_hdr
        else:
            max_ts = max(r[1] for r in run)
        seq = -1 if bseq < 0 else (bseq + (first - base)) & 0x7FFFFFFF
        codec, payload = _compress(attrs & _ATTR_CODEC, bytes(recs))
        tail = struct.pack(">hiqqqhii", (attrs & ~_ATTR_CODEC) | codec, n - 1, base_ts, max_ts, pid, pepoch, seq,
                           n) + payload
        batch = struct.pack(">qiib", first, len(tail) + 9, -1, 2) + struct.pack(">I", crc32c(tail)) + tail
        out.append(kafka_block_of(batch, scan_kafka(batch, 1 << 31, DEFAULT_BUDGET, control=True), first))
    return out


def _value_payload(v: bytes) -> int:
    return len(v) - 9 - (1 if v[8] & FLAG_KEY else 0)


def rewrite_block(hdr: BlockHeader, value: bytes | memoryview, infos: Sequence[RecordInfo],
                  keep: Sequence[bool]) -> list[bytes]:
    """The blocks holding a block's kept records (``keep[i]`` of ``infos[i]``): one dense
    block per run of consecutive offsets (see the module); [] when nothing is kept."""
    if not any(keep):
        return []
    if hdr.codec == CODEC_KAFKA:
        return _kafka_runs(value, keep)
    if hdr.codec == CODEC_STORE:
        values = _store_values_all(value, hdr)
    else:
        values = [_as_value(hdr.codec, r.ts_ms, r.key, r.value, r.headers) for r in records(value)]
    kept = [(info.offset, v) for info, v, k in zip(infos, values, keep, strict=True) if k]
    out = []
    for first_i, n in _runs([o for o, _v in kept]):
        run = [v for _o, v in kept[first_i:first_i + n]]
        out.append(store_block(kept[first_i][0], run, sum(map(_value_payload, run))))
    return out


# ---------------------------------------------------------------- LMDB transactions


class Scanned(NamedTuple):
    """What one :func:`scan_txn` step read."""

    blocks: int
    bytes: int


#: What reading a damaged stored block raises (ProtocolError is a ValueError): blocks are
#: checked when written, not when read (bit rot, a bug of an older version).
DAMAGE = (ValueError, struct.error, IndexError, zlib.error)

#: ``report(pid, first_offset, why)``: a stored block compaction cannot read, left as it is.
Report = Callable[[int, int, str], None]

def _ignore(_pid: int, _first: int, _why: str) -> None:
    pass


def _sound(first: int, value: bytes | memoryview) -> tuple[BlockHeader, list[RecordInfo]] | str:
    """A stored block's header and records, or why it cannot be read: its header, its CRC-32C
    (a block compaction rewrites is sealed again, so damage it read would pass for sound from
    then on), its records."""
    try:
        hdr = decode_header(value)
        if hdr.first_offset != first:
            return f"its header says offset {hdr.first_offset}"
        if not crc_matches(value):  # (readers do not check it: see block.crc_matches)
            return "its CRC-32C does not match"
        return hdr, block_infos(hdr, value)
    except DAMAGE as exc:
        return str(exc) or type(exc).__name__


def _seek_any(cur: Any, pid: int, offset: int) -> bool:
    """Put ``cur`` on the block of ``pid`` holding ``offset``, else on its first block after it
    (False: none), as :func:`~dafka.store.reader.seek` does, but reading no more than the
    header of the block keyed below ``offset``: one whose header cannot be read is taken to
    hold everything up to the next block (it is then read, and found damaged, by the caller)."""
    key = BLOCK_KEY.pack(pid, offset + 1)
    landed = offset < (1 << 64) - 1 and bool(cur.set_range(key))
    on = bool(cur.prev()) if landed else bool(cur.last())
    if on and BLOCK_KEY.unpack(cur.key())[0] == pid:  # the last block keyed at or below offset
        try:
            holds = decode_header(cur.value()).last_offset >= offset
        except DAMAGE:
            holds = True
        if holds:
            return True
        return landed and bool(cur.next()) and BLOCK_KEY.unpack(cur.key())[0] == pid
    if not landed:
        return False
    moved = bool(cur.next()) if on else bool(cur.set_range(key))  # back on the block it landed on
    return moved and BLOCK_KEY.unpack(cur.key())[0] == pid


def _next_first(cur: Any, pid: int) -> int | None:
    """The first offset of ``pid``'s block after the cursor's (the cursor moves onto it), or None."""
    if cur.next():
        kpid, first = BLOCK_KEY.unpack(cur.key())
        if kpid == pid:
            return int(first)
    return None


def scan_txn(txn: Any, blocks_db: Any, pid: int, planner: Planner, step_bytes: int,
             report: Report | None = None) -> Scanned:
    """Feed ``planner`` the records of ``pid`` from its :attr:`~Planner.map_end`, about
    ``step_bytes`` of blocks (at least one), in a read (or write) transaction.

    A block that cannot be read (:func:`_sound`) is ``report``-ed and passed: its records are
    not in the map (a record before it that one of them supersedes stays), the scan goes on
    from the next block."""
    report = report or _ignore
    cur = txn.cursor(db=blocks_db)
    nblocks = nbytes = 0
    if not _seek_any(cur, pid, planner.map_end):
        planner.scanned_through(planner.upto)  # nothing more is stored
        return Scanned(0, 0)
    while not planner.scan_done:
        first = BLOCK_KEY.unpack(cur.key())[1]
        if first > planner.upto:
            planner.scanned_through(planner.upto)
            break
        value = cur.value()
        got = _sound(first, value)
        nblocks += 1
        nbytes += len(value)
        if isinstance(got, str):
            report(pid, first, got)
            nxt = _next_first(cur, pid)
            planner.scanned_through(planner.upto if nxt is None else nxt - 1)
            if nxt is None:
                break
        else:
            hdr, infos = got
            if not planner.feed(infos):
                break
            planner.scanned_through(hdr.last_offset)
            if _next_first(cur, pid) is None:
                planner.scanned_through(planner.upto)  # nothing more is stored
                break
        if nbytes >= step_bytes:
            break
    return Scanned(nblocks, nbytes)


class Cleaned(NamedTuple):
    """What one :func:`clean_txn` step did."""

    next: int  # the offset the next step starts from
    done: bool  # every block below the planner's map_end was seen
    dropped: int  # records removed
    freed: int  # payload bytes removed
    rewritten: int  # blocks rewritten (or deleted)


def clean_txn(txn: Any, parts_db: Any, blocks_db: Any, pkey: bytes, planner: Planner, offset: int,
              step_bytes: int, report: Report | None = None) -> Cleaned:
    """Drop what ``planner`` does not keep from the blocks of partition ``pkey`` from ``offset``
    (at least the partition's ``first``) up to its ``map_end``, about ``step_bytes`` of blocks,
    in the write transaction ``txn``, updating the partition's ``count`` and ``bytes`` (its
    ``first`` stays, as Kafka's log start offset does under compaction).

    A block that cannot be read (:func:`_sound`), or whose rewrite fails on its records, is
    ``report``-ed and left as it is (never deleted or rewritten: what it holds is unknown);
    the step goes on from the next block."""
    report = report or _ignore
    raw = txn.get(pkey, db=parts_db)
    if raw is None:
        return Cleaned(offset, True, 0, 0, 0)
    pid, first, last, count, nbytes = PARTITION_INFO.unpack(raw)
    cur = txn.cursor(db=blocks_db)
    offset = max(offset, first)
    dropped = freed = rewritten = seen = 0
    done = False
    while True:
        if offset >= planner.map_end:
            done = True
            break
        if not _seek_any(cur, pid, offset):
            done = True
            break
        kfirst = BLOCK_KEY.unpack(cur.key())[1]
        if kfirst >= planner.map_end:
            done = True
            break
        value = cur.value()
        seen += len(value)
        got = _sound(kfirst, value)
        if isinstance(got, str):
            report(pid, kfirst, got)
            nxt = _next_first(cur, pid)
            if nxt is None:
                done = True
                break
            offset = nxt
            if seen >= step_bytes:
                break
            continue
        hdr, infos = got
        offset = hdr.last_offset + 1
        if hdr.first_offset < first:
            continue  # the partial front block of a DeleteRecords: left alone
        keep = [planner.keep(r) for r in infos]
        if all(keep):
            if seen >= step_bytes:
                break
            continue
        try:
            new = rewrite_block(hdr, value, infos, keep)
        except DAMAGE as exc:
            report(pid, kfirst, str(exc) or type(exc).__name__)
            if seen >= step_bytes:
                break
            continue
        old_payload = block_payload(hdr, value)
        new_payload = sum(block_payload(decode_header(b), b) for b in new)
        cur.delete()
        for b in new:
            h = decode_header(b)
            if not txn.put(BLOCK_KEY.pack(pid, h.first_offset), b, db=blocks_db, overwrite=False):
                raise ProtocolError(f"pid {pid}: offset {h.first_offset} is taken")  # aborts the transaction
        gone = len(keep) - sum(keep)
        count -= gone
        nbytes = max(0, nbytes - old_payload + new_payload)
        dropped += gone
        freed += old_payload - new_payload
        rewritten += 1
        if seen >= step_bytes:
            break
    if rewritten:
        # ``first`` stays (as Kafka's log start offset does): a read from it gets the next
        # record held, and what lies below ``first`` is what retention removed, a loss for
        # readers that planned it (Spark); a gap above it is compaction's.
        txn.put(pkey, PARTITION_INFO.pack(pid, first, last, count, nbytes), db=parts_db)
    return Cleaned(offset, done, dropped, freed, rewritten)


# ---------------------------------------------------------------- the background driver


@dataclass
class _Round:
    topic: str
    partition: str
    pkey: bytes
    pid: int
    planner: Planner
    clean_from: int = 0
    cleaning: bool = False


class Compactor:
    """Runs compaction rounds over a :class:`~dafka.store.db.RecordDB`, one bounded step at a time.

    ``policy()`` gives the current :class:`CompactionPolicy` (read at each round);
    ``bounds(topic, partition, head)`` the last offset a round may take in its map and the
    partition's aborted ranges (None: unknown, see :class:`Planner`).  Not thread-safe: one
    caller (the store's writer thread).
    """

    def __init__(self, db: Any, policy: Callable[[], CompactionPolicy], *,
                 bounds: Callable[[str, str, int], tuple[int, Sequence[tuple[int, int]] | None]] | None = None,
                 max_keys: int = DEFAULT_MAX_KEYS, step_bytes: int = DEFAULT_STEP_BYTES,
                 limiter: LogLimiter | None = None) -> None:
        self.db = db
        self.policy = policy
        self.bounds = bounds or (lambda _t, _p, head: (head, None))
        self.max_keys = max_keys
        self.step_bytes = step_bytes
        self.done_upto: dict[bytes, int] = {}  # pkey -> map_end of its last complete round
        self.tombstone_due: dict[bytes, int] = {}
        self.heads_seen: dict[bytes, int] = {}  # pkey -> its head at the last look
        self.blocked: dict[bytes, int] = {}  # pkey -> its head when a round could take nothing
        self.round: _Round | None = None
        self._last = b""  # the partition key of the last round started
        self.dropped = 0  # records removed, in all
        self.rounds = 0  # rounds completed
        #: Stored blocks found damaged (each counted and logged once), left as they are.
        self.damaged = 0
        self._reported: set[tuple[int, int]] = set()
        self.limiter = limiter or LogLimiter(log)

    def _damaged(self, pid: int, first: int, why: str) -> None:
        """A stored block the round cannot read: left as it is, logged (rate-limited, one line)
        and counted the first time it is met (every round of its partition passes it again)."""
        if (pid, first) in self._reported:
            return
        if len(self._reported) >= 4096:  # bounded: past it, a block may be logged once more
            self._reported.clear()
        self._reported.add((pid, first))
        self.damaged += 1
        rnd = self.round
        where = f"{rnd.topic}/{rnd.partition}" if rnd is not None else f"partition id {pid}"
        self.limiter.emit(logging.ERROR, "compaction-damaged", "compaction of %s passes the stored block at offset %d"
                          " and leaves it as it is: it cannot be read (%s)", where, first, why)

    def _due(self, now_ms: int) -> _Round | None:
        policy = self.policy()
        if not policy.topics:
            return None
        infos = []
        if len(policy.topics) <= FEW_TOPICS:
            for topic in sorted(policy.topics):
                try:
                    infos += self.db.partitions(topic)  # a prefix of the partitions table: the topic's only
                except ValueError:
                    continue  # a name no topic can have
        else:
            infos = [i for i in self.db.partitions() if policy.compacts(i.topic)]
        parts = [(self.db.partition_key(i.topic, i.partition), i) for i in infos if i.count]
        # Round robin: the partitions after the last one compacted first, so none starves.
        parts.sort(key=lambda kv: (kv[0] <= self._last, kv[0]))
        for pkey, info in parts:
            done = self.done_upto.get(pkey, info.first)
            dirty = info.last + 1 - max(done, info.first)
            due = self.tombstone_due.get(pkey)
            if dirty <= 0 and (due is None or due > now_ms):
                continue
            idle = self.heads_seen.get(pkey) == info.last  # nothing new since the last look
            self.heads_seen[pkey] = info.last
            if self.blocked.get(pkey) == info.last:
                continue  # its last round could take nothing new (a transaction): wait for records
            if dirty > 0 and dirty < DIRTY_RATIO * info.count and (due is None or due > now_ms) \
                    and pkey in self.done_upto and not idle:
                continue
            upto, aborted = self.bounds(info.topic, info.partition, info.last)
            start = max(done, info.first) if dirty > 0 else info.first
            planner = Planner(start=start, upto=upto, head=info.last, now_ms=now_ms,
                              delete_retention_ms=policy.tombstone_ms(info.topic), aborted=aborted,
                              max_keys=self.max_keys)
            if dirty <= 0:
                planner.scan_done = True
                planner.map_end = done  # nothing new: a pass for expired tombstones only
            self._last = pkey
            return _Round(info.topic, info.partition, pkey, info.pid, planner, info.first)
        return None

    def give_up(self) -> None:
        """The round in progress failed (its step raised: a full disk, a bug; a damaged block
        does not raise, it is passed): drop it, and leave its partition alone until it gets
        new records (the failure is not met again every second)."""
        rnd = self.round
        if rnd is not None:
            self.blocked[rnd.pkey] = rnd.planner.head
        self.round = None

    def _tombstones_due(self, rnd: _Round, now_ms: int) -> bool:
        due = self.tombstone_due.get(rnd.pkey)
        return due is not None and due <= now_ms

    def step(self, now_ms: int) -> bool:
        """One bounded step (one LMDB transaction, or none when nothing is due).  True while
        a round is in progress (call again)."""
        rnd = self.round
        if rnd is None:
            rnd = self.round = self._due(now_ms)
            if rnd is None:
                return False
        pl = rnd.planner
        if not rnd.cleaning:
            self.db.compaction_scan(rnd.pid, pl, self.step_bytes, self._damaged)
            if pl.scan_done:
                rnd.cleaning = True
                if pl.map_end <= pl.start and rnd.pkey in self.done_upto and not self._tombstones_due(rnd, now_ms):
                    # Nothing new can be taken (an unfinished or unknown transaction at the
                    # dirty part's start): no pass over the partition until it grows.
                    self.blocked[rnd.pkey] = pl.head
                    self.round = None
                    return False
            return True
        res = self.db.compaction_clean(rnd.pkey, pl, rnd.clean_from, self.step_bytes, self._damaged)
        self.dropped += res.dropped
        rnd.clean_from = res.next
        if res.dropped:
            log.debug("compaction of %s/%s removed %d records (%d bytes)", rnd.topic, rnd.partition,
                      res.dropped, res.freed)
        if res.done:
            self.done_upto[rnd.pkey] = max(pl.map_end, self.done_upto.get(rnd.pkey, 0))
            if pl.tombstone_due is None:
                self.tombstone_due.pop(rnd.pkey, None)
            else:
                self.tombstone_due[rnd.pkey] = pl.tombstone_due
            self.round = None
            self.rounds += 1
        return True
