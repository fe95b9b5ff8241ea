"""The "Across hosts" walkthrough (docs/tutorials/across-hosts.md), run as written on three hosts.

Three network namespaces (hosts 1-3, 10.0.0.5-7/24) hang on a bridge that
lives in a fourth namespace, so nothing of the machine's own network changes
and every address exists only inside namespaces this test creates and
deletes (always, also on failure).  The hosts share one filesystem: the
walkthrough's "copy allow/ and each key to its host" is a no-op here.

The commands are parsed from the page's ``<!-- walkthrough: NAME -->``
blocks: ``# host N`` switches host, ``export K=V`` sets a variable on that
host, a line ending in ``&`` is a service (started, ready once it prints its
first line, stopped at the end), any other line must exit 0.  The output of
``dafka consume`` must be exactly the lines fed to ``dafka produce``.  The
secure block runs the config files of ``towers/hosts/`` unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT

HOSTS = {1: "10.0.0.5", 2: "10.0.0.6", 3: "10.0.0.7"}
PREFIX = 24
STEP_TIMEOUT = 60.0
WALKTHROUGH = ROOT / "docs" / "tutorials" / "across-hosts.md"


@dataclass
class Step:
    host: int
    command: str
    background: bool = False


@dataclass
class Walkthrough:
    name: str
    steps: list[Step] = field(default_factory=list)
    env: dict[int, dict[str, str]] = field(default_factory=dict)


def walkthroughs(readme: str) -> dict[str, list[tuple[int, str]]]:
    """``name -> [(host, line)]`` of every walkthrough block of a page."""
    out = {}
    for m in re.finditer(r"<!-- walkthrough: (\w+) -->\s*```sh\n(.*?)```", readme, re.S):
        host = 0
        lines: list[tuple[int, str]] = []
        for raw in m.group(2).splitlines():
            line = raw.strip()
            hm = re.fullmatch(r"# host (\d)\b.*", line)
            if hm:
                host = int(hm.group(1))
            elif line and not line.startswith("#"):
                assert host in HOSTS, f"walkthrough {m.group(1)}: {line!r} before any '# host N'"
                lines.append((host, line))
        out[m.group(1)] = lines
    return out


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


class Hosts:
    """Three namespaces on a bridge (in a fourth); :meth:`close` deletes them all."""

    def __init__(self) -> None:
        tag = f"dk{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.names = {n: f"{tag}h{n}" for n in HOSTS}
        self.made: list[str] = []
        self._make(self.switch)
        self._ip(self.switch, "link", "add", "br0", "type", "bridge")
        self._ip(self.switch, "link", "set", "br0", "up")
        for n, addr in HOSTS.items():
            ns = self.names[n]
            self._make(ns)
            self._check("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{n}", "netns", self.switch)
            self._ip(self.switch, "link", "set", f"p{n}", "master", "br0")
            self._ip(self.switch, "link", "set", f"p{n}", "up")
            self._ip(ns, "addr", "add", f"{addr}/{PREFIX}", "dev", "eth0")
            self._ip(ns, "link", "set", "eth0", "up")
            self._ip(ns, "link", "set", "lo", "up")

    def _make(self, ns: str) -> None:
        self._check("ip", "netns", "add", ns)
        self.made.append(ns)

    def _ip(self, ns: str, *args: str) -> None:
        self._check("ip", "-n", ns, *args)

    @staticmethod
    def _check(*cmd: str) -> None:
        out = _run(*cmd)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")

    def close(self) -> None:
        for ns in reversed(self.made):
            _run("ip", "netns", "del", ns)  # its interfaces (and the bridge) go with it
        self.made.clear()


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): `make test` installs it")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    try:
        made = Hosts()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def dafka_bin() -> Path:
    program = Path(sys.executable).with_name("dafka")
    if not program.exists():
        pytest.skip(f"no dafka script beside {sys.executable} (make setup installs it)")
    return program.parent


def run_walkthrough(name: str, hosts: Hosts, workdir: Path, bin_dir: Path) -> None:
    lines = walkthroughs(WALKTHROUGH.read_text())[name]
    base = dict(os.environ)
    for key in ("DAFKA_TOWERS", "DAFKA_CONFIG"):
        base.pop(key, None)
    base["PATH"] = f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"
    base["PYTHONPATH"] = str(ROOT) + os.pathsep + base.get("PYTHONPATH", "")
    env = {n: dict(base) for n in HOSTS}
    services: list[tuple[str, subprocess.Popen, Path]] = []
    produced: list[str] | None = None
    consumed = False
    try:
        for i, (host, line) in enumerate(lines):
            export = re.fullmatch(r"export (\w+)=(\S+)", line)
            if export:
                env[host][export.group(1)] = export.group(2)
                continue
            where = f"walkthrough {name}, host {host}: {line}"
            cmd = ["ip", "netns", "exec", hosts.names[host], "sh", "-c", line.removesuffix("&").strip()]
            if line.endswith("&"):
                log = workdir / f"{name}-{i}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        cmd, cwd=workdir, env=env[host], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                services.append((line, proc, log))
                deadline = time.monotonic() + STEP_TIMEOUT
                while not log.read_text(errors="replace").strip():  # ready: its first line
                    assert proc.poll() is None, f"{where} exited: {log.read_text(errors='replace')}"
                    assert time.monotonic() < deadline, f"{where}: nothing printed"
                    time.sleep(0.05)
                continue
            out = subprocess.run(cmd, cwd=workdir, env=env[host], capture_output=True, text=True, timeout=STEP_TIMEOUT)
            assert out.returncode == 0, f"{where} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            feed = re.fullmatch(r"(.+?)\s*\|\s*dafka .*\bproduce\b.*", line)
            if feed:
                produced = subprocess.run(["sh", "-c", feed.group(1)], capture_output=True, text=True).stdout.splitlines()
            if re.search(r"\bdafka\b.*\bconsume\b", line):
                assert produced, f"{where}: nothing was produced before"
                got = out.stdout.splitlines()
                assert len(got) == len(produced) and sorted(got) == sorted(produced), (
                    f"{where}: {len(got)} of {len(produced)} records arrived"
                )
                consumed = True
            if re.search(r"\bdafka\b.*\bdoctor\b", line):
                assert "FAIL" not in out.stdout and "ok   reachable from peers" in out.stdout, out.stdout
                assert name == "secure" or "ok   reachable from the tower's side" in out.stdout, out.stdout
    finally:
        for _, proc, _ in services:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in services:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
    assert consumed, f"walkthrough {name} consumed nothing"


def test_the_page_has_both_walkthroughs_on_three_hosts() -> None:
    found = walkthroughs(WALKTHROUGH.read_text())
    assert set(found) == {"plain", "secure"}
    for lines in found.values():
        assert {host for host, _ in lines} == set(HOSTS)
    # The secure one runs the shipped three-host files.
    used = {m for _, line in found["secure"] for m in re.findall(r"towers/hosts/\w+\.toml", line)}
    assert used == {f"towers/hosts/{n}.toml" for n in ("tower", "store", "producer", "consumer")}
    assert used == {str(p.relative_to(ROOT)) for p in (ROOT / "towers" / "hosts").glob("*.toml")}


@pytest.mark.parametrize("name", ["plain", "secure"])
def test_walkthrough_on_three_hosts(name: str, hosts: Hosts, dafka_bin: Path, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "towers", tmp_path / "towers")
    run_walkthrough(name, hosts, tmp_path, dafka_bin)


def test_a_store_on_loopback_with_a_tower_on_another_host_stops_at_once(
    hosts: Hosts, dafka_bin: Path, tmp_path: Path
) -> None:
    # The trap of a new user: the store's defaults with a tower on host 1.
    env = dict(os.environ, DAFKA_TOWERS=HOSTS[1], PYTHONPATH=str(ROOT))
    started = time.monotonic()
    out = subprocess.run(
        ["ip", "netns", "exec", hosts.names[2], str(dafka_bin / "dafka"), "store", "--db", str(tmp_path / "db")],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
        env=env,
    )
    assert out.returncode == 2 and time.monotonic() - started < 20
    assert out.stderr.count("\n") == 1 and "--bind ADDR" in out.stderr and "--insecure" in out.stderr, out.stderr


class Netns:
    """Processes in the namespaces of ``hosts``, each killed at the end (see :meth:`close`)."""

    def __init__(self, hosts: Hosts, workdir: Path) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))
        for key in ("DAFKA_TOWERS", "DAFKA_CONFIG"):
            self.env.pop(key, None)
        self.procs: list[subprocess.Popen] = []
        self.lines: dict[int, list[str]] = {}

    def start(self, host: int, *argv: str, ready: str | None = None) -> subprocess.Popen:
        """``argv`` (a python program or ``-m`` module) on host ``host``; waits for a line holding ``ready``."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts.names[host], sys.executable, *argv],
            cwd=self.workdir, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        lines = self.lines[proc.pid] = []
        threading.Thread(target=self._read, args=(proc, lines), daemon=True).start()
        if ready is not None:
            deadline = time.monotonic() + STEP_TIMEOUT
            while not any(ready in line for line in lines):
                assert proc.poll() is None, f"{argv[:3]} exited: {lines} {proc.stderr.read()[-3000:]}"  # type: ignore[union-attr]
                assert time.monotonic() < deadline, f"{argv[:3]}: no {ready!r} line"
                time.sleep(0.02)
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, lines: list[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())

    def dafka(self, host: int, *args: str, ready: str) -> subprocess.Popen:
        return self.start(host, "-m", "dafka.cli", *args, ready=ready)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_two_bridged_regions(hosts: Hosts, tmp_path: Path) -> None:
    """Two regions (host 1: A, host 2: B), each a tower and a store with a leaf port, the towers bridged;
    a leaf device in each (B's on host 3); a consumer of region A reads B's leaf; B's store killed -9
    and restarted while B's device publishes loses nothing it acknowledged, and duplicates nothing."""
    a, b = HOSTS[1], HOSTS[2]
    run = Netns(hosts, tmp_path)
    try:
        run.dafka(1, "tower", "--bind", a, "--insecure", "--bridge", b, ready="tower up")
        run.dafka(2, "tower", "--bind", b, "--insecure", "--bridge", a, ready="tower up")
        store = ("store", "--insecure")
        run.dafka(1, *store, "--db", "a", "--tower", a, "--bind", a, "--leaves", f"{a}:7700", ready="store up")
        store_b = ("--db", "b", "--tower", b, "--bind", b, "--leaves", f"{b}:7700")
        run.dafka(2, *store, *store_b, ready="store up")
        device = str(ROOT / "tests" / "leaf_device.py")
        total_a, total_b = 100, 300
        dev_a = run.start(1, device, f"{a}:7700", "a.json", str(total_a), "0.01", "1.0", ready="start ")
        dev_b = run.start(3, device, f"{b}:7700", "b.json", str(total_b), "0.01", "1.0", ready="start ")

        def address(dev: subprocess.Popen) -> str:
            return next(x for x in run.lines[dev.pid] if x.startswith("start ")).split()[2]

        def acked(dev: subprocess.Popen) -> int:
            return max((int(x.split()[1]) for x in list(run.lines[dev.pid]) if x.startswith("acked ")), default=-1)

        reader = run.start(1, str(ROOT / "tests" / "region_reader.py"), a, a, "60",
                           f"{address(dev_b)}={total_b}", f"{address(dev_a)}={total_a}", ready="ready")
        deadline = time.monotonic() + STEP_TIMEOUT
        while acked(dev_b) < 50:
            assert time.monotonic() < deadline and dev_b.poll() is None, run.lines[dev_b.pid][-5:]
            time.sleep(0.02)
        victim = run.procs[3]  # B's store
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
        acked_before = acked(dev_b)  # B's store acknowledged at least this much before it died
        run.dafka(2, *store, *store_b, ready="store up")
        for dev in (dev_a, dev_b):
            assert dev.wait(STEP_TIMEOUT) == 0, run.lines[dev.pid][-5:]
        assert reader.wait(STEP_TIMEOUT) == 0, run.lines[reader.pid]
        assert run.lines[reader.pid][1:] == [f"{address(dev_b)} got {total_b} dup 0 bad 0",
                                             f"{address(dev_a)} got {total_a} dup 0 bad 0"]
        restarted = run.procs[-1]
        os.killpg(restarted.pid, signal.SIGTERM)
        assert restarted.wait(15) == 0
    finally:
        run.close()
    from dafka.store.db import RecordDB

    db = RecordDB(str(tmp_path / "b"))
    try:
        held = {r.offset: r.content for r in db.read("readings", address(dev_b), 0, total_b)}
    finally:
        db.close()
    assert acked_before >= 50 and all(held.get(i) == b"rec-%d" % i for i in range(acked_before + 1))
