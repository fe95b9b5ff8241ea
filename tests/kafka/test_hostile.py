"""Hostile Kafka clients: what one connection can make the gateway hold.

Real TCP on 127.0.0.1, a real gateway with LMDB; the requests are written by
hand, as an attacker would, not by a well-behaved client library.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.producer import ProduceRequest
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.kafka.codec import Err
from dafka.kafka.gateway import KafkaGateway
from dafka.kafka.groups import Coordinator
from dafka.tank.client import TankClient
from tests.conftest import wait_until
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
    kgw.kafka.max_record_bytes = 4 << 20  # the 3 MiB record itself is allowed here
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


def test_the_coordinator_holds_a_bounded_amount_over_all_groups() -> None:
    """Member metadata was bounded per join (1 MiB) and members per group (1,000) and groups
    (10,000), but not in total: one client joining group after group with 1 MiB of metadata
    each (answered at once, kept for the session, 300 s at most, or for ever with heartbeats)
    made the gateway hold up to 10 GiB, and more with many members."""
    c = Coordinator()
    c.max_held = 4 << 20
    meta = [("range", bytes((1 << 20) - 16))]
    codes = []
    members = {}
    for i in range(10):
        a = c.join(f"t{i}", 0.0, f"g{i}", "", "evil", "consumer", meta, 300.0, 300.0)[0].fields
        codes.append(a["error_code"])
        if a["error_code"] == 0:
            members[f"g{i}"] = a["member_id"]
    assert codes.count(Err.NONE) == 3 and codes[3:] == [Err.COORDINATOR_NOT_AVAILABLE] * 7
    assert c.held <= c.max_held and len(c.groups) == 3
    # A leader's assignments count too.
    g, m = next(iter(members.items()))
    assert c.sync("s", 0.1, g, m, 1, [(m, bytes(2 << 20))])[0].fields["error_code"] == Err.COORDINATOR_NOT_AVAILABLE
    assert c.sync("s", 0.1, g, m, 1, [(m, b"p0")])[0].fields["assignment"] == b"p0"
    # What members leave (or time out) is given back.
    c.leave(0.2, g, [m])
    assert c.join("t", 0.3, "again", "", "ok", "consumer", meta, 10.0, 10.0)[0].fields["error_code"] == Err.NONE
    c.tick(400.0)
    assert c.held == 0


def test_kafka_create_topics_keeps_the_gateways_partition_limit(cfg: NodeConfig, tmp_path: Path) -> None:
    """The Tank port refuses a topic over max_partitions_per_topic; Kafka's CreateTopics took
    up to 10,000 partitions whatever the operator set."""
    from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse

    from dafka.tank.limits import GatewayLimits
    from tests.kafka.test_gateway import read_frame

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0),
                      limits=GatewayLimits(max_partitions_per_topic=8))
    try:
        def create(name: str, n: int) -> int:
            t = CreateTopicsRequest[0].CreatableTopic(
                name=name, num_partitions=n, replication_factor=-1, assignments=[], configs=[])
            req = CreateTopicsRequest[0](topics=[t], timeout_ms=5000)
            with socket.create_connection((HOST, gw.kafka_port)) as s:
                s.sendall(frame(19, 0, 1, bytes(req.encode(version=0))))
                return CreateTopicsResponse.decode(read_frame(s)[4:], version=0).topics[0].error_code

        assert create("wide", 9000) == Err.INVALID_PARTITIONS
        assert gw.pmap.partitions("wide") is None
        assert create("fits", 8) == Err.NONE and len(gw.pmap.partitions("fits") or ()) == 8
    finally:
        gw.close()


def test_auto_created_topics_stop_at_the_gateways_partition_limit(cfg: NodeConfig, tmp_path: Path) -> None:
    """Metadata auto-creates one topic per unknown name: a client naming thousands of
    topics made as many, each a line of the partition map rewritten whole."""
    from kafka.protocol.metadata import MetadataRequest

    from dafka.tank.limits import GatewayLimits

    gw = KafkaGateway(
        tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0), limits=GatewayLimits(max_owned_partitions=20)
    )
    try:
        names = [f"auto{i}" for i in range(50)]
        req = MetadataRequest[4](topics=names, allow_auto_topic_creation=True)
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            s.sendall(frame(3, 4, 1, bytes(req.encode(version=4))))
            s.settimeout(10)
            size = int.from_bytes(s.recv(4, socket.MSG_WAITALL), "big")
            assert size > 0
        created = [n for n in names if gw.pmap.partitions(n) is not None]
        assert len(created) == 20 and gw.topics_refused == 30
    finally:
        gw.close()


def fetch_frame(corr: int, topic: str, offset: int = 0, max_bytes: int = 1 << 20) -> bytes:
    from kafka.protocol.consumer import FetchRequest

    req = FetchRequest[11](
        replica_id=-1, max_wait_ms=0, min_bytes=1, max_bytes=max_bytes, isolation_level=0, session_id=0,
        session_epoch=-1, forgotten_topics_data=[], rack_id="",
        topics=[FetchRequest.FetchTopic(topic=topic, partitions=[FetchRequest.FetchTopic.FetchPartition(
            partition=0, current_leader_epoch=-1, fetch_offset=offset, log_start_offset=-1,
            partition_max_bytes=max_bytes)])],
    )
    return frame(1, 11, corr, bytes(req.encode(version=11)))


def test_clients_that_never_read_cannot_make_the_gateway_hold_more_than_its_output_budget(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    """Each connection's unsent answers were bounded (64 MiB), their sum was not: N connections
    pipelining big fetches and never reading made the gateway hold about N x 64 MiB."""
    from confluent_kafka import Consumer as CKConsumer
    from confluent_kafka import TopicPartition
    from kafka.protocol.consumer import FetchResponse

    from dafka.tank.limits import GatewayLimits
    from tests.conftest import wait_until
    from tests.kafka.test_gateway import client_batch_of, read_frame

    budget = 4 << 20
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0),
                      limits=GatewayLimits(kafka_max_output_bytes=budget))
    hogs: list[socket.socket] = []
    try:
        gw.create_topic("hog", 1)
        gw.create_topic("small", 1)
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            for i in range(8):  # 8 MiB of 1 KiB records
                r: Any = produce_raw(s, i, "hog", client_batch_of([bytes(1024)] * 1024))
                assert r.error_code == 0
            assert produce_raw(s, 99, "small", client_batch_of([b"r%d" % i for i in range(20)])).error_code == 0
        conns, fetches = 8, 24
        for _ in range(conns):
            h = socket.socket()
            h.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel holds little for it
            h.connect((HOST, gw.kafka_port))
            h.sendall(b"".join(fetch_frame(c, "hog") for c in range(fetches)))  # 1 MiB answers, never read
            hogs.append(h)
        # Every hog's requests are taken, or it is held back: the gateway holds what the budget allows.
        wait_until(lambda: gw.kafka_queued_bytes >= budget, timeout=30)
        wait_until(lambda: all(c.frames.buffered == 0 or not c.reading for c in gw._kconns.values()), timeout=30)
        # A well-behaved client is still served (its answers shrink while the budget is spent).
        c = CKConsumer({"bootstrap.servers": f"{HOST}:{gw.kafka_port}", "group.id": "good",
                        "enable.auto.commit": False})
        try:
            c.assign([TopicPartition("small", 0, 0)])
            got: list[bytes] = []
            deadline = time.monotonic() + 30
            while len(got) < 20 and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is not None and not m.error():
                    got.append(m.value())
        finally:
            c.close()
        assert got == [b"r%d" % i for i in range(20)]
        peak = gw.kafka_queued_peak
        assert peak <= budget + (256 << 10), f"held {peak} bytes of answers over a budget of {budget}"
        # Nothing was dropped or reordered: a hog that reads at last gets every answer, in order.
        h = hogs.pop()
        corrs = []
        for _ in range(fetches):
            answer = read_frame(h, 30)
            corrs.append(struct.unpack(">i", answer[:4])[0])
            p = FetchResponse.decode(answer[4:], version=11).responses[0].partitions[0]
            assert p.error_code == 0 and len(p.records) > 0
        assert corrs == list(range(fetches))
        h.close()
    finally:
        for h in hogs:
            h.close()
        gw.close()


def tiny_records_batch(n: int) -> bytes:
    """One uncompressed v2 batch of ``n`` 10-byte records, written directly (kafka-python's
    builder takes a few µs a record)."""
    import struct as st

    from crc32c import crc32c

    body = bytearray()
    for i in range(n):
        v, out = i << 1, bytearray()  # the offset delta, a zigzag varint
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
        # attributes, timestamp delta 0, offset delta, null key, value of 10, no headers
        rec = b"\x00\x00" + bytes(out) + b"\x01" + b"\x14" + b"0123456789" + b"\x00"
        body += bytes([len(rec) << 1]) + rec
    tail = st.pack(">hiqqqhii", 0, n - 1, 1000, 1000, -1, -1, -1, n) + bytes(body)
    return st.pack(">qiib", 0, len(tail) + 9, -1, 2) + st.pack(">I", crc32c(tail)) + tail


def test_a_huge_produce_of_tiny_records_is_refused_before_it_becomes_millions_of_objects(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    """A produce request was decoded whole before anything was checked: 20 MiB of 10-byte
    records became over a million record objects (about 10x the request in memory)."""
    import tracemalloc

    from kafka.protocol.producer import ProduceResponse

    from dafka.tank.limits import GatewayLimits
    from tests.kafka.test_gateway import client_batch_of, read_frame

    cap = 50_000
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0),
                      limits=GatewayLimits(kafka_max_produce_records=cap))
    try:
        gw.create_topic("tiny", 2)
        big = tiny_records_batch(1_200_000)  # ~20 MiB
        small = tiny_records_batch(cap // 2)
        req = ProduceRequest[7](
            transactional_id=None, acks=-1, timeout_ms=5000,
            topic_data=[ProduceRequest.TopicProduceData(name="tiny", partition_data=[
                ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=small),
                ProduceRequest.TopicProduceData.PartitionProduceData(index=1, records=big)])],
        )
        data = frame(0, 7, 1, bytes(req.encode(version=7)))
        tracemalloc.start()
        try:
            with socket.create_connection((HOST, gw.kafka_port)) as s:
                s.sendall(data)
                answer = read_frame(s, 60)
                peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        parts = ProduceResponse.decode(answer[4:], version=7).responses[0].partition_responses
        assert [(p.index, p.error_code) for p in parts] == [(0, Err.NONE), (1, Err.MESSAGE_TOO_LARGE)]
        # The request arrives, is framed and decoded once (~3 copies); the records within the
        # cap, ~400 bytes each at most; nothing for the refused ones.
        bound = 3 * len(data) + cap * 400
        assert peak < bound, f"peak {peak >> 20} MiB over {bound >> 20} MiB"
        # The gateway still serves: within the cap a produce is taken.
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            r: Any = produce_raw(s, 2, "tiny", client_batch_of([b"after"]))
        assert r.error_code == 0
    finally:
        gw.close()


def test_the_kafka_limits_come_from_the_gateway_table_and_flags(cfg: NodeConfig, tmp_path: Path) -> None:
    from dafka.cli import build_parser
    from dafka.tank.limits import GatewayLimits

    args = build_parser().parse_args(
        ["gateway", "--db", "x", "--kafka-max-rebalance-timeout", "60", "--kafka-max-produce-records", "1000"]
    )
    limits = GatewayLimits.from_settings({"kafka_max_rebalance_timeout": 90, "kafka_max_output_bytes": 1 << 20}, args)
    assert (limits.kafka_max_rebalance_timeout, limits.kafka_max_produce_records, limits.kafka_max_output_bytes) == (
        60.0, 1000, 1 << 20)
    assert GatewayLimits.from_settings({"kafka_max_rebalance_timeout": 90}).kafka_max_rebalance_timeout == 90.0
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0), limits=limits)
    try:
        assert gw.kafka.coordinator.max_rebalance_timeout == 60.0
        assert gw.kafka.max_records == 1000
    finally:
        gw.close()


def test_a_client_that_leaves_its_answers_unread_is_closed_after_the_timeout(cfg: NodeConfig, tmp_path: Path) -> None:
    """Answers a client never read were held for as long as it stayed connected: a few such
    clients kept the gateway's output budget spent, every other client's fetches shrunk to one
    record, for ever.  As on the Tank port, answers untaken for request_timeout close it."""
    from dafka.tank.limits import GatewayLimits
    from tests.conftest import wait_until
    from tests.kafka.test_gateway import client_batch_of

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0),
                      limits=GatewayLimits(request_timeout=0.5))
    try:
        gw.create_topic("hog", 1)
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            for i in range(4):
                assert produce_raw(s, i, "hog", client_batch_of([bytes(1024)] * 1024)).error_code == 0
        h = socket.socket()
        h.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        h.connect((HOST, gw.kafka_port))
        try:
            h.sendall(b"".join(fetch_frame(c, "hog") for c in range(8)))
            wait_until(lambda: gw.kafka_queued_bytes > 0)
            wait_until(lambda: gw.kafka_connections == 0, timeout=15)
            assert gw.kafka_queued_bytes == 0
        finally:
            h.close()
        # A client that reads is served as before.
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            assert produce_raw(s, 9, "hog", client_batch_of([b"x"])).error_code == 0
    finally:
        gw.close()


def parked_fetch_frame(corr: int, parts: list[tuple[str, int]], min_bytes: int, max_wait_ms: int = 60_000,
                       max_bytes: int = 1 << 20) -> bytes:
    from kafka.protocol.consumer import FetchRequest

    req = FetchRequest[11](
        replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=min_bytes, max_bytes=max_bytes, isolation_level=0,
        session_id=0, session_epoch=-1, forgotten_topics_data=[], rack_id="",
        topics=[FetchRequest.FetchTopic(topic=topic, partitions=[FetchRequest.FetchTopic.FetchPartition(
            partition=0, current_leader_epoch=-1, fetch_offset=offset, log_start_offset=-1,
            partition_max_bytes=max_bytes)]) for topic, offset in parts],
    )
    return frame(1, 11, corr, bytes(req.encode(version=11)))


def test_parked_fetches_that_cannot_reach_min_bytes_do_not_read_the_store_again_at_every_commit(
    kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch waits (parks) while its answer holds fewer than min_bytes; each commit to a
    partition it waits on retried it by building its whole answer again.  Before the fix a
    client parking fetches with a min_bytes they can never reach, naming a partition with a
    backlog (1 MiB read, converted and thrown away each time) and one a tiny produce can
    wake, made every such produce cost the gateway 200 answers: 4 ms a produce became
    330 ms, all clients stalled.  Now a retry looks at how many bytes came since (partition
    metadata) and builds the answer only when they can make min_bytes, as Kafka's broker
    does; the answer goes then, or at max_wait."""
    from tests.kafka.test_gateway import read_frame

    kgw.create_topic("idle", 1)
    kgw.create_topic("backlog", 1)
    with TankClient(HOST, kgw.tank_port) as t:
        t.produce("backlog", 0, [b"b%05d" % i + b"z" * 50 for i in range(20_000)])
        t.produce("idle", 0, [b"x"])
    reads: list[int] = []
    fetch_batches = kgw.fetch_batches

    def counted(*args: Any, **kw: Any) -> Any:
        reads.append(args[2])
        return fetch_batches(*args, **kw)

    monkeypatch.setattr(kgw, "fetch_batches", counted)
    n = 50
    with socket.create_connection((HOST, kgw.kafka_port)) as hog, socket.create_connection(
        (HOST, kgw.kafka_port)
    ) as s, TankClient(HOST, kgw.tank_port) as t:
        for i in range(n):
            hog.sendall(parked_fetch_frame(i, [("idle", 1), ("backlog", 0)], min_bytes=2**31 - 1))
        wait_until(lambda: len(kgw._kparked) == n, 20)
        before = len(reads)
        for _ in range(10):
            t.produce("idle", 0, [b"y"])
        # A legitimate long poll on the same partition is answered as soon as a record comes,
        # even one of no bytes; one with min_bytes when enough bytes came.
        s.sendall(parked_fetch_frame(100, [("idle", 11)], min_bytes=1))
        wait_until(lambda: len(kgw._kparked) == n + 1, 20)
        t.produce("idle", 0, [b""])
        assert read_frame(s)[:4] == (100).to_bytes(4, "big")
        s.sendall(parked_fetch_frame(101, [("idle", 12)], min_bytes=3000))
        wait_until(lambda: len(kgw._kparked) == n + 1, 20)
        t.produce("idle", 0, [b"w" * 1000])
        t.produce("idle", 0, [b"w" * 1000])
        assert len(kgw._kparked) == n + 1  # not enough yet
        t.produce("idle", 0, [b"w" * 1000])
        assert read_frame(s)[:4] == (101).to_bytes(4, "big")
    assert len(reads) - before < n  # before: 10 produces x 50 parked fetches read the backlog again


