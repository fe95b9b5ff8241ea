"""RecordDB.append_blocks' lean transaction (``append_plain_blocks``) against the general
path: the same heads, refusals, duplicates and database, whatever blocks come; real LMDB."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dafka.store.block import store_block
from dafka.store.db import RecordDB
from dafka.store.layout import VALUE_HEADER

P = "0123456789ABCDEF0123456789ABCDEF"
TOPICS = ("t", "u", "v")


def sblock(first: int, n: int, tag: int) -> bytes:
    contents = [b"%d-%d-%d" % (tag, first, i) for i in range(n)]
    values = [VALUE_HEADER.pack(1000 + first, 0) + c for c in contents]
    return store_block(first, values, sum(map(len, contents)))


def dump(db: RecordDB) -> dict[str, list[tuple[bytes, bytes]]]:
    out: dict[str, list[tuple[bytes, bytes]]] = {}
    with db._read_txn() as (txn, dbs):
        for name, handle in zip(dbs._fields, dbs, strict=True):
            out[name] = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=handle)]
        if db._holes_db is not None:
            out["holes"] = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db._holes_db)]
    return out


def apply(db: RecordDB, blocks: list[tuple[str, str, bytes]], skips: list[Any], refuse: bool) -> tuple[Any, ...]:
    rejected: dict[tuple[str, str], str] | None = {} if refuse else None
    try:
        heads = db.append_blocks(blocks, skips=skips, rejected=rejected)
    except (ValueError, TypeError) as exc:
        return ("raised", type(exc).__name__)
    return (heads, sorted(rejected or ()), db.duplicates)


# A call: blocks of some partitions, each at an offset relative to that partition's head
# (continuing it, a duplicate, an overlap, a gap), sometimes not a block at all.
BLOCK = st.tuples(
    st.sampled_from(TOPICS),
    st.sampled_from([1, 1, 1, 1, 0, -1, -2, 2, 4]),  # first offset - head
    st.integers(1, 4),  # records
    st.booleans(),  # not a block (a few bytes)
)
CALLS = st.lists(
    # blocks, with a skip over a gap, with a rejected dict (else a refusal raises)
    st.tuples(st.lists(BLOCK, min_size=1, max_size=5), st.booleans(), st.booleans()),
    min_size=1, max_size=8,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CALLS)
def test_the_lean_transaction_stores_exactly_what_the_general_path_stores(calls: list[Any]) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        with RecordDB(Path(d) / "lean", sync=False) as lean, RecordDB(Path(d) / "general", sync=False) as general:
            general.append_plain_blocks = lambda blocks, gate: None  # type: ignore[method-assign]
            heads: dict[str, int] = {}  # the general database's, to aim the next offsets
            for i, (spec, with_skip, refuse) in enumerate(calls):
                blocks: list[tuple[str, str, bytes]] = []
                aim = dict(heads)
                skips: list[Any] = []
                for topic, delta, n, broken in spec:
                    first = max(0, aim.get(topic, -1) + delta)
                    if broken:
                        blocks.append((topic, P, b"not a block %d" % i))
                        continue
                    blocks.append((topic, P, sblock(first, n, i)))
                    if delta > 1 and with_skip:
                        skips.append((topic, P, aim.get(topic, -1) + 1, first - 1))
                    aim[topic] = max(aim.get(topic, -1), first + n - 1)
                want = apply(general, blocks, skips, refuse)
                assert apply(lean, blocks, skips, refuse) == want
                assert dump(lean) == dump(general)
                if isinstance(want[0], dict):
                    heads.update({k[0]: v for k, v in want[0].items()})


def test_blocks_continuing_stored_partitions_take_the_lean_transaction(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        taken: list[bool] = []
        plainly = db.append_plain_blocks

        def watched(blocks: Any, gate: Any) -> Any:
            got = plainly(blocks, gate)
            taken.append(got is not None)
            return got

        db.append_plain_blocks = watched  # type: ignore[method-assign]
        # New partitions: the general path creates them.
        assert db.append_blocks([("t", P, sblock(0, 2, 0)), ("u", P, sblock(5, 1, 0))]) == {("t", P): 1, ("u", P): 5}
        # Continuing them, two blocks of one partition and one of another: lean.
        heads = db.append_blocks([("u", P, sblock(6, 3, 1)), ("t", P, sblock(2, 1, 1)), ("t", P, sblock(3, 2, 1))])
        assert heads == {("t", P): 4, ("u", P): 8}
        assert taken == [False, True]
        info = db.info("t", P)
        assert info is not None and (info.first, info.last, info.count) == (0, 4, 5)
        assert db.fetch("t", P, 0, 10) == (0, [b"0-0-0", b"0-0-1", b"1-2-0", b"1-3-0", b"1-3-1"])
        assert db.fetch("u", P, 0, 10) == (5, [b"0-5-0", b"1-6-0", b"1-6-1", b"1-6-2"])
        # A duplicate, a gap, or blocks of one partition out of order: the general path.
        assert db.append_blocks([("t", P, sblock(4, 1, 2))]) == {("t", P): 4}
        assert db.duplicates == 1
        with pytest.raises(ValueError, match="gap"):
            db.append_blocks([("t", P, sblock(7, 1, 2))])
        assert db.append_blocks([("t", P, sblock(6, 1, 3)), ("t", P, sblock(5, 1, 3))]) == {("t", P): 6}
        assert taken == [False, True, False, False, False]
        assert db.fetch("t", P, 5, 10) == (5, [b"3-5-0", b"3-6-0"])


def test_the_lean_transaction_grows_a_full_map_and_commits_everything(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db", sync=False, map_size=1 << 20) as db:
        db.append_blocks([("t", P, sblock(0, 1, 0))])
        big = [VALUE_HEADER.pack(1, 0) + bytes(60_000) for _ in range(8)]
        first = 1
        for _ in range(6):  # about 3 MB through a map of 1 MB
            assert db.append_blocks([("t", P, store_block(first, big, 8 * 60_000))]) == {("t", P): first + 7}
            first += 8
        info = db.info("t", P)
        assert info is not None and (info.first, info.last, info.count) == (0, first - 1, first)
        assert db.fetch("t", P, first - 1, 1) == (first - 1, [bytes(60_000)])


def test_a_name_no_partition_can_have_refuses_that_partition_alone_as_the_general_path_does(tmp_path: Path) -> None:
    """A partition whose name cannot be stored (a topic over 255 bytes, one holding NUL) is
    refused alone with a rejected dict, the others commit; without one, a ValueError and
    nothing written: the lean transaction leaves such a call to the general path."""
    with RecordDB(tmp_path / "db", sync=False) as db:
        assert db.append_blocks([("t", P, sblock(0, 1, 0))]) == {("t", P): 0}
        for n, bad in enumerate(("x" * 300, "a\x00b"), start=1):
            rejected: dict[tuple[str, str], str] = {}
            heads = db.append_blocks([("t", P, sblock(n, 1, n)), (bad, P, sblock(0, 1, n))], rejected=rejected)
            assert heads == {("t", P): n}
            assert list(rejected) == [(bad, P)]
            assert db.fetch("t", P, n, 1) == (n, [b"%d-%d-0" % (n, n)])
        with pytest.raises(ValueError, match="NUL"):
            db.append_blocks([("t", P, sblock(3, 1, 3)), ("a\x00b", P, sblock(0, 1, 3))])
        assert db.head("t", P) == 2 and db.partitions() == [db.info("t", P)]


def test_no_blocks_is_nothing_to_do(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db", sync=False) as db:
        assert db.append_plain_blocks([]) == {}
        assert db.append_blocks([]) == {}
