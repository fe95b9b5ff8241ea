"""Record batches v2 and legacy message sets, sans-IO, against a real client's encoder."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.legacy_records import LegacyRecordBatchBuilder

from dafka.errors import ProtocolError
from dafka.kafka.records import (
    CODEC_GZIP,
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_SNAPPY,
    CODEC_ZSTD,
    TooManyRecords,
    decode_batches,
    encode_batch,
    make_ext,
    parse_headers,
)
from dafka.store.layout import FLAG_KAFKA, FLAG_KEY, VALUE_HEADER


def client_batch(records, codec=CODEC_NONE, pid=-1, seq=-1) -> bytes:
    """A batch as kafka-python's producer builds it."""
    b = DefaultRecordBatchBuilder(2, codec, False, pid, 0 if pid >= 0 else -1, seq, 1 << 24)
    for i, (ts, key, value, headers) in enumerate(records):
        b.append(i, ts, key, value, headers)
    return bytes(b.build())


RECS = [
    (1000, None, b"plain", []),
    (1001, b"k1", b"keyed", []),
    (1002, b"k2", b"with headers", [("a", b"1"), ("b", None)]),
    (1002, None, b"", [("only", b"header")]),
]


@pytest.mark.parametrize("codec", [CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD])
def test_decodes_what_a_client_sends_in_every_codec(codec: int) -> None:
    data = client_batch(RECS * 50, codec, pid=7, seq=3)
    [batch] = decode_batches(data)
    assert (batch.producer_id, batch.base_sequence) == (7, 3)
    got = [(r.timestamp, r.key, r.value, parse_headers(r.headers)) for r in batch.records]
    assert got == [(ts, k, v, h) for ts, k, v, h in RECS * 50]


def test_legacy_message_sets_decode() -> None:
    for magic in (0, 1):
        b = LegacyRecordBatchBuilder(magic, 0, 1 << 20)
        b.append(0, 5000, b"k", b"v0")
        b.append(1, 5001, None, b"v1")
        got = [(r.key, r.value) for bt in decode_batches(bytes(b.build())) for r in bt.records]
        assert got == [(b"k", b"v0"), (None, b"v1")]


def stored(ts: int, key: bytes | None, value: bytes, headers: list) -> bytes:
    """A stored value as the gateway writes it for this record."""
    if headers:
        enc = client_batch([(ts, key, value, headers)])
        rec = decode_batches(enc)[0].records[0]
        ext = make_ext(key, rec.headers)
        return VALUE_HEADER.pack(ts, FLAG_KEY | FLAG_KAFKA | 2) + bytes((len(ext),)) + ext + value
    if key is not None:
        return VALUE_HEADER.pack(ts, FLAG_KEY | 2) + bytes((len(key),)) + key + value
    return VALUE_HEADER.pack(ts, 0) + value


@pytest.mark.parametrize("codec", [CODEC_NONE, CODEC_GZIP])
def test_a_record_budget_is_spent_per_request_and_checked_before_decoding(codec: int) -> None:
    data = client_batch([(1000, None, b"v", [])] * 30, codec)
    budget = [70]
    assert len(decode_batches(data, records=budget)[0].records) == 30
    assert len(decode_batches(data, records=budget)[0].records) == 30
    assert budget == [10]
    with pytest.raises(TooManyRecords):
        decode_batches(data + data, records=[45])
    budget = [45]
    with pytest.raises(TooManyRecords):  # the second batch does not fit: the first is given back
        decode_batches(data + data, records=budget)
    assert budget == [45]
    # A lying header count is still a protocol error, not a refusal of size.
    with pytest.raises(ProtocolError):
        decode_batches(data[:-3], records=[100])


def test_legacy_messages_count_one_by_one() -> None:
    b = LegacyRecordBatchBuilder(1, 0, 1 << 20)
    for i in range(10):
        b.append(i, 5000, None, b"v%d" % i)
    data = bytes(b.build())
    assert len(decode_batches(data, records=[10])) == 10
    with pytest.raises(TooManyRecords):
        decode_batches(data, records=[9])


def test_encode_round_trips_keys_headers_and_timestamps() -> None:
    values = [stored(*r) for r in RECS]
    data = encode_batch(40, values)
    [batch] = decode_batches(data)  # checks the CRC too
    assert batch.base_offset == 40
    assert [(r.timestamp, r.key, r.value, parse_headers(r.headers)) for r in batch.records] == RECS


def test_crc_mismatch_and_truncation_are_protocol_errors() -> None:
    data = bytearray(client_batch(RECS))
    data[-1] ^= 0xFF
    with pytest.raises(ProtocolError, match="CRC"):
        decode_batches(bytes(data))
    with pytest.raises(ProtocolError):
        decode_batches(client_batch(RECS)[:-3])


