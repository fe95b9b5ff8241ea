"""Leaf readers in a secure region: a key reads only the topics the store's ``leaf_read`` allows it
(none by default), ``{key}`` standing for its own key; hostile first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig, TowerAddress
from dafka.core import leafwire, wire
from dafka.core.leafread import READ_AGAIN
from dafka.nodes import security
from dafka.nodes.leafread import LeafConsumer
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from dafka.store.leaves import read_policy
from dafka.store.node import Store
from tests.conftest import wait_until
from tests.test_leaf_secure import answers, dealer, keys, store_key
from tests.test_security import Pki, pki, secure_tower  # noqa: F401  (fixtures)


def make_store(pki: Pki, tower: Tower, tmp: Path, read_topics: list[str] | None) -> Store:  # noqa: F811
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),), bind="127.0.0.1",
        beacon_interval=0.2, beacon_timeout=2.0, security=pki.config("store"),
    )
    limits = None if read_topics is None else {"read_topics": read_topics}
    return Store(str(tmp / "db"), cfg, sync=False, leaves="127.0.0.1:0", leaf_limits=limits)


def ask(sock: Any, subject: str) -> Any:
    sock.send_multipart(leafwire.encode(leafwire.LeafRead("R" * 32, subject)))
    (reply,) = wait_until(lambda: answers(sock, 0.2), timeout=10)
    return leafwire.decode(reply)


def test_a_secure_store_lets_no_key_read_by_default(pki: Pki, secure_tower: Tower, tmp_path: Path) -> None:  # noqa: F811
    with make_store(pki, secure_tower, tmp_path, None) as store:
        sock = dealer(store, keys(pki, "producer"))
        try:
            refused = ask(sock, "commands/x")
            assert isinstance(refused, wire.StoreStatus) and refused.writing == 0 and "may not be read" in refused.reason
            assert store.leaves is not None and len(store.leaves.reads) == 0 and store.leaves.core.bad == 1
        finally:
            sock.close(0)


def test_a_key_reads_its_own_commands_topic_and_the_allowed_ones_only(
    pki: Pki, secure_tower: Tower, tmp_path: Path  # noqa: F811
) -> None:
    with make_store(pki, secure_tower, tmp_path, ["commands/{key}", "broadcast"]) as store:
        own = keys(pki, "forger")
        other = keys(pki, "producer").public.decode()
        sock = dealer(store, own)
        try:
            assert isinstance(ask(sock, f"commands/{own.public.decode()}"), leafwire.LeafReading)
            assert isinstance(ask(sock, "broadcast"), leafwire.LeafReading)
            refused = ask(sock, f"commands/{other}")
            assert isinstance(refused, wire.StoreStatus) and refused.writing == 0
            refused = ask(sock, "commands/*")
            assert isinstance(refused, wire.StoreStatus) and refused.writing == 0
            # A FETCH of a topic it does not read gets no record: only "say LEAF-READ" (which is refused).
            sock.send_multipart(wire.encode(wire.Fetch("P" * 32, "R" * 32, f"commands/{other}", 0, 10)))
            got = [leafwire.decode(f) for f in answers(sock, 0.5)]
            assert got == [wire.StoreStatus("R" * 32, store.address, f"commands/{other}", 0, READ_AGAIN)]
        finally:
            sock.close(0)
        # The real parts: a secure leaf producer sends the forger's key its commands; its LeafConsumer reads them.
        assert store.leaves is not None
        topic = f"commands/{own.public.decode()}"
        endpoint = store.leaves.endpoint
        with Producer(topic, NodeConfig(security=replace(pki.config("producer"), leaf_keys=(store_key(store),))),
                      leaf=endpoint) as p:
            assert p.publish_many([b"reboot", b"update"]).wait(15)  # type: ignore[union-attr]
        cfg = NodeConfig(security=replace(pki.config("forger"), leaf_keys=(store_key(store),)))
        with LeafConsumer(topic, cfg, leaf=endpoint) as c:
            got = c.poll_batch(2, timeout=10) + c.poll_batch(2, timeout=0.3)
            assert [r.content for r in got] == [b"reboot", b"update"]


@pytest.mark.parametrize(
    ("key", "subject", "allowed"),
    [
        ("abc", "commands/abc", True),
        ("a*c", "commands/a*c", True),
        ("a*c", "commands/aXc", False),  # Z85 keys hold glob characters: they match only themselves
        ("a[b]", "commands/ab", False),
        ("", "commands/", False),  # plain mode has no key: {key} patterns match nothing
        ("abc", "broadcast", True),
        ("abc", "other", False),
    ],
)
def test_read_policy_patterns(key: str, subject: str, allowed: bool) -> None:
    assert read_policy(["commands/{key}", "broad*"], secure=True)(key, subject) is allowed


def test_read_policy_defaults() -> None:
    assert read_policy(None, secure=False)("", "anything")
    assert not read_policy(None, secure=True)("k", "anything")
    assert security.KEY_LENGTH == 40
