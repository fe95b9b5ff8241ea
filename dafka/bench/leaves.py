"""``dafka bench scale --leaves N``: N leaf devices at 1 record/s each, dialling regional stores.

A tower and ``--endpoints`` stores with a leaf port run in processes of their
own; the devices are spread over ``--procs`` processes, each driving its
share from one :class:`~dafka.nodes.leaf.LeafLoop` thread (a device k uses
endpoint ``k % E`` first, the others after it for failover); a mesh consumer
in this process reads the topic live.  CPU is read from /proc over the
publishing window: *servers* are the tower, the stores and the consumer, *the
whole* adds the device processes.  One summary line starts with ``scale:``.

``--readers M``: the first M devices also read a shared commands topic on
their connection (``producer.reader``, see ``docs/concepts/leaves.md``), to
which a mesh producer in this process publishes one command a second (each
pushed to every reader); the summary adds what they got and how late.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

from dafka.bench.common import PAYLOAD, _proc_cpu, _spawn_tower, _tcp_sockets
from dafka.config import NodeConfig
from dafka.gctune import settle

APP_TICK = 0.002  # seconds: the devices' app thread publishes what is due at most this often


GcPause = tuple[float, int, float]  # when it ended (time.time()), generation, seconds


def _gc_watch() -> list[GcPause]:
    """Record each collection of this process's cyclic GC (all of them, until it ends)."""
    import gc

    pauses: list[GcPause] = []
    started = [0.0]

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.time(), info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(watch)
    return pauses


def _gc_summary(pauses: list[GcPause], since: float, until: float) -> tuple[int, float, float, int]:
    """Of the collections between ``since`` and ``until``: (how many, seconds in all, the
    longest in ms, how many over 10 ms)."""
    took = [d for t, _, d in pauses if since <= t <= until]
    return len(took), sum(took), max(took, default=0.0) * 1000, sum(1 for d in took if d > 0.010)


def _leaf_store(cfg: NodeConfig, db: str, sync: bool, ports: Any, done: Any) -> None:
    import logging

    from dafka.store.node import Store

    logging.getLogger("dafka").setLevel(logging.ERROR)
    pauses = _gc_watch()
    store = Store(db, cfg, sync=sync, leaves="127.0.0.1:0")
    assert store.leaves is not None
    settle()  # as `dafka store` does
    ports.put(store.leaves.port)
    done.wait(3600)
    ports.put(("gc", pauses))
    store.close()


READER_DRAIN = 0.1  # seconds between the app thread's drains of its readers' queues

ThreadCpu = dict[str, int]  # nanoseconds on the CPU so far: "app", "loop", "zmq" (ZeroMQ's I/O threads), "other"


def _thread_cpu(app: int, loop: int) -> ThreadCpu:
    """This process's CPU so far per kind of thread, in ns, from /proc/self/task/*/schedstat
    (Linux; empty elsewhere): the app's thread (native id ``app``), the LeafLoop's
    (``loop``), ZeroMQ's I/O threads, and the others."""
    out: ThreadCpu = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # (a thread that ended meanwhile)
        kind = ("app" if int(tid) == app else "loop" if int(tid) == loop
                else "zmq" if comm.startswith("ZMQbg/IO") else "other")
        out[kind] = out.get(kind, 0) + ns
    return out


