"""Format-2 blocks in real LMDB (dafka.store.blocktable): put, find, iterate, retention by block."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import lmdb
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.store import block as B
from dafka.store.blocktable import OverlapError, drop_front, find, iter_blocks, put_block

TS = 1_700_000_000_000


@pytest.fixture
def env(tmp_path: object) -> Iterator[lmdb.Environment]:
    e = lmdb.open(str(tmp_path), map_size=64 << 20, max_dbs=4)
    yield e
    e.close()


def _blk(first: int, n: int, ts: int = TS) -> bytes:
    return B.dafka_block([(ts, None, b"r%d" % (first + i)) for i in range(n)], first)


def _sparse(first: int, seqs: list[int]) -> bytes:
    from dafka.tank.bundle import encode_bundle

    return B.tank_block(encode_bundle([(s, TS, None, b"x") for s in seqs], sparse=True), first)


def test_find_across_holes_partitions_and_ends(env: lmdb.Environment) -> None:
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        put_block(txn, db, 1, _blk(0, 10))  # 0..9
        put_block(txn, db, 1, _blk(20, 5))  # 20..24 (10..19 a hole)
        put_block(txn, db, 1, _sparse(30, [1, 2, 6]))  # 30, 31, 35: a block with a hole inside
        put_block(txn, db, 0, _blk(0, 3))  # another pid before
        put_block(txn, db, 2, _blk(100, 3), append=True)  # and after
    with env.begin(db=db, buffers=True) as txn:
        def first_of(pid: int, off: int) -> int | None:
            got = find(txn, db, pid, off)
            return None if got is None else got[0].first_offset

        assert [first_of(1, o) for o in (0, 5, 9, 10, 19, 20, 24, 25, 30, 33, 35, 36)] == [
            0, 0, 0, 20, 20, 20, 20, 30, 30, 30, 30, None]
        assert first_of(0, 2) == 0 and first_of(0, 3) is None
        assert first_of(2, 0) == 100 and first_of(2, 102) == 100 and first_of(2, 103) is None
        assert first_of(3, 0) is None and first_of(1, 1 << 63) is None
        hdr, value = find(txn, db, 1, 22)  # type: ignore[misc]
        assert [r.value for r in B.records(value, 22)] == [b"r22", b"r23", b"r24"]
        assert [h.first_offset for h, _v in iter_blocks(txn, db, 1, 7)] == [0, 20, 30]
        assert [h.first_offset for h, _v in iter_blocks(txn, db, 1, 25)] == [30]
        assert list(iter_blocks(txn, db, 1, 40)) == []


def test_put_refuses_overlaps_and_non_blocks(env: lmdb.Environment) -> None:
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        put_block(txn, db, 1, _blk(10, 10))  # 10..19
        for first, n in ((10, 1), (9, 2), (19, 3), (12, 2), (0, 100)):
            with pytest.raises(OverlapError):
                put_block(txn, db, 1, _blk(first, n))
        put_block(txn, db, 1, _blk(5, 5))  # 5..9 fits before
        put_block(txn, db, 1, _blk(20, 1))  # and 20 after
        put_block(txn, db, 2, _blk(10, 10))  # another partition is independent
        with pytest.raises(ProtocolError):
            put_block(txn, db, 1, b"not a block")
        with pytest.raises(ValueError, match="append"):  # MDB_APPEND is checked by LMDB, not trusted
            put_block(txn, db, 1, _blk(30, 1), append=True)
        assert find(txn, db, 1, 30) is None


def test_retention_by_block(env: lmdb.Environment) -> None:
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        for i in range(10):
            put_block(txn, db, 1, _blk(i * 10, 10, ts=TS + i))
        put_block(txn, db, 2, _blk(0, 1))
    with env.begin(write=True, db=db) as txn:
        # By age: a block leaves when its max timestamp is before the cutoff.
        d = drop_front(txn, db, 1, lambda h, _n: h.max_ts < TS + 3)
        assert (d.blocks, d.records, d.first) == (3, 30, 30)
        # At most max_blocks a call.
        d = drop_front(txn, db, 1, lambda h, _n: True, max_blocks=2)
        assert (d.blocks, d.first) == (2, 50)
        d = drop_front(txn, db, 1, lambda h, _n: True)
        assert (d.blocks, d.records, d.first) == (5, 50, None)
        assert find(txn, db, 2, 0) is not None  # the other partition untouched
        d = drop_front(txn, db, 2, lambda h, _n: True)
        assert (d.blocks, d.first) == (1, None)
        assert drop_front(txn, db, 2, lambda h, _n: True) == (0, 0, 0, None)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(1, 8)), max_size=25),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 80)), min_size=1, max_size=30))
def test_find_agrees_with_a_model(puts: list[tuple[int, int, int]], probes: list[tuple[int, int]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        e = lmdb.open(d, map_size=16 << 20, max_dbs=2)
        db = e.open_db(b"blocks")
        model: dict[int, list[tuple[int, int]]] = {}
        with e.begin(write=True, db=db) as txn:
            for pid, first, n in puts:
                last = first + n - 1
                overlaps = any(f <= last and first <= lst for f, lst in model.get(pid, []))
                try:
                    put_block(txn, db, pid, _blk(first, n))
                except OverlapError:
                    assert overlaps
                    continue
                assert not overlaps
                model.setdefault(pid, []).append((first, last))
        with e.begin(db=db) as txn:
            for pid, off in probes:
                want = min((b for b in model.get(pid, []) if b[1] >= off), default=None)
                got = find(txn, db, pid, off)
                assert (None if got is None else (got[0].first_offset, got[0].last_offset)) == want
        e.close()
