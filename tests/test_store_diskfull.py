"""A store whose LMDB lives on a tmpfs that becomes full, killed -9 and restarted
while it is full: every record a producer saw acknowledged stays in the store's
database and readable (the chaos soak's full-disk fault, made small and fast).

Needs root (mount -t tmpfs); skipped otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.store.db import RecordDB
from tests.conftest import dafka_cmd, spawned, subprocess_env, tower_flag, wait_until
from tests.test_reliability import read_partition, start_producer

pytestmark = pytest.mark.timeout(180)

TMPFS_BYTES = 16 << 20


def _mount(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _resize(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], capture_output=True, check=True)


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _store(cfg: NodeConfig, db: Path, log: Path) -> subprocess.Popen:
    err = open(log, "ab")
    proc = spawned(
        subprocess.Popen(
            dafka_cmd("store", "--db", str(db), "--tower", tower_flag(cfg), "--bind", "127.0.0.1"),
            stdout=subprocess.PIPE,
            stderr=err,
            env=subprocess_env(),
        )
    )
    err.close()
    line = proc.stdout.readline() if proc.stdout else b""
    assert b"store up" in line, (line, log.read_text())
    return proc


class Acks:
    """The offsets a producer process printed as acknowledged (read by a thread)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.offsets: set[int] = set()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.offsets.add(int(line))

    def count(self) -> int:
        return len(self.offsets)

    def stop(self) -> set[int]:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._t.join(10)
        return set(self.offsets)


@pytest.fixture
def tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "tmpfs"
    if os.geteuid() != 0 or not _mount(mnt, TMPFS_BYTES):
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_store_killed_and_restarted_on_a_full_disk_keeps_every_acknowledged_record(
    cfg: NodeConfig, tmp_path: Path, tmpfs: Path
) -> None:
    db = tmpfs / "db"
    log = tmp_path / "store.log"
    store = _store(cfg, db, log)
    producer, address = start_producer(cfg, tmp_path / "id.json", "r", 10_000_000)
    acks = Acks(producer)
    wait_until(lambda: acks.count() >= 1000, timeout=60)
    for _round in range(2):
        _resize(tmpfs, _used(tmpfs) + 64 * 1024)  # full: commits fail (EIO / ENOSPC)
        wait_until(lambda: "cannot write" in log.read_text(), timeout=30)
        time.sleep(0.3)
        store.send_signal(signal.SIGKILL)
        store.wait(10)
        store = _store(cfg, db, log)  # restarted on the full disk
        time.sleep(1.0)
        _resize(tmpfs, TMPFS_BYTES)
        before = acks.count()
        wait_until(lambda n=before + 500: acks.count() >= n, timeout=60)
    acked = acks.stop()
    store.send_signal(signal.SIGKILL)
    store.wait(10)
    with RecordDB(db, readonly=True) as rdb:
        info = rdb.info("reliable", address)
        assert info is not None
        held: set[int] = set()
        offset = info.first
        while offset <= info.last:
            start, values = rdb.fetch("reliable", address, offset, 10_000)
            if not values:
                break
            for i, v in enumerate(values):
                assert v == b"r-%d" % (start + i) or not v.startswith(b"r-"), (start + i, v)
            held.update(range(start, start + len(values)))
            offset = start + len(values)
    lost = sorted(acked - held)
    assert not lost, (
        f"{len(lost)} of {len(acked)} acknowledged records not in the store's database, "
        f"e.g. {lost[:5]}..{lost[-5:]}; log: {log.read_text()[-3000:]}"
    )
    store = _store(cfg, db, log)
    got = read_partition(cfg, "reliable", acked, timeout=30)
    unread = sorted(acked - got.keys())
    assert not unread, f"{len(unread)} acknowledged records not read back, e.g. {unread[:5]}"


def test_a_store_that_cannot_write_still_serves_what_it_holds(cfg: NodeConfig, tmp_path: Path) -> None:
    """While commits fail (a full disk), a store keeps answering FETCHes of the
    records it committed before: it may be the only one holding them, and
    readers (and other stores, which record a hole after skip_after) must not
    skip acknowledged records because the store cannot take new ones."""
    from dafka.nodes.consumer import Consumer
    from dafka.nodes.producer import Producer
    from dafka.store.db import StorageFullError
    from dafka.store.node import Store
    from tests.test_reliability import FlakyDB

    db = FlakyDB(tmp_path / "db")
    with Store(db, cfg) as store:
        with Producer("full", cfg, publish_timeout=0.1) as producer:
            producer.publish_many(b"r%d" % i for i in range(100))
            assert producer.flush(30)
            partition = producer.address
            db.failure = StorageFullError("commit failed: Input/output error")
            producer.publish_many(b"r%d" % i for i in range(100, 200))
            wait_until(lambda: store.storage_error is not None, timeout=15)
            # more records after the failure: the store's batch stays unwritten
            producer.publish_many(b"r%d" % i for i in range(200, 300))
            time.sleep(0.5)
            producer.close(0.1)
        with Consumer("full", cfg, offset_reset="earliest") as consumer:
            got: dict[int, bytes] = {}
            deadline = time.monotonic() + 15
            while not set(range(100)) <= got.keys() and time.monotonic() < deadline:
                for r in consumer.poll_batch(1000, 0.5):
                    if r.partition == partition:
                        got[r.offset] = r.content
        assert store.storage_error is not None  # still cannot write
        db.failure = None
    assert all(got.get(i) == b"r%d" % i for i in range(100)), sorted(got)[:10]
