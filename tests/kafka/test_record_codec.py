"""The compiled record codec and its pure twin give identical results (and identical errors)."""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.errors import ProtocolError
from dafka.kafka import _pure, records
from dafka.kafka.records import BATCH_HEADER_SIZE, Record, decode_batches, make_ext, record_tuples
from dafka.store.layout import FLAG_KAFKA, FLAG_KEY, FLAG_PRODUCER_TS, VALUE_HEADER

try:
    from dafka.kafka import _compiled  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without a compiler
    _compiled = None


@pytest.fixture(scope="module", autouse=True)
def compiled_twin() -> None:
    if _compiled is None:
        if os.environ.get("DAFKA_REQUIRE_EXTENSIONS") == "1":
            pytest.fail("DAFKA_REQUIRE_EXTENSIONS=1 but dafka.kafka._compiled is not built")
        pytest.skip("dafka.kafka._compiled is not built")


def test_the_chosen_implementation_follows_the_environment() -> None:
    want = "pure" if os.environ.get("DAFKA_NO_EXTENSIONS", "") not in ("", "0") else "compiled"
    assert records.IMPLEMENTATION == want


def both(fn: str, *args: object) -> object:
    """``fn`` of both twins: the same value, or the same exception type and message."""
    results = []
    for impl in (_pure, _compiled):
        try:
            results.append(("ok", getattr(impl, fn)(*args)))
        except (ProtocolError, ValueError, TypeError) as exc:
            results.append((type(exc).__name__, str(exc)))
    assert results[0] == results[1], (fn, results)
    return results[0][1]


def body_of(recs: list[tuple[int, bytes | None, bytes | None, list]], base_ts: int = 1000) -> tuple[bytes, int]:
    """A batch's records section as kafka-python's producer encodes it, and its base timestamp."""
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 26)
    for i, (ts, key, value, headers) in enumerate(recs):
        b.append(i, base_ts + ts, key, value, headers)
    data = bytes(b.build())
    return data[BATCH_HEADER_SIZE:], (struct.unpack_from(">q", data, 27)[0] if recs else base_ts)


small = st.binary(max_size=20)
header = st.tuples(st.text(max_size=8), st.none() | small)
record = st.tuples(
    st.integers(-(1 << 40), 1 << 40),
    st.none() | small,
    st.none() | st.binary(max_size=300),
    st.lists(header, max_size=3),
)


@settings(max_examples=300)
@given(st.lists(record, max_size=30), st.sampled_from([None, 77]))
def test_decode_records_agree_on_client_batches(recs: list, fixed: int | None) -> None:
    body, base_ts = body_of(recs)
    out = both("decode_records", body, 0, len(body), len(recs), base_ts, fixed, Record)
    got, max_slot, min_ts, nulls = out  # type: ignore[misc]
    assert [(r.key, r.value) for r in got] == [(k, v) for _, k, v, _ in recs]  # a null value: None
    assert nulls == sum(v is None for _, _, v, _ in recs)
    want_ts = [77 if fixed is not None else 1000 + ts for ts, _, _, _ in recs]
    assert [r.timestamp for r in got] == want_ts
    assert min_ts == min(want_ts, default=(1 << 63) - 1)
    slots = [len(make_ext(r.key, r.headers)) if r.headers != b"\x00" else len(r.key or b"") for r in got]
    assert max_slot == max(slots, default=0)


@settings(max_examples=500)
@given(st.lists(record, min_size=1, max_size=5), st.integers(0, 400), st.binary(min_size=1, max_size=12),
       st.integers(-3, 3))
def test_decode_records_agree_on_mutated_input(recs: list, pos: int, junk: bytes, count_delta: int) -> None:
    body, _ = body_of(recs)
    pos %= len(body)
    data = body[:pos] + junk + body[pos + len(junk):]
    both("decode_records", data, 0, len(data), max(0, len(recs) + count_delta), 1000, None, Record)


@given(st.binary(max_size=200), st.integers(0, 30), st.integers(-(1 << 63), (1 << 63) - 1))
def test_decode_records_agree_on_random_bytes(data: bytes, count: int, base_ts: int) -> None:
    both("decode_records", data, 0, len(data), count, base_ts, None, Record)


