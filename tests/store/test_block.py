"""Format-2 blocks (dafka.store.block): byte layout, validation, refusal of lying blocks, fuzz."""

from __future__ import annotations

import struct

import pytest
import snappy
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st
from kafka.errors import CorruptRecordError
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from dafka.errors import ProtocolError
from dafka.kafka.records import decode_batches
from dafka.store import block as B
from dafka.tank.bundle import CODEC_NONE, CODEC_SNAPPY, decode_bundle, encode_bundle

TS = 1_700_000_000_123
TS_LE = struct.pack("<Q", TS)
# tank_current.md, "Captured: tank-cli produce -s 2 hello world": the bundle (its chunk
# length prefix was 0x17 = 23 bytes), with our own timestamp in the <ts:8> slot.
HELLO_WORLD = b"\x08" + b"\x00" + TS_LE + b"\x05hello" + b"\x02" + b"\x05world"
# "Captured: a consume answer": chunk `0f` then the bundle `04 00 <ts:8> 04 'late'`.
LATE = b"\x04" + b"\x00" + TS_LE + b"\x04late"


def _kafka_batch(n: int = 3, compression: int = 0, key: bytes | None = None,
                 headers: list[tuple[str, bytes]] | None = None, value: bytes = b"v" * 10) -> bytes:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=compression, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    for i in range(n):
        b.append(i, TS + i, key, value, headers or [])
    return bytes(b.build())


def _recrc_kafka(batch: bytearray) -> bytes:
    struct.pack_into(">I", batch, 17, crc32c(bytes(batch[21:])))
    return bytes(batch)


def _reseal(value: bytes, **fields: int) -> bytes:
    """A block whose header fields were changed and whose CRC was recomputed: a liar with a valid CRC."""
    names = ("magic", "version", "codec", "compression", "flags", "reserved", "first", "last", "count",
             "body_size", "first_ts", "max_ts", "crc")
    vals = dict(zip(names, B.HEADER.unpack_from(value), strict=True))
    vals.update(fields)
    head = B.HEADER.pack(*vals.values())[:48]
    body = value[B.HEADER_SIZE:]
    return head + struct.pack(">I", crc32c(body, crc32c(head))) + body


# ---------------------------------------------------------------- byte-exact


def test_captured_tank_bundle_block_is_byte_exact() -> None:
    assert len(HELLO_WORLD) == 0x17
    value = B.tank_block(HELLO_WORLD, 109)
    head = (
        b"DB" + b"\x02" + b"\x02" + b"\x00" + b"\x00" + b"\x00\x00"
        + (109).to_bytes(8, "big") + (110).to_bytes(8, "big")
        + (2).to_bytes(4, "big") + (23).to_bytes(4, "big")
        + TS.to_bytes(8, "big") + TS.to_bytes(8, "big")
    )
    assert len(head) == 48 and B.HEADER_SIZE == 52
    assert value == head + crc32c(HELLO_WORLD, crc32c(head)).to_bytes(4, "big") + HELLO_WORLD
    hdr = B.validate(value)
    assert (hdr.codec, hdr.first_offset, hdr.last_offset, hdr.record_count) == (B.CODEC_TANK, 109, 110, 2)
    assert [(r.offset, r.ts_ms, r.key, r.value) for r in B.records(value)] == [
        (109, TS, None, b"hello"), (110, TS, None, b"world")]
    assert [r.value for r in B.records(value, 110)] == [b"world"]


def test_captured_consume_bundle() -> None:
    value = B.tank_block(LATE, 108)
    assert value[B.HEADER_SIZE:] == LATE and len(LATE) == 0x0F
    assert B.validate(value)[1:5] == (B.COMPRESSION_NONE, 108, 108, 1)
    assert list(B.records(value)) == [B.BlockRecord(108, TS, None, b"late", None)]


def test_block_key_orders_numerically() -> None:
    keys = [B.block_key(p, o) for p, o in [(1, 0), (1, 255), (1, 256), (1, 1 << 40), (2, 0)]]
    assert keys == sorted(keys)
    assert B.unpack_block_key(keys[3]) == (1, 1 << 40)