def _devices(
    topic: str, endpoints: list[str], first: int, n: int, seconds: float, go: Any, result: Any,
    readers: int = 0, commands: str = "",
) -> None:
    """Host ``n`` leaf devices on one LeafLoop; each publishes one record a second for ``seconds``."""
    import logging

    from dafka.nodes.leaf import LeafLoop, LeafProducer

    logging.getLogger("dafka").setLevel(logging.ERROR)
    pauses = _gc_watch()
    loop = LeafLoop()
    e = len(endpoints)
    devices = []
    for k in range(first, first + n):
        order = [endpoints[(k + i) % e] for i in range(e)]
        devices.append(LeafProducer(topic, leaf=order, capacity=1000, loop=loop))
    # Readers of the commands topic, riding their devices' connections.
    reading = [d.reader(commands, offset_reset="latest") for k, d in zip(range(first, first + n), devices, strict=True)
               if k < readers]
    command_lags: list[float] = []
    commands_got = 0
    drained_at = 0.0
    latencies: list[float] = []
    clock = time.perf_counter

    def stamp(sent: float) -> Any:
        def on_ack(receipt: Any) -> None:
            if receipt.acked():
                latencies.append(clock() - sent)

        return on_ack

    # Every device welcomed, and its partition known to its store (a fleet's devices make
    # their partitions once in their lives: that cost is timed apart), before the clock starts.
    t_warm = time.monotonic()
    for d in devices:
        d.publish(b"warm-up")
    warm = all(d.flush(300) for d in devices)
    # Settled once every device is made, as a device process would be after its start-up:
    # full collections walked the 2,500 devices of this process (0.3-0.7 s each on a
    # loaded machine, every record in flight here waiting), where a real device has one.
    settle()
    result.put(("ready", n, warm, time.monotonic() - t_warm))
    go.wait(600)
    t_go = time.time()
    me, loop_id = threading.get_native_id(), loop._thread.native_id or 0
    cpu_go = _thread_cpu(me, loop_id)
    published = 0
    t0 = clock()
    rounds = max(1, int(seconds))
    spacing = 1.0 / n
    payload = b"x" * PAYLOAD
    for k in range(rounds * n):  # device k % n publishes at t0 + k / n: 1 record/s each
        delay = t0 + k * spacing - clock()
        if delay > 0:
            # The app thread of thousands of devices wakes at most every APP_TICK and
            # publishes what is due: a sleep per record cost it a wake-up each (a
            # third of the device processes' CPU at 10,000 devices), which a fleet's
            # devices, each in its own process, never pay for one another.
            time.sleep(max(delay, APP_TICK))
        if reading and clock() - drained_at >= READER_DRAIN:
            drained_at = clock()
            wall = time.time()
            for c in reading:
                for r in c.poll_batch(100, 0):
                    commands_got += 1
                    command_lags.append(wall - float(r.content))
        devices[k % n].publish(payload, stamp(clock()))
        published += 1
    cpu_published = _thread_cpu(me, loop_id)
    threads = {k: v - cpu_go.get(k, 0) for k, v in cpu_published.items()}  # over the publishing window
    result.put(("published", published))
    deadline = time.monotonic() + 3.0  # the last commands: until none came for a second (3 s at most)
    quiet_since = time.monotonic()
    while reading and time.monotonic() < deadline and time.monotonic() - quiet_since < 1.0:
        wall = time.time()
        for c in reading:
            for r in c.poll_batch(100, 0):
                commands_got += 1
                command_lags.append(wall - float(r.content))
                quiet_since = time.monotonic()
        time.sleep(READER_DRAIN)
    for c in reading:
        c.close(1.0)
    acked_all = all(d.flush(30) for d in devices)
    t_end = time.time()
    failovers = sum(d.link.failovers for d in devices)
    for d in devices:
        d.close(0)
    loop.close()
    result.put(("done", published, acked_all, latencies, failovers, commands_got, command_lags,
                _gc_summary(pauses, t_go, t_end), threads))


