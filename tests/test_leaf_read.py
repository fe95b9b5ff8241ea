"""Leaf readers with real parts: a store's leaf port serving readers (hostile clients first, real
ZeroMQ on 127.0.0.1, LMDB in temp dirs), then store processes, a mesh producer publishing to a
commands topic and a LeafConsumer reading it live, across its own restart, a store killed -9 and
restarted, and a failover to the next endpoint."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig
from dafka.consumer import Consumer
from dafka.core import leafwire, wire
from dafka.nodes.leafread import LeafConsumer
from dafka.nodes.node import new_address
from dafka.nodes.producer import Producer
from dafka.store.node import Store
from tests.conftest import wait_until
from tests.test_leaf_mesh import start_store

CMD = "commands/dev-1"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(0)


def leaf_store(tmp: Path, **kw: Any) -> Store:
    return Store(str(tmp / "db"), leaves="127.0.0.1:0", **kw)


class RawReader:
    """A reader played by hand on a DEALER."""

    def __init__(self, ctx: zmq.Context, store: Store, **opts: int) -> None:
        self.address = new_address()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        assert store.leaves is not None
        self.sock.connect(f"tcp://127.0.0.1:{store.leaves.port}")

    def send(self, msg: Any) -> None:
        self.sock.send_multipart(leafwire.encode(msg))

    def read(self, subject: str = CMD) -> Any:
        self.send(leafwire.LeafRead(self.address, subject))
        return self.recv()

    def recv(self, timeout: float = 5.0) -> Any:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return leafwire.decode(self.sock.recv_multipart())

    def drain(self, timeout: float = 0.3) -> list[Any]:
        out = []
        while (msg := self.recv(timeout)) is not None:
            out.append(msg)
        return out


def publish_leaf(store: Store, topic: str, n: int, start: int = 0) -> str:
    """Records into the store through its own leaf port (a leaf producer), acknowledged."""
    assert store.leaves is not None
    with Producer(topic, leaf=f"127.0.0.1:{store.leaves.port}") as p:
        receipt = None
        for i in range(start, start + n):
            receipt = p.publish(b"c%d" % i)
        assert receipt is not None and receipt.wait(10)
        return p.address


# ---------------------------------------------------------------- hostile clients (in-process store)


def test_unknown_topic_and_too_many_topics_are_refused_and_the_port_keeps_serving(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    store = leaf_store(tmp_path, topics=["commands/dev-1", "a", "b", "c", "d"])
    try:
        r = RawReader(ctx, store)
        refused = r.read("not-kept")
        assert isinstance(refused, wire.StoreStatus) and refused.writing == 0 and "does not keep" in refused.reason
        for topic in ("a", "b", "c", "d"):
            assert isinstance(r.read(topic), leafwire.LeafReading)
        too_many = r.read(CMD)
        assert isinstance(too_many, wire.StoreStatus) and "at most 4 topics" in too_many.reason
        # The port still serves a reader on another connection.
        other = RawReader(ctx, store)
        assert isinstance(other.read(), leafwire.LeafReading)
        partition = publish_leaf(store, CMD, 3)
        got = [m for m in other.drain() if isinstance(m, wire.DirectRecord)]
        assert [(m.address, m.sequence, m.content) for m in got] == [(partition, i, b"c%d" % i) for i in range(3)]
    finally:
        store.close()


def test_fetch_flood_huge_positions_and_garbage_cost_bounded_answers(ctx: zmq.Context, tmp_path: Path) -> None:
    store = leaf_store(tmp_path)
    try:
        partition = publish_leaf(store, CMD, 100)
        r = RawReader(ctx, store, RCVHWM=100_000)
        reading = r.read()
        assert reading.partitions == (leafwire.ReadPartition(partition, 0, 99),) and reading.max_answer == 32
        for _ in range(5_000):
            r.send(wire.Fetch(partition, r.address, CMD, 0, 100_000))
        r.send(wire.Fetch(partition, r.address, CMD, 2**64 - 1, 2**32 - 1))  # a huge position: nothing held
        r.sock.send_multipart([b"R\xff\xfe"])  # garbage
        got = r.drain(0.5)
        records = [m for m in got if isinstance(m, wire.DirectRecord)]
        assert store.leaves is not None
        reads = store.leaves.reads
        assert reads.fetches_dropped > 4_000  # the flood was dropped, not answered
        assert len(records) <= 32 * (reads.fetches) and reads.fetches < 200
        assert {m.sequence for m in records} <= set(range(32))
        # The store keeps serving: a producer's records are acknowledged, another reader is answered.
        publish_leaf(store, "telemetry", 5)
        other = RawReader(ctx, store)
        assert isinstance(other.read(), leafwire.LeafReading)
        other.send(wire.Fetch(partition, other.address, CMD, 90, 100))
        answer = [m.sequence for m in other.drain() if isinstance(m, wire.DirectRecord)]
        assert answer == list(range(90, 100))
    finally:
        store.close()


def test_a_reader_that_never_reads_costs_its_queue_only(ctx: zmq.Context, tmp_path: Path) -> None:
    store = leaf_store(tmp_path)
    try:
        assert store.leaves is not None
        sleeper = RawReader(ctx, store, RCVHWM=1)
        sleeper.send(leafwire.LeafRead(sleeper.address, CMD))  # and never reads again
        wait_until(lambda: len(store.leaves.reads) == 1, timeout=5)  # type: ignore[union-attr]
        with LeafConsumer(CMD, leaf=f"127.0.0.1:{store.leaves.port}") as honest:
            t0 = time.monotonic()
            publish_leaf(store, CMD, 2_000)  # each commit pushes to both readers
            assert time.monotonic() - t0 < 20
            assert take(honest, 2_000) == [(i, b"c%d" % i) for i in range(2_000)]
            assert honest.poll(0.3) is None
    finally:
        store.close()


# ---------------------------------------------------------------- the device's LeafConsumer


def take(consumer: LeafConsumer, n: int, timeout: float = 20.0) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out.extend((r.offset, r.content) for r in consumer.poll_batch(n - len(out), timeout=0.2))
    return out


def test_consumer_reads_what_the_store_holds_then_live_and_resumes_at_its_position(tmp_path: Path) -> None:
    store = leaf_store(tmp_path)
    try:
        assert store.leaves is not None
        endpoint = f"127.0.0.1:{store.leaves.port}"
        partition = publish_leaf(store, CMD, 50)
        pos = tmp_path / "pos.json"
        with Consumer(CMD, leaf=endpoint, position=pos) as c:
            assert isinstance(c, LeafConsumer)
            assert take(c, 50) == [(i, b"c%d" % i) for i in range(50)]  # earliest: fetched
            publish_leaf(store, CMD, 3)  # a second partition, pushed live
            got = [(r.partition, r.offset) for r in c.poll_batch(3, timeout=10) + c.poll_batch(3, timeout=1)]
            assert len(got) == 3 and {o for _, o in got} == {0, 1, 2} and partition not in {p for p, _ in got}
        saved = json.loads(pos.read_text())["positions"]
        assert saved[partition] == 50 and len(saved) == 2
        # Closed; more published meanwhile; reopened: from its position, nothing twice.
        with Producer(CMD, leaf=endpoint, identity=None) as p:
            p.publish(b"late").wait(10)
        with LeafConsumer(CMD, leaf=endpoint, position=pos) as c:
            again = c.poll_batch(10, timeout=10) + c.poll_batch(10, timeout=0.5)
            assert [r.content for r in again] == [b"late"]
    finally:
        store.close()


def test_consumer_latest_skips_what_is_held(tmp_path: Path) -> None:
    store = leaf_store(tmp_path)
    try:
        assert store.leaves is not None
        endpoint = f"127.0.0.1:{store.leaves.port}"
        publish_leaf(store, CMD, 20)
        with LeafConsumer(CMD, leaf=endpoint, offset_reset="latest") as c:
            wait_until(lambda: c.reader.state == "active", timeout=10)
            assert c.poll(0.5) is None
    finally:
        store.close()


def test_mesh_commands_reach_a_leaf_reader_across_its_restart_and_a_store_kill(cfg: NodeConfig, tmp_path: Path) -> None:
    store, port = start_store(cfg, tmp_path / "s", leaves="127.0.0.1:0")
    endpoint = f"127.0.0.1:{port}"
    pos = tmp_path / "pos.json"
    total = 300
    with Producer(CMD, cfg) as p:
        c = LeafConsumer(CMD, leaf=endpoint, position=pos, poll_interval=1.0, connect_timeout=1.0)
        got: dict[int, bytes] = {}
        for i in range(100):
            p.publish(b"cmd-%d" % i)
        for offset, content in take(c, 100):
            assert offset not in got
            got[offset] = content
        assert sorted(got) == list(range(100))
        c.close()  # the device restarts (position saved) ...
        for i in range(100, 150):
            p.publish(b"cmd-%d" % i).wait(10)
        c = LeafConsumer(CMD, leaf=endpoint, position=pos, poll_interval=1.0, connect_timeout=1.0)
        for offset, content in take(c, 50):
            assert offset not in got
            got[offset] = content
        # ... and the store is killed -9 and restarted on its database meanwhile.
        store.send_signal(signal.SIGKILL)
        store.wait(10)
        receipts = [p.publish(b"cmd-%d" % i) for i in range(150, 200)]  # acknowledged once it is back
        store, _ = start_store(cfg, tmp_path / "s", leaves=endpoint)
        assert all(r.wait(30) for r in receipts)
        for i in range(200, total):
            p.publish(b"cmd-%d" % i)
        for offset, content in take(c, total - 150, timeout=40):
            assert offset not in got
            got[offset] = content
        c.close()
    assert got == {i: b"cmd-%d" % i for i in range(total)}
    store.send_signal(signal.SIGTERM)
    store.wait(15)


def test_reader_fails_over_to_the_next_endpoint(cfg: NodeConfig, tmp_path: Path) -> None:
    a, port_a = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    b, port_b = start_store(cfg, tmp_path / "b", leaves="127.0.0.1:0")
    with Producer(CMD, cfg) as p:
        c = LeafConsumer(CMD, leaf=f"127.0.0.1:{port_a},127.0.0.1:{port_b}", poll_interval=0.5, connect_timeout=1.0)
        try:
            for i in range(20):
                p.publish(b"cmd-%d" % i)
            first = take(c, 20)
            assert [o for o, _ in first] == list(range(20)) and c.endpoint == f"127.0.0.1:{port_a}"
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            receipts = [p.publish(b"cmd-%d" % i) for i in range(20, 60)]
            assert all(r.wait(20) for r in receipts)  # B acknowledges
            rest = take(c, 40, timeout=30)
            assert rest == [(i, b"cmd-%d" % i) for i in range(20, 60)]
            assert c.endpoint == f"127.0.0.1:{port_b}" and c.reader.failovers >= 1
        finally:
            c.close()
    b.send_signal(signal.SIGTERM)
    b.wait(15)


def test_a_device_reads_its_commands_on_its_producers_connection(cfg: NodeConfig, tmp_path: Path) -> None:
    """One DEALER per device: the reader rides the leaf producer's connection, and its failover."""
    a, port_a = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    b, port_b = start_store(cfg, tmp_path / "b", leaves="127.0.0.1:0")
    pos = tmp_path / "pos.json"
    with Producer(CMD, cfg) as commander, Producer(
        "telemetry", leaf=f"127.0.0.1:{port_a},127.0.0.1:{port_b}", ack_timeout=1.0, connect_timeout=1.0
    ) as device:
        c = device.reader(CMD, position=pos, poll_interval=0.5, connect_timeout=1.0)
        try:
            assert isinstance(c, LeafConsumer) and c.sock is device.sock
            for i in range(10):
                commander.publish(b"cmd-%d" % i)
            assert device.publish(b"21.5").wait(10)  # its own records acknowledged meanwhile
            assert take(c, 10) == [(i, b"cmd-%d" % i) for i in range(10)]
            assert device.link.bad_input == 0  # no reader message reached the producer's link
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            receipts = [commander.publish(b"cmd-%d" % i) for i in range(10, 30)]
            assert all(r.wait(20) for r in receipts)
            # The device publishes nothing meanwhile: its reader finds A silent, the producer moves to B.
            assert take(c, 20, timeout=30) == [(i, b"cmd-%d" % i) for i in range(10, 30)]
            assert device.endpoint == c.endpoint == f"127.0.0.1:{port_b}"
            assert device.publish(b"22.0").wait(20)
        finally:
            c.close()
        assert json.loads(pos.read_text())["positions"] == {commander.address: 30}
        # Closed: what the endpoint still pushes to it is dropped quietly, not taken for the producer's.
        assert commander.publish(b"after-close").wait(20)
        wait_until(lambda: device.reader_strays >= 1, timeout=10)
        assert device.link.bad_input == 0
    b.send_signal(signal.SIGTERM)
    b.wait(15)


