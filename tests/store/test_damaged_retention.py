"""Retention and DeleteRecords at a stored front block that cannot be read (bit rot in its
header): the block is kept (its range and age are not known), the partition's retention stops
there, logged rate-limited; every other partition is retained as before, and the store's
writer thread lives on.  Real LMDB stores; the node case over real sockets."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.store.block import block_key
from dafka.store.db import RecordDB
from dafka.store.node import Store
from dafka.store.retention import Retention, RetentionPolicy
from tests.conftest import wait_until
from tests.store.test_damaged_reads import DAMAGED, HEALTHY, TS, damaged, got, healthy

pytestmark = pytest.mark.timeout(120)

NOW = TS + 3_600_000  # an hour after every planted record


def plant_front(path: Path) -> None:
    """Topic t: DAMAGED 0-2 (its header rotten), 3-4 healthy; HEALTHY 0-2, 3-4.  Topic u:
    HEALTHY 0-2.  Every record written at TS."""
    with RecordDB(path, sync=False) as db:
        db.append_blocks([
            ("t", DAMAGED, damaged("header", 0)), ("t", DAMAGED, healthy(3, [b"a3", b"a4"])),
            ("t", HEALTHY, healthy(0, [b"b0", b"b1", b"b2"])), ("t", HEALTHY, healthy(3, [b"b3", b"b4"])),
            ("u", HEALTHY, healthy(0, [b"c0", b"c1", b"c2"])),
        ])
        pid = db.info("t", DAMAGED).pid
        db._write(lambda txn: txn.put(block_key(pid, 0), b"XB" + damaged("store-ends", 0)[2:], db=db._dbs.blocks))


@pytest.mark.parametrize("rule", [Retention(max_age_ms=1000), Retention(max_bytes=1)])
def test_retention_keeps_a_front_block_it_cannot_read_and_retains_the_rest(tmp_path: Path, rule: Retention) -> None:
    """By age or by size: the damaged front block stays (its partition's first and records
    too), named to the caller; the other partitions of its topic and of other topics are
    retained.  Before, its header's ProtocolError raised out of the transaction: nothing was
    retained anywhere, every round."""
    plant_front(tmp_path / "db")
    with RecordDB(tmp_path / "db", sync=False) as db:
        damaged: list[tuple[str, str, int]] = []
        assert db.enforce_retention(NOW, RetentionPolicy(rule), damaged=damaged).deleted > 0
        assert damaged == [("t", DAMAGED, 0)]
        assert db.first("t", DAMAGED) == 0 and db.info("t", DAMAGED).count == 5
        if rule.max_bytes is None:  # by age: everything else leaves
            assert db.info("t", HEALTHY).count == 0 and db.info("u", HEALTHY).count == 0
        else:  # by size: the topic's other partition passes it (its bytes still count: all of them leave)
            assert db.info("t", HEALTHY).count == 0 and db.info("u", HEALTHY).count == 3  # (u: one block stays)
        again = db.enforce_retention(NOW, RetentionPolicy(rule), damaged=damaged)
        assert damaged == [("t", DAMAGED, 0)] and again.deleted == 0
        assert db.first("t", DAMAGED) == 0


def test_a_store_node_retains_past_a_damaged_front_block_and_its_writer_lives(
        cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Retention rounds of a store node at a damaged front block: the other partitions are
    retained, the writer thread lives (a round after it still runs), and the damaged block is
    logged rate-limited, not once a round.  Before, the ProtocolError ended the writer thread
    at the first round: nothing was retained or committed again."""
    plant_front(tmp_path / "db")
    caplog.set_level(logging.ERROR)
    policy = RetentionPolicy(Retention(max_age_ms=1000))
    with Store(tmp_path / "db", cfg, retention=policy, retention_interval=0.02) as store:
        rounds = []
        enforce = store.db.enforce_retention

        def counted(*args: object, **kwargs: object) -> object:
            rounds.append(1)
            return enforce(*args, **kwargs)  # type: ignore[arg-type]

        store.db.enforce_retention = counted  # type: ignore[method-assign]
        wait_until(lambda: store.db.info("u", HEALTHY).count == 0 and store.db.info("t", HEALTHY).count == 0,
                   timeout=30)
        wait_until(lambda: len(rounds) >= 40, timeout=30)
        assert store._writer.is_alive() and store.running
        assert store.db.first("t", DAMAGED) == 0 and store.db.info("t", DAMAGED).count == 5
        lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert lines and all("cannot be read" in r.getMessage() for r in lines), [r.getMessage() for r in lines]
        assert len(lines) <= 11, len(lines)


def test_delete_records_at_a_damaged_front_block_deletes_it_only_when_it_is_wholly_below(tmp_path: Path) -> None:
    """Kafka's DeleteRecords (delete_front) at a front block whose header cannot be read:
    below the new start by the next block's key, it leaves; otherwise it stays and the start
    moves into it; the records after it are never passed, the count never reaches 0 while
    records are held.  Before, its header's ProtocolError failed every such delete."""
    plant_front(tmp_path / "db")
    with RecordDB(tmp_path / "db", sync=False) as db:
        assert db.delete_front("t", DAMAGED, 2) == (2, True)  # inside it (0-2 by the keys): kept
        assert db.first("t", DAMAGED) == 2 and db.info("t", DAMAGED).count == 5
        assert db.delete_front("t", DAMAGED, 3) == (3, True)  # now wholly below: gone
        info = db.info("t", DAMAGED)
        assert info.first == 3 and info.count > 0
        start, values = db.fetch("t", DAMAGED, 0, 10)  # from the healthy block after it
        assert start == 3 and [v[-2:] for v in values] == [b"a3", b"a4"]
    with RecordDB(tmp_path / "last", sync=False) as db:  # the partition's last block, damaged
        db.append_blocks([("t", DAMAGED, healthy(0, [b"a0"])), ("t", DAMAGED, damaged("header", 1))])
        pid = db.info("t", DAMAGED).pid
        db._write(lambda txn: txn.put(block_key(pid, 1), b"XB" + damaged("store-ends", 1)[2:], db=db._dbs.blocks))
        assert db.delete_front("t", DAMAGED, 3) == (3, True)  # up to the head (3): inside it, kept
        assert db.info("t", DAMAGED).count > 0
        assert db.delete_front("t", DAMAGED, 4) == (4, True)  # past the head: all of it
        assert db.info("t", DAMAGED).count == 0


def test_fetches_from_below_the_start_are_logged_rate_limited(cfg: NodeConfig, tmp_path: Path, raw_peer: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A reader asking again and again for offsets retention removed: each FETCH is answered
    from the start, but the warning that they were removed is logged rate-limited, not once a
    FETCH (a hostile reader flooded the log).  Before, 40 FETCHes logged 40 lines."""
    with RecordDB(tmp_path / "db", sync=False) as db:
        db.append_blocks([("t", HEALTHY, healthy(0, [b"b0", b"b1", b"b2"])), ("t", HEALTHY, healthy(3, [b"b3"]))])
        assert db.delete_front("t", HEALTHY, 3) == (3, True)
    caplog.set_level(logging.WARNING)
    with Store(tmp_path / "db", cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        for i in range(40):
            peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 1))
            peer.wait_for(lambda q, n=i + 1: len(got(q, HEALTHY)) >= n)
        assert set(got(peer, HEALTHY)) == {(3, b"b3")}
        lines = [r for r in caplog.records if "removed by retention" in r.getMessage()]
        assert 1 <= len(lines) <= 11, len(lines)
