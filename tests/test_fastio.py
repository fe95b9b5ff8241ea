"""dafka.fastio: the compiled functions and their pure-Python twin give the same bytes and batches.

Differential tests on real ZeroMQ socket pairs (inproc): the same input goes
through both implementations, malformed messages included, and everything
observable is compared (frames on the wire, records queued, callbacks in
order, tracker state).
"""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import count
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dafka import fastio
from dafka.core import wire
from dafka.core.gaps import PartitionTracker
from dafka.fastio import _pure
from dafka.nodes.consumed import ConsumerRecord
from dafka.store.layout import pack_value

try:
    from dafka.fastio import _compiled  # type: ignore[attr-defined]
    from dafka.fastio._bind import bind

    bind(_compiled)
except ImportError:  # not built: only the pure twin can be tested
    _compiled = None

needs_compiled = pytest.mark.skipif(_compiled is None, reason="compiled extension not built")
IMPLS = [pytest.param(_pure, id="pure"), pytest.param(_compiled, id="compiled", marks=needs_compiled)]
_endpoints = count()


def test_extension_active_when_required() -> None:
    # CI (make test) sets DAFKA_REQUIRE_EXTENSIONS=1: the build must have produced it.
    if os.environ.get("DAFKA_REQUIRE_EXTENSIONS") != "1":
        pytest.skip("DAFKA_REQUIRE_EXTENSIONS is not set")
    assert fastio.COMPILED, fastio.REASON


@needs_compiled
def test_the_compiled_tank_walk_inflates_with_cramjam_itself() -> None:
    # Not python-snappy's uncompress(), which copies cramjam's output into bytes once more:
    # an import of cramjam.snappy as a module fails silently into that fallback.
    import cramjam

    assert _compiled._snappy_raw is cramjam.snappy.decompress_raw
    assert _compiled._snappy_raw_into is cramjam.snappy.decompress_raw_into  # (into a kept buffer)
    assert _compiled._SnappyError is cramjam.DecompressionError


@pytest.mark.parametrize("impl", IMPLS)
def test_view_start_finds_a_view_in_its_bytearray(impl: Any) -> None:
    buf = bytearray(b"0123456789")
    whole = memoryview(buf)
    cases = [
        (whole, 0), (whole[3:7], 3), (whole[9:], 9), (whole[3:7][1:], 4),
        (whole[10:], -1),  # empty
        (whole[::2], -1),  # not contiguous
        (whole.toreadonly()[2:], -1),
        (memoryview(b"0123"), -1),  # a view of bytes
        (whole.cast("H"), -1),  # items of two bytes
        (b"0123", -1), (buf, -1), (None, -1),
    ]
    assert [impl.view_start(view) for view, _ in cases] == [at for _, at in cases]


@pytest.mark.parametrize("impl", IMPLS)
def test_new_bytearray_has_the_size_asked(impl: Any) -> None:
    got = impl.new_bytearray(100_000)
    assert type(got) is bytearray and len(got) == 100_000
    assert impl.new_bytearray(0) == bytearray()
    with pytest.raises(ValueError):
        impl.new_bytearray(-1)


