"""A damaged stored block (bit rot, a bug of an older version: blocks are checked when they
are written, not when read) read by a Kafka client (kafka-python, a real gateway on a real
LMDB store): its partition's answer is a KAFKA_STORAGE_ERROR from the damage on, logged
(rate-limited); the records before it and the other partitions are served."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import CorruptRecordError
from kafka.protocol.consumer import ListOffsetsRequest, ListOffsetsResponse

from dafka.config import NodeConfig
from dafka.kafka.codec import Err
from dafka.kafka.gateway import KafkaGateway
from tests.kafka.test_gateway import HOST, frame, read_frame
from tests.store.test_damaged_reads import TS, plant

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def damaged_gateway(cfg: NodeConfig, path: Path, kind: str) -> KafkaGateway:
    """A gateway whose topic ``kx`` has partition 0 at offsets 0-1 healthy, 2-4 damaged, 5-6
    healthy, and partition 1 at 0-2 healthy."""
    gw = KafkaGateway(path, cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    gw.create_topic("kx", 2)
    a = [gw.pmap.get("kx", i).address for i in range(2)]
    gw.close()
    plant(path, kind, "kx", (a[0], a[1]))
    return KafkaGateway(path, cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))


def consumer(gw: KafkaGateway) -> KafkaConsumer:
    return KafkaConsumer(bootstrap_servers=f"{HOST}:{gw.kafka_port}", api_version=(2, 5), enable_auto_commit=False)


def poll_for(c: KafkaConsumer, seconds: float) -> tuple[list[tuple[int, int, bytes]], Exception | None]:
    got: list[tuple[int, int, Any]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            for tp, recs in c.poll(300).items():
                got += [(tp.partition, r.offset, r.value) for r in recs]
        except CorruptRecordError as exc:
            return got, exc
    return got, None


@pytest.mark.parametrize("kind", ["count-varint", "snappy-payload", "store-ends", "header", "store-count"])
def test_a_damaged_converted_block_costs_its_partition_from_the_damage_on(
        cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    """A block the gateway converts into a Kafka batch (a Tank bundle, the store's own).
    Before: a read reaching it after healthy blocks failed whole, so the records before the
    damage (read with it) never went: the client stayed at offset 0 on storage errors."""
    caplog.set_level(logging.ERROR)
    gw = damaged_gateway(cfg, tmp_path / "gw", kind)
    c = consumer(gw)
    try:
        tps = [TopicPartition("kx", 0), TopicPartition("kx", 1)]
        c.assign(tps)
        c.seek_to_beginning()
        got, exc = poll_for(c, 4.0)
        assert exc is None
        assert sorted(got) == [(0, 0, b"a0"), (0, 1, b"a1"), (1, 0, b"b0"), (1, 1, b"b1"), (1, 2, b"b2")]
        assert c.position(tps[0]) == 2  # at the damage: asked again and again, answered with an error
        errors = [r for r in caplog.records if r.name.startswith("dafka") and r.levelno >= logging.ERROR]
        assert errors and len(errors) <= 11, [r.getMessage() for r in errors]
        assert "cannot serve kx from offset 2" in errors[0].getMessage()
    finally:
        c.close()
        gw.close()


def test_a_damaged_kafka_batch_goes_as_stored_and_its_client_says_so(
        cfg: NodeConfig, tmp_path: Path) -> None:
    """A stored Kafka batch goes whole, not decoded (as a Kafka broker sends its log): the
    client finds the damage (its CRC-32C) after the records before it."""
    gw = damaged_gateway(cfg, tmp_path / "gw", "kafka-records")
    c = consumer(gw)
    try:
        c.assign([TopicPartition("kx", 0)])
        c.seek_to_beginning()
        got, exc = poll_for(c, 4.0)
        assert got == [(0, 0, b"a0"), (0, 1, b"a1")]
        assert isinstance(exc, CorruptRecordError) and "at offset 2" in str(exc)
    finally:
        c.close()
        gw.close()


def list_offsets_at(s: socket.socket, corr: int, ts: int) -> list[int]:
    """ListOffsets v1 of ``kx`` partitions 0 and 1 for timestamp ``ts``: their error codes."""
    part = ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition
    req = ListOffsetsRequest[1](replica_id=-1, topics=[ListOffsetsRequest.ListOffsetsTopic(
        name="kx", partitions=[part(partition_index=0, timestamp=ts), part(partition_index=1, timestamp=ts)])])
    s.sendall(frame(2, 1, corr, bytes(req.encode(version=1))))
    r = ListOffsetsResponse.decode(read_frame(s)[4:], version=1)
    return [p.error_code for p in r.topics[0].partitions]


def test_a_damaged_block_met_by_a_lookup_by_time_costs_its_partition_not_the_connection(
        cfg: NodeConfig, tmp_path: Path) -> None:
    """ListOffsets by timestamp reads records (a binary search); one in a damaged block
    raised into the request: the connection was closed as if the client had sent bad input,
    with the answers of the request's other partitions.  Now its partition alone is answered
    with KAFKA_STORAGE_ERROR."""
    gw = damaged_gateway(cfg, tmp_path / "gw", "count-varint")
    try:
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            assert list_offsets_at(s, 1, TS) == [Err.KAFKA_STORAGE_ERROR, Err.NONE]
            assert list_offsets_at(s, 2, -1) == [Err.NONE, Err.NONE]  # the connection goes on
    finally:
        gw.close()
