"""Benchmarks: ``dafka bench WHICH``, one module per benchmark.

This package parses the arguments (:func:`add_arguments`) and dispatches
(:func:`main`) to the benchmark's module (``live``, ``store``, ``replay``, ``blocks``,
``zmq_baseline``, ``ceiling``, ``tank``, ``kafka``, ``outbox``, ``latency``,
``embedded``, ``aio``, ``scale``, ``group``, ``spark``); what they share is in
:mod:`dafka.bench.common`.

Each benchmark runs the nodes in separate processes (spawned, never forked:
a forked ZeroMQ context is unusable), repeats the measurement and reports the
median.  Figures go in docs/reference/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

from dafka.bench.aio import bench_aio
from dafka.bench.blocks import add_arguments as _blocks_arguments
from dafka.bench.blocks import bench_blocks
from dafka.bench.ceiling import bench_ceiling
from dafka.bench.common import PAYLOAD
from dafka.bench.embedded import bench_embedded
from dafka.bench.group import bench_group, bench_group_partitions
from dafka.bench.kafka import bench_kafka, bench_kafka_group
from dafka.bench.latency import bench_latency
from dafka.bench.live import bench_live
from dafka.bench.outbox import bench_outbox
from dafka.bench.replay import bench_replay
from dafka.bench.scale import bench_scale
from dafka.bench.store import bench_store
from dafka.bench.tank import bench_tank
from dafka.bench.zmq_baseline import bench_zmq


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dafka.cli import count_arg, positive_seconds_arg

    p.add_argument("which", choices=sorted(BENCHMARKS), help="what to measure")
    p.add_argument("--records", type=count_arg, default=1_000_000, help="records per run")
    p.add_argument("--runs", type=count_arg, default=3, help="runs (the median is reported)")
    p.add_argument("--size", type=count_arg, default=PAYLOAD, help="payload bytes")
    p.add_argument("--no-sync", action="store_true", help="store: do not fsync commits")
    p.add_argument("--no-store", action="store_true", help="latency: no store process, delivery only")
    p.add_argument("--transport", default="both", help="spark: path, gateway or both")
    p.add_argument("--rate", type=count_arg, default=10_000, help="latency: records/s published")
    p.add_argument(
        "--seconds", type=positive_seconds_arg, default=3.0,
        help="latency: seconds of publishing per run; embedded: seconds per measurement; scale: seconds measured",
    )
    p.add_argument("--secure", action="store_true", help="live, store, replay: CURVE mesh with temporary keys; zmq, ceiling: CURVE on the bare pair")
    p.add_argument("--nodes", type=int, default=100, help="scale: producers in the mesh")
    p.add_argument("--procs", type=int, default=4, help="scale: processes hosting the producers")
    p.add_argument(
        "--shared-loop", action="store_true",
        help="scale, group --partitions: the producers of a process share one I/O thread (NodeLoop)",
    )
    p.add_argument(
        "--partitions", type=int, default=0,
        help="group: a group over this many partitions (one producer each, 1 record/s): rebalance times",
    )
    p.add_argument(
        "--outbox-sync", choices=["each", "batch"], default="each",
        help="outbox, latency --outbox: each (publish waits for the fsync) or batch",
    )
    p.add_argument("--outbox", action="store_true", help="latency: the producer publishes through an edge outbox")
    p.add_argument(
        "--no-batches", action="store_true",
        help="live, store, replay, latency (plain mesh): one record a message, as to C readers",
    )
    _blocks_arguments(p)


def _spark_bench(args: argparse.Namespace) -> dict[str, list[float]]:
    from dafka.bench.spark import bench_spark  # pyspark is an extra: imported only here

    return bench_spark(args)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "zmq": bench_zmq,
    "ceiling": bench_ceiling,
    "live": bench_live,
    "store": bench_store,
    "replay": bench_replay,
    "tank": bench_tank,
    "kafka": bench_kafka,
    "kafka-group": bench_kafka_group,
    "embedded": bench_embedded,
    "aio": bench_aio,
    "blocks": bench_blocks,
    "scale": bench_scale,
    "spark": _spark_bench,
    "latency": bench_latency,
    "outbox": bench_outbox,
    "group": lambda args: bench_group_partitions(args) if args.partitions else bench_group(args),
}


def main(args: argparse.Namespace) -> int:
    result = BENCHMARKS[args.which](args)
    if isinstance(result, int):
        return result  # reported its own figures
    series = result if isinstance(result, dict) else {args.which: result}
    status = 0
    for name, rates in series.items():
        if not rates:
            print(f"{name}: no successful run", file=sys.stderr)
            status = 1
            continue
        if name.endswith(" seconds"):
            print(f"{name[:-8]}: median {statistics.median(rates):.2f}s over {len(rates)} runs")
            continue
        print(
            f"{name}: median {statistics.median(rates):,.0f} records/s of {args.size}-byte records "
            f"over {len(rates)} runs"
        )
    return status
