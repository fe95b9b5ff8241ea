"""The ``dafka`` PySpark data source: batch and streaming reads, batch and streaming writes.

Spark runs every method here in Python worker processes (planning in one
long-lived process per query, ``read()``/``write()`` in executor workers), so
the classes hold only plain, picklable option values; stores and gateway
connections are opened inside the calls.  The planning itself is in
:mod:`dafka.spark.offsets`, the I/O in :mod:`dafka.spark.transport` and
:mod:`dafka.spark.sink`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from dafka.errors import ConfigError
from dafka.spark.offsets import (
    LATEST,
    Offsets,
    OffsetSpec,
    PartitionState,
    admit,
    canonical,
    cap,
    latest_offsets,
    plan_ranges,
    resolve,
)
from dafka.spark.options import ReadOptions, parse_read_options, parse_write_options
from dafka.spark.transport import list_partitions, read_range, report_losses

try:  # PySpark >= 4.2: admission control and Trigger.AvailableNow
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - PySpark 4.0/4.1
    ReadAllAvailable = ReadMaxRows = None  # type: ignore[assignment,misc]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Stand-in: without the 4.2 mixin, availableNow reads everything in one batch."""


__all__ = ["SCHEMA", "DafkaDataSource", "DafkaStreamReader", "DafkaBatchReader", "register"]

log = logging.getLogger(__name__)

#: The source's schema, like Spark's Kafka source (``partition`` is the producer address).
SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", StringType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
)


_SCHEMA_DDL = (
    "key BINARY, value BINARY, topic STRING, `partition` STRING, `offset` BIGINT,"
    " `timestamp` TIMESTAMP, timestampType INT"
)


def _check_schema(schema: StructType, opts: ReadOptions) -> StructType | None:
    """The schema to shape batches to, None for the source's own (read as they come).

    Any of the source's columns (same name and type) may be asked for, plus a
    ``data`` struct when ``valueFormat`` is msgpack or json.
    """
    if schema == SCHEMA:
        return None
    known = {f.name: f.dataType for f in SCHEMA.fields}
    for f in schema.fields:
        if f.name == "data" and opts.value_format != "bytes" and isinstance(f.dataType, StructType):
            continue
        if known.get(f.name) != f.dataType:
            extra = "" if opts.value_format != "bytes" else " (a data STRUCT column needs valueFormat msgpack or json)"
            raise ConfigError(
                f"the dafka source has the columns {SCHEMA.simpleString()}, plus data STRUCT<...> with"
                f" valueFormat msgpack or json; column {f.name} {f.dataType.simpleString()} is not one{extra}"
            )
    return schema


def _shaped(batches: Iterator[Any], opts: ReadOptions, schema: StructType | None) -> Iterator[Any]:
    if schema is None:
        return batches
    from dafka.spark.values import decode_batches

    return decode_batches(batches, opts.value_format, schema)


def _by_partition(parts: Sequence[PartitionState]) -> dict[tuple[str, str], PartitionState]:
    return {(p.topic, p.partition): p for p in parts}


