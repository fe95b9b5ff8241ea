"""Kafka transactions (KIP-98) with real clients against a real gateway process:
confluent-kafka's and kafka-python's transactional producers, a consume-transform-produce
loop with send_offsets_to_transaction, read_committed readers, a fenced zombie, a timeout,
and a gateway killed (SIGKILL) in the middle of a transaction."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from confluent_kafka import Consumer as CKConsumer
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka import Producer as CKProducer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata
from kafka import TopicPartition as KTopicPartition

from tests.conftest import dafka_cmd, subprocess_env, tower_flag, wait_until

pytestmark = pytest.mark.timeout(120)
HOST = "127.0.0.1"


class GatewayProcess:
    """A `dafka gateway` process with a Kafka listener, restartable on the same port and db."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.tower = "127.0.0.1:1:2"  # none: the mesh is not used

    def start(self) -> str:
        self.proc = subprocess.Popen(
            dafka_cmd("gateway", "--db", str(self.db), "--listen", f"{HOST}:0",
                      "--kafka-listen", f"{HOST}:{self.port}", "--tower", self.tower),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env(),
        )
        assert self.proc.stdout is not None
        up = self.proc.stdout.readline()
        found = re.search(r"Kafka on 127\.0\.0\.1:(\d+)", up)
        assert found, up
        self.port = int(found.group(1))
        return self.bootstrap

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    g = GatewayProcess(tmp_path_factory.mktemp("txn") / "gw")
    try:
        yield g.start()
    finally:
        g.kill()


def create(bs: str, *topics: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bs})
    for f in admin.create_topics([NewTopic(t, partitions, 1) for t in topics]).values():
        f.result(20)


def txn_producer(bs: str, tid: str, **extra: Any) -> CKProducer:
    p = CKProducer({"bootstrap.servers": bs, "transactional.id": tid, "linger.ms": 5, **extra})
    p.init_transactions(30)
    return p


def ck_read(bs: str, topic: str, isolation: str, partitions: int = 1, timeout: float = 20.0) -> list[tuple[int, int, bytes]]:
    """Every record of ``topic`` a confluent-kafka consumer with ``isolation`` gets, to the end."""
    c = CKConsumer({"bootstrap.servers": bs, "group.id": f"read-{isolation}", "isolation.level": isolation,
                    "enable.partition.eof": True, "enable.auto.commit": False})
    got = []
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(at_end) < partitions and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error():
                at_end.add(m.partition())
                continue
            at_end.discard(m.partition())
            got.append((m.partition(), m.offset(), m.value()))
    finally:
        c.close()
    assert len(at_end) == partitions, "the reader did not reach the end"
    return got


def kp_read(bs: str, topic: str, isolation: str) -> list[tuple[int, bytes]]:
    c = KafkaConsumer(bootstrap_servers=bs, isolation_level=isolation, enable_auto_commit=False,
                      consumer_timeout_ms=2000)
    try:
        tp = KTopicPartition(topic, 0)
        c.assign([tp])
        c.seek(tp, 0)
        return [(m.offset, m.value) for m in c]
    finally:
        c.close()


def watermarks(bs: str, topic: str, isolation: str) -> tuple[int, int]:
    c = CKConsumer({"bootstrap.servers": bs, "group.id": "wm", "isolation.level": isolation})
    try:
        return tuple(c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False))  # type: ignore[return-value]
    finally:
        c.close()


