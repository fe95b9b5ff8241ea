"""Compacted topics: the sans-IO planner, block rewrites, and compaction on real LMDB
(a kill -9 mid-way included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from dafka.kafka.gateway import encode_batch
from dafka.kafka.records import batch_record_count
from dafka.store.block import (
    CODEC_KAFKA,
    CODEC_STORE,
    decode_header,
    kafka_block,
    records,
    store_block,
    tank_block,
    validate,
)
from dafka.store.compaction import (
    CONTROL,
    PLAIN,
    TXN,
    CompactionPolicy,
    Compactor,
    Planner,
    RecordInfo,
    block_infos,
    rewrite_block,
)
from dafka.store.db import RecordDB
from dafka.store.reader import block_payload, seek
from dafka.tank.bundle import encode_bundle
from tests.conftest import subprocess_env, wait_until

NOW = 2_000_000_000_000
DAY = 86_400_000


def plan(recs: list[RecordInfo], *, head: int | None = None, upto: int | None = None, now: int = NOW,
         tomb_ms: int = DAY, aborted: Any = (), max_keys: int = 1000, start: int = 0) -> list[int]:
    """The offsets one round keeps, the whole map fed at once."""
    head = recs[-1].offset if head is None else head
    p = Planner(start=start, upto=head if upto is None else upto, head=head, now_ms=now,
                delete_retention_ms=tomb_ms, aborted=aborted, max_keys=max_keys)
    p.feed(recs)
    p.scanned_through(head)
    return [r.offset for r in recs if p.keep(r)]


def r(off: int, key: bytes | None, tomb: bool = False, ts: int = NOW - 10, kind: int = PLAIN) -> RecordInfo:
    return RecordInfo(off, key, tomb, ts, kind)


# ---------------------------------------------------------------- the planner


def test_the_latest_record_per_key_stays_and_records_without_a_key_stay() -> None:
    recs = [r(0, b"a"), r(1, b"b"), r(2, None), r(3, b"a"), r(4, b"b"), r(5, b"c")]
    assert plan(recs) == [2, 3, 4, 5]


def test_a_tombstone_stays_until_delete_retention_passed_its_time_then_goes_with_its_key() -> None:
    recs = [r(0, b"a"), r(1, b"a", tomb=True, ts=NOW - 100), r(2, b"z")]
    assert plan(recs, tomb_ms=1000) == [1, 2]  # the older value of a goes at once
    assert plan(recs, tomb_ms=100) == [2]  # due: the key is gone
    assert plan(recs, tomb_ms=101) == [1, 2]


def test_the_head_is_never_dropped_even_an_expired_tombstone() -> None:
    recs = [r(0, b"a"), r(1, b"a", tomb=True, ts=0)]
    assert plan(recs, tomb_ms=0) == [1]


def test_nothing_past_the_last_stable_offset_supersedes_or_goes() -> None:
    # An unfinished transaction from offset 3: its records neither supersede 0..2 nor go.
    recs = [r(0, b"a"), r(1, b"b"), r(2, b"a"), r(3, b"a", kind=TXN), r(4, b"b", kind=TXN), r(5, b"c")]
    assert plan(recs, upto=2) == [1, 2, 3, 4, 5]


def test_aborted_records_never_supersede_and_control_records_stay() -> None:
    recs = [r(0, b"a"), r(1, b"a", kind=TXN), r(2, b"\x00\x01", kind=CONTROL), r(3, b"b"), r(4, b"\x00\x01", kind=CONTROL)]
    assert plan(recs, aborted=[(1, 1)]) == [0, 1, 2, 3, 4]
    assert plan(recs, aborted=[]) == [1, 2, 3, 4]  # committed: it supersedes 0


def test_without_knowing_the_transactions_the_map_stops_at_the_first_transactional_record() -> None:
    recs = [r(0, b"a"), r(1, b"a"), r(2, b"a", kind=TXN), r(3, b"a")]
    p = Planner(start=0, upto=3, head=3, now_ms=NOW, delete_retention_ms=DAY, aborted=None)
    assert p.feed(recs) is False
    assert p.map_end == 2
    assert [x.offset for x in recs if p.keep(x)] == [1, 2, 3]


def test_a_full_map_stops_the_round_where_it_is_and_the_next_round_goes_on() -> None:
    recs = [r(i, b"k%d" % (i % 4)) for i in range(12)]
    p = Planner(start=0, upto=11, head=11, now_ms=NOW, delete_retention_ms=DAY, max_keys=2)
    assert p.feed(recs) is False
    assert p.map_end == 2 and len(p.latest) == 2  # k0, k1: k2 at offset 2 does not fit
    kept = [x for x in recs if p.keep(x)]
    assert [x.offset for x in kept] == list(range(12))  # nothing of 0..1 is superseded below 2
    # The next round: map from 2, cleaning everything below its map_end.
    p2 = Planner(start=2, upto=11, head=11, now_ms=NOW, delete_retention_ms=DAY, max_keys=2)
    p2.feed(kept)
    assert p2.map_end == 4
    assert [x.offset for x in kept if p2.keep(x)] == list(range(12))
    p3 = Planner(start=4, upto=11, head=11, now_ms=NOW, delete_retention_ms=DAY, max_keys=2)
    p3.feed(kept)
    assert p3.map_end == 6  # k0, k1 at 4, 5 supersede 0, 1
    assert [x.offset for x in kept if p3.keep(x)] == [2, 3, *range(4, 12)]


def test_the_map_holds_digests_whatever_the_key_size() -> None:
    p = Planner(start=0, upto=0, head=0, now_ms=NOW, delete_retention_ms=DAY)
    p.feed([r(0, b"x" * (1 << 20))])
    assert [len(k) for k in p.latest] == [16]


keys = st.sampled_from([None, b"a", b"b", b"c", b"d", b"e"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(keys, st.booleans(), st.integers(0, 100), st.integers(0, 3)), min_size=1, max_size=60),
    st.integers(1, 6), st.integers(0, 120), st.integers(0, 70),
)
def test_rounds_keep_the_latest_per_key_and_drop_only_what_a_later_record_supersedes(
    spec: list[tuple[bytes | None, bool, int, int]], max_keys: int, tomb_ms: int, lso_at: int
) -> None:
    """Rounds with a small map, over what the previous ones kept, until nothing changes:
    no record is dropped unless a later committed record of its key exists (or it is an
    expired tombstone, the latest of its key, below the head); the latest record per key
    always survives otherwise; nothing at or past the last stable offset goes."""
    recs = []
    aborted = []
    for i, (key, tomb, age, kind) in enumerate(spec):
        k = CONTROL if kind == 3 and key is not None else TXN if kind == 2 else PLAIN
        if kind == 1:
            aborted.append((i, i))
        recs.append(RecordInfo(i, key, tomb and key is not None, NOW - age, k))
    head = len(recs) - 1
    upto = min(head, lso_at)
    is_aborted = {a for a, _b in aborted}
    kept = list(recs)
    start = 0
    for _round in range(100):
        p = Planner(start=start, upto=upto, head=head, now_ms=NOW, delete_retention_ms=tomb_ms, aborted=aborted,
                    max_keys=max_keys)
        p.feed([x for x in kept if x.offset >= start])
        if p.scan_done is False:
            p.scanned_through(upto)
        new = [x for x in kept if p.keep(x)]
        start = p.map_end
        if new == kept and start > upto:
            break
        kept = new
    survivors = {x.offset for x in kept}
    for x in recs:
        if x.offset in survivors:
            continue
        assert x.offset < head and x.offset <= upto and x.key is not None and x.kind != CONTROL
        later = [y for y in recs if y.key == x.key and x.offset < y.offset <= upto and y.kind != CONTROL
                 and y.offset not in is_aborted]
        expired_tomb = x.tombstone and x.ts_ms + tomb_ms <= NOW and x.offset not in is_aborted
        assert later or expired_tomb, (x, kept)
    # The latest committed record of each key below the LSO survives, unless an expired tombstone.
    for key in {x.key for x in recs if x.key is not None}:
        mine = [y for y in recs if y.key == key and y.offset <= upto and y.kind != CONTROL
                and y.offset not in is_aborted]
        if mine:
            last = mine[-1]
            if not (last.tombstone and last.ts_ms + tomb_ms <= NOW and last.offset < head):
                assert last.offset in survivors
    assert head in survivors
    assert all(x.offset in survivors for x in recs if x.offset > upto)


# ---------------------------------------------------------------- block rewrites


def kbatch(keys: list[bytes | None], ts: int = 1_700_000_000_000, compression: int = 0, txn: bool = False,
           values: list[bytes | None] | None = None) -> bytes:
    b = DefaultRecordBatchBuilder(2, compression, txn, 7 if txn else -1, 3 if txn else -1, 10 if txn else -1, 1 << 20)
    for i, k in enumerate(keys):
        v = values[i] if values is not None else b"v%d" % i
        b.append(i, ts + i, k, v, [("h", b"%d" % i)])
    return bytes(b.build())


@pytest.mark.parametrize("compression", [0, 1, 2, 3, 4])
def test_a_kafka_batch_becomes_one_batch_per_run_with_offsets_timestamps_and_headers_kept(compression: int) -> None:
    vals: list[bytes | None] = [b"v%d" % i + b" compressible" * 20 for i in range(5)]
    blk = kafka_block(kbatch([b"a", b"b", b"c", b"d", b"e"], compression=compression, txn=True, values=vals), 100)
    hdr = decode_header(blk)
    assert hdr.compression == compression
    infos = block_infos(hdr, blk)
    assert [(i.offset, i.key, i.kind) for i in infos] == [(100 + i, k, TXN) for i, k in enumerate([b"a", b"b", b"c", b"d", b"e"])]
    out = rewrite_block(hdr, blk, infos, [False, True, True, False, True])
    assert [(decode_header(b).first_offset, decode_header(b).last_offset) for b in out] == [(101, 102), (104, 104)]
    got = []
    for b in out:
        h = validate(b)
        assert h.codec == CODEC_KAFKA and h.compression == compression  # compressed again, alike
        batch = DefaultRecordBatch(b[52:])
        assert batch.is_transactional and batch.producer_id == 7 and batch.producer_epoch == 3
        assert batch.base_sequence == 10 + h.first_offset - 100
        got += [(x.offset, x.timestamp, x.key, x.value, x.headers) for x in batch]
    assert got == [(100 + i, 1_700_000_000_000 + i, k, vals[i], [("h", b"%d" % i)])
                   for i, k in [(1, b"b"), (2, b"c"), (4, b"e")]]


def test_store_and_tank_blocks_become_store_blocks_keeping_keys_flags_and_timestamps() -> None:
    values = [b"\x00" * 7 + bytes([i]) + b"\x01\x01" + b"k" + b"c%d" % i for i in range(4)]
    blk = store_block(10, values, sum(len(v) - 10 for v in values))
    hdr = decode_header(blk)
    out = rewrite_block(hdr, blk, block_infos(hdr, blk), [True, False, False, True])
    assert [decode_header(b).first_offset for b in out] == [10, 13]
    for b in out:
        validate(b)
    assert sum(block_payload(decode_header(b), b) for b in out) == 2 * (1 + 2)
    bundle = encode_bundle([(0, 5, b"k1", b"one"), (0, 6, None, b"two"), (0, 7, b"k1", b"three")])
    tblk = tank_block(bundle, 0)
    th = decode_header(tblk)
    infos = block_infos(th, tblk)
    assert [(i.key, i.ts_ms) for i in infos] == [(b"k1", 5), (None, 6), (b"k1", 7)]
    (only,) = rewrite_block(th, tblk, infos, [False, True, True])
    assert validate(only).codec == CODEC_STORE and decode_header(only).first_offset == 1


def test_seek_on_a_table_whose_first_entry_is_past_the_offset(tmp_path: Path) -> None:
    """reader.seek raised struct.error when the partition's first block (the table's first
    entry) began past the offset sought (a hole, or compaction, at the very front)."""
    with RecordDB(tmp_path / "db", sync=False) as db:
        db.append([("t", "p", 5, b"x", 1)])
        with db._read_txn() as (txn, dbs):
            found = seek(txn.cursor(db=dbs.blocks), 0, 2)
            assert found is not None and found[0].first_offset == 5


# ---------------------------------------------------------------- on LMDB


def fill(db: RecordDB, topic: str = "t", rounds: int = 6, nkeys: int = 5) -> dict[bytes, tuple[int, bytes | None]]:
    """Kafka batches (some compressed), then store values with Tank keys: the latest per key."""
    latest: dict[bytes, tuple[int, bytes | None]] = {}
    off = 0
    for rnd in range(rounds):
        keys = [b"k%d" % ((rnd + i) % nkeys) for i in range(nkeys)] + [None]
        vals: list[bytes | None] = [b"r%d-%d" % (rnd, i) for i in range(len(keys))]
        if rnd == 2:
            vals[0] = None  # a tombstone
        db.append_blocks([(topic, "p", kafka_block(kbatch(keys, compression=rnd % 3, values=vals), off))])
        for i, k in enumerate(keys):
            if k is not None:
                latest[k] = (off + i, vals[i])
        off += len(keys)
    recs = []
    for i in range(nkeys):
        k = b"k%d" % i
        recs.append((topic, "p", off + i, b"s%d" % i, 1_700_000_000_000, k))
        latest[k] = (off + i, b"s%d" % i)
    db.append(recs)
    return latest


def compact_all(db: RecordDB, policy: CompactionPolicy, now: int = NOW, **kw: Any) -> Compactor:
    c = Compactor(db, lambda: policy, **kw)
    for _ in range(10_000):
        if not c.step(now):
            return c
    raise AssertionError("compaction did not finish")


def check_consistent(db: RecordDB, topic: str = "t") -> list[tuple[int, bytes | None, bytes]]:
    """Every block valid and dense, the partition's count, bytes and first agree with them."""
    info = db.info(topic, "p")
    assert info is not None
    with db._read_txn() as (txn, dbs):
        blocks = [(decode_header(v), bytes(v)) for k, v in txn.cursor(db=dbs.blocks)
                  if int.from_bytes(k[:4], "big") == info.pid]
    total = payload = 0
    prev = -1
    for hdr, v in blocks:
        validate(v)
        assert hdr.first_offset > prev
        prev = hdr.last_offset
        total += hdr.record_count
        payload += block_payload(hdr, v)
    assert info.count == total and info.bytes == payload
    assert info.first <= blocks[0][0].first_offset  # compaction leaves first (Kafka's log start) alone
    return [(x.offset, x.key, x.content) for x in db.read(topic, "p", 0, 10_000)]


