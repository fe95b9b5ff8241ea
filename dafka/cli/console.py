"""``dafka console``: the web console (:mod:`dafka.console`) from the command line."""

from __future__ import annotations

import argparse
from typing import Any

from dafka.cli.common import StopSignals, node_config
from dafka.config import NodeConfig, Settings, is_loopback
from dafka.errors import ConfigError

DEFAULT_LISTEN = "127.0.0.1:9980"


def add_parser(sub: Any, add_node_flags: Any, listen_arg: Any, seconds_arg: Any) -> None:
    p = sub.add_parser("console", help="serve a read-only web console of the mesh (topics, groups, lag, records)")
    add_node_flags(p)
    p.add_argument(
        "--listen",
        type=listen_arg,
        default=None,
        metavar="HOST:PORT",
        help=f"where the web server listens (default {DEFAULT_LISTEN}; :0 any free port)",
    )
    p.add_argument("--db", metavar="DIR", help="a local store's LMDB directory: record counts, bytes, holes, and records with keys and timestamps (without it records are read over the mesh)")
    p.add_argument("--interval", type=seconds_arg, default=1.0, help="seconds between updates of the pages (default 1)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback (the console has no authentication and, with --db, shows records)",
    )


def check_listen(host: str, insecure: bool) -> None:
    """Loopback only, unless told otherwise (as the gateway's Tank and Kafka ports)."""
    if not is_loopback(host) and not insecure:
        raise ConfigError(
            f"the console would listen on {host}, and it has no authentication: anyone who reaches it sees the mesh"
            " (and with --db the records). Listen on 127.0.0.1, or pass --insecure"
        )


def run(args: argparse.Namespace, cfg: NodeConfig, wait: Any) -> int:
    try:
        from dafka.console.server import Console
    except ImportError as exc:
        raise ConfigError(f"the console needs aiohttp: pip install 'dafka[console]' ({exc})") from None
    from dafka.config import parse_listen

    host, port = args.listen or parse_listen(DEFAULT_LISTEN, 9980)
    check_listen(host, args.insecure)
    with Console(cfg, host, port, db=args.db, interval=args.interval) as console:
        print(f"console up: {console.url}" + (f" (records from {args.db})" if args.db else ""), flush=True)
        return int(wait())


def cmd_console(args: argparse.Namespace, settings: Settings) -> int:
    cfg = node_config(args, settings)
    signals = StopSignals()
    return run(args, cfg, signals.wait)
