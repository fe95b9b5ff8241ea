"""What the commands share: exit codes, the node configuration from flags and settings, stopping on a
signal, paths, towers and the metrics endpoint."""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from dafka.config import (
    NodeConfig,
    Settings,
    TowerAddress,
    is_loopback,
    loopback_trap,
    parse_listen,
    parse_max_record_bytes,
)
from dafka.errors import ConfigError, DafkaError
from dafka.nodes.security import SecurityConfig, security_from

Command = Callable[[argparse.Namespace, Settings], int]


EXIT_FAILURE = 1  # runtime failure (missing peer, unusable path, ...)
EXIT_USAGE = 2  # bad option value or configuration
EXIT_NOT_STARTED = 2  # produce: refused to start publishing (ResumeError), nothing was sent
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (128 + SIGPIPE)

IN_USE_HINT = " (is another process using that port?)"


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
    """[security] of the config file overridden by --key / --allow / --tower-key (/ --leaf-key)."""
    tower_keys = getattr(args, "tower_key", None)
    leaf_keys = getattr(args, "leaf_key", None)
    flags = {
        "key": getattr(args, "key", None),
        "allow": getattr(args, "allow", None),
        "tower_keys": ",".join(tower_keys) if tower_keys else None,
        "leaf_keys": ",".join(leaf_keys) if leaf_keys else None,
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
    """SIGINT/SIGTERM stop the service from now on (install before a service says it is up).

    The handlers only note the signal.  A handler runs in the main thread between two of its
    bytecodes, so one that took a lock (``Event.set``) hung the process for good when the
    signal came while the main thread held that lock itself (inside ``Event.wait``): a
    service then never stopped.  :meth:`wait` wakes on a signal through a pipe the
    interpreter writes to as it arrives (``signal.set_wakeup_fd``).
    """

    # Every instance not yet done waiting, newest last: a signal is noted in each (a later
    # instance takes the handlers and the wakeup fd over; an earlier one, woken by its own
    # poll, must still hear it), and the wakeup fd goes back to the newest one left.
    _live: ClassVar[list[StopSignals]] = []
    _first_wake = -1  # the wakeup fd before the first live instance (Python's or an event loop's)
    MAX_NOTED = 64  # signals noted at most (only the first decides the exit code)

    def __init__(self) -> None:
        self.stop = threading.Event()  # set once a signal came (other threads may set it too)
        self.got: list[int] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        old = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        if not StopSignals._live:
            StopSignals._first_wake = old
        StopSignals._live.append(self)
        signal.signal(signal.SIGINT, self._handler)
        signal.signal(signal.SIGTERM, self._handler)

    @staticmethod
    def _handler(signum: int, frame: Any) -> None:
        for live in StopSignals._live:  # no lock: see the class
            if len(live.got) < StopSignals.MAX_NOTED:
                live.got.append(signum)

    def wait(self) -> int:
        """Block until a signal came (or ``stop`` is set); the exit code to use (again when
        called again)."""
        try:
            while not self.got and not self.stop.is_set():
                select.select([self._wake_r], [], [], 0.5)
                try:
                    while os.read(self._wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
        finally:
            self._close()
        self.stop.set()
        # SIGTERM is how a service manager stops a service: a clean stop, 0.
        return EXIT_INTERRUPTED if self.got[:1] == [signal.SIGINT] else 0

    def _close(self) -> None:
        """Done waiting (once): the wakeup fd, if still ours, back to the newest live instance's
        (or to what was before the first), then the pipe closed."""
        if self._wake_w < 0:
            return
        live = StopSignals._live
        if self in live:
            live.remove(self)
        current = signal.set_wakeup_fd(-1)
        back = current
        if current == self._wake_w:
            back = live[-1]._wake_w if live else StopSignals._first_wake
        if back != -1:
            try:
                signal.set_wakeup_fd(back, warn_on_full_buffer=False)
            except (OSError, ValueError):  # closed since (what was before us): none then
                pass
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1


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


def note_unreached_towers(towers: tuple[TowerAddress, ...]) -> None:
    """A service just started: say so if no tower answers (it keeps trying)."""
    unreached = unreached_towers(towers)
    if towers and len(unreached) == len(towers):
        print(f"note: no tower reached at {', '.join(unreached)}; still trying", file=sys.stderr, flush=True)


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
