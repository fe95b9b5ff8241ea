"""``dafka bench latency``: a short run in separate processes reports every figure."""

from __future__ import annotations

import subprocess

from tests.conftest import dafka_cmd, subprocess_env


def test_bench_latency_reports_percentiles() -> None:
    cmd = dafka_cmd(
        "--log-level",
        "WARNING",
        "bench",
        "latency",
        "--rate",
        "2000",
        "--seconds",
        "1",
        "--runs",
        "1",
    )
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in (
        "producer -> consumer delivery: p50",
        "publish -> store ACK:          p50",
        "floor",
    ):
        assert line in out.stdout, out.stdout
    assert "(1000 records)" in out.stdout  # 2000/s for 1 s, the first half second left out
    assert "%|" not in out.stderr  # no progress bar in a pipe


def test_bench_latency_without_a_store_reports_delivery_only() -> None:
    cmd = dafka_cmd(
        "--log-level", "WARNING", "bench", "latency", "--no-store",
        "--rate", "2000", "--seconds", "1", "--runs", "1",
    )
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(no store)" in out.stdout
    assert "producer -> consumer delivery: p50" in out.stdout
    assert "(1000 records)" in out.stdout
    assert "store ACK" not in out.stdout
