"""``dafka bench group``: a consumer group's throughput and takeover time."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Iterator
from itertools import repeat
from typing import Any

from dafka.bench.common import _mesh, _spawn_tower, _store_process
from dafka.bench.scale import _scale_producers
from dafka.config import NodeConfig

GROUP_PARTITIONS = 6


GROUP_MEMBERS = 3


def _group_producers(cfg: NodeConfig, topic: str, per: int, size: int, started: Any, done: Any) -> None:
    """Six producers (threads of one process): a burst of ``per`` records each, then a steady trickle."""
    import threading

    from dafka.nodes.producer import Producer

    producers = [Producer(topic, cfg, capacity=per + 1_000_000) for _ in range(GROUP_PARTITIONS)]
    deadline = time.monotonic() + 30
    while not all(len(p.peers) >= GROUP_MEMBERS + 1 for p in producers) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    payload = b"x" * size
    started.set()

    def run(producer: Any) -> None:
        producer.publish_many(repeat(payload, per))
        while not done.is_set():  # records keep flowing while a member is killed
            producer.publish_many(repeat(payload, 20))
            time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(p,)) for p in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in producers:
        p.close(0)


def _group_member(cfg: NodeConfig, topic: str, index: int, events: Any, stop: Any) -> None:
    """A group member: reports assignments, delivered counts and the first record of each new partition.

    ``events`` is this member's own pipe: the member that is killed could
    otherwise die holding a queue shared with the others (its write lock),
    and their reports would never arrive.
    """
    import logging
    import os
    import threading

    lock = threading.Lock()  # on_assign runs in the consumer's I/O thread

    def report(*event: Any) -> None:
        with lock:
            events.send(event)

    from dafka.nodes.consumer import Consumer

    if os.environ.get("DAFKA_BENCH_LOG"):
        logging.basicConfig(
            filename=f"{os.environ['DAFKA_BENCH_LOG']}.{index}.{os.getpid()}",
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    fresh: set[tuple[str, str]] = set()
    known: set[tuple[str, str]] = set()

    def on_assign(parts: frozenset[tuple[str, str]]) -> None:
        fresh.update(parts - known)
        known.clear()
        known.update(parts)
        report("assign", index, len(parts), time.time())

    consumer = Consumer(
        topic, cfg, group="bench", offset_reset="earliest", auto_commit_interval=0.2, on_assign=on_assign
    )
    count = 0
    reported = 0.0
    while not stop.is_set():
        batch = consumer.poll_batch(20_000, 0.05)
        count += len(batch)
        if fresh:
            for r in batch:
                key = (r.topic, r.partition)
                if key in fresh:
                    fresh.discard(key)
                    report("resumed", index, r.partition, time.time())
        if time.monotonic() - reported >= 0.05:
            report("count", index, count, time.time())
            reported = time.monotonic()
    consumer.close()


def _reports(events: list[Any], wait: float) -> Iterator[Any]:
    """The member reports that come within ``wait`` from ``events`` (their pipes);
    a pipe whose member exited is dropped from ``events``."""
    from multiprocessing.connection import wait as ready

    if not events:
        time.sleep(wait)
        return
    for conn in ready(events, timeout=wait):
        try:
            yield conn.recv()
        except (EOFError, OSError):
            events.remove(conn)


def _group_event(events: list[Any], wait: float, owned: list[int], counts: list[int], resumed: list[Any]) -> None:
    """Take the member reports that come within ``wait`` (from ``events``, their pipes) into the tallies."""
    for event in _reports(events, wait):
        if event[0] == "assign":
            owned[event[1]] = event[2]
        elif event[0] == "count":
            counts[event[1]] = event[2]
        else:
            resumed.append((event[1], event[3]))


def bench_group(args: argparse.Namespace) -> dict[str, list[float]]:
    """3 group members on 6 partitions: records/s delivered, and the time from
    a member's kill -9 to its partitions delivering again at another member."""
    import tempfile

    ctx = mp.get_context("spawn")
    rates: list[float] = []
    takeovers: list[float] = []
    per = max(1, args.records // GROUP_PARTITIONS)
    for run in range(args.runs):
        tower, cfg = _mesh()
        cfg = NodeConfig(cfg.towers, bind=cfg.bind, beacon_interval=0.2, beacon_timeout=1.0)
        topic = f"bench-group-{run}"
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            ready, done, stop = ctx.Event(), ctx.Event(), ctx.Event()
            pipes = [ctx.Pipe(duplex=False) for _ in range(GROUP_MEMBERS)]
            events = [reader for reader, _ in pipes]
            store = ctx.Process(target=_store_process, args=(cfg, db, not args.no_sync, ready, done))
            store.start()
            ready.wait(60)
            members = [
                ctx.Process(target=_group_member, args=(cfg, topic, i, pipes[i][1], stop))
                for i in range(GROUP_MEMBERS)
            ]
            for m in members:
                m.start()
            started = ctx.Event()
            prod = ctx.Process(target=_group_producers, args=(cfg, topic, per, args.size, started, done))
            prod.start()
            owned = [0] * GROUP_MEMBERS
            counts = [0] * GROUP_MEMBERS
            resumed: list[tuple[int, float]] = []
            tallies = (owned, counts, resumed)

            deadline = time.monotonic() + 120
            while not started.is_set() and time.monotonic() < deadline:
                _group_event(events, 0.05, *tallies)
            t0 = time.time()
            deadline = time.monotonic() + 600
            while sum(counts) < per * GROUP_PARTITIONS and time.monotonic() < deadline:
                _group_event(events, 0.05, *tallies)
            elapsed = time.time() - t0
            total = sum(counts)
            balanced = sorted(owned)
            # Kill the member with the most partitions once all is delivered.
            victim = max(range(GROUP_MEMBERS), key=lambda i: owned[i])
            lost = owned[victim]
            members[victim].kill()
            killed = time.time()
            # Its pipe may hold half a report now: read the others only.
            events = [reader for i, (reader, _) in enumerate(pipes) if i != victim]
            resumed.clear()
            deadline = time.monotonic() + 60
            while len([t for i, t in resumed if i != victim and t > killed]) < lost and time.monotonic() < deadline:
                _group_event(events, 0.05, *tallies)
            back = [t for i, t in resumed if i != victim and t > killed]
            stop.set()  # members commit and leave while the store still runs
            for p in members:
                p.join(30)
            done.set()
            for p in (*members, prod, store):
                p.join(30)
                if p.is_alive():
                    p.kill()
            for conn in (c for pair in pipes for c in pair):
                conn.close()
        tower.close()
        if total >= per * GROUP_PARTITIONS:
            rate = total / elapsed
            rates.append(rate)
            print(f"run {run}: {rate:,.0f} records/s over the group (partitions per member {balanced})", flush=True)
        else:
            print(f"run {run}: only {total} of {per * GROUP_PARTITIONS} records delivered", file=sys.stderr)
        if lost and len(back) >= lost:
            takeover = max(back) - killed
            takeovers.append(takeover)
            print(
                f"run {run}: killed member's {lost} partitions delivering again after {takeover:.2f}s "
                f"(beacon timeout {cfg.beacon_timeout}s, goal < {3 * cfg.beacon_timeout:.1f}s)",
                flush=True,
            )
        else:
            print(f"run {run}: the killed member's partitions did not resume within 60s", file=sys.stderr)
    if takeovers:
        print(f"group takeover: median {statistics.median(takeovers):.2f}s over {len(takeovers)} runs")
    return {"group": rates}


def _group_settled(owned: list[int], pending: list[int], members: list[int], total: int) -> bool:
    """Whether ``members`` own every partition between them, each some, and each
    delivered a record of every partition it was newly given (``pending`` of them not yet)."""
    if sum(owned[i] for i in members) != total or not all(owned[i] for i in members):
        return False
    return not any(pending[i] for i in members)


def bench_group_partitions(args: argparse.Namespace) -> int:
    """A group over ``--partitions`` partitions (that many producers, 1 record/s
    each): seconds until 2 members own every partition and records flow, then
    after a third joins, then after one is killed (kill -9)."""
    import tempfile

    n = args.partitions
    ctx = mp.get_context("spawn")
    tower, tower_done, cfg = _spawn_tower(ctx)
    topic = f"bench-group-{n}-{int(time.time())}"
    procs = max(1, min(args.procs, n))
    phases: list[tuple[str, float | None]] = []
    members: list[Any] = []
    hosts: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        ready, done, stop = ctx.Event(), ctx.Event(), ctx.Event()
        store = ctx.Process(target=_store_process, args=(cfg, db, not args.no_sync, ready, done))
        store.start()
        ready.wait(60)
        go, result = ctx.Event(), ctx.Queue()
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        seconds = 180.0  # publishing 1 record/s each for as long as the phases may take
        hosts = [
            ctx.Process(target=_scale_producers, args=(cfg, topic, k, seconds, go, result, getattr(args, "shared_loop", False)))
            for k in shares
        ]
        for host in hosts:
            host.start()
        for _ in hosts:
            result.get(timeout=600)
        go.set()
        print(f"group: {n} producers publishing (1 record/s each)", flush=True)
        pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
        owned = [0, 0, 0]
        pending = [0, 0, 0]  # newly given partitions without a record yet
        events = [pipes[0][0], pipes[1][0]]

        def member(i: int) -> Any:
            m = ctx.Process(target=_group_member_parts, args=(cfg, topic, i, pipes[i][1], stop))
            m.start()
            return m

        def settle(live: list[int], limit: float) -> float | None:
            t0 = time.monotonic()
            while time.monotonic() - t0 < limit:
                _group_event_parts(events, 0.1, owned, pending)
                if _group_settled(owned, pending, live, n):
                    return time.monotonic() - t0
            print(f"group: not settled: owned {owned}, without a record yet {pending}", flush=True)
            return None

        members = [member(0), member(1)]
        phases.append(("2 members start", settle([0, 1], 120)))
        print(f"group: owned {owned[:2]}", flush=True)
        events.append(pipes[2][0])
        members.append(member(2))
        phases.append(("a 3rd member joins", settle([0, 1, 2], 120)))
        print(f"group: owned {owned}", flush=True)
        victim = max(range(3), key=lambda i: owned[i])
        members[victim].kill()
        events = [pipes[i][0] for i in range(3) if i != victim]
        owned[victim] = pending[victim] = 0
        live = [i for i in range(3) if i != victim]
        phases.append((f"a member with {max(owned)} partitions is killed", settle(live, 120)))
        print(f"group: owned {owned}", flush=True)
        stop.set()
        for m in members:
            m.join(30)
            if m.is_alive():
                m.kill()
        for host in hosts:
            host.kill()
        done.set()
        store.join(60)
    tower_done.set()
    tower.join(30)
    status = 0
    for what, took in phases:
        if took is None:
            print(f"group over {n} partitions: {what}: not settled within 120s", flush=True)
            status = 1
        else:
            print(
                f"group over {n} partitions: {what}: every partition owned and delivering after {took:.2f}s"
                f" (beacon timeout {cfg.beacon_timeout}s)",
                flush=True,
            )
    return status


def _group_member_parts(cfg: NodeConfig, topic: str, index: int, events: Any, stop: Any) -> None:
    """A group member over many partitions: reports its assignment size and each
    newly assigned partition's first record (as a partition name)."""
    import logging
    import threading

    from dafka.nodes.consumer import Consumer

    logging.getLogger("dafka").setLevel(logging.ERROR)
    lock = threading.Lock()
    fresh: set[str] = set()
    known: set[str] = set()

    def on_assign(parts: frozenset[tuple[str, str]]) -> None:
        names = {p for _, p in parts}
        with lock:
            # Still ours and not seen yet, and the new ones.
            fresh.intersection_update(names)
            fresh.update(names - known)
            known.clear()
            known.update(names)
            events.send(("state", index, len(parts), len(fresh)))

    consumer = Consumer(topic, cfg, group="bench", offset_reset="latest", on_assign=on_assign)
    while not stop.is_set():
        batch = consumer.poll_batch(20_000, 0.1)
        seen = []
        with lock:
            for r in batch:
                if r.partition in fresh:
                    fresh.discard(r.partition)
                    seen.append(r.partition)
            if seen:
                events.send(("state", index, len(known), len(fresh)))
    consumer.close()


def _group_event_parts(events: list[Any], wait: float, owned: list[int], pending: list[int]) -> None:
    """Take the reports of :func:`_group_member_parts` into the tallies."""
    for event in _reports(events, wait):
        owned[event[1]], pending[event[1]] = event[2], event[3]
