"""Tank bundles and consume chunks."""

from __future__ import annotations

import struct

import pytest
import snappy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.tank.bundle import (
    CODEC_NONE,
    CODEC_SNAPPY,
    BundleHeader,
    Record,
    choose_codec,
    decode_bundle,
    decode_chunk,
    encode_bundle,
    encode_chunk,
    parse_bundle_header,
    should_compress,
    split_chunk,
)
from dafka.tank.codec import encode_varint

TS = 1_700_000_000_123
TS_BYTES = struct.pack("<Q", TS)
U64 = struct.Struct("<Q")

# ``tank-cli produce -s 2 hello world``: codec 0, 2 messages, one timestamp.
CAPTURED_BUNDLE = b"\x08" + b"\x00" + TS_BYTES + b"\x05hello" + b"\x02\x05world"


def plain(values: list[bytes], ts: int = TS) -> list[Record]:
    return [(None, ts, None, v) for v in values]


# ---------------------------------------------------------------- strategies


@st.composite
def timestamps(draw: st.DrawFn, n: int) -> list[int]:
    """Runs of equal timestamps (the encoder elides repeats) mixed with new ones."""
    out: list[int] = []
    for _ in range(n):
        if out and draw(st.booleans()):
            out.append(out[-1])
        else:
            out.append(draw(st.integers(0, 2**64 - 1)))
    return out


@st.composite
def record_lists(draw: st.DrawFn, sparse: bool, min_size: int = 1, max_size: int = 40) -> list:
    n = draw(st.integers(min_size, max_size))
    tss = draw(timestamps(n))
    keyed = draw(st.sampled_from(["none", "all", "some"]))
    recs = []
    seq = draw(st.integers(0, 2**63)) if sparse else None
    for i in range(n):
        if keyed == "none":
            key = None
        elif keyed == "all":
            key = draw(st.binary(max_size=255))
        else:
            key = draw(st.none() | st.binary(max_size=20))
        value = draw(st.binary(max_size=200))
        if sparse and i:
            gap = draw(st.integers(0, 3) | st.integers(0, 1000) | st.integers(0, 2**20))
            seq += 1 + gap
        recs.append((seq, tss[i], key, value))
    return recs


def strip_seqs(recs: list) -> list:
    return [(None, ts, k, v) for _, ts, k, v in recs]


# ---------------------------------------------------------------- captured vector


def test_captured_bundle_decodes() -> None:
    hdr = parse_bundle_header(CAPTURED_BUNDLE)
    assert hdr == BundleHeader(CODEC_NONE, 2, False, None, None, 1, 23)
    assert decode_bundle(CAPTURED_BUNDLE) == plain([b"hello", b"world"])
    assert decode_bundle(CAPTURED_BUNDLE, base_seq=1) == [
        (1, TS, None, b"hello"),
        (2, TS, None, b"world"),
    ]


def test_captured_bundle_reencodes_byte_for_byte() -> None:
    assert encode_bundle(plain([b"hello", b"world"])) == CAPTURED_BUNDLE
    assert len(CAPTURED_BUNDLE) == 0x17


def test_tail_wakeup_bundle() -> None:
    b = b"\x04" + b"\x00" + TS_BYTES + b"\x04late"
    assert encode_bundle(plain([b"late"])) == b
    assert decode_bundle(b, base_seq=109) == [(109, TS, None, b"late")]


# ---------------------------------------------------------------- exact layouts


def test_keys_and_timestamps_layout() -> None:
    recs = [
        (None, 5, b"k", b"a"),
        (None, 5, None, b"b"),
        (None, 6, b"", b"c"),
        (None, 6, b"kk", b""),
    ]
    expected = (
        b"\x10"  # 4 messages, codec 0
        + b"\x01" + U64.pack(5) + b"\x01k" + b"\x01a"
        + b"\x02" + b"\x01b"
        + b"\x01" + U64.pack(6) + b"\x00" + b"\x01c"
        + b"\x03" + b"\x02kk" + b"\x00"
    )  # fmt: skip
    assert encode_bundle(recs) == expected
    assert decode_bundle(expected) == recs


def test_count_over_15_uses_varint() -> None:
    recs = plain([b"v"] * 16)
    b = encode_bundle(recs)
    assert b[0] == 0x00 and b[1] == 16
    assert decode_bundle(b) == recs
    recs = plain([b"v"] * 300)
    b = encode_bundle(recs, codec=CODEC_NONE)
    assert b[:3] == b"\x00" + encode_varint(300)
    assert parse_bundle_header(b).count == 300
    assert decode_bundle(b) == recs


