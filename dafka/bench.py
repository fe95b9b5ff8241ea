"""Benchmarks: ``dafka bench live`` (and more as components land).

Each benchmark runs the nodes in separate processes (spawned, never forked:
a forked ZeroMQ context is unusable), repeats the measurement and reports the
median.  Figures go in docs/reference/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any

from dafka import progress
from dafka.config import NodeConfig, TowerAddress

PAYLOAD = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dafka.cli import count_arg, positive_seconds_arg

    p.add_argument("which", choices=sorted(BENCHMARKS), help="what to measure")
    p.add_argument("--records", type=count_arg, default=1_000_000, help="records per run")
    p.add_argument("--runs", type=count_arg, default=3, help="runs (the median is reported)")
    p.add_argument("--size", type=count_arg, default=PAYLOAD, help="payload bytes")
    p.add_argument("--no-sync", action="store_true", help="store: do not fsync commits")
    p.add_argument("--no-store", action="store_true", help="latency: no store process, delivery only")
    p.add_argument("--transport", default="both", help="spark: path, gateway or both")
    p.add_argument("--rate", type=count_arg, default=10_000, help="latency: records/s published")
    p.add_argument(
        "--seconds", type=positive_seconds_arg, default=3.0,
        help="latency: seconds of publishing per run; embedded: seconds per measurement; scale: seconds measured",
    )
    p.add_argument("--secure", action="store_true", help="live, store, replay: CURVE mesh with temporary keys; zmq, ceiling: CURVE on the bare pair")
    p.add_argument("--nodes", type=int, default=100, help="scale: producers in the mesh")
    p.add_argument("--procs", type=int, default=4, help="scale: processes hosting the producers")
    p.add_argument(
        "--partitions", type=int, default=0,
        help="group: a group over this many partitions (one producer each, 1 record/s): rebalance times",
    )
    p.add_argument(
        "--outbox-sync", choices=["each", "batch"], default="each",
        help="outbox, latency --outbox: each (publish waits for the fsync) or batch",
    )
    p.add_argument("--outbox", action="store_true", help="latency: the producer publishes through an edge outbox")
    p.add_argument(
        "--no-batches", action="store_true",
        help="live, store, replay, latency (plain mesh): one record a message, as to C readers",
    )


def _mesh(secure: bool = False, batches: bool = True) -> tuple[Any, NodeConfig]:
    from dafka.tower import Tower

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

    from dafka import security

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
        tower, cfg = _mesh(args.secure, not args.no_batches)
        from dafka.consumer import Consumer

        topic = f"bench-live-{run}"
        consumer = Consumer(topic, _role(cfg, "consumer"), offset_reset="earliest")
        start, done = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_live_producer, args=(cfg, topic, args.records, args.size, start, done))
        proc.start()
        deadline = time.monotonic() + 30
        while len(consumer.peers) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let subscriptions propagate both ways
        # The setup's garbage would otherwise trigger a full collection in the
        # short measured part; a long-running consumer pays that once at start.
        gc.collect()
        start.set()
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 300
        with progress.bar(args.records, f"run {run}") as bar:
            while got < args.records and time.monotonic() < deadline:
                n = len(consumer.poll_batch(100_000, 1.0))
                got += n
                bar.update(n)
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
    from dafka.producer import Producer

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


def bench_store(args: argparse.Namespace) -> list[float]:
    """Records/s acknowledged by one store process, from one producer process."""
    import tempfile

    ctx = mp.get_context("spawn")
    rates = []
    for run in range(args.runs):
        tower, cfg = _mesh(args.secure, not args.no_batches)
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            ready, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
            store = ctx.Process(target=_store_process, args=(_role(cfg, "store"), db, not args.no_sync, ready, done))
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
            tower, cfg = _mesh(args.secure, not args.no_batches)
            ready, done = ctx.Event(), ctx.Event()
            store = ctx.Process(target=_store_process, args=(_role(cfg, "store"), db, False, ready, done))
            store.start()
            ready.wait(60)
            consumer = Consumer(topic, _role(cfg, "consumer"), offset_reset="earliest")
            got = 0
            t0 = None
            deadline = time.monotonic() + 600
            bar = progress.bar(args.records, f"run {run}")
            while got < args.records and time.monotonic() < deadline:
                batch = consumer.poll_batch(100_000, 1.0)
                if batch and t0 is None:
                    t0 = time.perf_counter()  # from the first record: excludes discovery
                got += len(batch)
                bar.update(len(batch))
            bar.close()
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


def _zmq_receiver(port: int, n: int, ready: Any, result: Any, curve: tuple[bytes, bytes, bytes] | None) -> None:
    sub = _bare_sub(port, curve)
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


def bench_zmq(args: argparse.Namespace) -> list[float]:
    """The ceiling: bare pyzmq PUB -> SUB of 2-frame messages, no protocol work."""
    import zmq

    from dafka import wire

    rates = []
    header = wire.record_prefix(wire.RECORD, "bench", "A" * 32, "bench")
    payload = b"x" * args.size
    def send_all(pub: zmq.Socket) -> None:
        send, pack, more = pub.send, wire.pack_u64, int(zmq.SNDMORE)
        for seq in range(args.records):
            send(header + pack(seq), more)
            send(payload)

    for run in range(args.runs):
        rate = _publish_to_receiver(_zmq_receiver, args.records, send_all, args.secure)
        rates.append(rate)
        print(f"run {run}: {rate:,.0f} messages/s received", flush=True)
    return rates


def _ceiling_receiver(port: int, n: int, ready: Any, result: Any, curve: tuple[bytes, bytes, bytes] | None) -> None:
    import zmq

    from dafka import fastio, wire
    from dafka.consumer import ConsumerRecord
    from dafka.gaps import PartitionTracker
    from dafka.node import DRAIN

    sub = _bare_sub(port, curve)
    tracker = PartitionTracker("bench", "A" * 32, 0)
    by_prefix = {wire.record_prefix(wire.RECORD, "bench", "A" * 32, "bench"): tracker}
    out: list[Any] = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    ready.set()
    got, t0 = 0, 0.0
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        poller.poll(1000)  # the GIL is released only to wait, as in a node's I/O thread
        k = fastio.drain_records(sub, DRAIN, by_prefix, out, ConsumerRecord, 0, _unexpected, _unexpected)
        if k and not t0:
            t0 = time.perf_counter()
        got += k
        out.clear()
    result.put(got / (time.perf_counter() - t0) if got >= n and t0 else 0.0)
    sub.close(0)


def _unexpected(*args: Any) -> None:
    raise RuntimeError("ceiling: a record out of order or an unknown message")


def bench_ceiling(args: argparse.Namespace) -> list[float]:
    """The compiled ceiling: the extension's batch send -> batch drain, 2 processes, no protocol.

    The same per-record work as ``live`` at the socket (RECORD frames, one
    record object per record) without nodes, trackers' gaps, FETCHes or the
    hand-over from a consumer's I/O thread to the application thread.
    """
    import zmq

    from dafka import fastio, wire

    print(f"I/O implementation: {fastio.IMPLEMENTATION} ({fastio.REASON})", flush=True)
    rates = []
    prefix = wire.record_prefix(wire.RECORD, "bench", "A" * 32, "bench")
    contents = [b"x" * args.size] * 1024  # the chunks publish_many sends
    def send_all(pub: zmq.Socket) -> None:
        for seq in range(0, args.records, len(contents)):
            fastio.send_records(pub, prefix, seq, contents, 0, min(len(contents), args.records - seq))

    for run in range(args.runs):
        rate = _publish_to_receiver(_ceiling_receiver, args.records, send_all, args.secure)
        if rate:
            rates.append(rate)
            print(f"run {run}: {rate:,.0f} records/s received", flush=True)
        else:
            print(f"run {run}: not every record arrived", file=sys.stderr)
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


def _kafka_gateway_process(cfg: NodeConfig, db: str, sync: bool, port: Any, done: Any) -> None:
    from dafka.kafka.gateway import KafkaGateway

    gateway = KafkaGateway(db, cfg, listen=("127.0.0.1", 0), kafka_listen=("127.0.0.1", 0), sync=sync)
    port.put(gateway.kafka_port)
    done.wait(900)
    gateway.close()


def _kafka_produce(port: int, topic: str, n: int, size: int) -> float:
    """confluent-kafka (librdkafka) producing ``n`` records, acks=all: records/s acknowledged."""
    from confluent_kafka import Producer as KProducer

    # Delivery reports for failures only: flush() still waits for every ack,
    # but the client makes no Python callback per record (the Tank bench's
    # client has no per-record work at all).
    p = KProducer({
        "bootstrap.servers": f"127.0.0.1:{port}", "acks": "all", "linger.ms": 5,
        "batch.size": 1 << 20, "queue.buffering.max.messages": 2_000_000,
        "queue.buffering.max.kbytes": 1 << 21, "enable.idempotence": False,
        "delivery.report.only.error": True,
    })
    payload = b"x" * size
    failed = [0]

    def cb(err: Any, _msg: Any) -> None:
        if err is not None:
            failed[0] += 1

    p.produce(topic, payload, partition=0, on_delivery=cb)  # creates the topic
    p.flush(30)
    produce = p.produce
    t0 = time.perf_counter()
    for _ in range(n):
        while True:
            try:
                produce(topic, payload, partition=0, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.01)
    left = p.flush(300)
    elapsed = time.perf_counter() - t0
    if left or failed[0]:
        raise RuntimeError(f"{left} records undelivered, {failed[0]} failed")
    return n / elapsed


def _kafka_consume(port: int, topic: str, n: int) -> float:
    """confluent-kafka consuming ``n`` records from offset 1 of partition 0: records/s."""
    from confluent_kafka import Consumer as KConsumer
    from confluent_kafka import TopicPartition

    # Like the Tank bench's client: connected before the clock starts, and
    # asking for the next range while the answer in hand is decoded.  (With
    # librdkafka's default fetch.queue.backoff.ms, 1 s, the prefetcher sleeps
    # a whole second whenever its queue is above queued.min.messages.)
    c = KConsumer({
        "bootstrap.servers": f"127.0.0.1:{port}", "group.id": "bench", "enable.auto.commit": False,
        "fetch.max.bytes": 16 << 20, "max.partition.fetch.bytes": 8 << 20,
        "fetch.queue.backoff.ms": 10,
    })
    c.list_topics(topic, timeout=30)
    c.assign([TopicPartition(topic, 0, 1)])
    got = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + 600
    while got < n and time.monotonic() < deadline:
        msgs = c.consume(10_000, 1.0)
        got += sum(1 for m in msgs if not m.error())
    elapsed = time.perf_counter() - t0
    c.close()
    if got < n:
        raise RuntimeError(f"consumed {got} of {n}")
    return n / elapsed


def bench_kafka(args: argparse.Namespace) -> dict[str, list[float]]:
    """Through a Kafka gateway process: confluent-kafka produce (acks=all) and consume."""
    import tempfile

    ctx = mp.get_context("spawn")
    produce, consume = [], []
    for run in range(args.runs):
        tower, cfg = _mesh()
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            port, done = ctx.Queue(), ctx.Event()
            gateway = ctx.Process(target=_kafka_gateway_process, args=(cfg, db, not args.no_sync, port, done))
            gateway.start()
            try:
                kafka_port = port.get(timeout=60)
                topic = f"bench-kafka-{run}"
                rate = _kafka_produce(kafka_port, topic, args.records, args.size)
                produce.append(rate)
                print(f"run {run}: kafka produce {rate:,.0f} records/s acknowledged", flush=True)
                rate = _kafka_consume(kafka_port, topic, args.records)
                consume.append(rate)
                print(f"run {run}: kafka consume {rate:,.0f} records/s", flush=True)
            finally:
                done.set()
                gateway.join(60)
                tower.close()
    return {"kafka produce": produce, "kafka consume": consume}


KAFKA_GROUP_PARTITIONS = 6
KAFKA_GROUP_MEMBERS = 3


def _kafka_member(bootstrap: str, topic: str, group: str, index: int, session_ms: int, heartbeat_ms: int,
                  events: Any, stop: Any) -> None:
    """A confluent-kafka group member: reports its assignment, and the first record it
    gets from each partition after every assignment change."""
    from confluent_kafka import Consumer as KConsumer

    c = KConsumer({
        "bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
        "session.timeout.ms": session_ms, "heartbeat.interval.ms": heartbeat_ms,
        "auto.commit.interval.ms": 200, "fetch.wait.max.ms": 100,
    })
    c.subscribe([topic])
    assigned: frozenset[int] = frozenset()
    seen: set[int] = set()
    try:
        while not stop.is_set():
            msgs = c.consume(1000, 0.05)
            now = time.time()
            current = frozenset(tp.partition for tp in c.assignment())
            if current != assigned:
                assigned = current
                seen.clear()
                events.send(("assign", index, sorted(current), now))
            for m in msgs:
                if m.error() is None and m.partition() not in seen:
                    seen.add(m.partition())
                    events.send(("got", index, m.partition(), now))
    finally:
        c.close()


def kafka_failover(bootstrap: str, session_ms: int = 6000, heartbeat_ms: int = 500, timeout: float = 90.0) -> float:
    """A group of 3 confluent-kafka members over 6 partitions, records flowing; one member
    is killed (SIGKILL): seconds from the kill until every partition it had delivered
    a record to another member.  Raises RuntimeError if that does not happen in ``timeout``."""
    import threading
    import uuid
    from multiprocessing.connection import wait as ready

    from confluent_kafka import Producer as KProducer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"failover-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, KAFKA_GROUP_PARTITIONS, 1)])[topic].result(30)
    flowing = threading.Event()

    def produce() -> None:  # a record to every partition every 20 ms
        p = KProducer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
        while not flowing.is_set():
            for part in range(KAFKA_GROUP_PARTITIONS):
                p.produce(topic, b"x" * 100, partition=part)
            p.poll(0)
            flowing.wait(0.02)
        p.flush(30)

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(KAFKA_GROUP_MEMBERS)]
    members = [
        ctx.Process(target=_kafka_member, args=(bootstrap, topic, topic, i, session_ms, heartbeat_ms, pipes[i][1], stop))
        for i in range(KAFKA_GROUP_MEMBERS)
    ]
    producer = threading.Thread(target=produce)
    producer.start()
    owned: dict[int, list[int]] = {}
    got: dict[int, set[int]] = {i: set() for i in range(KAFKA_GROUP_MEMBERS)}
    after: dict[int, float] = {}  # partition -> when a survivor first got it after the kill
    killed_at = 0.0
    victim = -1

    def take(conns: list[Any], wait: float) -> None:
        for conn in ready(conns, timeout=wait):
            try:
                kind, index, what, when = conn.recv()
            except (EOFError, OSError):
                conns.remove(conn)
                continue
            if kind == "assign":
                owned[index] = what
                got[index] = set()
            else:
                got[index].add(what)
                if victim >= 0 and index != victim and when >= killed_at:
                    after.setdefault(what, when)

    try:
        for m in members:
            m.start()
        conns = [r for r, _ in pipes]
        deadline = time.monotonic() + timeout
        # Balanced and every member delivering from both of its partitions.
        while not (
            len(owned) == KAFKA_GROUP_MEMBERS
            and all(len(owned[i]) == 2 and got[i] >= set(owned[i]) for i in owned)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the group did not settle: {owned}")
            take(conns, 0.05)
        victim = 0
        lost = set(owned[victim])
        members[victim].kill()
        killed_at = time.time()
        conns = [r for i, (r, _) in enumerate(pipes) if i != victim]
        deadline = time.monotonic() + timeout
        while not lost <= set(after):
            if time.monotonic() > deadline:
                raise RuntimeError(f"partitions {sorted(lost - set(after))} not consumed again in {timeout:.0f}s")
            take(conns, 0.05)
        return max(after[p] for p in lost) - killed_at
    finally:
        stop.set()
        flowing.set()
        for m in members:
            m.join(20)
            if m.is_alive():
                m.kill()
                m.join(5)
        producer.join(60)
        for conn in (c for pair in pipes for c in pair):
            conn.close()


def bench_kafka_group(args: argparse.Namespace) -> dict[str, list[float]]:
    """Kafka consumer group failover through a gateway process: 3 confluent-kafka members,
    6 partitions, one killed: seconds until its partitions are consumed again."""
    import tempfile

    session, heartbeat = 6000, 500
    ctx = mp.get_context("spawn")
    times: list[float] = []
    for run in range(args.runs):
        tower, cfg = _mesh()
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            port, done = ctx.Queue(), ctx.Event()
            gateway = ctx.Process(target=_kafka_gateway_process, args=(cfg, db, not args.no_sync, port, done))
            gateway.start()
            try:
                kafka_port = port.get(timeout=60)
                took = kafka_failover(f"127.0.0.1:{kafka_port}", session, heartbeat)
                times.append(took)
                print(
                    f"run {run}: killed member's partitions consumed again after {took:.2f}s "
                    f"(session timeout {session / 1000:.0f}s, heartbeat {heartbeat / 1000:.1f}s, "
                    f"goal <= {session / 1000 + 2:.0f}s)",
                    flush=True,
                )
            except RuntimeError as exc:
                print(f"run {run}: {exc}", file=sys.stderr)
            finally:
                done.set()
                gateway.join(60)
                tower.close()
    return {"kafka group failover seconds": times}


def bench_outbox(args: argparse.Namespace) -> dict[str, list[float]]:
    """Records/s published into an fsync'd edge outbox and drained to a store, beside ``bench store``.

    Each run measures the plain acknowledged producer (``bench store``) and
    then the same through an outbox (``--outbox-sync``), in the same sitting.
    """
    import tempfile

    ctx = mp.get_context("spawn")
    plain: list[float] = []
    boxed: list[float] = []
    for run in range(args.runs):
        for label, rates in (("store", plain), ("outbox", boxed)):
            tower, cfg = _mesh(False, not args.no_batches)
            with tempfile.TemporaryDirectory(prefix="dafka-bench-") as tmp:
                ready, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
                store = ctx.Process(
                    target=_store_process, args=(_role(cfg, "store"), f"{tmp}/db", not args.no_sync, ready, done)
                )
                store.start()
                ready.wait(60)
                outbox = f"{tmp}/outbox" if label == "outbox" else None
                prod = ctx.Process(
                    target=_acked_producer,
                    args=(cfg, f"bench-{label}-{run}", args.records, args.size, result, outbox, args.outbox_sync),
                )
                prod.start()
                rate = result.get(timeout=900)
                prod.join(30)
                done.set()
                store.join(60)
            tower.close()
            if rate:
                rates.append(rate)
                print(f"run {run}: {label}: {rate:,.0f} records/s acknowledged", flush=True)
    if plain and boxed:
        ratio = statistics.median(boxed) / statistics.median(plain)
        print(f"outbox ({args.outbox_sync}) / store: {ratio:.2f}x")
    return {"store": plain, "outbox": boxed}


def _percentiles(samples: list[float]) -> str:
    """p50/p99/p99.9/max of latencies in seconds, as milliseconds."""
    if not samples:
        return "no samples"
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return (
        f"p50 {at(0.5):.3f} ms  p99 {at(0.99):.3f} ms  p99.9 {at(0.999):.3f} ms"
        f"  max {ordered[-1] * 1000:.3f} ms  ({len(ordered)} records)"
    )


def _bucket_quantile(bounds: tuple[float, ...], counts: list[int], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile ``q``."""
    need, running = q * sum(counts), 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        running += n
        if running >= need:
            return bound
    return float("inf")


