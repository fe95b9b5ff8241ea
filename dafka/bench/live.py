"""``dafka bench live``: producer -> consumer records/s through a live mesh (no store)."""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import sys
import time
from itertools import repeat
from typing import Any

from dafka.bench.common import _mesh, _role
from dafka.cli import progress
from dafka.config import NodeConfig


def _live_producer(cfg: NodeConfig, topic: str, n: int, size: int, start: Any, done: Any) -> None:
    from dafka.nodes.producer import Producer

    producer = Producer(topic, cfg, acks=False, capacity=max(n, 1))
    start.wait(30)
    producer.publish_many(repeat(b"x" * size, n))
    done.wait(120)  # keep answering FETCHes until the consumer has everything
    producer.close(0)


def bench_live(args: argparse.Namespace) -> list[float]:
    """Records/s from one producer process to one consumer process."""
    ctx = mp.get_context("spawn")
    rates = []
    for run in range(args.runs):
        tower, cfg = _mesh(args.secure, not args.no_batches)
        from dafka.nodes.consumer import Consumer

        topic = f"bench-live-{run}"
        consumer = Consumer(topic, _role(cfg, "consumer"), offset_reset="earliest")
        start, done = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_live_producer, args=(cfg, topic, args.records, args.size, start, done))
        proc.start()
        deadline = time.monotonic() + 30
        while len(consumer.peers) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let subscriptions propagate both ways
        # The setup's garbage would otherwise trigger a full collection in the
        # short measured part; a long-running consumer pays that once at start.
        gc.collect()
        start.set()
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 300
        with progress.bar(args.records, f"run {run}") as bar:
            while got < args.records and time.monotonic() < deadline:
                n = len(consumer.poll_batch(100_000, 1.0))
                got += n
                bar.update(n)
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
