"""The plain tower's own XPUB (dafka.core.zmtp, dafka.nodes.tower_front) against real libzmq.

Byte for byte what a libzmq XPUB says to the same client (ZMTP 3.0 and 3.1),
real pyzmq SUB sockets, the sans-IO session and book fuzzed with hypothesis,
and the bounds: oversize subscriptions, too many, all connections over the
budget, handshakes that never finish, subscribers that stop reading.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.core import wire, zmtp
from dafka.errors import ProtocolError
from dafka.nodes import tower_front
from dafka.nodes.tower import Tower
from dafka.nodes.tower_front import PlainXpub
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)

READY_SUB = zmtp.ready(b"SUB")


def subscribe_bytes(minor: int, prefix: bytes, subscribe: bool = True) -> bytes:
    """An (un)subscription as a libzmq SUB sends it to a ZMTP 3.<minor> XPUB."""
    if minor >= 1:
        return zmtp.command(b"SUBSCRIBE" if subscribe else b"CANCEL", prefix)
    return zmtp.frame((b"\x01" if subscribe else b"\x00") + prefix)


def read_until(sock: socket.socket, heard: bytes, done: Callable[[bytes], bool], timeout: float = 5.0) -> bytes:
    """``heard`` and what ``sock`` receives after it, until ``done`` holds of it all, the peer closes or ``timeout`` passes."""
    sock.settimeout(0.05)
    deadline = time.monotonic() + timeout
    while not done(heard) and time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        heard += chunk
    return heard


def ends_with(*frames: bytes) -> Callable[[bytes], bool]:
    """Whether a stream heard so far ends with the message of ``frames``."""
    message = zmtp.message(list(frames))
    return lambda heard: heard.endswith(message)


class FrontThread:
    """A PlainXpub driven by a thread, as the tower drives it."""

    def __init__(self, welcome: bytes = wire.WELCOME) -> None:
        import threading

        self.xpub = PlainXpub("127.0.0.1", 0, welcome)
        self.port = self.xpub.port
        self.events: list[bytes] = []
        self.outbox: list[list[bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import select

        while not self.stop.is_set():
            select.select([self.xpub.fileno()], [], [], 0.01)
            self.xpub.process()
            self.events += self.xpub.subscriptions()
            while self.outbox:
                self.xpub.send(self.outbox.pop(0))
            self.xpub.flush()

    def send(self, frames: list[bytes]) -> None:
        self.outbox.append(frames)

    def reported(self, n: int) -> None:
        """Wait until the front has reported ``n`` (un)subscriptions (it applied them)."""
        wait_until(lambda: len(self.events) >= n, 5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.xpub.close()


@pytest.fixture
def front():
    f = FrontThread()
    yield f
    f.close()


class LibzmqXpub:
    """A libzmq XPUB set up as the secure tower's (welcome W), driven the same way."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_WELCOME_MSG, wire.WELCOME)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.events: list[bytes] = []

    def pump(self) -> None:
        while self.sock.poll(50):
            self.events.append(self.sock.recv())

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def reported(self, n: int) -> None:
        """Wait until the XPUB has reported ``n`` (un)subscriptions (it applies each as it reports it)."""
        wait_until(lambda: (self.pump(), len(self.events) >= n)[1], 5)

    def close(self) -> None:
        self.sock.close(0)


