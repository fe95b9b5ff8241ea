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
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from dafka.config import (
    NodeConfig,
    Settings,
    TowerAddress,
    is_loopback,
    load_settings,
    loopback_trap,
    parse_listen,
    parse_max_record_bytes,
    parse_port,
    parse_topic,
    parse_towers,
    shorten,
)
from dafka.errors import ConfigError, DafkaError, ResumeError
from dafka.nodes.security import SecurityConfig, security_from

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
EXIT_NOT_STARTED = 2  # produce: refused to start publishing (ResumeError), nothing was sent
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (128 + SIGPIPE)


def node_config(args: argparse.Namespace, settings: Settings) -> NodeConfig:
    cfg = settings.node
    if getattr(args, "tower", None):
        cfg = cfg.with_towers(",".join(args.tower))
    if getattr(args, "advertise", None) is not None:
        cfg = replace(cfg, advertise=args.advertise)
    if getattr(args, "max_record_bytes", None) is not None:
        cfg = replace(cfg, max_record_bytes=parse_max_record_bytes(args.max_record_bytes))
    if getattr(args, "bind", None):
        cfg = replace(cfg, bind=args.bind)
    elif cfg.bind in ("*", "0.0.0.0") and all(is_loopback(t.host) for t in cfg.towers):
        # Every tower is on this machine, so peers reach us as the tower sees
        # us: 127.0.0.1.  Binding every interface would only expose the node.
        if not cfg.advertise or is_loopback(cfg.advertise):
            cfg = replace(cfg, bind="127.0.0.1")
    sec = security_config(args, settings)
    if sec is not None:
        cfg = replace(cfg, security=sec)
    return cfg


def security_config(args: argparse.Namespace, settings: Settings) -> SecurityConfig | None:
    """[security] of the config file overridden by --key / --allow / --tower-key."""
    tower_keys = getattr(args, "tower_key", None)
    flags = {
        "key": getattr(args, "key", None),
        "allow": getattr(args, "allow", None),
        "tower_keys": ",".join(tower_keys) if tower_keys else None,
    }
    return security_from(settings.section("security"), flags)


def service_bind(args: argparse.Namespace, given: str | None, secure: bool, what: str) -> str:
    """Where a service binds: loopback unless told otherwise (all interfaces when secure).

    Safe by default: binding beyond loopback without security needs --insecure.
    """
    bind = given or ("*" if secure else "127.0.0.1")
    if not secure and not is_loopback(bind) and not getattr(args, "insecure", False):
        raise ConfigError(
            f"the {what} would bind {bind} without security: anyone who reaches it could join the mesh, "
            "read every topic and forge ACKs. Configure [security] (--key/--allow, see `dafka keys`), "
            "bind 127.0.0.1, or pass --insecure"
        )
    return bind


def service_node_config(args: argparse.Namespace, settings: Settings, what: str) -> NodeConfig:
    """node_config of a store or gateway, with its bind checked by service_bind."""
    cfg = node_config(args, settings)
    given = args.bind or (cfg.bind if "bind" in settings.node_keys else None)
    cfg = replace(cfg, bind=service_bind(args, given, cfg.security is not None, what))
    trap = loopback_trap(cfg, cfg.bind, what)  # at once, before anything starts (Node checks again)
    if trap:
        raise ConfigError(trap)
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
    from dafka.nodes.tower import Tower

    section = settings.section("tower")
    sec = security_config(args, settings)
    bind = service_bind(args, args.bind or section.get("bind"), sec is not None, "tower")
    in_port = args.in_port if args.in_port is not None else parse_port(section.get("beacon_in_port", 5556))
    out_port = args.out_port if args.out_port is not None else parse_port(section.get("beacon_out_port", 5557))
    if in_port == out_port and in_port != 0:
        raise ConfigError(
            f"--in-port and --out-port must differ (both {in_port}): beacons come in on one and go out on the other"
        )
    signals = StopSignals()
    with Tower(bind, in_port, out_port, sec) as tower:
        mode = " (secure)" if sec else ""
        print(f"tower up: beacons in tcp://{bind}:{tower.in_port}, out tcp://{bind}:{tower.out_port}{mode}", flush=True)
        server = serve_metrics(args, section, tower)
        try:
            return signals.wait()
        finally:
            if server is not None:
                server.close()


