"""Retention by block: the oldest blocks of a partition leave whole, by age or by a topic's size.

A function over a write transaction the caller owns (:meth:`dafka.store.db.RecordDB.enforce_retention`
opens and commits it).  Only block headers are read (and a CODEC_STORE block's payload field):
no record is decoded.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dafka.store.block import BLOCK_KEY, decode_header
from dafka.store.layout import PARTITION_INFO
from dafka.store.reader import block_payload

__all__ = ["Retention", "RetentionPolicy", "RetentionResult", "retention_txn"]


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


def retention_txn(
    txn: Any, parts_db: Any, blocks_db: Any, holes_db: Any, now_ms: int, policy: RetentionPolicy, budget: int
) -> RetentionResult:
    """Delete the blocks ``policy`` no longer keeps, about ``budget`` records at most.

    Per topic, first by age: from the front of each partition, the blocks whose newest
    record (``max_ts``) is before ``now_ms - max_age_ms``, stopping at the first block
    it keeps, so what is left stays one run.  Then by size: while the topic's payload
    total exceeds ``max_bytes``, the front block with the oldest first record among the
    topic's partitions.  A block leaves whole: up to one block per partition may outlive
    its limit.  Heads never change.  A block leaves only when its records fit what is
    left of ``budget``, except the first of a call (so every call makes progress).
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

    def front(st: list[Any]) -> tuple[Any, bytes]:
        """The header and value of partition ``st``'s first block (the cursor on it)."""
        if not cur.set_range(pack_key(st[1], 0)) or unpack_key(cur.key())[0] != st[1]:
            raise ValueError(f"partition pid {st[1]} counts {st[4]} records and holds no block")
        value = cur.value()
        return decode_header(value), value

    def drop(st: list[Any], hdr: Any, value: bytes) -> None:
        """Delete the block under the cursor, the front of partition ``st``."""
        nonlocal deleted, freed, budget
        size = block_payload(hdr, value)
        cur.delete()  # the cursor moves to the next entry
        st[4] -= hdr.record_count
        key = cur.key()
        if st[4] > 0 and key and unpack_key(key)[0] == st[1]:
            st[2] = unpack_key(key)[1]  # the next block: first + n, or past a hole
        else:
            st[4] = 0
            st[2] = st[3] + 1
        st[5] = max(0, st[5] - size)
        st[6] = True
        deleted += hdr.record_count
        freed += size
        budget -= hdr.record_count

    for tprefix, states in by_topic.items():
        rule = policy.for_topic(bytes(tprefix[1:]).decode("utf-8"))
        if rule.max_age_ms is not None:
            cutoff = now_ms - rule.max_age_ms
            for st in states:
                while st[4]:
                    hdr, value = front(st)
                    if hdr.max_ts >= cutoff:
                        break
                    if hdr.record_count > budget and deleted:
                        more = True
                        break
                    drop(st, hdr, value)
                if more:
                    break
        if more:
            break
        if rule.max_bytes is not None:
            total = sum(st[5] for st in states)
            heap = []
            for i, st in enumerate(states):
                if st[4]:
                    heap.append((front(st)[0].first_ts, st[2], i))
            heapq.heapify(heap)
            while total > rule.max_bytes and heap:
                _ts, _off, i = heapq.heappop(heap)
                st = states[i]
                before = st[5]
                hdr, value = front(st)
                if total - block_payload(hdr, value) < rule.max_bytes:
                    break  # the oldest block outlives the limit: without it the topic would hold less
                if hdr.record_count > budget and deleted:
                    more = True
                    break
                drop(st, hdr, value)
                total -= before - st[5]
                if st[4]:
                    heapq.heappush(heap, (front(st)[0].first_ts, st[2], i))
            if more:
                break
    hcur = None if holes_db is None else txn.cursor(db=holes_db)
    for states in by_topic.values():
        for st in states:
            if st[6]:
                txn.put(st[0], PARTITION_INFO.pack(*st[1:6]), db=parts_db)
                if hcur is not None:
                    # Holes below the new first are forgotten, as the records before them.
                    floor = pack_key(st[1], st[2])
                    if hcur.set_range(pack_key(st[1], 0)):
                        while bytes(hcur.key()) < floor and hcur.delete():
                            pass
    return RetentionResult(deleted, freed, more)