def test_confluent_commits_and_aborts_and_read_committed_never_returns_aborted_records(gateway: str) -> None:
    create(gateway, "tx-basic")
    p = txn_producer(gateway, "basic")
    p.begin_transaction()
    for i in range(5):
        p.produce("tx-basic", b"c%d" % i)
    p.commit_transaction(30)
    p.begin_transaction()
    for i in range(3):
        p.produce("tx-basic", b"a%d" % i)
    p.flush(30)
    p.abort_transaction(30)
    p.begin_transaction()
    p.produce("tx-basic", b"d0")
    p.commit_transaction(30)
    # Offsets as in Kafka: each transaction ends with a marker of its own in the partition.
    committed = [(0, b"c0"), (1, b"c1"), (2, b"c2"), (3, b"c3"), (4, b"c4"), (10, b"d0")]
    aborted = [(6, b"a0"), (7, b"a1"), (8, b"a2")]
    assert [(o, v) for _, o, v in ck_read(gateway, "tx-basic", "read_committed")] == committed
    assert kp_read(gateway, "tx-basic", "read_committed") == committed
    # read_uncommitted gets the aborted records too (as from Kafka), never a marker.
    assert [(o, v) for _, o, v in ck_read(gateway, "tx-basic", "read_uncommitted")] == sorted(committed + aborted)
    assert kp_read(gateway, "tx-basic", "read_uncommitted") == sorted(committed + aborted)
    assert watermarks(gateway, "tx-basic", "read_committed") == (0, 12)


def test_an_open_transaction_holds_read_committed_readers_at_its_first_offset(gateway: str) -> None:
    create(gateway, "tx-lso")
    plain = CKProducer({"bootstrap.servers": gateway})
    plain.produce("tx-lso", b"before")
    assert plain.flush(30) == 0
    p = txn_producer(gateway, "lso")
    p.begin_transaction()
    p.produce("tx-lso", b"pending")
    p.flush(30)
    plain.produce("tx-lso", b"after")  # not transactional, but behind the open transaction
    assert plain.flush(30) == 0
    assert watermarks(gateway, "tx-lso", "read_committed") == (0, 1)  # the last stable offset
    assert watermarks(gateway, "tx-lso", "read_uncommitted") == (0, 3)
    assert [v for _, _, v in ck_read(gateway, "tx-lso", "read_committed")] == [b"before"]
    assert [v for _, v in kp_read(gateway, "tx-lso", "read_committed")] == [b"before"]
    p.commit_transaction(30)
    assert [v for _, _, v in ck_read(gateway, "tx-lso", "read_committed")] == [b"before", b"pending", b"after"]


def test_a_read_committed_long_poll_waits_for_the_transaction_not_for_its_batches(gateway: str) -> None:
    """A read_committed fetch parked at the last stable offset: batches of the open
    transaction come (the head moves, the last stable offset does not) and it waits on; it
    is answered when the transaction commits.  (A parked fetch is retried on the partitions'
    metadata: counted on the head, it went out empty at each batch.)"""
    import socket

    from kafka.protocol.consumer import FetchRequest, FetchResponse
    from kafka.record import MemoryRecords

    from tests.kafka.test_gateway import frame, read_frame

    create(gateway, "tx-poll")
    p = txn_producer(gateway, "poll")
    p.begin_transaction()
    p.produce("tx-poll", b"t0", partition=0)
    p.flush(30)
    req = FetchRequest[11](
        replica_id=-1, max_wait_ms=30_000, min_bytes=1, max_bytes=1 << 20, isolation_level=1, session_id=0,
        session_epoch=-1, forgotten_topics_data=[], rack_id="",
        topics=[FetchRequest.FetchTopic(topic="tx-poll", partitions=[FetchRequest.FetchTopic.FetchPartition(
            partition=0, current_leader_epoch=-1, fetch_offset=0, log_start_offset=-1, partition_max_bytes=1 << 20)])],
    )
    host, port = gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(frame(1, 11, 7, bytes(req.encode(version=11))))
        for i in range(1, 4):
            p.produce("tx-poll", b"t%d" % i, partition=0)
            p.flush(30)
        s.settimeout(1.0)
        with pytest.raises(TimeoutError):
            s.recv(1)  # no answer while the transaction is open
        p.commit_transaction(30)
        answer = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
    assert [r.value for rb in MemoryRecords(bytes(answer.records)) for r in rb if not rb.is_control_batch][:4] == [
        b"t0", b"t1", b"t2", b"t3"]


