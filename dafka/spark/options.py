"""Options of the ``dafka`` Spark data source, parsed and checked without Spark.

Reading
-------
``subscribe``
    Comma-separated topics (required).
``path`` | ``gateway``
    The transport, exactly one of them: ``path`` is a local store's LMDB
    directory (opened read-only: executors must run on the store's machine),
    ``gateway`` is ``host:port`` of a Tank gateway (executors anywhere).
``startingOffsets``
    ``earliest`` | ``latest`` | JSON (see :mod:`dafka.spark.offsets`).
    Default ``earliest`` for batch reads, ``latest`` for streams.
``endingOffsets``
    Batch only: ``latest`` (default) or JSON.
``maxOffsetsPerTrigger``
    Streams: at most this many records per micro-batch (all partitions).
``failOnDataLoss``
    ``true`` (default): fail when records to read were removed by retention;
    ``false``: log a warning and go on.
``maxRecordsPerPartition``
    Longest offset range one Spark task reads (default 250000): larger
    ranges are split so one big Dafka partition still uses every core.
``timeout``
    Seconds to wait for a gateway answer (default 10).
``valueFormat``
    ``bytes`` (default) | ``msgpack`` | ``json``: with a value schema, a
    ``data`` struct column decoded from ``value`` (see :mod:`dafka.spark.values`).
``valueSchema``
    The fields of ``data`` as DDL (``"device STRING, temp DOUBLE"``); or pass
    ``.schema(...)`` with a ``data STRUCT<...>`` column instead.

Writing (through a gateway)
---------------------------
``gateway`` (required), ``topic`` (or a ``topic`` column), ``numPartitions``
(partitions of a topic the sink creates, default 4), ``maxRecordsPerRequest``
(records per produce request, default 8192), ``sinkId`` (streams: name of
the sink's commit log, default the query id).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dafka.errors import ConfigError
from dafka.spark.offsets import OffsetSpec, parse_offset_spec

__all__ = [
    "DEFAULT_MAX_RECORDS_PER_PARTITION",
    "DEFAULT_MAX_RECORDS_PER_REQUEST",
    "DEFAULT_NUM_PARTITIONS",
    "DEFAULT_TIMEOUT",
    "ReadOptions",
    "Transport",
    "WriteOptions",
    "parse_gateway",
    "parse_read_options",
    "parse_write_options",
]

# 250k 100-byte records take a task well under a second to read: big enough
# that per-task overhead does not dominate, small enough that a single large
# Dafka partition is spread over every core of a small cluster.
DEFAULT_MAX_RECORDS_PER_PARTITION = 250_000
DEFAULT_MAX_RECORDS_PER_REQUEST = 8192
DEFAULT_NUM_PARTITIONS = 4
DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Transport:
    """Where records are read from: a local store directory or a gateway.

    Plain strings and numbers only, because it travels to executors pickled.
    """

    path: str | None = None
    host: str | None = None
    port: int | None = None
    timeout: float = DEFAULT_TIMEOUT

    @property
    def is_gateway(self) -> bool:
        return self.host is not None

    def describe(self) -> str:
        return f"gateway {self.host}:{self.port}" if self.is_gateway else f"store {self.path}"


@dataclass(frozen=True)
class ReadOptions:
    """Everything a reader needs, checked."""

    topics: tuple[str, ...]
    transport: Transport
    starting: OffsetSpec
    ending: OffsetSpec | None
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    max_records_per_partition: int
    value_format: str = "bytes"
    value_schema: str | None = None


@dataclass(frozen=True)
class WriteOptions:
    """Everything a writer needs, checked."""

    transport: Transport
    topic: str | None
    num_partitions: int
    max_records_per_request: int
    sink_id: str | None


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    # Spark passes a case-insensitive dict; tests pass plain dicts.
    return {str(k).lower(): str(v) for k, v in options.items()}


def _int(opts: dict[str, str], name: str, default: int | None, minimum: int = 1) -> int | None:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"option {name!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"option {name!r} must be at least {minimum}, got {value}")
    return value


def _bool(opts: dict[str, str], name: str, default: bool) -> bool:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {name!r} must be true or false, got {raw!r}")


def parse_gateway(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` too) -> ``(host, port)``."""
    spec = text.strip()
    if spec.startswith("tcp://"):
        spec = spec[len("tcp://") :]
    host, sep, port = spec.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"option 'gateway' must be host:port, got {text!r}")
    return host, int(port)


