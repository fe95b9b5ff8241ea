"""What an observer costs the mesh: ``python -m dafka.console.cost``.

Not part of ``make test`` (``make console-cost``).  The transfer of ``dafka
bench live`` (one producer process -> one consumer, through a mesh with a
tower; ``--store`` adds a store process and acknowledged records), run with no
observer, with ``dafka status --watch`` attached, and with ``dafka console``
attached and one page open on it (its event stream read), the three in turn,
``--rounds`` times in one sitting (the order rotates each round, so the
machine's load drifts over all three alike).  Per run: the consumer's
records/s, and the observer process's CPU seconds over the transfer and over
``--idle`` seconds of the mesh at rest after it (the producer still beaconing
its head; with ``--store`` also the store's CPU then: what the observer's
questions cost it).  Prints one line per run and a JSON summary (medians per observer).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from dafka.bench.common import _mesh
from dafka.bench.live import _live_producer
from dafka.config import NodeConfig

OBSERVERS = ("none", "status", "console")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tower_flag(cfg: NodeConfig) -> str:
    t = cfg.towers[0]
    return f"{t.host}:{t.in_port}:{t.out_port}"


def _read_events(host: str, port: int, stop: threading.Event) -> None:
    """An open page: read the console's event stream until told to stop."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/events")
        resp = conn.getresponse()
        while not stop.is_set():
            if not resp.fp.readline(1 << 24):
                break
    except OSError:
        pass
    finally:
        conn.close()


def _observer(kind: str, cfg: NodeConfig) -> tuple[subprocess.Popen[bytes] | None, threading.Event]:
    stop = threading.Event()
    base = [sys.executable, "-m", "dafka.cli", "--log-level", "WARNING"]
    if kind == "none":
        return None, stop
    if kind == "status":
        proc = subprocess.Popen(
            [*base, "status", "--watch", "--interval", "1", "--tower", _tower_flag(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return proc, stop
    proc = subprocess.Popen(
        [*base, "console", "--tower", _tower_flag(cfg), "--listen", "127.0.0.1:0", "--interval", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "console up" not in line:
        raise RuntimeError(f"the console did not start: {line!r}")
    url = urllib.parse.urlsplit(line.split()[2])
    threading.Thread(target=_read_events, args=(url.hostname, url.port, stop), daemon=True).start()
    return proc, stop


def one_run(kind: str, records: int, size: int, idle: float, store: bool, run: int) -> dict[str, Any]:
    from dafka.nodes.consumer import Consumer

    ctx = mp.get_context("spawn")
    tower, cfg = _mesh()
    procs: list[Any] = []
    workdir = tempfile.mkdtemp(prefix="dafka-console-cost-")
    observer, stop = None, threading.Event()
    store_pid: int | None = None
    try:
        if store:
            store_proc = subprocess.Popen(
                [sys.executable, "-m", "dafka.cli", "--log-level", "WARNING", "store", "--db", str(Path(workdir) / "db"),
                 "--tower", _tower_flag(cfg), "--bind", "127.0.0.1"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            procs.append(store_proc)
            assert store_proc.stdout is not None
            if b"store up" not in store_proc.stdout.readline():
                raise RuntimeError("the store did not start")
            store_pid = store_proc.pid
        observer, stop = _observer(kind, cfg)
        topic = f"cost-{kind}-{run}"
        consumer = Consumer(topic, cfg, offset_reset="earliest")
        start, done = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_live_producer, args=(cfg, topic, records, size, start, done))
        proc.start()
        expected = 1 + (observer is not None) + store
        deadline = time.monotonic() + 30
        while len(consumer.peers) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # subscriptions both ways, the observer's first views
        cpu0 = cpu_seconds(observer.pid) if observer else 0.0
        start.set()
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 300
        while got < records and time.monotonic() < deadline:
            got += len(consumer.poll_batch(100_000, 1.0))
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_seconds(observer.pid) if observer else 0.0
        store1 = cpu_seconds(store_pid) if store_pid else 0.0
        time.sleep(idle)  # the mesh at rest, the observer still watching
        cpu2 = cpu_seconds(observer.pid) if observer else 0.0
        store2 = cpu_seconds(store_pid) if store_pid else 0.0
        done.set()
        proc.join(30)
        consumer.close()
        return {
            "observer": kind,
            "records_per_s": round(got / elapsed) if got >= records else None,
            "seconds": round(elapsed, 3),
            "observer_cpu_s": round(cpu1 - cpu0, 3),
            "observer_cpu_pct": round(100 * (cpu1 - cpu0) / elapsed, 1),
            "idle_cpu_pct": round(100 * (cpu2 - cpu1) / idle, 2) if idle else None,
            # what the observer's questions (GET-HEADS, GET-POSITIONS) cost the store at rest
            "store_idle_cpu_pct": round(100 * (store2 - store1) / idle, 2) if idle and store_pid else None,
        }
    finally:
        stop.set()
        for p in [observer, *procs]:
            if p is not None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        tower.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dafka.console.cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of the mesh at rest measured after each transfer")
    ap.add_argument("--store", action="store_true", help="a store process on the mesh too (heads, ACKs, GET-HEADS)")
    args = ap.parse_args(argv)
    # Stopped (timeout, kill): end through the finally blocks, which stop the processes started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = OBSERVERS[r % 3 :] + OBSERVERS[: r % 3]
        for kind in order:
            row = one_run(kind, args.records, args.size, args.idle, args.store, r)
            runs.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for kind in OBSERVERS:
        rows = [x for x in runs if x["observer"] == kind]
        rates = [x["records_per_s"] for x in rows if x["records_per_s"]]
        summary[kind] = {
            "records_per_s_median": round(statistics.median(rates)) if rates else None,
            "records_per_s": rates,
            "observer_cpu_pct_median": statistics.median(x["observer_cpu_pct"] for x in rows),
            "idle_cpu_pct_median": statistics.median(x["idle_cpu_pct"] or 0 for x in rows),
            "store_idle_cpu_pct_median": (
                statistics.median(x["store_idle_cpu_pct"] for x in rows) if args.store else None
            ),
        }
    print(json.dumps({"records": args.records, "size": args.size, "store": args.store, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