def serve_metrics(args: argparse.Namespace, section: dict[str, Any], service: Any) -> Any:
    """Start the service's Prometheus endpoint if ``--metrics`` (or ``metrics =``) asks for one."""
    listen = getattr(args, "metrics", None) or section.get("metrics")
    if not listen:
        return None
    from dafka.nodes import metrics

    host, port = parse_listen(listen, 9100)
    try:
        server = metrics.serve(service, host, port)
    except OSError as exc:
        raise DafkaError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    print(f"metrics on http://{host}:{server.port}/metrics", flush=True)
    if hasattr(service, "metrics_server"):
        service.metrics_server = server  # the node closes it when it stops
    return server


# ---------------------------------------------------------------- doctor


@command("doctor")
def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    """The I/O implementation; with a tower named, whether a node started here reaches the mesh and is reached."""
    from dafka import fastio
    from dafka.cli import doctor
    print(fastio.describe(), flush=True)
    if not (args.tower or os.environ.get("DAFKA_TOWERS") or "towers" in settings.node_keys):
        print("mesh not checked: name a tower (--tower HOST, $DAFKA_TOWERS or [node] towers)")
        return 0
    cfg = node_config(args, settings)
    unreached = unreached_towers(cfg.towers)
    passed = doctor.check(cfg, args.wait, lambda line: print(line, flush=True), unreached)
    return 0 if passed else EXIT_FAILURE


# ---------------------------------------------------------------- produce


