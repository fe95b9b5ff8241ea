"""What a producer offers its outbox: the interface :class:`dafka.outbox.Outbox` is written against.

The producer owns the partition (its address, its in-memory window of unacknowledged records, the
lock that guards it) and the sockets; the outbox owns the disk.  The outbox takes over the window,
checks records the producer's way before it writes them, sends what it made durable through the
producer, and stops its beacons when another process took the outbox over.  The producer
(:mod:`dafka.nodes.producer`) implements this with a small adapter; the outbox never sees the
producer itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from dafka.core.unacked import UnackedWindow
from dafka.errors import ResumeError


class OutboxHost(Protocol):
    """What a producer offers a durable queue of its records."""

    @property
    def address(self) -> str:
        """The partition's address."""

    @property
    def window(self) -> UnackedWindow:
        """The producer's window of unacknowledged records (the outbox may replace it on attach)."""

    @window.setter
    def window(self, window: UnackedWindow) -> None: ...

    @property
    def lock(self) -> Any:
        """The lock guarding the window (a :class:`threading.Condition` is built on it)."""

    @property
    def publish_timeout(self) -> float | None:
        """How long a publish waits for room by default (None: forever)."""

    @property
    def closed(self) -> bool:
        """Whether the producer is closed."""

    @property
    def resume_error(self) -> ResumeError | None:
        """Why the producer could not resume its partition (None: it did, or had nothing to resume)."""

    def prepare(self, batch: list[Any]) -> list[bytes]:
        """The records as bytes, checked as the producer's own publish checks them (raises, nothing published)."""

    def send_live(self, first: int, contents: Sequence[bytes]) -> None:
        """Send records ``first..`` to the live readers (the window's lock held)."""

    def hold_beacons(self) -> None:
        """Stop beaconing: the partition is no longer this producer's to announce."""


class ProducerPort:
    """The part of :class:`OutboxHost` every producer kind offers the same way (its
    partition, window, lock, timeout and state); a producer's port adds the rest."""

    __slots__ = ("_producer",)

    def __init__(self, producer: Any) -> None:
        self._producer = producer

    @property
    def address(self) -> str:
        return self._producer.address  # type: ignore[no-any-return]

    @property
    def window(self) -> UnackedWindow:
        return self._producer.window  # type: ignore[no-any-return]

    @window.setter
    def window(self, window: UnackedWindow) -> None:
        self._producer.window = window

    @property
    def lock(self) -> Any:
        return self._producer._lock

    @property
    def publish_timeout(self) -> float | None:
        return self._producer.publish_timeout  # type: ignore[no-any-return]

    @property
    def closed(self) -> bool:
        return self._producer._closed  # type: ignore[no-any-return]
