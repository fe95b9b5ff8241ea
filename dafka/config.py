"""Configuration: defaults, TOML files, environment variables.

Precedence, lowest first: built-in defaults, the TOML file (``--config`` or
``$DAFKA_CONFIG``), environment variables (``$DAFKA_TOWERS``), command-line
flags.  A tower is named ``host`` (ports 5556/5557), ``host:in_port`` (out is
in + 1) or ``host:in_port:out_port``; ``tcp://`` prefixes are accepted.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dafka.errors import ConfigError
from dafka.security import SecurityConfig, security_from

DEFAULT_BEACON_IN_PORT = 5556  # tower XSUB: node beacons in
DEFAULT_BEACON_OUT_PORT = 5557  # tower XPUB: tower beacons out


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
    # nodes; see dafka.audience).  False: always one record a message.
    batches: bool = True

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


_NODE_KEYS = {"towers", "bind", "advertise", "beacon_interval", "beacon_timeout", "hwm", "batches"}


def node_config_from(data: dict[str, Any], base: NodeConfig | None = None) -> NodeConfig:
    """A NodeConfig from a ``[node]`` table over ``base``; ConfigError for unknown keys or bad values."""
    cfg = base or NodeConfig()
    unknown = set(data) - _NODE_KEYS
    if unknown:
        raise ConfigError(f"unknown [node] keys: {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    if "towers" in data:
        kwargs["towers"] = parse_towers(data["towers"])
    for key in ("bind", "advertise"):
        if key in data:
            kwargs[key] = str(data[key])
    for key in ("beacon_interval", "beacon_timeout"):
        if key in data:
            kwargs[key] = float(data[key])
    if "hwm" in data:
        kwargs["hwm"] = int(data["hwm"])
    if "batches" in data:
        if not isinstance(data["batches"], bool):
            raise ConfigError(f"[node] batches must be true or false, not {data['batches']!r}")
        kwargs["batches"] = data["batches"]
    return replace(cfg, **kwargs)


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Read the TOML file (if any) and apply ``$DAFKA_TOWERS``."""
    path = path or os.environ.get("DAFKA_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            with Path(path).open("rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    node = node_config_from(data.get("node", {}))
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