def test_compaction_on_lmdb_keeps_the_latest_per_key_and_every_reader_passes_the_gaps(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db", sync=False) as db:
        latest = fill(db)
        before = {x.offset: x.content for x in db.read("t", "p", 0, 10_000)}
        c = compact_all(db, CompactionPolicy(frozenset({"t"})), step_bytes=200)
        assert c.dropped > 0
        after = check_consistent(db)
        offsets = [o for o, _k, _c in after]
        # Keyless records (every 6th of the Kafka ones) and the latest per key stay, contents unchanged.
        want = sorted({o for o, _v in latest.values()} | {i for i in range(36) if i % 6 == 5})
        assert offsets == want
        assert all(before[o] == content for o, _k, content in after)
        # Kafka fetch: batches with gaps between them, every record at its own offset.
        _start, nxt, batches = db.fetch_kafka("t", "p", 0, 1 << 20, encode_batch, batch_record_count)
        got = [(x.offset, x.key) for b in batches for x in DefaultRecordBatch(b)]
        assert [o for o, _k in got] == want and nxt == 41
        # Dafka FETCH (exact ranges): from inside a gap, the next offset held.
        start, values = db.fetch_raw("t", "p", 1, 100)
        assert start == want[0] and len(values) >= 1
        # Tank consume (whole blocks): from a gap, the block after it.
        s2, first, blocks = db.read_blocks("t", "p", 6, 1 << 20)
        assert (s2, first) == (6, 0) and blocks[0][0].first_offset == 11
        # A second pass changes nothing.
        assert compact_all(db, CompactionPolicy(frozenset({"t"})), step_bytes=200).dropped == 0


def test_expired_tombstones_go_with_their_keys_and_other_topics_are_untouched(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db", sync=False) as db:
        fill(db, "t")
        fill(db, "u")
        db.append_blocks([("t", "p", kafka_block(kbatch([b"gone", b"gone", b"last"], values=[b"x", None, b"y"],
                                                        ts=NOW - 5000), 41))])
        compact_all(db, CompactionPolicy(frozenset({"t"}), {"t": 1000}))
        keys = [k for _o, k, _c in check_consistent(db, "t")]
        assert not any(k is not None and b"gone" in k for k in keys)
        assert db.info("u", "p").count == 41  # type: ignore[union-attr]


_CHILD = textwrap.dedent("""
    import sys
    from dafka.store.compaction import CompactionPolicy, Compactor
    from dafka.store.db import RecordDB
    db = RecordDB(sys.argv[1], sync=True)
    c = Compactor(db, lambda: CompactionPolicy(frozenset({"t"})), step_bytes=1)
    while c.step(2_000_000_000_000):
        if c.round is not None and c.round.cleaning:
            print("cleaning", flush=True)
    print("done", flush=True)
""")


def test_a_kill_9_mid_compaction_leaves_each_block_old_or_rewritten_and_the_next_run_finishes(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with RecordDB(path, sync=False) as db:
        latest = fill(db, rounds=40, nkeys=7)
        before = {x.offset: x.content for x in db.read("t", "p", 0, 100_000)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    assert proc.stdout is not None
    steps = 0
    for _line in proc.stdout:
        steps += 1
        if steps == 15:
            os.kill(proc.pid, signal.SIGKILL)  # mid-way: between two commits or inside one
            break
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    with RecordDB(path, sync=False) as db:
        mid = check_consistent(db)
        assert all(before[o] == content for o, _k, content in mid)  # nothing altered, nothing invented
        assert {o for o, _v in latest.values()} <= {o for o, _k, _c in mid}  # the latest per key all there
        assert len(mid) < len(before)  # it did compact some
        compact_all(db, CompactionPolicy(frozenset({"t"})))
        end = check_consistent(db)
        want = sorted({o for o, _v in latest.values()} | {o for o in before if o < 320 and o % 8 == 7})
        assert [o for o, _k, _c in end] == want


def test_a_partition_with_ten_times_more_keys_than_the_map_takes_is_compacted_in_rounds_each_within_it(tmp_path: Path) -> None:
    """Hostile: every record a new key.  Each round's map stops at max_keys; the rounds go on
    from where the last stopped, and none holds more (the bound of docs/concepts/security.md)."""
    with RecordDB(tmp_path / "db", sync=False) as db:
        n = 5000
        db.append([("t", "p", i, b"v", 1, b"%d" % i) for i in range(n)] + [("t", "p", n, b"v", 1, b"0")])
        c = Compactor(db, lambda: CompactionPolicy(frozenset({"t"})), max_keys=500, step_bytes=64 << 10)
        biggest = 0
        for _ in range(100_000):
            more = c.step(NOW)
            if c.round is not None:
                biggest = max(biggest, len(c.round.planner.latest))
            if not more:
                break
        assert 0 < biggest <= 500
        assert c.rounds >= n // 500
        info = db.info("t", "p")
        assert info is not None and info.count == n  # key "0" at 0 superseded by the last record
        assert [x.offset for x in db.read("t", "p", 0, 2)] == [1, 2]


def test_a_store_compacts_its_configured_topics_in_its_writer_thread(tmp_path: Path) -> None:
    from dafka.config import NodeConfig
    from dafka.store.node import Store

    cfg = NodeConfig(towers=[])
    store = Store(str(tmp_path / "db"), cfg, sync=False, retention_interval=0.05,
                  compaction=CompactionPolicy(frozenset({"t"})))
    with store:
        fill(store.db)
        wait_until(lambda: store.db.info("t", "p").count == 11, timeout=20)  # type: ignore[union-attr]


def test_the_spark_path_transport_passes_compacted_gaps_without_reporting_a_loss(tmp_path: Path) -> None:
    from dafka.spark.offsets import ReadRange
    from dafka.spark.transport import _read_store

    path = tmp_path / "db"
    with RecordDB(path, sync=False) as db:
        fill(db)
        compact_all(db, CompactionPolicy(frozenset({"t"})))
        want = [o for o, _k, _c in check_consistent(db)]
        # A recorded hole past the head's records is still a loss: a partition with one.
        db.append([("h", "p", 0, b"a", 1), ("h", "p", 5, b"b", 1)], skips=[("h", "p", 1, 4)])
    got = [o for batch in _read_store(str(path), ReadRange("t", "p", 0, 41), True)
           for o in batch.column("offset").to_pylist()]
    assert got == want  # failOnDataLoss=true: no error for the gaps
    with pytest.raises(Exception, match="lost|loss|Loss"):
        list(_read_store(str(path), ReadRange("h", "p", 0, 6), True))


def test_a_tank_client_reads_a_compacted_partition_with_seq_gaps(tmp_path: Path) -> None:
    from dafka.config import NodeConfig
    from dafka.tank.client import TankClient
    from dafka.tank.gateway import Gateway

    gw = Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=("127.0.0.1", 0), retention_interval=0.05,
                 compaction=CompactionPolicy(frozenset({"tk"})))
    with gw, TankClient("127.0.0.1", gw.tank_port) as c:
        c.create_topic("tk", 1)
        for rnd in range(5):
            c.produce("tk", 0, [(b"k%d" % k, b"r%d-k%d" % (rnd, k)) for k in range(4)] + [b"nokey-%d" % rnd])
        address = gw.pmap.get("tk", 0).address
        wait_until(lambda: gw.db.info("tk", address).count == 9, timeout=30)  # type: ignore[union-attr]
        seen = []
        seq = 1
        for _ in range(50):
            res = c.consume("tk", 0, seq)
            if not res.messages:
                break
            seen += [(m[0], m[2], m[3]) for m in res.messages]
            seq = res.messages[-1][0] + 1
        # Tank seqs are offsets + 1: the gaps are there, keys and values as produced.
        assert [s for s, _k, _v in seen] == [5, 10, 15, 20, 21, 22, 23, 24, 25]
        assert seen[-5:] == [(21, b"k0", b"r4-k0"), (22, b"k1", b"r4-k1"), (23, b"k2", b"r4-k2"),
                             (24, b"k3", b"r4-k3"), (25, None, b"nokey-4")]


def _damage(db: RecordDB, topic: str, first: int, how: str = "crc") -> bytes:
    """Alter the stored block of ``topic``/p keyed ``first`` in place (as bit rot would):
    ``crc``, a record byte (its batch's CRC-32C and the block's no longer match); ``header``,
    its magic; ``resealed``, a CODEC_STORE block's header count one short of its table with
    the block's CRC right (a bug of an older version: only reading its records finds it)."""
    from dafka.store.block import HEADER_SIZE, _seal, block_key

    info = db.info(topic, "p")
    assert info is not None
    with db._write_lock, db._live_env().begin(write=True) as txn:
        dbs = db._dbs
        assert dbs is not None
        key = block_key(info.pid, first)
        raw = txn.get(key, db=dbs.blocks)
        assert raw is not None
        bad = bytearray(raw)
        if how == "crc":
            bad[-1] ^= 0xFF
        elif how == "header":
            bad[0:2] = b"XB"
        else:
            h = decode_header(raw)
            assert h.codec == CODEC_STORE and h.record_count > 1
            bad = bytearray(_seal(h.codec, h.compression, first, h.last_offset - 1, h.record_count - 1, h.first_ts,
                                  h.max_ts, bytes(raw[HEADER_SIZE:])))
        txn.put(key, bytes(bad), db=dbs.blocks)
    return bytes(bad)


def _blocks(db: RecordDB, topic: str) -> dict[int, bytes]:
    info = db.info(topic, "p")
    assert info is not None
    with db._read_txn() as (txn, dbs):
        return {int.from_bytes(k[4:], "big"): bytes(v) for k, v in txn.cursor(db=dbs.blocks)
                if int.from_bytes(k[:4], "big") == info.pid}


@pytest.mark.parametrize("how", ["crc", "header"])
def test_a_damaged_block_is_passed_and_left_as_it_is_while_the_rest_of_its_partition_is_compacted(
        tmp_path: Path, caplog: Any, how: str) -> None:
    """Hostile: a stored block that cannot be read (bit rot: its CRC, or its header) in the
    middle of a compacted partition.  Before: every round of the partition raised at it (a
    traceback each time, the partition then left until new records, whose round raised
    again): nothing of the partition was ever compacted.  Now each round passes it: the
    records before and after it are compacted, it stays byte for byte (nothing it holds is
    known: none of its records supersedes another, none goes), it is logged once in one line
    (no traceback) and counted, whatever the rounds after, and other topics go on."""
    import logging

    caplog.set_level(logging.ERROR, logger="dafka")
    policy = CompactionPolicy(frozenset({"t", "u"}))
    with RecordDB(tmp_path / "db", sync=False) as db:
        fill(db, "t")
        fill(db, "u")
        bad = _damage(db, "t", 12, how)  # the third batch: offsets 12-17
        c = compact_all(db, policy, step_bytes=200)
        blocks = _blocks(db, "t")
        assert blocks[12] == bad  # left as it is
        held = sorted(r.offset for first, v in blocks.items() if first != 12 for r in records(v))
        # Keyless records, the latest per key (the store block's); the damaged batch's six whole.
        assert held == [5, 11, 23, 29, 35, 36, 37, 38, 39, 40]
        info = db.info("t", "p")
        assert info is not None and info.count == len(held) + 6
        assert db.info("u", "p").count == 11  # type: ignore[union-attr]
        assert c.rounds == 2 and c.damaged == 1
        lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(lines) == 1 and not lines[0].exc_info, [r.getMessage() for r in lines]
        assert "compaction of t/p passes the stored block at offset 12" in lines[0].getMessage()
        # New records, new rounds: the block is passed again, not logged again.
        caplog.clear()
        for k in range(3):
            db.append([("t", "p", 41 + k, b"new%d" % k, 1_700_000_000_000, b"k%d" % k)])
            for _ in range(100):
                if not c.step(NOW) and c.round is None and 36 + k not in {
                        r.offset for first, v in _blocks(db, "t").items() if first != 12 for r in records(v)}:
                    break
            else:
                raise AssertionError(f"record {36 + k} was not compacted away")
        assert _blocks(db, "t")[12] == bad
        assert c.damaged == 1 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("how", ["resealed", "crc"])
def test_a_damaged_store_block_is_neither_rewritten_nor_deleted(tmp_path: Path, caplog: Any, how: str) -> None:
    """The store's own blocks, every record of the damaged one superseded by the next block.
    ``crc``: a record byte altered, the block's CRC-32C no longer matching, its records still
    parse: compaction checks the CRC before it trusts a block's keys (before, it deleted the
    block as superseded, whatever its altered keys were; a partial rewrite would have sealed
    the damage with a fresh CRC).  ``resealed``: its header's count one short of its ends
    table, with a right CRC (a bug of an older version): its records cannot be read (the ends
    table).  Either way it is passed and left as it is."""
    import logging

    caplog.set_level(logging.ERROR, logger="dafka")
    with RecordDB(tmp_path / "db", sync=False) as db:
        for rnd in range(3):  # three store blocks of the same five keys
            db.append([("t", "p", rnd * 5 + i, b"r%d-%d" % (rnd, i), 1_700_000_000_000, b"k%d" % i)
                       for i in range(5)])
        bad = _damage(db, "t", 5, how)
        c = compact_all(db, CompactionPolicy(frozenset({"t"})))
        blocks = _blocks(db, "t")
        assert blocks[5] == bad and sorted(blocks) == [5, 10]  # the first block's records superseded
        assert c.damaged == 1 and c.rounds == 1
        lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(lines) == 1 and not lines[0].exc_info and "offset 5" in lines[0].getMessage()


def test_a_damaged_block_does_not_stop_a_stores_compaction(tmp_path: Path, caplog: Any) -> None:
    """The store's writer-thread driver (``Store._compact``): a damaged block is passed, the
    round completes, nothing is logged as a failure (before: "compaction failed" with a
    traceback, the round given up)."""
    import logging

    from dafka.config import NodeConfig
    from dafka.store.node import Store

    caplog.set_level(logging.ERROR, logger="dafka")
    store = Store(str(tmp_path / "db"), NodeConfig(towers=[]), sync=False, retention_interval=3600,
                  compaction=CompactionPolicy(frozenset({"t"})))
    with store:
        fill(store.db)
        bad = _damage(store.db, "t", 0)
        for _ in range(20):
            store._compact()
            if store.compactor.round is None and store.compactor.rounds:
                break
        assert store.compactor.rounds == 1 and store.compactor.damaged == 1
        assert "compaction failed" not in caplog.text
        assert _blocks(store.db, "t")[0] == bad
        assert store.db.info("t", "p").count == 6 + 10  # type: ignore[union-attr]
        assert store.db.fetch_raw("t", "p", 40, 1)[1]  # the store still reads


def test_many_compacted_topics_are_found_with_one_read_of_the_partitions(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db", sync=False) as db:
        fill(db, "t")
        fill(db, "u")
        topics = frozenset({"t", *(f"other-{i}" for i in range(100))})
        compact_all(db, CompactionPolicy(topics))
        assert db.info("t", "p").count == 11 and db.info("u", "p").count == 41  # type: ignore[union-attr]


def test_a_reopened_store_does_not_take_compaction_gaps_for_holes(tmp_path: Path) -> None:
    """A store without a holes table builds one at open from the block headers, for every
    partition whose count says it has gaps: compaction's gaps must not become holes (a store
    would then fetch them, and cap its ACKs below them)."""
    with RecordDB(tmp_path / "db", sync=False) as db:
        fill(db)
        compact_all(db, CompactionPolicy(frozenset({"t"})))
        assert db.holes() == []
    with RecordDB(tmp_path / "db", sync=False) as db:
        assert db.holes() == []


batch_spec = st.tuples(
    st.booleans(),  # a Kafka batch (else the store's own records)
    st.integers(0, 2),  # its compression
    st.lists(st.tuples(st.sampled_from([None, b"a", b"b", b"c", b"d"]), st.booleans()), min_size=1, max_size=6),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(batch_spec, min_size=1, max_size=8), st.integers(1, 4), st.integers(1, 3000), st.booleans())
def test_compaction_on_lmdb_matches_the_model(
    batches: list[tuple[bool, int, list[tuple[bytes | None, bool]]]], max_keys: int, step: int, expire: bool
) -> None:
    """Whatever the blocks, map bound and step size: what is left is exactly the model's
    (the latest per key, keyless records, the head; expired tombstones gone), each record
    unchanged, and the partition's count and bytes true."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp()
    try:
        with RecordDB(d, sync=False) as db:
            off = 0
            recs: list[tuple[int, bytes | None, bool]] = []
            for kafka, comp, items in batches:
                if kafka:
                    keys = [k for k, _t in items]
                    vals: list[bytes | None] = [None if t and k is not None else b"v%d" % (off + i)
                                                for i, (k, t) in enumerate(items)]
                    db.append_blocks([("t", "p", kafka_block(kbatch(keys, compression=comp, values=vals), off))])
                    recs += [(off + i, k, vals[i] is None) for i, k in enumerate(keys)]
                else:
                    db.append([("t", "p", off + i, b"v%d" % (off + i), 1_700_000_000_000, k)
                               for i, (k, _t) in enumerate(items)])
                    recs += [(off + i, k, False) for i, (k, _t) in enumerate(items)]
                off += len(items)
            before = {x.offset: x.content for x in db.read("t", "p", 0, 10_000)}
            head = off - 1
            latest = {k: o for o, k, _t in recs if k is not None}
            want = sorted(o for o, k, tomb in recs
                          if o == head or k is None or (latest[k] == o and not (expire and tomb)))
            compact_all(db, CompactionPolicy(frozenset({"t"}), default_delete_retention_ms=0 if expire else 10**15),
                        max_keys=max_keys, step_bytes=step)
            after = check_consistent(db)
            assert [o for o, _k, _c in after] == want
            assert all(before[o] == c for o, _k, c in after)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_stored_kafka_batch_is_rewritten_within_the_budget_it_was_stored_under(tmp_path: Path) -> None:
    """Compaction's rewrite of a stored Kafka batch inflates it at most as far as the batch was
    checked when stored (block.DEFAULT_BUDGET, 64 MiB), not 2 GiB: a gzip bomb in a block (an
    older version's, altered with its CRCs right) is refused as damage, in the writer thread.
    Read from a real store.  Before, it was inflated whole (65 MiB) and rewritten."""
    from dafka.errors import ProtocolError
    from dafka.store.block import DEFAULT_BUDGET, block_key, decode_header, kafka_block
    from dafka.store.compaction import PLAIN, RecordInfo, rewrite_block
    from tests.store.test_damaged_reads import TS, _kafka_batch

    big = b"z" * (DEFAULT_BUDGET + (1 << 20))
    bomb = kafka_block(_kafka_batch(0, [b"k0", big], gzipped=True), 0, max_record_bytes=1 << 30, budget=1 << 30)
    assert len(bomb) < DEFAULT_BUDGET // 64
    with RecordDB(tmp_path / "db", sync=False) as db:
        db.append_blocks([("t", "p", kafka_block(_kafka_batch(0, [b"k0", b"k1"]), 0))])
        pid = db.info("t", "p").pid
        db._write(lambda txn: txn.put(block_key(pid, 0), bomb, db=db._dbs.blocks))
        with db._read_txn(buffers=False) as (txn, dbs):
            value = bytes(txn.get(block_key(pid, 0), db=dbs.blocks))
    infos = [RecordInfo(0, b"a", False, TS, PLAIN), RecordInfo(1, b"a", False, TS, PLAIN)]
    with pytest.raises(ProtocolError):
        rewrite_block(decode_header(value), value, infos, [False, True])