def _paced_producer(
    cfg: NodeConfig,
    topic: str,
    rate: int,
    seconds: float,
    size: int,
    go: Any,
    result: Any,
    acks: bool = True,
    outbox: str | None = None,
    sync: str = "each",
) -> None:
    """Publish ``rate`` records/s stamped with their send time; collect publish->ACK latencies."""
    import struct

    from dafka.producer import Producer

    n = int(rate * seconds)
    extra: dict[str, Any] = {"outbox": outbox, "outbox_sync": sync} if outbox else {}
    producer = Producer(topic, cfg, capacity=max(n, 1), acks=acks, **extra)
    stamp = struct.Struct(">q")
    pad = b"x" * max(0, size - stamp.size)
    sent = [0] * n
    acked: list[float] = []
    clock = time.perf_counter_ns  # CLOCK_MONOTONIC: comparable across processes

    def on_ack(receipt: Any) -> None:
        if acks and receipt.acked():
            acked.append((clock() - sent[receipt.offset]) / 1e9)

    go.wait(60)
    t0 = clock()
    interval = 1e9 / rate
    i = 0
    while i < n:
        due = min(n, int((clock() - t0) / interval) + 1)
        while i < due:
            now = clock()
            sent[i] = now
            producer.publish(stamp.pack(now) + pad, on_ack)
            i += 1
        if i < n:
            # Sleep to the next record's time (Linux sleeps ~60 us past it).
            time.sleep(max(0.0, (t0 + i * interval - clock()) / 1e9))
    producer.flush(30)
    producer.close(5)
    result.put(acked)