def test_a_parked_fetch_is_answered_when_records_come_after_delete_records_shrank_its_partition(
    kgw: KafkaGateway,
) -> None:
    """A parked fetch counts the bytes its partition stored since it parked (partition
    metadata).  DeleteRecords (or retention, or compaction) lowering those bytes while it
    waited hid what came next: before the fix, 10 KB produced after a DeleteRecords of
    200 KB left a fetch with min_bytes 5000 parked until its max_wait (30 s)."""
    from tests.kafka.test_admin import delete_records
    from tests.kafka.test_gateway import read_frame

    kgw.create_topic("shrink", 1)
    with TankClient(HOST, kgw.tank_port) as t, socket.create_connection((HOST, kgw.kafka_port)) as s:
        for _ in range(4):
            t.produce("shrink", 0, [b"o" * 1000] * 50)
        s.sendall(parked_fetch_frame(7, [("shrink", 200)], min_bytes=5000, max_wait_ms=30_000))
        wait_until(lambda: len(kgw._kparked) == 1, 20)
        assert delete_records(kgw.kafka_port, "shrink", 200) == (Err.NONE, 200)
        t.produce("shrink", 0, [b"n" * 1000] * 10)
        started = time.monotonic()
        answer = read_frame(s, timeout=10)
        assert answer[:4] == (7).to_bytes(4, "big")
        assert time.monotonic() - started < 5  # before: at max_wait
        assert answer.count(b"n" * 1000) == 10


