"""Reliability in separate processes: producer restarts, twins, forged ACKs, diagnostics.

Each test runs real nodes (a store process, producer processes killed with
SIGKILL) on 127.0.0.1 with a tower on ephemeral ports.
"""

from __future__ import annotations

import errno
import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import zmq

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.errors import ResumeError
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB, StorageFullError
from dafka.store.node import Store
from tests.conftest import (
    dafka_cmd,
    spawned,
    start_store_process,
    subprocess_env,
    tower_flag,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)




# A producer process: publishes one record at a time, waits for its ACK and
# prints the acknowledged offset (what its receipts promised).
PRODUCER = textwrap.dedent(
    """
    import sys, time
    from dafka.config import NodeConfig, TowerAddress
    from dafka.nodes.producer import Producer

    host, pin, pout, identity, prefix, count, pause = sys.argv[1:8]
    cfg = NodeConfig(towers=(TowerAddress(host, int(pin), int(pout)),), bind="127.0.0.1",
                     beacon_interval=0.2, beacon_timeout=2.0)
    producer = Producer("reliable", cfg, identity=identity, resume_timeout=10.0)
    print("ready", producer.address, producer.next_offset, flush=True)
    for i in range(int(count)):
        receipt = producer.publish(b"%s-%d" % (prefix.encode(), i))
        if receipt.wait(30):
            print(receipt.offset, flush=True)
        time.sleep(float(pause))
    producer.close(10)
    """
)


def start_producer(cfg: NodeConfig, identity: Path, prefix: str, count: int, pause: float = 0.0):
    t = cfg.towers[0]
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, t.host, str(t.in_port), str(t.out_port), str(identity), prefix,
         str(count), str(pause)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    spawned(proc)
    line = proc.stdout.readline().split()
    assert line[:1] == [b"ready"], (line, proc.stderr.read() if proc.poll() is not None else b"")
    return proc, line[1].decode()


def read_partition(cfg: NodeConfig, topic: str, want: set[int], timeout: float = 60.0) -> dict[int, bytes]:
    """Records of ``topic`` until every offset of ``want`` came (a restart may leave holes)."""
    with Consumer(topic, cfg, offset_reset="earliest") as consumer:
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        while not want <= got.keys() and time.monotonic() < deadline:
            for r in consumer.poll_batch(100_000, 0.5):
                got[r.offset] = r.content
    return got


