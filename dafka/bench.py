"""Benchmarks: ``dafka bench live`` (and more as components land).

Each benchmark runs the nodes in separate processes (spawned, never forked:
a forked ZeroMQ context is unusable), repeats the measurement and reports the
median.  Figures go in the README's performance table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from dafka.config import NodeConfig, TowerAddress

PAYLOAD = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=sorted(BENCHMARKS), help="what to measure")
    p.add_argument("--records", type=int, default=1_000_000, help="records per run")
    p.add_argument("--runs", type=int, default=3, help="runs (the median is reported)")
    p.add_argument("--size", type=int, default=PAYLOAD, help="payload bytes")
    p.add_argument("--no-sync", action="store_true", help="store: do not fsync commits")


def _mesh() -> tuple[Any, NodeConfig]:
    from dafka.tower import Tower

    tower = Tower("127.0.0.1", 0, 0)
    tower.start()
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
    )
    return tower, cfg


def _live_producer(cfg: NodeConfig, topic: str, n: int, size: int, start: Any, done: Any) -> None:
    from dafka.producer import Producer

    producer = Producer(topic, cfg, acks=False, capacity=max(n, 1))
    start.wait(30)
    payload = b"x" * size
    chunk = [payload] * 1000
    sent = 0
    while sent < n:
        batch = chunk if n - sent >= 1000 else chunk[: n - sent]
        producer.publish_many(batch)
        sent += len(batch)
    done.wait(120)  # keep answering FETCHes until the consumer has everything
    producer.close(0)


def bench_live(args: argparse.Namespace) -> list[float]:
    """Records/s from one producer process to one consumer process."""
    ctx = mp.get_context("spawn")
    rates = []
    for run in range(args.runs):
        tower, cfg = _mesh()
        from dafka.consumer import Consumer

        topic = f"bench-live-{run}"
        consumer = Consumer(topic, cfg, offset_reset="earliest")
        start, done = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_live_producer, args=(cfg, topic, args.records, args.size, start, done))
        proc.start()
        deadline = time.monotonic() + 30
        while len(consumer.peers) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let subscriptions propagate both ways
        start.set()
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 300
        while got < args.records and time.monotonic() < deadline:
            got += len(consumer.poll_batch(100_000, 1.0))
        elapsed = time.perf_counter() - t0
        done.set()
        proc.join(30)
        consumer.close()
        tower.close()
        if got < args.records:
            print(f"run {run}: only {got} of {args.records} records arrived", file=sys.stderr)
            continue
        rate = got / elapsed
        rates.append(rate)
        print(f"run {run}: {rate:,.0f} records/s ({consumer.fetches_sent} fetches)", flush=True)
    return rates


BENCHMARKS: dict[str, Callable[[argparse.Namespace], list[float]]] = {"live": bench_live}


def main(args: argparse.Namespace) -> int:
    rates = BENCHMARKS[args.which](args)
    if not rates:
        print("no successful run", file=sys.stderr)
        return 1
    print(
        f"{args.which}: median {statistics.median(rates):,.0f} records/s of {args.size}-byte records "
        f"over {len(rates)} runs"
    )
    return 0
