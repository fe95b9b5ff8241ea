"""``dafka bench tank``: publish and fetch through the Tank gateway (records/s)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dafka.bench.common import _mesh, disk_mb_s, write_temp
from dafka.config import NodeConfig


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


def _tank_publish(port: int, topic: str, n: int, size: int, per_bundle: int, window: int,
                  host: str = "127.0.0.1") -> float:
    """Records/s acknowledged: ``window`` produce requests of one bundle each in flight."""
    from dafka.tank.client import TankClient
    from dafka.tank.messages import ProducePartition, ProduceRequest, ProduceResponse, ProduceTopic

    bundles = _tank_bundles(size, per_bundle)
    requests = n // per_bundle
    with TankClient(host, port, timeout=120) as client:
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


def _tank_fetch(port: int, topic: str, n: int, fetch_size: int, host: str = "127.0.0.1") -> float:
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

    with TankClient(host, port, timeout=120) as client:
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


@contextmanager
def _local_gateway(sync: bool) -> Iterator[int]:
    """A Tank gateway in a process of its own, on a tower of its own, over a temporary
    database: its Tank port."""
    ctx = mp.get_context("spawn")
    tower, cfg = _mesh()
    with tempfile.TemporaryDirectory(prefix="dafka-bench-") as db:
        port, done = ctx.Queue(), ctx.Event()
        gateway = ctx.Process(target=_gateway_process, args=(cfg, db, sync, port, done))
        gateway.start()
        try:
            yield port.get(timeout=60)
        finally:
            done.set()
            gateway.join(60)
            tower.close()


def _warm_page_cache(mb: int) -> None:
    """Write ``mb`` MB to a temporary file and delete it.

    On a VM whose freed memory goes back to the host (``virtio_balloon``), writes into the page
    cache are several times faster into memory freed just before than into memory not written
    recently (the TANK broker published 16-24M records/s against 3-6M; see "Issue 36's
    targets, quiet sitting" in docs/reference/performance.md).  Done before every run of a
    comparison, so that neither side gets the fast memory the other's run freed."""
    if mb > 0:
        write_temp(None, mb, sync=False)


def _compare(args: argparse.Namespace) -> dict[str, list[float]]:
    """``--against HOST:PORT``: publish to the broker there and to a gateway started here,
    alternating which goes first, each run after the same page-cache preparation."""
    import statistics

    host, _, port_text = args.against.rpartition(":")
    if not host or not port_text.isdigit():
        raise SystemExit(f"--against {args.against!r}: give HOST:PORT")
    broker: list[float] = []
    gateway: list[float] = []
    ratios: list[float] = []
    stamp = int(time.time())
    for run in range(args.runs):
        with _local_gateway(not args.no_sync) as local:
            sides = [("broker", host, int(port_text)), ("gateway", "127.0.0.1", local)]
            got: dict[str, float] = {}
            for name, h, p in sides if run % 2 == 0 else sides[::-1]:
                _warm_page_cache(args.warm_mb)
                got[name] = _tank_publish(p, f"bench-tank-{stamp}-{run}", args.records, args.size, 1000,
                                          args.window, h)
        broker.append(got["broker"])
        gateway.append(got["gateway"])
        ratios.append(got["gateway"] / got["broker"])
        print(f"run {run}: publish: broker {got['broker']:,.0f}, gateway {got['gateway']:,.0f} records/s"
              f" acknowledged: {ratios[-1]:.2f}x", flush=True)
    print(f"tank publish gateway/broker: median {statistics.median(ratios):.2f}x"
          f" ({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} runs")
    return {"tank publish (broker)": broker, "tank publish (gateway)": gateway}


def _share(record_bytes_per_s: float, disk: float | None) -> str:
    """``: N% of the disk's ...`` when the disk was measured (MB/s), else nothing."""
    if disk is None:
        return ""
    return (f": {record_bytes_per_s / 1e6 / disk:.0%} of the disk's {disk:,.0f} MB/s fdatasync'd,"
            " in record bytes")


def _synced_bound(records: int, size: int, window: int) -> float:
    """Records/s the same client publishes to a minimal store that syncs before it answers
    (:mod:`dafka.bench.synced`), its database where the gateway's goes."""
    from dafka.bench.synced import MinimalSyncedStore

    with MinimalSyncedStore(tempfile.gettempdir()) as store:
        rate = _tank_publish(store.port, "bound", records, size, 1000, window)
    if store.result is None or store.result.requests != records // 1000:
        raise RuntimeError(f"the minimal store answered {store.result} of {records // 1000} requests")
    return rate


def bench_tank(args: argparse.Namespace) -> dict[str, list[float]]:
    """Through a gateway process: publish (bundles of 1000, acknowledged) and fetch; or a
    running broker (``--broker``); or the two compared (``--against``)."""
    if getattr(args, "against", None):
        return _compare(args)
    publish, fetch = [], []
    if getattr(args, "broker", None):
        host, _, port_text = args.broker.rpartition(":")
        if not host or not port_text.isdigit():
            raise SystemExit(f"--broker {args.broker!r}: give HOST:PORT")
        stamp = int(time.time())
        for run in range(args.runs):
            topic = f"bench-tank-{stamp}-{run}"  # a new topic a run: a broker keeps what it was sent
            rate = _tank_publish(int(port_text), topic, args.records, args.size, 1000, getattr(args, "window", 8), host)
            publish.append(rate)
            print(f"run {run}: publish {rate:,.0f} records/s acknowledged ({args.broker})", flush=True)
            rate = _tank_fetch(int(port_text), topic, args.records // 1000 * 1000, 8 << 20, host)
            fetch.append(rate)
            print(f"run {run}: fetch {rate:,.0f} records/s ({args.broker})", flush=True)
        return {"tank publish": publish, "tank fetch": fetch}
    disk_mb = 0 if args.no_sync else getattr(args, "disk_mb", 0)
    bound = getattr(args, "bound", False)
    if bound and args.no_sync:
        raise SystemExit("--bound measures a store that syncs: not with --no-sync")
    window = getattr(args, "window", 8)
    shares: list[float] = []
    of_bound: list[float] = []
    for run in range(args.runs):
        # The disk is measured right before each run, where the gateway's database goes.
        disk = disk_mb_s(tempfile.gettempdir(), disk_mb) if disk_mb > 0 else None
        if bound:
            best = _synced_bound(args.records, args.size, window)
            print(f"run {run}: a minimal store that syncs before it answers (window {window}):"
                  f" {best:,.0f} records/s" + _share(best * args.size, disk), flush=True)
        with _local_gateway(not args.no_sync) as tank_port:
            topic = f"bench-tank-{run}"
            rate = _tank_publish(tank_port, topic, args.records, args.size, 1000, window)
            publish.append(rate)
            line = f"run {run}: publish {rate:,.0f} records/s acknowledged"
            if disk is not None:
                shares.append(rate * args.size / 1e6 / disk)
                line += _share(rate * args.size, disk)
            if bound:
                of_bound.append(rate / best)
                line += f"; {of_bound[-1]:.2f}x the minimal store"
            print(line, flush=True)
            rate = _tank_fetch(tank_port, topic, args.records // 1000 * 1000, 8 << 20)
            fetch.append(rate)
            print(f"run {run}: fetch {rate:,.0f} records/s", flush=True)
    import statistics

    if shares:
        print(f"tank publish / disk: median {statistics.median(shares):.0%}"
              f" ({min(shares):.0%}-{max(shares):.0%}) over {len(shares)} runs")
    if of_bound:
        print(f"tank publish / minimal synced store: median {statistics.median(of_bound):.2f}x"
              f" ({min(of_bound):.2f}-{max(of_bound):.2f}) over {len(of_bound)} runs")
    return {"tank publish": publish, "tank fetch": fetch}