def conversation(port: int, minor: int, reported: Callable[[int], None], send: Callable[[list[bytes]], None]) -> bytes:
    """What a raw ZMTP 3.<minor> SUB hears from the port at ``port``, step by step as libzmq's SUB talks.

    Each step waits for what it needs: the port's signature, its greeting and
    READY, the (un)subscriptions reported (so applied) before publishing, and
    each batch's last subscribed message before the next step.
    """
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(zmtp.SIGNATURE)
        heard = read_until(c, b"", lambda h: len(h) >= len(zmtp.SIGNATURE))
        c.sendall(zmtp.greeting_rest(minor))
        heard = read_until(c, heard, lambda h: len(h) > 65 and len(h) >= 66 + h[65])  # greeting and READY
        c.sendall(READY_SUB)  # the welcome comes when libzmq's XPUB attaches the pipe (at its next call)
        c.sendall(subscribe_bytes(minor, b"B") + subscribe_bytes(minor, b"X T") + subscribe_bytes(minor, b"R" * 300))
        reported(3)
        send([b"B", b"A" * 32, b"tcp://127.0.0.1:5000"])
        send([b"X T" + b"1" * 32])
        send([b"X P hello\x00", b"A" * 32, b"tcp://127.0.0.1:5001"])  # not subscribed
        send([b"R" * 300 + b"!", b"x" * 400])  # long frames
        heard = read_until(c, heard, ends_with(b"R" * 300 + b"!", b"x" * 400))
        c.sendall(subscribe_bytes(minor, b"B", subscribe=False))
        reported(4)
        send([b"B", b"C" * 32, b"tcp://127.0.0.1:5002"])  # no longer subscribed
        send([b"X T" + b"2" * 32])
        return read_until(c, heard, ends_with(b"X T" + b"2" * 32))


@pytest.mark.parametrize("minor", [0, 1])
def test_same_bytes_as_a_libzmq_xpub(front: FrontThread, minor: int) -> None:
    reference = LibzmqXpub()
    try:
        expected = conversation(reference.port, minor, reference.reported, reference.send)
        ours = conversation(front.port, minor, front.reported, front.send)
        assert ours == expected
        assert expected.startswith(zmtp.greeting(1) + zmtp.ready(b"XPUB") + zmtp.message([wire.WELCOME]))
        # The (un)subscriptions reported, as the XPUB reports them (the peer's leaving included).
        wait_until(lambda: len(front.events) >= 6, 5)
        wait_until(lambda: (reference.pump(), len(reference.events) >= len(front.events))[1], 5)
        assert front.events == reference.events
    finally:
        reference.close()


def test_a_message_goes_to_those_subscribed_when_it_is_sent() -> None:
    """As a libzmq XPUB: a CANCEL read before a sent message is written does not take it back,
    and a message sent after the CANCEL does not go."""
    xpub = PlainXpub("127.0.0.1", 0, wire.WELCOME)
    events: list[bytes] = []

    def reported(event: bytes) -> bool:
        xpub.process()
        events.extend(xpub.subscriptions())
        return event in events

    try:
        with socket.create_connection(("127.0.0.1", xpub.port)) as c:
            c.sendall(zmtp.greeting(1) + READY_SUB + subscribe_bytes(1, b"B") + subscribe_bytes(1, b"X"))
            wait_until(lambda: reported(b"\x01X"))
            xpub.send([b"B", b"before"])  # queued; written at flush
            c.sendall(subscribe_bytes(1, b"B", subscribe=False))
            wait_until(lambda: reported(b"\x00B"))
            xpub.send([b"B", b"after"])
            xpub.send([b"X", b"end"])
            xpub.flush()
            heard = read_until(c, b"", ends_with(b"X", b"end"))
            assert zmtp.message([b"B", b"before"]) in heard
            assert zmtp.message([b"B", b"after"]) not in heard
    finally:
        xpub.close()


