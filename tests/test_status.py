"""``dafka status``: the sans-IO MeshView, and the command against real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from dafka.cli.status import MeshView, render_text
from dafka.config import NodeConfig
from dafka.core import wire
from dafka.nodes.consumer import Consumer
from tests.conftest import dafka_cmd, subprocess_env, tower_flag, wait_until

OWN = "0" * 32
PROD = "A" * 32
STORE = "B" * 32
STORE2 = "C" * 32
CONS = "D" * 32


def test_view_tells_producer_and_store_heads_apart() -> None:
    view = MeshView(OWN, ["tcp://t:5557"], timeout=4.0)
    view.on_tower("tcp://t:5557", 0.0)
    assert view.on_beacon(PROD, "tcp://h:1", 0.0) == "tcp://h:1"
    assert view.on_beacon(PROD, "tcp://h:1", 0.5) is None  # known: nothing to connect
    assert view.on_beacon(OWN, "tcp://h:9", 0.5) is None  # ourselves
    view.on_beacon(STORE, "tcp://h:2", 0.0)
    view.on_beacon(STORE2, "tcp://h:3", 0.0)
    view.on_beacon(CONS, "tcp://h:4", 0.0)
    # Same message shape, different senders: the producer's own HEAD, a store's re-announcement.
    view.on_message(PROD, wire.Head("t", PROD, "t", 41))
    view.on_message(STORE, wire.Head("t", PROD, "t", 40))
    view.on_message(STORE2, wire.Ack(PROD, "t", 30))  # an ACK is a store's head too
    view.on_message(STORE2, wire.DirectHead(OWN, PROD, "t", 35))  # answer to GET-HEADS
    view.on_subscription(wire.P_STORE_HELLO + CONS.encode())  # a consumer's subscription
    view.on_subscription(wire.P_FETCH)  # a store's: carries no address
    snap = view.snapshot(1.0)
    kinds = {n["address"]: n["kind"] for n in snap["nodes"]}
    assert kinds == {PROD: "producer", STORE: "store", STORE2: "store", CONS: "consumer"}
    (part,) = snap["partitions"]
    assert part["producer_head"] == 41 and part["producer_alive"]
    assert part["stores"] == [
        {"address": STORE, "head": 40, "lag": 1},
        {"address": STORE2, "head": 35, "lag": 6},
    ]
    assert snap["towers"] == [{"endpoint": "tcp://t:5557", "reached": True}]
    text = render_text(snap)
    assert "producer" in text and "BBBBBBBB:40/1" in text


def test_view_expires_silent_peers_and_reconnects_new_endpoints() -> None:
    view = MeshView(OWN, ["tcp://t:5557"], timeout=4.0)
    view.on_beacon(PROD, "tcp://h:1", 0.0)
    view.on_beacon(STORE, "tcp://h:2", 0.0)
    view.on_beacon(STORE, "tcp://h:2", 3.0)
    assert view.expire(4.5) == [PROD]
    assert view.expire(5.0) == []
    assert view.on_beacon(PROD, "tcp://h:1", 6.0) == "tcp://h:1"  # back: connect again
    assert view.on_beacon(STORE, "tcp://h:7", 6.0) == "tcp://h:7"  # restarted elsewhere
    snap = view.snapshot(6.0)
    assert snap["towers"] == [{"endpoint": "tcp://t:5557", "reached": False}]
    assert all(n["alive"] for n in snap["nodes"])


def test_view_ignores_other_topics_prefix_and_foreign_subscriptions() -> None:
    view = MeshView(OWN, [], timeout=4.0)
    view.on_message(PROD, wire.Head("t2", PROD, "t", 3))  # topic and subject disagree
    view.on_subscription(wire.P_ACK + OWN.encode())  # our own address
    view.on_subscription(b"K\xff\xfe")  # not UTF-8
    assert view.partitions == {} and view.evidence == {}


PRODUCER = textwrap.dedent(
    """
    import sys, time
    from dafka.nodes.producer import Producer
    p = Producer("status-t", towers=sys.argv[1])
    deadline = time.monotonic() + 20
    while len(p.peers) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(25):
        p.publish(b"r%d" % i)
    assert p.flush(20)
    print(p.address, flush=True)
    sys.stdin.read()  # stay on the mesh until the test closes stdin
    p.close(1)
    """
)


def test_status_command_against_processes(cfg: NodeConfig, tmp_path: Path) -> None:
    env = subprocess_env()
    towers = tower_flag(cfg)
    store = subprocess.Popen(
        dafka_cmd("store", "--tower", towers, "--db", str(tmp_path / "db"), "--bind", "127.0.0.1"),
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, towers],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    consumer = Consumer("status-t", cfg)
    try:
        store_line = store.stdout.readline()  # "store up: ADDRESS db ..."
        store_address = store_line.split()[2]
        producer_address = producer.stdout.readline().strip()
        assert len(producer_address) == 32, producer_address

        def status() -> dict[str, Any] | None:
            out = subprocess.run(
                dafka_cmd("status", "--tower", towers, "--json", "--wait", "3"),
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            snap = json.loads(out.stdout)
            kinds = {n["address"]: n["kind"] for n in snap["nodes"]}
            parts = [p for p in snap["partitions"] if p["partition"] == producer_address]
            ok = (
                kinds.get(store_address) == "store"
                and kinds.get(producer_address) == "producer"
                and kinds.get(consumer.address) == "consumer"
                and parts
                and parts[0]["producer_head"] == 24
                and [(s["address"], s["head"]) for s in parts[0]["stores"]] == [(store_address, 24)]
            )
            return snap if ok else None

        snap = wait_until(status, timeout=40, interval=0.1)
        assert snap["towers"][0]["reached"]
        assert all(n["last_beacon_age"] < 5 for n in snap["nodes"])
    finally:
        consumer.close()
        producer.stdin.close()
        producer.wait(10)
        store.terminate()
        store.wait(10)


def test_status_watch_prints_repeated_views(cfg: NodeConfig) -> None:
    proc = subprocess.Popen(
        dafka_cmd(
            "status", "--tower", tower_flag(cfg), "--watch", "--wait", "0.3", "--interval", "0.3"
        ),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        seen = 0
        for line in proc.stdout:
            seen += line.startswith("TOWERS")
            if seen == 3:
                break
        assert seen == 3
    finally:
        proc.terminate()
        proc.wait(10)


def test_status_of_c_like_nodes_that_only_answer_get_heads(cfg: NodeConfig, raw_peer: Any) -> None:
    """Nodes that behave as the C reference: no HEAD re-announcement, heads only on GET-HEADS."""
    import threading

    from dafka.cli.status import StatusProbe

    producer = raw_peer([])  # a C producer: HEADs of its own partition
    store = raw_peer([wire.P_GET_HEADS])  # a C store's reader: answers GET-HEADS
    result: dict[str, Any] = {}
    probe = StatusProbe(cfg)
    thread = threading.Thread(target=lambda: result.update(probe.run(4.0)))
    thread.start()
    answered: set[str] = set()
    try:
        while thread.is_alive():
            producer.send(wire.Head("ct", producer.address, "ct", 9))
            producer.pump(0.05)
            store.pump(0.05)
            for msg in store.messages(wire.GetHeads):
                if msg.topic == "ct" and msg.address not in answered:
                    answered.add(msg.address)
                    store.send(wire.DirectHead(msg.address, producer.address, "ct", 7))
            for sub in store.subscriptions:
                if sub[:2] == b"\x01" + wire.P_STORE_HELLO and len(sub) > 2:
                    store.send(wire.StoreHello(sub[2:].decode(), store.address))
            store.subscriptions.clear()
        thread.join()
    finally:
        probe.close()
    assert answered == {probe.address}
    kinds = {n["address"]: n["kind"] for n in result["nodes"]}
    assert kinds == {producer.address: "producer", store.address: "store"}
    (part,) = result["partitions"]
    assert part["producer_head"] == 9
    assert part["stores"] == [{"address": store.address, "head": 7, "lag": 2}]


def test_status_without_a_tower_says_so() -> None:
    out = subprocess.run(
        dafka_cmd("status", "--tower", "127.0.0.1:1:2", "--wait", "0.5", "--json"),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert json.loads(out.stdout)["towers"] == [{"endpoint": "tcp://127.0.0.1:2", "reached": False}]
    assert "no tower answered" in out.stderr


def test_view_forgets_gone_nodes_and_untold_partitions() -> None:
    """A --watch (or the console) over a mesh whose nodes come and go for days: a node
    that stopped beaconing is listed down for GONE_KEPT seconds, then forgotten; a
    partition nobody tells a head of for PARTITION_KEPT seconds is forgotten."""
    from dafka.cli import status

    view = MeshView(OWN, [], timeout=4.0)
    gone = [f"{i + 1:032X}" for i in range(5000)]
    for i, address in enumerate(gone):
        view.on_beacon(address, f"tcp://127.0.0.1:{1000 + i % 60000}", 0.0)
        view.on_message(address, wire.Head("t", address, "t", 1), 0.0)  # a producer's own head
    view.on_beacon(STORE, "tcp://127.0.0.1:9", 0.0)
    assert len(view.peers) == 5001 and len(view.partitions) == 5000
    t = 0.0
    while t < 4.0 + status.GONE_KEPT + 1:  # the store beacons and tells one head, the rest are silent
        t += 1.0
        view.on_beacon(STORE, "tcp://127.0.0.1:9", t)
        view.on_message(STORE, wire.Head("t", gone[0], "t", 1), t)
        view.expire(t)
        if t == 5.0:
            assert sum(not p.alive for p in view.peers.values()) == 5000  # down, still listed
    assert list(view.peers) == [STORE]
    assert set(view.evidence) <= {STORE}
    assert list(view.partitions) == [("t", gone[0])]  # the one a store still tells of
    snap = view.snapshot(t)
    assert [n["address"] for n in snap["nodes"]] == [STORE]


def test_view_bounds_partitions_a_hostile_peer_tells(monkeypatch: Any) -> None:
    from dafka.cli import status

    monkeypatch.setattr(status, "MAX_PARTITIONS", 1000)
    view = MeshView(OWN, [], timeout=4.0)
    for i in range(5000):
        view.on_message(STORE, wire.Head(f"t{i}", PROD, f"t{i}", i), 1.0)
        view.on_message(STORE, wire.Ack(PROD, f"u{i}", i), 1.0)
    assert len(view.partitions) == 1000 and view.dropped_partitions == 9000
    assert view.snapshot(1.0)["dropped_partitions"] == 9000
    view.expire(1.0 + status.PARTITION_KEPT)
    assert not view.partitions  # nobody told them again
    view.on_message(STORE, wire.Head("t", PROD, "t", 1), 70.0)
    assert list(view.partitions) == [("t", PROD)]
