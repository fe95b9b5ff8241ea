"""``dafka bench embedded``: publish and consume from an app thread, with and without a busy thread."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from dafka.bench.common import _mesh_with_stored_topic
from dafka.config import NodeConfig


def _busy(stop: Any) -> None:
    """The application's own work: a pure-Python loop that never waits."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _with_busy_thread(busy: bool, fn: Callable[[], float]) -> float:
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if busy:
        thread.start()
    try:
        return fn()
    finally:
        stop.set()
        if busy:
            thread.join()


def _embedded_publish(cfg: NodeConfig, topic: str, args: argparse.Namespace, busy: bool) -> float:
    """Records/s an embedded Producer gets acknowledged by the store, for ``--seconds``."""
    from dafka.nodes.producer import Producer

    producer = Producer(topic, cfg, capacity=max(args.records, 1))
    deadline = time.monotonic() + 30
    while len(producer.peers) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # subscriptions both ways
    chunk = [b"x" * args.size] * 100

    def run() -> float:
        t0 = time.perf_counter()
        end = time.monotonic() + args.seconds
        sent = 0
        while time.monotonic() < end and sent < args.records:
            producer.publish_many(chunk)
            sent += len(chunk)
        ok = producer.flush(120)
        elapsed = time.perf_counter() - t0
        return (producer.acked_offset + 1) / elapsed if ok else 0.0

    try:
        return _with_busy_thread(busy, run)
    finally:
        producer.close(0)


def _embedded_consume(cfg: NodeConfig, topic: str, args: argparse.Namespace, busy: bool) -> float:
    """Records/s an embedded earliest Consumer reads from the store, for ``--seconds``."""
    from dafka.nodes.consumer import Consumer

    def run() -> float:
        consumer = Consumer(topic, cfg, offset_reset="earliest")
        try:
            got, t0 = 0, None
            end = time.monotonic() + 60
            while got < args.records and time.monotonic() < end:
                batch = consumer.poll_batch(100_000, 1.0)
                if batch and t0 is None:
                    t0 = time.perf_counter()  # from the first record: excludes discovery
                    end = time.monotonic() + args.seconds
                got += len(batch)
            return got / (time.perf_counter() - t0) if t0 is not None and got else 0.0
        finally:
            consumer.close()

    return _with_busy_thread(busy, run)


def bench_embedded(args: argparse.Namespace) -> dict[str, list[float]]:
    """An app with one busy pure-Python thread embeds a Producer, then a Consumer.

    The store and the tower run in their own processes; the producer and the
    consumer run in this one, beside the busy thread or alone.  Reports
    records/s for both with and without the busy thread, and the ratio.
    """

    from dafka import fastio

    print(f"I/O implementation: {fastio.IMPLEMENTATION} ({fastio.REASON})", flush=True)
    series: dict[str, list[float]] = {}
    for run in range(args.runs):
        topic = f"bench-embedded-read-{run}"
        with _mesh_with_stored_topic(topic, args) as cfg:
            for busy in (False, True):
                label = "busy" if busy else "alone"
                rate = _embedded_publish(cfg, f"bench-embedded-{run}-{label}", args, busy)
                series.setdefault(f"produce {label}", []).append(rate)
                print(f"run {run}: produce, {label}: {rate:,.0f} records/s acknowledged", flush=True)
            for busy in (False, True):
                label = "busy" if busy else "alone"
                rate = _embedded_consume(cfg, topic, args, busy)
                series.setdefault(f"consume {label}", []).append(rate)
                print(f"run {run}: consume, {label}: {rate:,.0f} records/s", flush=True)
    for what in ("produce", "consume"):
        alone, busy = series.get(f"{what} alone", []), series.get(f"{what} busy", [])
        if alone and busy and statistics.median(alone) > 0:
            ratio = statistics.median(busy) / statistics.median(alone)
            print(f"{what}: busy/alone ratio {ratio:.2f} (goal >= 0.4)", flush=True)
    return series
