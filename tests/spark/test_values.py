"""valueFormat msgpack/json: a ``data`` struct column decoded an Arrow batch at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from dafka.errors import ConfigError
from dafka.spark.options import parse_read_options
from dafka.store.db import RecordDB
from tests.spark.helpers import TS0, A, B

pa = pytest.importorskip("pyarrow")


def _readings(db: RecordDB) -> None:
    good = [msgpack.packb({"device": f"d{i % 3}", "temp": 20.0 + i, "n": i, "extra": [1]}) for i in range(500)]
    good[7] = b"\xc1 not msgpack"  # does not decode
    good[8] = msgpack.packb({"device": "d1", "temp": "hot", "n": 8})  # does not fit the schema
    good[9] = msgpack.packb({"device": "d2"})  # missing fields: nulls
    db.append([("readings", A, i, good[i], TS0 + i) for i in range(500)])
    db.append([("jreadings", B, i, json.dumps({"device": "j", "temp": 1.5 * i, "n": i}).encode(), TS0 + i) for i in range(10)])


def test_options_are_checked() -> None:
    base = {"subscribe": "t", "path": "/x"}
    assert parse_read_options(base, streaming=False).value_format == "bytes"
    opts = parse_read_options({**base, "valueFormat": "MsgPack", "valueSchema": "a INT"}, streaming=False)
    assert (opts.value_format, opts.value_schema) == ("msgpack", "a INT")
    with pytest.raises(ConfigError, match="valueFormat"):
        parse_read_options({**base, "valueFormat": "avro"}, streaming=False)
    with pytest.raises(ConfigError, match="valueSchema"):
        parse_read_options({**base, "valueFormat": "msgpack", "valueSchema": "a INT>, b"}, streaming=False)


def test_decode_batch_without_spark() -> None:
    from dafka.spark.values import decode_batch

    values = [msgpack.packb({"x": 1}), b"\xc1", msgpack.packb({"x": "no"}), None]
    batch = pa.RecordBatch.from_arrays(
        [pa.array(values, pa.binary()), pa.array(["t"] * 4), pa.array(["p"] * 4), pa.array([0, 1, 2, 3], pa.int64())],
        names=["value", "topic", "partition", "offset"],
    )
    out = decode_batch(batch, "msgpack", pa.struct([("x", pa.int64())]), ["offset", "data"])
    assert out.schema.names == ["offset", "data"]
    assert out.column("data").to_pylist() == [{"x": 1}, None, None, None]


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_msgpack_and_json_values_as_a_data_column(spark: Any, tmp_path: Path) -> None:
    path = tmp_path / "store"
    with RecordDB(path) as db:
        _readings(db)
    df = (
        spark.read.format("dafka")
        .option("path", str(path))
        .option("subscribe", "readings")
        .option("valueFormat", "msgpack")
        .option("valueSchema", "device STRING, temp DOUBLE, n BIGINT")
        .option("maxRecordsPerPartition", "200")
        .load()
    )
    assert df.schema["data"].dataType.simpleString() == "struct<device:string,temp:double,n:bigint>"
    assert df.columns[:7] == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
    got = {r.offset: (r.data.asDict() if r.data else None, r.value) for r in df.collect()}
    assert len(got) == 500  # nothing dropped: the bad records keep their bytes
    assert got[0][0] == {"device": "d0", "temp": 20.0, "n": 0}
    assert got[499][0] == {"device": "d1", "temp": 519.0, "n": 499}
    assert got[7] == (None, b"\xc1 not msgpack") and got[8][0] is None
    assert got[9][0] == {"device": "d2", "temp": None, "n": None}
    by_device = {r.device: r.c for r in df.where("data IS NOT NULL").groupBy("data.device").count().withColumnRenamed("count", "c").collect()}
    assert by_device == {"d0": 166, "d1": 166, "d2": 166}
    # .schema(...) instead: any of the source's columns plus data, in the order asked.
    projected = (
        spark.read.format("dafka")
        .schema("offset BIGINT, data STRUCT<n: BIGINT, temp: DOUBLE>")
        .option("path", str(path))
        .option("subscribe", "jreadings")
        .option("valueFormat", "json")
        .load()
    )
    assert sorted((r.offset, r.data.n, r.data.temp) for r in projected.collect()) == [(i, i, 1.5 * i) for i in range(10)]
    with pytest.raises(Exception, match="valueSchema"):
        spark.read.format("dafka").option("path", str(path)).option("subscribe", "readings").option(
            "valueFormat", "msgpack"
        ).load().collect()
