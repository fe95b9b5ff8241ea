"""RecordDB against real LMDB environments in temporary directories (no mocks)."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dafka.errors import ClosedError, DafkaError
from dafka.store import layout
from dafka.store.db import (
    RecordDB,
    Retention,
    RetentionPolicy,
    StorageError,
    StorageFullError,
    StoreRecord,
)

P1 = "0123456789ABCDEF0123456789ABCDEF"
P2 = "FEDCBA9876543210FEDCBA9876543210"


def content_for(offset: int, size: int = 40) -> bytes:
    """Deterministic content, so another process can verify what it reads."""
    return (b"%d:" % offset).ljust(size, b"x")


def plain(topic: str, partition: str, first: int, n: int, ts: int = 1000) -> list[tuple[Any, ...]]:
    return [(topic, partition, o, content_for(o), ts) for o in range(first, first + n)]


class ChildLines:
    """A child process whose stdout lines arrive on a queue (read by a thread)."""

    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child printed nothing for {timeout}s") from None
        if line is None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"child ended early (rc={self.proc.wait()}): {err}")
        return line

    def rest(self, timeout: float) -> list[str]:
        """Every line still to come, once the child has ended."""
        self.proc.wait(timeout=timeout)
        self._thread.join(timeout=timeout)
        out = []
        while True:
            line = self.lines.get_nowait()
            if line is None:
                return out
            out.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


# --------------------------------------------------------------------------- layout

names = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=60
).filter(lambda s: len(s.encode()) <= 255)


@pytest.mark.timeout(60)
@given(
    topic=names,
    partition=st.text(max_size=60).filter(lambda s: len(s.encode()) <= 255),
    pid=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    ts=st.integers(0, 2**64 - 1),
    key=st.none() | st.binary(max_size=255),
    content=st.binary(max_size=300),
    producer_ts=st.booleans(),
)
def test_layout_round_trips(
    topic: str,
    partition: str,
    pid: int,
    offset: int,
    ts: int,
    key: bytes | None,
    content: bytes,
    producer_ts: bool,
) -> None:
    pkey = layout.pack_partition_key(topic, partition)
    assert layout.unpack_partition_key(pkey) == (topic, partition)
    assert pkey.startswith(layout.topic_prefix(topic))
    rkey = layout.pack_record_key(pid, offset)
    assert len(rkey) == layout.RECORD_KEY_SIZE
    assert layout.unpack_record_key(rkey) == (pid, offset)
    value = layout.pack_value(ts, content, key, producer_ts)
    ts2, flags, key2, content2 = layout.unpack_value(value)
    assert (ts2, key2, content2) == (ts, key, content)
    assert bool(flags & layout.FLAG_PRODUCER_TS) == producer_ts
    assert bool(flags & layout.FLAG_KEY) == (key is not None)
    assert layout.value_content(value) == content
    assert layout.value_payload_size(value) == len(content) + len(key or b"")
    info = (pid, offset, ts, 7, 8)
    assert layout.unpack_info(layout.pack_info(*info)) == info


@pytest.mark.timeout(60)
@given(
    a=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)),
    b=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)),
)
def test_record_key_order_is_numeric_order(a: tuple[int, int], b: tuple[int, int]) -> None:
    # One partition's records must be one contiguous, offset-ordered key range.
    assert (layout.pack_record_key(*a) < layout.pack_record_key(*b)) == (a < b)


def test_bad_names_are_rejected(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        with pytest.raises(ValueError):
            db.append([("a\x00b", P1, 0, b"x", 1)])
        with pytest.raises(ValueError):
            db.append([("t" * 256, P1, 0, b"x", 1)])
        with pytest.raises(ValueError):
            db.append([("t", "é" * 128, 0, b"x", 1)])  # 256 bytes in UTF-8
        with pytest.raises(TypeError):
            db.append([(b"t", P1, 0, b"x", 1)])
        with pytest.raises(ValueError):
            db.append([("t", "\ud800", 0, b"x", 1)])  # not encodable as UTF-8
        with pytest.raises(ValueError):
            db.append([StoreRecord("t", P1, 0, b"x", 1, key=b"k" * 256)])
        with pytest.raises(ValueError):
            db.append([("t", P1, -1, b"x", 1)])
        with pytest.raises(ValueError):
            db.append([("t", P1, 0, b"x", -5)])
        with pytest.raises(TypeError):
            db.append([("t", P1, 0, "not bytes", 1)])
        assert db.partitions() == []
        with pytest.raises(ValueError, match="LMDB key size"):
            db.append([("t" * 255, "p" * 255, 0, b"x", 1)])
        assert db.partitions() == []
        # The longest legal names work.
        db.append([("t" * 255, "p" * 254, 0, b"x", 1), ("t" * 32, "p" * 255, 0, b"y", 1)])
        assert db.head("t" * 255, "p" * 254) == 0
        assert db.fetch("t" * 32, "p" * 255, 0, 1) == (0, [b"y"])


# --------------------------------------------------------------------------- append/read


@pytest.mark.timeout(60)
def test_append_read_round_trip(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        heads = db.append(
            [
                ("t", P1, 0, b"a", 100),
                StoreRecord("t", P2, 0, b"tank", 5, key=b"k1", ts_from_producer=True),
                ("t", P1, 1, b"b", 101),
                ("t", P2, 1, b"nokey", 6, None, True),
                ("t", P2, 2, b"keyed", 200, b""),  # an empty key is still a key
                ("u", P1, 0, b"", 300),
            ]
        )
        assert heads == {("t", P1): 1, ("t", P2): 2, ("u", P1): 0}
        assert list(db.read("t", P1, 0, 10)) == [(0, 100, None, b"a"), (1, 101, None, b"b")]
        assert list(db.read("t", P2, 0, 10)) == [
            (0, 5, b"k1", b"tank"),
            (1, 6, None, b"nokey"),
            (2, 200, b"", b"keyed"),
        ]
        assert list(db.read("u", P1, 0, 10)) == [(0, 300, None, b"")]
        assert db.fetch("t", P2, 0, 10) == (0, [b"tank", b"nokey", b"keyed"])
        start, raw = db.fetch_raw("t", P2, 1, 10)
        assert start == 1
        assert [layout.unpack_value(v) for v in raw] == [
            (6, layout.FLAG_PRODUCER_TS, None, b"nokey"),
            (200, layout.FLAG_KEY, b"", b"keyed"),
        ]
        info = db.info("t", P2)
        assert info is not None
        assert (info.first, info.last, info.count, info.bytes) == (0, 2, 3, 4 + 2 + 5 + 5)
        assert db.topics() == ["t", "u"]


@pytest.mark.timeout(60)
def test_read_bounds(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 10, 3000))
        assert db.head("t", P1) == 3009
        assert db.first("t", P1) == 10
        # Never more than count (the reference C store sends count + 1).
        for count in (0, 1, 2, 1023, 1024, 1025, 2500):
            got = list(db.read("t", P1, 10, count))
            assert [r.offset for r in got] == list(range(10, 10 + count))
            start, values = db.fetch("t", P1, 10, count)
            assert (start, len(values)) == (10, count)
        # Before the first offset: starts at first.
        assert [r.offset for r in db.read("t", P1, 0, 3)] == [10, 11, 12]
        assert db.fetch("t", P1, 0, 2) == (10, [content_for(10), content_for(11)])
        # Up to the head, then nothing.
        assert [r.offset for r in db.read("t", P1, 3008, 10)] == [3008, 3009]
        assert db.fetch("t", P1, 3010, 10) == (3010, [])
        assert list(db.read("t", P1, 5000, 10)) == []
        assert db.fetch("t", P1, 10, -1) == (10, [])
        # Unknown partition or topic.
        assert db.fetch("t", P2, 0, 10) == (0, [])
        assert list(db.read("nope", P1, 0, 10)) == []
        assert db.head("t", P2) is None and db.first("t", P2) is None
        assert db.info("nope", P1) is None
        # Contents are what was stored.
        assert all(r.content == content_for(r.offset) for r in db.read("t", P1, 0, 10_000))


@pytest.mark.timeout(60)
def test_contiguity_duplicates_and_gaps(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        # A partition's first record may be at any offset (retention elsewhere).
        assert db.append(plain("t", P1, 500, 5)) == {("t", P1): 504}
        assert db.first("t", P1) == 500
        # Duplicates (<= head) are skipped silently and counted.
        assert db.append(plain("t", P1, 502, 5)) == {("t", P1): 506}
        assert db.duplicates == 3
        assert db.append(plain("t", P1, 0, 2)) == {("t", P1): 506}  # all duplicates
        assert db.duplicates == 5
        # Duplicates inside one batch too.
        assert db.append(plain("t", P1, 507, 2) + plain("t", P1, 507, 3)) == {("t", P1): 509}
        assert db.duplicates == 7
        # A gap rejects the whole batch, every partition of it.
        with pytest.raises(ValueError, match="gap"):
            db.append(plain("t", P2, 0, 3) + plain("t", P1, 510, 1) + plain("t", P1, 512, 1))
        assert db.head("t", P2) is None
        assert db.head("t", P1) == 509
        # Out of order within a batch is a gap as well (the caller must sort).
        with pytest.raises(ValueError):
            db.append([("t", P1, 511, b"x", 1), ("t", P1, 510, b"y", 1)])
        assert [r.offset for r in db.read("t", P1, 0, 100)] == list(range(500, 510))
        assert db.partitions()[0].count == 10


@pytest.mark.timeout(60)
def test_tuple_shapes_and_timestamps(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(
            [
                ("t", P1, 0, b"a", 1),
                ("t", P1, 1, b"b", 2, None),
                ("t", P1, 2, b"c", 3, None, False),
                StoreRecord("t", P1, 3, b"d", 4),
                ("t", P1, 4, bytearray(b"e"), 4),
                ("t", P1, 5, memoryview(b"f"), 4),
            ]
        )
        assert list(db.read("t", P1, 0, 10)) == [
            (i, min(i + 1, 4), None, c) for i, c in enumerate([b"a", b"b", b"c", b"d", b"e", b"f"])
        ]
        # Fast path with several timestamps in one batch.
        db.append([("t", P1, o, b"z", o) for o in range(6, 600)])
        assert [(r.offset, r.ts_ms) for r in db.read("t", P1, 6, 1000)] == [
            (o, o) for o in range(6, 600)
        ]
        # ... overlapping the head: the leading duplicates and their timestamps are dropped.
        assert db.append([("t", P1, o, b"w", o + 1) for o in range(590, 610)]) == {("t", P1): 609}
        assert db.duplicates == 10
        got = list(db.read("t", P1, 595, 100))
        assert [(r.offset, r.ts_ms, r.content) for r in got] == [
            (o, o, b"z") for o in range(595, 600)
        ] + [(o, o + 1, b"w") for o in range(600, 610)]
        # Plain StoreRecords (7 fields, no key, store timestamp) take the fast path too.
        db.append([StoreRecord("t", P2, o, b"s%d" % o, 5) for o in range(3, 8)])
        assert db.fetch("t", P2, 0, 10) == (3, [b"s%d" % o for o in range(3, 8)])
        assert list(db.read("t", P2, 3, 1)) == [(3, 5, None, b"s3")]
        # A producer timestamp flag anywhere sends the batch down the general path.
        db.append([StoreRecord("t", P2, 8, b"a", 6), StoreRecord("t", P2, 9, b"b", 7, None, True)])
        assert [layout.unpack_value(v)[:2] for v in db.fetch_raw("t", P2, 8, 2)[1]] == [
            (6, 0),
            (7, layout.FLAG_PRODUCER_TS),
        ]
        # append_runs takes one timestamp per record too.
        db.append_runs([("t", P2, 9, [b"dup", b"c", b"d"], [1, 2, 3])])
        assert [(r.offset, r.ts_ms, r.content) for r in db.read("t", P2, 9, 5)] == [
            (9, 7, b"b"),
            (10, 2, b"c"),
            (11, 3, b"d"),
        ]
        with pytest.raises(ValueError):
            db.append_runs([("t", P2, 12, [b"e", b"f"], [1])])


@pytest.mark.timeout(60)
def test_append_runs(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        heads = db.append_runs(
            [
                ("t", P1, 7, [b"a", b"b"], 10),
                ("t", P2, 0, [b"c"], 11),
                ("t", P1, 9, [b"d"], 12),
                ("t", P1, 3, [], 12),  # empty runs are ignored
            ]
        )
        assert heads == {("t", P1): 9, ("t", P2): 0}
        # Overlap with the head: the old part is skipped as duplicates.
        assert db.append_runs([("t", P1, 8, [b"B", b"D", b"e"], 13)]) == {("t", P1): 10}
        assert db.duplicates == 2
        assert db.append_runs([("t", P1, 0, [b"old"], 13)]) == {("t", P1): 10}
        assert db.duplicates == 3
        with pytest.raises(ValueError, match="gap"):
            db.append_runs([("t", P2, 1, [b"ok"], 1), ("t", P1, 12, [b"x"], 14)])
        assert db.head("t", P2) == 0
        assert list(db.read("t", P1, 0, 10)) == [
            (7, 10, None, b"a"),
            (8, 10, None, b"b"),
            (9, 12, None, b"d"),
            (10, 13, None, b"e"),
        ]
        assert db.append_runs([]) == {}
        assert db.append([]) == {}


def _ready(topic: str, partition: str, pid: int, first: int, n: int, ts: int) -> tuple[list[Any], Any]:
    """Ready pairs and their run, as fastio.drain_pairs builds them."""
    pairs = [(layout.RECORD_KEY.pack(pid, o), layout.pack_value(ts, content_for(o))) for o in range(first, first + n)]
    return pairs, (topic, partition, pid, first, first + n - 1, 40 * n)


def test_append_pairs_matches_append(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "a") as a, RecordDB(tmp_path / "b") as b:
        for db in (a, b):
            db.append(plain("t", P1, 0, 3) + plain("t", P2, 0, 2))
        pid1, pid2 = a.info("t", P1).pid, a.info("t", P2).pid
        # Interleaved runs of two partitions, the older one in the middle of the key space,
        # plus tuples of a new partition in the same transaction.
        p1a, s1a = _ready("t", P1, pid1, 3, 4, 7)
        p2, s2 = _ready("t", P2, pid2, 2, 5, 7)
        p1b, s1b = _ready("t", P1, pid1, 7, 2, 7)
        heads = b.append_pairs(plain("t", "N" * 32, 4, 3, 7), p1a + p2 + p1b, [s1a, s2, s1b])
        assert heads == {("t", P1): 8, ("t", P2): 6, ("t", "N" * 32): 6}
        a.append(plain("t", P1, 3, 6, 7) + plain("t", P2, 2, 5, 7) + plain("t", "N" * 32, 4, 3, 7))
        for t, p in (("t", P1), ("t", P2), ("t", "N" * 32)):
            assert b.info(t, p) == a.info(t, p)
            assert list(b.read(t, p, 0, 100)) == list(a.read(t, p, 0, 100))
        # A run that does not continue its head (or names another pid) rejects everything.
        bad, seg = _ready("t", P1, pid1, 10, 1, 7)
        with pytest.raises(ValueError, match="continue"):
            b.append_pairs(plain("t", P2, 7, 1), bad, [seg])
        bad, seg = _ready("t", P1, pid2, 9, 1, 7)
        with pytest.raises(ValueError, match="continue"):
            b.append_pairs([], bad, [seg])
        assert b.head("t", P2) == 6 and b.head("t", P1) == 8


@pytest.mark.timeout(60)
def test_older_partitions_use_ordinary_puts(tmp_path: Path) -> None:
    """MDB_APPEND only for the newest partition: interleaving must stay correct."""
    parts = [f"{i:032X}" for i in range(5)]
    with RecordDB(tmp_path / "db") as db:
        nxt = dict.fromkeys(parts, 0)
        for round_ in range(30):
            batch = []
            order = parts if round_ % 2 else list(reversed(parts))
            for i in range(200):
                p = order[(i * 7 + round_) % len(order)]
                batch.append(("t", p, nxt[p], content_for(nxt[p]) + p.encode(), round_))
                nxt[p] += 1
            db.append(batch)
        for p in parts:
            got = list(db.read("t", p, 0, 100_000))
            assert [r.offset for r in got] == list(range(nxt[p]))
            assert all(r.content == content_for(r.offset) + p.encode() for r in got)
        assert sorted(i.pid for i in db.partitions("t")) == list(range(5))


@pytest.mark.timeout(60)
def test_partitions_and_topics(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("ab", P2, 0, 2) + plain("a", P1, 3, 1) + plain("ab", P1, 0, 1))
        db.append(plain("b", P1, 0, 4) + plain("", P1, 0, 1))
        assert db.topics() == ["", "a", "ab", "b"]
        assert [(i.topic, i.partition) for i in db.partitions()] == [
            ("", P1),
            ("a", P1),
            ("ab", P1),
            ("ab", P2),
            ("b", P1),
        ]
        # "a" is a prefix of "ab" but the length byte keeps them apart.
        assert [(i.partition, i.first, i.last, i.count) for i in db.partitions("a")] == [
            (P1, 3, 3, 1)
        ]
        assert [i.partition for i in db.partitions("ab")] == [P1, P2]
        assert db.partitions("zz") == []
        assert sorted(i.pid for i in db.partitions()) == [0, 1, 2, 3, 4]
        # At most ``limit`` (a leaf reader's LEAF-READ lists a bounded number of them).
        assert [i.partition for i in db.partitions("ab", limit=1)] == [P1]
        assert len(db.partitions(limit=3)) == 3 and db.partitions("ab", limit=0) == []


@pytest.mark.timeout(60)
def test_reopen_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "db"
    for sync in (True, False):
        with RecordDB(path, sync=sync) as db:
            base = db.head("t", P1)
            first = 0 if base is None else base + 1
            batch = plain("t", P1, first, 1000)
            if first == 0:
                batch.append(StoreRecord("k", P2, 0, b"v", 9, b"key"))
            db.append(batch)
    with RecordDB(path) as db:
        assert db.head("t", P1) == 1999
        assert [r.offset for r in db.read("t", P1, 0, 5000)] == list(range(2000))
        assert list(db.read("k", P2, 0, 5)) == [(0, 9, b"key", b"v")]
        # pids continue after reopening
        db.append(plain("new", P1, 0, 1))
        assert db.info("new", P1).pid == 2  # type: ignore[union-attr]
    with RecordDB(path, readonly=True) as ro:
        assert ro.topics() == ["k", "new", "t"]


def test_closed_and_readonly_errors(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with pytest.raises(FileNotFoundError):
        RecordDB(path, readonly=True)
    db = RecordDB(path)
    db.append(plain("t", P1, 0, 1))
    db.close()
    db.close()  # idempotent
    with pytest.raises(ClosedError):
        db.head("t", P1)
    with pytest.raises(ClosedError):
        db.append(plain("t", P1, 1, 1))
    with RecordDB(path, readonly=True) as ro:
        assert ro.head("t", P1) == 0
        with pytest.raises(StorageError):
            ro.append(plain("t", P1, 1, 1))
        with pytest.raises(StorageError):
            ro.enforce_retention(0, RetentionPolicy(Retention(max_age_ms=1)))


def test_format_version_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "db"
    RecordDB(path).close()
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(layout.META_FORMAT, layout.U32.pack(99), db=meta)
    env.close()
    with pytest.raises(StorageError, match="format 99"):
        RecordDB(path)
    with pytest.raises(DafkaError):
        RecordDB(path, readonly=True)
    other = tmp_path / "other"
    env = lmdb.open(str(other), max_dbs=8)
    env.open_db(b"unrelated")
    env.close()
    with pytest.raises(StorageError):
        RecordDB(other)  # an LMDB environment that is not ours is left alone


# --------------------------------------------------------------------------- map size


@pytest.mark.timeout(120)
def test_map_grows_from_tiny_size(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db", map_size=32 << 10) as db:
        start = db.map_size
        for b in range(20):
            db.append(
                [("t", P1, b * 1000 + i, content_for(b * 1000 + i, 200), 1) for i in range(1000)]
            )
        # One batch far larger than the map: grows several times in one call.
        db.append([("t", P2, i, b"y" * 1000, 1) for i in range(5000)])
        assert db.map_size >= 8 * start
        assert db.head("t", P1) == 19_999
        assert all(r.content == content_for(r.offset, 200) for r in db.read("t", P1, 0, 30_000))
        assert db.fetch("t", P2, 4999, 5) == (4999, [b"y" * 1000])


@pytest.mark.timeout(120)
def test_storage_full_at_max_map_size(tmp_path: Path) -> None:
    """Reaching max_map_size takes the same path as a full disk: StorageFullError."""
    cap = 4 << 20
    with RecordDB(tmp_path / "db", map_size=256 << 10, max_map_size=cap) as db:
        committed = -1
        with pytest.raises(StorageFullError):
            for b in range(1000):
                heads = db.append(plain("t", P1, committed + 1, 1000) + plain("u", P2, b, 1))
                committed = heads[("t", P1)]
        assert db.map_size == cap
        assert committed > 0
        # Nothing of the failed batch, everything before it.
        assert db.head("t", P1) == committed
        assert [r.offset for r in db.read("t", P1, 0, 10**6)] == list(range(committed + 1))
        assert isinstance(StorageFullError("x"), DafkaError)
        # Still usable: retention frees room and appends go on.
        u_count = db.info("u", P2).count  # type: ignore[union-attr]
        policy = RetentionPolicy(Retention(max_bytes=0))
        deleted = 0
        while True:
            res = db.enforce_retention(0, policy, max_records=500)
            deleted += res.deleted
            if not res.more:
                break
        assert deleted == committed + 1 + u_count
        assert db.append(plain("t", P1, committed + 1, 1000)) == {("t", P1): committed + 1000}
    with RecordDB(tmp_path / "db") as db:
        assert db.head("t", P1) == committed + 1000


_FSIZE_CHILD = """
import os, resource, signal, sys
from dafka.store.db import RecordDB, StorageFullError