def test_tank_snappy_and_keys_and_sparse() -> None:
    msgs = [(None, TS + (i % 4), b"k%d" % i if i % 3 == 0 else None, b"m" * (i % 50)) for i in range(600)]
    for codec in (CODEC_NONE, CODEC_SNAPPY):
        value = B.tank_block(encode_bundle(msgs, codec=codec), 1000)
        hdr = B.validate(value)
        assert hdr.compression == (B.COMPRESSION_SNAPPY if codec else B.COMPRESSION_NONE)
        assert (hdr.record_count, hdr.last_offset, hdr.first_ts, hdr.max_ts) == (600, 1599, TS, TS + 3)
        got = list(B.records(value, 1590))
        assert [(r.offset, r.key, r.value) for r in got] == [
            (1000 + i, msgs[i][2], msgs[i][3]) for i in range(590, 600)]
    sparse = encode_bundle([(10, TS, None, b"a"), (11, TS, None, b"b"), (15, TS + 1, None, b"c")], sparse=True)
    value = B.tank_block(sparse, 500)
    hdr = B.validate(value)
    assert (hdr.first_offset, hdr.last_offset, hdr.record_count) == (500, 505, 3)  # a block with holes inside
    assert [r.offset for r in B.records(value)] == [500, 501, 505]


def test_kafka_block_keeps_the_batch_and_its_crc() -> None:
    batch = _kafka_batch(5, key=b"K" * 600, headers=[("trace", b"h" * 2048)])
    value = B.kafka_block(batch, 77)
    hdr = B.validate(value, max_record_bytes=4096)
    assert (hdr.codec, hdr.first_offset, hdr.last_offset, hdr.first_ts, hdr.max_ts) == (
        B.CODEC_KAFKA, 77, 81, TS, TS + 4)
    body = value[B.HEADER_SIZE:]
    assert body[:8] == (77).to_bytes(8, "big") and body[12:16] == b"\xff\xff\xff\xff"
    assert body[16:] == batch[16:]  # everything under the CRC is as produced
    # An independent reader (kafka-python) accepts the stored batch and sees the new offsets.
    rb = DefaultRecordBatch(body)
    assert rb.validate_crc()
    recs = list(rb)
    assert [r.offset for r in recs] == [77, 78, 79, 80, 81]
    assert recs[0].key == b"K" * 600 and recs[0].headers == [("trace", b"h" * 2048)]
    ours = list(B.records(value, 80))
    assert [(r.offset, r.ts_ms, r.key) for r in ours] == [(80, TS + 3, b"K" * 600), (81, TS + 4, b"K" * 600)]
    assert ours[0].headers == b"\x02\x0atrace" + b"\x80\x20" + b"h" * 2048  # zigzag(2048) = 4096


@pytest.mark.parametrize("compression", [1, 2, 3, 4])
def test_kafka_compressed(compression: int) -> None:
    value = B.kafka_block(_kafka_batch(50, compression), 0)
    assert B.validate(value).compression == compression
    assert [r.value for r in B.records(value)] == [b"v" * 10] * 50


def test_dafka_block_record_over_max() -> None:
    with pytest.raises(ProtocolError, match="max_record_bytes"):
        B.dafka_block([(TS, b"kk", b"x" * 9)], 0, max_record_bytes=10)
    value = B.dafka_block([(TS, None, b"x" * 11)], 0)
    with pytest.raises(ProtocolError, match="max_record_bytes"):
        B.validate(value, max_record_bytes=10)
    assert B.validate(value, max_record_bytes=11)


def test_dafka_block_timestamps_far_apart() -> None:
    lo, hi = -(1 << 63), (1 << 63) - 1
    with pytest.raises(ProtocolError, match="2\\^63"):
        B.dafka_block([(lo, None, b"a"), (hi, None, b"b")], 0)
    value = B.dafka_block([(lo, None, b"a"), (-1, None, b"b")], 0)
    assert [r.ts_ms for r in B.records(value)] == [lo, -1]


