"""Red-team checks of the Tank gateway's one-call produce and the compiled FrameBuffer."""

from __future__ import annotations

import select
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dafka.config import NodeConfig
from dafka.errors import ProtocolError
from dafka.tank.bundle import encode_bundle
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
from tests.tank.test_produce_plainly import IMPLS, _unchanged_by

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
