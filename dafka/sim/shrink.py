"""Shrinking a failing schedule to a short one that fails the same way.

Our own shrinker rather than hypothesis': the schedule is an explicit list of
steps, each with its own seed, so a shrunk schedule is printable, replays
exactly with ``--replay`` (no example database needed) and its steps keep
their random decisions when others are removed.

Two passes until nothing changes (or the budget is spent):

1. delta debugging: remove chunks of steps (halves, quarters, ... single
   steps) while the run still fails with the same violation kind;
2. simplification: make each step's numbers smaller (counts, durations,
   waits halved, down to 1) while it still fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dafka.sim.schedule import Step

Fails = Callable[[list[Step]], bool]


def shrink(schedule: list[Step], fails: Fails, *, max_runs: int = 400, max_seconds: float = 300.0) -> tuple[list[Step], int]:
    """The shortest failing schedule found and the number of runs it took."""
    deadline = time.monotonic() + max_seconds
    runs = 0
    current = list(schedule)

    def attempt(candidate: list[Step]) -> bool:
        nonlocal runs
        if runs >= max_runs or time.monotonic() >= deadline:
            return False
        runs += 1
        return fails(candidate)

    changed = True
    while changed and runs < max_runs and time.monotonic() < deadline:
        changed = False
        # 1. remove chunks, from large to single steps
        size = max(1, len(current) // 2)
        while size >= 1:
            i = 0
            while i < len(current):
                candidate = current[:i] + current[i + size :]
                if candidate and attempt(candidate):
                    current = candidate
                    changed = True
                else:
                    i += size
            if size == 1:
                break
            size //= 2
        # 2. smaller numbers
        for i in range(len(current)):
            step = current[i]
            for field in ("a",) if step.kind == "wait" else ("b",):
                value = getattr(step, field)
                if step.kind == "net":
                    continue  # a mode, not a size
                while value > 1:
                    smaller = step._replace(**{field: value // 2})
                    candidate = current[:i] + [smaller] + current[i + 1 :]
                    if not attempt(candidate):
                        break
                    current, step, value, changed = candidate, smaller, value // 2, True
    return current, runs
