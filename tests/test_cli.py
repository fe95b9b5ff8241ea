"""The dafka command line, run as separate processes."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.conftest import dafka_cmd, subprocess_env

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "sub", [[], ["tower"], ["produce"], ["consume"], ["store"], ["gateway"], ["tank"], ["up"], ["bench"]]
)
def test_help(sub: list[str]) -> None:
    out = subprocess.run(dafka_cmd(*sub, "--help"), capture_output=True, text=True, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert "usage: dafka" in out.stdout


@pytest.fixture
def tower_proc():
    in_port, out_port = free_port(), free_port()
    proc = subprocess.Popen(
        dafka_cmd("tower", "--bind", "127.0.0.1", "--in-port", str(in_port), "--out-port", str(out_port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    line = proc.stdout.readline()
    assert "tower up" in line
    yield f"127.0.0.1:{in_port}:{out_port}"
    proc.terminate()
    assert proc.wait(10) == 0


def test_produce_then_consume_across_processes(tower_proc: str) -> None:
    consumer = subprocess.Popen(
        dafka_cmd("consume", "news", "--tower", tower_proc, "--from-beginning", "--count", "3", "--timeout", "60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    producer = subprocess.run(
        dafka_cmd("produce", "news", "--tower", tower_proc, "--no-ack", "--wait-peers", "10", "--linger", "3"),
        input=b"first\nsecond\nthird\n",
        capture_output=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert producer.returncode == 0, producer.stderr
    out, err = consumer.communicate(timeout=60)
    assert consumer.returncode == 0, err
    assert out.splitlines() == [b"first", b"second", b"third"]


def test_produce_without_store_fails_clearly(tower_proc: str) -> None:
    producer = subprocess.run(
        dafka_cmd("produce", "news", "--tower", tower_proc, "--timeout", "1"),
        input=b"a\nb\n",
        capture_output=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert producer.returncode == 1
    assert b"2 of 2 records were not acknowledged" in producer.stderr


def test_bad_tower_address_is_a_clear_error() -> None:
    out = subprocess.run(
        dafka_cmd("consume", "x", "--tower", "host:notaport", "--timeout", "1"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert out.returncode == 2
    assert "bad tower address" in out.stderr


def test_tank_cli_against_a_gateway(tmp_path) -> None:
    from dafka.config import NodeConfig
    from dafka.tank.gateway import Gateway

    def tank(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            dafka_cmd("tank", "--broker", f"127.0.0.1:{gw.tank_port}", *args),
            input=stdin,
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=60,
        )

    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=("127.0.0.1", 0)) as gw:
        assert tank("create", "news", "2").returncode == 0
        assert tank("produce", "news", "hello", "world", "-k", "greeting").returncode == 0
        assert tank("produce", "news", "-p", "1", stdin="a\nb\nc\n").returncode == 0
        out = tank("consume", "news", "-v")
        assert out.returncode == 0, out.stderr
        rows = [line.split("\t") for line in out.stdout.splitlines()]
        assert [(r[0], r[2], r[3]) for r in rows] == [("1", "greeting", "hello"), ("2", "greeting", "world")]
        assert tank("consume", "news", "-p", "1", "--from", "2").stdout.split() == ["b", "c"]
        assert tank("partitions", "news").stdout.split("\n")[:2] == ["0\tfirst 1\thwm 2", "1\tfirst 1\thwm 3"]
        assert "news\t2 partitions" in tank("topics").stdout
        assert "version 400" in tank("status").stdout
        missing = tank("consume", "nope")
        assert missing.returncode == 1 and "unknown topic" in missing.stderr
