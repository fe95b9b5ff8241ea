"""Kafka batches stored as produced (issue 36): keys and headers of any size, batches that lie,
records on the mesh only for readers that are there.  Real clients, real TCP, real LMDB."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as CKConsumer
from confluent_kafka import Producer as CKProducer
from confluent_kafka import TopicPartition
from crc32c import crc32c
from kafka import KafkaConsumer
from kafka import TopicPartition as KTopicPartition
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.kafka.codec import Err
from dafka.kafka.gateway import KafkaGateway
from dafka.nodes.consumer import Consumer
from dafka.store.block import CODEC_KAFKA, decode_header
from dafka.store.db import RecordDB
from dafka.tank.client import TankClient
from tests.conftest import dafka_cmd, spawned, subprocess_env, tower_flag, wait_until
from tests.kafka.test_gateway import HOST, ck_produce, closed, produce_raw
from tests.kafka.test_hostile_input import make_kgw  # noqa: F401 (a fixture)
from tests.store.test_append_blocks import sparse_partition

pytestmark = pytest.mark.timeout(120)

KEY = bytes(range(256)) * 2 + b"k" * 88  # 600 bytes, every byte value
HEADERS = [(f"trace-{i}", bytes([i]) * 200) for i in range(10)] + [("null", None)]  # 2 KB and more


def header_bytes(headers: list[tuple[str, bytes | None]]) -> int:
    return sum(len(k) + len(v or b"") for k, v in headers)


@pytest.fixture
def kgw(make_kgw: Any) -> KafkaGateway:  # noqa: F811
    return make_kgw()  # type: ignore[no-any-return]


@pytest.fixture
def gateway_process(cfg: NodeConfig, tmp_path: Path) -> str:
    """``host:port`` of the Kafka listener of a `dafka gateway` process on the test's tower."""
    proc = spawned(subprocess.Popen(
        dafka_cmd("gateway", "--db", str(tmp_path / "gw"), "--listen", f"{HOST}:0", "--kafka-listen", f"{HOST}:0",
                  "--tower", tower_flag(cfg), "--bind", HOST),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env(),
    ))
    assert proc.stdout is not None
    up = proc.stdout.readline()
    found = re.search(r"Kafka on 127\.0\.0\.1:(\d+)", up)
    assert found, up
    return f"{HOST}:{found.group(1)}"


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_600_byte_key_and_2_kb_of_headers_come_back_exact_to_both_clients(gateway_process: str, codec: str) -> None:
    """Before blocks, a key and headers shared a 255-byte slot: this was INVALID_RECORD."""
    assert len(KEY) == 600 and header_bytes(HEADERS) > 2000
    topic = f"wide-{codec}"
    p = CKProducer({"bootstrap.servers": gateway_process, "acks": "all", "compression.type": codec})
    delivered: list[Any] = []
    for i in range(3):
        p.produce(topic, value=b"value %d" % i if i != 1 else None, key=KEY, headers=HEADERS, partition=0,
                  timestamp=1_700_000_000_000 + i, on_delivery=lambda err, msg: delivered.append(err or msg.offset()))
    assert p.flush(30) == 0
    assert delivered == [0, 1, 2]
    want = [(KEY, b"value 0", HEADERS), (KEY, None, HEADERS), (KEY, b"value 2", HEADERS)]

    c = CKConsumer({"bootstrap.servers": gateway_process, "group.id": "wide", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, 0)])
    got: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        while len(got) < 3 and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                got.append(m)
    finally:
        c.close()
    assert [(m.key(), m.value(), m.headers()) for m in got] == want
    assert [m.timestamp()[1] for m in got] == [1_700_000_000_000 + i for i in range(3)]

    k = KafkaConsumer(bootstrap_servers=gateway_process, group_id=None, enable_auto_commit=False,
                      auto_offset_reset="earliest", consumer_timeout_ms=10_000)
    k.assign([KTopicPartition(topic, 0)])
    kgot = []
    for r in k:
        kgot.append(r)
        if len(kgot) == 3:
            break
    k.close()
    assert [(r.key, r.value, [(hk, hv) for hk, hv in r.headers]) for r in kgot] == want
    assert [(r.offset, r.timestamp) for r in kgot] == [(i, 1_700_000_000_000 + i) for i in range(3)]


