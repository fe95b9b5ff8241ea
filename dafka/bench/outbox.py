"""``dafka bench outbox``: publishing through an edge outbox (records/s, each or batch fsync)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics

from dafka.bench.common import _acked_producer, _mesh, _role, _store_process


def bench_outbox(args: argparse.Namespace) -> dict[str, list[float]]:
    """Records/s published into an fsync'd edge outbox and drained to a store, beside ``bench store``.

    Each run measures the plain acknowledged producer (``bench store``) and
    then the same through an outbox (``--outbox-sync``), in the same sitting.
    """
    import tempfile

    ctx = mp.get_context("spawn")
    plain: list[float] = []
    boxed: list[float] = []
    for run in range(args.runs):
        for label, rates in (("store", plain), ("outbox", boxed)):
            tower, cfg = _mesh(False, not args.no_batches)
            with tempfile.TemporaryDirectory(prefix="dafka-bench-") as tmp:
                ready, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
                store = ctx.Process(
                    target=_store_process, args=(_role(cfg, "store"), f"{tmp}/db", not args.no_sync, ready, done)
                )
                store.start()
                ready.wait(60)
                outbox = f"{tmp}/outbox" if label == "outbox" else None
                prod = ctx.Process(
                    target=_acked_producer,
                    args=(cfg, f"bench-{label}-{run}", args.records, args.size, result, outbox, args.outbox_sync),
                )
                prod.start()
                rate = result.get(timeout=900)
                prod.join(30)
                done.set()
                store.join(60)
            tower.close()
            if rate:
                rates.append(rate)
                print(f"run {run}: {label}: {rate:,.0f} records/s acknowledged", flush=True)
    if plain and boxed:
        ratio = statistics.median(boxed) / statistics.median(plain)
        print(f"outbox ({args.outbox_sync}) / store: {ratio:.2f}x")
    return {"store": plain, "outbox": boxed}
