"""Issue 35.12: a hostile tower announcing thousands of made-up peers must not turn a node
into a port scanner (real processes: a rogue tower, a consumer; a producer here)."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig, TowerAddress
from dafka.nodes.producer import Producer
from tests.conftest import spawned, subprocess_env, wait_until
from tests.rogue_tower import RogueTower

ROOT = Path(__file__).resolve().parent.parent
# Made-up producers, each at its own endpoint (ZeroMQ makes one connection per endpoint),
# a listener here that accepts and closes: ZeroMQ then connects again, at its base interval.
FAKES = 1_500


class Sinks:
    """TCP listeners on 127.0.0.1 that accept every connection and close it, counting them."""

    def __init__(self, n: int) -> None:
        self.listeners = []
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(1024)
            s.setblocking(False)
            self.listeners.append(s)
        self.ports = [s.getsockname()[1] for s in self.listeners]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self.listeners:
            sel.register(s, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                for _ in range(1000):
                    try:
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    except (BlockingIOError, OSError):
                        break
                    conn.close()
                    self.accepted += 1
        sel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.listeners:
            s.close()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Lines:
    """A child's stdout lines, read in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.strip())

    def got(self) -> int:
        counts = [int(line.split()[1]) for line in list(self.lines) if line.startswith("got ")]
        return counts[-1] if counts else 0


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_a_tower_naming_thousands_of_fake_producers_gets_a_bounded_trickle_of_connections() -> None:
    sinks = Sinks(FAKES)
    env = subprocess_env()
    try:
        rogue = spawned(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "rogue_tower.py"), "flood", str(FAKES), *map(str, sinks.ports)],
                stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            )
        )
        assert rogue.stdout is not None
        _, in_port, out_port = rogue.stdout.readline().split()
        consumer = spawned(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "flood_consumer.py"), in_port, out_port, "flood"],
                stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            )
        )
        lines = Lines(consumer)
        cfg = NodeConfig(
            towers=(TowerAddress("127.0.0.1", int(in_port), int(out_port)),),
            bind="127.0.0.1",
            beacon_interval=0.2,
            beacon_timeout=2.0,
        )
        with Producer("flood", cfg, acks=False) as producer:
            for i in range(1000):  # bounded: one record every 20 ms while the flood goes on
                producer.publish(b"r%d" % i)
                if lines.got() >= 5:
                    break
                time.sleep(0.02)
            assert lines.got() >= 5, f"the consumer read {lines.got()} records; its output: {lines.lines[-5:]}"
            # The flood is on; measure a window of it.
            wait_until(lambda: sinks.accepted > 0, timeout=10)
            got0, accepted0, rss0, started = lines.got(), sinks.accepted, rss_mb(consumer.pid), time.monotonic()
            peak_fds = 0
            for i in range(150):  # 3 s
                producer.publish(b"w%d" % i)
                peak_fds = max(peak_fds, fds(consumer.pid))
                time.sleep(0.02)
            wait_until(lambda: lines.got() >= got0 + 100, timeout=5)  # it keeps consuming its real producer
            elapsed = time.monotonic() - started
            rate = (sinks.accepted - accepted0) / elapsed
            grown = rss_mb(consumer.pid) - rss0
        print(f"connections to fake peers {rate:.0f}/s, peak fds {peak_fds}, RSS grew {grown:.1f} MB")
        assert rate < 1_000, f"{rate:.0f} connections a second to made-up peers"
        assert peak_fds < 500, f"{peak_fds} descriptors open in the consumer"
        assert grown < 40, f"the consumer grew by {grown:.1f} MB in {elapsed:.1f}s"
        assert consumer.poll() is None  # still running
    finally:
        sinks.close()


class LyingTower(RogueTower):
    """A rogue tower that also tells every node a made-up reflection (how it sees it)."""

    def _forward(self) -> None:
        subscription = self.xpub.recv()
        if subscription[:2] == b"\x01R":
            address = subscription[2:]
            self.xpub.send_multipart([b"R" + address, b"10.66.66.66", b"tcp://10.66.66.66:1", b"ok"])
        if not (len(subscription) >= 2 and subscription[1:2] == b"W"):
            self.xsub.send(subscription)


@pytest.mark.parametrize("wait", [2.0, 4.0])
def test_doctor_marks_what_the_tower_says_and_summarises_many_peers(wait: float) -> None:
    """Issue 35.13: a tower announcing 200 made-up peers and a made-up reflection.  By 4 s
    every made-up peer has failed and been dropped (on a loaded machine, by 2 s): the doctor
    said "no other node on the mesh" and passed."""
    from dafka.cli import doctor

    sinks = Sinks(200)
    tower = LyingTower("flood", 200, sinks.ports).start()
    try:
        cfg = NodeConfig(
            towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
            bind="127.0.0.1",
            beacon_interval=0.2,
            beacon_timeout=2.0,
        )
        lines: list[str] = []
        assert not doctor.check(cfg, wait, lines.append, [])
        text = "\n".join(lines)
        assert len(lines) < 25, text
        said = [line for line in lines if "10.66.66.66" in line]
        assert said and all("the tower's word" in line or "the tower says" in line or "as the tower announces" in line
                            for line in said), text
        assert not any(line.startswith("ok ") and "10.66.66.66" in line and "tower's word" not in line for line in lines)
        assert any(line.startswith("info the tower announced 200 peer(s) (the tower's word") for line in lines), text
        assert any(line.startswith("info 200 peers: 0 reached, 200 not; examples:") for line in lines), text
        examples = sum(line.startswith("FAIL cannot reach peer") for line in lines)
        assert examples == doctor.EXAMPLES or "every one failed" in text, text  # (all dropped: none listed)
        assert "FAIL cannot reach 200 of 200 peer(s) announced by the tower" in text
        assert "relays what nodes send, as the C reference tower does" in text
    finally:
        tower.close()
        sinks.close()
