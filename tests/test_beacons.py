"""What nodes beacon, and meshes whose tower is not ours (the C reference's).

The C tower (``src/dafka_tower.c``) relays a beacon's host as given; an empty
host becomes the connection's Peer-Address, and a Peer-Address of 127.0.0.1
(or none) becomes the tower's own first non-loopback interface address.  The
raw towers here behave like that (or relay hosts verbatim, filling in
nothing), so our nodes are tested against both.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig, TowerAddress, loopback_trap
from dafka.core import reach, wire
from dafka.errors import ConfigError
from dafka.nodes.consumer import Consumer
from dafka.nodes.node import Node
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from dafka.store.node import Store
from tests.c_tower import atoi
from tests.conftest import dafka_cmd, subprocess_env, wait_until


def own_interface_address() -> str | None:
    """This machine's first non-loopback IPv4 address, as the C tower's ziflist finds one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))  # no packet is sent: only a route is chosen
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") else host


class RawTower:
    """A tower as the C reference's, on raw ZeroMQ sockets (in a thread).

    ``rewrite``: the C tower's rule (empty host -> Peer-Address; 127.0.0.1 or
    no Peer-Address -> ``own_address``), and as the C tower every message is
    relayed (any first frame: a node's probe comes back to it, so it knows a C
    tower within a beacon interval, see tests/c_tower.py).  Without it the
    beacon's host is relayed verbatim, even when empty, and only ``B`` beacons:
    a tower that neither echoes nor greets (nodes take it for a C tower after
    the hello-only wait).  ``relayed``: the ``B`` beacons' endpoints.
    """

    def __init__(self, rewrite: str | None) -> None:
        self.own_address = rewrite
        ctx = zmq.Context.instance()
        self.xsub = ctx.socket(zmq.XSUB)
        self.xpub = ctx.socket(zmq.XPUB)
        for s in (self.xsub, self.xpub):
            s.setsockopt(zmq.LINGER, 0)
        self.xpub.setsockopt(zmq.XPUB_WELCOME_MSG, b"W")
        self.in_port = self.xsub.bind_to_random_port("tcp://127.0.0.1")
        self.out_port = self.xpub.bind_to_random_port("tcp://127.0.0.1")
        self.relayed: list[str] = []
        self.subscriptions: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def towers(self) -> tuple[TowerAddress, ...]:
        return (TowerAddress("127.0.0.1", self.in_port, self.out_port),)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        for _ in range(100_000):  # bounded: 100 ms polls, far beyond any test
            if self._stop.is_set():
                break
            for sock, _ in poller.poll(100):
                if sock is self.xpub:
                    sub = self.xpub.recv()
                    self.subscriptions.append(sub)
                    if not (len(sub) >= 2 and sub[1:2] == b"W"):
                        self.xsub.send(sub)
                    continue
                first = self.xsub.recv(copy=False)
                rest = self.xsub.recv_multipart() if first.more else []
                if self.own_address is None and (first.bytes != b"B" or len(rest) != 3):
                    continue
                address, host, port = (f.decode(errors="replace") for f in (*rest, b"", b"", b"")[:3])
                if self.own_address is not None and not host:
                    try:
                        peer = first.get("Peer-Address")
                    except zmq.ZMQError:
                        peer = None
                    host = self.own_address if peer in (None, "127.0.0.1") else peer
                endpoint = f"tcp://{host}:{atoi(port.encode()) if self.own_address is not None else port}"
                if first.bytes == b"B":
                    self.relayed.append(endpoint)
                self.xpub.send_multipart([first.bytes, address.encode(), endpoint.encode()])
        self.xsub.close(0)
        self.xpub.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def raw_tower() -> Any:
    made: list[RawTower] = []

    def make(rewrite: str | None) -> RawTower:
        made.append(RawTower(rewrite))
        return made[-1]

    yield make
    for t in made:
        t.close()


def node_config(towers: tuple[TowerAddress, ...], bind: str) -> NodeConfig:
    return NodeConfig(towers=towers, bind=bind, beacon_interval=0.2, beacon_timeout=2.0)


def produce_and_ack(cfg: NodeConfig, db: Path, n: int = 50) -> None:
    """A store and a producer through the given tower: every record is acknowledged and read back."""
    with Store(str(db), cfg, sync=False), Producer("beacons", cfg) as producer:
        receipts = [producer.publish(b"r%d" % i) for i in range(n)]
        assert receipts[-1].wait(15), producer.diagnose()
        with Consumer("beacons", cfg, offset_reset="earliest") as consumer:
            got = [consumer.poll(10) for _ in range(n)]
        assert [r.content for r in got if r is not None] == [b"r%d" % i for i in range(n)]


