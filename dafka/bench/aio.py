"""``dafka bench aio``: the asyncio API against the threaded one (records/s)."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from dafka.bench.common import _mesh_with_stored_topic
from dafka.config import NodeConfig


def _aio_rates(cfg: NodeConfig, topic: str, read_topic: str, args: argparse.Namespace) -> dict[str, float]:
    """Records/s of the threaded and the asyncio producer (acknowledged) and consumer, one record a call."""
    import asyncio

    from dafka import aio
    from dafka.nodes.consumer import Consumer
    from dafka.nodes.producer import Producer

    n, payload = args.records, b"x" * args.size
    rates: dict[str, float] = {}

    def settle(node: Any) -> None:
        deadline = time.monotonic() + 30
        while len(node.peers) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # subscriptions both ways

    with Producer(f"{topic}-sync", cfg, capacity=max(n, 1)) as producer:
        settle(producer)
        gc.collect()
        t0 = time.perf_counter()
        publish = producer.publish
        for _ in range(n):
            publish(payload)
        ok = producer.flush(300)
        rates["produce sync"] = n / (time.perf_counter() - t0) if ok else 0.0

    with Consumer(read_topic, cfg, offset_reset="earliest") as consumer:
        got, t0 = 0, 0.0
        end = time.monotonic() + 300
        for _ in consumer:
            if got == 0:
                t0 = time.perf_counter()  # from the first record: excludes discovery
            got += 1
            if got >= n or time.monotonic() > end:
                break
        rates["consume sync"] = (got - 1) / (time.perf_counter() - t0) if got == n else 0.0

    async def run_async() -> None:
        async with aio.Producer(f"{topic}-aio", cfg, capacity=max(n, 1)) as producer:
            await asyncio.to_thread(settle, producer.node)
            gc.collect()
            t0 = time.perf_counter()
            publish = producer.publish_nowait
            for i in range(n):
                publish(payload)
                if not i & 1023:
                    await asyncio.sleep(0)  # a task among others: let the loop turn
            ok = await producer.flush(300)
            rates["produce aio"] = n / (time.perf_counter() - t0) if ok else 0.0
        async with aio.Consumer(read_topic, cfg, offset_reset="earliest") as consumer:
            got, t0 = 0, 0.0
            end = time.monotonic() + 300
            async for _ in consumer:
                if got == 0:
                    t0 = time.perf_counter()
                got += 1
                if got >= n or time.monotonic() > end:
                    break
            rates["consume aio"] = (got - 1) / (time.perf_counter() - t0) if got == n else 0.0

    asyncio.run(run_async())
    return rates


def bench_aio(args: argparse.Namespace) -> dict[str, list[float]]:
    """dafka.aio beside the threaded API: one record a call, in this process.

    The tower and a store run in their own processes.  Producers publish one
    record a call (``publish`` / ``publish_nowait``) until all are acknowledged;
    consumers read a partition the store holds (``for`` / ``async for``).
    """


    series: dict[str, list[float]] = {}
    for run in range(args.runs):
        read_topic = f"bench-aio-read-{run}"
        with _mesh_with_stored_topic(read_topic, args) as cfg:
            rates = _aio_rates(cfg, f"bench-aio-{run}", read_topic, args)
        for name, rate in rates.items():
            series.setdefault(name, []).append(rate)
        figures = ", ".join(f"{k} {v:,.0f}/s" for k, v in rates.items())
        print(f"run {run}: {figures}", flush=True)
    for what in ("produce", "consume"):
        sync, asy = series.get(f"{what} sync", []), series.get(f"{what} aio", [])
        if sync and asy and statistics.median(sync) > 0:
            ratio = statistics.median(asy) / statistics.median(sync)
            print(f"{what}: aio/sync ratio {ratio:.2f} (goal >= 0.5)", flush=True)
    return series
