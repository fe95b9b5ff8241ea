"""The compiled block functions of dafka.fastio (store_blocks, block_slice, fetch_blocks) and their
pure-Python twins give the same blocks, slices and reads, hostile blocks included.

The store builds its CODEC_STORE blocks and reads them through these (issue 36, format 2 level
with format 1): differential tests over hypothesis inputs and a real LMDB with holes.
"""

from __future__ import annotations

import struct
import tempfile
from typing import Any

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.fastio import _pure
from dafka.store import block as B
from dafka.store.layout import FLAG_KEY, VALUE_HEADER

try:
    from dafka.fastio import _compiled  # type: ignore[attr-defined]
except ImportError:  # not built: nothing to compare
    _compiled = None

pytestmark = pytest.mark.skipif(_compiled is None, reason="compiled extension not built")

TS = 1_700_000_000_000


def _value(ts: int, key: bytes | None, content: bytes) -> bytes:
    if key is None:
        return VALUE_HEADER.pack(ts, 0) + content
    return VALUE_HEADER.pack(ts, FLAG_KEY) + bytes((len(key),)) + key + content


values_st = st.lists(
    st.builds(
        _value,
        st.one_of(st.integers(0, 2**64 - 1), st.just(TS)),
        st.one_of(st.none(), st.binary(max_size=20)),
        st.binary(max_size=300),
    ),
    min_size=1,
    max_size=60,
)


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return ("ok", fn(*args))
    except (ProtocolError, TypeError, IndexError, OverflowError) as exc:
        return (type(exc).__name__, str(exc))


@settings(max_examples=150, deadline=None)
@given(values=values_st, lo=st.integers(0, 5), cut=st.integers(0, 5), pid=st.integers(0, 2**32 - 1),
       first=st.integers(0, 2**40), block_bytes=st.integers(1, 3000), as_pairs=st.booleans())
def test_store_blocks_same_blocks(values: list[bytes], lo: int, cut: int, pid: int, first: int,
                                  block_bytes: int, as_pairs: bool) -> None:
    lo = min(lo, len(values))
    hi = max(lo, len(values) - cut)
    items: list[Any] = [(b"k", v) for v in values] if as_pairs else values
    field = 1 if as_pairs else -1
    pure = _pure.store_blocks(items, lo, hi, pid, first, block_bytes, field)
    assert _compiled.store_blocks(items, lo, hi, pid, first, block_bytes, field) == pure
    # The blocks hold the values, in order, each block valid, cut at block_bytes of values.
    got: list[bytes] = []
    for key, block in pure:
        hdr = B.validate(block)
        assert key == B.BLOCK_KEY.pack(pid, hdr.first_offset) and hdr.first_offset == first + len(got)
        part = B.store_values(block, hdr, hdr.first_offset, hdr.record_count)
        assert hdr.record_count == 1 or sum(map(len, part)) <= block_bytes
        assert B.store_payload(block) == sum(len(v) - 9 - (v[8] & 1) for v in part)
        got.extend(part)
    assert got == values[lo:hi]


@pytest.mark.parametrize("bad", [b"", b"12345678", "not bytes", None])
def test_store_blocks_refuse_bad_values_alike(bad: Any) -> None:
    values = [_value(TS, None, b"a"), bad, _value(TS, None, b"b")]
    pure = _outcome(_pure.store_blocks, values, 0, 3, 1, 0, 1 << 16, -1)
    assert pure[0] in ("ProtocolError", "TypeError")
    assert _outcome(_compiled.store_blocks, values, 0, 3, 1, 0, 1 << 16, -1) == pure
    pairs = [(b"k", v) for v in values]
    assert _outcome(_compiled.store_blocks, pairs, 0, 3, 1, 0, 1 << 16, 1) == _outcome(
        _pure.store_blocks, pairs, 0, 3, 1, 0, 1 << 16, 1)


def test_store_blocks_range_outside_items_is_refused() -> None:
    with pytest.raises(IndexError):
        _compiled.store_blocks([_value(TS, None, b"a")], 0, 2, 1, 0, 1 << 16, -1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=values_st, first=st.integers(0, 2**40), data=st.data())
