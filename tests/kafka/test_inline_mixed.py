"""Tank and Kafka producers on one Kafka gateway without fsync, into the same partition: a loop
turn that read Tank requests commits on the I/O thread what is staged, the Kafka produces
with it (Store._commit_inline), while the writer takes the rest.  Real TCP, real LMDB."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.producer import ProduceRequest
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.kafka.gateway import KafkaGateway
from dafka.store.pipeline import Work
from dafka.tank.client import TankClient
from dafka.tank.messages import ProduceResponse
from tests.conftest import wait_until
from tests.kafka.test_gateway import frame, produce_raw
from tests.tank.test_gateway import HOST, consume_all, values
from tests.tank.test_inline_commit import reread
from tests.tank.test_pipelined_commit import bundle_of, produce_request

pytestmark = pytest.mark.timeout(120)


def kafka_batch(k: int, i: int, n: int) -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    for j in range(n):
        b.append(j, 1_700_000_000_000, None, b"k%d-%d-%d" % (k, i, j), [])
    return bytes(b.build())


class Commits(KafkaGateway):
    """Records which thread wrote each commit and whether it held Kafka batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.commits: list[tuple[str, bool]] = []
        super().__init__(*args, **kwargs)

    def _write_work(self, work: Work) -> Any:
        self.commits.append((threading.current_thread().name, work.marks.get("kafka", 0) > 0))
        return super()._write_work(work)


def test_tank_and_kafka_produces_into_one_partition_answer_in_order_and_lose_nothing(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    gw = Commits(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0), sync=False)
    errors: list[str] = []
    kafka_offsets: dict[bytes, int] = {}  # a Kafka record's value -> the offset its answer gave
    hwms: list[int] = []
    done = threading.Event()
    try:
        gw.create_topic("mixed", 1)

        def tank(t: int) -> None:
            with TankClient(HOST, gw.tank_port, timeout=30) as c:
                inflight: list[int] = []
                for i in range(60):
                    inflight.append(c.send(produce_request(c, "mixed", bundle_of(1000 * t + i, 3))))
                    if len(inflight) == 4 or i == 59:
                        while inflight:
                            resp = c.wait(inflight.pop(0))
                            if not (isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0):
                                errors.append(f"tank {t}: {resp}")

        def kafka(k: int) -> None:
            with socket.create_connection((HOST, gw.kafka_port), timeout=30) as s:
                for i in range(60):
                    r = produce_raw(s, i, "mixed", kafka_batch(k, i, 2))
                    if r.error_code != 0:
                        errors.append(f"kafka {k}: {r}")
                        continue
                    for j in range(2):
                        kafka_offsets[b"k%d-%d-%d" % (k, i, j)] = r.base_offset + j

        def watch() -> None:  # the partition's end as a reader sees it never goes back
            with TankClient(HOST, gw.tank_port, timeout=30) as c:
                while not done.is_set():
                    hwm = c.consume("mixed", 0, 0, 64).hwm
                    if hwm is not None:
                        hwms.append(hwm)

        threads = [threading.Thread(target=tank, args=(t,)) for t in range(3)]
        threads += [threading.Thread(target=kafka, args=(k,)) for k in range(2)]
        watcher = threading.Thread(target=watch)
        watcher.start()
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
        done.set()
        watcher.join(30)
        assert not errors, errors[:5]
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            got = consume_all(c, "mixed", 0)
        tank_values = [b"b%d-m%d" % (1000 * t + i, j) for t in range(3) for i in range(60) for j in range(3)]
        assert sorted(values(got)) == sorted(tank_values + list(kafka_offsets))  # each once
        at = {r[3]: r[0] - 1 for r in got}  # (a Tank seq is the offset + 1)
        assert [r[0] - 1 for r in got] == list(range(len(got)))
        assert {v: at[v] for v in kafka_offsets} == kafka_offsets  # where each answer said
        for t in range(3):  # a client's bundles in the order it sent them
            mine = [at[b"b%d-m0" % (1000 * t + i)] for i in range(60)]
            assert mine == sorted(mine)
        # The case looked at: Kafka batches committed on the I/O thread with Tank bundles
        # (about 20 of some 150 commits a run here).
        assert any(name != "dafka-store-writer" and k for name, k in gw.commits), gw.commits[:20]
        assert hwms and all(a <= b for a, b in zip(hwms, hwms[1:], strict=False)), hwms
    finally:
        done.set()
        gw.close()