def test_varints_are_64_bit_at_most() -> None:
    # 10 bytes whose last carries more than the 64th bit: refused by both.
    rec = b"\x00" + b"\xff" * 9 + b"\x7f"
    body = bytes([len(rec) * 2 + 10]) + rec + b"\x00" * 5
    both("decode_records", body, 0, len(body), 1, 0, None, Record)
    with pytest.raises(ProtocolError, match="varint"):
        _compiled.decode_records(body, 0, len(body), 1, 0, None, Record)


def test_a_timestamp_past_64_bits_is_refused() -> None:
    body, _ = body_of([(0, None, b"v", []), (1 << 40, None, b"w", [])], base_ts=0)
    with pytest.raises(ProtocolError, match="timestamp"):
        _compiled.decode_records(body, 0, len(body), 2, (1 << 63) - 10, None, Record)
    both("decode_records", body, 0, len(body), 2, (1 << 63) - 10, None, Record)


def stored_value(ts: int, kind: int, key: bytes | None, value: bytes, headers: list) -> bytes:
    if kind == 0 or (kind == 1 and key is None):
        return VALUE_HEADER.pack(ts, 0) + value
    if kind == 1:
        return VALUE_HEADER.pack(ts, FLAG_KEY | FLAG_PRODUCER_TS) + bytes((len(key),)) + key + value  # type: ignore[arg-type]
    rec = decode_batches(client_batch([(ts & ((1 << 62) - 1), key, value, headers)]))[0].records[0]
    ext = make_ext(key, rec.headers)[:255]
    return VALUE_HEADER.pack(ts, FLAG_KEY | FLAG_KAFKA) + bytes((len(ext),)) + ext + value


def client_batch(recs: list) -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 26)
    for i, (ts, key, value, headers) in enumerate(recs):
        b.append(i, ts, key, value, headers)
    return bytes(b.build())


stored = st.tuples(
    st.integers(0, (1 << 64) - 1), st.sampled_from([0, 1, 2]), st.none() | small,
    st.binary(max_size=300), st.lists(header, min_size=1, max_size=3),
).map(lambda t: stored_value(*t))


@settings(max_examples=300)
@given(st.lists(stored, max_size=40), st.integers(0, (1 << 62)))
def test_encode_batch_agrees_and_round_trips(values: list[bytes], base: int) -> None:
    data = both("encode_batch", base, values)
    if not values:
        assert data == b""
        return
    [batch] = decode_batches(data)  # checks the CRC and every record
    assert batch.base_offset == base and len(batch.records) == len(values)
    for v, r in zip(values, batch.records, strict=True):
        # A negative stored timestamp (a u64 past 2^63) goes out as 0: the batch stays valid.
        assert r.timestamp == max(struct.unpack(">q", v[:8])[0], 0)
        assert v.endswith(r.value)


@settings(max_examples=200)
@given(st.lists(stored, max_size=40), st.integers(-100, 4000))
def test_encode_batch_with_a_limit_keeps_the_values_that_fit(values: list[bytes], limit: int) -> None:
    """At least one value, then those whose sizes + 8 each, + the 61-byte header, fit the limit."""
    data = both("encode_batch", 3, values, limit)
    if not values:
        assert data == b""
        return
    keep, cost = 1, len(values[0]) + 8
    for v in values[1:]:
        cost += len(v) + 8
        if cost + 61 > limit:
            break
        keep += 1
    assert data == _pure.encode_batch(3, values[:keep])


def test_encode_batch_with_a_limit_does_not_look_past_it() -> None:
    good = VALUE_HEADER.pack(1, 0) + b"v" * 100
    bad = b"short"  # would raise if encoded
    data = both("encode_batch", 0, [good, good, bad], 61 + 2 * (len(good) + 8))
    assert len(decode_batches(data)[0].records) == 2  # type: ignore[arg-type]
    both("encode_batch", 0, [good, good, bad], 61 + 3 * (len(good) + 8))  # the same ValueError


@given(st.lists(st.binary(max_size=30), max_size=6))
def test_encode_batch_agrees_on_malformed_stored_values(values: list[bytes]) -> None:
    both("encode_batch", 5, values)


def test_a_kafka_slot_that_does_not_parse_is_served_as_a_key() -> None:
    bad = VALUE_HEADER.pack(1, FLAG_KEY | FLAG_KAFKA) + b"\x02\xff\xff" + b"value"
    data = both("encode_batch", 0, [bad])
    [r] = decode_batches(data)[0].records  # type: ignore[arg-type]
    assert (r.key, r.value, r.headers) == (b"\xff\xff", b"value", b"\x00")


