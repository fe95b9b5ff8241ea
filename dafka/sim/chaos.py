"""Chaos soak with real processes: ``python -m dafka.sim.chaos --minutes M`` (``make chaos``).

A tower, two stores, three producers and two consumers run as separate OS
processes on 127.0.0.1 (the ``dafka`` command line; producers are this
module's ``producer`` subcommand, a small driver over the public
:class:`~dafka.producer.Producer` API with an identity file, so a restart
keeps its partition).  For ``--minutes`` the soak injects, every 1-4 s, one of:
kill -9 of a store, producer, consumer or the tower (restarted after 0.5-4 s),
SIGSTOP/SIGCONT of a store or producer (1-5 s), and a full disk (the first
store's LMDB lives on a small tmpfs, remounted to just its current use and
grown again 3-10 s later; without root, no disk faults).

Each producer appends ``offset<TAB>content`` for every record it published to
a file, and keeps the offset its stores acknowledged in another (written after
the published lines are flushed), so whatever was acknowledged is known after
any kill.  At the end everything is resumed and restarted, the producers flush
and stop, and a consumer reads every partition back from the stores: every
acknowledged record must come back exactly once, in order, with its content.
One line sums up: faults by kind, records acknowledged, read back, lost,
duplicated, reordered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPIC = "chaos"
STORES = 2
PRODUCERS = 3
CONSUMERS = 2
TMPFS_BYTES = 16 << 20
READBACK_SKIP_AFTER = 1.5  # seconds a read-back waits at a hole (see read_back)
READBACK_STALL = 120.0  # the read-back ends after this long without a record
READBACK_MAX = 1800.0  # and after this long in all


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- the producer driver


def run_producer(args: argparse.Namespace) -> int:
    """Publish numbered records until SIGTERM; log what was published and acknowledged."""
    from dafka.errors import BufferFullError, PublishError, ResumeError
    from dafka.nodes.producer import Producer

    d = Path(args.dir)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    incarnation = int(time.time() * 1000)
    prod = Producer(TOPIC, towers=args.tower, identity=d / f"{args.name}.identity", publish_timeout=0.5)
    published = open(d / f"{args.name}.published", "a", buffering=1 << 16)
    acked_path = d / f"{args.name}.acked"
    n = 0
    last_write = 0.0
    try:
        while not stop:
            try:
                r = prod.publish(f"{args.name}|{incarnation}|{n}".encode())
            except ResumeError as exc:
                print(f"producer {args.name}: {exc}", file=sys.stderr)
                return 3
            except (BufferFullError, PublishError):
                time.sleep(0.05)
                continue
            published.write(f"{r.offset}\t{args.name}|{incarnation}|{n}\n")
            n += 1
            now = time.monotonic()
            if now - last_write >= 0.2:
                last_write = now
                _write_acked(published, acked_path, prod.acked_offset, incarnation)
            time.sleep(args.interval)
        prod.flush(timeout=30.0)
        _write_acked(published, acked_path, prod.acked_offset, incarnation)
    finally:
        prod.close(timeout=5.0)
        published.close()
    return 0


def _write_acked(published: object, path: Path, acked: int, incarnation: int) -> None:
    """Append ``incarnation acked``: every incarnation's acknowledgements count at the end."""
    published.flush()  # type: ignore[attr-defined]  # every acknowledged offset's line is on disk first
    with open(path, "a") as f:
        f.write(f"{incarnation} {acked}\n")


# ---------------------------------------------------------------- the soak


