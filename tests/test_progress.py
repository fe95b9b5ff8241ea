"""Progress bars: on stderr under a terminal, never in pipes or files."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading
from pathlib import Path

from dafka.config import NodeConfig
from tests.conftest import dafka_cmd, subprocess_env, tower_flag


def produce_cmd(cfg: NodeConfig, path: Path) -> list[str]:
    flags = ["--no-ack", "--wait-peers", "0", "--linger", "0", "--bind", "127.0.0.1"]
    return dafka_cmd(
        "produce", "progress-t", "--tower", tower_flag(cfg), "--file", str(path), *flags
    )


def big_file(tmp_path: Path) -> Path:
    path = tmp_path / "records.txt"
    path.write_bytes(b"".join(b"record %06d\n" % i for i in range(200_000)))
    return path


def test_no_progress_when_stderr_is_not_a_tty(cfg: NodeConfig, tmp_path: Path) -> None:
    out = subprocess.run(
        produce_cmd(cfg, big_file(tmp_path)), env=subprocess_env(), capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert b"published 200000 records" in out.stderr
    assert b"%|" not in out.stderr and b"\r" not in out.stderr  # no bar, no redraws
    consume = dafka_cmd(
        "consume", "progress-t", "--tower", tower_flag(cfg), "--count", "3", "--timeout", "0.5"
    )
    out = subprocess.run(consume, env=subprocess_env(), capture_output=True, timeout=30)
    assert out.returncode == 1 and b"got 0 of 3" in out.stderr
    assert b"%|" not in out.stderr and b"\r" not in out.stderr


def test_progress_on_a_terminal(cfg: NodeConfig, tmp_path: Path) -> None:
    master, slave = pty.openpty()
    # A fresh pty is 0 columns wide; give it a terminal's size.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        # A pty's buffer is small: read while the command runs, until it closes.
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            produce_cmd(cfg, big_file(tmp_path)),
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=slave,
            timeout=60,
        )
    finally:
        os.close(slave)
    reader.join(5)
    os.close(master)
    tty = b"".join(chunks)
    assert proc.returncode == 0, tty
    assert b"publishing progress-t" in tty and b"%|" in tty
    assert b"published 200000 records" in tty