def test_kafka_python_commits_and_aborts(gateway: str) -> None:
    create(gateway, "tx-kp")
    p = KafkaProducer(bootstrap_servers=gateway, transactional_id="kp")
    try:
        p.init_transactions()
        p.begin_transaction()
        p.send("tx-kp", b"k0")
        p.send("tx-kp", b"k1")
        # Offsets of a group (kafka-python's AddOffsetsToTxn and TxnOffsetCommit, v3): committed
        # with the transaction.
        p.send_offsets_to_transaction({KTopicPartition("tx-kp", 0): OffsetAndMetadata(2, "", -1)}, "kp-group")
        p.commit_transaction()
        p.begin_transaction()
        p.send("tx-kp", b"x0")
        p.flush()
        p.abort_transaction()
    finally:
        p.close()
    assert kp_read(gateway, "tx-kp", "read_committed") == [(0, b"k0"), (1, b"k1")]
    check = CKConsumer({"bootstrap.servers": gateway, "group.id": "kp-group"})
    try:
        assert check.committed([TopicPartition("tx-kp", 0)], timeout=10)[0].offset == 2
    finally:
        check.close()
    assert [v for _, _, v in ck_read(gateway, "tx-kp", "read_committed")] == [b"k0", b"k1"]


def test_a_consume_transform_produce_loop_is_exactly_once_through_aborts(gateway: str) -> None:
    create(gateway, "ctp-in", "ctp-out")
    src = CKProducer({"bootstrap.servers": gateway, "linger.ms": 5})
    n = 60
    for i in range(n):
        src.produce("ctp-in", b"%d" % i)
    assert src.flush(30) == 0
    group = "ctp"
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": group, "auto.offset.reset": "earliest",
                    "enable.auto.commit": False, "isolation.level": "read_committed"})
    p = txn_producer(gateway, "ctp")
    batches = 0
    try:
        c.subscribe(["ctp-in"])
        done = 0
        deadline = time.monotonic() + 60
        while done < n and time.monotonic() < deadline:
            msgs = c.consume(7, 0.5)
            msgs = [m for m in msgs if not m.error()]
            if not msgs:
                continue
            p.begin_transaction()
            for m in msgs:
                p.produce("ctp-out", b"out-" + m.value())
            p.send_offsets_to_transaction(
                [TopicPartition("ctp-in", 0, msgs[-1].offset() + 1)], c.consumer_group_metadata(), 30)
            batches += 1
            if batches % 3 == 0:
                # Aborted: its outputs (sent: flushed first) never count, and its offsets are not
                # committed: read again.
                p.flush(30)
                p.abort_transaction(30)
                tp = c.committed([TopicPartition("ctp-in", 0)], timeout=10)[0]
                c.seek(TopicPartition("ctp-in", 0, tp.offset if tp.offset >= 0 else 0))
                continue
            p.commit_transaction(30)
            done = msgs[-1].offset() + 1
    finally:
        c.close()
    assert batches >= 3, "no transaction was aborted"
    out = [v for _, _, v in ck_read(gateway, "ctp-out", "read_committed")]
    assert sorted(out) == sorted(b"out-%d" % i for i in range(n))  # each exactly once
    assert sorted(v for _, v in kp_read(gateway, "ctp-out", "read_committed")) == sorted(out)
    assert len(ck_read(gateway, "ctp-out", "read_uncommitted")) > n  # the aborted outputs are there
    check = CKConsumer({"bootstrap.servers": gateway, "group.id": group})
    try:
        assert check.committed([TopicPartition("ctp-in", 0)], timeout=10)[0].offset == n
    finally:
        check.close()


def test_a_zombie_producer_is_fenced_and_its_transaction_aborted(gateway: str) -> None:
    create(gateway, "tx-zombie")
    zombie = txn_producer(gateway, "zombie")
    zombie.begin_transaction()
    zombie.produce("tx-zombie", b"from-the-zombie")
    zombie.flush(30)
    fresh = txn_producer(gateway, "zombie")  # the same id: the zombie's transaction is aborted
    fresh.begin_transaction()
    fresh.produce("tx-zombie", b"from-the-new-one")
    fresh.commit_transaction(30)
    with pytest.raises(KafkaException) as err:
        zombie.produce("tx-zombie", b"late")
        zombie.commit_transaction(30)
    assert err.value.args[0].fatal() or "fenced" in str(err.value).lower(), err.value
    assert [v for _, _, v in ck_read(gateway, "tx-zombie", "read_committed")] == [b"from-the-new-one"]


