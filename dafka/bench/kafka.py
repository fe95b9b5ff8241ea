"""``dafka bench kafka`` and ``kafka-group``: the Kafka gateway with a Kafka client; group failover."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

from dafka.bench.common import _mesh
from dafka.config import NodeConfig


def _kafka_gateway_process(cfg: NodeConfig, db: str, sync: bool, port: Any, done: Any) -> None:
    from dafka.kafka.gateway import KafkaGateway

    gateway = KafkaGateway(db, cfg, listen=("127.0.0.1", 0), kafka_listen=("127.0.0.1", 0), sync=sync)
    port.put(gateway.kafka_port)
    done.wait(900)
    gateway.close()


def _kafka_produce(port: int, topic: str, n: int, size: int, host: str = "127.0.0.1") -> float:
    """confluent-kafka (librdkafka) producing ``n`` records, acks=all: records/s acknowledged."""
    from confluent_kafka import Producer as KProducer

    # Delivery reports for failures only: flush() still waits for every ack,
    # but the client makes no Python callback per record (the Tank bench's
    # client has no per-record work at all).
    p = KProducer({
        "bootstrap.servers": f"{host}:{port}", "acks": "all", "linger.ms": 5,
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


#: Calls :func:`_kafka_client_alone` times at most: the queue it fills is never drained
#: (no broker), and librdkafka's has a bound (queue.buffering.max.kbytes, 2 GiB).
CLIENT_ALONE_CALLS = 1_000_000


def _kafka_client_alone(n: int, size: int) -> float:
    """The same ``produce()`` calls as :func:`_kafka_produce`, into librdkafka's queue with no
    broker behind it (nothing listens on port 1): calls/s, the most that client can produce on
    this machine whatever the gateway does.  ``n`` calls, at most :data:`CLIENT_ALONE_CALLS`."""
    from confluent_kafka import Producer as KProducer

    n = min(n, CLIENT_ALONE_CALLS)
    p = KProducer({
        "bootstrap.servers": "127.0.0.1:1", "acks": "all", "linger.ms": 5,
        "batch.size": 1 << 20, "queue.buffering.max.messages": n + 1,
        "queue.buffering.max.kbytes": 1 << 21, "enable.idempotence": False,
        "delivery.report.only.error": True, "log_level": 0,
    })
    payload = b"x" * size
    produce = p.produce

    def cb(_err: Any, _msg: Any) -> None:
        pass

    try:
        t0 = time.perf_counter()
        for _ in range(n):
            produce("bench-client-alone", payload, partition=0, on_delivery=cb)
        return n / (time.perf_counter() - t0)
    finally:
        p.purge()
        p.flush(0)


def _kafka_produce_raw(host: str, port: int, topic: str, n: int, size: int, per_batch: int = 1000,
                       inflight: int = 8) -> float:
    """Produce requests (v7, acks=all) of one ready-made batch of ``per_batch`` records each,
    ``inflight`` in flight on one connection: records/s acknowledged.  The batch is encoded
    once (the client does nothing per record), as the Tank bench's client sends bundles."""
    import socket
    import struct

    from kafka.protocol.producer import ProduceRequest, ProduceResponse

    from dafka.kafka.records import encode_batch
    from dafka.store.layout import VALUE_HEADER

    _create_topic(f"{host}:{port}", topic)
    now = int(time.time() * 1000)
    batch = encode_batch(0, [VALUE_HEADER.pack(now, 0) + b"x" * size] * per_batch)
    body = bytes(ProduceRequest[7](
        transactional_id=None, acks=-1, timeout_ms=30_000,
        topic_data=[ProduceRequest.TopicProduceData(name=topic, partition_data=[
            ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=batch)])],
    ).encode(version=7))
    requests = -(-n // per_batch)
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()

        def answer() -> None:
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise RuntimeError("the gateway closed the connection")
                buf.extend(chunk)
            size_ = struct.unpack_from(">i", buf)[0]
            frame = bytes(buf[4:4 + size_])
            del buf[:4 + size_]
            part = ProduceResponse.decode(frame[4:], version=7).responses[0].partition_responses[0]
            if part.error_code:
                raise RuntimeError(f"produce failed: error {part.error_code}")

        t0 = time.perf_counter()
        sent = done = 0
        while done < requests:
            while sent < requests and sent - done < inflight:
                head = struct.pack(">hhih", 0, 7, sent, 5) + b"bench"
                sock.sendall(struct.pack(">i", len(head) + len(body)) + head + body)
                sent += 1
            answer()
            done += 1
        elapsed = time.perf_counter() - t0
    return requests * per_batch / elapsed


KCAT_MISSING = "--client kcat: the kcat command is not installed (e.g. apt-get install kcat)"


def _kafka_produce_kcat(host: str, port: int, topic: str, n: int, size: int) -> float:
    """kcat (librdkafka in C, no Python per record) producing ``n`` records of ``size`` bytes
    read as lines of a file written beforehand, acks=all, to partition 0: records/s from its
    start to its exit (it exits once every record is acknowledged), its start included."""
    import os
    import resource
    import shutil
    import subprocess
    import tempfile

    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat is None:
        raise SystemExit(KCAT_MISSING)
    _create_topic(f"{host}:{port}", topic)
    with tempfile.NamedTemporaryFile(prefix="dafka-bench-kcat-", suffix=".txt") as f:
        line = b"x" * size + b"\n"
        left = n
        while left:
            k = min(left, 100_000)
            f.write(line * k)
            left -= k
        f.flush()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(
            [kcat, "-P", "-b", f"{host}:{port}", "-t", topic, "-p", "0", "-X", "acks=all", "-X", "linger.ms=5",
             "-X", "batch.size=1000000", "-X", "queue.buffering.max.messages=2000000",
             "-X", "queue.buffering.max.kbytes=2097151", "-l", f.name],
            capture_output=True, text=True, timeout=600, env=dict(os.environ, LC_ALL="C"),
        )
        elapsed = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or "ERROR" in done.stderr or "ailed" in done.stderr:
        raise RuntimeError(f"kcat failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    stored = _high_watermark(f"{host}:{port}", topic) - 1  # (the record that created the topic)
    if stored != n:
        raise RuntimeError(f"kcat exited, but {stored} of its {n} records are stored")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"kcat: {cpu / n * 1e9:.0f} ns of its own CPU a record", flush=True)
    return n / elapsed


def _high_watermark(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Consumer as KConsumer
    from confluent_kafka import TopicPartition

    c = KConsumer({"bootstrap.servers": bootstrap, "group.id": "bench-hwm", "enable.auto.commit": False})
    try:
        return int(c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)[1])
    finally:
        c.close()


def _create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka import Producer as KProducer

    p = KProducer({"bootstrap.servers": bootstrap, "acks": "all"})
    p.produce(topic, b"first", partition=0)
    if p.flush(30):
        raise RuntimeError(f"cannot create {topic} at {bootstrap}")


def _kafka_consume(port: int, topic: str, n: int, host: str = "127.0.0.1") -> float:
    """confluent-kafka consuming ``n`` records from offset 1 of partition 0: records/s."""
    from confluent_kafka import Consumer as KConsumer
    from confluent_kafka import TopicPartition

    # Like the Tank bench's client: connected before the clock starts, and
    # asking for the next range while the answer in hand is decoded.  (With
    # librdkafka's default fetch.queue.backoff.ms, 1 s, the prefetcher sleeps
    # a whole second whenever its queue is above queued.min.messages.)
    c = KConsumer({
        "bootstrap.servers": f"{host}:{port}", "group.id": "bench", "enable.auto.commit": False,
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
    """Through a Kafka gateway process (or ``--broker``): produce (acks=all) and consume with
    confluent-kafka, or produce ready-made batches (``--client raw``) or with kcat (``--client
    kcat``, when installed).  With confluent-kafka each run first times the same calls with no
    broker (``kafka client alone``): a produce rate near it is the client's limit, not the
    gateway's."""
    import shutil
    import tempfile

    if args.client == "kcat" and not (shutil.which("kcat") or shutil.which("kafkacat")):
        raise SystemExit(KCAT_MISSING)  # before a gateway is started
    ctx = mp.get_context("spawn")
    produce: list[float] = []
    consume: list[float] = []
    alone: list[float] = []  # confluent-kafka's calls with no broker: the client's own ceiling
    for run in range(args.runs):
        topic = f"bench-kafka-{int(time.time())}-{run}"
        if args.client == "confluent":
            alone.append(_kafka_client_alone(args.records, args.size))
            print(f"run {run}: kafka client alone (confluent, no broker) {alone[-1]:,.0f} produce() calls/s",
                  flush=True)
        if args.broker:
            host, _, port_s = args.broker.rpartition(":")
            produce.append(_kafka_run(host, int(port_s), topic, args, run, consume))
            continue
        tower, cfg = _mesh()
        with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
            port, done = ctx.Queue(), ctx.Event()
            gateway = ctx.Process(target=_kafka_gateway_process, args=(cfg, db, not args.no_sync, port, done))
            gateway.start()
            try:
                produce.append(_kafka_run("127.0.0.1", port.get(timeout=60), topic, args, run, consume))
            finally:
                done.set()
                gateway.join(60)
                tower.close()
    result = {"kafka produce": produce, "kafka consume": consume}
    if alone:
        result["kafka client alone"] = alone
    return result


def _kafka_run(host: str, port: int, topic: str, args: argparse.Namespace, run: int, consume: list[float]) -> float:
    if args.client == "raw":
        rate = _kafka_produce_raw(host, port, topic, args.records, args.size)
    elif args.client == "kcat":
        rate = _kafka_produce_kcat(host, port, topic, args.records, args.size)
    else:
        rate = _kafka_produce(port, topic, args.records, args.size, host)
    print(f"run {run}: kafka produce ({args.client}) {rate:,.0f} records/s acknowledged", flush=True)
    got = _kafka_consume(port, topic, args.records, host)
    consume.append(got)
    print(f"run {run}: kafka consume {got:,.0f} records/s", flush=True)
    return rate


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
