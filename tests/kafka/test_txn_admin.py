"""DescribeProducers, DescribeTransactions and ListTransactions (KIP-664): kafka-python's
admin client against a real gateway (real TCP, real LMDB, confluent-kafka's transactional
producer), the answers' bytes read by hand (tests/kafka/flexwire.py), and hostile requests."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer as CKProducer
from kafka import KafkaProducer
from kafka import TopicPartition as KTopicPartition
from kafka.admin import KafkaAdminClient
from kafka.errors import TransactionalIdNotFoundError
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.kafka import txn_admin
from dafka.kafka.codec import Err
from dafka.kafka.gateway import KafkaGateway
from tests.conftest import wait_until
from tests.kafka.flexwire import (
    Reader,
    call_flex,
    carray,
    cstr,
    flex_frame,
    i32,
    i64,
    tags,
    uvarint,
)
from tests.kafka.test_gateway import HOST, closed, frame, produce_raw, read_frame

pytestmark = pytest.mark.timeout(90)
POLICY = Err.POLICY_VIOLATION


@pytest.fixture
def kgw(cfg: NodeConfig, tmp_path: Path) -> Iterator[KafkaGateway]:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    yield gw
    gw.close()


def bs(gw: KafkaGateway) -> str:
    return f"{HOST}:{gw.kafka_port}"


def idem_batch(pid: int, epoch: int = 0, seq: int = 0, ts: int = 1000, n: int = 1) -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, False, pid, epoch, seq, 1 << 16)
    for i in range(n):
        b.append(i, ts + i, None, b"v%d" % i, [])
    return bytes(b.build())


# ---------------------------------------------------------------- real clients


def test_kafka_python_admin_lists_and_describes_transactions_and_producers(kgw: KafkaGateway) -> None:
    kgw.create_topic("pt", 2)
    before = int(time.time() * 1000)
    tp = CKProducer({"bootstrap.servers": bs(kgw), "transactional.id": "tx-a", "transaction.timeout.ms": 45_000})
    tp.init_transactions(20)
    tp.begin_transaction()
    tp.produce("pt", b"a1", partition=1)
    tp.produce("pt", b"a2", partition=1)
    assert tp.flush(20) == 0
    ip = KafkaProducer(bootstrap_servers=bs(kgw), enable_idempotence=True, acks="all")
    for i in range(3):
        ip.send("pt", b"i%d" % i, partition=1, timestamp_ms=5_000 + i).get(20)
    ip.close()
    admin = KafkaAdminClient(bootstrap_servers=bs(kgw), request_timeout_ms=20_000)
    try:
        listed = admin.list_transactions()[0]
        assert [(t.transactional_id, t.state.value) for t in listed] == [("tx-a", "Ongoing")]
        pid = listed[0].producer_id
        d = admin.describe_transactions(["tx-a"])["tx-a"]
        assert (d.state.value, d.producer_id, d.producer_epoch, d.transaction_timeout_ms) == ("Ongoing", pid, 0, 45_000)
        assert before - 1000 <= d.transaction_start_time_ms <= int(time.time() * 1000)
        assert d.topic_partitions == {KTopicPartition("pt", 1)}
        with pytest.raises(TransactionalIdNotFoundError):
            admin.describe_transactions(["nobody"])
        states = admin.describe_producers([KTopicPartition("pt", 0), KTopicPartition("pt", 1)])
        assert states[KTopicPartition("pt", 0)].active_producers == []
        by_pid = {p.producer_id: p for p in states[KTopicPartition("pt", 1)].active_producers}
        assert len(by_pid) == 2
        txp = by_pid.pop(pid)
        assert (txp.producer_epoch, txp.coordinator_epoch, txp.current_transaction_start_offset) == (0, 0, 0)
        assert txp.last_sequence in (0, 1)  # one batch of two records, or two of one
        assert txp.last_timestamp >= before
        (idem,) = by_pid.values()
        assert (idem.producer_epoch, idem.last_sequence, idem.last_timestamp) == (0, 2, 5_002)
        assert (idem.coordinator_epoch, idem.current_transaction_start_offset) == (-1, -1)
        # Filters: by state, by producer id, by how long it has run (v1).
        assert admin.list_transactions(state_filters=["CompleteCommit"])[0] == []
        assert len(admin.list_transactions(producer_id_filters=[pid])[0]) == 1
        assert admin.list_transactions(producer_id_filters=[pid + 1])[0] == []
        assert admin.list_transactions(duration_filter_ms=3_600_000)[0] == []
        assert len(admin.list_transactions(duration_filter_ms=0)[0]) == 1
        tp.commit_transaction(20)
        d = admin.describe_transactions(["tx-a"])["tx-a"]
        assert (d.state.value, d.transaction_start_time_ms, d.topic_partitions) == ("CompleteCommit", -1, set())
        assert [t.transactional_id for t in admin.list_transactions(state_filters=["CompleteCommit"])[0]] == ["tx-a"]
        after = admin.describe_producers([KTopicPartition("pt", 1)])[KTopicPartition("pt", 1)].active_producers
        assert {p.producer_id: p.current_transaction_start_offset for p in after}[pid] == -1
        # An abort shows too; a new InitProducerId bumps the epoch.
        tp.begin_transaction()
        tp.produce("pt", b"a3", partition=0)
        assert tp.flush(20) == 0
        tp.abort_transaction(20)
        assert [t.state.value for t in admin.list_transactions()[0]] == ["CompleteAbort"]
    finally:
        admin.close()


# ---------------------------------------------------------------- bytes, by hand


def describe_producers_body(topics: list[tuple[str, list[int]]], extra_tags: dict[int, bytes] | None = None) -> bytes:
    return carray([cstr(name) + carray([i32(i) for i in parts]) + tags() for name, parts in topics]) + tags(extra_tags)


def read_describe_producers(r: Reader) -> list[tuple[str, list[tuple[int, int, str | None, list[tuple[int, ...]]]]]]:
    assert r.i32() == 0  # throttle

    def producer(r: Reader) -> tuple[int, ...]:
        out = (r.i64(), r.i32(), r.i32(), r.i64(), r.i32(), r.i64())
        assert r.tags() == {}
        return out

    def partition(r: Reader) -> tuple[int, int, str | None, list[tuple[int, ...]]]:
        out = (r.i32(), r.i16(), r.cstr(), r.array(producer) or [])
        assert r.tags() == {}
        return out

    def topic(r: Reader) -> tuple[str, list[Any]]:
        name = r.cstr()
        assert name is not None
        parts = r.array(partition) or []
        assert r.tags() == {}
        return name, parts

    topics = r.array(topic) or []
    assert r.tags() == {}
    r.end()
    return topics


def test_describe_producers_answers_kafkas_layout_and_skips_unknown_tags(kgw: KafkaGateway) -> None:
    kgw.create_topic("dp", 1)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert produce_raw(s, 1, "dp", idem_batch(77, epoch=3, seq=0, ts=4242, n=2)).error_code == 0
        # An unknown tagged field in the body (tag 9) and in the header (tag 5): skipped.
        body = describe_producers_body([("dp", [0, 7]), ("nope", [0])], extra_tags={9: b"\x01\x02\x03"})
        s.sendall(flex_frame(61, 0, 5, body, header_tags=tags({5: b"zz"})))
        r = Reader(read_frame(s))
        assert r.i32() == 5 and r.tags() == {}
        assert read_describe_producers(r) == [
            ("dp", [(0, 0, None, [(77, 3, 1, 4243, -1, -1)]),
                    (7, Err.UNKNOWN_TOPIC_OR_PARTITION, None, [])]),
            ("nope", [(0, Err.UNKNOWN_TOPIC_OR_PARTITION, None, [])]),
        ]


def test_describe_producers_is_bounded_in_partitions_and_producers(kgw: KafkaGateway,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    kgw.create_topic("dp", 2)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        for pid in (11, 12, 13):  # three producers in partition 0 (ids the gateway takes from their batch)
            assert produce_raw(s, pid, "dp", idem_batch(pid)).error_code == 0
        many = [0] * (txn_admin.MAX_DESCRIBED_PARTITIONS + 5)
        topics = read_describe_producers(call_flex(s, 61, 0, describe_producers_body([("dp", many)])))
        codes = [p[1] for p in topics[0][1]]
        assert codes == [0] * txn_admin.MAX_DESCRIBED_PARTITIONS + [POLICY] * 5
        assert all(len(p[3]) == 3 for p in topics[0][1][:txn_admin.MAX_DESCRIBED_PARTITIONS])
        # The answer's producers: a partition that would pass the bound is refused whole.
        monkeypatch.setattr(txn_admin, "MAX_DESCRIBED_PRODUCERS", 4)
        topics = read_describe_producers(call_flex(s, 61, 0, describe_producers_body([("dp", [0, 0, 1])])))
        parts = topics[0][1]
        assert [(p[1], len(p[3])) for p in parts] == [(0, 3), (POLICY, 0), (0, 0)]
        assert parts[1][2] is not None and "more than 4" in parts[1][2]


def describe_txn_body(ids: list[str]) -> bytes:
    return carray([cstr(t) for t in ids]) + tags()


def read_describe_txn(r: Reader) -> list[tuple[Any, ...]]:
    assert r.i32() == 0

    def topic(r: Reader) -> tuple[str | None, list[int]]:
        out = (r.cstr(), r.array(lambda r: r.i32()) or [])
        assert r.tags() == {}
        return out

    def state(r: Reader) -> tuple[Any, ...]:
        out = (r.i16(), r.cstr(), r.cstr(), r.i32(), r.i64(), r.i64(), r.i16(), r.array(topic))
        assert r.tags() == {}
        return out

    states = r.array(state) or []
    assert r.tags() == {}
    r.end()
    return states


def test_describe_transactions_bytes_and_bounds(kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    kgw.create_topic("dt", 3)
    tp = CKProducer({"bootstrap.servers": bs(kgw), "transactional.id": "tx-d"})
    tp.init_transactions(20)
    tp.begin_transaction()
    for p in (0, 2):
        tp.produce("dt", b"x", partition=p)
    assert tp.flush(20) == 0
    pid = kgw.kafka.txn.txns["tx-d"].pid
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        (st,) = read_describe_txn(call_flex(s, 65, 0, describe_txn_body(["tx-d"])))
        code, tid, state, timeout, started, got_pid, epoch, topics = st
        assert (code, tid, state, got_pid, epoch) == (0, "tx-d", "Ongoing", pid, 0)
        assert timeout == 60_000 and started > 0
        assert [(t, sorted(ps)) for t, ps in topics] == [("dt", [0, 2])]
        # Past the count: POLICY_VIOLATION without work; an unknown id: TRANSACTIONAL_ID_NOT_FOUND.
        ids = ["tx-d"] * txn_admin.MAX_ADMIN_ITEMS + ["tx-d", "zz"]
        got = read_describe_txn(call_flex(s, 65, 0, describe_txn_body(ids)))
        assert [g[0] for g in got] == [0] * txn_admin.MAX_ADMIN_ITEMS + [POLICY, POLICY]
        assert read_describe_txn(call_flex(s, 65, 0, describe_txn_body(["zz"])))[0][:3] == (105, "zz", "")
        # The answer's bytes: ids past the budget are refused, estimated before building.
        monkeypatch.setattr(txn_admin, "MAX_TXN_ANSWER_BYTES", 200)
        got = read_describe_txn(call_flex(s, 65, 0, describe_txn_body(["tx-d"] * 3)))
        assert [g[0] for g in got] == [0, POLICY, POLICY]
    tp.abort_transaction(20)


def list_txn_body(states: list[str], pids: list[int], duration: int | None = None) -> bytes:
    body = carray([cstr(x) for x in states]) + carray([i64(p) for p in pids])
    if duration is not None:
        body += i64(duration)
    return body + tags()


def read_list_txn(r: Reader) -> tuple[int, list[str | None], list[tuple[Any, ...]]]:
    assert r.i32() == 0
    code = r.i16()
    unknown = r.array(lambda r: r.cstr()) or []

    def state(r: Reader) -> tuple[Any, ...]:
        out = (r.cstr(), r.i64(), r.cstr())
        assert r.tags() == {}
        return out

    states = r.array(state) or []
    assert r.tags() == {}
    r.end()
    return code, unknown, states


def test_list_transactions_filters_and_bounds(kgw: KafkaGateway) -> None:
    kgw.create_topic("lt", 1)
    tp = CKProducer({"bootstrap.servers": bs(kgw), "transactional.id": "tx-l"})
    tp.init_transactions(20)
    pid = kgw.kafka.txn.txns["tx-l"].pid
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert read_list_txn(call_flex(s, 66, 0, list_txn_body([], []))) == (0, [], [("tx-l", pid, "Empty")])
        got = read_list_txn(call_flex(s, 66, 1, list_txn_body(["Empty", "Bogus", "Bogus", "Dead"], [pid, 1], -1)))
        assert got == (0, ["Bogus"], [("tx-l", pid, "Empty")])
        assert read_list_txn(call_flex(s, 66, 1, list_txn_body([], [], 0)))[2] == []  # not running
        too_many = list_txn_body(["Empty"] * (txn_admin.MAX_ADMIN_ITEMS + 1), [])
        assert read_list_txn(call_flex(s, 66, 0, too_many)) == (POLICY, [], [])
        assert read_list_txn(call_flex(s, 66, 0, list_txn_body([], list(range(1001))))) == (POLICY, [], [])
        assert read_list_txn(call_flex(s, 66, 0, list_txn_body(["x" * 65], []))) == (POLICY, [], [])
        # v2 (a regular expression run on the gateway) is not served: not advertised, refused.
        s.sendall(flex_frame(66, 2, 9, list_txn_body([], [], -1)[:-1] + b"\x02.\x00"))
        assert closed(s)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        s.sendall(frame(18, 0, 1, bytes(ApiVersionsRequest[0]().encode(version=0))))
        r = ApiVersionsResponse.decode(read_frame(s)[4:], version=0)
        served = {k.api_key: (k.min_version, k.max_version) for k in r.api_keys}
        assert (served[61], served[65], served[66]) == ((0, 0), (0, 0), (0, 1))


@pytest.mark.parametrize("body", [
    uvarint(1 << 28),  # an array of 2^28 - 1 ids, and nothing after
    carray([b"\x7f" + b"x"]),  # a string longer than the request
    carray([cstr("a")]) + b"\x05",  # five tagged fields announced, none there
    carray([cstr("a")]) + b"\x01\x03\x7f",  # a tagged field of 127 bytes past the end
    b"\xff\xff\xff\xff\xff\xff",  # a varint that never ends
])
def test_malformed_describe_transactions_close_only_their_connection(kgw: KafkaGateway, body: bytes) -> None:
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        s.sendall(flex_frame(65, 0, 1, body))
        assert closed(s)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:  # the gateway serves on
        assert read_list_txn(call_flex(s, 66, 0, list_txn_body([], [])))[0] == 0
    wait_until(lambda: kgw.kafka_connections == 0)


def test_a_forgotten_producer_leaves_describe_producers(kgw: KafkaGateway) -> None:
    kgw.create_topic("fp", 1)
    kgw.kafka.max_adopted = 2
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        for pid in (21, 22, 23):
            assert produce_raw(s, pid, "fp", idem_batch(pid)).error_code == 0
        topics = read_describe_producers(call_flex(s, 61, 0, describe_producers_body([("fp", [0])])))
        assert sorted(p[0] for p in topics[0][1][0][3]) == [22, 23]
        # A new epoch forgets the old one's batches: listed with its new epoch.
        assert produce_raw(s, 30, "fp", idem_batch(22, epoch=1, seq=0)).error_code == 0
        topics = read_describe_producers(call_flex(s, 61, 0, describe_producers_body([("fp", [0])])))
        assert sorted((p[0], p[1]) for p in topics[0][1][0][3]) == [(22, 1), (23, 0)]
    assert set(kgw.kafka._producers_of) == {("fp", kgw.pmap.get("fp", 0).address)}
