"""``dafka bench scale``: many producers in one mesh: CPU, sockets and a store catching up."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from typing import Any

from dafka.bench.common import PAYLOAD, _proc_cpu, _spawn_tower, _store_process, _tcp_sockets
from dafka.config import NodeConfig

# ---------------------------------------------------------------- scale


def _scale_producers(
    cfg: NodeConfig, topic: str, n: int, seconds: float, go: Any, result: Any, shared_loop: bool = False
) -> None:
    """Host ``n`` producers (on one shared I/O thread with ``shared_loop``); each
    publishes one record a second for ``seconds``; report (published, acked, ACK latencies)."""
    import logging

    import zmq

    from dafka.nodes.loop import NodeLoop
    from dafka.nodes.producer import Producer

    logging.getLogger("dafka").setLevel(logging.ERROR)
    # A producer holds about 10 ZeroMQ sockets (monitors' internal ends count
    # too); a context allows 1,023 by default.
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 16 * n + 64)
    loop = NodeLoop() if shared_loop else None
    producers = [Producer(topic, cfg, capacity=1000, loop=loop) for _ in range(n)]
    latencies: list[float] = []
    clock = time.perf_counter

    def stamp(sent: float) -> Callable[[Any], None]:
        def on_ack(receipt: Any) -> None:
            if receipt.acked():
                latencies.append(clock() - sent)

        return on_ack

    result.put(("ready", n))
    go.wait(600)
    published = 0
    t0 = clock()
    rounds = max(1, int(seconds))
    spacing = 1.0 / n
    for k in range(rounds * n):  # producer k % n publishes at t0 + k / n: 1 record/s each
        delay = t0 + k * spacing - clock()
        if delay > 0:
            time.sleep(delay)
        producers[k % n].publish(b"x" * PAYLOAD, stamp(clock()))
        published += 1
    result.put(("published", published))
    acked_all = all(p.flush(30) for p in producers)
    for p in producers:
        p.close(0)
    if loop is not None:
        loop.close()
    result.put(("done", published, len(latencies), acked_all, latencies))


def _catchup_store(cfg: NodeConfig, topic: str, n: int, expected: int, result: Any) -> None:
    """A fresh store: seconds until it holds ``expected`` records of ``n`` partitions (copied
    from the other store: the producers are gone by then)."""
    import logging
    import tempfile

    from dafka.store.node import Store

    logging.getLogger("dafka").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        t0 = time.monotonic()
        store = Store(db, cfg, sync=False)
        parts: list[Any] = []
        while time.monotonic() - t0 < 120:
            parts = store.db.partitions(topic)
            if len(parts) >= n and sum(p.count for p in parts) >= expected:
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        store.close()
        result.put((elapsed, len(parts), sum(p.count for p in parts)))


def bench_scale(args: argparse.Namespace) -> int:
    """A mesh of ``--nodes`` producers of one topic (1 record/s each, spread over
    ``--procs`` processes), a store and a consumer: connections, CPU and ACK latency."""
    import tempfile

    from dafka.nodes.consumer import Consumer

    if getattr(args, "leaves", 0):
        from dafka.bench.leaves import bench_leaves

        return bench_leaves(args)
    n, procs = args.nodes, max(1, min(args.procs, args.nodes))
    ctx = mp.get_context("spawn")
    tower, tower_done, cfg = _spawn_tower(ctx)
    topic = f"bench-scale-{int(time.time())}"
    status = 0
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        ready, done = ctx.Event(), ctx.Event()
        store = ctx.Process(target=_store_process, args=(cfg, db, not args.no_sync, ready, done))
        store.start()
        ready.wait(60)
        go, result = ctx.Event(), ctx.Queue()
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        hosts = [
            ctx.Process(target=_scale_producers, args=(cfg, topic, k, args.seconds, go, result, getattr(args, "shared_loop", False)))
            for k in shares
        ]
        t_start = time.monotonic()
        for host in hosts:
            host.start()
        live = Consumer(topic, cfg)
        started = 0
        while started < len(hosts):
            try:
                result.get(timeout=1.0)
                started += 1
            except Exception:
                if any(h.exitcode is not None for h in hosts) or time.monotonic() - t_start > 600:
                    print("scale: a producer process failed to start", file=sys.stderr)
                    live.close()
                    for h in hosts:
                        h.kill()
                    done.set()
                    store.join(30)
                    tower_done.set()
                    tower.join(30)
                    return 1
        # Let the mesh settle: everyone beaconed and connected (the consumer meets every
        # producer and the store), then a few beacon intervals more.
        settle = time.monotonic()
        while len(live.peers) < n + 1 and time.monotonic() - settle < 120:
            time.sleep(0.2)
        time.sleep(max(2.0, 2 * cfg.beacon_interval))
        print(
            f"scale: {n} producers in {procs} processes"
            f"{' (one shared I/O thread each)' if getattr(args, 'shared_loop', False) else ''} up in {time.monotonic() - t_start:.1f}s",
            flush=True,
        )
        pids = [p.pid for p in (*hosts, store)] + [__import__("os").getpid()]
        mesh_nodes = n + 2  # producers, the store, the consumer
        me = __import__("os").getpid()  # this process: the live consumer (its I/O thread) and the tally
        cpu0 = {pid: _proc_cpu(pid) for pid in [p.pid for p in (*hosts, store, tower)] + [me]}
        t0 = time.monotonic()
        go.set()
        time.sleep(min(args.seconds, 5.0) / 2)
        sockets = _tcp_sockets(pids)
        # CPU over the publishing window (not the flush after it).  One host's
        # "done" may come before another's "published": sort them by kind.
        finished: list[Any] = []
        waiting = len(hosts)
        while waiting:
            msg = result.get(timeout=args.seconds + 120)
            if msg[0] == "published":
                waiting -= 1
            else:
                finished.append(msg)
        elapsed = time.monotonic() - t0
        cpu = {pid: _proc_cpu(pid) - c for pid, c in cpu0.items()}
        while len(finished) < len(hosts):
            finished.append(result.get(timeout=120))
        received = 0
        while live.poll(0.0) is not None:
            received += 1
        live.close()
        published = sum(f[1] for f in finished)
        acked = all(f[3] for f in finished)
        latencies = sorted(x for f in finished for x in f[4])
        def pct(q: float) -> float:
            return latencies[int(q * (len(latencies) - 1))] * 1000 if latencies else float("nan")

        p99 = pct(0.99)
        producers_cpu = sum(cpu[h.pid] for h in hosts) / elapsed
        # A fresh earliest consumer: how long until it has records of every partition.
        t1 = time.monotonic()
        fresh = Consumer(topic, cfg, offset_reset="earliest")
        seen: set[str] = set()
        deadline = t1 + 120
        while len(seen) < n and time.monotonic() < deadline:
            record = fresh.poll(0.5)
            if record is not None:
                seen.add(record.partition)
        discovery = time.monotonic() - t1
        fresh.close()
        # A fresh store catches up every partition from the first one.
        ctx_result = ctx.Queue()
        catchup = ctx.Process(target=_catchup_store, args=(cfg, topic, n, published, ctx_result))
        catchup.start()
        caught_up, caught_parts, caught_records = ctx_result.get(timeout=300)
        catchup.join(30)
        done.set()
        store.join(60)
    for host in hosts:
        host.join(30)
    tower_done.set()
    tower.join(30)
    tower_cpu = cpu[tower.pid] / elapsed
    store_cpu = cpu[store.pid] / elapsed
    consumer_cpu = cpu[me] / elapsed
    print(
        f"scale: N={n}: {sockets} TCP sockets ({sockets / mesh_nodes:.1f} per node); "
        f"producers' CPU {producers_cpu:.1%} ({producers_cpu / n:.3%} per producer); "
        f"store CPU {store_cpu:.1%}; tower CPU {tower_cpu:.1%}; consumer CPU {consumer_cpu:.1%}; "
        f"the mesh {producers_cpu + store_cpu + tower_cpu + consumer_cpu:.1%}; "
        f"{published} published, all acked: {acked}, ACK p50 {pct(0.5):.1f} p90 {pct(0.9):.1f} "
        f"p99 {p99:.1f} max {pct(1.0):.1f} ms; "
        f"live consumer got {received}; fresh earliest consumer saw {len(seen)}/{n} partitions "
        f"in {discovery:.2f}s; a fresh store held {caught_records}/{published} records of "
        f"{caught_parts}/{n} partitions after {caught_up:.2f}s",
        flush=True,
    )
    if not acked or len(seen) < n or caught_records < published:
        status = 1
    return status
