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

import struct
from collections.abc import Iterator

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


def decode_varint(buf: bytes, pos: int = 0, end: int | None = None) -> tuple[int, int]:
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

    def __init__(self, buf: bytes, pos: int = 0, end: int | None = None) -> None:
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
    """Reassemble frames from a byte stream, sans-IO.

    ``feed()`` whatever the socket gave, then call ``next_frame()`` until it
    returns None.  A frame announcing more than ``max_frame_size`` bytes
    raises ProtocolError (the stream cannot be resynchronised after that).
    """

    __slots__ = ("_buf", "_pos", "max_frame_size")

    # Compact the buffer once this many consumed bytes sit at its front.
    _COMPACT_AT = 1 << 16

    def __init__(self, max_frame_size: int = MAX_FRAME_SIZE) -> None:
        self._buf = bytearray()
        self._pos = 0
        self.max_frame_size = max_frame_size

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf) - self._pos

    def needed(self) -> int:
        """How many more bytes complete the next frame (at least 1 when waiting)."""
        avail = len(self._buf) - self._pos
        if avail < FRAME_HEADER_SIZE:
            return FRAME_HEADER_SIZE - avail
        _, length = parse_frame_header(self._buf, self._pos, self.max_frame_size)
        return max(0, FRAME_HEADER_SIZE + length - avail)

    def pending_length(self) -> int:
        """The announced payload length of a frame begun but not complete (0: none).

        Raises ProtocolError as soon as a header announces more than the limit,
        before any of its payload needs to be buffered.
        """
        avail = len(self._buf) - self._pos
        if avail < FRAME_HEADER_SIZE:
            return 0
        _, length = parse_frame_header(self._buf, self._pos, self.max_frame_size)
        return length if FRAME_HEADER_SIZE + length > avail else 0

    def peek_msg_id(self) -> int | None:
        """The msgId of the next frame, as soon as its first byte is here."""
        return self._buf[self._pos] if len(self._buf) > self._pos else None

    def next_frame(self) -> tuple[int, bytes] | None:
        """The next complete ``(msg_id, payload)``, or None if more bytes are needed."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < FRAME_HEADER_SIZE:
            return None
        msg_id, length = parse_frame_header(buf, pos, self.max_frame_size)
        start = pos + FRAME_HEADER_SIZE
        stop = start + length
        if stop > len(buf):
            return None
        payload = bytes(buf[start:stop])
        if stop == len(buf):
            buf.clear()
            self._pos = 0
        elif stop >= self._COMPACT_AT and stop * 2 >= len(buf):
            # Only once the consumed prefix is at least half the buffer, so
            # that the memmove stays amortised O(1) per byte.
            del buf[:stop]
            self._pos = 0
        else:
            self._pos = stop
        return msg_id, payload

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        """Yield every complete frame currently buffered."""
        while (frame := self.next_frame()) is not None:
            yield frame
