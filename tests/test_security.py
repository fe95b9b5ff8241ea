"""Secure mesh (CURVE + allow-list + store-only ACKs), with real processes and sockets."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig, TowerAddress
from dafka.core import beacon as dafka_beacon
from dafka.errors import ConfigError
from dafka.nodes import security
from dafka.nodes.consumer import Consumer
from dafka.nodes.node import new_address
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from dafka.store.node import Store
from tests.conftest import ROOT, dafka_cmd, handshakes_end_in_connect, subprocess_env, wait_until
from tests.secure_rogue import Forger, RestartedOwner, SilentStore, VoidForger

ROLES = {
    "tower": "tower",
    "store": "store",
    "producer": "producer",
    "consumer": "consumer",
    "rogue": "producer",  # a valid key, but no store
    "removed": "consumer",
    "forger": "consumer",  # a valid key that writes into others' partitions
    "gateway": "gateway",
}


class Pki:
    """Keys in ``keys/``, the allowed public certificates in ``allow/`` (intruder: not allowed)."""

    def __init__(self, root: Path) -> None:
        self.keys = root / "keys"
        self.allow = root / "allow"
        self.allow.mkdir(parents=True)
        for name, role in [*ROLES.items(), ("intruder", "consumer")]:
            public, _ = security.new_keys(name, role, self.keys)
            if name != "intruder":
                shutil.copy(public, self.allow)
        self.tower_key = security.read_certificate(self.keys / "tower.key").public

    def secret(self, name: str) -> str:
        return str(self.keys / f"{name}.key_secret")

    def config(self, name: str) -> security.SecurityConfig:
        return security.SecurityConfig(self.secret(name), str(self.allow), (self.tower_key,), reload_interval=0.5)

    def flags(self, name: str, tower: Tower) -> list[str]:
        return [
            "--tower", f"127.0.0.1:{tower.in_port}:{tower.out_port}", "--bind", "127.0.0.1",
            "--key", self.secret(name), "--allow", str(self.allow), "--tower-key", str(self.keys / "tower.key"),
        ]  # fmt: skip


def curve_client(pki: Pki, sock_type: int, name: str, endpoint: str) -> zmq.Socket:
    """A CURVE client socket with ``name``'s keys, connected to the tower's ``endpoint``."""
    cert = security.read_certificate(pki.secret(name))
    sock = zmq.Context.instance().socket(sock_type)
    sock.setsockopt(zmq.LINGER, 0)
    security.make_client(sock, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
    security.connect(sock, endpoint, pki.tower_key)
    return sock


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
def secure_tower(pki: Pki) -> Any:
    with Tower("127.0.0.1", 0, 0, pki.config("tower")) as tower:
        yield tower


def node_cfg(pki: Pki, tower: Tower, name: str) -> NodeConfig:
    return NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
        beacon_timeout=2.0,
        security=pki.config(name),
    )


class Procs:
    """Subprocesses of a test, killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=subprocess_env(), **kw)
        self.procs.append(proc)
        return proc

    def store(self, pki: Pki, tower: Tower, db: Path) -> subprocess.Popen[bytes]:
        proc = self.start(
            dafka_cmd("store", "--db", str(db), *pki.flags("store", tower)),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        assert b"store up" in proc.stdout.readline()
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def procs() -> Any:
    p = Procs()
    yield p
    p.close()


def test_keys_carry_roles_and_allow_list_maps_them(pki: Pki) -> None:
    roles = security.load_allow_list(pki.allow)
    assert sorted(roles.values()) == sorted(ROLES.values())
    intruder = security.read_certificate(pki.keys / "intruder.key")
    assert intruder.role == "consumer" and intruder.public not in roles
    assert security.read_certificate(pki.secret("store")).secret is not None


def test_a_bad_certificate_does_not_freeze_the_allow_list(pki: Pki) -> None:
    (pki.allow / "junk.key").write_text("not a certificate\n")
    guard = security.Guard(str(pki.allow))
    try:
        store_key = security.read_certificate(pki.keys / "store.key").public
        assert guard.callback("*", store_key) and guard.role(store_key) == "store"
        (pki.allow / "store.key").unlink()
        assert guard.refresh()
        assert not guard.callback("*", store_key)  # what ZAP is told follows at once
    finally:
        guard.auth.stop()


def test_secure_mesh_delivers_and_store_acks(pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path) -> None:
    procs.store(pki, secure_tower, tmp_path / "db")
    with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
        with Producer("t", node_cfg(pki, secure_tower, "producer")) as producer:
            for i in range(200):
                producer.publish(b"r%d" % i)
            assert producer.flush(20)
            got: list[bytes] = []
            wait_until(lambda: got.extend(r.content for r in consumer.poll_batch(1000, 0.1)) or len(got) >= 200, 20)
            assert got == [b"r%d" % i for i in range(200)]
            assert producer.forged == 0
    # Read back from the store alone (the producer is gone): its FETCH answers come as batches.
    with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as late:
        again: list[bytes] = []
        wait_until(lambda: again.extend(r.content for r in late.poll_batch(1000, 0.1)) or len(again) >= 200, 20)
        assert again == [b"r%d" % i for i in range(200)]
        assert late.fetches_sent > 0



def test_group_positions_come_from_stores_in_secure_mode(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path
) -> None:
    # COMMITTED and POSITIONS are store-only answers: they travel on the trusted path.
    procs.store(pki, secure_tower, tmp_path / "db")
    with Producer("g", node_cfg(pki, secure_tower, "producer")) as producer:
        producer.publish_many(b"r%d" % i for i in range(30))
        assert producer.flush(20)
    cfg = node_cfg(pki, secure_tower, "consumer")
    with Consumer("g", cfg, group="billing", offset_reset="earliest") as first:
        got: list[bytes] = []
        wait_until(lambda: got.extend(r.content for r in first.poll_batch(10 - len(got), 0.1)) or len(got) >= 10, 20)
        assert got == [b"r%d" % i for i in range(10)]
        assert sum(first.commit(10).values()) == 10
        assert first.forged == 0
    with Consumer("g", cfg, group="billing", offset_reset="earliest") as second:
        rest: list[bytes] = []
        wait_until(lambda: rest.extend(r.content for r in second.poll_batch(100, 0.1)) or len(rest) >= 20, 20)
        assert rest == [b"r%d" % i for i in range(10, 30)]

def test_unknown_key_sees_nothing_and_cannot_publish_or_fetch(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = procs.store(pki, secure_tower, tmp_path / "db")
    assert store.poll() is None
    with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
        with Producer("t", node_cfg(pki, secure_tower, "producer")) as producer:
            producer.publish(b"secret")
            assert producer.flush(20)
            assert wait_until(lambda: consumer.poll(0.1), 20).content == b"secret"
            known = len(consumer.peers)  # the store and the producer
            assert known == 2
            # The intruder (a key outside the allow-list) tries to read and to publish.
            with caplog.at_level(logging.WARNING, logger="dafka.tower"):
                reader = procs.start(
                    dafka_cmd("consume", "t", "--from-beginning", "--count", "1", "--timeout", "4",
                              *pki.flags("intruder", secure_tower)),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                )  # fmt: skip
                writer = procs.start(
                    dafka_cmd("produce", "t", "--no-ack", "--wait-peers", "2", "--linger", "1",
                              *pki.flags("intruder", secure_tower)),
                    stdin=subprocess.PIPE, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                writer.communicate(b"evil\n", timeout=30)
                out, err = reader.communicate(timeout=30)
                assert reader.returncode == 1 and out == b"", err
                assert b"got 0 of 1" in err
                # Fetching straight from the store's publisher fails the handshake.
                store = next(a for a in consumer.peers._peers if consumer.peer_role(a) == "store")
                assert fetch_refused(pki, consumer.peers._peers[store][0])
                wait_until(lambda: "not in the allow-list" in caplog.text, 5)
            late = consumer.poll_batch(100, 1.0)
            assert [r.content for r in late] == []  # no "evil"
            assert len(consumer.peers) == known  # the intruder never showed up


def fetch_refused(pki: Pki, endpoint: str) -> bool:
    """A raw CURVE client with the intruder's key is refused by a node's publisher."""
    intruder = security.read_certificate(pki.secret("intruder"))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        keys = security.OwnKeys(intruder.public, intruder.secret or b"", "consumer")
        security.make_client(sub, keys)
        # The store's key is public knowledge; knowing it does not help.
        security.connect(sub, endpoint, security.read_certificate(pki.keys / "store.key").public)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if monitor.poll(200):
                event = zmq.utils.monitor.recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return False
                return True
        return False
    finally:
        monitor.close(0)
        sub.close(0)


def test_rogue_acks_from_a_producer_key_are_never_honoured(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path
) -> None:
    rogue = procs.start(
        [sys.executable, str(ROOT / "tests" / "secure_rogue.py"), pki.secret("rogue"), str(pki.allow),
         str(pki.keys / "tower.key"), str(secure_tower.in_port), str(secure_tower.out_port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert rogue.stdout is not None and b"rogue up" in rogue.stdout.readline()
    with Producer("t", node_cfg(pki, secure_tower, "producer"), head_interval=0.2) as producer:
        for i in range(10):
            producer.publish(b"r%d" % i)
        # The rogue sees our HEADs and answers with ACKs: they arrive and are counted as forged.
        wait_until(lambda: producer.forged >= 3, 15)
        assert b"acked" in rogue.stdout.readline()
        assert producer.acked_offset == -1
        assert not producer.flush(0.5)
        # The scenario: `dafka produce` with the rogue and no store must not
        # say "all acknowledged" nor exit 0.
        cli = subprocess.run(
            dafka_cmd("produce", "t", "--timeout", "3", "--wait-peers", "2", *pki.flags("producer", secure_tower)),
            input=b"precious\n", env=subprocess_env(), capture_output=True, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 1 and b"all acknowledged" not in cli.stderr, cli.stderr
        assert b"not acknowledged" in cli.stderr
        # A real store acknowledges.
        procs.store(pki, secure_tower, tmp_path / "db")
        assert producer.flush(20)
        assert producer.acked_offset == 9


def test_forged_store_hellos_and_direct_heads_are_never_acted_on(pki: Pki, secure_tower: Tower, procs: Procs) -> None:
    rogue = procs.start(
        [sys.executable, str(ROOT / "tests" / "secure_rogue.py"), pki.secret("rogue"), str(pki.allow),
         str(pki.keys / "tower.key"), str(secure_tower.in_port), str(secure_tower.out_port), "greet"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert rogue.stdout is not None and b"rogue up" in rogue.stdout.readline()
    with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
        # Believed, the DIRECT-HEAD would make the consumer FETCH offsets 0..1000 of a
        # partition nobody has, and the STORE-HELLO would make it say hello back.
        wait_until(lambda: consumer.forged >= 6, 15)
        assert consumer.fetches_sent == 0
        assert consumer.positions() == {}


def test_removed_key_is_cut_off_within_seconds(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path
) -> None:
    consumer = procs.start(
        dafka_cmd("consume", "t", "--count", "100000", "--timeout", "40", *pki.flags("removed", secure_tower)),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert consumer.stdout is not None
    with Producer("t", node_cfg(pki, secure_tower, "producer"), acks=False) as producer:
        # Publish until the consumer prints records: it is connected.
        first = None
        deadline = time.monotonic() + 20
        while first is None and time.monotonic() < deadline:
            producer.publish(b"before")
            time.sleep(0.05)
            if producer.peers and len(producer.peers) >= 1:
                first = consumer.stdout.readline() if _readable(consumer.stdout) else None
        assert first == b"before\n"
        (pki.allow / "removed.key").unlink()
        removed_at = time.monotonic()
        # Keep publishing, stamped with the time since the removal, for 8 seconds.
        while time.monotonic() - removed_at < 8:
            producer.publish(b"after %.2f" % (time.monotonic() - removed_at))
            time.sleep(0.05)
    consumer.terminate()
    out, _ = consumer.communicate(timeout=10)
    stamps = [float(line.split()[1]) for line in out.splitlines() if line.startswith(b"after")]
    # Records published from a few seconds after the removal on never reach it.
    assert not stamps or max(stamps) < 4.0, max(stamps)


def _readable(stream: Any) -> bool:
    import select

    return bool(select.select([stream], [], [], 0.05)[0])


def test_plain_node_and_secure_tower_do_not_mix_silently(
    pki: Pki, secure_tower: Tower, caplog: pytest.LogCaptureFixture
) -> None:
    plain = NodeConfig(
        towers=(TowerAddress("127.0.0.1", secure_tower.in_port, secure_tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
    )
    with caplog.at_level(logging.WARNING, logger="dafka.tower"):
        with Producer("t", plain, acks=False) as producer:
            wait_until(lambda: "refused" in caplog.text and "plain" in caplog.text, 10)
            assert len(producer.peers) == 0
    assert secure_tower.beacons == 0


def test_secure_node_and_plain_tower_do_not_mix_silently(
    pki: Pki, tower: Tower, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = node_cfg(pki, tower, "producer")
    with caplog.at_level(logging.WARNING, logger="dafka.producer"):
        with Producer("t", cfg, acks=False) as producer:
            wait_until(lambda: "refused" in caplog.text and "plain" in caplog.text, 10)
            assert len(producer.peers) == 0
    assert tower.beacons == 0


def test_services_refuse_to_expose_a_plain_mesh(tmp_path: Path) -> None:
    for args in (
        ["tower", "--bind", "0.0.0.0", "--in-port", "0", "--out-port", "0"],
        ["store", "--db", str(tmp_path / "s"), "--bind", "*"],
        ["gateway", "--db", str(tmp_path / "g"), "--listen", "0.0.0.0:0"],
    ):
        proc = subprocess.run(dafka_cmd(*args), env=subprocess_env(), capture_output=True, timeout=30)
        assert proc.returncode == 2, args
        assert b"--insecure" in proc.stderr


def test_secure_example_configs_load(tmp_path: Path) -> None:
    from dafka.config import load_settings

    base = tmp_path / "etc"
    for name, role in (("tower", "tower"), ("store1", "store"), ("gateway1", "gateway"), ("app1", "producer")):
        security.new_keys(name, role, base / "keys")
    (base / "allow").mkdir()
    for public in (base / "keys").glob("*.key"):
        shutil.copy(public, base / "allow")
    for example in sorted((ROOT / "towers" / "secure").glob("*.toml")):
        conf = tmp_path / example.name
        conf.write_text(example.read_text().replace("/etc/dafka", str(base)))
        sec = load_settings(conf).node.security
        assert sec is not None, example
        assert security.own_keys(sec).role == security.read_certificate(sec.key).role
        if example.name != "tower.toml":
            assert sec.tower_key(0) == security.read_certificate(base / "keys" / "tower.key").public


def tank_greeting(port: int) -> bytes:
    """What a Tank port says to a new client in its first 100 bytes (b"" if it hangs up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            return s.recv(100)
        except ConnectionResetError:
            return b""


def test_gateway_accepts_only_listed_client_networks(tmp_path: Path, cfg: NodeConfig) -> None:
    import ipaddress

    from dafka.tank.gateway import Gateway

    only_ten = [ipaddress.ip_network("10.0.0.0/8")]
    with Gateway(str(tmp_path / "g"), cfg, listen=("127.0.0.1", 0), allow_clients=only_ten) as gateway:
        assert tank_greeting(gateway.tank_port) == b""  # closed on accept
        assert gateway.clients_refused == 1
    loopback = [ipaddress.ip_network("127.0.0.0/8")]
    with Gateway(str(tmp_path / "g"), cfg, listen=("127.0.0.1", 0), allow_clients=loopback) as gateway:
        assert tank_greeting(gateway.tank_port) != b""  # the Tank ping
        assert gateway.clients_refused == 0


def test_added_key_joins_without_restart(pki: Pki, secure_tower: Tower) -> None:
    with Producer("t", node_cfg(pki, secure_tower, "producer"), acks=False) as producer:
        with Consumer("t", node_cfg(pki, secure_tower, "intruder")) as newcomer:
            time.sleep(1.0)  # the negative half: not allowed yet, nothing may happen
            assert len(newcomer.peers) == 0 and len(producer.peers) == 0
            shutil.copy(pki.keys / "intruder.key", pki.allow)
            wait_until(lambda: len(newcomer.peers) == 1 and len(producer.peers) == 1, 10)
            got = wait_until(lambda: producer.publish(b"welcome") and newcomer.poll(0.2), 10)
            assert got.content == b"welcome"


def test_a_refusal_before_the_node_has_started_is_retried(
    pki: Pki, secure_tower: Tower, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in test_why.py for a plain node: the tower refuses the handshake before the
    # node's constructor has gone on from connect() (on a loaded machine).  ZeroMQ
    # gives a refused connection up for good, so a refusal the node's monitor did not
    # see was never retried: the node never joined, even once its key was allowed.
    refusals_in, refusals_out = secure_tower._refusals
    handshakes_end_in_connect(
        monkeypatch,
        {secure_tower.in_port: lambda: refusals_in.count, secure_tower.out_port: lambda: refusals_out.count},
    )
    with (
        caplog.at_level(logging.WARNING, logger="dafka.consumer"),
        Consumer("t", node_cfg(pki, secure_tower, "intruder")) as newcomer,
    ):
        said = [
            f"handshake on tcp://127.0.0.1:{port} refused: our key is not in its allow-list"
            for port in (secure_tower.in_port, secure_tower.out_port)
        ]
        wait_until(lambda: all(s in caplog.text for s in said), 10)
        shutil.copy(pki.keys / "intruder.key", pki.allow)
        wait_until(lambda: newcomer.tower_watch.reached, 10)


def test_status_probe_joins_once_its_key_is_added(pki: Pki, secure_tower: Tower) -> None:
    # ZeroMQ gives a refused handshake up for good: a watching status probe
    # connects again, so adding its key lets it in without a restart.
    from dafka.cli.status import StatusProbe

    with Producer("t", node_cfg(pki, secure_tower, "producer"), acks=False) as producer:
        with StatusProbe(node_cfg(pki, secure_tower, "intruder")) as probe:
            snap = probe.run(1.5)  # the negative half: not allowed yet
            assert snap["nodes"] == [] and not any(t["reached"] for t in snap["towers"])
            assert probe.refused
            shutil.copy(pki.keys / "intruder.key", pki.allow)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                snap = probe.run(0.5)
                if any(n["address"] == producer.address for n in snap["nodes"]):
                    break
            assert all(t["reached"] for t in snap["towers"])
            assert producer.address in [n["address"] for n in snap["nodes"]]


def test_tower_relays_a_beacon_only_with_the_key_it_came_with(pki: Pki, secure_tower: Tower) -> None:
    from dafka.core import wire

    t = TowerAddress("127.0.0.1", secure_tower.in_port, secure_tower.out_port)
    listener = curve_client(pki, zmq.SUB, "consumer", t.beacon_out)
    listener.setsockopt(zmq.SUBSCRIBE, wire.BEACON)
    rogue = curve_client(pki, zmq.PUB, "rogue", t.beacon_in)
    store_key = security.read_certificate(pki.keys / "store.key").public
    rogue_key = security.read_certificate(pki.keys / "rogue.key").public
    lie, truth = security.bound_address(store_key), security.bound_address(rogue_key)
    seen: set[bytes] = set()
    try:
        deadline = time.monotonic() + 10
        while truth.encode() not in seen and time.monotonic() < deadline:
            # Posing as the store (its key in the beacon), and then honestly.
            rogue.send_multipart(security.secure_node_beacon(wire.node_beacon(lie, "", 4000), store_key))
            rogue.send_multipart(security.secure_node_beacon(wire.node_beacon(truth, "", 4001), rogue_key))
            while listener.poll(100):
                frames = listener.recv_multipart()
                assert len(frames) == 4 and frames[3] == (rogue_key if frames[1] == truth.encode() else b"?")
                seen.add(frames[1])
        assert truth.encode() in seen and lie.encode() not in seen
        assert secure_tower.bad_input.count > 0
    finally:
        listener.close(0)
        rogue.close(0)


def test_a_secure_tower_batches_a_burst_with_each_beacons_key_and_a_store_meets_every_peer(
    pki: Pki, secure_tower: Tower, tmp_path: Path
) -> None:
    # 200 producers of one topic beacon at once, each address bound to the producer
    # key: the tower relays them in a few batches, each entry with its key (stride 3).
    n = 200

    head = dafka_beacon.Interest.producer("burst").heads()[0]
    key = security.read_certificate(pki.keys / "producer.key").public
    t = TowerAddress("127.0.0.1", secure_tower.in_port, secure_tower.out_port)
    listener = curve_client(pki, zmq.SUB, "consumer", t.beacon_out)
    listener.setsockopt(zmq.SUBSCRIBE, head)
    pub = curve_client(pki, zmq.PUB, "producer", t.beacon_in)
    addresses = [security.bound_address(key) for _ in range(n)]
    # The producers' endpoint: a CURVE server with the producer key (a store drops peers
    # it cannot reach after a few failures, see PeerLimits).
    cert = security.read_certificate(pki.secret("producer"))
    server = zmq.Context.instance().socket(zmq.PUB)
    server.setsockopt(zmq.LINGER, 0)
    security.make_server(server, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
    port = str(server.bind_to_random_port("tcp://127.0.0.1")).encode()

    def heard(seconds: float) -> list[list[bytes]]:
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            if listener.poll(50):
                out.append(listener.recv_multipart())
        return out

    try:
        with Store(str(tmp_path / "db"), node_cfg(pki, secure_tower, "store")) as store:
            probe = security.bound_address(key)

            def relayed() -> bool:  # the CURVE connections and subscriptions are up
                pub.send_multipart([head, probe.encode(), b"127.0.0.1", port, key])
                return bool(heard(0.1)) and probe in store.peers._peers

            wait_until(relayed, 15)
            while listener.poll(0):
                listener.recv_multipart()
            for address in addresses:
                pub.send_multipart([head, address.encode(), b"127.0.0.1", port, key])
            messages: list[list[bytes]] = []
            got: set[bytes] = set()
            deadline = time.monotonic() + 10
            while not {a.encode() for a in addresses} <= got and time.monotonic() < deadline:
                messages += heard(0.1)
                got = {f for m in messages for f in m[1::3]}
            assert {a.encode() for a in addresses} <= got
            assert all(m[0] == head and len(m) % 3 == 1 and set(m[3::3]) == {key} for m in messages)
            assert len(messages) < n / 4  # batched
            assert max(len(m) for m in messages) <= 1 + 3 * dafka_beacon.RELAY_BATCH
            # The store decodes every entry of the batches, key and all, as its own peer.
            wait_until(lambda: set(addresses) <= set(store.peers._peers), 10)
            assert secure_tower.bad_input.count == 0
    finally:
        listener.close(0)
        pub.close(0)
        server.close(0)


def test_keys_command_and_up_stays_plain(tmp_path: Path) -> None:
    env = subprocess_env()
    run = subprocess.run(dafka_cmd("keys", "new", "s1", "--role", "store", "--dir", str(tmp_path)), env=env, timeout=30)
    assert run.returncode == 0
    out = subprocess.run(dafka_cmd("keys", "list", "--dir", str(tmp_path)), env=env, capture_output=True, timeout=30)
    lines = out.stdout.decode().splitlines()
    assert any(line.split()[:3] == ["s1", "store", "public"] for line in lines)
    assert any(line.split()[:3] == ["s1", "store", "secret"] for line in lines)
    again = subprocess.run(
        dafka_cmd("keys", "new", "s1", "--role", "store", "--dir", str(tmp_path)), env=env, capture_output=True, timeout=30
    )
    assert again.returncode == 2 and b"already exists" in again.stderr
    conf = tmp_path / "c.toml"
    conf.write_text(f'[security]\nkey = "{tmp_path}/s1.key_secret"\nallow = "{tmp_path}"\n')
    up = subprocess.run(dafka_cmd("--config", str(conf), "up", "--data", str(tmp_path / "var")), env=env, capture_output=True, timeout=30)
    assert up.returncode == 2 and b"makes its own keys" in up.stderr and b"dafka up --secure" in up.stderr


def test_status_shows_a_secure_mesh_only_with_an_allowed_key(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path
) -> None:
    import json

    store = procs.store(pki, secure_tower, tmp_path / "db")
    with Producer("t", node_cfg(pki, secure_tower, "producer")) as producer:
        producer.publish_many(b"r%d" % i for i in range(5))
        assert producer.flush(20)
        status = subprocess.run(
            dafka_cmd("status", "--json", "--wait", "4", *pki.flags("consumer", secure_tower)),
            env=subprocess_env(), capture_output=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        snap = json.loads(status.stdout)
        kinds = {n["address"]: n["kind"] for n in snap["nodes"]}
        assert kinds[producer.address] == "producer"
        assert sorted(kinds.values()) == ["producer", "store"]
        (part,) = snap["partitions"]
        assert part["partition"] == producer.address and part["producer_head"] == 4
        assert [s["head"] for s in part["stores"]] == [4]
        assert store.poll() is None
        # A key outside the allow-list (or no key: plain mode) sees nothing, and is told why.
        for flags in (pki.flags("intruder", secure_tower), pki.flags("consumer", secure_tower)[:4]):
            refused = subprocess.run(
                dafka_cmd("status", "--json", "--wait", "2", *flags),
                env=subprocess_env(), capture_output=True, timeout=60,
            )  # fmt: skip
            assert refused.returncode == 1, refused.stderr
            assert json.loads(refused.stdout)["nodes"] == []
            assert b"no tower answered" in refused.stderr
            if "--key" in flags:
                assert b"refused: our key is not in its allow-list" in refused.stderr, refused.stderr



def test_gateway_command_listens_beyond_loopback_only_for_listed_client_networks(
    tmp_path: Path, cfg: NodeConfig, procs: Procs
) -> None:
    import re

    from tests.conftest import tower_flag

    def start(before: list[str], after: list[str]) -> int:
        db = str(tmp_path / f"g{len(procs.procs)}")
        proc = procs.start(
            dafka_cmd(*before, "gateway", "--db", db, "--listen", "0.0.0.0:0", "--tower", tower_flag(cfg), *after),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(rb"Tank on 0\.0\.0\.0:(\d+)", line)
        assert found, line
        return int(found.group(1))

    # Checked on each accept: a loopback client is not in 10.0.0.0/8 ...
    assert tank_greeting(start([], ["--allow-clients", "10.0.0.0/8"])) == b""
    # ... but in 127.0.0.0/8, here from the config file's [gateway] allow_clients.
    conf = tmp_path / "gw.toml"
    conf.write_text('[gateway]\nallow_clients = "10.0.0.0/8,127.0.0.0/8"\n')
    assert tank_greeting(start(["--config", str(conf)], [])) != b""  # the Tank ping


def test_secure_producer_paces_a_burst_instead_of_dropping_it(pki: Pki, secure_tower: Tower) -> None:
    # Small queues: a plain PUB would drop most of this burst (fetched later); a
    # secure producer waits for room while CURVE encrypts, so nothing is fetched.
    small = replace(node_cfg(pki, secure_tower, "consumer"), hwm=100)
    n = 20_000
    with Consumer("t", small, offset_reset="earliest") as consumer:
        prod_cfg = replace(node_cfg(pki, secure_tower, "producer"), hwm=100)
        with Producer("t", prod_cfg, acks=False, capacity=n + 100, head_interval=60.0) as producer:
            wait_until(lambda: producer.publish(b"start") and consumer.poll(0.2), 10)
            base, fetches = producer.next_offset, consumer.fetches_sent
            producer.publish_many(b"%06d" % i for i in range(n))
            got: list[bytes] = []
            deadline = time.monotonic() + 30
            while len(got) < n and time.monotonic() < deadline:
                got.extend(r.content for r in consumer.poll_batch(n, 0.2) if r.offset >= base)
            assert got == [b"%06d" % i for i in range(n)]
            assert consumer.fetches_sent == fetches


def test_a_secure_producer_sends_records_in_batches(pki: Pki, secure_tower: Tower) -> None:
    # CURVE encrypts per frame: on a secure mesh a burst goes out as a few
    # batch messages (RECORD version 2), which consumers take as records.
    from dafka.core import wire

    cert = security.read_certificate(pki.secret("consumer"))
    listener = zmq.Context.instance().socket(zmq.SUB)
    listener.setsockopt(zmq.LINGER, 0)
    security.make_client(listener, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
    listener.setsockopt(zmq.SUBSCRIBE, b"Mt")
    n = 1000
    try:
        with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
            with Producer("t", node_cfg(pki, secure_tower, "producer"), acks=False) as producer:
                assert producer.batches
                security.connect(listener, f"tcp://127.0.0.1:{producer.port}", security.read_certificate(pki.keys / "producer.key").public)
                wait_until(lambda: producer.publish(b"start") and consumer.poll(0.2) and listener.poll(50), 10)
                while listener.poll(200):
                    listener.recv_multipart()
                base = producer.next_offset
                producer.publish_many(b"r%d" % i for i in range(n))
                batches = []
                deadline = time.monotonic() + 20
                while sum(len(b.contents) for b in batches) < n and time.monotonic() < deadline:
                    if listener.poll(200):
                        batches.append(wire.decode(listener.recv_multipart()))
                assert all(isinstance(b, wire.RecordBatch) for b in batches)
                assert [c for b in batches for c in b.contents] == [b"r%d" % i for i in range(n)]
                assert batches[0].sequence == base and len(batches) <= n // 100
                got: list = []
                while len(got) < n and time.monotonic() < deadline:
                    got += [r for r in consumer.poll_batch(n, 0.2) if r.offset >= base]
                assert [(r.offset, r.content) for r in got] == [(base + i, b"r%d" % i) for i in range(n)]
    finally:
        listener.close(0)


def test_a_stuck_subscriber_does_not_stall_a_secure_producer(pki: Pki, secure_tower: Tower) -> None:
    # A subscriber that never reads: after waiting PACE_LIMIT the producer drops
    # for it (as plain does), and the other consumer gets everything (fetching).
    cert = security.read_certificate(pki.secret("removed"))  # an allowed consumer key
    stuck = zmq.Context.instance().socket(zmq.SUB)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.setsockopt(zmq.RCVHWM, 10)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    security.make_client(stuck, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    n, payload = 3000, b"x" * 10_000  # 30 MB: more than the socket buffers hold
    try:
        with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
            cfg = replace(node_cfg(pki, secure_tower, "producer"), hwm=10)
            with Producer("t", cfg, acks=False, capacity=n + 100) as producer:
                wait_until(lambda: producer.publish(b"start") and consumer.poll(0.2), 10)
                base = producer.next_offset
                security.connect(stuck, f"tcp://127.0.0.1:{producer.port}", security.read_certificate(pki.keys / "producer.key").public)
                wait_until(lambda: stuck.poll(50), 10)  # connected and subscribed: it holds data now
                started = time.monotonic()
                producer.publish_many(repeat(payload, n))
                assert time.monotonic() - started < 5.0  # pace_limit 1 s, then no waiting for 2 s
                got = 0
                deadline = time.monotonic() + 60
                while got < n and time.monotonic() < deadline:
                    got += sum(r.offset >= base for r in consumer.poll_batch(n, 0.2))
                assert got == n
    finally:
        stuck.close(0)


# ---------------------------------------------------------------- partition ownership


def read_from_start(cfg: NodeConfig, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
    """What a consumer from the earliest offsets gets (n records, plus anything extra soon after)."""
    with Consumer(topic, cfg, offset_reset="earliest") as consumer:
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += consumer.poll_batch(1000, 0.1)
        got += consumer.poll_batch(100, 0.3)
    return got


def test_addresses_are_bound_to_keys(pki: Pki) -> None:
    producer, other = (security.read_certificate(f).public for f in (pki.keys / "producer.key", pki.keys / "rogue.key"))
    address = security.bound_address(producer)
    assert len(address) == 32 and address == address.upper() and int(address, 16) >= 0
    assert security.address_bound(address, producer)
    assert not security.address_bound(address, other)
    assert security.bound_address(producer) != address  # one key, many addresses (a nonce each)
    assert not security.address_bound(new_address(), producer)
    assert not security.address_bound(address[:-1] + "\u00e9", producer)  # no exception on odd text
    assert not security.address_bound("", producer)


def test_a_consumer_key_cannot_write_into_a_producers_partition(
    pki: Pki, secure_tower: Tower, tmp_path: Path
) -> None:
    # The attack: a consumer-role key watches HEADs and publishes RECORDs (and a
    # HEAD, and FETCH answers) at the producer's next offsets.
    with Store(tmp_path / "db", node_cfg(pki, secure_tower, "store")) as store:
        with Forger(node_cfg(pki, secure_tower, "forger")) as forger:
            with Producer("t", node_cfg(pki, secure_tower, "producer"), head_interval=0.2) as producer:
                wait_until(lambda: producer.address in forger.known and len(store.peers) == 2, 15)
                producer.publish_many(b"real%d" % i for i in range(5))
                assert producer.flush(20)
                key = ("t", producer.address)
                wait_until(lambda: forger.forged_sent >= 5, 15)
                # Either the store refused them, or (before partitions were bound to keys) took them.
                wait_until(lambda: getattr(store, "not_owner", 0) > 0 or store.heads().get(key, -1) >= 9, 15)
                producer.publish_many(b"real%d" % i for i in range(5, 10))
                assert producer.flush(20)
                assert store.heads()[key] == 9
                # Nothing the forger sent was taken into the fast path of its channel.
                channels = getattr(store, "_channels", {})  # (none before the binding)
                assert not channels or [c.prefixes for c in channels.values() if c.address == forger.address] == [{}]
        got = read_from_start(node_cfg(pki, secure_tower, "consumer"), "t", 10)
        assert [(r.offset, r.content) for r in got] == [(i, b"real%d" % i) for i in range(10)]
        assert store.not_owner > 0


def test_direct_records_only_from_the_owner_or_a_store(pki: Pki, secure_tower: Tower) -> None:
    # Forged FETCH answers and unsolicited DIRECT-RECORDs at a consumer's next offsets.
    prod_cfg = node_cfg(pki, secure_tower, "producer")
    with Producer("t", prod_cfg, acks=False, head_interval=0.2) as producer:
        with Consumer("t", node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
            with Forger(node_cfg(pki, secure_tower, "forger"), records=False) as forger:
                wait_until(lambda: consumer.address in forger.known and forger.address in consumer.peers, 15)
                wait_until(lambda: producer.address in consumer.peers, 15)
                producer.publish_many(b"real%d" % i for i in range(5))
                got: list[Any] = []
                wait_until(lambda: got.extend(consumer.poll_batch(100, 0.1)) or len(got) >= 5, 15)
                wait_until(lambda: forger.forged_sent >= 5, 15)
                # Either the consumer refused them, or (before the binding) delivered them.
                wait_until(lambda: getattr(consumer, "not_owner", 0) > 0 or got.extend(consumer.poll_batch(100, 0.1)) or len(got) > 5, 15)
                producer.publish_many(b"real%d" % i for i in range(5, 10))
                wait_until(lambda: got.extend(consumer.poll_batch(100, 0.1)) or len(got) >= 10, 15)
                got += consumer.poll_batch(100, 0.3)
                assert [(r.offset, r.content) for r in got] == [(i, b"real%d" % i) for i in range(10)]
                assert consumer.not_owner > 0
                # A newcomer fetches 0..9 from the producer's ring (the owner's DIRECT-RECORDs);
                # the forger answers its FETCHes too, in vain.
                late = read_from_start(node_cfg(pki, secure_tower, "consumer"), "t", 10)
                assert [(r.offset, r.content) for r in late] == [(i, b"real%d" % i) for i in range(10)]


def test_a_key_cannot_squat_a_producers_identity(pki: Pki, secure_tower: Tower, tmp_path: Path) -> None:
    import threading

    from dafka.core import wire

    identity = tmp_path / "id.json"
    cfg = node_cfg(pki, secure_tower, "producer")
    with Store(tmp_path / "db", node_cfg(pki, secure_tower, "store")):
        with Producer("t", cfg, identity=identity) as first:
            address = first.address
            first.publish_many(b"r%d" % i for i in range(3))
            assert first.flush(20)
        # A consumer-role key beacons the producer's address, as a live twin would.
        cert = security.read_certificate(pki.secret("forger"))
        squatter = zmq.Context.instance().socket(zmq.PUB)
        squatter.setsockopt(zmq.LINGER, 0)
        security.make_client(squatter, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
        security.connect(squatter, f"tcp://127.0.0.1:{secure_tower.in_port}", pki.tower_key)
        # As a producer of "t" says it (an interest beacon: what dafka towers and nodes read).
        plain = wire.node_beacon(address, "", 4000)
        beacon = security.secure_node_beacon([dafka_beacon.Interest.producer("t").heads()[0], *plain[1:]], cert.public)
        stop = threading.Event()

        def pump() -> None:
            deadline = time.monotonic() + 30
            while not stop.is_set() and time.monotonic() < deadline:
                squatter.send_multipart(beacon)
                stop.wait(0.05)

        pumping = threading.Thread(target=pump, daemon=True)
        pumping.start()
        try:
            wait_until(lambda: secure_tower.bad_input.count > 0 or secure_tower.beacons > 0, 10)
            with Producer("t", cfg, identity=identity, resume_timeout=5.0) as again:
                assert again.address == address
                assert again.publish(b"r3").offset == 3
                assert again.flush(20)
                assert again.duplicates_seen == 0
        finally:
            stop.set()
            pumping.join(5)
            squatter.close(0)
    assert secure_tower.bad_input.count > 0


def test_an_identity_not_bound_to_the_key_is_refused_clearly(pki: Pki, secure_tower: Tower, tmp_path: Path) -> None:
    # An identity file from a plain mesh (or from before addresses were bound to keys).
    import json

    identity = tmp_path / "old.json"
    identity.write_text(json.dumps({"address": new_address(), "topic": "t", "acked": 4, "next": 5}))
    with pytest.raises(ConfigError, match=r"identity file .*old.json: address .* is not bound to this node.s key"):
        Producer("t", node_cfg(pki, secure_tower, "producer"), identity=identity)


def test_stores_replicate_and_gateways_publish_their_own_partitions_securely(
    pki: Pki, secure_tower: Tower, tmp_path: Path
) -> None:
    from dafka.tank.client import TankClient
    from dafka.tank.gateway import Gateway

    with Store(tmp_path / "a", node_cfg(pki, secure_tower, "store")) as first:
        with Producer("t", node_cfg(pki, secure_tower, "producer")) as producer:
            producer.publish_many(b"r%d" % i for i in range(20))
            assert producer.flush(20)
            partition = producer.address
        # A second store, started after the producer left, gets the partition from the first
        # (a store's HEADs and DIRECT-RECORDs of a partition it does not own are believed).
        with Store(tmp_path / "b", node_cfg(pki, secure_tower, "store")) as second:
            wait_until(lambda: second.heads().get(("t", partition)) == 19, 20)
            assert getattr(second, "not_owner", 0) == 0
        # A gateway's own partition (its address is not bound to its key) is read on the mesh.
        gw_cfg = node_cfg(pki, secure_tower, "gateway")
        with Gateway(str(tmp_path / "gw"), gw_cfg, listen=("127.0.0.1", 0)) as gw:
            with TankClient("127.0.0.1", gw.tank_port) as client:
                client.create_topic("tank", 1)
                assert client.produce("tank", 0, [(None, b"v%d" % i, 0) for i in range(5)]) == 0
            got = read_from_start(node_cfg(pki, secure_tower, "consumer"), "tank", 5)
            assert [r.content for r in got] == [b"v%d" % i for i in range(5)]
            wait_until(lambda: any(t == "tank" for t, _ in first.heads()), 20)
            assert getattr(first, "not_owner", 0) == 0


def test_nodes_drop_unbound_beacons_even_from_a_tower_that_relays_them(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tower of an older version relays beacons whatever their address: the nodes check too.
    import dafka.nodes.tower
    from dafka.core import wire

    monkeypatch.setattr(dafka.nodes.tower, "check_bound", lambda address, key: None, raising=False)
    with Tower("127.0.0.1", 0, 0, pki.config("tower")) as lenient:
        cfg = node_cfg(pki, lenient, "producer")
        with Producer("t", cfg, acks=False) as producer:
            wait_until(lambda: producer.tower_watch.reached, 10)
            cert = security.read_certificate(pki.secret("forger"))
            squatter = zmq.Context.instance().socket(zmq.PUB)
            squatter.setsockopt(zmq.LINGER, 0)
            security.make_client(squatter, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
            security.connect(squatter, f"tcp://127.0.0.1:{lenient.in_port}", pki.tower_key)
            try:
                # Interest beacons of a consumer of "t": the ones the producer subscribes.
                head = dafka_beacon.Interest.consumer(["t"]).heads()[0]
                beacon = security.secure_node_beacon(
                    [head, *wire.node_beacon(producer.address, "", 4000)[1:]], cert.public
                )
                stranger = security.secure_node_beacon([head, *wire.node_beacon(new_address(), "", 4001)[1:]], cert.public)
                before = producer.bad_input.count
                deadline = time.monotonic() + 10
                while producer.bad_input.count < before + 4 and time.monotonic() < deadline:
                    squatter.send_multipart(beacon)
                    squatter.send_multipart(stranger)
                    time.sleep(0.05)
                assert lenient.beacons > 0  # relayed...
                assert producer.bad_input.count >= before + 4  # ...and dropped by the producer
                assert producer.duplicates_seen == 0 and len(producer.peers) == 0
            finally:
                squatter.close(0)


def test_a_paused_secure_consumer_resumes_every_channel(pki: Pki, secure_tower: Tower) -> None:
    # Each peer is read on a channel of its own: pausing (a full queue) and resuming
    # must take up every channel again, with nothing lost or reordered.
    n = 5000
    cfg = node_cfg(pki, secure_tower, "consumer")
    with Consumer("t", cfg, offset_reset="earliest", max_queued=300) as consumer:
        prod_cfg = node_cfg(pki, secure_tower, "producer")
        with Producer("t", prod_cfg, acks=False, capacity=n + 10) as a, Producer("t", prod_cfg, acks=False, capacity=n + 10) as b:
            wait_until(lambda: a.address in consumer.peers and b.address in consumer.peers, 15)
            for p in (a, b):
                p.publish_many(b"%s-%d" % (p.address[:4].encode(), i) for i in range(n))
            got: dict[str, list[bytes]] = {a.address: [], b.address: []}
            paused = False
            deadline = time.monotonic() + 60
            while sum(map(len, got.values())) < 2 * n and time.monotonic() < deadline:
                paused = paused or consumer.data_paused
                for r in consumer.poll_batch(100, 0.2):
                    got[r.partition].append(r.content)
                time.sleep(0.002)  # a slow application
            for p in (a, b):
                assert got[p.address] == [b"%s-%d" % (p.address[:4].encode(), i) for i in range(n)]
            assert paused


def test_a_channel_whose_input_was_seen_elsewhere_is_still_read(pki: Pki, secure_tower: Tower) -> None:
    # A channel's ZMQ_FD fires once per change of state: whoever asks ZMQ_EVENTS
    # (as data_waiting does, for a store's linger or its GET-HEADS answers) takes
    # that wake-up.  Its input must still be read: the selector never fires again.
    import select

    from dafka.nodes.node import Node

    class Recorder(Node):
        kind = "consumer"

        def on_data(self, frames: list[bytes]) -> None:
            got.append(frames)

    got: list[list[bytes]] = []
    node = Recorder(node_cfg(pki, secure_tower, "consumer"))  # its loop is driven here
    peer_ctx = zmq.Context()
    peer = peer_ctx.socket(zmq.XPUB)  # a CURVE server with a producer's key (no ZAP here)
    peer.setsockopt(zmq.LINGER, 0)
    cert = security.read_certificate(pki.secret("producer"))
    security.make_server(peer, security.OwnKeys(cert.public, cert.secret or b"", cert.role))
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    address = security.bound_address(cert.public)

    def turn() -> None:
        """One turn of the node's loop, as far as channels go."""
        assert node._channel_selector is not None
        if node._channel_selector.select(0):
            node._read_channels()
        if node._busy:
            node._read_busy()

    try:
        node.subscribe(b"Z")
        node._peer_keys[address] = cert.public
        node._open_channel(address, f"tcp://127.0.0.1:{port}")
        channel = node._channels[address]
        deadline = time.monotonic() + 10
        while not peer.poll(10) and time.monotonic() < deadline:
            turn()  # the handshake, then the subscription goes out
        assert peer.recv() == b"\x01Z"
        for _ in range(5):
            turn()
        assert not node._busy  # read, and idle
        peer.send(b"Z1")
        assert select.select([channel.sock.get(zmq.FD)], [], [], 5)[0]  # its wake-up is pending
        assert node.data_waiting()  # ...and taken by a check made elsewhere
        deadline = time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            turn()
            time.sleep(0.01)
        assert got == [[b"Z1"]]
        peer.send(b"Z2")
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            turn()
            time.sleep(0.01)
        assert got == [[b"Z1"], [b"Z2"]]
    finally:
        node.stop()
        peer.close(0)
        peer_ctx.term()


def test_console_sees_a_secure_mesh_and_its_group_lag(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path
) -> None:
    # The console is a status probe: with a consumer key it sees the group's positions (POSITIONS
    # are store-only answers, honoured from the store key only) and the lag.
    import json
    import urllib.request

    from dafka.console.server import Console

    procs.store(pki, secure_tower, tmp_path / "db")
    with Producer("sec", node_cfg(pki, secure_tower, "producer")) as producer:
        producer.publish_many(b"r%d" % i for i in range(50))
        assert producer.flush(20)
        with Consumer("sec", node_cfg(pki, secure_tower, "consumer"), group="billing", offset_reset="earliest") as member:
            got: list[bytes] = []
            wait_until(lambda: got.extend(r.content for r in member.poll_batch(20 - len(got), 0.1)) or len(got) >= 20, 20)
            assert member.commit(10) == {("sec", producer.address): 20}
            with Console(node_cfg(pki, secure_tower, "consumer"), interval=0.2) as console:

                def lag() -> Any:
                    with urllib.request.urlopen(console.url + "api/state", timeout=10) as resp:
                        state = json.loads(resp.read())
                    groups = [g for g in state["groups"] if g["group"] == "billing"]
                    return groups and groups[0]["lag"] == 30 and state

                state = wait_until(lag, timeout=20)
                assert len(state["nodes"]["store"]) == 1 and not any("forged" in a for a in state["alerts"])
                # Records over the secure mesh: FETCHed from the store, its DIRECT-RECORDs honoured.
                q = f"api/records?topic=sec&partition={producer.address}&limit=3"
                with urllib.request.urlopen(console.url + q, timeout=15) as resp:
                    page = json.loads(resp.read())
                assert [r["content"]["text"] for r in page["records"]] == ["r47", "r48", "r49"], page
                assert page["source"] == "mesh" and not page["timed_out"]


def test_console_with_a_key_not_allowed_says_its_handshake_was_refused(pki: Pki, secure_tower: Tower) -> None:
    import json
    import urllib.request

    from dafka.console.server import Console

    with Console(node_cfg(pki, secure_tower, "intruder"), interval=0.2) as console:

        def refused() -> Any:
            with urllib.request.urlopen(console.url + "api/state", timeout=10) as resp:
                alerts = json.loads(resp.read())["alerts"]
            return [a for a in alerts if "refused our handshake" in a]

        lines = wait_until(refused, timeout=20)  # the tower's two ports: beacons in and out
        assert all(f":{secure_tower.out_port} " in line or f":{secure_tower.in_port} " in line for line in lines), lines


@pytest.mark.parametrize("forger_key", ["forger", "store"])
def test_voids_are_believed_only_from_the_partitions_key_or_a_stores(
    pki: Pki, secure_tower: Tower, tmp_path: Path, forger_key: str
) -> None:
    # Issue 34: a store passes a restarted producer's hole at once when the
    # producer says it is one (VOID kind 1) and every store it knows said it
    # holds none of it (VOID kind 0).  A key that does not own the partition
    # must not say the first; only a store's key the second, and only in its
    # own name (with a store key too: one store does not answer for another).
    with Store(tmp_path / "db", node_cfg(pki, secure_tower, "store"), skip_after=30.0, retry_interval=0.1) as store:
        with SilentStore(node_cfg(pki, secure_tower, "gateway")) as other:  # a storing key that holds nothing
            with VoidForger(node_cfg(pki, secure_tower, forger_key), claim=other.address) as forger:
                with RestartedOwner(node_cfg(pki, secure_tower, "producer"), "t", (1, 9)) as owner:
                    everyone = {other.address, forger.address, owner.address}
                    wait_until(lambda: everyone <= {address for address, _ in store.peers.items()}, 15)
                    wait_until(lambda: list(store.known_stores()) == [other.address], 15)
                    key = ("t", owner.address)
                    # (again until it comes: the store's channel may not have subscribed yet)
                    wait_until(lambda: owner.publish(0) or store.heads().get(key) == 0, 15)
                    owner.publish(10)  # 1..9: the restart hole

                    def forger_answered(times: int) -> None:
                        """The forger answered ``times`` more FETCHes, and the store asked again since."""
                        sent = forger.forged_sent
                        wait_until(lambda: forger.forged_sent >= sent + times or store.skipped, 15)
                        asked = store.fetches_sent
                        wait_until(lambda: store.fetches_sent >= asked + 2 or store.skipped, 15)

                    # 1. The other store says it holds none; only the forger says the producer restarted.
                    other.answers = True
                    forger_answered(2)
                    assert store.heads()[key] == 0 and store.skipped == 0 and store.forged > 0
                    # 2. The producer says so; the other store is silent, the forger answers in its name.
                    other.answers = False
                    asked = store.fetches_sent  # (its answers to FETCHes before this come first)
                    wait_until(lambda: store.fetches_sent >= asked + 2 or store.skipped, 15)
                    owner.says_void = True
                    forged = store.forged
                    forger_answered(2)
                    assert store.heads()[key] == 0 and store.skipped == 0 and store.forged > forged
                    # 3. The other store itself says it holds none: passed at once.
                    other.answers = True
                    t0 = time.monotonic()
                    wait_until(lambda: store.heads().get(key) == 10, 15)
                    took = time.monotonic() - t0
        assert store.skipped == 9 and [r.offset for r in store.db.read("t", owner.address, 0, 100)] == [0, 10]
        assert took < 3.0, f"passed {took:.1f}s after every store said it holds none"


# A secure producer with an identity file: publishes 50 records at a time and
# prints each chunk's acknowledged offset, until killed.
SECURE_PRODUCER = """
import sys
from dafka.config import NodeConfig, TowerAddress
from dafka.nodes import security
from dafka.nodes.producer import Producer

key, allow, tower_key, pin, pout, identity = sys.argv[1:7]
sec = security.SecurityConfig(key, allow, (security.parse_key(tower_key),))
cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", int(pin), int(pout)),), bind="127.0.0.1",
                 beacon_interval=0.2, beacon_timeout=2.0, security=sec)
producer = Producer("t", cfg, identity=identity, resume_timeout=10.0)
print("ready", producer.next_offset, flush=True)
while True:
    first = producer.next_offset
    receipt = producer.publish_many(b"r%d" % (first + i) for i in range(50))
    if receipt.wait(30):
        print(receipt.offset, flush=True)
"""


def test_a_secure_store_passes_a_restarted_producers_hole_at_once(
    pki: Pki, secure_tower: Tower, procs: Procs, tmp_path: Path
) -> None:
    # Issue 34: in a secure mesh VOIDs were ignored, so after kill -9 and a
    # restart with the same identity the store waited skip_after (10 s) across
    # the reserved-but-unused offsets before it acknowledged anything new.
    import queue
    import signal
    import threading

    procs.store(pki, secure_tower, tmp_path / "db")
    argv = [sys.executable, "-c", SECURE_PRODUCER, pki.secret("producer"), str(pki.allow),
            pki.tower_key.decode(), str(secure_tower.in_port), str(secure_tower.out_port),
            str(tmp_path / "id.json")]  # fmt: skip

    def start() -> tuple[subprocess.Popen[bytes], int, queue.Queue[bytes]]:
        proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == [b"ready"], line
        lines: queue.Queue[bytes] = queue.Queue()
        out = proc.stdout
        threading.Thread(target=lambda: [lines.put(x) for x in out], daemon=True).start()
        return proc, int(line[1]), lines

    proc, _, lines = start()
    acked = -1
    while acked < 300:
        acked = int(lines.get(timeout=30))
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc, restart_at, lines = start()
    ready = time.monotonic()
    first = int(lines.get(timeout=20))
    took = time.monotonic() - ready
    assert first >= restart_at > acked + 1  # past a hole: reserved by the killed run, never used
    assert took < 2.0, f"the restarted producer's first ACK came {took:.1f}s after it resumed"
