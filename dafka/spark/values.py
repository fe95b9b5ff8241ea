"""Structured record values in Spark: the ``data`` column, decoded an Arrow batch at a time.

With ``.option("valueFormat", "msgpack")`` (or ``"json"``) and a value schema
(``.option("valueSchema", "device STRING, temp DOUBLE")``, or a ``.schema(...)``
with a ``data STRUCT<...>`` column) the source adds a ``data`` struct column
decoded from ``value``.  Decoding runs in the reader over each Arrow batch
(msgpack's C decoder, then one Arrow conversion per batch), never as a Python
UDF per row.  A record that does not decode, or does not fit the schema, keeps
its ``value`` bytes and gets a null ``data``; the reader logs how many, and the
first one's topic, partition and offset.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgpack
import pyarrow as pa

from dafka.errors import ConfigError

log = logging.getLogger(__name__)

FORMATS = ("bytes", "msgpack", "json")
DATA = "data"


def _unpack(content: bytes) -> Any:
    return msgpack.unpackb(content, raw=False, strict_map_key=False)


_DECODERS: dict[str, Callable[[bytes], Any]] = {"msgpack": _unpack, "json": json.loads}


def check_format(fmt: str | None) -> str:
    """The ``valueFormat`` option, checked (default ``bytes``: no ``data`` column)."""
    value = (fmt or "bytes").strip().lower()
    if value not in FORMATS:
        raise ConfigError(f"option 'valueFormat' must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return value


def _decode_one(decode: Callable[[bytes], Any], content: bytes | None) -> tuple[Any, bool]:
    if content is None:
        return None, True
    try:
        return decode(content), True
    except Exception:
        return None, False


def decode_batch(batch: pa.RecordBatch, fmt: str, data_type: pa.DataType, names: list[str]) -> pa.RecordBatch:
    """``batch`` (the source's columns) with a ``data`` column decoded from ``value``, as ``names``."""
    decode = _DECODERS[fmt]
    contents = batch.column("value").to_pylist()
    try:
        decoded = [None if c is None else decode(c) for c in contents]
        bad: list[int] = []
    except Exception:
        decoded, bad = [], []
        for i, content in enumerate(contents):
            value, ok = _decode_one(decode, content)
            decoded.append(value)
            if not ok:
                bad.append(i)
    try:
        data = pa.array(decoded, type=data_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError, RecursionError):
        # Some rows do not fit the schema: those get null, the others their values.
        rows = []
        for i, value in enumerate(decoded):
            try:
                rows.append(pa.array([value], type=data_type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError, RecursionError):
                rows.append(pa.nulls(1, type=data_type))
                bad.append(i)
        data = pa.concat_arrays(rows) if rows else pa.nulls(0, type=data_type)
    if bad:
        first = min(bad)
        log.warning(
            "%d records do not decode as %s into the data schema; their data is null"
            " (first: offset %s of %s/%s)",
            len(bad),
            fmt,
            batch.column("offset")[first].as_py(),
            batch.column("topic")[first].as_py(),
            batch.column("partition")[first].as_py(),
        )
    columns = {name: batch.column(name) for name in batch.schema.names}
    columns[DATA] = data
    return pa.RecordBatch.from_arrays([columns[n] for n in names], names=names)


def decode_batches(
    batches: Iterable[pa.RecordBatch], fmt: str, schema: Any
) -> Iterator[pa.RecordBatch]:
    """The source's batches shaped as ``schema`` (a Spark StructType): decoded ``data``, projected."""
    from pyspark.sql.pandas.types import to_arrow_type

    names = [f.name for f in schema.fields]
    if DATA not in names:
        for batch in batches:
            yield batch if batch.schema.names == names else batch.select(names)
        return
    data_type = to_arrow_type(schema[DATA].dataType)
    for batch in batches:
        yield decode_batch(batch, fmt, data_type, names)
