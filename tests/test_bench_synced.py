"""``dafka bench tank --bound``: the minimal store that syncs before it answers."""

from __future__ import annotations

import subprocess

import pytest

from dafka.bench.synced import synced_store_run
from tests.conftest import dafka_cmd, subprocess_env


def test_the_minimal_store_answers_every_frame_after_group_commits(tmp_path) -> None:
    run = synced_store_run([b"x" * 1000, b"y" * 70_000, b""], 60, 4, str(tmp_path))
    assert run.frames == 60
    assert 1 <= run.commits <= 60
    assert run.seconds > 0
    assert run.per_second(10) == pytest.approx(600 / run.seconds)
    assert list(tmp_path.iterdir()) == []  # its database is removed


def test_the_minimal_store_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        synced_store_run([b"x"], 0, 4)
    with pytest.raises(ValueError):
        synced_store_run([b"x"], 5, 0)


def test_bench_tank_bound_prints_the_gateway_against_it() -> None:
    cmd = dafka_cmd("--log-level", "WARNING", "bench", "tank", "--records", "20000", "--runs", "1",
                    "--bound", "--disk-mb", "2")
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "a minimal store that syncs before it answers (window 8):" in out.stdout, out.stdout
    assert "x the minimal store" in out.stdout, out.stdout
    assert "tank publish / minimal synced store: median" in out.stdout, out.stdout


def test_bench_tank_bound_is_refused_without_sync() -> None:
    cmd = dafka_cmd("bench", "tank", "--records", "1000", "--runs", "1", "--bound", "--no-sync")
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--bound measures a store that syncs" in out.stderr