@command("produce")
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
    if args.leaf and (args.no_ack or args.outbox):
        raise DafkaError("--leaf takes neither --no-ack (its endpoint is a store) nor --outbox (not built yet)")
    source = open(args.file, "rb") if args.file else sys.stdin.buffer  # noqa: SIM115
    producer = Producer(
        args.topic,
        cfg,
        **({"leaf": args.leaf} if args.leaf else {}),
        acks=not args.no_ack,
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
            return _produce_interrupted(producer, args, read, count, start)
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
    """The first Ctrl-C sets ``stop`` (the command ends cleanly); a second one raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._before = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt
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


def _produce_interrupted(producer: Any, args: argparse.Namespace, read: int, count: int, start: int) -> int:
    """After a Ctrl-C: wait up to ``--timeout`` for what was published, then say what came of the lines."""
    if not args.no_ack and producer.acked_offset < producer.next_offset - 1:
        waiting = producer.next_offset - 1 - max(producer.acked_offset, start - 1)
        print(
            f"interrupted: waiting up to {args.timeout:g}s for {waiting} acknowledgements (Ctrl-C again to stop now)",
            file=sys.stderr,
            flush=True,
        )
        producer.flush(args.timeout)
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


@command("outbox")
def cmd_outbox(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from dafka.outbox import describe

    info = describe(args.dir, show=args.show)
    if args.json:
        print(json.dumps(info))
        return 0
    age = "-" if info["oldest_age"] is None else f"{info['oldest_age']:.1f}s"
    print(f"outbox {info['path']}")
    print(f"  topic      {info['topic'] or '(unused)'}")
    print(f"  partition  {info['partition'] or '(unused)'}")
    if info["records"]:
        print(f"  offsets    {info['first']}..{info['next'] - 1} unacknowledged (next {info['next']})")
    else:
        print(f"  offsets    none unacknowledged (next {info['next']})")
    print(f"  records    {info['records']}  bytes {info['bytes']}  oldest {age}")
    for r in info["shown"]:
        print(f"  {r['offset']:>10}  {r['content']}")
    return 0


# ---------------------------------------------------------------- consume


@command("consume")
def cmd_consume(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.nodes.consumer import Consumer

    cfg = node_config(args, settings)
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

    from dafka.store.node import Store, linger_setting

    db, sync, policy = storage_options(args, settings.section("store"), "store")
    section = settings.section("store")
    linger = linger_setting(section)
    signals = StopSignals()
    cfg = service_node_config(args, settings, "store")
    if args.leaves:
        from dafka.config import is_loopback
        from dafka.store.leaves import parse_endpoint

        if not is_loopback(parse_endpoint(args.leaves)[0]) and not args.insecure:
            raise ConfigError(f"--leaves {args.leaves}: the leaf port has no authentication yet; add --insecure")
    try:
        store = Store(db, cfg, sync=sync, retention=policy, linger=linger, leaves=args.leaves)
    except lmdb.Error as exc:
        raise open_error(db, exc) from None
    with store:
        print(
            f"store up: {store.address} db {db} (sync={'on' if sync else 'OFF'}), tower {tower_names(cfg.towers)}"
            + (f", leaves on {store.leaves.endpoint}" if store.leaves is not None else ""),
            flush=True,
        )
        serve_metrics(args, section, store)
        note_unreached_towers(cfg.towers)
        return signals.wait()


@command("gateway")
def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.tank.gateway import DEFAULT_PORT, Gateway
    from dafka.tank.limits import GatewayLimits

    section = settings.section("gateway")
    listen = args.listen or parse_listen(section.get("listen", f"127.0.0.1:{DEFAULT_PORT}"), DEFAULT_PORT)
    limits = GatewayLimits.from_settings(section, args)
    db, sync, policy = storage_options(args, section, "gateway")
    cfg = service_node_config(args, settings, "gateway")
    allow_clients = args.allow_clients or section.get("allow_clients")
    clients = parse_networks(allow_clients) if allow_clients else None
    if not is_loopback(listen[0]) and clients is None and not args.insecure:
        # Tank has no authentication: only listed client networks, or an explicit --insecure.
        raise ConfigError(
            f"the Tank port would listen on {listen[0]}, and the Tank protocol has no authentication: "
            "pass --allow-clients NET[,NET...] (e.g. 10.0.0.0/8), listen on 127.0.0.1, or pass --insecure"
        )
    kafka_text = args.kafka_listen or section.get("kafka_listen")
    kafka_listen = parse_listen(kafka_text, 9092) if kafka_text else None
    if kafka_listen is not None and not is_loopback(kafka_listen[0]) and clients is None and not args.insecure:
        raise ConfigError(
            f"the Kafka port would listen on {kafka_listen[0]} without authentication: "
            "pass --allow-clients NET[,NET...], listen on 127.0.0.1, or pass --insecure"
        )
    signals = StopSignals()
    try:
        if kafka_listen is not None:
            from dafka.kafka.gateway import KafkaGateway

            advertise = args.kafka_advertise or section.get("kafka_advertise")
            gateway = KafkaGateway(
                db, cfg, listen=listen, sync=sync, retention=policy, allow_clients=clients, limits=limits,
                kafka_listen=kafka_listen,
                kafka_advertise=parse_listen(advertise, 9092, minimum_port=1) if advertise else None,
            )
        else:
            gateway = Gateway(
                db, cfg, listen=listen, sync=sync, retention=policy, allow_clients=clients, limits=limits
            )
    except lmdb.Error as exc:
        raise open_error(db, exc) from None
    except OSError as exc:
        if exc.filename is not None:  # a file of the database, not the socket
            raise
        raise listen_error(exc, listen, kafka_listen) from None
    kafka_port = getattr(gateway, "kafka_port", None)
    kafka_note = f", Kafka on {kafka_listen[0]}:{kafka_port}" if kafka_listen is not None else ""
    with gateway:
        print(
            f"gateway up: Tank on {listen[0]}:{gateway.tank_port}{kafka_note}, store {gateway.address} db {db}"
            f" (sync={'on' if sync else 'OFF'}), tower {tower_names(cfg.towers)}",
            flush=True,
        )
        serve_metrics(args, section, gateway)
        note_unreached_towers(cfg.towers)
        return signals.wait()


def note_unreached_towers(towers: tuple[TowerAddress, ...]) -> None:
    """A service just started: say so if no tower answers (it keeps trying)."""
    unreached = unreached_towers(towers)
    if towers and len(unreached) == len(towers):
        print(f"note: no tower reached at {', '.join(unreached)}; still trying", file=sys.stderr, flush=True)


_IN_USE_HINT = " (is another process using that port?)"


def listen_error(exc: OSError, tank: tuple[str, int], kafka: tuple[str, int] | None) -> DafkaError:
    """A gateway's failure to listen, naming the listener (Tank or Kafka) that failed when it can tell."""
    text = str(exc)
    reason = exc.strerror or text
    hint = _IN_USE_HINT if exc.errno == errno.EADDRINUSE else ""
    # socket.create_server names the address it failed to bind.
    if kafka is not None and str(kafka) in text and str(tank) not in text:
        return DafkaError(f"cannot listen for Kafka clients on {kafka[0]}:{kafka[1]} (--kafka-listen): {reason}{hint}")
    if kafka is None or (str(tank) in text and str(kafka) not in text):
        return DafkaError(f"cannot listen for Tank clients on {tank[0]}:{tank[1]} (--listen): {reason}{hint}")
    return DafkaError(
        f"cannot listen for Tank clients on {tank[0]}:{tank[1]} or for Kafka clients on {kafka[0]}:{kafka[1]}:"
        f" {reason}{hint}"
    )


@command("tank")
def cmd_tank(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tank import cli as tank_cli

    return tank_cli.run(args, settings.section("gateway").get("listen"))


TOPIC_ROWS = 20  # partitions of a topic listed by `dafka topics` without --all


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
            held = sorted({r.topic for r in records.partitions()}) if args.topic and not rows else []
    except lmdb.Error as exc:
        raise DafkaError(f"cannot read the database in {db}: {exc}") from None
    if args.topic and not rows:
        names = ", ".join(map(shorten, held[:10])) + (f", ... ({len(held)} in all)" if len(held) > 10 else "")
        raise DafkaError(f"no topic {shorten(args.topic)} in {db} (" + (f"it holds {names})" if held else "it holds none)"))
    print(f"{'topic':<24} {'partition':<34} {'first':>12} {'last':>12} {'records':>12} {'bytes':>14}")
    by_topic: dict[str, list[Any]] = {}
    for r in rows:
        by_topic.setdefault(r.topic, []).append(r)
    for topic, parts in by_topic.items():
        shown = parts
        if not args.all and len(parts) > TOPIC_ROWS:
            shown = sorted(parts, key=lambda r: r.count, reverse=True)[:TOPIC_ROWS]
        for r in shown:
            print(f"{r.topic:<24} {r.partition:<34} {r.first:>12} {r.last:>12} {r.count:>12} {r.bytes:>14}")
        if len(shown) < len(parts):
            rest = [r for r in parts if r not in shown]
            print(
                f"{topic:<24} {f'... {len(rest)} more partitions':<34} {'':>12} {'':>12}"
                f" {sum(r.count for r in rest):>12} {sum(r.bytes for r in rest):>14}  (--all lists them)"
            )
    return 0


# ---------------------------------------------------------------- status


@command("status")
def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.cli.status import run_status

    try:
        return run_status(
            node_config(args, settings),
            wait=args.wait,
            watch=args.watch,
            as_json=args.json,
            interval=args.interval,
            out=sys.stdout,
            outboxes=args.outbox,
            show_all=args.all,
        )
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------- console


@command("console")
def cmd_console(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.cli import console

    cfg = node_config(args, settings)
    signals = StopSignals()
    return console.run(args, cfg, signals.wait)


# ---------------------------------------------------------------- up


@command("up")
def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.cli.services import Services

    if settings.node.security is not None:
        raise ConfigError(
            "`dafka up` makes its own keys: drop [security] from the config and run `dafka up --secure`, "
            "or start tower, store and gateway one by one"
        )
    bind = service_bind(args, args.bind or "127.0.0.1", args.secure, "services of `dafka up`")
    writable_dir(args.data, "data directory")
    signals = StopSignals()
    with Services(settings, data_dir=args.data, bind=bind, secure=args.secure) as services:
        for line in services.describe():
            print(line, flush=True)
        return signals.wait()


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
# ---------------------------------------------------------------- keys


def parse_networks(value: str | list[str]) -> list[Any]:
    """``10.0.0.0/8,192.168.1.7`` (or a list) as IP networks."""

    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return [ipaddress.ip_network(item.strip(), strict=False) for item in items if item.strip()]
    except ValueError as exc:
        raise ConfigError(f"--allow-clients: {exc}") from None


@command("keys")
def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.nodes import security

    if args.keys_command == "new":
        public, secret = security.new_keys(args.name, args.role, args.dir)
        print(f"{public}  (public: copy it into the allow-list directory of every node)")
        print(f"{secret}  (secret: only for the {args.role} that uses it)")
        return 0
    certs = security.list_certificates(args.dir)
    print(f"{'name':<24} {'role':<10} {'kind':<7} public key")
    for cert in certs:
        kind = "secret" if cert.secret else "public"
        print(f"{cert.name:<24} {cert.role or '?':<10} {kind:<7} {cert.public.decode()}")
    return 0


# ---------------------------------------------------------------- doctor


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
topic_arg = _checked(parse_topic, "topic")
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
    p.add_argument(
        "--advertise",
        help="host to announce in beacons (default: the interface bound; bound to all, as the tower sees us)",
    )
    p.add_argument(
        "--max-record-bytes",
        type=int,
        metavar="N",
        help="largest record content (bytes): publish and Tank produces refuse a bigger one, consumers, stores and"
        " gateways drop and count it ([node] max_record_bytes; default 1048576)",
    )
    _add_security_flags(p)


def _add_security_flags(p: argparse.ArgumentParser, insecure: bool = False) -> None:
    p.add_argument("--key", metavar="FILE", help="secure mode: this node's secret certificate (NAME.key_secret)")
    p.add_argument("--allow", metavar="DIR", help="secure mode: directory of allowed public certificates")
    p.add_argument(
        "--tower-key",
        action="append",
        metavar="KEY|FILE",
        help="secure mode: a tower's public key or certificate (repeatable: one per --tower, or one for all)",
    )
    if insecure:
        p.add_argument(
            "--insecure", action="store_true", help="allow binding beyond loopback without security"
        )


def _add_gateway_limit_flags(p: argparse.ArgumentParser) -> None:
    """One flag per Tank-port limit (dafka.tank.limits); unset flags leave [gateway] or the default."""
    from dafka.tank.limits import GatewayLimits

    d = GatewayLimits()
    byte_count = _checked(_number(int, 0, "must be 0 or more"), "count")
    for name, kind, what in (
        ("max_connections", count_arg, "Tank connections open at once"),
        ("max_request_bytes", count_arg, "largest Tank request frame, bytes"),
        ("max_buffered_bytes", count_arg, "request bytes in flight over all connections"),
        ("min_request_rate", byte_count, "bytes/s a request in flight must average once request-timeout passed"),
        ("request_timeout", positive_seconds_arg, "seconds of silence mid-request (or of unread answers)"),
        ("max_answer_bytes", count_arg, "record bytes in one consume answer"),
        ("max_output_bytes", count_arg, "unsent answer bytes of one connection"),
        ("max_partitions_per_topic", count_arg, "partitions a Tank CreateTopic may ask for"),
        ("max_owned_partitions", count_arg, "partitions of all topics the gateway created (Tank and Kafka), together"),
        ("kafka_max_output_bytes", count_arg, "Kafka answer bytes held over all connections"),
        ("kafka_max_produce_records", count_arg, "records in one Kafka produce request"),
        ("kafka_max_rebalance_timeout", positive_seconds_arg, "seconds a Kafka group's rebalance may wait"),
        ("kafka_max_metadata_bytes", count_arg, "bytes of one Kafka Metadata answer"),
        ("kafka_max_created_topics", count_arg, "topics one Kafka request may create"),
    ):
        p.add_argument(
            "--" + name.replace("_", "-"), type=kind, help=f"{what} (or [gateway] {name}; default {getattr(d, name)})"
        )


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
    parser.add_argument("--version", action=_Version, help="version and I/O implementation, then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("tower", help="run a tower (discovery service)")
    p.add_argument("--bind", type=host_arg, help="interface to bind (default 127.0.0.1, or * when secure; or [tower] bind)")
    p.add_argument("--in-port", type=port_arg, help="beacons in (XSUB) port, default 5556 (0: any free port)")
    p.add_argument("--out-port", type=port_arg, help="beacons out (XPUB) port, default 5557 (0: any free port)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics over HTTP here")
    _add_security_flags(p, insecure=True)

    p = sub.add_parser("produce", help="publish one record per input line, as lines arrive")
    p.add_argument("topic", type=topic_arg)
    _add_node_flags(p)
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

    p = sub.add_parser("consume", help="print records, one per line")
    p.add_argument("topic", nargs="+", type=topic_arg)
    _add_node_flags(p)
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
        "--commit-interval",
        type=seconds_arg,
        default=1.0,
        help="--group: seconds between commits of what was printed (0: only at exit; default 1)",
    )
    p.add_argument(
        "--commit-timeout", type=positive_seconds_arg, default=5.0, help="--group: seconds to wait for a store to confirm"
    )

    p = sub.add_parser("store", help="run a store (persists every record in LMDB)")
    _add_node_flags(p)
    p.add_argument("--insecure", action="store_true", help="allow binding beyond loopback without security")
    p.add_argument("--db", help="LMDB directory (or [store] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE: acked data can be lost on power failure)")
    p.add_argument("--retention-age", type=positive_seconds_arg, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=count_arg, help="default retention: bytes to keep per topic")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics over HTTP here")
    p.add_argument(
        "--leaves", metavar="HOST:PORT",
        help="take leaf devices (dafka produce --leaf) on this port (0: any free port); beyond loopback needs --insecure",
    )

    p = sub.add_parser("gateway", help="run a Tank-protocol (and optionally Kafka-protocol) gateway (also a full store)")
    _add_node_flags(p)
    p.add_argument("--listen", type=listen_arg, help="Tank address HOST:PORT (default 127.0.0.1:11011; port 0: any free port)")
    p.add_argument(
        "--kafka-listen", metavar="HOST:PORT",
        help="also speak Kafka here (or [gateway] kafka_listen; port 0: any free port)",
    )
    p.add_argument(
        "--kafka-advertise", metavar="HOST:PORT",
        help="the address Kafka clients are told to connect to (default: the Kafka listen address)",
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow binding or listening beyond loopback without security"
    )
    p.add_argument(
        "--allow-clients", metavar="NET[,NET...]", help="Tank clients allowed from these networks (checked on accept)"
    )
    p.add_argument("--db", help="LMDB directory (or [gateway] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE)")
    _add_gateway_limit_flags(p)
    p.add_argument("--retention-age", type=positive_seconds_arg, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=count_arg, help="default retention: bytes to keep per topic")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics over HTTP here")

    from dafka.tank import cli as tank_cli

    tank_cli.add_parser(sub)

    p = sub.add_parser("topics", help="list topics and partitions of a store's database")
    p.add_argument("--db", help="LMDB directory of a store (read-only)")
    p.add_argument("topic", nargs="?", help="only this topic")
    p.add_argument("--all", action="store_true", help=f"every partition (default: the {TOPIC_ROWS} largest of each topic)")

    p = sub.add_parser("status", help="join the mesh read-only and show nodes, heads and lag")
    _add_node_flags(p)
    p.add_argument("--wait", type=seconds_arg, default=3.0, help="seconds to listen before the first view")
    p.add_argument("--watch", action="store_true", help="keep refreshing the view (Ctrl-C ends)")
    p.add_argument("--interval", type=positive_seconds_arg, default=1.0, help="--watch: seconds between views")
    p.add_argument("--json", action="store_true", help="print JSON (one object per view)")
    p.add_argument("--all", action="store_true", help="every node and partition (default: a summary beyond 20)")
    p.add_argument("--outbox", metavar="DIR", action="append", help="also show this local edge outbox (repeatable)")

    from dafka.cli import console as console_cli

    console_cli.add_parser(sub, _add_node_flags, listen_arg, positive_seconds_arg)

    p = sub.add_parser("outbox", help="show what a producer's edge outbox holds (read-only)")
    p.add_argument("dir", help="the outbox directory")
    p.add_argument("--show", type=int, default=0, help="also print the first N records")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "doctor",
        help="the I/O implementation in use; with a tower: whether nodes started here reach the mesh and are reached",
    )
    _add_node_flags(p)
    p.add_argument("--wait", type=positive_seconds_arg, default=5.0, help="seconds to wait for peers (default 5)")

    p = sub.add_parser("up", help="run the main services (tower + store + gateway) on loopback")
    p.add_argument("--data", default="var", help="data directory (default ./var)")
    p.add_argument("--bind", type=host_arg, help="interface to bind (default 127.0.0.1)")
    p.add_argument("--insecure", action="store_true", help="allow binding beyond loopback (plain mode)")
    p.add_argument(
        "--secure",
        action="store_true",
        help="a CURVE-secured mesh: keys made once under DATA/keys, allow-list DATA/allow, "
        "client configs DATA/producer.toml and DATA/consumer.toml",
    )

    p = sub.add_parser("keys", help="make and list CURVE key pairs for a secure mesh")
    ksub = p.add_subparsers(dest="keys_command", required=True, metavar="new|list")
    k = ksub.add_parser("new", help="create NAME.key (public) and NAME.key_secret")
    k.add_argument("name")
    k.add_argument("--role", required=True, choices=["tower", "store", "producer", "consumer", "gateway"])
    k.add_argument("--dir", default=".", help="where to write them (default .)")
    k = ksub.add_parser("list", help="certificates in a directory, with role and public key")
    k.add_argument("--dir", default=".", help="directory (default .)")

    p = sub.add_parser("bench", help="measure throughput")
    from dafka import bench

    bench.add_arguments(p)


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


# zmq errnos of a bind/connect the user can fix (address in use, no such interface, ...).
_ADDRESS_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENODEV, errno.EACCES, errno.EINVAL}


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options of a command and of its own sub-commands (``dafka bench live --records``)."""
    options = dict(parser._option_string_actions)
    for sub in _commands(parser).values():
        options = {**_options_of(sub), **options}
    return options


def option_before_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """What is wrong when an option of a command comes before it (``dafka --tower H consume x``).

    argparse would take the option's value for the command ("invalid choice").
    """
    commands = _commands(parser)
    top = parser._option_string_actions
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            return None  # the command (or an argument argparse will judge)
        name, eq, _ = token.partition("=")
        known = [o for o in top if o.startswith(name)] if name.startswith("--") and name not in top else [name]
        if len(known) == 1 and known[0] in top:  # argparse takes unique prefixes (--conf)
            i += 1 if eq or top[known[0]].nargs == 0 else 2
            continue
        command = next((t for t in argv[i + 1 :] if t in commands), None)
        action = _options_of(commands[command]).get(name) if command else None
        if command is None or action is None:
            where = f" of dafka {command}" if command else ""
            return f"unknown option {_clip(name)}{where}: options of a command go after it"
        value = "" if eq or action.nargs == 0 or i + 1 >= len(argv) else f" {_clip(argv[i + 1])}"
        return f"{name} goes after the command: dafka {command} ... {_clip(token)}{value}"
    return None


def _clip(text: str) -> str:
    """A word of the command line as typed, unless too long to echo."""
    return text if len(text) <= 40 and text.isprintable() else shorten(text)


def _error(message: object, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command.  Known failures become one ``error:`` line; bugs keep their traceback."""
    import zmq

    try:
        parser = build_parser()
        misplaced = option_before_command(parser, sys.argv[1:] if argv is None else argv)
        if misplaced:
            return _error(f"{misplaced} (see 'dafka --help')", EXIT_USAGE)
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
    except ResumeError as exc:
        return _error(exc, EXIT_NOT_STARTED)  # nothing was published
    except DafkaError as exc:
        return _error(exc, EXIT_FAILURE)
    except zmq.ZMQError as exc:
        if exc.errno not in _ADDRESS_ERRNOS:
            raise
        hint = {
            errno.EADDRINUSE: _IN_USE_HINT,
            errno.ENODEV: " (bind takes an interface name, an IP address of this machine or *)",
            errno.EADDRNOTAVAIL: " (that address is not one of this machine's)",
        }.get(exc.errno, "")
        return _error(f"cannot bind: {exc}{hint}", EXIT_FAILURE)
    except OSError as exc:
        # A file or socket problem of this machine: name it, no traceback.
        if exc.filename is not None:
            return _error(f"{exc.filename}: {exc.strerror or exc}", EXIT_FAILURE)
        return _error(exc.strerror or exc, EXIT_FAILURE)