def _zmq_latency_receiver(port: int, n: int, ready: Any, result: Any) -> None:
    import struct

    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    ready.set()
    unpack, clock = struct.Struct(">q").unpack_from, time.perf_counter_ns
    lat = []
    while len(lat) < n and sub.poll(10_000):
        lat.append((clock() - unpack(sub.recv())[0]) / 1e9)
    sub.close(0)
    result.put(lat)


def _zmq_latency(rate: int, seconds: float, size: int) -> list[float]:
    """The floor on this machine: bare pyzmq PUB -> SUB between two processes at ``rate``."""
    import struct

    import zmq

    ctx = mp.get_context("spawn")
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    n = int(rate * seconds)
    ready, result = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_zmq_latency_receiver, args=(port, n, ready, result))
    proc.start()
    ready.wait(30)
    time.sleep(1.0)  # the subscription has to reach the PUB
    stamp, pad = struct.Struct(">q"), b"x" * max(0, size - 8)
    clock, interval, t0, i = time.perf_counter_ns, 1e9 / rate, time.perf_counter_ns(), 0
    while i < n:
        due = min(n, int((clock() - t0) / interval) + 1)
        while i < due:
            pub.send(stamp.pack(clock()) + pad)
            i += 1
        if i < n:
            time.sleep(max(0.0, (t0 + i * interval - clock()) / 1e9))
    lat = result.get(timeout=60)
    proc.join(30)
    pub.close(0)
    return lat[int(rate * 0.5) :]


