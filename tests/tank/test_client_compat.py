"""The gateway against what the real Tank clients send and how they read the answers.

No real client runs here (no network, no JVM, no TANK build).  Instead each
test sends, over a plain TCP socket, the request bytes exactly as the client
builds them, and parses the gateway's answer with the client's own parsing
steps, re-implemented below from reading its source:

* the Java client, ``phaistos-networks/TANK-JavaClient``
  (``gr/phaistosnetworks/tank/TankClient.java``, ``TankRequest.java``,
  ``TankMessage.java``, ``ByteManipulator.java``; the SocketChannel version);
* the C++ client behind tank-cli v4.0, ``phaistos-networks/TANK``
  (``client_api_produce.cpp``, ``client_api_consume.cpp``,
  ``client_api_discover_partitions.cpp``, ``client_api_create_topic.cpp``,
  ``client_api_srv_status.cpp``, ``client_api_discover_topics.cpp``,
  ``client_api.cpp`` process_msg, and ``cli.cpp``).

Requests are built here with ``struct`` only, not with ``dafka.tank``, so a
bug shared by our codec and our gateway cannot hide.  Where a client would
abort (the C++ client's ``IMPLEMENT_ME()``) or silently misread, the parsers
raise AssertionError.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import snappy

from dafka.config import NodeConfig
from dafka.tank.gateway import TANK_VERSION, Gateway
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
UINT64_MAX = (1 << 64) - 1
TS = 1_700_000_000_123
WAIT_FOREVER = 0xFFFFFFFF  # tank-cli's max_wait in the captured tail request
CLI_FETCH = 128 << 20  # tank-cli's default fetch size
RECV_TIMEOUT = 10.0


# ---------------------------------------------------------------- bytes


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def str8(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return bytes((len(b),)) + b


def frame(msg_id: int, payload: bytes) -> bytes:
    return struct.pack("<BI", msg_id, len(payload)) + payload


class Cursor:
    """Little-endian reads at an absolute position, as both clients do them."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos
        self.mark_pos = 0  # ByteManipulator.offsetMark

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise IndexError(f"{n} bytes wanted at {self.pos} of {len(self.data)}")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def u8(self) -> int:
        return self._take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self._take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def take(self, n: int) -> bytes:
        return self._take(n)

    def str8(self) -> bytes:
        return self._take(self.u8())

    def varint(self) -> int:
        value = shift = 0
        for _ in range(5):
            b = self.u8()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
        raise AssertionError("varint longer than 5 bytes")

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def mark(self) -> None:
        self.mark_pos = self.pos

    def marked(self) -> int:
        return self.pos - self.mark_pos


# ---------------------------------------------------------------- the Java client


JAVA_CLIENT_ID = b"JC01"  # TankClient's default clientId


def java_bundle(msgs: list[tuple[bytes, bytes, int]]) -> bytes:
    """TankRequest.Bundle.serialize() of ``(key, content, ts)`` messages.

    The count sits in the flags when <= 15 (else a varint follows the flags);
    each message is TankMessage.serialize(false): flags (1 = key), always a
    timestamp, str8 key, varint length, content; the message set is snappy
    compressed (codec 1) once it is over COMPRESS_MIN_SIZE (1024) bytes.
    """
    body = b"".join(
        bytes((1 if key else 0,)) + struct.pack("<Q", ts) + (str8(key) if key else b"")
        + varint(len(content)) + content
        for key, content, ts in msgs
    )
    flags = len(msgs) << 2 if len(msgs) <= 15 else 0
    if len(body) > 1024:
        body = snappy.compress(body)
        flags |= 1
    return bytes((flags,)) + (varint(len(msgs)) if len(msgs) > 15 else b"") + body


def java_publish(req_id: int, topic: str, partition: int, msgs: list[tuple[bytes, bytes, int]]) -> bytes:
    """TankClient.publish(): version 0, "JC01", acks 0, ack timeout 0, one topic/partition."""
    bundle = java_bundle(msgs)
    payload = (
        struct.pack("<HI", 0, req_id) + str8(JAVA_CLIENT_ID) + b"\x00" + struct.pack("<I", 0)
        + b"\x01" + str8(topic) + b"\x01" + struct.pack("<H", partition)
        + varint(len(bundle)) + bundle
    )
    return frame(0x01, payload)


def java_consume(
    req_id: int, topic: str, parts: list[tuple[int, int, int]], max_wait: int = 5000
) -> bytes:
    """TankClient.consume(): version 0, "JC01", maxWait (default 5 s), minBytes 0, no op flags.

    ``seq`` is a Java long: the tail (-1L) goes out as UINT64_MAX.
    """
    payload = (
        struct.pack("<HI", 0, req_id) + str8(JAVA_CLIENT_ID) + struct.pack("<QI", max_wait, 0)
        + b"\x01" + str8(topic) + bytes((len(parts),))
    )
    for pid, seq, fetch_size in parts:
        payload += struct.pack("<HQI", pid, seq & UINT64_MAX, fetch_size)
    return frame(0x02, payload)


def java_long(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass
class JavaResponse:
    """TankResponse: one partition's result."""

    topic: str
    partition: int
    error: int
    request_seq: int  # a Java long
    high_water_mark: int = -1
    first_avail: int = 0
    fetch_size: int = 0
    messages: list[tuple[int, int, bytes, bytes]] = field(default_factory=list)
    codecs: list[int] = field(default_factory=list)  # of the bundles read (test only)

    def next_seq(self) -> int:
        """getNextSeqNum(): after the last message, else the requested seq again."""
        return self.messages[-1][0] + 1 if self.messages else self.request_seq


class JavaClient:
    """The SocketChannel TankClient, byte for byte."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=RECV_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The constructor reads into a 4-byte buffer and exits unless that
        # read returns exactly 4 bytes starting with PING_REQ (3).  The fifth
        # byte of the greeting stays in the socket; poll() steps over it.
        got = self.sock.recv(4)
        assert len(got) == 4 and got[0] == 0x03, got
        self.req_id = 0  # clientReqId starts at 0

    def close(self) -> None:
        self.sock.close()

    def next_id(self) -> int:
        self.req_id += 1
        return self.req_id - 1

    def poll(self, request_type: int) -> Cursor:
        """poll(): 8 KiB reads; a first read under 5 bytes is dropped; bytes
        other than the response type are skipped; then u32 size, reading on
        until the payload is complete.  Returns a cursor past the size, over
        the whole buffer (Java keeps absolute offsets: see markOffset)."""
        buf = b""
        while True:
            data = self.sock.recv(8192)
            assert data, "the gateway closed the connection"
            if not buf and len(data) < 5:
                continue  # "receiving 1 byte with value 0 sometimes": skipped
            buf += data
            pos = 0
            while pos < len(buf) and buf[pos] != request_type:
                pos += 1
            if len(buf) - pos < 5:
                continue
            size = struct.unpack_from("<I", buf, pos + 1)[0]
            if len(buf) - pos - 5 < size:
                continue
            assert len(buf) - pos - 5 == size, "bytes after the answer (a synchronous client)"
            return Cursor(buf, pos + 5)

    def publish(self, topic: str, partition: int, msgs: list[tuple[bytes, bytes, int]]) -> int:
        self.sock.sendall(java_publish(self.next_id(), topic, partition, msgs))
        errors = java_publish_errors(self.poll(0x01), [(topic, partition)])
        return errors[0]

    def consume(self, topic: str, partition: int, seq: int, fetch_size: int, max_wait: int = 5000) -> list[JavaResponse]:
        self.sock.sendall(java_consume(self.next_id(), topic, [(partition, seq, fetch_size)], max_wait))
        return java_consume_response(self.poll(0x02), {(topic, partition): seq})


def java_publish_errors(c: Cursor, partitions: list[tuple[str, int]]) -> list[int]:
    """getPubResponse(): u32 request id, then an error byte per (topic, partition)
    in request order, except that after a 255 (no such topic) the rest of that
    topic's partitions carry no byte."""
    c.u32()
    errors = []
    no_topic = None
    error = 0
    for topic, _pid in partitions:
        if topic != no_topic:
            error = c.u8()
        if error == 255:
            no_topic = topic
        errors.append(error)
    assert c.remaining() == 0
    return errors


def java_consume_response(c: Cursor, requested: dict[tuple[str, int], int]) -> list[JavaResponse]:
    """processConsumeResponse() + processChunks() of the SocketChannel version."""
    responses: list[JavaResponse] = []
    chunks = []
    c.u32()  # header size: logged, not used
    c.u32()  # request id
    for _ in range(c.u8()):
        topic = c.str8().decode()
        total = c.u8()
        partition = c.u16()
        if partition == 0xFFFF:
            continue  # "Topic Not Found"
        for p in range(total):
            if p:
                partition = c.u16()
            flags = c.u8()
            if flags == 0xFF:
                continue  # "Unknown Partition"
            base = 0 if flags == 0xFE else c.u64()
            hwm = c.u64()
            length = c.u32()
            if flags == 0x01:
                first = c.u64()
                # getSequenceNum(topic, p): the partition's index stands for its id
                blank = JavaResponse(topic, partition, flags, java_long(requested[(topic, p)]))
                blank.high_water_mark = hwm
                blank.first_avail = first
                responses.append(blank)
                continue
            chunks.append((topic, partition, flags, base, hwm, length))

    incomplete = False
    for topic, partition, flags, base, hwm, length in chunks:
        requested_seq = java_long(requested[(topic, partition)])
        resp = JavaResponse(topic, partition, flags, requested_seq, hwm, base)
        if length == 0 or incomplete:
            responses.append(resp)
            continue
        first_num = base
        remaining = length
        while remaining > 0 and not incomplete:
            try:
                bundle_len = c.varint()
            except IndexError:
                incomplete = True
                break
            if bundle_len > resp.fetch_size:
                resp.fetch_size = bundle_len + 15
            if bundle_len > c.remaining():
                incomplete = True
            if bundle_len > remaining:
                incomplete = True
            else:
                remaining -= bundle_len
            remaining -= c.marked()
            c.mark()
            bflags = c.u8()
            count = (bflags >> 2) & 0xF
            codec = bflags & 0x3
            sparse = (bflags >> 6) & 0xF
            if count == 0:
                count = c.varint()
            last_num = 0
            if sparse == 1:
                first_num = c.u64()
                if count > 1:
                    last_num = c.varint() + 1 + first_num
            resp.codecs.append(codec)
            if codec == 1:
                if incomplete:
                    break
                msgs = Cursor(snappy.uncompress(c.take(bundle_len - c.marked())))
            else:
                assert codec == 0, f"codec {codec}: Java treats it as uncompressed and misreads"
                msgs = c
            remaining -= c.marked()
            ts = 0
            prev = cur = first_num
            for i in range(count):
                mflags = msgs.u8()
                if sparse == 1:
                    if i == 0:
                        pass
                    elif mflags & 0x4:
                        cur = prev + 1
                    elif i != count - 1:
                        cur = msgs.varint() + 1 + prev
                    else:
                        cur = last_num
                    prev = cur
                if not mflags & 0x2:
                    try:
                        ts = msgs.u64()
                    except IndexError:
                        incomplete = True
                        break
                key = msgs.str8() if mflags & 0x1 else b""
                try:
                    size = msgs.varint()
                except IndexError:
                    incomplete = True
                    break
                if size > msgs.remaining():
                    incomplete = True
                    break
                content = msgs.take(size)
                if cur >= requested_seq:  # "lower than we requested" is dropped
                    resp.messages.append((cur, ts, key, content))
                cur += 1
                first_num += 1
        responses.append(resp)
    return responses


# ---------------------------------------------------------------- the C++ client (tank-cli v4.0)


CPP_CLIENT_ID = b"c++"
CPP_RESPONSES = {0x01, 0x02, 0x06, 0x07, 0x08, 0x0A, 0x0B, 0x0C}  # process_msg()


def cpp_bundle(msgs: list[tuple[bytes, bytes, int]]) -> bytes:
    """TankClient::produce()'s bundle of ``(key, content, ts)`` messages.

    Snappy (codec 1) when over 512 messages or over 1024 bytes of key +
    content; the count in the flags when < 16, else a varint; a message that
    repeats the previous timestamp has flag 2 and no timestamp.
    """
    total = 0
    codec = 1 if len(msgs) > 512 else 0
    for key, content, _ts in msgs:
        total += len(key) + len(content)
        if total > 1024:
            codec = 1
    body = bytearray()
    for i, (key, content, ts) in enumerate(msgs):
        flags = 0x1 if key else 0
        if i and ts == msgs[i - 1][2]:
            body.append(flags | 0x2)
        else:
            body += struct.pack("<BQ", flags, ts)
        if key:
            body += str8(key)
        body += varint(len(content)) + content
    if codec:
        body = bytearray(snappy.compress(bytes(body)))
    if len(msgs) < 16:
        head = bytes((codec | len(msgs) << 2,))
    else:
        head = bytes((codec,)) + varint(len(msgs))
    return head + bytes(body)


def cpp_produce(req_id: int, topic: str, parts: list[tuple[int, list[tuple[bytes, bytes, int]]]]) -> bytes:
    """build_produce_broker_req_payload(): version 2, "c++", acks 0, ack timeout 0."""
    payload = (
        struct.pack("<HI", 2, req_id) + str8(CPP_CLIENT_ID) + b"\x00" + struct.pack("<I", 0)
        + b"\x01" + str8(topic) + bytes((len(parts),))
    )
    for pid, msgs in parts:
        bundle = cpp_bundle(msgs)
        payload += struct.pack("<H", pid) + varint(len(bundle)) + bundle
    return frame(0x01, payload)


def cpp_consume(req_id: int, wanted: list[tuple[str, int, int, int]], max_wait: int, min_size: int = 0) -> bytes:
    """build_consume_broker_req_payload(): version 2, client id "", max_wait u64,
    min_size u32, no op flags; partitions grouped by topic, in request order."""
    groups: list[tuple[str, list[tuple[int, int, int]]]] = []
    for topic, pid, seq, fetch_size in wanted:
        if not groups or groups[-1][0] != topic:
            groups.append((topic, []))
        groups[-1][1].append((pid, seq, fetch_size))
    payload = struct.pack("<HI", 2, req_id) + str8(b"") + struct.pack("<QI", max_wait, min_size)
    payload += bytes((len(groups),))
    for topic, parts in groups:
        payload += str8(topic) + bytes((len(parts),))
        for pid, seq, fetch_size in parts:
            payload += struct.pack("<HQI", pid, seq, fetch_size)
    return frame(0x02, payload)


def cpp_discover_partitions(req_id: int, topic: str) -> bytes:
    return frame(0x06, struct.pack("<I", req_id) + str8(topic))  # no ids: all partitions


def cpp_create_topic(req_id: int, topic: str, partitions: int, config: bytes = b"") -> bytes:
    return frame(0x07, struct.pack("<I", req_id) + str8(topic) + struct.pack("<H", partitions)
                 + varint(len(config)) + config)


def cpp_status(req_id: int) -> bytes:
    return frame(0x0A, struct.pack("<I", req_id))


def cpp_discover_topics(req_id: int) -> bytes:
    return frame(0x0B, struct.pack("<IB", req_id, 0))


class CppClient:
    """A TankClient connection: requests go out at once (no waiting for the
    greeting); a Ping is ignored; any other unknown msgId shuts the connection."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=RECV_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.ids = iter(range(1, 1 << 32))  # broker request ids start at 1

    def close(self) -> None:
        self.sock.close()

    def next_id(self) -> int:
        return next(self.ids)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames(self) -> Iterator[tuple[int, bytes]]:
        while True:
            while len(self.buf) >= 5:
                msg, size = struct.unpack_from("<BI", self.buf)
                if len(self.buf) < 5 + size:
                    break
                payload, self.buf = self.buf[5 : 5 + size], self.buf[5 + size :]
                if msg == 0x03:
                    continue  # Ping: "return true"
                assert msg in CPP_RESPONSES, f"msgId 0x{msg:02x}: the client shuts the connection"
                yield msg, payload
            data = self.sock.recv(1 << 16)
            assert data, "the gateway closed the connection"
            self.buf += data

    def answer(self, msg_id: int, req_id: int) -> bytes:
        """The next response; it must be the one for ``req_id``."""
        msg, payload = next(self.frames())
        assert msg == msg_id, (msg, payload[:32])
        assert struct.unpack_from("<I", payload, 4 if msg == 0x02 else 0)[0] == req_id
        return payload

    def produce(self, topic: str, parts: list[tuple[int, list[tuple[bytes, bytes, int]]]]) -> dict:
        req_id = self.next_id()
        self.send(cpp_produce(req_id, topic, parts))
        return cpp_produce_response(self.answer(0x01, req_id), [(topic, pid) for pid, _ in parts])

    def consume(self, wanted: list[tuple[str, int, int, int]], max_wait: int) -> CppConsumed:
        req_id = self.next_id()
        self.send(cpp_consume(req_id, wanted, max_wait))
        return cpp_consume_response(self.answer(0x02, req_id), wanted)


def cpp_produce_response(payload: bytes, requested: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """TankClient::process_produce(): outcome per requested (topic, partition)."""
    c = Cursor(payload)
    c.u32()
    out: dict[tuple[str, int], str] = {}
    i = 0
    codes = {0: "ok", 10: "invalid seqnum", 0xFE: "read only", 1: "unknown partition",
             0xFD: "no leader (retried until the request expires)", 0xFC: "other leader",
             2: "system", 4: "insufficient replicas"}
    while c.remaining():
        err = c.u8()
        if err in (0xFF, 0xFE):  # the whole topic
            topic = requested[i][0]
            while i < len(requested) and requested[i][0] == topic:
                out[requested[i]] = "unknown topic" if err == 0xFF else "read only"
                i += 1
            continue
        if err == 0xFC:
            c.u32(), c.u16()
        assert i < len(requested), "TANK_EXPECT(part_it != end): the client aborts"
        this_topic = requested[i][0]
        while True:
            assert err in codes, f"produce error {err}: IMPLEMENT_ME(), the client aborts"
            out[requested[i]] = codes[err]
            i += 1
            if i == len(requested) or requested[i][0] != this_topic:
                break
            err = c.u8()
            if err == 0xFC:
                c.u32(), c.u16()
    assert i == len(requested), "partitions without an answer"
    return out


@dataclass
class CppPartitionContent:
    """TankClient::partition_content: what consumed() yields for a partition."""

    topic: str
    partition: int
    msgs: list[tuple[int, int, bytes, bytes]]
    next_seq: int
    drained: bool
    codecs: list[int] = field(default_factory=list, compare=False)  # test only


@dataclass
class CppConsumed:
    parts: list[CppPartitionContent] = field(default_factory=list)
    faults: list[tuple] = field(default_factory=list)


def _varint_at(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """Compression::check_decode_varuint32 + decode_varuint32: None when cut short."""
    value = shift = 0
    for i in range(5):
        if pos + i >= end:
            return None
        b = data[pos + i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos + i + 1
        shift += 7
    raise AssertionError("varint longer than 5 bytes")


def cpp_consume_response(payload: bytes, wanted: list[tuple[str, int, int, int]]) -> CppConsumed:
    """TankClient::process_consume() (client_api_consume.cpp), step by step."""
    out = CppConsumed()
    end = len(payload)
    assert end >= 9, "unable to decode header"
    c = Cursor(payload)
    hdr_size = c.u32()
    bundles_chunk = c.pos + hdr_size  # right after the header, in header order
    c.u32()  # request id (matched by the caller)
    idx = 0  # the request partition context the next result belongs to
    for _ in range(c.u8()):
        topic = c.str8()
        cnt = c.u8()
        assert c.pos + 2 * cnt <= end, "not enough content for partitions: the response is dropped"
        if struct.unpack_from("<H", payload, c.pos)[0] == 0xFFFF:
            out.faults.append(("unknown topic", topic.decode()))
            while idx < len(wanted) and wanted[idx][0] == topic.decode():
                idx += 1
            c.pos += 2
            continue
        for _k in range(cnt):
            pid = c.u16()
            flags = c.u8()
            assert idx < len(wanted), "more partitions than requested"
            want_topic, want_pid, requested, _fetch = wanted[idx]
            idx += 1
            assert (topic.decode(), pid) == (want_topic, want_pid), "answered out of request order"
            if flags == 0xFB:
                out.faults.append(("system", want_topic, pid))
                continue
            if flags == 0xFF:
                out.faults.append(("unknown partition", want_topic, pid))
                continue
            if flags == 0xFD:
                out.faults.append(("no leader", want_topic, pid))
                continue
            if flags == 0xFC:
                c.u32(), c.u16()
                out.faults.append(("other leader", want_topic, pid))
                continue
            log_base = 0 if flags == 0xFE else c.u64()
            hwm = c.u64()
            chunk_len = c.u32()
            if flags == 0x01:
                first_avail = c.u64()
                out.faults.append(("boundary check", want_topic, pid, first_avail, hwm))
                continue
            assert not (flags and flags < 0xFE), f"flags 0x{flags:02x}: IMPLEMENT_ME(), abort"
            msgs = []
            codecs: list[int] = []
            drained = chunk_len == 0
            q = bundles_chunk
            bundles_chunk += chunk_len
            chunk_end = min(end, bundles_chunk)
            first_seq = last_seq = 0
            done = False
            while not done:
                got = _varint_at(payload, q, chunk_end)
                if got is None:
                    break
                bundle_len, q = got
                bundle_end = q + bundle_len
                if q >= chunk_end:
                    break
                bflags = payload[q]
                q += 1
                codec = bflags & 0x3
                sparse = bflags & 0x40
                size = (bflags >> 2) & 0xF
                if size == 0:
                    got = _varint_at(payload, q, chunk_end)
                    if got is None:
                        break
                    size, q = got
                if sparse:
                    if q + 8 >= chunk_end:
                        break
                    first_seq = struct.unpack_from("<Q", payload, q)[0]
                    q += 8
                    if size != 1:
                        got = _varint_at(payload, q, chunk_end)
                        if got is None:
                            break
                        last_seq = first_seq + got[0] + 1
                        q = got[1]
                    else:
                        last_seq = first_seq
                    log_base = first_seq
                    msgset_end = last_seq + 1
                else:
                    msgset_end = log_base + size
                if requested < UINT64_MAX and requested >= msgset_end:
                    q = bundle_end  # fast path: skip the bundle
                    log_base = msgset_end
                    continue
                codecs.append(codec)
                if codec:
                    if bundle_end > chunk_end:
                        break
                    assert codec == 1, f"codec {codec}: IMPLEMENT_ME(), abort"
                    try:
                        msgset = snappy.uncompress(payload[q:bundle_end])
                    except Exception as exc:  # "Failed to decompress", then IMPLEMENT_ME()
                        raise AssertionError("snappy: the client aborts") from exc
                else:
                    msgset = payload[q : min(chunk_end, bundle_end)]
                q = bundle_end
                ts = 0
                msg_idx = 0
                min_accepted = 0 if requested == UINT64_MAX else requested
                m = Cursor(msgset)
                while True:
                    if m.remaining() < 1:
                        break  # end of this bundle's message set
                    mflags = m.u8()
                    if sparse:
                        if mflags & 0x4:
                            pass
                        elif msg_idx == 0:
                            log_base = first_seq
                        elif msg_idx == size - 1:
                            log_base = last_seq
                        else:
                            got = _varint_at(msgset, m.pos, len(msgset))
                            if got is None:
                                done = True
                                break
                            log_base += got[0]
                            m.pos = got[1]
                    seq = log_base
                    if not mflags & 0x2:
                        if m.remaining() < 8:
                            done = True
                            break
                        ts = m.u64()
                    key = b""
                    if mflags & 0x1:
                        if m.remaining() < 1 or m.remaining() < 1 + msgset[m.pos]:
                            done = True
                            break
                        key = m.str8()
                    got = _varint_at(msgset, m.pos, len(msgset))
                    if got is None:
                        done = True
                        break
                    length, m.pos = got
                    if m.remaining() < length:
                        done = True
                        break
                    if seq > hwm:
                        done = True  # "Past HW mark": the rest is ignored
                        break
                    if seq >= min_accepted:
                        msgs.append((seq, ts, key, msgset[m.pos : m.pos + length]))
                    m.pos += length
                    msg_idx += 1
                    log_base += 1
            if msgs:
                last = msgs[-1][0]
                next_seq = last + 1 if requested == UINT64_MAX else max(requested, last + 1)
            else:
                next_seq = hwm + 1 if requested == UINT64_MAX else requested
            out.parts.append(CppPartitionContent(want_topic, pid, msgs, next_seq, drained, codecs))
    return out


def cpp_discover_partitions_response(payload: bytes, topic: str) -> list[tuple[int, int]] | None:
    """process_discover_partitions(): (first available, hwm) per partition; None = unknown topic."""
    c = Cursor(payload)
    c.u32()
    assert c.str8() == topic.encode(), "a different topic: IMPLEMENT_ME(), abort"
    cnt = c.u16()
    if cnt == 0:
        return None
    out = []
    for _ in range(cnt):
        first, hwm = c.u64(), c.u64()
        assert (first, hwm) != (UINT64_MAX, UINT64_MAX), "a per-partition fault"
        out.append((first, hwm))
    return out


def cpp_create_topic_response(payload: bytes, topic: str) -> int:
    """process_create_topic(): the error byte (0 created, 1 exists, ...)."""
    c = Cursor(payload)
    c.u32()
    assert c.str8() == topic.encode(), "Unexpected create_topic response: the client throws"
    return c.u8()


def cpp_status_response(payload: bytes) -> dict[str, Any]:
    """process_srv_status()."""
    c = Cursor(payload)
    c.u32()
    c.u8()  # global flags
    cluster_aware = c.u8()
    out: dict[str, Any] = {"topics": c.u32(), "partitions": c.u32(), "nodes": 1}
    if cluster_aware:
        c.u8()
        c.str8()
        out["nodes"] = c.u32()
    if c.remaining():
        out["open_partitions"] = c.u32()
        c.u32()  # time to open partitions
        out["startup_ts"] = c.u32()
        if c.remaining():
            out["version"] = c.u32()
    return out


def cpp_discover_topics_response(payload: bytes) -> list[tuple[str, bool, int]]:
    """process_discover_topics()."""
    c = Cursor(payload)
    c.u32()
    n = c.u32()
    cluster_aware = c.u8()
    out = []
    for _ in range(n):
        name = c.str8().decode()
        enabled = bool(c.u8())
        partitions = c.u16()
        if cluster_aware:
            c.u8()
        out.append((name, enabled, partitions))
    return out


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def gw(cfg: NodeConfig, tmp_path: Path) -> Iterator[Gateway]:
    gateway = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0))
    try:
        yield gateway
    finally:
        gateway.close()


@pytest.fixture
def cli(gw: Gateway) -> Iterator[CppClient]:
    c = CppClient(gw.tank_port)
    try:
        yield c
    finally:
        c.close()


def create_topic(cli: CppClient, topic: str, partitions: int, config: bytes = b"") -> int:
    req_id = cli.next_id()
    cli.send(cpp_create_topic(req_id, topic, partitions, config))
    return cpp_create_topic_response(cli.answer(0x07, req_id), topic)


def msg(content: bytes, key: bytes = b"", ts: int = TS) -> tuple[bytes, bytes, int]:
    return (key, content, ts)


# ---------------------------------------------------------------- the parsers against the capture


def test_the_mimics_reproduce_the_captured_traffic() -> None:
    """Our request builders and parsers checked against tank_current.md's captures."""
    captured_produce = (
        bytes.fromhex("01 32000000 0200 01000000") + b"\x03c++" + bytes.fromhex("00 00000000 01")
        + b"\x06events" + bytes.fromhex("01 0000 17 08 00") + struct.pack("<Q", TS)
        + b"\x05hello" + b"\x02\x05world"
    )
    assert cpp_produce(1, "events", [(0, [msg(b"hello"), msg(b"world")])]) == captured_produce
    assert cpp_produce_response(bytes.fromhex("01000000 00"), [("events", 0)]) == {
        ("events", 0): "ok"
    }

    header = (
        struct.pack("<IB", 1, 1) + b"\x06events" + b"\x01" + struct.pack("<HBQQI", 0, 0, 109, 109, 0x10)
    )
    answer = struct.pack("<I", len(header)) + header + b"\x0f\x04\x00" + struct.pack("<Q", TS) + b"\x04late"
    assert len(header) == 0x24 and len(answer) == 0x38
    got = cpp_consume_response(answer, [("events", 0, UINT64_MAX, CLI_FETCH)])
    assert got.faults == []
    assert got.parts == [CppPartitionContent("events", 0, [(109, TS, b"", b"late")], 110, False)]
    java = java_consume_response(Cursor(answer), {("events", 0): UINT64_MAX})
    assert [r.messages for r in java] == [[(109, TS, b"", b"late")]]
    assert java[0].next_seq() == 110


# ---------------------------------------------------------------- the Java client


def test_java_publish_consume_from_zero_and_consume_next(gw: Gateway, cli: CppClient) -> None:
    assert create_topic(cli, "jtopic", 1) == 0
    java = JavaClient(gw.tank_port)
    other = JavaClient(gw.tank_port)
    try:
        first = [msg(b"one", b"k1", TS), msg(b"two", b"", TS + 1), msg(b"three", b"k3", TS + 2)]
        assert java.publish("jtopic", 0, first) == 0  # error byte 0
        # Over 15 messages (varint count) and over 1024 bytes (snappy), keys on some.
        big = [msg(b"m%03d-" % i + bytes(60), b"key%d" % i if i % 3 == 0 else b"", TS + 10 + i)
               for i in range(20)]
        assert java.publish("jtopic", 0, big) == 0
        expected = [(i + 1, ts, key, content) for i, (key, content, ts) in enumerate(first + big)]

        # Tool.java's loop: from 0, fetch size 1000, on with getNextSeqNum().
        got: list[tuple[int, int, bytes, bytes]] = []
        seq, fetch_size = 0, 1000
        while len(got) < len(expected):
            (resp,) = java.consume("jtopic", 0, seq, fetch_size)
            assert resp.error == 0 and resp.high_water_mark == len(expected)
            assert resp.messages, "no progress"
            got += resp.messages
            fetch_size = max(fetch_size, resp.fetch_size)
            seq = resp.next_seq()
        assert got == expected
        assert seq == len(expected) + 1

        # Consume next at hwm + 1: a long poll; nothing arrives within maxWait.
        (resp,) = java.consume("jtopic", 0, seq, fetch_size, max_wait=100)
        assert (resp.error, resp.messages, resp.high_water_mark) == (0, [], len(expected))
        assert resp.next_seq() == seq  # asks again from the same place

        # ... and it wakes up when another client publishes.
        java.sock.sendall(java_consume(java.next_id(), "jtopic", [(0, seq, fetch_size)]))
        wait_until(lambda: gw._parked_all)
        assert other.publish("jtopic", 0, [msg(b"late", b"lk", TS + 99)]) == 0
        (resp,) = java_consume_response(java.poll(0x02), {("jtopic", 0): seq})
        assert resp.messages == [(seq, TS + 99, b"lk", b"late")]

        # Tool.java -tail: -1L (UINT64_MAX), every message of the answer kept.
        java.sock.sendall(java_consume(java.next_id(), "jtopic", [(0, UINT64_MAX, fetch_size)]))
        wait_until(lambda: gw._parked_all)
        assert other.publish("jtopic", 0, [msg(b"tail")]) == 0
        (resp,) = java_consume_response(java.poll(0x02), {("jtopic", 0): UINT64_MAX})
        assert resp.messages == [(seq + 1, TS, b"", b"tail")]
        assert resp.next_seq() == seq + 2

        # Out of bounds (README "Consume Next"): past the hwm, move to the hwm.
        (resp,) = java.consume("jtopic", 0, seq + 50, fetch_size)
        assert resp.error == 1 and resp.messages == []
        assert (resp.first_avail, resp.high_water_mark) == (1, seq + 1)
        (resp,) = java.consume("jtopic", 0, resp.high_water_mark, fetch_size)
        assert [m[3] for m in resp.messages] == [b"tail"]

        # An unknown topic is skipped ("Topic Not Found"), an unknown partition too.
        assert java.consume("nope", 0, 0, fetch_size) == []
        assert java.consume("jtopic", 3, 0, fetch_size) == []
        assert java.publish("nope", 0, [msg(b"x")]) == 255
        assert java.publish("jtopic", 3, [msg(b"x")]) == 1
    finally:
        java.close()
        other.close()


def test_java_reads_big_snappy_answers(gw: Gateway, cli: CppClient) -> None:
    """The gateway compresses large answers; Java inflates them with raw snappy."""
    assert create_topic(cli, "jbig", 1) == 0
    java = JavaClient(gw.tank_port)
    try:
        batch = [msg(b"payload %05d " % i + b"x" * 200, b"", TS + i) for i in range(100)]
        assert java.publish("jbig", 0, batch) == 0
        (resp,) = java.consume("jbig", 0, 0, 1 << 20)
        assert resp.codecs == [1]  # one bundle, snappy
        assert [(m[0], m[1], m[3]) for m in resp.messages] == [
            (i + 1, ts, content) for i, (_k, content, ts) in enumerate(batch)
        ]
    finally:
        java.close()


# ---------------------------------------------------------------- tank-cli (the C++ client)


def test_tank_cli_produce_and_consume_from_the_beginning(gw: Gateway, cli: CppClient) -> None:
    assert create_topic(cli, "events", 2, b"retention.segments.count=4\n") == 0
    # produce -s 2 hello world (the capture), then -K k=v pairs, then a file of
    # 40 lines with one timestamp (flag 2, varint count, snappy over 1 KiB).
    assert cli.produce("events", [(0, [msg(b"hello"), msg(b"world")])]) == {("events", 0): "ok"}
    assert cli.produce("events", [(0, [msg(b"v1", b"k1", TS + 1), msg(b"v2", b"k2", TS + 1)])]) == {
        ("events", 0): "ok"
    }
    lines = [msg(b"line %02d " % i + b"y" * 40, b"", TS + 2) for i in range(40)]
    assert cli.produce("events", [(0, lines)]) == {("events", 0): "ok"}
    expected = [(1, TS, b"", b"hello"), (2, TS, b"", b"world"), (3, TS + 1, b"k1", b"v1"),
                (4, TS + 1, b"k2", b"v2")]
    expected += [(5 + i, TS + 2, b"", content) for i, (_k, content, _t) in enumerate(lines)]

    # consume -d beginning: next = 0, max_wait 0 (drain and exit), fetch 128 MiB.
    got = []
    nxt = 0
    while True:
        res = cli.consume([("events", 0, nxt, CLI_FETCH)], max_wait=0)
        assert res.faults == []
        (part,) = res.parts
        if part.drained and not part.msgs:
            break
        got += part.msgs
        nxt = part.next_seq
    assert got == expected
    assert nxt == len(expected) + 1

    # From a seq in the middle, several partitions in one request (the other empty).
    res = cli.consume([("events", 0, 44, 1000), ("events", 1, 0, 1000)], max_wait=0)
    assert res.faults == []
    assert [m[0] for m in res.parts[0].msgs] == [44]
    assert res.parts[0].next_seq == 45
    assert res.parts[1] == CppPartitionContent("events", 1, [], 0, True)

    # A large answer comes back as one snappy bundle.
    big = [msg(b"z" * 200, b"key%d" % (i % 7), TS + 3) for i in range(100)]
    assert cli.produce("events", [(1, big)]) == {("events", 1): "ok"}
    res = cli.consume([("events", 1, 0, CLI_FETCH)], max_wait=0)
    (part,) = res.parts
    assert part.codecs == [1]
    assert part.msgs == [(i + 1, TS + 3, key, content) for i, (key, content, _t) in enumerate(big)]

    # discover_partitions
    req_id = cli.next_id()
    cli.send(cpp_discover_partitions(req_id, "events"))
    assert cpp_discover_partitions_response(cli.answer(0x06, req_id), "events") == [
        (1, len(expected)), (1, len(big))
    ]


def test_tank_cli_tail_follow_wakes_up(gw: Gateway, cli: CppClient) -> None:
    assert create_topic(cli, "follow", 1) == 0
    producer = CppClient(gw.tank_port)
    try:
        assert producer.produce("follow", [(0, [msg(b"old")])]) == {("follow", 0): "ok"}

        # consume end: UINT64_MAX, then -f style: next from the answer, again and again.
        nxt = UINT64_MAX
        for round_ in range(3):
            req_id = cli.next_id()
            cli.send(cpp_consume(req_id, [("follow", 0, nxt, CLI_FETCH)], WAIT_FOREVER))
            status_id = cli.next_id()
            cli.send(cpp_status(status_id))  # answered first: the consume is parked
            cpp_status_response(cli.answer(0x0A, status_id))
            content = [msg(b"new %d.%d" % (round_, i), b"", TS + round_) for i in range(round_ + 1)]
            assert producer.produce("follow", [(0, content)]) == {("follow", 0): "ok"}
            res = cpp_consume_response(cli.answer(0x02, req_id), [("follow", 0, nxt, CLI_FETCH)])
            assert res.faults == []
            (part,) = res.parts
            assert [m[3] for m in part.msgs] == [c for _k, c, _t in content]
            assert all(m[1] == TS + round_ for m in part.msgs)
            first = part.msgs[0][0]
            assert [m[0] for m in part.msgs] == list(range(first, first + len(content)))
            assert part.next_seq == part.msgs[-1][0] + 1
            nxt = part.next_seq
        assert nxt == 1 + 1 + 2 + 3 + 1

        # A timed-out tail answer: no messages, next = hwm + 1 for UINT64_MAX.
        res = cli.consume([("follow", 0, UINT64_MAX, CLI_FETCH)], max_wait=50)
        assert res.parts == [CppPartitionContent("follow", 0, [], nxt, True)]

        # The p2c benchmark: tail and produce pipelined on one connection.
        tail_id, produce_id = cli.next_id(), cli.next_id()
        cli.send(cpp_consume(tail_id, [("follow", 0, UINT64_MAX, 10_000)], 10_000))
        cli.send(cpp_produce(produce_id, "follow", [(0, [msg(b"bench")])]))
        answers = {}
        frames = cli.frames()
        while len(answers) < 2:
            msg_id, payload = next(frames)
            answers[msg_id] = payload
        assert cpp_produce_response(answers[0x01], [("follow", 0)]) == {("follow", 0): "ok"}
        res = cpp_consume_response(answers[0x02], [("follow", 0, UINT64_MAX, 10_000)])
        assert [(m[0], m[3]) for m in res.parts[0].msgs] == [(nxt, b"bench")]
    finally:
        producer.close()


def test_tank_cli_admin_commands(gw: Gateway, cli: CppClient) -> None:
    # create_topic -o k=v,k2=v2 3; again: "Already Exists"; a bad name.
    assert create_topic(cli, "admin", 3, b"retention.segments.count=8\nretention.size=1G\n") == 0
    assert create_topic(cli, "admin", 3) == 1
    assert create_topic(cli, "__reserved", 1) == 10

    req_id = cli.next_id()
    cli.send(cpp_discover_partitions(req_id, "admin"))
    assert cpp_discover_partitions_response(cli.answer(0x06, req_id), "admin") == [(0, 0)] * 3
    req_id = cli.next_id()
    cli.send(cpp_discover_partitions(req_id, "missing"))
    assert cpp_discover_partitions_response(cli.answer(0x06, req_id), "missing") is None

    req_id = cli.next_id()
    cli.send(cpp_status(req_id))
    status = cpp_status_response(cli.answer(0x0A, req_id))
    assert status["version"] == TANK_VERSION == 400
    assert status["nodes"] == 1 and status["topics"] >= 1 and status["partitions"] >= 3

    req_id = cli.next_id()
    cli.send(cpp_discover_topics(req_id))
    assert ("admin", True, 3) in cpp_discover_topics_response(cli.answer(0x0B, req_id))

    # Produce to unknown places: topic-level 0xff, partition-level 1.
    assert cli.produce("missing", [(0, [msg(b"x")]), (1, [msg(b"y")])]) == {
        ("missing", 0): "unknown topic", ("missing", 1): "unknown topic"
    }
    assert cli.produce("admin", [(0, [msg(b"a")]), (9, [msg(b"b")]), (2, [msg(b"c")])]) == {
        ("admin", 0): "ok", ("admin", 9): "unknown partition", ("admin", 2): "ok"
    }


def test_a_fault_beside_a_tail_partition_is_answered_at_once(gw: Gateway, cli: CppClient) -> None:
    """The broker answers at once when any partition has a fault (respond_now),
    even if another partition of the request is at its tail; a client asking
    several partitions must not wait for max_wait to learn of the fault."""
    assert create_topic(cli, "mixed", 2) == 0
    assert cli.produce("mixed", [(0, [msg(b"a"), msg(b"b")])]) == {("mixed", 0): "ok"}

    # An unknown partition beside a tail (tank-cli's WAIT_FOREVER).
    wanted = [("mixed", 0, UINT64_MAX, CLI_FETCH), ("mixed", 5, 0, CLI_FETCH)]
    res = cli.consume(wanted, max_wait=WAIT_FOREVER)
    assert res.faults == [("unknown partition", "mixed", 5)]
    assert res.parts == [CppPartitionContent("mixed", 0, [], 3, True)]

    # A boundary check (past the empty partition 1) beside hwm + 1.
    wanted = [("mixed", 0, 3, CLI_FETCH), ("mixed", 1, 99, CLI_FETCH)]
    res = cli.consume(wanted, max_wait=WAIT_FOREVER)
    assert res.faults == [("boundary check", "mixed", 1, 1, 0)]
    assert res.parts == [CppPartitionContent("mixed", 0, [], 3, True)]

    # An unknown topic beside a tail.
    wanted = [("mixed", 0, UINT64_MAX, CLI_FETCH), ("gone", 0, 0, CLI_FETCH)]
    res = cli.consume(wanted, max_wait=WAIT_FOREVER)
    assert res.faults == [("unknown topic", "gone")]
    assert res.parts == [CppPartitionContent("mixed", 0, [], 3, True)]
    assert not gw._parked_all


def test_stored_bundles_served_whole_several_to_a_chunk(gw: Gateway, cli: CppClient) -> None:
    """Bundles are stored as produced and sent back whole, several in one chunk, from the one
    holding the requested seq: both clients skip the messages before it themselves."""
    assert create_topic(cli, "whole", 1) == 0
    bundles = [
        [msg(b"a1", b"k", TS), msg(b"a2", b"", TS)],
        [msg(b"b%02d " % i + b"y" * 60, b"", TS + 1) for i in range(30)],  # over 1 KiB: snappy
        [msg(b"c1", b"kc", TS + 2)],
    ]
    for b in bundles:
        assert cli.produce("whole", [(0, b)]) == {("whole", 0): "ok"}
    flat = [(i + 1, ts, key, content) for i, (key, content, ts) in enumerate(x for b in bundles for x in b)]
    # The raw answer: one chunk of three bundles, beginning at seq 1 though seq 10 was asked.
    req_id = cli.next_id()
    cli.send(cpp_consume(req_id, [("whole", 0, 10, CLI_FETCH)], max_wait=0))
    answer = cli.answer(0x02, req_id)
    java = java_consume_response(Cursor(answer), {("whole", 0): 10})
    # The Java client stops its walk of a chunk after a snappy bundle (its byte count of the
    # chunk goes wrong there) and asks again from the seq after the last message it read:
    # nothing lost, nothing misread.
    assert java[0].codecs == [1] and java[0].messages == flat[9:32] and java[0].next_seq() == 33
    # Tool.java's loop from 0 reads every message once, in order.
    client = JavaClient(gw.tank_port)
    try:
        got: list[Any] = []
        seq = 0
        for _ in range(10):
            (resp,) = client.consume("whole", 0, seq, 1 << 20)
            got += resp.messages
            seq = resp.next_seq()
            if len(got) >= len(flat):
                break
        assert got == flat
    finally:
        client.close()
    res = cli.consume([("whole", 0, 10, CLI_FETCH)], max_wait=0)
    (part,) = res.parts
    assert part.msgs == flat[9:] and part.next_seq == len(flat) + 1
    # From the last bundle's seq: only that bundle.
    res = cli.consume([("whole", 0, len(flat), CLI_FETCH)], max_wait=0)
    assert res.parts[0].msgs == flat[-1:]
