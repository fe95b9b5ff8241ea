"""CURVE on the leaf port: in a secure region a leaf's key owns its partition exactly as on the mesh.

Hostile first: an unknown key, a plain client, and a known key naming another key's partition get
no session and store nothing; then an honest secure leaf is acknowledged."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq

from dafka.config import NodeConfig, TowerAddress
from dafka.consumer import Consumer
from dafka.core import leafwire, wire
from dafka.errors import ConfigError
from dafka.nodes import security
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from dafka.store.node import Store
from tests.conftest import wait_until
from tests.test_security import Pki, node_cfg, pki, secure_tower  # noqa: F401  (fixtures)

T = "telemetry"


@pytest.fixture
def secure_store(pki: Pki, secure_tower: Tower, tmp_path: Path) -> Any:  # noqa: F811
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", secure_tower.in_port, secure_tower.out_port),), bind="127.0.0.1",
        beacon_interval=0.2, beacon_timeout=2.0, security=pki.config("store"),
    )
    with Store(str(tmp_path / "db"), cfg, sync=False, leaves="127.0.0.1:0") as store:
        yield store


def keys(pki: Pki, name: str) -> security.OwnKeys:  # noqa: F811
    cert = security.read_certificate(pki.secret(name))
    return security.OwnKeys(cert.public, cert.secret or b"", cert.role)


def dealer(store: Store, own: security.OwnKeys | None, server_key: bytes | None = None) -> zmq.Socket:
    assert store.leaves is not None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if own is not None:
        security.make_client(sock, own)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key or store_key(store))
    sock.connect(f"tcp://{store.leaves.endpoint}")
    return sock


def store_key(store: Store) -> bytes:
    assert store.config.security is not None
    return security.read_certificate(store.config.security.key).public


def hello(address: str) -> list[bytes]:
    return leafwire.encode(leafwire.LeafHello(address, T, -1, 0))


def answers(sock: zmq.Socket, wait: float) -> list[list[bytes]]:
    out = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if sock.poll(50):
            out.append(sock.recv_multipart())
    return out


def test_an_unknown_key_gets_no_session(pki: Pki, secure_store: Store) -> None:  # noqa: F811
    intruder = keys(pki, "intruder")
    sock = dealer(secure_store, intruder)
    try:
        for _ in range(3):
            try:
                sock.send_multipart(hello(security.bound_address(intruder.public)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the refused handshake closed the connection's queue already
        assert answers(sock, 1.0) == []
        assert secure_store.leaves is not None
        assert len(secure_store.leaves.core) == 0
        wait_until(lambda: secure_store.leaves.refused_keys >= 1, timeout=5)  # type: ignore[union-attr]
    finally:
        sock.close(0)


def test_a_plain_client_gets_nothing(secure_store: Store) -> None:
    sock = dealer(secure_store, None)
    try:
        try:
            sock.send_multipart(hello("0123456789ABCDEF0123456789ABCDEF"), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the failed handshake closed the connection's queue already
        assert answers(sock, 1.0) == []
        assert secure_store.leaves is not None and len(secure_store.leaves.core) == 0
    finally:
        sock.close(0)


def test_a_key_cannot_publish_into_another_keys_partition(pki: Pki, secure_store: Store) -> None:  # noqa: F811
    victim = security.bound_address(keys(pki, "producer").public)
    forger = keys(pki, "forger")
    sock = dealer(secure_store, forger)
    try:
        sock.send_multipart(hello(victim))
        (reply,) = wait_until(lambda: answers(sock, 0.2), timeout=10)
        status = wire.decode(reply)
        assert isinstance(status, wire.StoreStatus) and status.writing == 0 and "key" in status.reason
        sock.send_multipart(wire.encode(wire.Record(T, victim, T, 0, b"forged")))
        time.sleep(0.5)
        assert (T, victim) not in secure_store.heads()
        assert secure_store.leaves is not None and len(secure_store.leaves.core) == 0
        # The same connection, its own partition: welcomed (the key is allowed; only the partition was not its).
        own = security.bound_address(forger.public)
        sock.send_multipart(hello(own))
        replies = wait_until(lambda: answers(sock, 0.2), timeout=10)
        assert any(isinstance(leafwire.decode(r), leafwire.LeafWelcome) for r in replies if r[0][:1] == b"O")
    finally:
        sock.close(0)


def test_a_secure_leaf_owns_its_partition_and_is_acknowledged(pki: Pki, secure_store: Store, tmp_path: Path) -> None:  # noqa: F811
    assert secure_store.leaves is not None
    sec = replace(pki.config("producer"), leaf_keys=(store_key(secure_store),))
    cfg = NodeConfig(security=sec)
    with Producer(T, cfg, leaf=secure_store.leaves.endpoint, identity=str(tmp_path / "id.json")) as leaf:
        assert security.address_bound(leaf.address, keys(pki, "producer").public)
        assert leaf.publish_many([b"a", b"b", b"c"]).wait(15)  # type: ignore[union-attr]
        assert secure_store.heads()[(T, leaf.address)] == 2
    # An identity file whose address is not bound to the key is refused, not published under.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"address": "0123456789ABCDEF0123456789ABCDEF", "topic": T, "acked": -1,
                                 "next": 0, "reserved": 0}))
    with pytest.raises(ValueError, match="not bound"):
        Producer(T, cfg, leaf=secure_store.leaves.endpoint, identity=str(other))


def test_a_secure_leaf_needs_the_endpoints_key(pki: Pki) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match="leaf_keys"):
        Producer(T, NodeConfig(security=pki.config("producer")), leaf="127.0.0.1:7700")


def test_the_port_asks_authorize_at_the_hello_only_and_counts_a_refusal_as_hostile() -> None:
    from dafka.core.leaf import LeafPort, Reply

    owner = "0123456789ABCDEF0123456789ABCDEF"
    port = LeafPort(lambda s, p: -1, address="S" * 32, bad_limit=2,
                    authorize=lambda key, partition: key == "K" and partition == owner)
    (refused,) = port.on_message(b"c1", hello(owner), 0.0, peer_key="other")
    assert isinstance(refused, Reply) and wire.decode(refused.frames).writing == 0  # type: ignore[union-attr]
    assert port.unauthorized == 1 and port.bad == 1 and len(port) == 0
    assert port.on_message(b"c1", hello(owner), 0.0, peer_key="other") == []  # the limit: ignored from now on
    assert port.on_message(b"c1", hello(owner), 0.0, peer_key="K") == []
    (welcome,) = port.on_message(b"c2", hello(owner), 0.0, peer_key="K")
    assert isinstance(leafwire.decode(welcome.frames), leafwire.LeafWelcome)  # type: ignore[union-attr]


def test_dafka_store_and_produce_leaf_in_a_secure_region(pki: Pki, secure_tower: Tower, tmp_path: Path) -> None:  # noqa: F811
    import re
    import subprocess

    from tests.conftest import dafka_cmd, spawned, subprocess_env

    store = spawned(subprocess.Popen(
        dafka_cmd("store", "--db", str(tmp_path / "db"), "--leaves", "127.0.0.1:0", *pki.flags("store", secure_tower)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(),
    ))
    assert store.stdout is not None
    line = store.stdout.readline().decode()
    found = re.search(r"leaves on ([\d.]+:\d+)", line)
    assert found, line + (store.stderr.read().decode() if store.poll() is not None and store.stderr else "")
    base = ["--key", pki.secret("producer"), "--allow", str(pki.allow)]
    run = subprocess.run(
        dafka_cmd("produce", T, "--leaf", found.group(1), *base, "--leaf-key", str(pki.keys / "store.key")),
        input=b"one\ntwo\n", capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert run.returncode == 0 and b"published 2 records, all acknowledged" in run.stderr, run.stderr
    wrong = subprocess.run(  # the wrong endpoint key: no handshake, nothing acknowledged
        dafka_cmd("produce", T, "--leaf", found.group(1), *base, "--leaf-key", str(pki.keys / "tower.key"),
                  "--timeout", "2"),
        input=b"three\n", capture_output=True, env=subprocess_env(), timeout=60,
    )
    assert wrong.returncode != 0, wrong.stderr
    store.terminate()
    assert store.wait(15) == 0


def test_a_leaf_whose_key_leaves_the_allow_list_is_taken_no_more(pki: Pki, secure_store: Store, tmp_path: Path) -> None:  # noqa: F811
    assert secure_store.leaves is not None
    sec = replace(pki.config("rogue"), leaf_keys=(store_key(secure_store),))
    with Producer(T, NodeConfig(security=sec), leaf=secure_store.leaves.endpoint, ack_timeout=30) as leaf:
        assert leaf.publish(b"allowed").wait(15)
        (pki.allow / "rogue.key").unlink()  # revoked while its connection stays open
        guard = secure_store.leaves.guard
        assert guard is not None
        wait_until(lambda: guard.role(keys(pki, "rogue").public) is None, timeout=10)  # the store reloaded it
        late = leaf.publish(b"revoked")
        assert not late.wait(2)
        assert secure_store.heads()[(T, leaf.address)] == 0
        assert secure_store.leaves.revoked > 0
        leaf.close(0.1)


def test_a_secure_mesh_reader_believes_the_endpoint_stating_a_leafs_restart_hole(
    pki: Pki, secure_store: Store, secure_tower: Tower, tmp_path: Path  # noqa: F811
) -> None:
    # The endpoint states a restarted leaf's hole for it (VOID kind 1 in the leaf's
    # name) with the store's key, which does not own the leaf's partition: believed
    # from a store's key, as its relays of the leaf's records are.  (Taken for a forgery
    # before: the reader waited skip_after, 10 s.)
    assert secure_store.leaves is not None
    endpoint = secure_store.leaves.endpoint
    cfg = NodeConfig(security=replace(pki.config("producer"), leaf_keys=(store_key(secure_store),)))
    identity = tmp_path / "id.json"
    with Producer(T, cfg, leaf=endpoint, identity=str(identity)) as leaf:
        assert leaf.publish_many([b"a", b"b"]).wait(15)  # type: ignore[union-attr]
    saved = json.loads(identity.read_text())
    assert saved["endpoint"] == endpoint and saved["acked"] == 1
    saved["reserved"] = 500  # as a run killed -9 leaves it: a reservation beyond what it used
    identity.write_text(json.dumps(saved))
    with Consumer(T, node_cfg(pki, secure_tower, "consumer"), offset_reset="earliest") as consumer:
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + 15
        while len(got) < 2 and time.monotonic() < deadline:
            record = consumer.poll(0.1)
            if record is not None:
                got[record.offset] = bytes(record.value)
        with Producer(T, cfg, leaf=endpoint, identity=str(identity)) as leaf:
            assert leaf.next_offset == 500
            restarted = time.monotonic()
            assert leaf.publish_many([b"c", b"d"]).wait(15)  # type: ignore[union-attr]
            deadline = restarted + 15
            while len(got) < 4 and time.monotonic() < deadline:
                record = consumer.poll(0.1)
                if record is not None:
                    got[record.offset] = bytes(record.value)
            took = time.monotonic() - restarted
    assert got == {0: b"a", 1: b"b", 500: b"c", 501: b"d"}
    assert took < 4.0, f"the reader passed the hole after {took:.1f}s (skip_after is 10 s)"