def test_key_and_headers_count_toward_max_record_bytes(make_kgw: Any, cfg: NodeConfig) -> None:  # noqa: F811
    gw = make_kgw(config=dataclasses.replace(cfg, max_record_bytes=4096))
    gw.create_topic("cap", 1)
    ok = ck_produce(gw, "cap", [(KEY, b"v" * 1000, HEADERS)])
    assert ok == [(0, 0)]
    p = CKProducer({"bootstrap.servers": f"{HOST}:{gw.kafka_port}", "acks": "all", "compression.type": "gzip",
                    "message.send.max.retries": 0})
    errors: list[Any] = []
    # Compressed, the batch is small; inflated, its record is over the limit.
    p.produce("cap", value=b"\x00" * 1000, key=KEY, headers=HEADERS + [("big", bytes(2000))], partition=0,
              on_delivery=lambda err, msg: errors.append(err))
    p.flush(30)
    assert len(errors) == 1 and errors[0] is not None and errors[0].code() == 10  # MSG_SIZE_TOO_LARGE
    assert gw.records_too_large == 0 and gw.kafka.records_too_large == 1
    assert ck_produce(gw, "cap", [(None, b"after", None)]) == [(0, 1)]  # the connection and partition go on


def batch_of(n: int, ts: int = 1_700_000_000_000) -> bytearray:
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    for i in range(n):
        b.append(i, ts, None, b"x", [])
    return bytearray(b.build())


def recrc(batch: bytearray) -> bytes:
    """The batch with its CRC-32C computed again (a lie a CRC does not catch)."""
    batch[17:21] = crc32c(bytes(batch[21:])).to_bytes(4, "big")
    return bytes(batch)


# Records of batch_of: length, attributes, timestamp delta, offset delta, null key, value 1, "x", no headers.
REC0, REC_SIZE = 61, 8


def lying_batches() -> dict[str, bytes]:
    out = {}
    b = batch_of(3)
    b[REC0 + REC_SIZE + 3] = 0  # record 1's offset delta: 0 again
    out["offset deltas"] = recrc(b)
    b = batch_of(3)
    b[REC0 + 1] = 0x01  # record 0's attributes
    out["record attributes"] = recrc(b)
    b = batch_of(3)
    b[23:27] = (5).to_bytes(4, "big")  # lastOffsetDelta 5 for 3 records
    out["lastOffsetDelta"] = recrc(b)
    b = batch_of(3)
    b[57:61] = (2).to_bytes(4, "big")  # a count of 2, 3 records follow
    out["record count"] = recrc(b)
    b = batch_of(3)
    b[REC0 + 5] = 0x04  # record 0's value length 2: runs past its record's end
    out["record framing"] = recrc(b)
    return out


@pytest.mark.parametrize("lie", sorted(lying_batches()))
def test_a_batch_that_lies_behind_a_good_crc_is_refused_and_nothing_of_it_stored(kgw: KafkaGateway, lie: str) -> None:
    """Before blocks, the first three were stored as if they were true (the decoder read
    fields it did not check against each other)."""
    kgw.create_topic("lies", 1)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        with pytest.raises(ConnectionError):
            produce_raw(s, 1, "lies", lying_batches()[lie])
        assert closed(s)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:  # the gateway goes on
        r = produce_raw(s, 2, "lies", bytes(batch_of(2)))
        assert (r.error_code, r.base_offset) == (Err.NONE, 0)
    address = kgw.pmap.get("lies", 0).address
    assert kgw.db.fetch("lies", address, 0, 10) == (0, [b"x", b"x"])


def test_each_batch_is_one_block_kept_as_sent(kgw: KafkaGateway) -> None:
    kgw.create_topic("kept", 1)
    sent = [bytes(batch_of(3)), bytes(batch_of(2))]
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert [produce_raw(s, i, "kept", b).base_offset for i, b in enumerate(sent)] == [0, 3]
    with kgw.db._read_txn() as (txn, dbs):
        stored = [bytes(v) for _k, v in txn.cursor(db=dbs.blocks)]
    assert [decode_header(v).codec for v in stored] == [CODEC_KAFKA, CODEC_KAFKA]
    # The batch from its magic on (CRC, attributes, records) is the one sent; its offset is the block's.
    assert [v[52 + 16:] for v in stored] == [b[16:] for b in sent]
    assert [int.from_bytes(v[52:60], "big") for v in stored] == [0, 3]


