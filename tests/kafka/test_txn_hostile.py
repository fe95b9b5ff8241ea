"""Hostile transaction requests: each bounded (ids, counts, sizes), refused with a Kafka error
code, nothing written, the gateway serving on.  Real TCP, a real gateway with LMDB; the
requests are written by hand."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.producer import (
    AddOffsetsToTxnRequest,
    AddOffsetsToTxnResponse,
    AddPartitionsToTxnRequest,
    AddPartitionsToTxnResponse,
    EndTxnRequest,
    EndTxnResponse,
    InitProducerIdRequest,
    InitProducerIdResponse,
    TxnOffsetCommitRequest,
    TxnOffsetCommitResponse,
)
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.kafka import txn_api
from dafka.kafka.codec import Err
from dafka.kafka.gateway import TXN_FILE, KafkaGateway
from dafka.kafka.records import MARKER_SLOT, control_batch
from tests.kafka.test_gateway import HOST, frame, produce_raw, read_frame

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def kgw(cfg: NodeConfig, tmp_path: Path) -> Iterator[KafkaGateway]:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    yield gw
    gw.close()


def call(s: socket.socket, api: int, version: int, req: Any, resp: Any, corr: int = 1) -> Any:
    s.sendall(frame(api, version, corr, bytes(req.encode(version=version))))
    return resp.decode(read_frame(s)[4:], version=version)


def init(s: socket.socket, tid: str, timeout_ms: int = 60_000) -> Any:
    return call(s, 22, 1, InitProducerIdRequest[1](transactional_id=tid, transaction_timeout_ms=timeout_ms),
                InitProducerIdResponse)


def add(s: socket.socket, tid: str, pid: int, epoch: int, topic: str, parts: list[int]) -> Any:
    req = AddPartitionsToTxnRequest[1](
        v3_and_below_transactional_id=tid, v3_and_below_producer_id=pid, v3_and_below_producer_epoch=epoch,
        v3_and_below_topics=[AddPartitionsToTxnRequest.AddPartitionsToTxnTopic(name=topic, partitions=parts)])
    return call(s, 24, 1, req, AddPartitionsToTxnResponse)


def txn_batch(pid: int, epoch: int, value: bytes = b"v") -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, True, pid, epoch, 0, 1 << 16)
    b.append(0, 1000, None, value, [])
    return bytes(b.build())


def codes_of(r: Any) -> list[int]:
    return [p.partition_error_code for t in r.results_by_topic_v3_and_below for p in t.results_by_partition]


def test_init_producer_id_refuses_bad_ids_and_timeouts(kgw: KafkaGateway) -> None:
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert init(s, "x" * 250).error_code == Err.INVALID_REQUEST
        assert init(s, "").error_code == Err.INVALID_REQUEST
        assert init(s, "t", 0).error_code == Err.INVALID_TRANSACTION_TIMEOUT
        assert init(s, "t", 2_000_000_000).error_code == Err.INVALID_TRANSACTION_TIMEOUT
        assert not kgw.kafka.txn.txns
        r = init(s, "t")
        assert r.error_code == 0 and r.producer_id >= 0 and r.producer_epoch == 0


def test_one_connection_cannot_init_more_than_its_transactional_ids(
        kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(txn_api, "MAX_TIDS_PER_CONNECTION", 3)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert [init(s, f"id{i}").error_code for i in range(4)] == [0, 0, 0, Err.POLICY_VIOLATION]
        assert init(s, "id0").error_code == 0  # one it has
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert init(s, "other").error_code == 0
    assert len(kgw.kafka.txn.txns) == 4


def test_add_partitions_is_bounded_per_request_and_per_transaction(
        kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    kgw.create_topic("many", 3)
    monkeypatch.setattr(txn_api, "MAX_TXN_REQUEST_PARTITIONS", 4)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        r = init(s, "t")
        pid, epoch = r.producer_id, r.producer_epoch
        # Past the request bound: refused without work (partitions past it POLICY_VIOLATION,
        # the others not attempted).
        codes = codes_of(add(s, "t", pid, epoch, "many", [0, 1, 2, 0, 1, 2]))
        assert codes == [Err.OPERATION_NOT_ATTEMPTED] * 4 + [Err.POLICY_VIOLATION] * 2
        assert kgw.kafka.txn.txns["t"].parts == {}
        # An unknown partition: nothing added either.
        assert codes_of(add(s, "t", pid, epoch, "many", [0, 9])) == [Err.OPERATION_NOT_ATTEMPTED,
                                                                      Err.UNKNOWN_TOPIC_OR_PARTITION]
        kgw.kafka.txn.max_partitions = 2
        assert codes_of(add(s, "t", pid, epoch, "many", [0, 1, 2])) == [Err.POLICY_VIOLATION] * 3
        assert codes_of(add(s, "t", pid, epoch, "many", [0, 1])) == [0, 0]
        # Someone else's producer id, a future epoch: refused.
        assert codes_of(add(s, "t", pid + 1, epoch, "many", [2])) == [Err.INVALID_PRODUCER_ID_MAPPING]
        assert codes_of(add(s, "t", pid, epoch + 5, "many", [2])) == [Err.INVALID_PRODUCER_EPOCH]


def test_transactional_batches_need_their_transaction_and_control_batches_are_refused(kgw: KafkaGateway) -> None:
    kgw.create_topic("guard", 1)
    address = kgw.pmap.get("guard", 0).address
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        # A made-up producer id.
        assert produce_raw(s, 2, "guard", txn_batch(123456, 0)).error_code == Err.INVALID_PRODUCER_ID_MAPPING
        r = init(s, "g")
        pid, epoch = r.producer_id, r.producer_epoch
        # Its partition not added to a transaction.
        assert produce_raw(s, 3, "guard", txn_batch(pid, epoch)).error_code == Err.INVALID_TXN_STATE
        # A control batch (markers are the coordinator's to write).
        marker = bytes(9) + bytes((MARKER_SLOT.size,)) + MARKER_SLOT.pack(pid, epoch, 1)
        assert produce_raw(s, 4, "guard", control_batch(0, marker)).error_code == Err.INVALID_REQUEST
        assert kgw.head("guard", address) is None  # nothing stored
        # The real thing is taken.
        assert codes_of(add(s, "g", pid, epoch, "guard", [0])) == [0]
        assert produce_raw(s, 5, "guard", txn_batch(pid, epoch)).error_code == 0


def test_offsets_and_ends_of_unknown_transactions_are_refused(kgw: KafkaGateway) -> None:
    kgw.create_topic("o", 1)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        r = call(s, 26, 1, EndTxnRequest[1](transactional_id="nope", producer_id=1, producer_epoch=0, committed=True),
                 EndTxnResponse)
        assert r.error_code == Err.INVALID_PRODUCER_ID_MAPPING
        r = call(s, 25, 1, AddOffsetsToTxnRequest[1](transactional_id="nope", producer_id=1, producer_epoch=0,
                                                      group_id="g"), AddOffsetsToTxnResponse)
        assert r.error_code == Err.INVALID_PRODUCER_ID_MAPPING
        t = init(s, "t")
        r = call(s, 25, 1, AddOffsetsToTxnRequest[1](transactional_id="t", producer_id=t.producer_id,
                                                      producer_epoch=0, group_id="g" * 300), AddOffsetsToTxnResponse)
        assert r.error_code == Err.INVALID_GROUP_ID
        topic = TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic(name="o", partitions=[
            TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic.TxnOffsetCommitRequestPartition(
                partition_index=0, committed_offset=5, committed_leader_epoch=-1, committed_metadata=None)])
        r = call(s, 28, 2, TxnOffsetCommitRequest[2](transactional_id="t", group_id="g", producer_id=t.producer_id,
                                                      producer_epoch=0, topics=[topic]), TxnOffsetCommitResponse)
        assert r.topics[0].partitions[0].error_code == Err.INVALID_TXN_STATE  # its group was not added
        assert kgw.positions("g") == {}


def test_a_torn_journal_line_is_cut_off_at_start(cfg: NodeConfig, tmp_path: Path) -> None:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            pid = init(s, "kept").producer_id
    finally:
        gw.close()
    journal = tmp_path / "gw" / TXN_FILE
    journal.write_bytes(journal.read_bytes() + b'{"op":"init","tid":"torn","pi')  # a crash mid-write
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        assert set(gw.kafka.txn.txns) == {"kept"} and gw.kafka.txn.txns["kept"].pid == pid
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            r = init(s, "kept")  # the journal goes on after the cut
            assert (r.error_code, r.producer_id, r.producer_epoch) == (0, pid, 1)
    finally:
        gw.close()
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        assert gw.kafka.txn.txns["kept"].epoch == 1
    finally:
        gw.close()


def test_a_commit_journalled_before_a_crash_is_finished_at_start(cfg: NodeConfig, tmp_path: Path) -> None:
    """The gateway died after journalling an EndTxn commit and before its marker reached the
    disk: at start the marker is written again (at the next offset), the group's offsets are
    committed, and read_committed readers get the transaction's records."""
    from confluent_kafka import Consumer, TopicPartition

    from tests.conftest import wait_until

    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        gw.create_topic("crash", 1)
        address = gw.pmap.get("crash", 0).address
        with socket.create_connection((HOST, gw.kafka_port)) as s:
            r = init(s, "c")
            pid, epoch = r.producer_id, r.producer_epoch
            assert codes_of(add(s, "c", pid, epoch, "crash", [0])) == [0]
            assert produce_raw(s, 2, "crash", txn_batch(pid, epoch, b"in-txn")).error_code == 0
            assert call(s, 25, 1, AddOffsetsToTxnRequest[1](transactional_id="c", producer_id=pid,
                                                             producer_epoch=epoch, group_id="grp"),
                        AddOffsetsToTxnResponse).error_code == 0
            topic = TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic(name="crash", partitions=[
                TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic.TxnOffsetCommitRequestPartition(
                    partition_index=0, committed_offset=7, committed_leader_epoch=-1, committed_metadata=None)])
            r = call(s, 28, 2, TxnOffsetCommitRequest[2](transactional_id="c", group_id="grp", producer_id=pid,
                                                          producer_epoch=epoch, topics=[topic]),
                     TxnOffsetCommitResponse)
            assert r.topics[0].partitions[0].error_code == 0
        assert gw.positions("grp") == {}  # not before the commit
    finally:
        gw.close()
    journal = tmp_path / "gw" / TXN_FILE
    with open(journal, "a") as f:  # what EndTxn journals before it writes the marker at offset 1
        f.write(json.dumps({"op": "end", "tid": "c", "commit": True, "markers": [["crash", address, 1]],
                            "epoch": None}) + "\n")
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        wait_until(lambda: gw.kafka.txn.txns["c"].state == "CompleteCommit", 10)
        assert gw.head("crash", address) == 1  # the marker, written again
        assert gw.positions("grp") == {("crash", address): 7}
        c = Consumer({"bootstrap.servers": f"{HOST}:{gw.kafka_port}", "group.id": "r",
                      "isolation.level": "read_committed"})
        try:
            c.assign([TopicPartition("crash", 0, 0)])
            m = wait_until(lambda: (lambda m: m if m is not None and not m.error() else None)(c.poll(0.2)), 20, 0)
            assert (m.offset(), m.value()) == (0, b"in-txn")
        finally:
            c.close()
    finally:
        gw.close()


