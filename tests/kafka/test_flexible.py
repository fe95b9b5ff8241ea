"""Flexible versions (KIP-482) of Produce (v9, v10) and Fetch (v12), the versions current
clients negotiate with the gateway, and the decoding of tagged fields.

Requests are built by hand and answers read by hand (tests/kafka/flexwire.py, from Kafka's
protocol guide), independent of the gateway's codec; real clients (confluent-kafka /
librdkafka and kafka-python) show which versions they ask for."""

from __future__ import annotations

import gc
import socket
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as CKConsumer
from confluent_kafka import Producer as CKProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaConsumer, KafkaProducer
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.errors import ProtocolError
from dafka.kafka import codec
from dafka.kafka import gateway as gateway_module
from dafka.kafka.codec import API, Err, decode_request
from dafka.kafka.gateway import KafkaGateway
from tests.kafka.flexwire import (
    Reader,
    call_flex,
    carray,
    cbytes,
    cstr,
    flex_frame,
    i8,
    i16,
    i32,
    i64,
    tags,
    uvarint,
)
from tests.kafka.test_gateway import HOST, read_frame

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def kgw(cfg: NodeConfig, tmp_path: Path) -> Any:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    yield gw
    gw.close()


def batch(values: list[bytes], ts: int = 1000) -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    for i, v in enumerate(values):
        b.append(i, ts + i, None, v, [])
    return bytes(b.build())


# ---------------------------------------------------------------- Produce v9 / v10, Fetch v12 by hand


def produce_body(topic: str, parts: list[tuple[int, bytes]], acks: int = -1) -> bytes:
    return (cstr(None) + i16(acks) + i32(5000)
            + carray([cstr(topic) + carray([i32(i) + cbytes(r) + tags() for i, r in parts]) + tags()])
            + tags())


def read_produce(r: Reader, version: int) -> list[tuple[str | None, list[tuple[int, ...]]]]:
    def part(r: Reader) -> tuple[int, ...]:
        out = (r.i32(), r.i16(), r.i64(), r.i64(), r.i64())
        assert r.array(lambda r: (r.i32(), r.cstr(), r.tags())) == []  # record errors
        assert r.cstr() is None  # error message
        assert r.tags() == {}  # (v10: no current leader: the gateway leads every partition)
        return out

    def topic(r: Reader) -> tuple[str | None, list[tuple[int, ...]]]:
        out = (r.cstr(), r.array(part) or [])
        assert r.tags() == {}
        return out

    topics = r.array(topic) or []
    assert r.i32() == 0  # throttle
    assert r.tags() == {}  # (v10: no node endpoints)
    r.end()
    return topics


def fetch_body(topic: str, parts: list[tuple[int, int]], max_bytes: int = 1 << 20,
               isolation: int = 0, extra_tags: dict[int, bytes] | None = None) -> bytes:
    partitions = [i32(p) + i32(-1) + i64(off) + i32(-1) + i64(-1) + i32(max_bytes) + tags() for p, off in parts]
    return (i32(-1) + i32(0) + i32(1) + i32(max_bytes) + i8(isolation) + i32(0) + i32(-1)
            + carray([cstr(topic) + carray(partitions) + tags()])
            + carray([]) + cstr("") + tags(extra_tags))


def read_fetch(r: Reader) -> list[tuple[str | None, list[tuple[Any, ...]]]]:
    assert (r.i32(), r.i16(), r.i32()) == (0, 0, 0)  # throttle, error, session id

    def part(r: Reader) -> tuple[Any, ...]:
        out = (r.i32(), r.i16(), r.i64(), r.i64(), r.i64())
        assert r.array(lambda r: (r.i64(), r.i64(), r.tags())) is None  # aborted transactions: null
        assert r.i32() == -1  # preferred read replica
        records = r.cbytes()
        assert r.tags() == {}
        return (*out, records)

    def topic(r: Reader) -> tuple[str | None, list[tuple[Any, ...]]]:
        out = (r.cstr(), r.array(part) or [])
        assert r.tags() == {}
        return out

    topics = r.array(topic) or []
    assert r.tags() == {}
    r.end()
    return topics