def test_dafka_block_round_trip() -> None:
    recs = [(TS, None, b"a"), (TS + 5, b"key", b"bb"), (TS - 3, b"", b""), (TS, None, b"x" * 300)]
    value = B.dafka_block(recs, 9)
    hdr = B.validate(value)
    assert (hdr.codec, hdr.record_count, hdr.first_ts, hdr.max_ts) == (B.CODEC_DAFKA, 4, TS, TS + 5)
    assert [(r.offset, r.ts_ms, r.key, r.value) for r in B.records(value)] == [
        (9 + i, ts, k, c) for i, (ts, k, c) in enumerate(recs)]


# ---------------------------------------------------------------- lying and malformed blocks


@pytest.mark.parametrize("bundle", [
    b"\x0c" + HELLO_WORLD[1:],  # says 3 messages, holds 2
    b"\x04" + HELLO_WORLD[1:],  # says 1 message, holds 2 (trailing bytes)
    HELLO_WORLD[:-1],  # the last message runs past the bundle
    HELLO_WORLD + b"\x00",  # trailing byte
    b"\x88" + HELLO_WORLD[1:],  # extra-flags bit
    b"\x0a" + HELLO_WORLD[1:],  # codec 2
    b"\x08\x02\x05hello\x02\x05world",  # the first message has no timestamp
    b"\x08\x08" + HELLO_WORLD[2:],  # unknown message flag
    b"\x00\x00",  # count 0 as a varint
    b"",
])
def test_tank_lying_bundles_are_refused(bundle: bytes) -> None:
    with pytest.raises(ProtocolError):
        B.tank_block(bundle, 0)


def test_tank_record_over_max_and_snappy_bomb() -> None:
    with pytest.raises(ProtocolError, match="max_record_bytes"):
        B.tank_block(HELLO_WORLD, 0, max_record_bytes=4)
    # A snappy block claiming 100 MB is refused from its length alone.
    bomb = b"\x01" + b"\x08" + b"\x80\x80\x80\x30" + b"\x00" * 10
    with pytest.raises(ProtocolError, match="budget"):
        B.tank_block(bomb, 0)
    big = encode_bundle([(None, TS, None, b"\0" * 100_000)], codec=CODEC_SNAPPY)
    assert len(big) < 10_000
    B.tank_block(big, 0)
    with pytest.raises(ProtocolError, match="budget"):
        B.tank_block(big, 0, budget=50_000)
    # Snappy data whose inflated message set lies about the count.
    liar = b"\x0d" + snappy.compress(HELLO_WORLD[1:])  # says 3, holds 2
    with pytest.raises(ProtocolError):
        B.tank_block(liar, 0)


def test_kafka_lying_batches_are_refused() -> None:
    good = _kafka_batch(3)
    B.kafka_block(good, 0)
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 1
    cases = [bytes(bad_crc)]
    # Count raised by one with a valid CRC (and lastOffsetDelta to match): a liar the CRC cannot catch.
    liar = bytearray(good)
    struct.pack_into(">i", liar, 57, 4)
    struct.pack_into(">i", liar, 23, 3)
    cases.append(_recrc_kafka(liar))
    lower = bytearray(good)
    struct.pack_into(">i", lower, 57, 2)
    struct.pack_into(">i", lower, 23, 1)
    cases.append(_recrc_kafka(lower))
    delta = bytearray(good)
    struct.pack_into(">i", delta, 23, 7)  # lastOffsetDelta disagrees with the count
    cases.append(_recrc_kafka(delta))
    short = bytearray(good)
    struct.pack_into(">i", short, 8, len(good) - 13)  # batchLength one short
    cases.append(bytes(short))
    control = bytearray(good)
    struct.pack_into(">h", control, 21, 0x20)
    cases.append(_recrc_kafka(control))
    magic1 = bytearray(good)
    magic1[16] = 1
    cases.append(bytes(magic1))
    cases.append(good[:40])
    for case in cases:
        with pytest.raises(ProtocolError):
            B.kafka_block(case, 0)


