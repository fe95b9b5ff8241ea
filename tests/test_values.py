"""Record values: serializers on the producer, lazy deserializers on the consumer."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest

from dafka import values
from dafka.config import NodeConfig
from dafka.errors import DeserializationError, SerializationError
from dafka.nodes.consumed import ConsumerRecord, record_type
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.node import Store
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def collect(consumer: Consumer, n: int, timeout: float = 15.0) -> list[ConsumerRecord]:
    got: list[ConsumerRecord] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += consumer.poll_batch(n - len(got), 0.2)
    return got


def test_format_names_and_callables() -> None:
    assert values.serializer(None) is None and values.serializer("bytes") is None
    assert values.deserializer("bytes") is None
    assert values.deserializer("msgpack")(values.serializer("msgpack")({"a": [1, b"x"]})) == {"a": [1, b"x"]}
    assert values.deserializer("json")(b'{"a": 1}') == {"a": 1}
    fn = str.encode
    assert values.serializer(fn) is fn
    with pytest.raises(ValueError, match="msgpack"):
        values.serializer("pickle")
    with pytest.raises(ValueError, match="msgpack"):
        values.deserializer("yaml")
    with pytest.raises(TypeError):
        values.serializer(42)  # type: ignore[arg-type]


def test_encode_errors_are_serialization_errors() -> None:
    pack = values.serializer("msgpack")
    assert pack is not None
    with pytest.raises(SerializationError, match="set") as info:
        values.encode(pack, {1, 2})
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with pytest.raises(SerializationError):
        values.encode(pack, 1 << 70)  # beyond msgpack's integers
    with pytest.raises(SerializationError, match="NaN|nan|Out of range"):
        values.encode(values.serializer("json"), float("nan"))
    with pytest.raises(SerializationError, match="not bytes"):
        values.encode(lambda v: "text", 1)
    assert values.encode(lambda v: bytearray(b"ab"), 1) == b"ab"


def test_default_records_are_plain_and_value_is_content() -> None:
    assert record_type(None) is ConsumerRecord and record_type("bytes") is ConsumerRecord
    r = ConsumerRecord("t", "p", 3, b"abc")
    assert r.value is r.content


def test_decoded_record_value_and_error_names_the_record() -> None:
    cls = record_type("msgpack")
    good = tuple.__new__(cls, ("t", "p" * 32, 7, msgpack.packb({"x": 1})))
    assert good.value == {"x": 1} and good.content == msgpack.packb({"x": 1})
    assert isinstance(good, ConsumerRecord) and repr(good).startswith("ConsumerRecord(")
    bad = tuple.__new__(cls, ("t", "p" * 32, 8, b"\xc1"))  # 0xc1: never used in msgpack
    with pytest.raises(DeserializationError) as info:
        _ = bad.value
    err = info.value
    assert (err.topic, err.partition, err.offset) == ("t", "p" * 32, 8)
    assert "8" in str(err) and "t/" + "p" * 32 in str(err)
    assert bad.content == b"\xc1"  # the bytes stay readable
    # Hostile nesting: an error naming the record, not a RecursionError escaping.
    for fmt, content in (("msgpack", b"\x91" * 100_000 + b"\x01"), ("json", b"[" * 100_000)):
        deep = tuple.__new__(record_type(fmt), ("t", "p", 9, content))
        with pytest.raises(DeserializationError, match="record 9 of t/p"):
            _ = deep.value


def test_msgpack_end_to_end_bad_record_is_not_dropped(cfg: NodeConfig, tmp_path: Path) -> None:
    readings = [{"device": "d1", "t": i, "temp": 20.5 + i, "tags": ["a", "b"]} for i in range(50)]
    with (
        Store(tmp_path / "db", cfg),
        Consumer("values", cfg, offset_reset="earliest", deserializer="msgpack") as consumer,
        Producer("values", cfg, serializer="msgpack") as producer,
        Producer("values", cfg) as raw,  # a writer of plain bytes on the same topic
    ):
        for r in readings[:25]:
            producer.publish(r)
        assert producer.publish_many(readings[25:]) is not None
        with pytest.raises(SerializationError):
            producer.publish({"bad": {1, 2}})
        with pytest.raises(SerializationError):
            producer.publish_many([{"ok": 1}, object()])
        assert producer.flush(10)
        raw.publish(b"not msgpack \xc1")
        raw.publish(msgpack.packb({"after": True}))
        assert raw.flush(10)
        got = collect(consumer, 52)
        mine = [r.value for r in got if r.partition == producer.address]
        assert mine == readings
        theirs = [r for r in got if r.partition == raw.address]
        assert len(theirs) == 2
        with pytest.raises(DeserializationError, match=f"record 0 of values/{raw.address}"):
            _ = theirs[0].value
        assert theirs[0].content == b"not msgpack \xc1"
        assert theirs[1].value == {"after": True}


def test_json_serializer_and_callable(cfg: NodeConfig, tmp_path: Path) -> None:
    with (
        Store(tmp_path / "db", cfg),
        Consumer("j", cfg, offset_reset="earliest", deserializer=lambda b: b.decode().upper()) as upper,
        Consumer("j", cfg, offset_reset="earliest", deserializer="json") as parsed,
        Producer("j", cfg, serializer="json") as producer,
    ):
        wait_until(lambda: len(producer.peers) >= 3)
        producer.publish({"name": "zoë", "n": [1, 2]})
        assert producer.flush(10)
        assert [r.value for r in collect(parsed, 1)] == [{"name": "zoë", "n": [1, 2]}]
        assert [r.value for r in collect(upper, 1)] == ['{"NAME":"ZOË","N":[1,2]}']