def bench_latency(args: argparse.Namespace) -> dict[str, list[float]]:
    """Latency at a fixed rate: producer -> consumer delivery and publish -> store ACK.

    Producer, store (fsync on unless --no-sync) and consumer are separate
    processes (the consumer is this one).  The first half second of each run
    is left out (connections settling).  ``--no-store``: no store, no ACKs,
    delivery alone (what a store's commits on the same cores cost it).
    """
    import struct
    import tempfile

    from dafka.consumer import Consumer

    ctx = mp.get_context("spawn")
    unpack = struct.Struct(">q").unpack_from
    clock = time.perf_counter_ns
    delivery: list[float] = []
    ack: list[float] = []
    for run in range(args.runs):
        tower, cfg = _mesh(batches=not args.no_batches)
        topic = f"bench-latency-{run}"
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            ready, done, go, result = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
            stats = ctx.Queue()
            with_store = not args.no_store
            store = ctx.Process(
                target=_store_process, args=(cfg, db, not args.no_sync, ready, done, stats)
            )
            if with_store:
                store.start()
                ready.wait(60)
            consumer = Consumer(topic, cfg)
            prod = ctx.Process(
                target=_paced_producer,
                args=(
                    cfg, topic, args.rate, args.seconds, args.size, go, result, with_store,
                    f"{db}/outbox" if args.outbox else None, args.outbox_sync,
                ),
            )
            prod.start()
            try:
                # Both the consumer and the store must be connected to the producer.
                deadline = time.monotonic() + 30
                while len(consumer.peers) < 1 + with_store and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(1.5)  # the producer connects to its peers from their beacons
                go.set()
                n = int(args.rate * args.seconds)
                warm = int(args.rate * 0.5)
                got: list[float] = []
                deadline = time.monotonic() + args.seconds + 30
                with progress.bar(n, f"run {run}") as bar:
                    while len(got) < n and time.monotonic() < deadline:
                        record = consumer.poll(0.5)
                        if record is not None:
                            got.append((clock() - unpack(record.content)[0]) / 1e9)
                            if len(got) % 1000 == 0:
                                bar.update(1000)  # not per record: this loop is measured
                acks = result.get(timeout=60)
            finally:
                prod.join(30)
                consumer.close()
                done.set()
                store_stats = []
                if with_store:
                    try:
                        store_stats = stats.get(timeout=60)
                    except Exception:
                        pass
                    store.join(60)
                tower.close()
        run_delivery, run_ack = got[warm:], acks[warm:]
        for name, unit, (bounds, counts, total, count) in zip(
            ("store commit (fsync)", "store commit size", "store receipt->ACK"),
            (1000, 1, 1000),
            store_stats,
            strict=False,
        ):
            if count:
                p99 = _bucket_quantile(bounds, counts, 0.99) * unit
                print(f"run {run}: {name}: mean {total / count * unit:.1f}, p99 <= {p99:g} ({count} commits)")
        print(f"run {run}: delivery {_percentiles(run_delivery)}", flush=True)
        if with_store:
            print(f"run {run}: ACK      {_percentiles(run_ack)}", flush=True)
        if len(got) < n:
            print(f"run {run}: only {len(got)} of {n} records delivered", file=sys.stderr)
        delivery += run_delivery
        ack += run_ack
    sync = "no store" if args.no_store else "fsync off" if args.no_sync else "fsync on"
    if args.outbox:
        sync += f", outbox {args.outbox_sync}"
    print(f"latency at {args.rate:,} records/s of {args.size} bytes, {args.runs} runs ({sync}):")
    print(f"  producer -> consumer delivery: {_percentiles(delivery)}")
    if not args.no_store:
        print(f"  publish -> store ACK:          {_percentiles(ack)}")
    print(f"  bare pyzmq PUB -> SUB (floor): {_percentiles(_zmq_latency(args.rate, args.seconds, args.size))}")
    return {} if delivery and (ack or args.no_store) else {"latency": []}


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


