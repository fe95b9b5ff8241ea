"""The Tank bundle walk (dafka.fastio.tank_scan): the compiled walk and its pure twin accept and
refuse the same bundles and return the same counts, seqs, timestamps and contents.

The Tank gateway stores each produced bundle as a block after this walk (issue 36): it is the
only validation a bundle gets before it is stored, so hostile bundles come first here, then
differential fuzz (random bytes and mutated valid bundles).
"""

from __future__ import annotations

import struct
from typing import Any

import cramjam
import pytest
import snappy
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.fastio import _pure
from dafka.store import block as B
from dafka.tank.bundle import CODEC_NONE, CODEC_SNAPPY, decode_bundle, encode_bundle

try:
    from dafka.fastio import _compiled  # type: ignore[attr-defined]
except ImportError:  # not built: nothing to compare
    _compiled = None

pytestmark = pytest.mark.skipif(_compiled is None or not hasattr(_compiled, "tank_scan"),
                                reason="compiled extension not built")

TS = 1_700_000_000_123
TS_LE = struct.pack("<Q", TS)
HELLO_WORLD = b"\x08" + b"\x00" + TS_LE + b"\x05hello" + b"\x02" + b"\x05world"
MAX = 1 << 20
BUDGET = 64 << 20
IMPLS = [pytest.param(_pure.tank_scan, id="pure"),
         pytest.param(getattr(_compiled, "tank_scan", None), id="compiled")]


def _outcome(scan: Any, data: Any, max_record_bytes: int = MAX, budget: int = BUDGET) -> Any:
    try:
        return ("ok", scan(data, max_record_bytes, budget, True))
    except ProtocolError:
        return ("refused",)


def _both(data: Any, max_record_bytes: int = MAX, budget: int = BUDGET) -> Any:
    pure = _outcome(_pure.tank_scan, data, max_record_bytes, budget)
    compiled = _outcome(_compiled.tank_scan, data, max_record_bytes, budget)
    assert pure == compiled, (data, pure, compiled)
    return pure


def _sparse(first: int, gap: int | None, msgs: bytes, count: int) -> bytes:
    """A sparse bundle's bytes: flags (count inline), first seq, the gap varint, then ``msgs``."""
    head = bytes((0x40 | count << 2,)) + struct.pack("<Q", first)
    if gap is not None:
        head += _varint(gap)
    return head + msgs


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# ---------------------------------------------------------------- hostile bundles

HOSTILE = [
    b"",
    b"\x0c" + HELLO_WORLD[1:],  # says 3 messages, holds 2
    b"\x04" + HELLO_WORLD[1:],  # says 1 message, holds 2 (trailing bytes)
    HELLO_WORLD[:-1],  # the last message runs past the bundle
    HELLO_WORLD + b"\x00",  # trailing byte
    b"\x88" + HELLO_WORLD[1:],  # extra-flags bit
    b"\x0a" + HELLO_WORLD[1:],  # codec 2
    b"\x0b" + HELLO_WORLD[1:],  # codec 3
    b"\x08\x02\x05hello\x02\x05world",  # the first message has no timestamp
    b"\x08\x08" + HELLO_WORLD[2:],  # unknown message flag
    b"\x00\x00",  # count 0 as a varint
    b"\x00\xff\xff\xff\xff\xff",  # a count varint over 5 bytes
    b"\x00\xff\xff\xff\xff\x0f" + HELLO_WORLD[1:],  # a huge count the set cannot hold
    b"\x04\x00" + TS_LE + b"\xff\xff\xff\xff\x0f",  # a content length of 4 GiB
    b"\x04\x00" + TS_LE + b"\x80",  # a truncated content length
    b"\x04\x01" + TS_LE + b"\x09ab\x01x",  # a key running past the bundle
    b"\x04\x01" + TS_LE,  # a key length missing
    b"\x04\x00" + TS_LE[:5],  # a truncated timestamp
    b"\x44" + b"\x00" * 4,  # a truncated sparse header
    # sparse, 2 messages: the range first..first+gap+1 past 2^64 - 1
    _sparse((1 << 64) - 2, 5, b"\x00" + TS_LE + b"\x01a" + b"\x02\x01b", 2),
    # sparse, 3 messages in a range of 2 seqs
    _sparse(10, 0, b"\x00" + TS_LE + b"\x01a" + b"\x06\x01b" + b"\x06\x01c", 3),
    # sparse, 3 messages: the middle one's gap lands on the last seq
    _sparse(10, 3, b"\x00" + TS_LE + b"\x01a" + b"\x02\x03\x01b" + b"\x02\x01c", 3),
    # sparse, 3 messages: "next" (flag 4) on the last one lands short of the header's last seq
    _sparse(10, 3, b"\x00" + TS_LE + b"\x01a" + b"\x06\x01b" + b"\x06\x01c", 3),
    # sparse, 3 messages: the middle gap wraps past 2^64
    _sparse((1 << 64) - 20, 10, b"\x00" + TS_LE + b"\x01a" + b"\x02\xff\xff\xff\xff\x0f\x01b" + b"\x02\x01c", 3),
    # snappy: claims 100 MB (a bomb, refused from its length), garbage, and a liar inside
    b"\x01" + b"\x08" + b"\x80\x80\x80\x30" + b"\x00" * 10,
    b"\x09" + b"\x20" + b"\xff" * 20,
    b"\x0d" + snappy.compress(HELLO_WORLD[1:]),  # says 3, holds 2
    b"\x09" + b"\x80\x80\x80\x80\x80",  # a snappy length varint over 5 bytes
]


