"""Gateway I/O of the Spark sink, without Spark: produce requests and the exactly-once protocol.

:mod:`dafka.spark.sink` wraps these in Spark's writer classes; keeping them
apart lets tests drive the protocol (a task killed half way, a batch run
again) deterministically against a real gateway.  See
:mod:`dafka.spark.sinklog` for the protocol itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from dafka.errors import ConfigError, DafkaError
from dafka.spark.options import WriteOptions
from dafka.spark.sinklog import (
    SinkState,
    base_record,
    commit_record,
    fold,
    log_topic,
    merge_ends,
    parse_record,
    suffix_complete,
)
from dafka.spark.transport import connect, partition_map
from dafka.tank.client import TankClient, TankError, UnknownTopicError
from dafka.tank.messages import CreateTopicError, ProduceError

__all__ = [
    "PartitionWriter",
    "Written",
    "append_log",
    "commit_stream_batch",
    "create_missing",
    "ensure_topic",
    "read_log",
    "rows_of",
    "write_batch_task",
    "write_stream_task",
]

log = logging.getLogger(__name__)

_LOG_RETRIES = 50  # appends to the commit log lost to concurrent appenders before giving up
_VERIFY_FETCH = 4 << 20

#: What a streaming task wrote: ``{topic: (partition id, first seq, last seq)}``.
Written = dict[str, tuple[int, int, int]]


def _column(batch: pa.RecordBatch, name: str) -> list[Any] | None:
    for i, n in enumerate(batch.schema.names):
        if n.lower() == name:
            return batch.column(i).to_pylist()
    return None


def _encode(v: Any) -> bytes | None:
    return v.encode() if isinstance(v, str) else v


def rows_of(
    batches: Iterable[pa.RecordBatch], topic_option: str | None
) -> Iterator[tuple[str, bytes | None, bytes]]:
    """``(topic, key, value)`` of every input row, in order."""
    for batch in batches:
        n = batch.num_rows
        values = _column(batch, "value")
        keys = _column(batch, "key") or [None] * n
        topics = [topic_option] * n if topic_option else _column(batch, "topic")
        if values is None:
            raise ConfigError("the dafka sink needs a 'value' column")
        if topics is None:
            raise ConfigError("no topic: set the 'topic' option or give a 'topic' column")
        for t, k, v in zip(topics, keys, values, strict=True):
            if t is None:
                raise ConfigError("a row has a null 'topic' and no 'topic' option is set")
            if v is None:
                raise DafkaError(f"a row for topic {t!r} has a null 'value'")
            yield t, _encode(k), _encode(v)


def create_missing(client: TankClient, topic: str, partitions: int) -> None:
    """Create ``topic`` with ``partitions`` gateway-owned partitions unless it exists."""
    try:
        client.discover_partitions(topic)
        return
    except UnknownTopicError:
        pass
    try:
        client.create_topic(topic, partitions)
        log.info(
            "created topic %r with %d partitions on %s:%d", topic, partitions, client.host, client.port
        )
    except TankError as exc:
        if exc.code != CreateTopicError.EXISTS:  # EXISTS: another task won the race
            raise DafkaError(f"cannot create topic {topic!r} on the gateway: {exc}") from exc


def ensure_topic(client: TankClient, topic: str, partitions: int) -> list[int]:
    """The gateway-owned (writable) partition ids of ``topic``, creating it if missing."""
    create_missing(client, topic, partitions)
    owned = sorted(pid for (_t, pid), (_a, own) in partition_map(client, [topic]).items() if own)
    if not owned:
        raise DafkaError(
            f"topic {topic!r} has no partition the gateway writes (it is written by Dafka "
            "producers only): write to a topic created through the gateway"
        )
    return owned


def _produce_error(exc: TankError, topic: str, pid: int, task: int) -> DafkaError:
    if exc.code in (ProduceError.NO_LEADER, ProduceError.UNKNOWN_PARTITION, ProduceError.READ_ONLY):
        return DafkaError(
            f"write task {task} cannot write partition {pid} of {topic!r}: the gateway does not "
            f"own it ({exc}); write to a topic created through the gateway, with at least as "
            "many partitions as write tasks"
        )
    return DafkaError(f"produce to {topic}/{pid} failed: {exc}")


def read_log(client: TankClient, topic: str, batch: int) -> tuple[list[dict], int]:
    """Enough of the commit log's tail to fold the state before ``batch``, and its hwm."""
    bounds = client.discover_partitions(topic, [0])[0]
    first, hwm = max(int(bounds.first_avail), 1), int(bounds.hwm)
    if hwm == 0:
        return [], 0
    window = 8
    while True:
        lo = max(first, hwm - window + 1)
        records = [parse_record(m[3]) for m in consume_range(client, topic, 0, lo, hwm)]
        if lo <= first or suffix_complete(records, batch):
            return records, hwm
        window *= 8


