"""``dafka bench blocks``: a small run through the CLI reports every layout and the read side."""

from __future__ import annotations

import subprocess

from tests.conftest import dafka_cmd, subprocess_env


def test_bench_blocks_reports_every_case() -> None:
    cmd = dafka_cmd(
        "--log-level", "WARNING", "bench", "blocks", "--records", "3000", "--runs", "1",
        "--block-sizes", "4096,65536", "--window", "100000", "--commit-bytes", "65536",
        "--seeks", "20", "--disk-mb", "2",
    )
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in (
        "sync=off retention=off records",
        "sync=on retention=on source block=65536 append=off",
        "sync=on retention=on internal block=4096 append=on",
        "records seek",
        "source block=65536 seek+slice",
        "internal block=4096 scan",
        "disk after:",
    ):
        assert line in out.stdout, out.stdout
    # 2 sync x 2 retention x (1 records + 2 sizes x 2 append x 2 layouts) ingest rows
    assert sum(1 for row in out.stdout.splitlines() if row.startswith("sync=")) == 36
