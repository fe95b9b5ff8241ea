"""How the connector reaches records: a local store's LMDB directory or a gateway.

Both transports answer two questions: which partitions a topic has (with
their oldest and next offsets) and "give me offsets ``[start, end)`` of one
partition as Arrow record batches".  Neither keeps anything open between
calls except the process-wide read-only :class:`~dafka.store.db.RecordDB`
cache: LMDB allows one environment per directory per process, and Spark runs
``read()`` in reused worker processes, so each process opens a store once.

Arrow batches follow :data:`ARROW_SCHEMA`, the Arrow form of the source's
Spark schema (Spark checks it field by field).
"""

from __future__ import annotations

import array
import json
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import lmdb
import pyarrow as pa
import pyarrow.compute as pc

from dafka.errors import DafkaError
from dafka.spark.offsets import DataLossError, Loss, PartitionState, ReadRange
from dafka.spark.options import Transport
from dafka.store.db import RecordDB, StorageError

__all__ = [
    "ARROW_SCHEMA",
    "BATCH_RECORDS",
    "PARTITIONS_TOPIC",
    "TIMESTAMP_CREATE",
    "TIMESTAMP_LOG_APPEND",
    "TIMESTAMP_UNKNOWN",
    "GatewayUnreachableError",
    "TopicNotFoundError",
    "connect",
    "gateway_partitions",
    "list_partitions",
    "partition_map",
    "read_range",
    "report_losses",
    "shared_db",
]

log = logging.getLogger(__name__)

#: Records per Arrow batch handed to Spark (about 3.5 MB of 100-byte records).
BATCH_RECORDS = 32_768
#: The gateway's read-only topic mapping Tank partition ids to producer addresses.
PARTITIONS_TOPIC = "__dafka_partitions"

# timestampType values, as in Kafka.
TIMESTAMP_UNKNOWN = -1  # the gateway transport cannot tell (Tank does not carry it)
TIMESTAMP_CREATE = 0  # supplied by the producer (records written through the gateway)
TIMESTAMP_LOG_APPEND = 1  # the store's receive time (records from Dafka producers)

ARROW_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.string()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("timestampType", pa.int32()),
    ]
)

_TS_TYPE = pa.timestamp("us", tz="UTC")
# binary_slice without a stop overflows in pyarrow 26; binary arrays end below 2 GiB anyway.
_NO_STOP = (1 << 31) - 1
_FETCH_SIZE = 4 << 20  # bytes asked per gateway consume
_MAX_FETCH_SIZE = 256 << 20


class TopicNotFoundError(DafkaError, LookupError):
    """A subscribed topic does not exist in the store or gateway."""


class GatewayUnreachableError(DafkaError, ConnectionError):
    """The gateway named by the ``gateway`` option cannot be reached."""


# ---------------------------------------------------------------- local store


_dbs: dict[str, RecordDB] = {}
_dbs_pid = os.getpid()
_dbs_lock = threading.Lock()
_inherited: list[RecordDB] = []  # environments from before a fork: never touched again


def shared_db(path: str) -> RecordDB:
    """This process's read-only RecordDB of the store at ``path`` (opened once)."""
    global _dbs_pid
    key = os.path.realpath(path)
    with _dbs_lock:
        if _dbs_pid != os.getpid():
            # A forked child must not use (nor close) its parent's environments.
            _inherited.extend(_dbs.values())
            _dbs.clear()
            _dbs_pid = os.getpid()
        db = _dbs.get(key)
        if db is None:
            try:
                db = RecordDB(key, readonly=True)
            except FileNotFoundError:
                raise DafkaError(f"option 'path': no Dafka store at {path!r}") from None
            except (StorageError, lmdb.Error) as exc:
                raise DafkaError(f"option 'path': cannot read the store at {path!r}: {exc}") from exc
            _dbs[key] = db
        return db


def _store_partitions(path: str, topics: Iterable[str]) -> list[PartitionState]:
    db = shared_db(path)
    out: list[PartitionState] = []
    for topic in topics:
        infos = db.partitions(topic)
        if not infos:
            raise TopicNotFoundError(f"unknown topic {topic!r}: the store at {path!r} has no such topic")
        out.extend(PartitionState(i.topic, i.partition, i.first, i.last + 1) for i in infos)
    return out


