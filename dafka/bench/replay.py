"""``dafka bench replay``: a consumer reading a stored topic from offset 0 (records/s)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

from dafka.bench.common import _mesh, _role, _store_process
from dafka.cli import progress


def bench_replay(args: argparse.Namespace) -> list[float]:
    """Records/s an earliest consumer reads back from one store process."""
    import tempfile

    from dafka.nodes.consumer import Consumer
    from dafka.store.db import RecordDB

    ctx = mp.get_context("spawn")
    rates = []
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        topic = "bench-replay"
        payload = b"x" * args.size
        with RecordDB(db, sync=False) as records:
            partition = "B" * 32
            now = int(time.time() * 1000)
            for start in range(0, args.records, 10_000):
                stop = min(start + 10_000, args.records)
                records.append([(topic, partition, i, payload, now) for i in range(start, stop)])
        for run in range(args.runs):
            tower, cfg = _mesh(args.secure, not args.no_batches)
            ready, done = ctx.Event(), ctx.Event()
            store = ctx.Process(target=_store_process, args=(_role(cfg, "store"), db, False, ready, done))
            store.start()
            ready.wait(60)
            consumer = Consumer(topic, _role(cfg, "consumer"), offset_reset="earliest")
            got = 0
            t0 = None
            deadline = time.monotonic() + 600
            bar = progress.bar(args.records, f"run {run}")
            while got < args.records and time.monotonic() < deadline:
                batch = consumer.poll_batch(100_000, 1.0)
                if batch and t0 is None:
                    t0 = time.perf_counter()  # from the first record: excludes discovery
                got += len(batch)
                bar.update(len(batch))
            bar.close()
            elapsed = time.perf_counter() - (t0 or time.perf_counter())
            consumer.close()
            done.set()
            store.join(60)
            tower.close()
            if got >= args.records and elapsed > 0:
                rates.append(got / elapsed)
                print(f"run {run}: {got / elapsed:,.0f} records/s replayed", flush=True)
            else:
                print(f"run {run}: only {got} records", file=sys.stderr)
    return rates
