"""What a request handler of :class:`~dafka.kafka.serving.KafkaServer` returns (its own module:
the handlers' mixins, :mod:`dafka.kafka.txn_api`, use it without importing the server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: An encoded answer: one byte string, or several to send back to back (a fetch's).
Data = bytes | list[bytes]


@dataclass(slots=True)
class Outcome:
    """What to do with a request's answer.

    ``data`` is the encoded answer, sent at once unless ``needs`` (committed
    head each partition must reach first) or ``park`` (a fetch to retry) is
    set; ``data`` None with neither: no answer (acks 0), or one that comes
    later from the group coordinator.  A fetch's answer is a list of byte
    strings to send back to back (its record sets are not copied into one).
    """

    data: Data | None = None
    needs: dict[tuple[str, str], int] | None = None
    park: ParkedFetch | None = None


@dataclass(slots=True)
class ParkedFetch:
    correlation_id: int
    version: int
    request: Any
    deadline: float  # monotonic seconds
    keys: list[tuple[str, str]]
    min_bytes: int
    #: Record bytes of its answer when it parked (the partitions not at their end).
    size: int = 0
    #: Each partition it waits on, as it was when it parked: ``(head, stored bytes, byte
    #: limit in this answer)`` (:meth:`dafka.kafka.serving.KafkaServer.retry_fetch`).
    marks: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)