def gateway_tuples(topic: str, part: str, recs: list[Record]) -> list[tuple]:
    """The record tuples the gateway queues for a partition not stored yet."""
    return record_tuples(topic, part, 0, recs)


@settings(max_examples=60, deadline=None)
@given(st.lists(record, min_size=1, max_size=25))
def test_store_pairs_are_what_the_store_writes_for_the_record_tuples(tmp_path_factory: Any, recs: list) -> None:
    from dafka.store.db import RecordDB
    from dafka.store.layout import RECORD_KEY

    data = client_batch([(abs(ts), k, v, h) for ts, k, v, h in recs])
    decoded = decode_batches(data)[0].records
    with RecordDB(tmp_path_factory.mktemp("db"), sync=False) as db:
        db.append(gateway_tuples("t", "p", decoded))
        info = db.info("t", "p")
        _, stored_values = db.fetch_raw("t", "p", 0, len(decoded))
    assert info is not None
    pairs, nbytes = both("store_pairs", decoded, info.pid, 0)  # type: ignore[misc]
    assert [k for k, _ in pairs] == [RECORD_KEY.pack(info.pid, i) for i in range(len(decoded))]
    assert [v for _, v in pairs] == stored_values
    assert nbytes == info.bytes


@given(st.lists(st.tuples(st.integers(-5, (1 << 64) + 5), st.none() | st.binary(max_size=300),
                          st.binary(max_size=5), st.sampled_from([b"\x00", b"\x02\x02k\x00", b"\x02" + bytes(300)])),
                max_size=4),
       st.integers(-1, (1 << 32) + 1))
def test_store_pairs_agree_on_out_of_range_input(recs: list, pid: int) -> None:
    if pid < 0:
        return  # an unsigned argument in the compiled twin: OverflowError, never passed by the gateway
    both("store_pairs", [Record(*r) for r in recs], pid, 7)


@pytest.mark.parametrize("version", range(13))
def test_the_fetch_envelope_is_what_the_generic_encoder_writes(version: int) -> None:
    from dafka.kafka.codec import N, encode_fetch_response, encode_response

    batch = client_batch([(1000, b"k", b"v", [("h", b"1")])])
    topics = [("a", [(0, 0, 10, 2, batch), (3, 1, 10, 0, b"")]), ("b.é", [(1, 3, -1, -1, b"")]), ("c", [])]
    generic = encode_response(
        7, 1, version, throttle_time_ms=0, error_code=0, session_id=0,
        responses=[N(topic=name, partitions=[
            N(partition_index=i, error_code=c, high_watermark=h, last_stable_offset=h, log_start_offset=s,
              aborted_transactions=None, preferred_read_replica=-1, records=r)
            for i, c, h, s, r in parts]) for name, parts in topics],
    )
    assert encode_fetch_response(7, version, topics) == generic


@given(
    st.integers(0, 10),
    st.integers(-(1 << 31), (1 << 31) - 1),
    st.lists(
        st.tuples(
            st.text(min_size=0, max_size=40),
            st.lists(st.tuples(st.integers(-(1 << 31), (1 << 31) - 1), st.integers(-(1 << 15), (1 << 15) - 1),
                               st.integers(-(1 << 63), (1 << 63) - 1)), max_size=4),
        ),
        max_size=4,
    ),
)
def test_the_produce_answer_is_what_the_generic_encoder_writes(version: int, corr: int, topics: list) -> None:
    from dafka.kafka.codec import N, encode_produce_response, encode_response

    generic = encode_response(
        corr, 0, version, throttle_time_ms=0,
        responses=[N(name=name, partition_responses=[
            N(index=i, error_code=c, base_offset=b, log_append_time_ms=-1, log_start_offset=-1, record_errors=[],
              error_message=None)
            for i, c, b in parts]) for name, parts in topics],
    )
    assert encode_produce_response(corr, version, topics) == generic


def test_a_produce_answer_of_a_version_not_served_is_refused() -> None:
    from dafka.errors import ProtocolError
    from dafka.kafka.codec import encode_produce_response

    with pytest.raises(ProtocolError):
        encode_produce_response(1, 11, [])