def test_a_transaction_past_its_timeout_is_aborted(gateway: str) -> None:
    create(gateway, "tx-timeout")
    p = txn_producer(gateway, "slow", **{"transaction.timeout.ms": 1000})
    p.begin_transaction()
    p.produce("tx-timeout", b"too-late")
    p.flush(30)
    # The gateway aborts it: the last stable offset passes its marker.
    wait_until(lambda: watermarks(gateway, "tx-timeout", "read_committed")[1] == 2, 15, 0.2)
    with pytest.raises(KafkaException):
        p.commit_transaction(30)
    assert ck_read(gateway, "tx-timeout", "read_committed") == []
    assert [v for _, _, v in ck_read(gateway, "tx-timeout", "read_uncommitted")] == [b"too-late"]


def test_a_gateway_killed_mid_transaction_keeps_it(tmp_path: Path) -> None:
    g = GatewayProcess(tmp_path / "gw")
    bs = g.start()
    try:
        create(bs, "tx-restart")
        p = txn_producer(bs, "restart", **{"transaction.timeout.ms": 60_000})
        p.begin_transaction()
        for i in range(3):
            p.produce("tx-restart", b"r%d" % i)
        p.flush(30)
        g.kill()  # SIGKILL, the transaction ongoing
        g.start()  # same port, same database
        p.produce("tx-restart", b"r3")
        p.commit_transaction(60)
        assert [v for _, _, v in ck_read(bs, "tx-restart", "read_committed")] == [b"r0", b"r1", b"r2", b"r3"]
        # And an aborted one stays aborted across a restart.
        p.begin_transaction()
        p.produce("tx-restart", b"gone")
        p.flush(30)
        p.abort_transaction(30)
        g.kill()
        g.start()
        assert [v for _, _, v in ck_read(bs, "tx-restart", "read_committed")] == [b"r0", b"r1", b"r2", b"r3"]
        assert kp_read(bs, "tx-restart", "read_committed") == [(0, b"r0"), (1, b"r1"), (2, b"r2"), (3, b"r3")]
    finally:
        g.kill()


def test_a_transaction_left_open_over_a_gateway_restart_still_times_out(tmp_path: Path) -> None:
    """Its producer gone and the gateway killed: the restarted gateway gives the transaction its
    timeout again and then aborts it, so read_committed readers are not held for ever."""
    g = GatewayProcess(tmp_path / "gw")
    bs = g.start()
    try:
        create(bs, "tx-orphan")
        p = txn_producer(bs, "orphan", **{"transaction.timeout.ms": 2000})
        p.begin_transaction()
        p.produce("tx-orphan", b"orphaned")
        p.flush(30)
        g.kill()  # SIGKILL; the producer is never used again
        g.start()
        assert watermarks(bs, "tx-orphan", "read_uncommitted")[1] == 1
        wait_until(lambda: watermarks(bs, "tx-orphan", "read_committed")[1] == 2, 20, 0.2)  # past its marker
        assert ck_read(bs, "tx-orphan", "read_committed") == []
        assert kp_read(bs, "tx-orphan", "read_committed") == []
        assert [v for _, _, v in ck_read(bs, "tx-orphan", "read_uncommitted")] == [b"orphaned"]
        del p
    finally:
        g.kill()


# ---------------------------------------------------------------- what mesh readers see


