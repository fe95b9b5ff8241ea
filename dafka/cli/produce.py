"""``dafka produce``: publish one record per input line, as lines arrive (optionally through an edge outbox)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from dafka.cli.args import add_node_flags, count_arg, positive_seconds_arg, seconds_arg, topic_arg
from dafka.cli.common import EXIT_FAILURE, EXIT_INTERRUPTED, node_config, writable_dir
from dafka.config import Settings
from dafka.errors import DafkaError


def cmd_produce(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.nodes.producer import Producer

    cfg = node_config(args, settings)
    if args.identity:
        parent = os.path.dirname(os.path.abspath(args.identity))
        if os.path.isdir(args.identity):
            raise DafkaError(f"identity file {args.identity}: is a directory")
        if not os.path.isdir(parent):
            raise DafkaError(f"identity file {args.identity}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise DafkaError(f"identity file {args.identity}: directory {parent} is not writable")
    if args.leaf and args.no_ack:
        raise DafkaError("--leaf takes no --no-ack (its endpoint is a store)")
    source = open(args.file, "rb") if args.file else sys.stdin.buffer  # noqa: SIM115
    producer = Producer(
        args.topic,
        cfg,
        acks=not args.no_ack,
        **({"leaf": args.leaf} if args.leaf else {}),
        identity=args.identity,
        capacity=args.capacity,
        publish_timeout=args.timeout,
        resume="start_anyway" if args.start_anyway else "strict",
        resume_timeout=args.resume_timeout,
        **outbox_options(args),
    )
    interrupt = _FirstInterrupt()
    read = 0
    start = producer.next_offset
    try:
        if args.no_ack:
            # Without stores nobody keeps the records: give consumers a moment to connect.
            deadline = time.monotonic() + args.wait_peers
            while len(producer.peers) == 0 and time.monotonic() < deadline and not interrupt.stop.is_set():
                time.sleep(0.05)
        start = producer.next_offset
        from dafka.cli import progress
        from dafka.cli.lines import read_batches

        # A bar for a file (its size is known); stdin is often a live stream.
        size = os.path.getsize(args.file) if args.file else None
        show = None if args.file else False
        bad: list[int] = []
        with progress.bar(size, f"publishing {args.topic}", bytes_=True, show=show) as bar:
            # Lines go out as they arrive (`tail -f app.log | dafka produce logs`),
            # a few ms apart at most; fast input still goes in batches.
            for batch in read_batches(source.fileno(), interrupt.stop, time.monotonic, bar.update):
                first = read + 1
                read += len(batch)
                if args.format != "bytes":
                    batch = list(_encoded_lines(batch, args.format, bad, first))
                if batch:
                    producer.publish_many(batch)
        count = producer.next_offset - start
        if bad:
            print(
                f"error: {len(bad)} input lines are not JSON and were not published"
                f" (lines {', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''})",
                file=sys.stderr,
            )
        if interrupt.stop.is_set():
            return _produce_interrupted(producer, args, read, count, start, interrupt)
        if args.no_ack:
            time.sleep(args.linger)  # answer late FETCHes from the kept records
            producer.close(0)
            print(f"published {count} records (no acknowledgement requested)", file=sys.stderr)
            return EXIT_FAILURE if bad else 0
        if producer.close(args.timeout):
            print(f"published {count} records, all acknowledged", file=sys.stderr)
            return EXIT_FAILURE if bad else 0
        unacked = producer.next_offset - 1 - max(producer.acked_offset, start - 1)
        print(
            f"error: {unacked} of {count} records were not acknowledged by a store "
            f"within {args.timeout}s: {producer.diagnose()}"
            + (f" (they stay in the outbox {args.outbox} and go out when it is used again)" if args.outbox else ""),
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: stop now
        count = producer.next_offset - start
        print(_interrupted_line(producer, args, read, count, start), file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        interrupt.restore()
        if args.file:
            source.close()
        producer.close(0)


class _FirstInterrupt:
    """The first Ctrl-C sets ``stop`` (the command ends cleanly); a second one sets ``again``
    and, unless ``waiting``, raises KeyboardInterrupt.  While waiting for acknowledgements it
    raises nothing: raised inside the producer's wait (a lock held by the main thread while
    its I/O thread needs it), it left ``close`` waiting for good (the test of a second Ctrl-C
    timed out once in the whole suite)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.again = threading.Event()
        self.waiting = False
        self._before = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.stop.is_set():
            self.again.set()
            if not self.waiting:
                raise KeyboardInterrupt
            return
        self.stop.set()

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._before)


def _interrupted_line(producer: Any, args: argparse.Namespace, read: int, count: int, start: int) -> str:
    """``interrupted: N lines read, M published, K acknowledged`` (an error line if some are not)."""
    head = f"interrupted: {read} lines read, {count} published"
    if args.no_ack:
        return f"{head} (no acknowledgement requested)"
    acked = max(0, min(producer.acked_offset, producer.next_offset - 1) - (start - 1))
    if acked >= count:
        return f"{head}, {acked} acknowledged"
    kept = f"; they stay in the outbox {args.outbox}" if args.outbox else ""
    return f"error: {head}, {acked} acknowledged ({count - acked} not{kept})"


