"""A Dafka consumer reading a compacted partition from a store passes the gaps compaction
left at once (VOID kind 2), not after skip_after (issue 37)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.nodes.consumer import Consumer
from dafka.store.compaction import CompactionPolicy
from dafka.store.db import RecordDB
from dafka.store.node import Store
from tests.conftest import wait_until
from tests.test_metrics import scrape

pytestmark = pytest.mark.timeout(120)

PARTITION = "AB" * 16  # a producer's address (gone: the store alone holds the partition)


def test_a_mesh_consumer_passes_compacted_gaps_without_waiting_skip_after(cfg: NodeConfig, tmp_path: Path) -> None:
    n = 400
    with RecordDB(tmp_path / "db", sync=False) as db:
        # Keys k0..k9 over and over (what a gateway keeps); every 25th record has no key.
        db.append([("cmp", PARTITION, i, b"v%d" % i, 1_700_000_000_000, None if i % 25 == 0 else b"k%d" % (i % 10))
                   for i in range(n)])
    survivors = sorted({i for i in range(n) if i % 25 == 0} | {max(i for i in range(n) if i % 10 == k and i % 25)
                                                              for k in range(10)})
    store = Store(tmp_path / "db", cfg, retention_interval=0.05, compaction=CompactionPolicy(frozenset({"cmp"})))
    with store:
        wait_until(lambda: store.db.info("cmp", PARTITION).count == len(survivors), timeout=30)  # type: ignore[union-attr]
        skip_after = 10.0
        t0 = time.monotonic()
        with Consumer("cmp", cfg, offset_reset="earliest", skip_after=skip_after, retry_interval=0.2) as c:
            got: list = []
            deadline = time.monotonic() + 30
            while (not got or got[-1].offset < survivors[-1]) and time.monotonic() < deadline:
                got += c.poll_batch(10_000, 0.2)
            took = time.monotonic() - t0
            assert [r.offset for r in got] == survivors
            assert [r.content for r in got] == [b"v%d" % i for i in survivors]
            assert c.skipped == 0 and c.compacted_passed > 0
            cm = scrape(c.serve_metrics())
            assert cm["dafka_compacted_passed_total"] == c.compacted_passed
            assert "dafka_records_compacted_total" not in cm
        assert store.compacted_voids > 0
        sm = scrape(store.serve_metrics())
        assert sm["dafka_records_compacted_total"] == n - len(survivors)
        assert took < skip_after / 2, f"{took:.1f}s: the gaps waited for skip_after"


def test_a_store_catching_up_from_a_compacting_store_passes_its_gaps_as_holes_at_once(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    n = 400
    with RecordDB(tmp_path / "a", sync=False) as db:
        db.append([("cmp", PARTITION, i, b"v%d" % i, 1_700_000_000_000, None if i % 25 == 0 else b"k%d" % (i % 10))
                   for i in range(n)])
    a = Store(tmp_path / "a", cfg, retention_interval=0.05, compaction=CompactionPolicy(frozenset({"cmp"})))
    with a:
        wait_until(lambda: a.db.info("cmp", PARTITION).count == 26, timeout=30)  # type: ignore[union-attr]
        t0 = time.monotonic()
        with Store(tmp_path / "b", cfg, skip_after=10.0) as b:
            def caught_up() -> bool:
                info = b.db.info("cmp", PARTITION)
                return info is not None and info.last == n - 1 and info.count == 26

            wait_until(caught_up, timeout=30)
            took = time.monotonic() - t0
            assert [x.offset for x in b.db.read("cmp", PARTITION, 0, n)] == \
                [x.offset for x in a.db.read("cmp", PARTITION, 0, n)]
            assert b.db.holes()  # recorded as holes: another store may hold those records
        assert took < 5.0, f"{took:.1f}s: the gaps waited for skip_after"
