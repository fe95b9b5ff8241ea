"""The Kafka listener of the gateway: sockets, slots and the store, around :class:`KafkaServer`.

:class:`KafkaGateway` is the Tank :class:`~dafka.tank.gateway.Gateway` (a
full store on the mesh) with a second TCP listener that speaks Kafka.  Both
protocols share the partition map (a Kafka partition index is the Tank
partition id), the owned partitions, the write path and the publishing of
produced records on the mesh.

Everything runs in the store's I/O thread.  Accepting, the allow-list and
non-blocking sends are the shell both listeners share
(:mod:`dafka.gateway.connections`).  Per connection:

* frames are read with their size checked before the body is buffered
  (``max_frame``); a frame over it, a malformed request or an API version not
  served closes that connection only (ApiVersions aside, which answers error
  35 as Kafka does);
* answers go out in request order (Kafka clients pipeline): each request
  takes a slot, filled now, after the commit of its records (produce), when
  data arrives or ``max_wait`` passes (fetch), or when its group's rebalance
  moves (join, sync).  At most ``max_inflight`` slots and ``MAX_OUTPUT``
  unsent bytes per connection: past either, the connection is not read;
  over all connections, answer bytes held (ready or unsent) past the limit
  ``kafka_max_output_bytes`` stop reading the connections that hold some,
  and fetch answers shrink to what still fits (one record at least);
* a client that stalls half way through a frame for ``request_timeout`` (the Tank port's limit)
  seconds is closed (slow loris), as is one that takes none of its answers for as long;
  at most ``max_connections`` are open.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from dafka import fastio
from dafka.core import wire
from dafka.errors import ProtocolError
from dafka.gateway.connections import (
    Connection,
    LogLimiter,
    Refusals,
    accepted,
    client_allowed,
    close_quietly,
    events,
    flush,
    prepare,
    send,
    unread_for,
)
from dafka.kafka.codec import DEFAULT_MAX_FRAME, FrameReader, decode_request
from dafka.kafka.meshtxn import mesh_steps, stable_head
from dafka.kafka.outcome import Data, ParkedFetch
from dafka.kafka.records import (
    Batch,
    batch_record_count,
    block_contents,
    encode_batch,
    log_append_time,
    store_pairs,
    txn_count,
    txn_encode,
)
from dafka.kafka.serving import KafkaServer
from dafka.kafka.txn import TxnLog
from dafka.nodes.node import new_address
from dafka.store.block import kafka_block_of, store_block
from dafka.store.compaction import CompactionPolicy
from dafka.store.db import RecordDB, Retention, RetentionPolicy
from dafka.store.layout import FLAG_CONTROL, FLAG_KEY, VALUE_HEADER
from dafka.store.node import FetchJob
from dafka.store.writer import pack_records
from dafka.tank.gateway import Gateway
from dafka.tank.mapping import TankPartition, shown, valid_topic_name

log = logging.getLogger("dafka.kafka")

DEFAULT_KAFKA_PORT = 9092
#: Topic configs altered by Kafka clients (retention), in the database directory.
CONFIGS_FILE = "kafka-configs.json"
#: The transaction coordinator's journal, in the database directory.
TXN_FILE = "kafka-transactions.journal"
_MARKER = struct.Struct(">qhB")  # a control record's key slot: producer id, epoch, type
RECV_SIZE = 256 << 10
MAX_OUTPUT = 64 << 20
DEFAULT_MAX_INFLIGHT = 256
DEFAULT_MAX_CONNECTIONS = 1024
TICK_INTERVAL = 0.1
_OFFSET = itemgetter(2)  # a record tuple's offset
_HEADS = (wire.Head, wire.DirectHead)


@dataclass(eq=False, slots=True, kw_only=True)
class _Conn(Connection):
    frames: FrameReader
    slots: deque[_Slot] = field(default_factory=deque)
    queued: int = 0  # answer bytes held: ready in slots, or unsent in out
    over: bool = False  # not read: the gateway holds too many answer bytes, some of them ours
    last_buffered: int = 0


@dataclass(eq=False, slots=True)
class _Slot:
    """One request's place in its connection's answer order (also the coordinator's token)."""

    conn: _Conn
    correlation_id: int
    api_key: int
    version: int
    data: Data | None = None
    held: bool = False  # a produce answer waiting for its records' commit


class KafkaGateway(Gateway):
    """The Tank gateway plus a Kafka listener on ``kafka_listen`` (port 0: ephemeral)."""

    def __init__(
        self,
        db: Any,
        config: Any = None,
        *,
        kafka_listen: tuple[str, int] = ("127.0.0.1", DEFAULT_KAFKA_PORT),
        kafka_advertise: tuple[str, int] | None = None,
        kafka_max_frame: int = DEFAULT_MAX_FRAME,
        kafka_max_connections: int = DEFAULT_MAX_CONNECTIONS,
        kafka_max_inflight: int = DEFAULT_MAX_INFLIGHT,
        kafka_auto_create: bool = True,
        kafka_default_partitions: int = 1,
        kafka_fetch_cap: int | None = None,
        **gateway_options: Any,
    ) -> None:
        self.kafka_listener = socket.create_server(kafka_listen, backlog=256)
        try:
            self.kafka_listener.setblocking(False)
            self.kafka_port = self.kafka_listener.getsockname()[1]
            host = kafka_listen[0]
            if kafka_advertise is None:
                if host in ("", "0.0.0.0", "::"):
                    host = socket.gethostname()
                kafka_advertise = (host, self.kafka_port)
            self.kafka_max_frame = kafka_max_frame
            self.kafka_max_connections = kafka_max_connections
            self.kafka_max_inflight = kafka_max_inflight
            self._kconns: dict[socket.socket, _Conn] = {}
            self._kpending: list[tuple[_Slot, dict[tuple[str, str], int]]] = []
            self._kparked: list[tuple[_Slot, ParkedFetch]] = []
            self._kthrottled: list[_Conn] = []
            self._kqueued = 0  # answer bytes held over every connection (their ``queued``)
            self.kafka_queued_peak = 0  # the most it has been
            self._kover: dict[_Conn, None] = {}  # connections with ``over`` set, in order
            self._kresuming = False
            # Kafka blocks queued, to go on the mesh once committed (each work handed to the
            # writer marks how many it holds); blocks committed whose records no mesh reader
            # was there to take.
            self._kpublish: list[tuple[tuple[str, str], int, bytes]] = []
            self.kafka_unpublished = 0
            self.txn_voids = 0  # VOIDs said to mesh readers for aborted records and markers
            self._kcommit_id = 0
            self._krefusals = Refusals(log)
            self._klimited = LogLimiter(log)
            extra = {} if kafka_fetch_cap is None else {"fetch_cap": kafka_fetch_cap}
            self.kafka = KafkaServer(
                self, kafka_advertise, auto_create=kafka_auto_create,
                default_partitions=kafka_default_partitions, **extra,
            )
            # The journal is replayed before the store starts: its I/O thread recovers the
            # transactions in on_start, at once.
            rdb = db if isinstance(db, RecordDB) else RecordDB(db, sync=gateway_options.get("sync", True))
            try:
                self._txnlog = TxnLog(os.path.join(rdb.path, TXN_FILE))
                self._txn_compact_at = TxnLog.COMPACT_LINES
                self._load_transactions()
            except BaseException:
                if rdb is not db:
                    rdb.close()
                raise
            super().__init__(rdb, config, **gateway_options)
            # The Tank port's limit holds for Kafka's CreateTopics too.
            self.kafka.max_partitions = min(self.kafka.max_partitions, self.limits.max_partitions_per_topic)
            self.kafka.max_records = self.limits.kafka_max_produce_records
            self.kafka.coordinator.max_rebalance_timeout = self.limits.kafka_max_rebalance_timeout
            self.kafka.max_metadata_bytes = self.limits.kafka_max_metadata_bytes
            self.kafka.max_created = self.limits.kafka_max_created_topics
            # As the Tank port and the mesh: a record the mesh would drop is refused here.
            self.kafka.max_record_bytes = self.config.max_record_bytes
            self._kretention_static = self.retention  # the configuration's; Kafka's changes go over it
            self._kretention: dict[str, Retention] = {}
            self._kcompaction_static = self.compaction  # likewise for cleanup.policy
            self._kcleanup: dict[str, tuple[str, int]] = {}  # topic -> (cleanup.policy, delete.retention.ms)
            self._load_configs()
        except BaseException:
            self.kafka_listener.close()
            raise
        log.info("Kafka listener on %s:%d (advertised as %s:%d)", kafka_listen[0], self.kafka_port, *kafka_advertise)

    # ---------------------------------------------------------------- Backend for KafkaServer

    def head(self, topic: str, address: str) -> int | None:
        return self._heads.get((topic, address))

    def first(self, topic: str, address: str) -> int | None:
        return self.db.first(topic, address)

    def stored_bytes(self, topic: str, address: str) -> int:
        info = self.db.info(topic, address)
        return 0 if info is None else info.bytes

    def fetch_raw(self, topic: str, address: str, offset: int, count: int) -> tuple[int, list[bytes]]:
        return self.db.fetch_raw(topic, address, offset, count)

    def fetch_txn_batches(self, topic: str, address: str, offset: int, limit: int, upto: int) -> tuple[int, list[bytes]]:
        """:meth:`fetch_batches` of a partition written by transactions, none starting past
        ``upto``: control records as control batches (:func:`~dafka.kafka.records.txn_encode`)."""
        _start, nxt, batches = self.db.fetch_kafka(topic, address, offset, limit, txn_encode, txn_count,
                                                   upto=upto)
        return nxt, batches

    def fetch_batches(
        self, topic: str, address: str, offset: int, limit: int, exact: bool = False
    ) -> tuple[int, list[bytes]]:
        """Kafka record batches from ``offset`` (stored batches whole, unless ``exact``),
        about ``limit`` bytes: ``(the offset after them, batches)``."""
        _start, nxt, batches = self.db.fetch_kafka(topic, address, offset, limit, encode_batch, batch_record_count,
                                                   exact)
        return nxt, batches

    def storage_failed(self) -> bool:
        return self.storage_error is not None

    def output_room(self, token: Any) -> int:
        """Answer bytes the gateway may still hold, over all connections and on the token's."""
        conn = token.conn
        return max(0, min(self.limits.kafka_max_output_bytes - self._kqueued, MAX_OUTPUT - conn.queued))

    def positions(self, group: str) -> dict[tuple[str, str], int]:
        return self.db.positions(group)

    def put_positions(self, group: str, positions: dict[tuple[str, str], int]) -> None:
        self.db.put_positions(group, positions)

    def broadcast_positions(self, group: str, positions: dict[tuple[str, str], int]) -> None:
        """Send a group's committed positions to every store (a COMMIT, as Dafka members send)."""
        self._kcommit_id += 1
        entries = tuple((t, p, o) for (t, p), o in sorted(positions.items()))
        self.send(wire.Commit(group, self.address, self._kcommit_id, entries))

    def create_topic(self, name: str, partitions: int, sync: bool = True) -> bool:
        if not valid_topic_name(name) or self.pmap.partitions(name) is not None or self.db.partitions(name):
            return False
        if not self.create_owned_topic(name, partitions, "Kafka", sync):
            return False
        log.info("created topic %s with %d gateway partitions (Kafka)", shown(name), partitions)
        return True

    # ---------------------------------------------------------------- Backend: the admin API

    def wall_ms(self) -> int:
        return int(time.time() * 1000)

    def client_host(self, token: Any) -> str:
        name = getattr(getattr(token, "conn", None), "name", "")
        return "/" + name.rsplit(":", 1)[0] if name else ""

    def static_retention(self, topic: str) -> tuple[int | None, int | None]:
        r = self._kretention_static.for_topic(topic)
        return r.max_age_ms, r.max_bytes

    def default_retention(self) -> tuple[int | None, int | None]:
        r = self._kretention_static.default
        return r.max_age_ms, r.max_bytes

    def topic_retention(self, topic: str) -> tuple[int | None, int | None, int]:
        """This store's retention of ``topic`` and its Kafka config source (1: altered by
        a Kafka client, 4: the configuration file, 5: keep everything, the default)."""
        r = self._kretention.get(topic)
        if r is not None:
            return r.max_age_ms, r.max_bytes, 1
        r = self._kretention_static.for_topic(topic)
        return r.max_age_ms, r.max_bytes, 5 if r == Retention() else 4

    def set_topic_retention(self, topic: str, age_ms: int | None, max_bytes: int | None) -> None:
        """Change ``topic``'s retention in this store, durably (raises OSError)."""
        configs = dict(self._kretention)
        r = Retention(age_ms, max_bytes)
        if r == self._kretention_static.for_topic(topic):
            configs.pop(topic, None)
        else:
            configs[topic] = r
        self._save_configs(configs, self._kcleanup)
        self._kretention = configs
        self._apply_retention()

    def static_cleanup(self, topic: str) -> tuple[str, int]:
        """The configuration's cleanup.policy and delete.retention.ms of ``topic``."""
        c = self._kcompaction_static
        return ("compact,delete" if c.compacts(topic) else "delete"), c.tombstone_ms(topic)

    def topic_cleanup(self, topic: str) -> tuple[str, int, int]:
        """``(cleanup.policy, delete.retention.ms, Kafka config source)`` of ``topic`` here."""
        got = self._kcleanup.get(topic)
        if got is not None:
            return got[0], got[1], 1
        policy, tomb = self.static_cleanup(topic)
        default = policy == "delete" and tomb == self._kcompaction_static.default_delete_retention_ms
        return policy, tomb, 5 if default else 4

    def set_topic_cleanup(self, topic: str, policy: str, delete_retention_ms: int) -> None:
        """Change ``topic``'s cleanup.policy and delete.retention.ms here, durably (raises OSError)."""
        cleanup = dict(self._kcleanup)
        if (policy, delete_retention_ms) == self.static_cleanup(topic):
            cleanup.pop(topic, None)
        else:
            cleanup[topic] = (policy, delete_retention_ms)
        self._save_configs(self._kretention, cleanup)
        self._kcleanup = cleanup
        self._apply_retention()

    def compaction_bounds(self, topic: str, partition: str, head: int) -> tuple[int, Any]:
        """A compaction round's map stops before the partition's oldest unfinished transaction;
        aborted records never supersede a key.  Read from the writer thread while the I/O
        thread may change them: a read that races a change skips the round (the next one
        reads again)."""
        txn = self.kafka.txn
        key = (topic, partition)
        for _ in range(3):
            try:
                return txn.lso(key, head + 1) - 1, list(txn.aborted.get(key, ()))
            except RuntimeError:  # a dict changed size under the read
                continue
        return -1, []

    def _apply_retention(self) -> None:
        static = self._kretention_static
        topics = {**static.topics, **self._kretention}
        cstatic = self._kcompaction_static
        compacted = set(cstatic.topics)
        tombs = dict(cstatic.delete_retention_ms)
        for topic, (policy, tomb) in self._kcleanup.items():
            if "compact" in policy:
                compacted.add(topic)
            else:
                compacted.discard(topic)
            tombs[topic] = tomb
            if policy == "compact":
                topics[topic] = Retention()  # Kafka's "compact" alone deletes nothing by age or size
        # One attribute swap each: the writer thread reads the whole policy at each round.
        self.retention = RetentionPolicy(static.default, topics)
        self.compaction = CompactionPolicy(frozenset(compacted), tombs, cstatic.default_delete_retention_ms)

    def _configs_path(self) -> str:
        return os.path.join(self.db.path, CONFIGS_FILE)

    def _save_configs(self, configs: dict[str, Retention], cleanup: dict[str, tuple[str, int]]) -> None:
        path = self._configs_path()
        tmp = path + ".tmp"
        text = json.dumps({"retention": {t: [r.max_age_ms, r.max_bytes] for t, r in sorted(configs.items())},
                           "cleanup": {t: list(c) for t, c in sorted(cleanup.items())}})
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _load_configs(self) -> None:
        try:
            with open(self._configs_path(), encoding="utf-8") as f:
                raw = json.load(f)
            configs = {}
            for topic, (age, size) in raw["retention"].items():
                for v in (age, size):
                    if v is not None and (not isinstance(v, int) or v < 0):
                        raise ValueError(f"retention of {topic!r}: {v!r}")
                configs[str(topic)] = Retention(age, size)
            cleanup = {}
            for topic, (policy, tomb) in raw.get("cleanup", {}).items():
                if policy not in ("delete", "compact", "compact,delete") or not isinstance(tomb, int) or tomb < 0:
                    raise ValueError(f"cleanup of {topic!r}: {policy!r}, {tomb!r}")
                cleanup[str(topic)] = (policy, tomb)
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("%s unreadable, Kafka topic configs left out (the configuration's retention holds): %s",
                      self._configs_path(), exc)
            return
        self._kretention = configs
        self._kcleanup = cleanup
        self._apply_retention()

    # ---------------------------------------------------------------- Backend: transactions

    def _load_transactions(self) -> None:
        txn = self.kafka.txn
        records = self._txnlog.load()
        bad = 0
        for rec in records:
            try:
                txn.apply(rec)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                bad += 1
                if bad <= 3:
                    log.error("%s: a record that does not apply, left out: %r (%s)", self._txnlog.path, rec, exc)
        if records:
            log.info("Kafka transactions: %d journal records replayed (%d transactional ids)",
                     len(records), len(txn.txns))

    def txn_log(self, records: list[dict[str, Any]]) -> None:
        """Journal the coordinator's records, fsync'ed (raises OSError: the request fails, and
        the coordinator goes back to the journal on disk: nothing it did not keep is acted on)."""
        try:
            self._txnlog.write(records)
        except OSError as exc:
            log.error("cannot write the Kafka transaction journal %s: %s; transactions go back to what"
                      " it holds", self._txnlog.path, exc)
            self._txnlog.close()
            try:
                self.kafka.txn.rebuild(self._txnlog.load(), time.monotonic())
            except (OSError, KeyError, TypeError, ValueError, IndexError) as again:
                log.error("cannot read back the Kafka transaction journal: %s", again)
            raise
        if self._txnlog.lines > self._txn_compact_at:
            snap = self.kafka.txn.snapshot()
            if len(snap) * 4 < self._txnlog.lines:
                self._txnlog.rewrite(snap)
            self._txn_compact_at = max(TxnLog.COMPACT_LINES, 4 * len(snap))

    def next_offset(self, topic: str, address: str) -> int:
        return self._next_offset.get((topic, address), 0)

    def append_marker(self, key: tuple[str, str], pid: int, epoch: int, commit: bool) -> int:
        """Queue a transaction's control record in an owned partition: its offset."""
        topic, address = key
        off = self._next_offset.get(key, 0)
        slot = _MARKER.pack(pid, epoch, 1 if commit else 0)
        value = VALUE_HEADER.pack(int(time.time() * 1000), FLAG_KEY | FLAG_CONTROL) + bytes((len(slot),)) + slot
        block = store_block(off, [value], len(slot), checked=True)
        self.queue_block(topic, address, block, 1)
        self._kpublish.append((key, off, b""))  # not published live: the mesh gets the HEAD only
        self._next_offset[key] = off + 1
        return off

    def add_partitions(self, topic: str, count: int) -> bool:
        """Give ``topic`` ``count`` more gateway-owned partitions (False: past max_owned_partitions)."""
        if len(self._owned) + count > self.limits.max_owned_partitions:
            return False
        for _ in range(count):
            part = self.pmap.add(topic, new_address(), owned=True)
            if part is None:
                return False
            self._owned[(part.topic, part.address)] = part
        log.info("topic %s: %d more gateway partitions (Kafka CreatePartitions)", shown(topic), count)
        return True

    def delete_front(self, topic: str, address: str, before: int, max_records: int) -> tuple[int, bool]:
        return self.db.delete_front(topic, address, before, max_records)

    def delete_positions(self, group: str, keys: list[tuple[str, str]] | None) -> int:
        return self.db.delete_positions(group, keys)

    def position_groups(self, limit: int) -> list[str]:
        return self.db.position_groups(limit)

    def sync_topics(self) -> None:
        """Make the topics created with ``sync=False`` durable (one fsync for all of them)."""
        self.topics_created()

    def append(self, part: TankPartition, batch: Batch) -> tuple[int, int]:
        """Queue a batch's records in an owned partition as one block: ``(first, last)`` offsets given.

        A v2 batch (validated by :func:`~dafka.kafka.records.split_batches`) is
        stored as the client sent it, a ``CODEC_KAFKA`` block
        (:func:`dafka.store.block.kafka_block_of`: its offset set, its CRC
        kept), built with no per-record step; a legacy message set's records
        become a ``CODEC_STORE`` block of format-1 values.  A batch with a
        record without timestamp (Kafka's -1, or any negative one) is stamped
        with the gateway's clock as log-append time, as a Kafka broker stamps
        a LogAppendTime topic (every record of it then reads as that time).
        """
        key = (part.topic, part.address)
        topic, address = key
        first = self._next_offset.get(key, 0)
        scan = batch.scan
        if scan is not None and batch.raw is not None:
            raw = batch.raw
            if scan.min_ts < 0:
                now = int(time.time() * 1000)
                raw = log_append_time(raw, now)
                scan = scan._replace(first_ts=now, max_ts=now, min_ts=now, log_append_time=True)
            n = scan.record_count
            block = kafka_block_of(raw, scan, first)
        else:
            records = batch.records
            if batch.min_ts < 0:
                now = int(time.time() * 1000)
                records = [r if r[0] >= 0 else r._replace(timestamp=now) for r in records]
            n = len(records)
            pairs, nbytes = store_pairs(records, 0, first)
            block = store_block(first, [v for _k, v in pairs], nbytes, checked=True)
        last = first + n - 1
        self.queue_block(topic, address, block, n)
        # A transaction's records are not published live (the mesh sees only committed
        # ones, FETCHed after the HEAD: see dafka.kafka.meshtxn); the HEAD goes out.
        self._kpublish.append((key, first, b"" if batch.transactional else block))
        self._next_offset[key] = last + 1
        return first, last

    def _prepare_work(self) -> None:
        if self._blocks and self._batch:
            self._untangle()
        super()._prepare_work()

    def _mark_work(self, work: Any) -> None:
        super()._mark_work(work)
        # Every Kafka block queued so far goes out on the mesh once this work commits.
        before = sum(w.marks.get("kafka", 0) for w in self._outstanding if w is not work)
        work.marks["kafka"] = len(self._kpublish) - before

    def _untangle(self) -> None:
        """Turn into blocks the Tank records queued for a partition that also has Kafka
        blocks queued (a Tank produce to the same partition), so that the commit puts all of
        that partition's records in offset order (it puts record tuples before blocks)."""
        pending = {(b[0], b[1]) for b in self._blocks}
        mixed = {(r[0], r[1]) for r in self._batch if (r[0], r[1]) in pending}
        if not mixed:
            return
        moved: dict[tuple[str, str], list[tuple[Any, ...]]] = {k: [] for k in mixed}
        rest = []
        for r in self._batch:
            k = (r[0], r[1])
            if k in moved:
                moved[k].append(r)
            else:
                rest.append(r)
        self._batch = rest
        for tp, recs in moved.items():
            recs.sort(key=_OFFSET)
            runs, _nxt, _nbytes, _dups = pack_records(recs[0][2], recs, tp)
            for first, values, payload, _plain in runs:
                self.queue_block(tp[0], tp[1], store_block(first, values, payload, checked=True), len(values))
        log.debug("Tank records of %d partitions queued as blocks beside Kafka batches", len(mixed))

    def _publish_blocks(self, items: list[tuple[tuple[str, str], int, bytes]]) -> None:
        """Committed Kafka blocks on the mesh: their records to the readers of their
        partition when it has any (a block's values are decoded only then), then the HEAD of
        each partition, which readers that were not there FETCH up to."""
        headers = self._record_headers
        publisher = self.publisher
        audience = self.audience
        opened = self.kafka.txn.open
        for key, first, block in items:
            if not block or (opened and key in opened):
                # A transaction's records or marker, or records past the last stable offset
                # of a partition with a transaction open: readers FETCH them once stable.
                continue
            header = headers.get(key)
            if header is None:
                header = headers[key] = wire.record_prefix(wire.RECORD, key[0], key[1], key[0])
            if not audience.readers(header):
                self.kafka_unpublished += 1
                continue
            try:
                values = block_contents(block)
            except (ProtocolError, ValueError) as exc:  # a block this gateway built: a bug
                log.error("cannot publish a Kafka block of %s at %d on the mesh: %s", shown(key[0]), first, exc)
                continue
            prefix, send = self.route(header)
            send(publisher, prefix, first, values, noblock=True)
        for key in {i[0] for i in items}:
            self.send(wire.Head(key[0], key[1], key[0], self._heads[key]))

    def _publish(self, records: list[tuple[tuple[str, str], int, Any]]) -> None:
        """As the Tank gateway's, but no Tank record of a partition with a Kafka transaction
        open goes out live: it is past the last stable offset (readers FETCH it once stable)."""
        opened = self.kafka.txn.open
        if opened:
            records = [r for r in records if r[0] not in opened]
        super()._publish(records)

    def _stable(self, key: tuple[str, str], head: int) -> int:
        """The HEAD a partition may announce: before its last stable offset while a
        transaction is open in it (-1: nothing of it is stable yet)."""
        opened = self.kafka.txn.open
        firsts = opened.get(key) if opened else None
        return stable_head(head, list(firsts.values())) if firsts else head

    def send(self, msg: wire.Message) -> None:
        """As the store's, but the HEAD of a partition with a transaction open stops before
        its last stable offset (none goes while nothing of it is stable)."""
        if isinstance(msg, _HEADS) and self.kafka.txn.open:
            stable = self._stable((msg.subject, msg.address), msg.sequence)
            if stable < 0:
                return
            msg = type(msg)(msg.topic, msg.address, msg.subject, stable)
        super().send(msg)

    def _send_head(self, key: tuple[str, str], head: int) -> None:
        """As :meth:`send` caps a HEAD, for the cached frame of a commit's HEADs."""
        stable = self._stable(key, head)
        if stable >= 0:
            super()._send_head(key, stable)

    filters_answers = True

    def _serve_filtered(self, job: FetchJob, start: int, values: list[bytes]) -> bool:
        """A slice of a FETCH answer of a partition written by Kafka transactions: its
        committed records, a VOID kind 2 for each run of aborted records and markers
        (a Dafka consumer passes them at once), nothing at or past the last stable offset."""
        key = (job.topic, job.partition)
        txn = self.kafka.txn
        if key not in txn.touched:
            return False
        end = txn.lso(key, self._heads.get(key, -1) + 1)
        stop = job.offset + job.remaining
        if job.offset < start and job.offset < end:  # nothing stored from job.offset:
            self._compacted_gap(job, min(start, end))  # a compacted gap is said so
        # A requester that takes no VOID (a C node) would stall at the first offset not sent:
        # it gets every stable record, as a read_uncommitted reader.
        hide = self.audience.has_readers(wire.P_VOID + job.key[0].encode())
        aborted = txn.aborted_between(key, start, start + len(values) - 1) if hide else []
        steps = mesh_steps(start, values, end, aborted, hide)
        pos = start
        for first, last, run in steps:
            if run is None:
                self._send_checked(wire.Void(job.key[0], job.partition, job.topic, first, last, self.address,
                                             wire.VOID_COMPACTED))
                self.txn_voids += 1
                pos = last + 1
                continue
            if not job.batched and self.batches_for(job.single, answer=True):
                job.prefix, job.batched = wire.batch_prefix(job.single), True
            if job.batched:
                sent = fastio.send_batches(self.publisher, job.prefix, first, run, noblock=True, stored=True)
            else:
                sent = fastio.send_values(self.publisher, job.prefix, first, run, True)
            self.records_served += sent
            pos = first + sent
            if sent < len(run):
                self._blocked = True  # a reader is full: resume from here on the next tick
                break
        job.offset, job.remaining = pos, stop - pos
        if job.remaining > 0 and pos < end and (pos > start or self._blocked):
            self._jobs.append(job)
        else:
            self._job_done(job)
        return True

    def on_refused(self, rejected: dict[tuple[str, str], str]) -> None:
        super().on_refused(rejected)
        refused = {key for key in rejected if key in self._owned}
        if not refused:
            return
        n = self._reported_mark("kafka")
        done = [i for i in self._kpublish[:n] if i[0] not in refused]
        if self._reported is not None:
            self._reported.marks["kafka"] = len(done)
        self._kpublish = done + [i for i in self._kpublish[n:] if i[0] not in refused]
        for slot, needs in [(s, n) for s, n in self._kpending if refused & n.keys()]:
            # Not written: the client hears so (its connection closes; it retries).
            self._kclose(slot.conn, f"produce refused by the store: {rejected[next(iter(refused & needs.keys()))]}", True)
        self._txn_refused(refused)

    # ---------------------------------------------------------------- store hooks

    def on_start(self) -> None:
        super().on_start()
        self.every(TICK_INTERVAL, self._kafka_tick)
        try:
            self.kafka.txn_recover(dict(self._heads), time.monotonic())
        except OSError as exc:
            log.error("cannot journal the recovery of Kafka transactions: %s", exc)
        self._flush_batch()

    def sockets(self) -> list[tuple[Any, Any]]:
        return [*super().sockets(), (self.kafka_listener, self._kafka_accept)]

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        n = self._reported_mark("kafka")
        if n:
            done = self._kpublish[:n]
            del self._kpublish[:n]
            self._publish_blocks(done)
        super().on_commit(heads)
        committed = self._heads
        if self.kafka.txn.active:
            opened = self.kafka.txn.open
            before = {key: min(firsts.values()) for key, firsts in opened.items() if firsts}
            try:
                self.kafka.txn_committed(committed)
            except OSError as exc:
                log.error("cannot journal completed Kafka transactions: %s", exc)
            # Transactions complete (their markers committed): where the last stable offset
            # moved, the mesh's readers hear of the records now stable (and FETCH them).
            opened = self.kafka.txn.open
            for key, lso in before.items():
                firsts = opened.get(key)
                head = committed.get(key)
                if head is not None and (not firsts or min(firsts.values()) != lso):
                    self.send(wire.Head(key[0], key[1], key[0], head))
        if self._kpending:
            still = []
            touched = set()
            for slot, needs in self._kpending:
                if any(committed.get(k, -1) < off for k, off in needs.items()):
                    still.append((slot, needs))
                else:
                    slot.held = False
                    touched.add(slot.conn)
            self._kpending = still
            for conn in touched:
                self._drain(conn)
        if self._kparked and heads:
            self._retry_parked(set(heads), timed_out=False)
        if self._kthrottled and self.batch_low():
            throttled, self._kthrottled = self._kthrottled, []
            for conn in throttled:
                self._set_kreading(conn)
                self._kprocess(conn)

    def _txn_refused(self, rejected: set[tuple[str, str]]) -> None:
        # Offsets a transaction journalled there will be given again: its ranges stop at the head.
        txn = self.kafka.txn
        for key in rejected:
            txn.clip(key, self._heads.get(key, -1))
        try:
            self.kafka._txn_flush()
            for plan in txn.lost_markers():  # markers of ending transactions, lost with the rest
                self.kafka.run_plan(plan, recovering=True)
        except OSError as exc:
            log.error("cannot journal Kafka transactions: %s", exc)

    def on_shutdown(self) -> None:
        super().on_shutdown()
        self._txnlog.close()
        for conn in list(self._kconns.values()):
            self._kflush(conn)
            self._kclose(conn, None)
        self.unwatch(self.kafka_listener)
        self.kafka_listener.close()

    def close(self, timeout: float = 10.0) -> None:
        super().close(timeout)
        self.kafka_listener.close()

    # ---------------------------------------------------------------- time

    def _kafka_tick(self, now: float) -> None:
        mono = time.monotonic()
        timeout = self.limits.request_timeout
        for conn in list(self._kconns.values()):
            since = conn.stalled_since
            if since is not None and mono - since > timeout:
                self._kclose(conn, f"stalled half way through a frame for {mono - since:.0f}s", True)
            elif unread_for(conn, mono) > timeout:
                # Its answers would hold the gateway's output budget for as long as it stays.
                self._kclose(conn, f"did not read its answers ({conn.out_size} bytes unsent) for {timeout:g}s", True)
        if self._kparked:
            self._retry_parked(None, timed_out=True, now=mono)
        self.kafka.tick(mono)
        if self._batch:  # markers of transactions the tick aborted (timeouts): committed soon
            self._flush_batch()
        self._send_released()

    def _retry_parked(self, keys: set[tuple[str, str]] | None, timed_out: bool, now: float = 0.0) -> None:
        still = []
        touched = set()
        for slot, parked in self._kparked:
            if slot.conn.closed:
                continue
            if keys is not None and not keys.intersection(parked.keys):
                still.append((slot, parked))
                continue
            expired = timed_out and parked.deadline <= now
            if timed_out and not expired:
                still.append((slot, parked))
                continue
            data = self.kafka.retry_fetch(parked, expired, self.output_room(slot))
            if data is None:
                still.append((slot, parked))
                continue
            self._kfill(slot, data)
            touched.add(slot.conn)
        self._kparked = still
        for conn in touched:
            self._drain(conn)

    def _send_released(self) -> None:
        released = self.kafka.released
        if not released:
            return
        self.kafka.released = []
        touched = set()
        for answer in released:
            slot = answer.token
            if isinstance(slot, _Slot) and not slot.conn.closed and slot.data is None:
                self._kfill(slot, self.kafka.encode_answer(answer))
                touched.add(slot.conn)
        for conn in touched:
            self._drain(conn)

    # ---------------------------------------------------------------- connections

    def _kafka_accept(self) -> None:
        refusals = self._krefusals
        for sock, peer in accepted(self.kafka_listener, "Kafka", log):
            if self.allow_clients is not None and not client_allowed(peer[0], self.allow_clients):
                refusals.note("refused a Kafka client from %s: not in --allow-clients", peer[0])
                sock.close()
                continue
            if len(self._kconns) >= self.kafka_max_connections:
                refusals.note("refused a Kafka client from %s: %d connections open", peer[0], len(self._kconns))
                sock.close()
                continue
            prepare(sock)
            conn = _Conn(sock, f"{peer[0]}:{peer[1]}", frames=FrameReader(self.kafka_max_frame))
            self._kconns[sock] = conn
            self.watch(sock, lambda c=conn: self._kready(c))
            log.debug("Kafka client %s connected", conn.name)

    @property
    def kafka_refused(self) -> int:
        """Kafka clients refused (not allowed, or over the connection cap)."""
        return self._krefusals.count

    @property
    def kafka_connections(self) -> int:
        return len(self._kconns)

    @property
    def kafka_queued_bytes(self) -> int:
        """Answer bytes held for Kafka clients (ready, or unsent), over all connections."""
        return self._kqueued

    def _kready(self, conn: _Conn) -> None:
        if conn.out:
            self._kflush(conn)
        if conn.reading and not conn.closed:
            self._kread(conn)

    def _kread(self, conn: _Conn) -> None:
        eof = False
        got = False
        for _ in range(16):
            try:
                data = conn.sock.recv(RECV_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._kclose(conn, f"receive failed: {exc}")
                return
            if not data:
                eof = True
                break
            got = True
            try:
                conn.frames.feed(data)  # checks the next frame's size at once
            except ProtocolError as exc:
                self._kclose(conn, f"bad input: {exc}", True)
                return
            if len(data) < RECV_SIZE:
                break
        if got:
            self._kprocess(conn)
        if eof and not conn.closed:
            self._kclose(conn, None)

    def _kprocess(self, conn: _Conn) -> None:
        frames = conn.frames
        budget = self.limits.kafka_max_output_bytes
        try:
            while conn.reading and not conn.closed:
                if conn.queued and self._kqueued >= budget:
                    self._kpause_over(conn)  # back pressure: until answers drain
                    break
                frame = frames.next_frame()
                if frame is None:
                    break
                self._kframe(conn, frame)
        except ProtocolError as exc:
            self._kclose(conn, f"bad input: {exc}", True)
            return
        if conn.closed:
            return
        buffered = frames.buffered
        if buffered and conn.reading:
            if conn.stalled_since is None or buffered != conn.last_buffered:
                conn.stalled_since = time.monotonic()
        else:
            conn.stalled_since = None
        conn.last_buffered = buffered
        if self.batch_full() and conn.reading:
            conn.reading = False  # the writer is behind: stop taking produces
            self._kthrottled.append(conn)
            self._kupdate(conn)
        self._flush_batch()

    def _kframe(self, conn: _Conn, frame: bytes) -> None:
        header, req = decode_request(frame)
        slot = _Slot(conn, header.correlation_id, header.api_key, header.version)
        try:
            outcome = self.kafka.handle(
                slot, header.api_key, header.version, header.correlation_id, header.client_id, req,
                time.monotonic(),
            )
        except ProtocolError:
            raise
        except Exception as exc:  # a request our encoder or logic cannot take: this connection only
            # With its traceback (a bug to fix), but at a bounded rate: a client asking again
            # and again must not fill the log.
            self._klimited.emit(logging.ERROR, "request-failed", "Kafka request %d v%d from %s failed",
                                header.api_key, header.version, conn.name, exc_info=True)
            raise ProtocolError(f"request {header.api_key} v{header.version} failed: {exc!r}") from exc
        if outcome.data is None and outcome.park is None and outcome.needs is not None:
            return  # acks 0: no answer, nothing waits
        if outcome.data is None and outcome.park is None and header.api_key == 0:
            return  # acks 0 with nothing queued
        conn.slots.append(slot)
        if outcome.park is not None:
            self._kparked.append((slot, outcome.park))
        elif outcome.needs:
            self._kfill(slot, outcome.data)
            slot.held = True
            self._kpending.append((slot, outcome.needs))
            self._flush_batch()
        elif outcome.data is not None:
            self._kfill(slot, outcome.data)
        self._send_released()
        self._drain(conn)
        if len(conn.slots) >= self.kafka_max_inflight and conn.reading:
            conn.reading = False
            self._kupdate(conn)

    def _drain(self, conn: _Conn) -> None:
        """Send the answers at the front of the connection's order that are ready."""
        if conn.closed:
            return
        slots = conn.slots
        while slots and slots[0].data is not None and not slots[0].held:
            self._kwrite(conn, slots.popleft().data)  # type: ignore[arg-type]
            if conn.closed:
                return
        self._kresume(conn)

    def _kresume(self, conn: _Conn) -> None:
        """Read a connection again once nothing holds it back."""
        if (
            not conn.reading
            and not conn.closed
            and not conn.over
            and len(conn.slots) < self.kafka_max_inflight // 2
            and conn.out_size <= MAX_OUTPUT
            and conn not in self._kthrottled
            and not self._shutting_down  # (unread requests stay so: see Gateway.on_shutdown)
        ):
            self._set_kreading(conn)
            self._kprocess(conn)

    def _kfill(self, slot: _Slot, data: Data) -> None:
        """A slot's answer is ready: its bytes count as held until sent."""
        slot.data = data
        size = len(data) if isinstance(data, bytes) else sum(map(len, data))
        slot.conn.queued += size
        self._kqueued += size
        if self._kqueued > self.kafka_queued_peak:
            self.kafka_queued_peak = self._kqueued

    def _kpause_over(self, conn: _Conn) -> None:
        if not conn.over:
            conn.over = True
            self._kover[conn] = None
        if conn.reading:
            conn.reading = False
            self._kupdate(conn)

    def _ksent(self, conn: _Conn, n: int) -> None:
        """``n`` answer bytes of ``conn`` went out: connections waiting on the budget may go on."""
        conn.queued -= n
        self._kqueued -= n
        if not self._kover or self._kresuming:
            return
        self._kresuming = True
        try:
            if conn.over and not conn.queued:
                # Nothing of its own held any more: it may ask again (its answers shrink).
                conn.over = False
                self._kover.pop(conn, None)
                self._kresume(conn)
            budget = self.limits.kafka_max_output_bytes
            while self._kover and self._kqueued < budget:
                nxt = next(iter(self._kover))
                del self._kover[nxt]
                nxt.over = False
                self._kresume(nxt)
        finally:
            self._kresuming = False

    def _set_kreading(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.reading = True
        self._kupdate(conn)

    def _kupdate(self, conn: _Conn) -> None:
        self.watch_events(conn.sock, events(conn))

    def _kwrite(self, conn: _Conn, data: Data) -> None:
        """Send an answer (one byte string, or several back to back), queueing what does not go."""
        try:
            n = send(conn, data)
        except OSError as exc:
            self._kclose(conn, f"send failed: {exc}")
            return
        if n:
            self._ksent(conn, n)
            if conn.closed:
                return
        if not conn.out:
            self._kread_ahead()
            return
        if conn.out_size > MAX_OUTPUT:
            conn.reading = False  # a client that does not read its answers
        self._kupdate(conn)

    def _kread_ahead(self) -> None:
        """An answer went out whole: encode what its consumer will ask for next meanwhile."""
        if self.kafka.ahead_wanted:
            self.kafka.read_ahead(time.monotonic())

    def _kflush(self, conn: _Conn) -> None:
        try:
            sent = flush(conn)
        except OSError as exc:
            self._kclose(conn, f"send failed: {exc}")
            return
        if sent:
            self._ksent(conn, sent)
            if conn.closed:
                return
        self._kupdate(conn)
        if not conn.out:
            self._kread_ahead()
            self._drain(conn)

    def _kclose(self, conn: _Conn, why: str | None, bad: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._kconns.pop(conn.sock, None)
        conn.over = False
        self._kover.pop(conn, None)
        self._ksent(conn, conn.queued)  # what it held is dropped
        self._kparked = [(s, p) for s, p in self._kparked if s.conn is not conn]
        self._kpending = [(s, n) for s, n in self._kpending if s.conn is not conn]
        self.kafka.coordinator.forget_token(conn)
        self.kafka.forget_connection(conn)
        self.unwatch(conn.sock)
        close_quietly(conn.sock)
        if bad:
            self.bad_input(f"Kafka request from {conn.name}", f"{why}; connection closed")
        elif why:
            log.info("Kafka client %s: %s; connection closed", conn.name, why)
        else:
            log.debug("Kafka client %s disconnected", conn.name)
