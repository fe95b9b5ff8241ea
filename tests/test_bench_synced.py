"""``dafka bench tank --bound``: the minimal store that syncs before it answers."""

from __future__ import annotations

import socket
import subprocess

from dafka.bench.synced import MinimalSyncedStore
from dafka.bench.tank import _tank_publish
from dafka.tank.client import TankClient
from dafka.tank.messages import Ping
from tests.conftest import dafka_cmd, subprocess_env


def test_the_minimal_store_answers_every_request_after_group_commits(tmp_path) -> None:
    with MinimalSyncedStore(str(tmp_path)) as store:
        rate = _tank_publish(store.port, "bound", 40_000, 100, 1000, 8)
    assert rate > 0
    assert store.result is not None
    assert store.result.requests == 40
    assert 1 <= store.result.commits <= 40
    assert list(tmp_path.iterdir()) == []  # its database is removed


def test_the_minimal_store_closes_on_what_it_does_not_answer(tmp_path) -> None:
    with MinimalSyncedStore(str(tmp_path)) as store:
        with TankClient("127.0.0.1", store.port, timeout=10) as client:
            client.create_topic("t", 1)  # answered
        with socket.create_connection(("127.0.0.1", store.port), timeout=10) as conn:
            assert conn.recv(5) == Ping().encode()  # the greeting
            conn.sendall(b"\x02\x04\x00\x00\x00abcd")  # a consume: not answered, closed
            assert conn.recv(100) == b""
    assert store.result is not None and store.result.requests == 0


def test_the_minimal_store_closes_a_short_frame_and_connections_past_its_cap(tmp_path) -> None:
    """Hostile: a produce frame too short for its fields closes its connection (before, its
    reader thread died on an IndexError and the connection stayed open, unanswered), and
    connections past the first eight are closed at once; the store still answers."""
    from dafka.bench import synced

    with MinimalSyncedStore(str(tmp_path)) as store:
        with socket.create_connection(("127.0.0.1", store.port), timeout=10) as conn:
            assert conn.recv(5) == Ping().encode()
            conn.sendall(b"\x01\x03\x00\x00\x00abc")  # a produce of 3 bytes
            assert conn.recv(100) == b""
        extra = [socket.create_connection(("127.0.0.1", store.port), timeout=10)
                 for _ in range(synced._MAX_CONNECTIONS)]
        try:
            assert all(c.recv(5) == Ping().encode() for c in extra[:-1])
            assert extra[-1].recv(5) == b""  # the ninth
        finally:
            for c in extra:
                c.close()
    assert store.result is not None and store.result.requests == 0


def test_bench_tank_bound_prints_the_gateway_against_it() -> None:
    cmd = dafka_cmd("--log-level", "WARNING", "bench", "tank", "--records", "20000", "--runs", "1",
                    "--bound", "--disk-mb", "2")
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "a minimal store that syncs before it answers (window 8):" in out.stdout, out.stdout
    assert "x the minimal store" in out.stdout, out.stdout
    assert "tank publish / minimal synced store: median" in out.stdout, out.stdout


def test_bench_tank_bound_is_refused_without_sync() -> None:
    cmd = dafka_cmd("bench", "tank", "--records", "1000", "--runs", "1", "--bound", "--no-sync")
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--bound measures a store that syncs" in out.stderr
