"""Answers to Kafka requests, sans-IO: mapping a Kafka broker onto the gateway's store.

The gateway is the one broker of the cluster a Kafka client sees (node 0),
the leader of every partition and the coordinator of every group.

* A Kafka topic is a Dafka topic; Kafka partition ``i`` is the partition the
  gateway's :class:`~dafka.tank.mapping.PartitionMap` gives id ``i`` (the ids
  Tank clients see).  Kafka offset = Dafka offset; the log start offset is
  the first stored offset and the high watermark the committed head + 1.
* Produce goes to partitions the gateway owns; a partition of a mesh
  producer is refused with POLICY_VIOLATION (its writer is a producer the
  client cannot reach).  The answer waits until the records are committed to
  LMDB (for acks 1 and -1 alike: the gateway is the only replica, so the
  two mean the same); acks 0 gets no answer.
* Idempotent producers: InitProducerId gives a random 63-bit producer id
  (not guessable); the last :data:`IDEMPOTENT_WINDOW` batches of each
  (producer id, epoch, partition) are remembered; a batch sent again gets the
  offset it was stored at, and is not stored twice.  A gap in the sequence
  is OUT_OF_ORDER_SEQUENCE_NUMBER; a higher epoch starts the sequences over
  (from 0), a lower one is fenced (INVALID_PRODUCER_EPOCH).  Ids this
  gateway gave (at most :data:`MAX_PRODUCERS`) and ids it did not give (a
  producer from before a restart, or made up: taken from their first batch,
  at most :data:`MAX_ADOPTED`) are kept apart, so made-up ids never push out
  a given id's state.  A given id forgotten to make room is remembered
  (:data:`MAX_FORGOTTEN`): its next batch is UNKNOWN_PRODUCER_ID, never
  stored unchecked.  (The state lives in memory: a restart forgets it.)
* Topic names: created on this port only when they follow Kafka's rules
  (``[a-zA-Z0-9._-]``, 1 to 249 characters, not ``.`` or ``..``, not
  ``__`` reserved); others are INVALID_TOPIC_EXCEPTION.  At most
  :data:`MAX_CREATED_PER_REQUEST` topics are created by one request
  (Metadata auto-creation answers the rest LEADER_NOT_AVAILABLE, a retriable
  code; CreateTopics answers THROTTLING_QUOTA_EXCEEDED).
* Metadata answers name each topic once however often it is asked for, and
  stop at :data:`MAX_METADATA_BYTES` (estimated before anything is built):
  the topics past it are answered POLICY_VIOLATION with no partitions.
* A record over the node's ``max_record_bytes`` is refused
  (MESSAGE_TOO_LARGE) as on the Tank port: the mesh would drop it.

:class:`KafkaServer` takes decoded requests and returns :class:`Outcome`
objects; the shell (:mod:`dafka.kafka.gateway`) owns sockets, clocks and the
database.  Everything it needs from the store is the :class:`Backend`.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from dafka.errors import ProtocolError
from dafka.gateway.connections import LogLimiter
from dafka.gateway.parking import arrived
from dafka.kafka.admin import (
    ALTERABLE_KEYS,
    CLEANUP_KEYS,
    MAX_ADMIN_ITEMS,
    AdminHandlers,
    parse_cleanup,
    parse_retention,
)
from dafka.kafka.codec import (
    API_VERSIONS,
    Err,
    N,
    api_keys,
    encode_fetch_parts,
    encode_produce_response,
    encode_response,
)
from dafka.kafka.groups import Answer, Coordinator
from dafka.kafka.outcome import Outcome, ParkedFetch
from dafka.kafka.records import (
    MAX_DECOMPRESSED,
    Batch,
    TooManyRecords,
    batch_spans,
    empty_batch,
    split_batches,
)
from dafka.kafka.txn import TxnCoordinator
from dafka.kafka.txn_admin import TxnAdminHandlers
from dafka.kafka.txn_api import TxnHandlers
from dafka.store.block import CODEC_KAFKA
from dafka.store.layout import MAX_NAME, MAX_OFFSET
from dafka.tank.mapping import (
    PARTITIONS_TOPIC,
    PartitionMap,
    TankPartition,
    shown,
    valid_topic_name,
)

log = logging.getLogger("dafka.kafka")

NODE_ID = 0
IDEMPOTENT_WINDOW = 5  # batches remembered per producer and partition (Kafka's in-flight max)
MAX_PRODUCERS = 100_000  # producer-id states kept (least recently used ones go)
#: Producer ids not given by this gateway (from before a restart) tracked, in a pool of their own.
MAX_ADOPTED = 10_000
#: Ids whose state was forgotten, remembered so that their batches are refused, not stored unchecked.
MAX_FORGOTTEN = 100_000
#: Topics one request may create (Metadata auto-creation or CreateTopics); the gateway sets its limit.
MAX_CREATED_PER_REQUEST = 100
#: Bytes of one Metadata answer, about (the gateway sets its limit).
MAX_METADATA_BYTES = 8 << 20
_KAFKA_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
DEFAULT_FETCH_CAP = 16 << 20  # bytes of records in one Fetch answer, whatever the client asks
DEFAULT_PARTITION_CAP = 8 << 20  # ... and in one partition of it
MAX_FETCH_RECORDS = 65_536  # records read for one partition of one answer
MAX_CREATE_PARTITIONS = 10_000
#: Reads of one partition of a read_committed answer while every record read was aborted.
TXN_READS = 16
TXN_PRUNE_INTERVAL = 10.0  # seconds between looks for aborted ranges retention passed
AHEAD_BYTES = 64 << 20  # batches encoded ahead of the fetches that will want them, in all
MAX_AHEAD_PARTITIONS = 1024
COLD_READ_BYTES = 1 << 20  # at most this much in an answer not encoded ahead (Kafka's default max.partition.fetch.bytes)
AHEAD_SECONDS = 5.0  # a batch encoded ahead and not asked for within this is dropped
#: Bytes the compressed batches of one produce request may inflate to, over all its partitions.
MAX_REQUEST_INFLATED = 4 * MAX_DECOMPRESSED
#: Records one produce request may carry, over all its partitions (the gateway sets its limit).
MAX_REQUEST_RECORDS = 500_000


class Backend(Protocol):
    """What the server needs from the store (the gateway implements it)."""

    pmap: PartitionMap

    def head(self, topic: str, address: str) -> int | None: ...
    def first(self, topic: str, address: str) -> int | None: ...
    def stored_bytes(self, topic: str, address: str) -> int: ...
    def packed_since(self, key: tuple[str, str], mark: int, codec: int) -> bool: ...
    def fetch_raw(self, topic: str, address: str, offset: int, count: int) -> tuple[int, list[bytes]]: ...
    def fetch_batches(
        self, topic: str, address: str, offset: int, limit: int, exact: bool = False
    ) -> tuple[int, list[bytes]]: ...
    def fetch_txn_batches(self, topic: str, address: str, offset: int, limit: int, upto: int) -> tuple[int, list[bytes]]: ...
    def create_topic(self, name: str, partitions: int, sync: bool = True) -> bool: ...
    def sync_topics(self) -> None: ...
    def append(self, part: TankPartition, batch: Batch) -> tuple[int, int]: ...
    def storage_failed(self) -> bool: ...
    def output_room(self, token: Any) -> int: ...
    def positions(self, group: str) -> dict[tuple[str, str], int]: ...
    def put_positions(self, group: str, positions: dict[tuple[str, str], int]) -> None: ...
    def broadcast_positions(self, group: str, positions: dict[tuple[str, str], int]) -> None: ...
    # the admin API (dafka.kafka.admin)
    def client_host(self, token: Any) -> str: ...
    def topic_retention(self, topic: str) -> tuple[int | None, int | None, int]: ...
    def static_retention(self, topic: str) -> tuple[int | None, int | None]: ...
    def default_retention(self) -> tuple[int | None, int | None]: ...
    def set_topic_retention(self, topic: str, age_ms: int | None, max_bytes: int | None) -> None: ...
    def topic_cleanup(self, topic: str) -> tuple[str, int, int]: ...
    def static_cleanup(self, topic: str) -> tuple[str, int]: ...
    def set_topic_cleanup(self, topic: str, policy: str, delete_retention_ms: int) -> None: ...
    def add_partitions(self, topic: str, count: int) -> bool: ...
    def delete_front(self, topic: str, address: str, before: int, max_records: int) -> tuple[int, bool]: ...
    def delete_positions(self, group: str, keys: list[tuple[str, str]] | None) -> int: ...
    def position_groups(self, limit: int) -> list[str]: ...
    # transactions (dafka.kafka.txn_api)
    def txn_log(self, records: list[dict[str, Any]]) -> None: ...
    def next_offset(self, topic: str, address: str) -> int: ...
    def append_marker(self, key: tuple[str, str], pid: int, epoch: int, commit: bool) -> int: ...
    def wall_ms(self) -> int: ...


@dataclass(slots=True)
class _ProducerState:
    epoch: int
    # partition key -> recent batches of this epoch (base sequence, last sequence, base offset)
    batches: dict[tuple[str, str], list[tuple[int, int, int]]] = field(default_factory=dict)
    # partition key -> the largest timestamp of its last batch there (DescribeProducers)
    stamps: dict[tuple[str, str], int] = field(default_factory=dict)


def _stored_ts(value: bytes) -> int:
    """A stored value's timestamp as Kafka readers see it: u64 read as int64, a negative one
    (a Tank client's past 2^63) as 0, as the fetch encoder does."""
    return max(int.from_bytes(value[:8], "big", signed=True), 0)


def kafka_topic_name(name: str) -> bool:
    """Whether Kafka's rules allow ``name``: ``[a-zA-Z0-9._-]``, 1..249, not ``.`` or ``..``
    (and not ``__`` reserved, the gateway's own rule)."""
    return (
        _KAFKA_TOPIC.fullmatch(name) is not None and name not in (".", "..") and valid_topic_name(name)
    )


def metadata_cost(name: str, partitions: int) -> int:
    """Bytes a Metadata answer (v8 at most) spends on a topic, at least."""
    return 16 + len(name) * 4 + partitions * 40


class KafkaServer(AdminHandlers, TxnHandlers, TxnAdminHandlers):
    """The gateway's Kafka brain: one per gateway, fed by the shell (the admin requests'
    handlers are :class:`~dafka.kafka.admin.AdminHandlers`)."""

    def __init__(
        self,
        backend: Backend,
        advertise: tuple[str, int],
        *,
        cluster_id: str = "dafka",
        auto_create: bool = True,
        default_partitions: int = 1,
        fetch_cap: int = DEFAULT_FETCH_CAP,
        partition_cap: int = DEFAULT_PARTITION_CAP,
    ) -> None:
        self.backend = backend
        self.advertise = advertise
        self.cluster_id = cluster_id
        self.auto_create = auto_create
        self.default_partitions = default_partitions
        self.fetch_cap = fetch_cap
        self.partition_cap = partition_cap
        self.max_inflated = MAX_REQUEST_INFLATED
        self.max_records = MAX_REQUEST_RECORDS
        #: CreateTopics above this many partitions is refused (the gateway sets its Tank limit).
        self.max_partitions = MAX_CREATE_PARTITIONS
        #: Records over this many bytes are refused (the gateway sets its node's max_record_bytes).
        self.max_record_bytes = 1 << 31
        self.max_created = MAX_CREATED_PER_REQUEST
        self.max_metadata_bytes = MAX_METADATA_BYTES
        self.max_producers = MAX_PRODUCERS
        self.coordinator = Coordinator()
        #: Transactions (KIP-98); the gateway replays its journal into it at start.
        self.txn = TxnCoordinator()
        self._conn_tids: dict[Any, set[str]] = {}  # transactional ids initialised per connection
        self._txn_pruned = 0.0
        #: Producer ids this gateway gave out, least recently used first.
        self._producers: OrderedDict[int, _ProducerState] = OrderedDict()
        #: Ids it did not give (a producer from before a restart, or made up), in a pool of their
        #: own: they can never push out the state of an id this gateway gave.
        self._adopted: OrderedDict[int, _ProducerState] = OrderedDict()
        self.max_adopted = MAX_ADOPTED
        #: Ids whose state was forgotten to make room (their batches cannot be checked).
        self._forgotten: OrderedDict[int, None] = OrderedDict()
        #: partition key -> the producer ids whose batches there are remembered (DescribeProducers)
        self._producers_of: dict[tuple[str, str], dict[int, None]] = {}
        self.producers_forgotten = 0
        self.records_too_large = 0
        self._limited = LogLimiter(log)
        # Read ahead: the next batch of partitions being read, encoded before it is asked for.
        # key -> (offset, limit, batches, when read, the offset after them)
        self._ahead: dict[tuple[str, str], tuple[int, int, bytes, float, int]] = {}
        self._ahead_bytes = 0
        self._wanted: dict[tuple[str, str], tuple[TankPartition, int, int]] = {}
        self.ahead_hits = 0  # fetches answered from a batch encoded ahead
        self.ahead_seconds = AHEAD_SECONDS
        #: Answers of group requests that waited, for the shell to send.
        self.released: list[Answer] = []

    # ---------------------------------------------------------------- dispatch

    def handle(self, token: Any, api_key: int, version: int, corr: int, client_id: str | None,
               req: Any, now: float) -> Outcome:
        """Answer one decoded request (``req`` None: a version not served)."""
        if req is None:
            if api_key == API_VERSIONS:
                return Outcome(encode_response(corr, API_VERSIONS, 0, error_code=Err.UNSUPPORTED_VERSION, api_keys=api_keys()))
            raise ProtocolError(f"API {api_key} v{version} is not served")
        handler = _HANDLERS[api_key]
        return handler(self, token, version, corr, client_id, req, now)

    def _reply(self, corr: int, api_key: int, version: int, **fields: Any) -> Outcome:
        return Outcome(encode_response(corr, api_key, version, **fields))

    # ---------------------------------------------------------------- ApiVersions

    def _api_versions(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        return self._reply(corr, 18, v, error_code=0, api_keys=api_keys(), throttle_time_ms=0)

    # ---------------------------------------------------------------- Metadata

    def _partitions_of(self, topic: str) -> list[TankPartition] | None:
        return self.backend.pmap.partitions(topic)

    def _metadata(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        pmap = self.backend.pmap
        if req.topics is None or (v == 0 and not req.topics):
            names = [t for t in pmap.topics() if t != PARTITIONS_TOPIC]
        else:
            names = list(dict.fromkeys(t.name for t in req.topics))  # each once, in order
        allow = self.auto_create and (v < 4 or req.allow_auto_topic_creation)
        created = 0
        budget = self.max_metadata_bytes
        cut = 0
        topics = []
        for name in names:
            parts = pmap.partitions(name)
            if parts is None and allow and kafka_topic_name(name):
                if created >= self.max_created:
                    topics.append(N(error_code=Err.LEADER_NOT_AVAILABLE, name=name, is_internal=False,
                                    partitions=[], authorized_operations=None))
                    budget -= metadata_cost(name, 0)
                    continue
                created += 1
                self.backend.create_topic(name, self.default_partitions, sync=False)
                parts = pmap.partitions(name)
            if parts is None:
                code = Err.UNKNOWN_TOPIC_OR_PARTITION if kafka_topic_name(name) else Err.INVALID_TOPIC_EXCEPTION
                topics.append(N(error_code=code, name=name, is_internal=False, partitions=[], authorized_operations=None))
                budget -= metadata_cost(name, 0)
                continue
            cost = metadata_cost(name, len(parts))
            if cost > budget:  # checked before the answer is built
                cut += 1
                topics.append(N(error_code=Err.POLICY_VIOLATION, name=name, is_internal=False, partitions=[],
                                authorized_operations=None))
                budget -= metadata_cost(name, 0)
                continue
            budget -= cost
            topics.append(
                N(
                    error_code=0, name=name, is_internal=False, authorized_operations=None,
                    partitions=[
                        N(error_code=0, partition_index=p.pid, leader_id=NODE_ID, leader_epoch=-1,
                          replica_nodes=[NODE_ID], isr_nodes=[NODE_ID], offline_replicas=[])
                        for p in parts
                    ],
                )
            )
        if created:
            self.backend.sync_topics()  # durable, all together, before the answer names them
        if cut:
            self._limited.warning(
                "metadata-cut", "a Kafka Metadata answer left out the partitions of %d topics: it would pass"
                " %d bytes (kafka_max_metadata_bytes)", cut, self.max_metadata_bytes,
            )
        host, port = self.advertise
        return self._reply(
            corr, 3, v, throttle_time_ms=0,
            brokers=[N(node_id=NODE_ID, host=host, port=port, rack=None)],
            cluster_id=self.cluster_id, controller_id=NODE_ID, topics=topics,
            authorized_operations=None,
        )

    # ---------------------------------------------------------------- CreateTopics

    def _create_topics(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        out = []
        created = 0
        for t in req.topics:
            n = t.num_partitions if t.num_partitions > 0 else (len(t.assignments) or self.default_partitions)
            if not kafka_topic_name(t.name):
                code, msg = Err.INVALID_TOPIC_EXCEPTION, "topic names are 1..249 of [a-zA-Z0-9._-], not . or .."
            elif not 0 < n <= self.max_partitions:
                code, msg = Err.INVALID_PARTITIONS, f"1..{self.max_partitions} partitions"
            elif self.backend.pmap.partitions(t.name) is not None:
                code, msg = Err.TOPIC_ALREADY_EXISTS, f"topic {t.name} exists"
            elif v >= 1 and req.validate_only:
                code, msg = Err.NONE, None
            elif created >= self.max_created:
                code, msg = Err.THROTTLING_QUOTA_EXCEEDED, f"at most {self.max_created} topics created per request"
            else:
                created += 1
                ok = self.backend.create_topic(t.name, n, sync=False)
                code, msg = (Err.NONE, None) if ok else (Err.TOPIC_ALREADY_EXISTS, f"topic {t.name} exists")
                if ok:
                    code, msg = self._created_configs(t)
            configs = None
            if v >= 5 and code == Err.NONE:
                configs = [N(name=k, value=val, read_only=ro, config_source=src, is_sensitive=False)
                           for k, val, ro, src, _typ in self._topic_configs(t.name)]
            out.append(N(name=t.name, error_code=code, error_message=msg, topic_config_error_code=0,
                         num_partitions=n if code == Err.NONE else -1,
                         replication_factor=1 if code == Err.NONE else -1, configs=configs))
        if created:
            self.backend.sync_topics()
        return self._reply(corr, 19, v, throttle_time_ms=0, topics=out)

    def _created_configs(self, t: Any) -> tuple[int, str | None]:
        """Apply a new topic's retention.ms / retention.bytes / cleanup.policy /
        delete.retention.ms (its other configs are not kept: the mesh has no per-topic
        setting for them)."""
        wanted = {c.name: c.value for c in (t.configs or ())[:MAX_ADMIN_ITEMS] if c.name in ALTERABLE_KEYS}
        if not wanted:
            return Err.NONE, None
        age, size = self.backend.static_retention(t.name)
        policy, tomb_ms = self.backend.static_cleanup(t.name)
        for name, value in wanted.items():
            if name in CLEANUP_KEYS:
                cparsed, err = parse_cleanup(name, value)
                if err is not None:
                    return Err.INVALID_CONFIG, f"topic created, config refused: {err}"
                if name == "cleanup.policy":
                    policy = str(cparsed)
                else:
                    tomb_ms = int(cparsed or 0)
                continue
            parsed, err = parse_retention(name, value)
            if err is not None:
                return Err.INVALID_CONFIG, f"topic created, config refused: {err}"
            if name == "retention.ms":
                age = parsed
            else:
                size = parsed
        try:
            if "retention.ms" in wanted or "retention.bytes" in wanted:
                self.backend.set_topic_retention(t.name, age, size)
            if any(k in wanted for k in CLEANUP_KEYS):
                self.backend.set_topic_cleanup(t.name, policy, tomb_ms)
        except OSError as exc:
            return Err.KAFKA_STORAGE_ERROR, f"topic created, config not kept: {exc}"
        return Err.NONE, None

    # ---------------------------------------------------------------- InitProducerId

    def _init_producer_id(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        if req.transactional_id is not None:
            return self._init_transactional(token, v, corr, req, now)
        pid = secrets.randbits(63)  # unguessable: another client's id cannot be used or fenced
        while pid in self._producers:
            pid = secrets.randbits(63)
        self._set_producer_state(pid, 0)
        return self._reply(corr, 22, v, throttle_time_ms=0, error_code=0, producer_id=pid, producer_epoch=0)

    # ---------------------------------------------------------------- Produce

    def _produce(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        if req.acks not in (0, 1, -1):
            return self._produce_all_failed(corr, v, req, Err.INVALID_REQUIRED_ACKS)
        if v >= 3 and req.transactional_id is not None and req.transactional_id not in self.txn.txns:
            return self._produce_all_failed(corr, v, req, Err.INVALID_PRODUCER_ID_MAPPING)
        pmap = self.backend.pmap
        # Decode everything first: a malformed batch closes the connection
        # before anything of the request is written.
        # Every partition's batches are held at once: their decompression shares one budget,
        # and so does their count of records (checked from batch headers before decoding:
        # a request of millions of tiny records would be millions of objects).
        plan: list[tuple[str, int, TankPartition | None, list[Batch] | None]] = []
        inflate = [self.max_inflated]
        count = [self.max_records]
        for t in req.topic_data:
            parts = None if t.name == PARTITIONS_TOPIC else pmap.partitions(t.name)
            for p in t.partition_data:
                part = parts[p.index] if parts is not None and 0 <= p.index < len(parts) else None
                batches: list[Batch] | None = []
                if part is not None and part.owned:
                    try:
                        batches = split_batches(p.records, shared=inflate, records=count)
                    except TooManyRecords as exc:
                        self._limited.warning("too-many", "Kafka produce to %s[%d] refused: %s", shown(t.name), p.index, exc)
                        batches = None
                plan.append((t.name, p.index, part, batches))
        needs: dict[tuple[str, str], int] = {}
        results: dict[str, list[tuple[int, int, int]]] = {}
        for name, index, part, batches in plan:
            if batches is None:
                code, base = Err.MESSAGE_TOO_LARGE, -1
            else:
                code, base = self._produce_partition(part, batches, needs)
            results.setdefault(name, []).append((index, code, base))
        if req.acks == 0:
            return Outcome(needs=needs or None)
        return Outcome(encode_produce_response(corr, v, list(results.items())), needs or None)

    def _produce_all_failed(self, corr: int, v: int, req: Any, code: int) -> Outcome:
        if req.acks == 0:
            return Outcome()
        return self._reply(
            corr, 0, v, throttle_time_ms=0,
            responses=[
                N(name=t.name, partition_responses=[
                    N(index=p.index, error_code=code, base_offset=-1, log_append_time_ms=-1,
                      log_start_offset=-1, record_errors=[], error_message=None)
                    for p in t.partition_data
                ])
                for t in req.topic_data
            ],
        )

    def _produce_partition(
        self, part: TankPartition | None, batches: list[Batch], needs: dict[tuple[str, str], int]
    ) -> tuple[int, int]:
        """``(error code, base offset)`` of one partition's produce; queues its records."""
        if part is None:
            return Err.UNKNOWN_TOPIC_OR_PARTITION, -1
        if not part.owned:
            return Err.POLICY_VIOLATION, -1  # a mesh producer writes it
        if self.backend.storage_failed():
            return Err.KAFKA_STORAGE_ERROR, -1
        key = (part.topic, part.address)
        if len(batches) > 1 and any(b.magic >= 2 for b in batches):
            # As Kafka's brokers: one v2 batch per partition a request.  Of two, the first
            # could be stored and the second refused (a sequence gap), and the error answer
            # would make the client retry, and store, the first twice.
            return Err.INVALID_RECORD, -1
        base = -1
        limit = self.max_record_bytes
        for b in batches:
            if b.control:  # markers are the coordinator's to write
                return Err.INVALID_REQUEST, -1
            if b.transactional:
                code = self.txn.check_produce(b.producer_id, b.producer_epoch, key)
                if code != Err.NONE:
                    return code, -1
            if b.scan is None and b.max_slot > MAX_NAME:
                # A legacy message's key the store's key slot cannot hold (v2 batches are kept
                # as sent: keys and headers of any size).
                return Err.INVALID_RECORD, -1
            if b.scan is not None or b.body_size > limit:  # (a legacy record can be over it only then)
                if b.scan is not None:  # key + value + headers, measured when it was checked
                    biggest = b.scan.biggest
                else:
                    biggest = max((len(r[2] or b"") for r in b.records), default=0)
                if biggest > limit:
                    self.records_too_large += 1
                    self._limited.warning(
                        "too-large", "Kafka produce to %s refused: a record of %d bytes, max_record_bytes=%d",
                        shown(part.topic), biggest, limit,
                    )
                    return Err.MESSAGE_TOO_LARGE, -1
        for b in batches:
            if not b.record_count:
                continue
            dup = self._check_sequence(b, key)
            if dup is not None:
                if dup < 0:
                    return -dup, -1
                base = dup if base < 0 else base
                continue
            if b.transactional:
                # Journalled (fsync'ed) before the records are queued: a restart knows them.
                nxt = self.backend.next_offset(*key)
                self.txn.appending(b.producer_id, key, nxt, nxt + b.record_count - 1)
                self._txn_flush()
            first, last = self.backend.append(part, b)
            if b.producer_id >= 0:
                self._remember(b, key, first)
            if base < 0:
                base = first
            needs[key] = last
        if base < 0:
            head = self.backend.head(*key)
            base = 0 if head is None else head + 1
        return Err.NONE, base

    def _check_sequence(self, b: Batch, key: tuple[str, str]) -> int | None:
        """None: a new batch to store; >= 0: a duplicate stored at that offset; < 0: minus
        the error code (an unknown producer, an old epoch, a gap in the sequence)."""
        if b.producer_id < 0:
            return None  # not idempotent
        pid = b.producer_id
        table = self._producers
        state = table.get(pid)
        if state is None:
            table = self._adopted
            state = table.get(pid)
        if state is None:
            if pid in self._forgotten:
                # Its state was forgotten to make room: its batch cannot be checked, and storing
                # it unchecked could store a retry twice.  Refused, never silently.
                self._limited.warning("forgotten", "Kafka producer %d refused: its state was forgotten"
                                      " (more than %d producers); UNKNOWN_PRODUCER_ID", pid, self.max_producers)
                return -Err.UNKNOWN_PRODUCER_ID
            # Not an id this gateway gave (given before a restart): taken from here on, as a
            # Kafka broker that lost a producer's state does, in the pool of such ids.
            state = self._adopted[pid] = _ProducerState(b.producer_epoch)
            if len(self._adopted) > self.max_adopted:
                old, gone = self._adopted.popitem(last=False)
                self._unindex(old, gone)
                self._limited.warning("adopted", "Kafka producer %d forgotten: more than %d producer ids"
                                      " this gateway did not give are in use", old, self.max_adopted)
            return None if b.base_sequence >= 0 else -Err.OUT_OF_ORDER_SEQUENCE_NUMBER
        table.move_to_end(pid)
        if b.producer_epoch < state.epoch:
            return -Err.INVALID_PRODUCER_EPOCH  # fenced: a newer incarnation writes
        if b.base_sequence < 0:
            return -Err.OUT_OF_ORDER_SEQUENCE_NUMBER
        if b.producer_epoch > state.epoch:
            # A new epoch starts every sequence over: nothing of the old one is a duplicate.
            if b.base_sequence != 0:
                return -Err.OUT_OF_ORDER_SEQUENCE_NUMBER
            return None
        recent = state.batches.get(key)
        if not recent:
            return None if b.base_sequence == 0 else -Err.OUT_OF_ORDER_SEQUENCE_NUMBER
        last_seq = b.base_sequence + b.record_count - 1
        for seq, last, offset in recent:
            if seq == b.base_sequence and last == last_seq:
                return offset
        expected = (recent[-1][1] + 1) & 0x7FFFFFFF
        if b.base_sequence != expected:
            return -Err.OUT_OF_ORDER_SEQUENCE_NUMBER
        return None

    def _forget(self, table: OrderedDict[int, _ProducerState]) -> None:
        """Forget the least recently used state of ``table``; its id is remembered (bounded)
        so that its next batch is refused, not stored unchecked."""
        pid, state = table.popitem(last=False)
        self._unindex(pid, state)
        self.producers_forgotten += 1
        self._forgotten[pid] = None
        if len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)

    def _remember(self, b: Batch, key: tuple[str, str], offset: int) -> None:
        state = self._producers.get(b.producer_id) or self._adopted.get(b.producer_id)
        if state is None:
            return
        if b.producer_epoch > state.epoch:
            state.epoch = b.producer_epoch
            self._unindex(b.producer_id, state)
            state.batches.clear()
            state.stamps.clear()
        recent = state.batches.get(key)
        if recent is None:
            recent = state.batches[key] = []
            self._producers_of.setdefault(key, {})[b.producer_id] = None
        recent.append((b.base_sequence, b.base_sequence + b.record_count - 1, offset))
        del recent[:-IDEMPOTENT_WINDOW]
        scan = b.scan
        state.stamps[key] = scan.max_ts if scan is not None else max((r.timestamp for r in b.records), default=-1)

    def _unindex(self, pid: int, state: _ProducerState) -> None:
        """``pid``'s remembered batches (``state``) are forgotten: DescribeProducers stops naming it."""
        index = self._producers_of
        for key in state.batches:
            pids = index.get(key)
            if pids is not None:
                pids.pop(pid, None)
                if not pids:
                    del index[key]

    def _set_producer_state(self, pid: int, epoch: int) -> None:
        """A fresh state for a producer id InitProducerId gave (its old one, if any, goes)."""
        old = self._producers.get(pid)
        if old is not None:
            self._unindex(pid, old)
        self._producers[pid] = _ProducerState(epoch)
        if len(self._producers) > self.max_producers:
            self._forget(self._producers)

    # ---------------------------------------------------------------- ListOffsets

    def _bounds(self, part: TankPartition) -> tuple[int, int]:
        """``(log start offset, high watermark)``; ``(-1, -1)`` for a partition whose offsets
        do not fit Kafka's int64 (a mesh peer's, stored before such offsets were refused)."""
        head = self.backend.head(part.topic, part.address)
        if head is None:
            return 0, 0
        first = self.backend.first(part.topic, part.address)
        if head > MAX_OFFSET or (first is not None and first > MAX_OFFSET + 1):
            self._limited.warning(
                "offset-range", "partition %s of %s has offsets past 2^63 (head %d): Kafka clients"
                " cannot read it (KAFKA_STORAGE_ERROR)", part.address, shown(part.topic), head,
            )
            return -1, -1
        return (head + 1 if first is None else first), head + 1

    def _list_offsets(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        topics = []
        for t in req.topics:
            parts = self._partitions_of(t.name)
            out = []
            for p in t.partitions:
                part = parts[p.partition_index] if parts and 0 <= p.partition_index < len(parts) else None
                if part is None:
                    out.append(N(partition_index=p.partition_index, error_code=Err.UNKNOWN_TOPIC_OR_PARTITION,
                                 old_style_offsets=[], timestamp=-1, offset=-1, leader_epoch=-1))
                    continue
                start, hwm = self._bounds(part)
                ts = -1
                if hwm < 0:
                    out.append(N(partition_index=p.partition_index, error_code=Err.KAFKA_STORAGE_ERROR,
                                 old_style_offsets=[], timestamp=-1, offset=-1, leader_epoch=-1))
                    continue
                if p.timestamp == -2:
                    offset = start
                elif p.timestamp in (-1, -3):  # latest; -3: max timestamp (approximated by the end)
                    offset = hwm
                    if v >= 2 and req.isolation_level == 1 and p.timestamp == -1:
                        offset = self.txn.lso((part.topic, part.address), hwm)
                else:
                    try:
                        offset, ts = self._offset_for_time(part, start, hwm, p.timestamp)
                    except Exception as exc:  # a damaged stored block, StorageError, LMDB errors
                        # Its partition alone: raised, it closed the connection as bad input.
                        self._limited.emit(logging.ERROR, "read-failed", "cannot read %s for a Kafka ListOffsets:"
                                           " %s", shown(part.topic), exc)
                        out.append(N(partition_index=p.partition_index, error_code=Err.KAFKA_STORAGE_ERROR,
                                     old_style_offsets=[], timestamp=-1, offset=-1, leader_epoch=-1))
                        continue
                out.append(N(partition_index=p.partition_index, error_code=0,
                             old_style_offsets=[offset], timestamp=ts, offset=offset, leader_epoch=-1))
            topics.append(N(name=t.name, partitions=out))
        return self._reply(corr, 2, v, throttle_time_ms=0, topics=topics)

    def _offset_for_time(self, part: TankPartition, start: int, hwm: int, ts: int) -> tuple[int, int]:
        """First offset whose timestamp is >= ts (binary search: timestamps mostly grow)."""
        lo, hi = start, hwm
        while lo < hi:
            mid = (lo + hi) // 2
            _, values = self.backend.fetch_raw(part.topic, part.address, mid, 1)
            if not values:
                break
            if _stored_ts(values[0]) < ts:
                lo = mid + 1
            else:
                hi = mid
        if lo >= hwm:
            return -1, -1
        _, values = self.backend.fetch_raw(part.topic, part.address, lo, 1)
        return lo, (_stored_ts(values[0]) if values else -1)

    # ---------------------------------------------------------------- Fetch

    def _fetch(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        data, size, waiting, faulted = self.fetch_answer(corr, v, req, self.backend.output_room(token))
        if faulted or size >= max(1, req.min_bytes) or not waiting or req.max_wait_ms <= 0:
            return Outcome(data)
        committed = v >= 4 and req.isolation_level == 1
        marks = {key: (self._readable_last(key, committed), self.backend.stored_bytes(*key), cap)
                 for key, cap in waiting.items()}
        return Outcome(park=ParkedFetch(corr, v, req, now + min(req.max_wait_ms, 300_000) / 1000.0, list(waiting),
                                        req.min_bytes, size, marks))

    def retry_fetch(self, parked: ParkedFetch, timed_out: bool, room: int | None = None) -> list[bytes] | None:
        """The answer of a parked fetch, or None while it should wait on (``room``: as for
        :meth:`fetch_answer`).

        Before its time is up, the answer is built only once the partitions it waits on
        have taken enough bytes since it parked to make ``min_bytes`` with what it had
        (their stored bytes and records, from the partitions' metadata: no record is
        read), and then it goes, as Kafka's broker completes a delayed fetch on its
        estimate.  Building it at every commit (reading the other partitions' records
        again and again, for a min_bytes they may never reach) let a client make each
        produce cost the gateway as many answers as it had fetches parked."""
        if not timed_out and parked.size + self._arrived(parked) < max(1, parked.min_bytes):
            return None
        data, _size, _, _faulted = self.fetch_answer(parked.correlation_id, parked.version, parked.request, room)
        return data

    def _arrived(self, parked: ParkedFetch) -> int:
        """About the bytes an answer would now hold from the partitions ``parked`` waits on
        (stored bytes since it parked, 8 more a record and a batch header each, within each
        partition's limit in the answer).  A partition that stores fewer bytes than when it
        parked (DeleteRecords, retention or compaction removed some since) cannot tell what
        came from its bytes, nor compressed blocks of another codec (a Tank producer's snappy
        bundles, converted for a Kafka answer), nor one whose last offset went back (deleted and created
        again): either counts as its whole limit once anything is readable, so the answer
        is built and goes (it waited to max_wait, whatever came)."""
        committed = parked.version >= 4 and parked.request.isolation_level == 1
        backend = self.backend
        return sum(
            arrived(mark, self._readable_last(key, committed), lambda k=key: backend.stored_bytes(*k),
                    lambda k=key, m=mark: backend.packed_since(k, m[0], CODEC_KAFKA), 8, 61)
            for key, mark in parked.marks.items()
        )

    def _readable_last(self, key: tuple[str, str], committed: bool) -> int:
        """The last offset of a partition a fetch can read now (-1: none): its head, or
        for read_committed before its last stable offset."""
        head = self.backend.head(*key)
        if head is None:
            return -1
        if committed and key in self.txn.touched:
            return self.txn.lso(key, head + 1) - 1
        return head

    def fetch_answer(
        self, corr: int, v: int, req: Any, room: int | None = None
    ) -> tuple[list[bytes], int, dict[tuple[str, str], int], bool]:
        """The answer as things are now (its parts, :func:`~dafka.kafka.codec.encode_fetch_parts`),
        its record bytes, the partitions at their end (each with its byte limit in the
        answer), any fault.

        ``room``: answer bytes the gateway may still hold (its output budget);
        the answer carries no more records than that, but one record at least.
        """
        budget = wanted = min(req.max_bytes if v >= 3 else self.fetch_cap, self.fetch_cap)
        tight = False  # the gateway's output room, not the client, bounds this answer
        if room is not None and room < budget:
            budget = room
            tight = True
        size = 0
        waiting: dict[tuple[str, str], int] = {}
        faulted = False
        topics = []
        committed = v >= 4 and req.isolation_level == 1
        touched = self.txn.touched
        for t in req.topics:
            parts = self._partitions_of(t.topic)
            out = []
            for p in t.partitions:
                part = parts[p.partition] if parts and 0 <= p.partition < len(parts) else None
                if part is None:
                    faulted = True
                    out.append((p.partition, Err.UNKNOWN_TOPIC_OR_PARTITION, -1, -1, b""))
                    continue
                start, hwm = self._bounds(part)
                off = p.fetch_offset
                if hwm < 0:
                    faulted = True
                    out.append((p.partition, Err.KAFKA_STORAGE_ERROR, -1, -1, b""))
                    continue
                if off < start or off > hwm:
                    faulted = True
                    out.append((p.partition, Err.OFFSET_OUT_OF_RANGE, hwm, start, b""))
                    continue
                records = b""  # an empty record set, never null: librdkafka refuses null
                key = (part.topic, part.address)
                if key in touched:  # written by transactions: markers, a last stable offset
                    lso = self.txn.lso(key, hwm)
                    end = lso if committed else hwm
                else:
                    lso = end = hwm
                if off < end and (budget > 0 or size == 0):
                    limit = max(1, min(p.partition_max_bytes, self.partition_cap, budget))
                    if key in touched:
                        read = self._read_txn(part, off, end, limit, committed)
                    else:
                        read = self._read(part, off, hwm, limit, tight and budget < p.partition_max_bytes)
                    if read is None:
                        faulted = True
                        out.append((p.partition, Err.KAFKA_STORAGE_ERROR, hwm, start, b""))
                        continue
                    records = read
                    size += len(records)
                    budget -= len(records)
                elif off >= end:
                    # (the client's limit, not the output room now: a parked fetch's estimate
                    # keeps it, and a room spent when it parked would hold it to max_wait)
                    waiting[key] = max(1, min(p.partition_max_bytes, self.partition_cap, wanted - size))
                out.append((p.partition, 0, hwm, start, records, lso))
            topics.append((t.topic, out))
        return encode_fetch_parts(corr, v, topics), size, waiting, faulted

    def _read(self, part: TankPartition, off: int, hwm: int, limit: int, exact: bool = False) -> bytes | None:
        """One batch of whole records from ``off``, at most ``limit`` bytes of values
        (but at least one record, as KIP-74 wants).

        A consumer reading a backlog asks next for where this answer ends, with
        the same limit: that batch is encoded ahead (:meth:`read_ahead`, called
        by the shell once the answer is sent), so it is ready when the request
        comes, and the gateway encodes while the client decodes.  ``exact``: the
        gateway's output budget bounds the answer, so a stored batch larger than
        ``limit`` is sliced (see :func:`dafka.store.reader.kafka_batches`).
        """
        key = (part.topic, part.address)
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self._ahead_bytes -= len(ahead[2])
            if ahead[0] == off and ahead[1] == limit:
                self.ahead_hits += 1
                data = ahead[2]
                self._want_ahead(part, ahead[4], hwm, limit)
                return data
        # Not asked for ahead: a short first answer comes back sooner, and the
        # full-size next one is read while it travels.
        got = self._encode_read(part, off, hwm, min(limit, COLD_READ_BYTES), exact)
        if got is None:
            return None
        data, nxt = got
        if data:
            self._want_ahead(part, nxt, hwm, limit)
        return data

    def _read_txn(self, part: TankPartition, off: int, end: int, limit: int, committed: bool) -> bytes | None:
        """A partition written by transactions, from ``off`` up to ``end`` (the last stable
        offset for read_committed): batches stored as sent go whole (a transaction's with
        its producer id and transactional flag), control records as control batches (every
        client skips them, and moves past them), and for read_committed no aborted batch at
        all (left out here, so any client drops them; the answer's aborted-transactions list
        is empty: a transaction's offset ranges are whole stored batches).  If every batch
        read was aborted and no marker came, an empty batch spans them, so the reader moves
        on.  Not read ahead."""
        key = (part.topic, part.address)
        out: list[bytes] = []
        size = 0
        pos = off
        for _ in range(TXN_READS):
            if pos >= end:
                break
            try:
                nxt, parts = self.backend.fetch_txn_batches(part.topic, part.address, pos, max(1, limit - size),
                                                            end - 1)
            except ValueError as exc:  # a stored value that does not parse
                self._limited.emit(logging.ERROR, "serve-failed", "cannot serve %s from offset %d to a Kafka"
                                   " fetch: %s", shown(part.topic), pos, exc)
                return None
            except Exception as exc:  # StorageError and LMDB errors
                self._limited.emit(logging.ERROR, "read-failed", "cannot read %s for a Kafka fetch: %s",
                                   shown(part.topic), exc)
                return None
            if not parts or nxt <= pos:
                break
            aborted = self.txn.aborted_between(key, pos, nxt - 1) if committed else []
            for data in parts:
                if not aborted:
                    out.append(data)
                    size += len(data)
                    continue
                for start, stop, base, _last in batch_spans(data):
                    if any(a <= base <= b for a, b in aborted):
                        continue  # an aborted transaction's batch: left out
                    out.append(data[start:stop])
                    size += stop - start
            pos = nxt
            if out or size >= limit:
                break
        if not out and pos > off:
            out.append(empty_batch(off, pos - 1))
        return b"".join(out)

    def _want_ahead(self, part: TankPartition, nxt: int, hwm: int, limit: int) -> None:
        if nxt < hwm and len(self._wanted) < MAX_AHEAD_PARTITIONS:
            self._wanted[(part.topic, part.address)] = (part, nxt, limit)

    @property
    def ahead_wanted(self) -> bool:
        """Whether :meth:`read_ahead` has work."""
        return bool(self._wanted)

    def drop_ahead(self, topic: str, address: str) -> None:
        """Forget what was read ahead for a partition (its front moved: a DeleteRecords)."""
        old = self._ahead.pop((topic, address), None)
        if old is not None:
            self._ahead_bytes -= len(old[2])

    def read_ahead(self, now: float) -> None:
        """Encode the batches consumers will ask for next (at most AHEAD_BYTES held,
        each for AHEAD_SECONDS unless asked for)."""
        wanted, self._wanted = self._wanted, {}
        for key, (part, off, limit) in wanted.items():
            if self._ahead_bytes + limit > AHEAD_BYTES:
                break
            hwm = self._bounds(part)[1]
            if off >= hwm:
                continue
            got = self._encode_read(part, off, hwm, limit)
            if got is not None and got[0]:
                data, nxt = got
                old = self._ahead.pop(key, None)
                if old is not None:
                    self._ahead_bytes -= len(old[2])
                self._ahead[key] = (off, limit, data, now, nxt)
                self._ahead_bytes += len(data)

    def _encode_read(self, part: TankPartition, off: int, hwm: int, limit: int,
                     exact: bool = False) -> tuple[bytes, int] | None:
        """``(record batches from off, the offset after them)``, about ``limit`` bytes; None
        when the store cannot be read.  Batches stored as produced go whole (one cursor
        seek to the block holding ``off``: the client skips the records before it, as with
        a Kafka broker); records stored otherwise are encoded into a batch."""
        try:
            nxt, parts = self.backend.fetch_batches(part.topic, part.address, off, limit, exact)
        except ValueError as exc:  # a stored value that does not parse
            self._limited.emit(logging.ERROR, "serve-failed", "cannot serve %s from offset %d to a Kafka fetch: %s",
                               shown(part.topic), off, exc)
            return None
        except Exception as exc:  # StorageError and LMDB errors
            self._limited.emit(logging.ERROR, "read-failed", "cannot read %s for a Kafka fetch: %s", shown(part.topic), exc)
            return None
        if not parts:
            return b"", off
        return (parts[0] if len(parts) == 1 else b"".join(parts)), nxt

    # ---------------------------------------------------------------- groups

    def _find_coordinator(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        host, port = self.advertise
        if v >= 4:  # batched (KIP-699): one answer per key
            out = []
            for i, key in enumerate(req.coordinator_keys):
                if i >= MAX_ADMIN_ITEMS:
                    code, msg = Err.POLICY_VIOLATION, f"at most {MAX_ADMIN_ITEMS} keys per request"
                elif req.key_type not in (0, 1):
                    code, msg = Err.INVALID_REQUEST, f"key type {req.key_type}"
                else:
                    code, msg = Err.NONE, None
                ok = code == Err.NONE
                out.append(N(key=key, node_id=NODE_ID if ok else -1, host=host if ok else "",
                             port=port if ok else -1, error_code=code, error_message=msg))
            return self._reply(corr, 10, v, throttle_time_ms=0, coordinators=out)
        if v >= 1 and req.key_type not in (0, 1):  # 0: a group, 1: a transactional id
            return self._reply(corr, 10, v, throttle_time_ms=0, error_code=Err.INVALID_REQUEST,
                               error_message=f"key type {req.key_type}", node_id=-1, host="", port=-1)
        return self._reply(corr, 10, v, throttle_time_ms=0, error_code=0, error_message=None,
                           node_id=NODE_ID, host=host, port=port)

    def _join_group(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        session = req.session_timeout_ms / 1000.0
        rebalance = (req.rebalance_timeout_ms if v >= 1 else req.session_timeout_ms) / 1000.0
        answers = self.coordinator.join(
            token, now, req.group_id, req.member_id, cid or "", req.protocol_type,
            [(p.name, bytes(p.metadata)) for p in req.protocols], session, rebalance,
            self.backend.client_host(token),
        )
        return self._release(token, answers)

    def _sync_group(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        answers = self.coordinator.sync(
            token, now, req.group_id, req.member_id, req.generation_id,
            [(a.member_id, bytes(a.assignment)) for a in req.assignments],
        )
        return self._release(token, answers)

    def _release(self, token: Any, answers: list[Answer]) -> Outcome:
        """Answers for this request come back as its outcome; the others wait for the shell."""
        mine = None
        for a in answers:
            if a.token is token:
                mine = a
            else:
                self.released.append(a)
        return Outcome(self.encode_answer(mine)) if mine is not None else Outcome()

    def encode_answer(self, a: Answer) -> bytes:
        """The encoded response of a group request (the token knows its request)."""
        corr, api_key, v = a.token.correlation_id, a.token.api_key, a.token.version
        fields = dict(a.fields)
        if api_key == 11:
            fields["members"] = [N(member_id=m, group_instance_id=None, metadata=md) for m, md in fields["members"]]
            if v < 7:
                fields.pop("protocol_type", None)
        return encode_response(corr, api_key, v, throttle_time_ms=0, **fields)

    def _heartbeat(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        code = self.coordinator.heartbeat(now, req.group_id, req.member_id, req.generation_id)
        return self._reply(corr, 12, v, throttle_time_ms=0, error_code=code)

    def _leave_group(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        ids = [m.member_id for m in req.members] if v >= 3 else [req.member_id]
        codes, answers = self.coordinator.leave(now, req.group_id, ids)
        self.released.extend(answers)
        members = [N(member_id=m, group_instance_id=None, error_code=c) for m, c in zip(ids, codes, strict=True)]
        top = codes[0] if v < 3 else Err.NONE
        return self._reply(corr, 13, v, throttle_time_ms=0, error_code=top, members=members)

    def tick(self, now: float) -> None:
        self.released.extend(self.coordinator.tick(now))
        self.txn_tick(now)
        if self.txn.aborted and now - self._txn_pruned >= TXN_PRUNE_INTERVAL:
            self._txn_pruned = now
            for key in list(self.txn.aborted):
                first = self.backend.first(*key)
                if first is not None:
                    self.txn.prune(key, first)
            self._txn_flush()
        if self._ahead:
            for key in [k for k, a in self._ahead.items() if now - a[3] > self.ahead_seconds]:
                self._ahead_bytes -= len(self._ahead.pop(key)[2])

    # ---------------------------------------------------------------- offsets

    def _offset_commit(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        check = self.coordinator.check_member(req.group_id, req.member_id, req.generation_id_or_member_epoch)
        positions: dict[tuple[str, str], int] = {}
        topics = []
        for t in req.topics:
            parts = self._partitions_of(t.name)
            out = []
            for p in t.partitions:
                part = parts[p.partition_index] if parts and 0 <= p.partition_index < len(parts) else None
                code = check
                if code == Err.NONE and part is None:
                    code = Err.UNKNOWN_TOPIC_OR_PARTITION
                elif code == Err.NONE and p.committed_offset >= 0:
                    positions[(part.topic, part.address)] = p.committed_offset  # type: ignore[union-attr]
                out.append(N(partition_index=p.partition_index, error_code=code))
            topics.append(N(name=t.name, partitions=out))
        if positions:
            try:
                self.backend.put_positions(req.group_id, positions)
            except Exception as exc:  # ValueError (names too long), storage errors
                self._limited.emit(logging.ERROR, "commit-failed", "cannot commit offsets of group %s: %s",
                                   shown(req.group_id), exc)
                for t in topics:
                    for p in t.partitions:
                        if p.error_code == Err.NONE:
                            p.error_code = Err.KAFKA_STORAGE_ERROR if not isinstance(exc, ValueError) else Err.INVALID_REQUEST
            else:
                # As a Dafka member's COMMIT does: every store of the mesh records them too.
                try:
                    self.backend.broadcast_positions(req.group_id, positions)
                except Exception as exc:  # the local commit stands; other stores miss this one
                    self._limited.warning("commit-send", "cannot send the commit of group %s to the mesh: %s",
                                          shown(req.group_id), exc)
        return self._reply(corr, 8, v, throttle_time_ms=0, topics=topics)

    def _offset_fetch(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        if v >= 8:  # batched: several groups in one request
            groups = []
            for i, g in enumerate(req.groups):
                if i >= MAX_ADMIN_ITEMS:
                    groups.append(N(group_id=g.group_id, topics=[], error_code=Err.POLICY_VIOLATION))
                    continue
                asked = None if g.topics is None else [(t.name, list(t.partition_indexes)) for t in g.topics]
                groups.append(N(group_id=g.group_id, topics=self._group_offsets(g.group_id, asked), error_code=0))
            return self._reply(corr, 9, v, throttle_time_ms=0, groups=groups)
        asked = None if req.topics is None else [(t.name, list(t.partition_indexes)) for t in req.topics]
        topics = self._group_offsets(req.group_id, asked)
        return self._reply(corr, 9, v, throttle_time_ms=0, topics=topics, error_code=0)

    def _group_offsets(self, group: str, asked: list[tuple[str, list[int]]] | None) -> list[Any]:
        """A group's committed offsets of the partitions ``asked`` (None: of every partition
        it has one for)."""
        try:
            held = self.backend.positions(group)
        except Exception as exc:
            self._limited.emit(logging.ERROR, "positions-failed", "cannot read offsets of group %s: %s",
                               shown(group), exc)
            held = {}
        pmap = self.backend.pmap
        if asked is None:  # every partition the group has a position for
            wanted: dict[str, list[int]] = {}
            for (topic, address) in held:
                part = pmap.lookup(topic, address)
                if part is not None:
                    wanted.setdefault(topic, []).append(part.pid)
            asked = list(wanted.items())
        topics = []
        for name, indexes in asked:
            parts = self._partitions_of(name)
            out = []
            for i in indexes:
                part = parts[i] if parts and 0 <= i < len(parts) else None
                off = held.get((part.topic, part.address), -1) if part is not None else -1
                if off > MAX_OFFSET + 1:  # a mesh COMMIT's u64 that Kafka's int64 cannot carry
                    off = -1
                out.append(N(partition_index=i, committed_offset=off, committed_leader_epoch=-1, metadata="", error_code=0))
            topics.append(N(name=name, partitions=out))
        return topics


_HANDLERS = {
    0: KafkaServer._produce,
    1: KafkaServer._fetch,
    2: KafkaServer._list_offsets,
    3: KafkaServer._metadata,
    8: KafkaServer._offset_commit,
    9: KafkaServer._offset_fetch,
    10: KafkaServer._find_coordinator,
    11: KafkaServer._join_group,
    12: KafkaServer._heartbeat,
    13: KafkaServer._leave_group,
    14: KafkaServer._sync_group,
    18: KafkaServer._api_versions,
    15: KafkaServer._describe_groups,
    16: KafkaServer._list_groups,
    19: KafkaServer._create_topics,
    20: KafkaServer._delete_topics,
    21: KafkaServer._delete_records,
    22: KafkaServer._init_producer_id,
    32: KafkaServer._describe_configs,
    33: KafkaServer._alter_configs,
    37: KafkaServer._create_partitions,
    42: KafkaServer._delete_groups,
    24: KafkaServer._add_partitions_to_txn,
    25: KafkaServer._add_offsets_to_txn,
    26: KafkaServer._end_txn,
    28: KafkaServer._txn_offset_commit,
    44: KafkaServer._incremental_alter_configs,
    47: KafkaServer._offset_delete,
    60: KafkaServer._describe_cluster,
    61: KafkaServer._describe_producers,
    65: KafkaServer._describe_transactions,
    66: KafkaServer._list_transactions,
}