def _int64_be(data: pa.Buffer, n: int) -> pa.Array:
    """``n`` big-endian u64 packed in ``data`` as an int64 Arrow array (C loops only)."""
    arr = array.array("q")
    arr.frombytes(memoryview(data)[: 8 * n])
    if sys.byteorder == "little":
        arr.byteswap()
    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(arr)])


def _store_batch(values: Sequence[bytes], start: int, topic: str, partition: str) -> pa.RecordBatch:
    """Stored values ``ts:u64 flags:u8 [klen:u8 key] content`` of offsets from ``start``."""
    n = len(values)
    raw = pa.array(values, pa.binary())
    flags = pc.binary_slice(raw, 8, 9).buffers()[2]
    ts_ms = _int64_be(pc.binary_slice(raw, 0, 8).buffers()[2], n)
    if flags is None or flags.to_pybytes()[:n] == bytes(n):
        # The common case, records from Dafka producers: no key, store time.
        key: pa.Array = pa.nulls(n, pa.binary())
        value = pc.binary_slice(raw, 9, _NO_STOP)
        ts_type = pa.repeat(pa.scalar(TIMESTAMP_LOG_APPEND, pa.int32()), n)
    else:
        keys: list[bytes | None] = []
        contents: list[bytes] = []
        types: list[int] = []
        for v in values:
            f = v[8]
            if f & 1:
                klen = v[9]
                keys.append(v[10 : 10 + klen])
                contents.append(v[10 + klen :])
            else:
                keys.append(None)
                contents.append(v[9:])
            types.append(TIMESTAMP_CREATE if f & 2 else TIMESTAMP_LOG_APPEND)
        key = pa.array(keys, pa.binary())
        value = pa.array(contents, pa.binary())
        ts_type = pa.array(types, pa.int32())
    return pa.RecordBatch.from_arrays(
        [
            key,
            value,
            pa.repeat(pa.scalar(topic, pa.string()), n),
            pa.repeat(pa.scalar(partition, pa.string()), n),
            pa.array(range(start, start + n), pa.int64()),
            pc.multiply(ts_ms, 1000).view(_TS_TYPE),
            ts_type,
        ],
        schema=ARROW_SCHEMA,
    )


def _read_store(path: str, rng: ReadRange, fail_on_data_loss: bool) -> Iterator[pa.RecordBatch]:
    db = shared_db(path)
    nxt = rng.start
    retried = -1
    while nxt < rng.end:
        try:
            start, values = db.fetch_raw(rng.topic, rng.partition, nxt, min(BATCH_RECORDS, rng.end - nxt))
        except (ValueError, struct.error, IndexError) as exc:  # a damaged stored block (ProtocolError is a ValueError)
            past = _past_damaged(db, path, rng, nxt, exc, fail_on_data_loss, retried == nxt)
            retried = nxt
            nxt = past
            continue
        if start > nxt and not (values and db.compacted_gap(rng.topic, rng.partition, nxt, start - 1)):
            # Retention removed records after the range was planned (a gap compaction left
            # is no loss: later records of the same keys superseded them).
            report_losses([Loss(rng.topic, rng.partition, nxt, min(start, rng.end))], fail_on_data_loss)
        if not values:
            if start >= rng.end:
                return
            raise DafkaError(
                f"{rng.topic}/{rng.partition}: offsets {start}..{rng.end - 1} are not in the "
                f"store at {path!r} (it holds fewer records than planned)"
            )
        yield _store_batch(values, start, rng.topic, rng.partition)
        nxt = start + len(values)


def _past_damaged(db: RecordDB, path: str, rng: ReadRange, nxt: int, exc: Exception, fail_on_data_loss: bool,
                  retried: bool = False) -> int:
    """The offset after the stored block holding ``nxt``, which cannot be read (a damaged
    store: blocks are checked when written; a read stops before one after others, so it is
    the first one read from ``nxt``): its records are lost to this read, as records retention
    removed are (DataLossError, or skipped with a warning for ``failOnDataLoss=false``).  Its
    error named neither the partition nor the offset.  The block is found unreadable in the
    transaction its range is taken from (:meth:`RecordDB.unreadable_block`): the store's
    retention or compaction may have replaced the one the read failed at, and a block that
    reads now is read again (``nxt``, once: ``retried``), never skipped."""
    what = f"{rng.topic}/{rng.partition}: the stored block holding offset {nxt} in the store at {path!r} cannot be read"
    try:
        hdr = db.unreadable_block(rng.topic, rng.partition, nxt)
    except Exception:  # its header too
        raise DafkaError(f"{what} ({exc})") from exc
    if hdr is None and not retried:
        return nxt  # (it reads now: replaced since the read failed)
    if hdr is None or hdr.last_offset < nxt:
        raise DafkaError(f"{what} ({exc})") from exc
    first = max(nxt, hdr.first_offset)
    last = min(hdr.last_offset, rng.end - 1)
    if fail_on_data_loss:
        raise DataLossError(f"{what} (records {first}..{last}, a damaged block: {exc}). Set failOnDataLoss=false to"
                            " skip them and go on.") from exc
    log.warning("%s (records %d..%d, a damaged block: %s); skipping them (failOnDataLoss=false)", what, first, last,
                exc)
    return last + 1