@pytest.mark.parametrize("version", [9, 10])
def test_produce_v9_v10_and_fetch_v12_bytes_by_hand(kgw: KafkaGateway, version: int) -> None:
    kgw.create_topic("fx", 2)
    first, second = batch([b"a", b"b"]), batch([b"c"], ts=2000)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        got = read_produce(call_flex(s, 0, version, produce_body("fx", [(0, first), (1, second), (5, first)])), version)
        assert got == [("fx", [(0, 0, 0, -1, -1), (1, 0, 0, -1, -1), (5, Err.UNKNOWN_TOPIC_OR_PARTITION, -1, -1, -1)])]
        got = read_produce(call_flex(s, 0, version, produce_body("fx", [(0, batch([b"d"]))]), corr=2), version)
        assert got == [("fx", [(0, 0, 2, -1, -1)])]
        # Fetch v12, with an unknown tag (7) and ClusterId (tag 0) in the request: both skipped.
        body = fetch_body("fx", [(0, 0), (1, 0), (1, 9)], extra_tags={0: cstr("c"), 7: b"\x00\x01"})
        (topic,) = read_fetch(call_flex(s, 1, 12, body, corr=3))
        assert topic[0] == "fx"
        (p0, p1, p1_far) = topic[1]
        assert p0[:5] == (0, 0, 3, 3, 0) and p1[:5] == (1, 0, 1, 1, 0)
        assert p1_far[:2] == (1, Err.OFFSET_OUT_OF_RANGE) and p1_far[5] == b""
        # A batch as produced goes back as it came (but for its partition leader epoch, bytes 12-15).
        assert p1[5][:12] + p1[5][16:] == second[:12] + second[16:]
        assert p0[5] is not None and p0[5][:12] + p0[5][16:len(first)] == first[:12] + first[16:]


def test_a_fetch_v12_waits_for_records_and_answers_when_they_come(kgw: KafkaGateway) -> None:
    kgw.create_topic("fw", 1)
    with socket.create_connection((HOST, kgw.kafka_port)) as s, \
            socket.create_connection((HOST, kgw.kafka_port)) as p:
        body = fetch_body("fw", [(0, 0)])
        body = body[:4] + i32(5000) + body[8:]  # max wait 5 s
        s.sendall(flex_frame(1, 12, 4, body))
        read_produce(call_flex(p, 0, 9, produce_body("fw", [(0, batch([b"late"]))])), 9)
        r = Reader(read_frame(s))
        assert r.i32() == 4 and r.tags() == {}
        (topic,) = read_fetch(r)
        assert topic[1][0][2] == 1 and topic[1][0][5]


# ---------------------------------------------------------------- the versions real clients negotiate


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[int, int]]:
    """Every (api key, version) the gateway decodes, counted."""
    seen: Counter[tuple[int, int]] = Counter()
    real = gateway_module.decode_request

    def spy(frame: bytes) -> Any:
        header, body = real(frame)
        seen[(header.api_key, header.version)] += 1
        return header, body

    monkeypatch.setattr(gateway_module, "decode_request", spy)
    return seen


