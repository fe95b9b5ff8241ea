"""The Tank gateway's store ACKs the mesh producers' partitions, not its own.

Only a partition's producer subscribes to its ACKs, and the producer of a partition the
gateway owns is the gateway itself: an ACK of it on the mesh went to no one (a zmq send
per commit).  Its HEADs still go out, for the mesh's readers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway

pytestmark = pytest.mark.timeout(120)
HOST = "127.0.0.1"


def test_owned_partitions_get_heads_and_no_acks_mesh_partitions_get_acks(
    cfg: NodeConfig, tmp_path: Path, raw_peer,
) -> None:
    peer = raw_peer([wire.P_ACK, wire.P_HEAD])
    with Gateway(tmp_path / "gw", cfg, listen=(HOST, 0)) as gw:
        peer.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        with TankClient(HOST, gw.tank_port) as c:
            c.create_topic("own", 1)
            own = gw.pmap.get("own", 0).address
            assert c.produce("own", 0, [b"a"]) == 0 and c.produce("own", 0, [b"b"]) == 0
            # The mesh hears the owned partition's HEAD...
            peer.wait_for(lambda p: any(h.address == own and h.sequence == 1 for h in p.messages(wire.Head)))
            # ...and a mesh producer's records, committed after those produces, their ACK.
            peer.send(wire.Record("h", peer.address, "h", 0, b"h0"))
            peer.wait_for(lambda p: any(a.topic == peer.address and a.sequence == 0 for a in p.messages(wire.Ack)))
            assert [a for a in peer.messages(wire.Ack) if a.topic == own] == []
            assert gw.acks_sent >= 1
