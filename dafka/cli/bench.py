"""``dafka bench BENCHMARK``: the benchmarks of :mod:`dafka.bench`, one sub-command each."""

from __future__ import annotations

import argparse
import multiprocessing
from typing import Any

from dafka.cli.common import EXIT_INTERRUPTED
from dafka.config import Settings


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from dafka import bench

    try:
        return bench.main(args)
    except KeyboardInterrupt:
        # The children ignore Ctrl-C (see dafka/cli/__init__.py): stop them.
        for child in multiprocessing.active_children():
            child.terminate()
        for child in multiprocessing.active_children():
            child.join(5)
        return EXIT_INTERRUPTED


def add_parser(sub: Any) -> None:
    from dafka import bench

    p = sub.add_parser("bench", help="measure throughput")
    bench.add_arguments(p)