def bench_embedded(args: argparse.Namespace) -> dict[str, list[float]]:
    """An app with one busy pure-Python thread embeds a Producer, then a Consumer.

    The store and the tower run in their own processes; the producer and the
    consumer run in this one, beside the busy thread or alone.  Reports
    records/s for both with and without the busy thread, and the ratio.
    """

    from dafka import fastio

    print(f"I/O implementation: {fastio.IMPLEMENTATION} ({fastio.REASON})", flush=True)
    series: dict[str, list[float]] = {}
    for run in range(args.runs):
        topic = f"bench-embedded-read-{run}"
        with _mesh_with_stored_topic(topic, args) as cfg:
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
    for what in ("produce", "consume"):
        alone, busy = series.get(f"{what} alone", []), series.get(f"{what} busy", [])
        if alone and busy and statistics.median(alone) > 0:
            ratio = statistics.median(busy) / statistics.median(alone)
            print(f"{what}: busy/alone ratio {ratio:.2f} (goal >= 0.4)", flush=True)
    return series


def _aio_rates(cfg: NodeConfig, topic: str, read_topic: str, args: argparse.Namespace) -> dict[str, float]:
    """Records/s of the threaded and the asyncio producer (acknowledged) and consumer, one record a call."""
    import asyncio

    from dafka import aio
    from dafka.consumer import Consumer
    from dafka.producer import Producer

    n, payload = args.records, b"x" * args.size
    rates: dict[str, float] = {}

    def settle(node: Any) -> None:
        deadline = time.monotonic() + 30
        while len(node.peers) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # subscriptions both ways

    with Producer(f"{topic}-sync", cfg, capacity=max(n, 1)) as producer:
        settle(producer)
        gc.collect()
        t0 = time.perf_counter()
        publish = producer.publish
        for _ in range(n):
            publish(payload)
        ok = producer.flush(300)
        rates["produce sync"] = n / (time.perf_counter() - t0) if ok else 0.0

    with Consumer(read_topic, cfg, offset_reset="earliest") as consumer:
        got, t0 = 0, 0.0
        end = time.monotonic() + 300
        for _ in consumer:
            if got == 0:
                t0 = time.perf_counter()  # from the first record: excludes discovery
            got += 1
            if got >= n or time.monotonic() > end:
                break
        rates["consume sync"] = (got - 1) / (time.perf_counter() - t0) if got == n else 0.0

    async def run_async() -> None:
        async with aio.Producer(f"{topic}-aio", cfg, capacity=max(n, 1)) as producer:
            await asyncio.to_thread(settle, producer.node)
            gc.collect()
            t0 = time.perf_counter()
            publish = producer.publish_nowait
            for i in range(n):
                publish(payload)
                if not i & 1023:
                    await asyncio.sleep(0)  # a task among others: let the loop turn
            ok = await producer.flush(300)
            rates["produce aio"] = n / (time.perf_counter() - t0) if ok else 0.0
        async with aio.Consumer(read_topic, cfg, offset_reset="earliest") as consumer:
            got, t0 = 0, 0.0
            end = time.monotonic() + 300
            async for _ in consumer:
                if got == 0:
                    t0 = time.perf_counter()
                got += 1
                if got >= n or time.monotonic() > end:
                    break
            rates["consume aio"] = (got - 1) / (time.perf_counter() - t0) if got == n else 0.0

    asyncio.run(run_async())
    return rates


