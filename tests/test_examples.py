"""The examples run as their docstrings say (real processes, real mesh, real Spark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.store.node import Store
from tests.conftest import ROOT, subprocess_env, tower_flag


def test_hello_example(cfg: NodeConfig, tmp_path: Path) -> None:
    env = subprocess_env()
    env["DAFKA_TOWERS"] = tower_flag(cfg)
    with Store(tmp_path / "db", cfg):
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "hello.py")],
            env=env,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
    assert "acknowledged: True" in out
    assert [line.split()[-1] for line in out.splitlines()[1:]] == [str(i) for i in range(5)]


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_edge_pipeline_example(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "edge_pipeline.py"),
            "--devices", "2", "--seconds", "25",
            "--data", str(tmp_path / "data"),
            "--parquet", str(tmp_path / "parquet"),
        ],
        env=subprocess_env(),
        capture_output=True,
        timeout=280,
    )
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    results = [json.loads(line[len("result: "):]) for line in out.splitlines() if line.startswith("result: ")]
    assert results, out
    assert {r["device"] for r in results} == {"device-0", "device-1"}
    # A closed 10 s window holds at most 100 readings a device (one each 100 ms).
    assert all(0 < r["readings"] <= 101 for r in results)
    assert list((tmp_path / "parquet").glob("*.parquet"))
