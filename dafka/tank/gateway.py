"""The Tank gateway: a store node on the mesh that also speaks Tank over TCP.

Existing Tank clients (tank-cli, the C++ and Java clients) connect to it as
to a Tank broker.  It is a full :class:`~dafka.store.node.Store`: it stores
and serves every record of the mesh, and Tank fetches are answered from its
own LMDB.

Mapping (see :mod:`dafka.tank.mapping`): a Tank topic is a Dafka topic, every
Dafka partition has a stable Tank partition id, and Tank sequence = Dafka
offset + 1.  ``CreateTopic(T, N)`` makes N partitions the gateway writes
itself; partitions of mesh producers are read-only to Tank clients (produce
answers 0xfd, "no leader": their leader is a producer Tank cannot reach).
The read-only topic ``__dafka_partitions`` (partition 0) lists the map: its
message i (seq i + 1) has the topic name as key and JSON
``{"address", "owned", "partition", "topic"}`` as value.

Keys and timestamps: a Tank message's key and timestamp are stored beside the
record in LMDB (record flags 1 and 2); the mesh RECORD carries the content
only, so Dafka consumers see exactly what they always see, and a Tank fetch
gets the key and the producer's timestamp back.

Produce is answered once the records are committed (synced) to LMDB; then
they are published on the mesh as RECORDs of the owned partition, and a HEAD
follows.  ProduceWithSeqnum (and a sparse bundle in a plain Produce) must
start exactly at hwm + 1: at or below the hwm is error 10 and nothing is
written, so an exact resend is idempotent; a gap is error 10 as well, since
Dafka offsets have none.

Everything runs in the store's I/O thread: the TCP sockets are polled beside
the ZeroMQ ones, so mapping, pending produces and parked fetches need no
locks.  A connection that sends a frame over the limit, an unknown msgId or a
malformed payload, or stalls half way through a frame, is closed and logged;
nothing else is affected.  :mod:`dafka.tank.limits` bounds what clients can
make the gateway hold (connections, request bytes, answer bytes, partitions).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from operator import itemgetter
from typing import Any

import zmq

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.errors import ProtocolError
from dafka.fastio import (
    FrameBuffer,
    new_bytearray,
    send_frames,
    tank_produce,
    tank_scan,
    view_start,
)
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
from dafka.gateway.parking import arrived
from dafka.nodes.node import new_address
from dafka.store.block import (
    CODEC_STORE,
    CODEC_TANK,
    DEFAULT_BUDGET,
    HEADER_SIZE,
    tank_seal,
    tank_seal_in_place,
    tank_seqs_are_offsets,
    tank_seqs_continue,
)
from dafka.store.block import records as block_records
from dafka.store.db import RecordDB, RetentionPolicy, StorageError
from dafka.store.node import Store
from dafka.store.pipeline import Block
from dafka.store.reader import values_from
from dafka.tank.codec import encode_varint
from dafka.tank.limits import SMALL_REQUEST, GatewayLimits, answer_budget, slowest_holder, too_slow
from dafka.tank.mapping import (
    FILE_NAME,
    PARTITIONS_TOPIC,
    PartitionMap,
    TankPartition,
    shown,
    valid_topic_name,
)
from dafka.tank.messages import (
    REQUEST_TYPES,
    ConsumeFlag,
    ConsumePartition,
    ConsumePartitionResult,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopicResult,
    CreateTopicError,
    CreateTopicRequest,
    CreateTopicResponse,
    DiscoverPartitionsRequest,
    DiscoverPartitionsResponse,
    DiscoverTopicsRequest,
    DiscoverTopicsResponse,
    DiscoverTopologyRequest,
    DiscoverTopologyResponse,
    MsgId,
    PartitionBounds,
    Ping,
    ProduceError,
    ProducePartitionResult,
    ProduceRequest,
    ProduceResponse,
    ProduceTopicResult,
    ProduceWithSeqnumRequest,
    ReloadConfRequest,
    ReloadConfResponse,
    StatusRequest,
    StatusResponse,
    TopicInfo,
    decode_request,
)
from dafka.tank.serving import Bounds, chunk_of, consume_start, stored_bundle

log = logging.getLogger("dafka.gateway")

DEFAULT_PORT = 11011
TANK_VERSION = 400  # what Status reports: clients expect a v4.0 broker
RECV_SIZE = 256 << 10
RECV_PROBE = 16 << 10  # what is read at a frame's start (see _read)
DIRECT_MAX = 1 << 20  # the largest request received in place (see _read)
MAX_ANSWER_RECORDS = 16_384  # per partition per consume answer
MAX_ANSWER_BYTES = 4 << 20  # ... and at most this much content (whole records)
# Partition entries of the parked fetches of one connection; a fetch past it is
# answered at once, as a timed-out one is (a long poll holds its request).
MAX_PARKED_ENTRIES = 4096
# Bytes a snappy bundle may inflate to (its claimed length is checked before inflating).
INFLATE_BUDGET = DEFAULT_BUDGET
UNBOUNDED = 1 << 62  # no record size limit: the second walk of a refused bundle
# Content bytes of Tank bundles kept for live RECORDs until their commit, over all
# connections.  Past it a bundle is stored without them (its readers get the HEAD and
# FETCH it): snappy bundles inflate up to 21 times, so a 64 MiB request could make the
# gateway hold over a GiB for a subscribed reader.
MAX_LIVE_HELD_BYTES = 64 << 20
MAX_PACKED_ENTRIES = 4096  # partitions x reader codecs whose compressed blocks packed_since remembers
OWNED_HEADS_INTERVAL = 1.0  # HEADs of owned partitions, for consumers that missed the tail
_PING = Ping().encode()
_PRODUCE_IDS = (MsgId.PRODUCE, MsgId.PRODUCE_WITH_SEQNUM)
_OFFSET = itemgetter(2)  # of a record tuple
_VIRTUAL_KEY = (PARTITIONS_TOPIC, "")
_MAP_RECORD_FLAGS = b"\x01"  # stored-value flags of a __dafka_partitions record: keyed


@dataclass(eq=False, slots=True, kw_only=True)
class _Conn(Connection):
    frames: FrameBuffer
    frame_since: float | None = None  # when the frame in flight began (while we read it)
    reserved: int = 0  # bytes of the in-flight budget its frame in flight holds
    parked_entries: int = 0  # partition entries of its parked fetches
    deferred: bool = False  # a parked fetch woke while its answers were not taken


@dataclass(eq=False, slots=True)
class _PendingProduce:
    conn: _Conn
    answer: bytes  # the response frame
    needs: dict[tuple[str, str], int]  # committed head each partition must reach


@dataclass(eq=False, slots=True)
class _Parked:
    conn: _Conn
    request: ConsumeRequest
    deadline: float
    keys: list[tuple[str, str]]
    size: int = 0  # chunk bytes of its answer when it parked
    # each partition it waits on when it parked: (head, stored bytes, its fetch size)
    marks: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)


class Gateway(Store):
    """A store on the mesh plus a Tank server on ``listen`` (port 0: ephemeral)."""

    kind = "gateway"
    ready_pairs = False  # it queues records of its own partitions in _batch too

    def __init__(
        self,
        db: str | RecordDB,
        config: NodeConfig | None = None,
        *,
        listen: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT),
        towers: str | list[str] | None = None,
        sync: bool = True,
        retention: RetentionPolicy | None = None,
        compress: bool = True,
        allow_clients: list[Any] | None = None,
        limits: GatewayLimits | None = None,
        **store_options: Any,
    ) -> None:
        rdb = db if isinstance(db, RecordDB) else RecordDB(db, sync=sync)
        # Tank has no authentication: when set, only these IP networks may connect.
        self.allow_clients = allow_clients
        self._refused_clients = Refusals(log)  # not in allow_clients
        self.limits = limits or GatewayLimits()
        self._refused_connections = Refusals(log)  # over max_connections
        self.topics_refused = 0  # creations over max_owned_partitions
        self.records_too_large = 0  # Tank produces refused for a record over max_record_bytes
        self.records_published = 0  # records of owned partitions sent live on the mesh
        self._tank_read = False  # a Tank connection was read in this loop turn
        self._shutting_down = False  # on_shutdown is answering and closing the connections
        self._limited = LogLimiter(log)  # repeated warnings, rate-limited
        try:
            self._setup(rdb, listen, compress)
            super().__init__(rdb, config, towers=towers, retention=retention, **store_options)
        except BaseException:
            # A failed start must not keep the LMDB environment open: it could
            # never be opened again in this process.
            listener = getattr(self, "listener", None)
            if listener is not None:
                listener.close()
            if rdb is not db:
                rdb.close()
            raise
        log.info("Tank gateway on %s:%d, db %s", listen[0], self.tank_port, rdb.path)

    def _setup(self, rdb: RecordDB, listen: tuple[str, int], compress: bool) -> None:
        # Everything the I/O thread uses must exist before Store starts it.
        self.map_path = os.path.join(rdb.path, FILE_NAME)
        self.pmap = PartitionMap.load(self.map_path)
        self._owned = {(p.topic, p.address): p for p in self.pmap.owned()}
        self._self_produced = self._owned  # (the same dict: partitions created later count)
        self.compress = compress
        self.started_at = time.time()
        self._conns: dict[socket.socket, _Conn] = {}
        self._throttled: list[_Conn] = []
        self._reserved = 0  # in-flight request bytes reserved over all connections
        self._out_held = 0  # unsent answer bytes over all connections (max_total_output_bytes)
        self._budget_waiting: list[_Conn] = []  # not read until the reservations allow
        self._contended_since: float | None = None  # since when requests wait for the budget
        self.budget_evictions = 0
        self.budget_waits = 0
        self._next_offset: dict[tuple[str, str], int] = {}  # owned: next offset to give
        self._to_publish: list[tuple[tuple[str, str], int, bytes]] = []
        self._live_held = 0  # content bytes of the bundles in _to_publish (MAX_LIVE_HELD_BYTES)
        # Owned partition -> the header prefix of its records on the mesh (single-record form).
        self._record_headers: dict[tuple[str, str], bytes] = {}
        self._head_prefixes = wire.FramePrefixes(lambda key: wire.Head(key[0], key[1], key[0], 0))
        self._pending: deque[_PendingProduce] = deque()
        self._parked: dict[tuple[str, str], list[_Parked]] = {}
        self._parked_all: list[_Parked] = []
        # (topic, address, a reader's codec) -> (scanned from, scanned up to, last offset of
        # the newest compressed block of another codec): see packed_since.
        self._packed: dict[tuple[str, str, int], tuple[int, int, int]] = {}
        self.listener = socket.create_server(listen, backlog=256)
        self.listener.setblocking(False)
        self.tank_port = self.listener.getsockname()[1]

    def __enter__(self) -> Gateway:
        return self

    # ---------------------------------------------------------------- store hooks

    def on_start(self) -> None:
        super().on_start()
        self.every(OWNED_HEADS_INTERVAL, self._announce_owned)
        for (topic, address), head in self._heads.items():
            if (topic, address) in self._owned:
                self._next_offset[(topic, address)] = head + 1
            elif self.pmap.lookup(topic, address) is None:
                self.pmap.add(topic, address)  # stored before the map knew it
        self._save_map(whole=True)  # the journal folded into the map

    def sockets(self) -> list[tuple[Any, Any]]:
        return [*super().sockets(), (self.listener, self._accept)]

    def owns(self, subject: str, partition: str) -> bool:
        return (subject, partition) in self._owned

    def new_tracker(self, subject: str, partition: str) -> Any:
        if self.pmap.lookup(subject, partition) is None and self.pmap.add(subject, partition):
            self._save_map()
            self._wake_parked((_VIRTUAL_KEY,))
        return super().new_tracker(subject, partition)

    def _prepare_work(self) -> None:
        if self._blocks and (self._batch or self._segs):
            self._untangle_blocks()
        super()._prepare_work()

    def _mark_work(self, work: Any) -> None:
        super()._mark_work(work)
        # Every entry of _to_publish queued so far goes out once this work commits (those
        # of the works handed over before it first).
        before = sum(w.marks.get("tank", 0) for w in self._outstanding if w is not work)
        work.marks["tank"] = len(self._to_publish) - before

    def _reported_mark(self, name: str) -> int:
        """How many of a list's entries the work being answered holds (see _mark_work)."""
        work = self._reported
        return work.marks.get(name, 0) if work is not None else 0

    def _untangle_blocks(self) -> None:
        """Turn into record tuples the queued blocks of any partition that also has records
        queued (a Kafka produce to a partition a Tank client writes too).

        The writer applies a commit's records before its blocks; a partition's records
        and blocks must go in offset order, so its blocks go as records this time.
        """
        pending = {(r[0], r[1]) for r in self._batch} | {(s[0], s[1]) for s in self._segs}
        mixed = {(b[0], b[1]) for b in self._blocks} & pending
        if not mixed:
            return
        kept: list[Block] = []
        mine = [r for r in self._batch if (r[0], r[1]) in mixed]
        for topic, address, value in self._blocks:
            if (topic, address) in mixed:
                mine.extend((topic, address, r.offset, r.value, r.ts_ms, r.key, True) for r in block_records(value))
            else:
                kept.append((topic, address, value))
        mine.sort(key=_OFFSET)
        self._batch = [r for r in self._batch if (r[0], r[1]) not in mixed] + mine
        self._blocks = kept
        self._recount_blocks()
        if self._pairs:
            self._untangle()
        log.debug("Tank bundles of %d partitions queued as records beside other records", len(mixed))

    def _untangle(self) -> None:
        """Hook: turn queued ready pairs of partitions that also have record tuples queued
        into tuples (the Kafka gateway queues pairs)."""

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        n = self._reported_mark("tank")
        if n:
            done = self._to_publish[:n]
            del self._to_publish[:n]
            self._live_held -= _held(done)
            self._publish(done)
        self._announce_committed(heads)
        pending = self._pending
        committed = self._heads
        answers: dict[_Conn, list[bytes]] = {}
        while pending:
            p = pending[0]
            if any(committed.get(k, -1) < off for k, off in p.needs.items()):
                break
            pending.popleft()
            answers.setdefault(p.conn, []).append(p.answer)
        for conn, frames in answers.items():
            # A pipelining client's answers of one commit go in one send.
            self._write(conn, frames if len(frames) > 1 else frames[0])
        self._wake_parked(heads)
        if self._throttled and self.batch_low():
            throttled, self._throttled = self._throttled, []
            for conn in throttled:
                if conn in self._budget_waiting:
                    continue  # on_tick resumes it
                self._set_reading(conn, True)
                self._process(conn)  # the frames that were left waiting

    def on_refused(self, rejected: dict[tuple[str, str], str]) -> None:
        """Owned partitions refused by the database: nothing of them is published or
        answered as written; their produces fail (the connection closes, the client
        retries) and the partition continues at its committed head."""
        owned = [key for key in rejected if key in self._owned]
        if not owned:
            return
        refused = set(owned)
        n = self._reported_mark("tank")
        done = self._to_publish[:n]
        later = self._to_publish[n:]
        if self._reported is not None:
            self._reported.marks["tank"] = sum(1 for r in done if r[0] not in refused)
        self._to_publish = [r for r in done if r[0] not in refused] + [r for r in later if r[0] not in refused]
        self._live_held = _held(self._to_publish)
        # Records of them queued since continue what was refused: they go too.
        self._batch = [r for r in self._batch if (r[0], r[1]) not in refused]
        if any((b[0], b[1]) in refused for b in self._blocks):
            # So do their blocks (produces staged behind the refused commit come back here;
            # Store._forget drops nothing of a partition with no tracker, as an owned one):
            # kept, they went in a later commit after offsets given again from the head, a
            # gap refused again or, filled by a new produce, stored for a failed produce and
            # taken for the next one's ("stored already": dropped though answered).
            self._blocks = [b for b in self._blocks if (b[0], b[1]) not in refused]
            self._recount_blocks()
        for key in owned:
            self._next_offset[key] = self._heads.get(key, -1) + 1
        for p in [p for p in self._pending if refused & p.needs.keys()]:
            self._pending.remove(p)
            self._close(p.conn, f"produce refused by the store: {rejected[next(iter(refused & p.needs.keys()))]}")

    def _publish(self, records: list[tuple[tuple[str, str], int, Any]]) -> None:
        """Committed records of owned partitions go out on the mesh (their HEADs follow:
        :meth:`_announce_committed`).

        An entry is one record ``(key, offset, content)`` (the Kafka gateway's) or a
        bundle's ``(key, first offset, contents)``; a Tank bundle nobody on the mesh
        subscribed to when it was produced has no entry (see :meth:`_live`): its HEAD
        goes out all the same, and a reader that comes later FETCHes it.
        """
        headers = self._record_headers
        publisher = self.publisher
        i, n = 0, len(records)
        while i < n:
            key, first, item = records[i]
            j = i + 1
            if isinstance(item, list):
                contents = item  # a bundle's run
            else:
                # A run of consecutive offsets of one partition is one batch send.
                while (j < n and records[j][0] == key and records[j][1] == first + (j - i)
                       and not isinstance(records[j][2], list)):
                    j += 1
                contents = [r[2] for r in records[i:j]]
            header = headers.get(key)
            if header is None:
                header = headers[key] = wire.record_prefix(wire.RECORD, key[0], key[1], key[0])
            # Batches or not as the readers of the moment take them; a full reader
            # gets less and FETCHes the rest after the HEAD.
            prefix, send = self.route(header)
            send(publisher, prefix, first, contents, noblock=True)
            self.records_published += len(contents)
            i = j

    def _announce_committed(self, heads: dict[tuple[str, str], int]) -> None:
        """The HEAD of every owned partition a commit moved (after its records, if any went);
        its frame is the partition's cached prefix and the head (see Store._send_acks)."""
        owned = self._owned
        for key, head in heads.items():
            if key in owned:
                self._send_head(key, head)

    def _send_head(self, key: tuple[str, str], head: int) -> None:
        """An owned partition's HEAD (as :meth:`send` sends one; a full reader drops it: it
        goes again with the next commit or ``_announce_owned``)."""
        try:
            send_frames(self.publisher, [self._head_prefixes.frame(key, head)])
        except zmq.ZMQError as exc:
            log.debug("could not send HEAD: %s", exc)

    def _announce_owned(self, now: float) -> None:
        for (topic, address) in self._owned:
            head = self._heads.get((topic, address))
            if head is not None:
                self.send(wire.Head(topic, address, topic, head))

    def on_tick(self, now: float) -> None:
        super().on_tick(now)
        limits = self.limits
        timeout = limits.request_timeout
        for conn in list(self._conns.values()):
            since = conn.stalled_since
            if since is not None and now - since > timeout:
                self._close(conn, f"stalled half way through a frame for {now - since:.0f}s", True)
            elif conn.frame_since is not None and too_slow(conn.frames.buffered, now - conn.frame_since, limits):
                self._close(
                    conn,
                    f"too slow: {conn.frames.buffered} bytes of a {conn.frames.pending_length()}-byte request"
                    f" in {now - conn.frame_since:.0f}s, under min_request_rate {limits.min_request_rate} bytes/s",
                    True,
                )
            elif unread_for(conn, now) > timeout:
                self._close(conn, f"did not read its answers ({conn.out_size} bytes unsent) for {timeout:g}s", True)
        if self._budget_waiting:
            if self._contended_since is None:
                self._contended_since = now
            elif now - self._contended_since >= timeout:
                self._contended_since = now
                self._cut_slowest_holder(now)
            self._resume_budget_waiting()
        else:
            self._contended_since = None
        if self._parked_all:
            for parked in [p for p in self._parked_all if p.deadline <= now]:
                self._answer_parked(parked, timed_out=True)

    def on_shutdown(self) -> None:
        # The last turn may have read Tank requests and ended at the stop, without its
        # before_wait: what it staged did not wake the writer (see _process), which may sleep
        # until its next retention round.
        try:
            self._commit_turn()
        except Exception:  # (as the loop's before_wait: the connections must still close)
            log.exception("Tank gateway: the last loop turn's commit failed at shutdown")
        super().on_shutdown()  # commits what is queued; its produces are answered
        # Their answers go out; requests still unread stay so (a produce taken now would be
        # committed by the stopping writer, never answered, and sent again by its client).
        self._shutting_down = True
        for conn in list(self._conns.values()):
            self._flush_out(conn)
            self._close(conn, None)
        self.unwatch(self.listener)
        self.listener.close()

    def close(self, timeout: float = 10.0) -> None:
        super().close(timeout)
        self.listener.close()  # when the loop never ran

    # ---------------------------------------------------------------- map

    def _save_map(self, whole: bool = False) -> None:
        """Make new partitions durable (appended to the journal), or write the whole map."""
        try:
            if whole:
                self.pmap.save(self.map_path)
            else:
                self.pmap.sync(self.map_path)
        except OSError as exc:
            log.error("cannot save the Tank partition map to %s: %s", self.map_path, exc)

    def _bounds(self, topic: str, part: TankPartition | None) -> Bounds:
        if part is None:  # the map topic
            return Bounds(1, len(self.pmap))
        key = (topic, part.address)
        last = self._heads.get(key)
        if last is None:
            return Bounds(1, 0)
        try:
            first = self.db.first(topic, part.address)
        except StorageError:
            first = None
        return Bounds.of(first, last)

    def _stored(self, topic: str, part: TankPartition | None, offset: int, count: int) -> tuple[int, list[bytes]]:
        """``(first offset, stored values)`` from ``offset`` on."""
        if part is None:
            ts = int(self.started_at * 1000).to_bytes(8, "big")
            values = []
            for p in self.pmap.order[offset : offset + count]:
                key = p.topic.encode()
                values.append(ts + _MAP_RECORD_FLAGS + bytes((len(key),)) + key + p.describe())
            return offset, values
        return self.db.fetch_raw(topic, part.address, offset, count)

    # ---------------------------------------------------------------- connections

    def _accept(self) -> None:
        for sock, peer in accepted(self.listener, "Tank", log):
            if self.allow_clients is not None and not client_allowed(peer[0], self.allow_clients):
                self._refused_clients.note("refused a Tank client from %s: not in --allow-clients", peer[0])
                sock.close()
                continue
            if len(self._conns) >= self.limits.max_connections:
                # Counted and logged before the close that the client sees.
                refused = self._refused_connections
                refused.note(
                    "refused a Tank client from %s: %d connections open, the limit (max_connections); "
                    "%d refused so far",
                    peer[0], len(self._conns), refused.count + 1,
                )
                sock.close()
                continue
            prepare(sock)
            conn = _Conn(sock, f"{peer[0]}:{peer[1]}", frames=FrameBuffer(self.limits.max_request_bytes, HEADER_SIZE, new_bytearray))
            self._conns[sock] = conn
            self.watch(sock, lambda c=conn: self._on_ready(c))
            log.debug("Tank client %s connected", conn.name)
            self._write(conn, _PING)  # the greeting some clients wait for

    @property
    def clients_refused(self) -> int:
        """Clients refused for not being in ``allow_clients``."""
        return self._refused_clients.count

    @property
    def connections_refused(self) -> int:
        """Clients refused over ``max_connections``."""
        return self._refused_connections.count

    def _on_ready(self, conn: _Conn) -> None:
        if conn.out:
            self._flush_out(conn)
        if conn.reading and not conn.closed:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        sock = conn.sock
        frames = conn.frames
        got = eof = False
        for _ in range(16):
            # A large frame the budget admitted (its reservation), up to DIRECT_MAX, is
            # received in place, into a buffer of its own at its announced size: its
            # payload is then decoded and sealed from that buffer, not copied on the way
            # (a bundle of 100 KB was copied three times).  Larger ones are gathered as
            # they come, so a sender that announces one and trickles it holds no more.
            # At a frame's start, a little is read (the header of a large frame, then the
            # rest of it in place); the rest of a small frame begun, much.
            try:
                n, want = frames.recv(sock, 0 < conn.reserved <= DIRECT_MAX, SMALL_REQUEST, RECV_PROBE, RECV_SIZE)
            except OSError as exc:
                self._close(conn, f"receive failed: {exc}")
                return
            except ProtocolError as exc:  # (a header over the limit: _reserve raised it first)
                self._close(conn, f"bad input: {exc}", True)
                return
            if n < 0:
                break  # nothing more now
            if not n:
                eof = True
                break
            got = True
            try:
                admitted = self._reserve(conn)  # an oversized header raises at once
            except ProtocolError as exc:
                self._close(conn, f"bad input: {exc}", True)
                return
            if not admitted:
                self._wait_for_budget(conn)
                break
            if n < want:
                break
        if got:
            msg_id = conn.frames.peek_msg_id()
            if msg_id is not None and msg_id not in REQUEST_TYPES:
                # Do not wait for the rest of a "frame" that is not Tank at all.
                self._close(conn, f"bad input: unsupported request msgId 0x{msg_id:02x}", True)
                return
            # Frames that arrived with the EOF are handled like any others.
            self._process(conn)
        if eof:
            self._close(conn, None)

    def _process(self, conn: _Conn) -> None:
        """Answer the complete frames buffered, while the connection may take more."""
        # Without fsync, what this turn stages is committed at its end (before_wait): its
        # offers do not wake the writer meanwhile (see Store._commit_inline).
        deferred, self._wake_deferred = self._wake_deferred, not self.db.sync
        try:
            self._process_frames(conn)
        finally:
            self._wake_deferred = deferred
            self._tank_read = True  # (for before_wait)

    def _process_frames(self, conn: _Conn) -> None:
        frames = conn.frames
        try:
            # Not past a pause: an over-full output (or the writer being
            # behind) must stop a client that pipelines requests, not only
            # its next recv().
            took = False
            while conn.reading and not conn.closed:
                frame = frames.next_view()
                if frame is None:
                    break
                took = True
                self._on_frame(conn, *frame)
        except ProtocolError as exc:
            self._close(conn, f"bad input: {exc}", True)
            return
        # Only a client we wait for can stall (not one whose frames we hold back).
        if frames.buffered and conn.reading and not conn.closed:
            now = time.monotonic()
            conn.stalled_since = now
            if conn.frame_since is None or took:
                conn.frame_since = now  # a new frame in flight
        else:
            conn.stalled_since = conn.frame_since = None
        if not conn.closed and not self._reserve(conn):
            self._wait_for_budget(conn)
        if self.batch_full() and conn.reading and not conn.closed:
            self._set_reading(conn, False)  # the writer is behind: stop taking produces
            self._throttled.append(conn)
        self._flush_batch()

    def before_wait(self) -> None:
        super().before_wait()
        self._commit_turn()

    def _commit_turn(self) -> None:
        """At the end of a loop turn that read Tank requests (before_wait, or on_shutdown for
        the turn a stop ended): without fsync, what the turn's reads staged (every connection
        read) is committed in one transaction and answered at once, or the writer woken: see
        Store._commit_inline.  Not after each connection's read: ninety connections of small
        produces then made ninety commits a turn, at half the rate."""
        if self._tank_read:
            self._tank_read = False
            self._commit_inline()

    def _reserve(self, conn: _Conn) -> bool:
        """Reserve the in-flight budget for the large frame this connection has begun.

        False: the reservations of others leave no room (the caller stops
        reading it).  A finished frame's reservation is given back.
        """
        length = conn.frames.pending_length()
        want = length if length > SMALL_REQUEST else 0
        if want == conn.reserved:
            return True
        self._reserved -= conn.reserved
        conn.reserved = 0
        if want and self._reserved + want > self.limits.max_buffered_bytes:
            return False
        conn.reserved = want
        self._reserved += want
        return True

    def _wait_for_budget(self, conn: _Conn) -> None:
        conn.stalled_since = conn.frame_since = None  # we hold it back: not its fault
        self._set_reading(conn, False)
        if conn in self._budget_waiting:
            return
        self.budget_waits += 1
        if self.budget_waits <= 20 or self.budget_waits % 1000 == 0:
            log.warning(
                "Tank client %s: its %d-byte request waits: %d bytes of requests are in flight, "
                "the limit is %d (max_buffered_bytes)",
                conn.name, conn.frames.pending_length(), self._reserved, self.limits.max_buffered_bytes,
            )
        self._budget_waiting.append(conn)

    def _cut_slowest_holder(self, now: float) -> None:
        """Requests have waited ``request_timeout`` for the budget: close the connection whose
        reserved frame comes slowest (a sender just above ``min_request_rate`` would
        otherwise hold its reservation for as long as its frame takes)."""
        holders = [c for c in self._conns.values() if c.reserved and c.frame_since is not None and not c.closed]
        i = slowest_holder([(c.frames.buffered, now - c.frame_since) for c in holders])  # type: ignore[operator]
        if i is None:
            return
        conn = holders[i]
        self.budget_evictions += 1
        self._close(
            conn,
            f"holds {conn.reserved} bytes of the request budget (max_buffered_bytes) at"
            f" {conn.frames.buffered / max(now - conn.frame_since, 1e-3):.0f} bytes/s, the slowest,"  # type: ignore[operator]
            f" while other requests have waited {self.limits.request_timeout:g}s",
            True,
        )

    def _resume_budget_waiting(self) -> None:
        waiting, self._budget_waiting = self._budget_waiting, []
        for i, conn in enumerate(waiting):
            if conn.closed:
                continue
            if not self._reserve(conn):
                self._budget_waiting += [c for c in waiting[i:] if not c.closed]  # in order
                return
            self._set_reading(conn, True)
            self._process(conn)

    def _set_reading(self, conn: _Conn, reading: bool) -> None:
        if conn.closed:
            return
        conn.reading = reading
        self._update_events(conn)

    def _update_events(self, conn: _Conn) -> None:
        self.watch_events(conn.sock, events(conn))

    def _write(self, conn: _Conn, data: bytes | list[bytes]) -> None:
        if conn.closed:
            return
        before = conn.out_size
        try:
            send(conn, data)
        except OSError as exc:
            self._close(conn, f"send failed: {exc}")
            return
        finally:
            self._out_held += conn.out_size - before
        if not conn.out:
            return
        if conn.out_size > self.limits.max_output_bytes or self._out_held > self.limits.max_total_output_bytes:
            conn.reading = False  # a client that does not read its answers (or too many such)
        self._update_events(conn)

    def _flush_out(self, conn: _Conn) -> None:
        out = conn.out
        if not conn.closed:
            before = conn.out_size
            try:
                flush(conn)
            except OSError as exc:
                self._close(conn, f"send failed: {exc}")
                return
            finally:
                self._out_held += conn.out_size - before
        if not out:
            if conn.deferred and not conn.closed:
                conn.deferred = False
                for parked in [p for p in self._parked_all if p.conn is conn]:
                    self._answer_parked(parked, timed_out=False)
        if (not out and not conn.reading and conn not in self._throttled and conn not in self._budget_waiting
                and not self._shutting_down):
            conn.reading = True
            if not conn.closed:
                self._update_events(conn)
                self._process(conn)  # the frames that were left waiting
            return
        if not conn.closed:
            self._update_events(conn)

    def _close(self, conn: _Conn, why: str | None, bad: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn in self._budget_waiting:
            self._budget_waiting.remove(conn)
        self._conns.pop(conn.sock, None)
        self._reserved -= conn.reserved
        conn.reserved = 0
        self._out_held -= conn.out_size  # its unsent answers go with it
        if self._parked_all:
            # Its parked fetches go too (a long poll may otherwise wait for weeks).
            for parked in [p for p in self._parked_all if p.conn is conn]:
                self._unpark(parked)
        self.unwatch(conn.sock)
        close_quietly(conn.sock)
        if bad:
            self.bad_input(f"Tank request from {conn.name}", f"{why}; connection closed")
        elif why:
            log.info("Tank client %s: %s; connection closed", conn.name, why)
        else:
            log.debug("Tank client %s disconnected", conn.name)

    @property
    def connections(self) -> int:
        return len(self._conns)

    # ---------------------------------------------------------------- requests

    def _on_frame(self, conn: _Conn, msg_id: int, payload: bytes | memoryview) -> None:
        if msg_id in _PRODUCE_IDS:
            if self._produce_plainly(conn, msg_id, payload):
                return
        elif type(payload) is memoryview:
            payload = bytes(payload)  # (only produces are decoded from a view: their bundles)
        req = decode_request(msg_id, payload)  # ProtocolError closes the connection
        if isinstance(req, ProduceRequest):
            self._on_produce(conn, req)
        elif isinstance(req, ConsumeRequest):
            self._on_consume(conn, req)
        elif isinstance(req, Ping):
            pass  # a heartbeat: Tank does not answer it
        elif isinstance(req, DiscoverPartitionsRequest):
            self._write(conn, self._discover_partitions(req).encode())
        elif isinstance(req, CreateTopicRequest):
            self._write(conn, self._create_topic(req).encode())
        elif isinstance(req, StatusRequest):
            topics = self.pmap.topics()
            self._write(
                conn,
                StatusResponse(
                    req.req_id,
                    topics=len(topics),
                    partitions=len(self.pmap),
                    open_partitions=len(self.pmap),
                    startup_ts=int(self.started_at),
                    version=TANK_VERSION,
                ).encode(),
            )
        elif isinstance(req, DiscoverTopicsRequest):
            infos = [
                TopicInfo(t, True, len(self.pmap.partitions(t) or ())) for t in self.pmap.topics()
            ]
            self._write(conn, DiscoverTopicsResponse(req.req_id, infos).encode())
        elif isinstance(req, DiscoverTopologyRequest):
            self._write(conn, DiscoverTopologyResponse(req.req_id).encode())  # standalone
        elif isinstance(req, ReloadConfRequest):
            # Dafka partitions have no per-partition configuration to reload.
            known = self.pmap.get(req.topic, req.partition) is not None
            self._limited.emit(logging.INFO, "reload", "ReloadConf %s/%d refused: nothing to reload",
                               shown(req.topic), req.partition)
            self._write(conn, ReloadConfResponse(req.req_id, req.topic, req.partition, 2 if known else 1).encode())

    # ---------------------------------------------------------------- produce

    def _produce_plainly(self, conn: _Conn, msg_id: int, payload: bytes | memoryview) -> bool:
        """A produce request of the common kind in one compiled call (:func:`dafka.fastio.tank_produce`:
        every partition known and owned, every bundle well formed and continuing its
        partition): decoded, walked, sealed and queued as :meth:`_on_produce` does it, without
        a Python object per partition or per field.  False: anything else, nothing done; the
        general path (:meth:`_on_produce`) decides."""
        if self.storage_error is not None:
            return False
        made: list[Block] = []
        done = tank_produce(
            payload, msg_id == MsgId.PRODUCE_WITH_SEQNUM, self.pmap.by_topic, self._next_offset,
            self.config.max_record_bytes, INFLATE_BUDGET, self._live, MAX_LIVE_HELD_BYTES - self._live_held,
            made, self._to_publish, PARTITIONS_TOPIC,
        )
        if done is None:
            return False
        needs, answer, records, live_bytes = done
        self.queue_blocks(made, records)
        self._live_held += live_bytes  # given back when published
        if needs:
            self._pending.append(_PendingProduce(conn, answer, needs))
        else:
            self._write(conn, answer)
        return True

    def _on_produce(self, conn: _Conn, req: ProduceRequest) -> None:
        """Store each bundle as it was sent, as one Tank block (issue 36).

        Every bundle of the request is walked first (:func:`dafka.fastio.tank_scan`:
        counts, lengths, sparse seqs, sizes, the snappy budget; no per-message
        Python): a malformed one closes the connection before anything of the
        request is queued.  Offsets are given per bundle; the answer goes out
        after the commit holding its blocks.
        """
        with_seq = isinstance(req, ProduceWithSeqnumRequest)
        plan: list[tuple[ProducePartitionResult, TankPartition, Any, tuple[Any, ...], int | None]] = []
        results: list[ProduceTopicResult] = []
        max_bytes = self.config.max_record_bytes
        scan = tank_scan
        for t in req.topics:
            parts = None if t.name == PARTITIONS_TOPIC else self.pmap.partitions(t.name)
            if parts is None:
                code = ProduceError.READ_ONLY if t.name == PARTITIONS_TOPIC else ProduceError.UNKNOWN_TOPIC
                results.append(ProduceTopicResult([], code if t.partitions else None))
                continue
            tres = ProduceTopicResult([])
            results.append(tres)
            for p in t.partitions:
                res = ProducePartitionResult()
                tres.partitions.append(res)
                part = parts[p.partition] if p.partition < len(parts) else None
                if part is None:
                    res.error = ProduceError.UNKNOWN_PARTITION
                elif not part.owned:
                    res.error = ProduceError.NO_LEADER  # a mesh producer writes it
                elif self.storage_error is not None:
                    res.error = ProduceError.SYSTEM
                else:
                    live = self._live_held < MAX_LIVE_HELD_BYTES and self._live(part)
                    try:
                        got = scan(p.bundle, max_bytes, INFLATE_BUDGET, live)
                    except ProtocolError:
                        # Malformed (raised on: the connection closes), or only a message
                        # over max_record_bytes: Tank has no "too large" code, so a system
                        # error for this partition, nothing of it written.
                        scan(p.bundle, UNBOUNDED, INFLATE_BUDGET)
                        res.error = ProduceError.SYSTEM
                        self.records_too_large += 1
                        self._limited.warning(
                            "too-large", "Tank produce to %s/%d refused: a message over max_record_bytes=%d",
                            shown(t.name), p.partition, max_bytes,
                        )
                        continue
                    if got[6] is not None:
                        self._live_held += sum(map(len, got[6]))  # given back if not published
                    first = p.first_seq if with_seq else got[2]
                    plan.append((res, part, p.bundle, got, first))
        needs: dict[tuple[str, str], int] = {}
        publish = self._to_publish.append
        # The first bundle walked is sealed where it lies, its block header written over the
        # request's fields before it (a produce received in place has HEADER_SIZE bytes of room
        # in front: _accept's FrameBuffer); a later one would overwrite the one before it.  Only
        # when it is half the frame or more: its block keeps the frame's buffer until committed.
        at = -1
        if plan:
            first_bundle = plan[0][2]
            if type(first_bundle) is memoryview and 2 * len(first_bundle) >= len(first_bundle.obj):  # type: ignore[arg-type]
                at = view_start(first_bundle)
        for res, part, bundle, got, first in plan:
            key = (part.topic, part.address)
            n = self._next_offset.get(key, 0)
            count = got[1]
            if not tank_seqs_continue(first, n + 1, got):
                res.error = ProduceError.INVALID_SEQNUM
                if got[6] is not None:
                    self._live_held -= sum(map(len, got[6]))
                continue
            if at >= HEADER_SIZE and bundle is plan[0][2]:
                block: bytes | memoryview = tank_seal_in_place(bundle, at, got, n)
            else:
                block = tank_seal(bundle, got, n)
            self.queue_block(part.topic, part.address, block, count)
            if got[6] is not None:
                publish((key, n, got[6]))
            n += count
            self._next_offset[key] = n
            needs[key] = n - 1
        answer = ProduceResponse(req.req_id, results).encode()
        if needs:
            self._pending.append(_PendingProduce(conn, answer, needs))
        else:
            self._write(conn, answer)

    def _live(self, part: TankPartition) -> bool:
        """Whether a partition's records go out on the mesh as RECORDs when committed: only
        while someone subscribes to them (a store, a consumer of the topic).  Otherwise
        only its HEAD goes, and whoever comes later FETCHes what it lacks."""
        key = (part.topic, part.address)
        header = self._record_headers.get(key)
        if header is None:
            header = self._record_headers[key] = wire.record_prefix(wire.RECORD, key[0], key[1], key[0])
        return self.audience.has_readers(header)

    # ---------------------------------------------------------------- create topic

    def create_owned_topic(self, topic: str, partitions: int, how: str = "Tank", sync: bool = True) -> bool:
        """Create a topic of ``partitions`` gateway-owned partitions (Tank or Kafka);
        False, logged, when that would pass ``max_owned_partitions``.  ``sync`` False: the
        caller makes it durable (:meth:`_save_map`) before it answers, with others."""
        if len(self._owned) + partitions > self.limits.max_owned_partitions:
            self.topics_refused += 1
            if self.topics_refused <= 20 or self.topics_refused % 1000 == 0:
                log.warning(
                    "%s topic %s refused: %d more partitions would pass the gateway's %d"
                    " (max_owned_partitions); %d refused so far",
                    how, shown(topic), partitions, self.limits.max_owned_partitions, self.topics_refused,
                )
            return False
        self.pmap.create_topic(topic, partitions, new_address)
        for part in self.pmap.partitions(topic) or ():
            self._owned[(part.topic, part.address)] = part
        if sync:
            self.topics_created()
        return True

    def topics_created(self) -> None:
        """Make new topics durable, then wake the consumes waiting on the partition list."""
        self._save_map()
        self._wake_parked((_VIRTUAL_KEY,))

    def _create_topic(self, req: CreateTopicRequest) -> CreateTopicResponse:
        def answer(code: int) -> CreateTopicResponse:
            return CreateTopicResponse(req.req_id, req.topic, code)

        if not valid_topic_name(req.topic) or req.partitions in (0, 0xFFFF):
            return answer(CreateTopicError.INVALID)
        if req.partitions > self.limits.max_partitions_per_topic:
            self._limited.warning(
                "too-wide", "CreateTopic %s refused: %d partitions, over the limit of %d (max_partitions_per_topic)",
                shown(req.topic), req.partitions, self.limits.max_partitions_per_topic,
            )
            return answer(CreateTopicError.INVALID)
        for line in req.config.splitlines():
            if line.strip() and not line.strip().startswith("#") and "=" not in line:
                return answer(CreateTopicError.INVALID_CONFIG)
        if self.pmap.partitions(req.topic) is not None or self.db.partitions(req.topic):
            return answer(CreateTopicError.EXISTS)
        if not self.create_owned_topic(req.topic, req.partitions):
            return answer(CreateTopicError.INVALID)
        if req.config.strip():
            log.info("topic %s: Tank topic configuration ignored (%r)", shown(req.topic), req.config)
        log.info("created topic %s with %d gateway partitions", shown(req.topic), req.partitions)
        return answer(CreateTopicError.OK)

    # ---------------------------------------------------------------- discover

    def _discover_partitions(self, req: DiscoverPartitionsRequest) -> DiscoverPartitionsResponse:
        virtual = req.topic == PARTITIONS_TOPIC
        parts: list[TankPartition | None] | None
        parts = [None] if virtual else self.pmap.partitions(req.topic)  # type: ignore[assignment]
        if not parts:
            return DiscoverPartitionsResponse(req.req_id, req.topic, [])
        pids = req.partitions or range(len(parts))
        bounds = []
        for pid in pids:
            if pid < len(parts):
                bounds.append(PartitionBounds(*self._bounds(req.topic, parts[pid]).discover()))
            else:
                bounds.append(PartitionBounds(0, 0))
        return DiscoverPartitionsResponse(req.req_id, req.topic, bounds)

    # ---------------------------------------------------------------- consume

    def _on_consume(self, conn: _Conn, req: ConsumeRequest) -> None:
        budget = answer_budget(conn.out_size, self.limits, self._out_held)
        response, size, waiting, faulted = self._consume_answer(req, False, budget)
        # Like the broker (respond_now), a fault is reported at once: a client
        # asking for several partitions must not wait max_wait to learn of it.
        # An answer cut short by its byte budget goes at once too.
        if faulted or size >= max(1, req.min_bytes) or not waiting or req.max_wait_ms == 0 or size >= budget:
            self._write(conn, response.encode())
            return
        entries = sum(len(t.partitions) for t in req.topics)
        if conn.parked_entries + entries > MAX_PARKED_ENTRIES:
            # A long poll holds its request: past this the connection gets
            # what a timed-out fetch gets, at once.
            response, *_ = self._consume_answer(req, True, budget)
            self._write(conn, response.encode())
            return
        # Park until one of the partitions at their tail gets data, or max_wait.
        deadline = time.monotonic() + req.max_wait_ms / 1000.0
        marks = {}
        for key, cap in waiting.items():
            if key != _VIRTUAL_KEY:
                info = self.db.info(*key)
                marks[key] = (self._heads.get(key, -1), 0 if info is None else info.bytes, cap)
        parked = _Parked(conn, req, deadline, list(waiting), size, marks)
        conn.parked_entries += entries
        self._parked_all.append(parked)
        for key in waiting:
            self._parked.setdefault(key, []).append(parked)

    def _wake_parked(self, keys: Any) -> None:
        """Re-answer parked fetches waiting on any of ``keys``."""
        if not self._parked:
            return
        woken: list[_Parked] = []
        for key in keys:
            for parked in self._parked.get(key, ()):
                if parked not in woken:
                    woken.append(parked)
        stored: dict[tuple[str, str], int] = {}  # stored bytes of the woken partitions, read once
        for parked in woken:
            self._answer_parked(parked, timed_out=False, stored=stored)

    def _answer_parked(self, parked: _Parked, timed_out: bool, stored: dict[tuple[str, str], int] | None = None) -> None:
        """Answer a parked consume, or leave it parked.  Before its time is up it is
        answered only once the partitions it waits on have taken enough bytes since it
        parked to make min_bytes with what it had (their stored bytes and messages, from
        the partitions' metadata: nothing read), and then whatever its answer holds.
        Building the answer at every commit (reading its other partitions again and again,
        for a min_bytes it may never reach) let a client make each produce cost the
        gateway as many answers as it had consumes parked."""
        conn = parked.conn
        if not conn.closed:
            if not timed_out and parked.size + self._arrived(parked, {} if stored is None else stored) < max(
                    1, parked.request.min_bytes):
                return  # not enough yet
            budget = answer_budget(conn.out_size, self.limits, self._out_held)
            if budget == 0 and not timed_out:
                conn.deferred = True  # answered once its earlier answers are taken
                return
            response, *_ = self._consume_answer(parked.request, timed_out, budget)
            self._write(conn, response.encode())
        self._unpark(parked)

    def _arrived(self, parked: _Parked, stored: dict[tuple[str, str], int]) -> int:
        """About the chunk bytes the partitions ``parked`` waits on would now add to its
        answer: their stored bytes since it parked and a byte a message, each within its
        fetch size (the partition map's virtual partition: always enough).  A partition that
        stores fewer bytes than when it parked (DeleteRecords, retention or compaction
        removed some since) cannot tell what came from its bytes, nor compressed blocks of
        another codec (a Kafka producer's, re-encoded for a Tank answer), nor a head that
        went back (deleted and created again): each counts as its whole fetch size once it has
        anything new, so the consume is answered (it waited to max_wait, whatever came).
        ``stored``: partitions' stored bytes read already (filled here)."""
        def stored_bytes(key: tuple[str, str]) -> int:
            nbytes = stored.get(key)
            if nbytes is None:
                info = self.db.info(*key)
                nbytes = stored[key] = 0 if info is None else info.bytes
            return nbytes

        total = 0
        for key in parked.keys:
            mark = parked.marks.get(key)
            if mark is None:
                return 1 << 62  # the virtual partition: answered from memory, at once
            total += arrived(mark, self._heads.get(key, -1), lambda k=key: stored_bytes(k),
                             lambda k=key, m=mark: self.packed_since(k, m[0], CODEC_TANK), 1, 0)
        return total

    def packed_since(self, key: tuple[str, str], mark: int, codec: int) -> bool:
        """Whether a compressed block of another codec than ``codec`` (a reader's) holds
        records of partition ``key`` past offset ``mark``: its stored bytes are then a
        fraction of what that reader's answer holds, so a parked long poll cannot count
        what came from them.  From the block headers, each block looked at once per reader
        codec however many long polls wait on the partition (bounded: about one entry a
        partition waited on)."""
        head = self._heads.get(key, -1)
        slot = (key[0], key[1], codec)
        entry = self._packed.get(slot)
        if entry is None or mark < entry[0] or head < entry[1]:
            entry = (mark, mark, -1)  # first look, an earlier mark, or the partition went back
        start, upto, newest = entry
        if upto < head:
            try:
                found = self.db.newest_packed(key[0], key[1], upto + 1, head, codec)
            except StorageError:
                found = head
            entry = (start, head, max(newest, found))
        if slot not in self._packed and len(self._packed) >= MAX_PACKED_ENTRIES:
            self._packed.clear()  # (a cache: partitions come and go; its entries are rebuilt from the marks)
        self._packed[slot] = entry
        return entry[2] > mark

    def _unpark(self, parked: _Parked) -> None:
        try:
            self._parked_all.remove(parked)
        except ValueError:
            return  # already gone (its connection closed while it was answered)
        parked.conn.parked_entries -= sum(len(t.partitions) for t in parked.request.topics)
        for key in parked.keys:
            waiters = self._parked.get(key)
            if waiters is not None:
                waiters.remove(parked)
                if not waiters:
                    del self._parked[key]

    def _consume_answer(
        self, req: ConsumeRequest, timed_out: bool, budget: int
    ) -> tuple[ConsumeResponse, int, dict[tuple[str, str], int], bool]:
        """The answer as things are now, its chunk bytes, the partitions at their
        tail, and whether any topic or partition is answered with a fault.

        The chunks hold at most ``budget`` bytes of records (or one whole
        record, when the first one alone is over it); partitions past the
        budget get an empty answer, as a partition at its end does, and the
        client asks again.  A partition named twice is served once: its
        repeats get the same empty answer (so a 3 KB request cannot make the
        gateway build hundreds of copies of one partition's data).
        """
        topics = []
        size = 0
        waiting: dict[tuple[str, str], int] = {}  # partitions at their tail: their fetch size
        faulted = False
        seen: set[tuple[str, int]] = set()
        for t in req.topics:
            virtual = t.name == PARTITIONS_TOPIC
            parts = None if virtual else self.pmap.partitions(t.name)
            if parts is None and not virtual:
                topics.append(ConsumeTopicResult(t.name, [], True, len(t.partitions)))
                faulted = True
                continue
            results = []
            for p in t.partitions:
                if virtual:
                    part, known = None, p.partition == 0
                else:
                    part = parts[p.partition] if p.partition < len(parts) else None  # type: ignore[index]
                    known = part is not None
                if not known:
                    results.append(ConsumePartitionResult(p.partition, ConsumeFlag.UNKNOWN_PARTITION))
                    continue
                if (t.name, p.partition) in seen or size >= budget:
                    results.append(self._empty_answer(t.name, part, p.partition))
                    continue
                seen.add((t.name, p.partition))
                got = self._consume_partition(t.name, part, p, timed_out, budget - size, size == 0)
                if got is None:
                    results.append(ConsumePartitionResult(p.partition, ConsumeFlag.SYSTEM_ERROR))
                    continue
                res, at_tail = got
                if res.chunk:
                    size += len(res.chunk)
                elif at_tail:
                    waiting[_VIRTUAL_KEY if part is None else (t.name, part.address)] = min(
                        max(p.fetch_size, 1), MAX_ANSWER_BYTES)
                elif res.flags == ConsumeFlag.OK:
                    size = max(size, budget)  # had data, but no room for it: the answer is full
                results.append(res)
            faulted = faulted or any(r.flags != ConsumeFlag.OK for r in results)
            topics.append(ConsumeTopicResult(t.name, results))
        return ConsumeResponse(req.req_id, topics), size, waiting, faulted

    def _empty_answer(self, topic: str, part: TankPartition | None, pid: int) -> ConsumePartitionResult:
        """No records this time: what a partition at its end is answered."""
        bounds = self._bounds(topic, part)
        return ConsumePartitionResult(pid, ConsumeFlag.OK, bounds.first_avail, bounds.hwm)

    def _consume_partition(
        self, topic: str, part: TankPartition | None, p: ConsumePartition, timed_out: bool, budget: int, first_data: bool
    ) -> tuple[ConsumePartitionResult, bool] | None:
        """One partition's answer and whether it is at its tail (None: a storage fault).

        Whole records, at most ``budget`` bytes of them, except that the
        ``first_data`` partition of an answer gets at least one record.
        """
        bounds = self._bounds(topic, part)
        start = consume_start(p.seq, bounds)
        if start.kind == "boundary":
            return ConsumePartitionResult(
                p.partition, ConsumeFlag.BOUNDARY_CHECK, 0, bounds.hwm, b"", bounds.first_avail
            ), False
        if start.kind == "tail":
            # Remember where the tail was: a parked "UINT64_MAX" must not move on.
            p.seq = start.seq
            return ConsumePartitionResult(
                p.partition, ConsumeFlag.OK, 0 if timed_out else bounds.first_avail, bounds.hwm
            ), True
        limit = min(max(p.fetch_size, 1), MAX_ANSWER_BYTES)
        if part is None:
            return self._consume_values(topic, part, p, start.seq - 1, limit, budget, first_data, bounds)
        try:
            first, front, blocks = self.db.read_blocks(topic, part.address, start.seq - 1, min(limit, budget))
        except (StorageError, ValueError) as exc:  # (ValueError: a damaged block's header)
            self._limited.emit(logging.ERROR, "read-failed", "cannot read %s for a Tank fetch: %s", shown(topic), exc)
            return None
        if not blocks:  # retention ran meanwhile
            return ConsumePartitionResult(
                p.partition, ConsumeFlag.BOUNDARY_CHECK, 0, bounds.hwm, b"", first + 1
            ), False
        # Stored bundles go whole, as the broker sends its log: the chunk may begin before
        # the requested seq (the client skips what precedes it) and may pass fetch_size to
        # finish a bundle.  Blocks of other codecs (mesh records, Kafka) become one bundle each,
        # and so does the partial front block (a bundle beginning below the partition's
        # first, left by a DeleteRecords): its records from ``first`` on only, deleted ones
        # never go out.  So does a first bundle over the answer's budget (a bundle may be
        # max_request_bytes): its records from ``first`` on, within the budget (one at least).
        # Every later bundle goes whole.
        pieces: list[Any] = []
        size = 0
        base = None
        for hdr, value in blocks:
            if pieces and size >= limit:
                break
            whole = hdr.codec == CODEC_TANK and hdr.first_offset >= front and (
                bool(pieces) or not first_data or len(value) - HEADER_SIZE <= budget
            ) and tank_seqs_are_offsets(value, hdr)
            if whole:
                body = memoryview(value)[HEADER_SIZE:]
                piece: list[Any] = [encode_varint(len(body)), body]
                at = hdr.first_offset
            else:
                at = max(first, hdr.first_offset)
                room = budget - size if (pieces or not first_data) else max(budget, 1)
                n = min(MAX_ANSWER_RECORDS, max(1, min(limit, room) // 64))
                # A client's block (a bundle over the budget, the partial front block) is walked
                # from its start at each conversion: a window of its records is kept for the
                # next consumes (read in N consumes, a bundle was walked N times).  (``at`` moves
                # on when it lies in a gap inside a sparse bundle: values go at their own seqs.)
                try:
                    at, values = values_from(value, hdr, at, n, None if hdr.codec == CODEC_STORE
                                             else self.db.window_convert(topic, part.address))
                    values = _whole_values(values, limit - size, room, bool(pieces) or not first_data)
                    if not values:
                        break
                    bundle = stored_bundle(values, self.compress)
                except (ValueError, IndexError, struct.error) as exc:  # a damaged store (blocks are checked when written)
                    # Its partition alone is answered with a fault: raised, it closed the
                    # connection as if the client had sent bad input, with the answers of
                    # the request's other partitions (ProtocolError), or left the request
                    # unanswered (a store block's values that do not parse: IndexError).
                    self._limited.emit(logging.ERROR, "read-damaged", "cannot read a stored block of %s at %d: %s",
                                       shown(topic), hdr.first_offset, exc)
                    if pieces:
                        break  # those before it go: the next consume begins at it
                    return None
                piece = [encode_varint(len(bundle)), bundle]
            n = len(piece[0]) + len(piece[1])
            if pieces and (size >= limit or size + n > budget):
                break
            if not pieces and not first_data and n > budget:
                # Had data, but no room for it in this answer: the answer is full.
                return ConsumePartitionResult(p.partition, ConsumeFlag.OK, bounds.first_avail, bounds.hwm), False
            if base is None:
                base = at
            pieces += piece
            size += n
            if not whole and at + len(values) <= hdr.last_offset:
                break  # a converted block cut short: the next bundle would not continue it
        if base is None:
            return ConsumePartitionResult(p.partition, ConsumeFlag.OK, bounds.first_avail, bounds.hwm), False
        return ConsumePartitionResult(p.partition, ConsumeFlag.OK, base + 1, bounds.hwm, b"".join(pieces)), False

    def _consume_values(
        self, topic: str, part: TankPartition | None, p: ConsumePartition, offset: int, limit: int, budget: int,
        first_data: bool, bounds: Bounds,
    ) -> tuple[ConsumePartitionResult, bool] | None:
        """An answer of stored values made into one bundle (the partition map topic)."""
        count = min(MAX_ANSWER_RECORDS, max(1, min(limit, budget) // 64), bounds.hwm - offset)
        first, values = self._stored(topic, part, offset, count)
        if not values:
            return ConsumePartitionResult(
                p.partition, ConsumeFlag.BOUNDARY_CHECK, 0, bounds.hwm, b"", first + 1
            ), False
        values = _whole_values(values, limit, budget, not first_data)
        if not values:
            return ConsumePartitionResult(p.partition, ConsumeFlag.OK, bounds.first_avail, bounds.hwm), False
        chunk = chunk_of(stored_bundle(values, self.compress))
        return ConsumePartitionResult(p.partition, ConsumeFlag.OK, first + 1, bounds.hwm, chunk), False


def _held(entries: list[tuple[tuple[str, str], int, Any]]) -> int:
    """Content bytes of the Tank bundles among ``_to_publish`` entries (single records: 0)."""
    return sum(sum(map(len, item)) for _key, _first, item in entries if isinstance(item, list))


def _whole_values(values: list[bytes], limit: int, budget: int, strict: bool) -> list[bytes]:
    """The values an answer takes: whole records, as Tank, the one that crosses ``limit``
    (fetch_size) too, but none past ``budget`` (except one, unless ``strict``)."""
    if sum(map(len, values)) <= min(limit, budget):
        return values
    ends = list(accumulate(map(len, values)))
    cut = bisect_left(ends, limit) + 1
    fit = bisect_right(ends, budget)
    return values[: min(cut, fit if strict else max(1, fit))]