def test_a_node_bound_to_one_interface_names_it_in_its_beacon() -> None:
    assert reach.beacon_host("", "tcp://127.0.0.1:4000") == "127.0.0.1"
    assert reach.beacon_host("", "tcp://10.1.2.3:4000") == "10.1.2.3"
    assert reach.beacon_host("", "tcp://0.0.0.0:4000") == ""  # as the C nodes: the tower fills it in
    assert reach.beacon_host("", "tcp://[::]:4000") == ""
    assert reach.beacon_host("gw.example", "tcp://127.0.0.1:4000") == "gw.example"


def test_a_mesh_through_a_tower_that_relays_hosts_verbatim(raw_tower, tmp_path: Path) -> None:
    tower = raw_tower(None)
    produce_and_ack(node_config(tower.towers(), "127.0.0.1"), tmp_path / "db")
    assert tower.relayed and all(e.startswith("tcp://127.0.0.1:") for e in tower.relayed)


def test_a_mesh_through_a_tower_that_rewrites_loopback_as_the_c_tower(raw_tower, tmp_path: Path) -> None:
    own = own_interface_address()
    if own is None:
        pytest.skip("no non-loopback interface: the C tower itself cannot run here")
    tower = raw_tower(own)
    # Our nodes bound to loopback beacon 127.0.0.1 themselves: nothing is rewritten.
    produce_and_ack(node_config(tower.towers(), "127.0.0.1"), tmp_path / "loop")
    assert all(e.startswith("tcp://127.0.0.1:") for e in tower.relayed)
    # Bound to every interface they beacon no host, as C nodes: the tower
    # announces its interface address, where they listen too.
    tower.relayed.clear()
    produce_and_ack(node_config(tower.towers(), "*"), tmp_path / "all")
    assert tower.relayed and all(e.startswith(f"tcp://{own}:") for e in tower.relayed)


def test_our_tower_still_fills_in_a_missing_host(tower: Tower) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    pub = ctx.socket(zmq.PUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"B")
        sub.connect(f"tcp://127.0.0.1:{tower.out_port}")
        pub.connect(f"tcp://127.0.0.1:{tower.in_port}")

        def relayed() -> list[bytes] | None:
            pub.send_multipart(wire.node_beacon("C0FFEE", "", 4321))
            return sub.recv_multipart() if sub.poll(100) else None

        assert wait_until(relayed) == [b"B", b"C0FFEE", b"tcp://127.0.0.1:4321"]
    finally:
        sub.close(0)
        pub.close(0)


def test_the_tower_tells_a_node_how_it_is_seen_and_c_nodes_never_get_it(
    tower: Tower, cfg: NodeConfig, caplog
) -> None:
    ctx = zmq.Context.instance()
    c_like = ctx.socket(zmq.SUB)  # a C node's beacon SUB: W and B only
    c_like.setsockopt(zmq.SUBSCRIBE, b"W")
    c_like.setsockopt(zmq.SUBSCRIBE, b"B")
    c_like.connect(f"tcp://127.0.0.1:{tower.out_port}")
    node = Node(cfg)
    node.start()
    try:
        r = wait_until(lambda: node.reach.reflection if node.reach.reflection and node.reach.reflection.probe else None)
        assert r.seen == "127.0.0.1"
        assert r.endpoint == f"tcp://127.0.0.1:{node.port}"
        assert r.probe == reach.PROBE_OK
        assert tower.reflections > 0
        assert "refused" not in caplog.text  # the probe is no failed handshake to a plain node
        heard = []
        for _ in range(200):
            if not c_like.poll(10):
                break
            heard.append(c_like.recv_multipart()[0][:1])
        assert set(heard) <= {b"W", b"B"}
    finally:
        node.stop()
        c_like.close(0)


def test_the_tower_names_an_announced_endpoint_nobody_listens_on(tower: Tower, cfg: NodeConfig, caplog) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    node = Node(replace(cfg, advertise="127.0.0.1"))
    node._beacon = wire.node_beacon(node.address, "127.0.0.1", port)  # a node announcing the wrong port
    node.port = port
    node.refresh_interest()  # the interest beacons copy the plain one's host and port
    node.start()
    try:
        r = wait_until(lambda: node.reach.reflection if node.reach.reflection and node.reach.reflection.probe else None)
        assert r.probe == "connection refused"
        wait_until(lambda: f"port {port}" in caplog.text and "connection refused" in caplog.text)
    finally:
        node.stop()