def test_a_parked_tank_consume_is_answered_when_messages_come_after_delete_records_shrank_its_partition(
    kgw: KafkaGateway,
) -> None:
    """The Tank side of the same estimate: a consume parked at the tail with min_bytes 5000
    waited to its max_wait (30 s) for 10 KB produced after a DeleteRecords of 200 KB."""
    from dafka.tank.messages import ConsumeResponse, MsgId
    from tests.kafka.test_admin import delete_records
    from tests.tank.test_gateway import connect_raw, consume_frame, recv_frame

    kgw.create_topic("tshrink", 1)
    with TankClient(HOST, kgw.tank_port) as t:
        for _ in range(4):
            t.produce("tshrink", 0, [b"o" * 1000] * 50)
        s = connect_raw(kgw.tank_port)
        try:
            s.sendall(consume_frame(7, "tshrink", 0, 201, max_wait_ms=30_000, min_bytes=5000))
            wait_until(lambda: len(kgw._parked_all) == 1, 20)
            assert delete_records(kgw.kafka_port, "tshrink", 200) == (Err.NONE, 200)
            t.produce("tshrink", 0, [b"n" * 1000] * 10)
            started = time.monotonic()
            s.settimeout(10)
            msg_id, payload = recv_frame(s)
            assert time.monotonic() - started < 5  # before: at max_wait
            p = ConsumeResponse.decode(payload).topics[0].partitions[0]
            assert msg_id == MsgId.CONSUME and [bytes(m[3]) for m in p.decode_chunk().records] == [b"n" * 1000] * 10
        finally:
            s.close()


