"""The main services in one process, for ``dafka up`` / ``make run``.

A tower on the standard ports, plus a store and a Tank gateway when those
components are available, all bound to loopback with data under ``./var``.

``dafka up --secure`` runs the same services as a CURVE-secured mesh: key
pairs made once under ``DATA/keys`` (tower, store, gateway, a producer key
``app`` and a consumer key ``dash``), the allow-list ``DATA/allow`` (their
public certificates), and two client configurations, ``DATA/producer.toml``
and ``DATA/consumer.toml``, that any ``dafka`` command or embedded node can
use (``dafka --config var/secure/producer.toml produce TOPIC`` after
``dafka up --secure --data var/secure``).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from dafka.config import Settings, TowerAddress, parse_listen
from dafka.errors import ConfigError, DafkaError
from dafka.nodes import security
from dafka.nodes.security import SecurityConfig
from dafka.nodes.tower import Tower

log = logging.getLogger("dafka.services")


class Services:
    """Start the tower (and store/gateway) on ``bind``; close them in reverse order."""

    def __init__(
        self, settings: Settings, *, data_dir: str = "var", bind: str = "127.0.0.1", secure: bool = False
    ) -> None:
        self.settings = settings
        self.data_dir = Path(data_dir)
        self.bind = bind
        self.secure = secure
        self.started: list[tuple[str, Any]] = []
        self.notes: list[str] = []

    def __enter__(self) -> Services:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        section = self.settings.section("tower")
        in_port = int(section.get("beacon_in_port", 5556))
        out_port = int(section.get("beacon_out_port", 5557))
        address = TowerAddress(self.bind if self.bind not in ("*", "0.0.0.0") else "127.0.0.1", in_port, out_port)
        plain_before = self.secure and not (self.data_dir / "keys").exists() and any(
            (self.data_dir / name / "data.mdb").exists() for name in ("store", "gateway")
        )
        keys = secure_mesh(self.data_dir, address) if self.secure else {}
        tower = Tower(self.bind, in_port, out_port, keys.get("tower"))
        tower.start()
        mode = " (secure)" if self.secure else ""
        self.started.append(
            (f"tower      beacons in tcp://{self.bind}:{in_port}, out tcp://{self.bind}:{out_port}{mode}", tower)
        )
        node = replace(self.settings.node, towers=(address,), bind=self.bind)
        if self.secure:
            self.notes = [
                f"keys       {self.data_dir / 'keys'}, allow-list {self.data_dir / 'allow'}",
                f"clients    dafka --config {self.data_dir / 'producer.toml'} produce TOPIC  (producer key app)",
                f"           dafka --config {self.data_dir / 'consumer.toml'} consume TOPIC  (consumer key dash)",
            ]
        if plain_before:
            self.notes.append(
                f"note       {self.data_dir} holds the store of a plain mesh: its records are on this secure mesh"
                " too; start on a fresh --data folder to keep them apart"
            )
        for starter in _STARTERS:
            try:
                role = starter.__name__.removeprefix("_start_")
                self.started.append(starter(self.settings, replace(node, security=keys.get(role)), self.data_dir))
            except Exception:
                self.__exit__()
                raise
        return self

    def describe(self) -> list[str]:
        """One line per service started (and, when secure, where the keys and client configs are)."""
        return [name for name, _ in self.started] + self.notes

    def __exit__(self, *exc: object) -> None:
        while self.started:
            name, service = self.started.pop()
            try:
                service.close()
            except Exception:
                log.exception("closing %s failed", name.split()[0])


# The keys of `dafka up --secure`: (name, role).  The services use the first
# three; "app" and "dash" are for the user's producers and consumers.
SECURE_KEYS = (("tower", "tower"), ("store", "store"), ("gateway", "gateway"), ("app", "producer"), ("dash", "consumer"))
CLIENT_CONFIGS = {"producer.toml": "app", "consumer.toml": "dash"}


def secure_mesh(data_dir: Path, tower: TowerAddress) -> dict[str, SecurityConfig]:
    """Make (once) the keys and allow-list of a secure ``dafka up`` and write its client configs.

    Key pairs already under ``DATA/keys`` are kept, so clients configured
    before a restart stay allowed; the allow-list gets every public key of
    :data:`SECURE_KEYS` (keys copied there by hand stay).  Returns the
    security settings of the tower, the store and the gateway.
    """
    keys, allow = (data_dir / "keys").resolve(), (data_dir / "allow").resolve()
    for name, role in SECURE_KEYS:
        public, secret = keys / f"{name}.key", keys / f"{name}.key_secret"
        if public.exists() != secret.exists():
            raise ConfigError(f"{keys}: {name}.key and {name}.key_secret go together; one is missing")
        if not public.exists():
            security.new_keys(name, role, keys)
        elif security.read_certificate(public).role != role:
            raise ConfigError(f"{public} is not a {role} key; move it away to have a new one made")
        security.private_secret(secret)
    allow.mkdir(parents=True, exist_ok=True)
    for name, _ in SECURE_KEYS:
        shutil.copyfile(keys / f"{name}.key", allow / f"{name}.key")
    tower_key = security.parse_key(str(allow / "tower.key"))
    for filename, name in CLIENT_CONFIGS.items():
        (data_dir / filename).write_text(
            f"# Written by `dafka up --secure` (again at each start): the key {name!r} on its mesh.\n"
            "[node]\n"
            f'towers = ["{tower.host}:{tower.in_port}:{tower.out_port}"]\n'
            "[security]\n"
            f'key = "{keys / (name + ".key_secret")}"\n'
            f'allow = "{allow}"\n'
            f'tower_keys = ["{allow / "tower.key"}"]\n',
            encoding="utf-8",
        )
    return {
        name: SecurityConfig(str(keys / f"{name}.key_secret"), str(allow), (tower_key,))
        for name in ("tower", "store", "gateway")
    }


def _start_store(settings: Settings, node: Any, data_dir: Path) -> tuple[str, Any]:
    from dafka.store.node import Store, linger_setting

    section = settings.section("store")
    db = section.get("db") or str(data_dir / "store")
    store = Store(db, node, sync=bool(section.get("sync", True)), linger=linger_setting(section))
    return f"store      {store.address} db {db}", store


def _start_gateway(settings: Settings, node: Any, data_dir: Path) -> tuple[str, Any]:
    from dafka.tank.gateway import DEFAULT_PORT, Gateway
    from dafka.tank.limits import GatewayLimits

    section = settings.section("gateway")
    db = section.get("db") or str(data_dir / "gateway")
    host = node.bind if node.bind not in ("*", "0.0.0.0") else "127.0.0.1"
    listen = parse_listen(section.get("listen", f"{host}:{DEFAULT_PORT}"), DEFAULT_PORT)
    try:
        gateway = Gateway(
            db, node, listen=listen, sync=bool(section.get("sync", True)), limits=GatewayLimits.from_settings(section)
        )
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise DafkaError(f"cannot listen on {listen[0]}:{listen[1]} for the Tank gateway: {exc.strerror or exc}") from None
    return f"gateway    Tank on {listen[0]}:{gateway.tank_port}, db {db}", gateway


# Components register a starter: (settings, node_config, data_dir) -> (description, service).
_STARTERS: list[Any] = [_start_store, _start_gateway]
