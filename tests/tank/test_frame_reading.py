"""Reading Tank frames from a socket: the compiled FrameBuffer and its pure twin
(``dafka.tank.codec.FrameBuffer``) over real TCP, whatever the splits, and against hostile or broken
peers; any sequence of calls gives the same results in both.  (The unit tests of either are in
test_codec.py.)"""

from __future__ import annotations

import select
import socket
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.tank.codec import FrameBuffer as PyFrameBuffer
from dafka.tank.codec import encode_frame
from tests.tank.test_gateway import HOST

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
        frame = fb.next_view()
        assert frame is not None and frame[0] == 1 and bytes(frame[1]) == b"x" * 600
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
