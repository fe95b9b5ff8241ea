"""Offset reset "latest": everything published after the consumer subscribed.

A partition that already existed when the consumer subscribed starts at its
live edge; one first seen after that (a new producer) is read from offset 0.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.core.gaps import LiveEdge
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.node import Store
from tests.conftest import (
    dafka_cmd,
    spawned,
    start_store_process,
    subprocess_env,
    tower_flag,
    wait_until,
)

SETTLED = "partitions that appear from now on are read from their start"


# ---------------------------------------------------------------- sans-IO


def test_partitions_seen_while_settling_start_at_the_live_edge() -> None:
    edge = LiveEdge(settle=1.0)
    edge.subscribe("t", now=10.0)
    assert edge.start(("t", "old"), now=10.5) is None  # no tower yet: still settling
    edge.on_tower(now=11.0)
    assert edge.settling("t", 11.9)
    assert edge.start(("t", "early"), now=11.9) is None
    assert not edge.settling("t", 12.0)
    assert edge.start(("t", "new"), now=12.0) == 0
    # What was seen while settling keeps its live-edge start (a group re-takes it).
    assert edge.start(("t", "old"), now=50.0) is None
    assert edge.start(("t", "early"), now=50.0) is None
    assert edge.start(("t", "new"), now=50.0) == 0


def test_a_topic_subscribed_later_settles_on_its_own() -> None:
    edge = LiveEdge(settle=1.0)
    edge.on_tower(now=0.0)
    edge.subscribe("a", now=0.0)
    edge.subscribe("b", now=5.0)
    assert edge.start(("a", "p"), now=5.5) == 0
    assert edge.start(("b", "p"), now=5.5) is None
    assert edge.start(("b", "q"), now=6.0) == 0
    edge.subscribe("a", now=9.0)  # again: no effect
    assert edge.start(("a", "r"), now=9.1) == 0


def test_a_reader_without_towers_settles_from_its_start() -> None:
    edge = LiveEdge(settle=1.0)
    edge.on_tower(now=0.0)  # the shell's choice for a node without towers
    edge.subscribe("t", now=0.0)
    assert edge.start(("t", "p"), now=2.0) == 0


# ---------------------------------------------------------------- processes


class Lines:
    """Reads a process's text stream in a thread, so tests can wait for a line."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)


@pytest.mark.timeout(120)
def test_live_consumer_prints_every_record_of_short_producer_runs(cfg: NodeConfig, tmp_path: Path) -> None:
    """The CLI scenario: `dafka consume T`, then three short `dafka produce T` runs."""
    start_store_process(cfg, tmp_path / "db")
    consumer = spawned(
        subprocess.Popen(
            dafka_cmd("consume", "news", "--tower", tower_flag(cfg), "--bind", "127.0.0.1", "--count", "6",
                      "--timeout", "90"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
    )
    err = Lines(consumer.stderr)
    wait_until(lambda: err.has(SETTLED), timeout=30)
    for run in range(3):
        out = subprocess.run(
            dafka_cmd("produce", "news", "--tower", tower_flag(cfg), "--bind", "127.0.0.1"),
            input=f"run{run}-a\nrun{run}-b\n",
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
    try:
        printed, _ = consumer.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        consumer.kill()
        printed, _ = consumer.communicate()
    assert sorted(printed.split()) == sorted(f"run{r}-{x}" for r in range(3) for x in "ab"), err.lines
    assert consumer.returncode == 0


# ---------------------------------------------------------------- embedded


def _settled(consumer: Consumer, topic: str) -> bool:
    return topic in consumer._live_told  # logged: partitions that appear from now on ...


def _short_runs(cfg: NodeConfig, topic: str, runs: int = 3) -> list[bytes]:
    published = []
    for run in range(runs):
        with Producer(topic, cfg) as producer:
            for x in (b"a", b"b"):
                producer.publish(b"run%d-%s" % (run, x))
                published.append(b"run%d-%s" % (run, x))
            assert producer.flush(20)
    return published


def _drain(consumer: Consumer, want: int, timeout: float = 30.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        record = consumer.poll(0.2)
        if record is not None:
            got.append(record.content)
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("group", [None, "g"])
def test_latest_reads_new_partitions_from_their_start(cfg: NodeConfig, tmp_path: Path, group: str | None) -> None:
    with Store(tmp_path / "db", cfg) as store:
        # An existing partition: its history is not delivered, what follows is.
        with Producer("t", cfg) as old:
            old.publish(b"history")
            assert old.flush(20)
            with Consumer("t", cfg, group=group) as consumer:
                wait_until(lambda: _settled(consumer, "t"), timeout=20)
                wait_until(lambda: ("t", old.address) in consumer._live._existing, timeout=10)
                published = _short_runs(cfg, "t")
                old.publish(b"live")
                published.append(b"live")
                got = _drain(consumer, len(published))
                assert sorted(got) == sorted(published)
                assert consumer.poll(0.5) is None  # and nothing more (no history)
        assert store.running