def test_a_parked_fetch_counts_what_a_snappy_tank_bundle_holds_not_its_stored_bytes(kgw: KafkaGateway) -> None:
    """A Tank producer's snappy bundle stores a fraction of the bytes a Kafka fetch answers
    with (its records, converted).  A fetch parked with min_bytes 20,000 for a bundle of
    1,000 messages of 100 bytes (about 100 KB answered, 5 KB stored)."""
    from dafka.tank.bundle import CODEC_SNAPPY
    from tests.kafka.test_gateway import read_frame

    kgw.create_topic("squeezed", 1)
    with TankClient(HOST, kgw.tank_port) as t, socket.create_connection((HOST, kgw.kafka_port)) as s:
        t.produce("squeezed", 0, [b"first"])
        s.sendall(parked_fetch_frame(8, [("squeezed", 1)], min_bytes=20_000, max_wait_ms=30_000))
        wait_until(lambda: len(kgw._kparked) == 1, 20)
        t.produce("squeezed", 0, [b"%03d" % (i % 1000) + b"s" * 97 for i in range(1000)], codec=CODEC_SNAPPY)
        assert kgw.db.info("squeezed", kgw.pmap.get("squeezed", 0).address).bytes < 20_000
        started = time.monotonic()
        answer = read_frame(s, timeout=10)
        assert answer[:4] == (8).to_bytes(4, "big") and len(answer) > 20_000
        assert time.monotonic() - started < 5  # before: at max_wait