def bench_aio(args: argparse.Namespace) -> dict[str, list[float]]:
    """dafka.aio beside the threaded API: one record a call, in this process.

    The tower and a store run in their own processes.  Producers publish one
    record a call (``publish`` / ``publish_nowait``) until all are acknowledged;
    consumers read a partition the store holds (``for`` / ``async for``).
    """


    series: dict[str, list[float]] = {}
    for run in range(args.runs):
        read_topic = f"bench-aio-read-{run}"
        with _mesh_with_stored_topic(read_topic, args) as cfg:
            rates = _aio_rates(cfg, f"bench-aio-{run}", read_topic, args)
        for name, rate in rates.items():
            series.setdefault(name, []).append(rate)
        figures = ", ".join(f"{k} {v:,.0f}/s" for k, v in rates.items())
        print(f"run {run}: {figures}", flush=True)
    for what in ("produce", "consume"):
        sync, asy = series.get(f"{what} sync", []), series.get(f"{what} aio", [])
        if sync and asy and statistics.median(sync) > 0:
            ratio = statistics.median(asy) / statistics.median(sync)
            print(f"{what}: aio/sync ratio {ratio:.2f} (goal >= 0.5)", flush=True)
    return series


def _spark_bench(args: argparse.Namespace) -> dict[str, list[float]]:
    from dafka.spark_bench import bench_spark  # pyspark is an extra: imported only here

    return bench_spark(args)


