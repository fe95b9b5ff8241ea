"""Configuration: defaults, TOML files, environment variables.

Precedence, lowest first: built-in defaults, the TOML file (``--config`` or
``$DAFKA_CONFIG``), environment variables (``$DAFKA_TOWERS``), command-line
flags.

Every setting is checked against :data:`SCHEMA` (type and range), wherever it
comes from: a TOML file (unknown sections and keys are refused, naming the
nearest valid one), a :class:`NodeConfig` built in code, and the command
line's numeric options (:func:`Spec.parse`).  Adding a setting is one line in
:data:`SCHEMA`; a ``[node]`` key also needs its :class:`NodeConfig` field.  A tower is named ``host`` (ports 5556/5557), ``host:in_port`` (out is
in + 1) or ``host:in_port:out_port``; ``tcp://`` prefixes are accepted.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dafka.errors import ConfigError
from dafka.nodes.security import SecurityConfig, security_from

DEFAULT_BEACON_IN_PORT = 5556  # tower XSUB: node beacons in
DEFAULT_BEACON_OUT_PORT = 5557  # tower XPUB: tower beacons out
DEFAULT_MAX_RECORD_BYTES = 1 << 20  # [node] max_record_bytes

@dataclass(frozen=True, slots=True)
class Spec:
    """What one setting accepts: a kind and, for numbers, a range.

    ``kind`` is ``"int"``, ``"float"`` (an integer is accepted), ``"bool"``,
    ``"str"``, ``"strs"`` (a string or a list of strings), ``"table"`` (a
    sub-table checked against ``SCHEMA[table]``) or ``"tables"`` (a table of
    freely named sub-tables, each checked against ``SCHEMA[table]``).
    ``minimum`` is exclusive when ``above`` is set.
    """

    kind: str
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    table: str = ""

    def describe(self) -> str:
        """What is expected, in words ("a number > 0", "an integer 0..65535")."""
        what = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "str": "a string",
            "strs": "a string or a list of strings",
        }.get(self.kind, "a table")
        if self.kind not in ("int", "float"):
            return what
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None and not self.above:
            return f"{what} from {_num(lo)} to {_num(hi)}"
        parts = []
        if lo is not None:
            parts.append(f"{'>' if self.above else '>='} {_num(lo)}")
        if hi is not None:
            parts.append(f"<= {_num(hi)}")
        return f"{what} {' and '.join(parts)}".strip()

    def check(self, value: Any, where: str) -> Any:
        """``value`` as this setting's type, or a ConfigError naming ``where``."""
        kind = self.kind
        given = value
        ok = True
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "str":
            ok = isinstance(value, str)
        elif kind == "strs":
            ok = isinstance(value, str) or (
                isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
            )
        elif kind in ("table", "tables"):
            ok = isinstance(value, dict)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if ok:
                value = float(value)
        if ok and kind in ("int", "float"):
            lo, hi = self.minimum, self.maximum
            ok = (lo is None or (value > lo if self.above else value >= lo)) and (hi is None or value <= hi)
        if not ok:
            raise ConfigError(f"{where} = {given!r}: expected {self.describe()}")
        return value

    def parse(self, text: str, where: str) -> Any:
        """A command-line value (text) as this setting's type, checked."""
        value: Any = text
        try:
            if self.kind == "int":
                value = int(text)
            elif self.kind == "float":
                value = float(text)
        except ValueError:
            raise ConfigError(f"{where} {text!r}: expected {self.describe()}") from None
        try:
            return self.check(value, where)
        except ConfigError:
            raise ConfigError(f"{where} {text}: expected {self.describe()}") from None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_SECONDS = Spec("float", 0, above=True)  # a positive duration
_RETENTION = {
    "max_age_s": _SECONDS,
    "max_bytes": Spec("int", 1),
}