def test_mesh_readers_see_only_committed_records_and_tank_readers_see_every_record(cfg: Any, tmp_path: Path) -> None:
    """A Dafka consumer of a gateway partition written by transactions gets its committed
    records only, in order, passing the aborted records and the markers at once (VOID kind 2,
    not after skip_after): as Kafka's read_committed consumers.  Tank clients (and Spark,
    which reads through them) read every record, aborted ones too, and each control record as
    an empty record with no key at its offset."""
    from dafka.kafka.gateway import KafkaGateway
    from dafka.nodes.consumer import Consumer
    from dafka.tank.client import TankClient

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        bs = f"{HOST}:{gw.kafka_port}"
        gw.create_topic("tx-mesh", 1)
        p = txn_producer(bs, "mesh")
        p.begin_transaction()
        p.produce("tx-mesh", b"kept", key=b"k")
        p.commit_transaction(30)
        p.begin_transaction()
        p.produce("tx-mesh", b"dropped", key=b"k")
        p.flush(30)
        p.abort_transaction(30)
        plain = CKProducer({"bootstrap.servers": bs})
        plain.produce("tx-mesh", b"after", key=b"k")  # offset 4, past the abort's marker
        assert plain.flush(30) == 0
        began = time.monotonic()
        with Consumer("tx-mesh", cfg, offset_reset="earliest", skip_after=60.0) as consumer:
            got: list[Any] = []
            deadline = time.monotonic() + 20
            while len(got) < 2 and time.monotonic() < deadline:
                got += consumer.poll_batch(100, 0.2)
            took = time.monotonic() - began
            got += consumer.poll_batch(100, 0.5)  # nothing more comes
        assert [(r.offset, bytes(r.content)) for r in got] == [(0, b"kept"), (4, b"after")]
        assert took < 15, took  # the aborted record and the markers were passed at once
        assert gw.txn_voids >= 1
        with TankClient(HOST, gw.tank_port) as t:
            r = t.consume("tx-mesh", 0, 0, 1 << 20)
        assert [(s, None if k is None else bytes(k), bytes(v)) for s, _ts, k, v in r.messages] == [
            (1, b"k", b"kept"), (2, None, b""), (3, b"k", b"dropped"), (4, None, b""), (5, b"k", b"after")]
        address = gw.pmap.get("tx-mesh", 0).address
        assert [(rec[0], rec[2], bytes(rec[3])) for rec in gw.db.read("tx-mesh", address, 0, 4)] == [
            (0, b"k", b"kept"), (1, None, b""), (2, b"k", b"dropped"), (3, None, b"")]
        # Kafka readers of the same partition: no marker, read_committed no aborted record.
        assert [(o, v) for _, o, v in ck_read(bs, "tx-mesh", "read_committed")] == [(0, b"kept"), (4, b"after")]
    finally:
        gw.close()


def test_a_reader_that_takes_no_void_gets_every_stable_record_and_one_that_does_gets_voids(
        cfg: Any, tmp_path: Path, raw_peer: Any) -> None:
    """A C reference reader does not subscribe to VOID, and has no way to pass an offset it is
    not sent: the gateway answers its FETCH with every stable record (aborted ones too, markers
    as empty records), as before.  A reader subscribed to VOID gets the committed records and a
    VOID kind 2 for the aborted record and the markers."""
    from dafka.core import wire
    from dafka.kafka.gateway import KafkaGateway

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        bs = f"{HOST}:{gw.kafka_port}"
        gw.create_topic("tx-c", 1)
        p = txn_producer(bs, "c-like")
        p.begin_transaction()
        p.produce("tx-c", b"kept")
        p.commit_transaction(30)  # 0 kept, 1 marker
        p.begin_transaction()
        p.produce("tx-c", b"dropped")
        p.flush(30)
        p.abort_transaction(30)  # 2 dropped, 3 marker
        address = gw.pmap.get("tx-c", 0).address
        c_like = raw_peer([])
        c_like.sub.setsockopt(zmq.SUBSCRIBE, wire.P_DIRECT_RECORD + c_like.address.encode())
        dafka_like = raw_peer([])
        for prefix in (wire.P_DIRECT_RECORD, wire.P_VOID):
            dafka_like.sub.setsockopt(zmq.SUBSCRIBE, prefix + dafka_like.address.encode())
        for peer in (c_like, dafka_like):
            peer.wait_for(lambda q: q.peers, 20)

        def asked(peer: Any, n: int) -> Any:
            def done(q: Any) -> bool:
                q.send(wire.Fetch(address, q.address, "tx-c", 0, 10))
                return len(q.messages(wire.DirectRecord)) + len(q.messages(wire.Void)) >= n
            return peer.wait_for(done, 20)

        asked(c_like, 4)
        assert [(m.sequence, m.content) for m in c_like.messages(wire.DirectRecord)][:4] == [
            (0, b"kept"), (1, b""), (2, b"dropped"), (3, b"")]
        asked(dafka_like, 2)
        assert {(m.sequence, m.content) for m in dafka_like.messages(wire.DirectRecord)} == {(0, b"kept")}
        assert {(v.first, v.last, v.kind) for v in dafka_like.messages(wire.Void)} == {(1, 3, wire.VOID_COMPACTED)}
    finally:
        gw.close()


