"""Without fsync the Tank gateway commits on its I/O thread (``Store._commit_inline``): real
LMDB, real TCP, a client with a window of produces in flight.  With fsync the I/O thread never
commits: a flush there would stop every other client for its duration."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.errors import StorageFullError
from dafka.store.pipeline import Work
from dafka.tank.bundle import encode_bundle
from dafka.tank.client import TankClient, TankConnectionError, TankTimeoutError
from dafka.tank.gateway import Gateway
from dafka.tank.messages import ProduceResponse
from tests.conftest import wait_until
from tests.tank.test_gateway import HOST, consume_all, values
from tests.tank.test_pipelined_commit import bundle_of, produce_request
from tests.test_store_diskfull import _mount, _resize

pytestmark = pytest.mark.timeout(120)


def reread(path: Path, cfg: NodeConfig, topic: str, sync: bool = False) -> list[tuple[Any, ...]]:
    """A topic's partition 0 as a gateway reopened on ``path`` serves it (what was committed)."""
    again = Gateway(path, cfg, listen=(HOST, 0), sync=sync)
    try:
        with TankClient(HOST, again.tank_port, timeout=30) as c:
            return consume_all(c, topic, 0)
    finally:
        again.close()


class CommitThreads(Gateway):
    """Records which thread wrote each commit, and how many records it held."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.commits: list[tuple[str, int]] = []
        super().__init__(*args, **kwargs)

    def _write_work(self, work: Work) -> Any:
        self.commits.append((threading.current_thread().name, work.records))
        return super()._write_work(work)


def publish_windows(gw: Gateway, topic: str, bundles: int, per: int, window: int) -> list[bytes]:
    """Produce ``bundles`` bundles with ``window`` requests in flight; every answer must be a
    success, in order.  Returns the values expected back."""
    with TankClient(HOST, gw.tank_port, timeout=30) as c:
        c.create_topic(topic, 1)
        inflight: list[int] = []
        for i in range(bundles):
            inflight.append(c.send(produce_request(c, topic, bundle_of(i, per))))
            if len(inflight) == window:
                resp = c.wait(inflight.pop(0))
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
        for req in inflight:
            resp = c.wait(req)
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
    return [b"b%d-m%d" % (i, j) for i in range(bundles) for j in range(per)]


def test_without_fsync_the_io_thread_commits_a_window_and_every_record_reads_back(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    gw = CommitThreads(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False)
    try:
        expected = publish_windows(gw, "inline", 300, 20, 8)
        io_commits = [n for name, n in gw.commits if name.startswith("dafka-gateway")]
        # Most commits of a busy client run where its requests are read; the writer may take
        # a staged work first now and then (it is woken by the offer): both are correct.
        assert sum(io_commits) > len(expected) // 2, gw.commits[:20]
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            assert values(consume_all(c, "inline", 0)) == expected
        assert not gw._pipe.halted and gw._pipe.committing is None
    finally:
        gw.close()


def test_an_inline_commit_does_not_wake_the_idle_writer(cfg: NodeConfig, tmp_path: Path) -> None:
    # Each wake of a writer with nothing to take cost a thread switch and the GIL handed over
    # and back, one a commit: 5-8% of the gateway's CPU in a publish.  Requests one at a
    # time: every one is a commit of its own on the I/O thread.
    gw = CommitThreads(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False)
    try:
        publish_windows(gw, "warm", 5, 10, 1)  # (the first commits)
        wakes = 0
        cond = gw._writer_cond
        notify = cond.notify

        def counted(n: int = 1) -> None:
            nonlocal wakes
            wakes += 1
            notify(n)

        cond.notify = counted  # type: ignore[method-assign]
        before = len(gw.commits)
        expected = publish_windows(gw, "quiet", 200, 10, 1)
        inline = [n for name, n in gw.commits[before:] if name.startswith("dafka-gateway")]
        assert len(inline) >= 150, gw.commits[before:][:20]
        assert wakes <= len(gw.commits) - before - len(inline) + 10, (wakes, len(inline))
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            assert values(consume_all(c, "quiet", 0)) == expected
    finally:
        gw.close()


def test_with_fsync_every_commit_is_the_writers(cfg: NodeConfig, tmp_path: Path) -> None:
    gw = CommitThreads(tmp_path / "gw", cfg, listen=(HOST, 0))
    try:
        expected = publish_windows(gw, "synced", 60, 20, 8)
        assert gw.commits and {name for name, _n in gw.commits} == {"dafka-store-writer"}
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            assert values(consume_all(c, "synced", 0)) == expected
    finally:
        gw.close()


def test_connections_read_in_one_loop_turn_share_a_commit(cfg: NodeConfig, tmp_path: Path) -> None:
    """Many clients of small produces: what one turn of the I/O loop read goes in one commit,
    not a commit per connection (that halved the rate of 90 such clients)."""
    gw = CommitThreads(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False)
    clients = [TankClient(HOST, gw.tank_port, timeout=30) for _ in range(30)]
    try:
        clients[0].create_topic("many", 1)
        hold, held = threading.Event(), threading.Event()

        def block() -> None:  # the I/O thread waits here while every client sends
            held.set()
            hold.wait(10)

        gw.call_soon(block)
        assert held.wait(10)
        before = len(gw.commits)
        requests = [c.send(produce_request(c, "many", bundle_of(i, 3))) for i, c in enumerate(clients)]
        hold.set()
        for c, req in zip(clients, requests, strict=True):
            resp = c.wait(req)
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
        commits = gw.commits[before:]
        assert sum(n for _name, n in commits) == 90
        assert len(commits) < len(clients) // 2, commits  # the writer may take a part meanwhile
        got = values(consume_all(clients[0], "many", 0))
        assert sorted(got) == sorted(b"b%d-m%d" % (i, j) for i in range(30) for j in range(3))
    finally:
        for c in clients:
            c.close()
        gw.close()


class SlowRetention(Gateway):
    """A gateway whose retention rounds have a backlog: each step is a real LMDB write
    transaction of 20 ms, and a round goes on (Store._enforce_retention, its own stop rule)
    until a commit waits or its budget of 2 s is spent."""

    retention_budget = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.rounds = 0
        super().__init__(*args, **kwargs)
        real_write = self.db._write

        def step(now_ms: int, policy: Any, *, max_records: int = 10_000, damaged: Any = None) -> Any:
            from dafka.store.retention import RetentionResult

            real_write(lambda txn: time.sleep(0.02))
            return RetentionResult(1, 1, True)

        self.db.enforce_retention = step  # type: ignore[method-assign]

    def _enforce_retention(self) -> None:
        self.rounds += 1
        super()._enforce_retention()


def test_a_retention_round_on_the_writer_never_holds_up_the_io_thread(cfg: NodeConfig, tmp_path: Path) -> None:
    """A guard: an inline commit takes the staged work off the pipe, so a retention round on
    the writer does not see it waiting and goes on for its budget; the I/O thread must still
    get the write lock between two steps, not wait out the round (every client of the
    gateway and the mesh would stand still that long)."""
    gw = SlowRetention(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False, retention_interval=0.2)
    try:
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("ret", 1)
            worst = 0.0
            deadline = time.monotonic() + 1.5
            i = 0
            while time.monotonic() < deadline or gw.rounds < 2:
                assert time.monotonic() < deadline + 10, "no retention rounds"
                t0 = time.monotonic()
                resp = c.wait(c.send(produce_request(c, "ret", bundle_of(i, 2))))
                worst = max(worst, time.monotonic() - t0)
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
                i += 1
                time.sleep(0.005)  # (a paced client: its produces land in retention rounds)
            assert gw.rounds >= 2
            # One retention step (20 ms) and a linger at most, with room for a loaded machine;
            # not a whole round's budget (2 s).
            assert worst < 1.0, worst
            assert values(consume_all(c, "ret", 0)) == [b"b%d-m%d" % (k, j) for k in range(i) for j in range(2)]
    finally:
        gw.close()


class FailsOnceInline(Gateway):
    """A gateway whose answering of a commit fails once (a bug's stand-in), on the I/O thread's
    own commit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.failed = 0
        super().__init__(*args, **kwargs)

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        if self._inlining and not self.failed:
            self.failed += 1
            raise RuntimeError("a bug answering a commit")
        super().on_commit(heads)


def test_a_failure_answering_an_inline_commit_is_logged_and_the_gateway_goes_on(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer's results are answered by a command of the I/O loop, where an exception is
    logged and the loop goes on; an inline commit is answered from before_wait, which the
    loop called unguarded: the same exception ended the I/O thread (every client then waited
    for nothing, the gateway dead but its process up)."""
    gw = FailsOnceInline(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False)
    try:
        with TankClient(HOST, gw.tank_port, timeout=10) as c:
            c.create_topic("bug", 1)
            # Produce until a commit of the I/O thread's own failed (the writer may take one).
            sent = 0
            while not gw.failed:
                assert sent < 200, "no inline commit"
                req = c.send(produce_request(c, "bug", bundle_of(sent, 2)))
                sent += 1
                # Its commit failed to be answered, or it is committed and answered.
                wait_until(lambda n=2 * sent: gw.failed or gw.stored >= n and not gw._pending, 10)
                if not gw.failed:
                    c.wait(req)
            with TankClient(HOST, gw.tank_port, timeout=10) as other:
                resp = other.wait(other.send(produce_request(other, "bug", bundle_of(sent, 2))))
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            resp = c.wait(req)  # the one whose commit failed to be answered: with the next commit
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            assert values(consume_all(c, "bug", 0)) == [b"b%d-m%d" % (i, j) for i in range(sent + 1) for j in range(2)]
        assert "a bug answering a commit" in caplog.text
    finally:
        gw.close()


def test_close_while_clients_produce_keeps_every_answered_record(cfg: NodeConfig, tmp_path: Path) -> None:
    """close() while three clients keep producing (windows of 4) and the I/O thread commits
    inline: it returns, and every produce answered before is there once, in order, when the
    database is opened again."""
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False)
    with TankClient(HOST, gw.tank_port, timeout=30) as c:
        c.create_topic("shut", 1)
    answered: list[list[int]] = [[] for _ in range(3)]
    started = threading.Barrier(4)

    def produce(t: int) -> None:
        try:
            with TankClient(HOST, gw.tank_port, timeout=10) as c:
                started.wait(10)
                inflight: list[tuple[int, int]] = []
                for i in range(100_000):
                    inflight.append((i, c.send(produce_request(c, "shut", bundle_of(1000_000 * t + i, 5)))))
                    if len(inflight) == 4:
                        i0, req = inflight.pop(0)
                        resp = c.wait(req)
                        assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
                        answered[t].append(i0)
        except Exception:  # (the gateway went away: what was answered is what counts)
            return

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    started.wait(10)
    wait_until(lambda: all(len(a) > 20 for a in answered), 20)
    t0 = time.monotonic()
    gw.close()
    assert time.monotonic() - t0 < 10
    for th in threads:
        th.join(30)
    got = reread(tmp_path / "gw", cfg, "shut")
    vals = values(got)
    assert len(vals) == len(set(vals))
    assert [r[0] for r in got] == list(range(got[0][0], got[0][0] + len(got)))
    stored = set(vals)
    for t in range(3):
        for i in answered[t]:
            assert b"b%d-m4" % (1000_000 * t + i) in stored, (t, i)


class StopsInTheTurnThatReadAProduce(Gateway):
    """close() from another thread lands in the loop turn that read a produce: the loop ends
    after that turn, without the before_wait that commits what the turn staged (the stop is
    set here, at that point, to make the race certain)."""

    stop_armed = False

    def _process(self, conn: Any) -> None:
        super()._process(conn)
        if self.stop_armed and self._pending:
            self.stop_armed = False
            self._stop.set()


def test_a_produce_read_in_the_last_loop_turn_is_committed_and_answered_at_shutdown(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    """The turn's offers do not wake the writer (Store._wake_deferred): its before_wait
    commits them.  The last turn before a stop has none, and the writer, idle, sleeps until
    its next retention round (``retention_interval``, 1 s by default): shutdown waited that
    long for the produce, or (a longer interval) gave up after 5 s and closed the connection
    unanswered, the records committed all the same when the writer stopped (the client, not
    answered, sends them again)."""
    gw = StopsInTheTurnThatReadAProduce(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False, retention_interval=30)
    closed = False
    try:
        with TankClient(HOST, gw.tank_port, timeout=10) as c:
            c.create_topic("last", 1)
            resp = c.wait(c.send(produce_request(c, "last", bundle_of(0, 3))))
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            # The writer idle in its wait (nothing staged: until its next retention round).
            wait_until(lambda: gw._pipe.committing is None and len(gw._writer_cond._waiters) == 1, 10)  # type: ignore[attr-defined]
            gw.stop_armed = True
            req = c.send(produce_request(c, "last", bundle_of(1, 3)))
            wait_until(gw._stop.is_set, 10)
            t0 = time.monotonic()
            gw.close()
            closed = True
            took = time.monotonic() - t0
            resp = c.wait(req)  # answered before the connection closed
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            assert took < 2.0, took
    finally:
        if not closed:
            gw.close()
    assert values(reread(tmp_path / "gw", cfg, "last")) == [b"b%d-m%d" % (i, j) for i in range(2) for j in range(3)]


class FailsAnsweringAtShutdown(StopsInTheTurnThatReadAProduce):
    """... and answering that commit fails (a bug's stand-in)."""

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        if self._stop.is_set():
            raise RuntimeError("a bug answering a commit at shutdown")
        super().on_commit(heads)


def test_a_failure_answering_the_last_turns_commit_at_shutdown_still_closes_the_connections(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The commit of the last turn at shutdown is answered from on_shutdown: an exception
    there must not skip the rest of it (the Tank connections and the listener left open)."""
    gw = FailsAnsweringAtShutdown(tmp_path / "gw", cfg, listen=(HOST, 0), sync=False, retention_interval=30)
    port = gw.tank_port
    try:
        with TankClient(HOST, port, timeout=10) as c:
            c.create_topic("bug", 1)
            wait_until(lambda: gw._pipe.committing is None and len(gw._writer_cond._waiters) == 1, 10)  # type: ignore[attr-defined]
            gw.stop_armed = True
            req = c.send(produce_request(c, "bug", bundle_of(0, 3)))
            wait_until(gw._stop.is_set, 10)
            gw.close()
            with pytest.raises(TankConnectionError):
                c.wait(req, timeout=5)  # closed, not left open (a timeout)
        with pytest.raises(OSError):
            socket.create_connection((HOST, port), timeout=2).close()
        assert "a bug answering a commit at shutdown" in caplog.text
    finally:
        gw.close()


class PausedWithAProduce(Gateway):
    """A connection paused while a produce of it is buffered, unread (as one whose answers
    were backed up), and its output empty when the gateway stops."""

    hold = True

    def _process(self, conn: Any) -> None:
        if self.hold and conn.frames.buffered:
            conn.reading = False  # paused: its frames wait
            return
        super()._process(conn)


@pytest.mark.parametrize("sync", [False, True], ids=["no-sync", "fsync"])
def test_a_produce_left_unread_at_shutdown_is_neither_stored_nor_answered(
    cfg: NodeConfig, tmp_path: Path, sync: bool
) -> None:
    """Shutdown answers what was committed, then closes each connection.  A produce still
    buffered then, unread, must not be taken at that point: it was committed by the stopping
    writer but never answered, and its client, seeing the connection close, sends it again
    (stored twice)."""
    gw = PausedWithAProduce(tmp_path / "gw", cfg, listen=(HOST, 0), sync=sync)
    closed = False
    try:
        gw.hold = False
        with TankClient(HOST, gw.tank_port, timeout=10) as c:
            c.create_topic("unread", 1)
            resp = c.wait(c.send(produce_request(c, "unread", bundle_of(0, 3))))
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            gw.hold = True
            req = c.send(produce_request(c, "unread", bundle_of(1, 3)))
            wait_until(lambda: any(not conn.reading for conn in list(gw._conns.values())), 10)
            gw.hold = False  # from here on, the gateway's own code decides
            gw.close()
            closed = True
            with pytest.raises(TankConnectionError):
                c.wait(req, timeout=5)  # not answered: closed
    finally:
        if not closed:
            gw.close()
    assert values(reread(tmp_path / "gw", cfg, "unread", sync)) == [b"b0-m%d" % j for j in range(3)]


class FailsAnsweringOnce(Gateway):
    """The writer's commit is answered with an exception once (a bug's stand-in)."""

    failed = 0

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        if self._pending and not self.failed:
            self.failed += 1
            raise RuntimeError("a bug answering a commit")
        super().on_commit(heads)


def test_a_failure_answering_a_commit_still_reports_it_to_the_writer(
    cfg: NodeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The report after a commit's answers (Store._report) tells a writer lingering for the
    refills that they will not come; skipped by the exception, it was never made, and the
    records queued meanwhile waited for the next event (none came at shutdown)."""
    gw = FailsAnsweringOnce(tmp_path / "gw", cfg, listen=(HOST, 0), sync=True, retention_interval=60)
    try:
        with TankClient(HOST, gw.tank_port, timeout=10) as c:
            c.create_topic("bug", 1)
            wait_until(lambda: gw._pipe._reported and gw._pipe.committing is None, 10)
            c.send(produce_request(c, "bug", bundle_of(0, 3)))  # committed, its answer fails
            wait_until(lambda: gw.failed == 1, 10)
            wait_until(lambda: gw._pipe._reported, 5)
            assert "a bug answering a commit" in caplog.text
            resp = c.wait(c.send(produce_request(c, "bug", bundle_of(1, 3))), timeout=10)
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
    finally:
        gw.close()


def test_a_full_disk_under_the_inline_commit_answers_nothing_unwritten_and_loses_nothing(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    """The inline commit's lean transaction (RecordDB.append_plain_blocks) fails on a real full
    tmpfs (ENOSPC): nothing of it is answered, the blocks are kept, new produces are refused
    (error 2); once there is room again every kept produce is answered OK and every record
    answered OK reads back, in order."""
    mnt = tmp_path / "fs"
    if not _mount(mnt, 3 << 20):
        pytest.skip("needs root (mount -t tmpfs)")
    try:
        gw = CommitThreads(mnt / "gw", cfg, listen=(HOST, 0), sync=False)
        try:
            lean_failures: list[Exception] = []
            lean_commits = 0
            plain = gw.db.append_plain_blocks

            def watched(blocks: Any, gate: Any = None) -> Any:
                nonlocal lean_commits
                try:
                    heads = plain(blocks, gate)
                except Exception as exc:
                    lean_failures.append(exc)
                    raise
                lean_commits += heads is not None
                return heads

            gw.db.append_plain_blocks = watched  # type: ignore[method-assign]
            payload = bytes(range(256)) * 40  # 10 KB
            with TankClient(HOST, gw.tank_port, timeout=60) as c:
                c.create_topic("full", 1)
                contents: list[list[bytes]] = []
                stored: list[bool] = []  # per bundle: OK (stored), or refused while the disk is full
                inflight: list[tuple[int, int]] = []  # (request, bundle)
                abandoned: int | None = None

                def answer(req: int, i: int, timeout: float | None = None) -> None:
                    resp = c.wait(req, timeout=timeout)
                    assert isinstance(resp, ProduceResponse)
                    code = resp.topics[0].partitions[0].error
                    assert code in (0, 2), code  # 2 (system): refused while the store cannot write
                    stored[i] = code == 0

                for i in range(400):  # 4 MB at most, past the 3 MB disk
                    contents.append([b"%d-%d|" % (i, j) + payload for j in range(10)])
                    stored.append(True)  # (a produce never answered is kept: it is written later)
                    bundle = encode_bundle([(None, 0, None, r) for r in contents[i]])
                    inflight.append((c.send(produce_request(c, "full", bundle)), i))
                    if len(inflight) == 4:
                        req, k = inflight[0]
                        try:
                            answer(req, k, timeout=5)
                        except TankTimeoutError:  # the disk is full: its answer is dropped, it is kept
                            abandoned = inflight.pop(0)[1]
                            break
                        inflight.pop(0)
                        if gw.storage_error is not None:
                            break
                wait_until(lambda: gw.storage_error is not None)
                assert lean_commits > 0  # the lean transaction committed before the disk filled...
                assert any(isinstance(e, StorageFullError) for e in lean_failures)  # ...and met it full
                # What was answered OK is in the database now (a read transaction sees only commits).
                address = gw.pmap.get("full", 0).address
                first_unanswered = abandoned if abandoned is not None else next((k for _r, k in inflight), len(contents))
                oks = sum(stored[:first_unanswered]) * 10
                assert len(gw.db.fetch("full", address, 0, oks)[1]) == oks
                _resize(mnt, 64 << 20)
                for req, k in inflight:
                    answer(req, k)
                wait_until(lambda: gw.storage_error is None)
                # The partition goes on: a produce now is answered OK and stored after the rest.
                contents.append([b"after"])
                stored.append(True)
                assert c.produce("full", 0, [b"after"]) == 0
                got = values(consume_all(c, "full", 0))
            want = [r for i, recs in enumerate(contents) if stored[i] for r in recs]
            assert got == want
        finally:
            gw.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
