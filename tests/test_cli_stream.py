"""`dafka produce` fed by a live stream (`tail -f app.log | dafka produce logs`), as a real process."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.nodes.consumer import Consumer
from dafka.store.node import Store
from tests.conftest import dafka_cmd, spawned, subprocess_env, tower_flag

pytestmark = pytest.mark.timeout(90)


def producer_process(cfg: NodeConfig, *args: str) -> subprocess.Popen[bytes]:
    return spawned(
        subprocess.Popen(
            dafka_cmd("produce", "logs", "--tower", tower_flag(cfg), *args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
    )


def next_content(consumer: Consumer, timeout: float = 15.0) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = consumer.poll(0.2)
        if record is not None:
            return record.content
    raise AssertionError(f"no record within {timeout}s")


def test_lines_go_out_as_they_arrive_while_the_pipe_stays_open(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "db"), cfg), Consumer("logs", cfg, offset_reset="earliest") as consumer:
        proc = producer_process(cfg)
        assert proc.stdin is not None
        for line in (b"first", b"second"):
            proc.stdin.write(line + b"\n")
            proc.stdin.flush()
            # The pipe stays open (as `tail -f` keeps it): the line is published all the same.
            assert next_content(consumer) == line
            assert proc.poll() is None
        _, err = proc.communicate(timeout=30)  # closes the pipe: the end of the input
    assert proc.returncode == 0, err
    assert b"published 2 records, all acknowledged" in err


def test_ctrl_c_says_how_many_lines_were_read_and_acknowledged(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "db"), cfg), Consumer("logs", cfg, offset_reset="earliest") as consumer:
        proc = producer_process(cfg)
        assert proc.stdin is not None
        proc.stdin.write(b"a\nb\nc\n")
        proc.stdin.flush()
        assert [next_content(consumer) for _ in range(3)] == [b"a", b"b", b"c"]
        proc.send_signal(signal.SIGINT)  # the pipe is still open
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err
    assert b"interrupted: 3 lines read, 3 published, 3 acknowledged" in err, err


def test_ctrl_c_without_a_store_says_none_were_acknowledged(cfg: NodeConfig) -> None:
    with Consumer("logs", cfg, offset_reset="earliest") as consumer:
        proc = producer_process(cfg, "--timeout", "1")
        assert proc.stdin is not None
        proc.stdin.write(b"a\nb\n")
        proc.stdin.flush()
        assert [next_content(consumer) for _ in range(2)] == [b"a", b"b"]  # no store: nobody acknowledges
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err, err
    assert b"interrupted: 2 lines read, 2 published, 0 acknowledged" in err, err


def test_a_second_ctrl_c_stops_waiting_for_acknowledgements(cfg: NodeConfig) -> None:
    with Consumer("logs", cfg, offset_reset="earliest") as consumer:
        proc = producer_process(cfg, "--timeout", "60")
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(b"a\n")
        proc.stdin.flush()
        assert next_content(consumer) == b"a"
        proc.send_signal(signal.SIGINT)
        for _ in range(50):  # bounded: the node's own log lines may come first
            line = proc.stderr.readline()
            if not line or b"waiting up to 60s for 1 acknowledgements" in line:
                break
        assert b"Ctrl-C again to stop now" in line, line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        err = proc.stderr.read()
    assert b"Traceback" not in err, err
    assert b"error: interrupted: 1 lines read, 1 published, 0 acknowledged (1 not)" in err, err


def test_line_batcher_sends_a_slow_line_after_linger_and_fills_batches_of_fast_ones() -> None:
    from dafka.cli.lines import LineBatcher

    b = LineBatcher(linger=0.005, max_lines=3)
    assert b.wait(0.0) is None
    b.feed(b"one\r\ntw", 1.0)
    assert b.wait(1.001) == pytest.approx(0.004)  # the first line waits a little for company
    b.feed(b"o\n", 1.002)
    assert b.wait(1.006) == 0.0 and b.take() == [b"one", b"two"]
    assert b.wait(1.006) is None
    b.feed(b"a\nb\nc\nd\npartial", 2.0)
    assert b.wait(2.0) == 0.0 and b.take() == [b"a", b"b", b"c"]  # full: at once
    assert b.wait(2.0) == pytest.approx(0.005) and b.take() == [b"d"]
    assert b.end() == [b"partial"]  # the last line needs no line end
    assert b.end() == []
