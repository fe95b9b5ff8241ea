"""A producer restarted with its identity never assigns an acknowledged offset again.

Real processes on 127.0.0.1: `dafka store` processes (one SIGSTOPped while it
holds the highest head), producers killed with SIGKILL and restarted from their
identity file.  "Acked means durable": an offset acknowledged to one
incarnation must never carry other contents in a later one.  The
reservation in the identity file (see dafka.core.resume) is what makes it hold.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB
from tests.conftest import spawned, start_store_process, subprocess_env, wait_until

pytestmark = pytest.mark.timeout(240)

TOPIC = "resume"
PAD = b"x" * 1000  # big records: what a stopped store's socket buffers hold stays small

# Publishes until killed.  Record at offset o is b"<prefix>-<o>-" + PAD.  With
# ACKs it waits for each chunk's ACK and prints the last acknowledged offset;
# without, it prints the last published offset.
PRODUCER = textwrap.dedent(
    """
    import sys, time
    from dafka.config import NodeConfig, TowerAddress
    from dafka.nodes.producer import Producer

    host, pin, pout, identity, prefix, acks = sys.argv[1:7]
    acks = acks == "1"
    cfg = NodeConfig(towers=(TowerAddress(host, int(pin), int(pout)),), bind="127.0.0.1",
                     beacon_interval=0.2, beacon_timeout=2.0)
    producer = Producer("resume", cfg, identity=identity, resume_timeout=10.0, acks=acks)
    print("ready", producer.address, producer.next_offset, flush=True)
    pad = b"x" * 1000
    while True:
        first = producer.next_offset
        receipt = producer.publish_many(b"%s-%d-" % (prefix.encode(), first + i) + pad for i in range(50))
        if acks:
            if receipt.wait(30):
                print(receipt.offset, flush=True)
        else:
            print(receipt.offset, flush=True)
            time.sleep(0.002)
    """
)


def content(prefix: bytes, offset: int) -> bytes:
    return b"%s-%d-" % (prefix, offset) + PAD


def start_producer(cfg: NodeConfig, identity: Path, prefix: str, acks: bool) -> subprocess.Popen:
    return start_producer_at(cfg, identity, prefix, acks)[0]


def start_producer_at(cfg: NodeConfig, identity: Path, prefix: str, acks: bool) -> tuple[subprocess.Popen, int]:
    """A producer process, once resumed; and the offset it continues at."""
    t = cfg.towers[0]
    proc = spawned(
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, t.host, str(t.in_port), str(t.out_port), str(identity),
             prefix, "1" if acks else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
    )
    line = proc.stdout.readline().split()
    assert line[:1] == [b"ready"], (line, proc.stderr.read() if proc.poll() is not None else b"")
    return proc, int(line[2])


def read_until(proc: subprocess.Popen, at_least: int) -> int:
    """Read printed offsets until one reaches ``at_least``; the last read."""
    deadline = time.monotonic() + 60
    last = -1
    while last < at_least:
        assert time.monotonic() < deadline, "the producer got stuck"
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        last = int(line)
    return last


def kill_and_drain(proc: subprocess.Popen, last: int) -> int:
    """SIGKILL ``proc``; the highest offset it printed (its output is read to the end)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for line in proc.stdout.read().splitlines():
        if line.strip().isdigit():
            last = max(last, int(line))
    return last


