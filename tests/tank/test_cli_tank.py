"""``dafka tank ...`` and ``dafka gateway`` on the command line against a real gateway (issue 21 items 7, 8)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from dafka.cli import build_parser
from dafka.config import NodeConfig
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from tests.conftest import dafka_cmd, subprocess_env, wait_until

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


@pytest.fixture
def gw(tmp_path: Path) -> Any:
    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0)) as g:
        yield g


def tank(gw: Gateway, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        dafka_cmd("tank", "--broker", f"{HOST}:{gw.tank_port}", *args),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )


def test_follow_from_tail_gets_new_messages_of_every_partition(gw: Gateway) -> None:
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("two", 2)
        assert c.produce("two", 0, [b"old-0"]) == 0 and c.produce("two", 1, [b"old-1"]) == 0
        proc = subprocess.Popen(
            dafka_cmd("tank", "--broker", f"{HOST}:{gw.tank_port}", "consume", "two", "--from", "tail", "--follow",
                      "--count", "6"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
        try:
            wait_until(lambda: gw._parked_all, timeout=30)  # it is at the tail, waiting
            # New messages on both partitions, in three rounds, in both orders.
            assert c.produce_many([("two", 0, [b"a0"]), ("two", 1, [b"a1"])]) == {("two", 0): 0, ("two", 1): 0}
            assert c.produce("two", 1, [b"b1"]) == 0
            assert c.produce("two", 0, [b"b0"]) == 0
            assert c.produce("two", 0, [b"c0"]) == 0
            assert c.produce("two", 1, [b"c1"]) == 0
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise AssertionError(f"6 new messages not all printed; got {out.decode().split()}") from None
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    got = out.decode().split()
    assert sorted(got) == ["a0", "a1", "b0", "b1", "c0", "c1"], got
    assert [m for m in got if m.endswith("0")] == ["a0", "b0", "c0"]  # in order per partition
    assert [m for m in got if m.endswith("1")] == ["a1", "b1", "c1"]


def test_options_between_positional_arguments(gw: Gateway) -> None:
    assert tank(gw, "create", "news", "2").returncode == 0
    out = tank(gw, "produce", "news", "-p", "1", "msg", "more")
    assert out.returncode == 0, out.stderr
    out = tank(gw, "produce", "news", "first", "-k", "K", "second")
    assert out.returncode == 0, out.stderr
    assert tank(gw, "consume", "news", "-p", "1").stdout.split() == ["msg", "more"]
    out = tank(gw, "consume", "-v", "news", "-p", "0")
    assert [line.split("\t")[3:] for line in out.stdout.splitlines()] == [["K", "first"], ["K", "second"]]


def test_gateway_listen_port_alone_says_expected_host_port(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["gateway", "--listen", "11012", "--db", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "expected HOST:PORT" in err and ":11012" in err and "authentication" not in err
    # The same for a Tank client's --broker.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tank", "--broker", "11012", "topics"])
    assert "expected HOST:PORT" in capsys.readouterr().err
    # What was meant still works.
    assert build_parser().parse_args(["gateway", "--listen", ":11012", "--db", "x"]).listen == ("127.0.0.1", 11012)


def test_gateway_process_with_a_port_alone_exits_with_the_address_error(tmp_path: Path) -> None:
    out = subprocess.run(
        dafka_cmd("gateway", "--listen", "11012", "--db", str(tmp_path / "db")),
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )
    assert out.returncode == 2 and "expected HOST:PORT" in out.stderr and "authentication" not in out.stderr


def test_without_broker_it_talks_to_the_configured_gateway(gw: Gateway, tmp_path: Path) -> None:
    config = tmp_path / "dafka.toml"
    config.write_text(f'[gateway]\nlisten = "*:{gw.tank_port}"\n')  # a wildcard host: this machine
    env = dict(subprocess_env(), DAFKA_CONFIG=str(config))
    out = subprocess.run(dafka_cmd("tank", "create", "cfg", "1"), capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cfg" in tank(gw, "topics").stdout
