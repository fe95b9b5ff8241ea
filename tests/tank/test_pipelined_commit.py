"""The Tank gateway's pipelined group commit with real LMDB, real TCP and a real SIGKILL:
the next transaction commits while the I/O thread answers the last one, and no produce is
answered before the commit holding its records returned."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.store.db import RecordDB, StorageError
from dafka.tank.bundle import encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from dafka.tank.messages import ProducePartition, ProduceRequest, ProduceResponse, ProduceTopic
from tests.conftest import spawned, wait_until
from tests.tank.test_gateway import HOST, consume_all, start_gateway_process, the_map, values

pytestmark = pytest.mark.timeout(120)


def bundle_of(i: int, n: int) -> bytes:
    return encode_bundle([(None, 0, None, b"b%d-m%d" % (i, j)) for j in range(n)])


def produce_request(c: TankClient, topic: str, bundle: bytes) -> ProduceRequest:
    return ProduceRequest(c.next_request_id(), [ProduceTopic(topic, [ProducePartition(0, bundle)])])


class SlowAnswers(Gateway):
    """A gateway whose I/O thread is slow to answer its first commit, and which checks, each
    time it answers, that LMDB (a read transaction sees only committed data) holds what it
    answers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.events: list[tuple[str, float]] = []
        self.unsafe: list[str] = []
        super().__init__(*args, **kwargs)

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        self.events.append(("answer", time.perf_counter()))
        before = list(self._pending)
        super().on_commit(heads)
        for p in before[: len(before) - len(self._pending)]:  # the ones just answered
            for (topic, address), off in p.needs.items():
                stored = self.db.head(topic, address)
                if stored is None or stored < off:
                    self.unsafe.append(f"answered {topic}@{off}, LMDB holds up to {stored}")
        if len(self.events) == 1:
            time.sleep(0.1)  # the I/O thread is busy: the writer must not wait for it
        self.events.append(("answered", time.perf_counter()))


def test_the_next_commit_runs_while_the_last_is_answered_and_nothing_is_answered_early(
    cfg: NodeConfig, tmp_path: Path
) -> None:
    gw = SlowAnswers(tmp_path / "gw", cfg, listen=(HOST, 0))
    try:
        append = gw.db.append
        commits: list[tuple[float, float, int]] = []
        first_began = threading.Event()

        def slow_first_append(batch: Any, **kw: Any) -> Any:
            if not commits:
                # The first commit lasts until produces not in it wait behind it (bounded).
                first_began.set()
                deadline = time.monotonic() + 10
                while len(gw._pending) <= len(kw.get("blocks", ())) and time.monotonic() < deadline:
                    time.sleep(0.005)
            t0 = time.perf_counter()
            heads = append(batch, **kw)
            commits.append((t0, time.perf_counter(), len(kw.get("blocks", ()))))
            return heads

        gw.db.append = slow_first_append  # type: ignore[method-assign]
        n, window = 40, 16
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("pipe", 1)
            inflight = [c.send(produce_request(c, "pipe", bundle_of(0, 10)))]
            assert first_began.wait(10)  # the others come while the first commits
            for i in range(1, n):
                inflight.append(c.send(produce_request(c, "pipe", bundle_of(i, 10))))
                if len(inflight) >= window:
                    resp = c.wait(inflight.pop(0))
                    assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            for req_id in inflight:
                resp = c.wait(req_id)
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            got = values(consume_all(c, "pipe", 0))
        assert got == [b"b%d-m%d" % (i, j) for i in range(n) for j in range(10)]
        assert gw.unsafe == []
        # The second commit began before the I/O thread had answered the first (it slept
        # 0.1 s in that answer): the writer took what was staged the moment it committed.
        first_answered = next(t for what, t in gw.events if what == "answered")
        assert len(commits) >= 2
        assert commits[1][0] < first_answered
        # Group commit: what arrived during a commit went into the next one, several bundles each.
        assert len(commits) < n and max(c[2] for c in commits) > 1
    finally:
        gw.close()