def _transport(opts: dict[str, str], *, writing: bool) -> Transport:
    path = opts.get("path")
    gateway = opts.get("gateway")
    timeout_raw = opts.get("timeout")
    try:
        timeout = float(timeout_raw) if timeout_raw is not None else DEFAULT_TIMEOUT
    except ValueError:
        raise ConfigError(f"option 'timeout' must be a number of seconds, got {timeout_raw!r}") from None
    if timeout <= 0:
        raise ConfigError(f"option 'timeout' must be positive, got {timeout}")
    if writing:
        if not gateway:
            raise ConfigError(
                "option 'gateway' (host:port of a Dafka gateway) is required to write"
                + (" ('path' is read-only)" if path else "")
            )
        host, port = parse_gateway(gateway)
        return Transport(host=host, port=port, timeout=timeout)
    if path and gateway:
        raise ConfigError("give only one of the options 'path' and 'gateway'")
    if gateway:
        host, port = parse_gateway(gateway)
        return Transport(host=host, port=port, timeout=timeout)
    if path:
        return Transport(path=path, timeout=timeout)
    raise ConfigError(
        "missing option: give 'path' (a local store's LMDB directory) "
        "or 'gateway' (host:port of a Dafka gateway)"
    )


def parse_topics(text: str | None) -> tuple[str, ...]:
    """The ``subscribe`` option: comma-separated topic names."""
    if text is None:
        raise ConfigError("option 'subscribe' is required (comma-separated topics)")
    topics = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not topics:
        raise ConfigError(f"option 'subscribe' names no topic: {text!r}")
    for t in topics:
        if "\x00" in t or len(t.encode()) > 255:
            raise ConfigError(f"option 'subscribe': invalid topic name {t!r}")
    return topics


def parse_read_options(options: Mapping[str, str], *, streaming: bool) -> ReadOptions:
    """Check the options of ``spark.read`` / ``spark.readStream``."""
    opts = _lower(options)
    for unsupported in ("assign", "subscribepattern"):
        if unsupported in opts:
            raise ConfigError(f"option {unsupported!r} is not supported: use 'subscribe'")
    topics = parse_topics(opts.get("subscribe"))
    transport = _transport(opts, writing=False)
    try:
        starting = parse_offset_spec(
            opts.get("startingoffsets"),
            "startingOffsets",
            topics,
            default="latest" if streaming else "earliest",
        )
        ending = None
        if "endingoffsets" in opts:
            if streaming:
                raise ConfigError("option 'endingOffsets' is for batch reads only")
            ending = parse_offset_spec(
                opts["endingoffsets"], "endingOffsets", topics, default="latest", ending=True
            )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    max_per_trigger = _int(opts, "maxOffsetsPerTrigger", None)
    if max_per_trigger is not None and not streaming:
        raise ConfigError("option 'maxOffsetsPerTrigger' is for streaming reads only")
    return ReadOptions(
        topics=topics,
        transport=transport,
        starting=starting,
        ending=ending,
        max_offsets_per_trigger=max_per_trigger,
        fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
        max_records_per_partition=_int(
            opts, "maxRecordsPerPartition", DEFAULT_MAX_RECORDS_PER_PARTITION
        ),  # type: ignore[arg-type]
        value_format=_value_format(opts.get("valueformat")),
        value_schema=_value_schema(opts.get("valueschema")),
    )


def _value_format(text: str | None) -> str:
    fmt = (text or "bytes").strip().lower()
    if fmt not in ("bytes", "msgpack", "json"):
        raise ConfigError(f"option 'valueFormat' must be bytes, msgpack or json, got {text!r}")
    return fmt


def _value_schema(text: str | None) -> str | None:
    if text is None:
        return None
    ddl = text.strip()
    # Spark parses it inside STRUCT<...>: brackets must balance, and nothing may close it early.
    depth = 0
    for ch in ddl:
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if depth < 0:
            break
    if not ddl or depth != 0 or ";" in ddl:
        raise ConfigError(f"option 'valueSchema' must be DDL fields like 'device STRING, temp DOUBLE', got {text!r}")
    return ddl


def parse_write_options(options: Mapping[str, str]) -> WriteOptions:
    """Check the options of ``df.write`` / ``df.writeStream``."""
    opts = _lower(options)
    topic = opts.get("topic")
    if topic is not None and (not topic or "\x00" in topic or len(topic.encode()) > 255):
        raise ConfigError(f"option 'topic': invalid topic name {topic!r}")
    num = _int(opts, "numPartitions", DEFAULT_NUM_PARTITIONS)
    if num is not None and num > 0xFFFF:
        raise ConfigError(f"option 'numPartitions' is at most 65535, got {num}")
    return WriteOptions(
        transport=_transport(opts, writing=True),
        topic=topic,
        num_partitions=num,  # type: ignore[arg-type]
        max_records_per_request=_int(
            opts, "maxRecordsPerRequest", DEFAULT_MAX_RECORDS_PER_REQUEST
        ),  # type: ignore[arg-type]
        sink_id=opts.get("sinkid") or None,
    )
