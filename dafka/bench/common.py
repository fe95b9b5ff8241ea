"""What the benchmarks share: a tower and its config, temporary CURVE keys, store and tower processes."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any

from dafka.config import NodeConfig, TowerAddress

PAYLOAD = 100


def _mesh(secure: bool = False, batches: bool = True) -> tuple[Any, NodeConfig]:
    from dafka.nodes.tower import Tower

    sec = _temporary_keys() if secure else None
    tower = Tower("127.0.0.1", 0, 0, _as(sec, "tower"))
    tower.start()
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
        security=sec,
        batches=batches,
    )
    return tower, cfg


def _temporary_keys() -> Any:
    """Keys of every role in a temporary directory (removed at exit), all allowed."""
    import atexit
    import shutil
    import tempfile

    from dafka.nodes import security

    root = Path(tempfile.mkdtemp(prefix="dafka-bench-keys-"))
    atexit.register(shutil.rmtree, root, True)
    allow = root / "allow"
    allow.mkdir()
    for role in ("tower", "store", "producer", "consumer"):
        public, _ = security.new_keys(role, role, root)
        shutil.copy(public, allow)
    tower_key = security.read_certificate(root / "tower.key").public
    return security.SecurityConfig(str(root / "producer.key_secret"), str(allow), (tower_key,))


def _as(sec: Any, role: str) -> Any:
    """The security config of the bench node with that role (None: plain)."""
    return None if sec is None else replace(sec, key=str(Path(sec.key).with_name(f"{role}.key_secret")))


def _role(cfg: NodeConfig, role: str) -> NodeConfig:
    return cfg if cfg.security is None else replace(cfg, security=_as(cfg.security, role))


def _store_process(
    cfg: NodeConfig, db: str, sync: bool, ready: Any, done: Any, stats: Any = None
) -> None:
    from dafka.store.node import Store

    store = Store(db, cfg, sync=sync)
    ready.set()
    done.wait(600)
    store.close()
    if stats is not None:
        hists = (store.commit_seconds, store.commit_sizes, store.ack_latency)
        stats.put([(h.bounds, h.counts, h.sum, h.count) for h in hists])


def _acked_producer(
    cfg: NodeConfig, topic: str, n: int, size: int, result: Any, outbox: str | None = None, sync: str = "each"
) -> None:
    from dafka.nodes.producer import Producer

    extra: dict[str, Any] = {"outbox": outbox, "outbox_sync": sync} if outbox else {}
    producer = Producer(topic, cfg, capacity=max(n, 1), **extra)
    deadline = time.monotonic() + 30
    while len(producer.peers) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    t0 = time.perf_counter()
    producer.publish_many(repeat(b"x" * size, n))
    ok = producer.flush(600)
    elapsed = time.perf_counter() - t0
    producer.close(0)
    result.put(n / elapsed if ok else 0.0)


def _bare_sub(port: int, curve: tuple[bytes, bytes, bytes] | None) -> Any:
    """The receiving SUB of a bare bench, a CURVE client when ``curve`` is
    (server public, client public, client secret)."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    if curve is not None:
        sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = curve
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _publish_to_receiver(
    receiver: Callable[..., None], n: int, send_all: Callable[[Any], None], secure: bool = False
) -> float:
    """One run of a bare PUB -> SUB bench: ``receiver(port, n, ready, result, curve)``
    runs in a process of its own and reports its rate; ``send_all(pub)`` sends the
    records.  ``secure``: CURVE on the pair (no ZAP), to see what encryption costs."""
    import zmq

    ctx = mp.get_context("spawn")
    pub = zmq.Context.instance().socket(zmq.PUB)
    curve = None
    if secure:
        server_public, server_secret = zmq.curve_keypair()
        pub.curve_secretkey, pub.curve_server = server_secret, True
        curve = (server_public, *zmq.curve_keypair())
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    ready, result = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(port, n, ready, result, curve))
    proc.start()
    try:
        ready.wait(30)
        time.sleep(0.5)  # the subscription has to reach the PUB; nothing to observe here
        send_all(pub)
        return float(result.get(timeout=300))
    finally:
        proc.join(30)
        pub.close(0)


def _tower_process(ports: Any, done: Any) -> None:
    from dafka.nodes.tower import Tower

    tower = Tower("127.0.0.1", 0, 0)
    tower.start()
    ports.put((tower.in_port, tower.out_port))
    done.wait(1800)
    tower.close()


def _spawn_tower(ctx: Any) -> tuple[Any, Any, NodeConfig]:
    """A tower in a process of its own: ``(process, done event, node config)``;
    set ``done`` and join the process to stop it."""
    ports, done = ctx.Queue(), ctx.Event()
    tower = ctx.Process(target=_tower_process, args=(ports, done))
    tower.start()
    in_port, out_port = ports.get(timeout=60)
    return tower, done, NodeConfig(towers=(TowerAddress("127.0.0.1", in_port, out_port),), bind="127.0.0.1")


@contextlib.contextmanager
def _mesh_with_stored_topic(topic: str, args: argparse.Namespace) -> Iterator[NodeConfig]:
    """A tower and a store process whose database already holds ``args.records``
    records of ``topic`` (one partition): the config of a node on that mesh."""
    import tempfile

    from dafka.store.db import RecordDB

    ctx = mp.get_context("spawn")
    ports, tower_done = ctx.Queue(), ctx.Event()
    tower = ctx.Process(target=_tower_process, args=(ports, tower_done))
    tower.start()
    try:
        in_port, out_port = ports.get(timeout=60)
        cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", in_port, out_port),), bind="127.0.0.1", beacon_interval=0.2)
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            with RecordDB(db, sync=False) as records:
                now = int(time.time() * 1000)
                payload = b"x" * args.size
                for start in range(0, args.records, 10_000):
                    stop = min(start + 10_000, args.records)
                    records.append([(topic, "B" * 32, i, payload, now) for i in range(start, stop)])
            ready, done = ctx.Event(), ctx.Event()
            store = ctx.Process(target=_store_process, args=(cfg, db, not args.no_sync, ready, done))
            store.start()
            ready.wait(60)
            try:
                yield cfg
            finally:
                done.set()
                store.join(60)
    finally:
        tower_done.set()
        tower.join(30)


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process used so far, from /proc (Linux)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tcp_sockets(pids: list[int]) -> int:
    """Established TCP sockets owned by these processes (both ends of a
    loopback connection count when both ends are ours), from /proc (Linux)."""
    import os

    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "01" and f[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def write_temp(directory: str | None, mb: int, sync: bool) -> float:
    """Write ``mb`` MiB of zeros to a new file in ``directory`` (None: the temporary
    directory), fdatasync it once if ``sync``, delete it: the seconds it took."""
    import os
    import tempfile

    chunk = bytes(1 << 20)
    t0 = time.perf_counter()
    fd, path = tempfile.mkstemp(prefix="dafka-bench-", dir=directory)
    try:
        for _ in range(mb):
            os.write(fd, chunk)
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return time.perf_counter() - t0


def disk_mb_s(directory: str, mb: int) -> float:
    """MB/s of ``mb`` 1 MiB writes to a new file in ``directory`` then one fdatasync (what
    ``dd bs=1M conv=fdatasync`` measures: issue 36's yardstick for a synced publish)."""
    return mb * 1.048576 / write_temp(directory, mb, sync=True)
