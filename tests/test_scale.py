"""Interest beacons (dafka.core.beacon): who connects to whom, and the tower relaying by subscription."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from dafka.config import NodeConfig, TowerAddress
from dafka.core import beacon, wire
from dafka.core.beacon import (
    CONSUMER,
    GROUP,
    PRODUCER,
    STORE,
    UNKNOWN,
    Interest,
    RelayBook,
    TowerCensus,
)
from dafka.core.peers import Connect, PeerTable
from dafka.errors import ProtocolError
from dafka.nodes.consumer import Consumer
from dafka.nodes.loop import NodeLoop
from dafka.nodes.node import new_address
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from dafka.store.node import Store
from tests.conftest import poll_record, subprocess_env, wait_until

# ---------------------------------------------------------------- sans-IO


def test_interest_rules() -> None:
    producer = Interest.producer("t")
    assert producer.wants(STORE, b"") and producer.wants(CONSUMER, b"t")
    assert not producer.wants(PRODUCER, b"t")  # nobody connects to its own kind
    assert not producer.wants(CONSUMER, b"other")
    assert producer.wants(None, b"") and producer.wants(UNKNOWN, b"")  # C nodes: as today
    consumer = Interest.consumer(["t", "u"], "g")
    assert consumer.wants(PRODUCER, b"u") and consumer.wants(STORE, b"") and consumer.wants(GROUP, b"g")
    assert not consumer.wants(CONSUMER, b"t") and not consumer.wants(PRODUCER, b"v")
    assert not consumer.wants(GROUP, b"h")
    store = Interest(STORE)
    assert all(store.wants(k, b"t") for k in (PRODUCER, CONSUMER, STORE, GROUP, None))
    # Each node subscribes exactly the beacons it may want (prefix + NUL: no topic prefix leak).
    assert producer.subscriptions() == {b"XT", b"XU", b"XS", b"XA", b"XCt\x00"}
    assert consumer.subscriptions() == {b"XT", b"XU", b"XS", b"XA", b"XPt\x00", b"XPu\x00", b"XGg\x00"}
    assert store.subscriptions() == {b"X"}
    assert consumer.heads() == [b"XCt\x00", b"XCu\x00", b"XGg\x00"]
    assert Interest.consumer([]).heads() == [b"XC\x00"]
    assert b"XPt\x00" in Interest.producer("t", watch_peers=True).subscriptions()


def test_peer_table_connects_by_interest() -> None:
    table = PeerTable("ME", 4.0, Interest.producer("t"))
    assert table.on_beacon("P2", "tcp://h:2", 0.0, PRODUCER, b"t") == []
    assert table.on_beacon("C1", "tcp://h:3", 0.0, CONSUMER, b"other") == []
    assert table.on_beacon("C2", "tcp://h:4", 0.0, CONSUMER, b"t") == [Connect("tcp://h:4", "C2")]
    assert table.on_beacon("S1", "tcp://h:5", 0.0, STORE, b"") == [Connect("tcp://h:5", "S1")]
    # A C node reveals no kind: connected as today (plain B, or the tower's X U copy).
    assert table.on_beacon("CN", "tcp://h:6", 0.0) == [Connect("tcp://h:6", "CN")]
    assert table.on_beacon("CU", "tcp://h:7", 0.0, UNKNOWN, b"") == [Connect("tcp://h:7", "CU")]
    # The plain B beacon of a dafka producer (heard behind a C tower) does not make it a C node...
    assert table.on_beacon("P2", "tcp://h:2", 1.0) == []
    # ...until its interest beacons stop for a whole timeout.
    table.expire(6.0)
    assert table.on_beacon("P2", "tcp://h:2", 6.0) == [Connect("tcp://h:2", "P2")]
    assert table.ignored == 2  # P2 and C1 at first


def test_heads_parse_and_refuse_junk() -> None:
    assert beacon.parse_head(beacon.head(PRODUCER, b"topic")) == (PRODUCER, b"topic")
    assert beacon.parse_head(b"XS") == (STORE, b"")
    for junk in (b"X", b"XPtopic", b"XPa\x00b\x00", b"XZ", b"XSx", b"Y", b"XP" + b"t" * 300 + b"\x00"):
        with pytest.raises(ProtocolError):
            beacon.parse_head(junk)
    with pytest.raises(ProtocolError):
        beacon.decode_node_beacon([b"XPt\x00", b"A" * 32, b"", b"notaport"])
    assert beacon.decode_tower_relay([b"XCt\x00", b"A" * 32, b"tcp://h:1"])[:3] == (CONSUMER, b"t", [("A" * 32, "tcp://h:1", b"")])
    assert beacon.decode_tower_relay([b"B", b"A" * 32, b"tcp://h:1"])[:3] == (None, b"", [("A" * 32, "tcp://h:1", b"")])
    assert beacon.parse_hello([b"XT" + b"F" * 32]) == "F" * 32
    assert beacon.parse_hello([b"XT"]) is None and beacon.parse_hello([b"XT1", b"x"]) is None


def test_relay_book_copies_c_beacons_only() -> None:
    book = RelayBook(memory=10.0)
    c_node = book.on_beacon(b"B", "C" * 32, "tcp://h:1", 0.0)
    assert c_node == [[b"B", b"C" * 32, b"tcp://h:1"], [b"XU", b"C" * 32, b"tcp://h:1"]]
    assert book.on_beacon(b"XPt\x00", "D" * 32, "tcp://h:2", 0.0) == [[b"XPt\x00", b"D" * 32, b"tcp://h:2"]]
    assert book.on_beacon(b"B", "D" * 32, "tcp://h:2", 1.0) == [[b"B", b"D" * 32, b"tcp://h:2"]]
    # The same address from elsewhere: a twin (or a C node reusing it) is copied as X U.
    assert book.on_beacon(b"B", "D" * 32, "tcp://h:9", 1.0)[1] == [b"XU", b"D" * 32, b"tcp://h:9"]
    assert len(book.on_beacon(b"B", "D" * 32, "tcp://h:2", 30.0)) == 2  # forgotten: a C node now
    bounded = RelayBook(limit=2)
    for i in range(5):
        bounded.on_beacon(b"XS", f"{i:032d}", "tcp://h:1", 0.0)
    assert len(bounded) == 2  # a flood of addresses cannot grow the book


def test_relay_batcher_sends_a_lone_beacon_at_once_and_batches_a_burst() -> None:
    batcher = beacon.RelayBatcher(window=0.05, max_entries=3, max_pending=10)
    one = [b"XPt\x00", b"A" * 32, b"tcp://h:1"]
    assert batcher.add(one, 0.0) == [one]  # nothing of this head lately: no delay
    assert batcher.due() is None
    assert batcher.add([b"XPt\x00", b"B" * 32, b"tcp://h:2"], 0.01) == []
    assert batcher.add([b"XSx", b"S" * 32, b"tcp://h:9"], 0.01)  # another head: its own window
    assert batcher.add([b"B", b"C" * 32, b"tcp://h:3"], 0.01) == [[b"B", b"C" * 32, b"tcp://h:3"]]  # C format
    assert batcher.add([b"XPt\x00", b"D" * 32, b"tcp://h:4"], 0.02) == []
    assert batcher.due() == pytest.approx(0.05)
    assert batcher.flush(0.04) == []
    assert batcher.flush(0.05) == [[b"XPt\x00", b"B" * 32, b"tcp://h:2", b"D" * 32, b"tcp://h:4"]]
    assert batcher.due() is None
    # A full batch goes at once; secure mode carries a key per beacon (stride 3).
    for i in range(2):
        assert batcher.add([b"XPt\x00", b"%032d" % i, b"tcp://h:1", b"K" * 40], 0.06, stride=3) == []
    full = batcher.add([b"XPt\x00", b"%032d" % 2, b"tcp://h:1", b"K" * 40], 0.07, stride=3)
    assert len(full) == 1 and len(full[0]) == 1 + 3 * 3
    # Hostile: beacons of ever new heads cannot pile up; past max_pending everything goes.
    flood = beacon.RelayBatcher(window=10.0, max_pending=10)
    sent = [m for i in range(100) for _ in range(2) for m in flood.add([b"XPt%d\x00" % i, b"A" * 32, b"e"], 1.0)]
    assert flood._waiting <= 10 and len(flood._last) <= 200
    assert sum(len(m) - 1 for m in sent) // 2 + flood._waiting == 200  # nothing lost
    # Heads sent at once are remembered for their window only, and never more than max_heads.
    heads = beacon.RelayBatcher(window=10.0, max_heads=64)
    for i in range(10_000):
        assert heads.add([b"XPt%d\x00" % i, b"A" * 32, b"e"], i * 0.001) == [[b"XPt%d\x00" % i, b"A" * 32, b"e"]]
    assert len(heads._last) <= 64


def test_tower_relay_decodes_one_beacon_or_a_batch_and_skips_a_bad_entry() -> None:
    a, b = b"A" * 32, b"B" * 32
    assert beacon.decode_tower_relay([b"XPt\x00", a, b"tcp://h:1"]) == (
        PRODUCER, b"t", [("A" * 32, "tcp://h:1", b"")], []
    )
    kind, key, entries, errors = beacon.decode_tower_relay([b"XPt\x00", a, b"tcp://h:1", b"", b"udp://x", b, b"tcp://h:2"])
    assert (kind, key) == (PRODUCER, b"t") and [e[0] for e in entries] == ["A" * 32, "B" * 32] and len(errors) == 1
    assert beacon.decode_tower_relay([b"B", a, b"tcp://h:1"])[2] == [("A" * 32, "tcp://h:1", b"")]
    secure = beacon.decode_tower_relay([b"XS", a, b"tcp://h:1", b"K" * 40, b, b"tcp://h:2", b"short"], key_length=40)
    assert secure[2] == [("A" * 32, "tcp://h:1", b"K" * 40)] and len(secure[3]) == 1
    for junk in (
        [b"B", a, b"tcp://h:1", b, b"tcp://h:2"],  # a C-format beacon is exactly 3 frames
        [b"XPt\x00", a],  # half an entry
        [b"XPt\x00"],
        [b"XQ", a, b"tcp://h:1"],
        [b"XPt\x00", *[a, b"tcp://h:1"] * (beacon.MAX_BATCH + 1)],  # longer than any tower sends
        [],
    ):
        with pytest.raises(ProtocolError):
            beacon.decode_tower_relay(junk)


def test_tower_census() -> None:
    census = TowerCensus(expected=2, started=0.0, grace=1.0, memory=5.0)
    assert not census.needs_plain(3.0)  # no tower welcomed us: B would not help
    census.on_welcome(3.0)
    assert not census.needs_plain(3.5)  # grace: the towers' hellos may still come
    assert census.needs_plain(4.5)
    census.on_hello("T1", 4.6)
    census.on_hello("T2", 4.7)
    assert not census.needs_plain(5.0)
    census.on_hello("T1", 9.0)
    assert census.needs_plain(10.0)  # T2 silent for 5 s: maybe a C tower replaced it
    for i in range(100):
        census.on_hello(f"X{i}", 7.0)
    assert len(census._heard) <= 64


# ---------------------------------------------------------------- real sockets


def test_producers_do_not_meet_and_consumer_gets_records(cfg: NodeConfig, tmp_path: Path) -> None:
    with (
        Store(str(tmp_path / "db"), cfg) as store,
        Producer("t", cfg) as p1,
        Producer("t", cfg) as p2,
        Producer("other", cfg) as p3,
        Consumer("t", cfg, offset_reset="earliest") as consumer,
    ):
        wait_until(lambda: consumer.address in p1.peers and consumer.address in p2.peers)
        wait_until(lambda: store.address in p1.peers and {p1.address, p2.address} <= set(consumer.peers._peers))
        p1.publish(b"one")
        p2.publish(b"two")
        got = set()
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            record = consumer.poll(0.2)
            if record is not None:
                got.add(record.content)
        assert got == {b"one", b"two"}
        assert p1.flush(10) and p2.flush(10)
        # Stores meet everyone; producers never meet producers; the consumer skips "other".
        assert {p1.address, p2.address, p3.address, consumer.address} <= set(store.peers._peers)
        assert p2.address not in p1.peers and p1.address not in p2.peers
        assert p3.address not in consumer.peers and consumer.address not in p3.peers
        assert len(p1.peers) == 2  # the store and the consumer
        # A fresh earliest consumer reads both partitions from the store.
        with Consumer("t", cfg, offset_reset="earliest") as fresh:
            seen = set()
            deadline = time.monotonic() + 10
            while len(seen) < 2 and time.monotonic() < deadline:
                record = fresh.poll(0.2)
                if record is not None:
                    seen.add(record.partition)
            assert seen == {p1.address, p2.address}


def test_c_like_peer_is_connected_both_ways(cfg: NodeConfig, raw_peer) -> None:
    # A C node: beacons only B, subscribes only B; reads records of "t".
    peer = raw_peer([wire.P_RECORD + b"t"])
    with Producer("t", cfg, acks=False) as producer:
        # The producer connects to it (subscribes its FETCH prefix on the peer's XPUB)...
        peer.wait_for(lambda p: p.subscribed(wire.P_FETCH + producer.address.encode()))
        assert peer.address in producer.peers
        # ...and it connects to the producer (it heard the producer's B beacon).
        peer.wait_for(lambda p: any(e.endswith(f":{producer.port}") for e in p.peers))
        deadline = time.monotonic() + 10
        while not peer.messages(wire.Record) and time.monotonic() < deadline:
            producer.publish(b"hello")
            peer.pump(0.1)
        assert [m.content for m in peer.messages(wire.Record)][:1] == [b"hello"]


def _beacon_sub(tower: Tower, *prefixes: bytes) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    for prefix in prefixes:
        sub.setsockopt(zmq.SUBSCRIBE, prefix)
    sub.connect(f"tcp://127.0.0.1:{tower.out_port}")
    return sub


def _heard(sub: zmq.Socket, seconds: float) -> list[list[bytes]]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if sub.poll(50):
            out.append(sub.recv_multipart())
    return out


def test_tower_relays_by_subscription(tower: Tower, cfg: NodeConfig, tmp_path: Path) -> None:
    only_a = _beacon_sub(tower, b"XPa\x00")
    plain = _beacon_sub(tower, b"B")
    unknown = _beacon_sub(tower, b"XU")
    try:
        with Producer("a", cfg) as pa, Producer("b", cfg) as pb, Store(str(tmp_path / "db"), cfg) as store:
            heard_a = _heard(only_a, 1.0)
            heard_plain = _heard(plain, 0.2)
            assert heard_a and {m[0] for m in heard_a} == {b"XPa\x00"}
            assert {m[1].decode() for m in heard_a} == {pa.address}
            # A plain B subscriber (a C node, dafka status) still hears every node.
            assert {pa.address, pb.address, store.address} <= {m[1].decode() for m in heard_plain}
            assert {m[0] for m in heard_plain} == {b"B"}
            # Not a single X U once the mesh met: every one of these nodes said what it
            # is.  (Before the store's subscription to X reached a producer, its interest
            # beacon had no taker and its B beacon went alone: an X U then is right.)
            wait_until(lambda: pa.address in store.peers and pb.address in store.peers, 10)
            while unknown.poll(0):
                unknown.recv_multipart()
            xu = _heard(unknown, 0.5)
            assert not {m[1].decode() for m in xu} & {pa.address, pb.address, store.address}
    finally:
        only_a.close(0)
        plain.close(0)
        unknown.close(0)


def test_hostile_interest_beacons_leave_the_tower_serving(tower: Tower, cfg: NodeConfig) -> None:
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{tower.in_port}")
    sub = _beacon_sub(tower, b"X")
    try:
        wait_until(lambda: sub.poll(50) and sub.recv_multipart()[0].startswith(b"XT"), timeout=5)
        for junk in ([b"XPt", b"A" * 32, b"", b"1"], [b"XQ", b"A" * 32, b"", b"1"], [b"X" * 1000, b"A", b"", b"1"]):
            pub.send_multipart(junk)
        good = new_address()
        deadline = time.monotonic() + 5
        heard: list[list[bytes]] = []
        while time.monotonic() < deadline and not any(m[1:2] == [good.encode()] for m in heard):
            pub.send_multipart([b"XS", good.encode(), b"127.0.0.1", b"1234"])
            heard += _heard(sub, 0.1)
        assert [b"XS", good.encode(), b"tcp://127.0.0.1:1234"] in heard
        assert tower.bad_input.count >= 3
    finally:
        pub.close(0)
        sub.close(0)


def test_tower_batches_a_burst_of_beacons_and_a_store_meets_every_peer(tower: Tower, cfg: NodeConfig, tmp_path: Path) -> None:
    n = 300
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{tower.in_port}")
    sub = _beacon_sub(tower, b"XPburst\x00")
    addresses = [new_address() for _ in range(n)]
    # The producers' endpoint: one ZeroMQ listener (a store drops peers it cannot reach
    # when others wait, see PeerLimits; its one handshake here answers for all 300).
    listener = zmq.Context.instance().socket(zmq.PUB)
    listener.setsockopt(zmq.LINGER, 0)
    port = str(listener.bind_to_random_port("tcp://127.0.0.1")).encode()
    try:
        with Store(str(tmp_path / "db"), cfg) as store:
            # Until the tower relays a probe to this SUB and to the store, the PUB's
            # connection or a subscription may not be up (the burst is sent once).
            probe = new_address()

            def relayed() -> bool:
                pub.send_multipart([b"XPburst\x00", probe.encode(), b"127.0.0.1", port])
                return bool(_heard(sub, 0.1)) and probe in store.peers._peers

            wait_until(relayed, 10)
            while sub.poll(0):
                sub.recv_multipart()
            for address in addresses:  # one burst: the beacons of 300 producers of one topic
                pub.send_multipart([b"XPburst\x00", address.encode(), b"127.0.0.1", port])
            messages: list[list[bytes]] = []
            heard: set[bytes] = set()
            deadline = time.monotonic() + 10
            while not set(a.encode() for a in addresses) <= heard and time.monotonic() < deadline:
                messages += _heard(sub, 0.1)
                heard = {f for m in messages for f in m[1::2]}
            assert set(a.encode() for a in addresses) <= heard
            assert all(m[0] == b"XPburst\x00" and len(m) % 2 == 1 for m in messages)
            assert len(messages) < n / 4  # batched: a few messages, not one a beacon
            assert max(len(m) for m in messages) <= 1 + 2 * beacon.RELAY_BATCH
            # The store takes every beacon of the batches as its own peer.
            wait_until(lambda: set(addresses) <= set(store.peers._peers), 10)
    finally:
        pub.close(0)
        sub.close(0)
        listener.close(0)


_TOWER_PROCESS = """
import sys
from dafka.nodes.tower import Tower
with Tower("127.0.0.1", 0, 0) as tower:
    print(tower.in_port, tower.out_port, flush=True)
    sys.stdin.read()  # until the test closes it (or dies)