def test_kafka_null_value_and_attributes() -> None:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    b.append(0, TS, b"k", None, [])  # a tombstone
    b.append(1, TS, None, b"", [])
    batch = bytes(b.build())
    assert [r.value for r in B.records(B.kafka_block(batch, 0))] == [None, b""]
    # Record attributes are unused: kafka-python reads them as a varint, Java as int8.
    bad = bytearray(batch)
    assert bad[62] == 0  # the first record's attributes, after its one-byte length
    bad[62] = 0x80
    with pytest.raises(ProtocolError, match="attributes"):
        B.kafka_block(_recrc_kafka(bad), 0)


def test_kafka_offset_deltas_must_count_up() -> None:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    for delta in (0, 2, 2):  # three records, the second claiming offset delta 2
        b.append(delta, TS, None, b"v", [])
    batch = bytearray(b.build())
    struct.pack_into(">i", batch, 23, 2)  # lastOffsetDelta = count - 1, as an honest batch has
    with pytest.raises(ProtocolError, match="offset delta"):
        B.kafka_block(_recrc_kafka(batch), 0)


def test_kafka_record_over_max_and_gzip_bomb() -> None:
    with pytest.raises(ProtocolError, match="max_record_bytes"):
        B.kafka_block(_kafka_batch(1, key=b"k" * 600, headers=[("h", b"x" * 500)]), 0, max_record_bytes=1000)
    b = DefaultRecordBatchBuilder(magic=2, compression_type=1, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    b.append(0, TS, None, b"\0" * 3_000_000, [])
    bomb = bytes(b.build())
    assert len(bomb) < 10_000
    with pytest.raises(ProtocolError, match="inflates past"):
        B.kafka_block(bomb, 0, budget=1 << 20, max_record_bytes=8 << 20)
    assert B.kafka_block(bomb, 0, budget=4 << 20, max_record_bytes=8 << 20)


def test_stored_block_lies_are_refused() -> None:
    value = B.tank_block(HELLO_WORLD, 5)
    for liar in (
        _reseal(value, count=1), _reseal(value, count=3), _reseal(value, last=5), _reseal(value, last=7),
        _reseal(value, first_ts=TS - 1), _reseal(value, max_ts=TS + 1), _reseal(value, compression=2),
        _reseal(value, codec=B.CODEC_DAFKA), _reseal(value, codec=B.CODEC_KAFKA), _reseal(value, version=1),
        _reseal(value, flags=1), _reseal(value, body_size=22), value + b"\0", value[:-1], value[:51],
    ):
        with pytest.raises(ProtocolError):
            B.validate(liar)
    kafka = B.kafka_block(_kafka_batch(2), 10)
    with pytest.raises(ProtocolError, match="baseOffset"):
        B.validate(_reseal(kafka, first=11, last=12))
    dafka = B.dafka_block([(TS, None, b"a"), (TS, None, b"b")], 0)
    for liar in (_reseal(dafka, count=1), _reseal(dafka, count=3, last=2), _reseal(dafka, max_ts=TS + 1)):
        with pytest.raises(ProtocolError):
            B.validate(liar)


# ---------------------------------------------------------------- fuzz

_recs = st.lists(
    st.tuples(st.integers(0, (1 << 63) - 1), st.none() | st.binary(max_size=255), st.binary(max_size=300)),
    min_size=1, max_size=40,
)


@given(_recs, st.integers(0, 1 << 62), st.booleans())
def test_fuzz_tank_round_trip(recs: list[tuple[int, bytes | None, bytes]], first: int, snap: bool) -> None:
    bundle = encode_bundle([(None, ts, k, c) for ts, k, c in recs], codec=CODEC_SNAPPY if snap else CODEC_NONE)
    value = B.tank_block(bundle, first)
    hdr = B.validate(value)
    assert (hdr.first_offset, hdr.record_count, hdr.first_ts, hdr.max_ts) == (
        first, len(recs), recs[0][0], max(r[0] for r in recs))
    assert [(r.offset, r.ts_ms, r.key, r.value) for r in B.records(value)] == [
        (first + i, ts, k, c) for i, (ts, k, c) in enumerate(recs)]


@given(st.lists(st.tuples(st.integers(-(1 << 40), 1 << 40), st.none() | st.binary(max_size=600),
                          st.binary(max_size=300)), min_size=1, max_size=40), st.integers(0, 1 << 62))
def test_fuzz_dafka_round_trip(recs: list[tuple[int, bytes | None, bytes]], first: int) -> None:
    value = B.dafka_block(recs, first)
    assert B.validate(value).record_count == len(recs)
    assert [(r.ts_ms, r.key, r.value) for r in B.records(value)] == recs


@given(st.binary(max_size=200), st.integers(0, 1 << 62))
def test_fuzz_tank_garbage_is_refused_or_consistent(data: bytes, first: int) -> None:
    # The walk without per-message objects accepts exactly what the full decoder accepts.
    try:
        full: list[object] | None = list(decode_bundle(data))
    except ProtocolError:
        full = None
    try:
        value = B.tank_block(data, first)
    except ProtocolError:
        assert full is None
        return
    assert full is not None
    assert B.validate(value).record_count == len(full)


@given(st.binary(max_size=200))
def test_fuzz_kafka_garbage_is_refused(data: bytes) -> None:
    try:
        B.kafka_block(data, 0)
    except ProtocolError:
        return
    raise AssertionError("random bytes made a valid batch")  # its CRC would have to match


@given(st.integers(0, 10_000), st.integers(0, 7), st.sampled_from(["tank", "kafka", "dafka", "store"]))
def test_fuzz_any_flipped_bit_is_found(pos: int, bit: int, codec: str) -> None:
    if codec == "store":
        values = [_store_value(TS + i, b"k" if i % 3 else None, b"x" * 50) for i in range(20)]
        value = B.store_block(3, values, sum(50 + (1 if i % 3 else 0) for i in range(20)))
    elif codec == "tank":
        value = B.tank_block(encode_bundle([(None, TS, b"k", b"x" * 50)] * 20, codec=CODEC_NONE), 3)
    elif codec == "kafka":
        value = B.kafka_block(_kafka_batch(10), 3)
    else:
        value = B.dafka_block([(TS, b"k", b"x" * 50)] * 20, 3)
    bad = bytearray(value)
    bad[pos % len(bad)] ^= 1 << bit
    with pytest.raises(ProtocolError):
        B.validate(bytes(bad))


@given(st.binary(max_size=300))
def test_fuzz_validate_garbage(data: bytes) -> None:
    for value in (data, B.MAGIC + b"\x02" + data, _reseal(B.tank_block(LATE, 0))[:48] + data):
        try:
            B.validate(value)
        except ProtocolError:
            continue



@given(st.lists(st.tuples(st.none() | st.binary(max_size=200), st.none() | st.binary(max_size=300),
                          st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=50)), max_size=3)),
                min_size=1, max_size=20),
       st.integers(0, 10_000), st.integers(0, 255))