@pytest.mark.parametrize("scan", IMPLS)
@pytest.mark.parametrize("bundle", HOSTILE)
def test_hostile_bundles_are_refused(scan: Any, bundle: bytes) -> None:
    with pytest.raises(ProtocolError):
        scan(bundle, MAX, BUDGET, True)
    with pytest.raises(ProtocolError):
        B.tank_block(bundle, 0)


@pytest.mark.parametrize("scan", IMPLS)
def test_bounds(scan: Any) -> None:
    # max_record_bytes counts key plus content; the snappy budget is checked before inflating.
    keyed = encode_bundle([(None, TS, b"k" * 10, b"v" * 90)], codec=CODEC_NONE)
    assert scan(keyed, 100, BUDGET)[1] == 1
    with pytest.raises(ProtocolError, match="max_record_bytes"):
        scan(keyed, 99, BUDGET)
    big = encode_bundle([(None, TS, None, b"\0" * 100_000)], codec=CODEC_SNAPPY)
    assert len(big) < 10_000
    assert scan(big, MAX, 200_000)[6] is None
    with pytest.raises(ProtocolError, match="budget"):
        scan(big, MAX, 50_000)


@pytest.mark.parametrize("scan", IMPLS)
def test_valid_bundles(scan: Any) -> None:
    assert scan(HELLO_WORLD, MAX, BUDGET, True) == (False, 2, None, None, TS, TS, [b"hello", b"world"])
    assert scan(memoryview(HELLO_WORLD), MAX, BUDGET)[:6] == (False, 2, None, None, TS, TS)
    msgs = [(None, TS + i % 7, b"key" if i % 3 else None, bytes([i % 256]) * (i % 50)) for i in range(600)]
    for codec in (CODEC_NONE, CODEC_SNAPPY):
        got = scan(encode_bundle(msgs, codec=codec), MAX, BUDGET, True)
        assert got == (codec == CODEC_SNAPPY, 600, None, None, TS, TS + 6, [m[3] for m in msgs])
    sparse = encode_bundle([(10, TS, None, b"a"), (11, TS, None, b"b"), (15, TS + 1, None, b"c")], sparse=True)
    assert scan(sparse, MAX, BUDGET, True) == (False, 3, 10, 15, TS, TS + 1, [b"a", b"b", b"c"])
    # Tank timestamps are u64: one past 2^63 - 1 stays in the bundle and counts as 2^63 - 1.
    late = encode_bundle([(None, 2**64 - 1, None, b"a"), (None, 1 << 63, None, b"b"), (None, 5, None, b"c")])
    assert scan(late, MAX, BUDGET) == (False, 3, None, None, 2**63 - 1, 2**63 - 1, None)
    one = encode_bundle([(2**64 - 1, TS, None, b"z")], sparse=True)
    assert scan(one, MAX, BUDGET)[:4] == (False, 1, 2**64 - 1, 2**64 - 1)


# ---------------------------------------------------------------- differential fuzz

_msgs = st.lists(
    st.tuples(st.integers(0, (1 << 64) - 1), st.none() | st.binary(max_size=40), st.binary(max_size=200)),
    min_size=1, max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_fuzz_garbage_same_verdict(data: bytes) -> None:
    got = _both(data)
    try:
        full: list[Any] | None = decode_bundle(data)
    except ProtocolError:
        full = None
    assert (got[0] == "ok") == (full is not None)
    if full is not None:
        assert got[1][6] == [bytes(m[3]) for m in full]


@settings(max_examples=300, deadline=None)
@given(_msgs, st.booleans(), st.booleans(), st.integers(0, 1 << 62), st.data())
def test_fuzz_mutated_bundles_same_verdict(msgs: list[tuple[int, bytes | None, bytes]], snap: bool, sparse: bool,
                                           first: int, data: st.DataObject) -> None:
    if sparse:
        gaps = data.draw(st.lists(st.integers(1, 3), min_size=len(msgs), max_size=len(msgs)))
        seqs, seq = [], first
        for g in gaps:
            seqs.append(seq)
            seq += g
        recs = [(s, ts, k, c) for s, (ts, k, c) in zip(seqs, msgs, strict=True)]
    else:
        recs = [(None, ts, k, c) for ts, k, c in msgs]
    bundle = encode_bundle(recs, codec=CODEC_SNAPPY if snap else CODEC_NONE, sparse=sparse)
    got = _both(bundle)
    assert got[0] == "ok" and got[1][1] == len(msgs) and got[1][6] == [c for _, _, c in msgs]
    # Flip, cut or extend it: both walks must agree on whatever comes out.
    mutated = bytearray(bundle)
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.integers(0, 2))
        at = data.draw(st.integers(0, max(0, len(mutated) - 1)))
        if how == 0 and mutated:
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == 1:
            del mutated[at:]
        else:
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    _both(bytes(mutated))
    _both(bytes(mutated), max_record_bytes=data.draw(st.integers(0, 300)), budget=data.draw(st.integers(0, 5000)))


