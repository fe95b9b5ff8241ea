"""The ``dafka`` command line.

Sub-commands: ``tower``, ``produce``, ``consume``, ``up`` (the services of
``make run``), ``bench``, and the store/gateway commands when available.
Tower addresses come from ``--tower`` (repeatable, or comma-separated), the
TOML file of ``--config`` / ``$DAFKA_CONFIG``, or ``$DAFKA_TOWERS``; with none
of them the tower on 127.0.0.1 is used.

Errors a user can act on (bad option values, paths, addresses, missing peers)
print one ``error: ...`` line on stderr, no traceback.  Exit codes: 0 done,
1 runtime failure, 2 usage or configuration error, 130 interrupted (Ctrl-C),
141 the reader of stdout went away.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dafka.config import (
    NodeConfig,
    Settings,
    TowerAddress,
    load_settings,
    parse_listen,
    parse_port,
    parse_towers,
)
from dafka.errors import ConfigError, DafkaError

log = logging.getLogger("dafka.cli")

if getattr(multiprocessing.current_process(), "_inheriting", False):
    # A process spawned by a command (the benchmarks' nodes) imports this
    # module first: Ctrl-C reaches the whole process group, and only the
    # parent handles it (it stops its children), so no child prints a
    # KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

Command = Callable[[argparse.Namespace, Settings], int]
_COMMANDS: dict[str, Command] = {}


def command(name: str) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        _COMMANDS[name] = fn
        return fn

    return register


EXIT_FAILURE = 1  # runtime failure (missing peer, unusable path, ...)
EXIT_USAGE = 2  # bad option value or configuration
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (128 + SIGPIPE)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_config(args: argparse.Namespace, settings: Settings) -> NodeConfig:
    cfg = settings.node
    if getattr(args, "tower", None):
        cfg = cfg.with_towers(",".join(args.tower))
    if getattr(args, "advertise", None) is not None:
        cfg = replace(cfg, advertise=args.advertise)
    if getattr(args, "bind", None):
        cfg = replace(cfg, bind=args.bind)
    elif cfg.bind in ("*", "0.0.0.0") and all(is_loopback(t.host) for t in cfg.towers):
        # Every tower is on this machine, so peers reach us as the tower sees
        # us: 127.0.0.1.  Binding every interface would only expose the node.
        if not cfg.advertise or is_loopback(cfg.advertise):
            cfg = replace(cfg, bind="127.0.0.1")
    return cfg


class StopSignals:
    """SIGINT/SIGTERM set a flag from now on (install before a service says it is up)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.got: list[int] = []
        signal.signal(signal.SIGINT, self._handler)
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.got.append(signum)
        self.stop.set()

    def wait(self) -> int:
        """Block until a signal came; the exit code to use."""
        while not self.stop.wait(0.5):
            pass
        # SIGTERM is how a service manager stops a service: a clean stop, 0.
        return EXIT_INTERRUPTED if self.got[:1] == [signal.SIGINT] else 0


def wait_for_signal(stop: threading.Event) -> int:
    """Block until SIGINT/SIGTERM (or ``stop`` is set); the exit code to use."""
    signals = StopSignals()
    signals.stop = stop
    return signals.wait()


