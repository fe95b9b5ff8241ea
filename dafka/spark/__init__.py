"""PySpark connector: the ``dafka`` data source (batch and streaming, read and write).

Usage::

    from dafka.spark import register
    register(spark)
    df = spark.read.format("dafka").option("path", "/var/dafka/store") \\
        .option("subscribe", "events").load()

Needs ``pip install dafka[spark]`` (pyspark >= 4.0 and pyarrow).  The names
below are imported lazily, so :mod:`dafka.spark.offsets` and
:mod:`dafka.spark.options` (pure planning code) load without Spark.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMA", "DafkaDataSource", "register"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dafka.spark import source

        return getattr(source, name)
    raise AttributeError(f"module 'dafka.spark' has no attribute {name!r}")