def test_a_store_replicating_a_transactional_partition_holds_its_committed_records(cfg: Any, tmp_path: Path) -> None:
    """A dafka store catching up on a gateway partition written by transactions passes the
    aborted records and markers at once (recorded as holes), not after its skip_after."""
    from dafka.kafka.gateway import KafkaGateway
    from dafka.store.node import Store

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        bs = f"{HOST}:{gw.kafka_port}"
        gw.create_topic("tx-rep", 1)
        p = txn_producer(bs, "rep")
        p.begin_transaction()
        p.produce("tx-rep", b"kept")
        p.commit_transaction(30)  # 0 kept, 1 marker
        p.begin_transaction()
        p.produce("tx-rep", b"dropped")
        p.flush(30)
        p.abort_transaction(30)  # 2 dropped, 3 marker
        plain = CKProducer({"bootstrap.servers": bs})
        plain.produce("tx-rep", b"after")  # 4
        assert plain.flush(30) == 0
        address = gw.pmap.get("tx-rep", 0).address
        began = time.monotonic()
        with Store(tmp_path / "b", cfg, skip_after=60.0) as b:
            def caught_up() -> bool:
                info = b.db.info("tx-rep", address)
                return info is not None and info.last == 4 and info.count == 2

            wait_until(caught_up, timeout=20)
            took = time.monotonic() - began
            assert [(x.offset, bytes(x.content)) for x in b.db.read("tx-rep", address, 0, 5)] == [
                (0, b"kept"), (4, b"after")]
        assert took < 15, took
    finally:
        gw.close()


def test_a_tank_record_written_while_a_transaction_is_open_waits_for_it_on_the_mesh(cfg: Any, tmp_path: Path) -> None:
    """A Tank produce to a partition with a Kafka transaction open lands past its last stable
    offset: it is not published live (a Dafka consumer holding it would give the transaction's
    offsets up after skip_after, and lose its records once committed); readers get both, in
    order, when the transaction commits."""
    from dafka.kafka.gateway import KafkaGateway
    from dafka.nodes.consumer import Consumer
    from dafka.tank.client import TankClient

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        bs = f"{HOST}:{gw.kafka_port}"
        gw.create_topic("tx-tank", 1)
        with TankClient(HOST, gw.tank_port) as t, \
                Consumer("tx-tank", cfg, offset_reset="earliest", skip_after=1.0) as consumer:
            t.produce("tx-tank", 0, [b"t0"])  # offset 0
            got: list[Any] = []
            assert wait_until(lambda: bool(got.extend(consumer.poll_batch(100, 0.1)) or got), 20)
            p = txn_producer(bs, "tank-mix")
            p.begin_transaction()
            p.produce("tx-tank", b"c1")  # 1
            p.flush(30)
            t.produce("tx-tank", 0, [b"t2"])  # 2: past the last stable offset (1)
            # The transaction stays open past the consumer's skip_after: nothing more comes.
            held = time.monotonic() + 2.5
            while time.monotonic() < held:
                got += consumer.poll_batch(100, 0.1)
            assert [(r.offset, bytes(r.content)) for r in got] == [(0, b"t0")]
            p.commit_transaction(30)  # marker 3
            deadline = time.monotonic() + 20
            while len(got) < 3 and time.monotonic() < deadline:
                got += consumer.poll_batch(100, 0.1)
        assert [(r.offset, bytes(r.content)) for r in got] == [(0, b"t0"), (1, b"c1"), (2, b"t2")]
    finally:
        gw.close()


