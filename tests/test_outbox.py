"""The edge outbox: sans-IO core, LMDB file, and real processes killed while offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dafka.core.unacked import UnackedWindow
from dafka.errors import BufferFullError, PublishError
from dafka.nodes.producer import Producer
from dafka.outbox import OutboxFullError, describe
from dafka.outbox.core import BLOCK, DROP_OLDEST, RECORD_OVERHEAD, SYNC_BATCH, SYNC_EACH, OutboxCore
from dafka.outbox.db import OutboxDB, OutboxError
from dafka.store.db import RecordDB
from tests.conftest import (
    ROOT,
    dafka_cmd,
    spawned,
    start_store_process,
    subprocess_env,
    tower_flag,
    wait_until,
)

# ---------------------------------------------------------------- sans-IO core


def _push(core: OutboxCore, contents: list[bytes], now: float = 0.0) -> int:
    first = core.window.push_many(contents)
    core.pushed(first, contents, now)
    return first


def test_core_sends_only_what_a_commit_made_durable() -> None:
    core = OutboxCore(UnackedWindow(100))
    _push(core, [b"a", b"b"])
    assert core.pending == 2 and core.durable == -1
    assert core.sendable(0, 10) == 0  # nothing on the wire before it is on disk
    take = core.take()
    assert take.runs == [(0, [b"a", b"b"])] and take.next == 2 and take.floor == 0
    _push(core, [b"c"])  # published while the commit runs: the next group
    assert core.committed(take) == [(0, [b"a", b"b"])]
    assert core.durable == 1 and core.sendable(0, 10) == 2 and core.pending == 1


def test_core_each_mode_rolls_back_a_failed_commit_and_later_pushes() -> None:
    window = UnackedWindow(100)
    core = OutboxCore(window, sync=SYNC_EACH)
    _push(core, [b"a"])
    core.committed(core.take())
    _push(core, [b"b", b"c"])
    take = core.take()
    _push(core, [b"d"])  # after the take: goes with the rollback too
    epoch = core.epoch
    back = core.commit_failed(take, OSError("full"))
    assert back == 1 and core.epoch == epoch + 1 and not core.has_work()
    window.truncate(back)
    assert window.next == 1 and window.bytes == 1 and core.records == 1
    assert _push(core, [b"e"]) == 1  # the offset is assigned again: it was never sent


def test_core_batch_mode_keeps_a_failed_commit_for_a_retry() -> None:
    core = OutboxCore(UnackedWindow(100), sync=SYNC_BATCH)
    _push(core, [b"a", b"b"], now=5.0)
    take = core.take()
    _push(core, [b"c"], now=6.0)
    assert core.commit_failed(take, OSError("full")) == -1
    assert core.error is not None
    retry = core.take()
    assert retry.runs == [(0, [b"a", b"b"]), (2, [b"c"])] and retry.ts_ms == [5000, 6000]
    core.committed(retry)
    assert core.error is None and core.durable == 2


def test_core_blocks_at_max_bytes_until_acks_free_room() -> None:
    window = UnackedWindow(100)
    core = OutboxCore(window, max_bytes=3 * (10 + RECORD_OVERHEAD), policy=BLOCK)
    _push(core, [b"x" * 10] * 3)
    core.committed(core.take())
    verdict = core.admit(1, 10, 0.0)
    assert not verdict.ok and "outbox_max_bytes" in verdict.why
    window.ack(0)
    core.acked()
    assert core.admit(1, 10, 0.0).ok
    assert core.take().floor == 1  # the next commit deletes the acknowledged record


def test_core_drop_oldest_evicts_durable_records_and_counts_them() -> None:
    window = UnackedWindow(100)
    core = OutboxCore(window, max_bytes=3 * (10 + RECORD_OVERHEAD), policy=DROP_OLDEST)
    _push(core, [b"x" * 10] * 3)
    core.committed(core.take())
    verdict = core.admit(2, 20, 0.0)
    assert verdict.ok and verdict.evict_upto == 1
    assert core.evict(verdict.evict_upto) == 2
    assert core.evicted == 2 and window.acked == 1 and core.evicted_at(0) and core.evicted_at(1)
    assert not core.evicted_at(2)
    assert core.take().floor == 2  # deleted on disk with the next commit


def test_core_never_evicts_pending_records() -> None:
    core = OutboxCore(UnackedWindow(100), max_bytes=10, policy=DROP_OLDEST)
    _push(core, [b"x" * 10] * 3)  # nothing durable yet
    assert core.evict(2) == 0 and core.records == 3


def test_core_max_age_block_and_expiry() -> None:
    window = UnackedWindow(100)
    core = OutboxCore(window, max_age=10.0, policy=BLOCK)
    _push(core, [b"a"], now=0.0)
    _push(core, [b"b"], now=8.0)
    core.committed(core.take())
    assert core.oldest_age(11.0) == 11.0
    assert not core.admit(1, 1, 11.0).ok
    assert core.expired(11.0) == -1  # block: nothing is dropped
    dropping = OutboxCore(UnackedWindow(100), max_age=10.0, policy=DROP_OLDEST)
    _push(dropping, [b"a"], now=0.0)
    _push(dropping, [b"b"], now=8.0)
    dropping.committed(dropping.take())
    assert dropping.expired(11.0) == 0  # only the record older than 10 s
    dropping.evict(0)
    assert dropping.oldest_age(11.0) == 3.0


def test_window_truncate_takes_back_offsets() -> None:
    window = UnackedWindow(10_000)
    window.push_many([b"ab"] * 5000)
    window.ack(99)
    window.truncate(4200)
    assert window.next == 4200 and len(window) == 4100 and window.bytes == 8200
    window.truncate(100)
    assert len(window) == 0 and window.bytes == 0
    assert window.push(b"z") == 100 and window.get(100) == b"z"
    with pytest.raises(ValueError):
        window.truncate(50)


# ---------------------------------------------------------------- LMDB file


def test_db_commit_load_and_describe(tmp_path: Path) -> None:
    db = OutboxDB(tmp_path / "ob")
    db.claim("t", "A" * 32, 5)
    db.commit([(5, [b"r5", b"r6"]), (7, [b"r7"])], [1000, 2000], 5, 5, 8)
    db.commit([], [], 5, 6, 8)  # an ACK of offset 5
    image = db.load()
    assert (image.topic, image.address, image.floor, image.next) == ("t", "A" * 32, 6, 8)
    assert image.records == [(6, 1000, b"r6"), (7, 2000, b"r7")]
    db.close()
    info = describe(tmp_path / "ob", show=1, now=3.0)
    assert info["records"] == 2 and info["bytes"] == 4 and info["first"] == 6
    assert info["oldest_age"] == pytest.approx(2.0) and info["shown"][0]["content"] == "r6"


def test_db_one_process_per_outbox(tmp_path: Path) -> None:
    db = OutboxDB(tmp_path / "ob")
    try:
        code = (
            "import sys; from dafka.outbox.db import OutboxDB, OutboxError\n"
            f"try: OutboxDB({str(tmp_path / 'ob')!r})\n"
            "except OutboxError as e: print('refused', e); sys.exit(3)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert b"in use by another process" in proc.stdout
    finally:
        db.close()


def test_db_map_full_is_an_error_and_keeps_what_was_committed(tmp_path: Path) -> None:
    db = OutboxDB(tmp_path / "ob", map_size=256 << 10, max_map_size=256 << 10)
    db.claim("t", "A" * 32, 0)
    db.commit([(0, [b"x" * 1000] * 10)], [1], 0, 0, 10)
    with pytest.raises(OutboxFullError):
        db.commit([(10, [b"y" * 1000] * 1000)], [2], 0, 0, 1010)
    image = db.load()
    assert image.next == 10 and len(image.records) == 10  # the last good commit, whole
    db.commit([(10, [b"z"])], [3], 0, 0, 11)  # still usable
    db.close()
    assert OutboxDB(tmp_path / "ob").load().next == 11


def test_db_refuses_another_partitions_outbox(tmp_path: Path, cfg) -> None:  # type: ignore[no-untyped-def]
    with Producer("t", cfg, outbox=tmp_path / "ob") as p:
        p.publish(b"a")
        p.close(0)  # no store here: the record stays in the outbox
    with pytest.raises(OutboxError):
        Producer("other-topic", cfg, outbox=tmp_path / "ob")


# ---------------------------------------------------------------- real processes


def _device(cfg, outbox: Path, total: int, sync: str = "each", pause: float = 0.0) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    return spawned(
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "outbox_device.py"), tower_flag(cfg), str(outbox), str(total), sync, str(pause)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
            text=True,
        )
    )


def _read_until(proc: subprocess.Popen, predicate, timeout: float = 60.0) -> list[str]:  # type: ignore[no-untyped-def]
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"device ended: {lines[-5:]} {proc.stderr.read() if proc.stderr else ''}")
        lines.append(line.strip())
        if predicate(line.strip()):
            return lines
    raise AssertionError(f"device did not get there: {lines[-5:]}")


def _stored(db: Path, address: str) -> list[bytes]:
    with RecordDB(db, readonly=True) as rdb:
        return [r.content for r in rdb.read("readings", address, 0, 1 << 30)]


def _published(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("published ")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sync", ["each", "batch"])
def test_killed_offline_device_resumes_and_every_record_is_stored_once_in_order(tmp_path: Path, cfg, sync: str) -> None:  # type: ignore[no-untyped-def]
    outbox, total = tmp_path / "outbox", 400
    # Offline: no store anywhere.  Kill -9 in the middle of publishing.
    dev = _device(cfg, outbox, total, sync)
    lines = _read_until(dev, lambda line: line == "published 150")
    address = lines[0].split()[2]
    dev.send_signal(signal.SIGKILL)
    dev.wait(10)
    returned = _published(lines)
    held = describe(outbox)
    # Each: every publish that returned is on disk.  Batch: what the group commits had made
    # durable before the kill, which on a loaded machine may be nothing yet (the rest of the
    # test checks that what was durable is kept, once and in order).
    assert held["next"] >= (max(returned) + 1 if sync == "each" else 0)
    assert held["records"] == held["next"] and held["partition"] == address
    # Reboot, still offline: publishing continues at once where the outbox says.
    dev = _device(cfg, outbox, total, sync)
    first = _read_until(dev, lambda line: line.startswith("start"))
    assert first[0].split()[1:] == [str(held["next"]), address]
    _read_until(dev, lambda line: line == f"published {total - 1}")
    # The mesh comes back: a store starts, everything is acknowledged.
    store = start_store_process(cfg, tmp_path / "db")
    assert _read_until(dev, lambda line: line in ("acked", "not acked"))[-1] == "acked"
    assert dev.wait(30) == 0
    store.terminate()
    store.wait(30)
    assert _stored(tmp_path / "db", address) == [b"rec-%d" % i for i in range(total)]
    assert describe(outbox)["records"] == 0  # acknowledged records left the outbox


@pytest.mark.timeout(240)
def test_store_comes_and_goes_device_killed_meanwhile(tmp_path: Path, cfg) -> None:  # type: ignore[no-untyped-def]
    outbox, db, total = tmp_path / "outbox", tmp_path / "db", 600
    dev = _device(cfg, outbox, total, "each", pause=0.01)
    lines = _read_until(dev, lambda line: line.startswith("start"))
    address = lines[0].split()[2]
    store = None
    for round_ in range(3):
        store = start_store_process(cfg, db)
        mark = 100 * (round_ + 1)
        _read_until(dev, lambda line, m=mark: line == f"published {m}")  # type: ignore[misc]
        store.send_signal(signal.SIGKILL if round_ % 2 else signal.SIGTERM)
        store.wait(30)
        _read_until(dev, lambda line, m=mark: line == f"published {m + 50}")  # type: ignore[misc]
        if round_ == 1:  # and the device reboots while the store is away
            dev.send_signal(signal.SIGKILL)
            dev.wait(10)
            dev = _device(cfg, outbox, total, "each", pause=0.01)
    store = start_store_process(cfg, db)
    assert _read_until(dev, lambda line: line in ("acked", "not acked"), 120)[-1] == "acked"
    assert dev.wait(30) == 0
    store.terminate()
    store.wait(30)
    assert _stored(db, address) == [b"rec-%d" % i for i in range(total)]


@pytest.mark.timeout(120)
def test_full_outbox_disk_is_an_error_at_publish_never_a_crash(tmp_path: Path, cfg) -> None:  # type: ignore[no-untyped-def]
    outbox = tmp_path / "outbox"
    big = b"x" * 1000  # within a page: no overflow pages, whose runs a freed map may not have
    with Producer("readings", cfg, outbox=outbox, outbox_max_map_size=512 << 10, publish_timeout=5) as p:
        published = []
        with pytest.raises(OutboxFullError, match="outbox"):
            for _ in range(5000):
                published.append(p.publish(big).offset)
        assert published and p.next_offset == len(published)  # the failed record's offset is taken back
        assert p.unacked == len(published)
        with pytest.raises(OutboxFullError):
            p.publish(big)  # still full: still a clear error
        try:
            assert p.publish(b"tiny").offset == len(published)  # may fit in what is left
            tiny = True
        except OutboxFullError:
            tiny = False
        address = p.address
        # A store takes the records: ACKs free the outbox, publishing works again.
        store = start_store_process(cfg, tmp_path / "db")
        assert p.flush(60)
        wait_until(lambda: p._outbox.core.floor_written == p.next_offset, 10)
        for _ in range(20):
            p.publish(big)
        assert p.flush(60)
        total = p.next_offset
    store.terminate()
    store.wait(30)
    stored = _stored(tmp_path / "db", address)
    assert len(stored) == total and stored[: len(published)] == [big] * len(published)
    assert stored[len(published)] == (b"tiny" if tiny else big)


@pytest.mark.timeout(60)
def test_blocking_outbox_raises_buffer_full_then_drop_oldest_counts(tmp_path: Path, cfg) -> None:  # type: ignore[no-untyped-def]
    with Producer("t", cfg, outbox=tmp_path / "a", outbox_max_bytes=10 * (100 + RECORD_OVERHEAD), publish_timeout=0.2) as p:
        for _ in range(10):
            p.publish(b"x" * 100)
        t0 = time.monotonic()
        with pytest.raises(BufferFullError, match="outbox_max_bytes"):
            p.publish(b"x" * 100)
        assert time.monotonic() - t0 >= 0.15
        p.close(0)
    with Producer(
        "t", cfg, outbox=tmp_path / "b", outbox_max_bytes=10 * (100 + RECORD_OVERHEAD), outbox_policy="drop_oldest"
    ) as p:
        first = p.publish(b"x" * 100)
        for _ in range(14):
            p.publish(b"x" * 100)
        assert p._outbox.evicted == 5 and p.unacked == 10
        assert first.failed() and not first.acked()
        with pytest.raises(PublishError, match="evicted"):
            first.wait(0)
        p.close(0)
    assert describe(tmp_path / "b")["records"] == 10


def test_cli_outbox_shows_what_a_stopped_outbox_holds(tmp_path: Path, cfg) -> None:  # type: ignore[no-untyped-def]
    with Producer("readings", cfg, outbox=tmp_path / "ob") as p:
        p.publish_many([b"one", b"two", b"three"])
        address = p.address
        p.close(0)
    out = subprocess.run(
        dafka_cmd("outbox", str(tmp_path / "ob"), "--show", "2"), env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert address in out.stdout and "records    3  bytes 11" in out.stdout and "two" in out.stdout
    js = subprocess.run(
        dafka_cmd("outbox", str(tmp_path / "ob"), "--json"), env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert json.loads(js.stdout)["records"] == 3
    missing = subprocess.run(dafka_cmd("outbox", str(tmp_path / "none")), env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "no outbox" in missing.stderr
    assert not os.path.exists(tmp_path / "none")


def test_metrics_show_the_outbox(tmp_path: Path, cfg) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import generate_latest

    from dafka.nodes.metrics import registry_for

    with Producer("readings", cfg, outbox=tmp_path / "ob") as p:
        p.publish_many([b"abc"] * 4)
        text = generate_latest(registry_for(p)).decode()
        assert "dafka_outbox_records 4.0" in text
        assert f"dafka_outbox_bytes {4 * (3 + RECORD_OVERHEAD)}.0" in text
        assert "dafka_outbox_oldest_age_seconds" in text and "dafka_outbox_evicted_total 0.0" in text
        p.close(0)
    with Producer("plain", cfg) as plain:
        assert "dafka_outbox" not in generate_latest(registry_for(plain)).decode()


def test_an_outbox_producer_checks_records_as_publish_does(tmp_path: Path) -> None:
    """Serializer, type and size checks hold through the outbox's publish too (nothing published)."""
    from dafka.config import NodeConfig
    from dafka.errors import RecordTooLargeError
    from dafka.nodes.producer import Producer

    cfg = NodeConfig(towers=(), max_record_bytes=1000)
    p = Producer("t", cfg, outbox=str(tmp_path / "box"), serializer="json", acks=True)
    try:
        with pytest.raises(RecordTooLargeError):
            p.publish("x" * 2000)
        with pytest.raises(RecordTooLargeError):
            p.publish_many([1, "y" * 2000])
        receipt = p.publish({"a": 1})
        assert receipt.offset == 0
        assert p._outbox.core.window.next == 1  # the refused records took no offset
    finally:
        p.close(timeout=0.1)  # no store: the record stays in the outbox