def test_environment_variable_forces_pure_python() -> None:
    code = "from dafka import fastio; print(fastio.IMPLEMENTATION)"
    env = dict(os.environ, DAFKA_NO_EXTENSIONS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "pure"


class Pair:
    """A PUSH -> PULL pair on inproc (no drops, nothing lost between them)."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        endpoint = f"inproc://fastio-test-{next(_endpoints)}"
        self.rx = ctx.socket(zmq.PULL)
        self.rx.setsockopt(zmq.RCVHWM, 0)
        self.rx.bind(endpoint)
        self.tx = ctx.socket(zmq.PUSH)
        self.tx.setsockopt(zmq.SNDHWM, 0)
        self.tx.connect(endpoint)

    def send_all(self, messages: list[list[bytes]]) -> None:
        for frames in messages:
            self.tx.send_multipart(frames)

    def recv_all(self) -> list[list[bytes]]:
        # Everything was sent before this is called, and inproc delivers as it
        # sends: after the first message, the rest is there already (a short wait
        # for more instead of 50 ms after each took the suite ~20 s).
        out = []
        while self.rx.poll(5 if out else 50):
            out.append(self.rx.recv_multipart())
        return out

    def close(self) -> None:
        self.rx.close(0)
        self.tx.close(0)


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


frame = st.binary(max_size=40)
message = st.lists(frame, min_size=1, max_size=4)
contents = st.lists(st.binary(max_size=64), max_size=50)
seqs = st.integers(min_value=0, max_value=(1 << 64) - 200)
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _same_from_buffers(pair: Pair, contents: list[bytes], send: Any) -> None:
    """``send(impl, items)`` sends the same bytes in both implementations from a slice of a
    tuple of memoryviews and bytearrays."""
    mixed = tuple(memoryview(c) if i % 2 else bytearray(c) for i, c in enumerate(contents))
    wires = []
    for impl in (_pure, _compiled):
        send(impl, mixed)
        wires.append(pair.recv_all())
    assert wires[0] == wires[1]


stored_values = st.lists(
    st.tuples(st.integers(0, (1 << 64) - 1), st.binary(max_size=50), st.none() | st.binary(max_size=20)),
    max_size=30,
)  # (ts, content, key) of stored LMDB values


@needs_compiled
@fast
@given(contents=contents, first=seqs, noblock=st.booleans())
def test_send_records_same_bytes(pair: Pair, contents: list[bytes], first: int, noblock: bool) -> None:
    prefix = wire.record_prefix(wire.RECORD, "t", "A" * 32, "t")
    wires = []
    for impl in (_pure, _compiled):
        assert impl.send_records(pair.tx, prefix, first, contents, noblock=noblock) == len(contents)
        wires.append(pair.recv_all())
    assert wires[0] == wires[1] == [[prefix + wire.pack_u64(first + i), c] for i, c in enumerate(contents)]
    _same_from_buffers(pair, contents, lambda impl, mixed: impl.send_records(pair.tx, prefix, first, mixed, 1, max(1, len(mixed) - 1)))


@needs_compiled
@fast
@given(values=stored_values, first=seqs)
def test_send_values_same_bytes(pair: Pair, values: list[tuple[int, bytes, bytes | None]], first: int) -> None:
    stored = [pack_value(ts, content, key) for ts, content, key in values]
    prefix = wire.record_prefix(wire.DIRECT_RECORD, "C" * 32, "A" * 32, "t")
    wires = []
    for impl in (_pure, _compiled):
        assert impl.send_values(pair.tx, prefix, first, [memoryview(v) for v in stored]) == len(stored)
        wires.append(pair.recv_all())
    expected = [[prefix + wire.pack_u64(first + i), v[1]] for i, v in enumerate(values)]
    assert wires[0] == wires[1] == expected


@needs_compiled
@fast
@given(
    contents=contents,
    first=seqs,
    noblock=st.booleans(),
    max_records=st.integers(1, 20),
    max_bytes=st.integers(0, 200),
)
def test_send_batches_same_bytes(
    pair: Pair, contents: list[bytes], first: int, noblock: bool, max_records: int, max_bytes: int
) -> None:
    prefix = wire.batch_prefix(wire.record_prefix(wire.RECORD, "t", "A" * 32, "t"))
    wires = []
    for impl in (_pure, _compiled):
        sent = impl.send_batches(pair.tx, prefix, first, contents, noblock=noblock, max_records=max_records, max_bytes=max_bytes)
        assert sent == len(contents)
        wires.append(pair.recv_all())
    assert wires[0] == wires[1]
    batches = [wire.decode(frames) for frames in wires[0]]
    assert all(isinstance(b, wire.RecordBatch) for b in batches)
    # Every record once, in order, with its offset; each batch within the limits.
    assert [c for b in batches for c in b.contents] == contents
    assert [b.sequence for b in batches] == [first + sum(len(x.contents) for x in batches[:i]) for i in range(len(batches))]
    for b in batches:
        assert len(b.contents) <= max_records
        assert len(b.contents) == 1 or sum(map(len, b.contents)) <= max_bytes
    _same_from_buffers(
        pair,
        contents,
        lambda impl, mixed: impl.send_batches(pair.tx, prefix, first, mixed, 1, max(1, len(mixed) - 1), max_records=max_records),
    )


@needs_compiled
@fast
@given(values=stored_values, first=seqs, max_records=st.integers(1, 10))
def test_send_batches_of_stored_values_same_bytes(
    pair: Pair, values: list[tuple[int, bytes, bytes | None]], first: int, max_records: int
) -> None:
    # A store's FETCH answer on a secure mesh: the stored values' contents, batched.
    stored = [memoryview(pack_value(ts, content, key)) for ts, content, key in values]
    prefix = wire.batch_prefix(wire.record_prefix(wire.DIRECT_RECORD, "C" * 32, "A" * 32, "t"))
    wires = []
    for impl in (_pure, _compiled):
        assert impl.send_batches(pair.tx, prefix, first, stored, noblock=True, max_records=max_records, stored=True) == len(values)
        wires.append(pair.recv_all())
        impl.send_batches(pair.tx, prefix, first, [v[1] for v in values], noblock=True, max_records=max_records)
        assert pair.recv_all() == wires[-1]  # the same as sending the contents themselves
    assert wires[0] == wires[1]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_stored_value_too_short_is_refused(impl: Any, pair: Pair) -> None:
    prefix = wire.batch_prefix(wire.record_prefix(wire.DIRECT_RECORD, "C" * 32, "A" * 32, "t"))
    for bad in (b"short", pack_value(1, b"", b"key")[:12]):
        with pytest.raises(ValueError):
            impl.send_batches(pair.tx, prefix, 0, [bad], stored=True)
    assert pair.recv_all() == []


@pytest.mark.parametrize("impl", IMPLS)
@fast
@given(messages=st.lists(message, max_size=40), limit=st.integers(1, 50))
def test_recv_messages_is_frame_exact(pair: Pair, impl: Any, messages: list[list[bytes]], limit: int) -> None:
    pair.send_all(messages)
    got: list[list[bytes]] = []
    for _ in range(len(messages) + 2):
        pair.rx.poll(100)
        batch = impl.recv_messages(pair.rx, limit)
        assert len(batch) <= limit
        got += batch
        if len(got) == len(messages):
            break
    assert got == messages
    assert impl.recv_messages(pair.rx, limit) == []


TOPIC = "t"
PARTITIONS = ["A" * 32, "B" * 32]


def _record(partition: str, seq: int, content: bytes, direct: bool = False) -> list[bytes]:
    cls = wire.DirectRecord if direct else wire.Record
    topic = "R" * 32 if direct else TOPIC
    return wire.encode(cls(topic, partition, TOPIC, seq, content))


def _batch(partition: str, seq: int, contents: tuple[bytes, ...], direct: bool = False) -> list[bytes]:
    cls = wire.DirectRecordBatch if direct else wire.RecordBatch
    topic = "R" * 32 if direct else TOPIC
    return wire.encode(cls(topic, partition, TOPIC, seq, contents))


def _prefixes(partition: str) -> list[bytes]:
    """The header prefixes a node registers for a partition: single records and batches."""
    singles = [
        wire.record_prefix(wire.RECORD, TOPIC, partition, TOPIC),
        wire.record_prefix(wire.DIRECT_RECORD, "R" * 32, partition, TOPIC),
    ]
    return singles + [wire.batch_prefix(p) for p in singles]


# What arrives: good records of two known partitions (in order, out of order,
# duplicates), records of an unknown partition, and malformed messages.
event = st.one_of(
    st.tuples(st.just("rec"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.binary(max_size=8)),
    st.tuples(st.just("direct"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.binary(max_size=8)),
    st.tuples(st.just("unknown"), st.just("U" * 32), st.integers(0, 3), st.binary(max_size=8)),
    st.tuples(st.just("short"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.just(b"")),
    st.tuples(st.just("long"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.binary(max_size=8)),
    st.tuples(st.just("garbage"), st.just(""), st.just(0), st.binary(max_size=12)),
    # Batches (version 2): good ones, direct ones, and ones whose content frame is malformed.
    st.tuples(st.just("batch"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.lists(st.binary(max_size=8), min_size=1, max_size=6).map(tuple)),
    st.tuples(st.just("dbatch"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.lists(st.binary(max_size=8), min_size=1, max_size=6).map(tuple)),
    st.tuples(st.just("badbatch"), st.sampled_from(PARTITIONS), st.integers(0, 12), st.binary(max_size=16)),
)  # fmt: skip


def _units(events: list[Any]) -> int:
    """How many callbacks and queued records the events make: one each, a good batch one per record."""
    return sum(len(content) if kind in ("batch", "dbatch") else 1 for kind, _, _, content in events)


def _messages(events: list[tuple[str, str, int, bytes]]) -> list[list[bytes]]:
    out = []
    for kind, partition, seq, content in events:
        if kind in ("rec", "unknown"):
            out.append(_record(partition, seq, content))
        elif kind == "direct":
            out.append(_record(partition, seq, content, direct=True))
        elif kind == "short":
            out.append(_record(partition, seq, b"")[:1])
        elif kind == "long":
            out.append(_record(partition, seq, content) + [b"extra"])
        elif kind in ("batch", "dbatch"):
            out.append(_batch(partition, seq, content, direct=kind == "dbatch"))
        elif kind == "badbatch":
            out.append([_batch(partition, seq, (b"",))[0], b"\x00\x00\x00\x05" + content])
        else:
            out.append([content])
    return out


def _on_too_large(calls: list[Any], out: list[Any]) -> Any:
    """What the nodes do with a record over max_size: counted (here: noted), the tracker skips it."""

    def on_too_large(tracker: PartitionTracker, seq: int, size: int) -> None:
        calls.append(("too large", tracker.address, seq, size))
        delivered: list[tuple[int, bytes]] = []
        tracker.drop_too_large(seq, delivered)
        out.extend(("slow", tracker.address, s, c) for s, c in delivered)

    return on_too_large


def _run_drain(
    impl: Any, pair: Pair, messages: list[list[bytes]], record_type: type | None, units: int, max_size: int | None = None
) -> Any:
    trackers = {p: PartitionTracker(TOPIC, p, 0) for p in PARTITIONS}
    by_prefix = {prefix: tracker for p, tracker in trackers.items() for prefix in _prefixes(p)}
    calls: list[Any] = []
    out: list[Any] = []

    def on_record(tracker: PartitionTracker, seq: int, content: bytes) -> None:
        calls.append(("record", tracker.address, seq, content))
        # As the nodes do: the tracker takes it (held, delivered or dropped).
        delivered: list[tuple[int, bytes]] = []
        tracker.on_record(seq, content, delivered)
        out.extend(("slow", tracker.address, s, c) for s, c in delivered)

    def on_message(frames: list[bytes]) -> None:
        calls.append(("message", frames))

    pair.send_all(messages)
    queued = 0
    for _ in range(len(messages) + 2):
        # Every message is read (none left over for the next example).
        if queued + len(calls) >= units or not pair.rx.poll(1000):
            break
        queued += impl.drain_records(
            pair.rx, 7, by_prefix, out, record_type, 1234, on_record, on_message, max_size, _on_too_large(calls, out)
        )
    state = {p: (t.next, t.known, sorted(t.held.items())) for p, t in trackers.items()}
    return queued, out, calls, state


@needs_compiled
@pytest.mark.parametrize("record_type", [None, ConsumerRecord], ids=["store", "consumer"])
@fast
@given(events=st.lists(event, max_size=60))
def test_drain_records_same_batches(pair: Pair, record_type: type | None, events: list[Any]) -> None:
    messages, units = _messages(events), _units(events)
    pure = _run_drain(_pure, pair, messages, record_type, units)
    compiled = _run_drain(_compiled, pair, messages, record_type, units)
    assert pure == compiled
    assert all(type(item) is (record_type or tuple) for item in compiled[1] if item[0] != "slow")
    # Frame-exact: every message was handled exactly once, as a whole (a
    # good batch as its records).
    queued, out, calls, _ = compiled
    assert queued + len(calls) == units
    for call in calls:
        if call[0] == "message":
            assert call[1] in messages


def _run_drain_pairs(impl: Any, pair: Pair, messages: list[list[bytes]], units: int, max_size: int | None = None) -> Any:
    # A stored partition (pid known, the largest pid) and a new one (no pid yet).
    trackers = {p: PartitionTracker(TOPIC, p, 0) for p in PARTITIONS}
    trackers[PARTITIONS[0]].pid = 0xFFFFFFFF
    by_prefix = {prefix: tracker for p, tracker in trackers.items() for prefix in _prefixes(p)}
    calls: list[Any] = []
    out: list[Any] = []
    segs: list[Any] = []

    def on_record(tracker: PartitionTracker, seq: int, content: bytes) -> None:
        calls.append(("record", tracker.address, seq, content))
        delivered: list[tuple[int, bytes]] = []
        tracker.on_record(seq, content, delivered)
        out.extend(("slow", tracker.address, s, c) for s, c in delivered)

    def on_message(frames: list[bytes]) -> None:
        calls.append(("message", frames))

    pair.send_all(messages)
    queued = 0
    for _ in range(len(messages) + 2):
        if queued + len(calls) >= units or not pair.rx.poll(1000):
            break
        queued += impl.drain_pairs(
            pair.rx, 7, by_prefix, out, segs, 1234, on_record, on_message, max_size, _on_too_large(calls, out)
        )
    state = {p: (t.next, t.known, sorted(t.held.items())) for p, t in trackers.items()}
    return queued, out, segs, calls, state


@needs_compiled
@fast
@given(events=st.lists(event, max_size=60))
def test_drain_pairs_same_pairs(pair: Pair, events: list[Any]) -> None:
    messages, units = _messages(events), _units(events)
    pure = _run_drain_pairs(_pure, pair, messages, units)
    compiled = _run_drain_pairs(_compiled, pair, messages, units)
    assert pure == compiled
    queued, out, segs, calls, _ = compiled
    assert queued + len(calls) == units
    pairs = [item for item in out if not isinstance(item, tuple)]
    assert len(pairs) == queued == sum(last - first + 1 for _, _, _, first, last, _ in segs)


@needs_compiled
@pytest.mark.parametrize("record_type", [None, ConsumerRecord], ids=["store", "consumer"])
@fast
@given(events=st.lists(event, max_size=60), max_size=st.integers(0, 8))
def test_drain_records_drops_what_is_too_large_alike(
    pair: Pair, record_type: type | None, events: list[Any], max_size: int
) -> None:
    """A record over max_size (alone or inside a batch) is never queued nor given to
    on_record: on_too_large gets it, in arrival order, in both implementations."""
    messages, units = _messages(events), _units(events)
    pure = _run_drain(_pure, pair, messages, record_type, units, max_size)
    compiled = _run_drain(_compiled, pair, messages, record_type, units, max_size)
    assert pure == compiled
    queued, out, calls, _ = compiled
    assert queued + len(calls) == units
    assert all(len(item[3]) <= max_size for item in out)
    assert all(len(c[3]) <= max_size for c in calls if c[0] == "record")
    expected = sum(
        len(c) > max_size
        for kind, partition, _, content in events
        if partition in PARTITIONS
        for c in (content if kind in ("batch", "dbatch") else (content,) if kind in ("rec", "direct") else ())
    )
    assert sum(c[0] == "too large" for c in calls) == expected


@needs_compiled
@fast
@given(events=st.lists(event, max_size=60), max_size=st.integers(0, 8))
def test_drain_pairs_drops_what_is_too_large_alike(pair: Pair, events: list[Any], max_size: int) -> None:
    messages, units = _messages(events), _units(events)
    pure = _run_drain_pairs(_pure, pair, messages, units, max_size)
    compiled = _run_drain_pairs(_compiled, pair, messages, units, max_size)
    assert pure == compiled
    queued, out, segs, calls, _ = compiled
    assert queued + len(calls) == units
    # Queued values are ts:8 flags:1 content; slow deliveries ("slow", ..., content).
    assert all((len(item[3]) if isinstance(item, tuple) else len(item) - 9) <= max_size for item in out)
    assert sum(c[0] == "too large" for c in calls) == sum(
        len(c) > max_size
        for kind, partition, _, content in events
        if partition in PARTITIONS
        for c in (content if kind in ("batch", "dbatch") else (content,) if kind in ("rec", "direct") else ())
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_drain_refuses_a_negative_max_size(impl: Any, pair: Pair) -> None:
    with pytest.raises(ValueError, match="max_size"):
        impl.drain_records(pair.rx, 1, {}, [], None, 0, None, None, -1)


@pytest.mark.parametrize("batched", [False, True], ids=["records", "batch"])
@pytest.mark.parametrize("impl", IMPLS)
def test_drain_pairs_builds_the_lmdb_layout(impl: Any, pair: Pair, batched: bool) -> None:
    # The values are byte-identical to what RecordDB stores for these records,
    # whether they came one a message or in a batch.
    tracker = PartitionTracker(TOPIC, PARTITIONS[0], 5)
    tracker.pid = 3
    by_prefix = {prefix: tracker for prefix in _prefixes(PARTITIONS[0])}
    contents = [b"", b"a", b"x" * 300]
    if batched:
        pair.send_all([_batch(PARTITIONS[0], 5, tuple(contents))])
    else:
        pair.send_all([_record(PARTITIONS[0], 5 + i, c) for i, c in enumerate(contents)])
    out: list[Any] = []
    segs: list[Any] = []
    got = 0
    for _ in range(10):
        if got == 3 or not pair.rx.poll(1000):
            break
        got += impl.drain_pairs(pair.rx, 10, by_prefix, out, segs, 1_700_000_000_123, None, None)
    # Stored values only: format 2's blocks need no LMDB key a record.
    assert out == [pack_value(1_700_000_000_123, c) for c in contents]
    # One run per drain call that read records: together 5..7, contiguous, 301 content bytes.
    assert all(seg[:3] == (TOPIC, PARTITIONS[0], 3) for seg in segs)
    assert [seg[3] for seg in segs] == [5] + [seg[4] + 1 for seg in segs[:-1]]
    assert segs[-1][4] == 7 and sum(seg[5] for seg in segs) == 301
    assert (tracker.next, tracker.known) == (8, 7)


def _run_drain_blocks(impl: Any, pair: Pair, messages: list[list[bytes]], units: int, max_size: int | None,
                      block_bytes: int, start: int = 0, stored: int = 1) -> Any:
    # As _run_drain_pairs; slow deliveries go into the same list as the blocks, so that their order counts.
    # The first ``stored`` partitions are stored (have a pid).
    trackers = {p: PartitionTracker(TOPIC, p, start) for p in PARTITIONS}
    for i, p in enumerate(PARTITIONS[:stored]):
        trackers[p].pid = 0xFFFFFFFF - i
    by_prefix = {prefix: tracker for p, tracker in trackers.items() for prefix in _prefixes(p)}
    calls: list[Any] = []
    out: list[Any] = []

    def on_record(tracker: PartitionTracker, seq: int, content: bytes) -> None:
        calls.append(("record", tracker.address, seq, content))
        delivered: list[tuple[int, bytes]] = []
        tracker.on_record(seq, content, delivered)
        out.extend(("slow", tracker.address, s, c) for s, c in delivered)

    def on_message(frames: list[bytes]) -> None:
        calls.append(("message", frames))

    pair.send_all(messages)
    queued = 0
    for _ in range(len(messages) + 2):
        if queued + len(calls) >= units or not pair.rx.poll(1000):
            break
        queued += impl.drain_blocks(
            pair.rx, 7, by_prefix, out, 1234, on_record, on_message, max_size, _on_too_large(calls, out), block_bytes
        )
    state = {p: (t.next, t.known, sorted(t.held.items())) for p, t in trackers.items()}
    return queued, out, calls, state


def _in_runs(steps: list[Any]) -> list[Any]:
    """Events where the stored partition's records mostly come in order (runs long enough to
    be cut into several blocks), other events among them."""
    events, seq = [], 0
    for step in steps:
        if step[0] == "next":
            content = step[1]
            events.append(("batch" if isinstance(content, tuple) else "rec", PARTITIONS[0], seq, content))
            seq += len(content) if isinstance(content, tuple) else 1
        else:
            events.append(step)
    return events


next_step = st.tuples(st.just("next"), st.one_of(
    st.binary(max_size=30), st.lists(st.binary(max_size=30), min_size=1, max_size=6).map(tuple)))
in_runs = st.lists(st.one_of(next_step, next_step, next_step, event), max_size=40).map(_in_runs)


def _as_blocks(impl: Any, out: list[Any], segs: list[Any], block_bytes: int) -> list[Any]:
    """What drain_pairs queued (values in ``out``, their runs in ``segs``) as the writer turns it
    into blocks: each run's values through store_blocks, the slow deliveries where they were."""
    got: list[Any] = []
    values: list[bytes] = []
    runs = list(segs)
    for item in out:
        if not isinstance(item, bytes):
            got.append(item)
            continue
        values.append(item)
        seg = runs[0]
        if len(values) == seg[4] - seg[3] + 1:
            got.extend((seg[0], seg[1], b) for _, b in impl.store_blocks(values, 0, len(values), seg[2], seg[3],
                                                                         block_bytes, -1))
            values = []
            del runs[0]
    assert not values and not runs
    return got


