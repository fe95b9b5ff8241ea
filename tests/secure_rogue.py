"""A rogue mesh node for tests/test_security.py: it answers every HEAD with an ACK.

Run as ``python tests/secure_rogue.py KEY ALLOW TOWER_KEY IN_PORT OUT_PORT [greet]``.
With a valid producer key it joins a secure mesh, but it is no store.  With
``greet`` it also sends every peer, five times a second, what only stores may
tell a consumer: a STORE-HELLO and a DIRECT-HEAD of a partition that does not exist.
"""

from __future__ import annotations

import sys
import time

from dafka.config import NodeConfig, TowerAddress
from dafka.core import wire
from dafka.nodes import security
from dafka.nodes.node import Node

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


class Forger(Node):
    """A node with a valid (e.g. consumer-role) key that writes into other nodes' partitions.

    On every HEAD of a partition beyond what it forged, it publishes ``count``
    forged records at the partition's next offsets (``records``: as RECORDs plus
    a HEAD; ``direct``: as DIRECT-RECORDs to every peer it knows), and it
    answers every FETCH with forged DIRECT-RECORDs.  Used in-process by
    tests/test_security.py.
    """

    kind = "forger"
    CONTENT = b"FORGED"

    def __init__(self, config: NodeConfig, *, records: bool = True, direct: bool = True, count: int = 5) -> None:
        super().__init__(config)
        self.records, self.direct, self.count = records, direct, count
        self.known: set[str] = set()
        self.forged_up_to: dict[tuple[str, str], int] = {}
        self.forged_sent = 0
        self.subscribe(wire.P_HEAD)
        if direct:
            self.subscribe(wire.P_FETCH)

    def __enter__(self) -> Forger:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def on_peer(self, endpoint: str, address: str) -> None:
        self.known.add(address)

    def _send(self, msg: wire.Message) -> None:
        self.publisher.send_multipart(wire.encode(msg))

    def on_data(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except Exception:
            return
        if isinstance(msg, wire.Head) and msg.sequence > self.forged_up_to.get((msg.subject, msg.address), -1):
            first, last = msg.sequence + 1, msg.sequence + self.count
            self.forged_up_to[(msg.subject, msg.address)] = last
            for seq in range(first, last + 1):
                if self.records:
                    self._send(wire.Record(msg.subject, msg.address, msg.subject, seq, self.CONTENT))
                if self.direct:
                    for peer in self.known:
                        self._send(wire.DirectRecord(peer, msg.address, msg.subject, seq, self.CONTENT))
                self.forged_sent += 1
            if self.records:
                self._send(wire.Head(msg.subject, msg.address, msg.subject, last))
        elif isinstance(msg, wire.Fetch) and msg.topic != self.address:
            for seq in range(msg.sequence, msg.sequence + min(msg.count, 100)):
                self._send(wire.DirectRecord(msg.address, msg.topic, msg.subject, seq, self.CONTENT))
            self.forged_sent += 1


class VoidForger(Node):
    """A node with a valid key (no store's, and owning no partition) that answers
    every FETCH with VOIDs: kind 1 in the name of the partition's producer, and
    kind 0 in its own name and in ``claim``'s (another node's address).
    Used in-process by tests/test_security.py."""

    kind = "forger"

    def __init__(self, config: NodeConfig, claim: str) -> None:
        super().__init__(config)
        self.claim = claim
        self.forged_sent = 0
        self.subscribe(wire.P_FETCH)

    def __enter__(self) -> VoidForger:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def on_data(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except Exception:
            return
        if isinstance(msg, wire.Fetch) and msg.topic != self.address:
            first, last = msg.sequence, msg.sequence + msg.count - 1
            for source, kind in ((msg.topic, wire.VOID_RESTART), (self.address, wire.VOID_STORE),
                                 (self.claim, wire.VOID_STORE)):  # fmt: skip
                self.publisher.send_multipart(
                    wire.encode(wire.Void(msg.address, msg.topic, msg.subject, first, last, source, kind))
                )
            self.forged_sent += 1


class RestartedOwner(Node):
    """A partition's owner (a producer key) that plays a producer resumed past a
    hole: it publishes the records it is given and, once ``says_void``, answers
    FETCHes of ``hole`` with VOID kind 1 as Producer._on_fetch does."""

    kind = "producer"

    def __init__(self, config: NodeConfig, topic: str, hole: tuple[int, int]) -> None:
        super().__init__(config)
        self.topic, self.hole = topic, hole
        self.says_void = False
        self.subscribe(wire.P_FETCH + self.address.encode())

    def __enter__(self) -> RestartedOwner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def publish(self, seq: int) -> None:
        self.call_soon(
            lambda: self.publisher.send_multipart(
                wire.encode(wire.Record(self.topic, self.address, self.topic, seq, b"r%d" % seq))
            )
        )

    def on_data(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except Exception:
            return
        if isinstance(msg, wire.Fetch) and msg.topic == self.address and self.says_void:
            void = wire.Void(msg.address, self.address, self.topic, *self.hole, self.address, wire.VOID_RESTART)
            self.publisher.send_multipart(wire.encode(void))


class SilentStore(Node):
    """A storing key's node that other stores count as a store (it subscribes to
    its CONSUMER-HELLOs) and holds nothing; it answers FETCHes with VOID kind 0
    in its own name only once ``answers``."""

    kind = "store"

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        self.answers = False
        self.subscribe(wire.P_CONSUMER_HELLO + self.address.encode())
        self.subscribe(wire.P_FETCH)

    def __enter__(self) -> SilentStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def on_data(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except Exception:
            return
        if isinstance(msg, wire.Fetch) and self.answers and msg.address != self.address:
            first, last = msg.sequence, msg.sequence + msg.count - 1
            void = wire.Void(msg.address, msg.topic, msg.subject, first, last, self.address, wire.VOID_STORE)
            self.publisher.send_multipart(wire.encode(void))
