"""``dafka gateway`` (run a Tank and Kafka gateway) and ``dafka tank`` (a Tank client)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
from typing import Any

from dafka.cli.args import (
    add_node_flags,
    checked,
    count_arg,
    listen_arg,
    number,
    positive_seconds_arg,
)
from dafka.cli.common import (
    IN_USE_HINT,
    StopSignals,
    note_unreached_towers,
    open_error,
    serve_metrics,
    service_node_config,
    tower_names,
)
from dafka.cli.store import (
    add_compaction_flags,
    check_leaf_port,
    compaction_policy,
    leaf_options,
    storage_options,
)
from dafka.config import Settings, is_loopback, parse_listen
from dafka.errors import ConfigError, DafkaError


def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.gctune import settle
    from dafka.tank.gateway import DEFAULT_PORT, Gateway
    from dafka.tank.limits import GatewayLimits

    section = settings.section("gateway")
    listen = args.listen or parse_listen(section.get("listen", f"127.0.0.1:{DEFAULT_PORT}"), DEFAULT_PORT)
    limits = GatewayLimits.from_settings(section, args)
    db, sync, policy = storage_options(args, section, "gateway")
    compaction = compaction_policy(args, section)
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
    check_leaf_port(args.leaves, args.insecure, cfg.security is not None)
    signals = StopSignals()
    try:
        if kafka_listen is not None:
            from dafka.kafka.gateway import KafkaGateway

            advertise = args.kafka_advertise or section.get("kafka_advertise")
            gateway = KafkaGateway(
                db, cfg, listen=listen, sync=sync, retention=policy, allow_clients=clients, limits=limits,
                compaction=compaction,
                kafka_listen=kafka_listen,
                kafka_advertise=parse_listen(advertise, 9092, minimum_port=1) if advertise else None,
                leaves=args.leaves, **leaf_options(args, section),
            )
        else:
            gateway = Gateway(
                db, cfg, listen=listen, sync=sync, retention=policy, allow_clients=clients, limits=limits,
                compaction=compaction,
                leaves=args.leaves, **leaf_options(args, section),
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
        settle()  # its start-up objects out of the cyclic GC's way (dafka.gctune), as the store does
        print(
            f"gateway up: Tank on {listen[0]}:{gateway.tank_port}{kafka_note}, store {gateway.address} db {db}"
            f" (sync={'on' if sync else 'OFF'}), tower {tower_names(cfg.towers)}"
            + (f", leaves on {gateway.leaves.endpoint}" if gateway.leaves is not None else ""),
            flush=True,
        )
        serve_metrics(args, section, gateway)
        note_unreached_towers(cfg.towers)
        return signals.wait()


def listen_error(exc: OSError, tank: tuple[str, int], kafka: tuple[str, int] | None) -> DafkaError:
    """A gateway's failure to listen, naming the listener (Tank or Kafka) that failed when it can tell."""
    text = str(exc)
    reason = exc.strerror or text
    hint = IN_USE_HINT if exc.errno == errno.EADDRINUSE else ""
    # socket.create_server names the address it failed to bind.
    if kafka is not None and str(kafka) in text and str(tank) not in text:
        return DafkaError(f"cannot listen for Kafka clients on {kafka[0]}:{kafka[1]} (--kafka-listen): {reason}{hint}")
    if kafka is None or (str(tank) in text and str(kafka) not in text):
        return DafkaError(f"cannot listen for Tank clients on {tank[0]}:{tank[1]} (--listen): {reason}{hint}")
    return DafkaError(
        f"cannot listen for Tank clients on {tank[0]}:{tank[1]} or for Kafka clients on {kafka[0]}:{kafka[1]}:"
        f" {reason}{hint}"
    )


def parse_networks(value: str | list[str]) -> list[Any]:
    """``10.0.0.0/8,192.168.1.7`` (or a list) as IP networks."""

    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return [ipaddress.ip_network(item.strip(), strict=False) for item in items if item.strip()]
    except ValueError as exc:
        raise ConfigError(f"--allow-clients: {exc}") from None


def cmd_tank(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.tank import cli as tank_cli

    return tank_cli.run(args, settings.section("gateway").get("listen"))


def add_gateway_limit_flags(p: argparse.ArgumentParser) -> None:
    """One flag per Tank-port limit (dafka.tank.limits); unset flags leave [gateway] or the default."""
    from dafka.tank.limits import GatewayLimits

    d = GatewayLimits()
    byte_count = checked(number(int, 0, "must be 0 or more"), "count")
    for name, kind, what in (
        ("max_connections", count_arg, "Tank connections open at once"),
        ("max_request_bytes", count_arg, "largest Tank request frame, bytes"),
        ("max_buffered_bytes", count_arg, "request bytes in flight over all connections"),
        ("min_request_rate", byte_count, "bytes/s a request in flight must average once request-timeout passed"),
        ("request_timeout", positive_seconds_arg, "seconds of silence mid-request (or of unread answers)"),
        ("max_answer_bytes", count_arg, "record bytes in one consume answer"),
        ("max_output_bytes", count_arg, "unsent answer bytes of one connection"),
        ("max_total_output_bytes", count_arg, "unsent Tank answer bytes over all connections"),
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run a Tank-protocol (and optionally Kafka-protocol) gateway (also a full store)")
    add_node_flags(p)
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
    add_gateway_limit_flags(p)
    p.add_argument("--retention-age", type=positive_seconds_arg, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=count_arg, help="default retention: bytes to keep per topic")
    add_compaction_flags(p)
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics over HTTP here")
    p.add_argument(
        "--leaves", metavar="HOST:PORT",
        help="take leaf devices (dafka produce --leaf) on this port, as a store does (0: any free port); beyond"
        " loopback needs [security] or --insecure",
    )
    p.add_argument(
        "--leaf-read", metavar="PATTERN[,PATTERN...]",
        help="topics leaf readers (dafka consume --leaf) may read, as a store's --leaf-read (or [gateway] leaf_read)",
    )


def add_tank_parser(sub: Any) -> None:
    from dafka.tank import cli as tank_cli

    tank_cli.add_parser(sub)