@needs_compiled
@fast
@given(events=st.one_of(in_runs, st.lists(event, max_size=60)), max_size=st.one_of(st.none(), st.integers(0, 30)),
       block_bytes=st.integers(1, 120))
def test_drain_blocks_same_blocks(pair: Pair, events: list[Any], max_size: int | None, block_bytes: int) -> None:
    messages, units = _messages(events), _units(events)
    pure = _run_drain_blocks(_pure, pair, messages, units, max_size, block_bytes)
    compiled = _run_drain_blocks(_compiled, pair, messages, units, max_size, block_bytes)
    assert pure == compiled
    queued, out, calls, _ = compiled
    assert queued + len(calls) == units
    assert queued == sum(_compiled.block_slice(item[2], 0, 0)[1] - _compiled.block_slice(item[2], 0, 0)[0] + 1
                         for item in out if item[0] != "slow")


@needs_compiled
@fast
@given(events=st.one_of(in_runs, st.lists(event, max_size=60)), max_size=st.one_of(st.none(), st.integers(0, 30)),
       block_bytes=st.integers(1, 120))
def test_drain_blocks_are_the_blocks_the_writer_built(
    pair: Pair, events: list[Any], max_size: int | None, block_bytes: int
) -> None:
    """drain_blocks gives the store's writer the very blocks it built from drain_pairs' values
    (one set per run, cut at block_bytes), in the same order among the slow deliveries, with
    the same callbacks and tracker states: the layout on disk does not change."""
    messages, units = _messages(events), _units(events)
    queued, out, segs, calls, state = _run_drain_pairs(_compiled, pair, messages, units, max_size)
    b_queued, b_out, b_calls, b_state = _run_drain_blocks(_compiled, pair, messages, units, max_size, block_bytes)
    assert (b_queued, b_calls, b_state) == (queued, calls, state)
    assert b_out == _as_blocks(_compiled, out, segs, block_bytes)


