"""The Spark connector's gateway transport over gaps in a partition's offsets (no Spark: the
transport's read of one planned range, as an executor runs it).  A real gateway on 127.0.0.1,
real LMDB."""

from __future__ import annotations

from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.spark.offsets import DataLossError, ReadRange
from dafka.spark.options import Transport
from dafka.spark.transport import list_partitions, read_range
from dafka.store.compaction import CompactionPolicy
from dafka.store.retention import Retention, RetentionPolicy
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from tests.conftest import wait_until
from tests.tank.test_gateway import HOST, consume_all

pytestmark = pytest.mark.timeout(120)


def _read(gw: Gateway, topic: str, fail: bool, start: int | None = None) -> list[tuple[int, bytes, bytes]]:
    transport = Transport(host=HOST, port=gw.tank_port)
    out = []
    for state in list_partitions(transport, [topic]):
        rng = ReadRange(topic, state.partition, state.first if start is None else start, state.next, state.pid)
        for batch in read_range(transport, rng, fail):
            cols = batch.to_pydict()
            out.extend(zip(cols["offset"], cols["key"], cols["value"], strict=True))
    return out


def test_a_compacted_topic_read_through_the_gateway_is_no_data_loss(cfg: NodeConfig, tmp_path: Path) -> None:
    """Compaction leaves gaps in a partition's offsets (a key's older records, superseded):
    the store transport passes them (RecordDB.compacted_gap); the gateway transport took a gap
    at the start of a consume's answer for records retention removed, and failed the read
    (failOnDataLoss, true by default) though nothing was lost."""
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False, retention_interval=0.02,
                 compaction=CompactionPolicy(frozenset({"cmp"})))
    try:
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("cmp", 1)
            for i in range(40):
                # The first bundle's keys all come again: once compacted, the partition
                # begins with a gap (its first offset stays 0).
                assert c.produce("cmp", 0, [(b"k%d" % ((j + i) % 60), b"v%d-%d" % (i, j)) for j in range(50)]) == 0
            wait_until(lambda: gw.records_compacted > 0, 20)
            # Compaction may still be running: compare with what the gateway held before and
            # after the read, once they agree.
            seen: list[tuple[list, list]] = []

            def read_between_two_equal_consumes() -> bool:
                held = [(s - 1, bytes(k), bytes(v)) for s, _t, k, v in consume_all(c, "cmp", 0)]
                got = _read(gw, "cmp", fail=True, start=0)  # raised DataLossError before the fix
                seen.append((held, got))
                return held == [(s - 1, bytes(k), bytes(v)) for s, _t, k, v in consume_all(c, "cmp", 0)]

            wait_until(read_between_two_equal_consumes, 20)
        held, got = seen[-1]
        assert len(held) < 40 * 50 and held[0][0] > 0  # compacted, from its front on
        assert [(o, bytes(k), bytes(v)) for o, k, v in got] == held
    finally:
        gw.close()


def test_records_retention_removed_before_they_were_read_are_still_data_loss(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False)
    try:
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("ret", 1)
            for i in range(20):
                assert c.produce("ret", 0, [b"r%d-%03d" % (i, j) for j in range(100)]) == 0
        # Planned from offset 0, then retention removes the front (whole bundles).
        while gw.db.enforce_retention(0, RetentionPolicy(topics={"ret": Retention(max_bytes=6000)})).more:
            pass
        first = gw.db.partitions("ret")[0].first
        assert first is not None and 0 < first < 2000
        with pytest.raises(DataLossError, match=f"records 0..{first - 1} of ret/"):
            _read(gw, "ret", fail=True, start=0)
        got = _read(gw, "ret", fail=False, start=0)
        assert [o for o, _k, _v in got] == list(range(first, 2000))
    finally:
        gw.close()
