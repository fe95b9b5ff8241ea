"""Messages of the command line that used to mislead (issue 34): each says what is wrong, and where."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import dafka_cmd, subprocess_env

pytestmark = pytest.mark.timeout(120)


def run(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        dafka_cmd(*args), capture_output=True, text=True, env=env or subprocess_env(), timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The single ``error:`` line of a failed command (and no traceback)."""
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- config file encodings

CONFIG = '[node]\ntowers = ["10.1.2.3:7000:7001"]  # café\n'


@pytest.mark.parametrize(
    ("encoding", "name"),
    [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32"),
     ("latin-1", "not UTF-8")],
)
def test_a_config_file_not_in_utf8_is_one_error_line_naming_file_and_encoding(
    tmp_path: Path, encoding: str, name: str
) -> None:
    config = tmp_path / "dafka.toml"
    config.write_bytes(CONFIG.encode(encoding))
    out = run("--config", str(config), "topics", "--db", str(tmp_path))
    assert out.returncode == 2, out.stderr
    line = error_line(out)
    assert str(config) in line and name in line and "save it as UTF-8" in line, line


def test_a_config_file_with_a_utf8_bom_is_read(tmp_path: Path) -> None:
    from dafka.config import load_settings

    config = tmp_path / "dafka.toml"
    config.write_bytes(CONFIG.encode("utf-8-sig"))  # as Notepad saves "UTF-8 with BOM"
    assert [t.host for t in load_settings(config).node.towers] == ["10.1.2.3"]


# ---------------------------------------------------------------- messages that misled


def test_kafka_port_in_use_is_named_as_the_kafka_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run(
            "gateway", "--db", str(tmp_path / "gw"), "--listen", "127.0.0.1:0",
            "--kafka-listen", f"127.0.0.1:{port}", "--tower", "127.0.0.1:1:2",
        )
    assert out.returncode == 1
    line = error_line(out)
    assert f"cannot listen for Kafka clients on 127.0.0.1:{port}" in line, line
    assert "Tank" not in line and "127.0.0.1:0" not in line, line
    assert "another process" in line, line  # the hint the tower gives too


def test_tank_port_in_use_is_named_as_the_tank_port_with_a_hint(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run(
            "gateway", "--db", str(tmp_path / "gw"), "--listen", f"127.0.0.1:{port}",
            "--kafka-listen", "127.0.0.1:0", "--tower", "127.0.0.1:1:2",
        )
    assert out.returncode == 1
    line = error_line(out)
    assert f"cannot listen for Tank clients on 127.0.0.1:{port}" in line and "another process" in line, line


def test_gateway_says_which_tower_it_uses_and_that_none_answers(tmp_path: Path) -> None:
    in_port, out_port = free_port(), free_port()
    towers = f"127.0.0.1:{in_port}:{out_port}"
    proc = subprocess.Popen(
        dafka_cmd("gateway", "--db", str(tmp_path / "gw"), "--listen", "127.0.0.1:0", "--tower", towers),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        up = proc.stdout.readline()
        assert "gateway up" in up and f"tower 127.0.0.1:{in_port}/{out_port}" in up, up
        note = ""
        for _ in range(20):  # bounded: the node's own log lines may come first
            note = proc.stderr.readline()
            if note.startswith("note:") or not note:
                break
        assert note.startswith("note: no tower reached at 127.0.0.1"), note
    finally:
        proc.terminate()
        proc.wait(20)


def test_tower_with_the_same_in_and_out_port_says_they_must_differ() -> None:
    port = str(free_port())
    out = run("tower", "--in-port", port, "--out-port", port)
    assert out.returncode == 2
    line = error_line(out)
    assert "--in-port and --out-port must differ" in line and "another process" not in line, line


@pytest.mark.parametrize(
    "args",
    [
        ["produce", "t" * 1000],
        ["consume", "t" * 1000],
        ["tank", "--broker", "127.0.0.1:1", "consume", "t" * 1000],
        ["tank", "--broker", "127.0.0.1:1", "produce", "t" * 1000, "x"],
        ["tank", "--broker", "127.0.0.1:1", "create", "t" * 1000],
        ["tank", "--broker", "127.0.0.1:1", "partitions", "t" * 1000],
    ],
)
def test_an_over_long_topic_is_refused_clearly_and_not_echoed_whole(args: list[str]) -> None:
    out = run(*args)
    assert out.returncode == 2, out.stderr
    line = error_line(out)
    assert "topic" in line and "1000 bytes" in line and "at most 255" in line, line
    assert "str8" not in line and "t" * 100 not in line, line
    assert len(line) < 300, line


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tower", "127.0.0.1:1", "consume", "x"], "--tower goes after the command: dafka consume ... --tower"),
        (["--timeout", "3", "consume", "x"], "--timeout goes after the command: dafka consume ... --timeout"),
        (["--db=/x", "topics"], "--db goes after the command: dafka topics ... --db"),
        (["--no-such-thing", "consume", "x"], "unknown option --no-such-thing"),
    ],
)
def test_a_command_option_before_the_command_says_where_it_goes(argv: list[str], words: str) -> None:
    out = run(*argv)
    assert out.returncode == 2, out.stderr
    line = error_line(out)
    assert words in line and "invalid choice" not in line, line


