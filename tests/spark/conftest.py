"""A session-scoped local SparkSession with the ``dafka`` format registered.

Spark starts once per test session (about 15 s on a 2-core machine): every
Spark test shares it.  Workers run this interpreter (``PYSPARK_PYTHON``), and
the ``dafka`` package is importable there because it is installed in it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    # Skipped, not failed, where the spark extra is not installed; the
    # planning tests in this directory need neither Spark nor Java.
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    from dafka.spark import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("dafka-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.extraJavaOptions", "-XX:+UseSerialGC -XX:TieredStopAtLevel=1")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
