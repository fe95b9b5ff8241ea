"""A rogue mesh node for tests/test_security.py: it answers every HEAD with an ACK.

Run as ``python tests/secure_rogue.py KEY ALLOW TOWER_KEY IN_PORT OUT_PORT [greet]``.
With a valid producer key it joins a secure mesh, but it is no store.  With
``greet`` it also sends every peer, five times a second, what only stores may
tell a consumer: a STORE-HELLO and a DIRECT-HEAD of a partition that does not exist.
"""

from __future__ import annotations

import sys
import time

from dafka import security, wire
from dafka.config import NodeConfig, TowerAddress
from dafka.node import Node

FAKE_PARTITION = "F" * 32


class Rogue(Node):
    kind = "rogue"
    greeted: set[str] = set()

    def on_peer(self, endpoint: str, address: str) -> None:
        self.greeted.add(address)

    def greet(self, now: float) -> None:
        for address in self.greeted:
            self.publisher.send_multipart(wire.encode(wire.StoreHello(address, self.address)))
            self.publisher.send_multipart(wire.encode(wire.DirectHead(address, FAKE_PARTITION, "t", 1000)))

    def on_data(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except Exception:
            return
        if isinstance(msg, wire.Head):
            # "Acknowledge" the whole partition without storing anything.
            self.publisher.send_multipart(wire.encode(wire.Ack(msg.address, msg.subject, msg.sequence)))
            print("acked", msg.address, msg.sequence, flush=True)


def main() -> None:
    key, allow, tower_key, in_port, out_port = sys.argv[1:6]
    sec = security.SecurityConfig(key, allow, (security.parse_key(tower_key),))
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", int(in_port), int(out_port)),),
        bind="127.0.0.1",
        beacon_interval=0.2,
        beacon_timeout=2.0,
        security=sec,
    )
    rogue = Rogue(cfg)
    rogue.subscribe(wire.P_HEAD)
    if sys.argv[6:] == ["greet"]:
        rogue.greeted = set()
        rogue.every(0.2, rogue.greet)
    rogue.start()
    print("rogue up", flush=True)
    deadline = time.monotonic() + 60  # bounded, the test kills it sooner
    while time.monotonic() < deadline:
        time.sleep(0.2)
    rogue.stop()


if __name__ == "__main__":
    main()
