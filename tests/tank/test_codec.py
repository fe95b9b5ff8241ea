"""Tank wire primitives: varints, str8, bounded reads, frames."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.fastio import view_start
from dafka.tank.codec import (
    MAX_FRAME_SIZE,
    MAX_VARINT,
    FrameBuffer,
    Reader,
    decode_text,
    decode_varint,
    encode_frame,
    encode_str8,
    encode_varint,
    frame_header,
    parse_frame_header,
    varint_is_truncated,
)

try:
    from dafka.fastio._compiled import FrameBuffer as CompiledFrameBuffer  # type: ignore[import-not-found]
except ImportError:  # not built: the pure twin alone
    CompiledFrameBuffer = None

# Every frame buffer test runs on both twins: this module's (pure) and the compiled one.
PyFrameBuffer = FrameBuffer
FRAME_BUFFERS = [pytest.param(PyFrameBuffer, id="pure"),
                 pytest.param(CompiledFrameBuffer, id="compiled",
                              marks=pytest.mark.skipif(CompiledFrameBuffer is None, reason="compiled extension not built"))]

VARINT_VECTORS = [
    (0, "00"),
    (1, "01"),
    (127, "7f"),
    (128, "8001"),
    (300, "ac02"),
    (16383, "ff7f"),
    (16384, "808001"),
    (2**28 - 1, "ffffff7f"),
    (2**28, "8080808001"),
    (MAX_VARINT, "ffffffff0f"),
]


@pytest.mark.parametrize(("value", "hexed"), VARINT_VECTORS)
def test_varint_vectors(value: int, hexed: str) -> None:
    raw = bytes.fromhex(hexed)
    assert encode_varint(value) == raw
    assert decode_varint(raw) == (value, len(raw))
    # at an offset, followed by other bytes
    assert decode_varint(b"\xaa" + raw + b"\x99", 1) == (value, 1 + len(raw))


@given(st.integers(0, MAX_VARINT), st.binary(max_size=4))
def test_varint_roundtrip(value: int, prefix: bytes) -> None:
    raw = encode_varint(value)
    assert 1 <= len(raw) <= 5
    assert decode_varint(prefix + raw, len(prefix)) == (value, len(prefix) + len(raw))


@pytest.mark.parametrize("value", [-1, MAX_VARINT + 1, 2**40])
def test_varint_encode_out_of_range(value: int) -> None:
    with pytest.raises(ProtocolError):
        encode_varint(value)


@pytest.mark.parametrize(
    "hexed",
    [
        "",  # nothing
        "80",  # cut
        "ffffffff",  # cut after 4 continuation bytes
        "8080808080",  # 5 continuation bytes: over-long
        "808080808000",  # 6 bytes
        "ffffffff1f",  # 33 bits
        "ffffffff7f",  # 35 bits
    ],
)
def test_varint_malformed(hexed: str) -> None:
    with pytest.raises(ProtocolError):
        decode_varint(bytes.fromhex(hexed))


def test_varint_end_bound() -> None:
    raw = encode_varint(300)
    with pytest.raises(ProtocolError):
        decode_varint(raw, 0, 1)


def test_varint_is_truncated() -> None:
    assert varint_is_truncated(b"\x80", 0, 1)
    assert varint_is_truncated(b"\x80\x80\x80\x80", 0, 4)
    assert not varint_is_truncated(b"\x80\x80\x80\x80\x80", 0, 5)  # over-long, not cut
    assert not varint_is_truncated(b"\x05", 0, 1)
    assert not varint_is_truncated(b"\x80\x01", 0, 2)
    assert varint_is_truncated(b"\x01\x80", 1, 2)


@given(st.binary(max_size=12), st.integers(0, 12))
def test_decode_varint_random_bytes(data: bytes, pos: int) -> None:
    try:
        value, end = decode_varint(data, pos)
    except ProtocolError:
        return
    assert 0 <= value <= MAX_VARINT
    assert pos < end <= min(len(data), pos + 5)


def test_str8() -> None:
    assert encode_str8("events") == b"\x06events"
    assert encode_str8(b"") == b"\x00"
    assert encode_str8("é") == b"\x02\xc3\xa9"
    assert len(encode_str8("x" * 255)) == 256
    with pytest.raises(ProtocolError):
        encode_str8("x" * 256)
    assert Reader(b"\x06events").str8() == "events"
    with pytest.raises(ProtocolError):
        Reader(b"\x06event").str8()
    with pytest.raises(ProtocolError):
        Reader(b"\x02\xff\xfe").str8()
    with pytest.raises(ProtocolError):
        decode_text(b"\xc3")


@given(st.text(max_size=80).filter(lambda s: len(s.encode()) <= 255))
def test_str8_roundtrip(text: str) -> None:
    r = Reader(encode_str8(text))
    assert r.str8() == text
    r.expect_end()


def test_reader_little_endian_and_bounds() -> None:
    data = bytes.fromhex("01 0200 03000000 0400000000000000 ff")
    r = Reader(data)
    assert (r.u8(), r.u16(), r.u32(), r.u64()) == (1, 2, 3, 4)
    assert r.remaining() == 1
    with pytest.raises(ProtocolError, match="trailing"):
        r.expect_end()
    assert r.peek_u16() is None
    assert r.rest() == b"\xff"
    r.expect_end()
    for method in (r.u8, r.u16, r.u32, r.u64, r.varint, r.str8):
        with pytest.raises(ProtocolError):
            method()
    with pytest.raises(ProtocolError):
        r.raw(1)
    # ``end`` bounds the reader even inside a longer buffer
    r = Reader(b"\x01\x02\x03\x04", 0, 2)
    assert r.u16() == 0x0201
    with pytest.raises(ProtocolError):
        r.u8()


@given(st.binary(max_size=40))
def test_reader_random_bytes(data: bytes) -> None:
    r = Reader(data)
    ops = [r.u8, r.u16, r.varint, r.str8, r.u32, r.u64]
    try:
        for i in range(20):
            ops[i % len(ops)]()
    except ProtocolError:
        pass


def test_frame_header() -> None:
    assert frame_header(3, 0) == bytes.fromhex("03 00000000")
    assert encode_frame(1, b"\x01\x00\x00\x00\x00") == bytes.fromhex("01 05000000 0100000000")
    assert parse_frame_header(bytes.fromhex("02 38000000")) == (2, 0x38)
    with pytest.raises(ProtocolError):
        parse_frame_header(b"\x02\x38\x00")
    with pytest.raises(ProtocolError):
        parse_frame_header(frame_header(1, MAX_FRAME_SIZE + 1))
    with pytest.raises(ProtocolError):
        frame_header(256, 0)


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_frame_buffer_byte_by_byte(FB: type[PyFrameBuffer]) -> None:
    stream = encode_frame(3, b"") + encode_frame(1, b"abc") + encode_frame(2, b"x" * 300)
    fb = FB()
    got = []
    for i in range(len(stream)):
        fb.feed(stream[i : i + 1])
        got.extend(fb)
    assert got == [(3, b""), (1, b"abc"), (2, b"x" * 300)]
    assert fb.buffered == 0


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_frame_buffer_needed_and_many_frames(FB: type[PyFrameBuffer]) -> None:
    fb = FB()
    assert fb.needed() == 5
    fb.feed(b"\x01\x03\x00")
    assert fb.needed() == 2
    fb.feed(b"\x00\x00ab")
    assert fb.needed() == 1
    assert fb.next_frame() is None
    fb.feed(b"c")
    assert fb.next_frame() == (1, b"abc")
    # enough frames in one feed to go through the buffer compaction path
    frames = [(7, bytes([i % 256]) * 1000) for i in range(200)]
    blob = b"".join(encode_frame(m, p) for m, p in frames)
    fb.feed(blob[:-10])
    got = list(fb)
    fb.feed(blob[-10:])
    got.extend(fb)
    assert got == frames


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_frame_buffer_oversized(FB: type[PyFrameBuffer]) -> None:
    fb = FB(max_frame_size=100)
    fb.feed(frame_header(1, 101))
    with pytest.raises(ProtocolError):
        fb.next_frame()


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
@given(st.lists(st.binary(max_size=30), max_size=8))
def test_frame_buffer_random_bytes(FB: type[PyFrameBuffer], pieces: list[bytes]) -> None:
    fb = FB(max_frame_size=64)
    try:
        for piece in pieces:
            fb.feed(piece)
            for msg_id, payload in fb:
                assert 0 <= msg_id <= 255 and len(payload) <= 64
    except ProtocolError:
        pass


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
@given(st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=50)), max_size=6), st.data())
def test_frame_buffer_roundtrip_any_split(FB: type[PyFrameBuffer], frames: list[tuple[int, bytes]], data) -> None:
    blob = b"".join(encode_frame(m, p) for m, p in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=5)))
    fb = FB()
    got = []
    prev = 0
    for cut in [*cuts, len(blob)]:
        fb.feed(blob[prev:cut])
        prev = cut
        got.extend(fb)
    assert got == frames


# ---------------------------------------------------------------- frames received in place


def _recv_like(fb: PyFrameBuffer, stream: bytes, pos: int, size: int, min_length: int, use_direct: bool) -> int:
    """What the gateway's read loop does with ``size`` bytes the socket has at ``pos``:
    into the frame's own buffer when :meth:`FrameBuffer.direct` offers it, else feed()."""
    target = fb.direct(min_length) if use_direct else None
    if target is not None:
        n = min(size, len(target))
        target[:n] = stream[pos : pos + n]
        fb.received(n)
        return n
    n = min(size, len(stream) - pos)
    fb.feed(stream[pos : pos + n])
    return n


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
@pytest.mark.parametrize("room", [0, 52])
def test_a_large_frame_is_received_in_place_and_handed_out_as_a_view(FB: type[PyFrameBuffer], room: int) -> None:
    big = bytes(range(256)) * 400  # 102,400 bytes
    stream = encode_frame(3, b"") + encode_frame(1, big) + encode_frame(2, b"after")
    fb = FB(room=room, alloc=lambda n: bytearray(b"\xee" * n))  # (not zeroed, as the gateway's)
    fb.feed(stream[:5 + 7])  # the Ping, the large frame's header and two bytes of it
    assert fb.direct(1 << 16) is not None  # a view of the rest of the large frame
    assert fb.pending_length() == len(big) and fb.buffered == 5 + 7
    view = fb.direct(1 << 16)
    assert view is not None and len(view) == 5 + len(big) - 7
    view[:1000] = stream[12:1012]
    fb.received(1000)
    assert fb.buffered == 1012 and fb.needed() == 0  # the Ping is complete, waiting
    assert fb.next_view() == (3, b"")
    assert fb.needed() == len(big) + 5 - 1007
    rest = fb.direct(1 << 16)
    assert rest is not None and len(rest) == len(big) + 5 - 1007
    rest[:] = stream[1012 : 10 + len(big)]
    fb.received(len(rest))
    assert fb.direct(1 << 16) is None  # nothing in flight
    fb.feed(stream[10 + len(big) :])
    msg_id, payload = fb.next_view()  # type: ignore[misc]
    assert msg_id == 1 and isinstance(payload, memoryview) and payload == big
    # ``room`` free bytes before the frame's header, in its own buffer (the gateway writes a
    # block header there); the frame's header and payload behind them.
    assert view_start(payload) == room + 5 and len(payload.obj) == room + 5 + len(big)  # type: ignore[arg-type]
    assert bytes(payload.obj)[room : room + 5] == stream[5:10]  # type: ignore[arg-type]
    assert fb.next_view() == (2, b"after") and fb.buffered == 0 and fb.next_view() is None


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_a_small_frame_or_one_already_here_is_not_received_in_place(FB: type[PyFrameBuffer]) -> None:
    fb = FB()
    fb.feed(encode_frame(1, b"x" * 100)[:50])
    assert fb.direct(64) is not None  # over min_length
    fb = FB()
    fb.feed(encode_frame(1, b"x" * 100)[:50])
    assert fb.direct(100) is None and fb.direct(1000) is None  # not over min_length
    fb.feed(encode_frame(1, b"x" * 100)[50:])
    assert fb.direct(10) is None  # complete already
    assert fb.next_frame() == (1, b"x" * 100)
    fb.feed(b"\x01\x00")
    assert fb.direct(0) is None  # no header yet


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_received_past_the_view_is_refused(FB: type[PyFrameBuffer]) -> None:
    fb = FB()
    with pytest.raises(ValueError):
        fb.received(1)  # nothing offered
    fb.feed(frame_header(1, 100))
    view = fb.direct(10)
    assert view is not None and len(view) == 100
    with pytest.raises(ValueError):
        fb.received(101)
    with pytest.raises(ValueError):
        fb.received(-1)
    fb.received(100)
    with pytest.raises(ValueError):
        fb.received(1)  # complete: nothing offered
    assert fb.next_frame() == (1, b"\0" * 100)


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_an_oversized_header_allocates_nothing_in_place(FB: type[PyFrameBuffer]) -> None:
    fb = FB(max_frame_size=1000)
    fb.feed(frame_header(1, 1001) + b"x")
    with pytest.raises(ProtocolError):
        fb.direct(10)
    with pytest.raises(ProtocolError):
        fb.pending_length()
    with pytest.raises(ProtocolError):
        fb.next_view()
    assert fb._big is None


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_feed_completes_a_frame_received_in_place(FB: type[PyFrameBuffer]) -> None:
    # A caller that mixes the two (feed while a frame is in place) still gets the stream in order.
    frames = [(1, b"a" * 300), (2, b"b"), (3, b"c" * 200)]
    stream = b"".join(encode_frame(m, p) for m, p in frames)
    fb = FB()
    fb.feed(stream[:20])
    assert fb.direct(100) is not None
    fb.feed(stream[20:])  # the rest of the first frame and the others, in one piece
    got = list(fb)
    assert got == frames and fb.buffered == 0


