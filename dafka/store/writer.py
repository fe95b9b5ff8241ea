"""The store's writer: packing appended records and building the blocks its group commit puts.

Pure functions over records and values (no LMDB, no threads): :class:`dafka.store.db.RecordDB`
calls them inside its write transaction.  Records that arrive one at a time (the mesh, C
producers, the Tank and Kafka gateways today) become format-1 values (:mod:`dafka.store.layout`),
and each run of one partition's values at consecutive offsets becomes CODEC_STORE blocks of at
most :data:`BLOCK_BYTES` (:func:`dafka.store.block.store_block`), one LMDB value each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dafka.fastio import store_blocks
from dafka.store.layout import FLAG_KEY, FLAG_PRODUCER_TS, MAX_NAME, PARTITION_INFO, VALUE_HEADER

__all__ = [
    "BLOCK_BYTES",
    "PartState",
    "Run",
    "Skip",
    "Unit",
    "blocks_of",
    "group",
    "pack_contents",
    "pack_records",
    "run_of",
    "skip_checker",
]

#: The store cuts its own blocks at this many bytes of values (docs/concepts/store.md, "Block size").
BLOCK_BYTES = 64 << 10

#: One run of a partition's values at consecutive offsets: ``(first offset, values, payload bytes, plain)``;
#: ``plain`` when no value has a key (its payload is then its length less the value headers).
Run = tuple[int, list[bytes], int, bool]


def blocks_of(run: Run, pid: int) -> list[tuple[bytes, bytes]]:
    """LMDB ``(key, block)`` pairs of the CODEC_STORE blocks of partition ``pid`` holding ``run``,
    each at most :data:`BLOCK_BYTES` of values (a single larger value is a block of its own).

    Its values are format-1 values built by the store (its packers, the compiled drain, hole
    repair); one pass of the compiled extension (:func:`dafka.fastio.store_blocks`)."""
    values = run[1]
    blocks: list[tuple[bytes, bytes]] = store_blocks(values, 0, len(values), pid, run[0], BLOCK_BYTES, -1)
    return blocks


def group(batch: Sequence[Sequence[Any]]) -> dict[tuple[str, str], list[Sequence[Any]]]:
    """Split a batch of several partitions per partition, keeping arrival order."""
    groups: dict[tuple[str, str], list[Sequence[Any]]] = {}
    for rec in batch:
        tp = (rec[0], rec[1])
        # try/append on a dict hit is the cheapest per-record step measured.
        try:
            groups[tp].append(rec)
        except KeyError:
            groups[tp] = [rec]
    return groups


def run_of(cols: tuple[tuple[Any, ...], ...]) -> tuple[int, tuple[bytes, ...], Any] | None:
    """``(first offset, contents, ts)`` if the transposed records ``cols`` are
    plain (no Tank key or timestamp) and at consecutive offsets, else None.

    ``ts`` is one int when every record has the same timestamp (the store
    stamps a batch with its receive time), else the tuple of timestamps.
    """
    if len(cols) != 5:
        if len(cols) != 7 or cols[6].count(False) != len(cols[6]):
            return None
        if cols[5].count(None) != len(cols[5]):
            return None
    offs = cols[2]
    first = offs[0]
    n = len(offs)
    if offs[-1] != first + n - 1 or offs != tuple(range(first, first + n)):
        return None
    tss = cols[4]
    return first, cols[3], (tss[0] if tss.count(tss[0]) == n else tss)


# What the packers return: runs of values at consecutive offsets, next offset, payload bytes,
# duplicates skipped.
Packed = tuple[list[Run], int, int, int]


def pack_contents(nxt: int, contents: Sequence[bytes], ts: Any) -> Packed:
    """Values of plain records at offsets ``nxt, nxt + 1, ...``: one run.

    ``ts`` is one timestamp for all or a sequence of one per content.  Each
    step is a C-level pass (list comprehension, map, struct), no per-record
    Python statements.
    """
    pack_hdr = VALUE_HEADER.pack
    if isinstance(ts, int):
        hdr = pack_hdr(ts, 0)
        values = [hdr + c for c in contents]
    else:
        if len(ts) != len(contents):
            raise ValueError(f"{len(ts)} timestamps for {len(contents)} records")
        hdrs = {t: pack_hdr(t, 0) for t in set(ts)}
        values = list(map(bytes.__add__, map(hdrs.__getitem__, ts), contents))
    n = len(values)
    nbytes = sum(map(len, contents))
    return [(nxt, values, nbytes, True)], nxt + n, nbytes, 0


def pack_records(
    nxt: int,
    recs: Sequence[Sequence[Any]],
    tp: tuple[str, str],
    skipped: Callable[[int, int], bool] | None = None,
    holes: list[tuple[int, int]] | None = None,
) -> Packed:
    """Pack one partition's records (tuples), which must continue at offset ``nxt``.

    The general case: duplicates, gaps, keys, producer timestamps.

    A record below ``nxt`` is a duplicate (skipped and counted); above it, a
    gap: allowed where ``skipped(first, last)`` says the missing offsets were
    given up (a hole, appended to ``holes``; the run ends there), else
    ValueError (which refuses the partition's records).
    """
    pack_hdr = VALUE_HEADER.pack
    runs: list[Run] = []
    values: list[bytes] = []
    add_value = values.append
    run_first = nxt
    run_bytes = 0
    plain = True
    nbytes = 0
    dups = 0
    hdr_ts: object = None
    hdr = b""
    for rec in recs:
        off = rec[2]
        if off != nxt:
            if off < nxt:
                dups += 1
                continue
            if skipped is None or not skipped(nxt, off - 1):
                raise ValueError(
                    f"gap in {tp[0]!r}/{tp[1]!r}: offset {off} after head {nxt - 1} "
                    "(offsets must be contiguous unless skipped)"
                )
            if holes is not None:
                holes.append((nxt, off - 1))
            nxt = off  # a hole: the offsets before were given up
            if values:
                runs.append((run_first, values, run_bytes, plain))
                values = []
                add_value = values.append
                run_bytes = 0
                plain = True
            run_first = off
        content = rec[3]
        size = len(content)
        if len(rec) > 5 and (rec[5] is not None or (len(rec) > 6 and rec[6])):
            key = rec[5]
            flags = FLAG_PRODUCER_TS if len(rec) > 6 and rec[6] else 0
            if len(rec) > 7:
                flags |= rec[7]  # e.g. FLAG_KAFKA: the key slot holds a Kafka key and headers
            if key is None:
                value = pack_hdr(rec[4], flags) + content
            else:
                if len(key) > MAX_NAME:
                    raise ValueError(f"record key of {len(key)} bytes, at most {MAX_NAME}")
                value = pack_hdr(rec[4], flags | FLAG_KEY) + bytes((len(key),)) + key + content
                size += len(key)
                plain = False
        else:
            ts = rec[4]
            if ts != hdr_ts:
                hdr = pack_hdr(ts, 0)
                hdr_ts = ts
            value = hdr + content
        nbytes += size
        run_bytes += size
        add_value(value)
        nxt += 1
    if values:
        runs.append((run_first, values, run_bytes, plain))
    return runs, nxt, nbytes, dups


Skip = tuple[str, str, int, int]  # (topic, partition, first, last): offsets given up


def skip_checker(skips: Sequence[Skip]) -> Callable[[tuple[str, str], int, int], bool]:
    """``covered(tp, lo, hi)``: whether ``skips`` give up every offset ``lo..hi`` of ``tp``."""
    ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for topic, partition, first, last in skips:
        ranges.setdefault((topic, partition), []).append((first, last))
    for spans in ranges.values():
        spans.sort()

    def covered(tp: tuple[str, str], lo: int, hi: int) -> bool:
        need = lo
        for first, last in ranges.get(tp, ()):
            if first <= need <= last:
                need = last + 1
                if need > hi:
                    return True
        return need > hi

    return covered


# One unit of an append: (topic, partition), partition key, first offset, then
# either record tuples and None, or contents and their ts_ms (int or one each).
Unit = tuple[tuple[str, str], bytes, int, Sequence[Any], Any]


class PartState:
    """A partition's info while an append transaction changes it."""

    __slots__ = ("pkey", "pid", "first", "last", "count", "nbytes", "changed", "new", "holes")

    def __init__(self, pkey: bytes, pid: int, first: int, last: int, count: int, nbytes: int):
        self.pkey = pkey
        self.pid = pid
        self.first = first
        self.last = last
        self.count = count
        self.nbytes = nbytes
        self.changed = False
        self.new = False  # created by this transaction
        self.holes: list[tuple[int, int]] = []  # (first, last) recorded by this transaction

    def pack(self) -> bytes:
        return PARTITION_INFO.pack(self.pid, self.first, self.last, self.count, self.nbytes)