# ---------------------------------------------------------------- gateway


def connect(transport: Transport) -> Any:
    """A connected TankClient, or GatewayUnreachableError naming the option."""
    from dafka.tank.client import TankClient, TankError

    try:
        return TankClient(transport.host, transport.port, transport.timeout)  # type: ignore[arg-type]
    except (TankError, OSError) as exc:
        raise GatewayUnreachableError(
            f"option 'gateway': cannot reach the Dafka gateway at "
            f"{transport.host}:{transport.port}: {exc}"
        ) from exc


def _consume_all(client: Any, topic: str, partition: int, seq: int = 1) -> Iterator[tuple]:
    """Every message of one partition from ``seq`` to its current high-water mark."""
    fetch = _FETCH_SIZE
    hwm: int | None = None
    while hwm is None or seq <= hwm:
        res = client.consume(topic, partition, seq, fetch)
        hwm = res.hwm if res.hwm is not None else 0
        if res.boundary_check:
            if res.first_avail and res.first_avail > seq:
                seq = res.first_avail
                continue
            return
        if not res.messages:
            if res.partial_size and fetch < _MAX_FETCH_SIZE:
                fetch = max(fetch * 2, res.partial_size)
                continue
            return
        yield from res.messages
        seq = res.messages[-1][0] + 1


def partition_map(client: Any, topics: Iterable[str]) -> dict[tuple[str, int], tuple[str, bool]]:
    """``{(topic, partition id): (producer address, owned by the gateway)}`` for ``topics``."""
    wanted = set(topics)
    out: dict[tuple[str, int], tuple[str, bool]] = {}
    for _seq, _ts, _key, value in _consume_all(client, PARTITIONS_TOPIC, 0):
        entry = json.loads(value)
        if entry.get("topic") in wanted:
            out[(entry["topic"], int(entry["partition"]))] = (
                str(entry["address"]),
                bool(entry.get("owned", False)),
            )
    return out


def gateway_partitions(client: Any, topics: Iterable[str]) -> list[PartitionState]:
    """Partitions of ``topics`` as the gateway numbers them, named by producer address."""
    from dafka.tank.client import UnknownTopicError

    bounds: dict[str, dict[int, Any]] = {}
    for topic in topics:
        try:
            bounds[topic] = client.discover_partitions(topic)
        except UnknownTopicError:
            raise TopicNotFoundError(
                f"unknown topic {topic!r}: the gateway at {client.host}:{client.port} "
                "has no such topic"
            ) from None
    # Read the id -> address map after the bounds, so it covers every id seen.
    addresses = partition_map(client, bounds) if any(bounds.values()) else {}
    out: list[PartitionState] = []
    for topic, parts in bounds.items():
        for pid, (first_avail, hwm) in sorted(parts.items()):
            entry = addresses.get((topic, pid))
            if entry is None:
                raise DafkaError(
                    f"the gateway at {client.host}:{client.port} did not map partition {pid} "
                    f"of {topic!r} to a producer address in {PARTITIONS_TOPIC!r}"
                )
            # Tank seq = Dafka offset + 1; 0/0 is an empty partition.
            nxt = int(hwm)
            first = int(first_avail) - 1 if first_avail else nxt
            out.append(PartitionState(topic, entry[0], min(first, nxt), nxt, pid))
    return out