def _produce_interrupted(producer: Any, args: argparse.Namespace, read: int, count: int, start: int,
                         interrupt: _FirstInterrupt) -> int:
    """After a Ctrl-C: wait up to ``--timeout`` for what was published (a second Ctrl-C ends
    the wait), then say what came of the lines."""
    if not args.no_ack and producer.acked_offset < producer.next_offset - 1:
        waiting = producer.next_offset - 1 - max(producer.acked_offset, start - 1)
        interrupt.waiting = True
        print(
            f"interrupted: waiting up to {args.timeout:g}s for {waiting} acknowledgements (Ctrl-C again to stop now)",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + args.timeout
        # In slices: the second Ctrl-C is seen between them (see _FirstInterrupt).
        while not interrupt.again.is_set():
            step = min(0.1, deadline - time.monotonic())
            if step <= 0:
                break
            began = time.monotonic()
            if producer.flush(step) or time.monotonic() - began < step / 2:
                break  # all acknowledged, or the producer failed (flush answers False at once)
    print(_interrupted_line(producer, args, read, count, start), file=sys.stderr)
    return EXIT_INTERRUPTED


def _encoded_lines(lines: Iterable[bytes], fmt: str, bad: list[int], first: int = 1) -> Iterator[bytes]:
    """``produce --format``: each JSON input line as ``fmt`` (blank lines skipped; others
    that are not JSON are reported once each and their line numbers added to ``bad``)."""
    from dafka import values

    encode = values.serializer(fmt)
    assert encode is not None
    for number, line in enumerate(lines, first):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            bad.append(number)
            if len(bad) <= 20:
                print(f"error: line {number} is not JSON ({exc}); not published", file=sys.stderr)
            continue
        yield encode(value)


def outbox_options(args: argparse.Namespace) -> dict[str, Any]:
    """``dafka produce --outbox DIR ...`` as Producer keyword arguments."""
    if not args.outbox:
        return {}
    if args.no_ack:
        raise DafkaError("--outbox needs acknowledgements: it keeps records until a store has them")
    return {
        "outbox": writable_dir(args.outbox, "outbox directory"),
        "outbox_max_bytes": args.outbox_max_bytes,
        "outbox_max_age": args.outbox_max_age,
        "outbox_sync": args.outbox_sync,
        "outbox_policy": args.outbox_policy,
    }


def add_parser(sub: Any) -> None:
    p = sub.add_parser("produce", help="publish one record per input line, as lines arrive")
    p.add_argument("topic", type=topic_arg)
    add_node_flags(p)
    p.add_argument("--file", help="read records from this file instead of stdin")
    p.add_argument("--timeout", type=positive_seconds_arg, default=30.0, help="seconds to wait for acknowledgements")
    p.add_argument("--no-ack", action="store_true", help="do not wait for a store (none running)")
    p.add_argument("--identity", help="persistent producer identity file (continue a partition)")
    p.add_argument(
        "--start-anyway",
        action="store_true",
        help="--identity: continue even if no store tells the partition's head (may overwrite)",
    )
    p.add_argument(
        "--resume-timeout", type=seconds_arg, default=5.0, help="--identity: seconds to wait for the stores' head"
    )
    p.add_argument("--capacity", type=count_arg, default=1_000_000, help="max unacknowledged records")
    p.add_argument(
        "--leaf", metavar="HOST:PORT[,HOST:PORT...]",
        help="be a leaf: one connection to a regional store's leaf port (the next one on failure), no tower",
    )
    p.add_argument(
        "--leaf-key", action="append", metavar="KEY|FILE",
        help="secure --leaf: an endpoint's (store's) public key or certificate (repeatable: one per endpoint,"
        " or one for all; or [security] leaf_keys)",
    )
    p.add_argument("--outbox", metavar="DIR", help="keep records in this local outbox until a store acknowledges them")
    p.add_argument("--outbox-max-bytes", type=count_arg, help="--outbox: most bytes kept")
    p.add_argument("--outbox-max-age", type=positive_seconds_arg, help="--outbox: oldest record kept, seconds")
    p.add_argument(
        "--outbox-sync", choices=["each", "batch"], default="each",
        help="--outbox: each (publish waits for the fsync) or batch (durable within the next group commit)",
    )
    p.add_argument(
        "--outbox-policy", choices=["block", "drop_oldest"], default="block",
        help="--outbox: at a limit, block (then fail) or evict the oldest unacknowledged records",
    )
    p.add_argument("--wait-peers", type=seconds_arg, default=2.0, help="--no-ack: seconds to wait for a peer")
    p.add_argument("--linger", type=seconds_arg, default=1.0, help="--no-ack: seconds to serve FETCHes after the last record")
    p.add_argument(
        "--format",
        choices=("bytes", "msgpack", "json"),
        default="bytes",
        help="bytes: each line as it is (default); msgpack / json: each line is JSON, published in that encoding",
    )