def test_kill_9_and_restart_loses_no_acknowledged_record(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "id.json"
    start_store_process(cfg, tmp_path / "db")
    proc, address = start_producer(cfg, identity, "old", 1_000_000)
    acked: dict[int, bytes] = {}
    while len(acked) < 2000:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        offset = int(line)
        acked[offset] = b"old-%d" % offset
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for line in proc.stdout.read().splitlines():  # acknowledged before the kill, not yet read
        if line.isdigit():
            acked[int(line)] = b"old-%d" % int(line)
    saved = json.loads(identity.read_text())
    # The file lags behind what the store acknowledged (saved at most every 0.5 s).
    assert saved["address"] == address and saved["acked"] < max(acked)

    with Producer("reliable", cfg, identity=identity, resume_timeout=10.0) as producer:
        assert producer.address == address
        assert producer.next_offset > max(acked)
        receipts = [(producer.publish(b"new-%d" % i), b"new-%d" % i) for i in range(1000)]
        assert producer.flush(60)
        assert producer.bad_acks == 0
    for receipt, content in receipts:
        assert receipt.acked()
        acked[receipt.offset] = content
    got = read_partition(cfg, "reliable", set(acked))
    lost = {o: c for o, c in acked.items() if got.get(o) != c}
    assert not lost, f"{len(lost)} acknowledged records lost or overwritten, e.g. {sorted(lost)[:5]}"


def test_resume_without_a_store_refuses_unless_started_anyway(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "id.json"
    address = "A" * 32
    identity.write_text(json.dumps({"address": address, "topic": "lonely", "acked": 41, "next": 45}))
    with pytest.raises(ValueError, match="resume must be one of"):
        Producer("lonely", cfg, identity=identity, resume="maybe")
    with Producer("lonely", cfg, identity=identity, resume_timeout=1.0) as strict:
        with pytest.raises(ResumeError, match="no store answered"):
            strict.publish(b"x")
        with pytest.raises(ResumeError):
            strict.publish_many([b"y"])
    assert json.loads(identity.read_text())["next"] == 45  # the refused one left the file alone
    with Producer("lonely", cfg, identity=identity, resume_timeout=1.0, resume="start_anyway") as anyway:
        assert anyway.publish(b"x").offset == 45
        assert anyway.bad_acks == 0
        anyway.close(0)  # no store: nothing will be acknowledged


def test_second_process_with_the_same_identity_is_refused(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "id.json"
    start_store_process(cfg, tmp_path / "db")
    first, address = start_producer(cfg, identity, "first", 1_000_000, pause=0.01)
    assert int(first.stdout.readline()) == 0  # publishing and acknowledged
    with Producer("reliable", cfg, identity=identity, resume_timeout=10.0) as twin:
        assert twin.address == address
        with pytest.raises(ResumeError, match="another live producer"):
            twin.publish(b"mine")
    # The first one keeps publishing and getting ACKs.
    before = int(first.stdout.readline())
    for _ in range(50):
        after = int(first.stdout.readline())
    assert after >= before + 50
    # The twin never beaconed (it listens first), so it disturbed nobody.
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert b"another node uses" not in first.stderr.read()


def test_running_producer_notices_a_newcomer_beaconing_its_address(cfg: NodeConfig, raw_peer, caplog) -> None:
    with Producer("twins", cfg) as producer:
        wait_until(lambda: producer.tower_watch.reached)
        newcomer = raw_peer([])
        newcomer.address = producer.address  # e.g. a producer that does not check first
        wait_until(lambda: newcomer.pump(0.05) or producer.duplicates_seen >= 1)
        assert producer.publish(b"still mine").offset == 0  # the first one keeps working
        producer.close(0)
    assert "another node uses this producer's address" in caplog.text


def test_forged_ack_beyond_published_offsets_is_counted_not_applied(cfg: NodeConfig, raw_peer) -> None:
    peer = raw_peer([])
    with Producer("forged", cfg) as producer:
        for i in range(3):
            producer.publish(b"r%d" % i)
        ack_prefix = wire.P_ACK + producer.address.encode()
        peer.wait_for(lambda p: p.subscribed(ack_prefix))
        peer.send(wire.Ack(producer.address, "forged", 1_000_000))
        wait_until(lambda: producer.bad_acks == 1)
        assert producer.acked_offset == -1 and producer.unacked == 3
        peer.send(wire.Ack(producer.address, "forged", 1))
        wait_until(lambda: producer.acked_offset == 1)
        assert producer.bad_acks == 1
        producer.close(0)


def test_cli_warns_when_no_tower_is_reached(tmp_path: Path) -> None:
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        pin, pout = a.getsockname()[1], b.getsockname()[1]
        # Bound but never listening: connections are refused while the test runs.
        proc = subprocess.run(
            dafka_cmd("consume", "nowhere", "--tower", f"127.0.0.1:{pin}:{pout}", "--timeout", "4.5"),
            capture_output=True,
            env=subprocess_env(),
            timeout=60,
        )
    err = proc.stderr.decode()
    assert "reached no tower" in err, err
    assert f"tcp://127.0.0.1:{pin}" in err and f"tcp://127.0.0.1:{pout}" in err


class FlakyDB(RecordDB):
    """A record database whose commits fail while ``failure`` is set.

    Injected at the RecordDB boundary (the store's only contact with LMDB):
    an I/O error such as a full tmpfs gives is hard to cause for real.
    """

    failure: BaseException | None = None

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.hold = threading.Event()  # cleared: commits wait (a slow disk)
        self.hold.set()

    def append(self, batch, **kw):  # type: ignore[no-untyped-def]
        self.hold.wait(30)
        if self.failure is not None:
            raise self.failure
        return super().append(batch, **kw)

    def append_pairs(self, batch, pairs, segs, gate=None, **kw):  # type: ignore[no-untyped-def]
        self.hold.wait(30)
        if self.failure is not None:
            raise self.failure
        return super().append_pairs(batch, pairs, segs, gate, **kw)


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.EIO, "Input/output error"), StorageFullError("commit failed: Input/output error")],
    ids=["raw-oserror", "storage-error"],
)
def test_commit_io_error_keeps_the_batch_stops_acks_and_says_why(
    cfg: NodeConfig, tmp_path: Path, failure: BaseException
) -> None:
    db = FlakyDB(tmp_path / "db")
    with Store(db, cfg) as store, Producer("eio", cfg, publish_timeout=0.1) as producer:
        producer.publish_many(b"r%d" % i for i in range(10))
        assert producer.flush(30)
        db.failure = failure
        producer.publish_many(b"r%d" % i for i in range(10, 20))
        wait_until(lambda: "Input/output error" in producer.diagnose(), timeout=15)
        assert "cannot write" in producer.diagnose() and store.address[:8] in producer.diagnose()
        assert producer.acked_offset == 9 and store.storage_error is not None
        db.failure = None  # the disk recovers: the kept batch is committed, ACKs resume
        assert producer.flush(30)
        wait_until(lambda: producer.store_status[store.address][0], timeout=10)
        assert "write" in producer.diagnose()
        partition = producer.address
        got = [r.content for r in db.read("eio", partition, 0, 100)]
    assert got == [b"r%d" % i for i in range(20)]


