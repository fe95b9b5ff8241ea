"""dafka.gctune: a server process's start-up objects out of the cyclic GC's way (in a process
of its own: the settings are the process's)."""

from __future__ import annotations

import subprocess
import sys

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
