"""A node leaving a peer whose message it has begun to read must not abort.

libzmq 4.3 aborts the whole process (``Assertion failed: !_more (src/fq.cpp:80)``)
when a SUB is disconnected from the endpoint whose multipart message it has
begun to read.  ZMQ_EVENTS and poll read a waiting message's first frame
ahead, and every node asks them all the time (``data_waiting``, its poller, a
shared loop), so a peer that goes silent right after sending was enough: the
store of ``bench group --partitions 1000`` died this way.

A busy reader, too, must not judge by what it has not read yet: a hole whose
answer waits unread is not given up.

The scenarios run in a child process: the abort kills the process, and here
it must show as a failed test, not take pytest with it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SETUP = """
import time, zmq
from dafka.config import NodeConfig, TowerAddress
from dafka.core import wire
from dafka.core.peers import Disconnect

def peer_and_node(node_class):
    node = node_class(NodeConfig(towers=(TowerAddress("127.0.0.1", 1, 2),), bind="127.0.0.1"))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also a reconnected SUB's
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    node.sub.connect(endpoint)
    return node, pub, endpoint

def wait(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)

def driven_consumer(**options):
    # A consumer of topic t whose loop is driven here, subscribed at the peer.
    from dafka.nodes.consumer import Consumer
    class Driven(Consumer):
        def start(self):
            pass
    node, pub, endpoint = peer_and_node(lambda cfg: Driven("t", cfg, offset_reset="earliest", **options))
    wait(lambda: pub.poll(10) and pub.recv()[:1] == b"\\x01")
    return node, pub, endpoint

def with_hole(node, pub):
    # Record 3 of partition B...B read: offsets 0..2 missing.
    pub.send_multipart(wire.encode(wire.Record("t", "B" * 32, "t", 3, b"r3")))
    wait(node.data_waiting)
    node._read_data()

def prefetched(node, pub, frames):
    pub.send_multipart(frames)
    # ZMQ_EVENTS reads the first frame ahead (as every poll of the node does).
    wait(node.data_waiting)
