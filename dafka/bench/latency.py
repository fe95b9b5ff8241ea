"""``dafka bench latency``: delivery and ACK latency percentiles at a fixed rate."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

from dafka.bench.common import _mesh, _store_process
from dafka.cli import progress
from dafka.config import NodeConfig


def _percentiles(samples: list[float]) -> str:
    """p50/p99/p99.9/max of latencies in seconds, as milliseconds."""
    if not samples:
        return "no samples"
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return (
        f"p50 {at(0.5):.3f} ms  p99 {at(0.99):.3f} ms  p99.9 {at(0.999):.3f} ms"
        f"  max {ordered[-1] * 1000:.3f} ms  ({len(ordered)} records)"
    )


def _bucket_quantile(bounds: tuple[float, ...], counts: list[int], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile ``q``."""
    need, running = q * sum(counts), 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        running += n
        if running >= need:
            return bound
    return float("inf")


def _paced_producer(
    cfg: NodeConfig,
    topic: str,
    rate: int,
    seconds: float,
    size: int,
    go: Any,
    result: Any,
    acks: bool = True,
    outbox: str | None = None,
    sync: str = "each",
) -> None:
    """Publish ``rate`` records/s stamped with their send time; collect publish->ACK latencies."""
    import struct

    from dafka.nodes.producer import Producer

    n = int(rate * seconds)
    extra: dict[str, Any] = {"outbox": outbox, "outbox_sync": sync} if outbox else {}
    producer = Producer(topic, cfg, capacity=max(n, 1), acks=acks, **extra)
    stamp = struct.Struct(">q")
    pad = b"x" * max(0, size - stamp.size)
    sent = [0] * n
    acked: list[float] = []
    clock = time.perf_counter_ns  # CLOCK_MONOTONIC: comparable across processes

    def on_ack(receipt: Any) -> None:
        if acks and receipt.acked():
            acked.append((clock() - sent[receipt.offset]) / 1e9)

    go.wait(60)
    t0 = clock()
    interval = 1e9 / rate
    i = 0
    while i < n:
        due = min(n, int((clock() - t0) / interval) + 1)
        while i < due:
            now = clock()
            sent[i] = now
            producer.publish(stamp.pack(now) + pad, on_ack)
            i += 1
        if i < n:
            # Sleep to the next record's time (Linux sleeps ~60 us past it).
            time.sleep(max(0.0, (t0 + i * interval - clock()) / 1e9))
    producer.flush(30)
    producer.close(5)
    result.put(acked)


def _zmq_latency_receiver(port: int, n: int, ready: Any, result: Any) -> None:
    import struct

    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    ready.set()
    unpack, clock = struct.Struct(">q").unpack_from, time.perf_counter_ns
    lat = []
    while len(lat) < n and sub.poll(10_000):
        lat.append((clock() - unpack(sub.recv())[0]) / 1e9)
    sub.close(0)
    result.put(lat)


def _zmq_latency(rate: int, seconds: float, size: int) -> list[float]:
    """The floor on this machine: bare pyzmq PUB -> SUB between two processes at ``rate``."""
    import struct

    import zmq

    ctx = mp.get_context("spawn")
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    n = int(rate * seconds)
    ready, result = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_zmq_latency_receiver, args=(port, n, ready, result))
    proc.start()
    ready.wait(30)
    time.sleep(1.0)  # the subscription has to reach the PUB
    stamp, pad = struct.Struct(">q"), b"x" * max(0, size - 8)
    clock, interval, t0, i = time.perf_counter_ns, 1e9 / rate, time.perf_counter_ns(), 0
    while i < n:
        due = min(n, int((clock() - t0) / interval) + 1)
        while i < due:
            pub.send(stamp.pack(clock()) + pad)
            i += 1
        if i < n:
            time.sleep(max(0.0, (t0 + i * interval - clock()) / 1e9))
    lat = result.get(timeout=60)
    proc.join(30)
    pub.close(0)
    return lat[int(rate * 0.5) :]


