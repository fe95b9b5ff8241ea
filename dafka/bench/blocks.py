"""``dafka bench blocks``: store layouts for format 2 (issue 36), measured in one process.

Writes ``--records`` records of ``--size`` bytes into real LMDB in temporary
directories, in each of three layouts, alternating them within every run so
that the machine's load falls on all alike:

``records``
    today's layout: one LMDB entry per record, through the store's own code
    (:meth:`dafka.store.db.RecordDB.append_runs`, its retention with
    :meth:`~dafka.store.db.RecordDB.enforce_retention`).
``source``
    one LMDB value per block holding the client's encoding with a tag: a Tank
    bundle as received, checked and wrapped by :func:`dafka.store.block.tank_block`.
``internal``
    one LMDB value per block in one internal encoding: the bundle decoded and
    re-encoded at ingest (:func:`dafka.tank.bundle.decode_bundle` then
    :func:`dafka.store.block.dafka_block`).

Blocks of ``--block-sizes`` bytes of records, written with and without
MDB_APPEND, with and without fsync, and with retention deleting the oldest
blocks while ingesting (the database held to ``--window`` bytes, so the
overflow pages of deleted blocks go through LMDB's free list).  Commits hold
``--commit-bytes`` of records (at least one block).  The bundles are encoded
before the clock starts (that is the client's work).

Then the read side: a random offset's block found with one cursor seek and
its header read (``seek``), the same plus slicing the record out in Python
(``seek+slice``), and a scan of everything (``scan``), against the records
layout's :meth:`~dafka.store.db.RecordDB.fetch_raw`.

Finally the disk: fdatasync'd sequential writes of 1 MiB (as ``dd
conv=fdatasync``), before and after, to put MB/s in proportion.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from dafka.bench.common import disk_mb_s

TOPIC, PARTITION = "bench", "p0"
PID = 1
TS = 1_764_000_000_000
_DB = b"blocks"


def _bundles(n: int, size: int, block_bytes: int) -> list[bytes]:
    from dafka.tank.bundle import CODEC_NONE, encode_bundle

    per = max(1, block_bytes // size)
    content = b"x" * size
    out = []
    for first in range(0, n, per):
        k = min(per, n - first)
        out.append(encode_bundle([(None, TS + first // per, None, content)] * k, codec=CODEC_NONE))
    return out


def _open_env(path: str, sync: bool) -> Any:
    import lmdb

    # The store's own settings (dafka.store.db.RecordDB._open), a map big enough not to grow.
    return lmdb.open(path, map_size=8 << 30, sync=sync, metasync=sync, writemap=False, lock=True, max_dbs=8)


def _ingest_records(path: str, n: int, size: int, sync: bool, window: int | None, commit_bytes: int) -> float:
    from dafka.store.db import RecordDB, Retention, RetentionPolicy

    per = max(1, commit_bytes // size)
    contents = [b"x" * size] * per
    policy = RetentionPolicy(default=Retention(max_bytes=window)) if window else None
    with RecordDB(path, sync=sync, map_size=1 << 30) as db:
        t0 = time.perf_counter()
        for first in range(0, n, per):
            k = min(per, n - first)
            db.append_runs([(TOPIC, PARTITION, first, contents[:k] if k < per else contents, TS)])
            if policy is not None:
                for _ in range(1000):
                    if not db.enforce_retention(TS, policy, max_records=100_000).more:
                        break
        return time.perf_counter() - t0


def _ingest_blocks(
    path: str, bundles: list[bytes], sync: bool, append: bool, window: int | None, commit_bytes: int,
    make: Callable[[bytes, int], bytes],
) -> float:
    from dafka.store.blocktable import drop_front, put_block

    env = _open_env(path, sync)
    try:
        db = env.open_db(_DB)
        per_commit = max(1, commit_bytes // max(1, len(bundles[0])))
        total = 0
        offset = 0
        t0 = time.perf_counter()
        for i in range(0, len(bundles), per_commit):
            with env.begin(write=True, db=db) as txn:
                for bundle in bundles[i : i + per_commit]:
                    value = make(bundle, offset)
                    offset = put_block(txn, db, PID, value, append=append).last_offset + 1
                    total += len(value)
            if window is not None and total > window:
                # Retention by block, in its own (synced) write transaction, as the store does.
                with env.begin(write=True, db=db) as txn:
                    def over(_hdr: Any, size: int) -> bool:
                        nonlocal total
                        if total <= window:
                            return False
                        total -= size
                        return True

                    drop_front(txn, db, PID, over, max_blocks=1 << 30)
        return time.perf_counter() - t0
    finally:
        env.close()


def _make_source(bundle: bytes, offset: int) -> bytes:
    from dafka.fastio import tank_scan
    from dafka.store.block import DEFAULT_BUDGET, DEFAULT_MAX_RECORD_BYTES, tank_seal

    return tank_seal(bundle, tank_scan(bundle, DEFAULT_MAX_RECORD_BYTES, DEFAULT_BUDGET), offset)


def _make_internal(bundle: bytes, offset: int) -> bytes:
    from dafka.store.block import dafka_block
    from dafka.tank.bundle import decode_bundle

    return dafka_block([(ts, key, bytes(val)) for _s, ts, key, val in decode_bundle(bundle)], offset)


def _read_blocks(path: str, n: int, seeks: int, slice_: bool) -> float:
    """Seconds for ``seeks`` random offsets (or, seeks=0, a scan of every block)."""
    import lmdb

    from dafka.store.block import decode_header, records
    from dafka.store.blocktable import find

    env = lmdb.open(path, readonly=True, lock=True, max_dbs=8, map_size=0)
    try:
        db = env.open_db(_DB, create=False)
        rnd = random.Random(7)
        t0 = time.perf_counter()
        with env.begin(db=db, buffers=True) as txn:
            cur = txn.cursor()
            if not seeks:
                got = 0
                for value in cur.iternext(keys=False):
                    got += decode_header(value).record_count
                if got != n:
                    raise RuntimeError(f"scan found {got} records of {n}")
                return time.perf_counter() - t0
            for _ in range(seeks):
                off = rnd.randrange(n)
                found = find(txn, db, PID, off)  # one seek, one step back
                if found is None:
                    raise RuntimeError("no block")
                hdr, value = found
                if not hdr.first_offset <= off <= hdr.last_offset:
                    raise RuntimeError(f"offset {off} not in the block found ({hdr.first_offset}..{hdr.last_offset})")
                if slice_ and next(records(value, off)).offset != off:
                    raise RuntimeError("slice found another offset")
        return time.perf_counter() - t0
    finally:
        env.close()


def _read_records(path: str, n: int, seeks: int) -> float:
    from dafka.store.db import RecordDB

    with RecordDB(path, readonly=True) as db:
        rnd = random.Random(7)
        t0 = time.perf_counter()
        if not seeks:
            got = 0
            while got < n:
                start, values = db.fetch_raw(TOPIC, PARTITION, got, 1024)
                if not values:
                    raise RuntimeError("scan stopped early")
                got += len(values)
            return time.perf_counter() - t0
        for _ in range(seeks):
            off = rnd.randrange(n)
            if db.fetch_raw(TOPIC, PARTITION, off, 1)[0] != off:
                raise RuntimeError("fetch_raw found another offset")
        return time.perf_counter() - t0


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def bench_blocks(args: argparse.Namespace) -> int:
    n, size, runs = args.records, args.size, args.runs
    mb = n * size / 1e6
    sizes = _sizes(args.block_sizes)
    window = args.window
    commit_bytes = args.commit_bytes
    base = tempfile.mkdtemp(prefix="dafka-bench-blocks-")
    print(f"{n:,} records of {size} B ({mb:.0f} MB) per case, {runs} runs (median; layouts alternate within "
          f"each run), commits of >= {commit_bytes:,} B, retention window {window:,} B, in {base}", flush=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus", flush=True)
    disk = [disk_mb_s(base, args.disk_mb)]
    print(f"disk: {disk[0]:.0f} MB/s fdatasync'd sequential ({args.disk_mb} MiB)", flush=True)
    bundles = {bs: _bundles(n, size, bs) for bs in sizes}
    # case name -> list of seconds, one per run
    times: dict[str, list[float]] = {}
    cases: list[tuple[str, Callable[[str], float]]] = []
    for sync in (False, True):
        for ret in (False, True):
            w = window if ret else None
            tag = f"sync={'on' if sync else 'off'} retention={'on' if ret else 'off'}"
            cases.append((f"{tag} records", partial(_ingest_records, n=n, size=size, sync=sync, window=w,
                                                    commit_bytes=commit_bytes)))
            for bs in sizes:
                for app in (True, False):
                    for name, make in (("source", _make_source), ("internal", _make_internal)):
                        cases.append((
                            f"{tag} {name} block={bs} append={'on' if app else 'off'}",
                            partial(_ingest_blocks, bundles=bundles[bs], sync=sync, append=app, window=w,
                                    commit_bytes=commit_bytes, make=make),
                        ))
    for run in range(runs):
        order = cases if run % 2 == 0 else cases[::-1]
        for name, fn in order:
            with tempfile.TemporaryDirectory(dir=base) as d:
                times.setdefault(name, []).append(fn(d))
        print(f"run {run} done (load {os.getloadavg()[0]:.2f})", flush=True)
    print()
    print(f"{'ingest case':<62} {'records/s':>11} {'MB/s':>7} {'x records':>9} {'% disk':>7}")
    ref: dict[str, float] = {}
    for name, _fn in cases:
        med = statistics.median(times[name])
        tag = " ".join(name.split()[:2])
        if name.endswith(" records"):
            ref[tag] = med
        print(f"{name:<62} {n / med:>11,.0f} {mb / med:>7.1f} {ref[tag] / med:>8.2f}x "
              f"{100 * mb / med / disk[0]:>6.0f}%")
    # The read side: databases written once (no retention, no sync), read alternately.
    print()
    seeks = args.seeks
    with tempfile.TemporaryDirectory(dir=base) as d:
        paths = {"records": os.path.join(d, "records")}
        _ingest_records(paths["records"], n, size, False, None, commit_bytes)
        for bs in sizes:
            for name, make in (("source", _make_source), ("internal", _make_internal)):
                p = os.path.join(d, f"{name}-{bs}")
                os.makedirs(p)
                _ingest_blocks(p, bundles[bs], False, True, None, commit_bytes, make)
                paths[f"{name} block={bs}"] = p
        reads: dict[str, list[float]] = {}
        for _run in range(runs):
            for key, p in paths.items():
                if key == "records":
                    reads.setdefault("records seek", []).append(_read_records(p, n, seeks))
                    reads.setdefault("records scan", []).append(_read_records(p, n, 0))
                    continue
                reads.setdefault(f"{key} seek", []).append(_read_blocks(p, n, seeks, False))
                reads.setdefault(f"{key} seek+slice", []).append(_read_blocks(p, n, max(1, seeks // 10), True))
                reads.setdefault(f"{key} scan", []).append(_read_blocks(p, n, 0, False))
        print(f"{'read case':<40} {'result':>24}")
        for key, ts in reads.items():
            med = statistics.median(ts)
            if key.endswith(" scan"):
                print(f"{key:<40} {n / med:>14,.0f} records/s ({mb / med:,.0f} MB/s)")
            else:
                k = max(1, seeks // 10) if key.endswith("slice") else seeks
                print(f"{key:<40} {med / k * 1e6:>14.1f} us per seek")
    disk.append(disk_mb_s(base, args.disk_mb))
    print(f"\ndisk after: {disk[1]:.0f} MB/s fdatasync'd; load average at end: {os.getloadavg()[0]:.2f}")
    os.rmdir(base)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dafka bench blocks`` (added to the bench parser)."""
    p.add_argument("--block-sizes", default="4096,65536,1048576",
                   help="blocks: block sizes in bytes of records, comma separated")
    p.add_argument("--window", type=int, default=8 << 20,
                   help="blocks: bytes kept by the retention cases")
    p.add_argument("--commit-bytes", type=int, default=256 << 10,
                   help="blocks: bytes of records per write transaction (at least one block)")
    p.add_argument("--seeks", type=int, default=2000, help="blocks: random offsets looked up per read case")
    p.add_argument("--disk-mb", type=int, default=256, help="blocks: MiB written to measure the disk")

