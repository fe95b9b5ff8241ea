"""The ``dafka`` parser, assembled from the commands' modules, and the check of misplaced options."""

from __future__ import annotations

import argparse
from typing import Any

from dafka.cli import (
    bench,
    console,
    consume,
    doctor,
    gateway,
    keys,
    outbox,
    produce,
    status,
    store,
    tower,
    up,
)
from dafka.cli.args import (
    LOG_LEVELS,
    add_node_flags,
    listen_arg,
    log_level_arg,
    positive_seconds_arg,
)
from dafka.cli.common import EXIT_USAGE, Command
from dafka.config import shorten

# Each command's function, by name (`dafka NAME`).
COMMANDS: dict[str, Command] = {
    "tower": tower.cmd_tower,
    "produce": produce.cmd_produce,
    "consume": consume.cmd_consume,
    "store": store.cmd_store,
    "gateway": gateway.cmd_gateway,
    "tank": gateway.cmd_tank,
    "topics": store.cmd_topics,
    "status": status.cmd_status,
    "console": console.cmd_console,
    "outbox": outbox.cmd_outbox,
    "doctor": doctor.cmd_doctor,
    "up": up.cmd_up,
    "keys": keys.cmd_keys,
    "bench": bench.cmd_bench,
}


class Parser(argparse.ArgumentParser):
    """argparse with a one-line ``error: ...`` for usage errors (exit 2)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"error: {message} (see '{self.prog} --help')\n")


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
    # In the order `dafka --help` lists them.
    tower.add_parser(sub)
    produce.add_parser(sub)
    consume.add_parser(sub)
    store.add_parser(sub)
    gateway.add_parser(sub)
    gateway.add_tank_parser(sub)
    store.add_topics_parser(sub)
    status.add_parser(sub)
    console.add_parser(sub, add_node_flags, listen_arg, positive_seconds_arg)
    outbox.add_parser(sub)
    doctor.add_parser(sub)
    up.add_parser(sub)
    keys.add_parser(sub)
    bench.add_parser(sub)
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
