"""Hostile and broken input on the Kafka port (issue 35, items 1-8).

Real TCP on 127.0.0.1, real gateways with LMDB, real mesh peers where the
item is about the mesh; requests written by hand, as an attacker would.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse
from kafka.protocol.consumer import FetchResponse, ListOffsetsRequest, ListOffsetsResponse
from kafka.protocol.metadata import MetadataRequest, MetadataResponse
from kafka.protocol.producer import InitProducerIdRequest, InitProducerIdResponse
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.kafka.codec import Err
from dafka.kafka.gateway import KafkaGateway
from dafka.kafka.groups import Coordinator
from dafka.store.db import RecordDB
from dafka.tank.limits import GatewayLimits
from dafka.tank.mapping import FILE_NAME, PartitionMap
from tests.conftest import wait_until
from tests.kafka.test_gateway import HOST, frame, produce_raw, read_frame
from tests.kafka.test_hostile import fetch_frame

JOURNAL_SUFFIX = ".journal"  # dafka.tank.mapping.JOURNAL_SUFFIX (literal: the test runs against old code too)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def make_kgw(cfg: NodeConfig, tmp_path: Path) -> Iterator[Any]:
    made: list[KafkaGateway] = []

    def make(name: str = "gw", config: NodeConfig | None = None, **options: Any) -> KafkaGateway:
        options.setdefault("kafka_listen", (HOST, 0))
        gw = KafkaGateway(tmp_path / name, config or cfg, listen=(HOST, 0), **options)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.close()


def metadata(port: int, names: list[str] | None, version: int = 8, auto: bool = True) -> tuple[int, Any]:
    """(answer bytes, decoded answer) of one Metadata request."""
    fields: dict[str, Any] = {"topics": names, "allow_auto_topic_creation": auto}
    if version >= 8:
        fields.update(include_cluster_authorized_operations=False, include_topic_authorized_operations=False)
    req = MetadataRequest[version](**fields)
    with socket.create_connection((HOST, port)) as s:
        s.sendall(frame(3, version, 1, bytes(req.encode(version=version))))
        answer = read_frame(s, 30)
    return len(answer), MetadataResponse.decode(answer[4:], version=version)


def create_topics(port: int, names: list[str], n: int = 1) -> list[int]:
    topics = [CreateTopicsRequest[0].CreatableTopic(name=t, num_partitions=n, replication_factor=-1, assignments=[],
                                                    configs=[]) for t in names]
    req = CreateTopicsRequest[0](topics=topics, timeout_ms=5000)
    with socket.create_connection((HOST, port)) as s:
        s.sendall(frame(19, 0, 1, bytes(req.encode(version=0))))
        r = CreateTopicsResponse.decode(read_frame(s)[4:], version=0)
    return [t.error_code for t in r.topics]


# ---------------------------------------------------------------- 1. Metadata amplification


def test_a_metadata_request_naming_one_topic_thousands_of_times_gets_it_once(make_kgw: Any) -> None:
    """One Metadata v8 request naming a 1,024-partition topic 3,000 times (24 KB) built a
    104.5 MB answer (the gateway went from 60 to 1,744 MB)."""
    gw = make_kgw()
    gw.create_topic("wide", 256)
    size, r = metadata(gw.kafka_port, ["wide"] * 1000)
    assert [(t.name, len(t.partitions)) for t in r.topics] == [("wide", 256)]
    assert size < 64 << 10, size


def test_a_metadata_answer_stops_at_its_byte_budget(make_kgw: Any) -> None:
    gw = make_kgw(limits=GatewayLimits(kafka_max_metadata_bytes=4096))
    for i in range(10):
        gw.create_topic(f"t{i}", 16)  # about 700 bytes each
    size, r = metadata(gw.kafka_port, None)
    served = [t.name for t in r.topics if t.error_code == 0]
    cut = [t for t in r.topics if t.error_code == Err.POLICY_VIOLATION]
    assert 0 < len(served) < 10 and len(served) + len(cut) == 10
    assert all(not t.partitions for t in cut)
    assert size <= 4096 + 10 * 64, size
    # Named alone, a topic that was cut is served.
    _, r = metadata(gw.kafka_port, [cut[0].name])
    assert r.topics[0].error_code == 0 and len(r.topics[0].partitions) == 16


# ---------------------------------------------------------------- 2. topic creation


def test_creating_a_topic_costs_the_same_however_many_there_are(make_kgw: Any, cfg: NodeConfig,
                                                                 tmp_path: Path) -> None:
    """Every created topic rewrote and fsynced the whole tank-partitions.json: 4,000 topics in
    one Metadata request stalled every client for 57 s.  A new topic is a journal line."""
    gw = make_kgw()
    path = os.path.join(gw.db.path, FILE_NAME)
    for i in range(300):
        assert gw.create_topic(f"c{i}", 1)
    before = os.stat(path)
    journal = path + JOURNAL_SUFFIX
    grown = os.path.getsize(journal)
    assert gw.create_topic("one-more", 2)
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert 0 < os.path.getsize(journal) - grown < 400  # two lines, whatever came before
    ids = {p.address: p.pid for p in gw.pmap.order}
    gw.close()
    # A crash in the middle of a line: that line (never acknowledged) is left out, the rest kept.
    with open(journal, "a", encoding="utf-8") as f:
        f.write('{"topic": "torn", "id": 0, "addr')
    again = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        assert {p.address: p.pid for p in again.pmap.order} == ids
        assert len(again.pmap.partitions("one-more") or ()) == 2 and again.pmap.partitions("torn") is None
        # At start the journal is folded into the map.
        assert not os.path.exists(journal)
        assert len(PartitionMap.load(path)) == len(ids)
    finally:
        again.close()


def test_a_crash_between_writing_the_map_and_dropping_the_journal_loses_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / FILE_NAME)
    pmap = PartitionMap()
    pmap.create_topic("a", 2, iter(["A0", "A1"]).__next__)
    pmap.sync(path)
    pmap.add("a", "MESH")
    pmap.sync(path)
    journal = Path(path + JOURNAL_SUFFIX).read_text()
    pmap.save(path)
    Path(path + JOURNAL_SUFFIX).write_text(journal)  # as if the unlink never happened
    assert [(p.topic, p.pid, p.address) for p in PartitionMap.load(path).order] == [
        ("a", 0, "A0"), ("a", 1, "A1"), ("a", 2, "MESH")]


def test_one_request_creates_a_bounded_number_of_topics(make_kgw: Any) -> None:
    gw = make_kgw(limits=GatewayLimits(kafka_max_created_topics=10))
    names = [f"auto{i}" for i in range(30)]
    _, r = metadata(gw.kafka_port, names, version=4)
    codes = [t.error_code for t in r.topics]
    assert codes == [Err.NONE] * 10 + [Err.LEADER_NOT_AVAILABLE] * 20
    _, r = metadata(gw.kafka_port, names, version=4)  # the client asks again: ten more
    assert [t.error_code for t in r.topics].count(Err.NONE) == 20
    codes = create_topics(gw.kafka_port, [f"made{i}" for i in range(12)])
    assert codes == [Err.NONE] * 10 + [Err.THROTTLING_QUOTA_EXCEEDED] * 2
    assert gw.pmap.partitions("made10") is None


def test_the_topics_one_request_creates_cost_one_fsync(make_kgw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each auto-created topic was made durable on its own: 100 topics in one request were 100
    fsyncs (about 0.2 s here) while every client waited.  They are made durable together,
    before the answer goes out."""
    gw = make_kgw()
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
    _, r = metadata(gw.kafka_port, [f"many{i}" for i in range(50)])
    assert [t.error_code for t in r.topics] == [Err.NONE] * 50
    assert 1 <= len(calls) <= 2, len(calls)  # the journal (and its directory when new)
    calls.clear()
    assert create_topics(gw.kafka_port, [f"more{i}" for i in range(20)]) == [Err.NONE] * 20
    assert len(calls) == 1
    assert len(PartitionMap.load(os.path.join(gw.db.path, FILE_NAME))) == 70