def test_block_slice_same_slices_and_refusals(values: list[bytes], first: int, data: st.DataObject) -> None:
    payload = sum(len(v) - 9 - (v[8] & 1) for v in values)
    block = bytearray(B.store_block(first, values, payload))
    # Hostile blocks: bytes overwritten (header and ends table included) or cut short.
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(block) - 1))
        block[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del block[data.draw(st.integers(0, len(block))):]
    raw = bytes(block)
    offset = first + data.draw(st.integers(-3, len(values) + 3))
    n = data.draw(st.integers(-1, len(values) + 2))
    offset = max(offset, 0)
    pure = _outcome(_pure.block_slice, raw, offset, n)
    assert _outcome(_compiled.block_slice, raw, offset, n) == pure
    assert _outcome(_compiled.block_slice, memoryview(raw), offset, n) == pure
    assert _outcome(_pure.block_slice, memoryview(raw), offset, n) == pure
    if raw == bytes(B.store_block(first, values, payload)) and n > 0:
        i = max(offset - first, 0)
        assert pure == ("ok", (first, first + len(values) - 1, values[i:i + n]))


def test_block_slice_of_another_codec_gives_no_values() -> None:
    block = B.dafka_block([(TS, None, b"a"), (TS + 1, b"k", b"b")], 10)
    assert _compiled.block_slice(block, 10, 5) == _pure.block_slice(block, 10, 5) == (10, 11, None)


def _convert(value: Any, offset: int, n: int) -> list[bytes]:
    hdr = B.decode_header(value)
    return [b"other %d" % o for o in range(offset, min(hdr.last_offset + 1, offset + n))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    layout=st.lists(  # per pid: runs of (gap before, records, other codec)
        st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.booleans()), max_size=5),
        min_size=1, max_size=3,
    ),
    block_bytes=st.integers(1, 600),
    reads=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 80), st.integers(1, 40)), min_size=1, max_size=25),
)
def test_fetch_blocks_same_reads(tmp_path: Any, layout: list[list[tuple[int, int, bool]]], block_bytes: int,
                                 reads: list[tuple[int, int, int]]) -> None:
    d = tempfile.mkdtemp(dir=tmp_path)  # one database an example
    env = lmdb.open(d, max_dbs=2, map_size=1 << 26, sync=False)
    try:
        db = env.open_db(b"blocks")
        held: dict[int, dict[int, bytes]] = {}
        with env.begin(write=True, db=db) as txn:
            for pid, runs in enumerate(layout, start=1):
                off = 0
                held[pid] = {}
                for gap, count, other in runs:
                    off += gap
                    vals = [_value(TS + off + i, None, b"v%d.%d" % (pid, off + i)) for i in range(count)]
                    if other:
                        blocks = [(B.BLOCK_KEY.pack(pid, off), B.dafka_block([(TS, None, b"o")] * count, off))]
                        vals = [b"other %d" % (off + i) for i in range(count)]
                    else:
                        blocks = _pure.store_blocks(vals, 0, count, pid, off, block_bytes, -1)
                    for key, block in blocks:
                        txn.put(key, block)
                    held[pid].update(zip(range(off, off + count), vals, strict=True))
                    off += count
        for buffers in (False, True):
            with env.begin(db=db, buffers=buffers) as txn:
                for pid, start, n in reads:
                    last = max(held.get(pid, {0: b""}), default=0)
                    pure = _pure.fetch_blocks(txn.cursor(), pid, start, last, n, _convert)
                    assert _compiled.fetch_blocks(txn.cursor(), pid, start, last, n, _convert) == pure
                    # What the layout says: from the first held offset >= start, up to n, to the next hole.
                    have = held.get(pid, {})
                    after = [o for o in sorted(have) if o >= start]
                    want: list[bytes] = []
                    for o in after:
                        if want and o != after[0] + len(want) or len(want) >= n:
                            break
                        want.append(have[o])
                    assert pure == ((after[0], want) if want else (last + 1, []))
    finally:
        env.close()


def test_fetch_blocks_key_of_another_size_is_refused(tmp_path: Any) -> None:
    env = lmdb.open(str(tmp_path), max_dbs=1, map_size=1 << 22)
    try:
        with env.begin(write=True) as txn:
            txn.put(struct.pack(">IQ", 1, 0) + b"x", b"junk")
        with env.begin() as txn:
            with pytest.raises(ProtocolError):
                _compiled.fetch_blocks(txn.cursor(), 1, 5, 9, 1, _convert)
    finally:
        env.close()


def test_store_blocks_take_values_and_pairs_mixed() -> None:
    """The store's queue holds the drain's values and the Kafka gateway's (key, value) pairs
    side by side: both become the same blocks (the gateway's commit failed on the mix)."""
    values = [_value(TS + i, b"k" if i % 3 else None, b"c%d" % i) for i in range(50)]
    mixed: list[Any] = [(b"key", v) if i % 2 else v for i, v in enumerate(values)]
    want = _pure.store_blocks(values, 0, 50, 9, 100, 400, -1)
    assert _pure.store_blocks(mixed, 0, 50, 9, 100, 400, -1) == want
    assert _compiled.store_blocks(mixed, 0, 50, 9, 100, 400, -1) == want
