"""``dafka tower``: run a tower (the discovery service)."""

from __future__ import annotations

import argparse
from typing import Any

from dafka.cli.args import add_security_flags, host_arg, port_arg
from dafka.cli.common import StopSignals, security_config, serve_metrics, service_bind
from dafka.config import Settings, TowerAddress, parse_port
from dafka.errors import ConfigError
from dafka.nodes.security import parse_key


def cmd_tower(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.gctune import settle
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
    bridges = bridge_endpoints(args.bridge or section.get("bridges") or [])
    keys = args.bridge_key or section.get("bridge_keys") or []
    if isinstance(keys, str):
        keys = [keys]
    bridge_keys = [parse_key(k) for value in keys for k in value.split(",") if k.strip()]
    if bridge_keys and sec is None:
        raise ConfigError("--bridge-key is for secure towers (a plain tower's bridges are plain)")
    if bridges and bridge_keys and len(bridge_keys) not in (1, len(bridges)):
        raise ConfigError(f"{len(bridge_keys)} bridge keys for {len(bridges)} bridges: give one per bridge, or one for all")
    signals = StopSignals()
    with Tower(bind, in_port, out_port, sec, bridges=bridges, bridge_keys=bridge_keys) as tower:
        settle()  # its start-up objects out of the cyclic GC's way (dafka.gctune), as the store does
        mode = " (secure)" if sec else ""
        bridged = f", bridged to {', '.join(bridges)}" if bridges else ""
        print(
            f"tower up: beacons in tcp://{bind}:{tower.in_port}, out tcp://{bind}:{tower.out_port}{mode}{bridged}",
            flush=True,
        )
        server = serve_metrics(args, section, tower)
        try:
            return signals.wait()
        finally:
            if server is not None:
                server.close()


def bridge_endpoints(values: str | list[str]) -> list[str]:
    """Other regions' towers (``HOST[:IN_PORT[:OUT_PORT]]``, comma-separated or listed)
    as the beacon-out endpoints a bridge reads."""
    if isinstance(values, str):
        values = [values]
    items = [item for value in values for item in value.split(",") if item.strip()]
    return [TowerAddress.parse(item).beacon_out for item in items]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tower", help="run a tower (discovery service)")
    p.add_argument("--bind", type=host_arg, help="interface to bind (default 127.0.0.1, or * when secure; or [tower] bind)")
    p.add_argument("--in-port", type=port_arg, help="beacons in (XSUB) port, default 5556 (0: any free port)")
    p.add_argument("--out-port", type=port_arg, help="beacons out (XPUB) port, default 5557 (0: any free port)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics over HTTP here")
    p.add_argument(
        "--bridge",
        action="append",
        metavar="HOST[:IN[:OUT]]",
        help="another region's tower (as nodes name towers; repeat or comma-separate): its stores, consumers "
        "and groups are relayed to our nodes, never its producers (or [tower] bridges)",
    )
    p.add_argument(
        "--bridge-key",
        action="append",
        metavar="KEY|FILE",
        help="secure towers: a bridged tower's public key or certificate (repeatable: one per --bridge, or one for"
        " all; or [tower] bridge_keys)",
    )
    add_security_flags(p, insecure=True)
