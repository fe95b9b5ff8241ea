"""Red-team checks of the Tank gateway's one-call produce and the compiled FrameBuffer."""

from __future__ import annotations

import random
import select
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dafka.config import NodeConfig
from dafka.errors import ProtocolError
from dafka.tank.bundle import CODEC_NONE, encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.codec import PyFrameBuffer, encode_frame
from dafka.tank.gateway import Gateway
from dafka.tank.messages import (
    ProduceError,
    ProducePartition,
    ProduceRequest,
    ProduceTopic,
    ProduceWithSeqnumRequest,
)
from tests.tank.test_gateway import HOST, connect_raw, consume_all, recv_frame
from tests.tank.test_produce_plainly import HAVE_COMPILED as _HAVE_COMPILED
from tests.tank.test_produce_plainly import IMPLS, MAX, Run, _requests, _table, _unchanged_by

TS = 1_700_000_000_000


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


# ---------------------------------------------------------------- FrameBuffer.recv, both twins, over TCP

try:
    from dafka.fastio._compiled import FrameBuffer as CompiledFrameBuffer  # type: ignore[import-not-found]
except ImportError:
    CompiledFrameBuffer = None

TWINS = [pytest.param(PyFrameBuffer, id="pure"),
         pytest.param(CompiledFrameBuffer, id="compiled",
                      marks=pytest.mark.skipif(CompiledFrameBuffer is None, reason="compiled extension not built"))]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server((HOST, 0)) as srv:
        a = socket.create_connection(srv.getsockname(), timeout=10)
        b, _ = srv.accept()
    b.setblocking(False)
    return a, b


def _take(fb: PyFrameBuffer, sock: socket.socket, count: int, direct: Any, probe: int, size: int,
          out: list[tuple[int, bytes]]) -> None:
    """Receive exactly ``count`` bytes the peer sent, as the gateway does (``direct(fb)``: in place?)."""
    got = 0
    while got < count:
        select.select([sock], [], [], 5)
        n, asked = fb.recv(sock, direct(fb), 8, probe, size)
        assert n != 0, "EOF"
        if n > 0:
            assert n <= asked
            got += n
        while (frame := fb.next_view()) is not None:
            out.append((frame[0], bytes(frame[1])))


_frames = st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.integers(0, 3000)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_frames, st.data())
def test_the_twins_receive_the_same_frames_over_tcp_whatever_the_splits(frames: list[tuple[int, int]], data: Any) -> None:
    blob = b"".join(encode_frame(m, bytes([i % 251]) * n) for i, (m, n) in enumerate(frames))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(blob) - 1), max_size=6)) if len(blob) > 1 else []))
    probe = data.draw(st.sampled_from([1, 5, 7, 64]))
    size = data.draw(st.sampled_from([1, 5, 100, 4096]))
    mode = data.draw(st.sampled_from(["always", "never", "alternate"]))
    results = []
    twins = [PyFrameBuffer] + ([CompiledFrameBuffer] if CompiledFrameBuffer is not None else [])
    for FB in twins:
        fb = FB(1 << 20, 52, lambda n: bytearray(b"\xee" * n))
        flip = [False]

        def direct(_fb: Any, flip: list[bool] = flip) -> bool:
            flip[0] = not flip[0]
            return mode == "always" or (mode == "alternate" and flip[0])

        a, b = _tcp_pair()
        out: list[tuple[int, bytes]] = []
        states = []
        try:
            prev = 0
            for cut in [*cuts, len(blob)]:
                a.sendall(blob[prev:cut])
                _take(fb, b, cut - prev, direct, probe, size, out)
                states.append((len(out), fb.buffered, fb.needed(), fb.pending_length(), fb.peek_msg_id()))
                prev = cut
            a.shutdown(socket.SHUT_WR)
            select.select([b], [], [], 5)
            assert fb.recv(b, direct(fb), 8, probe, size)[0] == 0  # EOF
        finally:
            a.close()
            b.close()
        assert out == [(m, bytes([i % 251]) * n) for i, (m, n) in enumerate(frames)]
        results.append((out, states))
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("FB", TWINS)
def test_a_header_over_the_limit_behind_a_frame_received_in_place(FB: Any) -> None:
    # The probe bytes read behind a frame received in place hold the next header: over the
    # limit, it raises where it is looked at (not at the receive), the frame before is whole.
    fb = FB(1000, 52)
    a, b = _tcp_pair()
    try:
        big = encode_frame(1, b"x" * 600)
        a.sendall(big[:100])
        select.select([b], [], [], 5)
        assert fb.recv(b, True, 8, 16, 4096)[0] > 0
        a.sendall(big[100:] + struct.pack("<BI", 1, 5000))
        got = 0
        while got < len(big) - 100 + 5:
            select.select([b], [], [], 5)
            n, _ = fb.recv(b, True, 8, 16, 4096)
            assert n > 0
            got += n
        assert fb.next_view() == (1, memoryview(b"x" * 600)) or bytes(fb.next_view()[1]) == b"x" * 600
    finally:
        a.close()
        b.close()
    with pytest.raises(ProtocolError):
        fb.pending_length()
    with pytest.raises(ProtocolError):
        fb.next_view()


