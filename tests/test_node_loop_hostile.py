"""NodeLoop under hostile use: edges ZeroMQ takes away, nodes closed from
several threads, from their own callbacks and by the loop itself, nodes that
fail, and many nodes made and closed on one loop.  Real sockets, tower and
stores (see test_node_loop.py for the basic cases)."""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.errors import ClosedError, PublishError
from dafka.nodes.consumer import Consumer
from dafka.nodes.loop import NodeLoop
from dafka.nodes.producer import Producer, Receipt
from dafka.store.node import Store
from tests.conftest import wait_until


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _recv_until(sock: zmq.Socket, predicate: Any, timeout: float) -> bool:
    """Read ``sock`` until a message satisfies ``predicate`` (False after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(50) and predicate(sock.recv_multipart()):
            return True
    return False


def _hello_to(store: str) -> Any:
    def match(frames: list[bytes]) -> bool:
        try:
            msg = wire.decode(frames)
        except Exception:
            return False
        return isinstance(msg, wire.ConsumerHello) and msg.topic == store

    return match


# ---------------------------------------------------------------- edges


def test_input_whose_edge_the_nodes_own_send_took_is_read(cfg: NodeConfig) -> None:
    # A consumer's XPUB is watched through its edge-triggered ZMQ_FD and also
    # sent on.  A send makes ZeroMQ process the socket's commands: a subscription
    # that came in just before is then queued with no edge left to wake the
    # loop.  Only the loop's look at the node's sockets after its turn finds it
    # (the node's timers would too, later: here they never come).
    ctx = zmq.Context.instance()
    with NodeLoop() as loop:
        consumer = Consumer("edge", cfg, loop=loop)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, wire.P_CONSUMER_HELLO + b"store-a")
            sub.connect(f"tcp://127.0.0.1:{consumer.port}")
            # A store's subscription is answered with a CONSUMER-HELLO: connected, read as usual.
            assert _recv_until(sub, _hello_to("store-a"), 10)

            consumer._loop_timers = lambda now: 3600.0  # type: ignore[method-assign]
            wait_until(lambda: loop._due.get(consumer, 0.0) > time.monotonic() + 60, 5)

            entered, sent = threading.Event(), threading.Event()

            def take_the_edge() -> None:  # in the loop's thread, as one of the node's turns
                fd = consumer.publisher.getsockopt(zmq.FD)
                t0 = time.monotonic()
                entered.set()
                deadline = t0 + 5
                # The subscription below arrived (ZMQ_FD readable, looked at without
                # ZeroMQ), and a send is not throttled (ZeroMQ skips the commands of a
                # send within ~1 ms of the last look):
                while time.monotonic() < deadline and not (
                    select.select([fd], [], [], 0.01)[0] and time.monotonic() > t0 + 0.005
                ):
                    pass
                consumer.send(wire.GetHeads("edge", consumer.address))
                sent.set()

            consumer.call_soon(take_the_edge)
            assert entered.wait(5)
            sub.setsockopt(zmq.SUBSCRIBE, wire.P_CONSUMER_HELLO + b"store-b")
            assert sent.wait(10)
            assert _recv_until(sub, _hello_to("store-b"), 3)  # the subscription was read
        finally:
            sub.close(0)
        consumer.close()


# ---------------------------------------------------------------- closing


def test_a_wake_after_the_loop_closed_writes_to_no_other_file(cfg: NodeConfig, tmp_path: Path) -> None:
    # The loop's wake-up pipe is closed with the loop; its descriptor numbers are
    # then given to the next files opened.  A node still woken (call_soon, a
    # paused consumer's poll) must not write its wake-up byte into one of them.
    loop = NodeLoop()
    producer = Producer("closed", cfg, loop=loop)
    consumer = Consumer("closed", cfg, loop=loop)
    old = loop._wake_w
    loop.close()
    victims: list[tuple[int, Path]] = []
    try:
        for i in range(64):
            path = tmp_path / f"victim{i}"
            victims.append((os.open(path, os.O_WRONLY | os.O_CREAT), path))
            if victims[-1][0] == old:
                break
        assert victims[-1][0] == old  # the pipe's write end's number, now a file's
        producer.call_soon(lambda: None)
        consumer.subscribe_topic("more")
    finally:
        for fd, _ in victims:
            os.close(fd)
    assert all(path.read_bytes() == b"" for _, path in victims)
    producer.close(0)
    consumer.close()


def test_closing_the_loop_releases_whoever_waits_on_its_nodes(cfg: NodeConfig) -> None:
    # NodeLoop.close() closes the nodes still on it: threads waiting on them
    # (a poll without timeout, a flush, a receipt, a publish held for room)
    # must return, and nothing unacknowledged may pass for acknowledged.
    loop = NodeLoop()
    producer = Producer("busy", cfg, loop=loop)  # no store: nothing is ever acknowledged
    full = Producer("busy", cfg, loop=loop, capacity=1, publish_timeout=None)
    consumer = Consumer("quiet", cfg, loop=loop)
    receipt = producer.publish(b"never acknowledged")
    full.publish(b"fills the window")
    outcome: dict[str, object] = {}

    def run(name: str, fn: Any) -> threading.Thread:
        def target() -> None:
            try:
                outcome[name] = fn()
            except Exception as exc:
                outcome[name] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    threads = [
        run("poll", lambda: consumer.poll(None)),
        run("flush", producer.flush),
        run("wait", receipt.wait),
        run("publish", lambda: full.publish(b"waits for room")),
    ]
    wait_until(lambda: consumer._sleepers, 5)
    time.sleep(0.2)  # (for the other waits to begin: they block, there is nothing to see)
    loop.close()
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads), outcome
    assert isinstance(outcome["poll"], ClosedError)
    assert outcome["flush"] is False
    assert isinstance(outcome["wait"], PublishError)
    assert isinstance(outcome["publish"], (ClosedError, PublishError))
    assert receipt.done()
    assert producer.close(0) is False  # it was not acknowledged
    full.close(0)
    consumer.close()


def test_closing_nodes_from_several_threads_while_they_publish(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    with Store(str(tmp_path / "db"), cfg, sync=False), NodeLoop() as loop:
        producers = [Producer("many", cfg, loop=loop) for _ in range(12)]
        assert all(p.publish(b"first").wait(20) for p in producers)
        stop = threading.Event()
        errors: list[BaseException] = []

        def publish(p: Producer) -> None:
            for i in range(100_000):
                if stop.is_set():
                    return
                try:
                    p.publish(b"%d" % i)
                except (ClosedError, PublishError):
                    return
                except BaseException as exc:  # anything else is a bug
                    errors.append(exc)
                    return

        publishers = [threading.Thread(target=publish, args=(p,), daemon=True) for p in producers]
        for t in publishers:
            t.start()
        wait_until(lambda: all(p.window.next > 50 for p in producers), 10)
        closers = [
            threading.Thread(target=p.close, args=(1.0,), daemon=True) for p in producers
        ]
        t0 = time.monotonic()
        for t in closers:
            t.start()
        for t in closers:
            t.join(15)
        stop.set()
        for t in publishers:
            t.join(5)
        assert not any(t.is_alive() for t in closers + publishers)
        assert time.monotonic() - t0 < 15
        assert not errors, errors
        # close(1.0) may give up waiting before a loop this busy has detached the node.
        wait_until(lambda: loop.nodes == 0 and not any(p.running for p in producers), 10)
        assert not loop._watches  # every socket unregistered
        late = Producer("many", cfg, loop=loop)  # the loop still serves
        assert late.publish(b"late").wait(20)
        assert late.close(5)


def test_a_producer_closed_from_its_own_callback(cfg: NodeConfig, tmp_path: Path) -> None:
    # Callbacks run in the loop's thread, inside the node's reader.
    with Store(str(tmp_path / "db"), cfg, sync=False), NodeLoop() as loop:
        producer = Producer("self", cfg, loop=loop)
        other = Producer("self", cfg, loop=loop)
        assert producer.publish(b"warm").wait(20)
        closed: list[tuple[bool, float]] = []

        def close_me(receipt: Receipt) -> None:
            t0 = time.monotonic()
            closed.append((producer.close(2), time.monotonic() - t0))

        producer.publish(b"first").add_done_callback(close_me)
        for i in range(200):
            producer.publish(b"%d" % i)
        wait_until(lambda: closed, 20)
        wait_until(lambda: not producer.running, 5)
        assert closed[0][1] < 3
        assert loop.nodes == 1
        assert other.publish(b"still served").wait(10)


def test_a_group_member_closed_from_its_on_assign(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A revocation comes with a peer's MEMBER message: on_assign runs inside the
    # consumer's reader of its data SUB, in the loop's thread.  Closing there
    # must not close the SUB under that reader.
    with Store(str(tmp_path / "db"), cfg, sync=False):
        producers = [Producer("grp", cfg) for _ in range(4)]
        try:
            assert all(p.publish(b"x").wait(20) for p in producers)
            with NodeLoop() as loop:
                sizes: list[int] = []
                closed: list[float] = []

                def on_assign(owned: frozenset[Any]) -> None:
                    sizes.append(len(owned))
                    if len(sizes) > 1 and len(owned) < max(sizes) and not closed:
                        t0 = time.monotonic()
                        first.close()
                        closed.append(time.monotonic() - t0)

                first = Consumer("grp", cfg, group="g", offset_reset="earliest", loop=loop, on_assign=on_assign)
                wait_until(lambda: first.poll(0.05) is None and len(first.assignment()) == 4, 15)
                with caplog.at_level(logging.ERROR):
                    second = Consumer("grp", cfg, group="g", offset_reset="earliest", loop=loop)
                    wait_until(lambda: closed, 15)
                    wait_until(lambda: second.poll(0.05) is None and len(second.assignment()) == 4, 15)
                assert "failed handling input" not in caplog.text
                assert not first.running and loop.nodes == 1
                assert closed[0] < 0.5  # nothing waited for the loop's own thread
                second.close()
        finally:
            for p in producers:
                p.close(1)


# ---------------------------------------------------------------- failing nodes


class _BrokenProducer(Producer):
    def has_work(self) -> bool:
        raise RuntimeError("a bug in a subclass's hook")


def test_a_node_failing_in_its_loop_step_leaves_the_others_served(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Store(str(tmp_path / "db"), cfg, sync=False), NodeLoop() as loop:
        kept = Producer("fail", cfg, loop=loop)

        def bad_timer(now: float) -> None:
            raise RuntimeError("a bug in a timer")

        kept.call_soon(lambda: kept.every(0.01, bad_timer))
        with caplog.at_level(logging.ERROR):
            broken = _BrokenProducer("fail", cfg, loop=loop)
            for i in range(50):
                kept.publish(b"%d" % i)
            assert kept.flush(20)  # timers failing every 10 ms, a node failing every turn
            wait_until(lambda: "timer failed" in caplog.text, 10)  # (the first may come after the ACKs)
            for i in range(50):
                kept.publish(b"%d" % i)
            assert kept.flush(20)
        assert loop._thread.is_alive()
        broken.close(0)
        assert kept.close(5)


# ---------------------------------------------------------------- many nodes


def test_nodes_made_and_closed_again_and_again_on_one_loop(cfg: NodeConfig) -> None:
    # Descriptors of closed nodes' sockets are given to the next ones: no stale
    # registration may survive, nor any descriptor leak; a long-lived pair on
    # the loop keeps talking throughout.
    with NodeLoop() as loop:
        consumer = Consumer("churn", cfg, offset_reset="earliest", loop=loop)
        producer = Producer("churn", cfg, loop=loop, acks=False)
        producer.publish(b"0")
        assert consumer.poll(10) is not None
        # Once it met the consumer the producer reads beacons at its own turns,
        # its beacon socket no longer watched: count from then on.
        wait_until(lambda: producer._lazy_beacons, 5)
        base_watches = len(loop._watches)
        for _ in range(3):  # (ZeroMQ's own threads and descriptors, once)
            Producer("churn", cfg, loop=loop, acks=False).close(0)
        wait_until(lambda: len(loop._watches) == base_watches, 5)
        fds0 = _open_fds()
        t0 = time.monotonic()
        delivered = 1
        for cycle in range(150):
            if time.monotonic() - t0 > 30:
                break
            batch = [
                Producer("churn", cfg, loop=loop, acks=False) if i % 2 else Consumer("churn", cfg, loop=loop)
                for i in range(2)
            ]
            producer.publish(b"%d" % (cycle + 1))
            for node in batch:
                node.close(0) if isinstance(node, Producer) else node.close()
            record = consumer.poll(5)
            assert record is not None and record.content == b"%d" % (cycle + 1), (cycle, record)
            delivered += 1
        assert delivered > 50
        assert loop.nodes == 2
        assert len(loop._watches) == base_watches
        assert len(loop._selector.get_map()) == base_watches + 1  # and the wake-up pipe
        wait_until(lambda: _open_fds() <= fds0 + 4, 10)  # sockets close in ZeroMQ's reaper
        producer.close(0)
        consumer.close()
    assert not loop._watches


def test_a_consumer_group_on_one_loop(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "db"), cfg, sync=False), NodeLoop() as loop:
        producers = [Producer("gl", cfg, loop=loop) for _ in range(4)]
        for p in producers:
            for i in range(20):
                p.publish(b"%d" % i)
        assert all(p.flush(20) for p in producers)
        members = [
            Consumer("gl", cfg, group="g", offset_reset="earliest", loop=loop) for _ in range(2)
        ]
        got: dict[tuple[str, int], int] = {}

        def settled() -> bool:
            for m in members:
                for r in m.poll_batch(1000, 0.02):
                    got[(r.partition, r.offset)] = got.get((r.partition, r.offset), 0) + 1
            owned = [m.assignment() for m in members]
            return len(got) == 80 and all(owned) and not (owned[0] & owned[1])

        wait_until(settled, 30)
        assert len(got) == 80
        for m in members:
            m.close()
        assert all(p.close(5) for p in producers)
        assert loop.nodes == 0


def test_a_producer_of_its_own_thread_closed_from_its_callback(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # As on a loop: the callback runs in the thread that close() would join.
    with Store(str(tmp_path / "db"), cfg, sync=False):
        producer = Producer("self", cfg)
        assert producer.publish(b"warm").wait(20)
        closed: list[bool] = []
        with caplog.at_level(logging.ERROR):
            producer.publish(b"last").add_done_callback(lambda r: closed.append(producer.close(2)))
            wait_until(lambda: closed, 20)
            wait_until(lambda: not producer.running, 5)  # its thread ended, sockets closed
        assert closed == [True]
        assert "callback failed" not in caplog.text


class _FailingStep(Producer):
    """A node whose loop step fails every turn once ``failing`` names where: ``has_work`` (a
    bug of a subclass's hook), or the end of ``_loop_after`` or ``_loop_timers`` (a bug of
    the node's own); it counts its timer's runs and its before_wait calls."""

    failing = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ticks = 0
        self.waits = 0
        super().__init__(*args, **kwargs)
        self.call_soon(lambda: self.every(0.01, self._tick))

    def _tick(self, now: float) -> None:
        self.ticks += 1

    def has_work(self) -> bool:
        if self.failing == "has_work":
            raise RuntimeError("a bug in a subclass's hook")
        return super().has_work()

    def _loop_after(self) -> None:
        super()._loop_after()
        if self.failing == "_loop_after":
            raise RuntimeError("a bug in a subclass's hook")

    def _loop_timers(self, now: float) -> float:
        wait = super()._loop_timers(now)
        if self.failing == "_loop_timers":
            raise RuntimeError("a bug in a subclass's hook")
        return wait

    def before_wait(self) -> None:
        self.waits += 1
        super().before_wait()


@pytest.mark.parametrize("where", ["has_work", "_loop_after", "_loop_timers"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-thread", "shared-loop"])
def test_a_node_failing_in_its_loop_step_keeps_its_timers_and_its_before_wait(
    cfg: NodeConfig, caplog: pytest.LogCaptureFixture, shared: bool, where: str
) -> None:
    # A failing step ended a node's own I/O thread (Node._run called it unguarded), and in a
    # shared loop skipped the rest of the node's turn: its before_wait, and its next timer
    # due (the loop then timed it no more).
    loop = NodeLoop() if shared else None
    try:
        node = _FailingStep("failing", cfg, loop=loop)
        wait_until(lambda: node.ticks >= 3, 10)
        with caplog.at_level(logging.ERROR):
            node.failing = where
            ticks, waits = node.ticks, node.waits
            wait_until(lambda: node.ticks >= ticks + 20 and node.waits >= waits + 20, 10)
            assert "a bug in a subclass's hook" in caplog.text
        node.failing = ""
        assert node.close(5)
    finally:
        if loop is not None:
            loop.close()
