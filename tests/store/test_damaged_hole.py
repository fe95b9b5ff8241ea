"""A read starting in a hole after a damaged stored block whose damage a header check does not
see (a store block's ends table): the block stepped back onto ends before the read,
so its damage is not the read's.  Real LMDB stores; the mesh case over real sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.store.db import RecordDB
from dafka.store.node import Store
from dafka.store.reader import convert_block
from tests.store.test_damaged_reads import DAMAGED, HEALTHY, damaged, got, healthy, value

pytestmark = pytest.mark.timeout(120)

KINDS = ["store-ends", "store-count"]  # (readers do not check a block's CRC: see dafka.store.block.crc_matches)


def plant(path: Path, kind: str) -> None:
    """DAMAGED: 0-1, 2-4 damaged (its header reads), a hole 5-7, 8-9, 10-11; HEALTHY: 0-2."""
    with RecordDB(path, sync=False) as db:
        db.append_blocks([
            ("t", DAMAGED, healthy(0, [b"a0", b"a1"])), ("t", DAMAGED, damaged(kind, 2)),
            ("t", DAMAGED, healthy(8, [b"a8", b"a9"])), ("t", DAMAGED, healthy(10, [b"a10", b"a11"])),
            ("t", HEALTHY, healthy(0, [b"b0", b"b1", b"b2"])),
        ], skips=[("t", DAMAGED, 5, 7)])


@pytest.mark.parametrize("impl", ["pure", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_read_from_a_hole_after_a_damaged_block_reads_on(tmp_path: Path, impl: str, kind: str) -> None:
    """Both twins of fetch_blocks, from 5-7: the records 8-11.  Before, the block stepped back
    onto (2-4) was checked (its CRC then, its ends table) before its range, and raised from a read holding
    none of its offsets: every reader from the hole was refused 8-11 (a mesh answer ended with
    no VOID, a leaf answer was empty, Spark failed the read) again and again."""
    from dafka.fastio import _pure

    fetch_blocks = _pure.fetch_blocks if impl == "pure" else pytest.importorskip("dafka.fastio._compiled").fetch_blocks
    plant(tmp_path / "db", kind)
    with RecordDB(tmp_path / "db", sync=False) as db, db._read_txn(buffers=True) as (txn, dbs):
        pid = db.info("t", DAMAGED).pid
        for start in (5, 6, 7):
            assert fetch_blocks(txn.cursor(db=dbs.blocks), pid, start, 11, 10, convert_block) == (
                8, [value(b"a8"), value(b"a9"), value(b"a10"), value(b"a11")])
        with pytest.raises(ValueError):
            fetch_blocks(txn.cursor(db=dbs.blocks), pid, 3, 11, 10, convert_block)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mesh_answer_past_a_damaged_block_and_a_hole_serves_the_rest(cfg: NodeConfig, tmp_path: Path,
                                                                               raw_peer: Any, kind: str) -> None:
    """A FETCH from 2: a VOID of the damaged block, then 8-11 (this store holds them).  Before,
    the answer ended at the hole: the read from 5 raised, the block found from 5 (8-9) read,
    so no VOID and no records: asked again and again, 8-11 never came from this store."""
    plant(tmp_path / "db", kind)
    with Store(tmp_path / "db", cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 1))  # (answered after the first's turns)
        peer.wait_for(lambda q: (0, b"b0") in got(q, HEALTHY) and any(v.address == DAMAGED
                                                                      for v in q.messages(wire.Void)))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 5, 10))
        peer.wait_for(lambda q: (11, b"a11") in got(q, DAMAGED), timeout=10)
        voids = [(v.first, v.last) for v in peer.messages(wire.Void) if v.address == DAMAGED]
        assert not [v for v in voids if v[1] >= 8], voids
        assert store.running