"""


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_subscribers_that_stop_reading_cost_the_tower_a_few_megabytes_each() -> None:
    # Hostile: four SUBs subscribe to everything and never read, while a PUB
    # floods 200,000 beacons of one topic.  The tower queues for each of them up
    # to its high-water mark, which counts messages: with batches of 128 that
    # was about 30 MB each (a few connections, and the tower is out of memory).
    tower = subprocess.Popen(
        [sys.executable, "-c", _TOWER_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env()
    )
    ctx = zmq.Context.instance()
    sockets: list[zmq.Socket] = []

    def socket(kind: int) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sockets.append(sock)
        return sock

    try:
        assert tower.stdout is not None
        in_port, out_port = map(int, tower.stdout.readline().split())
        stalled = []
        for _ in range(4):
            sub = socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.RCVBUF, 4096)  # a small TCP window: the tower's queue fills
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{out_port}")
            stalled.append(sub)
        healthy = socket(zmq.SUB)
        healthy.setsockopt(zmq.SUBSCRIBE, b"XPend\x00")
        healthy.connect(f"tcp://127.0.0.1:{out_port}")
        pub = socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.connect(f"tcp://127.0.0.1:{in_port}")
        marker = [b"XPend\x00", new_address().encode(), b"127.0.0.1", b"9"]

        def heard_by(subs: list[zmq.Socket]) -> bool:
            pub.send_multipart(marker)
            return all(sub.poll(100) and sub.recv_multipart() for sub in subs)

        # Every subscription is up once each SUB got a marker; the stalled ones read no more.
        wait_until(lambda: heard_by([*stalled, healthy]), 15)
        before = _rss_mb(tower.pid)
        addresses = [new_address().encode() for _ in range(1000)]
        for i in range(200_000):
            pub.send_multipart([b"XPflood\x00", addresses[i % 1000], b"127.0.0.1", b"9"])
        # The tower relayed the whole flood once a marker sent after it comes through.
        last = [b"XPend\x00", new_address().encode(), b"127.0.0.1", b"9"]

        def flood_relayed() -> bool:
            pub.send_multipart(last)
            return healthy.poll(100) and last[1] in healthy.recv_multipart()

        wait_until(flood_relayed, 60)
        grown = _rss_mb(tower.pid) - before
        assert grown < 40, f"the tower grew {grown:.0f} MB for 4 subscribers that stopped reading"
        assert tower.poll() is None
    finally:
        for sock in sockets:
            sock.close(0)
        tower.kill()
        tower.wait(10)


def test_earliest_consumer_discovers_100_partitions_from_the_store(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    n = 100
    with Store(str(tmp_path / "db"), cfg):
        # One raw peer plays 100 producers (partitions) that beacon only B; the store meets it
        # through the tower's X U copy.
        peer = raw_peer([wire.P_ACK])
        peer.wait_for(lambda p: p.subscribed(wire.P_RECORD))
        partitions = [new_address() for _ in range(n)]
        for address in partitions:
            peer.send(wire.Record("many", address, "many", 0, address.encode()))
        peer.wait_for(lambda p: len(p.messages(wire.Ack)) >= n)
        started = time.monotonic()
        seen: set[str] = set()
        with Consumer("many", cfg, offset_reset="earliest") as consumer:
            while len(seen) < n and time.monotonic() - started < 5.0:
                record = consumer.poll(0.1)
                if record is not None:
                    seen.add(record.partition)
        assert seen == set(partitions)


class _CLikeTower:
    """What the C tower does: relay node beacons (any first frame) as 3-frame tower
    beacons, forward subscriptions except W; no hello, no X U copies."""

    def __init__(self) -> None:
        import threading

        ctx = zmq.Context.instance()
        self.xsub = ctx.socket(zmq.XSUB)
        self.xpub = ctx.socket(zmq.XPUB)
        self.xpub.setsockopt(zmq.XPUB_WELCOME_MSG, wire.WELCOME)
        for sock in (self.xsub, self.xpub):
            sock.setsockopt(zmq.LINGER, 0)
        self.in_port = self.xsub.bind_to_random_port("tcp://127.0.0.1")
        self.out_port = self.xpub.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.xsub:
                    frames = self.xsub.recv_multipart()
                    if len(frames) >= 4:
                        endpoint = b"tcp://127.0.0.1:" + frames[3]
                        self.xpub.send_multipart([frames[0], frames[1], endpoint])
                else:
                    sub = self.xpub.recv()
                    if sub[1:2] != b"W":
                        self.xsub.send(sub)
        self.xsub.close(0)
        self.xpub.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_behind_a_c_tower_nodes_meet_c_nodes_and_each_other(cfg: NodeConfig) -> None:
    from dataclasses import replace

    from dafka.config import TowerAddress
    from tests.conftest import RawPeer

    c_tower = _CLikeTower()
    c_cfg = replace(cfg, towers=(TowerAddress("127.0.0.1", c_tower.in_port, c_tower.out_port),))
    peer = RawPeer(c_cfg, [wire.P_RECORD + b"t"])
    try:
        with Producer("t", c_cfg, acks=False) as producer, Consumer("t", c_cfg, offset_reset="earliest") as consumer:
            # No hello from this tower: the producer falls back to B and meets the C node too.
            peer.wait_for(lambda p: p.subscribed(wire.P_FETCH + producer.address.encode()))
            wait_until(lambda: producer.address in consumer.peers)
            producer.publish(b"x")
            record = poll_record(consumer)
            assert record is not None and record.content == b"x"
            assert wire.BEACON in producer._beacon_subs
    finally:
        peer.close()
        c_tower.close()


# ---------------------------------------------------------------- many partitions stay readable


def test_topics_and_status_summarise_many_partitions(tmp_path: Path) -> None:
    import subprocess

    from dafka.cli.status import render_text
    from dafka.store.db import RecordDB
    from tests.conftest import dafka_cmd, subprocess_env

    parts = [f"{i:032X}" for i in range(30)]
    with RecordDB(tmp_path / "db") as db:
        db.append([("many", p, 0, b"x" * (i + 1), 0) for i, p in enumerate(parts)])
        db.append([("many", parts[-1], 1, b"y", 0)])

    def topics(*extra: str) -> list[str]:
        out = subprocess.run(
            dafka_cmd("topics", "--db", str(tmp_path / "db"), *extra),
            capture_output=True, text=True, env=subprocess_env(), timeout=60, check=True,
        )
        return out.stdout.splitlines()

    short = topics()
    assert len(short) == 1 + 20 + 1 and "... 10 more partitions" in short[-1] and "--all" in short[-1]
    assert parts[-1] in short[1]  # the largest first
    assert len(topics("--all")) == 1 + 30

    snap = {
        "towers": [],
        "nodes": [
            {"address": p, "kind": "producer", "endpoint": "tcp://h:1", "alive": True, "last_beacon_age": 0.1}
            for p in parts
        ]
        + [{"address": "S" * 32, "kind": "store", "endpoint": "tcp://h:2", "alive": True, "last_beacon_age": 0.1}],
        "partitions": [
            {
                "topic": "many",
                "partition": p,
                "producer_head": 0,
                "producer_alive": i != 5,
                "stores": [{"address": "S" * 32, "head": 0 if i != 7 else -1, "lag": 0 if i != 7 else 1}],
            }
            for i, p in enumerate(parts)
        ],
    }
    text = render_text(snap)
    assert "NODES (31: 30 producer, 1 store)" in text and "S" * 32 in text
    assert "... 11 more producers" in text and "... 10 more partitions" in text
    assert "PARTITIONS (30, 1 without a live producer)" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("PARTITIONS"))
    assert parts[7] in lines[header + 2]  # the lagging one first
    full = render_text(snap, None)
    assert all(full.count(p) == 2 for p in parts) and "more" not in full


def test_an_idle_producer_wakes_about_once_a_second(cfg: NodeConfig, tmp_path: Path) -> None:
    """A fleet's cost is mostly its idle nodes' wake-ups: an idle producer beside a
    store runs its timers together, once a second, and no check every 250 ms."""
    cfg = dataclasses.replace(cfg, beacon_interval=1.0, beacon_timeout=5.0)  # the default
    with Store(str(tmp_path / "db"), cfg, sync=False) as store, Producer("idle", cfg) as producer:
        assert producer.publish(b"x").wait(10)
        wait_until(lambda: len(producer.peers) >= 1 and len(store.peers) >= 1, timeout=10)
        time.sleep(1.5)  # settled: the store's beacon and ACK repeats only
        timers0 = {fn.__name__: last for _, last, fn in producer._timers}
        turns0, t0 = producer.loop_turns, time.monotonic()
        time.sleep(4.0)
        rate = (producer.loop_turns - turns0) / (time.monotonic() - t0)
        ran = {fn.__name__ for _, last, fn in producer._timers if last != timers0[fn.__name__]}
    # Each second: the timers (one turn, the HEAD's too), the store's beacon, the
    # tower's hello, now and then a repeated ACK. It was 7-8: a cut check every
    # 250 ms, the HEAD timer a few ms out of step with the others, an ACK a second.
    assert "_check_cuts" not in ran
    assert rate < 4.5, (rate, producer._timers)


@pytest.mark.parametrize("shared_loop", [False, True])
def test_a_producer_that_met_its_peers_reads_beacons_at_its_own_turns(
    cfg: NodeConfig, tmp_path: Path, shared_loop: bool
) -> None:
    """The store's beacons and the towers' hellos woke a device producer three
    times a second; once it met a peer it reads them at its timers' turn."""
    cfg = dataclasses.replace(cfg, beacon_interval=1.0, beacon_timeout=5.0)  # the default
    with (
        NodeLoop() as loop,
        Store(str(tmp_path / "db"), cfg, sync=False) as store,
        Producer("lazy", cfg, loop=loop if shared_loop else None) as producer,
    ):
        assert producer.publish(b"x").wait(10)
        wait_until(lambda: producer._lazy_beacons and len(store.peers) >= 1, timeout=10)
        time.sleep(1.5)
        turns0, t0 = producer.loop_turns, time.monotonic()
        time.sleep(4.0)
        rate = (producer.loop_turns - turns0) / (time.monotonic() - t0)
        assert rate < 2.0, rate  # the timers' turn, now and then a repeated ACK
        assert store.address in producer.peers  # renewed all along: never expired
        # A consumer that comes later is met at the producer's next turn (a second).
        with Consumer("lazy", cfg) as consumer:
            wait_until(lambda: consumer.address in producer.peers, timeout=4.0)


