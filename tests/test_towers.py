"""The shipped service files in towers/: consistent configs and units systemd accepts."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dafka.config import load_settings, parse_listen
from tests.conftest import ROOT

TOWERS = ROOT / "towers"
UNITS = sorted(TOWERS.glob("*.service"))
INSTALLED_DAFKA = "/opt/dafka/.venv/bin/dafka"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(TOWERS / name)
    return parser


def test_units_start_after_the_network_they_want() -> None:
    assert [u.name for u in UNITS] == ["dafka-gateway.service", "dafka-store.service", "dafka-tower.service"]
    for path in UNITS:
        u = unit(path.name)["Unit"]
        assert "network-online.target" in u["Wants"].split(), path.name
        assert "network-online.target" in u["After"].split(), path.name
        assert INSTALLED_DAFKA in unit(path.name)["Service"]["ExecStart"]


@pytest.mark.parametrize("name", ["store", "gateway"])
def test_each_store_has_its_own_state_directory(name: str) -> None:
    service = unit(f"dafka-{name}.service")["Service"]
    state = service["StateDirectory"]
    other = unit(f"dafka-{'gateway' if name == 'store' else 'store'}.service")["Service"]["StateDirectory"]
    assert state != other and not state.startswith(other) and not other.startswith(state)
    settings = load_settings(TOWERS / f"{name}.toml")
    assert settings.section(name)["db"] == f"/var/lib/{state}"


def test_shipped_configs_stay_on_loopback() -> None:
    assert load_settings(TOWERS / "tower.toml").section("tower")["bind"] == "127.0.0.1"
    for name in ("store", "gateway"):
        settings = load_settings(TOWERS / f"{name}.toml")
        assert settings.node.bind == "127.0.0.1"
        assert [t.host for t in settings.node.towers] == ["127.0.0.1"]
    listen = load_settings(TOWERS / "gateway.toml").section("gateway")["listen"]
    assert parse_listen(listen, 0) == ("127.0.0.1", 11011)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point the copies at this
    # environment's dafka (or Python) instead of the install path.
    program = Path(sys.executable).with_name("dafka")
    if not program.exists():
        program = Path(sys.executable)
    for path in UNITS:
        (tmp_path / path.name).write_text(path.read_text().replace(INSTALLED_DAFKA, str(program)))
    out = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / p.name) for p in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if "dafka" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr
