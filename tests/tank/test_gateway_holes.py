"""The Tank gateway (a store too): holes nobody can fill and refused partitions.

The gateway failed as the store did ("offsets must be contiguous" on every
commit, nothing acknowledged or answered any more) once a mesh partition had
two holes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.tank.client import TankClient, TankError
from dafka.tank.gateway import Gateway
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)
HOST = "127.0.0.1"


def tank_values(c: TankClient, topic: str, partition: int) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    seq = 0
    for _ in range(100):
        r = c.consume(topic, partition, seq, 1 << 20)
        if not r.messages:
            return out
        out += [(s, bytes(v)) for s, _t, _k, v in r.messages]
        seq = r.next_seq
    raise AssertionError("no end")


def test_two_holes_in_a_mesh_partition_never_stop_the_gateway(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    peer = raw_peer([wire.P_ACK])
    with Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), skip_after=0.5, retry_interval=0.1) as gw:
        peer.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        with TankClient(HOST, gw.tank_port) as c:
            c.create_topic("own", 1)
            key = ("h", peer.address)

            def stored(upto: int) -> None:
                peer.wait_for(lambda p: gw.heads().get(key, -1) >= upto, timeout=20)  # beaconing meanwhile

            peer.send(wire.Record("h", peer.address, "h", 10, b"h10"))  # 0..9: nobody has them
            stored(10)
            assert c.produce("own", 0, [b"a"]) == 0
            peer.send(wire.Record("h", peer.address, "h", 20, b"h20"))  # 11..19: nobody has them
            stored(20)
            for seq in range(21, 24):
                peer.send(wire.Record("h", peer.address, "h", seq, b"h%d" % seq))
            stored(23)
            # Tank produces are still answered (committed), and the holes read as jumps.
            assert c.produce("own", 0, [b"b"]) == 0
            assert gw.storage_error is None
            part = next(p.pid for p in gw.pmap.partitions("h") or () if p.address == peer.address)
            assert tank_values(c, "h", part) == [(11, b"h10")] + [(s + 1, b"h%d" % s) for s in range(20, 24)]
            assert [v for _s, v in tank_values(c, "own", 0)] == [b"a", b"b"]


def test_a_refused_owned_partition_fails_the_produce_carrying_it(cfg: NodeConfig, tmp_path: Path) -> None:
    """The database refuses one owned partition's records (made to skip offsets, as a
    bug would): that produce fails (connection closed), the other partition's produce
    in the same commit is answered, and the refused partition works again after."""
    with Gateway(tmp_path / "gw", cfg, listen=(HOST, 0)) as gw:
        with TankClient(HOST, gw.tank_port) as c:
            c.create_topic("own", 2)
            assert c.produce("own", 0, [b"a0"]) == 0 and c.produce("own", 1, [b"b0"]) == 0
            key0 = ("own", gw.pmap.get("own", 0).address)

            def corrupt() -> None:
                gw._next_offset[key0] += 5  # the next records leave an unexplained gap

            gw.call_soon(corrupt)
            wait_until(lambda: gw._next_offset[key0] == 6)
            with pytest.raises((TankError, OSError)):
                c.produce_many({("own", 0): [b"a1"], ("own", 1): [b"b1"]})
            wait_until(lambda: gw.records_refused == 1)
            assert gw.storage_error is None
        with TankClient(HOST, gw.tank_port) as c:
            assert [v for _s, v in tank_values(c, "own", 1)] == [b"b0", b"b1"]
            assert c.produce("own", 0, [b"a1"]) == 0
            assert [(s, v) for s, v in tank_values(c, "own", 0)] == [(1, b"a0"), (2, b"a1")]