def test_the_tower_probes_only_the_address_a_beacon_came_from() -> None:
    plan = reach.ProbePlan(ttl=30, max_in_flight=2)
    probe, start = plan.on_beacon("10.0.0.6", "tcp://192.168.9.9:22", 0.0)
    assert start is None and probe.startswith("not checked")
    assert plan.on_beacon("10.0.0.6", "tcp://10.0.0.6:4000", 0.0) == ("", ("10.0.0.6", 4000))
    assert plan.on_beacon("10.0.0.6", "tcp://10.0.0.6:4000", 0.1) == ("", None)  # in flight
    assert plan.on_beacon("10.0.0.6", "tcp://10.0.0.6:4001", 0.1)[1] is not None
    assert plan.on_beacon("10.0.0.6", "tcp://10.0.0.6:4002", 0.1)[1] is None  # two in flight at most
    plan.on_result(("10.0.0.6", 4000), "ok", 1.0)
    assert plan.on_beacon("10.0.0.6", "tcp://10.0.0.6:4000", 5.0) == ("ok", None)  # once per ttl
    assert plan.on_beacon("10.0.0.6", "tcp://10.0.0.6:4000", 31.0)[1] is not None
    # Bounded memory, whatever a hostile node subscribes.
    small = reach.ProbePlan(max_nodes=3, max_results=3)
    for i in range(100):
        small.on_subscription(True, f"N{i}")
        small.on_result(("10.0.0.6", i), "ok", 0.0)
    assert len(small.wanting) == 3 and len(small.results) == 3


def test_a_tower_changing_its_probe_text_cannot_flood_the_log() -> None:
    watch = reach.ReachWatch(started=0.0, grace=5.0, repeat=60.0)

    def reflect(probe: str, now: float) -> str | None:
        return watch.on_reflection(reach.Reflection("A" * 32, "10.0.0.6", "tcp://10.0.0.6:4000", probe), now)

    assert reflect("connection refused", 1.0) is not None
    # A new failure text at every beacon: one warning a minute, not one a beacon.
    assert [reflect(f"refused #{i}", 1.0 + i) for i in range(1, 50)] == [None] * 49
    assert reflect(reach.PROBE_OK, 55.0) is None
    assert reflect("timed out", 62.0) is not None
    assert reflect("timed out", 200.0) is None  # the same text is said once


def test_hostile_reflections_are_dropped(cfg: NodeConfig, tower: Tower) -> None:
    node = Node(cfg)
    node.start()
    try:
        node.call_soon(lambda: node._on_reflection([b"R" + node.address.encode(), b"\xff" * 3, b"x", b"y"]))
        node.call_soon(lambda: node._on_reflection([b"R" + node.address.encode()]))
        node.call_soon(lambda: node._on_reflection([b"R" + node.address.encode()] + [b"x" * 5000] * 3))
        wait_until(lambda: node.bad_input.count >= 3)
        assert node.running
    finally:
        node.stop()


def test_a_node_no_peer_reaches_says_why(raw_tower, caplog) -> None:
    own = own_interface_address()
    if own is None:
        pytest.skip("no non-loopback interface")
    # A peer announced at our interface address (a C tower's rewrite) and a node
    # that announces 127.0.0.1 while bound there: the peer cannot reach it.
    tower = raw_tower(own)
    towers = tower.towers()
    lonely = Node(node_config(towers, "127.0.0.1"))
    lonely._beacon = wire.node_beacon(lonely.address, "", lonely.port)  # as before the fix: no host
    lonely.refresh_interest()  # its interest beacons (relayed too) carry no host either
    other = Node(node_config(towers, "*"))
    lonely.start()
    other.start()
    try:
        wait_until(lambda: "may be unreachable" in caplog.text, timeout=15)
        line = next(r.getMessage() for r in caplog.records if "may be unreachable" in r.getMessage())
        assert lonely.address[:8] in line and "127.0.0.1 only" in line and own in line
        assert "did not say how it sees this node" in line  # a C-like tower sends no reflection
        assert other.address[:8] not in line
    finally:
        lonely.stop()
        other.stop()


def test_loopback_node_with_a_tower_elsewhere_refuses_to_start() -> None:
    towers = (TowerAddress("10.9.8.7"),)
    with pytest.raises(ConfigError, match=r"listen on 127\.0\.0\.1 only.*10\.9\.8\.7.*--bind ADDR.*--insecure"):
        Node(NodeConfig(towers=towers, bind="127.0.0.1"))
    with pytest.raises(ConfigError):
        Node(NodeConfig(towers=towers, bind="lo"))  # an interface name is judged by what it binds
    # A non-loopback advertise is the user's own routing (a forwarded port): allowed.
    # Judged without starting a node: a started one would connect to the tower,
    # and tests send nothing beyond loopback.
    assert loopback_trap(NodeConfig(towers=towers, bind="127.0.0.1", advertise="10.9.8.1"), "127.0.0.1") is None
    Node(NodeConfig(towers=(TowerAddress("localhost"),), bind="127.0.0.1")).stop()


