"""The gateway's pure answer helpers: consume start rules, stored records as a Tank bundle."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dafka.store.layout import FLAG_KEY, FLAG_PRODUCER_TS, pack_value
from dafka.tank.bundle import (
    CODEC_NONE,
    CODEC_SNAPPY,
    decode_bundle,
    decode_chunk,
    parse_bundle_header,
)
from dafka.tank.codec import UINT64_MAX, encode_varint
from dafka.tank.serving import (
    COMPRESS_MIN,
    Bounds,
    Start,
    chunk_of,
    consume_start,
    stored_bundle,
)

TS = 1_700_000_000_123
TS_LE = struct.pack("<Q", TS)

# ``tank-cli produce -s 2 hello world`` (tank_current.md): codec 0, 2 messages, one timestamp.
CAPTURED_BUNDLE = b"\x08" + b"\x00" + TS_LE + b"\x05hello" + b"\x02\x05world"


def decoded(bundle: bytes, base: int = 1) -> list[tuple[int, int, bytes | None, bytes]]:
    return [(s, t, None if k is None else bytes(k), bytes(v)) for s, t, k, v in decode_bundle(bundle, base_seq=base)]


# ---------------------------------------------------------------- Bounds


@pytest.mark.parametrize(
    ("first", "last", "bounds", "discover"),
    [
        (None, None, (1, 0), (0, 0)),  # never anything stored
        (0, 0, (1, 1), (1, 1)),
        (0, 9, (1, 10), (1, 10)),
        (5, 9, (6, 10), (6, 10)),  # retention removed offsets 0..4
        (10, 9, (11, 10), (11, 10)),  # retention removed everything
        (None, 9, (11, 10), (11, 10)),  # no first known: nothing left
    ],
)
def test_bounds_from_store_offsets(first, last, bounds, discover) -> None:
    b = Bounds.of(first, last)
    assert b == bounds
    assert b.discover() == discover


# ---------------------------------------------------------------- consume_start


@pytest.mark.parametrize(
    ("requested", "bounds", "start"),
    [
        (0, (1, 10), ("data", 1)),  # 0 = first available
        (0, (6, 10), ("data", 6)),
        (0, (1, 0), ("tail", 1)),  # empty partition: park at the tail
        (0, (11, 10), ("tail", 11)),  # everything removed by retention
        (UINT64_MAX, (1, 10), ("tail", 11)),  # the end
        (UINT64_MAX, (1, 0), ("tail", 1)),
        (1, (1, 10), ("data", 1)),
        (10, (1, 10), ("data", 10)),
        (11, (1, 10), ("tail", 11)),  # exactly hwm + 1 parks
        (12, (1, 10), ("boundary", 12)),  # beyond hwm + 1
        (5, (6, 10), ("boundary", 5)),  # below first available
        (1, (1, 0), ("tail", 1)),
        (2, (1, 0), ("boundary", 2)),
    ],
)
def test_consume_start_table(requested, bounds, start) -> None:
    assert consume_start(requested, Bounds(*bounds)) == Start(*start)


seqs = st.integers(0, 2**64 - 1) | st.integers(0, 40) | st.just(UINT64_MAX)


@st.composite
def any_bounds(draw: st.DrawFn) -> Bounds:
    first_offset = draw(st.none() | st.integers(0, 30))
    last_offset = None if first_offset is None else draw(st.integers(first_offset - 1, 40))
    return Bounds.of(first_offset, last_offset)


@given(seqs, any_bounds())
def test_consume_start_follows_tank_rules(requested: int, bounds: Bounds) -> None:
    first, hwm = bounds
    start = consume_start(requested, bounds)
    assert start.kind in ("data", "tail", "boundary")
    if start.kind == "data":
        # Records exist from there on.
        assert first <= start.seq <= hwm
        assert start.seq == (first if requested == 0 else requested)
    elif start.kind == "tail":
        assert start.seq == hwm + 1
        assert requested in (0, UINT64_MAX, hwm + 1)
    else:
        assert requested not in (0, UINT64_MAX)
        assert requested < first or requested > hwm + 1
        assert start.seq == requested


# ---------------------------------------------------------------- stored_bundle


def test_stored_bundle_is_byte_identical_to_the_captured_tank_cli_bundle() -> None:
    values = [
        pack_value(TS, b"hello", ts_from_producer=True),
        pack_value(TS, b"world", ts_from_producer=True),
    ]
    assert stored_bundle(values) == CAPTURED_BUNDLE
    assert chunk_of(CAPTURED_BUNDLE) == b"\x17" + CAPTURED_BUNDLE


def test_stored_bundle_keys_and_timestamps() -> None:
    values = [
        pack_value(TS, b"a", key=b"k1", ts_from_producer=True),
        pack_value(TS, b"b", key=b"k2", ts_from_producer=True),  # same ts: flag 2 | 1
        pack_value(TS, b"c"),  # store timestamp, keyless, same ts
        pack_value(TS + 1, b"d", key=b""),  # an empty key is still a key
        pack_value(TS + 1, b"e", ts_from_producer=True),
        pack_value(TS, b"f", ts_from_producer=True),  # timestamps may go back
    ]
    bundle = stored_bundle(values)
    assert decoded(bundle) == [
        (1, TS, b"k1", b"a"),
        (2, TS, b"k2", b"b"),
        (3, TS, None, b"c"),
        (4, TS + 1, b"", b"d"),
        (5, TS + 1, None, b"e"),
        (6, TS, None, b"f"),
    ]
    # Layout: the second keyed message at the same timestamp carries no timestamp.
    assert bundle[:1] == bytes([6 << 2])
    assert bundle[1:10] == b"\x01" + TS_LE and bundle[10:14] == b"\x02k1\x01"
    assert bundle[15:19] == b"\x03\x02k2"


@pytest.mark.parametrize("top", [0x00, 0x2D, 0xFF])
def test_stored_bundle_first_message_always_has_a_timestamp(top: int) -> None:
    # A Tank producer may send any u64 timestamp; whatever its bytes, the
    # first message must carry it (0x2d is b"-": it once matched a sentinel).
    ts = (top << 56) | 0x0102030405
    for values in (
        [pack_value(ts, b"x", ts_from_producer=True)],
        [pack_value(ts, b"x")],
        [pack_value(ts, b"x", key=b"k", ts_from_producer=True)],
    ):
        bundle = stored_bundle(values, compress=False)
        assert not bundle[1] & 0x02, bundle.hex()
        assert decoded(bundle) == [(1, ts, b"k" if values[0][8] & FLAG_KEY else None, b"x")]


def test_stored_bundle_counts_and_long_values() -> None:
    values = [pack_value(TS, b"v" * n) for n in (0, 1, 127, 128, 300, 20_000)] * 3
    bundle = stored_bundle(values, compress=False)
    hdr = parse_bundle_header(bundle)
    assert hdr.count == 18 and bundle[0] == 0  # more than 15: a varint count follows
    assert bundle[1:2] == encode_varint(18)
    assert [v for _s, _t, _k, v in decoded(bundle)] == [v[9:] for v in values]


def test_stored_bundle_compresses_only_when_it_pays() -> None:
    compressible = [pack_value(TS, b"abcd" * 100) for _ in range(20)]
    bundle = stored_bundle(compressible)
    assert parse_bundle_header(bundle).codec == CODEC_SNAPPY
    assert len(bundle) < COMPRESS_MIN
    assert [v for _s, _t, _k, v in decoded(bundle)] == [b"abcd" * 100] * 20
    assert parse_bundle_header(stored_bundle(compressible, compress=False)).codec == CODEC_NONE
    random_data = [pack_value(TS, os.urandom(500)) for _ in range(20)]
    assert parse_bundle_header(stored_bundle(random_data)).codec == CODEC_NONE
    small = [pack_value(TS, b"a" * 100) for _ in range(3)]  # under COMPRESS_MIN
    assert parse_bundle_header(stored_bundle(small)).codec == CODEC_NONE


@st.composite
def stored_values(draw: st.DrawFn) -> list[tuple[int, bytes | None, bytes, bool]]:
    n = draw(st.integers(1, 40))
    out: list[tuple[int, bytes | None, bytes, bool]] = []
    for _ in range(n):
        if out and draw(st.booleans()):
            ts = out[-1][0]  # runs of equal timestamps
        else:
            ts = draw(st.integers(0, 2**64 - 1) | st.integers(0, 255).map(lambda b: b << 56))
        key = draw(st.none() | st.binary(max_size=255))
        content = draw(st.binary(max_size=300) | st.sampled_from([b"", b"x" * 200, b"ab" * 3000]))
        out.append((ts, key, content, draw(st.booleans())))
    return out


@given(stored_values(), st.booleans(), st.integers(0, 2**40))
@example([(0x2D << 56, None, b"a", True), (5, None, b"b", False)], False, 1)
@example([(0x2D00000000000000, None, b"", False)], True, 7)
def test_stored_bundle_round_trips(values, compress: bool, base: int) -> None:
    raw = [pack_value(ts, c, key=k, ts_from_producer=p) for ts, k, c, p in values]
    bundle = stored_bundle(raw, compress)
    assert decoded(bundle, base) == [(base + i, ts, k, c) for i, (ts, k, c, _p) in enumerate(values)]
    chunk = decode_chunk(chunk_of(bundle), base)
    assert chunk.bundles == 1 and chunk.next_seq == base + len(values) and chunk.partial_bytes == 0
    assert len(chunk.records) == len(values)


def test_stored_value_flags_are_what_stored_bundle_reads() -> None:
    # The serving code reads flags straight from stored values: keep them in step.
    v = pack_value(TS, b"c", key=b"key", ts_from_producer=True)
    assert v[8] == FLAG_KEY | FLAG_PRODUCER_TS and v[9] == 3 and v[10:13] == b"key"