def consume_range(client: TankClient, topic: str, pid: int, first_seq: int, last_seq: int) -> Iterator[tuple]:
    """Messages ``(seq, ts, key, value)`` of seqs ``first_seq..last_seq``, which must exist."""
    seq = first_seq
    fetch = _VERIFY_FETCH
    while seq <= last_seq:
        res = client.consume(topic, pid, seq, fetch)
        msgs = [m for m in res.messages if m[0] <= last_seq]
        if not msgs:
            if res.partial_size and not res.boundary_check:
                fetch = max(fetch * 2, res.partial_size)
                continue
            raise DafkaError(f"{topic}/{pid}: seq {seq} is not readable on the gateway (hwm {res.hwm})")
        if msgs[0][0] != seq:
            raise DafkaError(f"{topic}/{pid}: seqs {seq}..{msgs[0][0] - 1} are missing on the gateway")
        yield from msgs
        seq = msgs[-1][0] + 1


def append_log(
    client: TankClient, topic: str, batch: int, make: Callable[[SinkState], bytes | None]
) -> SinkState:
    """Append ``make(state)`` (bytes, or None for nothing) to the commit log, race-free.

    The record goes at ``hwm + 1`` with ProduceWithSeqnum: if anything was
    appended since the log was read, the gateway refuses it and the state is
    read and ``make`` asked again.  Returns the state the record was made from.
    """
    for _ in range(_LOG_RETRIES):
        records, hwm = read_log(client, topic, batch)
        state = fold(records, batch)
        payload = make(state)
        if payload is None:
            return state
        try:
            client.produce_with_seqnum(topic, 0, hwm + 1, [payload])
            return state
        except TankError as exc:
            if exc.code != ProduceError.INVALID_SEQNUM:
                raise DafkaError(f"cannot append to the sink commit log {topic!r}: {exc}") from exc
            log.debug("commit log %r moved past %d; reading it again", topic, hwm)
    raise DafkaError(f"could not append to the sink commit log {topic!r}: too much contention")


class PartitionWriter:
    """One task's rows for one topic: partition ``pid`` from seq ``start``.

    Seqs up to ``hwm`` are already on the gateway (an earlier attempt of this
    batch): the rows must equal them and are skipped; later rows are sent with
    ProduceWithSeqnum in chunks.
    """

    def __init__(self, client: TankClient, topic: str, pid: int, start: int, chunk: int, task: int):
        self.client = client
        self.topic = topic
        self.pid = pid
        self.task = task
        self.start = start
        self.next_seq = start
        self.chunk = chunk
        self.pending: list[tuple[bytes | None, bytes]] = []
        self.skipped = 0
        self._existing: Iterator[tuple] | None = None
        self._set_hwm(self._hwm())

    def _hwm(self) -> int:
        return int(self.client.discover_partitions(self.topic, [self.pid])[self.pid].hwm)

    def _set_hwm(self, hwm: int) -> None:
        if hwm < self.next_seq - 1:
            raise DafkaError(
                f"{self.topic}/{self.pid}: the gateway's high-water mark {hwm} is below the "
                f"{self.next_seq - 1} this sink committed: records were lost"
            )
        self.hwm = hwm
        self._existing = (
            consume_range(self.client, self.topic, self.pid, self.next_seq, hwm)
            if hwm >= self.next_seq
            else None
        )

    def add(self, key: bytes | None, value: bytes) -> None:
        if self.next_seq <= self.hwm:
            assert self._existing is not None
            seq, _ts, okey, ovalue = next(self._existing)
            if ovalue != value or (okey or None) != (key or None):
                raise DafkaError(
                    f"{self.topic}/{self.pid} seq {seq} holds another record than the one this "
                    "batch writes there: the query's input changed between runs of the batch, or "
                    "something else writes this partition"
                )
            self.next_seq += 1
            self.skipped += 1
            return
        self.pending.append((key, value))
        if len(self.pending) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        msgs, self.pending = self.pending, []
        if not msgs:
            return
        first = self.next_seq
        try:
            self.client.produce_with_seqnum(self.topic, self.pid, first, msgs)
            self.next_seq += len(msgs)
            self.hwm = self.next_seq - 1
        except TankError as exc:
            if exc.code != ProduceError.INVALID_SEQNUM:
                raise _produce_error(exc, self.topic, self.pid, self.task) from exc
            # Another attempt of this task wrote meanwhile: check against it.
            self._set_hwm(self._hwm())
            for key, value in msgs:
                self.add(key, value)
            self.flush()

    def finish(self) -> tuple[int, int, int]:
        """Flush; ``(pid, first seq, last seq)`` of this task's records."""
        self.flush()
        if self.hwm > self.next_seq - 1:
            raise DafkaError(
                f"{self.topic}/{self.pid} holds records up to seq {self.hwm}, past the "
                f"{self.next_seq - 1} this batch writes: the query's input changed between runs "
                "of the batch, or something else writes this partition"
            )
        return self.pid, self.start, self.next_seq - 1


