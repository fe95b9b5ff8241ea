"""The exactly-once streaming sink protocol against a real gateway, without Spark.

Spark's part (which task runs when, with which rows) is played by hand so
that a task dying half way through a batch, a batch run again after its
commit, and broken assumptions are exercised deterministically.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dafka.config import NodeConfig
from dafka.errors import DafkaError
from dafka.spark.options import Transport, WriteOptions
from dafka.spark.produce import commit_stream_batch, write_batch_task, write_stream_task
from dafka.spark.sinklog import log_topic
from dafka.tank.client import TankClient
from tests.spark.helpers import gateway

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gw(cfg: NodeConfig, tmp_path: Path) -> Any:
    with gateway(tmp_path / "gw", cfg) as g:
        yield g


def options(gw: Any, **kw: Any) -> WriteOptions:
    base = {"topic": "dst", "num_partitions": 2, "max_records_per_request": 100, "sink_id": None}
    base.update(kw)
    return WriteOptions(transport=Transport(host="127.0.0.1", port=gw.tank_port), **base)


def batches(values: list[bytes], size: int = 250, die_after: int | None = None) -> Iterator[pa.RecordBatch]:
    """Arrow input as Spark hands it to a writer; ``die_after`` batches, then the task dies."""
    for n, i in enumerate(range(0, len(values), size)):
        if die_after is not None and n == die_after:
            raise RuntimeError("task killed")
        chunk = values[i : i + size]
        yield pa.RecordBatch.from_pydict(
            {"key": [b"k" + v for v in chunk], "value": chunk},
            schema=pa.schema([("key", pa.binary()), ("value", pa.binary())]),
        )


def stored(gw: Any, topic: str, pid: int) -> list[tuple[int, bytes | None, bytes]]:
    with TankClient("127.0.0.1", gw.tank_port) as c:
        hwm = c.discover_partitions(topic)[pid].hwm
        out: list[tuple[int, bytes | None, bytes]] = []
        seq = 1
        while seq <= hwm:
            res = c.consume(topic, pid, seq, 1 << 20)
            out += [(m[0], m[2], m[3]) for m in res.messages]
            seq = res.messages[-1][0] + 1
        return out


def values(lo: int, hi: int, tag: bytes = b"v") -> list[bytes]:
    return [tag + b"%d" % i for i in range(lo, hi)]


def test_task_killed_half_way_then_run_again(gw: Any) -> None:
    opts = options(gw)
    first = values(0, 2000)
    with pytest.raises(RuntimeError, match="task killed"):
        write_stream_task(opts, "q1", 0, 0, batches(first, die_after=3))
    # 750 rows reached the task: 7 full produce requests are durable, 50 rows were lost.
    assert len(stored(gw, "dst", 0)) == 700
    written = write_stream_task(opts, "q1", 0, 0, batches(first))
    assert written == {"dst": (0, 1, 2000)}
    assert commit_stream_batch(opts, "q1", 0, [written])
    # Spark runs batch 0 once more (its completion was not recorded): nothing new.
    assert write_stream_task(opts, "q1", 0, 0, batches(first)) == written
    assert not commit_stream_batch(opts, "q1", 0, [written])
    # The next batch continues right after.
    second = values(2000, 2300)
    assert write_stream_task(opts, "q1", 1, 0, batches(second)) == {"dst": (0, 2001, 2300)}
    got = stored(gw, "dst", 0)
    assert got == [(i + 1, b"k" + v, v) for i, v in enumerate(first + second)]


def test_tasks_own_partitions_and_the_log_holds_commits(gw: Any) -> None:
    opts = options(gw, num_partitions=2)
    w0 = write_stream_task(opts, "q2", 0, 0, batches(values(0, 300, b"a")))
    w1 = write_stream_task(opts, "q2", 0, 1, batches(values(0, 200, b"b")))
    assert (w0, w1) == ({"dst": (0, 1, 300)}, {"dst": (1, 1, 200)})
    assert commit_stream_batch(opts, "q2", 0, [w0, w1])
    with pytest.raises(DafkaError, match="no partition of its own.*coalesce"):
        write_stream_task(opts, "q2", 1, 2, batches(values(0, 1)))
    # A task with nothing for this batch leaves its partition where it was.
    assert write_stream_task(opts, "q2", 1, 0, iter(())) == {}
    assert write_stream_task(opts, "q2", 1, 1, batches(values(200, 210, b"b"))) == {"dst": (1, 201, 210)}
    log = stored(gw, log_topic("q2"), 0)
    assert [b'"kind": "base"' in r[2] for r in log] == [True, False]


def test_changed_input_on_a_rerun_is_refused(gw: Any) -> None:
    opts = options(gw)
    with pytest.raises(RuntimeError):
        write_stream_task(opts, "q3", 0, 0, batches(values(0, 1000), die_after=2))
    with pytest.raises(DafkaError, match="holds another record"):
        write_stream_task(opts, "q3", 0, 0, batches(values(0, 1000, b"other")))
    with pytest.raises(DafkaError, match="past the"):
        write_stream_task(opts, "q3", 0, 0, batches(values(0, 100)))


def test_foreign_writes_to_an_owned_partition_are_detected(gw: Any) -> None:
    opts = options(gw)
    w = write_stream_task(opts, "q4", 0, 0, batches(values(0, 100)))
    assert commit_stream_batch(opts, "q4", 0, [w])
    with TankClient("127.0.0.1", gw.tank_port) as c:
        c.produce("dst", 0, [b"intruder"])
    with pytest.raises(DafkaError, match="something else writes this partition"):
        write_stream_task(opts, "q4", 1, 0, batches(values(100, 200)))


def test_batch_write_task_routes_by_topic_column(gw: Any) -> None:
    opts = options(gw, topic=None, num_partitions=3)
    rb = pa.RecordBatch.from_pydict({"topic": ["x", "y", "x"], "value": ["1", "2", "3"]})
    assert write_batch_task(opts, 4, [rb]) == {("x", 1): 2, ("y", 1): 1}
    assert [r[2] for r in stored(gw, "x", 1)] == [b"1", b"3"]
    with pytest.raises(DafkaError, match="null 'value'"):
        write_batch_task(opts, 0, [pa.RecordBatch.from_pydict({"topic": ["x"], "value": [None]})])
