"""Leaf devices on a real mesh, several processes: a tower, stores (`dafka store --leaves`),
a leaf device process, mesh consumers.  The leaf's partition reaches mesh consumers and the
other store; the endpoint killed -9 loses nothing it acknowledged; failover to a second
endpoint loses nothing and duplicates nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dafka.config import NodeConfig
from dafka.consumer import Consumer
from dafka.store.db import RecordDB
from tests.conftest import ROOT, dafka_cmd, spawned, subprocess_env, tower_flag, wait_until

TOPIC = "readings"


def start_store(cfg: NodeConfig, db: Path, leaves: str | None = None) -> tuple[subprocess.Popen, int | None]:
    cmd = dafka_cmd("store", "--db", str(db), "--tower", tower_flag(cfg), "--bind", "127.0.0.1")
    if leaves:
        cmd += ["--leaves", leaves]
    proc = spawned(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=subprocess_env()))
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert "store up" in line, line
    found = re.search(r"leaves on [\d.]+:(\d+)", line)
    return proc, int(found.group(1)) if found else None


class Device:
    """tests/leaf_device.py in a process of its own; its lines collected by a thread."""

    def __init__(self, endpoints: str, identity: Path, total: int | str, pause: float, ack_timeout: float) -> None:
        self.proc = spawned(subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "leaf_device.py"), endpoints, str(identity), str(total),
             str(pause), str(ack_timeout)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), text=True,
        ))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    @property
    def address(self) -> str:
        start = wait_until(lambda: next((x for x in self.lines if x.startswith("start ")), None))
        return str(start.split()[2])

    @property
    def start(self) -> int:
        start = wait_until(lambda: next((x for x in self.lines if x.startswith("start ")), None))
        return int(start.split()[1])

    def acked(self) -> int:
        values = [int(x.split()[1]) for x in list(self.lines) if x.startswith("acked ")]
        return max(values, default=-1)

    def done(self, timeout: float) -> None:
        wait_until(lambda: "done" in self.lines or self.proc.poll() is not None, timeout=timeout)
        if "done" not in self.lines:
            err = self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""
            raise AssertionError(f"device did not finish: {self.lines[-5:]} {err[-2000:]}")


def read_all(cfg: NodeConfig, partition: str, total: int, timeout: float = 30.0) -> dict[int, bytes]:
    """Every record of the leaf's partition a fresh mesh consumer reads (each offset once)."""
    got: dict[int, bytes] = {}
    with Consumer(TOPIC, cfg, offset_reset="earliest") as consumer:
        deadline = time.monotonic() + timeout
        while len(got) < total and time.monotonic() < deadline:
            record = consumer.poll(0.2)
            if record is None or record.partition != partition:
                continue
            assert record.offset not in got, f"offset {record.offset} delivered twice"
            got[record.offset] = record.content
    return got


def test_a_leafs_partition_reaches_mesh_consumers_and_the_other_store(cfg: NodeConfig, tmp_path: Path) -> None:
    a, port = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    start_store(cfg, tmp_path / "b")
    total = 100
    got: dict[int, bytes] = {}
    # A live reader (latest) learns of the partition only from what reaches the mesh: the relay.
    with Consumer(TOPIC, cfg) as live:
        wait_until(lambda: len(live.peers) >= 2, timeout=15)
        device = Device(f"127.0.0.1:{port}", tmp_path / "id.json", total, 0.005, 5.0)
        partition = device.address
        deadline = time.monotonic() + 15
        while len(got) < total and time.monotonic() < deadline:
            record = live.poll(0.2)
            if record is not None and record.partition == partition:
                assert record.offset not in got, f"offset {record.offset} delivered twice"
                got[record.offset] = record.content
    assert got == {i: b"rec-%d" % i for i in range(total)}
    device.done(30)
    # The endpoint gone at once, the other store alone serves the leaf's partition: it took the relay.
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    assert read_all(cfg, partition, total, timeout=15) == got


def test_failover_and_kill_9_of_the_endpoint_lose_nothing_acknowledged(cfg: NodeConfig, tmp_path: Path) -> None:
    a, port_a = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    b, port_b = start_store(cfg, tmp_path / "b", leaves="127.0.0.1:0")
    total = 300
    device = Device(f"127.0.0.1:{port_a},127.0.0.1:{port_b}", tmp_path / "id.json", total, 0.01, 2.0)
    partition = device.address
    wait_until(lambda: device.acked() >= 50, timeout=30)
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    acked_by_a = device.acked()  # A acknowledged at least this much before it died
    device.done(60)
    assert f"endpoint 127.0.0.1:{port_b}" in device.lines
    # A restarted on its database: everything it acknowledged is there.
    a, _ = start_store(cfg, tmp_path / "a", leaves=f"127.0.0.1:{port_a}")
    got = read_all(cfg, partition, total)
    assert got == {i: b"rec-%d" % i for i in range(total)}  # no loss, no duplicate
    a.send_signal(signal.SIGTERM)
    a.wait(15)
    b.send_signal(signal.SIGKILL)
    b.wait(10)
    db = RecordDB(str(tmp_path / "a"))
    try:
        held = {r.offset: r.content for r in db.read(TOPIC, partition, 0, total)}
    finally:
        db.close()
    assert all(held.get(i) == b"rec-%d" % i for i in range(acked_by_a + 1)), (acked_by_a, sorted(held)[:5])
    assert os.path.exists(tmp_path / "id.json")