def test_pyzmq_sub_sockets_meet_the_front(front: FrontThread) -> None:
    ctx = zmq.Context.instance()
    subs = [ctx.socket(zmq.SUB) for _ in range(2)]
    try:
        for s in subs:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 100)
            s.setsockopt(zmq.SUBSCRIBE, wire.WELCOME)
            s.connect(f"tcp://127.0.0.1:{front.port}")
        subs[0].setsockopt(zmq.SUBSCRIBE, b"X P")
        subs[1].setsockopt(zmq.SUBSCRIBE, b"X P topic\x00")
        for s in subs:
            assert s.recv_multipart() == [wire.WELCOME]
        # Reported once per prefix however many hold it.
        wait_until(lambda: {b"\x01W", b"\x01X P", b"\x01X P topic\x00"} <= set(front.events))
        assert front.events.count(b"\x01W") == 1

        def heard(sock: zmq.Socket, frames: list[bytes]) -> bool:
            front.send(frames)
            try:
                return sock.recv_multipart() == frames
            except zmq.Again:
                return False

        wait_until(lambda: heard(subs[1], [b"X P topic\x00", b"A" * 32, b"tcp://h:1"]))
        assert subs[0].recv_multipart() == [b"X P topic\x00", b"A" * 32, b"tcp://h:1"]
        big = [b"X P other\x00", os.urandom(70_000)]
        front.send(big)
        assert subs[0].recv_multipart() == big
        with pytest.raises(zmq.Again):
            subs[1].recv_multipart()
        subs[1].close(0)
        wait_until(lambda: b"\x00X P topic\x00" in front.events)
        assert b"\x00W" not in front.events  # subs[0] still holds it
    finally:
        for s in subs:
            s.close(0)


def test_heartbeating_sub_and_xsub_peers(front: FrontThread) -> None:
    """A SUB that pings (ZMQ_HEARTBEAT_IVL) is answered and stays; an XSUB's subscriptions count too."""
    ctx = zmq.Context.instance()
    sub, xsub = ctx.socket(zmq.SUB), ctx.socket(zmq.XSUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, 50)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 200)
        sub.setsockopt(zmq.SUBSCRIBE, b"B")
        sub.connect(f"tcp://127.0.0.1:{front.port}")
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.connect(f"tcp://127.0.0.1:{front.port}")
        xsub.send(b"\x01X")
        wait_until(lambda: {b"\x01B", b"\x01X"} <= set(front.events))
        time.sleep(0.6)  # three heartbeat timeouts
        assert not monitor.poll(0), "the SUB dropped its connection: no PONG"
        front.send([b"B", b"beat"])
        assert sub.poll(2000) and sub.recv_multipart() == [b"B", b"beat"]
        front.send([b"X", b"to the xsub"])
        assert xsub.poll(2000) and xsub.recv_multipart() == [wire.WELCOME]
        assert xsub.poll(2000) and xsub.recv_multipart() == [b"X", b"to the xsub"]
        sub.disable_monitor()
        monitor.close(0)
    finally:
        sub.close(0)
        xsub.close(0)


def test_secure_peer_and_wrong_socket_types_are_refused(front: FrontThread) -> None:
    for hello in (
        zmtp.SIGNATURE + b"\x03\x01" + b"CURVE".ljust(20, b"\0") + bytes(32),
        zmtp.greeting(1) + zmtp.ready(b"DEALER"),
        zmtp.greeting(1) + zmtp.frame(b"\x01B"),  # no READY
        b"GET / HTTP/1.1\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", front.port)) as c:
            c.sendall(hello)
            c.settimeout(5)
            got = b""
            while chunk := c.recv(4096):
                got += chunk  # ends: the front closed
            assert zmtp.message([wire.WELCOME]) not in got
    wait_until(lambda: front.xpub.cut.count >= 4)


def test_oversize_subscription_cuts_its_connection(front: FrontThread) -> None:
    with socket.create_connection(("127.0.0.1", front.port)) as c:
        c.sendall(zmtp.greeting(0) + READY_SUB + subscribe_bytes(0, b"B"))
        wait_until(lambda: b"\x01B" in front.events)
        c.sendall(zmtp.frame(b"\x01" + b"x" * (zmtp.MAX_SUBSCRIPTION + 1)))
        c.settimeout(5)
        while c.recv(4096):
            pass
    wait_until(lambda: b"\x00B" in front.events)  # its subscriptions went with it
    # A frame announcing 2^60 bytes is refused on its header, before any buffering.
    with socket.create_connection(("127.0.0.1", front.port)) as c:
        c.sendall(zmtp.greeting(1) + READY_SUB + b"\x02" + (2**60).to_bytes(8, "big"))
        c.settimeout(5)
        while c.recv(4096):
            pass