def test_a_producer_sends_no_head_while_its_records_say_it(cfg: NodeConfig, raw_peer) -> None:
    """A HEAD a second beside each device's record of the second was a message a
    second at every store and consumer; it goes once the records stop."""
    peer = raw_peer([wire.P_HEAD + b"beat\x00", wire.P_RECORD + b"beat\x00"])
    with Producer("beat", cfg, acks=False, head_interval=0.25) as producer:
        peer.wait_for(lambda p: any(e.endswith(f":{producer.port}") for e in p.peers))
        peer.wait_for(lambda p: p.subscribed(wire.P_FETCH + producer.address.encode()))
        start = time.monotonic()
        while not peer.messages(wire.Record) and time.monotonic() - start < 10:
            producer.publish(b"warm-up")
            peer.pump(0.1)
        assert peer.messages(wire.Record), "the peer never got a record"
        peer.pump(0.6)  # the HEAD of the warm-up goes within two intervals
        first_beat = producer.window.next
        for _ in range(20):  # a record every 0.1 s for 2 s: every HEAD tick had records
            producer.publish(b"beat")
            peer.pump(0.1)
        heads = [h for h in peer.messages(wire.Head) if h.sequence >= first_beat]
        assert not heads, heads
        last = producer.window.next - 1
        stopped = time.monotonic()
        peer.wait_for(lambda p: any(h.sequence == last for h in p.messages(wire.Head)), timeout=5)
        assert time.monotonic() - stopped < 2 * 0.25 + 0.5  # within two intervals (and slack)


