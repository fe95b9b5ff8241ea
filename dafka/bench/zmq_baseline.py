"""``dafka bench zmq``: the bare ZeroMQ PUB/SUB pair the mesh is measured against."""

from __future__ import annotations

import argparse
import time
from typing import Any

from dafka.bench.common import _bare_sub, _publish_to_receiver


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


def bench_zmq(args: argparse.Namespace) -> list[float]:
    """The ceiling: bare pyzmq PUB -> SUB of 2-frame messages, no protocol work."""
    import zmq

    from dafka.core import wire

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
