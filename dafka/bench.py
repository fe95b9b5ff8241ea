"""Benchmarks: ``dafka bench live`` (and more as components land).

Each benchmark runs the nodes in separate processes (spawned, never forked:
a forked ZeroMQ context is unusable), repeats the measurement and reports the
median.  Figures go in the README's performance table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from itertools import repeat
from typing import Any

from dafka.config import NodeConfig, TowerAddress

PAYLOAD = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=sorted(BENCHMARKS), help="what to measure")
    p.add_argument("--records", type=int, default=1_000_000, help="records per run")
    p.add_argument("--runs", type=int, default=3, help="runs (the median is reported)")
    p.add_argument("--size", type=int, default=PAYLOAD, help="payload bytes")
    p.add_argument("--no-sync", action="store_true", help="store: do not fsync commits")
    p.add_argument("--transport", default="both", help="spark: path, gateway or both")
    p.add_argument("--seconds", type=float, default=3.0, help="embedded: seconds per measurement")


def _mesh() -> tuple[Any, NodeConfig]:
    from dafka.tower import Tower

    tower = Tower("127.0.0.1", 0, 0)
    tower.start()
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
    )
    return tower, cfg


def _live_producer(cfg: NodeConfig, topic: str, n: int, size: int, start: Any, done: Any) -> None:
    from dafka.producer import Producer

    producer = Producer(topic, cfg, acks=False, capacity=max(n, 1))
    start.wait(30)
    producer.publish_many(repeat(b"x" * size, n))
    done.wait(120)  # keep answering FETCHes until the consumer has everything
    producer.close(0)


def bench_live(args: argparse.Namespace) -> list[float]:
    """Records/s from one producer process to one consumer process."""
    ctx = mp.get_context("spawn")
    rates = []
    for run in range(args.runs):
        tower, cfg = _mesh()
        from dafka.consumer import Consumer

        topic = f"bench-live-{run}"
        consumer = Consumer(topic, cfg, offset_reset="earliest")
        start, done = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_live_producer, args=(cfg, topic, args.records, args.size, start, done))
        proc.start()
        deadline = time.monotonic() + 30
        while len(consumer.peers) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let subscriptions propagate both ways
        start.set()
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 300
        while got < args.records and time.monotonic() < deadline:
            got += len(consumer.poll_batch(100_000, 1.0))
        elapsed = time.perf_counter() - t0
        done.set()
        proc.join(30)
        consumer.close()
        tower.close()
        if got < args.records:
            print(f"run {run}: only {got} of {args.records} records arrived", file=sys.stderr)
            continue
        rate = got / elapsed
        rates.append(rate)
        print(f"run {run}: {rate:,.0f} records/s ({consumer.fetches_sent} fetches)", flush=True)
    return rates


def _store_process(cfg: NodeConfig, db: str, sync: bool, ready: Any, done: Any) -> None:
    from dafka.store.node import Store

    store = Store(db, cfg, sync=sync)
    ready.set()
    done.wait(600)
    store.close()


def _acked_producer(cfg: NodeConfig, topic: str, n: int, size: int, result: Any) -> None:
    from dafka.producer import Producer

    producer = Producer(topic, cfg, capacity=max(n, 1))
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


def bench_store(args: argparse.Namespace) -> list[float]:
    """Records/s acknowledged by one store process, from one producer process."""
    import tempfile

    ctx = mp.get_context("spawn")
    rates = []
    for run in range(args.runs):
        tower, cfg = _mesh()
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            ready, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
            store = ctx.Process(target=_store_process, args=(cfg, db, not args.no_sync, ready, done))
            store.start()
            ready.wait(60)
            prod = ctx.Process(target=_acked_producer, args=(cfg, f"bench-store-{run}", args.records, args.size, result))
            prod.start()
            rate = result.get(timeout=900)
            prod.join(30)
            done.set()
            store.join(60)
        tower.close()
        if rate:
            rates.append(rate)
            print(f"run {run}: {rate:,.0f} records/s acknowledged (sync={'off' if args.no_sync else 'on'})", flush=True)
    return rates


def bench_replay(args: argparse.Namespace) -> list[float]:
    """Records/s an earliest consumer reads back from one store process."""
    import tempfile

    from dafka.consumer import Consumer
    from dafka.store.db import RecordDB

    ctx = mp.get_context("spawn")
    rates = []
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        topic = "bench-replay"
        payload = b"x" * args.size
        with RecordDB(db, sync=False) as records:
            partition = "B" * 32
            now = int(time.time() * 1000)
            for start in range(0, args.records, 10_000):
                stop = min(start + 10_000, args.records)
                records.append([(topic, partition, i, payload, now) for i in range(start, stop)])
        for run in range(args.runs):
            tower, cfg = _mesh()
            ready, done = ctx.Event(), ctx.Event()
            store = ctx.Process(target=_store_process, args=(cfg, db, False, ready, done))
            store.start()
            ready.wait(60)
            consumer = Consumer(topic, cfg, offset_reset="earliest")
            got = 0
            t0 = None
            deadline = time.monotonic() + 600
            while got < args.records and time.monotonic() < deadline:
                batch = consumer.poll_batch(100_000, 1.0)
                if batch and t0 is None:
                    t0 = time.perf_counter()  # from the first record: excludes discovery
                got += len(batch)
            elapsed = time.perf_counter() - (t0 or time.perf_counter())
            consumer.close()
            done.set()
            store.join(60)
            tower.close()
            if got >= args.records and elapsed > 0:
                rates.append(got / elapsed)
                print(f"run {run}: {got / elapsed:,.0f} records/s replayed", flush=True)
            else:
                print(f"run {run}: only {got} records", file=sys.stderr)
    return rates


def _zmq_receiver(port: int, n: int, ready: Any, result: Any) -> None:
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    ready.set()
    recv = sub.recv
    recv()
    recv()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        recv()
        recv()
    result.put((n - 1) / (time.perf_counter() - t0))
    sub.close(0)


def bench_zmq(args: argparse.Namespace) -> list[float]:
    """The ceiling: bare pyzmq PUB -> SUB of 2-frame messages, no protocol work."""
    import zmq

    from dafka import wire

    ctx = mp.get_context("spawn")
    rates = []
    header = wire.record_prefix(wire.RECORD, "bench", "A" * 32, "bench")
    payload = b"x" * args.size
    for run in range(args.runs):
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        ready, result = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_zmq_receiver, args=(port, args.records, ready, result))
        proc.start()
        ready.wait(30)
        time.sleep(0.5)  # the subscription has to reach the PUB; nothing to observe here
        send, pack, more = pub.send, wire.pack_u64, int(zmq.SNDMORE)
        for seq in range(args.records):
            send(header + pack(seq), more)
            send(payload)
        rate = result.get(timeout=300)
        proc.join(30)
        pub.close(0)
        rates.append(rate)
        print(f"run {run}: {rate:,.0f} messages/s received", flush=True)
    return rates


def _gateway_process(cfg: NodeConfig, db: str, sync: bool, port: Any, done: Any) -> None:
    from dafka.tank.gateway import Gateway

    gateway = Gateway(db, cfg, listen=("127.0.0.1", 0), sync=sync)
    port.put(gateway.tank_port)
    done.wait(900)
    gateway.close()


def _tank_bundles(size: int, per_bundle: int, distinct: int = 8) -> list[bytes]:
    """Bundles as the C++ client builds them (snappy above 512 messages), of random bytes."""
    import os

    from dafka.tank.bundle import encode_bundle

    now = int(time.time() * 1000)
    return [
        encode_bundle([(None, now, None, os.urandom(size)) for _ in range(per_bundle)])
        for _ in range(distinct)
    ]


def _tank_publish(port: int, topic: str, n: int, size: int, per_bundle: int, window: int) -> float:
    """Records/s acknowledged: ``window`` produce requests of one bundle each in flight."""
    from dafka.tank.client import TankClient
    from dafka.tank.messages import ProducePartition, ProduceRequest, ProduceResponse, ProduceTopic

    bundles = _tank_bundles(size, per_bundle)
    requests = n // per_bundle
    with TankClient("127.0.0.1", port, timeout=120) as client:
        client.create_topic(topic, 1)
        inflight: list[int] = []
        t0 = time.perf_counter()
        for i in range(requests):
            part = ProducePartition(0, bundles[i % len(bundles)])
            inflight.append(client.send(ProduceRequest(client.next_request_id(), [ProduceTopic(topic, [part])])))
            if len(inflight) >= window:
                resp = client.wait(inflight.pop(0))
                assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0, resp
        for req_id in inflight:
            resp = client.wait(req_id)
            assert isinstance(resp, ProduceResponse) and resp.topics[0].partitions[0].error == 0, resp
        return requests * per_bundle / (time.perf_counter() - t0)


def _tank_fetch(port: int, topic: str, n: int, fetch_size: int) -> float:
    """Records/s of one client fetching ``n`` records from seq 1, decoding every message.

    Like a pipelining Tank client, it asks for the next range (found from the
    bundle headers alone) before decoding the answer in hand, so the gateway
    encodes while the client decodes.
    """
    from dafka.tank.bundle import decode_chunk, parse_bundle_header, split_chunk
    from dafka.tank.client import TankClient
    from dafka.tank.messages import ConsumePartition, ConsumeRequest, ConsumeResponse, ConsumeTopic

    def ask(client: TankClient, seq: int) -> int:
        part = ConsumePartition(0, seq, fetch_size)
        return client.send(ConsumeRequest(client.next_request_id(), [ConsumeTopic(topic, [part])]))

    with TankClient("127.0.0.1", port, timeout=120) as client:
        got = 0
        t0 = time.perf_counter()
        pending = ask(client, 1)
        while got < n:
            resp = client.wait(pending)
            assert isinstance(resp, ConsumeResponse)
            res = resp.topics[0].partitions[0]
            if not res.chunk or res.base_seq is None:
                raise RuntimeError(f"fetch returned nothing (flags {res.flags})")
            spans, _ = split_chunk(res.chunk)
            count = sum(parse_bundle_header(res.chunk, a, b).count for a, b in spans)
            if got + count < n:
                pending = ask(client, res.base_seq + count)
            got += len(decode_chunk(res.chunk, res.base_seq).records)
        return got / (time.perf_counter() - t0)


def bench_tank(args: argparse.Namespace) -> dict[str, list[float]]:
    """Through a gateway process: publish (bundles of 1000, acknowledged) and fetch."""
    import tempfile

    ctx = mp.get_context("spawn")
    publish, fetch = [], []
    for run in range(args.runs):
        tower, cfg = _mesh()
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            port, done = ctx.Queue(), ctx.Event()
            gateway = ctx.Process(target=_gateway_process, args=(cfg, db, not args.no_sync, port, done))
            gateway.start()
            try:
                tank_port = port.get(timeout=60)
                topic = f"bench-tank-{run}"
                rate = _tank_publish(tank_port, topic, args.records, args.size, 1000, 8)
                publish.append(rate)
                print(f"run {run}: publish {rate:,.0f} records/s acknowledged", flush=True)
                rate = _tank_fetch(tank_port, topic, args.records // 1000 * 1000, 8 << 20)
                fetch.append(rate)
                print(f"run {run}: fetch {rate:,.0f} records/s", flush=True)
            finally:
                done.set()
                gateway.join(60)
                tower.close()
    return {"tank publish": publish, "tank fetch": fetch}


def _tower_process(ports: Any, done: Any) -> None:
    from dafka.tower import Tower

    tower = Tower("127.0.0.1", 0, 0)
    tower.start()
    ports.put((tower.in_port, tower.out_port))
    done.wait(1800)
    tower.close()


def _busy(stop: Any) -> None:
    """The application's own work: a pure-Python loop that never waits."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _with_busy_thread(busy: bool, fn: Callable[[], float]) -> float:
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if busy:
        thread.start()
    try:
        return fn()
    finally:
        stop.set()
        if busy:
            thread.join()