def call_flex(s: socket.socket, api: int, version: int, req: Any, resp: Any, corr: int = 1) -> Any:
    """A request at a flexible version: header v2 (an empty tagged-field section after the
    client id), the response's header v1 (one more)."""
    body = bytes(req.encode(version=version))
    payload = struct.pack(">hhih", api, version, corr, 4) + b"test" + b"\x00" + body
    s.sendall(struct.pack(">i", len(payload)) + payload)
    return resp.decode(read_frame(s)[5:], version=version)


def test_a_txn_offset_commit_of_a_member_the_group_does_not_have_is_refused(kgw: KafkaGateway) -> None:
    """KIP-447: TxnOffsetCommit v3 names the consumer's member and generation; a zombie
    consumer (its member gone, or of an old generation) cannot commit offsets."""
    kgw.create_topic("z", 1)
    address = kgw.pmap.get("z", 0).address
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        t = init(s, "zt")
        call(s, 25, 1, AddOffsetsToTxnRequest[1](transactional_id="zt", producer_id=t.producer_id,
                                                  producer_epoch=0, group_id="zg"), AddOffsetsToTxnResponse)

        def commit(member: str, generation: int) -> int:
            topic = TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic(name="z", partitions=[
                TxnOffsetCommitRequest.TxnOffsetCommitRequestTopic.TxnOffsetCommitRequestPartition(
                    partition_index=0, committed_offset=3, committed_leader_epoch=-1, committed_metadata=None)])
            r = call_flex(s, 28, 3, TxnOffsetCommitRequest[3](
                transactional_id="zt", group_id="zg", producer_id=t.producer_id, producer_epoch=0,
                generation_id=generation, member_id=member, group_instance_id=None, topics=[topic]),
                TxnOffsetCommitResponse)
            return int(r.topics[0].partitions[0].error_code)

        assert commit("gone-member", 4) == Err.UNKNOWN_MEMBER_ID
        assert kgw.kafka.txn.txns["zt"].groups["zg"] == {}
        assert commit("", -1) == Err.NONE  # a consumer with no group membership (assign())
        assert kgw.kafka.txn.txns["zt"].groups["zg"] == {("z", address): 3}



def test_a_journal_write_that_fails_leaves_nothing_acted_on(kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under the journal: the request fails (its connection closes), its records are
    not stored, and the coordinator forgets what it did not keep (a range it kept in memory only
    would later hide, at an abort, records other producers store at those offsets)."""
    kgw.create_topic("full", 1)
    address = kgw.pmap.get("full", 0).address
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        r = init(s, "f")
        pid, epoch = r.producer_id, r.producer_epoch
        assert codes_of(add(s, "f", pid, epoch, "full", [0])) == [0]
    real = kgw._txnlog.write

    def full(records: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kgw._txnlog, "write", full)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        with pytest.raises(ConnectionError):
            produce_raw(s, 2, "full", txn_batch(pid, epoch, b"lost"))
    assert kgw.kafka.txn.txns["f"].parts == {("full", address): []}
    assert kgw.kafka.txn.open == {} and kgw.head("full", address) is None
    monkeypatch.setattr(kgw._txnlog, "write", real)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert produce_raw(s, 3, "full", txn_batch(pid, epoch, b"kept")).error_code == 0
    assert kgw.kafka.txn.txns["f"].parts == {("full", address): [[0, 0]]}