def test_records_go_on_the_mesh_only_to_readers_that_are_there(kgw: KafkaGateway, cfg: NodeConfig) -> None:
    """Nobody reads the partition on the mesh: its blocks are not decoded, only its HEAD goes
    out, and a consumer that comes later FETCHes every record.  A consumer that is there gets
    the records live."""
    ck_produce(kgw, "quiet", [(None, b"q%d" % i, None) for i in range(50)])
    assert kgw.kafka_unpublished >= 1
    with Consumer("quiet", cfg, offset_reset="earliest") as consumer:
        got: list = []
        deadline = time.monotonic() + 20
        while len(got) < 50 and time.monotonic() < deadline:
            got += consumer.poll_batch(100, 0.2)
        assert [bytes(r.content) for r in got] == [b"q%d" % i for i in range(50)]
        # Now a reader is there: the next records are sent to it live.
        address = kgw.pmap.get("quiet", 0).address
        header = wire.record_prefix(wire.RECORD, "quiet", address, "quiet")
        wait_until(lambda: kgw.audience.readers(header) > 0, 10)
        before = kgw.kafka_unpublished
        ck_produce(kgw, "quiet", [(None, b"q%d" % i, None) for i in range(50, 60)])
        deadline = time.monotonic() + 20
        while len(got) < 60 and time.monotonic() < deadline:
            got += consumer.poll_batch(100, 0.2)
        assert [bytes(r.content) for r in got] == [b"q%d" % i for i in range(60)]
        assert kgw.kafka_unpublished == before
    with TankClient(HOST, kgw.tank_port) as t:
        r = t.consume("quiet", 0, 0, 1 << 20)
        assert [bytes(v) for _s, _ts, _k, v in r.messages][:3] == [b"q0", b"q1", b"q2"]


def test_records_deleted_from_inside_a_stored_batch_never_go_out(kgw: KafkaGateway) -> None:
    """DeleteRecords to offset 3 leaves the first stored batch (offsets 0-4) as the partial
    front block.  Before the fix a Fetch from the log start (3) got that batch whole, deleted
    records 0-2 on the wire (a client skips them only because it asked for 3; a reader of the
    raw batches, or the gateway's own transactional path, saw them).  Now the front batch is
    sliced from 3 (keys, headers and timestamps kept), and the batch after it goes as stored."""
    from kafka.protocol.consumer import FetchResponse
    from kafka.record import MemoryRecords

    from tests.kafka.test_gateway import read_frame
    from tests.kafka.test_hostile import fetch_frame

    kgw.create_topic("cut", 1)
    sent = []
    for b in range(2):
        builder = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
        for i in range(5):
            builder.append(i, 1_700_000_000_000 + b * 5 + i, b"k%d" % (b * 5 + i), b"v%d" % (b * 5 + i),
                           [("h", b"%d" % (b * 5 + i))])
        sent.append(bytes(builder.build()))
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        assert [produce_raw(s, i, "cut", b).base_offset for i, b in enumerate(sent)] == [0, 5]
    address = kgw.pmap.get("cut", 0).address
    assert kgw.delete_front("cut", address, 3, 10_000) == (3, True)

    def want(lo: int) -> list[Any]:
        return [(o, 1_700_000_000_000 + o, b"k%d" % o, b"v%d" % o, [("h", b"%d" % o)]) for o in range(lo, 10)]

    def got(records: bytes) -> list[Any]:
        return [(r.offset, r.timestamp, r.key, r.value, list(r.headers))
                for rb in MemoryRecords(records) for r in rb]

    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        s.sendall(fetch_frame(1, "cut", 3))
        p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
        assert p.error_code == 0 and p.log_start_offset == 3
        assert got(bytes(p.records)) == want(3)
        # The batch after the front one is the one stored, from its magic on.
        assert bytes(p.records).endswith(sent[1][16:])
        s.sendall(fetch_frame(2, "cut", 4))
        p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
        assert got(bytes(p.records)) == want(4)
        s.sendall(fetch_frame(3, "cut", 0))  # below the log start: no record below it either
        p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
        assert all(r[0] >= 3 for r in got(bytes(p.records or b"")))
    # The transactional read path (control records as control batches) slices it too.
    nxt, batches = kgw.fetch_txn_batches("cut", address, 3, 1 << 20, 9)
    assert nxt == 10 and got(b"".join(batches)) == want(3)

    # A real client from the beginning.
    c = KafkaConsumer(bootstrap_servers=f"{HOST}:{kgw.kafka_port}", enable_auto_commit=False,
                      auto_offset_reset="earliest", consumer_timeout_ms=5000)
    try:
        c.assign([KTopicPartition("cut", 0)])
        c.seek_to_beginning()
        seen: list[Any] = []
        deadline = time.monotonic() + 20
        while len(seen) < 7 and time.monotonic() < deadline:
            for recs in c.poll(500).values():
                seen += [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in recs]
        assert seen == want(3)
    finally:
        c.close()


