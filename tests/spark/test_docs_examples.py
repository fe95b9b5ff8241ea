"""The Spark blocks of docs/tutorials/spark.md that the docs runner leaves to the Spark tests.

Spark starts once per test session here (see conftest): running a block with
that session takes a second, where the docs runner would start a JVM of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from tests.conftest import ROOT
from tests.docs_runner import parse
from tests.spark.helpers import gateway, read

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

SPARK_DOC = ROOT / "docs" / "tutorials" / "spark.md"


def block_with(text: str) -> str:
    """The one python block of the Spark tutorial that holds ``text``."""
    bodies = [b.body for b in parse(SPARK_DOC).blocks if b.lang == "python" and text in b.body]
    assert len(bodies) == 1, f"{SPARK_DOC.name}: {len(bodies)} python blocks hold {text!r}"
    return bodies[0]


def test_the_batch_write_example_runs(spark: Any, cfg: NodeConfig, tmp_path: Path) -> None:
    body = block_with('.mode("append")')
    assert "writeStream" not in body  # a batch write
    with gateway(tmp_path / "gw", cfg) as gw:
        address = f"127.0.0.1:{gw.tank_port}"
        exec(compile(body.replace("127.0.0.1:11011", address), str(SPARK_DOC), "exec"), {"spark": spark})
        rows = read(spark, gateway=address, subscribe="readings-batch").collect()
        assert sorted((r.key, r.value) for r in rows) == [(b"d1", b"21.5"), (b"d1", b"21.7"), (b"d2", b"19.0")]
        # What the page says of the modes: the default is refused by Spark, overwrite by the sink.
        df = spark.createDataFrame([("x",)], "value string")
        writer = df.write.format("dafka").option("gateway", address).option("topic", "readings-batch")
        with pytest.raises(Exception, match="(?i)append"):
            writer.save()
        with pytest.raises(Exception, match="only appends"):
            writer.mode("overwrite").save()