def stop_store(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(30)


def stored(db: Path, partition: str) -> dict[int, bytes]:
    records = RecordDB(db, sync=False)
    try:
        return {r.offset: bytes(r.content) for r in records.read(TOPIC, partition, 0, 1 << 40)}
    finally:
        records.close()


def test_restart_while_the_store_with_the_highest_head_is_stopped(cfg: NodeConfig, tmp_path: Path) -> None:
    # Defect A: the producer resumed after the head of the store that answered
    # GET-HEADS (or after its 0.5 s-old file), reusing offsets a SIGSTOPped
    # store had acknowledged with other contents.
    identity = tmp_path / "id.json"
    high = start_store_process(cfg, tmp_path / "high")
    low = start_store_process(cfg, tmp_path / "low")
    proc = start_producer(cfg, identity, "old", acks=True)
    acked = read_until(proc, 1000)
    low.send_signal(signal.SIGSTOP)  # falls behind: only `high` acknowledges from now on
    acked = read_until(proc, acked + 20_000)
    acked = kill_and_drain(proc, acked)
    time.sleep(0.3)  # `high` commits what was in flight (it may hold more than was acked)
    high.send_signal(signal.SIGSTOP)  # holds the highest head, answers nothing
    low.send_signal(signal.SIGCONT)  # answers GET-HEADS with its lower head
    address = json.loads(identity.read_text())["address"]
    old_acked = {o: content(b"old", o) for o in range(acked + 1)}

    with Producer(TOPIC, cfg, identity=identity, resume_timeout=10.0) as producer:
        assert producer.address == address
        start = producer.next_offset
        n = max(2000, acked + 2000 - start)  # far enough to reach past `high`'s head either way
        producer.publish_many(content(b"new", start + i) for i in range(n))
        high.send_signal(signal.SIGCONT)
        flushed = producer.flush(90)
        new_acked = {o: content(b"new", o) for o in range(start, producer.acked_offset + 1)}
        bad_acks = producer.bad_acks
    stop_store(high)
    stop_store(low)

    twice = sorted(set(old_acked) & set(new_acked))
    assert not twice, (
        f"{len(twice)} offsets acknowledged to both incarnations with different contents"
        f" ({twice[0]}..{twice[-1]}); the new one started at {start}, the old one acked {acked}"
    )
    assert flushed and bad_acks == 0
    views = {name: stored(tmp_path / name, address) for name in ("high", "low")}
    for offset, want in (old_acked | new_acked).items():
        held = [view[offset] for view in views.values() if offset in view]
        assert want in held, f"acknowledged offset {offset} is in no store"
        assert all(c == want for c in held), f"a store holds other contents at acknowledged {offset}"


def test_restart_without_acks_does_not_publish_offsets_the_store_holds(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    # Defect B: an acks=False producer continued after its 0.5 s-old identity
    # file; the store dropped its new records as duplicates of the old ones.
    identity = tmp_path / "id.json"
    store = start_store_process(cfg, tmp_path / "db")
    proc = start_producer(cfg, identity, "old", acks=False)
    read_until(proc, 20_000)
    kill_and_drain(proc, -1)
    address = json.loads(identity.read_text())["address"]

    with Producer(TOPIC, cfg, identity=identity, resume_timeout=10.0, acks=False) as producer:
        start = producer.next_offset
        producer.publish_many(content(b"new", start + i) for i in range(2000))
        last = producer.next_offset - 1
        # The store acknowledges what it holds (nobody waits for it, but it tells).
        assert wait_until(lambda: producer.acked_offset >= last, timeout=60)
    stop_store(store)

    view = stored(tmp_path / "db", address)
    wrong = [o for o in range(start, last + 1) if view.get(o) != content(b"new", o)]
    assert not wrong, (
        f"{len(wrong)} of the new run's records are not stored (first {wrong[0]}: the store holds"
        f" {view.get(wrong[0], b'nothing')[:20]!r}); it started at {start}"
    )
    old = [o for o, c in view.items() if c.startswith(b"old-") and c != content(b"old", o)]
    assert not old


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2]",
        '"a string"',
        '{"address": 7, "topic": "resume", "acked": 1, "next": 2}',
        '{"address": "%s", "topic": "resume", "acked": "1", "next": 2}' % ("A" * 32),
        '{"address": "%s", "topic": "resume", "acked": 1, "next": true}' % ("A" * 32),
        '{"address": "%s", "topic": "resume", "acked": 1, "next": 2, "reserved": -5}' % ("A" * 32),
    ],
)
def test_identity_file_of_the_wrong_shape_is_refused_naming_it(cfg: NodeConfig, tmp_path: Path, text: str) -> None:
    path = tmp_path / "id.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="identity file .*id.json"):
        Producer(TOPIC, cfg, identity=path)
    assert path.read_text() == text  # left as it was


def test_reservation_is_saved_before_use_and_exact_after_close(cfg: NodeConfig, tmp_path: Path) -> None:
    identity = tmp_path / "id.json"
    with Producer(TOPIC, cfg, identity=identity, acks=False) as producer:
        saved = json.loads(identity.read_text())
        assert saved["reserved"] >= 1  # a new identity reserves before its first publish
        first = saved["reserved"]
        producer.publish_many(b"r-%d" % i for i in range(first + 5))  # outruns it: renewed at once
        saved = json.loads(identity.read_text())
        assert saved["reserved"] >= producer.next_offset > first
    saved = json.loads(identity.read_text())
    assert saved["reserved"] == saved["next"] == first + 5  # a clean close: no hole next time