# ---------------------------------------------------------------- 3. max_record_bytes


def test_a_record_over_max_record_bytes_is_refused_on_the_kafka_port(make_kgw: Any, cfg: NodeConfig) -> None:
    """A 3 MiB record was stored and served to Kafka readers while the mesh dropped it: a
    replica's connection was cut again and again, and it kept a permanent hole."""
    gw = make_kgw(config=dataclasses.replace(cfg, max_record_bytes=1000))
    gw.create_topic("big", 1)
    address = gw.pmap.get("big", 0).address

    def batch(values: list[bytes], codec: int = 0) -> bytes:
        b = DefaultRecordBatchBuilder(2, codec, False, -1, -1, -1, 1 << 20)
        for i, v in enumerate(values):
            b.append(i, 1000, None, v, [])
        return bytes(b.build())

    with socket.create_connection((HOST, gw.kafka_port)) as s:
        assert produce_raw(s, 1, "big", batch([bytes(1001)])).error_code == Err.MESSAGE_TOO_LARGE
        assert produce_raw(s, 2, "big", batch([bytes(4000)], codec=1)).error_code == Err.MESSAGE_TOO_LARGE
        # Records at the limit pass, however big their batch.
        r = produce_raw(s, 3, "big", batch([bytes(1000)] * 5))
        assert (r.error_code, r.base_offset) == (Err.NONE, 0)
    assert gw.head("big", address) == 4 and gw.kafka.records_too_large == 2