def bench_latency(args: argparse.Namespace) -> dict[str, list[float]]:
    """Latency at a fixed rate: producer -> consumer delivery and publish -> store ACK.

    Producer, store (fsync on unless --no-sync) and consumer are separate
    processes (the consumer is this one).  The first half second of each run
    is left out (connections settling).  ``--no-store``: no store, no ACKs,
    delivery alone (what a store's commits on the same cores cost it).
    """
    import struct
    import tempfile

    from dafka.nodes.consumer import Consumer

    ctx = mp.get_context("spawn")
    unpack = struct.Struct(">q").unpack_from
    clock = time.perf_counter_ns
    delivery: list[float] = []
    ack: list[float] = []
    for run in range(args.runs):
        tower, cfg = _mesh(batches=not args.no_batches)
        topic = f"bench-latency-{run}"
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            ready, done, go, result = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
            stats = ctx.Queue()
            with_store = not args.no_store
            store = ctx.Process(
                target=_store_process, args=(cfg, db, not args.no_sync, ready, done, stats)
            )
            if with_store:
                store.start()
                ready.wait(60)
            consumer = Consumer(topic, cfg)
            prod = ctx.Process(
                target=_paced_producer,
                args=(
                    cfg, topic, args.rate, args.seconds, args.size, go, result, with_store,
                    f"{db}/outbox" if args.outbox else None, args.outbox_sync,
                ),
            )
            prod.start()
            try:
                # Both the consumer and the store must be connected to the producer.
                deadline = time.monotonic() + 30
                while len(consumer.peers) < 1 + with_store and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(1.5)  # the producer connects to its peers from their beacons
                go.set()
                n = int(args.rate * args.seconds)
                warm = int(args.rate * 0.5)
                got: list[float] = []
                deadline = time.monotonic() + args.seconds + 30
                with progress.bar(n, f"run {run}") as bar:
                    while len(got) < n and time.monotonic() < deadline:
                        record = consumer.poll(0.5)
                        if record is not None:
                            got.append((clock() - unpack(record.content)[0]) / 1e9)
                            if len(got) % 1000 == 0:
                                bar.update(1000)  # not per record: this loop is measured
                acks = result.get(timeout=60)
            finally:
                prod.join(30)
                consumer.close()
                done.set()
                store_stats = []
                if with_store:
                    try:
                        store_stats = stats.get(timeout=60)
                    except Exception:
                        pass
                    store.join(60)
                tower.close()
        run_delivery, run_ack = got[warm:], acks[warm:]
        for name, unit, (bounds, counts, total, count) in zip(
            ("store commit (fsync)", "store commit size", "store receipt->ACK"),
            (1000, 1, 1000),
            store_stats,
            strict=False,
        ):
            if count:
                p99 = _bucket_quantile(bounds, counts, 0.99) * unit
                print(f"run {run}: {name}: mean {total / count * unit:.1f}, p99 <= {p99:g} ({count} commits)")
        print(f"run {run}: delivery {_percentiles(run_delivery)}", flush=True)
        if with_store:
            print(f"run {run}: ACK      {_percentiles(run_ack)}", flush=True)
        if len(got) < n:
            print(f"run {run}: only {len(got)} of {n} records delivered", file=sys.stderr)
        delivery += run_delivery
        ack += run_ack
    sync = "no store" if args.no_store else "fsync off" if args.no_sync else "fsync on"
    if args.outbox:
        sync += f", outbox {args.outbox_sync}"
    print(f"latency at {args.rate:,} records/s of {args.size} bytes, {args.runs} runs ({sync}):")
    print(f"  producer -> consumer delivery: {_percentiles(delivery)}")
    if not args.no_store:
        print(f"  publish -> store ACK:          {_percentiles(ack)}")
    print(f"  bare pyzmq PUB -> SUB (floor): {_percentiles(_zmq_latency(args.rate, args.seconds, args.size))}")
    return {} if delivery and (ack or args.no_store) else {"latency": []}