# ---------------------------------------------------------------- scale


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


def _scale_producers(cfg: NodeConfig, topic: str, n: int, seconds: float, go: Any, result: Any) -> None:
    """Host ``n`` producers; each publishes one record a second for ``seconds``;
    report (published, acked, ACK latencies)."""
    import logging

    import zmq

    from dafka.producer import Producer

    logging.getLogger("dafka").setLevel(logging.ERROR)
    # A producer holds about 10 ZeroMQ sockets (monitors' internal ends count
    # too); a context allows 1,023 by default.
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 16 * n + 64)
    producers = [Producer(topic, cfg, capacity=1000) for _ in range(n)]
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

    from dafka.consumer import Consumer

    n, procs = args.nodes, max(1, min(args.procs, args.nodes))
    ctx = mp.get_context("spawn")
    ports, tower_done = ctx.Queue(), ctx.Event()
    tower = ctx.Process(target=_tower_process, args=(ports, tower_done))
    tower.start()
    in_port, out_port = ports.get(timeout=60)
    cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", in_port, out_port),), bind="127.0.0.1")
    topic = f"bench-scale-{int(time.time())}"
    status = 0
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        ready, done = ctx.Event(), ctx.Event()
        store = ctx.Process(target=_store_process, args=(cfg, db, not args.no_sync, ready, done))
        store.start()
        ready.wait(60)
        go, result = ctx.Event(), ctx.Queue()
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        hosts = [ctx.Process(target=_scale_producers, args=(cfg, topic, k, args.seconds, go, result)) for k in shares]
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
        print(f"scale: {n} producers in {procs} processes up in {time.monotonic() - t_start:.1f}s", flush=True)
        pids = [p.pid for p in (*hosts, store)] + [__import__("os").getpid()]
        mesh_nodes = n + 2  # producers, the store, the consumer
        cpu0 = {p.pid: _proc_cpu(p.pid) for p in (*hosts, store, tower)}
        t0 = time.monotonic()
        go.set()
        time.sleep(min(args.seconds, 5.0) / 2)
        sockets = _tcp_sockets(pids)
        for _ in hosts:  # CPU over the publishing window (not the flush after it)
            result.get(timeout=args.seconds + 120)
        elapsed = time.monotonic() - t0
        cpu = {pid: _proc_cpu(pid) - c for pid, c in cpu0.items()}
        finished = [result.get(timeout=120) for _ in hosts]
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
    print(
        f"scale: N={n}: {sockets} TCP sockets ({sockets / mesh_nodes:.1f} per node); "
        f"producers' CPU {producers_cpu:.1%} ({producers_cpu / n:.3%} per producer); "
        f"store CPU {store_cpu:.1%}; tower CPU {tower_cpu:.1%}; "
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


BENCHMARKS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "zmq": bench_zmq,
    "ceiling": bench_ceiling,
    "live": bench_live,
    "store": bench_store,
    "replay": bench_replay,
    "tank": bench_tank,
    "kafka": bench_kafka,
    "kafka-group": bench_kafka_group,
    "embedded": bench_embedded,
    "aio": bench_aio,
    "scale": bench_scale,
    "spark": _spark_bench,
    "latency": bench_latency,
    "outbox": bench_outbox,
    "group": lambda args: bench_group_partitions(args) if args.partitions else bench_group(args),
}