"""


def run(script: str) -> subprocess.CompletedProcess[str]:
    code = SETUP + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def check(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "DONE" in result.stdout, result.stdout + result.stderr


@pytest.mark.timeout(90)
def test_dropping_a_peer_whose_message_was_read_ahead_keeps_the_node_and_the_message() -> None:
    check(
        run(
            """
            from dafka.nodes.node import Node
            got = []
            class Recorder(Node):
                kind = "consumer"
                def on_data(self, frames):
                    got.append(frames)
            node, pub, endpoint = peer_and_node(Recorder)
            node.subscribe(b"Z")
            wait(lambda: pub.poll(10) and pub.recv() == b"\\x01Z")
            prefetched(node, pub, [b"Z1", b"tail"])
            node._apply_peer_action(Disconnect(endpoint, "A" * 32))  # the peer went silent
            node._read_data()  # libzmq aborted here
            node._read_data()
            assert got == [[b"Z1", b"tail"]], got
            node.stop()
            print("DONE")
            """
        )
    )


@pytest.mark.timeout(90)
def test_a_consumer_keeps_a_record_read_ahead_from_a_dropped_peer() -> None:
    # A reader's held message goes through its slow path: the record is delivered.
    check(
        run(
            """
            node, pub, endpoint = driven_consumer()
            partition = "B" * 32
            record = wire.encode(wire.Record("t", partition, "t", 0, b"hello"))
            prefetched(node, pub, record)
            node._apply_peer_action(Disconnect(endpoint, partition))
            node._read_data()
            node._read_data()
            records = [r.content for r in node._queue]
            assert records == [b"hello"], records
            node.stop()
            print("DONE")
            """
        )
    )


@pytest.mark.timeout(90)
def test_held_messages_wait_while_reading_is_paused_and_are_bounded() -> None:
    check(
        run(
            """
            from dafka.nodes import channels as channels_module
            from dafka.nodes.node import Node
            got = []
            class Recorder(Node):
                kind = "consumer"
                def on_data(self, frames):
                    got.append(frames)
            channels_module.HELD_MAX_BYTES = 10_000
            node, pub, endpoint = peer_and_node(Recorder)
            node.subscribe(b"Z")
            wait(lambda: pub.poll(10) and pub.recv() == b"\\x01Z")
            node.data_paused = True  # a full consumer queue: nothing is read
            prefetched(node, pub, [b"Z1", b"x" * 6000])
            node._disconnect_data(node.sub, endpoint)
            assert len(node._held) == 1 and node._held_bytes == 6002
            assert not node._loop_spins()  # paused: held, not handled
            node.sub.connect(endpoint)  # back (as after a cut)
            wait(lambda: pub.poll(10) and pub.recv() == b"\\x01Z")
            prefetched(node, pub, [b"Z2", b"y" * 6000])
            node._disconnect_data(node.sub, endpoint)  # over the bound: counted, not held
            assert node.held_dropped == 1 and len(node._held) == 1
            node.data_paused = False
            assert node._loop_spins()  # handled at the end of the turn, with no new input
            node._loop_after()
            assert got == [[b"Z1", b"x" * 6000]], [f[0] for f in got]
            assert node._held_bytes == 0 and not node._loop_spins()
            node.stop()
            print("DONE")
            """
        )
    )


@pytest.mark.timeout(90)
def test_no_hole_is_given_up_while_its_answer_may_wait_unread() -> None:
    # A busy reader's tick comes while the FETCH's answer waits in the socket:
    # giving the hole up then (a store ACKs past it) would be for nothing.
    check(
        run(
            """
            from dafka.nodes import reader as reader_module
            node, pub, endpoint = driven_consumer(skip_after=0.2, retry_interval=0.05)
            partition = "B" * 32
            with_hole(node, pub)  # 0..2 missing
            t0 = time.monotonic()
            node.check_missing(t0)  # asks for them
            pub.send_multipart(wire.encode(wire.DirectRecord(node.address, partition, "t", 0, b"r0")))
            wait(node.data_waiting)  # the answer waits unread
            for k in range(1, 5):  # ticks: stalled long enough, but the answer is there
                node.check_missing(t0 + 0.25 * k)
            assert node.skipped == 0, node.skipped
            now = t0 + 1.0
            while now < t0 + reader_module.BEHIND_GRACE + 1.0:  # bounded: behind for too long
                now += 0.25
                node.check_missing(now)
            assert node.skipped == 3, node.skipped
            node.stop()
            print("DONE")
            """
        )
    )


@pytest.mark.timeout(90)
def test_a_starved_reader_gives_no_hole_up_for_the_time_it_could_not_ask() -> None:
    check(
        run(
            """
            node, pub, endpoint = driven_consumer(skip_after=2.0, retry_interval=0.05)
            with_hole(node, pub)  # 0..2 missing
            t0 = time.monotonic()
            node.check_missing(t0)  # asks
            node.check_missing(t0 + 15.0)  # the next check, 15 s later: the thread was starved
            assert node.skipped == 0, node.skipped
            now = t0 + 15.0
            while now < t0 + 18.0:  # then ticks again, and nobody answers
                now += 0.1
                node.check_missing(now)
            assert node.skipped == 3, node.skipped
            node.stop()
            print("DONE")
            """
        )
    )


@pytest.mark.timeout(90)
def test_a_reader_late_at_every_check_still_gives_a_hole_up() -> None:
    check(
        run(
            """
            from dafka.nodes import reader as reader_module
            node, pub, endpoint = driven_consumer(skip_after=1.0, retry_interval=0.05)
            with_hole(node, pub)  # 0..2 missing, and nobody answers
            now = time.monotonic()
            limit = now + reader_module.UNHEARD_LIMIT * 1.0 + 5.0
            while node.skipped == 0 and now < limit:
                now += 1.5  # every check comes late
                node.check_missing(now)
            assert node.skipped == 3, node.skipped
            node.stop()
            print("DONE")
            """
        )
    )
