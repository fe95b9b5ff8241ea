"""The store node: persists every record of every partition and serves them.

I/O thread (the node loop): subscribes to all RECORDs (``M``), HEADs (``H``),
FETCHes (``F``), GET-HEADS (``G``), and to ``D``/``W`` + own address.  Each
partition's :class:`PartitionTracker` (offset reset "earliest": a store wants
everything) turns arrivals into an in-order stream; gaps and HEADs ahead of
what is stored become FETCHes (with retries) to producers or other stores.

Writer thread: appends what the I/O thread queued to LMDB in one transaction
(group commit, synced by default), pipelined (:mod:`dafka.store.pipeline`): while
one transaction commits, what arrives is staged for the next, which the writer
takes the moment the commit returns.  Only after the commit returns does the I/O
thread send one cumulative ACK per partition.  A
failed commit (disk full, I/O error, any other write error) keeps the batch,
stops acknowledging and retries; nothing acknowledged is ever lost.  About once
a second the store tells each producer whose records it holds whether it can
write (STORE-STATUS, a dafka-only message), so a producer without ACKs can
report why.

FETCH(offset, count) is answered with exactly ``count`` DIRECT-RECORDs, or
fewer if fewer are stored, from the first retained offset when the asked one
was removed by retention.  Large answers are served in slices so one FETCH
cannot starve the rest.

Holes: offsets nobody supplied within ``skip_after`` are given up and recorded
in LMDB; the store asks for them again later (:class:`dafka.store.holes.HoleRepair`
decides which and when, backing off) and writes records that arrive for them
(:meth:`RecordDB.fill_holes`: never over a stored record).

Consumer groups: every COMMIT (``C``) seen is written to the ``positions``
table (one small synced transaction, in the I/O thread) and then confirmed
with COMMITTED; GET-POSITIONS (``P``) is answered with every position of the
group the store holds (POSITIONS).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from dafka import fastio
from dafka.config import NodeConfig, default_node_config
from dafka.core import beacon, wire
from dafka.core.gaps import KnownStores, PartitionTracker
from dafka.errors import ConfigError, ProtocolError
from dafka.gateway.connections import LogLimiter
from dafka.nodes.metrics import SECONDS_BUCKETS, SIZE_BUCKETS, Histogram
from dafka.nodes.node import DRAIN, read_subscriptions
from dafka.nodes.reader import PartitionReader, unheard_may_wait
from dafka.store.acks import AckRepeats
from dafka.store.announce import HeadsRota
from dafka.store.block import CODEC_STORE, decode_header
from dafka.store.compaction import DEFAULT_MAX_KEYS, CompactionPolicy, Compactor
from dafka.store.db import RecordDB, RetentionPolicy, StorageError
from dafka.store.holes import HoleRepair
from dafka.store.layout import VALUE_HEADER
from dafka.store.leaves import LeafEndpoint
from dafka.store.linger import TrickleLinger
from dafka.store.pipeline import Block, CommitPipe, Offer, Work
from dafka.store.writer import BLOCK_BYTES

log = logging.getLogger("dafka.store")
LINGER = 0.001  # seconds a store rests from reading after a small read (see Store)
LINGER_BELOW = 64  # a read of fewer records than this is small


def linger_setting(section: dict[str, Any]) -> float:
    """A [store] section's ``linger_ms`` in seconds (default :data:`LINGER`)."""
    value = section.get("linger_ms", LINGER * 1000)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1000:
        raise ConfigError(f"[store] linger_ms must be a number of milliseconds from 0 to 1000, not {value!r}")
    return float(value) / 1000


MAX_BATCH = 200_000  # records waiting for the writer before reading pauses
# ... or bytes of blocks waiting for it: a client's large one-record bundles (or Kafka batches)
# held by the hundred thousand were hundreds of GB, received faster than a synced writer commits.
MAX_QUEUED_BYTES = 256 << 20
MAX_FETCH_JOBS = 10_000  # FETCH answers in progress at once, all requesters
MAX_JOBS_PER_REQUESTER = 8  # of one requester for one partition (a reader needs one or two)
MAX_TOO_LARGE_HOLES = 10_000  # offsets dropped over the size limit, remembered until their hole commits
SERVE_SLICE = 2_000  # DIRECT-RECORDs sent per FETCH job per loop turn
STATS_INTERVAL = 10.0
RETENTION_BUDGET = 0.2  # seconds of deletions per retention round
COMPACTION_BUDGET = 0.2  # seconds of compaction steps per writer round
HEADS_INTERVAL = 30.0  # stores re-announce the heads they hold (replication)
HEADS_STEP = 1.0  # ... a slice every this many seconds (dafka.store.announce)
STATUS_INTERVAL = 1.0  # STORE-STATUS to the producers whose records came in
# A partition that commits and is acknowledged is told "writing" at most this
# often (a producer's diagnose() looks 5 s back): each second it was a message
# per producer (1,000 a second for a store of 1,000 devices) that said what its
# ACKs already say.  A failing or refusing store tells at once, every interval.
WRITING_STATUS_EVERY = 4.0


def status_phase(partition: str) -> float:
    """Seconds (0 to WRITING_STATUS_EVERY) by which a partition's "writing"
    slots are moved, fixed by its address (see :func:`writing_status_due`)."""
    return (zlib.crc32(partition.encode()) % 1024) / 1024 * WRITING_STATUS_EVERY


def writing_status_due(partition: str, last: float | None, now: float) -> bool:
    """Whether to tell a committing partition "writing" again at ``now`` (told at ``last``).

    Once per slot of WRITING_STATUS_EVERY seconds, the slots of each partition
    moved by its own phase.  Told "4 s after the last time", partitions told in
    the same second (a fleet that started together) were told again all in one
    turn every 4 s: the store, then every producer, stalled 60-100 ms, and those
    records' ACKs with them.  Spreading only the first repeat did not last: a
    timer runs up to a millisecond early, a 4 s span came out a hair short, and
    groups slipped into each other's second.  Fixed slots do not drift.
    """
    if last is None:
        return True
    phase = status_phase(partition)
    return (now + phase) // WRITING_STATUS_EVERY != (last + phase) // WRITING_STATUS_EVERY


ERROR_LOG_INTERVAL = 30.0  # a lasting write failure is logged again this often
# While its commits fail (a full disk), a store keeps reading its data socket:
# FETCHes, GET-HEADS and the rest come on it, and the records it holds may be
# held by no one else.  Messages of these kinds (records, record batches,
# HEADs) are left out meanwhile, as if the socket's high-water mark had
# dropped them: nothing of them is acknowledged, and once writes resume the
# partitions' next records show the gap, which is fetched again.
_SHED = frozenset((wire.P_RECORD, wire.P_DIRECT_RECORD, wire.P_HEAD, wire.P_DIRECT_HEAD))
_NO_PREFIXES: dict[bytes, Any] = {}  # no fast path: every message goes through on_message
REFUSED_LOG_INTERVAL = 5.0  # refused partitions are logged at most this often
REFUSED_STATUS_FOR = 10.0  # seconds a refused partition's producer is told "not writing"
SKIP_AFTER = 10.0  # seconds before offsets nobody has are given up
MAX_HEARERS = 1_000_000  # producers remembered as subscribed to their FETCHes here
MAX_ADDRESS = 64  # characters of an address counted as a FETCH subscriber (ours are 32)

# Records for recorded holes (content None: an offset given up for good), and
# ready-made blocks ``(topic, partition, block)`` (a gateway's client blocks);
# what the writer commits at once is a Work (dafka.store.pipeline).
_Fill = tuple[str, str, int, bytes | None, int]
_Block = Block


def _held_bytes(block: bytes | memoryview) -> int:
    """What a queued block holds in memory: a view (a Tank bundle sealed where it was received)
    holds its whole buffer."""
    return len(block.obj) if type(block) is memoryview else len(block)  # type: ignore[arg-type]


def _block_records(blocks: list[_Block]) -> int:
    """Records held by ready-made blocks (from their headers)."""
    return sum(decode_header(b[2]).record_count for b in blocks)


@dataclass(slots=True)
class FetchJob:
    """A FETCH answer in progress (served a slice at a time)."""

    key: tuple[str, str, str]  # (requester, subject, partition): one job each
    prefix: bytes  # DIRECT-RECORD header up to the sequence, for the requester
    batched: bool  # the prefix is a batch's: the requester takes batches (see dafka.core.audience)
    single: bytes  # the single-record prefix (the form until the requester is known to take batches)
    topic: str
    partition: str
    offset: int  # next offset to send
    remaining: int
    asked: int  # the offset the FETCH asked for