def test_handshake_deadline_and_slow_subscribers(monkeypatch) -> None:
    monkeypatch.setattr(tower_front, "OUT_MAX", 64 * 1024)
    xpub = PlainXpub("127.0.0.1", 0, wire.WELCOME)
    idle = socket.create_connection(("127.0.0.1", xpub.port))
    slow = socket.create_connection(("127.0.0.1", xpub.port))
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.sendall(zmtp.greeting(1) + READY_SUB + subscribe_bytes(1, b"B"))
        wait_until(lambda: (xpub.process(), xpub.subscriptions() == [b"\x01B"])[1])
        for _ in range(2000):  # ~20 MB for one subscriber who reads nothing
            xpub.send([b"B", os.urandom(10_000)])
            xpub.flush()
        assert xpub.dropped > 0 and len(xpub.conns) == 2  # dropped messages, as at a high-water mark
        assert xpub.out_total <= tower_front.OUT_MAX
        xpub.process(time.monotonic() + tower_front.HANDSHAKE_TIMEOUT + 1)
        assert len(xpub.conns) == 1 and xpub.cut.count == 1  # the idle one
    finally:
        idle.close()
        slow.close()
        xpub.close()


# ---------------------------------------------------------------- sans-IO


def test_book_bounds_and_eviction() -> None:
    book: zmtp.SubscriptionBook[str] = zmtp.SubscriptionBook(peer_count=3, peer_bytes=10_000, total_bytes=1200)
    assert book.subscribe("a", b"B") == (True, [])
    assert book.subscribe("a", b"B") == (False, [])  # held once
    assert book.subscribe("b", b"B") == (False, [])
    book.subscribe("a", b"X")
    book.subscribe("a", b"Y")
    with pytest.raises(zmtp.SubscriptionLimit):
        book.subscribe("a", b"Z")
    assert book.match(b"BX") == ["a", "b"] and book.match(b"Yes") == ["a"] and book.match(b"") == []
    assert not book.cancel("b", b"B") and not book.cancel("b", b"B")  # "a" still holds it; then nothing to cancel
    first, cut = book.subscribe("c", b"C" * 500)
    assert first and cut == ["a"]  # the largest holder, until the rest fit
    assert book.close("a") == [b"B", b"X", b"Y"]
    assert book.total == 500 + zmtp.ENTRY_COST + zmtp.HOLDING_COST and book.match(b"B") == []


prefixes = st.binary(max_size=4)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), prefixes), max_size=40), st.binary(max_size=6))
def test_book_matches_as_an_xpub(ops, topic: bytes) -> None:
    book: zmtp.SubscriptionBook[str] = zmtp.SubscriptionBook()
    model: dict[str, set[bytes]] = {}
    reported: dict[bytes, int] = {}
    for peer, subscribe, prefix in ops:
        held = model.setdefault(peer, set())
        if subscribe:
            first, cut = book.subscribe(peer, prefix)
            assert first == (not any(prefix in h for h in model.values())) and cut == []
            held.add(prefix)
        else:
            last = book.cancel(peer, prefix)
            had = prefix in held
            held.discard(prefix)
            assert last == (had and not any(prefix in h for h in model.values()))
        reported[prefix] = 1
    assert sorted(book.match(topic)) == sorted(p for p, h in model.items() if any(topic.startswith(x) for x in h))
    distinct = set().union(*model.values()) if model else set()
    assert len(book) == len(distinct)
    holdings = sum(len(h) for h in model.values())
    assert book.total == sum(len(p) + zmtp.ENTRY_COST for p in distinct) + holdings * zmtp.HOLDING_COST
    for peer in list(model):
        book.close(peer)
    assert book.total == 0 and len(book) == 0


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 5), st.binary(max_size=60)), max_size=60))
def test_book_cuts_bring_the_total_under_its_bound(ops) -> None:
    book: zmtp.SubscriptionBook[int] = zmtp.SubscriptionBook(peer_count=50, peer_bytes=10_000, total_bytes=3000)
    for peer, prefix in ops:
        try:
            _, cut = book.subscribe(peer, prefix)
        except zmtp.SubscriptionLimit:
            book.close(peer)
            continue
        for other in cut:
            book.close(other)
        assert book.total <= 3000
        if cut:
            assert book.total <= 2700


