"""The console's memory soak: ``python -m dafka.console.soak --minutes 60``.

Not part of ``make test`` (``make console-soak``).  Starts, on loopback, a
tower and a store (processes), a ``dafka console`` process attached to the
tower only, and in this process a small busy mesh: producers publishing
``--rate`` records a second in all over two topics (one producer replaced by a
new one every ``--churn`` seconds, as producers come and go), a consumer group
member committing as it goes, and web clients: one event stream kept open,
event streams opened and dropped mid-stream, and the JSON API and record
browser read every few seconds.  The console's resident memory (``VmRSS``) is
sampled every ``--sample`` seconds into a CSV and summed up at the end (start,
10, 30 and 60 minutes, and the highest).  Every loop is bounded by the
``--minutes`` deadline.  With ``--browser`` a real page is open too: Debian's
headless Chromium (selenium, as the browser test) with the landing page in one
tab and a topic page in another, their JavaScript heaps
(``performance.memory.usedJSHeapSize``) and Chromium's PSS sampled as well.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from dafka.config import NodeConfig, TowerAddress
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer

log = logging.getLogger("dafka.console.soak")

TOPICS = ("soak-a", "soak-b<script>alert(1)</script>")


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and its parts: RssAnon (the heap: what a leak grows) and RssFile
    (mapped files, e.g. the pages of an LMDB read with --db, reclaimable)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in ("VmRSS", "RssAnon", "RssFile"):
                out[name] = int(line.split()[1])
    return out


def pss_kb(pid: int) -> int:
    """Proportional set size (shared pages split among their processes)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def tree_pss_kb(root: int) -> int:
    """PSS summed over ``root`` and its descendants (Chromium's processes: their sum of
    RSS would count the pages they share once per process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    for _ in range(10_000):
        if not todo:
            break
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            total += pss_kb(pid)
        except OSError:
            pass
    return total


class Pages:
    """Headless Chromium with the landing page and a topic page open (``--browser``)."""

    def __init__(self, url: str, topic: str) -> None:
        import shutil

        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or ""
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--enable-precise-memory-info", "--window-size=1200,1000"):
            options.add_argument(arg)
        self.service = Service(shutil.which("chromedriver") or "")
        self.driver = webdriver.Chrome(service=self.service, options=options)
        self.driver.get(url)
        self.tabs = [self.driver.current_window_handle]
        self.driver.switch_to.new_window("tab")
        self.driver.get(url + "topics/" + urllib.parse.quote(topic, safe=""))
        self.tabs.append(self.driver.current_window_handle)

    def heaps_kb(self) -> list[int]:
        out = []
        for tab in self.tabs:
            self.driver.switch_to.window(tab)
            out.append(int(self.driver.execute_script("return performance.memory.usedJSHeapSize")) // 1024)
        return out

    def pss_kb(self) -> int:
        process = self.service.process
        return tree_pss_kb(process.pid) if process is not None else 0

    def close(self) -> None:
        self.driver.quit()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dafka.cli", "--log-level", "WARNING", *args]


def _started(proc: subprocess.Popen[bytes], word: bytes, timeout: float = 60.0) -> str:
    """The process's first line (it says it is up), or fail."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    if word not in line or time.monotonic() > deadline:
        raise RuntimeError(f"did not start: {line!r}")
    return line.decode()


class Web:
    """The console's web clients, each request bounded by a timeout."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.errors = 0
        self.requests = 0

    def get(self, path: str) -> Any:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            self.requests += 1
            return json.loads(body) if resp.getheader("Content-Type", "").startswith("application/json") else body
        except (OSError, ValueError):
            self.errors += 1
            return None
        finally:
            conn.close()

    def stream(self, events: int, stop: threading.Event) -> int:
        """Open /events, read ``events`` events, drop the connection mid-stream."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        got = 0
        try:
            conn.request("GET", "/events")
            resp = conn.getresponse()
            while got < events and not stop.is_set():
                line = resp.fp.readline(1 << 24)
                if not line:
                    break
                if line.startswith(b"data: "):
                    got += 1
        except OSError:
            self.errors += 1
        finally:
            conn.sock and conn.sock.close()  # abrupt: no clean end of the response
            conn.close()
        return got