def test_ack_repeats_back_off_until_the_producer_subscribes_again() -> None:
    from dafka.store.acks import MAX_GAP, AckRepeats

    r = AckRepeats()
    assert r.due("P", 5, 0.0)  # never sent: answer
    r.sent("P", 5, 0.0)
    assert not r.due("P", 5, 0.5)  # it has it, most likely
    assert r.due("P", 6, 0.5)  # a new head always goes
    r.sent("P", 6, 0.5)
    # Unchanged: after 1 s, then 2 s, 4 s ... at most MAX_GAP apart.
    times = [t / 10 for t in range(5, 2000, 5) if r.due("P", 6, t / 10)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 1.5 and gaps[:4] == [2.0, 4.0, 8.0, MAX_GAP] and max(gaps) == MAX_GAP
    r.forget("P")  # the producer subscribed again: its next HEAD is answered
    assert r.due("P", 6, 200.0)
    r.forget("never seen")  # a hostile subscription adds nothing
    assert len(r) == 0


def test_an_idle_producer_gets_fewer_and_fewer_repeated_acks(cfg: NodeConfig, tmp_path: Path) -> None:
    """Each HEAD of an idle producer (one a second) got its ACK again: on a fleet,
    most of the store's output and a wake-up a second for every producer."""
    with Store(str(tmp_path / "db"), cfg, sync=False) as store, Producer("idle", cfg) as producer:
        assert producer.publish(b"x").wait(10)
        time.sleep(0.5)
        sent0 = store.acks_sent
        time.sleep(6.0)  # six HEADs
        repeats = store.acks_sent - sent0
        assert repeats <= 3, repeats  # after 1, 2 (and 4) s
        # A record published now is acknowledged at once as before.
        assert producer.publish(b"y").wait(5)



_FULL_MONITOR = """
import logging, socket, time
import zmq
from dafka.nodes.node import OUTBOUND_EVENTS
from dafka.nodes.security import RefusalLog

ports = []
for _ in range(200):  # ports nobody listens on: every attempt is refused and retried
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.LINGER, 0)
refusals = RefusalLog(sub, "test", logging.getLogger("test"), events=OUTBOUND_EVENTS, refusals=False)
for port in ports:
    sub.connect(f"tcp://127.0.0.1:{port}")
time.sleep(1.5)  # ~200 endpoints x 10 retries a second, never read: over 1,000 events
refusals.close()
sub.close(0)
ctx.term()
print("closed")
"""


def test_closing_a_node_with_a_full_monitor_queue_does_not_hang() -> None:
    """Hundreds of gone peers queue a thousand reconnect events within a second
    after a node's loop stopped reading: stopping the monitor then blocked for
    good, holding the GIL (so in a child process, with a deadline)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        out = subprocess.run([sys.executable, "-c", _FULL_MONITOR], env=env, capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("closing the monitor hung")
    assert out.returncode == 0 and b"closed" in out.stdout, out.stderr


def test_a_busy_node_reads_waiting_hellos_before_taking_its_tower_for_a_c_one() -> None:
    """A node's census decides "some tower is no dafka tower" when it heard too few
    hellos; a node too busy to have read the ones waiting for it must read them
    first, not subscribe B and meet every peer of the mesh (seen at 1,000 nodes)."""
    ctx = zmq.Context.instance()
    # A tower of our own, to say exactly one hello when the node is looking away.
    beacons_out, beacons_in = ctx.socket(zmq.XPUB), ctx.socket(zmq.XSUB)
    try:
        out_port = beacons_out.bind_to_random_port("tcp://127.0.0.1")
        in_port = beacons_in.bind_to_random_port("tcp://127.0.0.1")
        cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", in_port, out_port),), bind="127.0.0.1")
        with Producer("census", cfg) as producer:
            # The node subscribed the hellos at this tower (its other subscriptions too).
            wait_until(lambda: beacons_out.poll(100) and beacons_out.recv() == b"\x01" + beacon.HELLO, 10)
            outcome: list[object] = []

            def in_io_thread() -> None:
                census = producer.census
                census.welcomed, census.grace_until = True, 0.0  # no hello heard, the grace over...
                beacons_out.send_multipart(beacon.tower_hello("T1"))  # ...while one waits unread
                if not producer.beacon_sub.poll(5000):
                    outcome.append("the hello did not come")
                    return
                assert census.needs_plain(time.monotonic())  # what it concluded before reading
                producer._check_census(time.monotonic())
                outcome.append(wire.BEACON in producer._beacon_subs)

            producer.call_soon(in_io_thread)
            wait_until(lambda: outcome, 10)
        assert outcome == [False]
    finally:
        beacons_out.close(0)
        beacons_in.close(0)