def test_a_parked_tank_consume_counts_what_a_gzip_kafka_batch_holds_not_its_stored_bytes(kgw: KafkaGateway) -> None:
    """The other way round: a Kafka producer's gzip batch is re-encoded for a Tank answer,
    its stored bytes a fraction of the chunk.  A consume parked with min_bytes 20,000 for a
    batch of 50 KB of records that gzip stores in well under 20,000 bytes."""
    from dafka.tank.messages import ConsumeResponse, MsgId
    from tests.kafka.test_gateway import client_batch_of
    from tests.tank.test_gateway import connect_raw, consume_frame, recv_frame

    kgw.create_topic("gzipped", 1)
    s = connect_raw(kgw.tank_port)
    try:
        with socket.create_connection((HOST, kgw.kafka_port)) as k:
            assert produce_raw(k, 1, "gzipped", client_batch_of([b"first"])).error_code == 0
            s.sendall(consume_frame(9, "gzipped", 0, 2, max_wait_ms=30_000, min_bytes=20_000))
            wait_until(lambda: len(kgw._parked_all) == 1, 20)
            assert produce_raw(k, 2, "gzipped", gzip_batch(b"g" * 50_000)).error_code == 0
        assert kgw.db.info("gzipped", kgw.pmap.get("gzipped", 0).address).bytes < 20_000
        started = time.monotonic()
        s.settimeout(10)
        msg_id, payload = recv_frame(s)
        assert time.monotonic() - started < 5  # before: at max_wait
        p = ConsumeResponse.decode(payload).topics[0].partitions[0]
        assert msg_id == MsgId.CONSUME and [bytes(m[3]) for m in p.decode_chunk().records] == [b"g" * 50_000]
    finally:
        s.close()


