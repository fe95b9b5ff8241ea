"""TankClient against a fake broker on a real 127.0.0.1 socket."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest

from dafka.errors import ProtocolError
from dafka.tank.bundle import decode_bundle, encode_bundle, encode_chunk
from dafka.tank.client import (
    ConsumeResult,
    TankClient,
    TankConnectionError,
    TankError,
    TankTimeoutError,
    UnknownTopicError,
)
from dafka.tank.codec import FrameBuffer, frame_header
from dafka.tank.messages import (
    SEQ_TAIL,
    ConsumePartitionResult,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopicResult,
    CreateTopicRequest,
    CreateTopicResponse,
    DiscoverPartitionsRequest,
    DiscoverPartitionsResponse,
    DiscoverTopicsRequest,
    DiscoverTopicsResponse,
    DiscoverTopologyRequest,
    DiscoverTopologyResponse,
    PartitionBounds,
    Ping,
    ProducePartitionResult,
    ProduceRequest,
    ProduceResponse,
    ProduceTopicResult,
    ProduceWithSeqnumRequest,
    ReloadConfRequest,
    ReloadConfResponse,
    StatusRequest,
    StatusResponse,
    TopicInfo,
    decode_request,
)
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(30)

GREETING = bytes.fromhex("03 00000000")
U64 = struct.Struct("<Q")
TS = 1_700_000_000_000
DEADLINE = 10.0


class Conn:
    """The broker side of one accepted connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = FrameBuffer()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_frame(self) -> tuple[int, bytes] | None:
        """The next frame, or None when the client closed."""
        while (frame := self.frames.next_frame()) is None:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.frames.feed(data)
        return frame

    def recv_request(self):
        frame = self.recv_frame()
        assert frame is not None, "client closed instead of sending a request"
        return decode_request(*frame)


class FakeBroker:
    """A listening socket on an ephemeral port; ``handler(conn)`` scripts one connection."""

    def __init__(self, handler: Callable[[Conn], None], greet: bool = True) -> None:
        self.handler = handler
        self.greet = greet
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(DEADLINE)
        self.port = self.listener.getsockname()[1]
        self.errors: list[BaseException] = []
        self.release = threading.Event()  # lets a handler block until the test is done
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            sock, _ = self.listener.accept()
            sock.settimeout(DEADLINE)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with sock:
                conn = Conn(sock)
                if self.greet:
                    conn.send(GREETING)
                self.handler(conn)
        except BaseException as exc:  # reported by __exit__
            self.errors.append(exc)

    def __enter__(self) -> FakeBroker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(DEADLINE)
        self.listener.close()
        assert not self.thread.is_alive(), "fake broker did not finish"
        if self.errors and exc[0] is None:
            raise self.errors[0]


def serve(answer: Callable[[object], bytes | None]) -> Callable[[Conn], None]:
    """A handler answering every request with ``answer(request)`` until the client leaves."""

    def handler(conn: Conn) -> None:
        while (frame := conn.recv_frame()) is not None:
            out = answer(decode_request(*frame))
            if out:
                conn.send(out)

    return handler


def client(broker: FakeBroker, timeout: float = 5.0, **kw) -> TankClient:
    return TankClient("127.0.0.1", broker.port, timeout=timeout, **kw)


# ---------------------------------------------------------------- connect and greeting


def test_produce_against_captured_broker_bytes() -> None:
    seen = []

    def handler(conn: Conn) -> None:
        msg_id, payload = conn.recv_frame()
        seen.append((msg_id, payload))
        conn.send(bytes.fromhex("01 05000000 01000000 00"))  # captured broker ack
        assert conn.recv_frame() is None

    with FakeBroker(handler) as broker, client(broker, client_id="c++") as c:
        assert c.produce("events", 0, [b"hello", (None, b"world", None)]) == 0
    msg_id, payload = seen[0]
    req = decode_request(msg_id, payload)
    bundle = req.topics[0].partitions[0].bundle
    ts = decode_bundle(bundle)[0][1]
    # byte for byte the tank-cli capture, apart from the timestamp
    expected = (
        bytes.fromhex("0200 01000000") + b"\x03c++" + b"\x00" + bytes(4)
        + b"\x01\x06events\x01\x00\x00\x17"
        + b"\x08\x00" + U64.pack(ts) + b"\x05hello\x02\x05world"
    )  # fmt: skip
    assert (msg_id, payload) == (0x01, expected)
    assert abs(ts - time.time() * 1000) < 60_000