def versions(seen: Counter[tuple[int, int]]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for key, v in seen:
        out.setdefault(key, set()).add(v)
    return out


def test_confluent_kafka_negotiates_the_flexible_produce_and_fetch(kgw: KafkaGateway,
                                                                  served: Counter[tuple[int, int]]) -> None:
    kgw.create_topic("neg", 1)
    p = CKProducer({"bootstrap.servers": f"{HOST}:{kgw.kafka_port}", "enable.idempotence": True})
    for i in range(20):
        p.produce("neg", b"v%d" % i)
    assert p.flush(20) == 0
    c = CKConsumer({"bootstrap.servers": f"{HOST}:{kgw.kafka_port}", "group.id": "neg",
                    "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe(["neg"])
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 20 and time.monotonic() < deadline:
        m = c.poll(0.2)
        if m is not None and not m.error():
            got.append(m.value())
    c.commit(asynchronous=False)
    c.close()
    assert got == [b"v%d" % i for i in range(20)]
    seen = versions(served)
    # librdkafka 2.12 asks Produce v10, Fetch v12 (v13+ needs topic ids), Metadata v13 and
    # OffsetCommit / OffsetFetch v9: it gets the highest the gateway serves, all flexible.
    assert seen[0] == {10} and seen[1] == {12}
    assert seen[3] == {API[3].max_version} and seen[8] == {API[8].max_version} and seen[9] == {API[9].max_version}
    for key in (0, 1, 3, 8, 9, 22):
        (v,) = seen[key]
        assert API[key].request.flexible_version_q(v), (key, v)


def test_kafka_python_negotiates_the_flexible_produce_and_fetch(kgw: KafkaGateway,
                                                               served: Counter[tuple[int, int]]) -> None:
    kgw.create_topic("kneg", 1)
    bs = f"{HOST}:{kgw.kafka_port}"
    p = KafkaProducer(bootstrap_servers=bs, acks="all")
    for i in range(5):
        p.send("kneg", b"v%d" % i).get(20)
    p.close()
    c = KafkaConsumer("kneg", bootstrap_servers=bs, group_id="kneg", auto_offset_reset="earliest",
                      enable_auto_commit=False, consumer_timeout_ms=15_000)
    got = []
    for m in c:
        got.append(m.value)
        if len(got) == 5:
            break
    c.commit()
    c.close()
    assert got == [b"v%d" % i for i in range(5)]
    seen = versions(served)
    assert seen[0] == {9} and seen[1] == {12}  # kafka-python 3's highest
    for key in (0, 1, 3, 8, 9):
        assert all(API[key].request.flexible_version_q(v) for v in seen[key]), (key, seen[key])


# ---------------------------------------------------------------- tagged fields, hostile


def flex_request(api_key: int, version: int, body: bytes) -> bytes:
    return struct.pack(">hhih", api_key, version, 1, 4) + b"test" + b"\x00" + body


def test_a_request_of_many_small_tagged_structs_decodes_in_linear_time() -> None:
    # Metadata v9: an array of topics, each a struct with its own tag section.  kafka-python's
    # generated decoder copied the rest of the request for each non-empty section (quadratic:
    # 2 MB took tens of seconds on the gateway's I/O thread).
    n = 300_000
    entry = cstr("a") + tags({9: b""})
    body = carray([entry] * n) + b"\x00" + b"\x00" + b"\x00" + tags()
    # This thread's CPU, without the cyclic GC (300,000 new objects in a worker that holds the
    # suite's: full collections): what the decoder itself costs, whatever else the machine runs.
    # Quiet, 0.5 s; the quadratic decoder took tens of seconds.
    gc.disable()
    try:
        start = time.thread_time()
        _header, req = decode_request(flex_request(3, 9, body))
        took = time.thread_time() - start
    finally:
        gc.enable()
    assert len(req.topics) == n
    assert took < 6.0, f"{took:.1f}s of CPU"


@pytest.mark.parametrize("section", [
    b"\x01\x03\x7f",  # a tag of 127 bytes past the end
    b"\x01\x03\x05ab",  # 5 bytes announced, 2 there
    b"\x41" + b"\x00\x00" * 65,  # 65 tags (at most 64)
    b"\x01\xff\xff\xff\xff\xff\x00",  # a tag number longer than 5 bytes
    b"\x01\x00\x05" + cstr("abcdefg"),  # a known tag (ClusterId) whose value is longer than its size
    b"\x01\x00\x05" + cstr("a") + b"xxx",  # ... or shorter
])
def test_malformed_tag_sections_are_protocol_errors(section: bytes) -> None:
    body = fetch_body("t", [(0, 0)])[:-1] + section
    with pytest.raises(ProtocolError):
        decode_request(flex_request(1, 12, body))


def test_bytes_after_a_request_are_left_alone_as_kafka_does() -> None:
    # librdkafka 2.12's Metadata v9 (AdminClient.list_topics, quixstreams at start), as sent:
    # a byte past its tag section.  Kafka's brokers take it; refusing it stopped quixstreams.
    frame = bytes.fromhex("0003000900000003000772646b61666b61000000000001000000")
    header, req = decode_request(frame)
    assert (header.api_key, header.version, header.client_id) == (3, 9, "rdkafka")
    assert req.topics is None and req.include_topic_authorized_operations is False


FLEXIBLE = [(0, 9), (0, 10), (1, 12), (61, 0), (65, 0), (66, 0), (66, 1), (3, 9), (8, 8)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FLEXIBLE), st.binary(max_size=200))
def test_any_bytes_decode_or_raise_protocol_error(kv: tuple[int, int], body: bytes) -> None:
    try:
        decode_request(flex_request(kv[0], kv[1], body))
    except ProtocolError:
        pass


VALID = {
    (1, 12): fetch_body("t", [(0, 5), (1, 7)]),
    (0, 9): produce_body("t", [(0, b"xyz")]),
    (61, 0): carray([cstr("t") + carray([i32(0), i32(3)]) + tags()]) + tags(),
    (65, 0): carray([cstr("a"), cstr("b")]) + tags(),
    (66, 1): carray([cstr("Ongoing")]) + carray([i64(5)]) + i64(-1) + tags(),
}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(VALID)),
       st.dictionaries(st.integers(1, 5000), st.binary(max_size=20), max_size=6),
       st.integers(0, 255))
def test_unknown_tags_are_skipped_and_truncations_refused(kv: tuple[int, int], extra: dict[int, bytes], cut: int) -> None:
    base = VALID[kv]
    _h, want = decode_request(flex_request(kv[0], kv[1], base))
    unknown = {t: v for t, v in extra.items() if t not in (0,)}  # tag 0 is Fetch's ClusterId
    tagged = base[:-1] + tags(unknown)
    _h, got = decode_request(flex_request(kv[0], kv[1], tagged))
    assert got == want
    if cut % len(tagged):  # any strict prefix is refused, never taken as a request
        with pytest.raises(ProtocolError):
            decode_request(flex_request(kv[0], kv[1], tagged[: cut % len(tagged)]))
    assert uvarint(0) == b"\x00" and codec.MAX_TAGS == 64