# Every section and key a TOML file may hold.  A new setting is one line here
# (plus, for [node], its NodeConfig field); "table"/"tables" specs name the
# entry below that checks their sub-tables.
SCHEMA: dict[str, dict[str, Spec]] = {
    "node": {
        "towers": Spec("strs"),
        "bind": Spec("str"),
        "advertise": Spec("str"),
        "beacon_interval": Spec("float", 0.001, 3600),
        "beacon_timeout": Spec("float", 0.002, 86_400),
        "hwm": Spec("int", 1, 2**31 - 1),
        "batches": Spec("bool"),
        "max_record_bytes": Spec("int", 1, 1 << 31),
    },
    "tower": {
        "bind": Spec("str"),
        "beacon_in_port": Spec("int", 0, 65535),
        "beacon_out_port": Spec("int", 0, 65535),
        "metrics": Spec("str"),
        "bridges": Spec("strs"),
        "bridge_keys": Spec("strs"),
    },
    "store": {
        "db": Spec("str"),
        "sync": Spec("bool"),
        "linger_ms": Spec("float", 0, 1000),
        "metrics": Spec("str"),
        "topics": Spec("strs"),
        "leaf_read": Spec("strs"),
        "retention": Spec("table", table="retention"),
        "compact_topics": Spec("strs"),
        "delete_retention_ms": Spec("int", 0),
    },
    "gateway": {
        "listen": Spec("str"),
        "db": Spec("str"),
        "sync": Spec("bool"),
        "metrics": Spec("str"),
        "allow_clients": Spec("strs"),
        "leaf_read": Spec("strs"),
        "kafka_listen": Spec("str"),
        "kafka_advertise": Spec("str"),
        "retention": Spec("table", table="retention"),
        "compact_topics": Spec("strs"),
        "delete_retention_ms": Spec("int", 0),
        # The Tank port's limits (dafka.tank.limits.GatewayLimits checks them again).
        "max_connections": Spec("int", 1, 2**31 - 1),
        "max_request_bytes": Spec("int", 1),
        "max_buffered_bytes": Spec("int", 1),
        "min_request_rate": Spec("int", 0),
        "request_timeout": _SECONDS,
        "max_answer_bytes": Spec("int", 1),
        "max_output_bytes": Spec("int", 1),
        "max_total_output_bytes": Spec("int", 1),
        "max_partitions_per_topic": Spec("int", 1, 0xFFFE),
        "max_owned_partitions": Spec("int", 1, 2**31 - 1),
        "kafka_max_output_bytes": Spec("int", 1),
        "kafka_max_produce_records": Spec("int", 1),
        "kafka_max_rebalance_timeout": _SECONDS,
        "kafka_max_metadata_bytes": Spec("int", 1),
        "kafka_max_created_topics": Spec("int", 1),
    },
    "security": {
        "key": Spec("str"),
        "allow": Spec("str"),
        "tower_keys": Spec("strs"),
        "leaf_keys": Spec("strs"),
        "reload_interval": _SECONDS,
    },
    # Sub-tables (not sections of their own).
    "retention": {**_RETENTION, "topics": Spec("tables", table="retention.topic")},
    "retention.topic": dict(_RETENTION),
}
SECTIONS = ("node", "tower", "store", "gateway", "security")


def _unknown(what: str, name: str, valid: list[str], show: str = "{}") -> ConfigError:
    """``what``: "FILE: unknown section" or "FILE [store]: unknown key"; ``show`` formats names."""
    near = difflib.get_close_matches(name, valid, n=1)
    if near:
        hint = f"did you mean {show.format(near[0])}?"
    else:
        hint = "valid: " + ", ".join(show.format(v) for v in sorted(valid))
    return ConfigError(f"{what} {show.format(name)} ({hint})")


def check_table(data: dict[str, Any], schema: str, where: str) -> dict[str, Any]:
    """Check a table against ``SCHEMA[schema]``; the checked copy (numbers as floats where asked).

    ``where`` names the table in errors, e.g. ``"dafka.toml [store]"``.
    """
    specs = SCHEMA[schema]
    out: dict[str, Any] = {}
    for key, value in data.items():
        spec = specs.get(key)
        if spec is None:
            raise _unknown(f"{where}: unknown key", key, list(specs), "'{}'")
        here = f"{where} {key}"
        value = spec.check(value, here)
        if spec.kind == "table":
            value = check_table(value, spec.table, f"{where[:-1]}.{key}]" if where.endswith("]") else here)
        elif spec.kind == "tables":
            value = {
                name: check_table(
                    Spec("table").check(sub, f"{here}.{name}"),
                    spec.table,
                    f"{where[:-1]}.{key}.{name}]" if where.endswith("]") else f"{here}.{name}",
                )
                for name, sub in value.items()
            }
        out[key] = value
    return out