def test_greeting_split_and_late() -> None:
    def handler(conn: Conn) -> None:
        conn.send(GREETING[:2])
        conn.send(GREETING[2:])
        req = conn.recv_request()
        conn.send(StatusResponse(req.req_id, version=400).encode())
        assert conn.recv_frame() is None

    with FakeBroker(handler) as broker, client(broker) as c:
        assert c.status().version == 400


def test_no_greeting_times_out() -> None:
    broker = FakeBroker(lambda conn: conn.recv_frame(), greet=False)
    with broker:
        start = time.monotonic()
        with pytest.raises(TankTimeoutError, match="greeting"):
            client(broker, timeout=0.3)
        assert time.monotonic() - start < 5


def test_connection_refused() -> None:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(TankConnectionError, match="cannot connect"):
        TankClient("127.0.0.1", port, timeout=2)


def test_broker_closes_before_greeting() -> None:
    with FakeBroker(lambda conn: None, greet=False) as broker:
        with pytest.raises(TankConnectionError):
            client(broker)


# ---------------------------------------------------------------- framing


def test_partial_frames_are_reassembled() -> None:
    holder: list[TankClient] = []
    ready = threading.Event()

    def handler(conn: Conn) -> None:
        req = conn.recv_request()
        frame = StatusResponse(req.req_id, topics=3, version=400).encode()
        ready.wait(DEADLINE)
        c = holder[0]
        sent = 0
        for cut in (1, 4, 5, 9, len(frame)):
            conn.send(frame[sent:cut])
            sent = cut
            if cut < len(frame):
                # the client holds the piece and is still waiting for the rest
                wait_until(lambda n=cut: c._frames.buffered == n, DEADLINE, 0.001)
        assert conn.recv_frame() is None

    with FakeBroker(handler) as broker, client(broker) as c:
        holder.append(c)
        ready.set()
        status = c.status()
        assert (status.topics, status.version) == (3, 400)


def test_out_of_order_responses_and_pings() -> None:
    def handler(conn: Conn) -> None:
        consume = conn.recv_request()
        status = conn.recv_request()
        assert isinstance(consume, ConsumeRequest) and isinstance(status, StatusRequest)
        # the parked long-poll is answered after the later request, pings in between
        out = (
            Ping().encode()
            + StatusResponse(status.req_id, version=400).encode()
            + Ping().encode()
            + ConsumeResponse(
                consume.req_id,
                [ConsumeTopicResult("t", [ConsumePartitionResult(0, 0, 0, 0)])],
            ).encode()
        )
        conn.send(out[:7])
        conn.send(out[7:])
        assert conn.recv_frame() is None

    with FakeBroker(handler) as broker, client(broker) as c:
        r1 = c.send(ConsumeRequest(c.next_request_id(), []))
        r2 = c.send(StatusRequest(c.next_request_id()))
        assert (r1, r2) == (1, 2)
        first = c.wait(r1)
        assert isinstance(first, ConsumeResponse) and first.req_id == 1
        second = c.wait(r2)
        assert isinstance(second, StatusResponse) and second.req_id == 2


def test_unknown_response_id_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    def handler(conn: Conn) -> None:
        req = conn.recv_request()
        conn.send(StatusResponse(999).encode() + StatusResponse(req.req_id, version=1).encode())
        assert conn.recv_frame() is None

    with caplog.at_level(logging.WARNING, "dafka.tank.client"):
        with FakeBroker(handler) as broker, client(broker) as c:
            assert c.status().version == 1
    assert "unknown request id 999" in caplog.text