class DafkaBatchReader(DataSourceReader):
    """``spark.read.format("dafka")``: offsets ``startingOffsets`` to ``endingOffsets``."""

    def __init__(self, opts: ReadOptions, schema: StructType | None = None) -> None:
        self.opts = opts
        self.schema = schema  # None: the source's own columns as they are

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        parts = list_partitions(opts.transport, opts.topics)
        start = resolve(opts.starting, parts)
        end = resolve(opts.ending or OffsetSpec(LATEST, {}), parts, ending=True)
        ranges, losses = plan_ranges(start, end, _by_partition(parts), opts.max_records_per_partition)
        report_losses(losses, opts.fail_on_data_loss)
        log.debug("batch read of %s: %d input partitions", ",".join(opts.topics), len(ranges))
        return [InputPartition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        batches = read_range(self.opts.transport, partition.value, self.opts.fail_on_data_loss)
        return _shaped(batches, self.opts, self.schema)


class DafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("dafka")``.

    Offsets are ``{topic: {partition: next offset}}`` (see
    :mod:`dafka.spark.offsets`).  ``maxOffsetsPerTrigger`` is honoured through
    admission control (PySpark >= 4.2, including ``availableNow``); on older
    PySpark the limit applies from the last offset this reader returned.
    """

    def __init__(self, opts: ReadOptions, schema: StructType | None = None) -> None:
        self.opts = opts
        self.schema = schema  # None: the source's own columns as they are
        self._target: Offsets | None = None  # availableNow: read no further than this
        self._last: Offsets | None = None  # for PySpark < 4.2, which gives no start

    def _parts(self) -> list[PartitionState]:
        return list_partitions(self.opts.transport, self.opts.topics)

    def initialOffset(self) -> dict:
        offsets = resolve(self.opts.starting, self._parts())
        log.info("stream of %s starts at %s", ",".join(self.opts.topics), offsets)
        self._last = offsets
        return offsets

    def getDefaultReadLimit(self) -> Any:
        n = self.opts.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = latest_offsets(self._parts())
        log.info("availableNow: reading up to %s", self._target)

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        parts = self._parts()
        latest = latest_offsets(parts)
        if self._target is not None:
            latest = cap(latest, self._target)
        if start is None:
            # PySpark < 4.2 gives neither start nor limit: apply the option from the
            # last offset this reader returned (none after a restart: no limit then).
            if self._last is None:
                self._last = latest
                return latest
            start, max_rows = self._last, self.opts.max_offsets_per_trigger
        elif ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            max_rows = limit.max_rows
        else:
            max_rows = None  # ReadAllAvailable (or a limit type that does not apply)
        end = admit(start, latest, {(p.topic, p.partition): p.first for p in parts}, max_rows)
        self._last = end
        return end

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        opts = self.opts
        ranges, losses = plan_ranges(
            canonical(start), canonical(end), _by_partition(self._parts()),
            opts.max_records_per_partition,
        )
        report_losses(losses, opts.fail_on_data_loss)
        return [InputPartition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        batches = read_range(self.opts.transport, partition.value, self.opts.fail_on_data_loss)
        return _shaped(batches, self.opts, self.schema)

    def commit(self, end: dict) -> None:
        """Nothing to release: Dafka keeps no consumer positions for Spark."""


class DafkaDataSource(DataSource):
    """The ``dafka`` format: ``spark.dataSource.register(DafkaDataSource)``."""

    @classmethod
    def name(cls) -> str:
        return "dafka"

    def schema(self) -> StructType | str:
        """The source's columns; with ``valueFormat`` and ``valueSchema``, a ``data`` struct too (DDL)."""
        opts = {str(k).lower(): str(v) for k, v in self.options.items()}
        fmt = opts.get("valueformat", "bytes").strip().lower()
        ddl = opts.get("valueschema")
        if fmt != "bytes" and ddl is None:
            raise ConfigError(
                f"valueFormat {fmt} needs the schema of the values: .option('valueSchema',"
                " 'device STRING, temp DOUBLE') or .schema(...) with a data STRUCT<...> column"
            )
        if ddl is None:
            return SCHEMA
        if fmt == "bytes":
            raise ConfigError("option 'valueSchema' needs valueFormat msgpack or json")
        return f"{_SCHEMA_DDL}, `data` STRUCT<{ddl.strip()}>"

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = parse_read_options(self.options, streaming=False)
        return DafkaBatchReader(opts, _check_schema(schema, opts))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        opts = parse_read_options(self.options, streaming=True)
        return DafkaStreamReader(opts, _check_schema(schema, opts))

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        from dafka.spark.sink import DafkaBatchWriter, check_input_schema

        check_input_schema(schema, overwrite)
        return DafkaBatchWriter(parse_write_options(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        from dafka.spark.sink import check_input_schema, make_stream_writer

        check_input_schema(schema, overwrite)
        return make_stream_writer(parse_write_options(self.options), schema)


def register(spark: Any) -> None:
    """Make ``format("dafka")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(DafkaDataSource)