@pytest.mark.parametrize("FB", TWINS)
def test_a_peer_reset_mid_frame_is_an_oserror(FB: Any) -> None:
    fb = FB(1 << 20, 52)
    a, b = _tcp_pair()
    try:
        a.sendall(encode_frame(1, b"y" * 5000)[:300])
        select.select([b], [], [], 5)
        assert fb.recv(b, True, 8, 16, 4096)[0] > 0
        a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        a.close()
        select.select([b], [], [], 5)
        with pytest.raises(ConnectionResetError):
            for _ in range(3):
                fb.recv(b, True, 8, 16, 4096)
        assert fb.buffered == 300
    finally:
        b.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_sparse_bundle_whose_own_first_seq_is_not_the_requests_is_left_to_the_general_path(impl: Any) -> None:
    sparse = encode_bundle([(0, TS, None, b"s0"), (2, TS, None, b"s2")], sparse=True)
    _unchanged_by(impl, ProduceWithSeqnumRequest(1, [ProduceTopic("t", [ProducePartition(0, sparse, 1)])]))


# ---------------------------------------------------------------- the one call against the general path itself


class _General:
    """What Gateway._on_produce reads and changes, nothing else (it runs as a method of this)."""

    def __init__(self, offsets: dict[Any, int], live_keys: set[Any], live_held: int) -> None:
        from dafka.gateway.connections import LogLimiter
        from dafka.tank.gateway import log

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
        from dafka.store.node import Store

        Store.queue_block(self, topic, partition, block, records)  # type: ignore[arg-type]

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
    from dafka.tank.gateway import MAX_LIVE_HELD_BYTES, Gateway
    from dafka.tank.messages import decode_request

    payload, with_seq, offsets = req
    if big_offset is not None:
        offsets = {**offsets, ("t", "t0"): big_offset}
    live = {("t", "t0")} if live_t0 else {("t", "t1"), ("u", "u0")}
    for impl in [i.values[0] for i in IMPLS if not i.marks or _HAVE_COMPILED]:
        run = Run(impl, payload, with_seq, offsets, live, live_room, in_place)
        event("left to the general path" if run.result is None else "taken")
        if run.result is None:
            continue
        needs, answer, records, held, live_bytes = run.result
        general = _General(offsets, live, MAX_LIVE_HELD_BYTES - live_room)
        buf = bytearray(52) + bytearray(payload)
        view: Any = memoryview(buf)[52:] if in_place else payload
        Gateway._on_produce(general, None, decode_request(5 if with_seq else 1, view))  # type: ignore[arg-type]
        assert [(t, p, bytes(b)) for t, p, b in general._blocks] == [(t, p, bytes(b)) for t, p, b in run.blocks]
        assert [type(b) for _t, _p, b in general._blocks] == [type(b) for _t, _p, b in run.blocks]
        assert general._next_offset == run.offsets
        assert general._to_publish == run.publish
        assert general._blocks_held == records and general._blocks_bytes == held
        assert general._live_held - (MAX_LIVE_HELD_BYTES - live_room) == live_bytes
        assert bytes(buf) == bytes(run.buf)  # the same header sealed in place
        if needs:
            assert [(p.answer, p.needs) for p in general._pending] == [(answer, needs)] and not general.written
        else:
            assert general.written == [answer] and not general._pending


def _random_requests(rng: random.Random, topic: str) -> list[Any]:
    """Pipelined produces of every size (received in place or not), duplicated partitions,
    seqs right and wrong, unknown partitions, sparse bundles."""
    from tests.tank.test_produce_plainly import _bundle

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


_ops = st.lists(st.one_of(
    st.tuples(st.just("feed"), st.integers(0, 400)),
    st.tuples(st.just("direct"), st.integers(-1, 300)),
    st.tuples(st.just("received"), st.integers(-2, 400)),
    st.tuples(st.just("next"), st.just(0)),
), max_size=30)


