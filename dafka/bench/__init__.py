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
from dafka.bench.storedb import bench_storedb
from dafka.bench.tank import bench_tank
from dafka.bench.zmq_baseline import bench_zmq


def _options() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every benchmark option: its flag and argparse keywords (``help`` may be overridden per benchmark)."""
    from dafka.cli.args import count_arg, positive_seconds_arg

    return {
        "records": ("--records", {"type": count_arg, "default": 1_000_000, "help": "records per run"}),
        "runs": ("--runs", {"type": count_arg, "default": 3, "help": "runs (the median is reported)"}),
        "size": ("--size", {"type": count_arg, "default": PAYLOAD, "help": "payload bytes"}),
        "no_sync": ("--no-sync", {"action": "store_true", "help": "the store does not fsync its commits"}),
        "no_store": ("--no-store", {"action": "store_true", "help": "no store process: delivery only"}),
        "transport": ("--transport", {"choices": ["path", "gateway", "both"], "default": "both",
                                      "help": "read the store's files (path), through the Tank gateway, or both"}),
        "rate": ("--rate", {"type": count_arg, "default": 10_000, "help": "records/s published"}),
        "seconds": ("--seconds", {"type": positive_seconds_arg, "default": 3.0, "help": "seconds measured"}),
        "secure": ("--secure", {"action": "store_true", "help": "a CURVE mesh with temporary keys"}),
        "nodes": ("--nodes", {"type": count_arg, "default": 100, "help": "producers in the mesh"}),
        "leaves": ("--leaves", {"type": count_arg, "default": 0,
                                "help": "instead of --nodes: this many leaf devices at 1 record/s, dialling"
                                        " --endpoints stores' leaf ports (see docs/concepts/leaves.md)"}),
        "endpoints": ("--endpoints", {"type": count_arg, "default": 1, "help": "--leaves: stores with a leaf port"}),
        "readers": ("--readers", {"type": int, "default": 0,
                                  "help": "--leaves: this many of the devices also read a shared commands topic on"
                                          " their connection (a mesh producer sends it 1 command/s)"}),
        "procs": ("--procs", {"type": count_arg, "default": 4, "help": "processes hosting the producers"}),
        "shared_loop": ("--shared-loop", {"action": "store_true",
                                          "help": "the producers of a process share one I/O thread (NodeLoop)"}),
        "partitions": ("--partitions", {"type": int, "default": 0,
                                        "help": "a group over this many partitions (one producer each, 1 record/s):"
                                                " rebalance times"}),
        "outbox_sync": ("--outbox-sync", {"choices": ["each", "batch"], "default": "each",
                                          "help": "each (publish waits for the fsync) or batch"}),
        "outbox": ("--outbox", {"action": "store_true", "help": "the producer publishes through an edge outbox"}),
        "no_batches": ("--no-batches", {"action": "store_true", "help": "one record a message, as to C readers"}),
        "sync": ("--sync", {"action": "store_true", "help": "fsync every commit (its wait is not CPU time)"}),
        "client": ("--client", {"choices": ["confluent", "raw", "kcat"], "default": "confluent",
                                "help": "confluent: confluent-kafka's producer (a Python call a record); raw:"
                                        " produce requests of ready-made batches of 1,000 records, 8 in flight"
                                        " (the Tank bench's client's way), which measures the gateway more than"
                                        " the client; kcat: the kcat command (librdkafka in C, a record a line"
                                        " of a file written first), if installed"}),
        "broker": ("--broker", {"metavar": "HOST:PORT", "default": None,
                                "help": "measure a running Tank broker (or gateway) there instead of a gateway"
                                        " started here; each run creates a topic"}),
        "window": ("--window", {"type": count_arg, "default": 8,
                                "help": "produce requests (one bundle of 1,000 records each) in flight"}),
        "against": ("--against", {"metavar": "HOST:PORT", "default": None,
                                  "help": "compare: publish to a running Tank broker there and to a gateway started"
                                          " here, alternating, each run after --warm-mb; prints each round's"
                                          " gateway/broker ratio"}),
        "disk_mb": ("--disk-mb", {"type": int, "default": 0,
                                  "help": "with fsync: before each run, write this many MiB and fdatasync once"
                                          " where the gateway's database goes (what `dd bs=1M conv=fdatasync`"
                                          " measures), and print the publish in record bytes as a share of it"
                                          " (0: no disk measured)"}),
        "bound": ("--bound", {"action": "store_true",
                              "help": "with fsync: before each run, also measure a minimal store that syncs"
                                      " before it answers (LMDB group commits behind one TCP connection, nothing"
                                      " parsed) with the same bundles and window, and print the gateway's"
                                      " publish as a ratio of it"}),
        "warm_mb": ("--warm-mb", {"type": int, "default": 2000,
                                  "help": "--against: MB written and deleted before every run, so that both"
                                          " sides start with the same page-cache state (0: none)"}),
    }


_COMMON = ("records", "runs", "size")
# benchmark -> (what it measures, its options beyond _COMMON, help overrides)
_BENCHMARKS: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {
    "zmq": ("the bare ZeroMQ PUB/SUB pair the mesh is measured against", ("secure",), {"secure": "CURVE on the bare pair"}),
    "ceiling": ("a PUB/SUB pair doing a consumer's per-record work, without a node", ("secure",),
                {"secure": "CURVE on the bare pair"}),
    "live": ("producer -> consumer records/s", ("secure", "no_batches"), {}),
    "store": ("records/s acknowledged by a store", ("secure", "no_batches", "no_sync"), {}),
    "replay": ("a consumer reading stored records from the beginning", ("secure", "no_batches"), {}),
    "storedb": ("the store's database layer alone: append and read, in CPU time", ("sync",), {}),
    "tank": ("publish and fetch through the Tank gateway (records/s)",
             ("no_sync", "broker", "window", "against", "warm_mb", "disk_mb", "bound"), {}),
    "kafka": ("a Kafka client through the Kafka gateway (records/s)", ("no_sync", "broker", "client"),
              {"broker": "measure a running Kafka gateway (or broker) there instead of one started here;"
                         " each run creates a topic"}),
    "kafka-group": ("Kafka consumer group failover through the gateway (seconds)", ("no_sync",), {}),
    "embedded": ("publish and consume from an app thread, with and without a busy thread", ("seconds", "no_sync"), {"seconds": "seconds per measurement"}),
    "aio": ("the asyncio producer and consumer beside the threaded ones", ("no_sync",), {}),
    "scale": ("a mesh of many producers at 1 record/s", ("nodes", "procs", "seconds", "shared_loop", "no_sync", "leaves", "endpoints", "readers"), {}),
    "spark": ("rows/s of a Spark batch read of stored records", ("transport",), {}),
    "latency": ("delivery and acknowledgement latency percentiles",
                ("rate", "seconds", "no_store", "no_sync", "outbox", "outbox_sync", "no_batches"),
                {"seconds": "seconds of publishing per run", "no_batches": "one record a message (plain mesh)"}),
    "outbox": ("records/s through an edge outbox", ("outbox_sync", "no_sync", "no_batches"), {}),
    "blocks": ("format-2 block layouts against today's one-entry-per-record store", (), {}),
    "group": ("a consumer group: records/s and the kill-to-resume time",
              ("partitions", "procs", "shared_loop", "no_sync"),
              {"shared_loop": "--partitions: the producers of a process share one I/O thread"}),
}
_NOT_COMMON = {"scale": _COMMON, "latency": ("records",)}  # they count seconds, not records


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``dafka bench WHICH [options]``: one sub-command per benchmark, each with its own options."""
    options = _options()
    defaults = {dest: kw.get("default", False if kw.get("action") == "store_true" else None)
                for dest, (_, kw) in options.items()}
    sub = p.add_subparsers(dest="which", required=True, metavar="BENCHMARK")
    for name in sorted(_BENCHMARKS):
        what, own, helps = _BENCHMARKS[name]
        q = sub.add_parser(name, help=what, description=f"dafka bench {name}: {what}")
        used = (*(c for c in _COMMON if c not in _NOT_COMMON.get(name, ())), *own)
        for dest in used:
            flag, kw = options[dest]
            q.add_argument(flag, **{**kw, "help": helps.get(dest, kw["help"])})
        if name == "blocks":
            _blocks_arguments(q)
        # What a benchmark's code reads but it does not take: the defaults.
        q.set_defaults(**{dest: value for dest, value in defaults.items() if dest not in used})


def _spark_bench(args: argparse.Namespace) -> dict[str, list[float]]:
    from dafka.bench.spark import bench_spark  # pyspark is an extra: imported only here

    return bench_spark(args)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "zmq": bench_zmq,
    "ceiling": bench_ceiling,
    "live": bench_live,
    "store": bench_store,
    "storedb": bench_storedb,
    "replay": bench_replay,
    "tank": bench_tank,
    "kafka": bench_kafka,
    "kafka-group": bench_kafka_group,
    "embedded": bench_embedded,
    "aio": bench_aio,
    "scale": bench_scale,
    "spark": _spark_bench,
    "latency": bench_latency,
    "outbox": bench_outbox,
    "blocks": bench_blocks,
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