def test_fuzz_kafka_mutated_records_with_valid_crc(
    recs: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]], pos: int, byte: int
) -> None:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    for i, (key, value, headers) in enumerate(recs):
        b.append(i, TS + i, key, value, headers)
    good = bytes(b.build())
    assert [r.value for r in B.records(B.kafka_block(good, 0))] == [v for _k, v, _h in recs]
    batch = bytearray(good)
    at = 61 + pos % (len(batch) - 61)  # somewhere in the records, then a valid CRC again
    batch[at] = byte
    try:
        value = B.kafka_block(_recrc_kafka(batch), 0)
    except ProtocolError:
        return
    # Accepted: the gateway's record decoder and kafka-python agree on every record.
    ours = list(B.records(value))
    assert len(ours) == len(recs)
    (batch_,) = decode_batches(value[B.HEADER_SIZE:])
    assert [(r.timestamp, r.key, r.value, r.headers) for r in batch_.records] == [
        (r.ts_ms, r.key, r.value, r.headers) for r in ours]  # both keep a null value as None
    try:
        theirs = list(DefaultRecordBatch(value[B.HEADER_SIZE:]))
    except CorruptRecordError as exc:
        # kafka-python decodes header keys as strict UTF-8; the store keeps them as bytes, as
        # the gateway does today (librdkafka and the Java client take any bytes).
        assert "UnicodeDecodeError" in str(exc)
        return
    assert [(r.offset, r.key, r.value) for r in theirs] == [(r.offset, r.key, r.value) for r in ours]


