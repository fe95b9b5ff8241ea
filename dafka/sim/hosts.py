"""What the scheduler and the invariants share: the simulated machines and a view of the world.

:mod:`dafka.sim.world` runs the hosts; :mod:`dafka.sim.invariants` reads them
through :class:`WorldView`.  Both import this module, neither imports the
other's (the checker is written against the view, not the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from dafka.sim.nodes import SimConsumer, SimProducer, SimStore


@dataclass
class StoreHost:
    """A store's machine: its directory outlives the store process."""

    name: str
    path: str
    store: SimStore | None = None
    incarnation: int = 0
    disk_full_until: float = 0.0
    commit_at: float | None = None
    stopped_until: float = 0.0  # SIGSTOPped: reads, commits and timers wait until then
    away_until: float = 0.0  # cut off past skip_after (an ``offline`` step): counts as down
    waiting: list[list[bytes]] = field(default_factory=list)  # sent to it while stopped


@dataclass
class ConsumerHost:
    name: str
    node: SimConsumer | None = None
    incarnation: int = 0


@dataclass
class ProducerHost:
    name: str
    ring: bool
    address: str
    node: SimProducer | None = None
    incarnation: int = 0
    saved: tuple[int, int, int] | None = None  # the identity file: (acked, next, reserved)
    device: bool = False  # an edge device: its outbox directory is ``path``
    path: str = ""
    commit_at: float | None = None  # a device's outbox commit finishes then


class WorldView(Protocol):
    """What the invariants read of a running world."""

    step_index: int
    now: float
    topic: str
    stores: list[StoreHost]
    consumers: list[ConsumerHost]
    producers: list[ProducerHost]
    partition_names: dict[str, str]  # partition address -> producer name

    def host(self, name: str) -> Any: ...
