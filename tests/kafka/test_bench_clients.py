"""``dafka bench kafka``'s produce clients against a real gateway: ready-made batches
(``--client raw``) and kcat (``--client kcat``, optional: skipped without the command)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import pytest

from dafka.bench.kafka import (
    KCAT_MISSING,
    _high_watermark,
    _kafka_client_alone,
    _kafka_produce_kcat,
    _kafka_produce_raw,
    bench_kafka,
)
from dafka.config import NodeConfig
from dafka.kafka.gateway import KafkaGateway

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


@pytest.fixture
def kgw(tmp_path: Path) -> Any:
    gw = KafkaGateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0), kafka_listen=(HOST, 0))
    yield gw
    gw.close()


def test_raw_batches_are_all_stored(kgw: KafkaGateway) -> None:
    rate = _kafka_produce_raw(HOST, kgw.kafka_port, "raw", 3000, 50, per_batch=1000, inflight=2)
    assert rate > 0
    assert _high_watermark(f"{HOST}:{kgw.kafka_port}", "raw") == 3001  # (and the record that created it)


@pytest.mark.skipif(shutil.which("kcat") is None and shutil.which("kafkacat") is None, reason="kcat is not installed")
def test_kcat_produces_every_record(kgw: KafkaGateway) -> None:
    assert _kafka_produce_kcat(HOST, kgw.kafka_port, "kc", 5000, 40) > 0  # it checks the count itself
    assert _high_watermark(f"{HOST}:{kgw.kafka_port}", "kc") == 5001


def test_without_kcat_the_bench_says_so_and_starts_nothing(monkeypatch: Any) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    args = argparse.Namespace(client="kcat", broker=None, runs=1, records=1000, size=10, no_sync=True)
    with pytest.raises(SystemExit, match="kcat command is not installed") as exc:
        bench_kafka(args)
    assert str(exc.value) == KCAT_MISSING
    with pytest.raises(SystemExit, match="kcat command is not installed"):
        _kafka_produce_kcat(HOST, 1, "t", 10, 10)



def test_the_client_alone_needs_no_broker_and_times_a_bounded_number_of_calls(monkeypatch: Any) -> None:
    # The ceiling line of `dafka bench kafka`: the same produce() calls, nothing listening.
    # The queue is never drained, so a bench of many records must not fill it (BufferError).
    import dafka.bench.kafka as bk

    assert _kafka_client_alone(5000, 100) > 0
    monkeypatch.setattr(bk, "CLIENT_ALONE_CALLS", 2000)
    assert _kafka_client_alone(10**12, 100) > 0  # 2000 calls, not 10**12
