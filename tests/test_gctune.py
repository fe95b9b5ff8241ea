"""dafka.gctune: a server process's start-up objects out of the cyclic GC's way (in a process
of its own: the settings are the process's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

PROBE = """
import gc
from dafka.gctune import GEN0, settle
before = gc.get_freeze_count()
settle()
print(before, gc.get_freeze_count() > 1000, gc.get_threshold()[0] == GEN0, gc.get_threshold()[1:] == (10, 10))
"""


def test_settle_freezes_what_exists_and_collects_the_young_generation_less_often() -> None:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "True", "True", "True"]


SERVICE = """
import gc, os, signal, sys, threading, time
from dafka.cli import main
from dafka.gctune import GEN0

def watch() -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GEN0):
        time.sleep(0.05)
    # One write to stderr: a print from this thread could land inside the service's "up" line.
    os.write(2, f"settled {gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GEN0}\\n".encode())
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=watch, daemon=True).start()
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["tower", "--bind", "127.0.0.1", "--in-port", "0", "--out-port", "0"],
        ["store", "--tower", "127.0.0.1:1:2", "--db", "{db}"],
        ["gateway", "--tower", "127.0.0.1:1:2", "--listen", "127.0.0.1:0", "--db", "{db}"],
        ["gateway", "--tower", "127.0.0.1:1:2", "--listen", "127.0.0.1:0", "--kafka-listen", "127.0.0.1:0", "--db", "{db}"],
    ],
    ids=["tower", "store", "tank-gateway", "kafka-gateway"],
)
def test_every_service_settles_its_start_up_objects(argv: list[str], tmp_path: Path) -> None:
    """Each long-running service (`dafka tower`, `store`, `gateway`) runs gctune.settle once up."""
    args = [a.replace("{db}", str(tmp_path / "db")) for a in argv]
    run = subprocess.run(
        [sys.executable, "-c", SERVICE, *args], capture_output=True, text=True, env=subprocess_env(), timeout=60, cwd=tmp_path
    )
    assert "settled True" in run.stderr.splitlines(), (run.stdout, run.stderr)
    assert " up: " in run.stdout, (run.stdout, run.stderr)
