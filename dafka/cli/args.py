"""Argument types and the flags several commands share (towers, bind, security)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from dafka.config import parse_listen, parse_port, parse_topic, parse_towers
from dafka.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def checked(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
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


def number(kind: type, minimum: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if value != value or value < minimum or value == float("inf"):
            raise ValueError(f"{text!r}: {what}")
        return value

    return parse


host_arg = checked(_host, "host")
port_arg = checked(lambda t: parse_port(t), "port")  # 0: any free port
towers_arg = checked(_towers, "tower")
topic_arg = checked(parse_topic, "topic")
log_level_arg = checked(_log_level, "log level")
listen_arg = checked(lambda t: parse_listen(t, 11011), "address")
seconds_arg = checked(number(float, 0.0, "must be 0 or more seconds"), "seconds")
positive_seconds_arg = checked(number(float, 1e-9, "must be more than 0 seconds"), "seconds")
count_arg = checked(number(int, 1, "must be 1 or more"), "count")


def add_node_flags(p: argparse.ArgumentParser) -> None:
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
    add_security_flags(p)


def add_security_flags(p: argparse.ArgumentParser, insecure: bool = False) -> None:
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
