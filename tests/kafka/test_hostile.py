"""Hostile Kafka clients: what one connection can make the gateway hold.

Real TCP on 127.0.0.1, a real gateway with LMDB; the requests are written by
hand, as an attacker would, not by a well-behaved client library.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.producer import ProduceRequest
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.kafka.gateway import KafkaGateway
from tests.kafka.test_gateway import HOST, closed, frame, produce_raw

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def kgw(cfg: NodeConfig, tmp_path: Path) -> Iterator[KafkaGateway]:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    yield gw
    gw.close()


def gzip_batch(value: bytes) -> bytes:
    b = DefaultRecordBatchBuilder(2, 1, False, -1, -1, -1, len(value) + 1024)
    b.append(0, 1000, None, value, [])
    return bytes(b.build())


def test_one_produce_request_cannot_inflate_past_its_budget_over_many_partition_entries(kgw: KafkaGateway) -> None:
    """Each partition entry of a produce request had a decompression budget of its own (64 MiB),
    and all of them are decoded before anything is written: one small request naming the same
    partition many times, each with a gzip bomb, made the gateway hold all of them at once."""
    kgw.create_topic("bomb", 1)
    kgw.kafka.max_inflated = 8 << 20
    bomb = gzip_batch(bytes(3 << 20))
    assert len(bomb) < 64 << 10
    req = ProduceRequest[7](
        transactional_id=None, acks=-1, timeout_ms=5000,
        topic_data=[ProduceRequest.TopicProduceData(name="bomb", partition_data=[
            ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=bomb) for _ in range(4)])],
    )
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        s.sendall(frame(0, 7, 1, bytes(req.encode(version=7))))
        assert closed(s), "a request inflating 12 MiB over a budget of 8 MiB was taken"
    assert kgw.head("bomb", kgw.pmap.get("bomb", 0).address) is None
    # Within the budget, the same batch is taken; the gateway still serves.
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        r: Any = produce_raw(s, 2, "bomb", bomb)
    assert (r.error_code, r.base_offset) == (0, 0)