def writable_dir(path: str | os.PathLike[str], what: str = "database directory") -> str:
    """Create ``path`` if needed and check it is a directory we may write; say what is wrong."""
    text = os.fspath(path)
    try:
        os.makedirs(text, exist_ok=True)
    except FileExistsError:
        raise DafkaError(f"{what} {text}: a file is in the way (not a directory)") from None
    except NotADirectoryError:
        raise DafkaError(f"{what} {text}: a file is in the way of one of its parent directories") from None
    except PermissionError:
        raise DafkaError(f"{what} {text}: permission denied (cannot create it)") from None
    except OSError as exc:
        raise DafkaError(f"{what} {text}: {exc.strerror or exc}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise DafkaError(f"{what} {text}: permission denied (not writable)")
    return text


def open_error(db: str, exc: Exception) -> DafkaError:
    """An LMDB failure to open ``db`` as an error line."""
    return DafkaError(f"cannot open the database in {db}: {exc}")


def tower_names(towers: tuple[TowerAddress, ...]) -> str:
    return ", ".join(f"{t.host}:{t.in_port}/{t.out_port}" for t in towers)


def unreached_towers(towers: tuple[TowerAddress, ...], timeout: float = 1.0) -> list[str]:
    """The towers nothing answers on (a plain TCP connect to their out port), with why."""
    out = []
    for t in towers:
        try:
            with socket.create_connection((t.host, t.out_port), timeout=timeout):
                pass
        except socket.gaierror:
            out.append(f"{t.host}:{t.in_port}/{t.out_port} (cannot resolve {t.host})")
        except OSError as exc:
            out.append(f"{t.host}:{t.in_port}/{t.out_port} ({exc.strerror or exc})")
    return out


# ---------------------------------------------------------------- tower


@command("tower")
def cmd_tower(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tower import Tower

    section = settings.section("tower")
    bind = args.bind or section.get("bind", "*")
    in_port = args.in_port if args.in_port is not None else parse_port(section.get("beacon_in_port", 5556))
    out_port = args.out_port if args.out_port is not None else parse_port(section.get("beacon_out_port", 5557))
    signals = StopSignals()
    with Tower(bind, in_port, out_port) as tower:
        print(f"tower up: beacons in tcp://{bind}:{tower.in_port}, out tcp://{bind}:{tower.out_port}", flush=True)
        return signals.wait()


# ---------------------------------------------------------------- produce


@command("produce")
def cmd_produce(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.producer import Producer

    cfg = node_config(args, settings)
    if args.identity:
        parent = os.path.dirname(os.path.abspath(args.identity))
        if os.path.isdir(args.identity):
            raise DafkaError(f"identity file {args.identity}: is a directory")
        if not os.path.isdir(parent):
            raise DafkaError(f"identity file {args.identity}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise DafkaError(f"identity file {args.identity}: directory {parent} is not writable")
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
    start = time.monotonic()
    deadline = start + args.timeout if args.timeout else None
    # No record and no peer after this long: check the towers and say so
    # once, rather than wait in silence.
    note_at: float | None = start + min(3.0, max(1.0, cfg.beacon_timeout))
    unreached: list[str] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    interrupted = False
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
        interrupted = True
    finally:
        out.flush()
        consumer.close()
    if interrupted:
        if args.count is not None:
            print(f"error: interrupted after {seen} of {args.count} records", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.count is not None and seen < args.count:
        hint = f" (no tower reached at {tower_names(cfg.towers)})" if unreached and len(consumer.peers) == 0 else ""
        if stop.is_set():
            print(f"error: stopped after {seen} of {args.count} records{hint}", file=sys.stderr)
        else:
            print(f"error: got {seen} of {args.count} records within {args.timeout:g}s{hint}", file=sys.stderr)
        return EXIT_FAILURE
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
        raise ConfigError(f"--db DIR (or [{name}] db) is required")
    writable_dir(db)
    sync = not args.no_sync and bool(section.get("sync", True))
    policy = retention_policy(section.get("retention", {}), args.retention_age, args.retention_bytes)
    return db, sync, policy


@command("store")
def cmd_store(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.store.node import Store

    db, sync, policy = storage_options(args, settings.section("store"), "store")
    signals = StopSignals()
    try:
        store = Store(db, node_config(args, settings), sync=sync, retention=policy)
    except lmdb.Error as exc:
        raise open_error(db, exc) from None
    with store:
        print(f"store up: {store.address} db {db} (sync={'on' if sync else 'OFF'})", flush=True)
        return signals.wait()


@command("gateway")
def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.tank.gateway import DEFAULT_PORT, Gateway

    section = settings.section("gateway")
    listen = args.listen or parse_listen(section.get("listen", f"127.0.0.1:{DEFAULT_PORT}"), DEFAULT_PORT)
    db, sync, policy = storage_options(args, section, "gateway")
    signals = StopSignals()
    try:
        gateway = Gateway(db, node_config(args, settings), listen=listen, sync=sync, retention=policy)
    except lmdb.Error as exc:
        raise open_error(db, exc) from None
    except OSError as exc:
        if exc.filename is not None:  # a file of the database, not the socket
            raise
        raise DafkaError(f"cannot listen on {listen[0]}:{listen[1]}: {exc.strerror or exc}") from None
    with gateway:
        print(
            f"gateway up: Tank on {listen[0]}:{gateway.tank_port}, store {gateway.address} db {db}"
            f" (sync={'on' if sync else 'OFF'})",
            flush=True,
        )
        return signals.wait()


@command("tank")
def cmd_tank(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tank import cli as tank_cli

    return tank_cli.run(args)


@command("topics")
def cmd_topics(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.store.db import RecordDB

    db = args.db or settings.section("store").get("db")
    if not db:
        raise ConfigError("--db DIR (or [store] db) is required")
    if not os.path.exists(db):
        raise DafkaError(f"{db}: no such directory")
    if not os.path.isdir(db):
        raise DafkaError(f"{db}: not a directory")
    if not os.path.exists(os.path.join(db, "data.mdb")):
        raise DafkaError(f"{db}: no store database here (no data.mdb); give the --db of a store or gateway")
    try:
        with RecordDB(db, readonly=True) as records:
            rows = records.partitions(args.topic)
    except lmdb.Error as exc:
        raise DafkaError(f"cannot read the database in {db}: {exc}") from None
    print(f"{'topic':<24} {'partition':<34} {'first':>12} {'last':>12} {'records':>12} {'bytes':>14}")
    for r in rows:
        print(f"{r.topic:<24} {r.partition:<34} {r.first:>12} {r.last:>12} {r.count:>12} {r.bytes:>14}")
    return 0


# ---------------------------------------------------------------- up


@command("up")
def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.services import Services

    writable_dir(args.data, "data directory")
    signals = StopSignals()
    with Services(settings, data_dir=args.data, bind=args.bind or "127.0.0.1") as services:
        for line in services.describe():
            print(line, flush=True)
        return signals.wait()


# ---------------------------------------------------------------- bench


@command("bench")
def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from dafka import bench

    try:
        return bench.main(args)
    except KeyboardInterrupt:
        # The children ignore Ctrl-C (see the top of this module): stop them.
        for child in multiprocessing.active_children():
            child.terminate()
        for child in multiprocessing.active_children():
            child.join(5)
        return EXIT_INTERRUPTED


# ---------------------------------------------------------------- parser

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line ``error: ...`` for usage errors (exit 2)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"error: {message} (see '{self.prog} --help')\n")


def _checked(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that turns ConfigError/ValueError into a usage error."""

    def check(text: str) -> Any:
        try:
            return parse(text)
        except (ConfigError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    check.__name__ = name
    return check


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"unknown log level {text!r}: use one of {', '.join(LOG_LEVELS)}")
    return level


def _host(text: str) -> str:
    if not text.strip() or any(c.isspace() for c in text):
        raise ValueError(f"bad host {text!r}: an interface name, an IP address or *")
    return text


def _towers(text: str) -> str:
    parse_towers(text)  # validate now; node_config parses again
    return text


def _topic(text: str) -> str:
    if not text or len(text.encode()) > 255 or "\x00" in text:
        raise ValueError(f"bad topic {text!r}: 1..255 bytes without NUL")
    return text


def _number(kind: type, minimum: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if value != value or value < minimum or value == float("inf"):
            raise ValueError(f"{text!r}: {what}")
        return value

    return parse


host_arg = _checked(_host, "host")
port_arg = _checked(lambda t: parse_port(t), "port")  # 0: any free port
towers_arg = _checked(_towers, "tower")
topic_arg = _checked(_topic, "topic")
log_level_arg = _checked(_log_level, "log level")
listen_arg = _checked(lambda t: parse_listen(t, 11011), "address")
seconds_arg = _checked(_number(float, 0.0, "must be 0 or more seconds"), "seconds")
positive_seconds_arg = _checked(_number(float, 1e-9, "must be more than 0 seconds"), "seconds")
count_arg = _checked(_number(int, 1, "must be 1 or more"), "count")


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tower",
        action="append",
        type=towers_arg,
        metavar="HOST[:IN[:OUT]]",
        help="tower to use (repeatable; default 127.0.0.1:5556:5557)",
    )
    p.add_argument(
        "--bind",
        type=host_arg,
        help="interface the node binds (default: 127.0.0.1 when every tower is on loopback, else all)",
    )
    p.add_argument("--advertise", help="host to announce in beacons (default: as the tower sees us)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dafka",
        description="Dafka: brokerless streaming over ZeroMQ",
        epilog="Exit codes: 0 done, 1 runtime failure (one 'error:' line on stderr), "
        "2 usage or configuration error, 130 interrupted (Ctrl-C), 141 stdout closed.",
    )
    parser.add_argument("--config", help="TOML config file (default: $DAFKA_CONFIG)")
    parser.add_argument(
        "--log-level", default="INFO", type=log_level_arg, help=", ".join(LOG_LEVELS) + " (default INFO)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("tower", help="run a tower (discovery service)")
    p.add_argument("--bind", type=host_arg, help="interface to bind (default *, or [tower] bind)")
    p.add_argument("--in-port", type=port_arg, help="beacons in (XSUB) port, default 5556 (0: any free port)")
    p.add_argument("--out-port", type=port_arg, help="beacons out (XPUB) port, default 5557 (0: any free port)")

    p = sub.add_parser("produce", help="publish one record per input line")
    p.add_argument("topic", type=topic_arg)
    _add_node_flags(p)
    p.add_argument("--file", help="read records from this file instead of stdin")
    p.add_argument("--timeout", type=positive_seconds_arg, default=30.0, help="seconds to wait for acknowledgements")
    p.add_argument("--no-ack", action="store_true", help="do not wait for a store (none running)")
    p.add_argument("--identity", help="persistent producer identity file (continue a partition)")
    p.add_argument("--capacity", type=count_arg, default=1_000_000, help="max unacknowledged records")
    p.add_argument("--wait-peers", type=seconds_arg, default=2.0, help="--no-ack: seconds to wait for a peer")
    p.add_argument("--linger", type=seconds_arg, default=1.0, help="--no-ack: seconds to serve FETCHes after the last record")

    p = sub.add_parser("consume", help="print records, one per line")
    p.add_argument("topic", nargs="+", type=topic_arg)
    _add_node_flags(p)
    p.add_argument("--from-beginning", action="store_true", help="start at offset 0 (earliest)")
    p.add_argument("--count", type=count_arg, help="exit after this many records")
    p.add_argument("--timeout", type=positive_seconds_arg, help="give up after this many seconds (default: never)")
    p.add_argument("-v", "--verbose", action="store_true", help="prefix topic, partition and offset")

    p = sub.add_parser("store", help="run a store (persists every record in LMDB)")
    _add_node_flags(p)
    p.add_argument("--db", help="LMDB directory (or [store] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE: acked data can be lost on power failure)")
    p.add_argument("--retention-age", type=positive_seconds_arg, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=count_arg, help="default retention: bytes to keep per topic")

    p = sub.add_parser("gateway", help="run a Tank-protocol gateway (also a full store)")
    _add_node_flags(p)
    p.add_argument("--listen", type=listen_arg, help="Tank address HOST:PORT (default 127.0.0.1:11011; port 0: any free port)")
    p.add_argument("--db", help="LMDB directory (or [gateway] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE)")
    p.add_argument("--retention-age", type=positive_seconds_arg, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=count_arg, help="default retention: bytes to keep per topic")

    from dafka.tank import cli as tank_cli

    tank_cli.add_parser(sub)

    p = sub.add_parser("topics", help="list topics and partitions of a store's database")
    p.add_argument("--db", help="LMDB directory of a store (read-only)")
    p.add_argument("topic", nargs="?", help="only this topic")

    p = sub.add_parser("up", help="run the main services (tower + store + gateway) on loopback")
    p.add_argument("--data", default="var", help="data directory (default ./var)")
    p.add_argument("--bind", type=host_arg, help="interface to bind (default 127.0.0.1)")

    p = sub.add_parser("bench", help="measure throughput")
    from dafka import bench

    bench.add_arguments(p)

    for extra in _EXTRA_PARSERS:
        extra(sub)
    return parser


_EXTRA_PARSERS: list[Callable[[Any], None]] = []


# zmq errnos of a bind/connect the user can fix (address in use, no such interface, ...).
_ADDRESS_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENODEV, errno.EACCES, errno.EINVAL}


def _error(message: object, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command.  Known failures become one ``error:`` line; bugs keep their traceback."""
    import zmq

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=getattr(logging, args.log_level),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        settings = load_settings(args.config)
        return _COMMANDS[args.command](args, settings)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dafka consume t | head`): quietly, as other
        # Unix tools do; stdout goes to /dev/null so the exit flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ConfigError as exc:
        return _error(exc, EXIT_USAGE)
    except DafkaError as exc:
        return _error(exc, EXIT_FAILURE)
    except zmq.ZMQError as exc:
        if exc.errno not in _ADDRESS_ERRNOS:
            raise
        hint = {
            errno.EADDRINUSE: " (is another process using that port?)",
            errno.ENODEV: " (bind takes an interface name, an IP address of this machine or *)",
            errno.EADDRNOTAVAIL: " (that address is not one of this machine's)",
        }.get(exc.errno, "")
        return _error(f"cannot bind: {exc}{hint}", EXIT_FAILURE)
    except OSError as exc:
        # A file or socket problem of this machine: name it, no traceback.
        if exc.filename is not None:
            return _error(f"{exc.filename}: {exc.strerror or exc}", EXIT_FAILURE)
        return _error(exc.strerror or exc, EXIT_FAILURE)


if __name__ == "__main__":
    sys.exit(main())
