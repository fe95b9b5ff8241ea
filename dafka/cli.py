"""The ``dafka`` command line.

Sub-commands: ``tower``, ``produce``, ``consume``, ``up`` (the services of
``make run``), ``bench``, and the store/gateway commands when available.
Tower addresses come from ``--tower`` (repeatable, or comma-separated), the
TOML file of ``--config`` / ``$DAFKA_CONFIG``, or ``$DAFKA_TOWERS``; with none
of them the tower on 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dafka.config import NodeConfig, Settings, load_settings, parse_listen
from dafka.errors import DafkaError

log = logging.getLogger("dafka.cli")

Command = Callable[[argparse.Namespace, Settings], int]
_COMMANDS: dict[str, Command] = {}


def command(name: str) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        _COMMANDS[name] = fn
        return fn

    return register


def node_config(args: argparse.Namespace, settings: Settings) -> NodeConfig:
    cfg = settings.node
    if getattr(args, "tower", None):
        cfg = cfg.with_towers(",".join(args.tower))
    if getattr(args, "bind", None):
        cfg = replace(cfg, bind=args.bind)
    if getattr(args, "advertise", None) is not None:
        cfg = replace(cfg, advertise=args.advertise)
    return cfg


def wait_for_signal(stop: threading.Event) -> None:
    """Block until SIGINT/SIGTERM (or ``stop`` is set)."""

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop.wait(0.5):
        pass


# ---------------------------------------------------------------- tower


@command("tower")
def cmd_tower(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tower import Tower

    section = settings.section("tower")
    bind = args.bind or section.get("bind", "*")
    in_port = args.in_port if args.in_port is not None else int(section.get("beacon_in_port", 5556))
    out_port = args.out_port if args.out_port is not None else int(section.get("beacon_out_port", 5557))
    with Tower(bind, in_port, out_port) as tower:
        print(f"tower up: beacons in tcp://{bind}:{tower.in_port}, out tcp://{bind}:{tower.out_port}", flush=True)
        wait_for_signal(threading.Event())
    return 0


# ---------------------------------------------------------------- produce


@command("produce")
def cmd_produce(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.producer import Producer

    cfg = node_config(args, settings)
    source = open(args.file, "rb") if args.file else sys.stdin.buffer  # noqa: SIM115
    producer = Producer(
        args.topic,
        cfg,
        acks=not args.no_ack,
        identity=args.identity,
        capacity=args.capacity,
        publish_timeout=args.timeout,
    )
    try:
        if args.no_ack:
            # Without stores nobody keeps the records: give consumers a moment to connect.
            deadline = time.monotonic() + args.wait_peers
            while len(producer.peers) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        start = producer.next_offset
        producer.publish_many(line.rstrip(b"\r\n") for line in source)
        count = producer.next_offset - start
        if args.no_ack:
            time.sleep(args.linger)  # answer late FETCHes from the kept records
            producer.close(0)
            print(f"published {count} records (no acknowledgement requested)", file=sys.stderr)
            return 0
        if producer.close(args.timeout):
            print(f"published {count} records, all acknowledged", file=sys.stderr)
            return 0
        unacked = producer.next_offset - 1 - max(producer.acked_offset, start - 1)
        print(
            f"error: {unacked} of {count} records were not acknowledged by a store "
            f"within {args.timeout}s (is a store running?)",
            file=sys.stderr,
        )
        return 1
    finally:
        if args.file:
            source.close()
        producer.close(0)


# ---------------------------------------------------------------- consume


@command("consume")
def cmd_consume(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.consumer import Consumer

    cfg = node_config(args, settings)
    consumer = Consumer(
        args.topic, cfg, offset_reset="earliest" if args.from_beginning else "latest"
    )
    out = sys.stdout.buffer
    seen = 0
    deadline = time.monotonic() + args.timeout if args.timeout else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set() and (args.count is None or seen < args.count):
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                break
            record = consumer.poll(wait)
            if record is None:
                continue
            seen += 1
            if args.verbose:
                out.write(f"{record.topic} {record.partition} {record.offset} ".encode())
            out.write(record.content + b"\n")
            if args.count is not None or seen % 1000 == 0:
                out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        out.flush()
        consumer.close()
    if args.count is not None and seen < args.count:
        print(f"error: got {seen} of {args.count} records within {args.timeout}s", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- store


def retention_policy(section: dict[str, Any], age: float | None = None, size: int | None = None) -> Any:
    """[store.retention] max_age_s / max_bytes, plus [store.retention.topics.NAME]."""
    from dafka.store.db import Retention, RetentionPolicy

    def one(d: dict[str, Any]) -> Retention:
        max_age = d.get("max_age_s")
        return Retention(
            None if max_age is None else int(float(max_age) * 1000),
            None if d.get("max_bytes") is None else int(d["max_bytes"]),
        )

    default = one(section)
    if age is not None:
        default = default._replace(max_age_ms=int(age * 1000))
    if size is not None:
        default = default._replace(max_bytes=size)
    topics = {name: one(d) for name, d in section.get("topics", {}).items()}
    return RetentionPolicy(default=default, topics=topics)


def storage_options(args: argparse.Namespace, section: dict[str, Any], name: str) -> tuple[str, bool, Any]:
    """``(db, sync, retention policy)`` of a store or gateway, from its flags and [name] section."""
    db = args.db or section.get("db")
    if not db:
        raise DafkaError(f"--db DIR (or [{name}] db) is required")
    sync = not args.no_sync and bool(section.get("sync", True))
    policy = retention_policy(section.get("retention", {}), args.retention_age, args.retention_bytes)
    return db, sync, policy


@command("store")
def cmd_store(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.store.node import Store

    db, sync, policy = storage_options(args, settings.section("store"), "store")
    with Store(db, node_config(args, settings), sync=sync, retention=policy) as store:
        print(f"store up: {store.address} db {db} (sync={'on' if sync else 'OFF'})", flush=True)
        wait_for_signal(threading.Event())
    return 0


@command("gateway")
def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tank.gateway import DEFAULT_PORT, Gateway

    section = settings.section("gateway")
    db, sync, policy = storage_options(args, section, "gateway")
    listen = parse_listen(args.listen or section.get("listen", f"127.0.0.1:{DEFAULT_PORT}"), DEFAULT_PORT)
    try:
        gateway = Gateway(db, node_config(args, settings), listen=listen, sync=sync, retention=policy)
    except OSError as exc:
        print(f"error: cannot listen on {listen[0]}:{listen[1]}: {exc}", file=sys.stderr)
        return 2
    with gateway:
        print(
            f"gateway up: Tank on {listen[0]}:{gateway.tank_port}, store {gateway.address} db {db}"
            f" (sync={'on' if sync else 'OFF'})",
            flush=True,
        )
        wait_for_signal(threading.Event())
    return 0


@command("tank")
def cmd_tank(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tank import cli as tank_cli

    return tank_cli.run(args)


@command("topics")
def cmd_topics(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.store.db import RecordDB

    db = args.db or settings.section("store").get("db")
    if not db:
        print("error: --db DIR is required", file=sys.stderr)
        return 2
    with RecordDB(db, readonly=True) as records:
        rows = records.partitions(args.topic)
    print(f"{'topic':<24} {'partition':<34} {'first':>12} {'last':>12} {'records':>12} {'bytes':>14}")
    for r in rows:
        print(f"{r.topic:<24} {r.partition:<34} {r.first:>12} {r.last:>12} {r.count:>12} {r.bytes:>14}")
    return 0


# ---------------------------------------------------------------- up


@command("up")
def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.services import Services

    with Services(settings, data_dir=args.data, bind=args.bind or "127.0.0.1") as services:
        for line in services.describe():
            print(line, flush=True)
        wait_for_signal(threading.Event())
    return 0


# ---------------------------------------------------------------- doctor


@command("doctor")
def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    from dafka import fastio

    print(fastio.describe())
    return 0


# ---------------------------------------------------------------- bench


@command("bench")
def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from dafka import bench

    return bench.main(args)


# ---------------------------------------------------------------- parser


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tower",
        action="append",
        metavar="HOST[:IN[:OUT]]",
        help="tower to use (repeatable; default 127.0.0.1:5556:5557)",
    )
    p.add_argument("--bind", help="interface the node binds (default: all)")
    p.add_argument("--advertise", help="host to announce in beacons (default: as the tower sees us)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dafka", description="Dafka: brokerless streaming over ZeroMQ")
    parser.add_argument("--config", help="TOML config file (default: $DAFKA_CONFIG)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action=_Version, help="version and I/O implementation, then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("tower", help="run a tower (discovery service)")
    p.add_argument("--bind", help="interface to bind (default *, or [tower] bind)")
    p.add_argument("--in-port", type=int, help="beacons in (XSUB) port, default 5556")
    p.add_argument("--out-port", type=int, help="beacons out (XPUB) port, default 5557")

    p = sub.add_parser("produce", help="publish one record per input line")
    p.add_argument("topic")
    _add_node_flags(p)
    p.add_argument("--file", help="read records from this file instead of stdin")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for acknowledgements")
    p.add_argument("--no-ack", action="store_true", help="do not wait for a store (none running)")
    p.add_argument("--identity", help="persistent producer identity file (continue a partition)")
    p.add_argument("--capacity", type=int, default=1_000_000, help="max unacknowledged records")
    p.add_argument("--wait-peers", type=float, default=2.0, help="--no-ack: seconds to wait for a peer")
    p.add_argument("--linger", type=float, default=1.0, help="--no-ack: seconds to serve FETCHes after the last record")

    p = sub.add_parser("consume", help="print records, one per line")
    p.add_argument("topic", nargs="+")
    _add_node_flags(p)
    p.add_argument("--from-beginning", action="store_true", help="start at offset 0 (earliest)")
    p.add_argument("--count", type=int, help="exit after this many records")
    p.add_argument("--timeout", type=float, help="give up after this many seconds")
    p.add_argument("-v", "--verbose", action="store_true", help="prefix topic, partition and offset")

    p = sub.add_parser("store", help="run a store (persists every record in LMDB)")
    _add_node_flags(p)
    p.add_argument("--db", help="LMDB directory (or [store] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE: acked data can be lost on power failure)")
    p.add_argument("--retention-age", type=float, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=int, help="default retention: bytes to keep per topic")

    p = sub.add_parser("gateway", help="run a Tank-protocol gateway (also a full store)")
    _add_node_flags(p)
    p.add_argument("--listen", help="Tank address HOST:PORT (default 127.0.0.1:11011)")
    p.add_argument("--db", help="LMDB directory (or [gateway] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE)")
    p.add_argument("--retention-age", type=float, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=int, help="default retention: bytes to keep per topic")

    from dafka.tank import cli as tank_cli

    tank_cli.add_parser(sub)

    p = sub.add_parser("topics", help="list topics and partitions of a store's database")
    p.add_argument("--db", help="LMDB directory of a store (read-only)")
    p.add_argument("topic", nargs="?", help="only this topic")

    p = sub.add_parser("up", help="run the main services (tower + store + gateway) on loopback")
    p.add_argument("--data", default="var", help="data directory (default ./var)")
    p.add_argument("--bind", help="interface to bind (default 127.0.0.1)")

    p = sub.add_parser("bench", help="measure throughput")
    from dafka import bench

    bench.add_arguments(p)

    sub.add_parser("doctor", help="say which I/O implementation is active and why")

    for extra in _EXTRA_PARSERS:
        extra(sub)
    return parser


class _Version(argparse.Action):
    """``--version``: imported only when asked (binding the I/O extension takes a moment)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        from dafka import fastio

        try:
            v = version("dafka")
        except PackageNotFoundError:
            v = "(not installed)"
        print(f"dafka {v}\n{fastio.describe()}")
        parser.exit()


_EXTRA_PARSERS: list[Callable[[Any], None]] = []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = load_settings(args.config)
        return _COMMANDS[args.command](args, settings)
    except DafkaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