def test_timeout_abandons_request_and_drops_late_answer() -> None:
    timed_out = threading.Event()

    def handler(conn: Conn) -> None:
        first = conn.recv_request()
        timed_out.wait(DEADLINE)
        second = conn.recv_request()
        conn.send(StatusResponse(first.req_id, version=1).encode())  # too late
        conn.send(StatusResponse(second.req_id, version=2).encode())
        assert conn.recv_frame() is None

    with FakeBroker(handler) as broker, client(broker, timeout=0.3) as c:
        with pytest.raises(TankTimeoutError):
            c.status()
        timed_out.set()
        c.timeout = 5
        assert c.status().version == 2
        assert not c.closed


def test_connection_lost_mid_request() -> None:
    def handler(conn: Conn) -> None:
        conn.recv_request()
        conn.send(frame_header(0x0A, 30) + b"\x01\x00")  # half a response, then gone

    with FakeBroker(handler) as broker, client(broker) as c:
        with pytest.raises(TankConnectionError, match="closed by the broker"):
            c.status()
        assert c.closed
        with pytest.raises(TankConnectionError, match="closed"):
            c.status()


def test_oversized_frame_is_a_protocol_error() -> None:
    def handler(conn: Conn) -> None:
        conn.recv_request()
        conn.send(frame_header(0x0A, 300 * 1024 * 1024))
        conn.recv_frame()

    with FakeBroker(handler) as broker, client(broker) as c:
        with pytest.raises(ProtocolError):
            c.status()
        assert c.closed


# ---------------------------------------------------------------- produce


def produce_ack(codes: list[list[int]] | None = None, topic_error: int | None = None):
    def answer(req):
        assert isinstance(req, ProduceRequest)
        topics = []
        for i, t in enumerate(req.topics):
            if topic_error is not None:
                topics.append(ProduceTopicResult([], topic_error))
            else:
                row = codes[i] if codes else [0] * len(t.partitions)
                topics.append(ProduceTopicResult([ProducePartitionResult(c) for c in row]))
        return ProduceResponse(req.req_id, topics).encode()

    return answer


def test_produce_message_forms_and_keys() -> None:
    got = []

    def answer(req):
        got.append(req)
        return produce_ack()(req)

    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        c.produce("t", 3, [b"a", "b", (b"k", b"c", 42), ("k2", "d"), bytearray(b"e")])
        c.produce("t", 3, [b"x" * 2000])  # over 1 KiB: snappy
    recs = decode_bundle(got[0].topics[0].partitions[0].bundle)
    assert [(k, v) for _, _, k, v in recs] == [
        (None, b"a"),
        (None, b"b"),
        (b"k", b"c"),
        (b"k2", b"d"),
        (None, b"e"),
    ]
    assert recs[2][1] == 42
    assert got[0].topics[0].partitions[0].partition == 3
    big = got[1].topics[0].partitions[0].bundle
    assert big[0] & 3 == 1 and decode_bundle(big)[0][3] == b"x" * 2000


def test_produce_errors() -> None:
    with FakeBroker(serve(produce_ack(topic_error=0xFF))) as broker, client(broker) as c:
        with pytest.raises(UnknownTopicError) as err:
            c.produce("nope", 0, [b"v"])
        assert (err.value.code, err.value.topic, err.value.partition) == (0xFF, "nope", 0)
    with FakeBroker(serve(produce_ack([[10]]))) as broker, client(broker) as c:
        with pytest.raises(TankError, match="INVALID_SEQNUM") as err:
            c.produce("t", 0, [b"v"])
        assert err.value.code == 10