# ---------------------------------------------------------------- 4. data kept as sent


def test_timestamp_zero_is_a_timestamp(make_kgw: Any) -> None:
    """Only a negative timestamp means none: 0 comes back as 0 (first records and later ones)."""
    gw = make_kgw()
    gw.create_topic("ts", 1)
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    b.append(0, 0, None, b"zero", [])
    b.append(1, 0, b"k", b"zero with key", [])
    batch = bytes(b.build())
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        assert produce_raw(s, 1, "ts", batch).error_code == 0
        assert produce_raw(s, 2, "ts", batch).error_code == 0
        s.sendall(fetch_frame(3, "ts"))
        records = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0].records
    got = [(r.offset, r.timestamp, r.value) for rb in MemoryRecords(records) for r in rb]
    assert got == [(0, 0, b"zero"), (1, 0, b"zero with key"), (2, 0, b"zero"), (3, 0, b"zero with key")]


def test_a_null_value_comes_back_null_and_an_empty_one_empty(make_kgw: Any) -> None:
    """A Kafka tombstone (null value) came back as b"": compacting consumers could not tell a
    delete from an empty record.  Through both write paths (a partition's first records, and
    the ready LMDB pairs of later ones), with and without key and headers."""
    gw = make_kgw()
    gw.create_topic("tomb", 1)
    address = gw.pmap.get("tomb", 0).address
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    b.append(0, 1000, None, None, [])
    b.append(1, 1000, b"k", None, [])
    b.append(2, 1000, b"k", None, [("h", b"v")])
    b.append(3, 1000, None, b"", [])
    b.append(4, 1000, b"k", b"", [])
    batch = bytes(b.build())
    want = [(None, None), (b"k", None), (b"k", None), (None, b""), (b"k", b"")]
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        assert produce_raw(s, 1, "tomb", batch).error_code == 0
        wait_until(lambda: gw.head("tomb", address) == 4)
        assert produce_raw(s, 2, "tomb", batch).error_code == 0
        wait_until(lambda: gw.head("tomb", address) == 9)
        s.sendall(fetch_frame(3, "tomb"))
        records = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0].records
    got = [(r.key, r.value) for rb in MemoryRecords(records) for r in rb]
    assert got == want + want
    # Readers that do not know the flag (the mesh, Tank, Dafka consumers) see empty contents.
    assert gw.db.fetch("tomb", address, 0, 10)[1] == [b""] * 10


def test_real_clients_see_tombstones(make_kgw: Any) -> None:
    from tests.kafka.test_gateway import ck_consume, ck_produce

    gw = make_kgw()
    assert ck_produce(gw, "ck", [(b"a", b"1", None), (b"a", None, None), (None, b"", [("h", b"x")])]) == [
        (0, 0), (0, 1), (0, 2)]
    got = ck_consume(gw, ["ck"], 3)
    assert [(m.key(), m.value()) for m in got] == [(b"a", b"1"), (b"a", None), (None, b"")]


# ---------------------------------------------------------------- 5. idempotence


