"""The store's leaf port under hostile clients (written before the port): garbage,
oversized frames, too many connections, a client that never reads.  Real ZeroMQ on
127.0.0.1, a real store on LMDB in a temp dir."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig
from dafka.core import leafwire, wire
from dafka.nodes.node import new_address
from dafka.store.node import Store
from tests.conftest import wait_until

T = "telemetry"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(0)


def make_store(cfg: NodeConfig, tmp: Path, **limits: Any) -> Store:
    return Store(str(tmp / "db"), cfg, leaves="127.0.0.1:0", leaf_limits=limits or None)


def dealer(ctx: zmq.Context, store: Store, **opts: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    assert store.leaves is not None
    sock.connect(f"tcp://127.0.0.1:{store.leaves.port}")
    return sock


def recv(sock: zmq.Socket, timeout: float = 5.0) -> Any:
    if not sock.poll(int(timeout * 1000)):
        return None
    return leafwire.decode(sock.recv_multipart())


class HonestLeaf:
    """A leaf played by hand: HELLO, records, and what comes back."""

    def __init__(self, ctx: zmq.Context, store: Store, address: str | None = None) -> None:
        self.address = address or new_address()
        self.sock = dealer(ctx, store)

    def hello(self, acked: int = -1, nxt: int = 0) -> Any:
        self.sock.send_multipart(leafwire.encode(leafwire.LeafHello(self.address, T, acked, nxt)))
        return recv(self.sock)

    def send(self, seq: int, content: bytes = b"v") -> None:
        self.sock.send_multipart(wire.encode(wire.Record(T, self.address, T, seq, content)))

    def wait_ack(self, seq: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = recv(self.sock, deadline - time.monotonic())
            if isinstance(msg, wire.Ack) and msg.sequence >= seq:
                return
        raise AssertionError(f"no ACK of {seq} within {timeout}s")

    def round_trip(self, n: int = 3) -> None:
        welcome = self.hello()
        assert isinstance(welcome, leafwire.LeafWelcome), welcome
        for seq in range(n):
            self.send(seq, b"r%d" % seq)
        self.wait_ack(n - 1)


def test_an_honest_leaf_is_welcomed_stored_and_acknowledged(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    with make_store(cfg, tmp_path) as store:
        leaf = HonestLeaf(ctx, store)
        leaf.round_trip(5)
        assert store.heads()[(T, leaf.address)] == 4
        assert [r.content for r in store.db.read(T, leaf.address, 0, 10)] == [b"r%d" % i for i in range(5)]


def test_garbage_frames_are_dropped_and_the_port_keeps_serving(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    with make_store(cfg, tmp_path, bad_limit=8) as store:
        hostile = dealer(ctx, store)
        junk = [[b""], [b"\xff" * 100], [b"M\x00\x01"], [b"I" + b"x" * 300 + b"\x00\x01"], [b"a", b"b", b"c"],
                wire.encode(wire.Fetch("A" * 32, "B" * 32, T, 0, 10)),
                wire.encode(wire.Record(T, "A" * 32, T, 0, b"before any hello"))]
        for frames in junk * 3:
            hostile.send_multipart(frames)
        assert store.leaves is not None
        wait_until(lambda: store.leaves.core.bad >= 8)
        while recv(hostile, 0.3) is not None:
            pass  # "no session" answers to its records before a HELLO
        # Ignored from now on: even a good HELLO gets no answer.
        hostile.send_multipart(leafwire.encode(leafwire.LeafHello("A" * 32, T, -1, 0)))
        assert recv(hostile, 0.5) is None
        assert (T, "A" * 32) not in store.heads()
        HonestLeaf(ctx, store).round_trip()


def test_an_oversized_frame_cuts_its_connection_only(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    cfg = dataclasses.replace(cfg, max_record_bytes=1000)
    with make_store(cfg, tmp_path) as store:
        assert store.leaves is not None
        big = HonestLeaf(ctx, store)
        assert isinstance(big.hello(), leafwire.LeafWelcome)
        wait_until(lambda: store.leaves.live == 1)
        big.sock.send_multipart(wire.encode(wire.Record(T, big.address, T, 0, b"x" * 2_000_000)))
        wait_until(lambda: store.leaves.disconnects >= 1)  # libzmq cut it (ZMQ_MAXMSGSIZE)
        honest = HonestLeaf(ctx, store)
        honest.round_trip()
        assert (T, big.address) not in store.heads()
        # A record over max_record_bytes but under the frame limit: refused, counted.
        small = HonestLeaf(ctx, store)
        assert isinstance(small.hello(), leafwire.LeafWelcome)
        small.send(0, b"y" * 1001)
        wait_until(lambda: "over 1000 bytes" in store.leaves.core.last_error)
        assert (T, small.address) not in store.heads()


def test_connections_beyond_the_limit_are_refused_at_the_handshake(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    with make_store(cfg, tmp_path, max_connections=4) as store:
        assert store.leaves is not None
        leaves = [HonestLeaf(ctx, store) for _ in range(4)]
        for leaf in leaves:
            assert isinstance(leaf.hello(), leafwire.LeafWelcome)
        extra = [HonestLeaf(ctx, store) for _ in range(4)]
        for leaf in extra:
            # Not a blocking send: a connection refused at its handshake may have left its
            # DEALER no pipe to queue into (a full run once hung here until the timeout).
            with contextlib.suppress(zmq.Again):
                leaf.sock.send_multipart(leafwire.encode(leafwire.LeafHello(leaf.address, T, -1, 0)), zmq.NOBLOCK)
        assert all(recv(leaf.sock, 0.3) is None for leaf in extra)
        wait_until(lambda: store.leaves.refused_connections >= 4, timeout=10)
        assert len(store.leaves.core) == 4
        for leaf in extra:
            leaf.sock.close(0)
        for leaf in leaves[:2]:
            leaf.sock.close(0)
        wait_until(lambda: store.leaves.live <= 2, timeout=10)
        HonestLeaf(ctx, store).round_trip()


def test_a_client_that_never_reads_does_not_hold_up_the_port(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    with make_store(cfg, tmp_path) as store:
        assert store.leaves is not None
        slow = HonestLeaf(ctx, store)
        assert isinstance(slow.hello(), leafwire.LeafWelcome)
        slow.send(0)
        slow.wait_ack(0)
        # Every HEAD asks for the ACK again; it never reads them.
        slow.sock.setsockopt(zmq.RCVHWM, 1)
        head = wire.encode(wire.Head(T, slow.address, T, 0))
        t0 = time.monotonic()
        sent = 0
        while time.monotonic() - t0 < 3.0 and sent < 200_000:
            try:
                slow.sock.send_multipart(head, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.001)
        wait_until(lambda: store.leaves.core.acks > 1000, timeout=15)
        t0 = time.monotonic()
        HonestLeaf(ctx, store).round_trip()
        assert time.monotonic() - t0 < 5.0


def test_many_leaves_share_one_loop(cfg: NodeConfig, tmp_path: Path) -> None:
    from dafka.nodes.leaf import LeafLoop, LeafProducer

    with make_store(cfg, tmp_path) as store:
        assert store.leaves is not None
        loop = LeafLoop()
        try:
            leaves = [LeafProducer(T, cfg, leaf=f"127.0.0.1:{store.leaves.port}", loop=loop) for _ in range(200)]
            for round_ in range(3):
                for leaf in leaves:
                    leaf.publish(b"%d" % round_)
            assert all(leaf.flush(20) for leaf in leaves)
            assert all(store.heads()[(T, leaf.address)] == 2 for leaf in leaves)
            assert all(leaf.close(1) for leaf in leaves)
        finally:
            loop.close()


def test_a_leafs_ack_never_passes_a_recorded_hole_it_may_still_fill(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    """As a mesh producer's (dafka.store.holes): the store gave 5..7 up (a hole), the
    leaf still holds them (its HELLO says nothing is acknowledged).  Its records
    8..10 are below the store's head; the ACK stops at 4, the leaf is asked to send
    again (STORE-STATUS writing=0), and what it sends fills the hole; then 10."""
    from dafka.store.db import RecordDB

    address = new_address()
    db = RecordDB(str(tmp_path / "db"))
    db.append([(T, address, s, b"r%d" % s, 1) for s in (*range(5), *range(8, 11))], skips=[(T, address, 5, 7)])
    assert db.holes() == [(T, address, 5, 7)]
    db.close()
    with make_store(cfg, tmp_path) as store:
        leaf = HonestLeaf(ctx, store, address)
        welcome = leaf.hello(acked=-1, nxt=11)
        assert isinstance(welcome, leafwire.LeafWelcome) and welcome.held == 10
        for seq in (8, 9, 10):
            leaf.send(seq, b"r%d" % seq)
        acks, statuses = [], []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            msg = recv(leaf.sock, deadline - time.monotonic())
            if isinstance(msg, wire.Ack):
                acks.append(msg.sequence)
            elif isinstance(msg, wire.StoreStatus):
                statuses.append(msg)
                break
        assert all(a <= 4 for a in acks), acks  # never past the hole
        assert statuses and not statuses[0].writing  # send again (a HELLO, then from acked+1)
        assert leaf.hello(acked=-1, nxt=11) is not None
        for seq in range(11):
            leaf.send(seq, b"r%d" % seq)
        leaf.wait_ack(10)
        assert [r.content for r in store.db.read(T, address, 0, 20)] == [b"r%d" % i for i in range(11)]


def test_holes_a_leaf_says_are_acknowledged_elsewhere_cap_its_acks_no_more(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    """A leaf that failed over says (HELLO) that offsets up to 7 were acknowledged by
    another endpoint: it holds none of them, so the hole 5..7 does not cap its ACK
    (the store asks the other stores for it, as for any hole)."""
    from dafka.store.db import RecordDB

    address = new_address()
    db = RecordDB(str(tmp_path / "db"))
    db.append([(T, address, s, b"r%d" % s, 1) for s in (*range(5), *range(8, 11))], skips=[(T, address, 5, 7)])
    db.close()
    with make_store(cfg, tmp_path) as store:
        leaf = HonestLeaf(ctx, store, address)
        assert isinstance(leaf.hello(acked=7, nxt=12), leafwire.LeafWelcome)
        for seq in (8, 9, 10, 11):
            leaf.send(seq, b"r%d" % seq)
        leaf.wait_ack(11)


def test_records_taken_in_one_read_are_relayed_in_their_order(cfg: NodeConfig, tmp_path: Path, ctx: zmq.Context) -> None:
    # The port relays what a read took back to back, after taking it all: the mesh still
    # sees each partition's records in order, every one of them.
    with make_store(cfg, tmp_path) as store:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{store.port}")
        leaf = HonestLeaf(ctx, store)
        assert isinstance(leaf.hello(), leafwire.LeafWelcome)
        leaf.send(0)
        leaf.wait_ack(0)

        def relayed() -> list[Any]:
            out = []
            while sub.poll(0):
                msg = wire.decode(sub.recv_multipart())
                if getattr(msg, "address", None) == leaf.address:
                    out.append(msg)
            return out

        def subscribed() -> bool:
            # A HEAD is relayed too: once one comes back, the subscription is in place.
            leaf.sock.send_multipart(wire.encode(wire.Head(T, leaf.address, T, 0)))
            sub.poll(50)
            return any(isinstance(m, wire.Head) for m in relayed())

        wait_until(subscribed, timeout=10)
        n = 500
        for seq in range(1, n + 1):
            leaf.send(seq, b"r%d" % seq)
        leaf.wait_ack(n)
        got: list[int] = []

        def all_relayed() -> bool:
            got.extend(m.sequence for m in relayed() if isinstance(m, wire.Record))
            return len(got) >= n

        assert wait_until(all_relayed, timeout=10)
        assert got == list(range(1, n + 1))
        assert store.leaves is not None and store.leaves.relays_dropped == 0
