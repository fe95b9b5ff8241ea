"""A damaged stored block (bit rot, a bug of an older version: blocks are checked when they
are written, not when read) met by a Tank consume of two partitions (a real gateway on a real
LMDB store): its partition's answer only (tests/tank/test_gateway.py has the Tank bundles
whose header cannot be read; these are the store's own blocks, and a block whose header is
damaged too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dafka.tank.client import TankClient
from dafka.tank.messages import ConsumeFlag
from tests.store.test_damaged_reads import plant
from tests.tank.test_gateway import HOST, consume_both, created_partitions, make_gateway  # noqa: F401, F811 (a fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("kind", ["header", "store-ends", "store-short", "store-crossed", "store-count"])
@pytest.mark.parametrize("seq", [1, 3], ids=["from-before", "at-the-damage"])
def test_a_damaged_block_costs_its_partition_only(make_gateway: Any, tmp_path: Path, kind: str,  # noqa: F811
                                                  seq: int) -> None:
    """The store's own blocks (mesh records) are converted into a bundle.  Before: a block
    whose values do not parse (an ends table) raised an IndexError out of the request, left
    unanswered (the client timed out); a damaged header closed the connection as bad input.
    Now the records before it go (a consume from before it), or its partition is answered
    with a system error (from it), and the other partition and the connection go on."""
    addresses = created_partitions(make_gateway, "cx")
    plant(tmp_path / "cx", kind, "cx", partitions=(addresses[0], addresses[1]))
    gw = make_gateway("cx")
    with TankClient(HOST, gw.tank_port) as c:
        damaged, other = consume_both(c, "cx", seq)
        assert [m[3] for m in other.decode_chunk().records] == [b"b0", b"b1", b"b2"]
        if seq == 1:  # the records before the damage
            assert damaged.flags == ConsumeFlag.OK
            assert [m[3] for m in damaged.decode_chunk().records] == [b"a0", b"a1"]
        else:
            assert damaged.flags == ConsumeFlag.SYSTEM_ERROR
        assert [m[3] for m in c.consume("cx", 1, 1).messages] == [b"b0", b"b1", b"b2"]  # the connection goes on
