"""``dafka bench storedb``: the store's database layer alone, in CPU time of this process.

Appends records as the store's compiled drain hands them (``append_pairs`` of ready stored
values, or of LMDB pairs in a tree before format 2, 1,000 a commit, each value built as the drain does), then reads them back 1,024 at a time and one at a time (``fetch_raw``).
Measured in CPU time (``time.process_time``) so that a loaded machine weighs on two trees
compared alternately alike; the commits are not synced unless ``--sync`` (then the fsyncs,
which take no CPU, are not in the figure either).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any

from dafka import fastio
from dafka.store.db import RecordDB
from dafka.store.layout import RECORD_KEY, pack_value

PER_COMMIT = 1000
TS = 1_700_000_000_000


def _one(n: int, size: int, sync: bool) -> tuple[float, float, float]:
    content = b"x" * size
    d = tempfile.mkdtemp(prefix="dafka-bench-")
    try:
        db = RecordDB(d, sync=sync)
        try:
            db.append([("t", "P", 0, content, TS)])
            info = db.info("t", "P")
            assert info is not None
            pid = info.pid
            value = pack_value(TS, content)
            # The drain hands format 2 stored values, format 1 (a tree before it) LMDB pairs.
            values_only = hasattr(fastio, "store_blocks")
            t = time.process_time()
            for first in range(1, n, PER_COMMIT):
                k = min(PER_COMMIT, n - first)
                if values_only:
                    pairs: list[Any] = [pack_value(TS, content) for _ in range(k)]
                else:
                    pairs = [(RECORD_KEY.pack(pid, o), value) for o in range(first, first + k)]
                db.append_pairs([], pairs, [("t", "P", pid, first, first + k - 1, size * k)])
            write = n / (time.process_time() - t)
            t = time.process_time()
            off = got = 0
            while got < n:
                start, values = db.fetch_raw("t", "P", off, 1024)
                got += len(values)
                off = start + len(values)
            read = n / (time.process_time() - t)
            probes = range(0, n, 997)
            t = time.process_time()
            for o in probes:
                db.fetch_raw("t", "P", o, 1)
            one = (time.process_time() - t) / len(probes) * 1e6
        finally:
            db.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return write, read, one


def bench_storedb(args: argparse.Namespace) -> dict[str, list[float]]:
    """Records/s of CPU for appending and reading, µs of CPU for a one-record read."""
    out: dict[str, list[float]] = {"append_pairs": [], "fetch_raw 1024": [], "fetch_raw 1 (us)": []}
    for run in range(args.runs):
        write, read, one = _one(args.records, args.size, args.sync)
        out["append_pairs"].append(write)
        out["fetch_raw 1024"].append(read)
        out["fetch_raw 1 (us)"].append(one)
        print(f"run {run}: append_pairs {write:,.0f}/s, fetch_raw(1024) {read:,.0f}/s, fetch_raw(1) {one:.1f} us"
              " (CPU time)", flush=True)
    return out


if __name__ == "__main__":
    # ``PYTHONPATH=TREE python dafka/bench/storedb.py [records] [runs]`` measures TREE's store:
    # how two trees are compared alternately (an older one has no ``dafka bench storedb``).
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    bench_storedb(argparse.Namespace(records=n, runs=runs, size=100, sync=False))
