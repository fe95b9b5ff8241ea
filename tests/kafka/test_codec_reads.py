"""Kafka batches stored as sent, compressed with each codec, read back by every kind of reader
(real TCP, real LMDB): a Tank consumer and the mesh (their values), and a Kafka fetch of the
partial front batch left by DeleteRecords (sliced, so inflated).

lz4 and zstd batches could not be read that way: the readers inflated them with an unbounded
limit, and both decoders allocate their limit up front (MemoryError, reported as "cannot
decompress a batch"): such a partition's records never reached a Tank or mesh reader.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from kafka.protocol.consumer import FetchResponse
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatchBuilder

from dafka.kafka._codec import _decompress, _lz4, _zstd_read
from dafka.kafka.gateway import KafkaGateway
from dafka.kafka.records import batch_values, kafka_values
from dafka.tank.client import TankClient
from tests.kafka.test_gateway import HOST, produce_raw, read_frame
from tests.kafka.test_hostile import fetch_frame
from tests.kafka.test_hostile_input import make_kgw

__all__ = ["make_kgw"]  # the fixture

pytestmark = pytest.mark.timeout(120)

CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def batch(codec: int, n: int = 10) -> bytes:
    b = DefaultRecordBatchBuilder(2, codec, False, -1, -1, -1, 1 << 20)
    for i in range(n):
        b.append(i, 1_700_000_000_000 + i, b"k%d" % i, b"v%d" % i * 50, [])
    return bytes(b.build())


@pytest.mark.parametrize("name", sorted(CODECS))
def test_values_of_a_compressed_batch(name: str) -> None:
    raw = batch(CODECS[name])
    assert batch_values(raw) == [b"v%d" % i * 50 for i in range(10)]
    got = kafka_values(raw, 0, 4, 3)
    assert got is not None and [v.endswith(b"v%d" % i * 50) for i, v in zip(range(4, 7), got, strict=True)]


@pytest.mark.parametrize("codec", [3, 4])
def test_a_bounded_inflation_still_stops_at_its_limit(codec: int) -> None:
    from dafka.errors import ProtocolError

    raw = batch(codec, 200)
    body = raw[61:]
    whole = _decompress(codec, body, [1 << 62])
    assert len(_decompress(codec, body, [len(whole)])) == len(whole)
    with pytest.raises(ProtocolError, match="inflates past"):
        _decompress(codec, body, [len(whole) - 1])
    # The piecewise reads used past ONE_CALL stop one byte past their limit too.
    piecewise = _lz4 if codec == 3 else _zstd_read
    assert piecewise(body, len(whole)) == whole and len(piecewise(body, 1000)) == 1001


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_reader_reads_a_batch_of_each_codec(make_kgw: Any, name: str) -> None:
    gw: KafkaGateway = make_kgw()
    gw.create_topic("z", 1)
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        assert produce_raw(s, 1, "z", batch(CODECS[name])).error_code == 0
    with TankClient(HOST, gw.tank_port) as t:
        r = t.consume("z", 0, 1, 1 << 20)
        assert [bytes(m[3]) for m in r.messages] == [b"v%d" % i * 50 for i in range(10)]
    assert gw.delete_front("z", gw.pmap.get("z", 0).address, 3, 10_000) == (3, True)
    with socket.create_connection((HOST, gw.kafka_port)) as s:
        s.sendall(fetch_frame(2, "z", 3))
        p = FetchResponse.decode(read_frame(s)[4:], version=11).responses[0].partitions[0]
        assert p.error_code == 0
        assert [r.value for rb in MemoryRecords(bytes(p.records or b"")) for r in rb] == [
            b"v%d" % i * 50 for i in range(3, 10)]
