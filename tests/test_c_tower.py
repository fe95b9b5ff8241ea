"""Our nodes behind the reference C tower (tests/c_tower.py, byte for byte), and our tower's hello.

A C tower relays whatever a node beacons and forwards every subscription but
``W``; it never says hello.  A node finds that out from its own probe coming
back (see :mod:`dafka.core.beacon`), within about a beacon interval, instead
of waiting for hellos that never come.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.config import NodeConfig, TowerAddress
from dafka.core import beacon, wire
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from dafka.store.node import Store
from tests.c_tower import CTower, atoi
from tests.conftest import RawPeer, wait_until


def c_config(tower: CTower, interval: float = 1.0) -> NodeConfig:
    # The C nodes' defaults: a beacon a second, peers dropped after 4 s.
    return NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=interval,
        beacon_timeout=4 * interval,
    )


def test_the_emulation_relays_as_the_c_tower() -> None:
    assert atoi(b"49155") == 49155 and atoi(b" 12x") == 12 and atoi(b"x") == 0 and atoi(b"") == 0
    with CTower(own_address="10.9.8.7") as tower:
        ctx = zmq.Context.instance()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        try:
            for s in (pub, sub):
                s.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"W")
            sub.setsockopt(zmq.SUBSCRIBE, b"Q")
            sub.connect(f"tcp://127.0.0.1:{tower.out_port}")
            pub.connect(f"tcp://127.0.0.1:{tower.in_port}")
            assert sub.recv_multipart() == [b"W"]
            wait_until(lambda: b"\x01Q" in tower.forwarded)
            assert not any(s[1:2] == b"W" for s in tower.forwarded)
            got: list[list[bytes]] = []

            def relayed() -> bool:
                # any first frame, extra frames dropped, an empty host: the Peer-Address 127.0.0.1, rewritten
                pub.send_multipart([b"Qany", b"ADDR", b"", b"42", b"extra"])
                if sub.poll(50):
                    got.append(sub.recv_multipart())
                return bool(got)

            wait_until(relayed)
            assert got[0] == [b"Qany", b"ADDR", b"tcp://10.9.8.7:42"]
            pub.send_multipart([b"Qh", b"A2", b"h.example", b"7"])
            assert sub.poll(2000)
            assert sub.recv_multipart() == [b"Qh", b"A2", b"tcp://h.example:7"]
        finally:
            pub.close(0)
            sub.close(0)


def test_behind_a_c_tower_a_store_acks_a_c_producer_within_two_seconds(tmp_path) -> None:
    """Issue 34.2: the store and a C producer start together behind a C tower."""
    with CTower() as tower:
        cfg = c_config(tower)
        peer = RawPeer(cfg, [wire.P_ACK])  # beacons B with no host, as a C producer
        started = time.monotonic()
        try:
            with Store(str(tmp_path / "db"), cfg, sync=False) as store:
                # It knows its tower is no dafka tower within about one beacon interval.
                wait_until(lambda: wire.BEACON in store._beacon_subs, timeout=1.5)
                known = time.monotonic() - started
                peer.wait_for(lambda p: p.subscribed(wire.P_RECORD), timeout=5)
                peer.send(wire.Record("c", peer.address, "c", 0, b"first"))
                peer.send(wire.Head("c", peer.address, "c", 0))
                peer.wait_for(lambda p: p.messages(wire.Ack), timeout=5)
                acked = time.monotonic() - started
                assert acked < 2.0, f"first ACK {acked:.2f}s after start (tower kind known after {known:.2f}s)"
                assert store.census.kind(time.monotonic()) == "c"
        finally:
            peer.close()


def test_behind_a_c_tower_dafka_nodes_and_a_c_node_meet_at_once() -> None:
    with CTower() as tower:
        cfg = c_config(tower, interval=0.2)
        peer = RawPeer(cfg, [wire.P_RECORD + b"t"])
        try:
            with Producer("t", cfg, acks=False) as producer, Consumer("t", cfg, offset_reset="earliest") as consumer:
                peer.wait_for(lambda p: p.subscribed(wire.P_FETCH + producer.address.encode()), timeout=2)
                wait_until(lambda: producer.address in consumer.peers, timeout=2)
                producer.publish(b"x")
                record = None
                for _ in range(50):
                    record = consumer.poll(0.1)
                    if record is not None:
                        break
                assert record is not None and record.content == b"x"
                # The probes went back only to their senders: nobody else subscribes them.
                assert not any(m[0][:1] == b"R" for m in peer.received)
        finally:
            peer.close()


def test_a_dafka_tower_greets_a_new_node_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our tower says hello when a node subscribes, not only on its timer (here a minute);
    the node never subscribes B and its probe never reaches our tower."""
    monkeypatch.setattr(beacon, "HELLO_INTERVAL", 60.0)
    with Tower("127.0.0.1", 0, 0) as tower:
        cfg = NodeConfig(
            towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
            bind="127.0.0.1",
            beacon_interval=1.0,
            beacon_timeout=4.0,
        )
        wait_until(lambda: tower.hellos >= 1)  # its timer's hello is out before any node connects
        with Producer("t", cfg, acks=False) as producer:
            started = time.monotonic()
            wait_until(lambda: producer.census.kind(time.monotonic()) == "dafka", timeout=1.0)
            assert time.monotonic() - started < 1.0
            assert wire.BEACON not in producer._beacon_subs
            # Its probe never reaches our tower (the tower keeps R subscriptions): nothing logged.
            assert tower.bad_input.count == 0
        assert tower.hellos <= 3  # one answer for the producer's subscription (rate-limited)