def valid_stream(minor: int, subs: list[tuple[bool, bytes]]) -> bytes:
    return zmtp.greeting(minor) + READY_SUB + b"".join(subscribe_bytes(minor, p, s) for s, p in subs)


@settings(max_examples=200)
@given(
    st.integers(0, 1),
    st.lists(st.tuples(st.booleans(), st.binary(max_size=300)), max_size=10),
    st.lists(st.integers(1, 400), max_size=20),
)
def test_session_reads_any_chunking_alike(minor: int, subs, cuts) -> None:
    data = valid_stream(minor, subs)
    session = zmtp.Session()
    events = []
    pos = 0
    for n in cuts:
        events += session.receive(data[pos : pos + n])
        pos += n
    events += session.receive(data[pos:])
    assert session.open and events == subs
    out = session.output()
    assert out == zmtp.greeting(1) + zmtp.ready(b"XPUB")


@settings(max_examples=500)
@given(st.binary(max_size=300), st.integers(0, 2), st.integers(0, 1))
def test_session_refuses_garbage_with_protocol_error_only(junk: bytes, where: int, minor: int) -> None:
    head = [b"", zmtp.greeting(minor), zmtp.greeting(minor) + READY_SUB][where]
    session = zmtp.Session()
    try:
        events = session.receive(head + junk)
    except ProtocolError:
        with pytest.raises(ProtocolError):
            session.receive(b"more")  # closed for good
        return
    assert all(isinstance(p, bytes) and len(p) <= zmtp.MAX_SUBSCRIPTION for _, p in events)


def test_session_answers_ping() -> None:
    session = zmtp.Session()
    session.receive(zmtp.greeting(1) + READY_SUB + zmtp.command(b"PING", b"\x00\x10ctx"))
    assert session.output().endswith(zmtp.command(b"PONG", b"ctx"))


# ---------------------------------------------------------------- the tower


def test_tower_forwards_only_subscriptions_that_select_b_beacons() -> None:
    with Tower("127.0.0.1", 0, 0) as tower:
        ctx = zmq.Context.instance()
        upstream = ctx.socket(zmq.XPUB)  # plays a node's beacon PUB, and sees what the tower forwards
        upstream.setsockopt(zmq.XPUB_VERBOSE, 1)
        sub = ctx.socket(zmq.SUB)
        try:
            upstream.connect(f"tcp://127.0.0.1:{tower.in_port}")
            for prefix in (b"W", b"R" + b"A" * 32, b"X P t\x00", os.urandom(40)):
                sub.setsockopt(zmq.SUBSCRIBE, prefix)
            sub.connect(f"tcp://127.0.0.1:{tower.out_port}")
            assert sub.poll(5000) and sub.recv_multipart() == [wire.WELCOME]  # those are sent
            sub.setsockopt(zmq.SUBSCRIBE, b"B")  # after them, on the same connection
            seen: list[bytes] = []

            def got_b() -> bool:
                while upstream.poll(10):
                    seen.append(upstream.recv())
                return b"\x01B" in seen

            # The tower reads a connection's subscriptions in order and forwards in that order:
            # when B came, whatever it would forward of the others came before it.
            wait_until(got_b)
            assert set(seen) == {b"\x01X", b"\x01B"}  # the tower's own X, and B
        finally:
            sub.close(0)
            upstream.close(0)
