"""A session-scoped local SparkSession with the ``dafka`` format registered.

Spark starts once per test session (about 15 s on a 2-core machine): every
Spark test shares it.  Workers run this interpreter (``PYSPARK_PYTHON``), and
the ``dafka`` package is importable there because it is installed in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    # Skipped, not failed, where the spark extra is not installed; the
    # planning tests in this directory need neither Spark nor Java.
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    from dafka.spark.session import local_session

    session = local_session(
        "dafka-tests",
        conf={
            "spark.sql.shuffle.partitions": "1",
            # A JVM that starts fast: the tests' queries are small.
            "spark.driver.extraJavaOptions": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1",
        },
    )
    yield session
    session.stop()
