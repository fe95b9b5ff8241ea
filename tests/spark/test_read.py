"""Reading Dafka topics into Spark: batch and streaming, through a store directory or a gateway.

Real LMDB stores in temporary directories, a real gateway and real mesh
nodes; Spark's Python workers open the stores read-only in their own
processes while this process writes them.
"""

from __future__ import annotations

import datetime as dt
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB, Retention, RetentionPolicy
from dafka.store.node import Store
from dafka.tank.client import TankClient
from tests.conftest import wait_until
from tests.spark.helpers import (
    TS0,
    A,
    B,
    C,
    D,
    expected,
    fill,
    forget_commit,
    gateway,
    read,
    rows,
    run_available_now,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


@pytest.fixture
def store(tmp_path: Path) -> Any:
    """A store with topic ``orders`` (A: 1000 plain records, B: 300 keyed) and ``other``."""
    path = tmp_path / "store"
    db = RecordDB(path)
    fill(db, "orders", A, 0, 1000)
    fill(db, "orders", B, 0, 300, keyed=True)
    fill(db, "other", C, 0, 5)
    yield path, db
    db.close()


def test_batch_read_equals_what_was_stored(spark: Any, store: Any) -> None:
    path, _db = store
    df = read(spark, path=path, subscribe="orders", maxRecordsPerPartition=256)
    # One input partition per Dafka partition, large ones split: 1000 -> 4, 300 -> 2.
    assert df.rdd.getNumPartitions() == 6
    assert rows(df) == expected(A, 0, 1000) + expected(B, 0, 300, keyed=True)
    first_b = df.where(f"partition = '{B}' AND offset = 7").collect()[0]
    assert first_b.topic == "orders"
    # Spark hands timestamps to Python as naive local times.
    assert first_b.timestamp == dt.datetime.fromtimestamp((TS0 + 7) / 1000)
    # Keyed records carry the producer's timestamp (0), the others the store's (1).
    types = {(r.partition, r.timestampType) for r in df.select("partition", "timestampType").collect()}
    assert types == {(A, 1), (B, 0)}


def test_batch_read_of_a_range_and_aggregation(spark: Any, store: Any) -> None:
    path, _db = store
    df = read(
        spark,
        path=path,
        subscribe="orders,other",
        startingOffsets={"orders": {A: 100, B: -2}, "other": -1},
        endingOffsets={"orders": {A: 200, B: 10}},
    )
    assert rows(df) == expected(A, 100, 200) + expected(B, 0, 10, keyed=True)
    from pyspark.sql import functions as F

    summary = df.groupBy("partition").agg(F.count("*").alias("n"), F.sum("offset").alias("s"))
    agg = {r.partition: (r.n, r.s) for r in summary.collect()}
    assert agg == {A: (100, sum(range(100, 200))), B: (10, 45)}


def test_stream_available_now_respects_max_offsets_per_trigger(
    spark: Any, store: Any, tmp_path: Path
) -> None:
    path, _db = store
    df = read(spark, True, path=path, subscribe="orders", startingOffsets="earliest",
              maxOffsetsPerTrigger=500)
    got = run_available_now(df, tmp_path / "cp")
    assert [len(r) for _b, r in got] == [500, 500, 300]
    assert sorted(r for _b, batch in got for r in batch) == expected(A, 0, 1000) + expected(
        B, 0, 300, keyed=True
    )
    # Without a limit availableNow reads everything in one batch.
    whole = run_available_now(
        read(spark, True, path=path, subscribe="orders", startingOffsets="earliest"), tmp_path / "cp2"
    )
    assert [len(r) for _b, r in whole] == [1300]


def test_stream_restarted_from_checkpoint_continues_exactly(
    spark: Any, store: Any, tmp_path: Path
) -> None:
    path, db = store
    cp = tmp_path / "cp"

    def stream() -> Any:
        return read(spark, True, path=path, subscribe="orders", startingOffsets="earliest",
                    maxOffsetsPerTrigger=700)

    first = run_available_now(stream(), cp)
    assert [b for b, _r in first] == [0, 1]
    fill(db, "orders", A, 1000, 1200)
    fill(db, "orders", D, 0, 50)  # a producer that appeared meanwhile: read from offset 0
    second = run_available_now(stream(), cp)
    assert [b for b, _r in second] == [2]
    assert second[0][1] == expected(A, 1000, 1200) + expected(D, 0, 50)
    # Spark lost the record of batch 2's completion: it runs it again, same records.
    forget_commit(cp, 2)
    again = run_available_now(stream(), cp)
    assert again == second
    assert run_available_now(stream(), cp) == []


def test_stream_reads_a_live_store(spark: Any, cfg: NodeConfig, tmp_path: Path) -> None:
    """A store on the mesh receives records from a producer while the query runs."""
    path = tmp_path / "live"
    got: list[tuple] = []
    with Store(path, cfg), Producer("live", cfg) as producer:
        producer.publish_many(b"r%d" % i for i in range(100))
        assert producer.flush(30)
        df = read(spark, True, path=path, subscribe="live", startingOffsets="earliest")
        query = (
            df.writeStream.foreachBatch(lambda b, _i: got.extend(rows(b)))
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            wait_until(lambda: len(got) >= 100, timeout=60)
            producer.publish_many(b"r%d" % i for i in range(100, 2000))
            assert producer.flush(30)
            wait_until(lambda: len(got) >= 2000, timeout=60)
            # A last record behind everything: a duplicate would have to arrive before it.
            producer.publish(b"end")
            assert producer.flush(30)
            wait_until(lambda: any(r[3] == b"end" for r in got), timeout=60)
        finally:
            query.stop()
    assert [(r[1], r[3]) for r in sorted(got)] == [(i, b"r%d" % i) for i in range(2000)] + [
        (2000, b"end")
    ]
    assert {r[0] for r in got} == {producer.address}


def test_both_transports_read_the_same(spark: Any, cfg: NodeConfig, tmp_path: Path) -> None:
    """Records from a Dafka producer and from a Tank client, read via the gateway and its store."""
    db = tmp_path / "gw"
    with gateway(db, cfg) as gw:
        with TankClient("127.0.0.1", gw.tank_port) as client:
            client.create_topic("mixed", 1)
            client.produce("mixed", 0, [(b"k%d" % i, b"t%d" % i, TS0 + i) for i in range(300)])
        with Producer("mixed", cfg) as producer:
            producer.publish_many(b"p%d" % i for i in range(700))
            assert producer.flush(30)
        addr = f"127.0.0.1:{gw.tank_port}"
        via_gw = read(spark, gateway=addr, subscribe="mixed", maxRecordsPerPartition=200)
        via_path = read(spark, path=db, subscribe="mixed")
        assert via_gw.rdd.getNumPartitions() == 2 + 4
        cols = ["partition", "offset", "key", "value", "topic", "timestamp"]
        g = sorted(tuple(r) for r in via_gw.select(*cols).collect())
        p = sorted(tuple(r) for r in via_path.select(*cols).collect())
        assert g == p and len(g) == 1000
        tank_rows = [r for r in g if r[2] is not None]
        assert [r[1:4] for r in tank_rows] == [(i, b"k%d" % i, b"t%d" % i) for i in range(300)]
        assert {r[0] for r in g} == {producer.address, tank_rows[0][0]}
        # Streaming through the gateway, with admission control.
        got = run_available_now(
            read(spark, True, gateway=addr, subscribe="mixed", startingOffsets="earliest",
                 maxOffsetsPerTrigger=400),
            tmp_path / "cp",
        )
        assert [len(r) for _b, r in got] == [400, 400, 200]
        assert sorted(r for _b, batch in got for r in batch) == rows(via_path)


def test_data_loss(spark: Any, store: Any) -> None:
    path, db = store
    # Retention keeps only the newest 600 of A's records (each 4-5 bytes: 2800 bytes).
    while db.enforce_retention(
        0, RetentionPolicy(topics={"orders": Retention(max_bytes=3500)})
    ).more:
        pass
    first = db.first("orders", A)
    assert 0 < first < 1000
    start = {"orders": {A: 0, B: 0}}
    with pytest.raises(Exception, match=f"records 0..{first - 1} of orders/{A} were removed"):
        read(spark, path=path, subscribe="orders", startingOffsets=start).collect()
    got = rows(read(spark, path=path, subscribe="orders", startingOffsets=start, failOnDataLoss="false"))
    assert [r for r in got if r[0] == A] == expected(A, first, 1000)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"path": "{path}"}, "option 'subscribe' is required"),
        ({"subscribe": "orders"}, "missing option: give 'path'"),
        ({"subscribe": "nope", "path": "{path}"}, "unknown topic 'nope'"),
        ({"subscribe": "orders", "path": "{path}/missing"}, "no Dafka store at"),
        ({"subscribe": "orders", "gateway": "127.0.0.1:{port}", "timeout": "2"},
         "cannot reach the Dafka gateway at 127.0.0.1:"),
        ({"subscribe": "orders", "path": "{path}", "startingOffsets": "{{"}, "startingOffsets"),
    ],
)
def test_clear_errors(spark: Any, store: Any, options: dict, message: str) -> None:
    path, _db = store
    opts = {k: v.format(path=path, port=_closed_port()) for k, v in options.items()}
    t0 = time.monotonic()
    with pytest.raises(Exception, match=message):
        read(spark, **opts).collect()
    assert time.monotonic() - t0 < 30


def test_unknown_topic_through_the_gateway(spark: Any, cfg: NodeConfig, tmp_path: Path) -> None:
    with gateway(tmp_path / "gw", cfg) as gw:
        with pytest.raises(Exception, match="unknown topic 'nope': the gateway"):
            read(spark, gateway=f"127.0.0.1:{gw.tank_port}", subscribe="nope").collect()
