"""``dafka bench tank --broker HOST:PORT``: the same client measured against any Tank broker."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

from dafka.bench.common import disk_mb_s
from dafka.bench.tank import bench_tank
from dafka.config import NodeConfig
from dafka.tank.gateway import Gateway


@pytest.mark.timeout(120)
def test_bench_tank_measures_a_broker_given_by_address(tmp_path: Path) -> None:
    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=("127.0.0.1", 0)) as gw:
        args = argparse.Namespace(broker=f"127.0.0.1:{gw.tank_port}", runs=2, records=2000, size=50, no_sync=False)
        got = bench_tank(args)
        assert len(got["tank publish"]) == 2 and len(got["tank fetch"]) == 2
        assert min(got["tank publish"] + got["tank fetch"]) > 0
        assert len([t for t in gw.db.topics() if t.startswith("bench-tank-")]) == 2  # a topic a run


def test_bench_tank_refuses_a_broker_without_a_port() -> None:
    with pytest.raises(SystemExit, match="HOST:PORT"):
        bench_tank(argparse.Namespace(broker="localhost", runs=1, records=1000, size=10, no_sync=False))


@pytest.mark.timeout(180)
def test_bench_tank_against_a_broker_alternates_and_gives_each_round_s_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Our own gateway plays the broker here (the TANK broker is not built on CI machines).
    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=("127.0.0.1", 0)) as gw:
        args = argparse.Namespace(against=f"127.0.0.1:{gw.tank_port}", broker=None, runs=2, records=2000, size=50,
                                  no_sync=True, window=4, warm_mb=2)
        got = bench_tank(args)
        assert len(got["tank publish (broker)"]) == 2 and len(got["tank publish (gateway)"]) == 2
        assert min(got["tank publish (broker)"] + got["tank publish (gateway)"]) > 0
        assert len([t for t in gw.db.topics() if t.startswith("bench-tank-")]) == 2  # a topic a run there
    out = capsys.readouterr().out
    assert out.count("x\n") == 2 and "tank publish gateway/broker: median" in out
    with pytest.raises(SystemExit, match="HOST:PORT"):
        bench_tank(argparse.Namespace(against="localhost", broker=None, runs=1, records=1000, size=10, no_sync=True,
                                      window=8, warm_mb=0))


@pytest.mark.timeout(180)
def test_bench_tank_gives_a_synced_publish_as_a_share_of_the_disk_measured_before_each_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the probe and the database go here
    args = argparse.Namespace(broker=None, against=None, runs=2, records=2000, size=50, no_sync=False, window=4,
                              disk_mb=2)
    got = bench_tank(args)
    assert len(got["tank publish"]) == 2 and min(got["tank publish"]) > 0
    out = capsys.readouterr().out
    assert out.count("of the disk's") == 2 and "tank publish / disk: median" in out
    assert list(tmp_path.iterdir()) == []  # the probe's file and the database are gone
    # Without fsync there is nothing to compare with the disk.
    bench_tank(argparse.Namespace(**{**vars(args), "no_sync": True, "runs": 1}))
    assert "disk" not in capsys.readouterr().out


def test_disk_probe_writes_what_it_is_asked_and_leaves_nothing(tmp_path: Path) -> None:
    assert disk_mb_s(str(tmp_path), 3) > 0
    assert list(tmp_path.iterdir()) == []