def test_produce_many() -> None:
    got = []

    def answer(req):
        got.append(req)
        return produce_ack([[0, 1], [0xFD]])(req)

    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        res = c.produce_many([("a", 0, [b"1"]), ("b", 5, [b"2"]), ("a", 1, [b"3"])], check=False)
        assert res == {("a", 0): 0, ("a", 1): 1, ("b", 5): 0xFD}
        with pytest.raises(TankError) as err:
            c.produce_many({("a", 0): [b"1"], ("a", 1): [b"3"], ("b", 5): [b"2"]})
        assert (err.value.code, err.value.topic, err.value.partition) == (1, "a", 1)
        with pytest.raises(ValueError):
            c.produce_many([("a", 0, [b"1"]), ("a", 0, [b"2"])])
    req = got[0]
    assert [(t.name, [p.partition for p in t.partitions]) for t in req.topics] == [
        ("a", [0, 1]),
        ("b", [5]),
    ]


def test_produce_with_seqnum() -> None:
    got = []

    def answer(req):
        got.append(req)
        return produce_ack()(req)

    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        assert c.produce_with_seqnum("t", 2, 1000, [b"a", b"b"]) == 0
    req = got[0]
    assert type(req) is ProduceWithSeqnumRequest
    assert req.topics[0].partitions[0].first_seq == 1000


# ---------------------------------------------------------------- consume

CAPTURED_CONSUME = (
    bytes.fromhex("02 38000000 24000000 01000000 01") + b"\x06events" + b"\x01\x00\x00\x00"
    + U64.pack(109) + U64.pack(109) + bytes.fromhex("10000000")
    + b"\x0f" + b"\x04\x00" + U64.pack(TS) + b"\x04late"
)  # fmt: skip


def test_consume_tail_wakeup_capture() -> None:
    def handler(conn: Conn) -> None:
        msg_id, payload = conn.recv_frame()
        # the request of the capture: ver 2, "", max_wait 0xffffffff, min_bytes 0,
        # seq UINT64_MAX, fetch size 128 MiB
        assert (msg_id, payload) == (
            0x02,
            bytes.fromhex("0200 01000000 00 ffffffff00000000 00000000 01")
            + b"\x06events\x01"
            + bytes.fromhex("0000 ffffffffffffffff 00000008"),
        )
        conn.send(CAPTURED_CONSUME)
        assert conn.recv_frame() is None

    with FakeBroker(handler) as broker, client(broker) as c:
        res = c.consume("events", 0, SEQ_TAIL, fetch_size=128 * 1024 * 1024, max_wait_ms=0xFFFFFFFF)
    assert res == ConsumeResult(
        "events", 0, [(109, TS, None, b"late")], next_seq=110, hwm=109, drained=False
    )


def consume_answer(**fields):
    def answer(req):
        p = req.topics[0].partitions[0]
        return ConsumeResponse(
            req.req_id,
            [
                ConsumeTopicResult(
                    req.topics[0].name, [ConsumePartitionResult(p.partition, **fields)]
                )
            ],
        ).encode()

    return answer


def plain(n: int, tag: bytes) -> bytes:
    return encode_bundle([(None, TS, None, tag)] * n)


def test_consume_drops_below_requested_and_reports_partial() -> None:
    b3 = plain(1, b"c" * 500)
    chunk = encode_chunk([plain(5, b"a"), plain(3, b"b"), b3])[: -len(b3) // 2]
    answer = consume_answer(base_seq=100, hwm=120, chunk=chunk)
    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        res = c.consume("t", 0, 103)
    assert [m[0] for m in res.messages] == [103, 104, 105, 106, 107]
    assert res.next_seq == 108 and res.hwm == 120
    assert res.partial_size == 2 + len(b3)


def test_consume_sparse_first_bundle() -> None:
    chunk = encode_chunk(
        [encode_bundle([(50, TS, None, b"x"), (52, TS, b"k", b"y")], sparse=True), plain(2, b"z")]
    )
    answer = consume_answer(flags=0xFE, hwm=60, chunk=chunk)
    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        res = c.consume("t", 0, 0)
    assert res.messages == [
        (50, TS, None, b"x"),
        (52, TS, b"k", b"y"),
        (53, TS, None, b"z"),
        (54, TS, None, b"z"),
    ]
    assert res.next_seq == 55 and res.flags == 0xFE


def test_consume_empty_boundary_and_errors() -> None:
    with FakeBroker(serve(consume_answer(base_seq=0, hwm=9))) as broker, client(broker) as c:
        res = c.consume("t", 0, 10, max_wait_ms=5)
        assert (res.messages, res.next_seq, res.drained, res.hwm) == ([], 10, True, 9)
    answer = consume_answer(flags=1, base_seq=0, hwm=9, first_avail=4)
    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        res = c.consume("t", 0, 2)
        assert res.boundary_check and res.first_avail == 4 and res.messages == []
    for flags, name in ((0xFF, "UNKNOWN_PARTITION"), (0xFB, "SYSTEM_ERROR"), (0xFD, "NO_LEADER")):
        with FakeBroker(serve(consume_answer(flags=flags))) as broker, client(broker) as c:
            with pytest.raises(TankError, match=name) as err:
                c.consume("t", 4, 0)
            assert (err.value.code, err.value.topic, err.value.partition) == (flags, "t", 4)
    answer = consume_answer(flags=0xFC, leader=(0x0100007F, 11012))
    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        with pytest.raises(TankError) as err:
            c.consume("t", 0, 0)
        assert err.value.leader == (0x0100007F, 11012)

    def unknown(req):
        return ConsumeResponse(req.req_id, [ConsumeTopicResult("t", [], True, 1)]).encode()

    with FakeBroker(serve(unknown)) as broker, client(broker) as c:
        with pytest.raises(UnknownTopicError):
            c.consume("t", 0, 0)


# ---------------------------------------------------------------- discovery and admin


def test_admin_requests() -> None:
    seen = []

    def answer(req):
        seen.append(req)
        rid = req.req_id
        if isinstance(req, DiscoverPartitionsRequest):
            if req.topic == "missing":
                return DiscoverPartitionsResponse(rid, req.topic).encode()
            n = len(req.partitions) or 2
            bounds = [PartitionBounds(i + 1, 10 * (i + 1)) for i in range(n)]
            return DiscoverPartitionsResponse(rid, req.topic, bounds).encode()
        if isinstance(req, DiscoverTopicsRequest):
            return DiscoverTopicsResponse(rid, [TopicInfo("a", True, 4)]).encode()
        if isinstance(req, CreateTopicRequest):
            code = 1 if req.topic == "dup" else 0
            return CreateTopicResponse(rid, req.topic, code).encode()
        if isinstance(req, StatusRequest):
            return StatusResponse(rid, topics=1, partitions=4, version=400).encode()
        if isinstance(req, DiscoverTopologyRequest):
            return DiscoverTopologyResponse(rid).encode()
        if isinstance(req, ReloadConfRequest):
            return ReloadConfResponse(
                rid, req.topic, req.partition, 0 if req.partition else 2
            ).encode()
        raise AssertionError(req)

    with FakeBroker(serve(answer)) as broker, client(broker) as c:
        assert c.discover_partitions("a") == {0: (1, 10), 1: (2, 20)}
        assert c.discover_partitions("a", [7]) == {7: (1, 10)}
        with pytest.raises(UnknownTopicError):
            c.discover_partitions("missing")
        assert c.discover_topics() == [TopicInfo("a", True, 4)]
        c.create_topic("new", 4, {"retention.segments.count": 10})
        with pytest.raises(TankError, match="EXISTS") as err:
            c.create_topic("dup", 1)
        assert err.value.code == 1
        assert c.status().partitions == 4
        assert c.discover_topology().standalone
        c.reload_conf("a", 1)
        with pytest.raises(TankError):
            c.reload_conf("a", 0)
    create = next(r for r in seen if isinstance(r, CreateTopicRequest))
    assert (create.partitions, create.config) == (4, "retention.segments.count=10\n")
    ids = [r.req_id for r in seen]
    assert ids == list(range(1, len(seen) + 1))
