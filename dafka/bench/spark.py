"""``dafka bench spark``: rows/s of a Spark batch read of stored records, both transports.

The store is filled directly through :class:`~dafka.store.db.RecordDB`
(``--records`` records of ``--size`` bytes, spread over a few producer
partitions), then a local SparkSession (all cores) reads it with the
``dafka`` source, through the store directory (``path``) and through a Tank
gateway serving the same store (``gateway``, run in its own process as it
would be in production).  Two queries per run: ``count()`` and a small
aggregation (per partition: count, total value bytes, highest offset).
The rate is records divided by the query's wall time, including Spark's
planning and task start-up.

Entry point: :func:`bench_spark`, called with the ``dafka bench`` arguments
(``records``, ``runs``, ``size``; optional ``transport`` = path | gateway |
both, ``partitions``, ``master``).  It prints one line per measurement and a
summary, and returns ``{"spark <transport> <query>": per-run rows/s}``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from typing import Any

from dafka.config import NodeConfig, TowerAddress

__all__ = ["bench_spark"]

_FILL_CHUNK = 20_000


def _fill(path: str, records: int, size: int, partitions: int) -> list[str]:
    """``records`` records of ``size`` bytes over ``partitions`` producer addresses."""
    from dafka.nodes.node import new_address
    from dafka.store.db import RecordDB

    payload = b"x" * size
    addresses = [new_address() for _ in range(partitions)]
    now = int(time.time() * 1000)
    with RecordDB(path, sync=False) as db:
        for i, address in enumerate(addresses):
            n = records // partitions + (1 if i < records % partitions else 0)
            for start in range(0, n, _FILL_CHUNK):
                stop = min(start + _FILL_CHUNK, n)
                db.append_runs([("bench", address, start, [payload] * (stop - start), now)])
        db.flush()
    return addresses


def _gateway_process(db: str, cfg: NodeConfig, port_q: Any, done: Any) -> None:
    from dafka.tank.gateway import Gateway

    gateway = Gateway(db, cfg, listen=("127.0.0.1", 0), sync=False)
    port_q.put(gateway.tank_port)
    done.wait(3600)
    gateway.close()


def _spark(master: str) -> Any:
    from dafka.spark.session import local_session

    return local_session("dafka-bench-spark", master)


def _measure(spark: Any, options: dict[str, str], records: int) -> tuple[float, float]:
    """``(count rate, aggregation rate)`` in records/s for one run."""
    from pyspark.sql import functions as F

    reader = spark.read.format("dafka")
    for k, v in options.items():
        reader = reader.option(k, v)
    t0 = time.perf_counter()
    n = reader.load().count()
    count_rate = n / (time.perf_counter() - t0)
    if n != records:
        raise RuntimeError(f"counted {n} records, stored {records}")
    t0 = time.perf_counter()
    rows = (
        reader.load()
        .groupBy("partition")
        .agg(F.count("*").alias("n"), F.sum(F.length("value")).alias("bytes"), F.max("offset"))
        .collect()
    )
    agg_rate = sum(r.n for r in rows) / (time.perf_counter() - t0)
    return count_rate, agg_rate


def bench_spark(args: argparse.Namespace) -> dict[str, list[float]]:
    """Measure Spark batch reads of ``args.records`` stored records; see the module docs."""
    records, runs, size = args.records, args.runs, args.size
    which = getattr(args, "transport", None) or "both"
    transports = ["path", "gateway"] if which == "both" else [which]
    partitions = max(1, int(getattr(args, "partitions", None) or 4))
    master = getattr(args, "master", None) or "local[*]"
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="dafka-bench-spark-") as db:
        t0 = time.perf_counter()
        _fill(db, records, size, partitions)
        print(
            f"stored {records:,} records of {size} bytes in {partitions} partitions "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        spark = _spark(master)
        try:
            # One untimed warm-up read: JVM code paths and Python workers start once.
            _measure(spark, {"path": db, "subscribe": "bench"}, records)
            for transport in transports:
                with _transport(transport, db) as options:
                    for run in range(runs):
                        count_rate, agg_rate = _measure(spark, options, records)
                        results.setdefault((transport, "count"), []).append(count_rate)
                        results.setdefault((transport, "aggregation"), []).append(agg_rate)
                        print(
                            f"run {run} {transport:>7}: count {count_rate:,.0f} rows/s, "
                            f"aggregation {agg_rate:,.0f} rows/s",
                            flush=True,
                        )
        finally:
            spark.stop()
    # Every series: `dafka bench` prints the median of each.
    return {f"spark {transport} {query}": rates for (transport, query), rates in results.items()}


class _transport:
    """Context manager: the reader options of one transport (starting a gateway if needed)."""

    def __init__(self, name: str, db: str) -> None:
        self.name = name
        self.db = db
        self._stop: list[Any] = []

    def __enter__(self) -> dict[str, str]:
        base = {"subscribe": "bench"}
        if self.name == "path":
            return {**base, "path": self.db}
        if self.name != "gateway":
            raise ValueError(f"unknown transport {self.name!r}: path, gateway or both")
        from dafka.nodes.tower import Tower

        tower = Tower("127.0.0.1", 0, 0)
        tower.start()
        self._stop.append(tower.close)
        cfg = NodeConfig(
            towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
            bind="127.0.0.1",
            beacon_interval=0.2,
        )
        ctx = mp.get_context("spawn")  # never fork a process holding ZeroMQ or the JVM bridge
        port_q, done = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_gateway_process, args=(self.db, cfg, port_q, done))
        proc.start()

        def stop() -> None:
            done.set()
            proc.join(60)

        self._stop.append(stop)
        port = port_q.get(timeout=120)
        return {**base, "gateway": f"127.0.0.1:{port}"}

    def __exit__(self, *exc: object) -> None:
        while self._stop:
            self._stop.pop()()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--transport", choices=["path", "gateway", "both"], default="both")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--master", default="local[*]")
    sys.exit(0 if bench_spark(parser.parse_args()) else 1)