def check_settings(data: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Check a whole TOML document: known sections only, each checked (:func:`check_table`)."""
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name not in SECTIONS:
            owner = [s for s in SECTIONS if name in SCHEMA[s]]
            if owner and not isinstance(value, dict):
                raise ConfigError(f"{source}: {name!r} belongs in a section: write it under [{owner[0]}]")
            raise _unknown(f"{source}: unknown section", name, list(SECTIONS), "[{}]")
        out[name] = check_table(Spec("table").check(value, f"{source} [{name}]"), name, f"{source} [{name}]")
    return out


@dataclass(frozen=True, slots=True)
class TowerAddress:
    """Where a node finds one tower."""

    host: str = "127.0.0.1"
    in_port: int = DEFAULT_BEACON_IN_PORT
    out_port: int = DEFAULT_BEACON_OUT_PORT

    @property
    def beacon_in(self) -> str:
        """The endpoint nodes send their beacons to."""
        return f"tcp://{self.host}:{self.in_port}"

    @property
    def beacon_out(self) -> str:
        """The endpoint nodes read the tower's beacons from."""
        return f"tcp://{self.host}:{self.out_port}"

    @classmethod
    def parse(cls, text: str) -> TowerAddress:
        """``HOST[:IN_PORT[:OUT_PORT]]`` (``tcp://`` allowed) as a TowerAddress; ConfigError if malformed."""
        spec = text.strip()
        if spec.startswith("tcp://"):
            spec = spec[len("tcp://") :]
        parts = spec.split(":")
        try:
            if any(not p.strip() or " " in p for p in parts[1:]) or " " in parts[0]:
                raise ValueError("empty part")
            if len(parts) == 1:
                return cls(parts[0] or "127.0.0.1")
            if len(parts) == 2:
                port = parse_port(parts[1], minimum=1, maximum=65534)  # out = in + 1
                return cls(parts[0] or "127.0.0.1", port, port + 1)
            if len(parts) == 3:
                return cls(parts[0] or "127.0.0.1", parse_port(parts[1], minimum=1), parse_port(parts[2], minimum=1))
        except (ValueError, ConfigError):
            pass
        raise ConfigError(
            f"bad tower address {text!r}: use host, host:in_port or host:in_port:out_port (ports 1..65535)"
        )


def parse_towers(value: str | list[str] | tuple[str, ...]) -> tuple[TowerAddress, ...]:
    """Comma-separated (or listed) tower addresses; ConfigError when none."""
    items = value.split(",") if isinstance(value, str) else list(value)
    towers = tuple(TowerAddress.parse(item) for item in items if item.strip())
    if not towers:
        raise ConfigError("at least one tower is needed")
    return towers


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What every mesh node needs: its towers and how it is reached."""

    towers: tuple[TowerAddress, ...] = (TowerAddress(),)
    bind: str = "*"  # interface the node's data publisher binds (port is ephemeral)
    advertise: str = ""  # host put in beacons; "" lets the tower use the peer address
    beacon_interval: float = 1.0
    beacon_timeout: float = 4.0
    hwm: int = 100_000  # ZeroMQ high-water marks of the data sockets, in messages
    security: SecurityConfig | None = None  # None: plain mode (as the C reference)
    # Plain mesh: records go out in batches to readers that all take them (dafka
    # nodes; see dafka.core.audience).  False: always one record a message.
    batches: bool = True
    # Largest record content accepted, as Kafka's message.max.bytes: Producer.publish
    # and the Tank gateway's produce refuse bigger ones; consumers, stores and
    # gateways drop (and count) bigger ones read from the mesh.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        # The same checks as a [node] table: a config built in code is refused as early.
        specs = SCHEMA["node"]
        for f in fields(self):
            spec = specs.get(f.name)
            if spec is not None and spec.kind in ("int", "float", "bool", "str"):
                value = getattr(self, f.name)
                checked = spec.check(value, f"[node] {f.name}")
                if checked is not value and checked != value:
                    object.__setattr__(self, f.name, checked)
        if self.beacon_timeout <= self.beacon_interval:
            raise ConfigError(
                f"[node] beacon_timeout = {self.beacon_timeout:g} must be more than"
                f" beacon_interval = {self.beacon_interval:g} (peers would be dropped between beacons)"
            )

    def with_towers(self, towers: str | list[str] | None) -> NodeConfig:
        """This config with ``towers`` instead of its own (unchanged when ``towers`` is empty)."""
        return self if not towers else replace(self, towers=parse_towers(towers))


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a TOML file can say, already merged with the environment."""

    node: NodeConfig = field(default_factory=NodeConfig)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_keys: frozenset[str] = frozenset()  # the keys the [node] table gave (bind given or not)

    def section(self, name: str) -> dict[str, Any]:
        """A copy of the TOML table ``name`` (empty if absent)."""
        return dict(self.sections.get(name, {}))


def node_config_from(data: dict[str, Any], base: NodeConfig | None = None, where: str = "[node]") -> NodeConfig:
    """A NodeConfig from a ``[node]`` table (checked against ``SCHEMA["node"]``)."""
    cfg = base or NodeConfig()
    kwargs = check_table(data, "node", where)
    if "towers" in kwargs:
        kwargs["towers"] = parse_towers(kwargs["towers"])
    try:
        return replace(cfg, **kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where[: -len('[node]')]}{exc}") from None


def parse_max_record_bytes(value: Any) -> int:
    """A ``max_record_bytes`` setting: a whole number of bytes from 1 to 2 GiB."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 31:
        raise ConfigError(f"[node] max_record_bytes must be a whole number of bytes from 1 to {1 << 31}, not {value!r}")
    return value


_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian, with a BOM)"),
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian, with a BOM)"),
    (b"\xff\xfe", "UTF-16 (little-endian, with a BOM)"),
    (b"\xfe\xff", "UTF-16 (big-endian, with a BOM)"),
)


def config_text(raw: bytes, path: str) -> str:
    """A config file's bytes as text: UTF-8, as TOML requires; a UTF-8 BOM is skipped.

    Some Windows editors save "UTF-8 with BOM" (accepted, the BOM ignored) or
    UTF-16 ("Unicode"): that, or any other encoding, is one error naming the
    file and the encoding found.
    """
    for bom, name in _WIDE_BOMS:
        if raw.startswith(bom):
            raise ConfigError(f"config {path} is {name}, not UTF-8: save it as UTF-8")
    head = raw[:64]
    if len(head) >= 4 and b"\x00" in head:
        # No BOM, but NUL bytes where ASCII text would be: UTF-16 or UTF-32.
        zeros = [i % 4 for i, byte in enumerate(head) if byte == 0]
        if len(zeros) * 4 >= len(head) * 3 - 4:
            kind = "UTF-32"
        elif all(i % 2 == 0 for i in zeros):
            kind = "UTF-16 (big-endian)"
        elif all(i % 2 == 1 for i in zeros):
            kind = "UTF-16 (little-endian)"
        else:
            kind = "binary data with NUL bytes"
        raise ConfigError(f"config {path} looks like {kind}, not UTF-8: save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"config {path} is not UTF-8 (byte 0x{raw[exc.start]:02x} on line {line}; perhaps Latin-1 or"
            " another legacy encoding): save it as UTF-8"
        ) from None


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Read the TOML file (if any) and apply ``$DAFKA_TOWERS``."""
    path = path or os.environ.get("DAFKA_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        try:
            data = tomllib.loads(config_text(raw, str(path)))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
        data = check_settings(data, str(path))
    node = node_config_from(data.get("node", {}), where=f"{path} [node]" if path else "[node]")
    env_towers = os.environ.get("DAFKA_TOWERS")
    if env_towers:
        node = node.with_towers(env_towers)
    if data.get("security"):
        node = replace(node, security=security_from(data["security"]))
    sections = {k: v for k, v in data.items() if k != "node" and isinstance(v, dict)}
    return Settings(node=node, sections=sections, node_keys=frozenset(data.get("node", {})))


def default_node_config() -> NodeConfig:
    """What a node embedded without a config uses: ``$DAFKA_CONFIG`` / ``$DAFKA_TOWERS``, else defaults."""
    return load_settings().node


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only exposes the machine itself ("*" does not)."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a host name


MAX_TOPIC_BYTES = 255  # the mesh's topic frames and Tank's str8


def parse_topic(text: str) -> str:
    """A topic name the mesh and the Tank port take: 1..255 bytes of UTF-8 without NUL.

    (The Kafka port takes fewer: Kafka's own rule, see docs/reference/cli.md.)
    """
    size = len(text.encode("utf-8", "surrogateescape"))
    if not text:
        raise ConfigError("bad topic '': a topic name is 1 to 255 bytes")
    if size > MAX_TOPIC_BYTES:
        raise ConfigError(f"bad topic {shorten(text)}: {size} bytes, at most {MAX_TOPIC_BYTES}")
    if "\x00" in text:
        raise ConfigError(f"bad topic {shorten(text)}: it holds a NUL character")
    return text


def shorten(text: str, keep: int = 40) -> str:
    """``text`` quoted, cut to its first ``keep`` characters when longer (bad input is not echoed whole)."""
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


def parse_port(text: str | int, *, minimum: int = 0, maximum: int = 65535) -> int:
    """A TCP port number in ``minimum..maximum`` (0 lets a server pick a free one)."""
    try:
        port = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"bad port {text!r}: not a number") from None
    if not minimum <= port <= maximum:
        raise ConfigError(f"bad port {port}: must be in {minimum}..{maximum}")
    return port


def parse_listen(text: str, default_port: int, *, minimum_port: int = 0) -> tuple[str, int]:
    """A server address ``HOST:PORT``, ``HOST`` or ``:PORT`` as (host, port).

    Ports must be in ``minimum_port..65535``; 0 (for a server) means any free port.
    """
    text = str(text).strip()
    if text.isdigit():
        # A port alone is not a host name (it would read as an IPv4 address in integer form).
        raise ConfigError(f"bad address {text!r}: expected HOST:PORT (for a port alone, write :{text})")
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    host = host.strip("[]")  # [::1]:PORT
    if " " in host or (not host and not port):
        raise ConfigError(f"bad address {text!r}: expected HOST:PORT")
    try:
        return host or "127.0.0.1", parse_port(port, minimum=minimum_port) if port else default_port
    except ConfigError as exc:
        raise ConfigError(f"bad address {text!r}: {exc}") from None


def _resolves_to_loopback(host: str) -> bool:
    """Whether a tower's host is this machine's loopback (a name is resolved; unresolvable: no)."""
    if is_loopback(host):
        return True
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(host.strip("[]"))
        return False  # an address, not loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def loopback_trap(cfg: NodeConfig, bound_host: str, what: str = "node") -> str | None:
    """Why a node bound to ``bound_host`` could not be reached, or None.

    The one rule of where nodes listen: a node whose towers are all on this
    machine's loopback may listen on loopback; with a tower on another host it
    must listen where that host's nodes reach it.  So a node bound to loopback
    only, with a tower elsewhere, is refused (unless ``advertise`` names a
    non-loopback host: a forwarded port, NAT).
    """
    if not is_loopback(bound_host) or (cfg.advertise and not is_loopback(cfg.advertise)):
        return None
    elsewhere = [t.host for t in cfg.towers if not _resolves_to_loopback(t.host)]
    if not elsewhere:
        return None
    addr = "ADDR: this host's address that peers reach, or '*'"
    fix = f"pass --bind ADDR ({addr})" + (
        " with --insecure, or configure [security] (see `dafka keys`)" if cfg.security is None else ""
    )
    return (
        f"this {what} would listen on {bound_host} only, but its tower {elsewhere[0]} is on another host,"
        f" so nodes there could not reach it: {fix}; in a config file, [node] bind"
    )
