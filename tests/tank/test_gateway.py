"""The Tank gateway: real TCP on 127.0.0.1, real LMDB, a real mesh with a tower.

Raw-byte tests follow ``shared/specs/tank_current.md`` (the captured tank-cli
traffic); the rest talk through :class:`TankClient`, plain Dafka producers and
consumers, and a gateway subprocess that is killed with SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.block import CODEC_TANK, HEADER_SIZE, _seal, tank_block
from dafka.store.db import RecordDB
from dafka.tank.bundle import CODEC_NONE, CODEC_SNAPPY, Record, decode_chunk, encode_bundle
from dafka.tank.client import TankClient, TankError, UnknownTopicError
from dafka.tank.codec import FrameBuffer, encode_frame, encode_str8, encode_varint, frame_header
from dafka.tank.gateway import TANK_VERSION, Gateway
from dafka.tank.limits import GatewayLimits
from dafka.tank.mapping import PARTITIONS_TOPIC
from dafka.tank.messages import (
    SEQ_TAIL,
    ConsumeFlag,
    ConsumePartition,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopic,
    CreateTopicError,
    CreateTopicRequest,
    CreateTopicResponse,
    DiscoverPartitionsRequest,
    DiscoverPartitionsResponse,
    DiscoverTopicsRequest,
    DiscoverTopicsResponse,
    DiscoverTopologyRequest,
    DiscoverTopologyResponse,
    MsgId,
    PartitionBounds,
    Ping,
    ProduceError,
    ProducePartition,
    ProduceRequest,
    ProduceTopic,
    ProduceWithSeqnumRequest,
    ReloadConfRequest,
    ReloadConfResponse,
    StatusRequest,
    StatusResponse,
    TopicInfo,
    decode_response,
    response_msg_id,
    response_request_id,
)
from tests.conftest import dafka_cmd, subprocess_env, tower_flag, wait_until
from tests.store.test_append_blocks import sparse_partition

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
PING = bytes.fromhex("03 00000000")
TS = 1_700_000_000_123
TS_LE = struct.pack("<Q", TS)
U32 = struct.Struct("<I")

# ``tank-cli produce -s 2 hello world`` as captured (tank_current.md).
CAPTURED_BUNDLE = b"\x08" + b"\x00" + TS_LE + b"\x05hello" + b"\x02\x05world"
CAPTURED_PAYLOAD = (
    b"\x02\x00" + b"\x01\x00\x00\x00" + b"\x03c++" + b"\x00" + b"\x00\x00\x00\x00" + b"\x01"
    + b"\x06events" + b"\x01" + b"\x00\x00" + b"\x17" + CAPTURED_BUNDLE
)
CAPTURED_PRODUCE = b"\x01" + b"\x32\x00\x00\x00" + CAPTURED_PAYLOAD
CAPTURED_ANSWER = bytes.fromhex("01 05000000 01000000 00")


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def make_gateway(cfg: NodeConfig, tmp_path: Path) -> Any:
    made: list[Gateway] = []

    def make(name: str = "gw", **options: Any) -> Gateway:
        options.setdefault("listen", (HOST, 0))
        db = options.pop("db", tmp_path / name)
        gw = Gateway(db, cfg, **options)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.close()


@pytest.fixture
def gw(make_gateway: Any) -> Gateway:
    return make_gateway()


@pytest.fixture
def client(gw: Gateway) -> Any:
    with TankClient(HOST, gw.tank_port) as c:
        yield c


def connect_raw(port: int) -> socket.socket:
    """A plain socket to the gateway, past its greeting Ping."""
    s = socket.create_connection((HOST, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert recv_exact(s, 5) == PING
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = s.recv_into(view[pos:])
        if not got:
            raise AssertionError(f"connection closed after {pos} of {n} bytes")
        pos += got
    return bytes(buf)


def recv_frame(s: socket.socket) -> tuple[int, bytes]:
    msg_id, size = struct.unpack("<BI", recv_exact(s, 5))
    return msg_id, recv_exact(s, size)


def read_until_closed(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the gateway sends until it closes the connection (EOF or reset)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"the gateway kept the connection open; got {data[:64]!r}")
        s.settimeout(remaining)
        try:
            got = s.recv(1 << 16)
        except ConnectionResetError:
            return data
        except TimeoutError:
            continue
        if not got:
            return data
        data += got


def consume_frame(
    req_id: int,
    topic: str,
    partition: int,
    seq: int,
    fetch_size: int = 1 << 20,
    max_wait_ms: int = 0,
    min_bytes: int = 0,
) -> bytes:
    part = ConsumePartition(partition, seq, fetch_size)
    return ConsumeRequest(req_id, [ConsumeTopic(topic, [part])], "", max_wait_ms, min_bytes).encode()


def produce_frame(req_id: int, topic: str, partition: int, bundle: bytes) -> bytes:
    return ProduceRequest(req_id, [ProduceTopic(topic, [ProducePartition(partition, bundle)])]).encode()


def produce_frame_request(c: TankClient, topic: str, partition: int, bundle: bytes) -> ProduceRequest:
    return ProduceRequest(c.next_request_id(), [ProduceTopic(topic, [ProducePartition(partition, bundle)])])


def consume_all(c: TankClient, topic: str, partition: int, seq: int = 0, fetch_size: int = 1 << 20) -> list[Record]:
    """Every message from ``seq`` to the end, fetching until a drained answer."""
    out: list[Record] = []
    while True:
        r = c.consume(topic, partition, seq, fetch_size)
        assert not r.boundary_check, r
        if not r.messages:
            return out
        out += [(s, t, None if k is None else bytes(k), bytes(v)) for s, t, k, v in r.messages]
        seq = r.next_seq


def values(records: list[Record]) -> list[bytes]:
    return [r[3] for r in records]


def created_partitions(make_gateway: Any, topic: str) -> list[str]:
    """Create ``topic`` with 2 partitions on a gateway from ``make_gateway``, closed after:
    the partitions' addresses (a test then writes its blocks into the database itself)."""
    gw = make_gateway(topic)
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic(topic, 2)
    addresses = [gw.pmap.get(topic, i).address for i in range(2)]
    gw.close()
    return addresses


def consume_both(c: TankClient, topic: str, seq: int) -> tuple[Any, Any]:
    """One consume of ``topic``'s partition 0 from ``seq`` and partition 1 from 1: their
    answers."""
    req = ConsumeRequest(c.next_request_id(), [ConsumeTopic(topic, [ConsumePartition(0, seq, 1 << 20),
                                                                    ConsumePartition(1, 1, 1 << 20)])])
    resp = c.request(req, 5.0)
    assert isinstance(resp, ConsumeResponse)
    first, second = resp.topics[0].partitions
    return first, second


def the_map(c: TankClient) -> list[tuple[bytes, dict]]:
    """``__dafka_partitions`` as (key, decoded JSON value) pairs."""
    return [(k, json.loads(v)) for _s, _t, k, v in consume_all(c, PARTITIONS_TOPIC, 0)]


def mesh_read(cfg: NodeConfig, topic: str, n: int, timeout: float = 20.0) -> list:
    """What a plain Dafka consumer (from the earliest offsets) gets, plus anything extra."""
    with Consumer(topic, cfg, offset_reset="earliest") as consumer:
        got: list = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += consumer.poll_batch(10_000, 0.2)
        got += consumer.poll_batch(100, 0.3)
    return got


