"""The record size limit ([node] max_record_bytes, 1 MiB by default): the
setting, the refusal at publish and at the Tank gateway's produce.  (Readers
of the mesh do not drop oversize records yet.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dafka.config import DEFAULT_MAX_RECORD_BYTES, NodeConfig, node_config_from
from dafka.errors import ConfigError, DafkaError, RecordTooLargeError
from dafka.producer import Producer
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from dafka.tank.messages import ProduceError

pytestmark = pytest.mark.timeout(120)
LIMIT = 64 * 1024


def test_the_setting_is_parsed_and_checked() -> None:
    assert NodeConfig().max_record_bytes == DEFAULT_MAX_RECORD_BYTES == 1 << 20
    assert node_config_from({"max_record_bytes": 4096}).max_record_bytes == 4096
    for bad in ("1MB", 0, -1, 1.5, True, 1 << 40):
        with pytest.raises(ConfigError, match="max_record_bytes"):
            node_config_from({"max_record_bytes": bad})


def test_publish_refuses_a_record_over_the_limit(cfg: NodeConfig) -> None:
    with Producer("big", replace(cfg, max_record_bytes=LIMIT)) as p:
        with pytest.raises(RecordTooLargeError, match="max_record_bytes"):
            p.publish(b"x" * (LIMIT + 1))
        with pytest.raises(RecordTooLargeError):
            p.publish_many([b"ok", b"x" * (LIMIT + 1)])
        assert p.window.next == 0  # nothing of the refused chunk was published
        assert isinstance(RecordTooLargeError("x"), ValueError | DafkaError)
        assert p.publish(b"x" * LIMIT).offset == 0


def test_the_gateway_refuses_an_oversize_tank_record(cfg: NodeConfig, tmp_path: Path) -> None:
    with Gateway(tmp_path / "gw", replace(cfg, max_record_bytes=LIMIT), listen=("127.0.0.1", 0)) as gw:
        with TankClient("127.0.0.1", gw.tank_port) as c:
            c.create_topic("t", 1)
            codes = c.produce_many({("t", 0): [b"x" * (LIMIT + 1)]}, check=False)
            assert codes[("t", 0)] == ProduceError.SYSTEM and gw.records_too_large == 1
            assert c.produce("t", 0, [b"fine"]) == 0
            assert [bytes(v) for _s, _t, _k, v in c.consume("t", 0, 0, 1 << 20).messages] == [b"fine"]