# ---------------------------------------------------------------- tasks and commits


def write_batch_task(
    opts: WriteOptions, task: int, batches: Iterable[pa.RecordBatch]
) -> dict[tuple[str, int], int]:
    """One batch write task: plain produce requests; ``{(topic, pid): records}``."""
    counts: dict[tuple[str, int], int] = {}
    owned: dict[str, list[int]] = {}
    pending: dict[str, list[tuple[bytes | None, bytes]]] = {}
    with connect(opts.transport) as client:

        def flush(topic: str) -> None:
            msgs = pending.pop(topic, None)
            if not msgs:
                return
            pids = owned[topic]
            pid = pids[task % len(pids)]
            try:
                client.produce(topic, pid, msgs)
            except TankError as exc:
                raise _produce_error(exc, topic, pid, task) from exc
            counts[(topic, pid)] = counts.get((topic, pid), 0) + len(msgs)

        for topic, key, value in rows_of(batches, opts.topic):
            if topic not in owned:
                owned[topic] = ensure_topic(client, topic, opts.num_partitions)
            buf = pending.setdefault(topic, [])
            buf.append((key, value))
            if len(buf) >= opts.max_records_per_request:
                flush(topic)
        for topic in list(pending):
            flush(topic)
    return counts


def _open_partition(
    client: TankClient, opts: WriteOptions, control: str, batch: int, task: int, topic: str
) -> PartitionWriter:
    """The writer of task ``task``'s rows for ``topic`` in ``batch``, from the committed state."""
    owned = ensure_topic(client, topic, opts.num_partitions)
    if task >= len(owned):
        raise DafkaError(
            f"write task {task} has no partition of its own in {topic!r}, which has "
            f"{len(owned)} the gateway writes: coalesce the stream to at most {len(owned)} "
            "partitions, or write to a topic with more (option numPartitions when the sink "
            "creates it)"
        )
    pid = owned[task]

    def make_base(state: SinkState) -> bytes | None:
        if topic in state.ends:
            return None
        bounds = client.discover_partitions(topic)
        return base_record(topic, {p: int(b.hwm) for p, b in bounds.items()})

    append_log(client, control, batch, make_base)
    state = fold(read_log(client, control, batch)[0], batch)
    ends = state.ends.get(topic)
    if ends is None or pid not in ends:
        raise DafkaError(f"the sink commit log {control!r} has no position for {topic}/{pid}")
    return PartitionWriter(client, topic, pid, ends[pid] + 1, opts.max_records_per_request, task)


def write_stream_task(
    opts: WriteOptions, sink_id: str, batch: int, task: int, batches: Iterable[pa.RecordBatch]
) -> Written:
    """One streaming write task of micro-batch ``batch`` (exactly once, see :mod:`~dafka.spark.sinklog`)."""
    control = log_topic(sink_id)
    written: Written = {}
    writers: dict[str, PartitionWriter] = {}
    with connect(opts.transport) as client:
        create_missing(client, control, 1)
        for topic, key, value in rows_of(batches, opts.topic):
            w = writers.get(topic)
            if w is None:
                w = writers[topic] = _open_partition(client, opts, control, batch, task, topic)
            w.add(key, value)
        for topic, w in writers.items():
            written[topic] = w.finish()
            if w.skipped:
                log.info(
                    "batch %d task %d: %d records of %s/%d were written by an earlier run",
                    batch, task, w.skipped, topic, w.pid,
                )
    return written


def commit_stream_batch(
    opts: WriteOptions, sink_id: str, batch: int, written: Iterable[Written]
) -> bool:
    """Record micro-batch ``batch`` in the sink's commit log; False if there was nothing to
    record or it was already committed (a re-run batch)."""
    done: dict[str, dict[int, int]] = {}
    for w in written:
        for topic, (pid, _first, last) in w.items():
            done.setdefault(topic, {})[pid] = last
    if not done:
        return False  # nothing written: the state after this batch is the state before it
    appended = True

    def make_commit(state: SinkState) -> bytes | None:
        nonlocal appended
        if state.committed:
            log.info("batch %d of sink %s was committed already (run again)", batch, sink_id)
            appended = False
            return None
        return commit_record(batch, merge_ends(state.ends, done))

    with connect(opts.transport) as client:
        append_log(client, log_topic(sink_id), batch, make_commit)
    return appended