def start_gateway_process(cfg: NodeConfig, db: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        dafka_cmd(
            "gateway", "--db", str(db), "--listen", f"{HOST}:0",
            "--tower", tower_flag(cfg), "--bind", HOST, *extra,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    )
    line = proc.stdout.readline().decode()
    m = re.search(r"gateway up: Tank on [\d.]+:(\d+)", line)
    assert m, line
    return proc, int(m.group(1))


# ---------------------------------------------------------------- the captured traffic


def test_greeting_and_the_captured_tank_cli_exchange(gw: Gateway, client: TankClient) -> None:
    assert len(CAPTURED_PAYLOAD) == 0x32
    s = socket.create_connection((HOST, gw.tank_port), timeout=10)
    try:
        assert recv_exact(s, 5) == PING  # at once, before the client says anything
        client.create_topic("events", 1)
        s.sendall(CAPTURED_PRODUCE)
        assert recv_exact(s, 10) == CAPTURED_ANSWER

        # A raw consume from 0 gets the records back, laid out as Tank does.
        req = (
            struct.pack("<HI", 2, 7) + b"\x00" + struct.pack("<QI", 0, 0) + b"\x01"
            + b"\x06events" + b"\x01" + struct.pack("<HQI", 0, 0, 128 << 20)
        )
        s.sendall(b"\x02" + U32.pack(len(req)) + req)
        header = (
            U32.pack(7) + b"\x01" + b"\x06events" + b"\x01" + struct.pack("<HB", 0, 0)
            + struct.pack("<QQI", 1, 2, 1 + len(CAPTURED_BUNDLE))
        )
        assert len(header) == 0x24
        assert recv_frame(s) == (2, U32.pack(len(header)) + header + b"\x17" + CAPTURED_BUNDLE)

        # The captured tail wake-up: park at UINT64_MAX, then "late" arrives.
        s.sendall(consume_frame(8, "events", 0, SEQ_TAIL, 128 << 20, max_wait_ms=0xFFFFFFFF))
        s.sendall(StatusRequest(9).encode())
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.STATUS and StatusResponse.decode(payload).req_id == 9  # parked, not answered
        client.produce("events", 0, [(None, b"late", TS)])
        header = (
            U32.pack(8) + b"\x01" + b"\x06events" + b"\x01" + struct.pack("<HB", 0, 0)
            + struct.pack("<QQI", 3, 3, 0x10)
        )
        frame = recv_exact(s, 5 + 0x38)
        assert frame == (
            b"\x02" + U32.pack(0x38) + U32.pack(0x24) + header
            + b"\x0f" + b"\x04\x00" + TS_LE + b"\x04late"
        )
    finally:
        s.close()


def test_captured_produce_delivered_byte_by_byte(gw: Gateway, client: TankClient) -> None:
    client.create_topic("events", 1)
    s = connect_raw(gw.tank_port)
    try:
        for i in range(len(CAPTURED_PRODUCE)):
            s.sendall(CAPTURED_PRODUCE[i : i + 1])
        assert recv_exact(s, 10) == CAPTURED_ANSWER
    finally:
        s.close()
    assert consume_all(client, "events", 0) == [(1, TS, None, b"hello"), (2, TS, None, b"world")]


# ---------------------------------------------------------------- topics


def test_create_topic(gw: Gateway, client: TankClient) -> None:
    client.create_topic("orders", 3)
    assert client.discover_partitions("orders") == {i: PartitionBounds(0, 0) for i in range(3)}
    owned = [(p.pid, p.owned) for p in gw.pmap.partitions("orders")]
    assert owned == [(0, True), (1, True), (2, True)]

    def code(topic: str, partitions: int, config: str = "") -> int:
        resp = client.request(CreateTopicRequest(client.next_request_id(), topic, partitions, config))
        assert isinstance(resp, CreateTopicResponse) and resp.topic == topic
        return resp.error

    assert code("orders", 1) == CreateTopicError.EXISTS
    assert code("orders", 5) == CreateTopicError.EXISTS
    assert code("", 1) == CreateTopicError.INVALID
    assert code("zero", 0) == CreateTopicError.INVALID
    assert code("a\0b", 1) == CreateTopicError.INVALID
    assert code("__mine", 1) == CreateTopicError.INVALID
    assert code(PARTITIONS_TOPIC, 1) == CreateTopicError.INVALID
    assert code("cfg", 1, "a line with no setting") == CreateTopicError.INVALID_CONFIG
    assert code("cfg2", 2, "retention.segments.count=2\n# a comment\n\n") == CreateTopicError.OK
    assert code("x" * 255, 1) == CreateTopicError.OK
    assert {t.name for t in client.discover_topics()} == {"orders", "cfg2", "x" * 255}
    assert gw.pmap.partitions("zero") is None and gw.pmap.partitions("cfg") is None


# ---------------------------------------------------------------- produce


def test_produce_error_codes(gw: Gateway, client: TankClient, cfg: NodeConfig) -> None:
    client.create_topic("t", 2)
    with Producer("t", cfg) as producer:
        producer.publish(b"from the mesh")
        assert producer.flush(15)
        mesh_address = producer.address
    wait_until(lambda: len(client.discover_partitions("t")) == 3)
    assert gw.pmap.get("t", 2).address == mesh_address and not gw.pmap.get("t", 2).owned

    codes = client.produce_many(
        [
            ("nope", 0, [b"x"]),
            ("t", 0, [b"ok0"]),
            ("t", 7, [b"x"]),
            ("t", 2, [b"x"]),  # a mesh producer's partition
            (PARTITIONS_TOPIC, 0, [b"x"]),
            ("t", 1, [b"ok1"]),
        ],
        check=False,
    )
    assert codes == {
        ("nope", 0): ProduceError.UNKNOWN_TOPIC,
        ("t", 0): ProduceError.OK,
        ("t", 7): ProduceError.UNKNOWN_PARTITION,
        ("t", 2): ProduceError.NO_LEADER,
        (PARTITIONS_TOPIC, 0): ProduceError.READ_ONLY,
        ("t", 1): ProduceError.OK,
    }
    assert values(consume_all(client, "t", 0)) == [b"ok0"]
    assert values(consume_all(client, "t", 1)) == [b"ok1"]
    assert values(consume_all(client, "t", 2)) == [b"from the mesh"]  # untouched

    # A topic-level error is one byte for all of the topic's partitions.
    s = connect_raw(gw.tank_port)
    try:
        bundle = encode_bundle([(None, TS, None, b"x")])
        parts = [ProducePartition(i, bundle) for i in range(3)]
        for topic, code in (("nope", 0xFF), (PARTITIONS_TOPIC, 0xFE)):
            s.sendall(ProduceRequest(5, [ProduceTopic(topic, parts)]).encode())
            assert recv_frame(s) == (1, U32.pack(5) + bytes([code]))
    finally:
        s.close()


def test_produce_kinds_keys_and_timestamps_reach_tank_and_mesh_consumers(
    gw: Gateway, client: TankClient, cfg: NodeConfig
) -> None:
    client.create_topic("kinds", 1)
    expected: list[tuple[int, bytes | None, bytes]] = []  # (ts, key, value)

    def add(msgs: list[tuple[bytes | None, bytes, int]]) -> list[tuple[bytes | None, bytes, int]]:
        expected.extend((ts, k, v) for k, v, ts in msgs)
        return msgs

    # Produce (0x1): plain and snappy bundles.
    plain = add([(None, b"a", TS), (b"k1", b"b", TS + 1), (b"k2", b"c", TS + 1), (b"", b"d", 5)])
    assert client.produce("kinds", 0, plain, codec=CODEC_NONE) == 0
    snappy = add([(b"k%d" % i if i % 3 == 0 else None, b"snappy-%d " % i * 20, TS + i // 7) for i in range(40)])
    assert client.produce("kinds", 0, snappy, codec=CODEC_SNAPPY) == 0

    # A sparse bundle in a plain Produce: its first seq must be hwm + 1.
    hwm = len(expected)
    sparse_msgs = add([(b"s1", b"sparse-1", TS), (None, b"sparse-2", TS), (None, b"sparse-3", TS + 9)])
    sparse = encode_bundle([(hwm + 1 + i, ts, k, v) for i, (k, v, ts) in enumerate(sparse_msgs)], sparse=True)
    resp = client.request(produce_frame_request(client, "kinds", 0, sparse))
    assert [r.error for t in resp.topics for r in t.partitions] == [0]

    # ProduceWithSeqnum (0x5): plain, snappy, sparse, and a one-message sparse bundle.
    for codec in (CODEC_NONE, CODEC_SNAPPY):
        msgs = add([(b"w", b"with-seq-%d" % codec, TS + 2), (None, b"x" * 300, TS + 3)])
        assert client.produce_with_seqnum("kinds", 0, len(expected) - 1, msgs, codec=codec) == 0
    for n in (1, 3):
        first = len(expected) + 1
        msgs = add([(b"sp", b"seq-sparse-%d" % i, TS + i) for i in range(n)])
        bundle = encode_bundle([(first + i, ts, k, v) for i, (k, v, ts) in enumerate(msgs)], sparse=True)
        req = ProduceWithSeqnumRequest(
            client.next_request_id(), [ProduceTopic("kinds", [ProducePartition(0, bundle, first)])]
        )
        resp = client.request(req)
        assert [r.error for t in resp.topics for r in t.partitions] == [0]

    got = consume_all(client, "kinds", 0)
    assert got == [(i + 1, ts, k, v) for i, (ts, k, v) in enumerate(expected)]
    # Tiny fetches return them one at a time, keys and timestamps included.
    assert consume_all(client, "kinds", 0, fetch_size=1) == got

    # A plain Dafka consumer gets exactly the contents, at offsets seq - 1.
    address = gw.pmap.get("kinds", 0).address
    mesh = mesh_read(cfg, "kinds", len(expected))
    assert [(r.partition, r.offset, r.content) for r in mesh] == [
        (address, i, v) for i, (_ts, _k, v) in enumerate(expected)
    ]


def test_produced_records_go_out_live_on_the_mesh_then_a_head(
    gw: Gateway, client: TankClient, raw_peer: Any
) -> None:
    client.create_topic("live", 1)
    address = gw.pmap.get("live", 0).address
    assert client.produce("live", 0, [b"r0"]) == 0
    peer = raw_peer([wire.P_RECORD + b"live", wire.P_HEAD + b"live"])
    # The gateway announces the heads of its partitions every second: once one
    # arrives, the peer's subscription has reached the gateway.
    peer.wait_for(lambda q: any(h.address == address for h in q.messages(wire.Head)))
    peer.received.clear()
    assert client.produce("live", 0, [(b"key", b"r1", TS), (None, b"r2", TS)]) == 0
    peer.wait_for(lambda q: any(h.sequence == 2 for h in q.messages(wire.Head)))
    # (A periodic HEAD of sequence 0 may still come in: only the new one counts.)
    live = [m for m in peer.messages() if isinstance(m, wire.Record) or isinstance(m, wire.Head) and m.sequence]
    first_head = next(i for i, m in enumerate(live) if isinstance(m, wire.Head))
    records = [(m.subject, m.address, m.sequence, m.content) for m in live[:first_head]]
    assert records == [("live", address, 1, b"r1"), ("live", address, 2, b"r2")]  # contents only
    assert (live[first_head].address, live[first_head].sequence) == (address, 2)


def test_nobody_subscribed_no_records_go_out_only_heads(gw: Gateway, client: TankClient, raw_peer: Any) -> None:
    # No per-record work for the mesh when nobody reads it: the HEAD is enough for a
    # reader that comes later (it FETCHes what it lacks).
    client.create_topic("quiet", 1)
    address = gw.pmap.get("quiet", 0).address
    header = wire.record_prefix(wire.RECORD, "quiet", address, "quiet")
    heads = raw_peer([wire.P_HEAD + b"quiet"])
    heads.wait_for(lambda q: q.peers)
    assert client.produce("quiet", 0, [b"q0", b"q1"]) == 0
    heads.wait_for(lambda q: any(h.sequence == 1 for h in q.messages(wire.Head)))
    assert gw.audience.readers(header) == 0 and gw.records_published == 0
    peer = raw_peer([wire.P_RECORD + b"quiet"])
    peer.wait_for(lambda q: q.peers)
    wait_until(lambda: gw.audience.readers(header) >= 1)
    assert client.produce("quiet", 0, [b"q2"]) == 0
    records = peer.wait_for(lambda q: q.messages(wire.Record))
    assert [(r.sequence, r.content) for r in records] == [(2, b"q2")] and gw.records_published == 1


def test_produced_records_go_out_in_batches_while_every_reader_takes_them(
    gw: Gateway, client: TankClient, raw_peer: Any
) -> None:
    client.create_topic("bl", 1)
    address = gw.pmap.get("bl", 0).address
    header = wire.record_prefix(wire.RECORD, "bl", address, "bl")
    assert client.produce("bl", 0, [b"r0"]) == 0
    # A reader subscribed as dafka readers are (with batch twins) gets one batch.
    dafka_like = raw_peer([wire.BATCH_CAPABLE + b"Mbl", b"Mbl"])
    dafka_like.wait_for(lambda q: q.peers)
    wait_until(lambda: gw.audience.readers(header) >= 1)
    assert client.produce("bl", 0, [b"r1", b"r2", b"r3"]) == 0
    got = dafka_like.wait_for(lambda q: q.messages(wire.RecordBatch))
    assert [(b.sequence, b.contents) for b in got] == [(1, (b"r1", b"r2", b"r3"))]
    # A reader subscribed as C nodes are: from then on both get single records.
    c_like = raw_peer([b"Mbl"])
    c_like.wait_for(lambda q: q.peers)
    wait_until(lambda: gw.audience.readers(header) >= 2)
    assert client.produce("bl", 0, [b"r4", b"r5"]) == 0
    for peer in (c_like, dafka_like):
        records = peer.wait_for(lambda q: len(q.messages(wire.Record)) >= 2 and q.messages(wire.Record))
        assert [(r.sequence, r.content) for r in records] == [(4, b"r4"), (5, b"r5")]
    assert len(dafka_like.messages(wire.RecordBatch)) == 1


def test_produce_with_seqnum_resend_is_idempotent_and_gaps_are_refused(gw: Gateway, client: TankClient) -> None:
    client.create_topic("seq", 2)
    assert client.produce("seq", 0, [b"a", b"b", b"c"]) == 0
    assert client.produce_with_seqnum("seq", 0, 4, [b"d", b"e"]) == 0

    def refused(first_seq: int, msgs: list[bytes]) -> None:
        with pytest.raises(TankError) as err:
            client.produce_with_seqnum("seq", 0, first_seq, msgs)
        assert err.value.code == ProduceError.INVALID_SEQNUM

    refused(4, [b"d", b"e"])  # the exact resend
    refused(5, [b"e", b"f"])  # overlaps the hwm
    refused(1, [b"a"])
    refused(0, [b"zero"])
    refused(7, [b"gap"])  # 6 would be next
    refused(2**64 - 1, [b"far"])

    def sparse_code(seqs: list[int]) -> int:
        bundle = encode_bundle([(s, TS, None, b"sp%d" % s) for s in seqs], sparse=True)
        resp = client.request(produce_frame_request(client, "seq", 0, bundle))
        return resp.topics[0].partitions[0].error

    assert sparse_code([5, 6]) == ProduceError.INVALID_SEQNUM  # starts at or below the hwm
    assert sparse_code([7]) == ProduceError.INVALID_SEQNUM  # starts after a gap
    assert sparse_code([6, 8]) == ProduceError.INVALID_SEQNUM  # a gap inside: Dafka offsets have none
    assert sparse_code([6, 7]) == ProduceError.OK

    # One request, two partitions: each judged on its own.
    bundle = encode_bundle([(None, TS, None, b"h")])
    req = ProduceWithSeqnumRequest(
        client.next_request_id(),
        [ProduceTopic("seq", [ProducePartition(0, bundle, 8), ProducePartition(1, bundle, 5)])],
    )
    resp = client.request(req)
    assert [r.error for r in resp.topics[0].partitions] == [0, ProduceError.INVALID_SEQNUM]
    assert client.discover_partitions("seq") == {0: (1, 8), 1: (0, 0)}
    assert values(consume_all(client, "seq", 0)) == [b"a", b"b", b"c", b"d", b"e", b"sp6", b"sp7", b"h"]


def test_answered_produce_is_on_disk_and_survives_sigkill(cfg: NodeConfig, tmp_path: Path) -> None:
    db = tmp_path / "gw"
    proc, port = start_gateway_process(cfg, db)
    try:
        expected: dict[int, list[bytes]] = {0: [], 1: []}
        with TankClient(HOST, port) as c:
            c.create_topic("dur", 2)
            addresses = {v["partition"]: v["address"] for _k, v in the_map(c)}
            for i in range(12):
                pid = i % 2
                batch = [b"d%d-%d" % (i, j) for j in range(i + 1)]
                assert c.produce("dur", pid, batch) == 0
                expected[pid] += batch
                # Answered means committed: another process reads it at once.
                with RecordDB(db, readonly=True) as rdb:
                    for p in (0, 1):
                        assert rdb.fetch("dur", addresses[p], 0, 1000)[1] == expected[p]
            map_before = the_map(c)
            bounds_before = c.discover_partitions("dur")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with RecordDB(db, readonly=True) as rdb:
            for p in (0, 1):
                assert rdb.fetch("dur", addresses[p], 0, 1000)[1] == expected[p]

        proc, port = start_gateway_process(cfg, db)
        with TankClient(HOST, port) as c:
            assert the_map(c) == map_before  # same ids, same owned addresses
            assert c.discover_partitions("dur") == bounds_before
            for p in (0, 1):
                assert values(consume_all(c, "dur", p)) == expected[p]
            with pytest.raises(TankError) as err:
                c.create_topic("dur", 2)
            assert err.value.code == CreateTopicError.EXISTS
            # Producing goes on at hwm + 1.
            hwm0, hwm1 = bounds_before[0].hwm, bounds_before[1].hwm
            with pytest.raises(TankError):
                c.produce_with_seqnum("dur", 0, hwm0, [b"resent"])
            assert c.produce_with_seqnum("dur", 0, hwm0 + 1, [b"after-0"]) == 0
            assert c.produce("dur", 1, [b"after-1"]) == 0
            assert [(r[0], r[3]) for r in consume_all(c, "dur", 0, hwm0)] == [
                (hwm0, expected[0][-1]),
                (hwm0 + 1, b"after-0"),
            ]
            assert [(r[0], r[3]) for r in consume_all(c, "dur", 1, hwm1 + 1)] == [(hwm1 + 1, b"after-1")]
    finally:
        proc.kill()
        proc.wait(10)


def test_restart_keeps_the_map_mesh_partitions_and_data(cfg: NodeConfig, make_gateway: Any, tmp_path: Path) -> None:
    gw = make_gateway("re")
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("r", 2)
        assert c.produce("r", 0, [b"r0", b"r1"]) == 0
        assert c.produce_with_seqnum("r", 1, 1, [(b"key", b"s1", TS)]) == 0
    with Producer("r", cfg) as producer:
        producer.publish_many([b"m0", b"m1", b"m2"])
        assert producer.flush(15)
    wait_until(lambda: gw.pmap.get("r", 2) is not None)
    before = [(p.topic, p.pid, p.address, p.owned) for p in gw.pmap.order]
    assert before[2] == ("r", 2, producer.address, False)
    gw.close()

    gw = make_gateway("re")  # the same directory
    assert [(p.topic, p.pid, p.address, p.owned) for p in gw.pmap.order] == before
    with TankClient(HOST, gw.tank_port) as c:
        assert c.discover_partitions("r") == {0: (1, 2), 1: (1, 1), 2: (1, 3)}
        assert c.produce("r", 0, [b"r2"]) == 0
        assert c.produce_with_seqnum("r", 1, 2, [b"s2"]) == 0
        assert c.produce_many([("r", 2, [b"no"])], check=False) == {("r", 2): ProduceError.NO_LEADER}
        assert [(r[0], r[2], r[3]) for r in consume_all(c, "r", 0)] == [
            (1, None, b"r0"),
            (2, None, b"r1"),
            (3, None, b"r2"),
        ]
        assert consume_all(c, "r", 1)[0] == (1, TS, b"key", b"s1")
        assert values(consume_all(c, "r", 2)) == [b"m0", b"m1", b"m2"]


# ---------------------------------------------------------------- consume


def test_consume_rules(gw: Gateway, client: TankClient) -> None:
    client.create_topic("c", 2)
    client.create_topic("c2", 1)
    assert client.produce("c", 0, [b"v%d" % i for i in range(1, 6)]) == 0
    assert client.produce("c2", 0, [(b"k", b"other", TS)]) == 0

    r = client.consume("c", 0, 0)
    assert [(m[0], m[3]) for m in r.messages] == [(i, b"v%d" % i) for i in range(1, 6)]
    assert r.next_seq == 6 and r.hwm == 5
    assert [m[3] for m in client.consume("c", 0, 3).messages] == [b"v3", b"v4", b"v5"]

    # Beyond hwm + 1: a boundary check pointing at the first available.
    r = client.consume("c", 0, 7)
    assert r.boundary_check and r.first_avail == 1 and r.hwm == 5 and not r.messages

    # Exactly hwm + 1 with no wait: an empty answer at once, base = first available.
    resp = client.request(ConsumeRequest(client.next_request_id(), [ConsumeTopic("c", [ConsumePartition(0, 6, 1000)])]))
    p = resp.topics[0].partitions[0]
    assert (p.flags, p.base_seq, p.hwm, p.chunk) == (0, 1, 5, b"")

    # At the tail with max_wait: an empty answer when it runs out, base 0.
    started = time.monotonic()
    req = ConsumeRequest(
        client.next_request_id(), [ConsumeTopic("c", [ConsumePartition(0, SEQ_TAIL, 1000)])], max_wait_ms=300
    )
    p = client.request(req).topics[0].partitions[0]
    assert time.monotonic() - started >= 0.28
    assert (p.flags, p.base_seq, p.hwm, p.chunk) == (0, 0, 5, b"")

    # Several topics and partitions in one request.
    req = ConsumeRequest(
        client.next_request_id(),
        [
            ConsumeTopic("c", [ConsumePartition(0, 4, 1000), ConsumePartition(1, 0, 1000), ConsumePartition(9, 0, 1000)]),
            ConsumeTopic("nope", [ConsumePartition(0, 0, 1000), ConsumePartition(1, 0, 1000)]),
            ConsumeTopic("c2", [ConsumePartition(0, 0, 1000)]),
        ],
    )
    resp = client.request(req)
    assert isinstance(resp, ConsumeResponse) and resp.req_id == req.req_id
    c, nope, c2 = resp.topics
    assert (c.name, nope.name, c2.name) == ("c", "nope", "c2")
    assert [(m[0], bytes(m[3])) for m in c.partitions[0].decode_chunk(4).records] == [(4, b"v4"), (5, b"v5")]
    assert (c.partitions[1].flags, c.partitions[1].chunk, c.partitions[1].hwm) == (0, b"", 0)
    assert c.partitions[2].flags == ConsumeFlag.UNKNOWN_PARTITION
    assert nope.unknown and nope.requested_partitions == 2
    assert [(m[0], m[1], bytes(m[2]), bytes(m[3])) for m in c2.partitions[0].decode_chunk().records] == [
        (1, TS, b"k", b"other")
    ]

    # A version 3 request carries an op_flags byte.
    req = ConsumeRequest(
        client.next_request_id(), [ConsumeTopic("c", [ConsumePartition(0, 2, 1000)])], version=3, op_flags=0
    )
    assert req.encode_payload()[15] == 0  # op_flags right after min_bytes
    p = client.request(req).topics[0].partitions[0]
    assert [bytes(m[3]) for m in p.decode_chunk(2).records] == [b"v2", b"v3", b"v4", b"v5"]

    # Bundles are stored and served whole, as the broker serves its log: a chunk may begin
    # before the requested seq (the client skips what precedes it) ...
    resp = client.request(ConsumeRequest(client.next_request_id(), [ConsumeTopic("c", [ConsumePartition(0, 3, 1)])]))
    p = resp.topics[0].partitions[0]
    assert p.base_seq == 1 and [m[0] for m in p.decode_chunk(3).records] == [3, 4, 5]
    assert [m[3] for m in client.consume("c", 0, 3, fetch_size=1).messages] == [b"v3", b"v4", b"v5"]
    # ... and a tiny fetch size still makes progress, one whole bundle at a time.
    for bundle in ([b"a"], [b"b", b"c"], [b"d"]):
        assert client.produce("c", 1, bundle) == 0
    seq, got = 1, []
    for _ in range(3):
        r = client.consume("c", 1, seq, fetch_size=1)
        got.append([m[3] for m in r.messages])
        seq = r.next_seq
    assert got == [[b"a"], [b"b", b"c"], [b"d"]] and seq == 5


@pytest.mark.parametrize("budget", [None, 30], ids=["whole", "sliced"])
def test_a_stored_sparse_bundle_with_gaps_is_consumed_at_its_own_seqs(make_gateway: Any, tmp_path: Path,
                                                                       budget: int | None) -> None:
    """A sparse bundle with gaps inside (offsets 10, 11, 14, 15, 19; as the gateway stored
    some before 29c6a24), consumed from every seq.  Whole, the client reads the bundle's own
    seqs; sliced (a bundle over the answer's budget), its records were labelled by position
    from the seq asked for: a consume at seq 13 (offset 12, a gap) got r14 as seq 13.  A
    bundle whose own seqs are not its offsets + 1 goes sliced: sent whole, the client read it
    at the seqs the bundle names."""
    addresses = created_partitions(make_gateway, "sp")
    with RecordDB(tmp_path / "sp", sync=False) as db:
        held = sparse_partition(db, "sp", addresses[0])
        # The bundle of the produce 29c6a24 refuses: seqs 0 and 2, given offset 0 by a
        # ProduceWithSeqnum at seq 1: stored as offsets 0 and 2 (seqs 1 and 3), its own seqs
        # one below.  Sent whole, a client read s0 at seq 0, before the seq it asked for.
        bundle = encode_bundle([(0, TS, None, b"s0"), (2, TS, None, b"s2")], sparse=True)
        db.append_blocks([("sp", addresses[1], tank_block(bundle, 0))])
    gw = make_gateway("sp", **({} if budget is None else {"limits": GatewayLimits(max_answer_bytes=budget)}))
    with TankClient(HOST, gw.tank_port) as c:
        for seq in range(1, 23):
            got = consume_all(c, "sp", 0, seq)
            assert [(r[0], r[3]) for r in got] == [(o + 1, b"r%d" % o) for o in held if o + 1 >= seq], seq
        for seq in range(1, 4):
            got = consume_all(c, "sp", 1, seq)
            assert [(r[0], r[3]) for r in got] == [(q, v) for q, v in [(1, b"s0"), (3, b"s2")] if q >= seq], seq


@pytest.mark.parametrize(("body", "seq", "budget"), [
    (b"\x40" + b"\x80" * 13, 1, None),  # sparse, its count a varint of more than 5 bytes: relayed whole
    (b"\x44\x01\x02\x03", 1, None),  # sparse, one message, its first seq cut short: relayed whole
    (b"\x40" + b"\x80" * 13, 2, 8),  # over the answer's budget: converted, which fails
], ids=["count-varint", "truncated-seq", "converted"])
def test_a_stored_bundle_that_cannot_be_read_costs_its_partition_only(
        make_gateway: Any, tmp_path: Path, body: bytes, seq: int, budget: int | None) -> None:
    """A stored Tank bundle whose header cannot be read (a damaged store: blocks are checked
    when they are written) in a consume of two partitions.  Reading a sparse bundle's first
    seq (279d31f) raised, and so does converting it: the connection was closed as if the client
    had sent bad input, the other partition's records never went, and every consume touching
    the bundle cost the client its connection.  Now the bundle is relayed as stored (as before
    279d31f), or its partition alone is answered with a system error."""
    addresses = created_partitions(make_gateway, "cx")
    with RecordDB(tmp_path / "cx", sync=False) as db:
        db.append_blocks([("cx", addresses[0], tank_block(encode_bundle([(None, TS, None, b"a")]), 0))])
        db.append_blocks([("cx", addresses[0], _seal(CODEC_TANK, 0, 1, 1, 1, TS, TS, body))])  # unchecked
        db.append_blocks([("cx", addresses[1], tank_block(encode_bundle([(None, TS, None, b"b")]), 0))])
    gw = make_gateway("cx", **({} if budget is None else {"limits": GatewayLimits(max_answer_bytes=budget)}))
    with TankClient(HOST, gw.tank_port) as c:
        damaged, other = consume_both(c, "cx", seq)
        assert [m[3] for m in other.decode_chunk().records] == [b"b"]
        if budget is None:
            assert damaged.flags == ConsumeFlag.OK and damaged.chunk.endswith(body)  # as stored
        else:
            assert damaged.flags == ConsumeFlag.SYSTEM_ERROR
        assert values(c.consume("cx", 1, 1).messages) == [b"b"]  # the connection goes on


def test_long_poll_does_not_hold_up_later_requests_on_its_connection(gw: Gateway, client: TankClient) -> None:
    client.create_topic("lp", 1)
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(consume_frame(1, "lp", 0, SEQ_TAIL, max_wait_ms=60_000))
        s.sendall(StatusRequest(2).encode())
        s.sendall(produce_frame(3, "lp", 0, encode_bundle([(None, TS, b"key", b"new")])))
        # Answers come out of order, matched by request id.
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.STATUS and StatusResponse.decode(payload).req_id == 2
        assert recv_frame(s) == (1, U32.pack(3) + b"\x00")
        msg_id, payload = recv_frame(s)
        resp = ConsumeResponse.decode(payload)
        assert msg_id == MsgId.CONSUME and resp.req_id == 1
        p = resp.topics[0].partitions[0]
        assert (p.flags, p.base_seq, p.hwm) == (0, 1, 1)
        assert [(m[0], m[1], bytes(m[2]), bytes(m[3])) for m in p.decode_chunk().records] == [(1, TS, b"key", b"new")]
    finally:
        s.close()
    # TankClient's send/wait does the same.
    rid = client.send(
        ConsumeRequest(client.next_request_id(), [ConsumeTopic("lp", [ConsumePartition(0, SEQ_TAIL, 1000)])], max_wait_ms=60_000)
    )
    assert client.produce("lp", 0, [b"second"]) == 0
    p = client.wait(rid).topics[0].partitions[0]
    assert [(m[0], bytes(m[3])) for m in p.decode_chunk().records] == [(2, b"second")]


def test_min_bytes_keeps_a_long_poll_parked(gw: Gateway, client: TankClient) -> None:
    client.create_topic("mb", 1)
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(consume_frame(1, "mb", 0, SEQ_TAIL, max_wait_ms=60_000, min_bytes=100))
        assert client.produce("mb", 0, [b"x" * 10]) == 0
        # A premature answer would have been written with the produce's; Status
        # goes after it, so whatever arrived first would show up here.
        s.sendall(StatusRequest(2).encode())
        assert recv_frame(s)[0] == MsgId.STATUS
        assert client.produce("mb", 0, [b"y" * 200]) == 0
        msg_id, payload = recv_frame(s)
        p = ConsumeResponse.decode(payload).topics[0].partitions[0]
        assert msg_id == MsgId.CONSUME
        assert [(m[0], bytes(m[3])) for m in p.decode_chunk().records] == [(1, b"x" * 10), (2, b"y" * 200)]
    finally:
        s.close()
    # min_bytes not reached by max_wait: what there is, when the wait runs out.
    started = time.monotonic()
    rid = client.send(
        ConsumeRequest(
            client.next_request_id(), [ConsumeTopic("mb", [ConsumePartition(0, SEQ_TAIL, 1000)])],
            max_wait_ms=400, min_bytes=10_000,
        )
    )
    assert client.produce("mb", 0, [b"z"]) == 0
    p = client.wait(rid).topics[0].partitions[0]
    assert time.monotonic() - started >= 0.38
    assert [(m[0], bytes(m[3])) for m in p.decode_chunk().records] == [(3, b"z")]


def test_parked_consumes_that_cannot_reach_min_bytes_do_not_read_the_store_again_at_every_commit(
    gw: Gateway, client: TankClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consume waiting at a partition's tail (parked) for min_bytes was answered anew at
    every commit to that partition, its other partitions read again each time.  Before the
    fix a client parking consumes with a min_bytes they never reach, naming a partition with
    a backlog (1 MiB read and thrown away each time) and one a tiny produce wakes, made each
    such produce cost the gateway as many answers (200 parked: 3 ms a produce became 120 ms,
    every client stalled).  Now a woken consume is answered only once the bytes stored since
    it parked (partition metadata) can make min_bytes with what it had, or at max_wait."""
    client.create_topic("idle", 1)
    client.create_topic("backlog", 1)
    client.produce("backlog", 0, [b"b%05d" % i + b"z" * 50 for i in range(20_000)])
    client.produce("idle", 0, [b"x"])
    reads: list[int] = []
    read_blocks = gw.db.read_blocks

    def counted(*args: Any, **kw: Any) -> Any:
        reads.append(args[2])
        return read_blocks(*args, **kw)

    monkeypatch.setattr(gw.db, "read_blocks", counted)
    n = 50
    hog = connect_raw(gw.tank_port)
    s = connect_raw(gw.tank_port)
    try:
        for i in range(n):
            hog.sendall(ConsumeRequest(i + 1, [ConsumeTopic("idle", [ConsumePartition(0, SEQ_TAIL, 1 << 20)]),
                                               ConsumeTopic("backlog", [ConsumePartition(0, 1, 1 << 20)])],
                                       "", 60_000, 2**31 - 1).encode())
        wait_until(lambda: len(gw._parked_all) == n, 20)
        before = len(reads)
        for _ in range(10):
            assert client.produce("idle", 0, [b"y"]) == 0
        # Long polls on the same partition are answered when they should: min_bytes 1 as soon
        # as a message comes (even an empty one), min_bytes 2500 once that much came.
        s.sendall(consume_frame(1, "idle", 0, SEQ_TAIL, max_wait_ms=60_000, min_bytes=1))
        wait_until(lambda: len(gw._parked_all) == n + 1, 20)
        assert client.produce("idle", 0, [b""]) == 0
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.CONSUME and ConsumeResponse.decode(payload).req_id == 1
        s.sendall(consume_frame(2, "idle", 0, SEQ_TAIL, max_wait_ms=60_000, min_bytes=2500))
        wait_until(lambda: len(gw._parked_all) == n + 1, 20)
        assert client.produce("idle", 0, [b"w" * 1000]) == 0
        assert client.produce("idle", 0, [b"w" * 1000]) == 0
        s.sendall(StatusRequest(3).encode())  # a premature answer would come before Status's
        assert recv_frame(s)[0] == MsgId.STATUS
        assert client.produce("idle", 0, [b"w" * 1000]) == 0
        msg_id, payload = recv_frame(s)
        p = ConsumeResponse.decode(payload).topics[0].partitions[0]
        assert msg_id == MsgId.CONSUME and [bytes(m[3]) for m in p.decode_chunk().records] == [b"w" * 1000] * 3
    finally:
        s.close()
        hog.close()
    assert len(reads) - before < n  # before: 10 produces x 50 parked consumes read the backlog again


def test_parked_fetches_of_a_closed_connection_are_dropped(gw: Gateway, client: TankClient) -> None:
    client.create_topic("idle", 1)
    for _ in range(3):
        with TankClient(HOST, gw.tank_port) as c:
            c.send(ConsumeRequest(c.next_request_id(), [ConsumeTopic("idle", [ConsumePartition(0, SEQ_TAIL, 100)])], max_wait_ms=2**40))
            c.status()  # the consume is parked by now
    wait_until(lambda: gw.connections == 1)
    client.status()
    assert not gw._parked_all and not gw._parked  # nothing waits for weeks on a dead socket


def test_a_dafka_producer_publishes_and_tank_clients_fetch(gw: Gateway, client: TankClient, cfg: NodeConfig) -> None:
    with Producer("mesh", cfg) as producer:
        producer.publish_many(b"r%d" % i for i in range(30))
        assert producer.flush(15)
        wait_until(lambda: client.discover_partitions("mesh") == {0: (1, 30)})
        assert gw.pmap.get("mesh", 0).address == producer.address

        got = consume_all(client, "mesh", 0)
        assert [(m[0], m[2], m[3]) for m in got] == [(i + 1, None, b"r%d" % i) for i in range(30)]
        assert consume_all(client, "mesh", 0, fetch_size=1) == got

        rid = client.send(
            ConsumeRequest(client.next_request_id(), [ConsumeTopic("mesh", [ConsumePartition(0, SEQ_TAIL, 1 << 20)])], max_wait_ms=30_000)
        )
        assert client.status().version == TANK_VERSION  # the connection is free meanwhile
        producer.publish(b"live")
        p = client.wait(rid, 20).topics[0].partitions[0]
        assert [(m[0], bytes(m[3])) for m in p.decode_chunk().records] == [(31, b"live")]


# ---------------------------------------------------------------- discovery and admin


def test_discover_status_topology_and_reload_conf(gw: Gateway, client: TankClient) -> None:
    client.create_topic("d", 3)
    assert client.produce("d", 1, [b"a", b"b"]) == 0
    assert client.discover_partitions("d") == {0: (0, 0), 1: (1, 2), 2: (0, 0)}
    assert client.discover_partitions("d", [1, 7]) == {1: (1, 2), 7: (0, 0)}
    with pytest.raises(UnknownTopicError):
        client.discover_partitions("nope")
    resp = client.request(DiscoverPartitionsRequest(client.next_request_id(), "nope"))
    assert isinstance(resp, DiscoverPartitionsResponse) and resp.partitions == []
    assert client.discover_partitions(PARTITIONS_TOPIC) == {0: (1, 3)}

    assert client.discover_topics() == [TopicInfo("d", True, 3)]
    status = client.status()
    assert status.version == TANK_VERSION == 400
    assert (status.topics, status.partitions, status.cluster_aware) == (1, 3, False)
    assert abs(status.startup_ts - time.time()) < 60
    assert client.discover_topology().standalone

    for topic, pid in (("d", 0), ("nope", 0), ("d", 99)):
        with pytest.raises(TankError) as err:
            client.reload_conf(topic, pid)
        assert err.value.code not in (None, 0)
    assert client.status().version == 400  # still usable


def test_client_ping_is_not_answered_and_changes_nothing(gw: Gateway) -> None:
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(Ping().encode() * 3 + StatusRequest(4).encode())
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.STATUS and StatusResponse.decode(payload).req_id == 4
    finally:
        s.close()


def test_partitions_topic_lists_the_map(gw: Gateway, client: TankClient, cfg: NodeConfig) -> None:
    assert the_map(client) == []
    client.create_topic("a", 2)
    with Producer("a", cfg) as producer:
        producer.publish(b"m")
        assert producer.flush(15)
    wait_until(lambda: len(the_map(client)) == 3)
    owned = [p.address for p in gw.pmap.partitions("a")[:2]]
    assert the_map(client) == [
        (b"a", {"address": owned[0], "owned": True, "partition": 0, "topic": "a"}),
        (b"a", {"address": owned[1], "owned": True, "partition": 1, "topic": "a"}),
        (b"a", {"address": producer.address, "owned": False, "partition": 2, "topic": "a"}),
    ]
    # A long poll on the map is answered when it grows.
    rid = client.send(
        ConsumeRequest(client.next_request_id(), [ConsumeTopic(PARTITIONS_TOPIC, [ConsumePartition(0, SEQ_TAIL, 1 << 20)])], max_wait_ms=30_000)
    )
    with TankClient(HOST, gw.tank_port) as other:
        other.create_topic("b", 1)
    p = client.wait(rid).topics[0].partitions[0]
    [(seq, _ts, key, value)] = p.decode_chunk().records
    assert (seq, bytes(key)) == (4, b"b")
    assert json.loads(bytes(value)) == {"address": gw.pmap.get("b", 0).address, "owned": True, "partition": 0, "topic": "b"}
    with pytest.raises(TankError) as err:
        client.consume(PARTITIONS_TOPIC, 1, 0)
    assert err.value.code == ConsumeFlag.UNKNOWN_PARTITION


# ---------------------------------------------------------------- load


def test_a_client_that_does_not_read_its_answers_is_paused(gw: Gateway, client: TankClient) -> None:
    client.create_topic("big", 1)
    records = [os.urandom(100_000) for _ in range(40)]  # one answer: 4 MB
    for i in range(0, 40, 10):
        assert client.produce("big", 0, records[i : i + 10], codec=CODEC_NONE) == 0
    n = 25  # 100 MB of answers, over the 32 MiB a connection may have queued
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(b"".join(consume_frame(i + 1, "big", 0, 1, 4 << 20) for i in range(n)))

        def slow() -> Any:
            conns = [c for c in list(gw._conns.values()) if c.out_size]
            return conns and not conns[0].reading and conns[0]

        conn = wait_until(slow)
        # Others are served meanwhile; and once this is answered the I/O thread
        # is past the read that paused the slow connection.
        assert client.status().version == TANK_VERSION
        # Paused at the limit: the rest of its pipelined requests wait, unanswered;
        # answers made near the limit are cut short (whole bundles, at least one: 1 MB here).
        assert conn.out_size <= gw.limits.max_output_bytes + 1_100_000
        full = 0
        for i in range(n):
            msg_id, payload = recv_frame(s)
            resp = ConsumeResponse.decode(payload)
            assert msg_id == MsgId.CONSUME and resp.req_id == i + 1
            got = [bytes(r[3]) for r in resp.topics[0].partitions[0].decode_chunk(1).records]
            assert got and got == records[: len(got)]
            full += got == records
        assert full >= gw.limits.max_output_bytes // 4_000_000
        assert client.status().version == TANK_VERSION
    finally:
        s.close()


def test_many_connections_produce_at_once(gw: Gateway, client: TankClient) -> None:
    client.create_topic("many", 4)
    n_clients, n_requests, per_request = 20, 10, 20
    barrier = threading.Barrier(n_clients)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with TankClient(HOST, gw.tank_port) as c:
                barrier.wait(10)
                for j in range(n_requests):
                    msgs = [b"%d-%d-%d" % (i, j, k) for k in range(per_request)]
                    assert c.produce("many", i % 4, msgs) == 0
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    total = 0
    for pid in range(4):
        got = values(consume_all(client, "many", pid))
        total += len(got)
        for i in range(pid, n_clients, 4):
            mine = [v for v in got if v.startswith(b"%d-" % i)]
            assert mine == [b"%d-%d-%d" % (i, j, k) for j in range(n_requests) for k in range(per_request)]
    assert total == n_clients * n_requests * per_request


# ---------------------------------------------------------------- bad input


def witness(gw: Gateway) -> tuple[TankClient, list[bytes]]:
    """A connection that must keep working, and acknowledged data that must stay."""
    c = TankClient(HOST, gw.tank_port)
    c.create_topic("keep", 1)
    kept = [b"kept-%d" % i for i in range(5)]
    assert c.produce("keep", 0, kept) == 0
    return c, kept


def intact(gw: Gateway, kept: list[bytes]) -> bool:
    with TankClient(HOST, gw.tank_port) as c:
        return values(consume_all(c, "keep", 0)) == kept


_BUNDLE = encode_bundle([(None, TS, None, b"never")])
_PRODUCE_PAYLOAD = produce_frame(1, "keep", 0, _BUNDLE)[5:]
_CONSUME_PAYLOAD = consume_frame(1, "keep", 0, 0)[5:]


@pytest.mark.parametrize(
    ("data", "answers"),
    [
        pytest.param(frame_header(MsgId.PRODUCE, 5000) + b"x" * 100, 0, id="frame-over-the-limit"),
        pytest.param(frame_header(MsgId.CONSUME, 0xFFFFFFFF), 0, id="frame-of-4GiB"),
        pytest.param(encode_frame(0x42, b"abc"), 0, id="unknown-msgid"),
        pytest.param(encode_frame(0x00, b""), 0, id="msgid-0"),
        pytest.param(encode_frame(MsgId.OBSOLETE_REPLICA_ID, b"\0" * 8), 0, id="obsolete-0x4"),
        pytest.param(encode_frame(MsgId.CONSUME_PEER, b"\0" * 8), 0, id="consume-peer-0x9"),
        pytest.param(encode_frame(MsgId.PRODUCE, _PRODUCE_PAYLOAD[:-3]), 0, id="truncated-produce"),
        pytest.param(produce_frame(1, "keep", 0, b"\x87" + _BUNDLE[1:]), 0, id="bundle-flags-bit-7"),
        pytest.param(produce_frame(1, "keep", 0, b"\x07" + _BUNDLE[1:]), 0, id="bundle-codec-3"),
        pytest.param(produce_frame(1, "keep", 0, b"\x05" + _BUNDLE[1:]), 0, id="bad-snappy"),
        pytest.param(produce_frame(1, "keep", 0, _BUNDLE[:-1]), 0, id="short-bundle"),
        pytest.param(produce_frame(1, "keep", 0, b""), 0, id="empty-bundle"),
        pytest.param(produce_frame(1, "keep", 0, b"\x0c" + CAPTURED_BUNDLE[1:]), 0, id="bundle-count-too-high"),
        pytest.param(produce_frame(1, "keep", 0, CAPTURED_BUNDLE + b"\x00"), 0, id="bundle-trailing-byte"),
        pytest.param(produce_frame(1, "keep", 0, b"\x01\x08\x80\x80\x80\x30" + bytes(10)), 0, id="snappy-bomb"),
        pytest.param(
            produce_frame(1, "keep", 0, b"\x4c" + struct.pack("<Q", 1) + b"\x00" + b"\x00" + TS_LE + b"\x01a"
                          + b"\x06\x01b" + b"\x06\x01c"),
            0, id="sparse-seqs-lie",
        ),
        pytest.param(encode_frame(MsgId.CONSUME, _CONSUME_PAYLOAD + b"\0"), 0, id="trailing-byte"),
        pytest.param(encode_frame(MsgId.PING, b"x"), 0, id="ping-with-payload"),
        pytest.param(encode_frame(MsgId.STATUS, b"\x01"), 0, id="short-status"),
        pytest.param(encode_frame(MsgId.CREATE_TOPIC, U32.pack(1) + b"\x02\xff\xfe" + b"\x01\x00\x00"), 0, id="non-utf8-topic"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: gateway\r\n\r\n", 0, id="http"),
        pytest.param(StatusRequest(7).encode() + encode_frame(0x42, b""), 1, id="valid-then-unknown"),
    ],
)
def test_bad_input_closes_only_that_connection(make_gateway: Any, data: bytes, answers: int) -> None:
    gw = make_gateway(limits=GatewayLimits(max_request_bytes=4096, request_timeout=0.5))
    w, kept = witness(gw)
    try:
        bad_before = gw.bad_input.count
        s = connect_raw(gw.tank_port)
        s.sendall(data)
        got = read_until_closed(s)
        s.close()
        frames = _frames(got)
        assert len(frames) == answers and all(f[0] == MsgId.STATUS for f in frames)
        wait_until(lambda: gw.bad_input.count > bad_before)  # counted as it closes
        assert w.status().version == 400  # the other connection goes on
        wait_until(lambda: gw.connections == 1)
        assert intact(gw, kept)
        assert w.produce("keep", 0, [b"more"]) == 0
    finally:
        w.close()


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    fb = FrameBuffer()
    fb.feed(data)
    frames = list(fb)
    assert fb.buffered == 0, f"{fb.buffered} bytes of a cut frame"
    return frames


def test_consume_of_partition_0xffff_closes_the_connection(gw: Gateway, client: TankClient) -> None:
    # In a consume answer a u16 0xffff where a partition id goes means "unknown
    # topic", so an answer about partition 0xffff cannot be written: the
    # gateway closes the connection as for a malformed request (no id is ever 0xffff).
    client.create_topic("p", 1)
    s = connect_raw(gw.tank_port)
    s.sendall(consume_frame(1, "p", 0xFFFF, 0))
    assert read_until_closed(s) == b""
    s.close()
    assert client.status().version == 400
    # Produce and discover answers can say it: unknown partition, empty bounds.
    assert client.produce_many([("p", 0xFFFF, [b"x"])], check=False) == {("p", 0xFFFF): 1}
    assert client.discover_partitions("p", [0xFFFF]) == {0xFFFF: (0, 0)}


def test_a_malformed_bundle_writes_nothing_of_its_request(gw: Gateway, client: TankClient) -> None:
    client.create_topic("half", 2)
    good = encode_bundle([(None, TS, None, b"good")])
    req = ProduceRequest(
        1, [ProduceTopic("half", [ProducePartition(0, good), ProducePartition(1, b"\x04\x00\x01")])]
    )
    s = connect_raw(gw.tank_port)
    s.sendall(req.encode())
    assert read_until_closed(s) == b""
    s.close()
    assert client.discover_partitions("half") == {0: (0, 0), 1: (0, 0)}


def test_a_stalled_half_frame_is_closed(make_gateway: Any) -> None:
    gw = make_gateway(limits=GatewayLimits(request_timeout=0.5))
    w, kept = witness(gw)
    try:
        s = connect_raw(gw.tank_port)
        frame = StatusRequest(3).encode()
        started = time.monotonic()
        s.sendall(frame[:7])  # header and half the payload, then nothing
        assert read_until_closed(s, timeout=10) == b""
        assert time.monotonic() - started >= 0.45
        s.close()
        # A half header stalls the same way.
        s = connect_raw(gw.tank_port)
        s.sendall(b"\x0a\x04")
        assert read_until_closed(s, timeout=10) == b""
        s.close()
        assert w.status().version == 400 and intact(gw, kept)
    finally:
        w.close()


# ---------------------------------------------------------------- fuzzing


def _base_frames() -> list[bytes]:
    bundle = encode_bundle([(None, TS, b"k", b"fuzz")])
    sparse = encode_bundle([(1, TS, None, b"a"), (2, TS, None, b"b")], sparse=True)
    snappy = encode_bundle([(None, TS, None, b"s" * 50)] * 30, codec=CODEC_SNAPPY)
    return [
        ProduceRequest(1, [ProduceTopic("fz", [ProducePartition(0, bundle), ProducePartition(1, snappy)])]).encode(),
        ProduceRequest(2, [ProduceTopic("fz", [ProducePartition(1, sparse)])]).encode(),
        ProduceWithSeqnumRequest(3, [ProduceTopic("fz", [ProducePartition(0, bundle, 1)])]).encode(),
        ProduceRequest(4, [ProduceTopic(PARTITIONS_TOPIC, [ProducePartition(0, bundle)])]).encode(),
        consume_frame(5, "fz", 0, 0),
        consume_frame(6, "fz", 1, SEQ_TAIL, max_wait_ms=50),
        consume_frame(7, PARTITIONS_TOPIC, 0, 0),
        ConsumeRequest(8, [ConsumeTopic("fz", [ConsumePartition(0, 1, 10)]), ConsumeTopic("x", [])], version=3).encode(),
        DiscoverPartitionsRequest(9, "fz", [0, 1, 5]).encode(),
        CreateTopicRequest(10, "fz-new", 2, "a=b\n").encode(),
        ReloadConfRequest(11, "fz", 0).encode(),
        StatusRequest(12).encode(),
        DiscoverTopicsRequest(13).encode(),
        DiscoverTopologyRequest(14).encode(),
        Ping().encode(),
        encode_frame(MsgId.CREATE_TOPIC, U32.pack(15) + encode_str8("fz") + b"\x01\x00\x00"),
    ]


BASE_FRAMES = _base_frames()


@st.composite
def mutated_frame(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(BASE_FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete", "length", "msgid"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[pos] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFE, 0xFF]))
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif kind == "length" and len(data) >= 5:
            # Keep the frame consistent with its new payload length, or lie about it.
            data[1:5] = U32.pack(draw(st.sampled_from([len(data) - 5, len(data) - 4, len(data) - 6, 0])) & 0xFFFFFFFF)
        elif kind == "msgid" and data:
            data[0] = draw(st.integers(0, 255))
    return bytes(data)


# Well-formed requests with arbitrary field values: they get past the decoders
# and exercise the gateway's own handling ("keep" is never written to).
fz_topics = st.sampled_from(["fz", "fz", "fz", "nope", PARTITIONS_TOPIC, "", "keep"]) | st.text(max_size=6)
pids = st.integers(0, 3) | st.sampled_from([0xFFFE, 0xFFFF])
u32s = st.sampled_from([0, 1, 2, 64, 1 << 20, 0xFFFFFFFF]) | st.integers(0, 0xFFFFFFFF)
u64s = st.sampled_from([0, 1, 2, 3, 10, SEQ_TAIL, SEQ_TAIL - 1, 1 << 63]) | st.integers(0, 2**64 - 1)
fz_records = st.lists(
    st.tuples(st.none(), st.integers(0, 2**64 - 1), st.none() | st.binary(max_size=8), st.binary(max_size=40)),
    min_size=1,
    max_size=20,
)


@st.composite
def fz_bundle(draw: st.DrawFn) -> bytes:
    records = draw(fz_records)
    codec = draw(st.sampled_from([CODEC_NONE, CODEC_SNAPPY]))
    if not draw(st.booleans()):
        return encode_bundle(records, codec=codec)
    seq = draw(st.integers(0, 12))
    sparse = []
    for r in records:
        sparse.append((seq, *r[1:]))
        seq += 1 + draw(st.sampled_from([0, 0, 0, 1, 2]))
    return encode_bundle(sparse, sparse=True, codec=codec)


@st.composite
def valid_request(draw: st.DrawFn, req_id: int) -> Any:
    kind = draw(st.sampled_from(["produce", "produce-seq", "consume", "discover", "create", "reload", "other"]))
    if kind in ("produce", "produce-seq"):
        with_seq = kind == "produce-seq"
        topics = [
            ProduceTopic(
                draw(fz_topics.filter(lambda t: t != "keep")),
                [
                    ProducePartition(draw(pids), draw(fz_bundle()), draw(st.integers(0, 14) | u64s) if with_seq else None)
                    for _ in range(draw(st.integers(0, 3)))
                ],
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        cls = ProduceWithSeqnumRequest if with_seq else ProduceRequest
        return cls(req_id, topics, draw(st.text(max_size=4)), draw(st.integers(0, 255)), draw(u32s))
    if kind == "consume":
        topics = [
            ConsumeTopic(
                draw(fz_topics),
                # (0xffff is left out: see test_consume_of_partition_0xffff_closes_the_connection)
                [ConsumePartition(draw(pids.filter(lambda p: p != 0xFFFF)), draw(u64s), draw(u32s))
                 for _ in range(draw(st.integers(0, 3)))],
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        version = draw(st.integers(0, 5))
        op_flags = draw(st.integers(0, 255)) if version >= 3 else 0
        # Short waits only: every request here must be answered.
        return ConsumeRequest(req_id, topics, "", draw(st.sampled_from([0, 1, 30])), draw(u32s), version, op_flags)
    if kind == "discover":
        return DiscoverPartitionsRequest(req_id, draw(fz_topics), draw(st.lists(pids, max_size=6)))
    if kind == "create":
        config = draw(st.sampled_from(["", "a=b", "bad", "# c\nx=1\n"]) | st.text(max_size=10))
        name = draw(fz_topics.filter(lambda t: t != "nope"))  # "nope" stays unknown
        return CreateTopicRequest(req_id, name, draw(st.integers(0, 4) | st.just(0xFFFF)), config)
    if kind == "reload":
        return ReloadConfRequest(req_id, draw(fz_topics), draw(pids))
    cls = draw(st.sampled_from([DiscoverTopicsRequest, DiscoverTopologyRequest, StatusRequest]))
    return StatusRequest(req_id) if cls is StatusRequest else cls(req_id, draw(st.integers(0, 255)))


@st.composite
def valid_requests(draw: st.DrawFn) -> list[Any]:
    base = draw(st.integers(0, 0xFFFFFFFF - 10))
    return [draw(valid_request(base + i)) for i in range(draw(st.integers(1, 4)))]


random_frame = st.builds(
    lambda msg_id, payload: encode_frame(msg_id, payload),
    st.integers(0, 255) | st.sampled_from([1, 2, 5, 6, 7, 8, 0xA, 0xB, 0xC]),
    st.binary(max_size=300),
)
fuzz_input = st.lists(
    mutated_frame()
    | random_frame
    | st.sampled_from(BASE_FRAMES)
    | st.binary(min_size=1, max_size=200),
    min_size=1,
    max_size=4,
).map(b"".join)

_RESPONSE_IDS = {1, 2, 3, 6, 7, 8, 0xA, 0xB, 0xC}


def check_answers(data: bytes) -> None:
    """Whatever the gateway answered is well-formed Tank (a last frame may be cut by the close)."""
    fb = FrameBuffer()
    fb.feed(data)
    for msg_id, payload in fb:
        assert msg_id in _RESPONSE_IDS, msg_id
        if msg_id == MsgId.CONSUME:
            ConsumeResponse.decode(payload)  # no flag a Tank client would choke on
        elif msg_id == MsgId.PRODUCE:
            assert len(payload) >= 4
        elif msg_id == MsgId.PING:
            assert payload == b""
        else:
            {
                MsgId.DISCOVER_PARTITIONS: DiscoverPartitionsResponse,
                MsgId.CREATE_TOPIC: CreateTopicResponse,
                MsgId.RELOAD_CONF: ReloadConfResponse,
                MsgId.STATUS: StatusResponse,
                MsgId.DISCOVER_TOPICS: DiscoverTopicsResponse,
                MsgId.DISCOVER_TOPOLOGY: DiscoverTopologyResponse,
            }[msg_id].decode(payload)


def test_fuzzed_requests_only_ever_close_their_own_connection(
    make_gateway: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gw = make_gateway(limits=GatewayLimits(max_request_bytes=1 << 16))
    w, kept = witness(gw)
    w.create_topic("fz", 2)

    @settings(max_examples=300)
    @given(fuzz_input)
    def run(data: bytes) -> None:
        s = connect_raw(gw.tank_port)
        try:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)  # then the gateway sees the end of the stream
            except (BrokenPipeError, ConnectionResetError):
                pass  # it closed already
            check_answers(read_until_closed(s))
        finally:
            s.close()
        assert w.status().version == 400

    with caplog.at_level(logging.WARNING, "dafka"):
        run()
        assert gw.running
        wait_until(lambda: gw.connections == 1)
        assert intact(gw, kept)
        assert w.produce("keep", 0, [b"after"]) == 0
        assert intact(gw, [*kept, b"after"])
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bugs, [r.getMessage() for r in bugs]
    w.close()


def check_semantics(request: Any, resp: Any) -> None:
    """What the answers about the topics of known state must say.

    "fz" has two gateway partitions, "nope" never exists, the map topic has
    one read-only partition; other (random) topics may come and go.
    """
    if isinstance(request, ProduceRequest):
        for topic, pid, code, _leader in resp.per_partition(request):
            if topic == PARTITIONS_TOPIC:
                assert code == ProduceError.READ_ONLY
            elif topic == "nope":
                assert code == ProduceError.UNKNOWN_TOPIC
            elif topic == "fz":
                ok = {ProduceError.UNKNOWN_PARTITION} if pid >= 2 else {ProduceError.OK, ProduceError.INVALID_SEQNUM}
                assert code in ok, (topic, pid, code)
    elif isinstance(request, ConsumeRequest):
        assert [t.name for t in resp.topics] == [t.name for t in request.topics]
        for treq, tres in zip(request.topics, resp.topics, strict=True):
            if treq.name == "nope":
                assert tres.unknown and tres.requested_partitions == len(treq.partitions)
                continue
            if treq.name not in ("fz", "keep", PARTITIONS_TOPIC):
                continue
            assert not tres.unknown
            assert [p.partition for p in tres.partitions] == [p.partition for p in treq.partitions]
            count = 1 if treq.name in ("keep", PARTITIONS_TOPIC) else 2
            for preq, pres in zip(treq.partitions, tres.partitions, strict=True):
                if preq.partition >= count:
                    assert pres.flags == ConsumeFlag.UNKNOWN_PARTITION
                    continue
                assert pres.flags in (ConsumeFlag.OK, ConsumeFlag.BOUNDARY_CHECK)
                if pres.flags == ConsumeFlag.OK and pres.chunk:
                    floor = 0 if preq.seq in (0, SEQ_TAIL) else preq.seq
                    got = pres.decode_chunk(floor).records
                    assert got and all(floor <= r[0] <= pres.hwm for r in got)
    elif isinstance(request, DiscoverPartitionsRequest):
        if request.topic == "nope":
            assert resp.partitions == []
        elif request.topic == "fz":
            assert len(resp.partitions) == (len(request.partitions) or 2)


def test_fuzzed_valid_requests_are_always_answered_in_shape(
    make_gateway: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gw = make_gateway()
    w, kept = witness(gw)
    w.create_topic("fz", 2)

    @settings(max_examples=200)
    @given(valid_requests())
    def run(requests: list[Any]) -> None:
        want = {r.req_id: r for r in requests}
        s = connect_raw(gw.tank_port)
        try:
            s.sendall(b"".join(r.encode() for r in requests))
            answered: dict[int, Any] = {}
            while len(answered) < len(want):
                msg_id, payload = recv_frame(s)  # times out (fails) if one is never answered
                req_id = response_request_id(msg_id, payload)
                assert req_id in want and req_id not in answered, req_id
                request = want[req_id]
                assert msg_id == response_msg_id(request)
                # Decoding against the request checks the shape and every code.
                answered[req_id] = decode_response(msg_id, payload, request)
        finally:
            s.close()
        for req_id, resp in answered.items():
            check_semantics(want[req_id], resp)

    with caplog.at_level(logging.WARNING, "dafka"):
        run()
        assert gw.bad_input.count == 0  # none of it was taken for bad input
        assert intact(gw, kept) and w.status().version == 400
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bugs, [r.getMessage() for r in bugs]
    w.close()


def test_requests_split_anywhere_get_the_same_answers(make_gateway: Any) -> None:
    gw = make_gateway()
    w, _kept = witness(gw)
    stream = (
        StatusRequest(1).encode()
        + consume_frame(2, "keep", 0, 0)
        + DiscoverPartitionsRequest(3, "keep").encode()
        + CAPTURED_PRODUCE  # to an unknown topic: error 0xff, nothing written
    )

    def answers(pieces: list[bytes]) -> list[tuple[int, bytes]]:
        s = connect_raw(gw.tank_port)
        try:
            for piece in pieces:
                s.sendall(piece)
            return [recv_frame(s) for _ in range(4)]
        finally:
            s.close()

    whole = answers([stream])
    assert [f[0] for f in whole] == [MsgId.STATUS, MsgId.CONSUME, MsgId.DISCOVER_PARTITIONS, MsgId.PRODUCE]
    assert whole[3][1] == U32.pack(1) + b"\xff"

    @settings(max_examples=40)
    @given(st.lists(st.integers(1, len(stream) - 1), max_size=10, unique=True))
    def run(cuts: list[int]) -> None:
        bounds = [0, *sorted(cuts), len(stream)]
        assert answers([stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]) == whole

    run()
    w.close()


# ---------------------------------------------------------------- storage


@pytest.mark.parametrize("sync", [True, False], ids=["fsync", "no-sync"])  # no-sync: commits on the I/O thread
def test_storage_failure_answers_system_error_and_keeps_acked_data(cfg: NodeConfig, tmp_path: Path, sync: bool) -> None:
    # A map that cannot grow past 1 MiB plays the full disk.
    db = RecordDB(tmp_path / "db", map_size=256 << 10, max_map_size=1 << 20, sync=sync)
    with Gateway(db, cfg, listen=(HOST, 0)) as gw, TankClient(HOST, gw.tank_port) as c:
        c.create_topic("full", 1)
        acked = [b"acked-%d" % i + b"." * 1000 for i in range(20)]
        assert c.produce("full", 0, acked) == 0
        big = [os.urandom(50_000) for _ in range(30)]  # 1.5 MB: does not fit
        held = connect_raw(gw.tank_port)
        held.sendall(produce_frame(77, "full", 0, encode_bundle([(None, TS, None, v) for v in big], codec=CODEC_NONE)))
        wait_until(lambda: gw.storage_error is not None)
        # Not committed, so not answered: what comes first is the Status sent after it.
        held.sendall(StatusRequest(78).encode())
        msg_id, payload = recv_frame(held)
        assert msg_id == MsgId.STATUS and StatusResponse.decode(payload).req_id == 78
        with TankClient(HOST, gw.tank_port) as other:
            with pytest.raises(TankError) as err:
                other.produce("full", 0, [b"while full"])
            assert err.value.code == ProduceError.SYSTEM
            assert values(consume_all(other, "full", 0)) == acked  # reads still work
        # Room again (the disk was cleaned up): the held produce goes through.
        db.max_map_size = 64 << 20
        assert recv_frame(held) == (MsgId.PRODUCE, U32.pack(77) + b"\x00")
        held.close()
        assert c.produce("full", 0, [b"after"]) == 0
        assert values(consume_all(c, "full", 0)) == [*acked, *big, b"after"]


def test_a_failed_start_releases_the_database(make_gateway: Any, tmp_path: Path) -> None:
    taken = socket.create_server((HOST, 0))
    try:
        with pytest.raises(OSError) as failed:  # kept: its traceback holds the frames alive
            Gateway(tmp_path / "again", listen=(HOST, taken.getsockname()[1]))
    finally:
        taken.close()
    gw = make_gateway("again")  # the same directory opens in this process
    assert failed.value.errno is not None
    with TankClient(HOST, gw.tank_port) as c:
        assert c.status().version == 400


def test_non_tank_bytes_are_refused_at_once_not_after_the_stall_timeout(tmp_path: Path) -> None:
    # A TLS ClientHello announces a ~131 KB "frame" with msgId 0x16.
    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=("127.0.0.1", 0), limits=GatewayLimits(request_timeout=60)) as gw:
        with socket.create_connection(("127.0.0.1", gw.tank_port), timeout=10) as sock:
            sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
            deadline = time.monotonic() + 10
            data = b""
            while time.monotonic() < deadline:
                chunk = sock.recv(100)
                if not chunk:
                    break
                data += chunk
            assert data == b"\x03\x00\x00\x00\x00"  # the greeting, then EOF well before 60 s
            assert time.monotonic() < deadline


def test_publish_keeps_single_records_and_bundle_runs_of_one_partition_apart(
    gw: Gateway, client: TankClient, raw_peer: Any
) -> None:
    # A commit may hold a partition's single records (the Kafka gateway's) and, right after
    # them, a Tank bundle's run: each goes out as what it is, in offset order.
    client.create_topic("mixpub", 1)
    address = gw.pmap.get("mixpub", 0).address
    key = ("mixpub", address)
    peer = raw_peer([wire.P_RECORD + b"mixpub"])
    peer.wait_for(lambda q: q.peers)
    # The gateway sends RECORDs only to an audience its XPUB has heard: wait for it.
    wait_until(lambda: gw.audience.readers(wire.record_prefix(wire.RECORD, "mixpub", address, "mixpub")) >= 1)
    done = threading.Event()

    def publish() -> None:
        gw._publish([(key, 0, b"k0"), (key, 1, b"k1"), (key, 2, [b"t2", b"t3"]), (key, 4, b"k4")])
        done.set()

    gw.call_soon(publish)
    assert done.wait(10)
    got = peer.wait_for(lambda q: len(q.messages(wire.Record)) >= 5 and q.messages(wire.Record))
    assert [(r.sequence, r.content) for r in got] == [(0, b"k0"), (1, b"k1"), (2, b"t2"), (3, b"t3"), (4, b"k4")]


def test_produced_bundles_come_back_byte_for_byte(gw: Gateway, client: TankClient) -> None:
    # Stored as sent, served whole: the chunk is the produced bundles, each behind its length.
    client.create_topic("exact", 1)
    bundles = [
        CAPTURED_BUNDLE,
        encode_bundle([(None, TS + i, b"k%d" % i if i % 2 else None, b"x%d" % i * 40) for i in range(30)],
                      codec=CODEC_SNAPPY),
        encode_bundle([(3 + 30, 2**64 - 1, None, b"late"), (3 + 31, 5, b"", b"")], sparse=True),
    ]
    s = connect_raw(gw.tank_port)
    try:
        for i, b in enumerate(bundles):
            s.sendall(produce_frame(i + 1, "exact", 0, b))
            assert recv_frame(s) == (1, U32.pack(i + 1) + b"\x00")
        s.sendall(consume_frame(9, "exact", 0, 20))
        msg_id, payload = recv_frame(s)
    finally:
        s.close()
    p = ConsumeResponse.decode(payload).topics[0].partitions[0]
    # From seq 20 (inside the second bundle): the chunk begins at that bundle's first seq.
    assert p.base_seq == 3 and p.hwm == 34
    assert p.chunk == b"".join(encode_varint(len(b)) + b for b in bundles[1:])


# ---------------------------------------------------------------- the partial front block


@pytest.mark.parametrize("sparse", [False, True])
def test_records_deleted_from_inside_a_bundle_never_come_back(gw: Gateway, client: TankClient, sparse: bool) -> None:
    """A DeleteRecords-style delete moves the partition's first inside its second stored
    bundle (the partial front block).  Before the fix a consume from seq 0 got that bundle
    whole, the deleted records below first with it, on the wire (a client asking for seq 0
    kept them).  Now only records from first on go out, and the bundles after the front one
    still go whole, as stored."""
    client.create_topic("front", 1)
    for b in range(3):  # offsets 0-9, 10-19, 20-29: seqs 1-30, one block each
        msgs = [(None, b"m%d" % (b * 10 + i), TS + i) for i in range(10)]
        if sparse:  # a sparse bundle in a plain Produce: stored with its own seqs
            bundle = encode_bundle([(b * 10 + i + 1, t, k, v) for i, (k, v, t) in enumerate(msgs)], sparse=True)
            assert client.request(produce_frame_request(client, "front", 0, bundle)).topics[0].partitions[0].error == 0
        else:
            assert client.produce("front", 0, msgs) == 0
    address = gw.pmap.get("front", 0).address
    with gw.db._read_txn() as (txn, dbs):
        assert len([k for k, _v in txn.cursor(db=dbs.blocks)]) == 3
    assert gw.db.delete_front("front", address, 15) == (15, True)  # first: offset 15, seq 16

    want = [b"m%d" % i for i in range(15, 30)]
    for seq in (0, 16):
        assert values(consume_all(client, "front", 0, seq)) == want, seq
    # The sliced front bundle keeps the records' seqs and producer timestamps.
    assert [r[:2] for r in consume_all(client, "front", 0, 0)] == [(j + 1, TS + j % 10) for j in range(15, 30)]
    for seq in (1, 10, 15):  # below first, not 0: a boundary check pointing at first (Tank's rule)
        r = client.consume("front", 0, seq, 1 << 20)
        assert r.boundary_check and r.first_avail == 16 and not r.messages
    assert values(consume_all(client, "front", 0, 18)) == want[2:]

    # On the wire: the chunk of a consume from 0 holds nothing below seq 16 (decoded with
    # no floor), and the bundle after the front one is the stored one, byte for byte.
    with connect_raw(gw.tank_port) as s:
        s.sendall(consume_frame(7, "front", 0, 0))
        msg_id, body = recv_frame(s)
        resp = decode_response(msg_id, body)
        assert isinstance(resp, ConsumeResponse)
        p = resp.topics[0].partitions[0]
        assert p.flags == ConsumeFlag.OK and p.base_seq == 16
        got = decode_chunk(p.chunk, p.base_seq, 0)
        assert [(m[0], bytes(m[3])) for m in got.records] == [(16 + i, v) for i, v in enumerate(want)]
        with gw.db._read_txn() as (txn, dbs):
            stored = [bytes(v) for _k, v in txn.cursor(db=dbs.blocks)]
        last = stored[-1][HEADER_SIZE:]
        assert p.chunk.endswith(encode_varint(len(last)) + last)


def test_what_packed_since_remembers_is_bounded(gw: Gateway) -> None:
    """packed_since keeps an entry per partition and reader codec a parked long poll asked
    about; partitions come and go (a client creating and deleting topics while it parks polls
    on them), so the entries are a bounded cache (they grew with every partition ever asked)."""
    from dafka.store.block import CODEC_TANK
    from dafka.tank.gateway import MAX_PACKED_ENTRIES

    for i in range(MAX_PACKED_ENTRIES + 10):
        assert gw.packed_since((f"gone{i}", "p"), -1, CODEC_TANK) is False
    assert len(gw._packed) <= MAX_PACKED_ENTRIES