@pytest.mark.parametrize("impl", IMPLS)
def test_drain_blocks_cuts_at_block_bytes(impl: Any, pair: Pair) -> None:
    # Values of 9 + 100 bytes, blocks of at most 250 bytes of them: two a block; a value over
    # the bound is a block of its own; one drain call, one run.
    tracker = PartitionTracker(TOPIC, PARTITIONS[0], 5)
    tracker.pid = 3
    by_prefix = {prefix: tracker for prefix in _prefixes(PARTITIONS[0])}
    contents = [b"a" * 100, b"b" * 100, b"c" * 100, b"d" * 300, b"e" * 100]
    pair.send_all([_batch(PARTITIONS[0], 5, tuple(contents))])
    blocks: list[Any] = []
    assert pair.rx.poll(1000)
    assert impl.drain_blocks(pair.rx, 10, by_prefix, blocks, 1_700_000_000_123, None, None, None, None, 250) == 5
    assert [b[:2] for b in blocks] == [(TOPIC, PARTITIONS[0])] * 4
    ranges = [impl.block_slice(b[2], 0, 10) for b in blocks]
    assert [(first, last) for first, last, _ in ranges] == [(5, 6), (7, 7), (8, 8), (9, 9)]
    assert [v for _, _, values in ranges for v in values] == [pack_value(1_700_000_000_123, c) for c in contents]
    assert (tracker.next, tracker.known) == (10, 9)
    with pytest.raises(ValueError, match="block_bytes"):
        impl.drain_blocks(pair.rx, 10, by_prefix, blocks, 0, None, None, None, None, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_closed_socket_raises_instead_of_crashing(impl: Any) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.close(0)
    with pytest.raises(zmq.ZMQError):
        impl.send_records(sock, b"p", 0, [b"x"])
    with pytest.raises(zmq.ZMQError):
        impl.recv_messages(sock, 10)


@needs_compiled
def test_bad_content_fails_before_its_header_goes_out(pair: Pair) -> None:
    with pytest.raises((TypeError, ValueError)):
        _compiled.send_records(pair.tx, b"h", 0, [b"ok", "not bytes", b"never"])
    _compiled.send_records(pair.tx, b"h", 5, [b"next"])
    assert pair.recv_all() == [[b"h" + wire.pack_u64(0), b"ok"], [b"h" + wire.pack_u64(5), b"next"]]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_batch_counts_its_records_against_the_limit(impl: Any, pair: Pair) -> None:
    # Callers check their back-pressure between calls: a call must not take
    # limit batches, each of many records, at once.
    tracker = PartitionTracker(TOPIC, PARTITIONS[0], 0)
    by_prefix = {prefix: tracker for prefix in _prefixes(PARTITIONS[0])}
    pair.send_all([_batch(PARTITIONS[0], 5 * i, (b"r",) * 5) for i in range(4)])
    assert pair.rx.poll(1000)
    out: list[Any] = []
    got = [impl.drain_records(pair.rx, limit, by_prefix, out, None, 0, None, None) for limit in (1, 6, 100)]
    assert got == [5, 10, 5]
    assert [item[2] for item in out] == list(range(20))


@pytest.mark.parametrize("impl", IMPLS)
def test_send_batches_defaults_are_the_wire_limits(impl: Any, pair: Pair) -> None:
    prefix = wire.batch_prefix(wire.record_prefix(wire.RECORD, "t", "A" * 32, "t"))
    small, big = [b"s" * 100] * 300, [b"b" * (wire.BATCH_BYTES // 2 + 1)] * 3
    for contents, sizes in ((small, [128, 128, 44]), (big, [1, 1, 1])):
        assert impl.send_batches(pair.tx, prefix, 0, contents) == len(contents)
        assert [len(wire.decode(frames).contents) for frames in pair.recv_all()] == sizes
    assert wire.BATCH_RECORDS == 128


@needs_compiled
@fast
@given(messages=st.lists(message, min_size=1, max_size=5))
def test_send_frames_same_messages(pair: Pair, messages: list[list[bytes]]) -> None:
    wires = []
    for impl in (_pure, _compiled):
        for frames in messages:
            assert impl.send_frames(pair.tx, frames) is True
        wires.append(pair.recv_all())
    assert wires[0] == wires[1] == messages


@needs_compiled
def test_send_frames_says_when_the_socket_cannot_take_it(pair: Pair) -> None:
    ctx = zmq.Context.instance()
    lone = ctx.socket(zmq.PUSH)  # no peer: nothing can be sent now
    try:
        for impl in (_pure, _compiled):
            assert impl.send_frames(lone, [b"a", b"b"]) is False
            with pytest.raises(ValueError):
                impl.send_frames(lone, [])
    finally:
        lone.close(0)


@needs_compiled
def test_events_as_pyzmq_says(pair: Pair) -> None:
    for impl in (_pure, _compiled):
        assert impl.events(pair.rx) == 0 and impl.events(pair.tx) == int(zmq.POLLOUT)
    pair.tx.send(b"x")
    assert pair.rx.poll(1000)
    for impl in (_pure, _compiled):
        assert impl.events(pair.rx) == int(pair.rx.get(zmq.EVENTS)) == int(zmq.POLLIN)
    closed = zmq.Context.instance().socket(zmq.PULL)
    closed.close(0)
    for impl in (_pure, _compiled):
        with pytest.raises(zmq.ZMQError):
            impl.events(closed)


@pytest.mark.parametrize("batched", [False, True], ids=["records", "batch"])
@pytest.mark.parametrize("drain", ["drain_records", "drain_pairs", "drain_blocks"])
@pytest.mark.parametrize("impl", IMPLS)
def test_drain_at_the_last_offset_does_not_wrap(impl: Any, pair: Pair, drain: str, batched: bool) -> None:
    # A hostile producer's partition at the very end of the offset space: records 2**64-2 and
    # 2**64-1, then 0 again in the same read.  The compiled cursors kept ``next`` in a u64: it
    # wrapped to 0 after 2**64-1 (the pure twin had 2**64), and the record at 0 then continued
    # the run on the fast path (queued as if it followed 2**64-1).
    top = 2**64 - 2
    tracker = PartitionTracker(TOPIC, PARTITIONS[0], top)
    tracker.pid = 3
    by_prefix = {prefix: tracker for prefix in _prefixes(PARTITIONS[0])}
    if batched:
        pair.send_all([_batch(PARTITIONS[0], top, (b"a", b"b")), _record(PARTITIONS[0], 0, b"c")])
    else:
        pair.send_all([_record(PARTITIONS[0], top, b"a"), _record(PARTITIONS[0], top + 1, b"b"),
                       _record(PARTITIONS[0], 0, b"c")])
    out: list[Any] = []
    calls: list[Any] = []
    slow: list[Any] = []

    def on_record(t: PartitionTracker, seq: int, content: bytes) -> None:
        calls.append(seq)
        t.on_record(seq, content, slow)

    assert pair.rx.poll(1000)
    queued = 0
    for _ in range(10):
        if queued + len(calls) == 3 or not pair.rx.poll(1000):
            break
        if drain == "drain_records":
            queued += impl.drain_records(pair.rx, 10, by_prefix, out, None, 1, on_record, None)
        elif drain == "drain_pairs":
            queued += impl.drain_pairs(pair.rx, 10, by_prefix, out, [], 1, on_record, None)
        else:
            queued += impl.drain_blocks(pair.rx, 10, by_prefix, out, 1, on_record, None)
    assert (tracker.next, tracker.known) == (2**64, 2**64 - 1)
    assert 0 in calls  # never queued as the run's next record
    assert queued + len(calls) == 3
    assert [seq for seq, _ in slow] == [s for s in calls if s != 0]


class _Boom(Exception):
    pass


def _run_drain_blocks_failing(impl: Any, pair: Pair, messages: list[list[bytes]], units: int, block_bytes: int,
                               booms: set[int]) -> Any:
    # As _run_drain_blocks, the handlers raising at the calls numbered in ``booms``.
    trackers = {p: PartitionTracker(TOPIC, p, 0) for p in PARTITIONS}
    trackers[PARTITIONS[0]].pid = 0xFFFFFFFF
    by_prefix = {prefix: tracker for p, tracker in trackers.items() for prefix in _prefixes(p)}
    calls: list[Any] = []
    out: list[Any] = []

    def boom() -> None:
        if len(calls) - 1 in booms:
            raise _Boom()

    def on_record(tracker: PartitionTracker, seq: int, content: bytes) -> None:
        calls.append(("record", tracker.address, seq, content))
        boom()
        delivered: list[tuple[int, bytes]] = []
        tracker.on_record(seq, content, delivered)
        out.extend(("slow", tracker.address, s, c) for s, c in delivered)

    def on_message(frames: list[bytes]) -> None:
        calls.append(("message", frames))
        boom()

    pair.send_all(messages)
    queued = raised = 0
    for _ in range(len(messages) + 10):
        # (after a failure some records are never read: all sent is in the inproc pipe by now)
        if queued + len(calls) >= units or not pair.rx.poll(50 if raised else 1000):
            break
        before = len(out)
        try:
            queued += impl.drain_blocks(pair.rx, 7, by_prefix, out, 1234, on_record, on_message, None, None,
                                        block_bytes)
        except _Boom:
            raised += 1
            # As the store recounts: the blocks queued before the failure.
            queued += sum(impl.block_slice(b[2], 0, 0)[1] - impl.block_slice(b[2], 0, 0)[0] + 1
                          for b in out[before:] if b[0] != "slow")
    state = {p: (t.next, t.known, sorted(t.held.items())) for p, t in trackers.items()}
    return queued, raised, out, calls, state


@needs_compiled
@fast
@given(events=st.one_of(in_runs, st.lists(event, max_size=60)), block_bytes=st.integers(1, 120),
       booms=st.sets(st.integers(0, 30), max_size=4))
def test_drain_blocks_a_failing_handler_keeps_what_was_queued(
    pair: Pair, events: list[Any], block_bytes: int, booms: set[int]
) -> None:
    """A handler raising part-way (the store's on_message or track failing): the records the
    drain queued before it are in ``blocks`` exactly once, the tracker's next just past them,
    in both twins alike; the next reads go on from there."""
    messages, units = _messages(events), _units(events)
    results = [_run_drain_blocks_failing(impl, pair, messages, units, block_bytes, booms) for impl in (_pure, _compiled)]
    assert results[0] == results[1]
    queued, raised, out, calls, state = results[1]
    # (a batch's records after the one whose handler raised are not read: the message was)
    assert queued + len(calls) == units if not raised else queued + len(calls) <= units
    # The stored partition's offsets, fast and slow, each once and in order up to its next.
    offsets: list[int] = []
    for item in out:
        if item[0] == "slow":
            if item[1] == PARTITIONS[0]:
                offsets.append(item[2])
        else:
            first, last, _ = _compiled.block_slice(item[2], 0, 0)
            offsets.extend(range(first, last + 1))
    assert offsets == list(range(len(offsets)))
    assert state[PARTITIONS[0]][0] == len(offsets)



@needs_compiled
@fast
@given(events=st.one_of(in_runs, st.lists(event, max_size=60)), max_size=st.one_of(st.none(), st.integers(0, 30)),
       block_bytes=st.integers(1, 120), back=st.integers(1, 16))
def test_drain_blocks_same_blocks_at_the_end_of_the_offsets(
    pair: Pair, events: list[Any], max_size: int | None, block_bytes: int, back: int
) -> None:
    """The twins alike where offsets end (2**64 - 1): runs reaching it, batches reaching past
    it (malformed), duplicates and gaps there."""
    top = 2**64 - back  # where the trackers start; the events' offsets moved there
    events = [(k, p, seq if k == "garbage" else top + seq, c) for k, p, seq, c in events]
    events = [e for e in events if e[2] < 2**64]
    messages = _messages(events)
    # (a batch reaching past the end is malformed: one message to on_message)
    units = sum(len(c) if k in ("batch", "dbatch") and seq + len(c) <= 2**64 else 1 for k, _, seq, c in events)
    pure = _run_drain_blocks(_pure, pair, messages, units, max_size, block_bytes, top)
    compiled = _run_drain_blocks(_compiled, pair, messages, units, max_size, block_bytes, top)
    assert pure == compiled


@needs_compiled
@fast
@given(events=st.lists(event, max_size=80), block_bytes=st.integers(1, 120))
def test_drain_blocks_same_blocks_of_two_stored_partitions_interleaved(
    pair: Pair, events: list[Any], block_bytes: int
) -> None:
    """Two stored partitions' records interleaved (each switch ends a run and its block):
    the twins alike, each block of one partition, its pid's."""
    messages, units = _messages(events), _units(events)
    pure = _run_drain_blocks(_pure, pair, messages, units, None, block_bytes, stored=2)
    compiled = _run_drain_blocks(_compiled, pair, messages, units, None, block_bytes, stored=2)
    assert pure == compiled
    queued, out, calls, _ = compiled
    assert queued + len(calls) == units