@pytest.mark.parametrize("version", [0, 4, 11, 12])
@pytest.mark.parametrize("big", [(0,), (1,), (0, 1), (0, 2), (2,)])
def test_fetch_parts_join_to_the_frame_and_leave_big_record_sets_uncopied(version: int, big: tuple) -> None:
    from dafka.kafka.codec import SCATTER_MIN, encode_fetch_parts, encode_fetch_response

    values = [VALUE_HEADER.pack(1000 + i, 0) + os.urandom(200) for i in range(SCATTER_MIN // 200 + 10)]
    small = client_batch([(1000, b"k", b"v", [])])
    sets = [_pure.encode_batch(10 * i, values) if i in big else small for i in range(3)]
    topics = [("a", [(0, 0, 10, 2, sets[0]), (1, 0, 10, 0, sets[1])]), ("b", [(2, 0, 5, 0, sets[2])])]
    parts = encode_fetch_parts(9, version, topics)
    assert b"".join(parts) == encode_fetch_response(9, version, topics)
    assert sum(1 for p in parts if any(p is sets[i] for i in big)) == len(big)
    assert len(parts) <= 2 * len(big) + 1


@given(st.binary(max_size=40))
def test_a_tank_view_of_any_kafka_slot_never_raises(slot: bytes) -> None:
    from dafka.store.layout import without_kafka_extras

    v = VALUE_HEADER.pack(1, FLAG_KEY | FLAG_KAFKA) + bytes((min(len(slot), 255),)) + slot + b"content"
    out = without_kafka_extras(v)
    assert out.endswith(b"content") and not out[8] & FLAG_KAFKA


# ---------------------------------------------------------------- walk_records (batches stored as sent)


@settings(max_examples=300)
@given(st.lists(record, max_size=30))
def test_walk_records_agree_on_client_batches_and_measure_them(recs: list) -> None:
    body, base_ts = body_of(recs)
    first_ts, min_ts, max_ts, biggest, end = both("walk_records", body, 0, len(body), len(recs), base_ts)  # type: ignore[misc]
    assert end == len(body)
    tss = [1000 + ts for ts, _, _, _ in recs] or [base_ts]
    assert (first_ts, min_ts, max_ts) == (tss[0], min(tss), max(tss))
    decoded, *_ = _pure.decode_records(body, 0, len(body), len(recs), base_ts, None, Record)
    # key + value + the header section less its count byte: what max_record_bytes bounds
    sizes = [len(r.key or b"") + len(r.value or b"") + len(r.headers) - 1 for r in decoded]
    assert biggest == max(sizes, default=0)


@settings(max_examples=800)
@given(st.lists(record, min_size=1, max_size=5), st.integers(0, 400), st.binary(min_size=1, max_size=12),
       st.integers(-3, 3), st.integers(-(1 << 63), (1 << 63) - 1))
def test_walk_records_agree_on_mutated_input(recs: list, pos: int, junk: bytes, count_delta: int, base: int) -> None:
    body, _ = body_of(recs)
    pos %= len(body)
    data = body[:pos] + junk + body[pos + len(junk):]
    both("walk_records", data, 0, len(data), max(0, len(recs) + count_delta), base)


@settings(max_examples=500)
@given(st.binary(max_size=200), st.integers(0, 30), st.integers(-(1 << 63), (1 << 63) - 1), st.integers(0, 10))
def test_walk_records_agree_on_random_bytes(data: bytes, count: int, base_ts: int, start: int) -> None:
    both("walk_records", data, min(start, len(data)), len(data), count, base_ts)


def test_walk_records_refuses_what_the_decoder_would_read_differently() -> None:
    body, base = body_of([(0, b"k", b"v", [("h", b"x")]), (1, None, b"w", [])])
    assert both("walk_records", body, 0, len(body), 2, base)[4] == len(body)  # type: ignore[index]
    for pos, byte, why in (
        (1, 1, "attributes"),  # record 0's attributes byte
        (3, 2, "offset delta"),  # record 0's offset delta 1
    ):
        bad = body[:pos] + bytes((byte,)) + body[pos + 1:]
        err = both("walk_records", bad, 0, len(bad), 2, base)
        assert why in str(err)
    # a count over what is there, a range outside the buffer
    assert "record" in str(both("walk_records", body, 0, len(body), 3, base))
    assert "outside the buffer" in str(both("walk_records", body, 0, len(body) + 1, 2, base))
    # a timestamp delta that overflows int64
    assert "out of range" in str(both("walk_records", body, 0, len(body), 2, (1 << 63) - 1))
