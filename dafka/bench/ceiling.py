"""``dafka bench ceiling``: a PUB/SUB pair doing a consumer's per-record work, without a node."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from dafka.bench.common import _bare_sub, _publish_to_receiver


def _ceiling_receiver(port: int, n: int, ready: Any, result: Any, curve: tuple[bytes, bytes, bytes] | None) -> None:
    import zmq

    from dafka import fastio
    from dafka.core import wire
    from dafka.core.gaps import PartitionTracker
    from dafka.nodes.consumed import ConsumerRecord
    from dafka.nodes.node import DRAIN

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

    from dafka import fastio
    from dafka.core import wire
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
