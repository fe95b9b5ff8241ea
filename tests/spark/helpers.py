"""Helpers shared by the Spark tests: stores, gateways, reading and streaming."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dafka.config import NodeConfig
from dafka.store.db import RecordDB

A, B, C, D = "A" * 32, "B" * 32, "C" * 32, "D" * 32
TS0 = 1_700_000_000_000  # ms


def fill(db: RecordDB, topic: str, partition: str, start: int, stop: int, *, keyed: bool = False) -> None:
    """Records ``start..stop-1``: value ``<partition[0]><offset>``, ts TS0 + offset.

    ``keyed`` records look like ones written through the gateway: a key and
    the producer's timestamp.
    """
    tag = partition[0].lower().encode()
    # In commits of 100 records, as a store's group commit would: blocks of 100 records, so
    # that retention (by whole blocks) can remove part of a partition.
    for lo in range(start, stop, 100):
        hi = min(lo + 100, stop)
        if keyed:
            db.append(
                [(topic, partition, i, tag + b"%d" % i, TS0 + i, b"k%d" % i, True) for i in range(lo, hi)]
            )
        else:
            db.append([(topic, partition, i, tag + b"%d" % i, TS0 + i) for i in range(lo, hi)])


def read(spark: Any, streaming: bool = False, **options: Any) -> Any:
    """``spark.read(Stream).format("dafka")`` with ``options`` (dicts become JSON)."""
    r = (spark.readStream if streaming else spark.read).format("dafka")
    for k, v in options.items():
        r = r.option(k, json.dumps(v) if isinstance(v, dict) else str(v))
    return r.load()


def rows(df: Any) -> list[tuple]:
    """``(partition, offset, key, value)`` of every row, sorted."""
    return sorted((r.partition, r.offset, r.key, r.value) for r in df.collect())


def expected(partition: str, start: int, stop: int, *, keyed: bool = False) -> list[tuple]:
    tag = partition[0].lower().encode()
    return [
        (partition, i, b"k%d" % i if keyed else None, tag + b"%d" % i) for i in range(start, stop)
    ]


def run_available_now(df: Any, checkpoint: Path, timeout: float = 120.0) -> list[tuple[int, list[tuple]]]:
    """Run ``df`` to the end with Trigger.AvailableNow; ``[(batch id, rows)]`` per micro-batch."""
    got: list[tuple[int, list[tuple]]] = []

    def sink(batch: Any, batch_id: int) -> None:
        got.append((batch_id, rows(batch)))

    query = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(timeout), "the availableNow query did not finish"
    if query.exception() is not None:
        raise AssertionError(f"query failed: {query.exception()}")
    return got


@contextmanager
def gateway(db: Path, cfg: NodeConfig) -> Iterator[Any]:
    """A Tank gateway (a full store node) on an ephemeral loopback port."""
    from dafka.tank.gateway import Gateway

    gw = Gateway(str(db), cfg, listen=("127.0.0.1", 0))
    try:
        yield gw
    finally:
        gw.close()


def forget_commit(checkpoint: Path, batch: int) -> None:
    """Make Spark forget that ``batch`` completed, as if it died right before recording it."""
    (checkpoint / "commits" / str(batch)).unlink()
    (checkpoint / "commits" / f".{batch}.crc").unlink(missing_ok=True)
