"""A consumer whose whole network is cut, towers included, holds its holes (issue 40).

Peers are not expired while no tower is heard (discovery), so such a consumer never
learns that its stores are gone; its towers' silence must count as that, or a hole it
knows would be skipped after ``skip_after`` over records its stores hold.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig, TowerAddress
from dafka.nodes.consumer import Consumer
from tests.conftest import (
    dafka_cmd,
    spawned,
    start_store_process,
    subprocess_env,
    wait_until,
)
from tests.docs_runner import free_port


def test_a_consumer_whose_towers_fall_silent_counts_its_holes_unheard(cfg: NodeConfig) -> None:
    with Consumer("cut", cfg) as c:
        assert c.owner_hears("P")
        wait_until(lambda: c.tower_watch.heard_at is not None, timeout=10)  # the tower is heard
        assert c.owner_hears("P")
        c.tower_watch.heard_at = time.monotonic() - 10 * c._quiet_limit  # silent for long
        assert not c.owner_hears("P")
        wait_until(lambda: c.owner_hears("P"), timeout=10)  # heard again: holes go on as before


def test_a_consumer_without_towers_is_not_held_by_their_silence() -> None:
    with Consumer("cut", NodeConfig(towers=(), bind="127.0.0.1")) as c:
        assert c.tower_watch.heard_at is None
        assert c.owner_hears("P")


def _tower_process() -> tuple[subprocess.Popen, TowerAddress]:
    in_port, out_port = free_port(), free_port()
    proc = spawned(subprocess.Popen(
        dafka_cmd("tower", "--bind", "127.0.0.1", "--in-port", str(in_port), "--out-port", str(out_port)),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=subprocess_env(),
    ))
    assert proc.stdout is not None and b"tower up" in proc.stdout.readline()
    return proc, TowerAddress("127.0.0.1", in_port, out_port)


# A producer process: a backlog, acknowledged, then a record every 10 ms (live).
_PRODUCER = """
import sys, time
from dafka.config import NodeConfig, TowerAddress
from dafka.nodes.producer import Producer
host, tin, tout, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = NodeConfig(towers=(TowerAddress(host, tin, tout),), bind="127.0.0.1", beacon_interval=0.2, beacon_timeout=2.0)
with Producer("cutoff", cfg) as p:
    deadline = time.monotonic() + 20
    while not p.peers and time.monotonic() < deadline:
        time.sleep(0.02)
    last = p.publish_many([b"r%d" % i for i in range(n)])
    assert p.flush(60) and last is not None and last.acked()
    print("backlog acknowledged", flush=True)
    for i in range(n, n + 100_000):
        p.publish(b"r%d" % i)
        time.sleep(0.01)
"""


@pytest.mark.timeout(120)
def test_a_consumer_cut_off_from_its_whole_network_mid_fetch_skips_nothing(tmp_path: Path) -> None:
    # End to end: a tower, a store and a producer as processes, SIGSTOPped
    # together while a consumer holds live records past a backlog only the
    # store holds and fetches it (to the consumer, a cut of its whole network:
    # every peer silent, towers included, so no peer expires).  Held past
    # skip_after, the hole must wait, not be skipped.
    n, skip_after, cut = 300_000, 8.0, 14.0
    tower_proc, tower_address = _tower_process()
    cfg = NodeConfig(towers=(tower_address,), bind="127.0.0.1", beacon_interval=0.2, beacon_timeout=2.0)
    store_proc = start_store_process(cfg, tmp_path / "db")
    producer_proc = spawned(subprocess.Popen(
        [sys.executable, "-c", _PRODUCER, "127.0.0.1", str(tower_address.in_port), str(tower_address.out_port), str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(),
    ))
    assert producer_proc.stdout is not None
    line = producer_proc.stdout.readline()
    assert b"backlog acknowledged" in line, producer_proc.stderr.read() if producer_proc.stderr else line
    peers = (tower_proc, store_proc, producer_proc)
    offsets: list[int] = []
    # A small queue: while the application reads slowly, the consumer reads
    # its socket slowly too, so the backlog is still being fetched when the
    # producer's live records arrive and are held past the hole.
    # Peers expire after 8 s of silence, later than the towers count as silent
    # (5 s): a cut is seen through the towers' silence, not through the store
    # expiring (which makes the consumer "lonely", the other rule).
    slow_expiry = NodeConfig(towers=(tower_address,), bind="127.0.0.1", beacon_interval=0.2, beacon_timeout=8.0)
    with Consumer("cutoff", slow_expiry, offset_reset="earliest", skip_after=skip_after, max_queued=1000) as consumer:

        def take(timeout: float, most: int = 100_000) -> None:
            offsets.extend(r.offset for r in consumer.poll_batch(most, timeout))

        deadline = time.monotonic() + 30
        while not any(t.held for t in consumer._missing) and time.monotonic() < deadline:
            take(0.05, 500)
            time.sleep(0.02)  # the slow application (a pace, not a wait for something)
        for proc in peers:
            proc.send_signal(signal.SIGSTOP)
        try:
            assert any(t.held for t in consumer._missing), "no live record held past the hole: nothing tested"
            cut_at = time.monotonic()
            while time.monotonic() - cut_at < cut:
                take(0.2)
            assert len(offsets) < n, "the backlog came whole before the cut: nothing was tested"
        finally:
            for proc in peers:
                proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while len(offsets) < n + 10 and time.monotonic() < deadline:
            take(0.2)
        assert consumer.skipped == 0, f"{consumer.skipped} offsets skipped while the network was cut"
        assert offsets == list(range(len(offsets))) and len(offsets) >= n + 10