def test_a_fetch_parked_while_the_output_budget_was_spent_is_answered_once_enough_comes(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    """A parked fetch's limit on each partition it waits on was the answer's budget when it
    parked, the gateway's output room included: parked while other clients' unread answers
    held the whole budget, each limit was 1 byte, so no produce could make its min_bytes
    (4,000 here) and it waited to max_wait (30 s) though the room came back and 5 KB came."""
    from dafka.tank.limits import GatewayLimits
    from tests.kafka.test_gateway import client_batch_of, read_frame

    budget = 64 << 10
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0),
                      limits=GatewayLimits(kafka_max_output_bytes=budget))
    try:
        gw.create_topic("hog", 1)
        gw.create_topic("tail", 1)
        with socket.create_connection((HOST, gw.kafka_port)) as k:
            assert produce_raw(k, 1, "hog", client_batch_of([bytes(1024)] * 1024)).error_code == 0
            assert produce_raw(k, 2, "tail", client_batch_of([b"first"])).error_code == 0
        hog = socket.socket()
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect((HOST, gw.kafka_port))
        hog.sendall(b"".join(parked_fetch_frame(c, [("hog", 0)], min_bytes=1) for c in range(200)))
        wait_until(lambda: gw.kafka_queued_bytes >= budget - 1024, timeout=30)
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            s.sendall(parked_fetch_frame(5, [("tail", 1)], min_bytes=4000, max_wait_ms=30_000))
            wait_until(lambda: len(gw._kparked) == 1, 20)
            hog.close()
            wait_until(lambda: gw.kafka_queued_bytes == 0, timeout=30)
            with socket.create_connection((HOST, gw.kafka_port)) as k:
                assert produce_raw(k, 3, "tail", client_batch_of([b"t" * 1000] * 5)).error_code == 0
            started = time.monotonic()
            answer = read_frame(s, timeout=10)
            assert answer[:4] == (5).to_bytes(4, "big") and answer.count(b"t" * 1000) == 5
            assert time.monotonic() - started < 5  # before: at max_wait
    finally:
        gw.close()