def test_dafka_consume_leaf_resumes_at_its_position_file(tmp_path: Path) -> None:
    import subprocess

    from tests.conftest import dafka_cmd, subprocess_env

    store = leaf_store(tmp_path)
    try:
        assert store.leaves is not None
        endpoint = f"127.0.0.1:{store.leaves.port}"
        publish_leaf(store, CMD, 3)
        pos = str(tmp_path / "pos.json")

        def consume(count: int) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(
                dafka_cmd("consume", CMD, "--leaf", endpoint, "--position", pos, "--from-beginning",
                          "--count", str(count), "--timeout", "20"),
                capture_output=True, env=subprocess_env(), timeout=60,
            )

        first = consume(3)
        assert first.returncode == 0 and first.stdout == b"c0\nc1\nc2\n", first.stderr
        publish_leaf(store, CMD, 1, start=3)
        again = consume(1)
        assert again.returncode == 0 and again.stdout == b"c3\n", again.stderr
        refused = subprocess.run(dafka_cmd("consume", CMD, "--position", pos, "--timeout", "1"),
                                 capture_output=True, env=subprocess_env(), timeout=60)
        assert refused.returncode != 0 and b"--position" in refused.stderr
    finally:
        store.close()


def test_the_gateway_serves_readers_the_records_its_tank_clients_wrote(cfg: NodeConfig, tmp_path: Path) -> None:
    from dafka.tank.client import TankClient
    from dafka.tank.gateway import Gateway

    with Gateway(tmp_path / "gw", cfg, listen=("127.0.0.1", 0), leaves="127.0.0.1:0") as gw:
        assert gw.leaves is not None
        with TankClient("127.0.0.1", gw.tank_port) as tank:
            tank.create_topic("commands", 1)
            tank.produce("commands", 0, [b"held-before"])
            with LeafConsumer("commands", leaf=f"127.0.0.1:{gw.leaves.port}") as c:
                assert [r.content for r in c.poll_batch(5, timeout=10)] == [b"held-before"]
                tank.produce("commands", 0, [b"live-1", b"live-2"])  # pushed after the gateway's commit
                got = c.poll_batch(5, timeout=10)
                got += c.poll_batch(5, timeout=0.5) if len(got) < 2 else []
                assert [r.content for r in got] == [b"live-1", b"live-2"]
                assert gw.leaves.reads.pushed == 2  # pushed at the commit, not found by a later LEAF-READ


def test_bench_scale_leaves_with_readers_prints_what_they_got() -> None:
    import re
    import subprocess

    from tests.conftest import dafka_cmd, subprocess_env

    run = subprocess.run(
        dafka_cmd("bench", "scale", "--leaves", "10", "--readers", "5", "--procs", "2", "--seconds", "1"),
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("scale:") and "all acked" in x][-1]
    found = re.search(r"readers 5 got (\d+) of (\d+) commands, lag p50 [\d.]+ p99 [\d.]+ ms", line)
    assert found and found.group(1) == found.group(2) and int(found.group(2)) >= 5, line