# ---------------------------------------------------------------- stored values of a Tank block


@settings(max_examples=200, deadline=None)
@given(_msgs, st.booleans(), st.integers(0, 40), st.integers(0, 40))
def test_fuzz_tank_values_same_as_pure_and_as_the_record_path(
        msgs: list[tuple[int, bytes | None, bytes]], snap: bool, skip: int, n: int) -> None:
    from dafka.store.reader import _as_value, block_values

    bundle = encode_bundle([(None, ts, k, c) for ts, k, c in msgs], codec=CODEC_SNAPPY if snap else CODEC_NONE)
    got = _compiled.tank_values(bundle, skip, n)
    assert got == _pure.tank_values(bundle, skip, n)
    # What readers of stored values got before (a record at a time through block.records).
    value = B.tank_block(bundle, 1000)
    hdr = B.decode_header(value)
    old = [_as_value(B.CODEC_TANK, r.ts_ms, r.key, r.value, None) for r in B.records(value, 1000 + skip)][:n]
    assert got == old
    assert block_values(value, hdr, 1000 + skip, n) == old


@pytest.mark.parametrize("bundle", HOSTILE)
def test_tank_values_refuse_what_the_walk_refuses(bundle: bytes) -> None:
    for impl in (_pure, _compiled):
        with pytest.raises(ProtocolError):
            impl.tank_values(bundle, 0, 10)


# ---------------------------------------------------------------- the snappy body itself

def _snappy_element(kind: int, n: int, off: int, lit: bytes) -> bytes:
    """One element of a raw snappy stream: a literal (short or with a 1-4 byte length, which
    may lie about what follows) or a copy with a 1, 2 or 4 byte offset (which may point
    before the output's start, or be 0)."""
    if kind == 0:
        return bytes(((min(n, 59) & 0x3F) << 2,)) + lit
    if kind == 1:
        width = 1 + off % 4
        return bytes(((59 + width) << 2,)) + (n & ((1 << (8 * width)) - 1)).to_bytes(width, "little") + lit
    if kind == 2:
        return bytes((0x01 | ((n % 8) << 2) | ((off >> 8) & 7) << 5, off & 0xFF))
    if kind == 3:
        return bytes((0x02 | ((n % 64) << 2),)) + (off & 0xFFFF).to_bytes(2, "little")
    return bytes((0x03 | ((n % 64) << 2),)) + (off & 0xFFFFFFFF).to_bytes(4, "little")


_elements = st.lists(
    st.builds(_snappy_element, st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 1 << 33),
              st.binary(max_size=24)),
    max_size=12,
)


def _honest_stream(draw: Any) -> tuple[bytes, bytes]:
    """A raw snappy stream of honest literals and copies (offsets within the output) and
    what it inflates to."""
    out = bytearray(HELLO_WORLD[1:])
    body = bytearray(snappy.compress(bytes(out))[1:])  # (its length varint is one byte)
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            lit = draw(st.binary(min_size=1, max_size=60))
            body += bytes(((len(lit) - 1) << 2,)) + lit
            out += lit
        else:
            n, off = draw(st.integers(4, 11)), draw(st.integers(1, min(len(out), 2047)))
            body += bytes((0x01 | (n - 4) << 2 | (off >> 8) << 5, off & 0xFF))
            for _i in range(n):
                out.append(out[-off])
    return bytes(body), bytes(out)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 3), st.integers(-2, 600), _elements, st.sampled_from([bytes, bytearray, memoryview]),
       st.booleans(), st.data())
