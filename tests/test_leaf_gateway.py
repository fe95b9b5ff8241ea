"""The gateway as a leaf endpoint (``dafka gateway --leaves HOST:PORT``): it is a store, and takes leaves as one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from dafka.config import NodeConfig
from tests.conftest import dafka_cmd, spawned, subprocess_env, tower_flag
from tests.test_leaf_mesh import TOPIC, read_all


def test_dafka_gateway_takes_leaves(cfg: NodeConfig, tmp_path: Path) -> None:
    gateway = spawned(subprocess.Popen(
        dafka_cmd("gateway", "--db", str(tmp_path / "g"), "--listen", "127.0.0.1:0", "--tower", tower_flag(cfg),
                  "--bind", "127.0.0.1", "--leaves", "127.0.0.1:0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(),
    ))
    assert gateway.stdout is not None
    line = gateway.stdout.readline().decode()
    found = re.search(r"leaves on ([\d.]+:\d+)", line)
    assert found, line
    run = subprocess.run(
        dafka_cmd("produce", TOPIC, "--leaf", found.group(1), "--identity", str(tmp_path / "id.json")),
        input=b"rec-0\nrec-1\nrec-2\n", capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert run.returncode == 0 and b"published 3 records, all acknowledged" in run.stderr, run.stderr
    import json

    partition = json.loads((tmp_path / "id.json").read_text())["address"]
    assert read_all(cfg, partition, 3, timeout=15) == {i: b"rec-%d" % i for i in range(3)}  # a mesh partition
    refused = subprocess.run(
        dafka_cmd("gateway", "--db", str(tmp_path / "h"), "--listen", "127.0.0.1:0", "--leaves", "0.0.0.0:0"),
        capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert refused.returncode != 0 and b"--insecure" in refused.stderr
    gateway.terminate()
    assert gateway.wait(15) == 0