def run(
    minutes: float, rate: float, churn: float, sample: float, out: Path, db_flag: bool, browser: bool = False
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dafka-console-soak-"))
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    pages: Pages | None = None
    try:
        tower = subprocess.Popen(
            _cmd("tower", "--in-port", "0", "--out-port", "0"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        procs.append(tower)
        line = _started(tower, b"tower up")
        ports = [int(part.rsplit(":", 1)[1].split(",")[0].split()[0]) for part in line.split("tcp://")[1:]]
        tower_flag = f"127.0.0.1:{ports[0]}:{ports[1]}"
        cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", ports[0], ports[1]),), bind="127.0.0.1")
        db = work / "db"
        store = subprocess.Popen(
            _cmd("store", "--db", str(db), "--tower", tower_flag, "--bind", "127.0.0.1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs.append(store)
        _started(store, b"store up")
        console_args = ["console", "--tower", tower_flag, "--listen", "127.0.0.1:0"]
        if db_flag:
            console_args += ["--db", str(db)]
        console = subprocess.Popen(_cmd(*console_args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(console)
        url = urllib.parse.urlsplit(_started(console, b"console up").split()[2])
        web = Web(url.hostname or "127.0.0.1", url.port or 0)
        log.info("console pid %d at %s; store db %s", console.pid, url.geturl(), db)

        producers = [Producer(TOPICS[i % 2], cfg) for i in range(4)]
        member = Consumer(list(TOPICS), cfg, group="soak-group", offset_reset="earliest")
        held = threading.Thread(target=web.stream, args=(10**9, stop), daemon=True)
        held.start()

        def client_loop() -> None:
            n = 0
            while not stop.wait(2.0):
                n += 1
                state = web.get("/api/state")
                web.get("/api/topic?name=" + urllib.parse.quote(TOPICS[n % 2]))
                web.get("/api/group?name=soak-group")
                topic = urllib.parse.quote(TOPICS[n % 2])
                parts = (state or {}).get("topics", []) if isinstance(state, dict) else []
                heads = [h for t in parts if t["topic"] == TOPICS[n % 2] for h in t["heads"]]
                if heads:
                    part = urllib.parse.quote(heads[n % len(heads)]["partition"])
                    web.get(f"/api/records?topic={topic}&partition={part}&limit=50")
                if n % 5 == 0:
                    web.stream(3, stop)  # a page opened and closed

        clients = threading.Thread(target=client_loop, daemon=True)
        clients.start()
        if browser:
            pages = Pages(url.geturl(), TOPICS[1])

        start = time.monotonic()
        deadline = start + minutes * 60
        next_sample, next_churn, sent = start, start + churn, 0
        rows: list[tuple[float, int, int, int, float]] = []
        browser_rows: list[tuple[float, int, int, int]] = []  # seconds, landing heap, topic heap, Chromium PSS
        with open(out, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["seconds", "rss_kb", "anon_kb", "file_kb", "cpu_s", "published", "consumed",
                             "landing_heap_kb", "topic_heap_kb", "chromium_pss_kb"])
            consumed = 0
            while time.monotonic() < deadline:
                now = time.monotonic()
                due = int((now - start) * rate) - sent
                for i in range(min(due, int(rate))):
                    producers[(sent + i) % len(producers)].publish(b'{"n": %d, "pad": "%s"}' % (sent + i, b"x" * 150))
                sent += max(0, min(due, int(rate)))
                for _ in range(1000):
                    if member.poll(0) is None:
                        break
                    consumed += 1
                if now >= next_churn:
                    old = producers.pop(0)
                    old.close(2)
                    producers.append(Producer(old.topic if hasattr(old, "topic") else TOPICS[0], cfg))
                    member.commit(2)
                    next_churn += churn
                if now >= next_sample:
                    if console.poll() is not None:
                        raise RuntimeError(f"the console exited ({console.returncode})")
                    mem = memory_kb(console.pid)
                    row = (round(now - start, 1), mem["VmRSS"], mem["RssAnon"], mem["RssFile"],
                           round(cpu_seconds(console.pid), 2))
                    rows.append(row)
                    extra: list[int] = []
                    if pages is not None:
                        extra = [*pages.heaps_kb(), pages.pss_kb()]
                        browser_rows.append((row[0], extra[0], extra[1], extra[2]))
                    writer.writerow([*row, sent, consumed, *extra])
                    f.flush()
                    log.info("t=%6.0fs rss=%d kB (anon %d, file %d) cpu=%.1fs published=%d consumed=%d web errors=%d%s",
                             *row, sent, consumed, web.errors,
                             f" heaps {extra[0]}/{extra[1]} kB chromium {extra[2]} kB" if extra else "")
                    next_sample += sample
                time.sleep(0.05)
        stop.set()
        clients.join(15)
        member.close(2)
        for p in producers:
            p.close(2)

        def curve(column: int, table: Any = rows) -> dict[str, int | None]:
            def at(minute: float) -> int | None:
                got = [r[column] for r in table if r[0] >= minute * 60 - sample]  # (the last sample of an hour is at 59:50)
                return int(got[0]) if got else None

            return {"start": at(0), "10min": at(10), "30min": at(30), "60min": at(60),
                    "end": int(table[-1][column]) if table else None,
                    "max": int(max(r[column] for r in table)) if table else None}

        return {
            "samples": len(rows),
            "rss_kb": curve(1),
            "anon_kb": curve(2),
            "file_kb": curve(3),
            **({"landing_heap_kb": curve(1, browser_rows), "topic_heap_kb": curve(2, browser_rows),
                "chromium_pss_kb": curve(3, browser_rows)} if browser_rows else {}),
            "cpu_s": rows[-1][4] if rows else None,
            "published": sent,
            "consumed": consumed,
            "web_requests": web.requests,
            "web_errors": web.errors,
            "csv": str(out),
        }
    finally:
        stop.set()
        if pages is not None:
            pages.close()
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dafka.console.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=200.0, help="records a second, all producers together")
    ap.add_argument("--churn", type=float, default=120.0, help="seconds between producer replacements")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--out", type=Path, default=Path("console-soak.csv"))
    ap.add_argument("--db", action="store_true", help="the console also reads the store's LMDB (--db)")
    ap.add_argument("--browser", action="store_true", help="also a real page open: headless Chromium (selenium)")
    args = ap.parse_args(argv)
    # Stopped (timeout, kill): end through the finally blocks, which stop the processes started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    summary = run(args.minutes, args.rate, args.churn, args.sample, args.out, args.db, args.browser)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