def test_mesh_readers_pass_a_restarted_leafs_hole_at_once(cfg: NodeConfig, tmp_path: Path) -> None:
    # A leaf device killed -9 and restarted on its identity file continues at its
    # reservation: the offsets it reserved and never used are a hole.  Before the leaf
    # stated it (VOID kind 1, through its endpoint), every mesh reader waited skip_after
    # (10 s) to pass it: a consumer that gives up after 4 s without a record got none
    # of what the restarted device published.
    a, port = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    start_store(cfg, tmp_path / "b")  # a second store: readers pass the hole once both said they hold none
    identity = tmp_path / "id.json"
    old = Device(f"127.0.0.1:{port}", identity, 10**9, 0.01, 5.0)
    partition = old.address
    wait_until(lambda: old.acked() >= 30, timeout=30)
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait(10)
    acked = old.acked()
    got: dict[int, bytes] = {}
    with Consumer(TOPIC, cfg, offset_reset="earliest") as consumer:

        def poll_until(done: Callable[[], bool], idle: float) -> None:
            """Poll until ``done()`` or no record came for ``idle`` seconds (bounded: 60 s)."""
            deadline = time.monotonic() + 60
            last = time.monotonic()
            while not done() and time.monotonic() - last < idle and time.monotonic() < deadline:
                record = consumer.poll(0.1)
                if record is not None and record.partition == partition:
                    assert record.offset not in got, f"offset {record.offset} delivered twice"
                    got[record.offset] = bytes(record.value)
                    last = time.monotonic()

        poll_until(lambda: max(got, default=-1) >= acked, idle=30)
        assert all(got.get(i) == b"rec-%d" % i for i in range(acked + 1)), f"got {len(got)} of {acked + 1}"
        new = Device(f"127.0.0.1:{port}", identity, "+200", 0.002, 5.0)
        start = new.start
        assert start > max(got) + 1  # the hole: reserved by the killed run, never used
        published = time.monotonic()
        poll_until(lambda: all(o in got for o in range(start, start + 200)), idle=4.0)
        took = time.monotonic() - published
    fresh = [o for o in range(start, start + 200) if got.get(o) == b"rec-%d" % o]
    assert len(fresh) == 200, (
        f"the consumer got {len(fresh)} of the 200 records published after the restart"
        f" (next offset {start}, the killed run ended at {max(o for o in got if o < start)})"
    )
    assert took < 4.0, f"all 200 took {took:.1f}s"
    new.done(30)  # and every one acknowledged: the endpoint passed the hole too


def test_dafka_produce_leaf(cfg: NodeConfig, tmp_path: Path) -> None:
    store, port = start_store(cfg, tmp_path / "a", leaves="127.0.0.1:0")
    run = subprocess.run(
        dafka_cmd("produce", TOPIC, "--leaf", f"127.0.0.1:{port}", "--identity", str(tmp_path / "id.json")),
        input=b"one\ntwo\nthree\n", capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert b"published 3 records, all acknowledged" in run.stderr
    again = subprocess.run(
        dafka_cmd("produce", TOPIC, "--leaf", f"127.0.0.1:{port}", "--identity", str(tmp_path / "id.json")),
        input=b"four\n", capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert again.returncode == 0, again.stderr
    import json

    partition = json.loads((tmp_path / "id.json").read_text())["address"]
    got = read_all(cfg, partition, 4, timeout=15)
    assert got == {0: b"one", 1: b"two", 2: b"three", 3: b"four"}  # the identity continues the partition
    bad = subprocess.run(dafka_cmd("produce", TOPIC, "--leaf", "nohost"), input=b"", capture_output=True,
                         env=subprocess_env(), timeout=60)
    assert bad.returncode != 0 and b"HOST:PORT" in bad.stderr


def test_bench_scale_leaves_prints_its_summary_line() -> None:
    run = subprocess.run(
        dafka_cmd("bench", "scale", "--leaves", "20", "--procs", "2", "--seconds", "1"),
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("scale:") and "all acked" in x][-1]
    assert re.search(r"leaves 20\b.*servers [\d.]+%.*the whole [\d.]+%.*all acked: True.*ACK p50 [\d.]+ .*p99 [\d.]+ .*ms", line), line
    threads = [x for x in run.stdout.splitlines() if x.startswith("scale: device threads:")]
    assert threads and re.search(r"[\d.]+ µs a record: app [\d.]+, LeafLoop [\d.]+, ZeroMQ I/O [\d.]+, other [\d.]+",
                                 threads[-1]), run.stdout
