"""The edge outbox: sans-IO core, LMDB file, and real processes killed while offline."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    with pytest.raises(OutboxFullError, match="reached outbox_max_map_size .* stores acknowledge"):
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


def _at_least(line: str, offset: int) -> bool:
    return line.startswith("published ") and int(line.split()[1]) >= offset


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
    if held["next"] < total:
        # (On a loaded machine the device may have published all of them before the kill
        # reached it: then it has nothing left to publish and waits for the ACKs at once.)
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
        # "At least": a device restarted in round 1 resumes at its outbox's next offset, which
        # may already be past the mark when the test read the killed one's output late.
        _read_until(dev, lambda line, m=mark: _at_least(line, m))  # type: ignore[misc]
        store.send_signal(signal.SIGKILL if round_ % 2 else signal.SIGTERM)
        store.wait(30)
        _read_until(dev, lambda line, m=mark: _at_least(line, m + 50))  # type: ignore[misc]
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


# ---------------------------------------------------------------- damage, exclusion, full disk (issue 35)

# Opens an outbox both ways (read-only as `dafka outbox` does, and as a producer) in a
# process of its own, so that a SIGBUS shows as a signal exit, and says how each went.
_OPEN_BOTH = """
import json, sys
from dafka.config import NodeConfig
from dafka.nodes.producer import Producer
from dafka.outbox import describe
out = {}
for how in ("describe", "producer"):
    try:
        if how == "describe":
            describe(sys.argv[1])
        else:
            p = Producer("readings", NodeConfig(towers=()), outbox=sys.argv[1])
            out["address"] = p.address
            p.close(0)
        out[how] = "opened"
    except Exception as exc:
        out[how] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _full_outbox(path: Path, n: int = 3000) -> str:
    """An outbox holding ``n`` unacknowledged records (about 200 pages); its partition address."""
    from dafka.config import NodeConfig

    with Producer("readings", NodeConfig(towers=()), outbox=path) as p:
        p.publish_many([b"rec-%05d-" % i + b"z" * 200 for i in range(n)])
        address = p.address
        p.close(0)
    return address