def test_a_compression_bomb_is_bounded() -> None:
    data = client_batch([(0, None, bytes(1 << 20), [])] * 8, CODEC_GZIP)
    assert len(data) < 100_000
    with pytest.raises(ProtocolError, match="inflates"):
        decode_batches(data, limit=1 << 20)


def test_a_lying_record_count_is_refused_before_looping() -> None:
    data = bytearray(client_batch(RECS))
    struct.pack_into(">i", data, 57, 1 << 30)
    from crc32c import crc32c

    struct.pack_into(">I", data, 17, crc32c(bytes(data[21:])))
    with pytest.raises(ProtocolError, match="count"):
        decode_batches(bytes(data))


@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    try:
        decode_batches(data)
    except ProtocolError:
        pass


@given(st.integers(0, 200), st.binary(max_size=40))
def test_mutated_client_batches_only_ever_raise_protocol_error(pos: int, junk: bytes) -> None:
    base = client_batch(RECS, CODEC_NONE)
    data = base[:pos] + junk + base[pos + len(junk):]
    try:
        decode_batches(data)
    except ProtocolError:
        pass


# ---------------------------------------------------------------- batches kept as sent (split_batches)


@pytest.mark.parametrize("codec", [CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD])
def test_split_keeps_every_codec_as_sent_and_measures_it(codec: int) -> None:
    from dafka.kafka.records import split_batches

    data = client_batch(RECS, codec)
    budget, count = [1 << 20], [100]
    [b] = split_batches(data, shared=budget, records=count)
    assert b.raw == data and b.records == [] and b.record_count == 4 and count == [96]
    assert b.scan is not None and b.scan.compression == b.attributes & 7  # (the builder may not compress)
    assert (b.scan.first_ts, b.min_ts, b.scan.max_ts) == (1000, 1000, 1002)
    assert b.scan.biggest == len(b"k2") + len(b"with headers") + len(b"a") + 1 + len(b"b") + 2 * 2
    if b.scan.compression:
        assert budget[0] < 1 << 20  # the inflated size was spent
    with pytest.raises(TooManyRecords):
        split_batches(data, records=[3])


@given(st.binary(max_size=300))
def test_split_of_random_bytes_only_ever_raises_protocol_error(data: bytes) -> None:
    from dafka.kafka.records import split_batches

    try:
        split_batches(data)
    except ProtocolError:
        pass


@given(st.sampled_from([CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD]), st.integers(0, 300),
       st.binary(min_size=1, max_size=40))
def test_split_of_mutated_batches_only_ever_raises_protocol_error_or_keeps_a_true_batch(
    codec: int, pos: int, junk: bytes
) -> None:
    """Whatever a mutation leaves, a batch is either refused or kept with a scan that agrees
    with a full decode of it (count, timestamps and values)."""
    from dafka.kafka.records import batch_values, split_batches

    base = client_batch(RECS, codec)
    data = base[:pos] + junk + base[pos + len(junk):]
    try:
        got = split_batches(data)
    except ProtocolError:
        return
    for b in got:
        if b.scan is None or b.raw is None:
            continue
        [decoded] = decode_batches(b.raw)
        assert b.record_count == len(decoded.records)
        assert batch_values(b.raw) == [r.value or b"" for r in decoded.records]


@given(st.integers(21, 300), st.binary(min_size=1, max_size=12), st.integers(-2, 2))
def test_split_of_lies_behind_a_good_crc_refuses_or_keeps_a_true_batch(pos: int, junk: bytes, grow: int) -> None:
    """Mutations under the CRC (which is computed again, as a hostile client would): refused, or
    kept only when a full decode agrees with what was measured (a batch that tells the truth)."""
    from crc32c import crc32c

    from dafka.kafka.records import batch_values, split_batches

    base = bytearray(client_batch(RECS, CODEC_NONE))
    data = base[:pos] + junk + base[pos + len(junk) - grow if grow < 0 else pos + len(junk):]
    if len(data) >= 61:
        struct.pack_into(">i", data, 8, len(data) - 12)
        struct.pack_into(">I", data, 17, crc32c(bytes(data[21:])))
    try:
        got = split_batches(bytes(data))
    except ProtocolError:
        return
    for b in got:
        if b.scan is None or b.raw is None:
            continue
        [decoded] = decode_batches(b.raw)
        assert b.record_count == len(decoded.records) == b.scan.record_count
        assert batch_values(b.raw) == [r.value or b"" for r in decoded.records]
        assert b.scan.max_ts == max(r.timestamp for r in decoded.records)
