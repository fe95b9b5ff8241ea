"""docs/reference/configuration.md documents exactly the keys of dafka.config.SCHEMA (it cannot rot)."""

from __future__ import annotations

import re

from dafka.cli import build_parser
from dafka.config import SCHEMA, SECTIONS
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "reference" / "configuration.md"


def documented() -> dict[str, set[str]]:
    """``### [section]`` -> the keys in the first column of the table under it."""
    out: dict[str, set[str]] = {}
    section = None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"### \[([\w.]+)\]", line)
        if heading:
            section = heading.group(1)
            out[section] = set()
        elif section and (row := re.match(r"\| `(\w+)` \|", line)):
            out[section].add(row.group(1))
    return out


def test_every_schema_key_is_documented_and_nothing_else() -> None:
    docs = documented()
    expected = {name: set(SCHEMA[name]) for name in SECTIONS}
    expected["store.retention"] = set(SCHEMA["retention"])
    assert docs == expected
    assert set(SCHEMA["retention.topic"]) <= docs["store.retention"]


def test_every_command_is_in_the_cli_reference() -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    missing = [name for name in commands if f"`dafka {name}" not in page]
    assert not missing, f"not in docs/reference/cli.md: {missing}"