def _damage(data: Path, how: str) -> None:
    size = data.stat().st_size
    if how == "empty":
        os.truncate(data, 0)
    elif how == "half":
        os.truncate(data, size // 2)
    elif how == "few_bytes":
        os.truncate(data, 40)
    elif how == "garbage":
        data.write_bytes(os.urandom(size))
    elif how == "garbage_after_header":  # meta pages intact, every other page garbage
        # (seeded: LMDB's own checks catch this garbage; garbage made to look like pages may not be)
        with open(data, "r+b") as f:
            f.seek(8192)
            f.write(random.Random(35).randbytes(size - 8192))
    elif how == "missing":
        data.unlink()


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("empty", "data.mdb is empty"),
        ("half", "data.mdb is truncated to"),
        ("few_bytes", "data.mdb is truncated to 40 bytes"),
        ("garbage", "no LMDB header"),
        ("garbage_after_header", "LMDB cannot read"),
        ("missing", "data.mdb is missing"),
    ],
)
def test_a_damaged_outbox_is_refused_never_started_over_never_a_sigbus(tmp_path: Path, how: str, says: str) -> None:
    outbox = tmp_path / "ob"
    address = _full_outbox(outbox)
    data = outbox / "data.mdb"
    _damage(data, how)
    before = data.stat().st_size if data.exists() else None
    proc = subprocess.run(
        [sys.executable, "-c", _OPEN_BOTH, str(outbox)], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by that signal) {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    assert "address" not in out, f"opened as a new outbox with address {out.get('address')}"
    for way in ("describe", "producer"):
        assert out[way].startswith("OutboxDamagedError: "), out[way]
        assert says in out[way] and address in out[way] and "move it aside" in out[way], out[way]
    # Nothing was started over: the damage is still there as it was left.
    assert (data.stat().st_size if data.exists() else None) == before
    if how == "half":
        cli = subprocess.run(dafka_cmd("outbox", str(outbox)), env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1, f"exit {cli.returncode} {cli.stderr[-2000:]}"
        assert "truncated" in cli.stderr


def test_a_short_data_file_is_refused_only_when_it_lost_pages_in_use(tmp_path: Path) -> None:
    """LMDB may end a file before its last page when that page is free: such a file opens."""
    import struct

    outbox = tmp_path / "ob"
    _full_outbox(outbox)
    data = outbox / "data.mdb"
    with open(data, "r+b") as f:  # the newer meta page now spans 5 pages more than were written
        head = f.read(8192)
        txn0, txn1 = (struct.unpack_from("<Q", head, base + 16 + 128)[0] for base in (0, 4096))
        base = 0 if txn0 > txn1 else 4096
        last = struct.unpack_from("<Q", head, base + 16 + 120)[0]
        assert data.stat().st_size == (last + 1) * 4096
        f.seek(base + 16 + 120)
        f.write(struct.pack("<Q", last + 5))
    db = OutboxDB(outbox)
    image = db.load()
    assert image.next == 3000 and len(image.records) == 3000 and image.records[-1][2].startswith(b"rec-02999-")
    db.commit([(3000, [b"more"])], [1], 0, 0, 3001)
    db.close()
    os.truncate(data, data.stat().st_size // 2)
    proc = subprocess.run(  # (a process of its own: a SIGBUS must not take the tests down)
        [sys.executable, "-c", _OPEN_BOTH, str(outbox)], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by that signal) {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    assert out["producer"].startswith("OutboxDamagedError") and "cut off" in out["producer"], out


def test_an_outbox_without_its_identity_file_gets_it_back_and_then_refuses_damage(tmp_path: Path) -> None:
    outbox = tmp_path / "ob"
    address = _full_outbox(outbox, 10)
    ident = json.loads((outbox / "outbox.id").read_text())
    assert ident["address"] == address and ident["topic"] == "readings"
    (outbox / "outbox.id").unlink()  # as an outbox from before identity files
    db = OutboxDB(outbox)
    assert db.load().next == 10
    db.close()
    assert json.loads((outbox / "outbox.id").read_text()) == ident
    os.truncate(outbox / "data.mdb", 0)
    with pytest.raises(OutboxError, match="empty"):
        OutboxDB(outbox)
    (outbox / "outbox.id").unlink()  # both gone: still not taken for a new outbox
    with pytest.raises(OutboxError, match="no outbox.id"):
        OutboxDB(outbox)


def test_an_outbox_that_never_held_a_record_is_created_again(tmp_path: Path) -> None:
    """A crash while a new outbox was created (before any partition claimed it) leaves nothing to lose."""
    OutboxDB(tmp_path / "ob").close()
    os.truncate(tmp_path / "ob" / "data.mdb", 0)
    db = OutboxDB(tmp_path / "ob")
    assert db.load().address is None
    db.close()
    assert [n for n in os.listdir(tmp_path / "ob") if n.startswith("data.mdb.damaged-")]  # kept aside


# A producer on an outbox, publishing one record per line read, saying what happened.
_HOLDER = """
import os, sys
from dafka.config import NodeConfig
from dafka.nodes.producer import Producer
from dafka.outbox import db
if sys.argv[2] == "no-flock":  # as on a filesystem where flock does nothing
    db.OutboxDB._take_lock = lambda self: os.open(self.path, os.O_RDONLY)
try:
    p = Producer("readings", NodeConfig(towers=()), outbox=sys.argv[1])
except Exception as exc:
    print("refused", type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("open", p.address, p.next_offset, flush=True)
for line in sys.stdin:
    try:
        print("published", p.publish(line.strip().encode()).offset, flush=True)
    except Exception as exc:
        print("failed", type(exc).__name__, exc, flush=True)
p.close(0)
"""


def _holder(outbox: Path, mode: str = "") -> subprocess.Popen:
    return spawned(
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(outbox), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
            text=True,
        )
    )


def _say(proc: subprocess.Popen, line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _opened(proc: subprocess.Popen) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("open "), f"{line} {proc.stderr.read() if proc.stderr else ''}"
    return line.split()


@pytest.mark.timeout(60)
def test_deleting_lock_files_does_not_let_a_second_process_in(tmp_path: Path) -> None:
    outbox = tmp_path / "ob"
    first = _holder(outbox)
    _, address, _ = _opened(first)
    assert _say(first, "a") == "published 0"
    for name in os.listdir(outbox):  # every lock file anyone could delete
        if name.endswith(".lock") or name == "lock.mdb":
            os.unlink(outbox / name)
    second = _holder(outbox)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 3, f"a second process opened it: {out} {err[-2000:]}"
    assert "in use by another process" in out
    assert _say(first, "b") == "published 1"  # the first one goes on
    first.communicate("", timeout=60)
    assert describe(outbox)["records"] == 2 and describe(outbox)["partition"] == address


@pytest.mark.timeout(60)
def test_two_incarnations_of_one_outbox_the_older_is_fenced_off(tmp_path: Path) -> None:
    """Should exclusion fail (no flock), the process that opened the outbox first stops writing."""
    outbox = tmp_path / "ob"
    first = _holder(outbox)
    _, address, _ = _opened(first)
    for i in range(3):
        assert _say(first, f"first-{i}") == f"published {i}"
    second = _holder(outbox, "no-flock")
    assert _opened(second)[1:] == [address, "3"]  # continues where the outbox says
    fenced = _say(first, "first-3")
    assert fenced.startswith("failed OutboxFencedError") and "opened by another process" in fenced, fenced
    assert _say(first, "first-4").startswith("failed OutboxFencedError")  # and stays so
    assert _say(second, "second-3") == "published 3"
    first.communicate("", timeout=60)
    second.communicate("", timeout=60)
    db = OutboxDB(outbox, readonly=True)
    try:
        assert [c for _, _, c in db.load().records] == [b"first-0", b"first-1", b"first-2", b"second-3"]
    finally:
        db.close()


@pytest.fixture
def small_fs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real 1 MiB filesystem (tmpfs; skipped where mounting is not permitted)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {made.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


@pytest.mark.timeout(60)
def test_a_full_disk_says_disk_full_and_what_to_do(small_fs: Path) -> None:
    from dafka.config import NodeConfig

    filler = small_fs / "filler"
    filler.write_bytes(b"f" * 300_000)
    with Producer("readings", NodeConfig(towers=()), outbox=small_fs / "ob", publish_timeout=5) as p:
        published = 0
        with pytest.raises(OutboxFullError) as full:
            for _ in range(2000):
                p.publish(b"x" * 1000)
                published += 1
        text = str(full.value)
        assert "disk full" in text and "Free space" in text, text
        assert published > 100
        filler.unlink()  # room again: publishing works again, at the next offset
        assert p.publish(b"after").offset == published
        p.close(0)
    db = OutboxDB(small_fs / "ob", readonly=True)
    try:
        image = db.load()
        assert image.next == published + 1 and len(image.records) == published + 1
    finally:
        db.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pages_free", [0, 1, 2, 4])
def test_a_new_outbox_on_a_full_disk_says_disk_full_never_a_sigbus(small_fs: Path, pages_free: int) -> None:
    """LMDB writes lock.mdb through a mapping: on a full tmpfs that was a SIGBUS."""
    with open(small_fs / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        for _ in range(2000):  # until the filesystem is full
            f.write(b"f" * 4096)
    os.truncate(small_fs / "filler", max(0, (small_fs / "filler").stat().st_size // 4096 - pages_free) * 4096)
    proc = subprocess.run(
        [sys.executable, "-c", _OPEN_BOTH, str(small_fs / "ob")], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by that signal) {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    assert out["producer"] == "opened" or (
        out["producer"].startswith("OutboxFullError") and "disk full" in out["producer"]
    ), out["producer"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    last_pg=st.integers(2, 30),
    written=st.integers(2, 31),
    roots=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    pages=st.lists(st.tuples(st.sampled_from([0x01, 0x02, 0x04, 0x22, 0x00, 0xFFFF]), st.binary(min_size=0, max_size=64)), max_size=30),
    seed=st.integers(0, 1 << 16),
)
def test_fuzz_the_data_file_check_reads_any_file_without_failing(
    tmp_path: Path, last_pg: int, written: int, roots: tuple[int, int], pages: list[tuple[int, bytes]], seed: int
) -> None:
    """dafka.outbox.check decodes LMDB pages from a file that may be anything: a verdict, never an exception."""
    import struct

    from dafka.outbox import check

    rnd = random.Random(seed)
    body = bytearray(rnd.randbytes(written * 4096))
    for base in (0, 4096):
        struct.pack_into("<II", body, base + 16, check.MAGIC, 1)
        struct.pack_into("<I", body, base + 16 + 24, 4096)
        struct.pack_into("<Q", body, base + 16 + 24 + 40, roots[0])
        struct.pack_into("<Q", body, base + 16 + 24 + 48 + 40, roots[1])
        struct.pack_into("<QQ", body, base + 16 + 24 + 96, last_pg, base // 4096 + 1)
    for n, (flags, tail) in enumerate(pages[: written - 2]):
        at = (n + 2) * 4096
        struct.pack_into("<HH", body, at + 10, flags, 16 + 2 * rnd.randint(0, 40))
        body[at + 16 : at + 16 + len(tail)] = tail
    path = tmp_path / f"data-{seed}.mdb"
    path.write_bytes(bytes(body))
    verdict = check.damage(path)
    assert verdict is None or isinstance(verdict, str)
    if written < last_pg + 1 and verdict is None:
        assert all(2 <= r < written for r in roots)  # a root cut off or out of range is a verdict
