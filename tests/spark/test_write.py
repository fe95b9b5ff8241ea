"""Writing DataFrames to Dafka through a real gateway: batch, and streaming exactly once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.spark.options import Transport
from dafka.spark.transport import connect, partition_map
from dafka.tank.client import TankClient, UnknownTopicError
from tests.spark.helpers import forget_commit, gateway, read

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


@pytest.fixture
def gw(cfg: NodeConfig, tmp_path: Path) -> Any:
    with gateway(tmp_path / "gw", cfg) as g:
        yield g


def topic_rows(spark: Any, gw: Any, topic: str) -> list[tuple]:
    """``(partition, offset, key, value)`` of every record of ``topic``, read through the gateway."""
    df = read(spark, gateway=f"127.0.0.1:{gw.tank_port}", subscribe=topic)
    return sorted((r.partition, r.offset, r.key, r.value) for r in df.collect())


def test_batch_write_lands_in_order(spark: Any, gw: Any) -> None:
    addr = f"127.0.0.1:{gw.tank_port}"
    df = spark.createDataFrame(
        [(f"k{i}" if i % 3 else None, f"v{i}") for i in range(5000)], "key string, value string"
    ).coalesce(1)
    (df.write.format("dafka").option("gateway", addr).option("topic", "out")
     .option("maxRecordsPerRequest", "700").mode("append").save())
    got = topic_rows(spark, gw, "out")
    assert [(r[1], r[2], r[3]) for r in got] == [
        (i, (b"k%d" % i) if i % 3 else None, b"v%d" % i) for i in range(5000)
    ]
    # A topic column routes rows; binary columns; the source's own columns are ignored.
    src = spark.createDataFrame(
        [("t1" if i % 2 else "t2", bytearray(b"x%d" % i)) for i in range(100)], "topic string, value binary"
    ).repartition(2)
    src.write.format("dafka").option("gateway", addr).mode("append").save()
    t1, t2 = topic_rows(spark, gw, "t1"), topic_rows(spark, gw, "t2")
    assert sorted(r[3] for r in t1) == sorted(b"x%d" % i for i in range(1, 100, 2))
    assert sorted(r[3] for r in t2) == sorted(b"x%d" % i for i in range(0, 100, 2))
    # Copying a topic read with the dafka source.
    copy = read(spark, gateway=addr, subscribe="out")
    copy.coalesce(1).write.format("dafka").option("gateway", addr).option("topic", "out2").mode(
        "append"
    ).save()
    assert [r[1:] for r in topic_rows(spark, gw, "out2")] == [r[1:] for r in got]


def test_write_errors(spark: Any, gw: Any, tmp_path: Path) -> None:
    df = spark.createDataFrame([("a",)], "value string")
    with pytest.raises(Exception, match="'gateway'.*required"):
        df.write.format("dafka").option("path", str(tmp_path)).option("topic", "x").mode("append").save()
    with pytest.raises(Exception, match="needs a 'value' column"):
        spark.createDataFrame([("a",)], "v string").write.format("dafka").option(
            "gateway", f"127.0.0.1:{gw.tank_port}"
        ).option("topic", "x").mode("append").save()
    with pytest.raises(Exception, match="no topic"):
        df.write.format("dafka").option("gateway", f"127.0.0.1:{gw.tank_port}").mode("append").save()


PER_PARTITION = 15_000  # two source partitions; micro-batches of 5000 + 5000
FAIL_AT = 7_500  # batch 1 dies in its second task, once its first task has finished


def test_streaming_write_restarted_does_not_duplicate(spark: Any, gw: Any, tmp_path: Path) -> None:
    """Batch 1 dies half done; the query restarts from its checkpoint; then batch 2 runs twice."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    port = gw.tank_port
    addr = f"127.0.0.1:{port}"
    with TankClient("127.0.0.1", port) as client:
        client.create_topic("src", 2)
        for pid, tag in ((0, b"a"), (1, b"b")):
            for lo in range(0, PER_PARTITION, 5000):
                client.produce("src", pid, [(b"k%d" % i, tag + b"%d" % i) for i in range(lo, lo + 5000)])
        with connect(Transport(host="127.0.0.1", port=port)) as c:
            by_address = sorted((a, pid) for (_t, pid), (a, _o) in partition_map(c, ["src"]).items())
    # Write task i reads the i-th source partition by address and writes dst partition i.
    doomed = by_address[1][0]
    marker = tmp_path / "failed-once"

    def guard(partition: str, offset: int) -> int:
        # Runs in the second write task: the first time its row FAIL_AT comes by, wait
        # until the first task has written all of batch 1, then kill the batch.
        if partition == doomed and offset == FAIL_AT and not marker.exists():
            deadline = time.monotonic() + 60
            while dst_hwm(port, 0) < 2 * 5000 and time.monotonic() < deadline:
                time.sleep(0.05)
            marker.touch()
            raise RuntimeError("injected failure in the middle of a batch")
        return offset

    guard_udf = F.udf(guard, LongType(), useArrow=False)

    def start() -> Any:
        src = read(spark, True, gateway=addr, subscribe="src", startingOffsets="earliest",
                   maxOffsetsPerTrigger=10_000)
        out = src.select("key", "value", guard_udf("partition", "offset").alias("checked"))
        return (
            out.writeStream.format("dafka")
            .option("gateway", addr)
            .option("topic", "dst")
            .option("numPartitions", "2")
            .option("maxRecordsPerRequest", "500")
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )

    query = start()
    with pytest.raises(Exception, match="injected failure"):
        query.awaitTermination(120)
    assert dst_hwm(port, 0) == 10_000  # batches 0 and 1 of the first task
    assert 5_000 <= dst_hwm(port, 1) < 10_000  # batch 0 and maybe part of batch 1
    query = start()
    assert query.awaitTermination(120) and query.exception() is None
    # Spark forgets it finished the last batch: it runs it again; the sink recognises it.
    forget_commit(tmp_path / "cp", 2)
    query = start()
    assert query.awaitTermination(120) and query.exception() is None
    got = topic_rows(spark, gw, "dst")
    assert len(got) == 2 * PER_PARTITION
    for tag in (b"a", b"b"):
        mine = [r for r in got if r[3].startswith(tag)]
        assert len({r[0] for r in mine}) == 1  # one task, one partition, in order
        assert [r[1:] for r in mine] == [(i, b"k%d" % i, tag + b"%d" % i) for i in range(PER_PARTITION)]


def dst_hwm(port: int, pid: int) -> int:
    with TankClient("127.0.0.1", port) as c:
        try:
            return c.discover_partitions("dst")[pid].hwm
        except (UnknownTopicError, KeyError):
            return 0