def bench_leaves(args: argparse.Namespace) -> int:
    import multiprocessing as mp
    import tempfile

    from dafka.nodes.consumer import Consumer
    from dafka.nodes.producer import Producer

    n = args.leaves
    readers = max(0, min(getattr(args, "readers", 0), n))
    procs = max(1, min(args.procs, n))
    e = max(1, args.endpoints)
    ctx = mp.get_context("spawn")
    tower, tower_done, cfg = _spawn_tower(ctx)
    topic = f"bench-leaves-{int(time.time())}"
    commands = f"bench-commands-{int(time.time())}"
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as tmp:
        ports, done = ctx.Queue(), ctx.Event()
        stores = [ctx.Process(target=_leaf_store, args=(cfg, os.path.join(tmp, f"s{i}"), not args.no_sync, ports, done))
                  for i in range(e)]
        for s in stores:
            s.start()
        endpoints = [f"127.0.0.1:{ports.get(timeout=60)}" for _ in stores]
        live = Consumer(topic, cfg)
        go, result = ctx.Event(), ctx.Queue()
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        firsts = [sum(shares[:i]) for i in range(procs)]
        hosts = [ctx.Process(target=_devices, args=(topic, endpoints, f, k, args.seconds, go, result, readers, commands))
                 for f, k in zip(firsts, shares, strict=True)]
        commander = Producer(commands, cfg) if readers else None
        t_start = time.monotonic()
        for h in hosts:
            h.start()
        warm_ups = [result.get(timeout=900) for _ in hosts]
        warmed = all(w[2] for w in warm_ups)
        warm_s = max(w[3] for w in warm_ups)
        # The consumer meets the stores (the devices are no mesh nodes).
        while len(live.peers) < e and time.monotonic() - t_start < 60:
            time.sleep(0.2)
        print(f"scale: {n} leaves in {procs} processes, {e} endpoint store(s), up in "
              f"{time.monotonic() - t_start:.1f}s (first record of every device, which makes its"
              f" partition, acknowledged: {warmed}, in {warm_s:.1f}s)", flush=True)
        me = os.getpid()
        servers = [tower.pid, *(s.pid for s in stores), me]
        devices = [h.pid for h in hosts]
        cpu0 = {pid: _proc_cpu(pid) for pid in servers + devices}
        t0 = time.monotonic()
        t0_wall = time.time()
        go.set()
        sent_commands = 0
        finished: list[Any] = []
        waiting = len(hosts)
        if commander is None:
            time.sleep(min(args.seconds, 5.0) / 2)
            sockets = _tcp_sockets(servers + devices)
            while waiting:
                msg = result.get(timeout=args.seconds + 120)
                if msg[0] == "published":
                    waiting -= 1
                else:
                    finished.append(msg)
        else:
            import queue

            next_command = time.monotonic() + 0.5
            sockets = 0
            sockets_at = time.monotonic() + min(args.seconds, 5.0) / 2
            while waiting:
                now = time.monotonic()
                if sockets == 0 and now >= sockets_at:
                    sockets = _tcp_sockets(servers + devices)
                if now >= next_command and now - t0 < args.seconds:
                    commander.publish(repr(time.time()).encode())  # one command a second, to every reader
                    sent_commands += 1
                    next_command += 1.0
                try:
                    msg = result.get(timeout=0.05)
                except queue.Empty:
                    if now - t0 > args.seconds + 120:
                        raise
                    continue
                if msg[0] == "published":
                    waiting -= 1
                else:
                    finished.append(msg)
        elapsed = time.monotonic() - t0
        cpu = {pid: _proc_cpu(pid) - c for pid, c in cpu0.items()}
        while len(finished) < len(hosts):
            finished.append(result.get(timeout=120))
        t_acked = time.time()  # every device flushed: the end of the window the GC pauses are counted in
        received = 0
        deadline = time.monotonic() + 10
        published = sum(f[1] for f in finished)
        while received < published and time.monotonic() < deadline:
            if live.poll(0.2) is not None:
                received += 1
        live.close()
        if commander is not None:
            commander.close(5.0)
        done.set()
        store_gc = []
        for _ in stores:
            try:
                store_gc.append(_gc_summary(ports.get(timeout=30)[1], t0_wall, t_acked))
            except Exception:  # noqa: BLE001 (a store that died says nothing)
                pass
        for s in stores:
            s.join(60)
    for h in hosts:
        h.join(30)
    tower_done.set()
    tower.join(30)
    acked = all(f[2] for f in finished)
    failovers = sum(f[4] for f in finished)
    latencies = sorted(x for f in finished for x in f[3])
    commands_got = sum(f[5] for f in finished)
    lags = sorted(x for f in finished for x in f[6])
    device_gc = [f[7] for f in finished]

    def gc_text(sums: list[tuple[int, float, float, int]]) -> str:
        if not sums:
            return "?"
        return (f"{sum(x[0] for x in sums)} collections, {sum(x[1] for x in sums) * 1000:.0f} ms in all, longest "
                f"{max(x[2] for x in sums):.0f} ms, {sum(x[3] for x in sums)} over 10 ms")

    def pct(q: float) -> float:
        return latencies[int(q * (len(latencies) - 1))] * 1000 if latencies else float("nan")

    server_cpu = sum(cpu[p] for p in servers) / elapsed
    store_cpu = sum(cpu[s.pid] for s in stores) / elapsed
    device_cpu = sum(cpu[p] for p in devices) / elapsed
    print(
        f"scale: leaves {n}, {procs} device processes, {e} endpoint(s); {sockets} TCP sockets; "
        f"servers {server_cpu:.1%} (stores {store_cpu:.1%}, tower {cpu[tower.pid] / elapsed:.1%}, "
        f"consumer {cpu[me] / elapsed:.1%}; {server_cpu / n:.4%} per device); "
        f"devices {device_cpu:.1%} ({device_cpu / n:.4%} per device); the whole {server_cpu + device_cpu:.1%}; "
        f"{published} published, all acked: {acked}, ACK p50 {pct(0.5):.1f} p90 {pct(0.9):.1f} "
        f"p99 {pct(0.99):.1f} max {pct(1.0):.1f} ms; live consumer got {received}; failovers {failovers}"
        + (f"; readers {readers} got {commands_got} of {readers * sent_commands} commands, lag p50 "
           f"{lags[len(lags) // 2] * 1000:.1f} p99 {lags[int(0.99 * (len(lags) - 1))] * 1000:.1f} ms"
           if readers and lags else (f"; readers {readers} got 0 of {readers * sent_commands} commands"
                                     if readers else "")),
        flush=True,
    )
    print(f"scale: gc: stores {gc_text(store_gc)}; device processes {gc_text(device_gc)}", flush=True)
    threads: dict[str, int] = {}
    for f in finished:
        for kind, ns in f[8].items():
            threads[kind] = threads.get(kind, 0) + ns
    if threads and published:
        # The device processes' CPU a record, per thread, while they published (the flush after
        # it left out): where a device's cost goes (docs/concepts/leaves.md, Cost).
        each = {k: threads.get(k, 0) / 1000 / published for k in ("app", "loop", "zmq", "other")}
        print(f"scale: device threads: {sum(each.values()):.1f} µs a record: app {each['app']:.1f}, "
              f"LeafLoop {each['loop']:.1f}, ZeroMQ I/O {each['zmq']:.1f}, other {each['other']:.1f}", flush=True)
    return 0 if acked and received >= published and (not readers or commands_got >= readers * sent_commands) else 1
