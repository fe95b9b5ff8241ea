"""``dafka consume``: print records, one per line (optionally as a group member, or as JSON)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

from dafka.cli.args import add_node_flags, count_arg, positive_seconds_arg, seconds_arg, topic_arg
from dafka.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    node_config,
    tower_names,
    unreached_towers,
)
from dafka.config import Settings
from dafka.errors import ConfigError, DafkaError


def cmd_consume(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.nodes.consumer import Consumer

    cfg = node_config(args, settings)
    if args.leaf:
        return _consume_leaf(args, cfg)
    if args.position:
        raise ConfigError("--position is a leaf reader's (with --leaf); a mesh consumer resumes with --group")
    start = parse_starts(args.start or [], args.topic)
    consumer = Consumer(
        args.topic,
        cfg,
        offset_reset="earliest" if args.from_beginning else "latest",
        start=start,
        group=args.group,
    )
    out = sys.stdout.buffer
    seen = 0
    start = time.monotonic()
    deadline = start + args.timeout if args.timeout else None
    # No record and no peer after this long: check the towers and say so
    # once, rather than wait in silence.
    note_at: float | None = start + min(3.0, max(1.0, cfg.beacon_timeout))
    unreached: list[str] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    from dafka.cli import progress

    # Records printed to the same terminal would tear the bar: only with stdout redirected.
    show = args.count is not None and progress.enabled() and not progress.enabled(sys.stdout)
    bar = progress.bar(args.count, f"consuming {' '.join(args.topic)}", show=show)
    commit_every = args.commit_interval if args.group and args.commit_interval > 0 else None
    next_commit = time.monotonic() + (commit_every or 0)
    commit_failure = ""  # the last commit error shown (each new one is shown once)
    interrupted = False
    undecodable = 0
    try:
        while not stop.is_set() and (args.count is None or seen < args.count):
            now = time.monotonic()
            wait = 0.5 if deadline is None else min(0.5, deadline - now)
            if wait <= 0:
                break
            if note_at is not None and now >= note_at:
                note_at = None
                if seen == 0 and len(consumer.peers) == 0:
                    unreached = unreached_towers(cfg.towers)
                    if len(unreached) == len(cfg.towers):
                        print(
                            f"note: no tower reached at {', '.join(unreached)}; still trying"
                            + ("" if deadline is not None else " (Ctrl-C to stop)"),
                            file=sys.stderr,
                            flush=True,
                        )
                    else:
                        unreached = []
            if commit_every is not None and time.monotonic() >= next_commit:
                # What was printed is flushed before its position is committed (at-least-once).
                out.flush()
                try:
                    consumer.commit(args.commit_timeout)
                    commit_failure = ""
                except DafkaError as exc:
                    if str(exc) != commit_failure:
                        commit_failure = str(exc)
                        print(f"warning: {exc}", file=sys.stderr, flush=True)
                    # Retried less often while it fails (each try waits for a store).
                    next_commit = time.monotonic() + max(commit_every, 5.0)
                    continue
                next_commit = time.monotonic() + commit_every
            record = consumer.poll(min(wait, commit_every or wait))
            if record is None:
                continue
            seen += 1
            bar.update()
            content = record.content
            if args.format == "json":
                line = _json_line(content)
                if line is None:
                    undecodable += 1
                    if undecodable <= 20 or undecodable % 1000 == 0:
                        print(
                            f"error: record {record.offset} of {record.topic}/{record.partition} is"
                            f" neither msgpack nor JSON; skipped ({undecodable} so far)",
                            file=sys.stderr,
                            flush=True,
                        )
                    continue
                content = line
            if args.verbose:
                out.write(f"{record.topic} {record.partition} {record.offset} ".encode())
            out.write(content + b"\n")
            if args.count is not None or seen % 1000 == 0:
                out.flush()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        out.flush()
        consumer.close()  # a group member commits what was printed and leaves
    if interrupted:
        if args.count is not None:
            print(f"error: interrupted after {seen} of {args.count} records", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.count is None and seen == 0 and len(consumer.peers) == 0:
        # Ended by --timeout or SIGTERM: a consumer that never reached the mesh failed, it did not "read nothing".
        unreached = unreached_towers(cfg.towers)
        if cfg.towers and len(unreached) == len(cfg.towers):
            ended = "stopped" if stop.is_set() else f"got 0 records within {args.timeout:g}s"
            print(f"error: {ended}: no tower reached at {', '.join(unreached)}", file=sys.stderr)
            return EXIT_FAILURE
    if args.count is not None and seen < args.count:
        hint = f" (no tower reached at {tower_names(cfg.towers)})" if unreached and len(consumer.peers) == 0 else ""
        if stop.is_set():
            print(f"error: stopped after {seen} of {args.count} records{hint}", file=sys.stderr)
        else:
            print(f"error: got {seen} of {args.count} records within {args.timeout:g}s{hint}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def _consume_leaf(args: argparse.Namespace, cfg: Any) -> int:
    """``dafka consume TOPIC --leaf HOST:PORT[,...]``: a leaf reader (one connection, no tower)."""
    from dafka.nodes.leafread import LeafConsumer

    if len(args.topic) != 1 or args.group or args.start:
        raise ConfigError("--leaf reads one topic, without --group or --start (its position: --position FILE)")
    consumer = LeafConsumer(
        args.topic[0], cfg, leaf=args.leaf, position=args.position,
        offset_reset="earliest" if args.from_beginning else "latest",
    )
    out = sys.stdout.buffer
    seen = 0
    deadline = time.monotonic() + args.timeout if args.timeout else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    interrupted = False
    try:
        while not stop.is_set() and (args.count is None or seen < args.count):
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                break
            for record in consumer.poll_batch(1 if args.count is not None else 1000, wait):
                seen += 1
                content = record.content
                if args.format == "json":
                    line = _json_line(content)
                    if line is None:
                        print(f"error: record {record.offset} of {record.topic}/{record.partition} is neither"
                              " msgpack nor JSON; skipped", file=sys.stderr, flush=True)
                        continue
                    content = line
                if args.verbose:
                    out.write(f"{record.topic} {record.partition} {record.offset} ".encode())
                out.write(content + b"\n")
            out.flush()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        out.flush()
        state = consumer.diagnose()
        consumer.close()  # what was printed is the position saved (--position)
    if interrupted:
        return EXIT_INTERRUPTED
    if args.count is not None and seen < args.count:
        print(f"error: got {seen} of {args.count} records ({state})", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def parse_starts(items: list[str], topics: list[str]) -> dict[tuple[str, str], int]:
    """``[TOPIC/]PARTITION=OFFSET`` items (a bare partition applies to every topic)."""
    starts: dict[tuple[str, str], int] = {}
    for item in items:
        where, sep, offset = item.rpartition("=")
        if not sep or not where or not offset.isdigit():
            raise ConfigError(f"--start {item!r}: expected [TOPIC/]PARTITION=OFFSET")
        topic, slash, partition = where.rpartition("/")
        for t in [topic] if slash else topics:
            starts[(t, partition)] = int(offset)
    return starts


def _json_line(content: bytes) -> bytes | None:
    """``consume --format json``: a record's content (msgpack, else JSON) as one JSON line; None if neither.

    Hostile content (nesting deeper than the decoders or the encoder take)
    counts as neither: it is reported, never a crash.
    """
    import msgpack

    try:
        value = msgpack.unpackb(content, raw=False, strict_map_key=False)
    except Exception:
        try:
            value = json.loads(content)
        except (ValueError, RecursionError):
            return None
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except RecursionError:
        return None
    except (TypeError, ValueError):
        try:
            text = json.dumps(_jsonable(value), ensure_ascii=False, separators=(",", ":"))
        except (RecursionError, TypeError, ValueError):
            return None
    return text.encode()


def _jsonable(value: Any) -> Any:
    """msgpack values JSON has no form for: bytes as text (undecodable bytes escaped),
    map keys as strings, NaN and extension types by their repr."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(_jsonable(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return repr(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("consume", help="print records, one per line")
    p.add_argument("topic", nargs="+", type=topic_arg)
    add_node_flags(p)
    p.add_argument("--from-beginning", action="store_true", help="start at offset 0 (earliest)")
    p.add_argument("--count", type=count_arg, help="exit after this many records")
    p.add_argument("--timeout", type=positive_seconds_arg, help="give up after this many seconds (default: never)")
    p.add_argument("-v", "--verbose", action="store_true", help="prefix topic, partition and offset")
    p.add_argument(
        "--format",
        choices=("bytes", "json"),
        default="bytes",
        help="bytes: contents as they are (default); json: decode msgpack (or JSON) records, print JSON lines",
    )
    p.add_argument(
        "--start",
        action="append",
        metavar="[TOPIC/]PARTITION=OFFSET",
        help="start this partition at OFFSET (repeatable; others follow --from-beginning or latest)",
    )
    p.add_argument("--group", help="consumer group: share partitions with its members, resume at its commits")
    p.add_argument(
        "--leaf", metavar="HOST:PORT[,HOST:PORT...]",
        help="be a leaf reader of one topic: one connection to a regional store's leaf port (the next one on"
        " failure), no tower",
    )
    p.add_argument(
        "--leaf-key", action="append", metavar="KEY|FILE",
        help="secure --leaf: an endpoint's public key or certificate (one per endpoint, or one for all)",
    )
    p.add_argument("--position", metavar="FILE", help="--leaf: keep the position in this file (a restart resumes there)")
    p.add_argument(
        "--commit-interval",
        type=seconds_arg,
        default=1.0,
        help="--group: seconds between commits of what was printed (0: only at exit; default 1)",
    )
    p.add_argument(
        "--commit-timeout", type=positive_seconds_arg, default=5.0, help="--group: seconds to wait for a store to confirm"
    )
