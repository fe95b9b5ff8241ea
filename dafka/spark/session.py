"""A local SparkSession set up the way this project's tools need it.

Workers must run this interpreter (``PYSPARK_PYTHON``: else they start
another Python without dafka and crash), Spark must bind loopback on hosts
whose name does not resolve (``SPARK_LOCAL_IP``), and the ``dafka`` format
must be registered.  Used by the benchmark, the example pipeline and the tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any


def local_session(
    app: str,
    master: str = "local[2]",
    *,
    log_level: str = "ERROR",
    conf: Mapping[str, str] | None = None,
) -> Any:
    """A local SparkSession (UI off, few shuffle partitions) with ``dafka`` registered.

    ``conf`` adds or overrides Spark settings.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from dafka.spark.source import register

    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
    }
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    register(spark)
    return spark
