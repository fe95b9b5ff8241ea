"""The Kafka gateway's produce answers under the pipelined group commit: SIGKILL right after
answers (16 produce requests in flight, acks=all) loses nothing answered."""

from __future__ import annotations

import re
import signal
import socket
import struct
import subprocess
from pathlib import Path

import pytest
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.store.db import RecordDB
from dafka.tank.client import TankClient
from tests.conftest import dafka_cmd, spawned, subprocess_env, tower_flag
from tests.kafka.test_gateway import frame, read_frame
from tests.tank.test_gateway import the_map

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


def start_kafka_gateway(cfg: NodeConfig, db: Path) -> tuple[subprocess.Popen, int, int]:
    proc = spawned(subprocess.Popen(
        dafka_cmd("gateway", "--db", str(db), "--listen", f"{HOST}:0", "--kafka-listen", f"{HOST}:0",
                  "--tower", tower_flag(cfg), "--bind", HOST),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=subprocess_env(),
    ))
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.search(r"Tank on [\d.]+:(\d+), Kafka on [\d.]+:(\d+)", line)
    assert m, line
    return proc, int(m.group(1)), int(m.group(2))


def batch_of(i: int, n: int) -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    for j in range(n):
        b.append(j, 1000, None, b"k%d-%d" % (i, j), [])
    return bytes(b.build())


def produce_frame(corr: int, topic: str, batch: bytes) -> bytes:
    req = ProduceRequest[7](
        transactional_id=None, acks=-1, timeout_ms=30_000,
        topic_data=[ProduceRequest.TopicProduceData(name=topic, partition_data=[
            ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=batch)])],
    )
    return frame(0, 7, corr, bytes(req.encode(version=7)))


def test_every_answered_kafka_produce_survives_a_sigkill_right_after_its_answer(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    db = tmp_path / "gw"
    proc, tank_port, kafka_port = start_kafka_gateway(cfg, db)
    per, window, kill_after = 40, 16, 60
    with TankClient(HOST, tank_port, timeout=30) as c:
        c.create_topic("kcrash", 1)
        address = next(v["address"] for _k, v in the_map(c) if v["topic"] == "kcrash")
    answered: dict[int, int] = {}  # batch -> its base offset, as answered
    with socket.create_connection((HOST, kafka_port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = 0
        while len(answered) < kill_after:
            while sent - len(answered) < window:
                s.sendall(produce_frame(sent, "kcrash", batch_of(sent, per)))
                sent += 1
            answer = read_frame(s, 30)
            corr = struct.unpack(">i", answer[:4])[0]
            part = ProduceResponse.decode(answer[4:], version=7).responses[0].partition_responses[0]
            assert part.error_code == 0, part
            answered[corr] = part.base_offset
        # Right after an answer, with a commit and a staged transaction under way most likely.
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert sorted(answered) == list(range(kill_after))  # answered in order, one connection
    with RecordDB(db, readonly=True) as rdb:
        for i, base in answered.items():
            first, values = rdb.fetch("kcrash", address, base, per)
            assert first == base
            assert values == [b"k%d-%d" % (i, j) for j in range(per)], i
