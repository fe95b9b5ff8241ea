"""The dafka command line, run as separate processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

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
        # Every partition by default, in partition order.
        assert [(r[0], r[1], r[3], r[4]) for r in rows] == [
            ("0", "1", "greeting", "hello"),
            ("0", "2", "greeting", "world"),
            ("1", "1", "-", "a"),
            ("1", "2", "-", "b"),
            ("1", "3", "-", "c"),
        ]
        assert tank("consume", "news", "-p", "0").stdout.split() == ["hello", "world"]
        assert tank("consume", "news", "-p", "1", "--from", "2").stdout.split() == ["b", "c"]
        assert tank("consume", "news", "--count", "3").stdout.split() == ["hello", "world", "a"]
        assert tank("partitions", "news").stdout.split("\n")[:2] == ["0\tfirst 1\thwm 2", "1\tfirst 1\thwm 3"]
        assert "news\t2 partitions" in tank("topics").stdout
        assert "version 400" in tank("status").stdout
        missing = tank("consume", "nope")
        assert missing.returncode == 1 and "unknown topic" in missing.stderr


# ---------------------------------------------------------------- errors a user can act on


def error_line(out: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a failed command (and no traceback)."""
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        dafka_cmd(*args), capture_output=True, text=True, env=subprocess_env(), timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["produce", ""], "bad topic"),
        (["--log-level", "bogus", "tower"], "unknown log level 'bogus'"),
        (["tower", "--in-port", "70000"], "bad port 70000"),
        (["tower", "--bind", ""], "bad host"),
        (["consume", "x", "--tower", "h:65536"], "bad tower address"),
        (["consume", "x", "--count", "0"], "must be 1 or more"),
        (["consume", "x", "--timeout", "-1"], "more than 0 seconds"),
        (["gateway", "--db", "d", "--listen", "127.0.0.1:port"], "bad address"),
        (["tank", "--broker", "127.0.0.1:70000", "topics"], "bad port 70000"),
        (["tank", "consume", "t", "-p", "x"], "not a whole number"),
        (["tank", "consume", "t", "--from", "soon"], "use first, tail or a sequence number"),
        (["store"], "--db DIR"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args: list[str], words: str) -> None:
    out = run(*args)
    assert out.returncode == 2, out.stderr
    assert words in error_line(out)


def test_path_errors_name_the_path(tmp_path) -> None:
    in_the_way = tmp_path / "file"
    in_the_way.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["topics", "--db", str(empty)], f"{empty}: no store database here"),
        (["topics", "--db", str(tmp_path / "nope")], "no such directory"),
        (["topics", "--db", str(in_the_way)], "not a directory"),
        (["store", "--db", str(in_the_way / "db"), "--tower", "127.0.0.1:1:2"], "a file is in the way"),
        (["store", "--db", str(in_the_way), "--tower", "127.0.0.1:1:2"], "a file is in the way"),
        (["gateway", "--db", str(in_the_way / "db"), "--listen", "127.0.0.1:0", "--tower", "127.0.0.1:1:2"],
         "a file is in the way"),
        (["up", "--data", str(in_the_way)], "a file is in the way"),
        (["produce", "t", "--file", str(tmp_path / "missing.txt")], "No such file or directory"),
        (["produce", "t", "--identity", str(tmp_path / "nodir" / "id.json")], "does not exist"),
        (["produce", "t", "--identity", str(empty)], "is a directory"),
    ]
    for args, words in cases:
        out = run(*args)
        assert out.returncode == 1, (args, out.stderr)
        line = error_line(out)
        assert words in line and "cannot listen" not in line, (args, line)
        assert str(tmp_path) in line, line


@pytest.mark.parametrize("command", ["store", "gateway"])
def test_db_where_it_may_not_be_created(tmp_path, command: str) -> None:
    if os.geteuid() == 0:
        # Root may write anywhere, but not even root may create a directory in sysfs.
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("no sysfs")
        db = "/sys/dafka-test-db"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        db = str(locked / "db")
    listen = ["--listen", "127.0.0.1:0"] if command == "gateway" else []
    out = run(command, "--db", db, "--tower", "127.0.0.1:1:2", *listen)
    assert out.returncode == 1
    line = error_line(out)
    assert f"database directory {db}: permission denied" in line and "cannot listen" not in line