@pytest.mark.parametrize("extra", [(), ("--no-sync",)], ids=["fsync", "no-sync"])
def test_every_answered_produce_survives_a_sigkill_right_after_its_answer(
    cfg: NodeConfig, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    # Without fsync a machine crash may lose the last commits, a killed process not: the
    # answer comes after the commit (on the I/O thread there), which a SIGKILL cannot undo.
    db = tmp_path / "gw"
    proc, port = start_gateway_process(cfg, db, *extra)
    spawned(proc)
    per, window, kill_after = 50, 16, 60
    answered = 0
    with TankClient(HOST, port, timeout=30) as c:
        c.create_topic("crash", 1)
        address = next(v["address"] for _k, v in the_map(c) if v["topic"] == "crash")
        inflight: list[int] = []
        i = 0
        while answered < kill_after:
            while len(inflight) < window:
                inflight.append(c.send(produce_request(c, "crash", bundle_of(i, per))))
                i += 1
            resp = c.wait(inflight.pop(0))
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            answered += 1
        # Right after an answer, with a commit and a staged transaction under way most likely.
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    expected = [b"b%d-m%d" % (b, j) for b in range(answered) for j in range(per)]
    with RecordDB(db, readonly=True) as rdb:
        _first, stored = rdb.fetch("crash", address, 0, len(expected))
    assert stored == expected  # one connection: bundle b holds offsets b*per .. b*per + per - 1
    proc, port = start_gateway_process(cfg, db)
    spawned(proc)
    with TankClient(HOST, port, timeout=30) as c:
        got = values(consume_all(c, "crash", 0))
    assert got[: len(expected)] == expected
    proc.kill()
    proc.wait(10)


@pytest.mark.parametrize("sync", [True, False], ids=["fsync", "no-sync"])  # no-sync: commits on the I/O thread
def test_a_refused_partition_does_not_stop_the_others_of_a_pipelined_commit(
    cfg: NodeConfig, tmp_path: Path, sync: bool
) -> None:
    """A commit that refuses a partition halts the writer until the I/O thread has seen it:
    the staged transaction comes back and goes again; the other partition's produces are all
    answered, in order."""
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), sync=sync)
    try:
        with TankClient(HOST, gw.tank_port, timeout=30) as c, TankClient(HOST, gw.tank_port, timeout=30) as b:
            c.create_topic("ok", 1)
            c.create_topic("bad", 1)
            assert b.produce("bad", 0, [b"first"]) == 0
            bad_key = next(k for k in gw._owned if k[0] == "bad")
            append = gw.db.append
            refused = threading.Event()

            def refuse_bad_once(batch: Any, **kw: Any) -> Any:
                if not refused.is_set() and any((b[0], b[1]) == bad_key for b in kw.get("blocks", ())):
                    refused.set()
                    kw["rejected"][bad_key] = "refused by the test"
                    kw["blocks"] = [b for b in kw["blocks"] if (b[0], b[1]) != bad_key]
                return append(batch, **kw)

            gw.db.append = refuse_bad_once  # type: ignore[method-assign]
            ok_requests = [c.send(produce_request(c, "ok", bundle_of(i, 5))) for i in range(10)]
            b.send(produce_request(b, "bad", bundle_of(99, 5)))  # refused: its connection closes
            ok_requests += [c.send(produce_request(c, "ok", bundle_of(i, 5))) for i in range(10, 20)]
            for req_id in ok_requests:
                resp = c.wait(req_id)
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            wait_until(lambda: gw.records_refused == 5)  # the I/O thread saw the refusal
            assert values(consume_all(c, "ok", 0)) == [b"b%d-m%d" % (i, j) for i in range(20) for j in range(5)]
            # The refused partition goes on from its committed head.
            with TankClient(HOST, gw.tank_port, timeout=30) as again:
                assert again.produce("bad", 0, [b"second"]) == 0
        wait_until(lambda: gw._pipe.staged is None and not gw._outstanding)
        assert not gw._pipe.halted
        assert gw.db.fetch("bad", bad_key[1], 0, 10)[1] == [b"first", b"second"]
    finally:
        gw.close()


def test_a_client_with_a_window_gets_it_into_one_commit_when_commits_are_slow(cfg: NodeConfig, tmp_path: Path) -> None:
    """8 produces in flight and 30 ms commits: taking the staged work at once split the window
    between two commits (4 bundles each, 8 commits for 32 bundles); the writer lingers for the
    refills its answers bring, so a commit holds the whole window."""
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0))
    try:
        gw._pipe.max_linger = 1.0  # (the linger is bounded by the commit's duration then: 30 ms)
        append = gw.db.append
        sizes: list[int] = []

        def slow_append(batch: Any, **kw: Any) -> Any:
            time.sleep(0.03)  # a slow disk (the GIL is free, as in an fsync)
            sizes.append(len(kw.get("blocks", ())))
            return append(batch, **kw)

        gw.db.append = slow_append  # type: ignore[method-assign]
        n, window = 48, 8
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("win", 1)
            inflight: list[int] = []
            for i in range(n):
                inflight.append(c.send(produce_request(c, "win", bundle_of(i, 10))))
                if len(inflight) >= window:
                    resp = c.wait(inflight.pop(0))
                    assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            for req_id in inflight:
                resp = c.wait(req_id)
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0
            assert values(consume_all(c, "win", 0)) == [b"b%d-m%d" % (i, j) for i in range(n) for j in range(10)]
        assert sum(sizes) == n
        steady = sorted(sizes[2:-1])  # (the first commits hold what came first, the last the rest)
        assert steady[len(steady) // 2] == window, sizes
    finally:
        gw.close()


def test_a_commit_whose_answering_raised_still_counts_as_answered(cfg: NodeConfig, tmp_path: Path) -> None:
    """The pipe counts one answer a commit: a commit whose answering raised (a bug; here in
    telling the mesh why writes failed) and so was never told left it a commit behind for
    good (every later commit's linger ran to its bound, no refill timed)."""
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0))
    try:
        append, send_status = gw.db.append, gw._send_status
        failed = threading.Event()

        def first_append_fails(batch: Any, **kw: Any) -> Any:
            if not failed.is_set():
                failed.set()
                raise StorageError("disk full (test)")
            return append(batch, **kw)

        def status_raises_once(now: float) -> None:
            gw._send_status = send_status  # type: ignore[method-assign]
            raise RuntimeError("a bug while answering")

        gw.db.append = first_append_fails  # type: ignore[method-assign]
        gw._send_status = status_raises_once  # type: ignore[method-assign]
        with TankClient(HOST, gw.tank_port, timeout=20) as c:
            c.create_topic("t", 1)
            first = c.send(produce_request(c, "t", bundle_of(0, 3)))
            assert isinstance(c.wait(first), ProduceResponse)  # (kept and written again)
            assert isinstance(c.wait(c.send(produce_request(c, "t", bundle_of(1, 3)))), ProduceResponse)
        assert failed.is_set()
        # (The last answer may reach the client before its commit is counted answered.)
        wait_until(lambda: gw._pipe._answered == gw._pipe._commits >= 2, 10)
    finally:
        gw.close()