def test_an_ack_while_resuming_counts_as_a_store_head(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    # A store's pending ACK reaches a resuming producer before its GET-HEADS
    # answer: it was logged as "ACK beyond the last published offset" (the
    # placeholder window) and ignored. It says what the store holds.
    address = "E" * 32
    identity = tmp_path / "id.json"
    identity.write_text(json.dumps({"address": address, "topic": TOPIC, "acked": 5, "next": 6, "reserved": 6}))
    peer = raw_peer([])
    stop = threading.Event()

    def ack_while_resuming() -> None:
        while not stop.is_set():
            peer.pump(0.02)
            if peer.subscribed(wire.P_ACK + address.encode()):
                peer.send(wire.Ack(address, TOPIC, 1000))

    sender = threading.Thread(target=ack_while_resuming, daemon=True)
    sender.start()
    try:
        with Producer(TOPIC, cfg, identity=identity, resume_timeout=5.0) as producer:
            stop.set()
            sender.join(5)
            assert producer.next_offset == 1001
            assert producer.bad_acks == 0
            producer.close(0)
    finally:
        stop.set()
        sender.join(5)


def test_readers_pass_a_restart_hole_at_once_when_every_store_holds_none_of_it(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    # Issue 34 item 1: after kill -9 and a restart with the same identity, the
    # offsets the crashed run had reserved and never used are a hole.  Before
    # the fix every reader waited skip_after (10 s) to pass it, though the
    # only store had said it holds none of it: a consumer that gives up after
    # 4 s without a record got none of the records published after the restart.
    identity = tmp_path / "id.json"
    store = start_store_process(cfg, tmp_path / "db")
    proc = start_producer(cfg, identity, "old", acks=True)
    acked = kill_and_drain(proc, read_until(proc, 300))
    from dafka.consumer import Consumer

    with Consumer([TOPIC], cfg, offset_reset="earliest") as consumer:
        got: dict[int, bytes] = {}

        def poll_until(done: Callable[[], bool], idle: float) -> None:
            """Poll until ``done()`` or no record came for ``idle`` seconds (bounded: 60 s)."""
            deadline = time.monotonic() + 60
            last = time.monotonic()
            while not done() and time.monotonic() - last < idle and time.monotonic() < deadline:
                record = consumer.poll(0.1)
                if record is not None:
                    got[record.offset] = bytes(record.value)
                    last = time.monotonic()

        poll_until(lambda: max(got, default=-1) >= acked, idle=30)
        assert max(got, default=-1) >= acked, f"got {len(got)} of the old run's {acked + 1} records"
        producer = Producer(TOPIC, cfg, identity=identity, resume_timeout=10.0)
        try:
            start = producer.next_offset
            assert start > max(got) + 1  # the hole: reserved by the crashed run, never used
            published = time.monotonic()
            producer.publish_many(content(b"new", start + i) for i in range(300))
            poll_until(lambda: all(o in got for o in range(start, start + 300)), idle=4.0)
            took = time.monotonic() - published
        finally:
            producer.close(0.5)  # (the store's own ACKs still wait its skip_after: not tested here)
    stop_store(store)
    new = [o for o in range(start, start + 300) if got.get(o) == content(b"new", o)]
    assert len(new) == 300, (
        f"the consumer got {len(new)} of the 300 records published after the restart"
        f" (next offset {start}, the old run ended at {max(o for o in got if o < start)})"
    )
    assert took < 4.0, f"all 300 took {took:.1f}s"


def test_stores_pass_a_restart_hole_at_once_so_the_restarted_producer_is_acknowledged_soon(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    # Issue 34 item 1, the stores' side: after kill -9 and a restart with the
    # same identity, each store (a reader of the partition) waited skip_after
    # (10 s) before it recorded the reserved-but-unused offsets as a hole, and
    # only then stored and acknowledged what the restarted producer published:
    # its first ACK came ~10 s after the restart, though the producer said the
    # offsets are its restart hole and the other store said it holds none.
    import queue

    identity = tmp_path / "id.json"
    stores = [start_store_process(cfg, tmp_path / name) for name in ("a", "b")]
    try:
        proc = start_producer(cfg, identity, "old", acks=True)
        acked = kill_and_drain(proc, read_until(proc, 300))
        spawned_at = time.monotonic()
        proc, start = start_producer_at(cfg, identity, "new", acks=True)
        ready_at = time.monotonic()
        lines: queue.Queue[bytes] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
        reader.start()
        try:
            first = lines.get(timeout=15)
        except queue.Empty:
            first = b""
        first_ack_at = time.monotonic()
        new_acked = kill_and_drain(proc, int(first) if first.strip().isdigit() else -1)
        reader.join(10)
    finally:
        for store in stores:
            stop_store(store)
    took = first_ack_at - ready_at
    assert first.strip().isdigit(), f"no ACK within 15 s of the restart ({first!r})"
    assert took < 2.0, (
        f"the restarted producer's first ACK came {took:.1f}s after it resumed"
        f" ({first_ack_at - spawned_at:.1f}s after it was started)"
    )
    address = json.loads(identity.read_text())["address"]
    views = [stored(tmp_path / name, address) for name in ("a", "b")]
    want = {o: content(b"old", o) for o in range(acked + 1)}
    want |= {o: content(b"new", o) for o in range(start, new_acked + 1)}
    assert new_acked >= start > acked + 1  # a hole: reserved by the crashed run, never used
    for offset, value in want.items():
        held = [view[offset] for view in views if offset in view]
        assert held and all(c == value for c in held), f"acknowledged offset {offset}: {held[:1]!r}"
