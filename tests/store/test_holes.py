"""Holes in a partition's history (skipped offsets) and per-partition refusals.

A store that gives up on offsets nobody can supply records the skip: the
partition's head moves past the hole, its stored records do not.  A batch the
database refuses for one partition must never take the others down with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dafka.store import layout
from dafka.store.db import RecordDB, Retention, RetentionPolicy

P1 = "0123456789ABCDEF0123456789ABCDEF"
P2 = "FEDCBA9876543210FEDCBA9876543210"


def content_for(offset: int) -> bytes:
    return (b"%d:" % offset).ljust(40, b"x")


def plain(topic: str, partition: str, first: int, n: int, ts: int = 1000) -> list[tuple[Any, ...]]:
    return [(topic, partition, o, content_for(o), ts) for o in range(first, first + n)]


def ready(topic: str, partition: str, pid: int, first: int, n: int, ts: int = 1000) -> tuple[list[Any], Any]:
    """Ready pairs and their run, as fastio.drain_pairs builds them."""
    pairs = [(layout.RECORD_KEY.pack(pid, o), layout.pack_value(ts, content_for(o))) for o in range(first, first + n)]
    return pairs, (topic, partition, pid, first, first + n - 1, 40 * n)


def offsets(db: RecordDB, partition: str, start: int = 0) -> list[int]:
    return [r.offset for r in db.read("t", partition, start, 1000)]


def test_the_issue_pattern_two_skips_then_more(tmp_path: Path) -> None:
    """Offset 10 first (0..9 skipped), then 20 (11..19 skipped), then 21..: as the store node commits them."""
    with RecordDB(tmp_path / "db") as db:
        rejected: dict[tuple[str, str], str] = {}
        heads = db.append(plain("t", P1, 10, 1), skips=[("t", P1, 0, 9)], rejected=rejected)
        assert heads == {("t", P1): 10} and not rejected
        pid = db.info("t", P1).pid
        pairs, seg = ready("t", P1, pid, 20, 5)
        heads = db.append_pairs([], pairs, [seg], skips=[("t", P1, 11, 19)], rejected=rejected)
        assert heads == {("t", P1): 24} and not rejected
        info = db.info("t", P1)
        assert (info.first, info.last, info.count) == (10, 24, 6)
        assert offsets(db, P1) == [10, 20, 21, 22, 23, 24]
        # The next commit continues the head as usual.
        pairs, seg = ready("t", P1, pid, 25, 2)
        assert db.append_pairs([], pairs, [seg]) == {("t", P1): 26}


def test_skip_in_tuples_and_runs(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 3))
        # Tuples of one partition with a hole inside the batch.
        batch = plain("t", P1, 3, 2) + plain("t", P1, 8, 2)
        assert db.append(batch, skips=[("t", P1, 5, 7)]) == {("t", P1): 9}
        # A run beyond the head.
        assert db.append_runs([("t", P1, 12, [b"a", b"b"], 5)], skips=[("t", P1, 10, 11)]) == {("t", P1): 13}
        assert offsets(db, P1) == [0, 1, 2, 3, 4, 8, 9, 12, 13]
        info = db.info("t", P1)
        assert (info.first, info.last, info.count) == (0, 13, 9)
        assert info.bytes == 40 * 7 + 2


def test_fetch_over_a_hole_starts_at_the_next_stored_offset(tmp_path: Path) -> None:
    """As after retention: asked for a missing offset, the answer starts at the next one held."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 5))
        db.append(plain("t", P1, 10, 5), skips=[("t", P1, 5, 9)])
        start, values = db.fetch("t", P1, 0, 100)
        assert start == 0 and values == [content_for(o) for o in range(5)]  # contiguous: stops at the hole
        start, values = db.fetch("t", P1, 6, 3)
        assert start == 10 and values == [content_for(o) for o in range(10, 13)]
        assert db.fetch("t", P1, 15, 10) == (15, [])
        assert offsets(db, P1, 3) == [3, 4, 10, 11, 12, 13, 14]