def test_cli_produce_says_why_records_were_not_acknowledged(cfg: NodeConfig, tmp_path: Path) -> None:
    source = tmp_path / "records.txt"
    source.write_bytes(b"".join(b"%06d-" % i + b"x" * 1000 + b"\n" for i in range(3000)))  # 3 MB
    produce = dafka_cmd("produce", "full", "--tower", tower_flag(cfg), "--bind", "127.0.0.1",
                        "--file", str(source), "--timeout", "4")
    # No store at all.
    proc = subprocess.run(produce, capture_output=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 1
    assert b"no store seen" in proc.stderr, proc.stderr
    # A store whose map cannot grow past 1 MiB: a full disk, for real.
    db = RecordDB(tmp_path / "db", map_size=256 << 10, max_map_size=1 << 20)
    with Store(db, cfg):
        proc = subprocess.run(produce, capture_output=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 1
    assert b"cannot write" in proc.stderr and b"max_map_size" in proc.stderr, proc.stderr


def test_cli_produce_with_identity_refuses_without_a_store_unless_started_anyway(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    identity = tmp_path / "id.json"
    identity.write_text(json.dumps({"address": "B" * 32, "topic": "cli", "acked": 6, "next": 8}))
    produce = dafka_cmd("produce", "cli", "--tower", tower_flag(cfg), "--bind", "127.0.0.1",
                        "--identity", str(identity), "--resume-timeout", "1", "--timeout", "1")
    proc = subprocess.run(produce, input=b"a\nb\n", capture_output=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert b"error: cannot resume the partition: no store answered" in proc.stderr
    assert b"--start-anyway" in proc.stderr
    proc = subprocess.run([*produce, "--start-anyway"], input=b"a\nb\n", capture_output=True,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 1, proc.stderr  # started, but nothing acknowledges
    assert b"2 of 2 records were not acknowledged" in proc.stderr and b"no store seen" in proc.stderr
    assert json.loads(identity.read_text())["next"] == 10  # continued after the saved offsets


def test_twin_noticed_just_after_resume_stops_the_newcomer(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    identity = tmp_path / "id.json"
    identity.write_text(json.dumps({"address": "C" * 32, "topic": "late", "acked": -1, "next": 0}))
    with Producer("late", cfg, identity=identity, resume_timeout=1.0, resume="start_anyway") as producer:
        assert producer.publish(b"first").offset == 0
        twin = raw_peer([])
        twin.address = producer.address  # its beacons come late, after our resume
        wait_until(lambda: twin.pump(0.05) or producer.duplicates_seen >= 1)
        with pytest.raises(ResumeError, match="noticed just after this one resumed"):
            producer.publish(b"second")
        producer.close(0)


def test_resume_continues_after_records_a_busy_store_holds_uncommitted(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "id.json"
    db = FlakyDB(tmp_path / "db")
    with Store(db, cfg) as store:
        with Producer("held", cfg, identity=identity) as first:
            first.publish_many(b"old-%d" % i for i in range(10))
            assert first.flush(30)
            db.hold.clear()  # the next commit takes its time (a slow disk)
            first.publish_many(b"old-%d" % i for i in range(10, 20))
            wait_until(lambda: store._trackers[("held", first.address)].next == 20)
            first.close(0)  # it dies with 10..19 published, received by the store, not committed
        with Producer("held", cfg, identity=identity) as second:
            assert second.next_offset == 20  # after what the store received, not what it committed
            db.hold.set()
            second.publish_many(b"new-%d" % i for i in range(20, 30))
            assert second.flush(30)
            assert second.bad_acks == 0
            got = [r.content for r in db.read("held", second.address, 0, 100)]
    assert got == [b"old-%d" % i for i in range(20)] + [b"new-%d" % i for i in range(20, 30)]


def test_resume_refuses_while_the_store_cannot_write_and_says_why(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "id.json"
    db = FlakyDB(tmp_path / "db")
    with Store(db, cfg) as store:
        with Producer("failing", cfg, identity=identity) as first:
            first.publish_many(b"old-%d" % i for i in range(10))
            assert first.flush(30)
            db.failure = OSError(errno.EIO, "Input/output error")
            first.publish_many(b"old-%d" % i for i in range(10, 20))
            wait_until(lambda: store.storage_error is not None)
            first.close(0)
        # A store that cannot write reads nothing (it keeps its batch): no head, no guess.
        with Producer("failing", cfg, identity=identity, resume_timeout=2.0) as second:
            with pytest.raises(ResumeError, match="no store answered.*Input/output error"):
                second.publish(b"x")
        db.failure = None
        with Producer("failing", cfg, identity=identity) as third:
            # 11..19 were never acknowledged: the store still has them (20), or
            # it expired the closed producer while paused, which drops what its
            # pipe held, and they are gone (11). Either way nothing is reused
            # that a store holds.
            resumed = third.next_offset
            assert resumed in (11, 20)
            third.publish(b"new")
            assert third.flush(30)
            got = [r.content for r in db.read("failing", third.address, 0, 100)]
    assert got == [b"old-%d" % i for i in range(resumed)] + [b"new"]


def test_resumed_producer_without_acks_beacons_and_is_read(cfg: NodeConfig, tmp_path: Path) -> None:
    # Without stores to wait for, the resume was done as soon as the producer
    # could beacon, and its held beacon was never let go: nobody connected to it.
    identity = tmp_path / "id.json"
    identity.write_text(json.dumps({"address": "D" * 32, "topic": "silent", "acked": -1, "next": 0}))
    with Store(tmp_path / "db", cfg) as store:
        with Producer("silent", cfg, identity=identity, acks=False, resume_timeout=5.0) as producer:
            assert not producer.beacon_held
            producer.publish(b"heard")
            wait_until(lambda: store.db.head("silent", "D" * 32) is not None, timeout=20)
            assert [r.content for r in store.db.read("silent", "D" * 32, 0, 10)] == [b"heard"]


def test_a_late_beacon_of_an_incarnation_this_process_closed_is_no_twin(cfg: NodeConfig, tmp_path: Path) -> None:
    # A busy tower (a thread of a loaded process) relays a producer's last beacons
    # after it closed, when the next incarnation of its identity already listens
    # for twins. Those beacons (its address, its port) came from a node this very
    # process closed: no live twin, and no reason to refuse to publish. (Full runs
    # failed so, in three different tests, once a run or so.)
    from dafka.core import beacon as dafka_beacon

    identity = tmp_path / "id.json"
    with Store(tmp_path / "db", cfg):
        with Producer("late", cfg, identity=identity) as first:
            assert first.publish(b"a").wait(20)
            address, port = first.address, first.port
        # The beacons the first one sent, as the tower relays them late.
        stale = zmq.Context.instance().socket(zmq.PUB)
        stale.setsockopt(zmq.LINGER, 0)
        stale.connect(cfg.towers[0].beacon_in)
        plain = wire.node_beacon(address, "", port)
        beacons = [plain, [dafka_beacon.Interest.producer("late").heads()[0], *plain[1:]]]
        stop = threading.Event()

        def pump() -> None:  # for the first second of the next incarnation
            deadline = time.monotonic() + 1.0
            while not stop.is_set() and time.monotonic() < deadline:
                for frames in beacons:
                    stale.send_multipart(frames)
                stop.wait(0.05)

        pumping = threading.Thread(target=pump, daemon=True)
        pumping.start()
        try:
            with Producer("late", cfg, identity=identity, resume_timeout=5.0) as second:
                assert second.address == address
                assert second.publish(b"b").offset == 1
                assert second.flush(20)
                assert second.duplicates_seen == 0
        finally:
            stop.set()
            pumping.join(5)
            stale.close(0)
