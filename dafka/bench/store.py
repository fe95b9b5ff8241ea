"""``dafka bench store``: acknowledged publishing (records/s) into a store process."""

from __future__ import annotations

import argparse
import multiprocessing as mp

from dafka.bench.common import _acked_producer, _mesh, _role, _store_process


def bench_store(args: argparse.Namespace) -> list[float]:
    """Records/s acknowledged by one store process, from one producer process."""
    import tempfile

    ctx = mp.get_context("spawn")
    rates = []
    for run in range(args.runs):
        tower, cfg = _mesh(args.secure, not args.no_batches)
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            ready, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
            store = ctx.Process(target=_store_process, args=(_role(cfg, "store"), db, not args.no_sync, ready, done))
            store.start()
            ready.wait(60)
            prod = ctx.Process(target=_acked_producer, args=(cfg, f"bench-store-{run}", args.records, args.size, result))
            prod.start()
            rate = result.get(timeout=900)
            prod.join(30)
            done.set()
            store.join(60)
        tower.close()
        if rate:
            rates.append(rate)
            print(f"run {run}: {rate:,.0f} records/s acknowledged (sync={'off' if args.no_sync else 'on'})", flush=True)
    return rates
