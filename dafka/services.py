"""The main services in one process, for ``dafka up`` / ``make run``.

A tower on the standard ports, plus a store and a Tank gateway when those
components are available, all bound to loopback with data under ``./var``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from dafka.config import Settings, TowerAddress, parse_listen
from dafka.errors import DafkaError
from dafka.tower import Tower

log = logging.getLogger("dafka.services")


class Services:
    """Start the tower (and store/gateway) on ``bind``; close them in reverse order."""

    def __init__(self, settings: Settings, *, data_dir: str = "var", bind: str = "127.0.0.1") -> None:
        self.settings = settings
        self.data_dir = Path(data_dir)
        self.bind = bind
        self.started: list[tuple[str, Any]] = []

    def __enter__(self) -> Services:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        section = self.settings.section("tower")
        in_port = int(section.get("beacon_in_port", 5556))
        out_port = int(section.get("beacon_out_port", 5557))
        tower = Tower(self.bind, in_port, out_port)
        tower.start()
        self.started.append((f"tower      beacons in tcp://{self.bind}:{in_port}, out tcp://{self.bind}:{out_port}", tower))
        node = replace(
            self.settings.node,
            towers=(TowerAddress(self.bind if self.bind not in ("*", "0.0.0.0") else "127.0.0.1", in_port, out_port),),
            bind=self.bind,
        )
        for starter in _STARTERS:
            try:
                self.started.append(starter(self.settings, node, self.data_dir))
            except Exception:
                self.__exit__()
                raise
        return self

    def describe(self) -> list[str]:
        return [name for name, _ in self.started]

    def __exit__(self, *exc: object) -> None:
        while self.started:
            name, service = self.started.pop()
            try:
                service.close()
            except Exception:
                log.exception("closing %s failed", name.split()[0])


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