@given(
    st.lists(st.tuples(st.integers(0, 255), st.integers(0, 400)), max_size=8),
    st.lists(st.integers(1, 500), min_size=1, max_size=40),
    st.lists(st.booleans(), min_size=1, max_size=40),
    st.integers(0, 300),
    st.sampled_from([0, 1, 52]),
)
@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_frames_received_in_place_or_fed_come_out_in_order(
    FB: type[PyFrameBuffer], shapes: list[tuple[int, int]], sizes: list[int], direct: list[bool], min_length: int, room: int
) -> None:
    frames = [(m, bytes([i % 251]) * n) for i, (m, n) in enumerate(shapes)]
    stream = b"".join(encode_frame(m, p) for m, p in frames)
    fb = FB(max_frame_size=1000, room=room)
    got: list[tuple[int, bytes]] = []
    pos = step = 0
    while pos < len(stream):
        pos += _recv_like(fb, stream, pos, sizes[step % len(sizes)], min_length, direct[step % len(direct)])
        step += 1
        assert fb.buffered == pos - sum(5 + len(p) for _, p in got)
        if step % 3 == 0:  # take frames now and then, as the gateway does after its reads
            while (frame := fb.next_view()) is not None:
                got.append((frame[0], bytes(frame[1])))
    while (frame := fb.next_view()) is not None:
        got.append((frame[0], bytes(frame[1])))
    assert got == frames and fb.buffered == 0 and fb.needed() == 5


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_recv_reads_a_socket_as_the_gateway_does(FB: type[PyFrameBuffer]) -> None:
    # A real socket pair: a small frame and the start of a large one read at a frame's start
    # (``probe`` bytes asked), the rest of the large one received in place (its view) with
    # the start of the next frame behind it in the same call, -1 with nothing there, 0 at the
    # peer's close; an error of the socket raises as the socket's.
    big = bytes(range(256)) * 300
    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        fb = FB(max_frame_size=1 << 20, room=52)
        assert fb.recv(b, True, 1000, 16, 4096) == (-1, 16)  # nothing yet
        a.sendall(encode_frame(3, b"") + encode_frame(1, big) + encode_frame(2, b"x" * 100) + encode_frame(4, b"y"))
        assert fb.recv(b, True, 1000, 16, 4096) == (16, 16)
        assert fb.next_frame() == (3, b"") and fb.pending_length() == len(big)
        while rest := fb.needed():
            n, asked = fb.recv(b, True, 1000, 16, 4096)  # in place, and 16 bytes behind
            assert n > 0 and asked == rest + 16
        msg_id, payload = fb.next_view()  # type: ignore[misc]
        assert msg_id == 1 and type(payload) is memoryview and payload == big
        assert view_start(payload) == 52 + 5
        assert fb.buffered == 16  # the next frame's start, read behind the large one
        assert fb.recv(b, False, 1000, 16, 4096) == (89 + 6, 4096)  # a frame begun: much asked
        assert list(fb) == [(2, b"x" * 100), (4, b"y")]
        a.close()
        assert fb.recv(b, True, 1000, 16, 4096) == (0, 16)  # the peer closed
        b.close()
        with pytest.raises(OSError):
            fb.recv(b, True, 1000, 16, 4096)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
def test_recv_reads_only_a_plain_socket(FB: type[PyFrameBuffer]) -> None:
    # The compiled twin reads the descriptor: a socket subclass (a TLS socket is one) whose
    # recv does more than the descriptor's would be read wrong, so it is refused, in both.
    class Wrapped(socket.socket):
        pass

    a, b = socket.socketpair()
    w = Wrapped(fileno=b.detach())
    try:
        with pytest.raises(TypeError):
            FB().recv(w, True, 10, 16, 64)
    finally:
        a.close()
        w.close()


def test_the_compiled_frame_buffer_is_the_one_used_when_built() -> None:
    from dafka import fastio

    if CompiledFrameBuffer is None or not fastio.COMPILED:  # (not built, or DAFKA_NO_EXTENSIONS)
        assert fastio.FrameBuffer is FrameBuffer
    else:
        assert fastio.FrameBuffer is CompiledFrameBuffer
        assert CompiledFrameBuffer().max_frame_size == PyFrameBuffer().max_frame_size == MAX_FRAME_SIZE
