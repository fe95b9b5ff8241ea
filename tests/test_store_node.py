"""Stores on the mesh: real processes, real LMDB, SIGKILL, replication, retention."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB, Retention, RetentionPolicy
from dafka.store.node import Store
from tests.conftest import (
    misframed_stream,
    start_store_process,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)





def read_all(cfg: NodeConfig, topic: str, n: int, timeout: float = 90.0) -> list:
    with Consumer(topic, cfg, offset_reset="earliest") as consumer:
        got: list = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += consumer.poll_batch(100_000, 0.5)
        extra = consumer.poll_batch(10, 0.5)
    return got + extra


def test_store_killed_halfway_keeps_every_acked_record(cfg: NodeConfig, tmp_path: Path) -> None:
    n = 100_000
    db = tmp_path / "store"
    store = start_store_process(cfg, db)
    producer = Producer("crash", cfg)
    try:
        producer.publish_many(b"record-%d" % i for i in range(n // 2))
        wait_until(lambda: producer.acked_offset >= n // 4, timeout=60)
        store.send_signal(signal.SIGKILL)
        store.wait(10)
        acked_before_kill = producer.acked_offset
        store = start_store_process(cfg, db)
        producer.publish_many(b"record-%d" % i for i in range(n // 2, n))
        assert producer.flush(120), f"acked only up to {producer.acked_offset}"
        assert producer.acked_offset == n - 1 and acked_before_kill >= n // 4
    finally:
        producer.close(0)
    got = read_all(cfg, "crash", n)
    store.terminate()
    store.wait(20)
    assert [r.offset for r in got] == list(range(n))
    assert all(r.content == b"record-%d" % r.offset for r in got)


def test_second_store_catches_up_and_replaces_the_first(cfg: NodeConfig, tmp_path: Path) -> None:
    first = start_store_process(cfg, tmp_path / "first")
    producer = Producer("repl", cfg)
    second = None
    try:
        producer.publish_many(b"v%d" % i for i in range(50_000))
        assert producer.flush(60)
        second = start_store_process(cfg, tmp_path / "second")
        producer.publish_many(b"v%d" % i for i in range(50_000, 60_000))
        assert producer.flush(60)
    finally:
        producer.close(0)

    def second_has_everything() -> bool:
        try:
            with RecordDB(tmp_path / "second", readonly=True) as db:
                return [(p.first, p.last) for p in db.partitions("repl")] == [(0, 59_999)]
        except Exception:
            return False

    wait_until(second_has_everything, timeout=90, interval=0.5)
    first.terminate()
    first.wait(20)
    shutil.rmtree(tmp_path / "first")
    got = read_all(cfg, "repl", 60_000)
    second.terminate()
    second.wait(20)
    assert [r.offset for r in got] == list(range(60_000))
    assert got[12345].content == b"v12345"


def test_producer_identity_continues_partition_without_duplicates(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "producer.json"
    with Store(tmp_path / "db", cfg):
        with Producer("ident", cfg, identity=identity) as p1:
            address = p1.address
            p1.publish_many(b"a%d" % i for i in range(100))
            assert p1.flush(30)
        with Producer("ident", cfg, identity=identity) as p2:
            assert p2.address == address and p2.next_offset == 100
            # An app resending what is already stored: recognised, not re-sent.
            assert p2.publish(b"a5", offset=5).acked()
            for i in range(100, 150):
                p2.publish(b"a%d" % i)
            assert p2.flush(30)
        got = read_all(cfg, "ident", 150)
    assert [(r.partition, r.offset) for r in got] == [(address, i) for i in range(150)]
    assert [r.content for r in got] == [b"a%d" % i for i in range(150)]


def test_retention_by_bytes_and_consumers_skip_forward(cfg: NodeConfig, tmp_path: Path) -> None:
    policy = RetentionPolicy(topics={"small": Retention(max_bytes=10_000), "young": Retention(max_age_ms=1)})
    with Store(tmp_path / "db", cfg, retention=policy, retention_interval=0.2) as store:
        with Producer("small", cfg) as p:
            p.publish_many(b"x" * 100 for _ in range(1000))  # 100 kB, keep 10 kB
            assert p.flush(30)
        with Producer("young", cfg) as p:
            p.publish_many(b"y" for _ in range(10))
            assert p.flush(30)

        def trimmed() -> bool:
            # Blocks leave whole while the topic keeps at least its limit: it may hold up
            # to one block (the store cuts its own at 64 KiB) more.
            parts = {i.topic: i for i in store.db.partitions()}
            return parts["small"].first > 0 and parts["small"].bytes <= 10_000 + (64 << 10) and parts["young"].count == 0

        wait_until(trimmed, timeout=30)
        first = store.db.partitions("small")[0].first
        assert first > 0
        with Consumer("small", cfg, offset_reset="earliest", skip_after=1.0, retry_interval=0.2) as c:
            got = []
            deadline = time.monotonic() + 30
            while (not got or got[-1].offset < 999) and time.monotonic() < deadline:
                got += c.poll_batch(10_000, 0.5)
            assert [r.offset for r in got] == list(range(got[0].offset, 1000))
            assert got[0].offset >= first and c.skipped >= first


def test_store_serves_exact_counts_heads_and_hello(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    with Store(tmp_path / "db", cfg) as store:
        with Producer("t", cfg) as p:
            p.publish_many(b"r%d" % i for i in range(20))
            assert p.flush(30)
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_DIRECT_HEAD, wire.P_STORE_HELLO])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        partition = next(iter(store.heads()))[1]
        peer.send(wire.Fetch(partition, peer.address, "t", 3, 5))
        peer.send(wire.Fetch("F" * 32, peer.address, "t", 0, 10))  # unknown partition
        peer.send(wire.Fetch(partition, peer.address, "t", 15, 2**32 - 1))  # huge count
        peer.send(wire.GetHeads("t", peer.address))
        peer.send(wire.ConsumerHello(store.address, peer.address, ("t", "nothing")))
        peer.wait_for(lambda q: len(q.messages(wire.DirectRecord)) >= 10 and len(q.messages(wire.DirectHead)) >= 2)
        peer.pump(0.5)
        records = [(m.sequence, m.content) for m in peer.messages(wire.DirectRecord)]
        assert records == [(i, b"r%d" % i) for i in range(3, 8)] + [(i, b"r%d" % i) for i in range(15, 20)]
        heads = peer.messages(wire.DirectHead)
        assert [(h.address, h.subject, h.sequence) for h in heads] == [(partition, "t", 19)] * 2
        # Garbage at the store, then it still works.
        for frames in ([b"F\x00\x01"], [b"Gt\x00\x01\x05"], [b"Wxx"], [b"M"], [b"Ht\x00\x01\x01"]):
            peer.send_raw(frames)
        peer.wait_for(lambda q: store.bad_input.count >= 3)
        peer.send(wire.Fetch(partition, peer.address, "t", 0, 1))
        peer.wait_for(lambda q: len(q.messages(wire.DirectRecord)) >= 11)
        assert store.running


def test_store_drops_misframed_records_whole(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    producer = raw_peer([])
    with Store(tmp_path / "db", cfg) as store:
        producer.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        # 300 messages in flight at most: well below the 1000 messages of the
        # raw peer's high-water mark (libzmq may count up to half of it as in
        # flight long after they were read).
        n, chunk = 3000, 100
        stream = misframed_stream("t", producer.address, n)
        for start in range(0, n, chunk):
            for frames in stream[3 * start : 3 * (start + chunk)]:
                producer.send_raw(frames)
            last = start + chunk - 1
            producer.wait_for(lambda p, last=last: store.heads().get(("t", producer.address), -1) >= last)
        producer.wait_for(lambda p: store.bad_input.count >= 2 * n)
        got = [(r.offset, r.content) for r in store.db.read("t", producer.address, 0, n + 10)]
        assert got == [(i, b"good %d" % i) for i in range(n)]


def test_retention_works_off_a_backlog_in_one_round(cfg: NodeConfig, tmp_path: Path) -> None:
    policy = RetentionPolicy(default=Retention(max_bytes=100))
    # The writer's own round never comes (interval 1 h): the test drives one.
    with Store(tmp_path / "db", cfg, retention=policy, retention_interval=3600) as store:
        # The steps, not the time budget, are under test: on a loaded machine
        # 0.2 s may not fit four synced 10k-deletion transactions.
        store.retention_budget = 60.0
        now = int(time.time() * 1000)
        store.db.append([("t", "P" * 32, i, b"x", now) for i in range(35_000)])  # 3.5 steps of 10k
        store._enforce_retention()
        info = store.db.partitions("t")[0]
        # Whole blocks leave while the topic keeps at least its limit: the last block
        # (of the store's 64 KiB ones: 6,553 of these records) stays.
        assert 0 < info.count <= 6_553 and info.first == 35_000 - info.count


def test_retention_round_stops_at_its_time_budget(cfg: NodeConfig, tmp_path: Path) -> None:
    policy = RetentionPolicy(default=Retention(max_bytes=100))
    with Store(tmp_path / "db", cfg, retention=policy, retention_interval=3600) as store:
        store.retention_budget = 0.0  # spent after the first step
        now = int(time.time() * 1000)
        store.db.append([("t", "P" * 32, i, b"x", now) for i in range(35_000)])
        store._enforce_retention()
        info = store.db.partitions("t")[0]
        # One step of about 10k deletions, the rest left for later rounds: whole blocks
        # (of 64 KiB: 6,553 of these records) while they fit the step's budget.
        assert 0 < info.first <= 10_000
        assert info.count == 35_000 - info.first


def test_full_disk_stops_acks_and_keeps_every_acked_record(cfg: NodeConfig, tmp_path: Path) -> None:
    # A map that cannot grow past 1 MiB plays the full disk.
    db = RecordDB(tmp_path / "db", map_size=256 << 10, max_map_size=1 << 20)
    with Store(db, cfg) as store:
        producer = Producer("full", cfg, capacity=100_000, publish_timeout=0.1)
        try:
            producer.publish_many(b"z" * 200 for _ in range(1_000))  # fits: acknowledged
            assert producer.flush(30)
            producer.publish_many(b"z" * 200 for _ in range(19_000))  # ~4 MB more: cannot fit
            wait_until(lambda: store.storage_error is not None, timeout=60)
            assert store.running
            info = store.db.partitions("full")[0]
            # Nothing is acknowledged beyond what is stored (the store only ACKs
            # committed heads), and what did not fit is not acknowledged.
            assert 999 <= producer.acked_offset <= info.last < 19_999
            assert max(store._unsent_acks.values(), default=-1) <= info.last
            assert info.first == 0
            got = [r.offset for r in store.db.read("full", info.partition, 0, info.count)]
            assert got == list(range(info.count))
        finally:
            producer.close(0)


def test_heads_answer_counts_records_held_beyond_a_hole(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    # A producer restarted after a crash resumes after the head the stores
    # give: offsets the store holds beyond a hole must count, or the new
    # records would reuse them and be dropped as their duplicates.
    with Store(tmp_path / "db", cfg, retry_interval=60) as store:
        peer = raw_peer([wire.P_DIRECT_HEAD, wire.P_FETCH])
        peer.wait_for(lambda q: q.subscribed(b"M") and q.subscribed(b"G"))
        for seq in (0, 1, 2, 5):
            peer.send(wire.Record("h", peer.address, "h", seq, b"c%d" % seq))
        wait_until(lambda: store.heads().get(("h", peer.address)) == 2)
        peer.send(wire.GetHeads("h", peer.address))
        heads = peer.wait_for(lambda q: q.messages(wire.DirectHead))
        assert [(h.address, h.sequence) for h in heads] == [(peer.address, 5)]


def test_a_lost_ack_is_sent_again_on_the_producers_head(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    # A new producer publishes as soon as it knows any peer: the store may
    # commit its records and send the one ACK before the producer subscribed
    # to it.  The producer's next HEAD must bring the ACK again, else its
    # flush waits forever.  (Never an ACK beyond the HEAD's offset.)
    producer = raw_peer([])  # not subscribed to ACKs yet: the first one is lost
    with Store(tmp_path / "db", cfg) as store:
        producer.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        for i in range(5):
            producer.send(wire.Record("t", producer.address, "t", i, b"r%d" % i))
        producer.wait_for(lambda p: store.heads().get(("t", producer.address), -1) == 4)
        producer.wait_for(lambda p: store.acks_sent >= 1)
        producer.sub.setsockopt(zmq.SUBSCRIBE, wire.P_ACK + producer.address.encode())
        producer.pump(0.3)  # the subscription reaches the store
        assert producer.messages(wire.Ack) == []

        def acked(p: Any, upto: int) -> bool:
            p.send(wire.Head("t", producer.address, "t", upto))
            return any(a.sequence == upto for a in p.messages(wire.Ack))

        producer.wait_for(lambda p: acked(p, 4))
        # A HEAD behind the store (a producer that lost its state) is not acked past itself.
        producer.pump(0.5)  # answers to the HEADs still in flight
        producer.received.clear()
        producer.wait_for(lambda p: acked(p, 2))
        assert all(a.sequence <= 2 for a in producer.messages(wire.Ack))


@pytest.mark.parametrize("linger", [0.0, 0.3])
def test_a_store_reads_a_trickle_together_after_a_small_read(
    cfg: NodeConfig, tmp_path: Path, raw_peer, linger: float
) -> None:
    # At low rates a store rests from reading after a small read (linger):
    # what arrives meanwhile is read at once, one wake-up for several records,
    # and still stored and acknowledged.  Without linger, a read a record.
    producer = raw_peer([wire.P_ACK])
    with Store(tmp_path / "db", cfg, linger=linger) as store:
        producer.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        producer.send(wire.Record("t", producer.address, "t", 0, b"first"))
        producer.wait_for(lambda p: store.heads().get(("t", producer.address), -1) == 0)
        reads = store.data_reads  # the trickle follows that small read at once
        for i in range(1, 11):
            producer.send(wire.Record("t", producer.address, "t", i, b"r%d" % i))
            producer.pump(0.02)  # a trickle: 20 ms apart, 0.2 s in all
        producer.wait_for(lambda p: any(a.sequence == 10 for a in p.messages(wire.Ack)))
        if linger:
            assert store.data_reads - reads <= 3
        else:
            assert store.data_reads - reads >= 6


def test_linger_setting_is_checked() -> None:
    from dafka.errors import ConfigError
    from dafka.store.node import linger_setting

    assert linger_setting({}) == 0.001
    assert linger_setting({"linger_ms": 0}) == 0.0
    assert linger_setting({"linger_ms": 2.5}) == 0.0025
    for bad in ("1", -1, 1001, True):
        with pytest.raises(ConfigError):
            linger_setting({"linger_ms": bad})



def test_a_departed_producers_head_is_announced_by_the_store_that_holds_it(
    cfg: NodeConfig, tmp_path: Path, raw_peer
) -> None:
    # A producer that closes without lingering may leave its last records (and
    # their HEAD) unsent to a second store; the store that holds them says where
    # the partition ends once the producer goes silent, not at the next
    # re-announce HEADS_INTERVAL (30 s) later.
    with Store(tmp_path / "db", cfg) as store:
        replica = raw_peer([wire.P_HEAD])  # takes every HEAD, as a store does
        replica.wait_for(lambda p: store.audience.readers(wire.P_HEAD + b"gone") >= 1)
        producer = Producer("gone", cfg, head_interval=3600)  # it tells nobody its head itself
        try:
            wait_until(lambda: producer.audience.readers(producer._record_header) >= 1)  # the store hears it
            producer.publish_many(b"r%d" % i for i in range(20))
            assert producer.flush(10)
        finally:
            producer.close(0)

        def tail_announced(p: Any) -> bool:
            return any(
                (h.address, h.sequence) == (producer.address, 19) for h in p.messages(wire.Head)
            )

        # Within a beacon timeout and slack, well before HEADS_INTERVAL (30 s).
        replica.wait_for(tail_announced, timeout=cfg.beacon_timeout + 8)


def test_a_stored_partitions_records_go_in_as_the_drains_blocks(cfg: NodeConfig, tmp_path: Path) -> None:
    """Once its partition is stored, a record from the mesh goes in inside a CODEC_STORE block
    the I/O thread built as it arrived (fastio.drain_blocks), stamped with its receive time:
    every commit of them is acknowledged, counted and observed in the ACK latency, and each
    record reads back at its offset."""
    from dafka.store import block as B

    with Store(tmp_path / "db", cfg) as store:
        with Producer("drained", cfg) as producer:
            wait_until(lambda: len(producer.peers) > 0)
            producer.publish_many(b"first-%d" % i for i in range(10))
            assert producer.flush(20)  # (its first commit creates the partition)
            key = ("drained", producer.address)
            wait_until(lambda: key in store._trackers and store._trackers[key].pid is not None)
            # (A commit is counted and observed just after its ACKs go out.)
            wait_until(lambda: store.commit_sizes.sum == 10 and store.ack_latency.count == store.commit_sizes.count)
            commits = store.commit_sizes.count
            before = int(time.time() * 1000)
            producer.publish_many(b"r%d" % i for i in range(3000))
            assert producer.flush(20)
            after = int(time.time() * 1000)
            wait_until(lambda: store.stored == 3010 and store.commit_sizes.sum == 3010)
            assert store.commit_sizes.count > commits
            wait_until(lambda: store.ack_latency.count == store.commit_sizes.count)
            got = [r.content for r in store.db.read(*key, 0, 4000)]
            assert got == [b"first-%d" % i for i in range(10)] + [b"r%d" % i for i in range(3000)]
            pid = store._pids[key]
            env = store.db._live_env()
            dbs = store.db._dbs
            assert dbs is not None
            with env.begin(db=dbs.blocks) as txn:
                headers = [B.decode_header(v) for k, v in txn.cursor() if k[:4] == pid.to_bytes(4, "big")]
    assert {h.codec for h in headers} == {B.CODEC_STORE}
    assert [h.first_offset for h in headers] == [0] + [h.last_offset + 1 for h in headers[:-1]]
    assert headers[-1].last_offset == 3009
    assert all(before <= h.first_ts <= h.max_ts <= after for h in headers if h.first_offset >= 10)


def test_records_a_failing_read_queued_stay_counted(cfg: NodeConfig, tmp_path: Path) -> None:
    """A read that fails part-way (a bug in a handler: the node loop logs it and goes on)
    keeps the blocks its drain queued before, and counts their records among those waiting
    for the writer (its bound, the commit's size, the stored count)."""
    from dafka.core.gaps import PartitionTracker
    from tests.test_fastio import TOPIC, Pair, _batch, _prefixes

    with Store(tmp_path / "db", cfg) as store:
        store.stop()  # (the test reads for the store's I/O thread)
        tracker = PartitionTracker(TOPIC, "P" * 32, 0)
        tracker.pid = 0
        prefixes = {prefix: tracker for prefix in _prefixes("P" * 32)}
        pair = Pair()
        pair.send_all([_batch("P" * 32, 0, (b"a", b"b", b"c", b"d", b"e")), [b"a message"]])
        assert pair.rx.poll(1000)

        def failing(frames: list[bytes]) -> None:
            raise RuntimeError("a handler's bug")

        store.on_message = failing  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="a handler's bug"):
            store.read_data(pair.rx, prefixes)
        assert tracker.next == 5
        assert sum(int.from_bytes(b[2][24:28], "big") for b in store._blocks) == 5
        assert store.pending_records() == 5
