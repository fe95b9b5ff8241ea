"""Tank wire primitives: integers, varints, ``str8`` and frames.

Everything here is sans-IO: functions take and return bytes, and
:class:`FrameBuffer` turns a byte stream (fed in arbitrary pieces) into
``(msg_id, payload)`` frames.  Integers are little-endian.  Varints are
LEB128 (seven bits a byte, low bits first) of at most five bytes and at most
32 bits of value, the broker's ``varuint32``.

Decoders raise :class:`~dafka.errors.ProtocolError` for any malformed input;
encoders raise it for values the format cannot carry (a 300-byte ``str8``, a
negative varint, ...).
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from collections.abc import Callable, Iterator

from dafka.errors import ProtocolError

__all__ = [
    "FRAME_HEADER",
    "FRAME_HEADER_SIZE",
    "MAX_FRAME_SIZE",
    "MAX_VARINT",
    "MAX_VARINT_BYTES",
    "U8",
    "U16",
    "U32",
    "U64",
    "UINT64_MAX",
    "FrameBuffer",
    "Reader",
    "decode_text",
    "decode_varint",
    "encode_frame",
    "encode_str8",
    "encode_varint",
    "frame_header",
    "parse_frame_header",
    "varint_is_truncated",
]

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
#: ``msgId:u8, payload length:u32``
FRAME_HEADER = struct.Struct("<BI")
FRAME_HEADER_SIZE = FRAME_HEADER.size

#: The broker drops a connection that announces a larger frame.
MAX_FRAME_SIZE = 256 * 1024 * 1024
MAX_VARINT_BYTES = 5
MAX_VARINT = 0xFFFFFFFF
UINT64_MAX = 0xFFFFFFFFFFFFFFFF

# One-byte varints are by far the most common (message lengths under 128).
_VARINT1 = tuple(bytes((i,)) for i in range(128))


# ---------------------------------------------------------------- varints


def encode_varint(value: int) -> bytes:
    """LEB128 encoding of ``0 <= value <= 2**32 - 1`` (1 to 5 bytes)."""
    if 0 <= value < 0x80:
        return _VARINT1[value]
    if value < 0 or value > MAX_VARINT:
        raise ProtocolError(f"varint value {value} is outside 0..2**32-1")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf: bytes | memoryview, pos: int = 0, end: int | None = None) -> tuple[int, int]:
    """Decode the varint at ``buf[pos:end]``; return ``(value, position after it)``.

    Raises ProtocolError when it is truncated, longer than five bytes or
    larger than 32 bits.
    """
    if end is None:
        end = len(buf)
    result = 0
    shift = 0
    for _ in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise ProtocolError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if result > MAX_VARINT:
                raise ProtocolError("varint value exceeds 32 bits")
            return result, pos
        shift += 7
    raise ProtocolError("varint longer than 5 bytes")


def varint_is_truncated(buf: bytes, pos: int, end: int) -> bool:
    """True when ``buf[pos:end]`` is a proper prefix of a varint (cut short).

    Used to tell a chunk's partial last bundle (its length prefix itself may
    be cut) from a malformed one.
    """
    n = end - pos
    if n >= MAX_VARINT_BYTES:
        return False
    for i in range(pos, end):
        if buf[i] < 0x80:
            return False
    return True


# ---------------------------------------------------------------- strings


def encode_str8(value: str | bytes) -> bytes:
    """``str8``: a u8 length then the (UTF-8) bytes."""
    b = value.encode() if isinstance(value, str) else bytes(value)
    if len(b) > 255:
        raise ProtocolError(f"str8 value is {len(b)} bytes, more than 255")
    return bytes((len(b),)) + b


def decode_text(b: bytes) -> str:
    """UTF-8 text, or ProtocolError (never UnicodeDecodeError)."""
    try:
        return b.decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("string is not valid UTF-8") from exc


class Reader:
    """A bounds-checked little-endian cursor over ``buf[pos:end]``.

    Every read raises ProtocolError instead of reading past ``end``; it is the
    tool for the (cold) request and response layouts.  The bundle hot path
    does its own, cheaper, checks.
    """

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: bytes | memoryview, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def _take(self, n: int, what: str) -> int:
        pos = self.pos
        if pos + n > self.end:
            raise ProtocolError(f"truncated {what}")
        self.pos = pos + n
        return pos

    def u8(self, what: str = "u8") -> int:
        return self.buf[self._take(1, what)]

    def u16(self, what: str = "u16") -> int:
        return U16.unpack_from(self.buf, self._take(2, what))[0]

    def u32(self, what: str = "u32") -> int:
        return U32.unpack_from(self.buf, self._take(4, what))[0]

    def u64(self, what: str = "u64") -> int:
        return U64.unpack_from(self.buf, self._take(8, what))[0]

    def peek_u16(self) -> int | None:
        """The next u16 without consuming it, or None if fewer than 2 bytes are left."""
        if self.pos + 2 > self.end:
            return None
        return U16.unpack_from(self.buf, self.pos)[0]

    def varint(self, what: str = "varint") -> int:
        try:
            value, self.pos = decode_varint(self.buf, self.pos, self.end)
        except ProtocolError as exc:
            raise ProtocolError(f"{what}: {exc}") from None
        return value

    def raw(self, n: int, what: str = "bytes") -> bytes:
        pos = self._take(n, what)
        return bytes(self.buf[pos : pos + n])

    def view(self, n: int, what: str = "bytes") -> bytes | memoryview:
        """``n`` bytes as :meth:`raw`, but a slice of the buffer itself when it is a
        memoryview (a payload received in place): no copy."""
        pos = self._take(n, what)
        return self.buf[pos : pos + n]

    def str8(self, what: str = "str8") -> str:
        n = self.u8(what)
        return decode_text(self.raw(n, what))

    def remaining(self) -> int:
        return self.end - self.pos

    def rest(self) -> bytes:
        """All bytes left."""
        return self.raw(self.end - self.pos)

    def expect_end(self, what: str = "payload") -> None:
        if self.pos != self.end:
            raise ProtocolError(f"{self.end - self.pos} trailing bytes after {what}")


# ---------------------------------------------------------------- frames


def frame_header(msg_id: int, length: int) -> bytes:
    """The 5-byte ``msgId:u8, length:u32`` frame header."""
    try:
        return FRAME_HEADER.pack(msg_id, length)
    except struct.error as exc:
        raise ProtocolError(f"bad frame header values ({msg_id}, {length})") from exc


def encode_frame(msg_id: int, payload: bytes) -> bytes:
    """One complete frame: header plus payload."""
    return frame_header(msg_id, len(payload)) + payload


def parse_frame_header(
    data: bytes, pos: int = 0, max_frame_size: int = MAX_FRAME_SIZE
) -> tuple[int, int]:
    """``(msg_id, payload length)`` of the header at ``data[pos:pos+5]``."""
    if len(data) - pos < FRAME_HEADER_SIZE:
        raise ProtocolError("truncated frame header")
    msg_id, length = FRAME_HEADER.unpack_from(data, pos)
    if length > max_frame_size:
        raise ProtocolError(f"frame of {length} bytes is over the {max_frame_size}-byte limit")
    return msg_id, length


class FrameBuffer:
    """Reassemble frames from a byte stream, sans-IO.  (The Tank gateway reads with its
    compiled twin, :data:`dafka.fastio.FrameBuffer`, when it is built: same methods, same
    results; tests/tank/test_codec.py runs both.)

    ``feed()`` whatever the socket gave, then call ``next_frame()`` until it
    returns None.  A frame announcing more than ``max_frame_size`` bytes
    raises ProtocolError (the stream cannot be resynchronised after that).

    A large frame can be received in place instead (the gateway does, for
    bundles): :meth:`direct` gives a writable view of the frame's own buffer,
    the caller receives into it (``recv_into``) and reports the bytes with
    :meth:`received`, and :meth:`next_view` hands the payload out as a view of
    that buffer, not copied (``feed`` and ``next_frame`` copy a payload once
    each way).  The frame's buffer is allocated whole, at its announced
    length, only when :meth:`direct` is called: the caller does so once it has
    accounted for that length (the gateway's ``max_buffered_bytes``), with
    ``alloc`` (the gateway's does not zero what is received into at once), and
    ``room`` free bytes before the frame: the gateway writes a block header
    there, in front of a bundle (:func:`dafka.store.block.tank_seal_in_place`),
    instead of copying the bundle behind a header.

    Complete frames are taken out of the byte buffer as they arrive, so that
    it only ever holds the frame being received (the partial one).
    """

    __slots__ = ("_alloc", "_buf", "_ready", "_ready_bytes", "_big", "_have", "_room", "max_frame_size")

    def __init__(self, max_frame_size: int = MAX_FRAME_SIZE, room: int = 0,
                 alloc: Callable[[int], bytearray] = bytearray) -> None:
        # The bytes of the frame being received, unless it is received in place (_big).
        self._buf = bytearray()
        # Complete frames not yet taken, in stream order; they precede what _big and
        # _buf hold.  _ready_bytes: their bytes, frame headers included.
        self._ready: deque[tuple[int, bytes | memoryview]] = deque()
        self._ready_bytes = 0
        # The frame received in place (header included, at its full length, after
        # _room free bytes) and how many of its bytes are here; _buf is empty while
        # it is incomplete.
        self._big: bytearray | None = None
        self._have = 0
        self._room = room
        self._alloc = alloc  # (the gateway's leaves the bytes unset: dafka.fastio.new_bytearray)
        self.max_frame_size = max_frame_size

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        big = self._big
        if big is not None:
            at = self._room + self._have
            take = min(len(data), len(big) - at)
            big[at : at + take] = data[:take]
            self._have += take
            if at + take < len(big):
                return
            self._big_done()
            if take == len(data):
                return
            data = memoryview(data)[take:]
        self._buf += data
        self._extract()

    def _big_done(self) -> None:
        big = self._big
        assert big is not None
        room = self._room
        self._ready.append((big[room], memoryview(big)[room + FRAME_HEADER_SIZE :]))
        self._ready_bytes += len(big) - room
        self._big = None
        self._have = 0

    def _extract(self) -> None:
        """Move the complete frames of ``_buf`` to ``_ready`` (each payload copied once).

        Stops at a header over the limit without raising: the error is raised by
        the calls that look at that frame (:meth:`pending_length`, :meth:`next_frame`...).
        """
        buf = self._buf
        size = len(buf)
        pos = 0
        ready = self._ready
        limit = self.max_frame_size
        while size - pos >= FRAME_HEADER_SIZE:
            msg_id, length = FRAME_HEADER.unpack_from(buf, pos)
            stop = pos + FRAME_HEADER_SIZE + length
            if length > limit or stop > size:
                break
            with memoryview(buf) as view:
                ready.append((msg_id, bytes(view[pos + FRAME_HEADER_SIZE : stop])))
            self._ready_bytes += stop - pos
            pos = stop
        if pos:
            del buf[:pos]  # what is left is one partial frame: a short move

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return self._ready_bytes + len(self._buf) + self._have

    def _partial(self) -> int:
        """The payload length the frame being received announces (-1: no header yet)."""
        big = self._big
        if big is not None:
            return len(big) - self._room - FRAME_HEADER_SIZE
        if len(self._buf) < FRAME_HEADER_SIZE:
            return -1
        return parse_frame_header(self._buf, 0, self.max_frame_size)[1]

    def needed(self) -> int:
        """How many more bytes complete the next frame (at least 1 when waiting)."""
        if self._ready:
            return 0
        if self._big is not None:
            return len(self._big) - self._room - self._have
        length = self._partial()
        if length < 0:
            return FRAME_HEADER_SIZE - len(self._buf)
        return max(0, FRAME_HEADER_SIZE + length - len(self._buf))

    def pending_length(self) -> int:
        """The announced payload length of the frame begun but not complete (0: none).

        Raises ProtocolError as soon as a header announces more than the limit,
        before any of its payload needs to be buffered.
        """
        length = self._partial()
        return length if length > 0 else 0

    def peek_msg_id(self) -> int | None:
        """The msgId of the next frame, as soon as its first byte is here."""
        if self._ready:
            return self._ready[0][0]
        if self._big is not None:
            return self._big[self._room]
        return self._buf[0] if self._buf else None

    def direct(self, min_length: int) -> memoryview | None:
        """A writable view of the rest of the frame being received, to receive into in
        place, when it announces over ``min_length`` payload bytes (None: ``feed``).

        The first call for a frame allocates its buffer at the announced length and
        moves the bytes already here into it; report what was written into the view
        with :meth:`received`.
        """
        big = self._big
        room = self._room
        if big is None:
            length = self._partial()
            if length <= min_length:
                return None  # small, or no header yet
            buf = self._buf
            big = self._big = self._alloc(room + FRAME_HEADER_SIZE + length)
            big[room : room + len(buf)] = buf
            self._have = len(buf)
            buf.clear()
        return memoryview(big)[room + self._have :]

    def received(self, n: int) -> None:
        """``n`` bytes were written at the front of the view :meth:`direct` gave."""
        big = self._big
        if big is None or not 0 <= n <= len(big) - self._room - self._have:
            raise ValueError(f"received({n}) without room for it from direct()")
        self._have += n
        if self._room + self._have == len(big):
            self._big_done()

    def next_view(self) -> tuple[int, bytes | memoryview] | None:
        """As :meth:`next_frame`; a frame received in place comes as a view of its own
        buffer (valid for as long as the caller keeps it: nothing reuses that buffer)."""
        if self._ready:
            frame = self._ready.popleft()
            self._ready_bytes -= FRAME_HEADER_SIZE + len(frame[1])
            return frame
        if self._big is None and len(self._buf) >= FRAME_HEADER_SIZE:
            parse_frame_header(self._buf, 0, self.max_frame_size)  # raises for an oversized header
        return None

    def next_frame(self) -> tuple[int, bytes] | None:
        """The next complete ``(msg_id, payload)``, or None if more bytes are needed."""
        got = self.next_view()
        if got is None:
            return None
        msg_id, payload = got
        return msg_id, payload if type(payload) is bytes else bytes(payload)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        """Yield every complete frame currently buffered."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def recv(self, sock: socket.socket, direct: bool, min_length: int, probe: int, size: int) -> tuple[int, int]:
        """One receive from the non-blocking ``sock``, as the Tank gateway reads.

        When ``direct`` and :meth:`direct` offers the frame's own buffer (a frame announcing
        over ``min_length`` bytes), into the rest of it, and up to ``probe`` bytes of what
        follows behind it in the same call (the next frame's start, fed); else fed: up to
        ``size`` bytes once a frame is begun, ``probe`` at a frame's start (a large frame's
        header, then the rest in place).

        ``(n, asked)``: n of the ``asked`` bytes came, 0 when the peer closed, -1 when there
        was nothing to take.  Raises OSError as the socket does, ProtocolError for a header
        over the limit, TypeError for anything but a plain socket (the compiled twin reads
        its descriptor: a TLS socket's bytes would come undeciphered), ValueError for one
        that is not non-blocking (a timeout or blocking: the descriptor's read does neither).
        """
        if type(sock) is not socket.socket:
            raise TypeError(f"FrameBuffer.recv reads a plain socket, not {type(sock).__name__}")
        if sock.gettimeout() != 0.0:  # (the compiled twin's readv would block, or not wait its timeout)
            raise ValueError("FrameBuffer.recv reads a non-blocking socket")
        target = self.direct(min_length) if direct else None
        try:
            if target is not None:
                after = bytearray(probe)
                want = len(target) + probe
                n = sock.recvmsg_into([target, after])[0]
                first = min(n, len(target))
                if first:
                    self.received(first)
                if n > first:
                    self.feed(memoryview(after)[: n - first])
                return n, want
            want = size if self.pending_length() else probe
            data = sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return -1, want
        finally:
            target = None  # (the view of the frame's buffer goes at once)
        if data:
            self.feed(data)
        return len(data), want