def test_long_value_varint_length() -> None:
    recs = plain([b"x" * 200, b"y" * 70000])
    b = encode_bundle(recs, codec=CODEC_NONE)
    assert b[10:12] == encode_varint(200)
    assert decode_bundle(b) == recs


def test_sparse_layout() -> None:
    recs = [(10, 7, None, b"a"), (11, 7, None, b"b"), (15, 7, None, b"c"), (20, 8, b"k", b"d")]
    expected = (
        bytes([0x40 | 4 << 2])
        + U64.pack(10) + encode_varint(20 - 10 - 1)
        + b"\x00" + U64.pack(7) + b"\x01a"  # first: seq in header
        + b"\x06" + b"\x01b"  # prev + 1, same ts
        + b"\x02" + encode_varint(15 - 11 - 1) + b"\x01c"  # gap of 3
        + b"\x01" + U64.pack(8) + b"\x01k" + b"\x01d"  # last: seq in header
    )  # fmt: skip
    assert encode_bundle(recs, sparse=True) == expected
    hdr = parse_bundle_header(expected)
    assert (hdr.sparse, hdr.first_seq, hdr.last_seq, hdr.count) == (True, 10, 20, 4)
    assert decode_bundle(expected) == recs
    assert decode_bundle(expected, base_seq=999) == recs  # sparse ignores the base


def test_sparse_single_message_has_no_delta() -> None:
    recs = [(42, TS, None, b"only")]
    b = encode_bundle(recs, sparse=True)
    assert b == b"\x44" + U64.pack(42) + b"\x00" + TS_BYTES + b"\x04only"
    assert decode_bundle(b) == recs


def test_sparse_flag4_on_first_and_last_is_accepted_when_consistent() -> None:
    # Other encoders may set "prev + 1" on the last message; it must agree with the header.
    body = b"\x00" + TS_BYTES + b"\x01a" + b"\x06\x01b"
    good = b"\x48" + U64.pack(5) + encode_varint(0) + body
    assert decode_bundle(good) == [(5, TS, None, b"a"), (6, TS, None, b"b")]
    bad = b"\x48" + U64.pack(5) + encode_varint(3) + body  # header says last = 9
    with pytest.raises(ProtocolError):
        decode_bundle(bad)


def test_sparse_middle_seq_reaching_last_is_rejected() -> None:
    # 3 messages 1..3 but the middle one claims a gap that reaches the last seq
    b = (
        b"\x4c" + U64.pack(1) + encode_varint(1)
        + b"\x00" + TS_BYTES + b"\x01a"
        + b"\x02" + encode_varint(1) + b"\x01b"
        + b"\x02\x01c"
    )  # fmt: skip
    with pytest.raises(ProtocolError):
        decode_bundle(b)


def test_snappy_is_raw_block_over_message_set() -> None:
    recs = plain([b"hello world " * 10] * 20)
    raw = encode_bundle(recs, codec=CODEC_NONE)
    comp = encode_bundle(recs, codec=CODEC_SNAPPY)
    assert raw[0] == 0x00 and comp[0] == 0x01  # count 20 > 15: varint follows
    assert comp[1] == raw[1] == 20
    assert snappy.uncompress(comp[2:]) == raw[2:]
    assert len(comp) < len(raw)
    assert decode_bundle(comp) == recs
    sparse = [(i * 3, TS, None, b"v" * 50) for i in range(1, 5)]
    sc = encode_bundle(sparse, codec=CODEC_SNAPPY, sparse=True)
    sr = encode_bundle(sparse, codec=CODEC_NONE, sparse=True)
    hdr = parse_bundle_header(sc)
    assert sc[: hdr.msgset_start] == bytes([sr[0] | 1]) + sr[1 : hdr.msgset_start]
    assert snappy.uncompress(sc[hdr.msgset_start :]) == sr[hdr.msgset_start :]
    assert decode_bundle(sc) == sparse


# ---------------------------------------------------------------- compression rule


