"""Recorded holes and filling them (RecordDB.holes / fill_holes), on real LMDB.

A store that gave offsets up records the hole; a peer bringing the records
later fills it.  Filling must never overwrite a stored record, and every read
(fetch, read, info, retention) must see the filled records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb

from dafka.store import layout
from dafka.store.db import Hole, RecordDB, Retention, RetentionPolicy

P1 = "0123456789ABCDEF0123456789ABCDEF"
P2 = "FEDCBA9876543210FEDCBA9876543210"


def content_for(offset: int) -> bytes:
    return (b"%d:" % offset).ljust(40, b"x")


def plain(partition: str, first: int, n: int, ts: int = 1000) -> list[tuple[Any, ...]]:
    return [("t", partition, o, content_for(o), ts) for o in range(first, first + n)]


def fills(partition: str, first: int, n: int, ts: int = 2000) -> list[tuple[Any, ...]]:
    return [("t", partition, o, content_for(o), ts) for o in range(first, first + n)]


def offsets(db: RecordDB, partition: str, start: int = 0) -> list[int]:
    return [r.offset for r in db.read("t", partition, start, 1000)]


def holed(tmp_path: Path) -> RecordDB:
    """0..4, hole 5..9, 10..14, hole 15..19, 20..24 (tuples, runs and ready pairs make them)."""
    db = RecordDB(tmp_path / "db")
    db.append(plain(P1, 0, 5))
    db.append(plain(P1, 10, 5), skips=[("t", P1, 5, 9)])
    pid = db.info("t", P1).pid
    pairs = [(layout.RECORD_KEY.pack(pid, o), layout.pack_value(1000, content_for(o))) for o in range(20, 25)]
    db.append_pairs([], pairs, [("t", P1, pid, 20, 24, 200)], skips=[("t", P1, 15, 19)])
    return db


def test_holes_are_recorded_where_the_head_moves_past_them(tmp_path: Path) -> None:
    with holed(tmp_path) as db:
        db.append_runs([("t", P2, 0, [b"a"], 5)])
        db.append_runs([("t", P2, 3, [b"b"], 5)], skips=[("t", P2, 1, 2)])
        assert db.holes() == [Hole("t", P1, 5, 9), Hole("t", P1, 15, 19), Hole("t", P2, 1, 2)]
        assert db.holes(limit=1) == [Hole("t", P1, 5, 9)]
    # They survive a restart.
    with RecordDB(tmp_path / "db") as db:
        assert len(db.holes()) == 3


def test_a_refused_partition_records_no_hole(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain(P1, 0, 2))
        rejected: dict[tuple[str, str], str] = {}
        # The skip covers 2..4 but not 5: the partition is refused, no hole recorded.
        db.append(plain(P1, 6, 1), skips=[("t", P1, 2, 4)], rejected=rejected)
        assert rejected and db.holes() == []


def test_filling_a_hole_makes_every_read_see_the_records(tmp_path: Path) -> None:
    with holed(tmp_path) as db:
        assert db.fill_holes(fills(P1, 5, 5)) == (5, 0)
        info = db.info("t", P1)
        assert (info.first, info.last, info.count, info.bytes) == (0, 24, 20, 20 * 40)
        assert offsets(db, P1) == list(range(15)) + list(range(20, 25))
        assert db.holes() == [Hole("t", P1, 15, 19)]
        start, values = db.fetch("t", P1, 3, 100)
        assert start == 3 and values == [content_for(o) for o in range(3, 15)]  # stops at the other hole
        assert [r.ts_ms for r in db.read("t", P1, 5, 5)] == [2000] * 5
        # The last hole too: the partition is contiguous again (the fast read path).
        assert db.fill_holes(fills(P1, 15, 5)) == (5, 0)
        info = db.info("t", P1)
        assert info.count == info.last - info.first + 1 == 25
        assert db.fetch("t", P1, 0, 100)[1] == [content_for(o) for o in range(25)]
        assert db.holes() == []


def test_a_partial_fill_splits_the_hole(tmp_path: Path) -> None:
    with holed(tmp_path) as db:
        assert db.fill_holes(fills(P1, 7, 1) + fills(P1, 9, 1)) == (2, 0)
        assert db.holes() == [Hole("t", P1, 5, 6), Hole("t", P1, 8, 8), Hole("t", P1, 15, 19)]
        assert offsets(db, P1, 5) == [7, 9, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
        assert db.info("t", P1).count == 17


def test_filling_never_overwrites_nor_writes_outside_a_hole(tmp_path: Path) -> None:
    """A hostile or confused peer: stored offsets, offsets past the head, unknown partitions."""
    with holed(tmp_path) as db:
        before = list(db.read("t", P1, 0, 100))
        evil = [
            ("t", P1, 3, b"EVIL", 1),  # stored
            ("t", P1, 12, b"EVIL", 1),  # stored, between holes
            ("t", P1, 25, b"EVIL", 1),  # past the head
            ("t", P1, 10**12, b"EVIL", 1),
            ("t", P1, -1, b"EVIL", 1),
            ("t", P2, 0, b"EVIL", 1),  # never stored
            ("t", "x" * 300, 0, b"EVIL", 1),  # no partition has such a name
        ]
        assert db.fill_holes(evil) == (0, 0)
        assert list(db.read("t", P1, 0, 100)) == before
        assert db.info("t", P1).count == 15
        # Twice the same fill: the second one finds no hole.
        assert db.fill_holes(fills(P1, 5, 2)) == (2, 0)
        assert db.fill_holes([("t", P1, 5, b"EVIL", 1)]) == (0, 0)
        assert db.fetch("t", P1, 5, 1)[1] == [content_for(5)]


def test_giving_an_offset_up_leaves_it_out_of_the_hole(tmp_path: Path) -> None:
    with holed(tmp_path) as db:
        assert db.fill_holes([("t", P1, 5, None, 0)]) == (0, 1)
        assert db.holes()[0] == Hole("t", P1, 6, 9)
        assert db.info("t", P1).count == 15


def test_retention_forgets_the_holes_below_first(tmp_path: Path) -> None:
    with holed(tmp_path) as db:
        policy = RetentionPolicy(Retention(max_age_ms=500))
        db.append([("t", P1, o, content_for(o), 10_000) for o in range(25, 30)])
        assert db.holes() == [Hole("t", P1, 5, 9), Hole("t", P1, 15, 19)]
        # Records with ts 1000 are older than 500 ms at 1600: 0..24 go, 25.. stay.
        db.enforce_retention(1600, policy)
        info = db.info("t", P1)
        assert info.first == 25
        assert db.holes() == []  # both holes were below first
        assert db.fill_holes(fills(P1, 5, 5)) == (0, 0)


def test_retention_keeps_the_holes_above_first(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain(P1, 0, 5, ts=1000))
        db.append(plain(P1, 10, 5, ts=5000), skips=[("t", P1, 5, 9)])
        db.append(plain(P1, 20, 5, ts=5000), skips=[("t", P1, 15, 19)])
        db.enforce_retention(3000, RetentionPolicy(Retention(max_age_ms=1000)))
        assert db.info("t", P1).first == 10
        assert db.holes() == [Hole("t", P1, 15, 19)]
        assert db.fill_holes(fills(P1, 15, 5)) == (5, 0)
        assert db.fill_holes(fills(P1, 5, 5)) == (0, 0)  # below first: forgotten
        assert offsets(db, P1) == list(range(10, 25))
        # Retention after a fill still finds first on a stored record.
        db.enforce_retention(10_000, RetentionPolicy(Retention(max_age_ms=1000)))
        assert db.info("t", P1).count == 0 and db.holes() == []


def test_a_store_with_holes_from_before_the_table_gets_it_built(tmp_path: Path) -> None:
    with holed(tmp_path) as db:
        pass
    # Drop the table, as a store written before it existed.
    env = lmdb.open(str(tmp_path / "db"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"holes", txn=txn), delete=True)
    env.close()
    with RecordDB(tmp_path / "db", readonly=False) as db:
        assert db.holes() == [Hole("t", P1, 5, 9), Hole("t", P1, 15, 19)]
        assert db.fill_holes(fills(P1, 5, 5)) == (5, 0)


def test_building_the_table_past_a_partial_front_block_finds_only_the_real_holes(tmp_path: Path) -> None:
    """delete_front leaves the block holding the new start whole (its records below the
    start hidden): building the holes table starts from that block, not after it."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain(P1, 0, 10))
        db.append(plain(P1, 10, 10))
        db.append(plain(P1, 25, 5), skips=[("t", P1, 20, 24)])
        assert db.delete_front("t", P1, 3) == (3, True)
    env = lmdb.open(str(tmp_path / "db"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"holes", txn=txn), delete=True)
    env.close()
    with RecordDB(tmp_path / "db", readonly=False) as db:
        assert db.holes() == [Hole("t", P1, 20, 24)]
        assert offsets(db, P1) == [*range(3, 20), *range(25, 30)]
