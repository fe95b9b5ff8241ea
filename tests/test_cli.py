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


@pytest.mark.parametrize("sub", [[], ["tower"], ["produce"], ["consume"], ["up"], ["bench"]])
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