def _embedded_publish(cfg: NodeConfig, topic: str, args: argparse.Namespace, busy: bool) -> float:
    """Records/s an embedded Producer gets acknowledged by the store, for ``--seconds``."""
    from dafka.producer import Producer

    producer = Producer(topic, cfg, capacity=max(args.records, 1))
    deadline = time.monotonic() + 30
    while len(producer.peers) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # subscriptions both ways
    chunk = [b"x" * args.size] * 100

    def run() -> float:
        t0 = time.perf_counter()
        end = time.monotonic() + args.seconds
        sent = 0
        while time.monotonic() < end and sent < args.records:
            producer.publish_many(chunk)
            sent += len(chunk)
        ok = producer.flush(120)
        elapsed = time.perf_counter() - t0
        return (producer.acked_offset + 1) / elapsed if ok else 0.0

    try:
        return _with_busy_thread(busy, run)
    finally:
        producer.close(0)


def _embedded_consume(cfg: NodeConfig, topic: str, args: argparse.Namespace, busy: bool) -> float:
    """Records/s an embedded earliest Consumer reads from the store, for ``--seconds``."""
    from dafka.consumer import Consumer

    def run() -> float:
        consumer = Consumer(topic, cfg, offset_reset="earliest")
        try:
            got, t0 = 0, None
            end = time.monotonic() + 60
            while got < args.records and time.monotonic() < end:
                batch = consumer.poll_batch(100_000, 1.0)
                if batch and t0 is None:
                    t0 = time.perf_counter()  # from the first record: excludes discovery
                    end = time.monotonic() + args.seconds
                got += len(batch)
            return got / (time.perf_counter() - t0) if t0 is not None and got else 0.0
        finally:
            consumer.close()

    return _with_busy_thread(busy, run)