class Soak:
    def __init__(self, minutes: float, seed: int, workdir: str | None) -> None:
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="dafka-chaos-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.in_port, self.out_port = _free_port(), _free_port()
        self.tower = f"127.0.0.1:{self.in_port}:{self.out_port}"
        self.procs: dict[str, subprocess.Popen[bytes] | None] = {}
        self.stopped: set[str] = set()
        self.restart_at: dict[str, float] = {}
        self.faults: dict[str, int] = {}
        self.tmpfs: Path | None = None
        self.logs = self.dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.conflicts = 0  # offsets acknowledged to two producer incarnations

    def count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    # -- processes

    def command(self, name: str) -> list[str]:
        py = [sys.executable, "-c", "import sys; from dafka.cli import main; sys.exit(main(sys.argv[1:]))"]
        if name == "tower":
            return [*py, "tower", "--in-port", str(self.in_port), "--out-port", str(self.out_port)]
        if name.startswith("store"):
            i = int(name[5:])
            db = (self.tmpfs / "db") if (i == 0 and self.tmpfs is not None) else (self.dir / name)
            return [*py, "store", "--tower", self.tower, "--db", str(db)]
        if name.startswith("consumer"):
            return [*py, "consume", TOPIC, "--tower", self.tower, "--from-beginning"]
        return [sys.executable, "-m", "dafka.sim.chaos", "producer", "--name", name, "--dir", str(self.dir),
                "--tower", self.tower]

    def start(self, name: str) -> None:
        out = open(self.logs / f"{name}.log", "ab")
        stdout = subprocess.DEVNULL if name.startswith("consumer") else out
        self.procs[name] = subprocess.Popen(self.command(name), stdout=stdout, stderr=out)
        out.close()

    def kill(self, name: str) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            if name in self.stopped:
                p.send_signal(signal.SIGCONT)
                self.stopped.discard(name)
            p.kill()
            p.wait(10)
        self.procs[name] = None

    def names(self) -> list[str]:
        return (
            ["tower"]
            + [f"store{i}" for i in range(STORES)]
            + [f"p{i}" for i in range(PRODUCERS)]
            + [f"consumer{i}" for i in range(CONSUMERS)]
        )

    # -- disk

    def mount_tmpfs(self) -> None:
        path = self.dir / "tmpfs"
        path.mkdir(exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)], capture_output=True
        )
        if r.returncode == 0:
            self.tmpfs = path
        else:
            print(f"chaos: no tmpfs ({r.stderr.decode().strip()}): no full-disk faults", file=sys.stderr)

    def set_disk(self, size: int) -> bool:
        assert self.tmpfs is not None
        r = subprocess.run(["mount", "-o", f"remount,size={size}", str(self.tmpfs)], capture_output=True)
        return r.returncode == 0

    def disk_used(self) -> int:
        assert self.tmpfs is not None
        st = os.statvfs(self.tmpfs)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    # -- the run

    def inject(self, now: float) -> None:
        rng = self.rng
        kind = rng.choice(["kill-store", "kill-producer", "kill-consumer", "kill-tower", "stop-store",
                           "stop-producer", "disk-full", "kill-store", "kill-producer"])
        if kind == "disk-full":
            if self.tmpfs is None or "disk" in self.restart_at:
                return
            if self.set_disk(self.disk_used() + 64 * 1024):
                self.restart_at["disk"] = now + rng.uniform(3, 10)
                self.count(kind)
            return
        if kind.startswith("kill"):
            group = {"kill-store": "store", "kill-producer": "p", "kill-consumer": "consumer", "kill-tower": "tower"}[kind]
            candidates = [n for n in self.names() if n.startswith(group) and self.procs.get(n) is not None]
            if not candidates:
                return
            name = rng.choice(candidates)
            self.kill(name)
            self.restart_at[name] = now + rng.uniform(0.5, 4)
            self.count(kind)
            return
        group = "store" if kind == "stop-store" else "p"
        candidates = [n for n in self.names() if n.startswith(group) and self.procs.get(n) is not None
                      and n not in self.stopped]
        if not candidates:
            return
        name = rng.choice(candidates)
        p = self.procs[name]
        assert p is not None
        p.send_signal(signal.SIGSTOP)
        self.stopped.add(name)
        self.restart_at[f"cont:{name}"] = now + rng.uniform(1, 5)
        self.count(kind)

    def due(self, now: float, everything: bool = False) -> None:
        for key, at in sorted(self.restart_at.items()):
            if at > now and not everything:
                continue
            del self.restart_at[key]
            if key == "disk":
                self.set_disk(TMPFS_BYTES)
            elif key.startswith("cont:"):
                name = key[5:]
                p = self.procs.get(name)
                if p is not None and name in self.stopped:
                    p.send_signal(signal.SIGCONT)
                    self.stopped.discard(name)
            elif self.procs.get(key) is None:
                self.start(key)
        # A producer that exited (refused to resume: no store answered in time) starts again.
        for name, p in self.procs.items():
            if p is not None and p.poll() is not None and name not in self.restart_at:
                self.procs[name] = None
                self.restart_at[name] = now + 1.0
                self.count("restart-after-exit")

    def run(self) -> int:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        self.mount_tmpfs()
        try:
            for name in self.names():
                self.start(name)
            time.sleep(2.0)
            end = time.monotonic() + self.minutes * 60
            next_fault = time.monotonic() + 2.0
            while time.monotonic() < end:
                now = time.monotonic()
                self.due(now)
                if now >= next_fault:
                    self.inject(now)
                    next_fault = now + self.rng.uniform(1, 4)
                time.sleep(0.05)
            # Heal: everything up, then the producers flush and stop.
            self.due(time.monotonic(), everything=True)
            time.sleep(3.0)
            self.due(time.monotonic(), everything=True)
            for i in range(PRODUCERS):
                p = self.procs.get(f"p{i}")
                if p is not None:
                    p.send_signal(signal.SIGTERM)
            for i in range(PRODUCERS):
                p = self.procs.get(f"p{i}")
                if p is not None:
                    try:
                        p.wait(60)
                    except subprocess.TimeoutExpired:
                        self.kill(f"p{i}")
            return self.read_back()
        finally:
            for name in list(self.procs):
                self.kill(name)
            if self.tmpfs is not None:
                subprocess.run(["umount", str(self.tmpfs)], capture_output=True)

    def read_back(self) -> int:
        from dafka.nodes.consumer import Consumer

        expected: dict[str, dict[int, str]] = {}  # partition -> offset -> content (acknowledged)
        for i in range(PRODUCERS):
            name = f"p{i}"
            ident = self.dir / f"{name}.identity"
            acked_file = self.dir / f"{name}.acked"
            if not ident.exists() or not acked_file.exists():
                continue
            address = json.loads(ident.read_text())["address"]
            acked: dict[str, int] = {}  # incarnation -> highest offset acknowledged to it
            for line in acked_file.read_text().splitlines():
                inc, _, off = line.partition(" ")
                if off.lstrip("-").isdigit():
                    acked[inc] = max(acked.get(inc, -1), int(off))
            want_here: dict[int, str] = {}
            with open(self.dir / f"{name}.published") as f:
                for line in f:
                    off, _, content = line.rstrip("\n").partition("\t")
                    parts = content.split("|")
                    if not off.isdigit() or len(parts) != 3:
                        continue
                    if int(off) <= acked.get(parts[1], -1):
                        if int(off) in want_here and want_here[int(off)] != content:
                            # Two incarnations were both acknowledged at this offset:
                            # one of the two records cannot be read back.
                            self.conflicts += 1
                        want_here[int(off)] = content
            expected[address] = want_here
        got: dict[str, list[tuple[int, str]]] = {p: [] for p in expected}
        want = {p: max(offs, default=-1) for p, offs in expected.items()}
        # Every producer crash leaves a hole of reserved offsets nobody published,
        # which a reader waits out for ``skip_after``.  Everything is up and healed
        # by now, so the read-back waits READBACK_SKIP_AFTER instead: a skip that
        # came too early would jump over records and count them lost, so a short
        # wait can make the result worse, never better.
        stall_deadline = time.monotonic() + READBACK_STALL
        hard_deadline = time.monotonic() + READBACK_MAX
        with Consumer(TOPIC, towers=self.tower, offset_reset="earliest", skip_after=READBACK_SKIP_AFTER) as c:
            while time.monotonic() < min(stall_deadline, hard_deadline):
                r = c.poll(timeout=1.0)
                if r is None:
                    if all((got[p][-1][0] if got[p] else -1) >= want[p] for p in expected):
                        break
                    continue
                stall_deadline = time.monotonic() + READBACK_STALL
                if r.partition in got:
                    got[r.partition].append((r.offset, r.content.decode(errors="replace")))
            time.sleep(1.0)
            for r in c.poll_batch(100_000, timeout=0.5):  # anything late (duplicates)
                if r.partition in got:
                    got[r.partition].append((r.offset, r.content.decode(errors="replace")))
        acked_total = sum(len(v) for v in expected.values())
        lost, duplicated, reordered, read = self.conflicts, 0, 0, 0
        for p, records in got.items():
            seen: dict[int, str] = {}
            prev = -1
            for off, content in records:
                read += 1
                if off in seen:
                    duplicated += 1
                elif off < prev:
                    reordered += 1
                seen.setdefault(off, content)
                prev = max(prev, off)
            for off, content in expected[p].items():
                if seen.get(off) != content:
                    lost += 1
        held = self.stores_hold(expected)
        faults = " ".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        print(
            f"chaos {self.minutes:g} min: faults {faults}; records acknowledged {acked_total}, "
            f"read back {read}, lost {lost}, duplicated {duplicated}, reordered {reordered}"
        )
        print("chaos: stores hold " + ", ".join(f"{n} {k} of {acked_total}" for n, k in held.items()))
        return 0 if lost == duplicated == reordered == 0 and acked_total > 0 else 1

    def stores_hold(self, expected: dict[str, dict[int, str]]) -> dict[str, int]:
        """How many acknowledged records each store's database holds, read
        directly once the stores are stopped: the redundancy left after the faults
        (a record needs only one store; the read-back above is the verdict)."""
        from dafka.store.db import RecordDB

        held: dict[str, int] = {}
        for i in range(STORES):
            name = f"store{i}"
            self.kill(name)
            db_dir = (self.tmpfs / "db") if (i == 0 and self.tmpfs is not None) else (self.dir / name)
            try:
                db = RecordDB(str(db_dir), readonly=True)
            except Exception as e:  # noqa: BLE001 - a report line, not the verdict
                print(f"chaos: {name}: cannot open {db_dir}: {e}", file=sys.stderr)
                continue
            n = 0
            try:
                for partition, want in expected.items():
                    for r in db.read(TOPIC, partition, 0, 1 << 62):
                        if want.get(r.offset) == r.content.decode(errors="replace"):
                            n += 1
            finally:
                db.close()
            held[name] = n
        return held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dafka.sim.chaos", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("producer", help="(internal) one producer process of the soak")
    p.add_argument("--name", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--tower", required=True)
    p.add_argument("--interval", type=float, default=0.002)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--dir", help="work directory (default: a new temporary one, removed if all is well)")
    args = ap.parse_args(argv)
    if args.cmd == "producer":
        return run_producer(args)
    soak = Soak(args.minutes, args.seed, args.dir)
    print(f"chaos: seed {args.seed}, {args.minutes:g} min, work directory {soak.dir}", flush=True)
    rc = soak.run()
    if rc == 0 and args.dir is None:
        with contextlib.suppress(OSError):
            shutil.rmtree(soak.dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