def test_a_kafka_produce_after_a_tank_turn_still_wakes_the_writer(cfg: NodeConfig, tmp_path: Path) -> None:
    """A guard: only the offers of a turn that reads Tank requests leave the writer asleep (its
    before_wait commits them); a Kafka produce read in a later turn wakes it.  Were the Tank
    read's deferral left on, the Kafka produce would wait for the writer's next retention
    round (30 s here) with nothing else to wake it."""
    gw = Commits(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0), sync=False, retention_interval=30)
    try:
        gw.create_topic("after", 1)
        with TankClient(HOST, gw.tank_port, timeout=10) as c:
            resp = c.wait(c.send(produce_request(c, "after", bundle_of(0, 3))))
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
        with socket.create_connection((HOST, gw.kafka_port), timeout=5) as s:
            for i in range(3):
                # The writer idle in its wait: nothing staged, nothing to answer.
                wait_until(lambda: gw._pipe.committing is None and len(gw._writer_cond._waiters) == 1, 10)  # type: ignore[attr-defined]
                before = len(gw.commits)
                t0 = time.monotonic()
                r = produce_raw(s, i, "after", kafka_batch(0, i, 2))
                assert r.error_code == 0
                assert time.monotonic() - t0 < 2.0
                assert [name for name, k in gw.commits[before:] if k] == ["dafka-store-writer"]
    finally:
        gw.close()


class KafkaPausedWithAProduce(KafkaGateway):
    """A Kafka connection paused while a produce of it is buffered, unread, and its output
    empty when the gateway stops (see tests/tank/test_inline_commit.py for Tank's)."""

    hold = True

    def _kprocess(self, conn: Any) -> None:
        if self.hold and conn.frames.buffered:
            conn.reading = False  # paused: its frames wait
            return
        super()._kprocess(conn)


def test_a_kafka_produce_left_unread_at_shutdown_is_neither_stored_nor_answered(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    """Shutdown answers what was committed, then closes each connection; a produce still
    unread then must not be taken (the stopping writer committed it, never answered, and a
    client without idempotence sent it again: stored twice)."""
    gw = KafkaPausedWithAProduce(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0), sync=False)
    closed = False
    try:
        gw.hold = False
        gw.create_topic("unread", 1)
        with socket.create_connection((HOST, gw.kafka_port), timeout=10) as s:
            assert produce_raw(s, 1, "unread", kafka_batch(0, 0, 2)).error_code == 0
            gw.hold = True
            req = ProduceRequest[7](
                transactional_id=None, acks=-1, timeout_ms=5000,
                topic_data=[ProduceRequest.TopicProduceData(name="unread", partition_data=[
                    ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=kafka_batch(0, 1, 2))])],
            )
            s.sendall(frame(0, 7, 2, bytes(req.encode(version=7))))
            wait_until(lambda: any(not c.reading for c in list(gw._kconns.values())), 10)
            gw.hold = False  # from here on, the gateway's own code decides
            gw.close()
            closed = True
            s.settimeout(5)
            try:
                assert s.recv(1 << 16) == b""  # closed, not answered
            except ConnectionResetError:
                pass
    finally:
        if not closed:
            gw.close()
    assert values(reread(tmp_path / "gw", cfg, "unread")) == [b"k0-0-0", b"k0-0-1"]  # (a Tank reader of it)
