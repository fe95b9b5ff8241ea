"""A shared LeafLoop reads every ACK as it comes, whatever the turn did before.

ZMQ_FD fires for a socket's commands, and a send processes them: a send can
take the edge of an ACK that came meanwhile, which then sits unread until
something else looks at the socket.  The loop looks at ZMQ_EVENTS of the
members that sent since their socket was read to the end (LoopMember.armed);
these tests play the endpoint by hand (a ROUTER that acknowledges each record
at once, real ZeroMQ on 127.0.0.1) with HEADs and failovers timed out of reach,
so an ACK left unread shows as a flush that times out."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from dafka.core import leafwire, wire
from dafka.nodes.leaf import LeafLoop, LeafProducer
from dafka.nodes.receipt import Receipt
from tests.conftest import wait_until

T = "telemetry"


class QuickEndpoint:
    """A leaf endpoint played by hand: WELCOMEs each HELLO and ACKs each record at once."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.records = 0
        self.hold = threading.Event()  # set: records are taken but not acknowledged until cleared
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self.sock
        while not self._stop.is_set():
            if not sock.poll(50) or self.hold.is_set():
                continue
            for _ in range(1000):
                try:
                    peer, *frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = leafwire.decode(frames)
                if isinstance(msg, leafwire.LeafHello):
                    out = leafwire.encode(leafwire.LeafWelcome(msg.topic, msg.subject, msg.acked, 1000, 1 << 20))
                elif isinstance(msg, wire.Record):
                    self.records += 1
                    out = wire.encode(wire.Ack(msg.address, msg.subject, msg.sequence))
                else:
                    continue  # (a HEAD: none comes within these tests' timeouts)
                sock.send_multipart([peer, *out])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def endpoint() -> Iterator[QuickEndpoint]:
    e = QuickEndpoint()
    yield e
    e.close()


def test_acks_that_come_while_the_loop_sends_are_read_at_once(endpoint: QuickEndpoint) -> None:
    loop = LeafLoop()
    leaves: list[LeafProducer] = []
    try:
        leaves = [LeafProducer(T, leaf=f"127.0.0.1:{endpoint.port}", loop=loop, head_interval=60.0,
                               ack_timeout=60.0) for _ in range(20)]
        t0 = time.monotonic()
        for round_ in range(150):
            # Each device publishes twice a round, the second about when the first one's ACK
            # comes back: the loop's send of it may take that ACK's edge.
            for leaf in leaves:
                leaf.publish(b"a%d" % round_)
            time.sleep(0.0003 * (round_ % 7))
            for leaf in leaves:
                leaf.publish(b"b%d" % round_)
            for leaf in leaves:
                assert leaf.flush(5.0), f"round {round_}: {leaf.diagnose()}"  # no HEAD comes for a minute
        assert all(leaf.acked_offset == 299 for leaf in leaves)
        assert all(leaf.link.failovers == 0 for leaf in leaves)
        assert time.monotonic() - t0 < 30
    finally:
        for leaf in leaves:
            leaf.close(0)
        loop.close()


def test_a_lone_producer_reads_each_ack_as_it_comes(endpoint: QuickEndpoint) -> None:
    # Its own loop (no linger): one record at a time, each ACK read before the next publish.
    with LeafProducer(T, leaf=f"127.0.0.1:{endpoint.port}", head_interval=60.0, ack_timeout=60.0) as leaf:
        for i in range(300):
            leaf.publish(b"%d" % i)
            assert leaf.flush(5.0), f"record {i}: {leaf.diagnose()}"
        assert leaf.acked_offset == 299


def test_callbacks_and_waiters_are_resolved_by_the_acks(endpoint: QuickEndpoint) -> None:
    # The loop resolves what an ACK frees under the producer's lock it holds: a publish
    # waiting for room in a full window, a flush and a receipt waiting in other threads
    # (notified only while one waits), and the callbacks now due, each once, in offset order.
    loop = LeafLoop()
    try:
        with LeafProducer(T, leaf=f"127.0.0.1:{endpoint.port}", loop=loop, capacity=3, head_interval=60.0,
                          ack_timeout=60.0) as leaf:
            called: list[int] = []
            for i in range(3):
                leaf.publish(b"%d" % i, lambda r: called.append(r.offset) if r.acked() else None)
            assert leaf.flush(5.0), leaf.diagnose()
            assert called == [0, 1, 2]
            endpoint.hold.set()  # the next records wait for their ACK: the window fills up
            receipts = [leaf.publish(b"%d" % i, lambda r: called.append(r.offset) if r.acked() else None)
                        for i in range(3, 6)]
            waited: dict[str, object] = {}

            def publish_one_more() -> None:  # the window is full: this waits for room
                waited["publish"] = leaf.publish(b"6", timeout=10.0).offset

            def wait_for_receipt() -> None:
                waited["receipt"] = receipts[-1].wait(10.0)

            def flush() -> None:
                waited["flush"] = leaf.flush(10.0)

            threads = [threading.Thread(target=f) for f in (publish_one_more, wait_for_receipt, flush)]
            for t in threads:
                t.start()
            wait_until(lambda: leaf._waiting == 3, timeout=5.0)
            assert leaf._waiting == 3 and called == [0, 1, 2] and not waited
            endpoint.hold.clear()
            for t in threads:
                t.join(10.0)
            assert waited == {"publish": 6, "receipt": True, "flush": True}
            assert leaf.flush(5.0)
            assert called == [0, 1, 2, 3, 4, 5]
            late: list[int] = []
            receipts[0].add_done_callback(lambda r: late.append(r.offset))  # resolved already: called at once
            assert late == [3] and leaf._waiting == 0
    finally:
        loop.close()