@pytest.mark.parametrize("service", ["store", "gateway"])
def test_a_service_with_a_tower_elsewhere_refuses_loopback_in_one_line(service: str, tmp_path: Path) -> None:
    # Before: the store bound 127.0.0.1 silently and no other host ever reached it.
    out = subprocess.run(
        dafka_cmd(service, "--db", str(tmp_path / "db"), "--tower", "10.9.8.7"),
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: this {service} would listen on 127.0.0.1 only")
    assert "10.9.8.7" in lines[0] and "--bind ADDR" in lines[0] and "--insecure" in lines[0]
    assert "[security]" in lines[0]


def test_the_producer_names_the_store_endpoint_it_cannot_reach(cfg: NodeConfig, tmp_path: Path) -> None:
    # A store that announces where nothing listens (127.0.0.2: loopback, but the
    # store is bound to 127.0.0.1 only): the producer sees its beacons but cannot connect.
    with Store(str(tmp_path / "db"), replace(cfg, advertise="127.0.0.2"), sync=False) as store:
        with Producer("unreached", cfg) as producer:
            receipt = producer.publish(b"x")
            assert not receipt.wait(1.5)
            why = wait_until(lambda: "failed connection attempt" in producer.diagnose() and producer.diagnose())
            assert f"tcp://127.0.0.2:{store.port}" in why and store.address[:8] in why
            assert why.startswith("no store reported; this producer cannot connect to 1 of the 1 node(s)")
            producer.close(timeout=0.1)


def test_the_producer_says_when_it_reached_every_node_and_none_is_a_store(cfg: NodeConfig) -> None:
    with Consumer("nostore", cfg), Producer("nostore", cfg) as producer:
        why = wait_until(lambda: "reached all" in producer.diagnose() and producer.diagnose())
        assert why.startswith("no store on the mesh: this producer reached all 1 other node(s)")
        producer.close(timeout=0.1)


def test_doctor_names_what_cannot_be_reached(tower: Tower, cfg: NodeConfig) -> None:
    from dafka.cli import doctor

    peer = Node(cfg)
    peer.start()
    try:
        lines: list[str] = []
        assert doctor.check(cfg, 3.0, lines.append, [])
        assert any(line.startswith("ok   reachable from the tower's side") for line in lines), lines
        assert any(line.startswith("ok   reachable from peers") for line in lines), lines
        assert f"ok   reaches peer node {peer.address[:8]} at tcp://127.0.0.1:{peer.port}" in lines
        # Announced where nothing listens: the tower's probe and the peer both fail, by address and port.
        lines = []
        assert not doctor.check(replace(cfg, advertise="127.0.0.2"), 3.0, lines.append, ["x:1/2 (refused)"])
        text = "\n".join(lines)
        assert "FAIL tower x:1/2 (refused)" in text
        assert "FAIL not reachable from the tower's side: address 127.0.0.2 port" in text
        assert "connection refused" in text
        assert "FAIL not reachable from any peer: 1 peer(s) on the mesh, none connected to address 127.0.0.2" in text
    finally:
        peer.stop()


def test_a_node_expires_no_peer_while_it_hears_no_tower() -> None:
    # At 1,000 partitions a starved store read no beacon for seconds and then
    # dropped every producer at once (each drop a connection torn down and
    # made again a beacon later, which kept it busier still).
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", 1, 2),), bind="127.0.0.1", beacon_interval=0.1, beacon_timeout=0.5
    )
    node = Node(cfg)  # its loop is driven here
    try:
        now = time.monotonic()
        node.peers.on_beacon("A" * 32, "tcp://127.0.0.1:9", now - 100.0)
        node.tower_watch.on_heard(now - 100.0)  # the towers fell silent long ago
        node._expire_peers(now)
        assert "A" * 32 in node.peers  # kept: its silence proves nothing
        node.tower_watch.on_heard(time.monotonic())  # heard again; A's beacon not yet
        node._expire_peers(time.monotonic())
        assert "A" * 32 in node.peers  # a whole timeout to show up
        deadline = time.monotonic() + 5
        while "A" * 32 in node.peers and time.monotonic() < deadline:
            time.sleep(0.05)
            node.tower_watch.on_heard(time.monotonic())  # the towers keep talking; A does not
            node._expire_peers(time.monotonic())
        assert "A" * 32 not in node.peers
    finally:
        node.stop()
