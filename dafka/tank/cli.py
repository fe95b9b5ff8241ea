"""``dafka tank ...``: a Tank client on the command line (for a gateway or a Tank broker).

    dafka tank create TOPIC [PARTITIONS]
    dafka tank produce TOPIC [-p N] [-k KEY] [MESSAGE ...]      (else one per stdin line)
    dafka tank consume TOPIC [-p N] [--from first|tail|SEQ] [--count N] [--follow] [-v]
    dafka tank topics | partitions TOPIC | status
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dafka.tank.client import TankClient, TankError
from dafka.tank.codec import UINT64_MAX

DEFAULT_BROKER = "127.0.0.1:11011"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tank", help="Tank client: talk to a dafka gateway (or a Tank broker)")
    p.add_argument("--broker", default=DEFAULT_BROKER, help=f"HOST:PORT (default {DEFAULT_BROKER})")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    tank = p.add_subparsers(dest="tank_command", required=True, metavar="ACTION")

    q = tank.add_parser("create", help="create a topic with gateway-owned partitions")
    q.add_argument("topic")
    q.add_argument("partitions", type=int, nargs="?", default=1)

    q = tank.add_parser("produce", help="publish messages (arguments, else stdin lines)")
    q.add_argument("topic")
    q.add_argument("messages", nargs="*")
    q.add_argument("-p", "--partition", type=int, default=0)
    q.add_argument("-k", "--key", help="key of every message")
    q.add_argument("--batch", type=int, default=1000, help="messages per produce request")

    q = tank.add_parser("consume", help="print messages, one per line")
    q.add_argument("topic")
    q.add_argument("-p", "--partition", type=int, default=0)
    q.add_argument("--from", dest="start", default="first", help="first, tail or a sequence number")
    q.add_argument("--count", type=int, help="stop after this many messages")
    q.add_argument("--follow", action="store_true", help="wait for new messages at the end")
    q.add_argument("-v", "--verbose", action="store_true", help="prefix seq, timestamp and key")

    tank.add_parser("topics", help="list topics")
    q = tank.add_parser("partitions", help="first and last sequence number of each partition")
    q.add_argument("topic")
    tank.add_parser("status", help="the broker's status")


def run(args: argparse.Namespace) -> int:
    host, _, port = args.broker.rpartition(":")
    try:
        with TankClient(host or "127.0.0.1", int(port), timeout=args.timeout) as client:
            return _ACTIONS[args.tank_command](client, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TankError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _create(client: TankClient, args: argparse.Namespace) -> int:
    client.create_topic(args.topic, args.partitions)
    print(f"created {args.topic} with {args.partitions} partitions")
    return 0


def _produce(client: TankClient, args: argparse.Namespace) -> int:
    lines = args.messages or (line.rstrip("\n") for line in sys.stdin)
    key = args.key.encode() if args.key is not None else None
    batch: list[Any] = []
    sent = 0
    for line in lines:
        batch.append(line.encode() if key is None else (key, line.encode()))
        if len(batch) >= args.batch:
            client.produce(args.topic, args.partition, batch)
            sent += len(batch)
            batch = []
    if batch:
        client.produce(args.topic, args.partition, batch)
        sent += len(batch)
    print(f"{sent} messages acknowledged", file=sys.stderr)
    return 0


def _consume(client: TankClient, args: argparse.Namespace) -> int:
    start = {"first": 0, "tail": UINT64_MAX}.get(args.start)
    seq = int(args.start) if start is None else start
    printed = 0
    out = sys.stdout.buffer
    while args.count is None or printed < args.count:
        wait = 1000 if args.follow else 0
        result = client.consume(args.topic, args.partition, seq, max_wait_ms=wait)
        if result.boundary_check:
            # Below what is kept: go to the first kept; past the end: go to the end.
            below = result.first_avail is not None and seq < result.first_avail
            seq = result.first_avail if below else (result.hwm or 0) + 1  # type: ignore[assignment]
            continue
        for s, ts, key, value in result.messages:
            if args.verbose:
                k = key.decode(errors="replace") if key is not None else "-"
                out.write(f"{s}\t{ts}\t{k}\t".encode())
            out.write(value + b"\n")
            printed += 1
            if args.count is not None and printed >= args.count:
                break
        out.flush()
        if result.messages:
            seq = result.next_seq
        elif not args.follow:
            break
    return 0


def _topics(client: TankClient, args: argparse.Namespace) -> int:
    for t in client.discover_topics():
        print(f"{t.name}\t{t.partitions} partitions")
    return 0


def _partitions(client: TankClient, args: argparse.Namespace) -> int:
    for pid, bounds in client.discover_partitions(args.topic).items():
        print(f"{pid}\tfirst {bounds.first_avail}\thwm {bounds.hwm}")
    return 0


def _status(client: TankClient, args: argparse.Namespace) -> int:
    s = client.status()
    print(f"version {s.version}, {s.topics} topics, {s.partitions} partitions, up since {s.startup_ts}")
    return 0


_ACTIONS = {
    "create": _create,
    "produce": _produce,
    "consume": _consume,
    "topics": _topics,
    "partitions": _partitions,
    "status": _status,
}
