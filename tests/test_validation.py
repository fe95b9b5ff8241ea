"""Input validation at every boundary: TOML files, NodeConfig, the CLI, publish, the database lock."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dafka.config import SCHEMA, NodeConfig, load_settings, node_config_from
from dafka.errors import ConfigError
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB
from dafka.store.lockfile import DatabaseInUseError
from tests.conftest import (
    dafka_cmd,
    spawned,
    start_store_process,
    subprocess_env,
    tower_flag,
    wait_until,
)


def load(tmp_path: Path, text: str):
    conf = tmp_path / "dafka.toml"
    conf.write_text(text)
    return conf, load_settings(conf)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[node]\nbeacon_interval = "fast"\n', "[node] beacon_interval = 'fast': expected a number"),
        ('[store.retention]\nmax_age_s = "week"\n', "[store.retention] max_age_s = 'week': expected a number > 0"),
        ("[store.retention.topics.m]\nmax_bytes = 0\n", "[store.retention.topics.m] max_bytes = 0: expected an integer"),
        ("[node]\nhwm = -5\n", "[node] hwm = -5: expected an integer from 1"),
        ('[store]\nsync = "no"\n', "[store] sync = 'no': expected true or false"),
        ("[tower]\nbeacon_in_port = 70000\n", "[tower] beacon_in_port = 70000: expected an integer from 0 to 65535"),
        ("[security]\nreload_interval = 0\n", "[security] reload_interval = 0: expected a number > 0"),
        ("[node]\nbeacon_interval = 5.0\n", "beacon_timeout = 4 must be more than beacon_interval = 5"),
        ("[nodes]\ntowers = []\n", "unknown section [nodes] (did you mean [node]?)"),
        ("[store]\nsyncc = true\n", "[store]: unknown key 'syncc' (did you mean 'sync'?)"),
        ("[gateway]\nlisten_on = 'x'\n", "[gateway]: unknown key 'listen_on' (did you mean 'listen'?)"),
        ("[store.retention]\nmax_age = 1\n", "[store.retention]: unknown key 'max_age' (did you mean 'max_age_s'?)"),
        ("[security]\nkeys = 'x'\n", "[security]: unknown key 'keys' (did you mean 'key'?)"),
        ("[tower]\nport = 1\n", "[tower]: unknown key 'port'"),
        ('towers = ["h"]\n', "'towers' belongs in a section: write it under [node]"),
    ],
)
def test_bad_config_files_are_refused_naming_file_section_and_key(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    assert str(tmp_path / "dafka.toml") in str(err.value)
    assert words in str(err.value)


def test_good_config_still_loads(tmp_path: Path) -> None:
    _, settings = load(
        tmp_path,
        "[node]\ntowers = ['127.0.0.1']\nbeacon_interval = 1\nhwm = 1000\nbatches = false\n"
        "[store]\ndb = 'x'\nlinger_ms = 2\n[store.retention]\nmax_age_s = 86400\n"
        "[store.retention.topics.m]\nmax_bytes = 1000\n[tower]\nbeacon_in_port = 6000\n",
    )
    assert settings.node.beacon_interval == 1.0 and isinstance(settings.node.beacon_interval, float)
    assert settings.node.hwm == 1000 and settings.node.batches is False
    assert settings.section("store")["retention"]["topics"]["m"]["max_bytes"] == 1000


def test_embedded_node_config_is_checked_as_the_file_is() -> None:
    with pytest.raises(ConfigError, match=r"\[node\] hwm = -5"):
        NodeConfig(hwm=-5)
    with pytest.raises(ConfigError, match="beacon_interval = 'fast'"):
        NodeConfig(beacon_interval="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key 'hwn'.*'hwm'"):
        node_config_from({"hwn": 5})
    assert NodeConfig(beacon_interval=1).beacon_interval == 1.0


def test_every_schema_table_is_reachable() -> None:
    # Sub-tables named by "table" specs exist, so a new key is one line.
    for specs in SCHEMA.values():
        for spec in specs.values():
            if spec.kind in ("table", "tables"):
                assert spec.table in SCHEMA


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        dafka_cmd(*args), capture_output=True, text=True, env=subprocess_env(), timeout=60, stdin=subprocess.DEVNULL
    )


def one_error(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_cli_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text('[store.retention]\nmax_age_s = "week"\n')
    out = run("--config", str(conf), "store", "--db", str(tmp_path / "db"))
    assert out.returncode == 2
    assert f"{conf} [store.retention] max_age_s = 'week'" in one_error(out)
    conf.write_text("[node]\nhwm = -5\n")
    out = run("--config", str(conf), "consume", "t", "--timeout", "1")
    assert out.returncode == 2
    assert "hwm = -5: expected an integer" in one_error(out)


@pytest.mark.parametrize(
    "args",
    [
        ["consume", "t", "--group", "g", "--commit-interval", "-1"],
        ["consume", "t", "--group", "g", "--commit-timeout", "0"],
        ["status", "--interval", "0"],
        ["status", "--wait", "-2"],
        ["bench", "live", "--records", "0"],
        ["bench", "live", "--runs", "-1"],
        ["bench", "latency", "--seconds", "0"],
    ],
)
def test_cli_numbers_out_of_range_are_usage_errors(args: list[str]) -> None:
    out = run(*args)
    assert out.returncode == 2, out.stderr
    assert "must be" in one_error(out)


# ---------------------------------------------------------------- publish


def test_publish_refuses_what_is_not_bytes_like(cfg: NodeConfig) -> None:
    with Producer("t", cfg, acks=True) as producer:
        with pytest.raises(TypeError, match="not str.*encode"):
            producer.publish("a str")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not int"):
            producer.publish(5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not str"):
            producer.publish_many([b"ok", "no"])  # type: ignore[list-item]
        assert producer.next_offset == 0  # nothing of the refused chunk went out
        # Nothing waits for an ACK: close returns at once, all acknowledged.
        assert producer.close(5)


def test_bytes_like_records_are_delivered(cfg: NodeConfig, tmp_path: Path) -> None:
    from dafka.nodes.consumer import Consumer
    from dafka.store.node import Store

    with Store(tmp_path / "db", cfg), Consumer("t", cfg, offset_reset="earliest") as consumer:
        with Producer("t", cfg) as producer:
            producer.publish(b"a")
            producer.publish(bytearray(b"b"))
            producer.publish(memoryview(b"cc"))
            producer.publish_many([b"d", bytearray(b"e"), memoryview(b"ff")])
            assert producer.flush(20)
        got: list[bytes] = []
        wait_until(lambda: got.extend(r.content for r in consumer.poll_batch(100, 0.1)) or len(got) >= 6, timeout=20)
        assert got == [b"a", b"b", b"cc", b"d", b"e", b"ff"]


# ---------------------------------------------------------------- one writer per database


def test_second_writer_of_a_database_is_refused(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db"):
        with pytest.raises(DatabaseInUseError, match=r"in use by another store \(pid \d+"):
            RecordDB(tmp_path / "db")
    RecordDB(tmp_path / "db").close()  # free again once closed


def test_second_store_process_on_a_db_in_use_is_refused(cfg: NodeConfig, tmp_path: Path) -> None:
    first = start_store_process(cfg, tmp_path / "db")
    out = run("store", "--db", str(tmp_path / "db"), "--tower", tower_flag(cfg), "--bind", "127.0.0.1")
    assert out.returncode == 1
    line = one_error(out)
    assert "in use by another store" in line and f"pid {first.pid}" in line
    first.kill()
    first.wait(10)
    # The kernel dropped the killed holder's lock: a restart is not blocked.
    again = spawned(
        subprocess.Popen(
            dafka_cmd("store", "--db", str(tmp_path / "db"), "--tower", tower_flag(cfg), "--bind", "127.0.0.1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
    )
    assert b"store up" in again.stdout.readline()


def test_every_gateway_limit_is_a_known_key(tmp_path):
    """The [gateway] schema knows every key GatewayLimits reads (a key missing there is refused)."""
    from dafka.config import SCHEMA
    from dafka.tank.limits import GatewayLimits

    assert set(GatewayLimits.keys()) <= set(SCHEMA["gateway"])