def test_delete_records_drops_the_batches_read_ahead_for_its_partition(kgw: KafkaGateway) -> None:
    """The gateway encodes the next answer of a consumer ahead (from the offset its last
    answer ended at, the block holding it whole).  Read before a DeleteRecords, it could
    hold records the delete hid: the delete drops it, so the next fetch reads the store."""
    from kafka.protocol.consumer import FetchResponse

    from tests.kafka.test_admin import delete_records
    from tests.kafka.test_gateway import read_frame
    from tests.kafka.test_hostile import fetch_frame

    kgw.create_topic("ahead", 1)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        for i in range(3):
            assert produce_raw(s, i, "ahead", bytes(batch_of(5))).base_offset == 5 * i
        s.sendall(fetch_frame(9, "ahead", 0, max_bytes=100))  # one batch; the next is read ahead
        p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
        assert p.error_code == 0 and p.records
    key = ("ahead", kgw.pmap.get("ahead", 0).address)
    assert wait_until(lambda: key in kgw.kafka._ahead, 10)
    assert delete_records(kgw.kafka_port, "ahead", 7) == (Err.NONE, 7)
    assert key not in kgw.kafka._ahead


def _converted_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on the store reader's conversions of a block's records into stored values: the
    number of records each is asked for."""
    from dafka.store import reader

    asked: list[int] = []
    block_values, kafka_values = reader.block_values, reader.kafka_values

    def spy_block(value: Any, hdr: Any, offset: int, n: int) -> list[bytes]:
        asked.append(n)
        return block_values(value, hdr, offset, n)

    def spy_kafka(batch: Any, first_offset: int, offset: int, n: int) -> list[bytes] | None:
        asked.append(n)
        return kafka_values(batch, first_offset, offset, n)

    monkeypatch.setattr(reader, "block_values", spy_block)
    monkeypatch.setattr(reader, "kafka_values", spy_kafka)
    return asked


def test_a_small_fetch_from_a_large_tank_bundle_converts_only_what_its_answer_can_hold(
    kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of another codec is encoded into a batch for a Kafka fetch.  Before the fix the
    whole rest of the block became stored values first (200,000 Python objects for an answer
    of 4 KiB, and again for every next fetch: reading a 64 MiB bundle of millions of small
    messages took the gateway minutes, each fetch holding its event loop and memory in
    proportion to the bundle, not to the answer).  Now a fetch converts what its answer can
    hold, or a window of the block's records kept for the next fetches (the store's
    CONVERT_WINDOW)."""
    from kafka.protocol.consumer import FetchResponse
    from kafka.record import MemoryRecords

    from dafka.store.db import CONVERT_WINDOW
    from tests.kafka.test_gateway import read_frame
    from tests.kafka.test_hostile import fetch_frame

    kgw.create_topic("bundle", 1)
    n = 200_000
    with TankClient(HOST, kgw.tank_port) as t:
        t.produce("bundle", 0, [b"m%d" % i for i in range(n)])  # one bundle: one block
    wait_until(lambda: kgw.head("bundle", kgw.pmap.get("bundle", 0).address) == n - 1)
    asked = _converted_counts(monkeypatch)
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        for corr, off in enumerate((0, 10, 5_000, n - 3)):
            s.sendall(fetch_frame(corr, "bundle", off, max_bytes=4096))
            p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
            got = [(r.offset, r.value) for rb in MemoryRecords(bytes(p.records)) for r in rb]
            assert p.error_code == 0 and got[0][0] == off and len(got) == min(n - off, len(got)) > 1
            assert got == [(o, b"m%d" % o) for o in range(off, off + len(got))]
            assert sum(len(v) + 8 for _o, v in got) < 4096 + 200  # about the answer's bytes
    assert asked and max(asked) <= CONVERT_WINDOW < n - 5_000  # before: the rest of the block, up to 200,000