GROUP_PARTITIONS = 6
GROUP_MEMBERS = 3


def _group_producers(cfg: NodeConfig, topic: str, per: int, size: int, started: Any, done: Any) -> None:
    """Six producers (threads of one process): a burst of ``per`` records each, then a steady trickle."""
    import threading

    from dafka.producer import Producer

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

    from dafka.consumer import Consumer

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


def _group_event(events: list[Any], wait: float, owned: list[int], counts: list[int], resumed: list[Any]) -> None:
    """Take the member reports that come within ``wait`` (from ``events``, their pipes) into the tallies."""
    from multiprocessing.connection import wait as ready

    if not events:
        time.sleep(wait)
        return
    for conn in ready(events, timeout=wait):
        try:
            event = conn.recv()
        except (EOFError, OSError):
            events.remove(conn)  # the member exited
            continue
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
    ports, tower_done = ctx.Queue(), ctx.Event()
    tower = ctx.Process(target=_tower_process, args=(ports, tower_done))
    tower.start()
    in_port, out_port = ports.get(timeout=60)
    cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", in_port, out_port),), bind="127.0.0.1")
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
        hosts = [ctx.Process(target=_scale_producers, args=(cfg, topic, k, seconds, go, result)) for k in shares]
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

    from dafka.consumer import Consumer

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
    from multiprocessing.connection import wait as ready

    if not events:
        time.sleep(wait)
        return
    for conn in ready(events, timeout=wait):
        try:
            event = conn.recv()
        except (EOFError, OSError):
            events.remove(conn)
            continue
        owned[event[1]], pending[event[1]] = event[2], event[3]


def main(args: argparse.Namespace) -> int:
    result = BENCHMARKS[args.which](args)
    if isinstance(result, int):
        return result  # reported its own figures
    series = result if isinstance(result, dict) else {args.which: result}
    status = 0
    for name, rates in series.items():
        if not rates:
            print(f"{name}: no successful run", file=sys.stderr)
            status = 1
            continue
        if name.endswith(" seconds"):
            print(f"{name[:-8]}: median {statistics.median(rates):.2f}s over {len(rates)} runs")
            continue
        print(
            f"{name}: median {statistics.median(rates):,.0f} records/s of {args.size}-byte records "
            f"over {len(rates)} runs"
        )
    return status
