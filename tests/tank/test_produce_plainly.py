"""The Tank gateway's compiled produce (dafka.fastio.tank_produce) and its pure twin.

The gateway hands every produce request to ``tank_produce`` first: where the request is the
common kind it is decoded, walked, sealed and queued in that one call; anything else comes
back None with nothing changed and goes the general way (``Gateway._on_produce``).  Here:

* the twins give the same result for the same input, well formed or broken (hypothesis);
* None leaves the caller's lists, offsets and the received buffer untouched;
* what they queue is what the general path queues: the same blocks, byte for byte, the
  same offsets, the same answer (each checked against :func:`dafka.store.block.tank_seal`
  and the request's own encoder).

And at the end, two gateways over TCP, one taking the common requests this way and one
sending all to the general path: the same answers, the same records stored.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dafka.config import NodeConfig
from dafka.fastio import _pure
from dafka.gateway.connections import LogLimiter
from dafka.store.block import HEADER_SIZE, decode_header, tank_seal
from dafka.store.node import Store
from dafka.tank.bundle import CODEC_NONE, CODEC_SNAPPY, encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.gateway import MAX_LIVE_HELD_BYTES, Gateway, log
from dafka.tank.mapping import PARTITIONS_TOPIC, TankPartition
from dafka.tank.messages import (
    ProduceError,
    ProducePartition,
    ProducePartitionResult,
    ProduceRequest,
    ProduceResponse,
    ProduceTopic,
    ProduceTopicResult,
    ProduceWithSeqnumRequest,
    decode_request,
)
from tests.tank.test_gateway import HOST, connect_raw, consume_all, recv_frame

try:
    from dafka.fastio import _compiled  # type: ignore[attr-defined]
except ImportError:  # not built: the pure twin alone
    _compiled = None

HAVE_COMPILED = _compiled is not None and hasattr(_compiled, "tank_produce")
IMPLS = [pytest.param(_pure, id="pure"),
         pytest.param(_compiled, id="compiled",
                      marks=pytest.mark.skipif(not HAVE_COMPILED, reason="compiled extension not built"))]
MAX = 1 << 20
BUDGET = 64 << 20
ROOM = HEADER_SIZE  # what the gateway leaves in front of a frame received in place
TS = 1_700_000_000_000


def _table() -> dict[str, list[Any]]:
    """Topic "t": partitions 0 and 1 owned, 2 a mesh producer's; "u": 0 owned; the map's own topic."""
    return {
        "t": [TankPartition("t", 0, "t0", True), TankPartition("t", 1, "t1", True), TankPartition("t", 2, "m2", False)],
        "u": [TankPartition("u", 0, "u0", True)],
        PARTITIONS_TOPIC: [TankPartition(PARTITIONS_TOPIC, 0, "", True)],
    }


def _bundle(n: int, size: int = 20, codec: int | None = None, sparse_from: int | None = None) -> bytes:
    if sparse_from is None:
        return encode_bundle([(None, TS + i, None, bytes([i % 251]) * size) for i in range(n)], codec=codec)
    return encode_bundle([(sparse_from + i, TS + i, None, bytes([i % 251]) * size) for i in range(n)],
                         codec=codec, sparse=True)


def _received(req: ProduceRequest) -> tuple[bytearray, memoryview]:
    """A request as the gateway receives a large one: its frame in a buffer of its own, after
    ROOM free bytes; the payload is a view of it."""
    frame = req.encode()
    buf = bytearray(ROOM) + bytearray(frame)
    return buf, memoryview(buf)[ROOM + 5:]


class Run:
    """One call of an implementation on fresh copies of everything it may change."""

    def __init__(self, impl: Any, payload_bytes: bytes, with_seq: bool, offsets: dict[Any, int],
                 live_keys: set[Any] = frozenset(), live_room: int = 1 << 26, in_place: bool = True) -> None:
        self.buf = bytearray(ROOM) + bytearray(payload_bytes)
        payload: Any = memoryview(self.buf)[ROOM:] if in_place else payload_bytes
        self.offsets = dict(offsets)
        self.blocks: list[Any] = []
        self.publish: list[Any] = []
        self.result = impl.tank_produce(
            payload, with_seq, _table(), self.offsets, MAX, BUDGET,
            lambda part: (part.topic, part.address) in live_keys, live_room, self.blocks, self.publish,
            PARTITIONS_TOPIC,
        )

    def outcome(self) -> tuple[Any, ...]:
        blocks = [(t, p, type(b).__name__, bytes(b)) for t, p, b in self.blocks]
        return self.result, blocks, self.publish, self.offsets, bytes(self.buf)


# ---------------------------------------------------------------- what the common request gives


@pytest.mark.parametrize("impl", IMPLS)
def test_a_common_request_is_sealed_queued_and_answered_in_one_call(impl: Any) -> None:
    first = _bundle(700, 150)  # the bulk of the frame: sealed where it lies
    second = _bundle(3, codec=CODEC_NONE)
    req = ProduceRequest(77, [ProduceTopic("t", [ProducePartition(0, first), ProducePartition(1, second)]),
                              ProduceTopic("u", [ProducePartition(0, second)])])
    buf, payload = _received(req)
    offsets = {("t", "t0"): 10}
    blocks: list[Any] = []
    publish: list[Any] = []
    got = impl.tank_produce(payload, False, _table(), offsets, MAX, BUDGET, lambda p: False, 1 << 26,
                            blocks, publish, PARTITIONS_TOPIC)
    assert got is not None
    needs, answer, records, live_bytes = got
    assert needs == {("t", "t0"): 709, ("t", "t1"): 2, ("u", "u0"): 2}
    assert offsets == {("t", "t0"): 710, ("t", "t1"): 3, ("u", "u0"): 3}
    expected = ProduceResponse(77, [ProduceTopicResult([ProducePartitionResult(), ProducePartitionResult()]),
                                    ProduceTopicResult([ProducePartitionResult()])]).encode()
    assert answer == expected
    assert records == 706 and live_bytes == 0 and publish == []
    # The blocks are the general path's, byte for byte: tank_seal of each bundle at its offset.
    scan = impl.tank_scan
    assert [(t, p, bytes(b)) for t, p, b in blocks] == [
        ("t", "t0", tank_seal(first, scan(first, MAX, BUDGET), 10)),
        ("t", "t1", tank_seal(second, scan(second, MAX, BUDGET), 0)),
        ("u", "u0", tank_seal(second, scan(second, MAX, BUDGET), 0)),
    ]
    # The first one is a view of the received buffer (no copy), the others copies.
    assert type(blocks[0][2]) is memoryview and blocks[0][2].obj is buf
    assert [type(b[2]) for b in blocks[1:]] == [bytes, bytes]


@pytest.mark.parametrize("impl", IMPLS)
def test_live_partitions_get_their_contents_while_there_is_room(impl: Any) -> None:
    bundle = _bundle(4, 10, codec=CODEC_NONE)
    req = ProduceRequest(1, [ProduceTopic("t", [ProducePartition(0, bundle), ProducePartition(1, bundle)])])
    run = Run(impl, req.encode()[5:], False, {}, live_keys={("t", "t0"), ("t", "t1")})
    assert run.result is not None and run.result[3] == 80
    assert run.publish == [(("t", "t0"), 0, [bytes([i]) * 10 for i in range(4)]),
                           (("t", "t1"), 0, [bytes([i]) * 10 for i in range(4)])]
    # The room runs out after the first: the second is stored without its contents.
    run = Run(impl, req.encode()[5:], False, {}, live_keys={("t", "t0"), ("t", "t1")}, live_room=40)
    assert run.result is not None and run.result[3] == 40
    assert [p[0] for p in run.publish] == [("t", "t0")]


@pytest.mark.parametrize("impl", IMPLS)
def test_seqs_that_continue_the_partition_are_taken(impl: Any) -> None:
    req = ProduceWithSeqnumRequest(5, [ProduceTopic("t", [ProducePartition(0, _bundle(3), first_seq=8)])])
    run = Run(impl, req.encode()[5:], True, {("t", "t0"): 7})
    assert run.result is not None and run.offsets == {("t", "t0"): 10}
    sparse = ProduceRequest(5, [ProduceTopic("t", [ProducePartition(0, _bundle(3, sparse_from=1))])])
    run = Run(impl, sparse.encode()[5:], False, {})
    assert run.result is not None and decode_header(run.blocks[0][2]).first_offset == 0


def _unchanged_by(impl: Any, req: ProduceRequest, offsets: dict[Any, int] | None = None) -> None:
    payload = req.encode()[5:]
    run = Run(impl, payload, isinstance(req, ProduceWithSeqnumRequest), offsets or {})
    assert run.result is None
    assert run.blocks == [] and run.publish == [] and run.offsets == (offsets or {})
    assert bytes(run.buf) == bytes(ROOM) + payload  # nothing sealed in place either


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [
    "unknown topic", "unknown partition", "not owned", "the map's topic", "second bundle malformed",
    "second seq does not continue", "a sparse bundle behind", "trailing byte", "cut short", "too large",
])
def test_anything_uncommon_is_left_to_the_general_path_untouched(impl: Any, case: str) -> None:
    ok = ProducePartition(0, _bundle(600, 150))
    bad = _bundle(3)[:-1]
    reqs: dict[str, ProduceRequest] = {
        "unknown topic": ProduceRequest(1, [ProduceTopic("t", [ok]), ProduceTopic("nope", [ok])]),
        "unknown partition": ProduceRequest(1, [ProduceTopic("t", [ok, ProducePartition(9, _bundle(2))])]),
        "not owned": ProduceRequest(1, [ProduceTopic("t", [ok, ProducePartition(2, _bundle(2))])]),
        "the map's topic": ProduceRequest(1, [ProduceTopic(PARTITIONS_TOPIC, [ok])]),
        "second bundle malformed": ProduceRequest(1, [ProduceTopic("t", [ok, ProducePartition(1, bad)])]),
        "second seq does not continue": ProduceWithSeqnumRequest(1, [ProduceTopic("t", [
            ProducePartition(0, _bundle(3), first_seq=1), ProducePartition(0, _bundle(3), first_seq=5)])]),
        "a sparse bundle behind": ProduceRequest(1, [ProduceTopic("t", [ok, ProducePartition(1, _bundle(2, sparse_from=9))])]),
        "too large": ProduceRequest(1, [ProduceTopic("t", [ok, ProducePartition(1, _bundle(1, MAX + 1, CODEC_NONE))])]),
    }
    if case in reqs:
        _unchanged_by(impl, reqs[case])
        return
    payload = ProduceRequest(1, [ProduceTopic("t", [ok])]).encode()[5:]
    payload = payload + b"\x00" if case == "trailing byte" else payload[:-1]
    run = Run(impl, payload, False, {})
    assert run.result is None and run.blocks == [] and bytes(run.buf) == bytes(ROOM) + payload


# ---------------------------------------------------------------- the twins agree, on anything

_names = st.sampled_from(["t", "u", "nope", PARTITIONS_TOPIC, "\u00e9t\u00e9"])


@st.composite
def _requests(draw: Any) -> tuple[bytes, bool, dict[Any, int]]:
    with_seq = draw(st.booleans())
    topics = []
    for _ in range(draw(st.integers(0, 3))):
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            n = draw(st.integers(1, 40))
            codec = draw(st.sampled_from([None, CODEC_NONE, CODEC_SNAPPY]))
            sparse_from = draw(st.one_of(st.none(), st.integers(1, 5)))
            bundle = _bundle(n, draw(st.integers(0, 60)), codec, sparse_from)
            seq = draw(st.integers(0, 6)) if with_seq else None
            parts.append(ProducePartition(draw(st.integers(0, 3)), bundle, seq))
        topics.append(ProduceTopic(draw(_names), parts))
    cls = ProduceWithSeqnumRequest if with_seq else ProduceRequest
    payload = bytearray(cls(draw(st.integers(0, 2**32 - 1)), topics, draw(st.sampled_from(["", "c", "\u00e9"])),
                            1, 0).encode()[5:])
    for _ in range(draw(st.integers(0, 2))):  # bytes changed: long varints, lies, garbage
        if payload:
            i = draw(st.integers(0, len(payload) - 1))
            payload[i] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, payload[i] ^ 0x41]))
    if draw(st.booleans()):
        payload = payload[: draw(st.integers(0, len(payload)))] + draw(st.binary(max_size=2))
    offsets = {key: draw(st.integers(0, 5)) for key in [("t", "t0"), ("t", "t1"), ("u", "u0")] if draw(st.booleans())}
    return bytes(payload), with_seq, offsets


@pytest.mark.skipif(not HAVE_COMPILED, reason="compiled extension not built")
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_requests(), st.booleans(), st.sampled_from([0, 30, 1 << 26]), st.booleans())
def test_the_twins_give_the_same_result(req: tuple[bytes, bool, dict[Any, int]], in_place: bool,
                                        live_room: int, live_t0: bool) -> None:
    payload, with_seq, offsets = req
    live = {("t", "t0")} if live_t0 else {("t", "t1"), ("u", "u0")}
    pure = Run(_pure, payload, with_seq, offsets, live, live_room, in_place)
    compiled = Run(_compiled, payload, with_seq, offsets, live, live_room, in_place)
    assert pure.outcome() == compiled.outcome()
    event("left to the general path" if pure.result is None else "taken")
    if pure.result is None:  # nothing changed
        assert pure.blocks == [] and pure.publish == [] and pure.offsets == offsets
        assert bytes(pure.buf) == bytes(ROOM) + payload
    else:  # every block is the general path's seal of its bundle at the offsets given
        for _t, _p, block in pure.blocks:
            header = decode_header(block)
            body = bytes(block)[HEADER_SIZE:]
            assert bytes(block) == tank_seal(body, _pure.tank_scan(body, MAX, BUDGET), header.first_offset)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_view_of_a_small_share_of_its_buffer_is_copied(impl: Any) -> None:
    # The first bundle is sealed where it lies only when it is half the buffer or more: a
    # block that is a view keeps the whole buffer until it is committed.
    tiny = ProducePartition(0, _bundle(1, 5, CODEC_NONE))
    req = ProduceRequest(1, [ProduceTopic("t", [tiny]), ProduceTopic("u", [ProducePartition(0, _bundle(500, 150))])])
    run = Run(impl, req.encode()[5:], False, {})
    assert run.result is not None
    assert [type(b[2]) for b in run.blocks] == [bytes, bytes]
    assert struct.unpack_from("<I", run.result[1], 1)[0] == 6  # the answer: req id + two OKs


# ---------------------------------------------------------------- two gateways, one way each


def _mixed_requests() -> list[tuple[ProduceRequest, bool]]:
    """Requests of every kind, in order, each with whether the one call takes it."""
    big = _bundle(700, 150)
    return [
        (ProduceRequest(1, [ProduceTopic("a", [ProducePartition(0, big)])]), True),
        (ProduceRequest(2, [ProduceTopic("a", [ProducePartition(1, _bundle(5))]),
                            ProduceTopic("b", [ProducePartition(0, _bundle(3, codec=CODEC_NONE))])]), True),
        (ProduceWithSeqnumRequest(3, [ProduceTopic("a", [ProducePartition(2, _bundle(3), first_seq=1)])]), True),
        (ProduceRequest(4, [ProduceTopic("a", [ProducePartition(2, _bundle(4, sparse_from=4))])]), True),
        (ProduceRequest(5, [ProduceTopic("a", [ProducePartition(7, _bundle(2)), ProducePartition(0, _bundle(2))])]), False),
        (ProduceRequest(6, [ProduceTopic("zz", [ProducePartition(0, _bundle(2))])]), False),
        (ProduceWithSeqnumRequest(7, [ProduceTopic("a", [ProducePartition(1, _bundle(2), first_seq=100)])]), False),
        (ProduceRequest(8, [ProduceTopic("b", [ProducePartition(0, _bundle(600, 40, codec=CODEC_SNAPPY))])]), True),
        (ProduceRequest(9, [ProduceTopic("a", [ProducePartition(0, big), ProducePartition(0, _bundle(2))])]), True),
        (ProduceRequest(10, []), True),
    ]


def _store_through(gw: Gateway) -> tuple[list[bytes], dict[tuple[str, int], list[Any]]]:
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("a", 3)
        c.create_topic("b", 1)
        s = connect_raw(gw.tank_port)
        try:
            s.sendall(b"".join(req.encode() for req, _ in _mixed_requests()))  # pipelined
            # (by request id: an answer that waits for no commit goes at once, before others)
            answers = sorted((recv_frame(s)[1] for _ in _mixed_requests()), key=lambda a: a[:4][::-1])
        finally:
            s.close()
        stored = {(t, p): consume_all(c, t, p) for t, p in [("a", 0), ("a", 1), ("a", 2), ("b", 0)]}
    return answers, stored


@pytest.mark.timeout(120)
def test_the_compiled_produce_stores_what_the_general_path_stores(tmp_path: Path) -> None:
    taken: list[int] = []
    fast = Gateway(tmp_path / "fast", NodeConfig(towers=()), listen=(HOST, 0))
    general = Gateway(tmp_path / "general", NodeConfig(towers=()), listen=(HOST, 0))
    try:
        plainly = fast._produce_plainly

        def counted(conn: Any, msg_id: int, payload: Any) -> bool:
            done = plainly(conn, msg_id, payload)
            if done:
                taken.append(struct.unpack_from("<I", payload, 2)[0])
            return done

        fast._produce_plainly = counted  # type: ignore[method-assign]
        general._produce_plainly = lambda conn, msg_id, payload: False  # type: ignore[method-assign]
        got_fast, got_general = _store_through(fast), _store_through(general)
    finally:
        fast.close()
        general.close()
    assert got_fast == got_general
    assert taken == [req.req_id for req, common in _mixed_requests() if common]
    answers, stored = got_fast
    assert [a[4:] for a in answers[4:7]] == [bytes([ProduceError.UNKNOWN_PARTITION, 0]),
                                              bytes([ProduceError.UNKNOWN_TOPIC]),
                                              bytes([ProduceError.INVALID_SEQNUM])]
    assert [len(stored[k]) for k in sorted(stored)] == [700 + 2 + 700 + 2, 5, 3 + 4, 3 + 600]


# ---------------------------------------------------------------- hostile and broken requests


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plainly", [True, False], ids=["one call", "general path"])
def test_a_seqnum_produce_of_a_sparse_bundle_with_a_gap_takes_no_offsets_it_is_not_given(
        tmp_path: Path, plainly: bool) -> None:
    # ProduceWithSeqnum's first seq 1 continues the empty partition, and the sparse bundle's
    # last seq (2) is first + count - 1; but its header says it starts at 0: a block of
    # offsets 0..2 for two records, the partition moved on by two only.  The next produce
    # was then given offset 2 again (two blocks over one offset).
    gw = Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0))
    try:
        if not plainly:
            gw._produce_plainly = lambda conn, msg_id, payload: False  # type: ignore[method-assign]
        with TankClient(HOST, gw.tank_port) as c:
            c.create_topic("a", 1)
            s = connect_raw(gw.tank_port)
            try:
                sparse = encode_bundle([(0, TS, None, b"s0"), (2, TS, None, b"s2")], sparse=True)
                s.sendall(ProduceWithSeqnumRequest(1, [ProduceTopic("a", [ProducePartition(0, sparse, 1)])]).encode())
                first = recv_frame(s)[1]
                s.sendall(ProduceRequest(2, [ProduceTopic("a", [ProducePartition(0, encode_bundle(
                    [(None, TS, None, b"next")]))])]).encode())
                second = recv_frame(s)[1]
            finally:
                s.close()
            stored = consume_all(c, "a", 0)
    finally:
        gw.close()
    assert second[4:] == bytes([ProduceError.OK])
    if first[4:] == bytes([ProduceError.OK]):
        # Taken: every record answered OK is there, once, at offsets without overlap.
        assert [r[3] for r in stored] == [b"s0", b"s2", b"next"]
        seqs = [r[0] for r in stored]
        assert seqs == sorted(set(seqs))
    else:
        assert first[4:] == bytes([ProduceError.INVALID_SEQNUM])
        assert [r[3] for r in stored] == [b"next"]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_sparse_bundle_whose_own_first_seq_is_not_the_requests_is_left_to_the_general_path(impl: Any) -> None:
    sparse = encode_bundle([(0, TS, None, b"s0"), (2, TS, None, b"s2")], sparse=True)
    _unchanged_by(impl, ProduceWithSeqnumRequest(1, [ProduceTopic("t", [ProducePartition(0, sparse, 1)])]))


# ---------------------------------------------------------------- the one call against the general path itself


class _General:
    """What Gateway._on_produce reads and changes, nothing else (it runs as a method of this)."""

    def __init__(self, offsets: dict[Any, int], live_keys: set[Any], live_held: int) -> None:
        self.pmap = _Map()
        self.storage_error = None
        self._live_held = live_held
        self._live_keys = live_keys
        self.config = NodeConfig(towers=(), max_record_bytes=MAX)
        self.records_too_large = 0
        self._limited = LogLimiter(log)
        self._to_publish: list[Any] = []
        self._next_offset = dict(offsets)
        self._blocks: list[Any] = []
        self._blocks_held = self._blocks_bytes = 0
        self._pending: list[Any] = []
        self.written: list[bytes] = []

    def _live(self, part: Any) -> bool:
        return (part.topic, part.address) in self._live_keys

    def queue_block(self, topic: str, partition: str, block: Any, records: int) -> None:
        Store.queue_block(self, topic, partition, block, records)  # type: ignore[arg-type]

    def queue_blocks(self, blocks: list[Any], records: int) -> None:
        Store.queue_blocks(self, blocks, records)  # type: ignore[arg-type]

    def _write(self, conn: Any, data: bytes) -> None:
        self.written.append(data)


class _Map:
    def __init__(self) -> None:
        self._topics = _table()

    def partitions(self, topic: str) -> Any:
        return self._topics.get(topic)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_requests(), st.booleans(), st.sampled_from([0, 30, 1 << 26]), st.booleans(),
       st.sampled_from([None, 0, 2**64 - 1, 2**64 - 2, 2**63]))
def test_what_the_one_call_takes_it_does_as_the_general_path(req: tuple[bytes, bool, dict[Any, int]], in_place: bool,
                                                             live_room: int, live_t0: bool, big_offset: int | None) -> None:
    payload, with_seq, offsets = req
    if big_offset is not None:
        offsets = {**offsets, ("t", "t0"): big_offset}
    live = {("t", "t0")} if live_t0 else {("t", "t1"), ("u", "u0")}
    for impl in [i.values[0] for i in IMPLS if not i.marks or HAVE_COMPILED]:
        run = Run(impl, payload, with_seq, offsets, live, live_room, in_place)
        event("left to the general path" if run.result is None else "taken")
        if run.result is None:
            continue
        needs, answer, records, live_bytes = run.result
        general = _General(offsets, live, MAX_LIVE_HELD_BYTES - live_room)
        buf = bytearray(52) + bytearray(payload)
        view: Any = memoryview(buf)[52:] if in_place else payload
        Gateway._on_produce(general, None, decode_request(5 if with_seq else 1, view))  # type: ignore[arg-type]
        assert [(t, p, bytes(b)) for t, p, b in general._blocks] == [(t, p, bytes(b)) for t, p, b in run.blocks]
        assert [type(b) for _t, _p, b in general._blocks] == [type(b) for _t, _p, b in run.blocks]
        assert general._next_offset == run.offsets
        assert general._to_publish == run.publish
        assert general._blocks_held == records
        assert general._live_held - (MAX_LIVE_HELD_BYTES - live_room) == live_bytes
        assert bytes(buf) == bytes(run.buf)  # the same header sealed in place
        if needs:
            assert [(p.answer, p.needs) for p in general._pending] == [(answer, needs)] and not general.written
        else:
            assert general.written == [answer] and not general._pending


def _random_requests(rng: random.Random, topic: str) -> list[Any]:
    """Pipelined produces of every size (received in place or not), duplicated partitions,
    seqs right and wrong, unknown partitions, sparse bundles."""
    reqs: list[Any] = []
    hwm = {0: 0, 1: 0}  # what a client that knows the partitions would send as first seqs
    for req_id in range(1, rng.randint(3, 9)):
        with_seq = rng.random() < 0.3
        parts = []
        for _ in range(rng.randint(0, 3)):
            pid = rng.choice([0, 0, 1, 1, 5])
            n = rng.choice([1, 3, 40, 700, 2000])
            size = rng.choice([10, 150])
            seq = None
            sparse_from = None
            if with_seq:
                seq = hwm.get(pid, 0) + 1 if rng.random() < 0.8 else rng.choice([0, 2**64 - 1, 7])
            elif rng.random() < 0.2:
                sparse_from = hwm.get(pid, 0) + 1 if rng.random() < 0.7 else 1000
            if pid in hwm and (seq is None or seq == hwm[pid] + 1) and sparse_from in (None, hwm[pid] + 1):
                hwm[pid] += n
            parts.append(ProducePartition(pid, _bundle(n, size, rng.choice([None, CODEC_NONE]), sparse_from), seq))
        cls = ProduceWithSeqnumRequest if with_seq else ProduceRequest
        reqs.append(cls(req_id, [ProduceTopic(topic, parts)] if parts or rng.random() < 0.5 else []))
    return reqs


@pytest.mark.timeout(240)
def test_pipelined_produces_split_anywhere_store_and_answer_as_the_general_path(tmp_path: Path) -> None:
    fast = Gateway(tmp_path / "fast", NodeConfig(towers=()), listen=(HOST, 0))
    general = Gateway(tmp_path / "general", NodeConfig(towers=()), listen=(HOST, 0))
    general._produce_plainly = lambda conn, msg_id, payload: False  # type: ignore[method-assign]
    try:
        for seed in range(40):
            rng = random.Random(seed)
            topic = f"s{seed}"
            reqs = _random_requests(rng, topic)
            blob = b"".join(r.encode() for r in reqs)
            cuts = sorted(rng.sample(range(1, len(blob)), min(len(blob) - 1, rng.randint(0, 12))))
            got = []
            for gw in (fast, general):
                with TankClient(HOST, gw.tank_port) as c:
                    c.create_topic(topic, 2)
                    s = connect_raw(gw.tank_port)
                    try:
                        prev = 0
                        for cut in [*cuts, len(blob)]:
                            s.sendall(blob[prev:cut])
                            prev = cut
                        answers = sorted((recv_frame(s) for _ in reqs), key=lambda a: a[1][:4][::-1])
                    finally:
                        s.close()
                    stored = [consume_all(c, topic, p) for p in (0, 1)]
                got.append((answers, stored))
            assert got[0] == got[1], seed
    finally:
        fast.close()
        general.close()
