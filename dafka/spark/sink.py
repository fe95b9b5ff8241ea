"""Writing DataFrames to Dafka through a gateway: batch (at-least-once) and streaming (exactly-once).

Input columns: ``value`` (binary or string, required), ``key`` (binary or
string, optional, null for none), ``topic`` (string, optional; the
``topic`` option wins when both are given).  Other columns are ignored, so a
DataFrame read with the ``dafka`` source can be written back as it is.

Records land in gateway-owned partitions of the target topic (those made by
CreateTopic; partitions of Dafka producers are read-only to the gateway); a
missing topic is created with ``numPartitions`` partitions.  Write task ``i``
(Spark's partition index) sends its rows, in order, to the ``i``-th owned
partition (batch: ``i`` modulo their number), in produce requests of
``maxRecordsPerRequest`` records, each answered once durable.

Batch writes are at-least-once when Spark retries a task, like Spark's
Kafka sink.  Streaming writes are exactly-once across restarts from the
checkpoint: see :mod:`dafka.spark.sinklog` for the protocol and
:mod:`dafka.spark.produce` for its I/O; the classes here only adapt them to
Spark.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from dafka.errors import ConfigError, DafkaError
from dafka.spark.options import WriteOptions
from dafka.spark.produce import Written, commit_stream_batch, write_batch_task, write_stream_task

try:  # PySpark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase

    _ARROW_STREAM = True
except ImportError:  # pragma: no cover - PySpark 4.0: rows instead of Arrow batches
    from pyspark.sql.datasource import DataSourceStreamWriter as _StreamWriterBase

    _ARROW_STREAM = False

__all__ = [
    "BatchWritten",
    "DafkaBatchWriter",
    "DafkaStreamWriter",
    "StreamWritten",
    "check_input_schema",
    "make_stream_writer",
]

log = logging.getLogger(__name__)

# Spark local properties of a streaming query's jobs.
QUERY_ID_PROPERTY = "sql.streaming.queryId"  # persistent across restarts from the checkpoint
BATCH_ID_PROPERTY = "streaming.sql.batchId"


def check_input_schema(schema: StructType, overwrite: bool) -> None:
    """Fail early (on the driver) for a DataFrame the sink cannot write."""
    if overwrite:
        raise ConfigError("the dafka sink only appends: use .mode('append')")
    fields = {f.name.lower(): f for f in schema.fields}
    if "value" not in fields:
        raise ConfigError(
            f"the dafka sink needs a 'value' column (binary or string); got {schema.simpleString()}"
        )
    for name in ("value", "key"):
        f = fields.get(name)
        if f is not None and not isinstance(f.dataType, BinaryType | StringType):
            raise ConfigError(f"column {name!r} must be binary or string, not {f.dataType.simpleString()}")
    topic = fields.get("topic")
    if topic is not None and not isinstance(topic.dataType, StringType):
        raise ConfigError(f"column 'topic' must be a string, not {topic.dataType.simpleString()}")


def _row_batches(rows: Iterator[Any]) -> Iterator[pa.RecordBatch]:
    """Spark Rows (PySpark 4.0 stream writers) as small Arrow batches."""
    chunk: list[dict] = []
    for row in rows:
        chunk.append(row.asDict())
        if len(chunk) >= 4096:
            yield pa.RecordBatch.from_pylist(chunk)
            chunk = []
    if chunk:
        yield pa.RecordBatch.from_pylist(chunk)


@dataclass
class BatchWritten(WriterCommitMessage):
    """What one batch write task wrote: ``{(topic, partition id): records}``."""

    task: int
    counts: dict[tuple[str, int], int] = field(default_factory=dict)


class DafkaBatchWriter(DataSourceArrowWriter):
    """``df.write.format("dafka")``: plain produce requests, at-least-once on task retries."""

    def __init__(self, opts: WriteOptions, schema: StructType) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> BatchWritten:
        ctx = TaskContext.get()
        task = ctx.partitionId() if ctx is not None else 0
        return BatchWritten(task, write_batch_task(self.opts, task, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = sum(sum(m.counts.values()) for m in messages if isinstance(m, BatchWritten))
        log.info("batch write committed: %d records", total)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        done = sum(sum(m.counts.values()) for m in messages if isinstance(m, BatchWritten))
        log.warning("batch write aborted; %d records of finished tasks stay written", done)


@dataclass
class StreamWritten(WriterCommitMessage):
    """What one streaming write task wrote: ``{topic: (partition id, first seq, last seq)}``."""

    sink_id: str
    batch: int
    task: int
    written: Written = field(default_factory=dict)


class DafkaStreamWriter(_StreamWriterBase):  # type: ignore[misc,valid-type]
    """``df.writeStream.format("dafka")``: exactly-once (see :mod:`dafka.spark.sinklog`)."""

    def __init__(self, opts: WriteOptions, schema: StructType) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> StreamWritten:
        ctx = TaskContext.get()
        if ctx is None:
            raise DafkaError("the dafka stream writer runs only inside Spark tasks")
        batch_raw = ctx.getLocalProperty(BATCH_ID_PROPERTY)
        # The query id survives restarts from the checkpoint: the commit log's name.
        sink_id = self.opts.sink_id or ctx.getLocalProperty(QUERY_ID_PROPERTY)
        if batch_raw is None or not sink_id:
            raise DafkaError("no streaming batch id or query id in the task: cannot write exactly once")
        batch, task = int(batch_raw), ctx.partitionId()
        batches = iterator if _ARROW_STREAM else _row_batches(iterator)
        return StreamWritten(sink_id, batch, task, write_stream_task(self.opts, sink_id, batch, task, batches))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        written = [m for m in messages if isinstance(m, StreamWritten)]
        if written:
            commit_stream_batch(self.opts, written[0].sink_id, batchId, (m.written for m in written))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "streaming batch %d aborted: records written so far stay and are recognised "
            "when the batch runs again", batchId,
        )


def make_stream_writer(opts: WriteOptions, schema: StructType) -> DafkaStreamWriter:
    """The streaming writer (Arrow batches on PySpark >= 4.1)."""
    return DafkaStreamWriter(opts, schema)