def test_a_fetch_bounded_by_the_gateways_output_room_converts_only_what_fits(
    make_kgw: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """When the gateway's output room, not the client, bounds an answer, a stored Kafka batch
    larger than it is sliced; before the fix the whole batch from the fetch offset on was
    converted first (up to ``kafka_max_produce_records`` records for a few KiB)."""
    from kafka.protocol.consumer import FetchResponse
    from kafka.record import MemoryRecords

    from dafka.tank.limits import GatewayLimits
    from tests.kafka.test_gateway import read_frame
    from tests.kafka.test_hostile import fetch_frame

    gw = make_kgw(limits=GatewayLimits(kafka_max_output_bytes=4096))
    gw.create_topic("room", 1)
    n = 50_000
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        assert produce_raw(s, 1, "room", bytes(batch_of(n))).base_offset == 0
        asked = _converted_counts(monkeypatch)
        s.sendall(fetch_frame(2, "room", 7, max_bytes=1 << 20))
        p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
    got = [r.offset for rb in MemoryRecords(bytes(p.records)) for r in rb]
    assert p.error_code == 0 and got == list(range(7, 7 + len(got))) and 1 < len(got) < 1000
    assert asked and max(asked) <= 4096  # before: 49,993


def test_a_store_says_whether_it_holds_a_fetched_range_without_inflating_a_bundle(
    kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each FETCH a store receives is first checked for a range it holds none of (it says
    VOID then).  That read the range's first record, inflating and walking a Tank bundle to
    it (25 ms a FETCH inside a bundle of 2 million messages, for any peer): before the fix
    each of these looks converted the bundle; now the block headers answer."""
    from dafka.store import db as dbmod

    kgw.create_topic("held", 1)
    with TankClient(HOST, kgw.tank_port) as t:
        t.produce("held", 0, [b"m%d" % i for i in range(10_000)])
    key = ("held", kgw.pmap.get("held", 0).address)
    wait_until(lambda: kgw.head(*key) == 9_999)
    calls: list[int] = []
    convert = dbmod.convert_block
    monkeypatch.setattr(dbmod, "convert_block", lambda v, o, n: calls.append(o) or convert(v, o, n))
    assert [kgw._holds_none(key, a, b) for a, b in [(0, 0), (5_000, 5_001), (9_999, 20_000), (10_000, 20_000)]] == [
        False, False, False, True]
    assert calls == []  # before: [0, 5000, 9999]


def test_a_stored_sparse_bundle_with_gaps_is_fetched_at_its_own_offsets(make_kgw: Any, tmp_path: Path) -> None:  # noqa: F811
    """A sparse Tank bundle with gaps inside (offsets 10, 11, 14, 15, 19; the Tank gateway
    stored some before 29c6a24), fetched by a Kafka client from before it and from inside its
    gaps: its records were encoded from the offset asked for (r14 as offset 12), and the next
    fetch went on from there (r15 again as 13, ...)."""
    gw = make_kgw("sp")
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("sp", 1)
    address = gw.pmap.get("sp", 0).address
    gw.close()
    with RecordDB(tmp_path / "sp", sync=False) as db:
        held = sparse_partition(db, "sp", address)
    gw = make_kgw("sp")
    tp = KTopicPartition("sp", 0)
    for start in (0, 12, 16):
        k = KafkaConsumer(bootstrap_servers=f"{HOST}:{gw.kafka_port}", group_id=None, enable_auto_commit=False,
                          consumer_timeout_ms=5000)
        try:
            k.assign([tp])
            k.seek(tp, start)
            got = []
            for r in k:
                got.append((r.offset, r.value))
                if r.offset >= 21:
                    break
        finally:
            k.close()
        assert got == [(o, b"r%d" % o) for o in held if o >= start], start