@pytest.mark.skipif(CompiledFrameBuffer is None, reason="compiled extension not built")
@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=0, max_size=3000), _ops, st.sampled_from([0, 52]), st.sampled_from([64, 1000, 1 << 20]))
def test_the_twins_agree_on_any_sequence_of_calls(blob: bytes, ops: list[tuple[str, int]], room: int, limit: int) -> None:
    # A stream of anything (frames or not), fed or received in place in any order, with
    # received() told the truth or not: every call gives the same result or the same error.
    fbs = [PyFrameBuffer(limit, room, lambda n: bytearray(b"\xee" * n)),
           CompiledFrameBuffer(limit, room, lambda n: bytearray(b"\xee" * n))]
    pos = [0, 0]
    views: list[Any] = [None, None]

    def state(fb: Any) -> Any:
        out = []
        for f in (lambda: fb.buffered, fb.needed, fb.pending_length, fb.peek_msg_id):
            try:
                out.append(f())
            except ProtocolError as exc:
                out.append(("ProtocolError", str(exc)))
        return out

    for op, arg in ops:
        got = []
        for i, fb in enumerate(fbs):
            try:
                if op == "feed":
                    piece = blob[pos[i]:pos[i] + arg]
                    pos[i] += len(piece)
                    fb.feed(piece)
                    got.append(None)
                elif op == "direct":
                    views[i] = fb.direct(arg)
                    got.append(None if views[i] is None else len(views[i]))
                elif op == "received":
                    view = views[i]
                    if view is not None and 0 <= arg <= len(view):
                        piece = blob[pos[i]:pos[i] + arg]
                        view[:len(piece)] = piece
                        pos[i] += len(piece)
                        arg = len(piece)
                    views[i] = None
                    fb.received(arg)
                    got.append(arg)
                else:
                    frame = fb.next_view()
                    got.append(None if frame is None else (frame[0], bytes(frame[1])))
            except (ProtocolError, ValueError) as exc:
                got.append((type(exc).__name__, str(exc)))
            got.append(state(fb))
        assert got[0:2] == got[2:4], (op, arg)
        assert pos[0] == pos[1]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("FB", TWINS)
@pytest.mark.parametrize("timeout", [None, 0.2])
def test_recv_reads_only_a_non_blocking_socket(FB: Any, timeout: float | None) -> None:
    # The compiled twin reads the descriptor (readv): on a socket with a timeout it came back
    # at once with "nothing" (-1) where the pure one waited and raised TimeoutError, and on a
    # blocking one it blocked holding the GIL.  Both refuse such a socket now, before reading.
    a, b = _tcp_pair()
    try:
        b.settimeout(timeout)
        fb = FB(1 << 20, 52)
        with pytest.raises(ValueError, match="non-blocking"):
            fb.recv(b, True, 8, 16, 64)
        assert fb.buffered == 0
        b.setblocking(False)
        assert fb.recv(b, True, 8, 16, 64) == (-1, 16)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_large_produce_cut_by_eof_or_reset_stores_nothing_and_gives_its_budget_back(tmp_path: Path) -> None:
    # Received in place (readv into the frame's own buffer and the probe behind it), a frame
    # the peer ends half way (EOF, then a reset) is dropped whole; a complete one before it
    # on the same connection is stored and its reservation goes too.
    from tests.conftest import wait_until
    from tests.tank.test_produce_plainly import _bundle

    gw = Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0))
    try:
        with TankClient(HOST, gw.tank_port) as c:
            c.create_topic("a", 1)
            whole = ProduceRequest(1, [ProduceTopic("a", [ProducePartition(0, _bundle(700, 150, CODEC_NONE))])]).encode()
            cut = ProduceRequest(2, [ProduceTopic("a", [ProducePartition(0, _bundle(800, 150, CODEC_NONE))])]).encode()
            for how in ("eof", "reset"):
                s = connect_raw(gw.tank_port)
                s.sendall(whole)
                assert recv_frame(s)[1][4:] == bytes([ProduceError.OK])
                s.sendall(cut[: len(cut) // 2])
                wait_until(lambda: gw._reserved > 0)
                if how == "eof":
                    s.shutdown(socket.SHUT_WR)
                else:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
                wait_until(lambda: gw._reserved == 0)
            assert len(consume_all(c, "a", 0)) == 2 * 700
    finally:
        gw.close()