def init_pid(s: socket.socket, corr: int) -> tuple[int, int]:
    req = InitProducerIdRequest[0](transactional_id=None, transaction_timeout_ms=60000)
    s.sendall(frame(22, 0, corr, bytes(req.encode(version=0))))
    r = InitProducerIdResponse.decode(read_frame(s)[4:], version=0)
    assert r.error_code == 0
    return r.producer_id, r.producer_epoch


def idem_batch(pid: int, epoch: int, seq: int, n: int, tag: bytes = b"s") -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, False, pid, epoch, seq, 1 << 20)
    for i in range(n):
        b.append(i, 1000, None, tag + b"%d" % (seq + i), [])
    return bytes(b.build())


def test_producer_ids_are_not_guessable(make_kgw: Any) -> None:
    """Ids were the start time in ms, shifted, plus a counter: the next one was known."""
    gw = make_kgw()
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        ids = [init_pid(s, i)[0] for i in range(4)]
    assert all(0 <= i < 1 << 63 for i in ids) and len(set(ids)) == 4
    assert all(abs(a - b) > 1 << 32 for a, b in zip(ids, ids[1:], strict=False)), ids


def test_a_higher_epoch_starts_over_and_a_lower_one_is_fenced(make_kgw: Any) -> None:
    """A batch with the same producer id, a higher epoch and sequence 0 was answered success
    at the old batch's offsets, and its data was not stored (silent loss)."""
    gw = make_kgw()
    gw.create_topic("ep", 1)
    address = gw.pmap.get("ep", 0).address
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        pid, epoch = init_pid(s, 1)
        assert (produce_raw(s, 2, "ep", idem_batch(pid, epoch, 0, 3)).base_offset) == 0
        r = produce_raw(s, 3, "ep", idem_batch(pid, epoch + 1, 0, 3, b"new"))
        assert (r.error_code, r.base_offset) == (Err.NONE, 3)
        again = produce_raw(s, 4, "ep", idem_batch(pid, epoch + 1, 0, 3, b"new"))  # its retry
        assert (again.error_code, again.base_offset) == (Err.NONE, 3)
        assert produce_raw(s, 5, "ep", idem_batch(pid, epoch, 3, 1)).error_code == Err.INVALID_PRODUCER_EPOCH
        assert produce_raw(s, 6, "ep", idem_batch(pid, epoch + 2, 5, 1)).error_code == (
            Err.OUT_OF_ORDER_SEQUENCE_NUMBER)
    wait_until(lambda: gw.head("ep", address) == 5)
    assert gw.db.fetch("ep", address, 0, 10)[1] == [b"s0", b"s1", b"s2", b"new0", b"new1", b"new2"]


def test_a_forgotten_or_made_up_producer_is_told_so_never_stored_twice(make_kgw: Any) -> None:
    """Made-up ids filled the LRU and evicted a real producer's state: its retry was stored twice."""
    gw = make_kgw()
    gw.kafka.max_producers = 3
    gw.kafka.max_adopted = 2
    gw.create_topic("lru", 1)
    address = gw.pmap.get("lru", 0).address
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        pid, epoch = init_pid(s, 1)
        assert produce_raw(s, 2, "lru", idem_batch(pid, epoch, 0, 2)).error_code == 0
        for i in range(5):  # made-up ids are taken (as after a restart), in a pool of their own
            assert produce_raw(s, 3 + i, "lru", idem_batch(pid ^ (i + 1), 0, 0, 1)).error_code == 0
        retry = produce_raw(s, 9, "lru", idem_batch(pid, epoch, 0, 2))
        assert (retry.error_code, retry.base_offset) == (Err.NONE, 0)  # still known: not stored again
        for i in range(3):  # ids given out take every place
            init_pid(s, 10 + i)
        retry = produce_raw(s, 20, "lru", idem_batch(pid, epoch, 0, 2))
        assert retry.error_code == Err.UNKNOWN_PRODUCER_ID  # forgotten: refused, not stored unchecked
    wait_until(lambda: gw.head("lru", address) == 6)
    time.sleep(0.2)  # nothing more comes
    assert gw.head("lru", address) == 6 and gw.kafka.producers_forgotten == 1