def test_fuzz_snappy_streams_same_verdict(count: int, claimed: int, elements: list[bytes], kind: Any,
                                          honest: bool, data: st.DataObject) -> None:
    """Raw snappy streams built from tags (lying lengths, copies before the start or of
    offset 0, a claimed size the elements do not make), after an honest stream or alone: the
    compiled walk (cramjam's decompress_raw) and the pure one (python-snappy) accept and
    refuse the same ones, with a ProtocolError and nothing else, whatever buffer the bundle
    comes in."""
    body = b"".join(elements)
    if honest:  # an honest stream, then (or not) the hostile elements after it
        good, out = _honest_stream(data.draw)
        body = good + body
        if claimed < 0:  # the true size
            claimed = len(out)
    claimed = abs(claimed)
    bundle = bytes((CODEC_SNAPPY | count << 2,)) + _varint(claimed) + body
    _both(kind(bundle))
    assert _both(kind(bundle), budget=claimed // 2) == ("refused",) or claimed == 0
    # The two inflaters themselves: the same bytes or both refuse, cramjam only with its
    # DecompressionError (anything else would escape the walk as a bug, not a ProtocolError).
    stream = _varint(claimed) + body
    try:
        mine: Any = bytes(cramjam.snappy.decompress_raw(kind(stream)))
    except cramjam.DecompressionError:
        mine = None
    try:
        theirs: Any = snappy.uncompress(stream)
    except Exception:  # python-snappy's own error class, by version
        theirs = None
    assert mine == theirs, (stream, mine, theirs)


@settings(max_examples=200, deadline=None)
@given(_msgs, st.sampled_from([bytes, bytearray, memoryview]), st.data())
def test_fuzz_snappy_bundles_body_mutated_same_verdict(msgs: list[tuple[int, bytes | None, bytes]], kind: Any,
                                                       data: st.DataObject) -> None:
    """Valid snappy bundles whose compressed body (not the header) is flipped, cut or grown:
    both walks agree, and the unmutated bundle is accepted from any buffer."""
    bundle = encode_bundle([(None, ts, k, c) for ts, k, c in msgs], codec=CODEC_SNAPPY)
    got = _both(kind(bundle))
    assert got[0] == "ok" and got[1][6] == [c for _, _, c in msgs]
    head = 1 if len(msgs) <= 15 else 2  # the flags byte, the count varint (30 messages at most)
    mutated = bytearray(bundle)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(head, max(head, len(mutated) - 1)))
        how = data.draw(st.integers(0, 2))
        if how == 0 and at < len(mutated):
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == 1:
            del mutated[at:]
        else:
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    _both(kind(bytes(mutated)))


def test_contents_outlive_the_next_walk_of_a_snappy_bundle() -> None:
    # The compiled walk inflates into one buffer kept from walk to walk: what it returns (the
    # contents, the stored values) must be copies, untouched by the next bundle's inflation.
    def snappy_bundle(tag: bytes) -> bytes:
        return encode_bundle([(None, TS, None, tag * 300 + b"%04d" % i) for i in range(600)], codec=CODEC_SNAPPY)

    first, second = snappy_bundle(b"a"), snappy_bundle(b"b")
    contents = _compiled.tank_scan(first, MAX, BUDGET, True)[6]
    values = _compiled.tank_values(first, 0, 600)
    assert _compiled.tank_scan(second, MAX, BUDGET, True)[6] == _pure.tank_scan(second, MAX, BUDGET, True)[6]
    _compiled.tank_values(second, 0, 600)
    assert contents == _pure.tank_scan(first, MAX, BUDGET, True)[6]
    assert values == _pure.tank_values(first, 0, 600)
    # A smaller bundle after a larger one (the kept buffer is longer than it) and a refused one.
    small = encode_bundle([(None, TS, None, b"c" * 10)] * 600, codec=CODEC_SNAPPY)
    assert _compiled.tank_scan(small, MAX, BUDGET, True) == _pure.tank_scan(small, MAX, BUDGET, True)
    with pytest.raises(ProtocolError):
        _compiled.tank_scan(second[:-7], MAX, BUDGET)
    assert _compiled.tank_scan(first, MAX, BUDGET, True) == _pure.tank_scan(first, MAX, BUDGET, True)


def test_a_snappy_inflation_shorter_than_its_claim_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without cramjam the compiled walk inflates with python-snappy's uncompress into a new
    # buffer: one shorter than the bundle claimed must end the walk (truncated), never be read
    # past its end as if it had the claimed length.
    bundle = encode_bundle([(None, TS, None, b"x" * 50)] * 600, codec=CODEC_SNAPPY)
    real = snappy.uncompress
    monkeypatch.setattr(_compiled, "_snappy_raw_into", None)
    monkeypatch.setattr(_compiled, "_snappy_raw", lambda data: real(bytes(data))[:-40])
    with pytest.raises(ProtocolError):
        _compiled.tank_scan(bundle, MAX, BUDGET)
    monkeypatch.setattr(_compiled, "_snappy_raw", lambda data: real(bytes(data)))
    assert _compiled.tank_scan(bundle, MAX, BUDGET, True) == _pure.tank_scan(bundle, MAX, BUDGET, True)
