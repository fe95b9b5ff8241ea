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