# ---------------------------------------------------------------- the store's own blocks (CODEC_STORE)


def _store_value(ts: int, key: bytes | None, content: bytes, flags: int = 0) -> bytes:
    if key is None:
        return struct.pack(">QB", ts, flags) + content
    return struct.pack(">QB", ts, flags | 1) + bytes((len(key),)) + key + content


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.none() | st.binary(max_size=255), st.binary(max_size=300),
                          st.sampled_from([0, 2, 4, 8])), min_size=1, max_size=40),
       st.integers(0, 2**40))
def test_fuzz_store_block_round_trip(recs: list[tuple[int, bytes | None, bytes, int]], first: int) -> None:
    values = [_store_value(ts, k, c, f) for ts, k, c, f in recs]
    payload = sum(len(c) + len(k or b"") for _ts, k, c, _f in recs)
    value = B.store_block(first, values, payload)
    hdr = B.validate(value)
    n = len(values)
    assert (hdr.codec, hdr.first_offset, hdr.last_offset, hdr.record_count) == (B.CODEC_STORE, first, first + n - 1, n)
    # Timestamps past 2^63 - 1 are kept in the records and count as 2^63 - 1 in the header.
    assert hdr.first_ts == min(recs[0][0], 2**63 - 1)
    assert hdr.max_ts == min(max(r[0] for r in recs), 2**63 - 1)
    assert B.store_payload(value) == payload
    for i in range(n):
        for k in (1, 2, n):
            assert B.store_values(value, hdr, first + i, k) == values[i:i + k]
    assert B.store_values(value, hdr, first + n, 5) == []
    assert [(r.offset, r.ts_ms, r.key, r.value) for r in B.records(value, first + 1)] == [
        (first + i, ts, k, c) for i, (ts, k, c, _f) in enumerate(recs) if i >= 1
    ]


def test_store_blocks_that_lie_are_refused() -> None:
    values = [_store_value(TS + i, b"kk" if i == 1 else None, b"x" * 10) for i in range(3)]
    good = B.store_block(7, values, 32)
    B.validate(good)
    body = bytearray(good[B.HEADER_SIZE:])
    assert struct.unpack_from(">III", body, 8) == (91, 113, 132)  # ends count from the block's first byte

    def resealed(body: bytes, **fields: int) -> bytes:
        return _reseal(good[:B.HEADER_SIZE - 4] + b"\0" * 4 + body, body_size=len(body), **fields)

    liars = [
        B.store_block(7, values, 33),  # a payload that is not the records'
        _reseal(good, count=2, last=8),  # fewer records than the ends table holds
        _reseal(good, max_ts=TS + 9),  # a timestamp no record has
        resealed(bytes(body[:8]) + struct.pack(">III", 91, 113, 133) + bytes(body[20:])),  # ends past the body
        resealed(bytes(body[:8]) + struct.pack(">III", 77, 113, 132) + bytes(body[20:])),  # a record under 9 bytes
        resealed(bytes(body) + b"\0"),  # trailing bytes
    ]
    for liar in liars:
        with pytest.raises(ProtocolError):
            B.validate(liar)
    with pytest.raises(ProtocolError):
        B.store_block(0, [b"short"], 0)
    with pytest.raises(ProtocolError):
        B.store_block(0, [], 0)
