"""A store that keeps a subset of topics (``[store] topics`` / ``--topics``): what it stores, what it refuses."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from dafka.cli.store import store_topics
from dafka.config import NodeConfig
from dafka.core import leafwire, wire
from dafka.core.leaf import LeafPort, Reply
from dafka.errors import ConfigError
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB
from dafka.store.node import Store
from tests.conftest import dafka_cmd, spawned, subprocess_env, tower_flag, wait_until

ADDR = "0123456789ABCDEF0123456789ABCDEF"


def test_a_leaf_of_a_topic_the_store_does_not_keep_is_refused_at_its_hello() -> None:
    port = LeafPort(lambda s, p: -1, address="S" * 32, keeps=lambda subject: subject == "kept")
    (reply,) = port.on_message(b"c1", leafwire.encode(leafwire.LeafHello(ADDR, "other", -1, 0)), 0.0)
    assert isinstance(reply, Reply)
    status = wire.decode(reply.frames)
    assert isinstance(status, wire.StoreStatus) and status.writing == 0 and "does not keep" in status.reason
    assert len(port) == 0 and port.refused == 1
    # Its records then find no session: told to say HELLO (which is refused again), never taken.
    out = port.on_message(b"c1", wire.encode(wire.Record("other", ADDR, "other", 0, b"x")), 0.0)
    assert [type(wire.decode(r.frames)) for r in out if isinstance(r, Reply)] == [wire.StoreStatus]
    (welcome,) = port.on_message(b"c2", leafwire.encode(leafwire.LeafHello(ADDR, "kept", -1, 0)), 0.0)
    assert isinstance(leafwire.decode(welcome.frames), leafwire.LeafWelcome)  # type: ignore[union-attr]


def test_topics_are_named_by_flag_or_config() -> None:
    assert store_topics(None) is None
    assert store_topics("a, b") == ["a", "b"]
    assert store_topics(["a", "b,c"]) == ["a", "b", "c"]
    with pytest.raises(ConfigError):
        store_topics(" , ")
    with pytest.raises(ConfigError):
        Store(":memory:", topics=[])


def test_a_store_keeps_only_its_topics(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "all"), cfg, sync=False) as everything, \
            Store(str(tmp_path / "some"), cfg, sync=False, topics=["kept"]) as some, \
            Producer("kept", cfg) as kept, Producer("kept2", cfg) as near, Producer("other", cfg) as other:
        wait_until(lambda: len(kept.peers) >= 2 and len(other.peers) >= 2, timeout=15)
        receipts = [p.publish(b"%s-%d" % (p.topic.encode(), i)) for i in range(20) for p in (kept, near, other)]
        assert all(r.wait(15) for r in receipts)  # (the store of everything acknowledges all)
        wait_until(lambda: some.heads().get(("kept", kept.address)) == 19, timeout=15)
        time.sleep(0.3)  # HEADs of the others have come and gone meanwhile
        assert set(some.heads()) == {("kept", kept.address)}
        assert {subject for subject, _ in some._trackers} == {"kept"}  # no tracker, no FETCH of the others
        assert ("other", other.address) in everything.heads() and ("kept2", near.address) in everything.heads()
    db = RecordDB(str(tmp_path / "some"))
    try:
        assert {p.topic for p in db.partitions()} == {"kept"}
    finally:
        db.close()


def test_dafka_store_topics_says_what_it_keeps(cfg: NodeConfig, tmp_path: Path) -> None:
    proc = spawned(subprocess.Popen(
        dafka_cmd("store", "--db", str(tmp_path / "db"), "--tower", tower_flag(cfg), "--bind", "127.0.0.1",
                  "--topics", "b,a"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=subprocess_env(),
    ))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert re.search(r"store up: .*, keeps a, b$", line.strip()), line
    finally:
        proc.terminate()
        proc.wait(15)