def test_dafka_consumers_of_a_gateway_process_get_only_committed_records_live_and_after(cfg: Any, tmp_path: Path) -> None:
    """A real gateway process, a transactional producer committing and aborting, and a plain
    record produced while a transaction is open: a Dafka consumer live through it all and one
    started after get exactly the committed records, in offset order, no marker, no aborted
    record, well before skip_after (the live one is never handed a record past the last stable
    offset, so it never waits on the open transaction's offsets)."""
    from dafka.nodes.consumer import Consumer

    g = GatewayProcess(tmp_path / "gw")
    g.tower = tower_flag(cfg)
    bs = g.start()
    try:
        create(bs, "tx-live")
        plain = CKProducer({"bootstrap.servers": bs, "linger.ms": 0})
        plain.produce("tx-live", b"first")  # offset 0
        assert plain.flush(30) == 0
        with Consumer("tx-live", cfg, offset_reset="earliest", skip_after=60.0) as live:
            got: list[Any] = []
            assert wait_until(lambda: bool(got.extend(live.poll_batch(100, 0.1)) or got), 20)
            began = time.monotonic()
            p = txn_producer(bs, "live")
            p.begin_transaction()
            p.produce("tx-live", b"c1")  # 1
            p.produce("tx-live", b"c2")  # 2
            p.commit_transaction(30)  # marker 3
            p.begin_transaction()
            p.produce("tx-live", b"x1")  # 4
            p.produce("tx-live", b"x2")  # 5
            p.flush(30)
            p.abort_transaction(30)  # marker 6
            p.begin_transaction()
            p.produce("tx-live", b"c3")  # 7
            p.flush(30)
            plain.produce("tx-live", b"p")  # 8: written while the transaction is open
            assert plain.flush(30) == 0
            time.sleep(0.3)  # (the open transaction holds the mesh's readers at offset 7 meanwhile)
            live_mid = list(got) + live.poll_batch(100, 0.1)
            p.commit_transaction(30)  # marker 9
            expected = [(0, b"first"), (1, b"c1"), (2, b"c2"), (7, b"c3"), (8, b"p")]
            deadline = time.monotonic() + 20
            got = list(live_mid)
            while len(got) < len(expected) and time.monotonic() < deadline:
                got += live.poll_batch(100, 0.1)
            took = time.monotonic() - began
            got += live.poll_batch(100, 0.5)
        assert [(r.offset, bytes(r.content)) for r in live_mid] == expected[:3]
        assert [(r.offset, bytes(r.content)) for r in got] == expected
        assert took < 15, took
        began = time.monotonic()
        with Consumer("tx-live", cfg, offset_reset="earliest", skip_after=60.0) as late:
            after: list[Any] = []
            deadline = time.monotonic() + 20
            while len(after) < len(expected) and time.monotonic() < deadline:
                after += late.poll_batch(100, 0.1)
            took = time.monotonic() - began
            after += late.poll_batch(100, 0.5)
        assert [(r.offset, bytes(r.content)) for r in after] == expected
        assert took < 15, took
    finally:
        g.kill()


# ---------------------------------------------------------------- quixstreams, exactly once

QS_APP = """
import sys, time
from quixstreams import Application

bootstrap, state, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
app = Application(broker_address=bootstrap, consumer_group="qs-eos", auto_offset_reset="earliest",
                  processing_guarantee="exactly-once", commit_interval=0.3, state_dir=state,
                  consumer_extra_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
                  # the killed run's open transaction is aborted by the gateway after this
                  producer_extra_config={"transaction.timeout.ms": 3000})
orders = app.topic("eos-orders", value_deserializer="json")
big = app.topic("eos-big", value_serializer="json")


def slowly(order):
    time.sleep(linger)  # the first run is killed half way
    return {"id": order["id"], "total": order["total"] * 10}


sdf = app.dataframe(orders)
sdf = sdf.filter(lambda order: order["total"] % 2 == 0).apply(slowly)
sdf.to_topic(big)
app.run(timeout=6.0)
"""