def test_idempotent_producers_go_on_after_a_gateway_restart(make_kgw: Any, cfg: NodeConfig, tmp_path: Path) -> None:
    """kafka-python 3 (idempotent by default) is stuck for good after UNKNOWN_PRODUCER_ID or
    OUT_OF_ORDER_SEQUENCE_NUMBER: ids from before a restart must be taken."""
    from kafka import KafkaProducer

    gw = make_kgw()
    port = gw.kafka_port
    gw.create_topic("rs", 1)
    p = KafkaProducer(bootstrap_servers=f"{HOST}:{port}", enable_idempotence=True, acks="all",
                      reconnect_backoff_ms=50)
    try:
        assert p.send("rs", b"a").get(10).offset == 0
        gw.close()
        gw = make_kgw(kafka_listen=(HOST, port))
        assert p.send("rs", b"b").get(30).offset == 1
        assert p.send("rs", b"c").get(10).offset == 2
    finally:
        p.close(5)


# ---------------------------------------------------------------- 6. offsets past 2^63


def list_offsets(s: socket.socket, corr: int, topics: list[str]) -> list[int]:
    req = ListOffsetsRequest[1](replica_id=-1, topics=[
        ListOffsetsRequest.ListOffsetsTopic(name=t, partitions=[
            ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(partition_index=0, timestamp=-1)])
        for t in topics])
    s.sendall(frame(2, 1, corr, bytes(req.encode(version=1))))
    r = ListOffsetsResponse.decode(read_frame(s)[4:], version=1)
    return [t.partitions[0].error_code for t in r.topics]


