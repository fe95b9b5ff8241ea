"""Many nodes on one shared I/O thread (dafka.nodes.loop.NodeLoop), with a real
store process, tower and sockets."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.core import reach
from dafka.nodes.consumer import Consumer
from dafka.nodes.loop import NodeLoop
from dafka.nodes.producer import Producer
from dafka.store.node import Store
from tests.conftest import start_store_process, wait_until


def _node_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("dafka-producer", "dafka-consumer"))
    ]


def test_producers_and_a_consumer_share_one_thread(cfg: NodeConfig, tmp_path: Path) -> None:
    start_store_process(cfg, tmp_path / "db")
    with NodeLoop() as loop:
        consumer = Consumer("shared", cfg, offset_reset="earliest", loop=loop)
        producers = [Producer("shared", cfg, loop=loop) for _ in range(20)]
        assert _node_threads() == []  # no thread of their own
        assert loop.nodes == 21
        for i in range(50):
            for p in producers:
                p.publish(b"%d" % i)
        assert all(p.flush(30) for p in producers)  # the store's ACKs reached every one
        got: dict[str, list[bytes]] = {}

        def take() -> bool:
            for r in consumer.poll_batch(1000, 0.1):
                got.setdefault(r.partition, []).append(r.content)
            return sum(map(len, got.values())) >= 1000

        wait_until(take, 30)
        assert sorted(got) == sorted(p.address for p in producers)
        assert all(
            v == [b"%d" % i for i in range(50)] for v in got.values()
        )  # each partition in order
        for p in producers:
            assert p.close(5)
        consumer.close()
        assert loop.nodes == 0
        assert not any(p.running for p in producers)


def test_a_failing_node_and_a_leaving_node_leave_the_others_served(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    start_store_process(cfg, tmp_path / "db")
    with NodeLoop() as loop:
        broken, leaving, kept = (Producer("shared", cfg, loop=loop) for _ in range(3))

        def boom(frames: list[bytes]) -> None:
            raise RuntimeError("a bug in one node's reader")

        broken.on_data = boom  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="dafka.producer"):
            broken.publish(b"never acked")
            # Its ACK reaches a reader that fails...
            wait_until(lambda: "failed handling input" in caplog.text, 20)
            assert not broken.flush(0.5)
        leaving.publish(b"a")
        assert leaving.close(20)
        assert not leaving.running
        for i in range(100):
            kept.publish(b"%d" % i)
        assert kept.flush(20)  # ...and the loop went on for the others
        assert kept.running and loop.nodes == 2


def test_commands_before_the_loop_took_a_node_and_closing_the_loop(cfg: NodeConfig) -> None:
    loop = NodeLoop()
    ran = threading.Event()
    producer = Producer("shared", cfg, loop=loop)
    producer.call_soon(ran.set)
    assert ran.wait(5)
    assert producer.running
    consumer = Consumer("shared", cfg, loop=loop)
    assert loop.nodes == 2
    loop.close()  # closes the nodes still on it, without waiting for ACKs
    assert not producer.running and not consumer.running
    with pytest.raises(RuntimeError):
        Producer("shared", cfg, loop=loop)
    producer.close(0)  # closing a node the loop already closed is harmless
    consumer.close()


def test_an_idle_producer_on_a_loop_wakes_as_seldom_as_alone(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    # As test_scale's idle test, on a shared loop: its look at the sockets after
    # each turn must not make a node spin (every turn a node gets counts).
    cfg = dataclasses.replace(cfg, beacon_interval=1.0, beacon_timeout=5.0)  # the default
    with (
        Store(str(tmp_path / "db"), cfg, sync=False) as store,
        NodeLoop() as loop,
        Producer("idle", cfg, loop=loop) as producer,
    ):
        assert producer.publish(b"x").wait(10)
        wait_until(lambda: len(producer.peers) >= 1 and len(store.peers) >= 1, timeout=10)
        time.sleep(1.5)  # settled: the store's beacon and ACK repeats only
        turns0, loop0, t0 = producer.loop_turns, loop.turns, time.monotonic()
        time.sleep(4.0)
        elapsed = time.monotonic() - t0
        rate, loop_rate = (producer.loop_turns - turns0) / elapsed, (loop.turns - loop0) / elapsed
    assert rate < 4.5, rate
    assert loop_rate < 6, loop_rate


def test_the_tower_says_an_unchanged_reflection_again_only_after_a_while() -> None:
    plan = reach.ProbePlan(repeat=30.0)
    told = ("127.0.0.1", "tcp://127.0.0.1:4000", "ok")
    assert plan.should_reflect("A", told, 0.0)
    assert not any(plan.should_reflect("A", told, t) for t in range(1, 30))
    assert plan.should_reflect(
        "A", ("127.0.0.1", "tcp://127.0.0.1:4000", "refused"), 5.0
    )  # changed
    assert plan.should_reflect("A", told, 6.0)
    assert plan.should_reflect("A", told, 36.5)  # repeated
    plan.on_subscription(True, "A")  # (re)subscribed: told at once
    assert plan.should_reflect("A", told, 37.0)
    small = reach.ProbePlan(max_nodes=10)
    for i in range(1000):
        small.should_reflect(f"N{i}", told, 0.0)
    assert len(small.reflected) == 10  # bounded whatever a hostile mesh announces


def test_a_node_that_read_input_earlier_in_the_turn_still_runs_its_commands(cfg: NodeConfig) -> None:
    # Within one turn a node's data may be read before the loop's wake-up pipe:
    # its commands (call_soon, a consumer's wake) must still run in that turn,
    # or they wait for the node's next wake-up, which may never come.
    with NodeLoop() as loop, Producer("cmds", cfg, loop=loop) as producer:
        ran = threading.Event()
        outcome: list[bool] = []

        def in_the_loop() -> None:
            producer._commands.append(ran.set)
            loop._woken.append(producer)
            loop._read_wake({producer: None})  # the producer already had its input read this turn
            outcome.append(ran.is_set())

        producer.call_soon(in_the_loop)
        wait_until(lambda: outcome, 5)
    assert outcome == [True]


def test_a_node_turn_looks_at_its_timers_only_when_one_is_due_or_changed() -> None:
    # A shared loop runs a node's turn for every input; the timers are looked
    # at only when the earliest is due, or when one was added or rescheduled.
    from dafka.config import TowerAddress
    from dafka.nodes.node import Node

    node = Node(NodeConfig(towers=(TowerAddress("127.0.0.1", 1, 2),), bind="127.0.0.1"))
    try:
        now = time.monotonic()
        node._loop_timers(now)  # a full look: every timer just ran or is ahead
        due = node._timers_due
        assert due > now
        calls: list[float] = []
        node._timers.append((0.0, now, calls.append))  # behind its back: not seen until due
        node._loop_timers(now + 0.0001)
        assert calls == []
        node.every(0.01, calls.append)  # added: the next turn looks again
        node._loop_timers(now + 0.02)
        assert calls == [now + 0.02, now + 0.02]
        node._loop_timers(due + 0.01)  # due: a full look
        assert len(calls) > 2
    finally:
        node.stop()


class _WokenWhileDraining(NodeLoop):
    """A loop in which another thread signals (as ``wake()`` does) just as the loop empties its pipe."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        super().__init__("dafka-loop-test")

    def _drain_wake(self) -> None:
        if self.armed.is_set():
            self.armed.clear()
            other = threading.Thread(target=self._call, args=(lambda: None,))
            other.start()
            other.join(5)
        super()._drain_wake()


def test_a_wake_up_while_the_loop_empties_its_pipe_is_not_lost_for_later_ones() -> None:
    """The flag must be cleared after the pipe is emptied: a wake-up that came in between left
    the flag set with its byte read, and every later wake-up was lost (commit 9aaf322)."""
    loop = _WokenWhileDraining()
    try:
        loop.armed.set()
        first = threading.Event()
        loop._call(first.set)  # the loop drains: meanwhile another thread signals
        assert first.wait(5)
        assert not loop.armed.is_set()
        later = threading.Event()
        loop._call(later.set)  # a wake-up after that must still get through
        assert later.wait(3 * 1.0), "a wake-up was lost: the loop sleeps with a call queued"
    finally:
        loop.close(5)
