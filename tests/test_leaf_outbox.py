"""A leaf producer with an outbox (``Producer(topic, leaf=..., outbox=DIR)``): the mesh producer's outbox
semantics. Offline, closed and reopened, killed -9 and restarted, failed over: nothing published is lost
(what ``publish`` returned for is on disk and reaches a store), nothing acknowledged is lost, no offset is
delivered twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.nodes.producer import Producer
from dafka.outbox import describe
from dafka.store.db import RecordDB
from dafka.store.node import Store
from tests.conftest import ROOT, spawned, subprocess_env, wait_until
from tests.test_leaf_mesh import read_all, start_store

TOPIC = "readings"


def stored(db: Path, partition: str, total: int) -> dict[int, bytes]:
    rdb = RecordDB(str(db))
    try:
        return {r.offset: r.content for r in rdb.read(TOPIC, partition, 0, total + 10)}
    finally:
        rdb.close()


def test_offline_closed_and_reopened_then_the_endpoint_comes(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "db"), cfg, sync=False, leaves="127.0.0.1:0") as store:
        assert store.leaves is not None
        endpoint = store.leaves.endpoint  # then gone: the device is offline
    box = tmp_path / "box"
    with Producer(TOPIC, leaf=endpoint, outbox=str(box), connect_timeout=0.3) as leaf:
        partition = leaf.address
        for i in range(20):
            leaf.publish(b"rec-%d" % i)  # returns once on the outbox's disk
        assert not leaf.close(0.5)  # nobody acknowledged
    assert describe(box)["records"] == 20
    with Producer(TOPIC, leaf=endpoint, outbox=str(box), connect_timeout=0.3) as leaf:
        assert leaf.address == partition and leaf.next_offset == 20  # the outbox knows the partition
        for i in range(20, 30):
            leaf.publish(b"rec-%d" % i)
        with Store(str(tmp_path / "db"), cfg, sync=False, leaves=endpoint):
            assert leaf.flush(30)
            assert leaf.acked_offset == 29
    assert stored(tmp_path / "db", partition, 30) == {i: b"rec-%d" % i for i in range(30)}
    wait_until(lambda: describe(box)["records"] == 0, timeout=5)  # acknowledged: out of the outbox


def test_a_leaf_outbox_drops_oldest_at_its_limit_and_says_so(tmp_path: Path) -> None:
    from dafka.errors import PublishError

    with Producer(TOPIC, leaf="127.0.0.1:9", outbox=str(tmp_path / "box"), outbox_max_bytes=2000,
                  outbox_policy="drop_oldest", connect_timeout=0.3) as leaf:
        receipts = [leaf.publish(b"x" * 100) for _ in range(40)]
        assert leaf._outbox.evicted > 0  # type: ignore[attr-defined]
        assert receipts[0].failed() and not receipts[0].acked()
        with pytest.raises(PublishError, match="evicted"):
            receipts[0].wait(1)
        leaf.close(0.2)
    assert describe(tmp_path / "box")["records"] < 40


class Device:
    """tests/leaf_outbox_device.py in a process; its lines collected by a thread."""

    def __init__(self, endpoints: str, box: Path, total: int, pause: float = 0.005, ack_timeout: float = 2.0) -> None:
        self.proc = spawned(subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "leaf_outbox_device.py"), endpoints, str(box), str(total),
             str(pause), str(ack_timeout)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), text=True,
        ))
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def start(self) -> tuple[int, str]:
        line = wait_until(lambda: next((x for x in self.lines if x.startswith("start ")), None), timeout=30)
        _, nxt, address = line.split()
        return int(nxt), address

    def last(self, what: str) -> int:
        return max((int(x.split()[1]) for x in list(self.lines) if x.startswith(what + " ")), default=-1)

    def done(self, timeout: float) -> None:
        wait_until(lambda: "done" in self.lines or self.proc.poll() is not None, timeout=timeout)
        assert "done" in self.lines, (self.lines[-5:], self.proc.stderr.read()[-2000:] if self.proc.stderr else "")


def test_a_device_killed_and_restarted_on_its_outbox_loses_nothing_it_published(cfg: NodeConfig, tmp_path: Path) -> None:
    store, port = start_store(cfg, tmp_path / "db", leaves="127.0.0.1:0")
    box, total = tmp_path / "box", 400
    first = Device(f"127.0.0.1:{port}", box, total)
    _, partition = first.start()
    wait_until(lambda: first.last("acked") >= 50, timeout=30)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    durable, acked = first.last("durable"), first.last("acked")
    second = Device(f"127.0.0.1:{port}", box, total)
    nxt, again = second.start()
    assert again == partition and nxt >= durable + 1  # the outbox's partition, past all it made durable
    second.done(60)
    got = read_all(cfg, partition, total, timeout=20)
    assert got == {i: b"rec-%d" % i for i in range(total)}  # everything once, at its offset
    store.send_signal(signal.SIGTERM)
    store.wait(15)
    held = stored(tmp_path / "db", partition, total)
    assert set(held) == set(range(total)) and acked >= 50


def test_failover_with_an_outbox_loses_nothing_and_duplicates_nothing(cfg: NodeConfig, tmp_path: Path) -> None:
    a, port_a = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    b, port_b = start_store(cfg, tmp_path / "b", leaves="127.0.0.1:0")
    total = 300
    device = Device(f"127.0.0.1:{port_a},127.0.0.1:{port_b}", tmp_path / "box", total, pause=0.01, ack_timeout=1.0)
    _, partition = device.start()
    wait_until(lambda: device.last("acked") >= 50, timeout=30)
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    acked_by_a = device.last("acked")
    device.done(60)
    assert f"endpoint 127.0.0.1:{port_b}" in device.lines
    a, _ = start_store(cfg, tmp_path / "a", leaves=f"127.0.0.1:{port_a}")
    assert read_all(cfg, partition, total) == {i: b"rec-%d" % i for i in range(total)}
    for proc in (a, b):
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    held_a = stored(tmp_path / "a", partition, total)
    assert all(held_a.get(i) == b"rec-%d" % i for i in range(acked_by_a + 1))  # what A acknowledged, A kept
    assert describe(tmp_path / "box")["records"] == 0


def test_dafka_produce_leaf_with_an_outbox(cfg: NodeConfig, tmp_path: Path) -> None:
    from tests.conftest import dafka_cmd

    store, port = start_store(cfg, tmp_path / "db", leaves="127.0.0.1:0")
    run = subprocess.run(
        dafka_cmd("produce", TOPIC, "--leaf", f"127.0.0.1:{port}", "--outbox", str(tmp_path / "box")),
        input=b"one\ntwo\nthree\n", capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert run.returncode == 0 and b"published 3 records, all acknowledged" in run.stderr, run.stderr
    info = describe(tmp_path / "box")
    assert info["records"] == 0 and info["next"] == 3
    store.send_signal(signal.SIGTERM)
    store.wait(15)
    assert stored(tmp_path / "db", str(info["partition"]), 3) == {0: b"one", 1: b"two", 2: b"three"}


def test_records_the_outbox_evicts_resolve_their_waiters_and_callbacks_at_once(tmp_path: Path) -> None:
    # Offline, drop_oldest: records evicted by age (at the loop's tick) and by size (by a
    # publish) are failed. A thread waiting on such a receipt learns it then, not at its
    # timeout; their callbacks run then, not at close (nothing acknowledges anything here:
    # no ACK pass would ever notify them).
    import time

    from dafka.errors import PublishError

    with Producer(TOPIC, leaf="127.0.0.1:9", outbox=str(tmp_path / "box"), outbox_max_age=0.2,
                  outbox_max_bytes=2000, outbox_policy="drop_oldest", connect_timeout=0.3) as leaf:
        failed: list[int] = []
        outcome: dict[int, object] = {}

        def wait_on(receipt: object) -> None:
            t0 = time.monotonic()
            try:
                receipt.wait(8.0)  # type: ignore[attr-defined]
                outcome[receipt.offset] = "returned"  # type: ignore[attr-defined]
            except PublishError:
                outcome[receipt.offset] = time.monotonic() - t0  # type: ignore[attr-defined]

        old = leaf.publish(b"old", lambda r: failed.append(r.offset) if r.failed() else None)  # evicted by age
        waiter = threading.Thread(target=wait_on, args=(old,))
        waiter.start()
        waiter.join(10.0)
        assert isinstance(outcome.get(old.offset), float) and outcome[old.offset] < 4.0, outcome  # type: ignore[operator]
        wait_until(lambda: failed == [old.offset], timeout=4.0)
        leaf.close(0.2)

    with Producer(TOPIC, leaf="127.0.0.1:9", outbox=str(tmp_path / "box2"), outbox_max_bytes=2000,
                  outbox_policy="drop_oldest", connect_timeout=30.0) as leaf:  # (no tick for 30 s)
        failed.clear()
        first = leaf.publish(b"y" * 100, lambda r: failed.append(r.offset) if r.failed() else None)
        waiter = threading.Thread(target=wait_on, args=(first,))
        waiter.start()
        for _ in range(30):  # evicted by size (2000 bytes): by one of these publishes
            leaf.publish(b"y" * 100)
        waiter.join(10.0)
        assert isinstance(outcome.get(first.offset), float) and outcome[first.offset] < 4.0, outcome  # type: ignore[operator]
        wait_until(lambda: failed == [first.offset], timeout=4.0)
        leaf.close(0.2)


def test_an_offline_leaf_evicts_by_age_on_time_whatever_its_failover_timers(tmp_path: Path) -> None:
    # outbox_max_age under drop_oldest: a record older than it is evicted about then, not at
    # the link's next timer (offline, the next endpoint is tried after connect_timeout, doubled
    # after each failover: 5 s here, then up to 40 s).
    import time

    with Producer(TOPIC, leaf="127.0.0.1:9", outbox=str(tmp_path / "box"), outbox_max_age=0.3,
                  outbox_policy="drop_oldest", connect_timeout=5.0) as leaf:
        t0 = time.monotonic()
        receipt = leaf.publish(b"old")
        wait_until(receipt.failed, timeout=3.0)
        assert time.monotonic() - t0 < 3.0 and leaf._outbox.evicted == 1  # type: ignore[attr-defined]
        leaf.close(0.2)


def test_a_closed_leaf_is_no_longer_ticked_by_its_shared_loop(tmp_path: Path) -> None:
    # A shared loop ticks a member while something is due; once closed (detached) it is not
    # ticked again (a tick would run its outbox's age evictions on the closed outbox: records
    # kept on disk for the next start evicted in memory, and a warning saying so).
    from dafka.nodes.leaf import LeafLoop

    loop = LeafLoop()
    try:
        leaf = Producer(TOPIC, leaf="127.0.0.1:9", outbox=str(tmp_path / "box"), outbox_max_age=30.0,
                        outbox_policy="drop_oldest", connect_timeout=30.0, loop=loop)
        leaf.publish(b"kept")
        wait_until(lambda: leaf in loop._ticking, timeout=5.0)  # (its link's HELLO and the record's age are due)
        assert not leaf.close(0.1)
        assert leaf not in loop._ticking and leaf._outbox.evicted == 0  # type: ignore[attr-defined]
    finally:
        loop.close()
    assert describe(tmp_path / "box")["records"] == 1
