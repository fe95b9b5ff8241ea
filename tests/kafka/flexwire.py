"""Kafka's flexible-version wire format written and read by hand in the tests, from the
protocol guide (https://kafka.apache.org/protocol: unsigned varints, compact strings,
compact arrays and bytes with length + 1, tagged-field sections), independent of the
gateway's codec (kafka-python's generated classes), so a test checks the gateway's bytes
against the layout itself."""

from __future__ import annotations

import socket
import struct
from typing import Any

from tests.kafka.test_gateway import read_frame


def uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def cstr(s: str | None) -> bytes:
    """A compact (nullable) string."""
    if s is None:
        return b"\x00"
    raw = s.encode()
    return uvarint(len(raw) + 1) + raw


def cbytes(b: bytes | None) -> bytes:
    if b is None:
        return b"\x00"
    return uvarint(len(b) + 1) + b


def carray(items: list[bytes] | None) -> bytes:
    """A compact array of items already encoded."""
    if items is None:
        return b"\x00"
    return uvarint(len(items) + 1) + b"".join(items)


def tags(fields: dict[int, bytes] | None = None) -> bytes:
    """A tagged-field section (empty unless ``fields``)."""
    fields = fields or {}
    out = uvarint(len(fields))
    for tag in sorted(fields):
        out += uvarint(tag) + uvarint(len(fields[tag])) + fields[tag]
    return out


def i8(n: int) -> bytes:
    return struct.pack(">b", n)


def i16(n: int) -> bytes:
    return struct.pack(">h", n)


def i32(n: int) -> bytes:
    return struct.pack(">i", n)


def i64(n: int) -> bytes:
    return struct.pack(">q", n)


def flex_frame(api_key: int, version: int, corr: int, body: bytes, client_id: str = "test",
               header_tags: bytes = b"\x00") -> bytes:
    """A whole request frame with request header v2 (a nullable int16 string client id, then tags)."""
    raw = client_id.encode()
    payload = struct.pack(">hhih", api_key, version, corr, len(raw)) + raw + header_tags + body
    return struct.pack(">i", len(payload)) + payload


class Reader:
    """Reads a flexible response body field by field; raises AssertionError on any overrun."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def _take(self, n: int) -> bytes:
        assert n >= 0 and self.pos + n <= len(self.data), f"overrun at {self.pos} (+{n} of {len(self.data)})"
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def i8(self) -> int:
        return int(struct.unpack(">b", self._take(1))[0])

    def i16(self) -> int:
        return int(struct.unpack(">h", self._take(2))[0])

    def i32(self) -> int:
        return int(struct.unpack(">i", self._take(4))[0])

    def i64(self) -> int:
        return int(struct.unpack(">q", self._take(8))[0])

    def uvarint(self) -> int:
        v = shift = 0
        while True:
            b = self._take(1)[0]
            v |= (b & 0x7F) << shift
            if b < 0x80:
                return v
            shift += 7

    def cstr(self) -> str | None:
        n = self.uvarint()
        return None if n == 0 else self._take(n - 1).decode()

    def cbytes(self) -> bytes | None:
        n = self.uvarint()
        return None if n == 0 else self._take(n - 1)

    def uuid(self) -> bytes:
        return self._take(16)

    def array(self, item: Any) -> list[Any] | None:
        n = self.uvarint()
        return None if n == 0 else [item(self) for _ in range(n - 1)]

    def tags(self) -> dict[int, bytes]:
        out = {}
        for _ in range(self.uvarint()):
            tag = self.uvarint()
            out[tag] = self._take(self.uvarint())
        return out

    def end(self) -> None:
        assert self.pos == len(self.data), f"{len(self.data) - self.pos} bytes left over"


def call_flex(s: socket.socket, api_key: int, version: int, body: bytes, corr: int = 1) -> Reader:
    """Send one flexible request, read its answer: a Reader past the response header v1
    (correlation id and an empty tag section, checked)."""
    s.sendall(flex_frame(api_key, version, corr, body))
    answer = read_frame(s)
    r = Reader(answer)
    assert r.i32() == corr
    assert r.tags() == {}
    return r