path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # we want EFBIG, not death
db = RecordDB(path, map_size=64 << 20)

def batch(first):
    return [("t", "P", o, (b"%d:" % o).ljust(100, b"x"), 1) for o in range(first, first + 1000)]

head = db.append(batch(0))[("t", "P")]
size = os.path.getsize(os.path.join(path, "data.mdb"))
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + (1 << 20), hard))
try:
    while True:
        head = db.append(batch(head + 1))[("t", "P")]
        print("committed", head, flush=True)
except StorageFullError as exc:
    print("full", head, type(exc.__cause__).__name__, exc, flush=True)
print("readable", db.head("t", "P"), len(db.fetch("t", "P", 0, 10**6)[1]), flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the disk has room again
head = db.append(batch(head + 1))[("t", "P")]
print("after", head, flush=True)
db.close()
"""


@pytest.mark.timeout(120)
def test_storage_full_when_writes_fail(tmp_path: Path) -> None:
    """A failed page write at commit (here EFBIG from RLIMIT_FSIZE, which LMDB
    reports like ENOSPC's short write) raises StorageFullError, keeps earlier
    batches and leaves the database usable.  No root or tmpfs needed."""
    path = tmp_path / "db"
    child = ChildLines(_FSIZE_CHILD, str(path))
    try:
        lines = child.rest(timeout=100)
    finally:
        child.kill()
    assert child.proc.returncode == 0, child.proc.stderr.read() if child.proc.stderr else ""
    full = [line.split() for line in lines if line.startswith("full")]
    assert full, lines
    head_at_full = int(full[0][1])
    assert head_at_full >= 999
    readable = [line.split() for line in lines if line.startswith("readable")][0]
    assert int(readable[1]) == head_at_full and int(readable[2]) == head_at_full + 1
    after = int([line.split() for line in lines if line.startswith("after")][0][1])
    assert after == head_at_full + 1000
    with RecordDB(path) as db:
        assert db.head("t", "P") == after
        got = db.fetch("t", "P", 0, 10**6)
        assert got[0] == 0 and len(got[1]) == after + 1
        assert all(c.startswith(b"%d:" % i) for i, c in enumerate(got[1]))


# --------------------------------------------------------------------------- processes

_KILLED_WRITER = """
import sys
from dafka.store.db import RecordDB

db = RecordDB(sys.argv[1], map_size=256 << 10)  # small: growth happens while we kill
head = db.head("t", "P")  # later rounds go on where the killed one stopped
off = 0 if head is None else head + 1
while True:
    heads = db.append([("t", "P", o, (b"%d:" % o).ljust(60, b"k"), o) for o in range(off, off + 500)])
    off = heads[("t", "P")] + 1
    print(heads[("t", "P")], flush=True)
"""


@pytest.mark.timeout(120)
def test_sigkill_keeps_every_committed_batch(tmp_path: Path) -> None:
    path = tmp_path / "db"
    for round_ in range(3):
        child = ChildLines(_KILLED_WRITER, str(path))
        try:
            reported = [int(child.next_line(timeout=30)) for _ in range(20 + 7 * round_)]
            child.proc.send_signal(signal.SIGKILL)
            reported += [int(line) for line in child.rest(timeout=30)]
        finally:
            child.kill()
        assert child.proc.returncode == -signal.SIGKILL
        with RecordDB(path) as db:
            head = db.head("t", "P")
            assert head is not None
            # Every batch reported committed is there; batches are atomic.
            assert head >= reported[-1]
            assert (head + 1) % 500 == 0
            start, values = db.fetch("t", "P", 0, 10**7)
            assert start == 0 and len(values) == head + 1
            assert all(v.startswith(b"%d:" % i) for i, v in enumerate(values))


_READER = """
import sys, time
from dafka.store.db import RecordDB

path, target = sys.argv[1], int(sys.argv[2])
db = RecordDB(path, readonly=True)
print("ready", db.map_size, flush=True)
verified = -1
while verified < target:
    head = db.head("t", "P")
    if head is None or head <= verified:
        time.sleep(0.001)  # poll the writer's progress
        continue
    start, values = db.fetch("t", "P", verified + 1, head - verified)
    assert start == verified + 1, (start, verified)
    assert len(values) == head - verified, (len(values), head, verified)
    for i, v in enumerate(values, start):
        assert v.startswith(b"%d:" % i), (i, v[:20])
    verified = head
    for info in db.partitions():
        assert info.count == info.last - info.first + 1
print("ok", verified, db.map_size, flush=True)
db.close()
"""


@pytest.mark.timeout(120)
def test_readonly_reader_in_other_process_while_writing(tmp_path: Path) -> None:
    path = tmp_path / "db"
    target = 150_000
    with RecordDB(path, map_size=128 << 10) as db:
        db.append([("t", "P", 0, content_for(0, 100), 1)])
        child = ChildLines(_READER, str(path), str(target))
        try:
            ready = child.next_line(timeout=30).split()
            assert ready[0] == "ready"
            off = 1
            while off <= target:
                db.append([("t", "P", o, content_for(o, 100), 1) for o in range(off, off + 1000)])
                off += 1000
            line = child.next_line(timeout=60).split()
            assert line[0] == "ok" and int(line[1]) >= target
            # The reader adopted the map the writer grew (MDB_MAP_RESIZED path).
            assert int(line[2]) > int(ready[1])
            assert child.proc.wait(timeout=30) == 0
        finally:
            child.kill()


@pytest.mark.timeout(120)
def test_reader_threads_while_the_map_grows(tmp_path: Path) -> None:
    """Map resizes wait for this process's open read transactions."""
    errors: list[BaseException] = []
    stop = threading.Event()
    with RecordDB(tmp_path / "db", map_size=64 << 10) as db:
        db.append([("t", "P", 0, content_for(0, 200), 1)])

        def reader() -> None:
            try:
                while not stop.is_set():
                    head = db.head("t", "P") or 0
                    start, values = db.fetch("t", "P", max(0, head - 300), 300)
                    for i, v in enumerate(values, start):
                        assert v.startswith(b"%d:" % i)
                    for info in db.partitions():
                        assert info.count == info.last - info.first + 1
            except BaseException as exc:  # reported to the test thread
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            start_map = db.map_size
            for b in range(60):
                first = b * 500 + 1
                db.append(
                    [("t", "P", o, content_for(o, 200), 1) for o in range(first, first + 500)]
                )
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert not errors, errors
        assert db.map_size > 16 * start_map
        assert db.head("t", "P") == 30_000


# --------------------------------------------------------------------------- retention


@pytest.mark.timeout(60)
def test_retention_by_age(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        for b in range(10):  # batch b received at t = 1000 * b
            db.append(
                plain("t", P1, b * 100, 100, ts=1000 * b) + plain("t", P2, b * 10, 10, ts=1000 * b)
            )
        db.append(plain("keep", P1, 0, 50, ts=0))
        policy = RetentionPolicy(Retention(max_age_ms=3500), topics={"keep": Retention()})
        # now 9000: keep ts >= 5500, i.e. batches 6..9; bounded by max_records.
        results = []
        while True:
            res = db.enforce_retention(9000, policy, max_records=250)
            results.append(res)
            assert res.deleted <= 250
            if not res.more:
                break
        assert sum(r.deleted for r in results) == 600 + 60
        assert all(r.more for r in results[:-1])
        assert sum(r.freed_bytes for r in results) == 660 * 40
        p1, p2 = db.partitions("t")
        assert (p1.first, p1.last, p1.count, p1.bytes) == (600, 999, 400, 400 * 40)
        assert (p2.first, p2.last, p2.count) == (60, 99, 40)
        assert db.info("keep", P1).count == 50  # type: ignore[union-attr]
        assert [r.offset for r in db.read("t", P1, 0, 3)] == [600, 601, 602]
        assert db.fetch("t", P1, 0, 1) == (600, [content_for(600)])
        # Nothing left to do.
        assert db.enforce_retention(9000, policy) == (0, 0, False)
        # Everything expires: heads stay, first = head + 1, appends continue.
        assert db.enforce_retention(10**9, policy).deleted == 440
        info = db.info("t", P1)
        assert info is not None and (info.first, info.last, info.count, info.bytes) == (
            1000,
            999,
            0,
            0,
        )
        assert db.fetch("t", P1, 0, 10) == (1000, [])
        assert db.append(plain("t", P1, 5, 3)) == {("t", P1): 999}  # old ones: duplicates
        with pytest.raises(ValueError):
            db.append(plain("t", P1, 1001, 1))
        assert db.append(plain("t", P1, 1000, 2)) == {("t", P1): 1001}
        assert db.info("t", P1)[3:6] == (1000, 1001, 2)  # type: ignore[index]
    with RecordDB(tmp_path / "db") as db:
        assert db.first("t", P2) == 100 and db.head("t", P2) == 99


@pytest.mark.timeout(60)
def test_retention_by_bytes_oldest_first_across_partitions(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        # P1 has old and new records, P2 only middle-aged ones.
        db.append(plain("t", P1, 0, 10, ts=100))
        db.append(plain("t", P2, 0, 10, ts=200))
        db.append(plain("t", P1, 10, 10, ts=300))
        db.append(plain("other", P1, 0, 10, ts=0))
        policy = RetentionPolicy(topics={"t": Retention(max_bytes=15 * 40)})
        res = db.enforce_retention(0, policy)
        # Blocks leave whole (one block per append here), while the topic keeps at least its
        # limit: P1's ts-100 block leaves (800 bytes left), P2's ts-200 one would leave 400.
        assert res == (10, 10 * 40, False)
        p1, p2 = db.partitions("t")
        assert (p1.first, p1.count) == (10, 10)
        assert (p2.first, p2.count) == (0, 10)
        assert p1.bytes + p2.bytes == 20 * 40
        assert db.info("other", P1).count == 10  # type: ignore[union-attr]
        # A budget of 1 per call still converges: each call removes one block.
        policy = RetentionPolicy(Retention(max_bytes=0))
        calls = 0
        while db.enforce_retention(0, policy, max_records=1).more:
            calls += 1
        assert calls == 2  # the 3rd call removes the last block and reports no more
        assert all(i.count == 0 and i.bytes == 0 for i in db.partitions())
        # Keys count towards bytes.
        db.append([StoreRecord("k", P1, 0, b"12345", 1, key=b"abc")])
        assert db.info("k", P1).bytes == 8  # type: ignore[union-attr]
        assert db.enforce_retention(0, RetentionPolicy(Retention(max_bytes=7))) == (0, 0, False)
        assert db.enforce_retention(0, RetentionPolicy(Retention(max_bytes=0))) == (1, 8, False)


def test_keep_everything_policy_writes_nothing(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 10, ts=0))
        assert db.enforce_retention(10**12, RetentionPolicy()) == (0, 0, False)
        assert db.enforce_retention(
            10**12, RetentionPolicy(Retention(max_age_ms=1)), max_records=0
        ) == (0, 0, False)
        assert db.info("t", P1).count == 10  # type: ignore[union-attr]


# --------------------------------------------------------------------------- model


class Model:
    """What the database should hold: per partition, head and stored records."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], dict[int, tuple[int, bytes | None, bytes]]] = {}
        self.heads: dict[tuple[str, str], int] = {}
        self.duplicates = 0
        #: The offsets of each partition's blocks, oldest first (format 2: retention removes whole blocks).
        self.blocks: dict[tuple[str, str], list[list[int]]] = {}


PARTS = [("t", P1), ("t", P2), ("u", P1)]


@pytest.mark.timeout(300)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_append_read_against_model(tmp_path: Path, data: st.DataObject) -> None:
    model = Model()
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        db = RecordDB(d, map_size=64 << 10)
        try:
            for _ in range(data.draw(st.integers(1, 12), label="ops")):
                op = data.draw(st.sampled_from(["append", "append", "runs", "reopen", "retain"]))
                if op == "reopen":
                    db.close()
                    db = RecordDB(d, map_size=64 << 10)
                elif op == "retain":
                    budget = data.draw(st.integers(1, 20))
                    cutoff = data.draw(st.integers(0, 30))
                    res = db.enforce_retention(
                        cutoff, RetentionPolicy(Retention(max_age_ms=0)), max_records=budget
                    )
                    # Retention by block: a block leaves when its newest record is older than
                    # the cutoff, and only while it fits the budget (the first one of a call always).
                    removed = 0
                    stop = False
                    for tp in sorted(
                        model.records, key=lambda tp: (tp[0].encode(), tp[1].encode())
                    ):
                        recs = model.records[tp]
                        blocks = model.blocks.get(tp, [])
                        while blocks and max(recs[o][0] for o in blocks[0]) < cutoff:
                            if len(blocks[0]) > budget - removed and removed:
                                stop = True
                                break
                            for o in blocks.pop(0):
                                del recs[o]
                                removed += 1
                        if stop:
                            break
                    assert res.deleted == removed
                elif op == "runs":
                    tp = data.draw(st.sampled_from(PARTS))
                    head = model.heads.get(tp)
                    start = (
                        data.draw(st.integers(0, 5))
                        if head is None
                        else data.draw(st.integers(max(0, head - 3), head + 1))
                    )
                    contents = data.draw(st.lists(st.binary(max_size=20), max_size=5))
                    ts = data.draw(st.integers(0, 40))
                    heads = db.append_runs([(tp[0], tp[1], start, contents, ts)])
                    block = []
                    for i, c in enumerate(contents):
                        off = start + i
                        if head is not None and off <= head:
                            model.duplicates += 1
                            continue
                        model.records.setdefault(tp, {})[off] = (ts, None, c)
                        model.heads[tp] = head = off
                        block.append(off)
                    if block:
                        model.blocks.setdefault(tp, []).append(block)
                    if contents:
                        assert heads == {tp: model.heads[tp]}
                else:
                    batch, expect_gap = [], False
                    nxt = {tp: (h + 1 if h is not None else None) for tp, h in model.heads.items()}
                    for _ in range(data.draw(st.integers(1, 8))):
                        tp = data.draw(st.sampled_from(PARTS))
                        kind = data.draw(st.sampled_from(["next", "next", "next", "dup", "gap"]))
                        n = nxt.get(tp)
                        if n is None:
                            off = data.draw(st.integers(0, 5))  # a new partition starts anywhere
                        elif kind == "dup" and n > 0:
                            off = data.draw(st.integers(max(0, n - 4), n - 1))
                        elif kind == "gap":
                            off, expect_gap = n + 1, True
                        else:
                            off = n
                        if n is None or off >= n:
                            nxt[tp] = off + 1
                        key = data.draw(st.none() | st.binary(max_size=4))
                        rec = StoreRecord(
                            tp[0],
                            tp[1],
                            off,
                            data.draw(st.binary(max_size=20)),
                            data.draw(st.integers(0, 40)),
                            key,
                            data.draw(st.booleans()),
                        )
                        batch.append(
                            rec if key is not None or rec.ts_from_producer else tuple(rec[:5])
                        )
                    if expect_gap:
                        with pytest.raises(ValueError):
                            db.append(batch)
                    else:
                        before = db.duplicates
                        heads = db.append(batch)
                        new_blocks: dict[tuple[str, str], list[int]] = {}
                        for rec in batch:
                            tp = (rec[0], rec[1])
                            head = model.heads.get(tp)
                            if head is not None and rec[2] <= head:
                                model.duplicates += 1
                                continue
                            key = rec[5] if len(rec) > 5 else None
                            model.records.setdefault(tp, {})[rec[2]] = (rec[4], key, bytes(rec[3]))
                            model.heads[tp] = rec[2]
                            new_blocks.setdefault(tp, []).append(rec[2])  # one block per partition and append
                        for tp, block in new_blocks.items():
                            model.blocks.setdefault(tp, []).append(block)
                        assert heads == {(r[0], r[1]): model.heads[(r[0], r[1])] for r in batch}
                        assert db.duplicates - before <= len(batch)
                check_against_model(db, model, data)
        finally:
            db.close()


def check_against_model(db: RecordDB, model: Model, data: st.DataObject) -> None:
    infos = {(i.topic, i.partition): i for i in db.partitions()}
    assert set(infos) == set(model.heads)
    for tp, head in model.heads.items():
        recs = model.records.get(tp, {})
        info = infos[tp]
        assert info.last == head
        assert info.count == len(recs)
        assert info.first == (min(recs) if recs else head + 1)
        assert info.bytes == sum(len(c) + len(k or b"") for _, k, c in recs.values())
        expected = [(o, *recs[o]) for o in sorted(recs)]
        assert list(db.read(tp[0], tp[1], 0, 10**6)) == expected
        offset = data.draw(st.integers(0, head + 2))
        count = data.draw(st.integers(0, 6))
        want = [e for e in expected if e[0] >= offset][:count]
        start, contents = db.fetch(tp[0], tp[1], offset, count)
        assert contents == [e[3] for e in want]
        if want:
            assert start == want[0][0]


def test_environment_reopened_after_a_fatal_commit_failure(tmp_path: Path) -> None:
    """After a failed commit that leaves LMDB unusable (a failed meta-page write
    marks the environment fatally broken), the environment is reopened from disk."""
    with RecordDB(tmp_path / "db") as db:
        db.append(plain("t", P1, 0, 10))
        env = db._env
        assert env is not None
        env.close()  # stands in for MDB_PANIC: every transaction now fails
        with db._write_lock:
            db._recover_after_failed_commit()
        assert db._env is not env
        assert db.head("t", P1) == 9
        assert db.append(plain("t", P1, 10, 1)) == {("t", P1): 10}


def test_delete_front_on_blocks_hides_a_partial_block_and_retention_then_counts_it_right(tmp_path: Path) -> None:
    """Format 2: delete_front drops whole blocks below the new start and leaves the block
    holding it whole, its records below the start never read; the counts stay right when
    retention later drops that block, and across a reopen."""
    with RecordDB(tmp_path / "db") as db:
        for b in range(3):  # blocks [0-9], [10-19], [20-29], received at t = 1000 * b
            db.append(plain("t", P1, b * 10, 10, ts=1000 * b))
        # Budget 12: the first block leaves (10), then 2 of the second are hidden.
        assert db.delete_front("t", P1, 15, max_records=12) == (12, False)
        info = db.info("t", P1)
        assert info is not None and (info.first, info.last, info.count) == (12, 29, 18)
        assert info.bytes == 20 * 40  # the partial block's bytes count until it leaves
        assert db.delete_front("t", P1, 15) == (15, True)
        info = db.info("t", P1)
        assert info is not None and (info.first, info.count) == (15, 15)
        assert db.fetch("t", P1, 0, 3) == (15, [content_for(15), content_for(16), content_for(17)])
        assert db.fetch("t", P1, 11, 1) == (15, [content_for(15)])
        assert [r.offset for r in db.read("t", P1, 0, 100)] == list(range(15, 30))
    with RecordDB(tmp_path / "db") as db:
        assert db.info("t", P1)[3:6] == (15, 29, 15)  # type: ignore[index]
        # Retention by age drops the partial block: its 5 held records, its whole bytes.
        res = db.enforce_retention(2500, RetentionPolicy(Retention(max_age_ms=1000)))
        assert (res.deleted, res.freed_bytes, res.more) == (5, 10 * 40, False)
        info = db.info("t", P1)
        assert info is not None and (info.first, info.last, info.count, info.bytes) == (20, 29, 10, 10 * 40)
        assert db.delete_front("t", P1, 99) == (30, True)
        assert db.info("t", P1)[3:6] == (30, 29, 0)  # type: ignore[index]
        assert db.fetch("t", P1, 0, 10) == (30, [])
        assert db.append(plain("t", P1, 30, 2)) == {("t", P1): 31}
        assert db.fetch("t", P1, 0, 5)[0] == 30


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 70), st.integers(1, 15)), max_size=6),
)
def test_delete_front_and_retention_keep_count_and_bytes_true_to_what_is_read(
    sizes: list[int], steps: list[tuple[bool, int, int]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp, RecordDB(Path(tmp) / "db") as db:
        first = 0
        for b, n in enumerate(sizes):  # one block a batch, batch b received at t = 1000 * b
            db.append(plain("t", P1, first, n, ts=1000 * b))
            first += n
        for is_delete, arg, budget in steps:
            if is_delete:
                db.delete_front("t", P1, arg, max_records=budget)
            else:
                db.enforce_retention(arg * 100, RetentionPolicy(Retention(max_age_ms=0)), max_records=budget)
            info = db.info("t", P1)
            assert info is not None and info.last == first - 1
            got = [r.offset for r in db.read("t", P1, 0, 1000)]
            assert got == list(range(info.first, first))
            assert info.count == len(got)
            assert (info.bytes == 0) == (info.count == 0)
            assert info.bytes >= 40 * info.count