def bench_embedded(args: argparse.Namespace) -> dict[str, list[float]]:
    """An app with one busy pure-Python thread embeds a Producer, then a Consumer.

    The store and the tower run in their own processes; the producer and the
    consumer run in this one, beside the busy thread or alone.  Reports
    records/s for both with and without the busy thread, and the ratio.
    """
    import tempfile

    from dafka import fastio
    from dafka.store.db import RecordDB

    print(f"I/O implementation: {fastio.IMPLEMENTATION} ({fastio.REASON})", flush=True)
    ctx = mp.get_context("spawn")
    series: dict[str, list[float]] = {}
    for run in range(args.runs):
        ports, tower_done = ctx.Queue(), ctx.Event()
        tower = ctx.Process(target=_tower_process, args=(ports, tower_done))
        tower.start()
        in_port, out_port = ports.get(timeout=60)
        cfg = NodeConfig(
            towers=(TowerAddress("127.0.0.1", in_port, out_port),), bind="127.0.0.1", beacon_interval=0.2
        )
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            topic = f"bench-embedded-read-{run}"
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
                for busy in (False, True):
                    label = "busy" if busy else "alone"
                    rate = _embedded_publish(cfg, f"bench-embedded-{run}-{label}", args, busy)
                    series.setdefault(f"produce {label}", []).append(rate)
                    print(f"run {run}: produce, {label}: {rate:,.0f} records/s acknowledged", flush=True)
                for busy in (False, True):
                    label = "busy" if busy else "alone"
                    rate = _embedded_consume(cfg, topic, args, busy)
                    series.setdefault(f"consume {label}", []).append(rate)
                    print(f"run {run}: consume, {label}: {rate:,.0f} records/s", flush=True)
            finally:
                done.set()
                store.join(60)
                tower_done.set()
                tower.join(30)
    for what in ("produce", "consume"):
        alone, busy = series.get(f"{what} alone", []), series.get(f"{what} busy", [])
        if alone and busy and statistics.median(alone) > 0:
            ratio = statistics.median(busy) / statistics.median(alone)
            print(f"{what}: busy/alone ratio {ratio:.2f} (goal >= 0.4)", flush=True)
    return series


def _spark_bench(args: argparse.Namespace) -> dict[str, list[float]]:
    from dafka.spark_bench import bench_spark  # pyspark is an extra: imported only here

    return bench_spark(args)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "zmq": bench_zmq,
    "live": bench_live,
    "store": bench_store,
    "replay": bench_replay,
    "tank": bench_tank,
    "embedded": bench_embedded,
    "spark": _spark_bench,
}


def main(args: argparse.Namespace) -> int:
    result = BENCHMARKS[args.which](args)
    series = result if isinstance(result, dict) else {args.which: result}
    status = 0
    for name, rates in series.items():
        if not rates:
            print(f"{name}: no successful run", file=sys.stderr)
            status = 1
            continue
        print(
            f"{name}: median {statistics.median(rates):,.0f} records/s of {args.size}-byte records "
            f"over {len(rates)} runs"
        )
    return status