def test_compression_rule() -> None:
    assert not should_compress(512, 1024)
    assert should_compress(513, 0)
    assert should_compress(1, 1025)
    assert choose_codec(plain([b""] * 512)) == CODEC_NONE
    assert choose_codec(plain([b""] * 513)) == CODEC_SNAPPY
    assert choose_codec(plain([b"x" * 1024])) == CODEC_NONE
    assert choose_codec(plain([b"x" * 1025])) == CODEC_SNAPPY
    assert choose_codec([(None, TS, b"k" * 24, b"x" * 1000)]) == CODEC_NONE
    assert choose_codec([(None, TS, b"k" * 25, b"x" * 1000)]) == CODEC_SNAPPY
    # encode_bundle applies the rule unless told otherwise
    assert encode_bundle(plain([b"x" * 1025]))[0] & 3 == CODEC_SNAPPY
    assert encode_bundle(plain([b"x" * 1025]), codec=CODEC_NONE)[0] & 3 == CODEC_NONE
    assert encode_bundle(plain([b"x"]), codec=CODEC_SNAPPY)[0] & 3 == CODEC_SNAPPY


# ---------------------------------------------------------------- encoder errors


@pytest.mark.parametrize(
    ("recs", "kwargs"),
    [
        ([], {}),
        ([(None, TS, b"k" * 256, b"v")], {}),
        ([(None, -1, None, b"v")], {}),
        ([(None, 2**64, None, b"v")], {}),
        ([(None, None, None, b"v")], {}),
        ([(None, TS, None, b"v")], {"codec": 2}),
        ([(None, TS, None, b"v")], {"sparse": True}),
        ([(5, TS, None, b"v"), (5, TS, None, b"w")], {"sparse": True}),
        ([(5, TS, None, b"v"), (4, TS, None, b"w")], {"sparse": True}),
        ([(-1, TS, None, b"v")], {"sparse": True}),
        ([(2**64, TS, None, b"v")], {"sparse": True}),
        ([(0, TS, None, b"v"), (2**33, TS, None, b"w")], {"sparse": True}),  # span > u32
    ],
)
def test_encode_rejects(recs: list, kwargs: dict) -> None:
    with pytest.raises(ProtocolError):
        encode_bundle(recs, **kwargs)


# ---------------------------------------------------------------- decoder errors


