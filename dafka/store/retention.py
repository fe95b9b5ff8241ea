"""Retention by block: the oldest blocks of a partition leave whole, by age or by a topic's size.

A function over a write transaction the caller owns (:meth:`dafka.store.db.RecordDB.enforce_retention`
opens and commits it).  Only block headers are read (and a CODEC_STORE block's payload field):
no record is decoded.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dafka.store.block import BLOCK_KEY, HEADER_SIZE, BlockHeader, decode_header, records
from dafka.store.layout import PARTITION_INFO, unpack_partition_key
from dafka.store.reader import block_payload

__all__ = ["Retention", "RetentionPolicy", "RetentionResult", "delete_front_txn", "retention_txn", "visible"]


class Retention(NamedTuple):
    """Limits of one topic; ``None`` keeps everything."""

    max_age_ms: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class RetentionPolicy:
    """Retention limits: ``topics[topic]`` if present (it replaces ``default``
    entirely), else ``default``.  The default policy keeps everything."""

    default: Retention = Retention()
    topics: Mapping[str, Retention] = field(default_factory=dict)

    def for_topic(self, topic: str) -> Retention:
        """The limits that apply to ``topic``."""
        return self.topics.get(topic, self.default)


class RetentionResult(NamedTuple):
    """Outcome of one :meth:`RecordDB.enforce_retention` call."""

    deleted: int  # records removed
    freed_bytes: int  # payload bytes removed
    more: bool  # the budget ran out while records were still due: call again


def visible(hdr: BlockHeader, value: bytes | memoryview, first: int, stop: int | None = None) -> int:
    """The records of a block at offsets ``first`` (the partition's start) and on, below
    ``stop`` if given: what its partition counts of it.  A block starting before its
    partition's start is the partial front block :func:`delete_front_txn` leaves; only a
    sparse Tank bundle (holes inside) is decoded to count it."""
    lo = max(first, hdr.first_offset)
    hi = hdr.last_offset if stop is None else min(stop - 1, hdr.last_offset)
    if lo > hi:
        return 0
    if lo == hdr.first_offset and hi == hdr.last_offset:
        return int(hdr.record_count)
    if hdr.record_count == hdr.last_offset - hdr.first_offset + 1:
        return hi - lo + 1
    return sum(1 for rec in records(value, lo) if rec.offset <= hi)


def _forget_holes(txn: Any, holes_db: Any, pid: int, first: int) -> None:
    """Holes below a partition's new first are forgotten, as the records before them."""
    if holes_db is None:
        return
    hcur = txn.cursor(db=holes_db)
    floor = BLOCK_KEY.pack(pid, first)
    if hcur.set_range(BLOCK_KEY.pack(pid, 0)):
        while bytes(hcur.key()) < floor and hcur.delete():
            pass


def _reached(cur: Any, pid: int, offset: int) -> tuple[BlockHeader | None, Any] | None:
    """:func:`dafka.store.reader.seek`, whose header is None when it cannot be read (bit rot)
    rather than raise: the block keyed before ``offset`` is then taken to hold it (as
    :func:`dafka.store.reader.block_after` does).  The cursor on the block; None when none."""
    key = BLOCK_KEY.pack(pid, offset)
    landed = cur.set_range(key)
    if landed and cur.key() == key:
        value = cur.value()
        return _header(value), value
    if (cur.prev() if landed else cur.last()) and BLOCK_KEY.unpack(cur.key())[0] == pid:
        value = cur.value()
        hdr = _header(value)
        if hdr is None or hdr.last_offset >= offset:
            return hdr, value
    if not landed or not cur.set_range(key) or BLOCK_KEY.unpack(cur.key())[0] != pid:
        return None
    value = cur.value()
    return _header(value), value


def _header(value: Any) -> BlockHeader | None:
    try:
        return decode_header(value)
    except (ValueError, struct.error):
        return None


def _damaged_front(cur: Any, pid: int, last: int) -> tuple[int, int]:
    """At a block whose header cannot be read (the cursor on it), holding ``first`` or the
    first after it: ``(its key, where it certainly ends + 1)``, by the keys: the next
    block's key, or the head + 1 when it is the partition's last (``last``); the cursor
    back on it."""
    key = BLOCK_KEY.unpack(cur.key())[1]
    if cur.next():
        npid, nkey = BLOCK_KEY.unpack(cur.key())
        cur.prev()
        if npid == pid:
            return key, nkey
    else:
        cur.last()
    return key, last + 1


def delete_front_txn(
    txn: Any, parts_db: Any, blocks_db: Any, holes_db: Any, pkey: bytes, before: int, budget: int
) -> tuple[int, bool]:
    """Advance a partition's start to ``before`` (not past its head), about ``budget``
    records at most: ``(first offset now held, done)``.  (Kafka's DeleteRecords.)

    Blocks wholly below the new start leave whole, as retention drops them.  The block
    holding the new start stays, whole, as the partial front block: the partition's
    ``first`` (which every read starts from: ``max(offset, first)``) is the new start, its
    ``count`` leaves out the block's records below it (see :func:`visible`), and its
    ``bytes`` still count the block until it leaves (they are on disk).  Records hidden in
    a block spend the budget as deleted ones do.  Heads never change.
    """
    raw = txn.get(pkey, db=parts_db)
    if raw is None:
        return 0, True
    pid, first, last, count, nbytes = PARTITION_INFO.unpack(raw)
    stop = min(before, last + 1)
    if first >= stop or not count:
        return first, True
    cur = txn.cursor(db=blocks_db)
    while first < stop and budget > 0 and count > 0:
        found = _reached(cur, pid, first)
        if found is None:
            count = 0
            break
        hdr, value = found
        if hdr is None:
            # Its header cannot be read (bit rot): by the keys it ends before the next
            # block (or holds up to the head).  Deleted whole only when that is below the
            # new start; else the start moves into it, the block kept.  Its records are
            # not known: it counts one (at least, when none is hidden yet), never more
            # (the count must not reach 0 while records are held).
            key, end = _damaged_front(cur, pid, last)
            if key > first:
                first = key  # past a hole
                continue
            if end <= stop:
                nbytes -= len(value) - HEADER_SIZE
                cur.delete()
                count -= 1 if key == first else 0
                budget -= end - first
                first = end
                continue
            budget -= stop - first
            first = stop
            break
        if hdr.first_offset > first:
            first = hdr.first_offset  # past a hole
            continue
        held = visible(hdr, value, first)
        if hdr.last_offset < stop and held <= budget:
            nbytes -= block_payload(hdr, value)
            cur.delete()
            count -= held
            budget -= held
            first = hdr.last_offset + 1
            continue
        new_first = min(stop, first + budget)
        hidden = visible(hdr, value, first, new_first)
        count -= hidden
        budget -= new_first - first
        first = new_first
    if count > 0:
        found = _reached(cur, pid, first)
        if found is None:
            count = 0
        elif found[0] is None:
            first = max(first, BLOCK_KEY.unpack(cur.key())[1])  # (its header cannot be read)
        elif found[0].first_offset > first:
            first = found[0].first_offset  # the next record held (past a hole)
    if count <= 0:
        count, first = 0, last + 1  # nothing left
    txn.put(pkey, PARTITION_INFO.pack(pid, first, last, count, max(nbytes, 0)), db=parts_db)
    _forget_holes(txn, holes_db, pid, first)
    return first, first >= stop


def retention_txn(
    txn: Any, parts_db: Any, blocks_db: Any, holes_db: Any, now_ms: int, policy: RetentionPolicy, budget: int,
    damaged: list[tuple[str, str, int]] | None = None,
) -> RetentionResult:
    """Delete the blocks ``policy`` no longer keeps, about ``budget`` records at most.

    Per topic, first by age: from the front of each partition, the blocks whose newest
    record (``max_ts``) is before ``now_ms - max_age_ms``, stopping at the first block
    it keeps, so what is left stays one run.  Then by size: while the topic's payload
    total exceeds ``max_bytes``, the front block with the oldest first record among the
    topic's partitions.  A block leaves whole: up to one block per partition may outlive
    its limit.  Heads never change.  A block leaves only when its records fit what is
    left of ``budget``, except the first of a call (so every call makes progress).

    A front block that cannot be read (its header: bit rot) stops its partition's
    retention there, kept whole (its range and age are not known: deleting it might take
    records the policy keeps), its ``(topic, partition, offset)`` appended to ``damaged``
    when given; the other partitions go on (by size, the topic's others pass it, its bytes
    still counted).
    """
    by_topic: dict[bytes, list[list[Any]]] = {}
    for key, raw in txn.cursor(db=parts_db).iternext():
        # state: [pkey, pid, first, last, count, bytes, changed]
        by_topic.setdefault(key[: 1 + key[0]], []).append([key, *PARTITION_INFO.unpack(raw), False])
    cur = txn.cursor(db=blocks_db)
    pack_key = BLOCK_KEY.pack
    unpack_key = BLOCK_KEY.unpack
    deleted = freed = 0
    more = False

    if damaged is None:
        damaged = []

    def stuck(st: list[Any]) -> None:
        """Partition ``st``'s retention stops at its front block, which cannot be read."""
        where = (*unpack_partition_key(bytes(st[0])), st[2])
        if where not in damaged:
            damaged.append(where)

    def front(st: list[Any]) -> tuple[Any, bytes] | None:
        """The header and value of partition ``st``'s first block (the cursor on it), or None
        when its header cannot be read (noted in ``damaged``: the partition's retention stops
        there, the others go on; where it ends and how old it is are not known)."""
        if not cur.set_range(pack_key(st[1], 0)) or unpack_key(cur.key())[0] != st[1]:
            raise ValueError(f"partition pid {st[1]} counts {st[4]} records and holds no block")
        value = cur.value()
        try:
            return decode_header(value), value
        except (ValueError, struct.error):
            stuck(st)
            return None

    def drop(st: list[Any], hdr: Any, value: bytes) -> bool:
        """Delete the block under the cursor, the front of partition ``st``; False (nothing
        deleted, noted in ``damaged``) when a partial front block's records cannot be counted."""
        nonlocal deleted, freed, budget
        size = block_payload(hdr, value)
        try:
            held = visible(hdr, value, st[2])  # less than its count if it is a partial front block
        except (ValueError, struct.error):
            stuck(st)
            return False
        cur.delete()  # the cursor moves to the next entry
        st[4] -= held
        key = cur.key()
        if st[4] > 0 and key and unpack_key(key)[0] == st[1]:
            st[2] = unpack_key(key)[1]  # the next block: first + n, or past a hole
        else:
            st[4] = 0
            st[2] = st[3] + 1
        st[5] = max(0, st[5] - size)
        st[6] = True
        deleted += held
        freed += size
        budget -= held
        return True

    for tprefix, states in by_topic.items():
        rule = policy.for_topic(bytes(tprefix[1:]).decode("utf-8"))
        if rule.max_age_ms is not None:
            cutoff = now_ms - rule.max_age_ms
            for st in states:
                while st[4]:
                    got = front(st)
                    if got is None:
                        break
                    hdr, value = got
                    if hdr.max_ts >= cutoff:
                        break
                    if hdr.record_count > budget and deleted:
                        more = True
                        break
                    if not drop(st, hdr, value):
                        break
                if more:
                    break
        if more:
            break
        if rule.max_bytes is not None:
            total = sum(st[5] for st in states)
            heap = []
            for i, st in enumerate(states):
                if st[4] and (got := front(st)) is not None:
                    heap.append((got[0].first_ts, st[2], i))
            heapq.heapify(heap)
            while total > rule.max_bytes and heap:
                _ts, _off, i = heapq.heappop(heap)
                st = states[i]
                before = st[5]
                got = front(st)
                if got is None:
                    continue  # (read when pushed, in this transaction: cannot happen)
                hdr, value = got
                if total - block_payload(hdr, value) < rule.max_bytes:
                    break  # the oldest block outlives the limit: without it the topic would hold less
                if hdr.record_count > budget and deleted:
                    more = True
                    break
                if not drop(st, hdr, value):
                    continue  # this partition stops at it; the topic's others go on
                total -= before - st[5]
                if st[4] and (got := front(st)) is not None:
                    heapq.heappush(heap, (got[0].first_ts, st[2], i))
            if more:
                break
    for states in by_topic.values():
        for st in states:
            if st[6]:
                txn.put(st[0], PARTITION_INFO.pack(*st[1:6]), db=parts_db)
                _forget_holes(txn, holes_db, st[1], st[2])
    return RetentionResult(deleted, freed, more)
