"""Compaction on the writer thread while the Tank gateway's I/O thread commits inline (no
fsync): the two write transactions interleave between compaction steps, where before only
the writer wrote.  Real LMDB, real TCP."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.store.compaction import CompactionPolicy
from dafka.tank.bundle import CODEC_NONE, encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from dafka.tank.messages import ProducePartition, ProduceRequest, ProduceResponse, ProduceTopic
from tests.conftest import wait_until
from tests.tank.test_gateway import HOST, consume_all

pytestmark = pytest.mark.timeout(120)


def test_compaction_rounds_between_inline_commits_keep_each_keys_last_value(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False, retention_interval=0.02,
                 compaction=CompactionPolicy(frozenset({"cmp"})))
    last: dict[bytes, bytes] = {}
    try:
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("cmp", 1)
            inflight: list[int] = []
            deadline = time.monotonic() + 1.5
            i = 0
            while time.monotonic() < deadline:
                recs = [(None, 1_700_000_000_000, b"k%d" % ((i * 7 + j) % 50), b"v%d-%d" % (i, j) + b"." * 200)
                        for j in range(40)]
                for _s, _t, k, v in recs:
                    last[k] = v
                bundle = encode_bundle(recs, codec=CODEC_NONE)
                inflight.append(c.send(ProduceRequest(c.next_request_id(),
                                                      [ProduceTopic("cmp", [ProducePartition(0, bundle)])])))
                if len(inflight) == 4:
                    resp = c.wait(inflight.pop(0))
                    assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
                i += 1
            for req in inflight:
                resp = c.wait(req)
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            wait_until(lambda: gw.records_compacted > 0, 20)
            got = consume_all(c, "cmp", 0)
        seqs = [r[0] for r in got]
        assert seqs == sorted(set(seqs))
        seen: dict[bytes, bytes] = {}
        for _s, _t, k, v in got:
            assert k is not None
            seen[k] = v
        assert seen == last  # each key's last value, whatever compaction dropped before it
        assert len(got) < 40 * i  # compaction did run
        assert "compaction failed" not in caplog.text
    finally:
        gw.close()
