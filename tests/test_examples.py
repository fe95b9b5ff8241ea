"""The examples run as their docstrings say (real processes, real mesh, real Spark)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
    assert {"device-0", "device-1"} <= {r["device"] for r in results} <= {"device-0", "device-1", "device-edge"}
    # The device that was offline and rebooted lost nothing: all it published is where Spark reads.
    edge = re.search(r"device-edge: (\d+) readings published across the reboot, all acknowledged: True, (\d+) held", out)
    assert edge and int(edge.group(1)) == int(edge.group(2)) > 0, out
    # A closed 10 s window holds at most 100 readings a device (one each 100 ms).
    assert all(0 < r["readings"] <= 101 for r in results)
    assert list((tmp_path / "parquet").glob("*.parquet"))


def _interrupt(proc: subprocess.Popen, ready: str, after: float = 0.0) -> tuple[int, str]:
    """Read until ``ready``, then Ctrl-C the process group as a terminal would."""
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if ready in line:
            break
    else:
        raise AssertionError(f"never ready: {''.join(lines)}")
    time.sleep(after)  # let the run get going (the devices publish meanwhile)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out


@pytest.mark.timeout(120)
def test_pipeline_devices_ignore_ctrl_c_and_stop_cleanly(tmp_path: Path) -> None:
    # The device-process part of the example, without Spark: Ctrl-C reaches
    # every process of the group; only the parent handles it, and the devices
    # stop through their event (after their records are acknowledged).
    script = tmp_path / "devices.py"
    script.write_text(
        f"""
import multiprocessing as mp, sys, time
sys.path.insert(0, {str(ROOT / "examples")!r})
from edge_pipeline import start_devices, stop_devices
from dafka.config import NodeConfig, TowerAddress
from dafka.store.node import Store
from dafka.nodes.tower import Tower

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    devices = []
    with Tower("127.0.0.1", 0, 0) as tower:
        cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),), bind="127.0.0.1")
        with Store({str(tmp_path / "db")!r}, cfg) as store:
            try:
                devices = start_devices(ctx, 2, cfg, 60, stop)
                # Both devices publish and their store acknowledges them.
                deadline = time.monotonic() + 60
                while len(store.db.partitions("readings")) < 2 and time.monotonic() < deadline:
                    time.sleep(0.2)
                print("publishing", len(store.db.partitions("readings")), flush=True)
                time.sleep(60)
            except KeyboardInterrupt:
                # As the example: the devices stop (and flush) while the store still runs.
                stop_devices(devices, stop)
                print("stopped", [p.exitcode for p in devices], flush=True)
    sys.exit(130)
"""
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
        start_new_session=True,
    )
    try:
        code, out = _interrupt(proc, "publishing", 0.5)
    finally:
        proc.kill()
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "publishing 2" in out and "stopped [0, 0]" in out, out


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_edge_pipeline_ctrl_c(tmp_path: Path) -> None:
    env = subprocess_env()
    env["TMPDIR"] = str(tmp_path)  # where its temporary data directory goes
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "edge_pipeline.py"), "--devices", "2", "--seconds", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        code, out = _interrupt(proc, "streaming job running", 2.0)
    finally:
        proc.kill()
    assert code == 130, out[-3000:]
    # No traceback of ours (PySpark's own streaming-source worker may still
    # print a BrokenPipe one while the JVM shuts down: Spark's, not ours).
    assert "KeyboardInterrupt" not in out, out[-3000:]
    assert not re.search(r'File "[^"]*(/dafka/|edge_pipeline)', out), out[-3000:]
    assert "data in " + str(tmp_path) in out
    assert not list(tmp_path.glob("dafka-pipeline-*")), "the temporary data directory was left behind"
