"""Offset planning for the Spark connector: plain functions, no Spark, no I/O.

Offsets
=======

A Dafka partition is one producer's stream (named by the producer address);
its records have contiguous offsets from 0.  The connector's offset object
(what Spark checkpoints for a streaming query) is::

    {"topic": {"partition address": next offset to read, ...}, ...}

i.e. an *exclusive* end, like Spark's Kafka source.  Spark serialises it as
JSON and compares offsets as strings, so :func:`canonical` always emits topics
and partitions sorted.

A partition missing from a start offset is one that appeared after the query
started (a new producer): it is read from offset 0, so records that retention
removed before the query saw the partition count as data loss, as in Spark's
Kafka source.

``startingOffsets`` / ``endingOffsets``
=======================================

``earliest``, ``latest`` or JSON ``{"topic": {"partition": offset}}`` where
``-2`` means earliest and ``-1`` latest, as with Kafka.  A topic may also map
to one number applied to all its partitions (``{"t": -2}``), which is handy
because Dafka partitions are producer addresses nobody knows in advance.
Partitions a JSON spec does not name start at earliest and end at latest.

Admission control
=================

:func:`admit` caps a micro-batch at ``max_rows`` records in total, shared
across partitions by water-filling: partitions with a smaller backlog get all
of it, the rest is split evenly among the others (deterministic ties by
topic and partition).  The batch therefore holds exactly
``min(max_rows, total backlog)`` records, which keeps batch sizes predictable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from dafka.errors import DafkaError

__all__ = [
    "EARLIEST",
    "LATEST",
    "DataLossError",
    "Loss",
    "OffsetSpec",
    "Offsets",
    "PartitionState",
    "ReadRange",
    "admit",
    "canonical",
    "cap",
    "latest_offsets",
    "parse_offset_spec",
    "plan_ranges",
    "resolve",
    "split_range",
]

EARLIEST = -2
LATEST = -1

#: ``{topic: {partition: offset}}``.
Offsets = dict[str, dict[str, int]]


class DataLossError(DafkaError):
    """Records a query should read were removed (retention) before it read them."""


class PartitionState(NamedTuple):
    """What a transport reports about one partition.

    ``first`` is the oldest offset still stored and ``next`` the head + 1
    (``first == next`` when nothing is stored).  ``pid`` is the gateway's
    Tank partition id (None for the local-store transport).
    """

    topic: str
    partition: str
    first: int
    next: int
    pid: int | None = None


class ReadRange(NamedTuple):
    """Records ``[start, end)`` of one partition: one Spark input partition."""

    topic: str
    partition: str
    start: int
    end: int
    pid: int | None = None


class Loss(NamedTuple):
    """Offsets ``[start, end)`` of a partition that were removed before being read."""

    topic: str
    partition: str
    start: int
    end: int

    def describe(self) -> str:
        return (
            f"records {self.start}..{self.end - 1} of {self.topic}/{self.partition} were "
            "removed (retention) before they were read"
        )


@dataclass(frozen=True)
class OffsetSpec:
    """A parsed ``startingOffsets``/``endingOffsets`` value.

    ``default`` (EARLIEST or LATEST) applies to every partition not named in
    ``topics``; ``topics[t]`` is either one number for all of ``t``'s
    partitions or a per-partition mapping.
    """

    default: int
    topics: Mapping[str, int | Mapping[str, int]]

    def for_partition(self, topic: str, partition: str, fallback: int) -> int:
        """The requested offset (or EARLIEST/LATEST) of one partition."""
        spec = self.topics.get(topic)
        if spec is None:
            return self.default
        if isinstance(spec, int):
            return spec
        return spec.get(partition, fallback)


def _check_offset(value: object, where: str, option: str, ending: bool) -> int:
    # bool is an int subclass: reject it explicitly.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"option {option!r}: offset of {where} must be an integer, not {value!r}")
    if value < EARLIEST:
        raise ValueError(f"option {option!r}: offset {value} of {where} is negative")
    if ending and value == EARLIEST:
        raise ValueError(f"option {option!r}: earliest (-2) is not a valid ending offset ({where})")
    return value


def parse_offset_spec(
    text: str | None, option: str, topics: Iterable[str], *, default: str, ending: bool = False
) -> OffsetSpec:
    """Parse ``startingOffsets`` (``ending=False``) or ``endingOffsets``.

    ``topics`` are the subscribed topics: a JSON spec naming another topic is
    an error, as is ``earliest`` for an ending offset.
    """
    value = (text if text is not None else default).strip()
    lowered = value.lower()
    if lowered == "earliest":
        if ending:
            raise ValueError(f"option {option!r}: 'earliest' is not a valid ending offset")
        return OffsetSpec(EARLIEST, {})
    if lowered == "latest":
        return OffsetSpec(LATEST, {})
    try:
        data = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(
            f"option {option!r}: expected earliest, latest or JSON "
            f'{{"topic": {{"partition": offset}}}}, got {value!r}'
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"option {option!r}: the JSON must be an object of topics, got {value!r}")
    subscribed = set(topics)
    out: dict[str, int | dict[str, int]] = {}
    for topic, spec in data.items():
        if topic not in subscribed:
            raise ValueError(
                f"option {option!r} names topic {topic!r}, which is not subscribed "
                f"(subscribe={','.join(sorted(subscribed))})"
            )
        if isinstance(spec, dict):
            out[topic] = {
                str(p): _check_offset(o, f"{topic}/{p}", option, ending) for p, o in spec.items()
            }
        else:
            out[topic] = _check_offset(spec, topic, option, ending)
    # Partitions not named: start at earliest, end at latest.
    return OffsetSpec(LATEST if ending else EARLIEST, out)


def canonical(offsets: Mapping[str, Mapping[str, int]]) -> Offsets:
    """The same offsets with topics and partitions in sorted order (Spark compares JSON)."""
    return {t: {p: int(offsets[t][p]) for p in sorted(offsets[t])} for t in sorted(offsets)}


def resolve(spec: OffsetSpec, parts: Iterable[PartitionState], *, ending: bool = False) -> Offsets:
    """Concrete offsets of ``parts`` for ``spec``.

    EARLIEST is a partition's ``first``, LATEST its ``next``.  A starting
    offset past ``next`` is kept (the query waits for those records); an
    ending offset is capped at ``next`` (a batch cannot read the future).
    """
    out: dict[str, dict[str, int]] = {}
    fallback = LATEST if ending else EARLIEST
    for st in parts:
        want = spec.for_partition(st.topic, st.partition, fallback)
        if want == EARLIEST:
            off = st.first
        elif want == LATEST:
            off = st.next
        else:
            off = min(want, st.next) if ending else want
        out.setdefault(st.topic, {})[st.partition] = off
    return canonical(out)


def latest_offsets(parts: Iterable[PartitionState]) -> Offsets:
    """``next`` of every partition."""
    out: dict[str, dict[str, int]] = {}
    for st in parts:
        out.setdefault(st.topic, {})[st.partition] = st.next
    return canonical(out)


def cap(latest: Offsets, target: Mapping[str, Mapping[str, int]]) -> Offsets:
    """``latest`` limited to ``target`` (``availableNow``): partitions absent
    from ``target`` appeared after it was taken and are left out."""
    out: dict[str, dict[str, int]] = {}
    for topic, parts in latest.items():
        tparts = target.get(topic)
        if not tparts:
            continue
        for partition, off in parts.items():
            if partition in tparts:
                out.setdefault(topic, {})[partition] = min(off, int(tparts[partition]))
    return canonical(out)


def _get(offsets: Mapping[str, Mapping[str, int]], topic: str, partition: str) -> int | None:
    parts = offsets.get(topic)
    if parts is None:
        return None
    value = parts.get(partition)
    return None if value is None else int(value)


def admit(
    start: Mapping[str, Mapping[str, int]],
    latest: Mapping[str, Mapping[str, int]],
    firsts: Mapping[tuple[str, str], int],
    max_rows: int | None,
) -> Offsets:
    """The end offset of the next micro-batch.

    ``start`` is where the batch begins (partitions missing from it start at
    0), ``latest`` what is stored now, ``firsts`` the oldest stored offset of
    each partition (records below it were removed and will not be read, so
    they do not count against the budget).  ``max_rows`` None admits
    everything.

    Offsets never move backwards, and partitions without admitted records are
    left as they are in ``start`` (a new partition with nothing admitted is
    not added), so "no new data" returns ``start`` unchanged.
    """
    if max_rows is not None and max_rows <= 0:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    end: dict[str, dict[str, int]] = {t: dict(p) for t, p in start.items()}
    backlog: list[tuple[int, str, str, int]] = []  # (records, topic, partition, from)
    for topic, parts in latest.items():
        for partition, head in parts.items():
            begin = _get(start, topic, partition)
            known = begin is not None
            begin = begin if known else 0
            readable_from = max(begin, firsts.get((topic, partition), 0))
            count = int(head) - readable_from
            if count > 0:
                backlog.append((count, topic, partition, readable_from))
    if max_rows is None:
        for count, topic, partition, frm in backlog:
            end.setdefault(topic, {})[partition] = frm + count
        return canonical(end)
    # Water-filling, smallest backlog first: each gets min(backlog, fair share
    # of what is left); the last ones absorb the rounding remainder.
    backlog.sort()
    remaining = max_rows
    k = len(backlog)
    for i, (count, topic, partition, frm) in enumerate(backlog):
        take = min(count, remaining // (k - i))
        if take > 0:
            end.setdefault(topic, {})[partition] = frm + take
            remaining -= take
    return canonical(end)


def split_range(start: int, end: int, max_records: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into the fewest near-equal pieces of at most ``max_records``."""
    if max_records <= 0:
        raise ValueError(f"max_records must be positive, got {max_records}")
    total = end - start
    if total <= 0:
        return []
    pieces = -(-total // max_records)
    base, extra = divmod(total, pieces)
    out = []
    pos = start
    for i in range(pieces):
        size = base + (1 if i < extra else 0)
        out.append((pos, pos + size))
        pos += size
    return out


def plan_ranges(
    start: Mapping[str, Mapping[str, int]],
    end: Mapping[str, Mapping[str, int]],
    parts: Mapping[tuple[str, str], PartitionState],
    max_records: int,
) -> tuple[list[ReadRange], list[Loss]]:
    """The input partitions that read from ``start`` to ``end``, and what is lost.

    One range per partition with records to read, split when longer than
    ``max_records``.  ``parts`` (what the transport reports now) gives each
    partition's oldest stored offset and gateway id: a range is clamped to
    ``first``, and the records below it are reported as a :class:`Loss`.
    Partitions missing from ``start`` start at 0.  Sorted by topic,
    partition, offset.
    """
    ranges: list[ReadRange] = []
    losses: list[Loss] = []
    for topic in sorted(end):
        for partition in sorted(end[topic]):
            stop = int(end[topic][partition])
            begin = _get(start, topic, partition)
            begin = 0 if begin is None else begin
            st = parts.get((topic, partition))
            first = st.first if st is not None else begin
            pid = st.pid if st is not None else None
            if begin < min(first, stop):
                losses.append(Loss(topic, partition, begin, min(first, stop)))
            for a, b in split_range(max(begin, first), stop, max_records):
                ranges.append(ReadRange(topic, partition, a, b, pid))
    return ranges, losses