def test_census_decides_on_an_echo_and_forgets_it() -> None:
    census = beacon.TowerCensus(expected=1, started=0.0, grace=5.0, memory=10.0)
    census.on_welcome(0.1)
    assert census.kind(0.2) == "unknown" and not census.needs_plain(0.2)
    census.on_echo(0.3)
    assert census.kind(0.3) == "c" and census.needs_plain(0.3)  # no grace: the echo is proof
    census.on_hello("T", 0.4)
    assert census.needs_plain(0.5)  # a dafka tower greets, and another relays as a C tower
    census.on_hello("T", 9.0)
    assert not census.needs_plain(10.5)  # the echo is old (the C tower was replaced by ours)
    assert census.kind(10.5) == "dafka"


def test_an_echo_is_the_probe_of_this_node_relayed_by_a_tower() -> None:
    me = "A" * 32
    probe = beacon.probe(wire.node_beacon(me, "127.0.0.1", 4000), me)
    assert probe == [b"R" + me.encode(), me.encode(), b"127.0.0.1", b"4000"]
    assert beacon.is_echo([probe[0], me.encode(), b"tcp://127.0.0.1:4000"], me)
    assert not beacon.is_echo([b"R" + b"B" * 32, b"B" * 32, b"tcp://127.0.0.1:4000"], me)
    assert not beacon.is_echo([probe[0], b"127.0.0.1", b"tcp://x:1", b"ok"], me)  # a reflection
    assert not beacon.is_echo([probe[0], b"C" * 32, b"tcp://127.0.0.1:4000"], me)  # another sender


def test_a_node_behind_our_tower_and_a_c_tower_meets_c_nodes_at_once() -> None:
    with CTower() as c_tower, Tower("127.0.0.1", 0, 0) as ours:
        cfg = replace(
            c_config(c_tower, interval=0.5),
            towers=(
                TowerAddress("127.0.0.1", ours.in_port, ours.out_port),
                TowerAddress("127.0.0.1", c_tower.in_port, c_tower.out_port),
            ),
        )
        with Producer("t", cfg, acks=False) as producer:
            wait_until(lambda: wire.BEACON in producer._beacon_subs, timeout=1.5)
            assert producer.census.kind(time.monotonic()) == "c"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_is_echo_takes_only_this_nodes_relayed_probe(frames: list[bytes]) -> None:
    me = "A" * 32
    assert beacon.is_echo(frames, me) == (
        len(frames) == 3 and frames[0] == b"R" + me.encode() and frames[1] == me.encode()
    )
    # and an echo with any endpoint frame is one (the tower wrote it; nothing is read from it)
    assert beacon.is_echo([b"R" + me.encode(), me.encode(), (frames or [b""])[0]], me)
