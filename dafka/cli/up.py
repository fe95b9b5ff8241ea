"""``dafka up``: the main services (tower, store, gateway) on loopback, as ``make run`` starts them."""

from __future__ import annotations

import argparse
from typing import Any

from dafka.cli.args import host_arg
from dafka.cli.common import StopSignals, service_bind, writable_dir
from dafka.config import Settings
from dafka.errors import ConfigError


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


def add_parser(sub: Any) -> None:
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
