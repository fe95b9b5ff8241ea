"""Running seeds: ``python -m dafka.sim`` / ``dafka-sim`` / ``make sim SEEDS=N``.

Prints one line per run (seed, steps, simulated seconds, faults injected by
kind, invariants checked, records published / acknowledged / delivered) and,
for a failing seed, the violation and the command that replays it; with
``--shrink`` also the shrunk schedule and the command that replays that.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import time
from collections.abc import Iterator

from dafka.sim.schedule import Step, dumps, generate, generate_classic, loads
from dafka.sim.shrink import shrink
from dafka.sim.world import HEAL_SECONDS, RunResult, World

DEFAULT_STEPS = 120


def run_schedule(schedule: list[Step], seed: int | None = None, heal_seconds: float = HEAL_SECONDS) -> RunResult:
    """Run one schedule in a fresh world (temporary LMDB directories, removed after)."""
    return World(heal_seconds=heal_seconds).run(schedule, seed)


def run_seed(seed: int, steps: int = DEFAULT_STEPS, classic: bool = False) -> RunResult:
    """Run ``seed``'s schedule (``classic``: the first generator's, see schedule.generate_classic)."""
    return run_schedule((generate_classic if classic else generate)(seed, steps), seed)


def shrink_failure(schedule: list[Step], kind: str, *, max_runs: int = 400, max_seconds: float = 300.0) -> tuple[list[Step], int]:
    """Shrink ``schedule`` keeping a violation of ``kind``."""

    def fails(candidate: list[Step]) -> bool:
        return any(v.kind == kind for v in run_schedule(candidate).violations)

    return shrink(schedule, fails, max_runs=max_runs, max_seconds=max_seconds)


def summary(r: RunResult) -> str:
    faults = " ".join(f"{k}={v}" for k, v in r.faults.items()) or "none"
    who = f"seed {r.seed}" if r.seed is not None else "replay"
    verdict = "ok" if r.ok else f"FAIL ({len(r.violations)} violations)"
    return (
        f"{who}: {verdict}; {r.steps} steps, {r.sim_seconds:.1f}s simulated in {r.wall_seconds:.2f}s; "
        f"faults {faults}; {r.checks} invariant checks; published {r.published}, "
        f"acknowledged {r.acked}, delivered {r.delivered}"
        + "".join(f"; observed {k}={v}" for k, v in r.observations.items())
    )


def replay_command(seed: int | None, steps: int, schedule: list[Step] | None = None, classic: bool = False) -> str:
    if schedule is not None:
        return f"python -m dafka.sim --replay '{dumps(schedule)}'"
    return f"python -m dafka.sim --seed {seed} --steps {steps}" + (" --classic" if classic else "")


def _run_one(job: tuple[int, int, bool]) -> RunResult:
    seed, steps, classic = job
    return run_seed(seed, steps, classic)


def _quiet_worker(level: int) -> None:
    logging.basicConfig(level=level, format="%(name)s: %(message)s")


def _results(seeds: list[int], steps: int, jobs: int, level: int, classic: bool = False) -> Iterator[RunResult]:
    """Run ``seeds`` in order (``jobs`` worker processes); results in seed order."""
    if jobs <= 1:
        for seed in seeds:
            yield run_seed(seed, steps, classic)
        return
    with multiprocessing.get_context("spawn").Pool(jobs, _quiet_worker, (level,)) as pool:
        yield from pool.imap(_run_one, [(seed, steps, classic) for seed in seeds], chunksize=4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dafka.sim", description="Deterministic fault simulation of the mesh")
    ap.add_argument("--seeds", type=int, default=20, help="how many seeds to run (from --first)")
    ap.add_argument("--first", type=int, default=0, help="first seed of the range")
    ap.add_argument("--seed", type=int, help="run this one seed")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per schedule")
    ap.add_argument("--replay", help="run this schedule (the text a failing run printed)")
    ap.add_argument("--shrink", action="store_true", help="shrink a failing schedule")
    ap.add_argument("--keep-going", action="store_true", help="run every seed even after a failure")
    ap.add_argument("--quiet", action="store_true", help="print only failing seeds and the total")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (a sweep of many seeds)")
    ap.add_argument(
        "--minutes", type=float, default=0.0, help="stop starting seeds after this long (0: no bound)"
    )
    ap.add_argument(
        "--classic",
        action="store_true",
        help="schedules of the first generator (no topo/offline/freeze steps: seeds found before them)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log the nodes' warnings")
    args = ap.parse_args(argv)
    level = logging.WARNING if args.verbose else logging.CRITICAL
    logging.basicConfig(level=level, format="%(name)s: %(message)s")

    if args.replay:
        schedule = loads(args.replay)
        r = run_schedule(schedule)
        print(summary(r))
        for v in r.violations:
            print(f"  {v}")
        return 0 if r.ok else 1

    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    failed = 0
    ran = 0
    started = time.perf_counter()
    deadline = started + args.minutes * 60 if args.minutes > 0 else None
    results = _results(seeds, args.steps, max(1, args.jobs), level, args.classic)
    try:
        for r in results:
            ran += 1
            if not args.quiet or not r.ok:
                print(summary(r), flush=True)
            if not r.ok:
                failed += 1
                for v in r.violations[:5]:
                    print(f"  {v}")
                print(f"  replay: {replay_command(r.seed, args.steps, classic=args.classic)}", flush=True)
                if args.shrink:
                    make = generate_classic if args.classic else generate
                    small, runs = shrink_failure(make(r.seed or 0, args.steps), r.violations[0].kind)
                    print(f"  shrunk to {len(small)} steps in {runs} runs: {dumps(small)}")
                    print(f"  replay shrunk: {replay_command(None, 0, small)}", flush=True)
                if not args.keep_going:
                    break
            if args.quiet and ran % 500 == 0:
                print(f"... {ran} seeds, {failed} failed, {time.perf_counter() - started:.0f}s", flush=True)
            if deadline is not None and time.perf_counter() >= deadline:
                print(f"time bound of {args.minutes:g} minutes reached", flush=True)
                break
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    elapsed = time.perf_counter() - started
    last = f" (seeds {seeds[0]}..{seeds[0] + ran - 1})" if ran and args.seed is None else ""
    print(f"{ran} seeds{last} in {elapsed:.1f}s ({ran / max(elapsed, 1e-9) * 60:.0f} seeds/minute), {failed} failed")
    return 1 if failed else 0
