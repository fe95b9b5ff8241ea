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
