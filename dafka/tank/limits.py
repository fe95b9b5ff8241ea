"""What a Tank client may make the gateway hold: the limits and their pure rules.

The Tank protocol has no authentication, so every client is a possible
attacker.  These limits bound what one connection, and all of them together,
can make the gateway hold or wait for:

* ``max_connections``: connections open at once; more are accepted and closed
  at once (logged).
* ``max_request_bytes``: the largest request frame; a frame announcing more is
  refused as soon as its 5-byte header is read, before its payload is taken.
* ``max_buffered_bytes``: request bytes in flight over all connections.  A
  request over 64 KiB reserves its announced size when its header arrives;
  when the reservations would pass this, its connection is not read until
  others finish (logged).
* ``min_request_rate`` and ``request_timeout``: a frame in flight must keep
  arriving: silence of ``request_timeout`` seconds half way through a frame,
  or, once it has been in flight that long, fewer than ``min_request_rate``
  bytes a second on average since it began, closes the connection
  (slow-loris senders).  And while a request has waited ``request_timeout``
  seconds for the ``max_buffered_bytes`` budget, the slowest frame holding a
  reservation is cut, one per ``request_timeout``: senders keeping just above
  ``min_request_rate`` cannot hold the budget for an hour.  An unsent answer that the client does not read for
  ``request_timeout`` seconds closes it too (on the Kafka port as well).
* ``max_answer_bytes``: record bytes in one consume answer (on top of the
  4 MiB per partition); ``max_output_bytes``: unsent answer bytes of one
  connection, past which its requests wait and its answers shrink;
  ``max_total_output_bytes``: unsent answer bytes of all connections together
  (else ``max_connections`` clients that never read could make the gateway hold
  that many times ``max_output_bytes``): past it, a connection holding answers
  is not read until they go, and answers shrink to what still fits (one record
  at least for a connection holding none).
* ``max_partitions_per_topic``: CreateTopic above it is refused (error 10).
* ``max_owned_partitions``: partitions of topics the gateway created (Tank
  CreateTopic, Kafka CreateTopics and auto-creation), all topics together; a
  creation past it is refused.  Each costs a HEAD every announce interval and
  a line of the partition map, so the count of topics must be bounded too.

The Kafka port shares ``request_timeout`` and the partition limits, and has
its own (``kafka_`` keys):

* ``kafka_max_output_bytes``: answer bytes held for Kafka clients, over all
  connections: unsent, or ready behind an answer that is not.  Past it, a
  connection with answers of its own held is not read until they drain, and
  fetch answers shrink to what still fits (one record at least).
* ``kafka_max_produce_records``: records one produce request may carry, all
  its partitions together (counted from the batch headers before anything is
  decoded); a partition past it is answered MESSAGE_TOO_LARGE.
* ``kafka_max_rebalance_timeout``: seconds a JoinGroup's rebalance timeout
  may hold a group's rebalance; longer ones are cut to it.
* ``kafka_max_metadata_bytes``: bytes of one Metadata answer, estimated
  from the partition counts before it is built (each topic named once,
  however often a request names it); topics past it are answered
  POLICY_VIOLATION without their partitions.
* ``kafka_max_created_topics``: topics one request may create (Metadata
  auto-creation, CreateTopics); the rest are answered LEADER_NOT_AVAILABLE
  (auto-creation: the client asks again) or THROTTLING_QUOTA_EXCEEDED.

Every limit is a key of the ``[gateway]`` TOML table; ``dafka gateway`` also
takes each as a flag (``--max-connections`` ...).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from dafka.errors import ConfigError

#: The limits given in seconds (floats; an integer in TOML is taken too).
_SECONDS = ("request_timeout", "kafka_max_rebalance_timeout")
#: A request frame at most this large needs no reservation of the in-flight budget.
SMALL_REQUEST = 64 << 10


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """Limits of the gateway's Tank and Kafka ports (see the module doc); defaults documented in README."""

    max_connections: int = 256
    max_request_bytes: int = 64 << 20
    max_buffered_bytes: int = 256 << 20
    min_request_rate: int = 16 << 10  # bytes a second
    request_timeout: float = 30.0  # seconds
    max_answer_bytes: int = 16 << 20
    max_output_bytes: int = 32 << 20
    max_total_output_bytes: int = 256 << 20
    max_partitions_per_topic: int = 1024
    max_owned_partitions: int = 65536
    kafka_max_output_bytes: int = 256 << 20
    kafka_max_produce_records: int = 500_000
    kafka_max_rebalance_timeout: float = 300.0  # seconds
    kafka_max_metadata_bytes: int = 8 << 20
    kafka_max_created_topics: int = 100

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = float if f.type in ("float", float) else int
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and not isinstance(value, int)
            ):
                raise ConfigError(f"[gateway] {f.name} must be a number, not {value!r}")
            minimum = 0 if f.name == "min_request_rate" else 1
            if kind is float and not value > 0:
                raise ConfigError(f"[gateway] {f.name} must be more than 0, not {value!r}")
            if kind is int and value < minimum:
                raise ConfigError(f"[gateway] {f.name} must be {minimum} or more, not {value!r}")
        if self.max_partitions_per_topic > 0xFFFE:
            raise ConfigError("[gateway] max_partitions_per_topic must be at most 65534 (Tank partition ids are u16)")
        if self.max_request_bytes > self.max_buffered_bytes:
            raise ConfigError(
                f"[gateway] max_request_bytes ({self.max_request_bytes}) must not be over "
                f"max_buffered_bytes ({self.max_buffered_bytes}): such a request could never be read"
            )

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The ``[gateway]`` keys these limits read."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_settings(cls, section: dict[str, Any], args: argparse.Namespace | None = None) -> GatewayLimits:
        """From the ``[gateway]`` table, then flags (``args.max_connections`` ...) that were given."""
        given: dict[str, Any] = {}
        for name in cls.keys():
            if name in section:
                value = section[name]
                if name in _SECONDS and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                given[name] = value
            flag = getattr(args, name, None) if args is not None else None
            if flag is not None:
                given[name] = flag
        return replace(cls(), **given) if given else cls()


def too_slow(received: int, in_flight: float, limits: GatewayLimits) -> bool:
    """Whether a frame in flight for ``in_flight`` seconds with ``received`` bytes of it is too slow.

    Judged only once it has been in flight ``request_timeout`` seconds: from
    then on it must have come at ``min_request_rate`` bytes a second on average.
    """
    return in_flight >= limits.request_timeout and received < limits.min_request_rate * in_flight


def slowest_holder(holders: list[tuple[int, float]]) -> int | None:
    """Which reservation holder to cut while requests wait for the budget: the index of the
    one with the lowest average rate so far among ``(received bytes, seconds in flight)``
    (None if there is none)."""
    best, best_rate = None, 0.0
    for i, (received, in_flight) in enumerate(holders):
        rate = received / max(in_flight, 1e-3)
        if best is None or rate < best_rate:
            best, best_rate = i, rate
    return best


def answer_budget(out_size: int, limits: GatewayLimits, held: int = 0) -> int:
    """Record bytes one consume answer may carry on a connection with ``out_size`` bytes unsent,
    when all connections hold ``held``: past ``max_total_output_bytes`` a connection holding none
    still gets 1 (one record: it makes progress), one holding some gets 0."""
    room = limits.max_total_output_bytes - held
    if out_size == 0:
        room = max(room, 1)
    return max(0, min(limits.max_answer_bytes, limits.max_output_bytes - out_size, room))