def _gateway_batch(messages: list[tuple], topic: str, partition: str) -> pa.RecordBatch:
    n = len(messages)
    seqs, tss, keys, values = zip(*messages, strict=True)
    ts_ms = pa.array(tss, pa.int64())
    return pa.RecordBatch.from_arrays(
        [
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.repeat(pa.scalar(topic, pa.string()), n),
            pa.repeat(pa.scalar(partition, pa.string()), n),
            pc.subtract(pa.array(seqs, pa.int64()), 1),
            pc.multiply(ts_ms, 1000).view(_TS_TYPE),
            pa.repeat(pa.scalar(TIMESTAMP_UNKNOWN, pa.int32()), n),
        ],
        schema=ARROW_SCHEMA,
    )


def _first_seq(client: Any, topic: str, pid: int) -> int:
    """The first seq the gateway holds of a partition now (its next one when it holds
    none)."""
    first_avail, hwm = client.discover_partitions(topic)[pid]
    return int(first_avail) if first_avail else int(hwm) + 1


def _read_gateway(
    transport: Transport, rng: ReadRange, fail_on_data_loss: bool
) -> Iterator[pa.RecordBatch]:
    if rng.pid is None:
        raise DafkaError(f"{rng.topic}/{rng.partition}: no gateway partition id planned")
    last_seq = rng.end  # offsets [start, end) are seqs [start + 1, end]
    seq = rng.start + 1
    fetch = _FETCH_SIZE
    pending: list[tuple] = []
    with connect(transport) as client:
        while seq <= last_seq:
            res = client.consume(rng.topic, rng.pid, seq, fetch)
            if res.boundary_check:
                first = res.first_avail or 0
                if first > seq:
                    report_losses(
                        [Loss(rng.topic, rng.partition, seq - 1, min(first, last_seq + 1) - 1)],
                        fail_on_data_loss,
                    )
                    seq = first
                    continue
                raise DafkaError(
                    f"{rng.topic}/{rng.partition}: the gateway has no offset {seq - 1} "
                    f"(high-water mark {res.hwm})"
                )
            msgs = res.messages
            if not msgs:
                if res.partial_size and fetch < _MAX_FETCH_SIZE:
                    fetch = max(fetch * 2, res.partial_size)
                    continue
                raise DafkaError(
                    f"{rng.topic}/{rng.partition}: the gateway returned nothing at offset "
                    f"{seq - 1} (high-water mark {res.hwm})"
                )
            if msgs[0][0] > seq:
                # Records from seq on missing: retention removed them after the range was
                # planned (a loss), or they are a gap compaction left (superseded by later
                # records of their keys) or a hole (never stored): not records removed.  The
                # answer does not say which; the partition's first seq now does.
                first = _first_seq(client, rng.topic, rng.pid)
                if first > seq:
                    report_losses(
                        [Loss(rng.topic, rng.partition, seq - 1, min(first, msgs[0][0], last_seq + 1) - 1)],
                        fail_on_data_loss,
                    )
            if msgs[-1][0] > last_seq:
                msgs = [m for m in msgs if m[0] <= last_seq]
            pending.extend(msgs)
            seq = msgs[-1][0] + 1
            if len(pending) >= BATCH_RECORDS:
                yield _gateway_batch(pending, rng.topic, rng.partition)
                pending = []
    if pending:
        yield _gateway_batch(pending, rng.topic, rng.partition)


# ---------------------------------------------------------------- either


def list_partitions(transport: Transport, topics: Iterable[str]) -> list[PartitionState]:
    """Every partition of ``topics``; TopicNotFoundError for an unknown topic."""
    if transport.is_gateway:
        with connect(transport) as client:
            return gateway_partitions(client, topics)
    return _store_partitions(transport.path, topics)  # type: ignore[arg-type]


def read_range(
    transport: Transport, rng: ReadRange, fail_on_data_loss: bool
) -> Iterator[pa.RecordBatch]:
    """Offsets ``[rng.start, rng.end)`` of one partition as Arrow batches."""
    if rng.end <= rng.start:
        return iter(())
    if transport.is_gateway:
        return _read_gateway(transport, rng, fail_on_data_loss)
    return _read_store(transport.path, rng, fail_on_data_loss)  # type: ignore[arg-type]


def report_losses(losses: Iterable[Loss], fail_on_data_loss: bool) -> None:
    """Raise DataLossError for the first loss, or log them all (``failOnDataLoss=false``)."""
    for loss in losses:
        if fail_on_data_loss:
            raise DataLossError(
                loss.describe() + ". Set failOnDataLoss=false to skip them and go on."
            )
        log.warning("%s; skipping them (failOnDataLoss=false)", loss.describe())