def test_gateway_port_in_use_says_cannot_listen(tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run("gateway", "--db", str(tmp_path / "gw"), "--listen", f"127.0.0.1:{port}", "--tower", "127.0.0.1:1:2")
    assert out.returncode == 1
    assert f"cannot listen for Tank clients on 127.0.0.1:{port}" in error_line(out)


def test_tower_port_in_use_is_one_line(tower_proc: str) -> None:
    in_port = tower_proc.split(":")[1]
    out = run("tower", "--bind", "127.0.0.1", "--in-port", in_port, "--out-port", "0")
    assert out.returncode == 1
    assert "Address already in use" in error_line(out)


def test_tank_errors(tmp_path) -> None:
    from dafka.config import NodeConfig
    from dafka.tank.gateway import Gateway

    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=("127.0.0.1", 0)) as gw:
        broker = f"127.0.0.1:{gw.tank_port}"
        assert run("tank", "--broker", broker, "create", "t", "2").returncode == 0
        out = run("tank", "--broker", broker, "consume", "t", "-p", "7")
        assert out.returncode == 1
        assert "unknown partition 7 of topic 't'" in error_line(out)
        out = run("tank", "--broker", broker, "consume", "nope")
        assert out.returncode == 1 and "unknown topic 'nope'" in error_line(out)
        # A reader that goes away (`| head`) is no error: quiet, exit 141.
        run("tank", "--broker", broker, "produce", "t", *["x" * 100] * 2000)
        proc = subprocess.Popen(
            dafka_cmd("tank", "--broker", broker, "consume", "t"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
        proc.stdout.readline()
        proc.stdout.close()  # the reader is gone, most of 200 kB still to write
        assert proc.wait(30) == 141
        assert proc.stderr.read() == b""
        proc.stderr.close()
    out = run("tank", "--broker", "nonsense.invalid", "--timeout", "2", "topics")
    assert out.returncode == 1 and "cannot connect to Tank at nonsense.invalid:11011" in error_line(out)
    out = run("tank", "--broker", f"127.0.0.1:{free_port()}", "topics")
    assert out.returncode == 1 and "is a gateway running?" in error_line(out)


def test_consume_without_tower_says_so() -> None:
    towers = f"127.0.0.1:{free_port()}:{free_port()}"
    out = run("consume", "x", "--tower", towers, "--count", "2", "--timeout", "4")
    assert out.returncode == 1
    assert "note: no tower reached at 127.0.0.1" in out.stderr
    line = error_line(out)
    assert "got 0 of 2 records within 4s" in line and "no tower reached" in line


def test_processes_the_tests_start_take_ctrl_c() -> None:
    # The Ctrl-C tests below send SIGINT to a `dafka` process: it must start with
    # SIGINT neither ignored nor blocked, however the suite itself was started
    # (see tests/conftest.py: a shell's background job ignores SIGINT).
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,"
            " signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert probe.stdout.split() == ["True", "False"], (probe.stdout, probe.stderr)


def test_consume_interrupted_exits_130() -> None:
    towers = f"127.0.0.1:{free_port()}:{free_port()}"
    proc = subprocess.Popen(
        dafka_cmd("consume", "x", "--tower", towers, "--count", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        # Without --timeout it does not wait in silence: the note comes first.
        # (the consumer node's own warning may come first)
        lines = [proc.stderr.readline() for _ in range(2)]
        assert any("no tower reached" in line and "still trying" in line for line in lines), lines
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Nones" not in err
    assert "error: interrupted after 0 of 2 records" in err


SIGNAL_IN_THE_LOCK = """
import os, signal
from dafka.cli.common import StopSignals

signals = StopSignals()
# The race, made certain: the signal comes while the main thread holds the stop event's own
# lock (as it does for moments inside Event.wait), and its handler runs right there, at the
# loop's next backward jump.
with signals.stop._cond:
    os.kill(os.getpid(), signal.SIG)
    for _ in range(1000):
        pass
print("code", signals.wait(), flush=True)
"""


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 0)])
def test_a_stop_signal_in_the_middle_of_waiting_never_hangs_a_service(sig: str, code: int) -> None:
    """A service's signal handler took the lock of the event its main thread waits on: a
    SIGTERM at the wrong moment left the service running for good (seen once in a full run)."""
    run = subprocess.run(
        [sys.executable, "-c", SIGNAL_IN_THE_LOCK.replace("signal.SIG)", f"signal.{sig})")],
        capture_output=True, text=True, env=subprocess_env(), timeout=20,
    )
    assert run.stdout.split() == ["code", str(code)], (run.stdout, run.stderr)


SIGNALS_TWICE_IN_ONE_PROCESS = """
import os, signal
from dafka.cli.common import StopSignals

fds = set(os.listdir("/proc/self/fd"))
# Two services in one process (as in-process runs of the CLI): the first constructed waits first.
first, second = StopSignals(), StopSignals()
os.kill(os.getpid(), signal.SIGINT)
print("codes", first.wait(), second.wait(), first.wait(), flush=True)
# A later service in the same process still stops on a signal.
third = StopSignals()
os.kill(os.getpid(), signal.SIGTERM)
print("third", third.wait(), flush=True)
print("wakeup", signal.set_wakeup_fd(-1), "leaked", len(set(os.listdir("/proc/self/fd")) - fds), flush=True)
"""


def test_stop_signals_twice_in_one_process() -> None:
    """The second StopSignals took the wakeup fd and the handlers from the first: the first
    never heard a signal (its wait hung), and the second, done after it, restored the first's
    pipe, already closed (OSError, its own pipe leaked; a reused fd number would have been
    written to on every signal).  wait() twice raised too."""
    run = subprocess.run(
        [sys.executable, "-c", SIGNALS_TWICE_IN_ONE_PROCESS],
        capture_output=True, text=True, env=subprocess_env(), timeout=20,
    )
    assert run.stdout.split("\n")[:3] == ["codes 130 130 130", "third 0", "wakeup -1 leaked 0"], (
        run.stdout, run.stderr)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_services_stop_cleanly_on_signals(tmp_path, sig: int, code: int) -> None:
    in_port, out_port = free_port(), free_port()
    procs = [
        subprocess.Popen(
            dafka_cmd(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        for args in (
            ["tower", "--bind", "127.0.0.1", "--in-port", str(in_port), "--out-port", str(out_port)],
            ["store", "--db", str(tmp_path / "db"), "--tower", f"127.0.0.1:{in_port}:{out_port}"],
        )
    ]
    try:
        for proc in procs:
            assert " up" in proc.stdout.readline()
        for proc in procs:
            proc.send_signal(sig)
        for proc in procs:
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == code, err
            assert "Traceback" not in err
    finally:
        for proc in procs:
            proc.kill()


def test_cli_nodes_bind_loopback_when_every_tower_is(monkeypatch) -> None:
    from dafka.cli import build_parser, node_config
    from dafka.config import load_settings

    monkeypatch.delenv("DAFKA_TOWERS", raising=False)
    monkeypatch.delenv("DAFKA_CONFIG", raising=False)

    def bind(*args: str) -> str:
        return node_config(build_parser().parse_args(["consume", "t", *args]), load_settings()).bind

    assert bind() == "127.0.0.1"
    assert bind("--tower", "localhost:7000") == "127.0.0.1"
    assert bind("--tower", "10.1.2.3") == "*"
    assert bind("--tower", "127.0.0.1", "--tower", "10.1.2.3") == "*"
    assert bind("--tower", "127.0.0.1", "--advertise", "10.1.2.3") == "*"
    assert bind("--bind", "0.0.0.0") == "0.0.0.0"


def test_bench_ctrl_c_stops_every_process_without_traceback() -> None:
    proc = subprocess.Popen(
        dafka_cmd("bench", "live", "--records", "50000000", "--runs", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C sees it
    )
    try:
        assert "tower" in proc.stdout.readline()
        # The benchmark's node process starts after the tower (beside
        # multiprocessing's resource tracker): wait for both.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(_children(proc.pid)) < 2:
            time.sleep(0.1)
        assert len(_children(proc.pid)) >= 2, "no benchmark process started"
        time.sleep(1)  # let it get busy
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out


def _children(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return f.read().split()
    except OSError:
        return []


def test_produce_msgpack_consume_json(tower_proc: str) -> None:
    import json

    import msgpack

    consumer = subprocess.Popen(
        dafka_cmd(
            "consume", "readings", "--tower", tower_proc, "--from-beginning", "--count", "3",
            "--timeout", "60", "--format", "json",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    producer = subprocess.run(
        dafka_cmd(
            "produce", "readings", "--tower", tower_proc, "--no-ack", "--wait-peers", "10", "--linger", "3",
            "--format", "msgpack",
        ),
        input=b'{"device": "d1", "temp": 21.5}\nnot json\n\n[1, "x", null]\n{"nested": {"k": [true]}}\n',
        capture_output=True,
        env=subprocess_env(),
        timeout=60,
    )
    # The line that is not JSON is named and not published; the exit status says so.
    assert producer.returncode == 1, producer.stderr
    assert b"line 2 is not JSON" in producer.stderr and b"published 3 records" in producer.stderr
    out, err = consumer.communicate(timeout=60)
    assert consumer.returncode == 0, err
    assert [json.loads(line) for line in out.splitlines()] == [
        {"device": "d1", "temp": 21.5},
        [1, "x", None],
        {"nested": {"k": [True]}},
    ]
    from dafka.cli.consume import _json_line

    assert _json_line(msgpack.packb({"b": b"\xff\x00ok", 1: float("nan")})) == b'{"b":"\\\\xff\\u0000ok","1":"nan"}'
    assert _json_line(b'{"plain": "json"}') == b'{"plain":"json"}'
    assert _json_line(b"\xc1 neither") is None
    # Hostile nesting: msgpack refuses it, JSON would recurse: reported as neither, no crash.
    assert _json_line(b"\x91" * 100_000 + b"\x01") is None
    assert _json_line(b"[" * 100_000 + b"]" * 100_000) is None
    _json_line(msgpack.packb(nested(900)))  # deep, within msgpack's limit: whatever it gives, no exception


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_up_secure_makes_keys_and_client_configs_that_work(tmp_path) -> None:
    in_port, out_port, tank_port = free_port(), free_port(), free_port()
    ports = tmp_path / "ports.toml"
    ports.write_text(
        f'[tower]\nbeacon_in_port = {in_port}\nbeacon_out_port = {out_port}\n'
        f'[gateway]\nlisten = "127.0.0.1:{tank_port}"\n'
    )
    env = dict(subprocess_env(), DAFKA_CONFIG=str(ports))
    data = tmp_path / "var"

    def up() -> subprocess.Popen:
        proc = subprocess.Popen(
            dafka_cmd("up", "--secure", "--data", str(data)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )
        assert "(secure)" in proc.stdout.readline()
        return proc

    def stop(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130

    proc = up()
    try:
        secret = (data / "keys" / "app.key_secret").read_text()
        producer, consumer = str(data / "producer.toml"), str(data / "consumer.toml")
        out = subprocess.run(dafka_cmd("--config", producer, "produce", "sec"), input="a\nb\n", capture_output=True,
                             text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        read = ["consume", "sec", "--from-beginning", "--count", "2", "--timeout", "20"]
        out = subprocess.run(dafka_cmd("--config", consumer, *read), capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and out.stdout.split() == ["a", "b"], out.stderr
        # A plain node (no key) gets nothing from the secure mesh.
        plain = dict(env, DAFKA_TOWERS=f"127.0.0.1:{in_port}:{out_port}")
        plain.pop("DAFKA_CONFIG")
        out = subprocess.run(dafka_cmd(*read[:-1], "3"), capture_output=True, text=True, env=plain, timeout=60)
        assert out.returncode == 1 and out.stdout == "" and "refused the handshake" in out.stderr
    finally:
        stop(proc)
    # A restart keeps the keys, so configured clients stay allowed.
    stop(up())
    assert (data / "keys" / "app.key_secret").read_text() == secret