class Store(PartitionReader):
    """A store on the mesh, persisting into the LMDB directory ``db``."""

    retention_budget = RETENTION_BUDGET  # seconds; an attribute so tests can drive whole rounds
    compaction_budget = COMPACTION_BUDGET  # likewise

    kind = "store"
    holds_records = True
    # Partitions whose producer is this very node (a gateway's own; see _on_committed).
    _self_produced: Collection[tuple[str, str]] = ()

    def interest(self) -> beacon.Interest:
        """Everyone: a store hears every producer and consumer, and the other stores."""
        return beacon.Interest(beacon.STORE)

    # Records of stored partitions are queued as ready CODEC_STORE blocks (fastio.drain_blocks:
    # the I/O thread builds them as the records arrive, the writer only puts them).  Off where
    # other code queues records of the same partitions (the Tank gateway).
    ready_pairs = True

    def __init__(
        self,
        db: str | RecordDB,
        config: NodeConfig | None = None,
        *,
        towers: str | list[str] | None = None,
        sync: bool = True,
        retention: RetentionPolicy | None = None,
        retention_interval: float = 1.0,
        retry_interval: float = 0.5,
        address: str | None = None,
        linger: float = LINGER,
        skip_after: float = SKIP_AFTER,
        leaves: str | None = None,
        leaf_limits: dict[str, Any] | None = None,
        topics: Collection[str] | None = None,
        compaction: CompactionPolicy | None = None,
        compaction_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        config = (config or default_node_config()).with_towers(towers)
        # The topics this store keeps (None: every one).  Records and HEADs of the
        # others are not subscribed to, and leaves of them are refused.
        self.topics: frozenset[str] | None = None if topics is None else frozenset(topics)
        if self.topics is not None and (not self.topics or any(not t for t in self.topics)):
            raise ConfigError("a store keeping a subset of topics needs at least one, and no empty name")
        super().__init__(config, address=address)
        self.db = db if isinstance(db, RecordDB) else RecordDB(db, sync=sync)
        # After a read that found only a few records, rest from reading for
        # this long (see Node.linger_data): at low rates the store then wakes
        # about once a millisecond rather than once a record, and consumers on
        # the same cores deliver sooner.  Its cost: up to this much more ACK latency.
        self.linger = linger
        self.data_reads = 0  # reads of the data socket (each a wake-up)
        self.retention = retention or RetentionPolicy()
        self.retention_interval = retention_interval
        # Compacted topics (dafka.store.compaction): run by the writer thread after
        # retention, in bounded steps.  The attribute is swapped whole when it changes.
        self.compaction = compaction or CompactionPolicy()
        self.compacted_voids = 0  # VOIDs kind 2 sent: gaps compaction left, said to FETCHers
        self.compactor = Compactor(self.db, lambda: self.compaction, bounds=self.compaction_bounds,
                                   max_keys=compaction_keys)
        self.retry_interval = retry_interval
        # Seconds a hole nobody fills (while later records are held) is waited for
        # before its offsets are given up and recorded as a hole.
        self.skip_after = skip_after
        self._heads: dict[tuple[str, str], int] = {}
        # The other stores (they subscribe to their CONSUMER-HELLOs on our
        # publisher): all must have said they hold none of a restarted
        # producer's hole before it is passed without waiting skip_after.
        self._stores = KnownStores(skip_after)
        self._pids: dict[tuple[str, str], int] = {}
        # Partition address -> the topics of its partitions held here (see on_peer_gone).
        self._topics_of: dict[str, set[str]] = {}
        for info in self.db.partitions():
            self._heads[(info.topic, info.partition)] = info.last
            self._topics_of.setdefault(info.partition, set()).add(info.topic)
            self._pids[(info.topic, info.partition)] = info.pid
        self._batch: list[tuple[Any, ...]] = []
        # Ready stored values and their runs (topic, partition, pid, first, last, bytes),
        # committed after _batch: the Kafka gateway's (key, value) pairs.
        self._pairs: list[Any] = []
        self._segs: list[tuple[str, str, int, int, int, int]] = []
        # Ready-made blocks, committed after _pairs, and how many records they hold: the
        # records of stored partitions from the mesh (CODEC_STORE blocks the drain builds),
        # a gateway's client blocks (stored as sent).
        self._blocks: list[_Block] = []
        self._blocks_held = 0
        self._blocks_bytes = 0  # (their bytes: see MAX_QUEUED_BYTES)
        self._trickle = TrickleLinger()  # the rest after a small read
        # Offsets given up (nobody had them), committed with the records after them.
        self._skips: list[tuple[str, str, int, int]] = []
        # Recorded holes are asked for again (see dafka.store.holes); records that
        # arrive for them wait here, one per offset, for the next commit.
        self.repair = HoleRepair(interval=max(retry_interval, 0.01), release_after=skip_after)
        self._fills: dict[tuple[str, str, int], tuple[bytes | None, int]] = {}
        # Offsets dropped over max_record_bytes whose hole is not yet committed
        # (given up for good once it is, see _sync_holes).
        self._too_large_holes: dict[tuple[str, str, int], None] = {}
        # Held by the writer while it puts ready blocks, by the I/O thread while it
        # drains: see RecordDB.append_pairs (py-lmdb gives up the GIL at every put,
        # and every put then waits for a thread running Python).  The pure drain
        # gives the GIL up at each recv, but taking turns is still faster: 150-170k
        # against 110-140k records/s acknowledged in pure mode, same sitting.
        self._put_gate: Any = threading.Lock()
        self._ts = 0  # receive time (ms) of the records being read
        self._jobs: deque[FetchJob] = deque()
        self._job_of: dict[tuple[str, str, str], FetchJob] = {}  # (requester, subject, partition)
        self._read_limited = LogLimiter(log)  # stored blocks that cannot be read (see _serve)
        self._retention_limited = LogLimiter(log)  # the writer thread's (see _enforce_retention)
        self._job_counts: dict[tuple[str, str, str], int] = {}  # jobs in self._jobs per key
        self.fetches_refused = 0  # FETCHes over MAX_JOBS_PER_REQUESTER or MAX_FETCH_JOBS
        self._stats_refused = 0
        self._blocked = False  # a FETCH reader's queue was full
        self.storage_error: StorageError | None = None
        self._retry_at = 0.0
        self._unsent_acks: dict[tuple[str, str], int] = {}
        self._ack_prefixes = wire.FramePrefixes(lambda key: wire.Ack(key[1], key[0], 0))  # (see _send_acks)
        self._ack_repeats = AckRepeats()  # whether a HEAD gets its unchanged ACK again
        # Producers subscribed to their FETCHes on our publisher (see owner_hears):
        # address -> subscriptions (a count: XPUB_VERBOSER passes each one).
        self._fetch_hearers: dict[str, int] = {}
        # GET-HEADS / CONSUMER-HELLO answers wait until the input queued before
        # them is read (see _answer_heads): (requester, subjects, when asked).
        self._heads_wanted: list[tuple[str, tuple[str, ...], float]] = []
        self._status_keys: set[tuple[str, str]] = set()  # partitions committed since the last status
        self._writing_told: dict[tuple[str, str], float] = {}  # partition -> when last told "writing"
        self._error_logged_at = 0.0
        # Writer thread hand-off (dafka.store.pipeline): the pipe under the writer lock; the
        # works handed over and not yet answered, oldest first; the one being answered.
        self._writer_cond = threading.Condition()
        self._pipe = CommitPipe()
        self._inlining = False  # a commit on the I/O thread is being answered (_commit_inline)
        # While True, an offer does not wake the writer: _commit_inline, due at the end of the
        # loop turn, commits the work itself or wakes the writer then (see Gateway._process).
        self._wake_deferred = False
        self._wake_owed = False
        self._outstanding: deque[Work] = deque()
        self._reported: Work | None = None
        self._answers = 0  # commits answered (_report), one each
        self._writer_stop = False
        self._writer = threading.Thread(target=self._write_loop, name="dafka-store-writer", daemon=True)
        # Counters for the periodic log and `dafka status`.
        self.stored = 0
        self.acks_sent = 0
        self.records_served = 0
        self.fetches_received = 0
        self.skipped = 0  # offsets given up: holes in stored partitions
        self.holes_filled = 0  # records written into recorded holes
        self.hole_fetches = 0  # FETCHes sent for recorded holes
        self.records_refused = 0  # records the database refused (their partition's trouble)
        self._refused: dict[tuple[str, str], tuple[str, float]] = {}  # partition -> (why, when)
        self._refused_logged_at = float("-inf")
        self._refused_unlogged = 0
        # Observed once per commit, read by the metrics collector.
        self.commit_sizes = Histogram(SIZE_BUCKETS)
        self.commit_seconds = Histogram(SECONDS_BUCKETS)
        self.ack_latency = Histogram(SECONDS_BUCKETS)
        self._stats_at = time.monotonic()
        self._stats_stored = 0
        self._stats_served = 0

        # Block (EAGAIN) rather than drop when a reader's queue is full, so a
        # big FETCH answer paces itself to the reader instead of being lost.
        self.publisher.setsockopt(zmq.XPUB_NODROP, 1)
        own = self.address.encode()
        for prefix in (wire.P_RECORD, wire.P_HEAD):
            if self.topics is None:
                self.subscribe(prefix)
            else:
                for topic in sorted(self.topics):
                    self.subscribe(wire.subscription(prefix, topic))  # (a prefix: wants() checks exactly)
        for prefix in (wire.P_FETCH, wire.P_GET_HEADS):
            self.subscribe(prefix)
        for prefix in (wire.P_COMMIT, wire.P_GET_POSITIONS):
            self.subscribe(prefix)
        self.subscribe(wire.P_DIRECT_RECORD + own)
        self.subscribe(wire.P_CONSUMER_HELLO + own)
        # VOIDs: a restarted producer's hole, and stores that hold none of it
        # (see PartitionTracker.pass_restart_hole; C stores never send them).
        self.subscribe(wire.P_VOID + own)
        self.every(STATS_INTERVAL, self._log_stats)
        # Every head again each HEADS_INTERVAL, a slice a second (not 10,000 in one turn).
        self._rota = HeadsRota(self._heads.keys, interval=HEADS_INTERVAL, step=HEADS_STEP)
        self.every(HEADS_STEP, self._announce_some)
        self.every(STATUS_INTERVAL, self._send_status)
        self._sync_holes()
        # Leaf devices dial this port (dafka.store.leaves): their records enter as the mesh's do.
        self.leaves: LeafEndpoint | None = None
        if leaves:
            self.leaves = LeafEndpoint(self, leaves, **(leaf_limits or {}))
        self._writer.start()
        self.start()

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is pending, stop the node and close the database."""
        self.stop(timeout)
        with self._writer_cond:
            self._writer_stop = True
            self._writer_cond.notify_all()
        self._writer.join(timeout)
        self.db.close()

    def batch_full(self) -> bool:
        """Whether what waits for the writer reached MAX_BATCH records or MAX_QUEUED_BYTES of
        blocks (reading then pauses)."""
        return self.pending_records() >= MAX_BATCH or self._blocks_bytes >= MAX_QUEUED_BYTES

    def batch_low(self) -> bool:
        """Whether what waits for the writer is down to half those bounds (reading resumes)."""
        return self.pending_records() < MAX_BATCH // 2 and self._blocks_bytes < MAX_QUEUED_BYTES // 2

    def _recount_blocks(self) -> None:
        """The queued blocks' records and bytes, counted again (after some were taken out)."""
        self._blocks_held = _block_records(self._blocks)
        self._blocks_bytes = sum(_held_bytes(b[2]) for b in self._blocks)

    def pending_records(self) -> int:
        """Records received and not yet handed to the writer."""
        return len(self._batch) + len(self._pairs) + len(self._fills) + self._blocks_held

    def queue_block(self, topic: str, partition: str, block: bytes | memoryview, records: int) -> None:
        """Queue a ready-made block (validated by its maker, offsets in its header) for the
        next commit (:meth:`dafka.store.db.RecordDB.append_blocks`); ``records`` it holds."""
        self.queue_blocks([(topic, partition, block)], records)

    def queue_blocks(self, blocks: list[_Block], records: int) -> None:
        """Queue ready-made ``(topic, partition, block)`` entries (see :meth:`queue_block`);
        ``records`` they hold in all."""
        self._blocks += blocks
        self._blocks_held += records
        held = self._blocks_bytes
        for entry in blocks:  # (a loop, not sum() of a generator: once a Tank produce)
            held += _held_bytes(entry[2])
        self._blocks_bytes = held

    def heads(self) -> dict[tuple[str, str], int]:
        """Committed head per (topic, partition)."""
        return dict(self._heads)

    # ---------------------------------------------------------------- writer thread

    @property
    def _to_write(self) -> Work | None:
        """The work the writer would take now (see :class:`CommitPipe`; the simulator reads it)."""
        return self._pipe.peek()

    def _take_work(self) -> Work | None:
        """The writer's side of the hand-off: the staged work, now committing (None: nothing)."""
        with self._writer_cond:
            return self._pipe.take()

    def _write_loop(self) -> None:
        next_retention = time.monotonic() + self.retention_interval
        while True:
            with self._writer_cond:
                while True:
                    now = time.monotonic()
                    # The staged work, at once or after a linger for a client's refills
                    # (CommitPipe.due); offers, answers and close() wake this wait.
                    due = self._pipe.due(now)
                    if due is not None and (due <= 0 or self._writer_stop):
                        work = self._pipe.take()
                        break
                    work = None
                    wait = next_retention - now
                    if self._writer_stop or wait <= 0:
                        break
                    self._writer_cond.wait(wait if due is None else min(due, wait))
                stop = self._writer_stop and work is None
            if stop:
                return
            if work is not None:
                self._commit(work)
            if time.monotonic() >= next_retention:
                self._enforce_retention()
                self._compact()
                next_retention = time.monotonic() + self.retention_interval

    def _commit(self, work: Work) -> None:
        """Write ``work`` in one transaction (its fills in one before), then let the I/O thread
        answer it; the writer goes on with the staged work at once (see :class:`CommitPipe`)."""
        heads, error, rejected, filled = self._write_work(work)
        self.call_soon(lambda: self._on_committed(work, heads, error, rejected, filled))

    def _commit_inline(self) -> None:
        """When the database does not fsync: commit the staged work here, on the I/O thread,
        and answer it at once.

        The Tank gateway calls it at the end of a loop turn that read Tank requests.  Such a
        commit is a copy into the page cache (a fraction of a millisecond for a client's
        window), and handing it to the writer thread and the result back (two wake-ups, the
        GIL passed twice, a turn of the I/O loop) cost more than the copy while the I/O thread
        had time to spare: a Tank client's publish, 8 bundles in flight, went from 3.8-3.9M to
        4.6-4.8M records/s.  Where the I/O thread is the busy one (the Kafka gateway's produce:
        its requests cost more Python) the copy is better left to the writer, which makes it
        beside the I/O thread: Kafka produce lost a quarter inline.  The writer thread still
        takes what the I/O thread leaves (it may take the staged work first, and takes it
        while a result of its own is not yet answered) and runs retention; the pipe keeps one
        commit at a time, and the answers stay in commit order.

        The offers of the turn did not wake the writer (``_wake_deferred``): woken, it took
        each connection's produces as they were offered, a commit each, and one commit a turn
        held only when the I/O thread got there first (30 connections read in one turn made
        26 commits, all the writer's, in a full test run on a loaded machine).  It is woken
        here when what they staged is left to it."""
        try:
            self._commit_staged_inline()
        finally:
            if self._wake_owed:
                self._wake_owed = False
                with self._writer_cond:
                    if self._pipe.staged is not None:
                        self._writer_cond.notify()

    def _commit_staged_inline(self) -> None:
        if self._inlining or self.db.sync:
            return
        outstanding = self._outstanding
        with self._writer_cond:
            # Only when every earlier commit has been answered: a result of the writer's still
            # queued for this thread would be handled after this one, out of commit order (a
            # partition's head set back to the older commit's).
            if not outstanding or outstanding[0] is not self._pipe.peek():
                return
            work = self._pipe.take()
        if work is None:
            return
        self._inlining = True  # the answers' own flush leaves its work to the writer: no recursion
        try:
            heads, error, rejected, filled = self._write_work(work)
            self._on_committed(work, heads, error, rejected, filled)
        finally:
            self._inlining = False

    def _write_work(
        self, work: Work,
    ) -> tuple[dict[tuple[str, str], int], StorageError | None, dict[tuple[str, str], str], tuple[int, int]]:
        """Write ``work`` (see :meth:`_commit`) and tell the pipe it returned; the result for
        :meth:`_on_committed`."""
        # A partition the database refuses (its records cannot go in as they
        # are) is left out alone: the others commit and are acknowledged.
        rejected: dict[tuple[str, str], str] = {}
        filled = (0, 0)
        began = time.monotonic()
        try:
            t0 = time.perf_counter()
            if work.fills:
                # First, in a transaction of its own: a retry after a failure
                # writes what is still a hole, nothing twice.
                filled = self.db.fill_holes(work.fills)
            if work.pairs:
                heads = self.db.append_pairs(work.batch, work.pairs, work.segs, self._put_gate, skips=work.skips,
                                             rejected=rejected, blocks=work.blocks)
            else:
                heads = self.db.append(work.batch, skips=work.skips, rejected=rejected, blocks=work.blocks,
                                       gate=self._put_gate)
            self.commit_seconds.observe(time.perf_counter() - t0)
            error = None
        except StorageError as exc:
            heads, error = {}, exc
            rejected.clear()
        except Exception as exc:  # a bug: keep the batch, report loudly
            log.exception("store commit failed")
            heads, error = {}, StorageError(str(exc))
            rejected.clear()
        with self._writer_cond:
            self._pipe.finish(work, error is None and not rejected, time.monotonic(), began)
        return heads, error, rejected, filled

    def _enforce_retention(self) -> None:
        """Delete what the policy no longer keeps, in bounded steps.

        Each step is one LMDB transaction of at most 10k deletions; steps go
        on while more is due, for at most ``retention_budget`` seconds, so a
        backlog is worked off without holding up commits for long.
        """
        deadline = time.monotonic() + self.retention_budget
        deleted = freed = 0
        while True:
            damaged: list[tuple[str, str, int]] = []
            try:
                result = self.db.enforce_retention(int(time.time() * 1000), self.retention, damaged=damaged)
            except Exception as exc:  # a full disk, a bug: never the writer thread's end
                self._retention_limited.emit(logging.ERROR, "retention-failed", "retention failed (%s)", exc,
                                             exc_info=True)
                break
            for topic, partition, offset in damaged:
                self._retention_limited.emit(
                    logging.ERROR, "retention-damaged", "retention of %s/%s stops at offset %d: its stored block"
                    " cannot be read (kept; the other partitions go on)", topic, partition, offset)
            deleted += result.deleted
            freed += result.freed_bytes
            if not result.more or time.monotonic() >= deadline or self._pipe.staged is not None:
                break
        if deleted:
            log.info("retention removed %d records (%d bytes)", deleted, freed)
            if self.repair:
                self.call_soon(self._sync_holes)  # holes below the new firsts are gone

    @property
    def records_compacted(self) -> int:
        """Records compaction removed since the store started."""
        return int(self.compactor.dropped)

    def compaction_bounds(self, topic: str, partition: str, head: int) -> tuple[int, Any]:
        """The last offset a compaction round of the partition may take, and its aborted
        transactions' ranges (None: unknown, so compaction stops at its first transactional
        record).  A store knows no transaction; the Kafka gateway does."""
        return head, None

    def _compact(self) -> None:
        """Compaction steps (each one LMDB transaction of about a MiB of blocks) for at most
        ``compaction_budget`` seconds, stopping early when a commit is waiting."""
        if not self.compaction.topics:
            return
        deadline = time.monotonic() + self.compaction_budget
        before = self.compactor.dropped
        while True:
            try:
                more = self.compactor.step(int(time.time() * 1000))
            except Exception as exc:  # a full disk, a bug: never the writer thread's end
                # (A damaged block raises nothing: the round passes it, logged once, and goes on.)
                rnd = self.compactor.round
                self.compactor.limiter.emit(
                    logging.ERROR, "compaction-failed", "compaction of %s failed (%s); the partition waits for new"
                    " records before the next round", "?" if rnd is None else f"{rnd.topic}/{rnd.partition}", exc,
                    exc_info=True)
                self.compactor.give_up()
                break
            if not more or time.monotonic() >= deadline or self._to_write is not None:
                break
        if self.compactor.dropped > before:
            log.info("compaction removed %d records", self.compactor.dropped - before)

    # ---------------------------------------------------------------- I/O thread: writing

    @property
    def _writer_busy(self) -> bool:
        """Whether works handed to the writer are not yet answered."""
        return bool(self._outstanding)

    def _prepare_work(self) -> None:
        """Hook: called before the queued records are offered to the writer (a subclass puts
        a partition's records in the order the writer applies them)."""

    def _mark_work(self, work: Work) -> None:
        """Hook: the queued records went into ``work`` (new or merged; see :class:`CommitPipe`)."""

    def _flush_batch(self, retry: bool = False) -> None:
        """Offer what is queued to the writer: a new staged transaction, or more for the staged
        one while a commit runs (group commit: everything queued during a commit goes into the
        next transaction, within its bounds).

        After a failed commit only a ``retry`` writes again.
        """
        if (
            not (self._batch or self._pairs or self._fills or self._blocks)
            or (self.storage_error is not None and not retry)
        ):
            return
        self._prepare_work()
        fills: list[_Fill] = []
        if self._fills:
            fills = [(t, p, off, c, ts) for (t, p, off), (c, ts) in self._fills.items()]
        skips, later = self._skips_with_records()
        work = Work(self._batch, self._pairs, self._segs, skips, fills, self._blocks, self._blocks_held)
        with self._writer_cond:
            outcome = self._pipe.offer(work, time.monotonic())
            # (A writer lingering for more counts the offers; one held back ends its linger:
            # the staged work can take no more.)
            if self._wake_deferred:
                self._wake_owed = True
            else:
                self._writer_cond.notify()
        if outcome is Offer.HELD:
            return  # still queued here, for a later transaction
        self._batch, self._pairs, self._segs, self._skips, self._blocks = [], [], [], later, []
        self._blocks_held = self._blocks_bytes = 0
        if fills:
            self._fills = {}
        if outcome is Offer.STAGED:
            self._outstanding.append(work)
            self._mark_work(work)
        else:
            self._mark_work(self._outstanding[-1])

    def _skips_with_records(self) -> tuple[list[tuple[str, str, int, int]], list[tuple[str, str, int, int]]]:
        """The queued skips split: those a queued record of their partition follows (they go
        with it, in its transaction), and the rest, kept for the transaction of the records
        after them.  The database checks a gap against the skips of the same transaction and
        records nothing for a skip no record follows: a skip sent ahead alone (the last record
        of a read too large, the next ones in the next read) was lost, and the records after it
        were refused as a gap."""
        skips = self._skips
        if not skips:
            return skips, []
        # The highest queued offset of each partition with a skip (a skip held back for a
        # producer that sent nothing since stays: only those partitions' entries are looked at).
        ends = {(sk[0], sk[1]): -1 for sk in skips}
        for r in self._batch:
            key = (r[0], r[1])
            if key in ends and r[2] > ends[key]:
                ends[key] = r[2]
        for seg in self._segs:
            key = (seg[0], seg[1])
            if key in ends and seg[4] > ends[key]:
                ends[key] = seg[4]
        for b in self._blocks:
            key = (b[0], b[1])
            if key in ends:
                last = decode_header(b[2]).last_offset
                if last > ends[key]:
                    ends[key] = last
        now = [sk for sk in skips if ends[(sk[0], sk[1])] > sk[3]]
        if len(now) == len(skips):
            return skips, []
        return now, [sk for sk in skips if ends[(sk[0], sk[1])] <= sk[3]]

    def _restore(self, work: Work) -> None:
        """Queue ``work``'s records again, before those queued since (a failed commit's, or the
        staged work taken back behind it)."""
        self._batch = work.batch + self._batch
        self._pairs = work.pairs + self._pairs
        self._segs = work.segs + self._segs
        self._skips = work.skips + self._skips
        self._blocks = work.blocks + self._blocks
        self._blocks_held += work.held
        self._blocks_bytes += sum(_held_bytes(b[2]) for b in work.blocks)
        for topic, partition, off, content, ts in work.fills:
            self._fills.setdefault((topic, partition, off), (content, ts))

    def _on_committed(
        self,
        work: Work,
        heads: dict[tuple[str, str], int],
        error: StorageError | None,
        rejected: dict[tuple[str, str], str] | None = None,
        filled: tuple[int, int] = (0, 0),
    ) -> None:
        """Answer a commit's result (:meth:`_answer_commit`), and tell the writer it is
        answered even when answering raised: the pipe counts one answer a commit, and one
        never told would leave it a commit behind for good (every later linger to its bound)."""
        answers = self._answers
        try:
            self._answer_commit(work, heads, error, rejected, filled)
        finally:
            if self._answers == answers:
                self._report()

    def _answer_commit(
        self,
        work: Work,
        heads: dict[tuple[str, str], int],
        error: StorageError | None,
        rejected: dict[tuple[str, str], str] | None,
        filled: tuple[int, int],
    ) -> None:
        if self._outstanding and self._outstanding[0] is work:
            self._outstanding.popleft()
        else:  # (the simulator and tests may commit a work taken by hand)
            try:
                self._outstanding.remove(work)
            except ValueError:
                pass
        self._reported = work
        if error is not None or rejected:
            # The writer halted after this commit: the staged work (queued after it) comes
            # back here, behind what failed, so that nothing goes out of order.
            with self._writer_cond:
                staged = self._pipe.reclaim()
                self._pipe.resume()
            if staged is not None:
                if self._outstanding and self._outstanding[-1] is staged:
                    self._outstanding.pop()
                self._restore(staged)
        batch, pairs = work.batch, work.pairs
        held = work.held
        if error is not None:
            now = time.monotonic()
            if self.storage_error is None or now - self._error_logged_at >= ERROR_LOG_INTERVAL:
                self._error_logged_at = now
                log.error(
                    "store cannot write (%s): %d records kept, acknowledgements stop, retrying",
                    error,
                    len(batch) + len(pairs) + held + self.pending_records(),
                )
            self.storage_error = error
            # Keep everything, retry later (the failed batch goes first).
            self._restore(work)
            # Reading goes on, new records and HEADs left out (see _SHED): the
            # records this store holds may be held by no one else, and FETCHes
            # of them come on the same socket as records.  Pausing it (as this
            # did) left them unserved while the disk stayed full, so other
            # stores recorded holes over acknowledged records and readers
            # skipped them (chaos soak, seed 1795922590: 23,772 lost).
            self.pause_data(False)
            self._send_status(now)  # producers learn why at once
            self._report()
            return
        fills, skips = work.fills, work.skips
        if self.storage_error is not None:
            log.info("store writes again; acknowledgements resume")
            self.storage_error = None
        refused = self._on_refused(work, rejected) if rejected else 0
        self.stored += len(batch) + len(pairs) + held - refused + filled[0]
        if fills or skips:
            self._on_holes_changed(filled)
        # Partitions of leaves connected here get their ACK on the leaf port: none
        # on the mesh (nobody there reads it), nor a STORE-STATUS.  Those this node
        # produces itself (a gateway's own) get no ACK either: only their producer
        # subscribes to it, and that is us.
        leaf_served = self.leaves.sessions() if self.leaves is not None else ()
        own = self._self_produced
        self._status_keys.update(k for k in heads if k not in leaf_served)
        if self._refused:
            for key in heads:
                self._refused.pop(key, None)  # taken again
        for key, head in heads.items():
            if key not in self._heads:
                self._topics_of.setdefault(key[1], set()).add(key[0])
            self._heads[key] = head
            if self.ready_pairs and key not in self._pids:
                self._learn_pid(key)
            # One cumulative ACK per partition per commit, after the commit.
            if key not in leaf_served and key not in own:
                self._unsent_acks[key] = head
        if fills:
            # Records written into holes may let an ACK capped below them move on
            # (see dafka.store.holes): the producer hears at once, not at its next HEAD.
            for key in {(f[0], f[1]) for f in fills}:
                head = self._heads.get(key)
                if head is not None and key not in heads and key not in leaf_served and key not in own:
                    self._unsent_acks[key] = max(head, self._unsent_acks.get(key, -1))
        self._send_acks()
        if self.leaves is not None:
            # After the heads above: an ACK read at once finds them.  Partitions whose
            # holes this commit filled too: their ACKs, capped below a hole, may move on.
            leaf_heads = heads
            if fills:
                leaf_heads = dict(heads)
                for f in fills:
                    key = (f[0], f[1])
                    if key not in leaf_heads and key in leaf_served and key in self._heads:
                        leaf_heads[key] = self._heads[key]
            self.leaves.on_commit(leaf_heads)
        self.commit_sizes.observe(len(batch) + len(pairs) + held)
        received: Any = batch[0][4] if batch and len(batch[0]) == 5 else None  # mesh records: ms stamp
        if received is None and pairs:
            value = pairs[0]
            if isinstance(value, tuple):  # a (key, value) pair queued by the Kafka gateway
                value = value[1]
            received = int.from_bytes(value[:8], "big")
        if received is None and work.blocks and self.ready_pairs:
            # The mesh's records in the blocks the drain built: their first_ts is the receive stamp
            # (a gateway's client blocks carry the clients' timestamps instead).
            block = work.blocks[0][2]
            if block[3] == CODEC_STORE:
                received = int.from_bytes(block[32:40], "big")
        if isinstance(received, int):
            # From the oldest record's receipt to its ACK.
            self.ack_latency.observe(max(0.0, time.time() - received / 1000))
        try:
            self.on_commit(heads)
        finally:
            # Even when answering failed (a bug, logged by the caller): a writer lingering for
            # this report, input paused for the batch, records queued meanwhile would
            # otherwise wait for an event that may not come (at shutdown, none does).
            self._report()
            if self.batch_low():
                self.pause_data(False)
            self._flush_batch()

    def _report(self) -> None:
        """Tell the writer this commit is answered (see CommitPipe.due: it may be lingering
        for the refills its answers bring).  Woken only when it has work it could take: after
        an inline commit it has none, and a wake for nothing cost a thread switch and the GIL
        handed over and back each commit (offers wake it when work comes)."""
        self._answers += 1
        with self._writer_cond:
            self._pipe.report(time.monotonic())
            if self._pipe.peek() is not None:
                self._writer_cond.notify()

    def _on_refused(self, work: Work, rejected: dict[tuple[str, str], str]) -> int:
        """Partitions the database refused in a commit: drop, count and log their
        records, and read them afresh from the committed head (a new tracker
        FETCHes what is missing).  Returns how many records were refused."""
        batch, segs, blocks = work.batch, work.segs, work.blocks
        now = time.monotonic()
        counts = dict.fromkeys(rejected, 0)
        for topic, partition, block in blocks:
            if (topic, partition) in counts:
                counts[(topic, partition)] += decode_header(block).record_count
        for rec in batch:
            key = (rec[0], rec[1])
            if key in counts:
                counts[key] += 1
        for seg in segs:
            key = (seg[0], seg[1])
            if key in counts:
                counts[key] += seg[4] - seg[3] + 1
        self.on_refused(rejected)
        for key, why in rejected.items():
            self._refused[key] = (why, now)
            self._status_keys.add(key)
            self._forget(key)
        n = sum(counts.values())
        self.records_refused += n
        self._refused_unlogged += n
        if now - self._refused_logged_at >= REFUSED_LOG_INTERVAL:
            self._refused_logged_at = now
            (topic, partition), why = next(iter(rejected.items()))
            log.error(
                "store refused %d record(s) of %d partition(s), e.g. %s/%s: %s"
                " (other partitions are unaffected; the refused ones are read again from their head)",
                self._refused_unlogged,
                len(rejected),
                topic,
                partition,
                why,
            )
            self._refused_unlogged = 0
        self._send_status(now)  # their producers learn why at once
        return n

    def _forget(self, key: tuple[str, str]) -> None:
        """Drop a partition's reading state: its next record starts a new tracker."""
        self._ack_repeats.forget(key[1])
        tracker = self._trackers.pop(key, None)
        if tracker is None:
            return
        for prefix in [p for p, t in self._by_prefix.items() if t is tracker]:
            del self._by_prefix[prefix]
        self._missing.pop(tracker, None)
        # Records of it queued since the refused batch continue what was refused.
        self._batch = [r for r in self._batch if (r[0], r[1]) != key]
        if any((s[0], s[1]) == key for s in self._segs):
            kept, segs, i = [], [], 0
            for seg in self._segs:
                n = seg[4] - seg[3] + 1
                if (seg[0], seg[1]) != key:
                    kept.extend(self._pairs[i : i + n])
                    segs.append(seg)
                i += n
            self._pairs, self._segs = kept, segs
        self._skips = [s for s in self._skips if (s[0], s[1]) != key]
        if self._blocks:
            self._blocks = [b for b in self._blocks if (b[0], b[1]) != key]
            self._recount_blocks()

    def _learn_pid(self, key: tuple[str, str]) -> None:
        """A partition was stored for the first time: its records can now go as ready blocks."""
        info = self.db.info(*key)
        if info is None:
            return
        self._pids[key] = info.pid
        tracker = self._trackers.get(key)
        if tracker is not None:
            tracker.pid = info.pid

    def _send_status(self, now: float) -> None:
        """Tell producers whether their records get acknowledged (STORE-STATUS)."""
        keys = self._status_keys
        self._status_keys = set()
        error = self.storage_error
        if error is not None:
            keys |= {(r[0], r[1]) for r in self._batch}  # the partitions waiting for an ACK
            keys |= {(r[0], r[1]) for r in self._segs}
            keys |= {(b[0], b[1]) for b in self._blocks}
            writing, reason = 0, wire.reason_text(f"store {self.address[:8]} cannot write: {error}")
        else:
            writing, reason = 1, ""
        refused = self._refused
        if refused:
            for key, (_why, when) in list(refused.items()):
                if now - when > REFUSED_STATUS_FOR:
                    del refused[key]
                else:
                    keys.add(key)
        told = self._writing_told
        if len(told) > 2 * len(keys) + 1024:  # bounded: forget what is old enough to be told again
            self._writing_told = told = {k: t for k, t in told.items() if now - t < WRITING_STATUS_EVERY}
        for key in keys:
            topic, partition = key
            got = refused.get(key) if refused else None
            if got is not None and writing:
                why = wire.reason_text(f"store {self.address[:8]} refused records of this partition: {got[0]}")
                self.send(wire.StoreStatus(partition, self.address, topic, 0, why))
                told.pop(key, None)
            elif writing:
                if not writing_status_due(partition, told.get(key), now):
                    continue  # told lately, and its ACKs say the same
                told[key] = now
                self.send(wire.StoreStatus(partition, self.address, topic, writing, reason))
            else:
                self.send(wire.StoreStatus(partition, self.address, topic, writing, reason))
                told.pop(key, None)

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        """Hook: a batch is durable; ``heads`` are the new heads it made."""

    def on_refused(self, rejected: dict[tuple[str, str], str]) -> None:
        """Hook: the database refused these partitions' records in the last commit
        (called before :meth:`on_commit` of that commit; nothing of them was written)."""

    def on_producer_head(self, tracker: PartitionTracker, sequence: int) -> None:
        # An ACK goes out once per commit, and is lost if the producer was not
        # yet connected to us (a new producer publishes as soon as it knows
        # any peer): its flush would wait forever.  Every HEAD (each second
        # while it has records) gets the committed head again; ACKs are
        # cumulative, so a repeat costs nothing.  Never beyond what it published.
        key = (tracker.subject, tracker.address)
        head = self._heads.get(key, -1)
        repair = self.repair
        if repair and self.producer_hears(tracker.address):
            # It hears our FETCHes: ask it at once for the holes that cap its ACKs
            # (see dafka.store.holes: it may hold what they lack).
            for topic, partition, offset, count in repair.owner_heard(key, time.monotonic()):
                self.send(wire.Fetch(partition, self.address, topic, offset, count))
                self.hole_fetches += 1
        if head >= 0 and self.storage_error is None:
            # A pending ACK may be higher (records a peer store sent us): keep it.
            ack = max(self._unsent_acks.get(key, -1), min(head, sequence))
            if repair:
                ack = repair.cap(key, ack)  # never past a hole it may still hold
                if ack < 0:
                    return
            if not self._ack_repeats.due(tracker.address, ack, time.monotonic()):
                return  # it has this ACK already, most likely (see dafka.store.acks)
            self._unsent_acks[key] = ack
            self._send_acks()

    def _send_acks(self) -> None:
        # An ACK a partition a commit: its frame is the partition's cached prefix and the
        # head (the generic encoder and pyzmq's send took 20-30 us of every commit).
        publisher, frame = self.publisher, self._ack_prefixes.frame
        sent = []
        repeats, now = self._ack_repeats, time.monotonic()
        repair = self.repair
        for (topic, partition), head in self._unsent_acks.items():
            if repair:
                # Never past a recorded hole its producer may still hold (see
                # dafka.store.holes; no holes, no lookup).
                head = repair.cap((topic, partition), head)
                if head < 0:
                    sent.append((topic, partition))
                    continue
            if not fastio.send_frames(publisher, [frame((topic, partition), head)]):
                break  # a full reader: the rest go out on the next tick
            sent.append((topic, partition))
            repeats.sent(partition, head, now)
            self.acks_sent += 1
        for key in sent:
            del self._unsent_acks[key]

    # ---------------------------------------------------------------- I/O thread: input

    def _watch_data(self) -> None:
        super()._watch_data()
        leaves = getattr(self, "leaves", None)
        if leaves is not None:
            leaves.rest(bool(self._linger_until))  # the leaf port rests with the data socket

    def sockets(self) -> list[tuple[zmq.Socket, Any]]:
        leaves = self.leaves.sockets() if self.leaves is not None else []
        return [(self.publisher, self._read_subscriptions), *leaves]

    def wants(self, subject: str) -> bool:
        """Whether this store keeps ``subject`` (``topics``)."""
        return self.topics is None or subject in self.topics

    def new_tracker(self, subject: str, partition: str) -> PartitionTracker:
        head = self._heads.get((subject, partition))
        tracker = PartitionTracker(
            subject,
            partition,
            0 if head is None else head + 1,
            retry_interval=self.retry_interval,
            # A new partition may begin after what other stores retained; a
            # stored one may get a hole (recorded as a skip, see on_skipped).
            skip_after=self.skip_after,
        )
        if self.ready_pairs:
            tracker.pid = self._pids.get((subject, partition))
        return tracker

    def emit(self, tracker: PartitionTracker, records: list[tuple[int, bytes]]) -> None:
        subject, partition, ts = tracker.subject, tracker.address, self._ts
        pid = tracker.pid
        if pid is None or not records:
            append = self._batch.append
            for seq, content in records:
                append((subject, partition, seq, content, ts))
            return
        # The slow path of drain_blocks: the same values and blocks, built here.
        hdr = VALUE_HEADER.pack(ts, 0)
        values = [hdr + content for _seq, content in records]
        n = len(values)
        self.queue_blocks([(subject, partition, block) for _key, block in fastio.store_blocks(
            values, 0, n, pid, records[0][0], BLOCK_BYTES, -1)], n)

    def read_data(self, sock: zmq.Socket, prefixes: dict[bytes, Any] | None) -> None:
        # The hot path: the next records of known partitions join the batch
        # inside drain_records (frame-exact); the rest go through track /
        # on_message in arrival order.
        if self.storage_error is not None:
            # Cannot write: no fast path, so every message goes through
            # on_message, which leaves out records and HEADs (see _SHED).
            prefixes = _NO_PREFIXES
        ts = self._ts = int(time.time() * 1000)
        blocks_before = len(self._blocks)
        if self.ready_pairs:
            held, bytes_before = self._blocks_held, self._blocks_bytes
            try:
                with self._put_gate:
                    read = fastio.drain_blocks(
                        sock, DRAIN, prefixes, self._blocks, ts, self.track, self.on_message,
                        self.max_record_bytes, self.too_large, BLOCK_BYTES,
                    )
            except BaseException:
                # A handler failed part-way: what the drain queued before stays queued (as its
                # blocks), and counted (the slow path counted its own blocks: all recounted).
                self._blocks_held = held + sum(
                    int.from_bytes(b[2][24:28], "big") for b in self._blocks[blocks_before:]
                )
                raise
            finally:  # (the slow path counted its own bytes too: all recounted)
                self._blocks_bytes = bytes_before + sum(_held_bytes(b[2]) for b in self._blocks[blocks_before:])
            self._blocks_held += read  # (the slow path counted its own)
        else:
            read = fastio.drain_records(
                sock, DRAIN, prefixes, self._batch, None, ts, self.track, self.on_message,
                self.max_record_bytes, self.too_large,
            )
        self.data_reads += 1
        # A trickle: few records read and nothing left waiting (``read`` counts
        # only the fast path's records, so a full read of others is no trickle).
        if self.linger and read < LINGER_BELOW and not self.data_waiting():
            pids = self._pids
            new = [pids.get((b[0], b[1])) for b in self._blocks[blocks_before:]]
            self.linger_data(self._trickle.rest(self.linger, [p for p in new if p is not None], time.monotonic()))
        if self._missing:
            self.fetch_missing()
        if self.batch_full() and self.storage_error is None:
            self.pause_data(True)
        self._flush_batch()
        if self._heads_wanted:
            self._answer_heads(time.monotonic())

    def on_message(self, frames: list[bytes]) -> None:
        if self.storage_error is not None and frames and frames[0][:1] in _SHED:
            return  # a store that cannot write takes no records (see _SHED)
        super().on_message(frames)

    def on_other(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.Fetch):
            self._on_fetch(msg)
        elif isinstance(msg, wire.GetHeads):
            self._heads_wanted.append((msg.address, (msg.topic,), time.monotonic()))
        elif isinstance(msg, wire.ConsumerHello):
            if msg.topic == self.address:
                self._heads_wanted.append((msg.address, tuple(msg.subjects), time.monotonic()))
        # Group positions touch the database: not from inside a drain, which holds
        # the put gate the writer (holding the write lock) may be waiting for.
        # Both go through the command queue, so they keep their order.
        elif isinstance(msg, wire.Commit):
            self.call_soon(partial(self._on_group_commit, msg))
        elif isinstance(msg, wire.GetPositions):
            self.call_soon(partial(self._send_positions, msg))

    def _answer_heads(self, now: float) -> None:
        """Answer the waiting GET-HEADS once the input queued before them is read.

        ZeroMQ reads its peers' queues in turn, so a GET-HEADS from a producer
        restarted after a crash can overtake records of its dead incarnation
        still queued here; answered at once, the producer would reuse their
        offsets and its new records would be dropped as duplicates of them.
        So answers wait until the data socket is drained (at most a second
        under a steady stream), and never while reading is paused.
        """
        if self.data_paused or self.storage_error is not None:
            return  # (while it cannot write, records are left out unread: see _SHED)
        if self.data_waiting() and now - self._heads_wanted[0][2] < 1.0:
            return
        wanted, self._heads_wanted = self._heads_wanted, []
        for requester, subjects, _ in wanted:
            self._send_heads(requester, subjects)

    def _on_group_commit(self, msg: wire.Commit) -> None:
        """Record a group's positions durably, then confirm to the member."""
        positions: dict[tuple[str, str], int] = {}
        for topic, partition, offset in msg.positions:
            positions[(topic, partition)] = offset
        try:
            self.db.put_positions(msg.topic, positions)
        except (StorageError, ValueError) as exc:
            self.bad_input("commit", exc)  # not confirmed: the member retries or another store confirms
            return
        self._send_checked(wire.Committed(msg.address, self.address, msg.commit_id))

    def _send_positions(self, msg: wire.GetPositions) -> None:
        try:
            held = self.db.positions(msg.topic)
        except (StorageError, ValueError) as exc:
            self.bad_input("get-positions", exc)
            return
        entries = tuple((t, p, o) for (t, p), o in sorted(held.items()))
        self._send_checked(wire.Positions(msg.address, self.address, msg.topic, msg.request_id, entries))

    def _send_checked(self, msg: wire.Message) -> None:
        """Send an answer whose fields came from the network (they may not encode)."""
        try:
            self.send(msg)
        except ProtocolError as exc:
            self.bad_input(type(msg).__name__, exc)

    def _send_heads(self, requester: str, subjects: tuple[str, ...] | list[str]) -> None:
        wanted = set(subjects)
        heads = {key: head for key, head in self._heads.items() if key[0] in wanted}
        # Every offset received counts, committed or not (a slow or failing
        # disk), in order or held beyond a hole: a producer resuming after a
        # crash must continue after all of them, or its new records would be
        # taken for duplicates of them.
        for key, tracker in list(self._trackers.items()):
            if key[0] in wanted and tracker.known > heads.get(key, -1):
                heads[key] = tracker.known
        for (topic, partition), head in heads.items():  # exact subject match, not a prefix
            self.send(wire.DirectHead(requester, partition, topic, head))

    def _holds_none(self, key: tuple[str, str], first: int, last: int) -> bool:
        """Whether nothing of offsets ``first..last`` of partition ``key`` is here:
        not committed, not being written, not held beyond a hole."""
        head = self._heads.get(key, -1)
        tracker = self._trackers.get(key)
        if tracker is not None and tracker.next is not None:
            pending = tracker.next - 1  # emitted up to here; committed up to head
            if pending > head and first <= pending and last > head:
                return False  # being written
            held = tracker.held
            if held and (
                any(first <= k <= last for k in held)
                if len(held) <= last - first
                else any(k in held for k in range(first, last + 1))
            ):
                return False
        if head < first:
            return True
        try:
            return not self.db.holds_any(key[0], key[1], first, last)  # (headers only: no record decoded)
        except (StorageError, ValueError, struct.error):  # (ValueError: a damaged block's header)
            # Raised, it dropped the rest of the messages read with the FETCH (records, FETCHes).
            return False

    def _on_fetch(self, fetch: wire.Fetch) -> None:
        self.fetches_received += 1
        key = (fetch.subject, fetch.topic)
        if fetch.count == 0 or fetch.address == self.address:
            return
        last = min(fetch.sequence + fetch.count - 1, wire.MAX_U64)
        leaves = self.leaves
        if leaves is not None and leaves.core.restart_holes:
            hole = leaves.core.restart_holes.get(key)
            if hole is not None and hole[0] <= fetch.sequence <= hole[1]:
                # A leaf of ours restarted past these offsets (its VOID kind 1, see
                # dafka.core.leaf): said for it, as its producer would on the mesh,
                # before our own word (a reader counts stores' words after it).
                self._send_checked(wire.Void(fetch.address, fetch.topic, fetch.subject, hole[0], hole[1],
                                             fetch.topic, wire.VOID_RESTART))
        if self._holds_none(key, fetch.sequence, last):
            # Say so (dafka readers pass a restarted producer's hole once every
            # store they know did; C readers never subscribe to VOID).
            self._send_checked(
                wire.Void(fetch.address, fetch.topic, fetch.subject, fetch.sequence, last, self.address, wire.VOID_STORE)
            )
        if key not in self._heads:
            return  # not a partition we have
        job_key = (fetch.address, fetch.subject, fetch.topic)
        job = self._job_of.get(job_key)
        start, end = fetch.sequence, fetch.sequence + fetch.count
        if job is not None and start <= job.offset + job.remaining and end >= job.offset:
            # A retry, or the next pipelined range, of an answer in progress:
            # one job covers both, so retries never multiply the records sent.
            # Starting earlier than where the job is means the requester lost
            # what was sent since: resend from there.  (A range ending below
            # the job, such as a recorded hole asked for, gets a job of its own.)
            stop = max(job.offset + job.remaining, end)
            if start < job.offset:
                job.offset = job.asked = start
            job.remaining = stop - job.offset
            return
        # Bounded: distinct ranges each get a job, so a broken or hostile peer
        # could otherwise queue one per FETCH it sends.  A refused FETCH is asked
        # again by a reader that needs it.
        n = self._job_counts.get(job_key, 0)
        if n >= MAX_JOBS_PER_REQUESTER or len(self._jobs) >= MAX_FETCH_JOBS:
            self.fetches_refused += 1
            return
        self._job_counts[job_key] = n + 1
        prefix = wire.record_prefix(wire.DIRECT_RECORD, fetch.address, fetch.topic, fetch.subject)
        self._read_subscriptions()  # the requester's may not be read yet: the answer's form depends on them
        single = prefix
        # Batches only once the requester's own subscriptions say it takes them.
        batched = self.batches_for(prefix, answer=True)
        if batched:
            prefix = wire.batch_prefix(prefix)
        new = FetchJob(
            job_key, prefix, batched, single, fetch.subject, fetch.topic, fetch.sequence, fetch.count, fetch.sequence
        )
        if job is None:
            self._job_of[job_key] = new
        self._jobs.append(new)  # (a range beyond the current job's gets a job of its own)

    def has_work(self) -> bool:
        return bool(self._jobs) and not self._blocked

    def do_work(self) -> None:
        self._serve()

    def _serve(self) -> None:
        """Send one slice of each pending FETCH answer."""
        jobs = self._jobs
        for _ in range(len(jobs)):
            job = jobs.popleft()
            try:
                start, values = self.db.fetch_raw(
                    job.topic, job.partition, job.offset, min(job.remaining, SERVE_SLICE)
                )
            except StorageError as exc:
                log.error("cannot serve FETCH of %s/%s: %s", job.topic, job.partition, exc)
                self._job_done(job)
                continue
            except Exception as exc:  # a damaged stored block (checked when written, not when read)
                # (An answer goes past the block only for an error of decoding: ProtocolError is
                # a ValueError; an LMDB error may pass, and the block may be sound.)
                self._unreadable(job, exc, past=isinstance(exc, (ValueError, struct.error, IndexError)))
                continue
            if not values:
                self._job_done(job)
                continue
            if self.filters_answers:
                try:
                    filtered = self._serve_filtered(job, start, values)
                except ValueError as exc:  # (as below)
                    self._unreadable(job, exc)
                    continue
                if filtered:
                    if self._blocked:
                        return
                    continue
            gap = start > job.offset and self._compacted_gap(job, start)
            if gap:
                pass  # said with a VOID kind 2 (_compacted_gap): no warning, the answer goes on past it
            elif start > job.offset == job.asked:
                # Rate-limited: a reader may ask for removed offsets again and again.
                self._read_limited.warning(
                    "below-start", "FETCH %s/%s from %d: offsets below %d were removed by retention or skipped"
                    " (a hole)", job.topic, job.partition, job.offset, start)
            if not job.batched and self.batches_for(job.single, answer=True):
                # Its subscriptions were read since: it takes batches (one cached lookup a slice).
                job.prefix, job.batched = wire.batch_prefix(job.single), True
            try:
                if job.batched:
                    sent = fastio.send_batches(self.publisher, job.prefix, start, values, noblock=True, stored=True)
                else:
                    sent = fastio.send_values(self.publisher, job.prefix, start, values, True)
            except ValueError as exc:  # a stored value shorter than its header: a damaged block
                self._unreadable(job, exc)
                continue
            if sent < len(values):
                # A reader is full: resume from here on the next tick.
                self._blocked = True
            self.records_served += sent
            job.offset, job.remaining = start + sent, job.remaining - sent
            if job.remaining > 0 and (sent == SERVE_SLICE or self._blocked or (sent and self._compacted(job))):
                # (a compacted partition's answer goes on past its gaps, a slice a turn)
                jobs.append(job)
            else:
                self._job_done(job)
            if self._blocked:
                return

    def _unreadable(self, job: FetchJob, exc: Exception, past: bool = False) -> None:
        """``job`` reached a stored block that cannot be read (bit rot, a bug of an older
        version: blocks are checked when written), logged (rate-limited: a reader asks again).
        ``past``: the block is the first one read from ``job.offset`` (a read stops before a
        damaged block after others, :func:`dafka.fastio.fetch_blocks`): the requester is told
        that this store has none of its offsets (a VOID kind 0, as for offsets it lacks: a
        Dafka reader gets them from another store, or passes them after ``skip_after``; a
        store's hole repair counts it) and the answer goes on past it.  When the block's
        header cannot be read either, where the block ends is not known: the VOID covers
        from ``job.offset`` up to just before the next block's key (none of those offsets
        is readable here: a hole, the block, a hole), and the answer goes on there
        (:meth:`RecordDB.past_block`); when the block is the partition's last, up to the
        head it has stored, and the answer ends there (never past it: this store may yet
        receive those offsets).  Before, the answer ended at such a block with no VOID and
        a reader never got past it.  Otherwise (an error that says nothing of the block:
        LMDB's) the answer ends.  (Raised into the loop, the job stayed in ``_job_of``
        while served no more: every later FETCH of that requester and partition joined it
        and none was answered again.)"""
        self._read_limited.emit(logging.ERROR, "unreadable", "cannot serve FETCH of %s/%s from %d: a stored block"
                                " cannot be read (%s: %s)", job.topic, job.partition, job.offset,
                                type(exc).__name__, exc)
        self.unreadable_reads += 1
        if not past:
            self._job_done(job)
            return
        lo = job.offset
        try:
            # (The block found now, checked unreadable in the same transaction: retention may
            # have replaced the one the read failed at, and a VOID of held records passes them.)
            hdr = self.db.unreadable_block(job.topic, job.partition, lo)
            if hdr is None or hdr.last_offset < lo:
                self._job_done(job)
                return
            lo, upto = max(lo, hdr.first_offset), hdr.last_offset
        except (ValueError, struct.error, IndexError):  # its header too: pass it by its key
            try:
                after = self.db.past_block(job.topic, job.partition, lo)
            except Exception:  # (StorageError, LMDB's: the answer ends)
                after = None
            if after is None or after <= lo:
                self._job_done(job)
                return
            upto = after - 1
        except Exception:  # (StorageError, LMDB's: the answer ends)
            self._job_done(job)
            return
        self._send_checked(wire.Void(job.key[0], job.partition, job.topic, lo, upto, self.address, wire.VOID_STORE))
        stop = job.offset + job.remaining
        job.offset, job.remaining = upto + 1, stop - upto - 1
        if job.remaining > 0:
            self._jobs.append(job)  # (served from there on the next turn)
        else:
            self._job_done(job)

    #: FETCH answers that ended at a stored block that cannot be read (:meth:`_unreadable`).
    unreadable_reads = 0

    #: Whether :meth:`_serve_filtered` may answer some FETCHes itself (a Kafka gateway's
    #: partitions written by transactions); one attribute check a slice otherwise.
    filters_answers = False

    def _serve_filtered(self, job: FetchJob, start: int, values: list[bytes]) -> bool:
        """Serve this slice of ``job`` (requeue it or finish it) if it needs filtering:
        True when done so.  A plain store never does."""
        return False

    def _compacted(self, job: FetchJob) -> bool:
        return self.compaction.compacts(job.topic)

    def _compacted_gap(self, job: FetchJob, start: int) -> bool:
        """Whether ``job.offset .. start - 1``, where a FETCH answer found no record, was
        compacted away here (the topic is compacted, the offsets are past the partition's
        first and in no recorded hole); if so, the requester is told so (VOID kind 2), and
        a Dafka consumer passes them at once rather than after ``skip_after``."""
        if not self._compacted(job):
            return False
        lo = job.offset
        try:
            if not self.db.compacted_gap(job.topic, job.partition, lo, start - 1):
                return False  # below first (retention), or a recorded hole
        except StorageError:
            return False
        self._send_checked(wire.Void(job.key[0], job.partition, job.topic, lo, start - 1, self.address,
                                     wire.VOID_COMPACTED))
        self.compacted_voids += 1
        return True

    def _job_done(self, job: FetchJob) -> None:
        if self._job_of.get(job.key) is job:
            del self._job_of[job.key]
        n = self._job_counts.get(job.key, 1) - 1
        if n > 0:
            self._job_counts[job.key] = n
        else:
            self._job_counts.pop(job.key, None)

    def _read_subscriptions(self) -> None:
        for subscribe, prefix in read_subscriptions(self.publisher):
            self.on_subscription(subscribe, prefix)
            if prefix[:1] == wire.P_FETCH and 1 < len(prefix) <= MAX_ADDRESS + 1:
                # (bounded: a node address is 32 characters, a subscription any size)
                self._count_hearer(subscribe, prefix[1:].decode(errors="replace"))
            if not subscribe:
                continue
            if prefix[:1] == wire.P_CONSUMER_HELLO and 1 < len(prefix) <= MAX_ADDRESS + 1:
                # Another store (it wants CONSUMER-HELLOs addressed to it) hears us.
                store = prefix[1:].decode(errors="replace")
                if store != self.address:
                    self._stores.met(store)
            elif prefix[:1] == wire.P_STORE_HELLO and len(prefix) > 1:
                try:
                    consumer = prefix[1:].decode()
                except UnicodeDecodeError:
                    self.bad_input("subscription", "consumer address is not UTF-8")
                    continue
                # A consumer subscribed to us: greet it (it answers CONSUMER-HELLO).
                self.send(wire.StoreHello(consumer, self.address))
            elif prefix[:1] == wire.P_FETCH:
                self.retry_missing_now()
            elif prefix[:1] == wire.P_ACK and len(prefix) > 1:
                # A producer (re)connected: an ACK sent before may have missed it.
                self._ack_repeats.forget(prefix[1:].decode(errors="replace"))
            elif prefix == wire.P_HEAD:
                # Another store (it takes every HEAD) connected: tell it what we
                # hold, so it can fetch partitions whose producers are gone.
                self._announce_heads(0.0)

    def _count_hearer(self, subscribe: bool, producer: str) -> None:
        hearers = self._fetch_hearers
        n = hearers.get(producer, 0) + (1 if subscribe else -1)
        if subscribe and n == 1 and self._missing and producer in self.peers:
            # It hears us from now on: its holes' time to be given up starts now.
            # (Only a live producer's, whose holes waited for it: anyone may
            # subscribe F<address>, and again and again.)
            now = time.monotonic()
            for tracker in self._missing:
                if tracker.address == producer and unheard_may_wait(tracker, now):
                    tracker.unheard(now)
        if n > 0:
            if producer in hearers or len(hearers) < MAX_HEARERS:
                hearers[producer] = n
        else:
            hearers.pop(producer, None)

    def owner_hears(self, partition: str) -> bool:
        # A live producer not (yet) subscribed to its FETCHes here cannot answer
        # them: its holes are not given up meanwhile (it may hold what they lack,
        # and an ACK past a hole given up would release it).  A producer that is
        # gone (no beacon: expired) or was never met leaves that to skip_after.
        return partition in self._fetch_hearers or partition not in self.peers

    def producer_hears(self, partition: str) -> bool:
        """Whether the partition's producer hears our FETCHes now: a live peer
        (its beacons come) subscribed to them here.  Any HEAD of the partition
        then counts toward releasing its holes (see dafka.store.holes), a
        store's too; a producer cut off is not a live peer once its beacons
        stopped, though its subscription may last until its connection drops."""
        return partition in self._fetch_hearers and partition in self.peers

    def known_stores(self) -> Collection[str]:
        return self._stores.current(time.monotonic())

    def on_peer_gone(self, address: str) -> None:
        self._stores.gone(address, time.monotonic())
        # Its last records may have reached only us (a producer closed without
        # lingering, its last HEAD unsent): say where its partitions end now,
        # so other stores and readers fetch the tail within a beacon timeout,
        # not at the next re-announce (HEADS_INTERVAL).  One HEAD a partition
        # held here: a peer that goes silent can make us send no more.
        for topic in self._topics_of.get(address, ()):
            head = self._heads.get((topic, address))
            if head is not None:
                self.send(wire.Head(topic, address, topic, head))

    def _announce_heads(self, now: float) -> None:
        for (topic, partition), head in list(self._heads.items()):
            self.send(wire.Head(topic, partition, topic, head))

    def _announce_some(self, now: float) -> None:
        """This second's slice of the periodic re-announce (see dafka.store.announce)."""
        heads = self._heads
        for key in self._rota.due(now):
            head = heads.get(key)
            if head is not None:
                self.send(wire.Head(key[0], key[1], key[0], head))

    def on_tick(self, now: float) -> None:
        self._blocked = False  # readers had a tick to drain their queues
        if self._heads_wanted:
            self._answer_heads(now)
        if self._unsent_acks:
            self._send_acks()
        if self.storage_error is None and self.batch_low():
            self.pause_data(False)
        if self.storage_error is not None and now - self._retry_at >= 2.0:
            # Retry the failed batch now and then (a full disk may get space).
            self._retry_at = now
            self._flush_batch(retry=True)
        self._ts = int(time.time() * 1000)
        self.check_missing(now)
        if self.repair:
            self._ask_holes(now)
        self._flush_batch()

    def on_skipped(self, tracker: PartitionTracker, first: int, last: int) -> None:
        log.warning(
            "store: offsets %d..%d of %s/%s are nowhere to be had; starting at %d"
            " (recorded as a hole: readers asking for them get what follows)",
            first,
            last,
            tracker.subject,
            tracker.address,
            last + 1,
        )
        # The records after the hole (emitted next) commit with this skip.
        self.skipped += last - first + 1
        self._skips.append((tracker.subject, tracker.address, first, last))

    # ---------------------------------------------------------------- I/O thread: holes

    def _sync_holes(self) -> None:
        """Track the holes the database holds now (after a commit or retention changed them)."""
        try:
            holes = self.db.holes(limit=self.repair.max_holes)
        except StorageError as exc:
            log.error("cannot read the recorded holes: %s", exc)
            return
        self.repair.sync(holes, time.monotonic())
        pending = self._too_large_holes
        if pending:
            # A hole this store made by dropping a record over its limit is given
            # up for good at once: every copy has that size, asking for it is futile
            # (also while the give-up commits: the repair asks for it no more).
            gone = [key for key in pending if self.repair.covers(key[:2], key[2])]
            for key in gone:
                self._fills[key] = (None, 0)
                del pending[key]
            if gone:
                self.repair.give_up((((t, p), off) for t, p, off in gone), time.monotonic())

    def _on_holes_changed(self, filled: tuple[int, int]) -> None:
        written, given_up = filled
        if written or given_up:
            self.holes_filled += written
            log.info(
                "store: %d records written into recorded holes%s",
                written,
                f", {given_up} offsets given up for good (over max_record_bytes)" if given_up else "",
            )
        self._sync_holes()

    def _ask_holes(self, now: float) -> None:
        """FETCH the recorded holes that are due (a few at a time, backing off)."""
        if self.storage_error is not None or len(self._fills) >= MAX_BATCH // 2:
            return
        for topic, partition, offset, count in self.repair.due(now):
            self.send(wire.Fetch(partition, self.address, topic, offset, count))
            self.hole_fetches += 1

    def track(self, tracker: PartitionTracker, seq: int, content: bytes) -> None:
        # Only records outside the fast path come here; one below the
        # partition's next offset is either a duplicate or fills a recorded hole.
        nxt = tracker.next
        if nxt is not None and seq < nxt and self.repair and self.repair.covers((tracker.subject, tracker.address), seq):
            self._fills[(tracker.subject, tracker.address, seq)] = (content, self._ts)
            return
        super().track(tracker, seq, content)

    def too_large(self, tracker: PartitionTracker, seq: int, size: int) -> None:
        nxt = tracker.next
        if nxt is not None and seq < nxt and self.repair and self.repair.covers((tracker.subject, tracker.address), seq):
            # Every copy of the record has its size: the offset stays a hole for good
            # (asked for no more from now, see HoleRepair.give_up).
            self._fills[(tracker.subject, tracker.address, seq)] = (None, 0)
            self.repair.give_up([((tracker.subject, tracker.address), seq)], time.monotonic())
        super().too_large(tracker, seq, size)

    def on_believed_void(self, msg: wire.Void) -> None:
        super().on_believed_void(msg)
        key = (msg.subject, msg.address)
        if msg.kind == wire.VOID_RESTART and key in self._trackers:
            # Its producer's current run never published these: they cap its ACKs
            # no more (see dafka.store.holes).  The ACK goes with the next commit or
            # HEAD (never here: not past what its current run published, see
            # on_producer_head).
            self.repair.on_restart_hole(key, msg.first, msg.last)
        if self.repair and msg.kind == wire.VOID_STORE and msg.source != self.address:
            # A peer store holds none of a range we asked for: once every store we
            # know said so, a recorded hole at the partition's start is asked for
            # no more (retention removed it there, most likely), until a peer
            # joins (see dafka.store.holes).
            self.repair.on_void((msg.subject, msg.address), msg.first, msg.last, msg.source, self.known_stores())

    def retry_missing_now(self) -> None:
        super().retry_missing_now()
        if self.repair:
            self.repair.peer_joined(time.monotonic())  # it may hold what the holes lack

    def on_too_large_skipped(self, tracker: PartitionTracker, seq: int) -> None:
        # A hole as any other (counted and logged as a record too large, not here):
        # readers asking for the offset get what follows it.  It commits with the
        # records after it; consecutive ones are one hole.
        skips, subject, partition = self._skips, tracker.subject, tracker.address
        pending = self._too_large_holes
        pending[(subject, partition, seq)] = None
        if len(pending) > MAX_TOO_LARGE_HOLES:
            del pending[next(iter(pending))]  # bounded: the oldest is asked for (and given up) as any hole
        if skips and skips[-1][:2] == (subject, partition) and skips[-1][3] == seq - 1:
            skips[-1] = (subject, partition, skips[-1][2], seq)
        else:
            skips.append((subject, partition, seq, seq))

    def on_shutdown(self) -> None:
        # Commit what was received; ACKs for it go out if the socket still can.
        deadline = time.monotonic() + 5.0
        while (self._batch or self._pairs or self._fills or self._blocks or self._writer_busy) and (
            time.monotonic() < deadline
        ):
            if self.storage_error is not None:
                break
            self._flush_batch()
            self._read_wake_blocking(0.05)
        if self.leaves is not None:
            self.leaves.close()

    def _read_wake_blocking(self, timeout: float) -> None:
        if self._wake_rx.poll(int(timeout * 1000)):
            self._read_wake()

    def _log_stats(self, now: float) -> None:
        elapsed = now - self._stats_at
        stored = self.stored - self._stats_stored
        served = self.records_served - self._stats_served
        self._stats_at, self._stats_stored, self._stats_served = now, self.stored, self.records_served
        if stored or served:
            log.info(
                "store %s: %.0f records/s stored, %.0f records/s served, %d partitions",
                self.address[:8],
                stored / elapsed,
                served / elapsed,
                len(self._heads),
            )
        if self.fetches_refused != self._stats_refused:
            log.warning(
                "store %s: %d FETCHes refused so far: more than %d answers in progress for one"
                " requester and partition, or %d in all (a reader asks again)",
                self.address[:8],
                self.fetches_refused,
                MAX_JOBS_PER_REQUESTER,
                MAX_FETCH_JOBS,
            )
            self._stats_refused = self.fetches_refused