def test_retention_over_a_hole_keeps_first_on_a_stored_record(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 3, ts=1))
        db.append(plain("t", P1, 10, 3, ts=100), skips=[("t", P1, 3, 9)])
        result = db.enforce_retention(200, RetentionPolicy(Retention(max_age_ms=150)))
        assert result.deleted == 3
        info = db.info("t", P1)
        assert (info.first, info.last, info.count) == (10, 12, 3)
        assert db.fetch("t", P1, 0, 10)[0] == 10
        # By size: the front record goes, first moves to the next stored one.
        db.append(plain("t", P1, 20, 1, ts=300), skips=[("t", P1, 13, 19)])
        db.enforce_retention(300, RetentionPolicy(Retention(max_bytes=40)))
        info = db.info("t", P1)
        assert (info.first, info.last, info.count) == (20, 20, 1)
        assert offsets(db, P1) == [20]


def test_an_unexplained_gap_refuses_only_its_partition(tmp_path: Path) -> None:
    """Pairs, tuples and runs: the other partitions of the transaction commit."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 3) + plain("t", P2, 0, 3))
        pid1, pid2 = db.info("t", P1).pid, db.info("t", P2).pid
        p1, s1 = ready("t", P1, pid1, 10, 2)  # gap: head is 2
        p2, s2 = ready("t", P2, pid2, 3, 4)
        rejected: dict[tuple[str, str], str] = {}
        heads = db.append_pairs(plain("t", "N", 0, 2), p1 + p2, [s1, s2], rejected=rejected)
        assert heads == {("t", P2): 6, ("t", "N"): 1}
        assert list(rejected) == [("t", P1)] and "continue" in rejected[("t", P1)]
        assert db.head("t", P1) == 2 and offsets(db, P2) == list(range(7))
        # Tuples: a gap in one partition, a good partition beside it.
        rejected.clear()
        heads = db.append(plain("t", P1, 5, 1) + plain("t", P2, 7, 2), rejected=rejected)
        assert heads == {("t", P2): 8} and list(rejected) == [("t", P1)]
        assert db.head("t", P1) == 2
        # A new partition refused (a malformed record): no pid is kept for it.
        rejected.clear()
        bad = [("t", "X", 0, "not bytes", 1)]
        heads = db.append(bad + plain("t", P2, 9, 1), rejected=rejected)
        assert heads == {("t", P2): 9} and list(rejected) == [("t", "X")]
        assert db.info("t", "X") is None
        db.append(plain("t", "Y", 0, 1))
        assert db.info("t", "Y").pid == db.info("t", "N").pid + 1
        # Without a `rejected` dict the old contract holds: everything is refused.
        with pytest.raises(ValueError):
            db.append(plain("t", P1, 5, 1) + plain("t", P2, 10, 1))
        assert db.head("t", P2) == 9


def test_a_skip_may_only_cover_what_is_not_stored(tmp_path: Path) -> None:
    """A skip below the head changes nothing; one not covering the whole gap refuses it."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 5))
        rejected: dict[tuple[str, str], str] = {}
        heads = db.append(plain("t", P1, 5, 1), skips=[("t", P1, 0, 3)], rejected=rejected)
        assert heads == {("t", P1): 5} and not rejected
        heads = db.append(plain("t", P1, 9, 1), skips=[("t", P1, 6, 7)], rejected=rejected)
        assert heads == {} and list(rejected) == [("t", P1)]
        assert db.info("t", P1).count == 6 and offsets(db, P1) == list(range(6))


def test_a_skip_before_a_new_partitions_first_record_is_a_hole(tmp_path: Path) -> None:
    """Issue 40, seed 205892: a store that gave up 0..14 of a partition it never held
    must record them as a hole (to ask its peers again), in tuples and in runs."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 15, 2), skips=[("t", P1, 0, 14)])
        db.append_runs([("t", P2, 7, [b"a"], 5)], skips=[("t", P2, 0, 6)])
        assert [(h.partition, h.first, h.last) for h in db.holes()] == [(P1, 0, 14), (P2, 0, 6)]
        info = db.info("t", P1)
        assert (info.first, info.last, info.count) == (15, 16, 2)
        assert offsets(db, P1) == [15, 16]
        # Filled later: first moves down.
        assert db.fill_holes([("t", P1, 14, b"x", 5)]) == (1, 0)
        assert db.info("t", P1).first == 14


def test_a_new_partition_starting_without_a_skip_has_no_hole(tmp_path: Path) -> None:
    """A store that began after others' retention removed the start gave nothing up."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 500, 2))
        db.append_runs([("t", P2, 7, [b"a"], 5)])
        assert db.holes() == []
        assert db.info("t", P1).first == 500
