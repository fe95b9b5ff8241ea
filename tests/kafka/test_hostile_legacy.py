"""Legacy (magic 0/1) message sets that lie about their fields, sans-IO and on the real Kafka port.

A message whose key or value length field lies past its end raised struct.error, which the
gateway took for a bug of its own (an ERROR with a traceback, "request failed"), not bad input.
"""

from __future__ import annotations

import logging
import socket
import struct
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.legacy_records import LegacyRecordBatchBuilder

from dafka.errors import ProtocolError
from dafka.kafka.gateway import KafkaGateway
from dafka.kafka.records import TooManyRecords, decode_batches, split_batches
from tests.conftest import wait_until
from tests.kafka.test_gateway import HOST, produce_raw
from tests.kafka.test_hostile_input import make_kgw

__all__ = ["make_kgw"]  # the fixture

pytestmark = pytest.mark.timeout(120)


def legacy(body: bytes, magic: int = 0) -> bytes:
    """One legacy message of ``body`` (from its key length on) with a good CRC."""
    rest = bytes((magic, 0)) + (struct.pack(">q", 1000) if magic else b"") + body
    return struct.pack(">qiI", 0, len(rest) + 4, zlib.crc32(rest)) + rest


LYING = {
    "no key length": legacy(b""),
    "key length cut": legacy(b"\x00\x00"),
    "no value length": legacy(b"\xff\xff\xff\xff"),
    "value length cut": legacy(b"\xff\xff\xff\xff\x00\x00"),
    "key past its end (magic 1)": legacy(b"\x00\x00\x00\x09ab", magic=1),
}


@pytest.mark.parametrize("lie", sorted(LYING))
def test_a_legacy_message_whose_fields_lie_is_a_protocol_error(lie: str) -> None:
    for decode in (decode_batches, split_batches):
        with pytest.raises(ProtocolError):
            decode(LYING[lie], records=[100])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 1), st.integers(0, 60))
def test_any_legacy_message_set_decodes_or_is_refused(body: bytes, magic: int, cut: int) -> None:
    data = (LegacyRecordBatchBuilder(magic, 0, 1 << 20).build() or b"") + legacy(body, magic)
    data = data[: max(0, len(data) - cut)]
    for decode in (decode_batches, split_batches):
        try:
            decode(data, records=[100])
        except (ProtocolError, TooManyRecords):
            pass


def test_a_lying_legacy_message_on_the_kafka_port_is_bad_input_not_a_failure(
    make_kgw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gw: KafkaGateway = make_kgw()
    gw.create_topic("v0", 1)
    bad = gw.bad_input.count
    with caplog.at_level(logging.WARNING), socket.create_connection((HOST, gw.kafka_port)) as s:
        with pytest.raises(ConnectionError):
            produce_raw(s, 1, "v0", LYING["no value length"], version=2)
    wait_until(lambda: gw.bad_input.count > bad)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    b = LegacyRecordBatchBuilder(0, 0, 1 << 20)
    b.append(0, None, b"k", b"legacy")
    with socket.create_connection((HOST, gw.kafka_port)) as s:  # the gateway goes on
        r = produce_raw(s, 2, "v0", bytes(b.build()), version=2)
    assert (r.error_code, r.base_offset) == (0, 0)


# ---------------------------------------------------------------- nulls where Kafka allows none


def _null_array_request(api_key: int, version: int) -> bytes:
    """A request of ``api_key`` whose first non-nullable array or string is sent as null (-1)."""
    from kafka.protocol.admin import DeleteRecordsRequest
    from kafka.protocol.consumer import SyncGroupRequest
    from kafka.protocol.metadata import MetadataRequest

    from tests.kafka.test_gateway import frame

    if api_key == 21:  # DeleteRecords: a topic whose partitions array is null
        body = DeleteRecordsRequest[version](topics=[
            DeleteRecordsRequest.DeleteRecordsTopic(name="v0", partitions=[])], timeout_ms=1000).encode(version=version)
        body = bytes(body)
        body = body[:-8] + b"\xff\xff\xff\xff" + body[-4:]  # the partitions count -1
    elif api_key == 14:  # SyncGroup: an assignment whose bytes are null
        req = SyncGroupRequest[version](group_id="g", generation_id=1, member_id="m", group_instance_id=None,
                                        assignments=[SyncGroupRequest.SyncGroupRequestAssignment(
                                            member_id="m", assignment=b"")])
        body = bytes(req.encode(version=version))
        assert body.endswith(b"\x00\x00\x00\x00")
        body = body[:-4] + b"\xff\xff\xff\xff"
    else:  # Metadata v4: a topic name null (nullable only from v10)
        req = MetadataRequest[version](topics=[MetadataRequest.MetadataRequestTopic(name="ab")],
                                       allow_auto_topic_creation=False)
        body = bytes(req.encode(version=version))
        body = body.replace(b"\x00\x02ab", b"\xff\xff")
    return frame(api_key, version, 7, body)


@pytest.mark.parametrize(("api_key", "version"), [(21, 1), (14, 3), (3, 4)])
def test_a_null_where_kafka_allows_none_is_bad_input_not_a_failure(
    make_kgw: Any, caplog: pytest.LogCaptureFixture, api_key: int, version: int
) -> None:
    gw: KafkaGateway = make_kgw()
    gw.create_topic("v0", 1)
    bad = gw.bad_input.count
    with caplog.at_level(logging.WARNING), socket.create_connection((HOST, gw.kafka_port)) as s:
        s.sendall(_null_array_request(api_key, version))
        s.settimeout(10)
        assert s.recv(100) == b""  # closed, nothing answered
    wait_until(lambda: gw.bad_input.count > bad)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_nulls_kafka_allows_are_taken() -> None:
    from kafka.protocol.metadata import MetadataRequest

    from dafka.kafka.codec import decode_request
    from tests.kafka.test_gateway import frame

    req = MetadataRequest[4](topics=None, allow_auto_topic_creation=False)  # null: every topic
    header, body = decode_request(frame(3, 4, 1, bytes(req.encode(version=4)))[4:])
    assert body.topics is None