def test_a_partition_stored_past_2_63_answers_an_error_not_a_traceback(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain-mesh peer announcing offsets past 2^63 made every ListOffsets/Fetch of that
    partition fail (struct.error, connection closed, a traceback per request).  Such a
    partition stored by an older version is answered KAFKA_STORAGE_ERROR; the others serve."""
    db = RecordDB(tmp_path / "gw")
    db.append([("bad", "PEER", (1 << 63) + 5, b"x", 1000), ("good", "PEER2", 0, b"y", 1000)])
    db.close()
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        with caplog.at_level(logging.WARNING, "dafka"), socket.create_connection((HOST, gw.kafka_port)) as s:
            for i in range(30):
                assert list_offsets(s, i, ["bad", "good"]) == [Err.KAFKA_STORAGE_ERROR, Err.NONE]
            s.sendall(fetch_frame(99, "bad"))
            p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
            assert p.error_code == Err.KAFKA_STORAGE_ERROR
            s.sendall(fetch_frame(100, "good"))
            assert FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0].error_code == 0
        assert not [r for r in caplog.records if r.exc_info]
        assert len([r for r in caplog.records if "past 2^63" in r.getMessage()]) <= 10
    finally:
        gw.close()


def test_a_mesh_peer_announcing_offsets_past_2_63_is_refused_where_they_enter(
    make_kgw: Any, raw_peer: Any
) -> None:
    gw = make_kgw()
    peer = raw_peer([])
    peer.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
    peer.send(wire.Head("evil", peer.address, "evil", (1 << 63) + 7))
    peer.send(wire.Record("evil", peer.address, "evil", (1 << 64) - 1, b"x"))
    peer.send(wire.Record("fine", peer.address, "fine", 0, b"ok"))
    wait_until(lambda: peer.pump(0.01) or gw.head("fine", peer.address) == 0)
    assert gw.head("evil", peer.address) is None and gw.pmap.partitions("evil") is None
    assert gw.bad_input.count >= 2


def test_list_offsets_by_time_over_a_timestamp_past_2_63_answers(cfg: NodeConfig, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Stored timestamps are u64 (a Tank client may give any): ListOffsets by time answered the
    one it found as Kafka's int64, and every such request failed with a traceback."""
    db = RecordDB(tmp_path / "gw")
    db.append([("huge", "PEER", 0, b"x", (1 << 64) - 1)])
    db.close()
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        req = ListOffsetsRequest[1](replica_id=-1, topics=[
            ListOffsetsRequest.ListOffsetsTopic(name="huge", partitions=[
                ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(partition_index=0, timestamp=5)])])
        with caplog.at_level(logging.WARNING, "dafka"), socket.create_connection((HOST, gw.kafka_port)) as s:
            for corr in range(3):
                s.sendall(frame(2, 1, corr, bytes(req.encode(version=1))))
                p = ListOffsetsResponse.decode(read_frame(s)[4:], version=1).topics[0].partitions[0]
                assert p.error_code == 0
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        gw.close()


def test_an_answer_that_cannot_be_encoded_logs_its_traceback_at_a_bounded_rate(
    make_kgw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever else an answer cannot carry closes its connection: with one traceback logged per
    request, a client asking again and again filled the log (368 tracebacks in 40 s)."""
    gw = make_kgw()
    gw.create_topic("t", 1)

    def broken(*args: Any) -> Any:
        raise RuntimeError("cannot encode")

    from dafka.kafka import serving

    old = serving._HANDLERS[2]
    serving._HANDLERS[2] = broken
    try:
        with caplog.at_level(logging.WARNING, "dafka"):
            for i in range(40):
                with socket.create_connection((HOST, gw.kafka_port)) as s:
                    s.sendall(frame(2, 1, i, bytes(ListOffsetsRequest[1](replica_id=-1, topics=[]).encode(version=1))))
                    with pytest.raises(ConnectionError):
                        read_frame(s)
        assert 1 <= len([r for r in caplog.records if r.exc_info]) <= 10
    finally:
        serving._HANDLERS[2] = old


# ---------------------------------------------------------------- 7. names and logs


@pytest.mark.parametrize("name", ["a\nINFO forged line", ".", "..", "x" * 250, "sp ace", "tab\t", "ünï", ""])
def test_kafka_topic_names_follow_kafkas_rules(make_kgw: Any, name: str) -> None:
    gw = make_kgw()
    _, r = metadata(gw.kafka_port, [name])
    assert r.topics[0].error_code == Err.INVALID_TOPIC_EXCEPTION
    assert create_topics(gw.kafka_port, [name]) == [Err.INVALID_TOPIC_EXCEPTION]
    assert gw.pmap.partitions(name) is None


def test_fine_kafka_topic_names_are_created(make_kgw: Any) -> None:
    gw = make_kgw()
    names = ["a.b_c-D9", "x" * 249, "..."]
    _, r = metadata(gw.kafka_port, names)
    assert [t.error_code for t in r.topics] == [Err.NONE] * 3


def test_topic_names_cannot_forge_log_lines(cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The Tank port takes any name but NUL: a name with a newline was written raw into the log."""
    from dafka.tank.client import TankClient

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        with caplog.at_level(logging.INFO, "dafka"), TankClient(HOST, gw.tank_port) as c:
            c.create_topic("t\n2026-11-28 INFO forged\x1b[2J", 1)
        lines = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
        assert lines and all("\n" not in m and "\x1b" not in m for m in lines), lines
    finally:
        gw.close()


def test_repeated_refusals_are_logged_at_a_bounded_rate(make_kgw: Any, cfg: NodeConfig,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    gw = make_kgw(config=dataclasses.replace(cfg, max_record_bytes=10))
    gw.create_topic("r", 1)
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    b.append(0, 1000, None, bytes(100), [])
    batch = bytes(b.build())
    with caplog.at_level(logging.INFO, "dafka"), socket.create_connection((HOST, gw.kafka_port)) as s:
        for i in range(200):
            assert produce_raw(s, i, "r", batch).error_code == Err.MESSAGE_TOO_LARGE
    assert 1 <= len([r for r in caplog.records if "max_record_bytes" in r.getMessage()]) <= 10


def test_a_join_storm_logs_nothing_per_join_and_leaves_an_idle_coordinator_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A JoinGroup storm logged one INFO line per join (44 MB) and left the coordinator
    scanning every member every 100 ms (46% of a core idle)."""
    c = Coordinator()
    meta = [("range", b"m")]
    with caplog.at_level(logging.INFO, "dafka"):
        for i in range(2000):
            c.join(f"t{i}", 0.0, f"g{i}", "", "storm", "consumer", meta, 1.0, 1.0)
    assert len([r for r in caplog.records if r.levelno >= logging.INFO]) <= 5
    # Their sessions end: the coordinator forgets them and their groups.
    c.tick(2.0)
    assert not c.groups and c.held == 0
    # Idle, it costs nothing however many came before; live members are looked at only when
    # a session may have ended, not every tick.
    member = c.join("live", 3.0, "live", "", "ok", "consumer", meta, 30.0, 30.0)[0].fields["member_id"]
    scanned = c.scanned
    for i in range(1, 200):
        now = 3.0 + i * 0.1
        c.tick(now)
        c.heartbeat(now, "live", member, 1)
    assert c.scanned - scanned <= 2, c.scanned - scanned
    c.tick(3.0 + 19.9 + 30.1)  # no heartbeat for longer than its session
    assert not c.groups


def test_refused_joins_are_logged_at_a_bounded_rate_with_their_names_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = Coordinator()
    c.max_held = 1000
    with caplog.at_level(logging.INFO, "dafka"):
        for i in range(300):
            code = c.join(f"t{i}", 0.0, f"g\n{i}", "", "storm", "consumer", [("range", bytes(2000))], 10.0, 10.0)[0]
            assert code.fields["error_code"] == Err.COORDINATOR_NOT_AVAILABLE
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 10 and not any("\n" in m for m in lines), lines[:3]


# ---------------------------------------------------------------- 8. what replicas keep


def test_a_replica_serves_kafka_records_without_their_key_headers_and_timestamp(make_kgw: Any) -> None:
    """Pins a known limit (issue 36 carries them over the mesh): keys, headers, producer
    timestamps and null values live only in the gateway that took the produce.  A second gateway serving the
    replica it holds gives key None, no headers and its own receive time.  When this test
    fails, the limit is gone: change docs/concepts/security.md and the Kafka page with it."""
    a = make_kgw("a")
    b = make_kgw("b")
    a.create_topic("meta", 1)
    address = a.pmap.get("meta", 0).address
    rb = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    rb.append(0, 1234, b"key", b"value", [("h", b"v")])
    rb.append(1, 1234, None, None, [])
    with socket.create_connection((HOST, a.kafka_port)) as s:
        assert produce_raw(s, 1, "meta", bytes(rb.build())).error_code == 0
    wait_until(lambda: b.head("meta", address) == 1, timeout=30)
    wait_until(lambda: b.pmap.lookup("meta", address) is not None)

    def fetch(gw: KafkaGateway) -> tuple[Any, ...]:
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            s.sendall(fetch_frame(2, "meta"))
            recs = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0].records
        return [(r.key, r.value, tuple(r.headers), r.timestamp) for rb in MemoryRecords(recs) for r in rb]

    assert fetch(a) == [(b"key", b"value", (("h", b"v"),), 1234), (None, None, (), 1234)]
    (key, value, headers, ts), (_, tomb, _, _) = fetch(b)
    assert (key, value, headers, tomb) == (None, b"value", (), b"")  # a null value arrives empty
    assert ts > 1234  # the replica's receive time


def test_two_batches_for_one_partition_are_refused_whole_never_half_stored(make_kgw: Any) -> None:
    # A plain batch then an idempotent one with a sequence gap: answered with an error after
    # storing the first, a client's retry would store it twice.  Kafka's brokers refuse more
    # than one v2 batch per partition a request (INVALID_RECORD); so does the gateway.
    gw = make_kgw()
    gw.create_topic("two", 1)
    address = gw.pmap.get("two", 0).address
    from tests.kafka.test_blocks import batch_of

    with socket.create_connection((HOST, gw.kafka_port)) as s:
        pid, epoch = init_pid(s, 0)
        r = produce_raw(s, 1, "two", bytes(batch_of(2)) + idem_batch(pid, epoch, 5, 2))
        assert r.error_code == Err.INVALID_RECORD and r.base_offset == -1
        r = produce_raw(s, 2, "two", bytes(batch_of(1)))  # the connection serves on
        assert r.error_code == Err.NONE and r.base_offset == 0
    wait_until(lambda: gw.db.fetch("two", address, 0, 10)[1] != [], timeout=10)
    start, values = gw.db.fetch("two", address, 0, 10)
    assert start == 0 and len(values) == 1  # the later single record only