def one(ts_flag: int = 0) -> bytes:
    return bytes([ts_flag]) + TS_BYTES + b"\x01a"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x06" + one(),  # codec 2
        b"\x07" + one(),  # codec 3
        b"\x84" + one(),  # bit 7
        b"\x00\x00" + one(),  # varint count 0
        b"\x00",  # varint count missing
        b"\x00\x80\x80\x80\x80\x80" + one(),  # over-long count
        b"\x08" + one(),  # count 2, one message
        b"\x04" + one() + b"\x00",  # trailing byte
        b"\x04" + one()[:-1],  # value cut
        b"\x04" + b"\x02\x01a",  # first message without timestamp
        b"\x04" + b"\x08" + TS_BYTES + b"\x01a",  # unknown message flag
        b"\x04" + b"\x01" + TS_BYTES + b"\x05a",  # key runs past the end
        b"\x04" + b"\x00" + TS_BYTES[:4],  # timestamp cut
        b"\x04" + b"\x00" + TS_BYTES + b"\xff\xff",  # length varint cut
        b"\x44" + U64.pack(1)[:5],  # sparse header cut
        b"\x48" + U64.pack(1),  # sparse delta missing
        b"\x48" + U64.pack(2**64 - 1) + b"\x00" + one() + one(2),  # last seq > u64
        b"\x05" + b"\x00\x01\x02",  # bad snappy
        b"\x05",  # empty snappy
        b"\x05" + encode_varint(2**31) + b"\x00",  # snappy claims a huge size
        b"\x05" + snappy.compress(one() + b"x"),  # snappy ok, trailing garbage inside
    ],
)
def test_decode_rejects(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_bundle(data)


def test_decode_inside_larger_buffer_is_bounded() -> None:
    # The bundle claims 2 messages but holds one; the bytes after it (another
    # bundle) must not be read as its second message.
    b1 = b"\x08" + one()
    b2 = encode_bundle(plain([b"zz"]))
    buf = b1 + b2
    with pytest.raises(ProtocolError):
        decode_bundle(buf, 0, len(b1))
    assert decode_bundle(buf, len(b1)) == plain([b"zz"])
    assert decode_bundle(memoryview(buf), len(b1)) == plain([b"zz"])


# ---------------------------------------------------------------- round trips


@given(record_lists(sparse=False), st.sampled_from([CODEC_NONE, CODEC_SNAPPY, None]))
def test_roundtrip_plain(recs: list, codec: int | None) -> None:
    b = encode_bundle(recs, codec=codec)
    assert decode_bundle(b) == recs
    hdr = parse_bundle_header(b)
    assert hdr.count == len(recs) and not hdr.sparse and hdr.end == len(b)
    assert hdr.codec == (choose_codec(recs) if codec is None else codec)
    assert decode_bundle(b, base_seq=77) == [(77 + i, *r[1:]) for i, r in enumerate(recs)]


@given(record_lists(sparse=True), st.sampled_from([CODEC_NONE, CODEC_SNAPPY]))
def test_roundtrip_sparse(recs: list, codec: int) -> None:
    b = encode_bundle(recs, codec=codec, sparse=True)
    assert decode_bundle(b) == recs
    hdr = parse_bundle_header(b)
    assert (hdr.first_seq, hdr.last_seq, hdr.count) == (recs[0][0], recs[-1][0], len(recs))


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(record_lists(sparse=False, min_size=16, max_size=140), st.booleans())
def test_roundtrip_many_messages(recs: list, sparse: bool) -> None:
    if sparse:
        recs = [(1000 + 2 * i, *r[1:]) for i, r in enumerate(recs)]
    b = encode_bundle(recs, sparse=sparse)
    assert b[0] >> 2 & 0xF == 0
    assert decode_bundle(b) == recs


# ---------------------------------------------------------------- chunks


def test_chunk_plain_bundles_continue_from_base() -> None:
    b1 = encode_bundle(plain([b"a", b"b", b"c"]))
    b2 = encode_bundle(plain([b"d"] * 20), codec=CODEC_SNAPPY)
    res = decode_chunk(encode_chunk([b1, b2]), 100)
    assert [r[0] for r in res.records] == list(range(100, 123))
    assert res.records[3] == (103, TS, None, b"d")
    assert (res.next_seq, res.bundles, res.partial_bytes, res.partial_size) == (123, 2, 0, None)


def test_chunk_sparse_bundle_resets_seq() -> None:
    b1 = encode_bundle([(50, TS, None, b"x"), (55, TS, None, b"y")], sparse=True)
    b2 = encode_bundle(plain([b"p", b"q"]))
    b3 = encode_bundle([(90, TS, None, b"z")], sparse=True)
    chunk = encode_chunk([b1, b2, b3])
    # flags 0xfe: no base in the header; the first bundle carries it
    res = decode_chunk(chunk, None)
    assert [r[0] for r in res.records] == [50, 55, 56, 57, 90]
    assert res.next_seq == 91
    with pytest.raises(ProtocolError):
        decode_chunk(encode_chunk([b2, b1]), None)


def test_chunk_drops_messages_below_min_seq() -> None:
    b1 = encode_bundle(plain([b"a"] * 5))  # 100..104
    b2 = encode_bundle(plain([b"b"] * 3))  # 105..107
    chunk = encode_chunk([b1, b2])
    res = decode_chunk(chunk, 100, 103)
    assert [r[0] for r in res.records] == [103, 104, 105, 106, 107]
    res = decode_chunk(chunk, 100, 106)
    assert [r[0] for r in res.records] == [106, 107]
    assert res.next_seq == 108 and res.bundles == 2
    sp = encode_bundle(
        [(10, TS, None, b"x"), (20, TS, None, b"y"), (30, TS, None, b"z")], sparse=True
    )
    assert [r[0] for r in decode_chunk(encode_chunk([sp]), None, 15).records] == [20, 30]


def test_chunk_skips_garbage_bundles_wholly_below_min_seq() -> None:
    # bundles wholly below the requested seq are skipped without decoding
    bad = b"\x04" + b"\x02\x01a"  # malformed message set
    good = encode_bundle(plain([b"ok"]))
    res = decode_chunk(encode_chunk([bad, good]), 10, 11)
    assert res.records == [(11, TS, None, b"ok")]


def test_chunk_partial_last_bundle() -> None:
    b1 = encode_bundle(plain([b"a", b"b"]))
    b2 = encode_bundle(plain([b"c" * 300]))
    chunk = encode_chunk([b1, b2])
    full = len(chunk)
    first_len = 1 + len(b1)
    for cut in range(first_len, full):
        res = decode_chunk(chunk[:cut], 1)
        assert res.records == [(1, TS, None, b"a"), (2, TS, None, b"b")]
        assert res.next_seq == 3 and res.bundles == 1
        assert res.partial_bytes == cut - first_len
        if cut - first_len >= 2:  # b2's 2-byte length prefix is readable
            assert res.partial_size == full - first_len
        else:
            assert res.partial_size is None
    for cut in range(first_len):
        res = decode_chunk(chunk[:cut], 1)
        assert res.records == [] and res.next_seq == 1 and res.bundles == 0


def test_chunk_empty_and_malformed() -> None:
    assert decode_chunk(b"", 7) == ([], 7, 0, 0, None)
    assert decode_chunk(b"", None).next_seq is None
    with pytest.raises(ProtocolError):
        decode_chunk(b"\x00", 1)  # zero-length bundle
    with pytest.raises(ProtocolError):
        decode_chunk(b"\x80\x80\x80\x80\x80\x01", 1)  # over-long length
    with pytest.raises(ProtocolError):
        decode_chunk(encode_chunk([b"\x84" + one()]), 1)


def test_split_chunk() -> None:
    b1, b2 = encode_bundle(plain([b"a"])), encode_bundle(plain([b"b" * 200]))
    chunk = encode_chunk([b1, b2])
    spans, partial = split_chunk(chunk)
    assert [chunk[s:e] for s, e in spans] == [b1, b2] and partial == 0
    spans, partial = split_chunk(chunk[:-1])
    assert [chunk[s:e] for s, e in spans] == [b1] and partial == len(b2) + 1


@st.composite
def chunks(draw: st.DrawFn) -> tuple[list[list], int]:
    bundles = []
    seq = draw(st.integers(1, 2**40))
    base = seq
    for _ in range(draw(st.integers(1, 5))):
        sparse = draw(st.booleans())
        recs = draw(record_lists(sparse=False, max_size=20))
        if sparse:
            seq += draw(st.integers(0, 50))
            recs = [(seq + 2 * i, *r[1:]) for i, r in enumerate(recs)]
            seq = recs[-1][0] + 1
        else:
            recs = [(seq + i, *r[1:]) for i, r in enumerate(recs)]
            seq += len(recs)
        bundles.append((recs, sparse, draw(st.sampled_from([CODEC_NONE, CODEC_SNAPPY]))))
    return bundles, base


@given(chunks(), st.data())
def test_roundtrip_chunk(spec: tuple, data: st.DataObject) -> None:
    bundles, base = spec
    encoded = [encode_bundle(r, codec=c, sparse=s) for r, s, c in bundles]
    chunk = encode_chunk(encoded)
    every = [rec for recs, _, _ in bundles for rec in recs]
    head_base = None if bundles[0][1] else base
    res = decode_chunk(chunk, head_base)
    assert res.records == every
    assert res.next_seq == every[-1][0] + 1
    min_seq = data.draw(st.integers(0, every[-1][0] + 2))
    assert decode_chunk(chunk, head_base, min_seq).records == [r for r in every if r[0] >= min_seq]
    # any cut: only complete bundles come back
    cut = data.draw(st.integers(0, len(chunk)))
    res = decode_chunk(chunk[:cut], head_base)
    done, pos = [], 0
    for recs, b in zip([r for r, _, _ in bundles], encoded, strict=True):
        pos += len(encode_varint(len(b))) + len(b)
        if pos > cut:
            break
        done.extend(recs)
    assert res.records == done


# ---------------------------------------------------------------- garbage in


@given(st.binary(max_size=120))
def test_random_bytes_bundle(data: bytes) -> None:
    for call in (
        lambda: parse_bundle_header(data),
        lambda: decode_bundle(data),
        lambda: decode_bundle(data, base_seq=5),
        lambda: decode_chunk(data, 1, 3),
        lambda: decode_chunk(data, None),
        lambda: split_chunk(data),
    ):
        try:
            call()
        except ProtocolError:
            pass


@given(st.binary(max_size=60))
def test_random_message_sets(body: bytes) -> None:
    for head in (
        b"\x04",
        b"\x08",
        b"\x00\x14",
        b"\x48" + U64.pack(3) + b"\x02",
        b"\x44" + U64.pack(9),
    ):
        try:
            decode_bundle(head + body)
        except ProtocolError:
            pass
        try:
            decode_bundle(bytes([head[0] | 1]) + head[1:] + snappy.compress(body))
        except ProtocolError:
            pass


@given(
    record_lists(sparse=True, max_size=10), st.sampled_from([CODEC_NONE, CODEC_SNAPPY]), st.data()
)
def test_mutated_bundles(recs: list, codec: int, data: st.DataObject) -> None:
    b = bytearray(encode_bundle(recs, codec=codec, sparse=data.draw(st.booleans())))
    i = data.draw(st.integers(0, len(b) - 1))
    new = data.draw(st.integers(0, 255))
    assume(b[i] != new)
    b[i] = new
    try:
        decode_bundle(bytes(b))
    except ProtocolError:
        pass
    try:
        decode_chunk(encode_chunk([bytes(b)]), 1)
    except ProtocolError:
        pass