def test_fds_freed_by_failovers_and_closes_are_reused_by_the_right_members(endpoint: QuickEndpoint) -> None:
    # Every new producer starts at a dead endpoint and fails over (its DEALER closed, a new
    # one opened) while others close and open beside it on the same loop: ZeroMQ hands the
    # freed fds out again. The loop's fd -> member map follows: each ACK reaches its producer
    # (a stale entry would read a socket's ACKs into another member, or refuse a register).
    with zmq.Context() as ctx:
        dead = ctx.socket(zmq.ROUTER)
        dead_port = dead.bind_to_random_port("tcp://127.0.0.1")
        dead.close(0)  # (nothing listens there now: connects are refused)
    endpoints = f"127.0.0.1:{dead_port},127.0.0.1:{endpoint.port}"
    loop = LeafLoop()
    leaves: list[LeafProducer] = []
    try:
        def new_leaf() -> LeafProducer:
            return LeafProducer(T, leaf=endpoints, loop=loop, head_interval=60.0, ack_timeout=60.0,
                                connect_timeout=0.1)

        leaves = [new_leaf() for _ in range(8)]
        t0 = time.monotonic()
        seen: dict[int, set[int]] = {}  # fd -> the producers (ids) it served
        for round_ in range(5):
            for leaf in leaves:
                if leaf.sock is not None:
                    seen.setdefault(leaf.sock.getsockopt(zmq.FD), set()).add(id(leaf))
            for leaf in leaves[:3]:
                leaf.close(0)
            leaves = [*leaves[3:], *(new_leaf() for _ in range(3))]
            for leaf in leaves:
                leaf.publish(b"r%d" % round_)
            for leaf in leaves:
                assert leaf.flush(5.0), f"round {round_}: {leaf.diagnose()}"
        assert all(leaf.link.failovers >= 1 and leaf.endpoint.endswith(f":{endpoint.port}") for leaf in leaves)
        assert time.monotonic() - t0 < 30
        assert any(len(ids) > 1 for ids in seen.values()), seen  # (fds were reused)
        by_fd = {fd: m for fd, m in dict(loop._by_fd).items() if m is not None}
        assert by_fd == {leaf.sock.getsockopt(zmq.FD): leaf for leaf in leaves if leaf.sock is not None}
    finally:
        for leaf in leaves:
            leaf.close(0)
        loop.close()


def test_a_close_that_times_out_fails_its_waiters_and_callbacks_once_in_order(endpoint: QuickEndpoint) -> None:
    # Nothing is acknowledged: a flush, a receipt's wait and a publish into the full window,
    # each in a thread waiting without a timeout, end at the close (failed, closed); each
    # callback runs once, failed, in offset order.
    from dafka.errors import ClosedError, PublishError

    leaf = LeafProducer(T, leaf=f"127.0.0.1:{endpoint.port}", capacity=3, head_interval=60.0, ack_timeout=60.0)
    try:
        endpoint.hold.set()
        called: list[tuple[int, bool]] = []
        receipts = [leaf.publish(b"%d" % i, lambda r: called.append((r.offset, r.failed()))) for i in range(3)]
        ended: dict[str, object] = {}

        def run(name: str, fn: object) -> None:
            try:
                ended[name] = fn()  # type: ignore[operator]
            except (PublishError, ClosedError) as exc:
                ended[name] = type(exc).__name__

        threads = [threading.Thread(target=run, args=(name, fn)) for name, fn in (
            ("flush", lambda: leaf.flush(None)), ("wait", lambda: receipts[1].wait(None)),
            ("publish", lambda: leaf.publish(b"3", timeout=None)))]
        for t in threads:
            t.start()
        wait_until(lambda: leaf._waiting == 3, timeout=5.0)
        assert leaf._waiting == 3 and not called
        assert not leaf.close(0.3)
        for t in threads:
            t.join(5.0)
        assert ended == {"flush": False, "wait": "PublishError", "publish": "ClosedError"}
        assert called == [(0, True), (1, True), (2, True)]
        assert all(r.failed() for r in receipts) and leaf._waiting == 0
    finally:
        endpoint.hold.clear()
        leaf.close(0)


def test_a_record_published_while_close_flushes_is_resolved_by_the_close(endpoint: QuickEndpoint) -> None:
    # Another thread publishes in the moment between close()'s flush returning True and the
    # producer closing: that record was not acknowledged when close returned, so close says
    # so (False) and its receipt fails then, instead of never resolving.
    from dafka.errors import PublishError

    leaf = LeafProducer(T, leaf=f"127.0.0.1:{endpoint.port}", head_interval=60.0, ack_timeout=60.0)
    try:
        assert leaf.publish(b"first").wait(5.0)
        late: list[Receipt] = []
        flush = leaf.flush

        def flush_then_publish(timeout: float | None = None) -> bool:
            ok = flush(timeout)
            endpoint.hold.set()  # (the endpoint acknowledges nothing from here on)
            late.append(leaf.publish(b"late"))  # (as another thread could, before _closed is set)
            return ok

        leaf.flush = flush_then_publish  # type: ignore[method-assign]
        assert not leaf.close(1.0)
        with pytest.raises(PublishError):
            late[0].wait(2.0)
    finally:
        endpoint.hold.clear()
        leaf.close(0)
