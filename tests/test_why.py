"""Say why nothing happens: a group without stores, a plain node at a secure tower."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.errors import CommitError
from dafka.nodes.consumer import Consumer
from dafka.store.node import Store
from tests.conftest import (
    dafka_cmd,
    handshakes_end_in_connect,
    subprocess_env,
    tower_flag,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


def test_group_commit_without_any_store_says_so(cfg: NodeConfig) -> None:
    with Consumer("t", cfg, group="g") as consumer:
        wait_until(lambda: consumer.tower_watch.reached)
        assert consumer.poll(0.5) is None  # nothing comes
        with pytest.raises(CommitError, match="no store on the mesh"):
            consumer.commit(timeout=1.0)
        started = time.monotonic()
    assert time.monotonic() - started < 1.5  # closing with nothing polled waits for no store


def test_group_commit_with_a_store_and_nothing_polled_is_empty(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(tmp_path / "db", cfg), Consumer("t", cfg, group="g") as consumer:
        assert consumer.commit(timeout=10) == {}


def test_consume_group_without_store_prints_why(cfg: NodeConfig, tmp_path: Path) -> None:
    conf = tmp_path / "node.toml"
    conf.write_text(f"[node]\nbeacon_interval = {cfg.beacon_interval}\nbeacon_timeout = {cfg.beacon_timeout}\n")
    out = subprocess.run(
        dafka_cmd("--config", str(conf), "consume", "t", "--group", "g", "--tower", tower_flag(cfg),
                  "--commit-interval", "0.5", "--commit-timeout", "1", "--timeout", "4"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, out.stderr  # said once, not every interval
    assert "no store on the mesh" in warnings[0] and "'g'" in warnings[0]


def test_plain_node_at_a_secure_tower_says_the_tower_refused_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from dafka.config import TowerAddress
    from dafka.nodes import security
    from dafka.nodes.tower import Tower

    security.new_keys("tower", "tower", tmp_path / "keys")
    allow = tmp_path / "allow"
    allow.mkdir()
    tower_cfg = security.SecurityConfig(str(tmp_path / "keys" / "tower.key_secret"), str(allow), ())
    with Tower("127.0.0.1", 0, 0, tower_cfg) as tower:
        plain = NodeConfig(
            towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
            bind="127.0.0.1",
            beacon_interval=0.2,
            beacon_timeout=2.0,
        )
        with caplog.at_level(logging.WARNING, logger="dafka.consumer"), Consumer("t", plain) as consumer:
            # Said at once, and in the periodic "reached no tower" warning once known.
            said = "refused the handshake: it is a secure (CURVE) tower and this node is plain"
            wait_until(lambda: said in caplog.text and "reached no tower" in caplog.text, timeout=10)
            text = caplog.text
            # Under load the refusal can come after the first warning (which then cannot
            # know it); no warning after it asks whether a tower runs.
            assert "is a tower running there?" not in text[text.index(said) :]
            assert not consumer.tower_watch.reached
            ports = tower.in_port, tower.out_port
            tower.close()
            # ZeroMQ gives a refused connection up; the node tries again, so a
            # plain tower started in its place is reached.
            plain_tower = wait_until(lambda: _tower_on(*ports), timeout=10)  # the old one closes asynchronously
            with plain_tower:
                wait_until(lambda: consumer.tower_watch.reached, timeout=10)


def test_a_refusal_before_the_node_has_started_is_still_seen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On loopback the secure tower refuses the handshake within a millisecond of
    # connect(); a loaded machine lets it happen before the node's constructor goes
    # on.  The node's monitors must have been watching from before the connect
    # (attached after it, they never saw the refusal: said nothing, retried nothing).
    import logging

    from dafka.config import TowerAddress
    from dafka.nodes import security
    from dafka.nodes.tower import Tower

    security.new_keys("tower", "tower", tmp_path / "keys")
    allow = tmp_path / "allow"
    allow.mkdir()
    tower_cfg = security.SecurityConfig(str(tmp_path / "keys" / "tower.key_secret"), str(allow), ())
    with Tower("127.0.0.1", 0, 0, tower_cfg) as tower:
        refusals_in, refusals_out = tower._refusals
        handshakes_end_in_connect(
            monkeypatch, {tower.in_port: lambda: refusals_in.count, tower.out_port: lambda: refusals_out.count}
        )
        plain = NodeConfig(
            towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
            bind="127.0.0.1",
            beacon_interval=0.2,
            beacon_timeout=2.0,
        )
        with caplog.at_level(logging.WARNING, logger="dafka.consumer"), Consumer("t", plain):
            # Both beacon sockets' refusals are seen (each tower endpoint named once).
            said = [
                f"the tower at tcp://127.0.0.1:{port} refused the handshake: it is a secure (CURVE) tower"
                for port in (tower.in_port, tower.out_port)
            ]
            wait_until(lambda: all(s in caplog.text for s in said), timeout=10)


def _tower_on(in_port: int, out_port: int):
    import zmq

    from dafka.nodes.tower import Tower

    try:
        return Tower("127.0.0.1", in_port, out_port)
    except zmq.ZMQError:
        return None


def test_tower_watch_names_a_refusing_tower() -> None:
    from dafka.core.peers import TowerWatch

    watch = TowerWatch(0.0, grace=1.0)
    assert watch.hint() == "is a tower running there?"
    assert watch.on_refused("tcp://h:1", 0.5) is True
    assert watch.on_refused("tcp://h:1", 0.7) is False  # said once
    assert "tower at tcp://h:1 refused the handshake" in watch.hint()
    assert watch.warning_due(1.0)