def test_topics_of_a_topic_the_store_does_not_hold_is_an_error(tmp_path: Path) -> None:
    from dafka.store.db import RecordDB

    db = tmp_path / "db"
    with RecordDB(str(db)):
        pass
    out = run("topics", "--db", str(db), "nosuchtopic")
    assert out.returncode == 1, out.stdout
    assert out.stdout == "", out.stdout  # no header for nothing
    assert f"no topic 'nosuchtopic' in {db}" in error_line(out)


def test_consume_that_never_reached_a_tower_fails_without_count() -> None:
    towers = f"127.0.0.1:{free_port()}:{free_port()}"
    out = run("consume", "x", "--tower", towers, "--timeout", "2")
    assert out.returncode == 1, out.stderr
    line = error_line(out)
    assert "no tower reached at 127.0.0.1" in line and "0 records" in line, line


def test_an_empty_outbox_shows_no_offset_range(tmp_path: Path) -> None:
    from dafka.outbox import OutboxDB

    OutboxDB(str(tmp_path / "ob")).close()
    out = run("outbox", str(tmp_path / "ob"))
    assert out.returncode == 0, out.stderr
    assert "..-1" not in out.stdout and "1..0" not in out.stdout, out.stdout
    assert "offsets    none unacknowledged (next " in out.stdout, out.stdout


def test_bench_help_lists_benchmarks_each_with_its_own_options() -> None:
    top = run("bench", "--help")
    assert top.returncode == 0, top.stderr
    for name in ("live", "store", "spark", "scale", "latency"):
        assert name in top.stdout
    for option in ("--transport", "--nodes", "--rate", "--records"):
        assert option not in top.stdout, top.stdout  # each benchmark shows its own
    spark = run("bench", "spark", "--help")
    assert spark.returncode == 0 and "--transport" in spark.stdout and "--nodes" not in spark.stdout, spark.stdout
    scale = run("bench", "scale", "--help")
    assert "--nodes" in scale.stdout and "--transport" not in scale.stdout and "--records" not in scale.stdout
    wrong = run("bench", "live", "--nodes", "5")
    assert wrong.returncode == 2 and "--nodes" in error_line(wrong)


def test_up_secure_on_the_data_folder_of_a_plain_mesh_says_to_start_fresh(tmp_path: Path) -> None:
    import signal

    from dafka.store.db import RecordDB

    data = tmp_path / "var"
    with RecordDB(str(data / "store")):
        pass  # what `make run` (a plain `dafka up`) left
    ports = tmp_path / "ports.toml"
    ports.write_text(
        f"[tower]\nbeacon_in_port = {free_port()}\nbeacon_out_port = {free_port()}\n"
        f'[gateway]\nlisten = "127.0.0.1:{free_port()}"\n'
    )
    proc = subprocess.Popen(
        dafka_cmd("up", "--secure", "--data", str(data)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=dict(subprocess_env(), DAFKA_CONFIG=str(ports)),
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the others follow at once; Ctrl-C only sets a flag meanwhile
        assert "(secure)" in first, first
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()  # to the end: the process exits
        assert proc.wait(30) == 130
    finally:
        proc.kill()
    lines = [first, *rest.splitlines()]
    notes = [line for line in lines if line.startswith("note")]
    assert notes and "holds the store of a plain mesh" in notes[0] and "fresh --data folder" in notes[0], lines


def test_topic_names_the_mesh_side_accepts() -> None:
    from dafka.config import parse_topic
    from dafka.errors import ConfigError

    for name in ("has space", "a/b", "température", "__x", "t" * 255, "é" * 127):
        assert parse_topic(name) == name  # the mesh and the Tank port take them (docs/reference/cli.md)
    for name, words in (("", "1 to 255 bytes"), ("t" * 256, "256 bytes, at most 255"),
                        ("é" * 128, "256 bytes, at most 255"), ("a\x00b", "NUL")):
        with pytest.raises(ConfigError, match=words):
            parse_topic(name)


def test_options_that_belong_before_the_command_still_work_there() -> None:
    from dafka.cli import build_parser, option_before_command

    parser = build_parser()
    for argv in (
        ["--config", "c.toml", "--log-level", "debug", "consume", "x", "--tower", "h"],
        ["--conf=c.toml", "--log", "debug", "topics"],  # argparse's unique prefixes
        ["--version"],
        ["consume", "x", "--tower", "h"],
    ):
        assert option_before_command(parser, argv) is None, argv
