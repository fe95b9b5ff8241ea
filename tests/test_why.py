"""Say why nothing happens: a group without stores, a plain node at a secure tower."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.consumer import Consumer
from dafka.errors import CommitError
from dafka.store.node import Store
from tests.conftest import dafka_cmd, subprocess_env, tower_flag, wait_until

pytestmark = pytest.mark.timeout(120)


def test_group_commit_without_any_store_says_so(cfg: NodeConfig) -> None:
    with Consumer("t", cfg, group="g") as consumer:
        wait_until(lambda: consumer.tower_watch.reached)
        assert consumer.poll(0.5) is None  # nothing comes
        with pytest.raises(CommitError, match="no store on the mesh"):
            consumer.commit(timeout=1.0)
        started = time.monotonic()
    assert time.monotonic() - started < 1.5  # closing with nothing polled waits for no store


def test_group_commit_with_a_store_and_nothing_polled_is_empty(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(tmp_path / "db", cfg), Consumer("t", cfg, group="g") as consumer:
        assert consumer.commit(timeout=10) == {}


def test_consume_group_without_store_prints_why(cfg: NodeConfig, tmp_path: Path) -> None:
    conf = tmp_path / "node.toml"
    conf.write_text(f"[node]\nbeacon_interval = {cfg.beacon_interval}\nbeacon_timeout = {cfg.beacon_timeout}\n")
    out = subprocess.run(
        dafka_cmd("--config", str(conf), "consume", "t", "--group", "g", "--tower", tower_flag(cfg),
                  "--commit-interval", "0.5", "--commit-timeout", "1", "--timeout", "4"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, out.stderr  # said once, not every interval
    assert "no store on the mesh" in warnings[0] and "'g'" in warnings[0]