def test_a_quixstreams_application_runs_exactly_once_through_a_sigkill(gateway: str, tmp_path: Path) -> None:
    pytest.importorskip("quixstreams")
    import json
    import os
    import signal
    import sys

    create(gateway, "eos-orders", "eos-big")
    src = CKProducer({"bootstrap.servers": gateway, "linger.ms": 5})
    for i in range(200):
        src.produce("eos-orders", key=str(i), value=json.dumps({"id": i, "total": i}).encode())
    assert src.flush(30) == 0
    script = tmp_path / "app.py"
    script.write_text(QS_APP)

    def run(linger: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(script), gateway, str(tmp_path / "state"), str(linger)],
                                env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    first = run(0.05)
    try:
        wait_until(lambda: watermarks(gateway, "eos-big", "read_uncommitted")[1] >= 20, 60, 0.2)
        os.kill(first.pid, signal.SIGKILL)  # half way, between commits or inside a transaction
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    second = run(0.0)
    try:
        _, err = second.communicate(timeout=90)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(10)
    assert second.returncode == 0, err.decode()[-3000:]
    got = [json.loads(v) for _, _, v in ck_read(gateway, "eos-big", "read_committed")]
    assert sorted((r["id"], r["total"]) for r in got) == [(i, i * 10) for i in range(0, 200, 2)]  # once each
    assert [json.loads(v)["id"] for _, v in kp_read(gateway, "eos-big", "read_committed")] == [r["id"] for r in got]
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": "qs-eos"})
    try:
        assert c.committed([TopicPartition("eos-orders", 0)], timeout=20)[0].offset == 200
    finally:
        c.close()


def test_read_committed_readers_move_past_a_long_aborted_run_with_small_fetches(gateway: str) -> None:
    """A read_committed fetch over more aborted records than it reads at once answers an empty
    batch spanning them: without it the reader would ask for the same offset for ever."""
    create(gateway, "tx-long")
    p = txn_producer(gateway, "long", **{"linger.ms": 20})
    p.begin_transaction()
    for i in range(3000):
        p.produce("tx-long", b"x%d" % i)
    p.flush(30)
    p.abort_transaction(30)
    p.begin_transaction()
    p.produce("tx-long", b"after")
    p.commit_transaction(30)
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": "long", "isolation.level": "read_committed",
                    "max.partition.fetch.bytes": 1600, "fetch.max.bytes": 1600, "message.max.bytes": 1600})
    try:
        c.assign([TopicPartition("tx-long", 0, 0)])
        m = wait_until(lambda: (lambda m: m if m is not None and not m.error() else None)(c.poll(0.2)), 20, 0)
        assert (m.offset(), m.value()) == (3001, b"after")
    finally:
        c.close()
    k = KafkaConsumer(bootstrap_servers=gateway, isolation_level="read_committed", max_partition_fetch_bytes=1600,
                      fetch_max_bytes=1600, consumer_timeout_ms=5000)
    try:
        tp = KTopicPartition("tx-long", 0)
        k.assign([tp])
        k.seek(tp, 0)
        assert [(m.offset, m.value) for m in k] == [(3001, b"after")]
    finally:
        k.close()


def test_transactional_batches_keep_large_keys_and_headers(gateway: str) -> None:
    """A transaction's batches are stored as sent and served whole: a 600-byte key and 300
    bytes of headers come back exact to read_committed readers (not through the store's
    255-byte key slot)."""
    create(gateway, "tx-big")
    p = txn_producer(gateway, "big")
    p.begin_transaction()
    p.produce("tx-big", b"v", key=b"k" * 600, headers=[("h", b"x" * 300)])
    p.commit_transaction(30)
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": "big", "isolation.level": "read_committed"})
    try:
        c.assign([TopicPartition("tx-big", 0, 0)])
        m = wait_until(lambda: (lambda m: m if m is not None and not m.error() else None)(c.poll(0.2)), 20, 0)
        assert (m.key(), m.value(), m.headers()) == (b"k" * 600, b"v", [("h", b"x" * 300)])
    finally:
        c.close()
    k = KafkaConsumer(bootstrap_servers=gateway, isolation_level="read_committed", consumer_timeout_ms=3000)
    try:
        tp = KTopicPartition("tx-big", 0)
        k.assign([tp])
        k.seek(tp, 0)
        got = [(m.key, m.value, m.headers) for m in k]
        assert got == [(b"k" * 600, b"v", [("h", b"x" * 300)])]
    finally:
        k.close()
