"""The exactly-once streaming sink's commit log: record formats and folding, no I/O.

Protocol
========

Each streaming query writing through the gateway owns a *commit log*: the
gateway topic ``_dafka_sink_<sink id>`` (one gateway-owned partition; the
sink id is the query's persistent id, which survives restarts from the
checkpoint, or the ``sinkId`` option).  Its records are JSON:

``{"kind": "base", "topic": T, "ends": {"<pid>": seq, ...}}``
    Written once per target topic, before the query writes anything to it:
    the high-water mark (Tank seq) of every partition of ``T`` at that time.

``{"kind": "commit", "batch": b, "ends": {T: {"<pid>": seq, ...}, ...}}``
    Written by the driver's ``commit(messages, b)``: the last seq of every
    partition the query has written to, after batch ``b``.  Cumulative: it
    includes everything before it, bases too.

In micro-batch ``b`` the write task with partition index ``i`` sends all
its rows for topic ``T`` to the ``i``-th gateway-owned partition of ``T`` with
ProduceWithSeqnum, from seq ``ends[T][i] + 1`` where ``ends`` is the state
*before* batch ``b`` (:func:`fold`).  A seq is written at most once (the
gateway refuses a seq at or below its high-water mark), so when a killed
batch runs again from the checkpoint, with the same input, each task finds
its first rows already there: it checks they are the same records (key and
value) and skips them, then writes the rest.  A batch whose commit record is
already in the log (the driver died after committing but before Spark
recorded it) is re-run the same way, writes nothing new and its commit is a
no-op.

Every append to the log uses ProduceWithSeqnum at ``hwm + 1`` after reading
up to ``hwm``, so concurrent appenders (a task writing a base while another
does, a late task of an earlier attempt) cannot interleave unseen: the loser
gets INVALID_SEQNUM, re-reads and retries.  Hence a commit record folds every
record before it, and the state before batch ``b`` is the last commit of a
batch ``< b`` merged with the bases after it: readers only need the log's
tail (:func:`suffix_complete`).

What it needs: each write task gets the same rows in the same order when a
batch is re-run (true for deterministic queries over replayable sources
such as ``dafka`` without a shuffle before the sink; after a shuffle, sort
within partitions), write task ``i`` owns the ``i``-th partition of each
target topic (at most as many write tasks as the topic has gateway
partitions), and nothing else writes those partitions.  Violations are detected (records that
differ, more records than the task has) and fail the task instead of
duplicating or losing records.  Readers may see a batch's records before its
commit (like Kafka's read_uncommitted); they are never duplicated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dafka.errors import DafkaError

__all__ = [
    "LOG_PREFIX",
    "SinkState",
    "base_record",
    "commit_record",
    "fold",
    "log_topic",
    "merge_ends",
    "parse_record",
    "suffix_complete",
]

# One underscore: the gateway reserves names starting with "__" for itself.
LOG_PREFIX = "_dafka_sink_"

#: ``{topic: {tank partition id: last seq}}``.
Ends = dict[str, dict[int, int]]


def log_topic(sink_id: str) -> str:
    """The commit log topic of a sink (names limited to a safe character set)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", sink_id)
    if not safe:
        raise ValueError("empty sink id")
    return (LOG_PREFIX + safe)[:255]


def _ends_json(ends: Mapping[int, int]) -> dict[str, int]:
    return {str(pid): int(seq) for pid, seq in sorted(ends.items())}


def base_record(topic: str, ends: Mapping[int, int]) -> bytes:
    """The log record saying where ``topic``'s partitions stood before the sink wrote to it."""
    return json.dumps(
        {"kind": "base", "topic": topic, "ends": _ends_json(ends)}, sort_keys=True
    ).encode()


def commit_record(batch: int, ends: Mapping[str, Mapping[int, int]]) -> bytes:
    """The log record committing micro-batch ``batch`` (cumulative ends)."""
    body = {"kind": "commit", "batch": int(batch), "ends": {t: _ends_json(e) for t, e in ends.items()}}
    return json.dumps(body, sort_keys=True).encode()


def parse_record(value: bytes) -> dict:
    """Decode one log record (ends with int pids); DafkaError if it is not one."""
    try:
        rec = json.loads(value)
        kind = rec["kind"]
        if kind == "base":
            return {
                "kind": kind,
                "topic": str(rec["topic"]),
                "ends": {int(p): int(s) for p, s in rec["ends"].items()},
            }
        if kind == "commit":
            return {
                "kind": kind,
                "batch": int(rec["batch"]),
                "ends": {
                    str(t): {int(p): int(s) for p, s in e.items()} for t, e in rec["ends"].items()
                },
            }
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    raise DafkaError(f"not a sink commit log record: {value[:200]!r}")


@dataclass
class SinkState:
    """Where the query's writes stood before a batch."""

    ends: Ends = field(default_factory=dict)
    #: The batch is already committed (it is being re-run).
    committed: bool = False
    #: Highest committed batch seen (any batch, for sanity checks).
    last_batch: int | None = None


def merge_ends(ends: Mapping[str, Mapping[int, int]], more: Mapping[str, Mapping[int, int]]) -> Ends:
    """``ends`` updated with ``more`` (per partition, the higher seq wins)."""
    out: Ends = {t: dict(e) for t, e in ends.items()}
    for topic, parts in more.items():
        dst = out.setdefault(topic, {})
        for pid, seq in parts.items():
            if seq > dst.get(pid, -1):
                dst[pid] = seq
    return out


def fold(records: Iterable[Mapping], batch: int) -> SinkState:
    """The state before ``batch`` from log records in log order.

    ``records`` must start at the log's beginning or at a commit of a batch
    below ``batch`` (see :func:`suffix_complete`).  Commits of ``batch`` and
    later are not applied; a commit of ``batch`` marks it committed.
    """
    state = SinkState()
    for rec in records:
        if rec["kind"] == "base":
            if rec["topic"] not in state.ends:  # the first base of a topic wins
                state.ends[rec["topic"]] = dict(rec["ends"])
        else:
            b = rec["batch"]
            state.last_batch = b if state.last_batch is None else max(state.last_batch, b)
            if b < batch:
                state.ends = merge_ends(state.ends, rec["ends"])
            elif b == batch:
                state.committed = True
    if state.last_batch is not None and state.last_batch > batch:
        raise DafkaError(
            f"the sink's commit log already holds batch {state.last_batch}, after batch {batch}: "
            "was the checkpoint deleted while keeping the sinkId? Use a new sinkId for a new "
            "checkpoint"
        )
    return state


def suffix_complete(records: Iterable[Mapping], batch: int) -> bool:
    """Whether a log tail holds a commit of a batch below ``batch`` (enough to :func:`fold`)."""
    return any(r["kind"] == "commit" and r["batch"] < batch for r in records)
