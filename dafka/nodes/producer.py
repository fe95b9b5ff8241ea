"""The producer: publishes records to one partition of one topic.

Each producer is one partition, named by its address.  ``publish`` assigns the
next offset, sends a RECORD and keeps the record until a store acknowledges it
(ACKs are cumulative).  FETCH requests are answered from the kept records with
DIRECT-RECORDs.  Once something is published a HEAD goes out every interval,
so consumers and stores notice what they missed.

``publish`` is thread-safe and sends from the caller's thread (the data PUB is
shared under a lock); ACKs, FETCHes and timers run in the node's I/O thread.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import zmq

from dafka import fastio, values
from dafka.config import NodeConfig, default_node_config
from dafka.core import beacon, wire
from dafka.core.resume import POLICIES, PROBATION, STRICT, Resume
from dafka.core.unacked import UnackedWindow
from dafka.errors import (
    BufferFullError,
    ClosedError,
    ConfigError,
    ProtocolError,
    PublishError,
    RecordTooLargeError,
    ResumeError,
)
from dafka.nodes.fairlock import FairLock
from dafka.nodes.loop import NodeLoop
from dafka.nodes.node import Node, Route, read_subscriptions
from dafka.nodes.receipt import Receipt as Receipt  # (re-exported: it was defined here)
from dafka.nodes.receipt import ReceiptCallbacks, check_content
from dafka.outbox.host import ProducerPort

_ONLY_BYTES = frozenset((bytes,))

log = logging.getLogger("dafka.producer")

# A send waits for room in a full subscriber queue (see Producer._send_run);
# after PACE_LIMIT with no progress it drops for LOSSY_HOLD seconds as a PUB
# (and the C reference) does; a subscriber that stays stuck doubles the hold,
# up to MAX_LOSSY_HOLD, so it costs its producers less and less.  A moving
# reader frees room only in steps: ZeroMQ reopens a full pipe once its reader
# has taken half the queue (50,000 messages at the default hwm, 0.5 s for a
# reader at 100k records/s), so the limit must be longer than such a step.
PACE_LIMIT = 1.0
PACE_STEP = 0.002
LOSSY_HOLD = 2.0
MAX_LOSSY_HOLD = 32.0
IDLE_TICK = 1.0  # seconds between ticks of a producer with nothing pending (see tick_interval)
BUSY_TICK = 0.25  # ... with records in flight and nothing else pending
SUBSCRIPTION_CHECK = 0.001  # seconds between checks for new subscriptions while batching
# Offset reservations in the identity file (see dafka.core.resume): offsets are
# reserved a block at a time, made durable before the first of them is used.
# A block lasts about RESERVE_SECONDS at the recent publish rate (at least
# RESERVE_MIN offsets) and is renewed by the I/O thread once half of it is
# used; a publisher that outruns it renews it itself (one fsync) with a block
# twice as large.  After a crash the unused rest is a hole in the partition.
RESERVE_MIN = 10_000
RESERVE_MAX = 1 << 30
RESERVE_SECONDS = 10.0
RESERVE_RATE_INTERVAL = 1.0  # seconds between measurements of the publish rate
NO_RESERVATION = 1 << 62  # the bound of producers without reservations: never reached
_SEND_BATCHES = fastio.send_batches
_monotonic = time.monotonic



class _OutboxPort(ProducerPort):
    """What a producer offers its outbox (:class:`dafka.outbox.host.OutboxHost`)."""

    __slots__ = ()
    _producer: Producer

    @property
    def resume_error(self) -> ResumeError | None:
        return self._producer._resume_error

    def prepare(self, batch: list[Any]) -> list[bytes]:
        producer = self._producer
        if producer._serialize is not None:
            batch = [values.encode(producer._serialize, content) for content in batch]
        for content in batch:
            if content.__class__ is not bytes:
                check_content(content)
        biggest = max(map(len, batch))
        if biggest > producer.config.max_record_bytes:
            raise producer._too_large(biggest)
        return batch

    def send_live(self, first: int, contents: Sequence[bytes]) -> None:
        producer = self._producer
        producer._send_run(producer._live, first, contents, 0, len(contents))

    def hold_beacons(self) -> None:
        self._producer.beacon_held = True


class Producer(ReceiptCallbacks, Node):
    """Publish records to ``topic``.

    Parameters
    ----------
    topic:
        The topic (subject) to publish to.
    config / towers:
        Node configuration; ``towers`` overrides ``config.towers``.
    capacity:
        How many records may wait for an ACK.  When full, ``publish`` blocks
        up to ``publish_timeout`` seconds, then raises BufferFullError
        (``publish_timeout=0`` raises at once).  Nothing is ever dropped.
    acks:
        False for a mesh without stores: publishes never wait, receipts
        resolve at once, and the newest ``capacity`` records are kept to
        answer FETCHes.
    identity:
        Path of a small JSON file holding the producer's address and offsets,
        so that a restarted producer continues its partition.  A producer
        started from an existing identity file first checks that no other
        live process uses that identity, then asks the stores for the head
        of its partition and continues right after it (see
        :mod:`dafka.core.resume`); this takes at least 2.5 beacon intervals.
    resume_timeout:
        Seconds the resume may take.  The identity file also reserves, ahead
        of use, the offsets the producer may assign (a block at a time), so a
        restart continues after everything a crashed run may have assigned
        even if a store holding its last records does not answer; the
        reserved offsets it never used stay a hole in the partition (readers
        wait ``skip_after`` for them, then skip them).  A clean ``close``
        saves the exact end: the next run continues without a hole.
    pace_limit:
        Seconds a publish waits for room when a live subscriber's queue (the
        high-water mark) is full, instead of dropping what it cannot take:
        a burst larger than the queues then reaches fast readers whole, with
        no FETCH.  A subscriber that takes nothing for that long is stuck (its
        application stopped reading): the producer then drops for it, as the
        C reference always does, for a hold that starts at 2 s and doubles
        while it stays stuck (up to 32 s).  0: never wait.
    resume:
        What to do when no store answers within ``resume_timeout``:
        ``"strict"`` (default) makes ``publish`` raise :class:`ResumeError`;
        ``"start_anyway"`` continues after the offsets the identity file
        reserved (overwriting nothing; an identity file from before
        reservations only knows what it saved, and records a store holds
        beyond that may then be overwritten).
        Another process with the same identity is always refused.
    serializer:
        How ``publish`` turns values into record contents: ``"bytes"``
        (default: contents are bytes already), ``"msgpack"``, ``"json"`` or a
        callable returning bytes.  A value it cannot serialize raises
        :class:`~dafka.errors.SerializationError` from ``publish``.
    outbox:
        Directory of an edge outbox (see :mod:`dafka.outbox`): every record
        is committed there (fsync'ed) before it goes on the wire and stays
        until a store acknowledged it, so records survive a crash or reboot
        while no store is reachable.  Reopened, the outbox continues its
        partition at once (no store needs to answer) and sends again what is
        unacknowledged.  It also serves as the identity when ``identity`` is
        not given.  ``outbox_sync``: ``"each"`` (``publish`` returns once the
        record is durable) or ``"batch"`` (durable within the next group
        commit, a few ms).  ``outbox_max_bytes`` / ``outbox_max_age`` bound
        what it keeps; at a limit ``outbox_policy="block"`` makes ``publish``
        wait up to ``publish_timeout`` then raise BufferFullError, and
        ``"drop_oldest"`` evicts the oldest unacknowledged records (counted).
        ``outbox_max_map_size`` caps the LMDB file (a full disk or cap raises
        OutboxFullError at ``publish``).
    leaf:
        ``"HOST:PORT[,HOST:PORT...]"``: be a *leaf* instead of a mesh node: one
        connection to a regional endpoint (a store started with ``--leaves``), no
        tower, no beacons; returns a :class:`dafka.nodes.leaf.LeafProducer` (same
        API; see ``docs/concepts/leaves.md``).
    loop:
        A :class:`~dafka.nodes.loop.NodeLoop` to run this producer's I/O in,
        shared with the other nodes given it (one thread for all; callbacks
        then run in that thread). None (default): the producer's own thread.
    """

    kind = "producer"
    _lock: FairLock  # (ReceiptCallbacks takes any lock)

    def __new__(cls, *args: Any, leaf: str | Sequence[str] | None = None, **kwargs: Any) -> Any:
        # A leaf producer (one connection to a regional endpoint, no mesh side) is another
        # class with the same API: dafka.nodes.leaf.LeafProducer.
        if leaf is not None:
            from dafka.nodes.leaf import LeafProducer

            return LeafProducer(*args, leaf=leaf, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        topic: str,
        config: NodeConfig | None = None,
        *,
        towers: str | list[str] | None = None,
        capacity: int = 1_000_000,
        publish_timeout: float | None = 30.0,
        acks: bool = True,
        identity: str | os.PathLike[str] | None = None,
        head_interval: float = 1.0,
        resume_timeout: float = 5.0,
        resume: str = STRICT,
        pace_limit: float = PACE_LIMIT,
        serializer: str | values.Serializer | None = None,
        outbox: str | os.PathLike[str] | None = None,
        outbox_max_bytes: int | None = None,
        outbox_max_age: float | None = None,
        outbox_sync: str = "each",
        outbox_policy: str = "block",
        outbox_max_map_size: int | None = None,
        loop: NodeLoop | None = None,
        leaf: None = None,  # taken by __new__: see dafka.nodes.leaf
    ) -> None:
        self._serialize = values.serializer(serializer)
        if not topic or len(topic.encode()) > wire.MAX_STRING or "\x00" in topic:
            raise ValueError("topic must be 1..255 bytes without NUL")
        if resume not in POLICIES:
            raise ValueError(f"resume must be one of {POLICIES}, not {resume!r}")
        config = (config or default_node_config()).with_towers(towers)
        self.topic = topic
        self.acks = acks
        self.publish_timeout = publish_timeout
        self.head_interval = head_interval
        self._head_tick_last = -1  # the offset announced at the last HEAD tick (see _send_head)
        self._identity_path = Path(identity) if identity else None
        saved = self._load_identity() if self._identity_path else None
        self._outbox = None
        if outbox is not None:
            if not acks:
                raise ValueError("an outbox needs acks: records leave it when a store acknowledges them")
            from dafka.outbox import Outbox

            self._outbox = Outbox(
                outbox,
                topic,
                max_bytes=outbox_max_bytes,
                max_age=outbox_max_age,
                policy=outbox_policy,
                sync=outbox_sync,
                max_map_size=outbox_max_map_size,
            )
            kept = self._outbox.saved_identity()
            if kept is not None:
                if saved is not None and saved["address"] != kept["address"]:
                    self._outbox.db.close()
                    raise ValueError(
                        f"outbox {outbox} belongs to partition {kept['address']}, identity file"
                        f" {identity} to {saved['address']}"
                    )
                saved = kept  # the outbox knows every offset it assigned: no store needs to answer
        # An XPUB that refuses (NODROP) rather than drops when a subscriber's
        # queue is full, so a publisher can pace itself to its readers (and to
        # what CURVE encrypts) instead of losing a burst's tail (see _send_run).
        # On the wire it is a PUB: C reference subscribers see no difference.
        self.publisher_type = zmq.XPUB
        try:
            super().__init__(config, address=saved["address"] if saved else None, loop=loop)
        except ConfigError as exc:
            if saved is None:
                raise
            # A secure mesh binds addresses to keys: an identity from a plain mesh,
            # from before the binding, or made with another key cannot continue here.
            raise ConfigError(
                f"identity file {self._identity_path}: {exc}; start a new identity file"
                " (the old partition stays readable from the stores)"
            ) from None
        if self._identity_path is not None:
            self.every(self.config.beacon_interval, self._check_twin_watch)
        self.pace_limit = max(0.0, pace_limit)
        self._paced = self.pace_limit > 0
        self._lossy_until = 0.0
        self._lossy_hold = LOSSY_HOLD  # doubles while a subscriber stays stuck
        self._paced_since = 0.0  # when the last lossy hold ended
        # Set while a live send waits for room with the lock released: other
        # publishers wait for their turn before taking offsets, so records go
        # out in offset order whatever the number of publishing threads.
        self._live_waiting = False
        # While it waits: the first offset of that send not handed to ZeroMQ yet.
        # Heads never announce it or what follows (see _announced).
        self._unsent_from = 0
        self.pace_timeouts = 0  # times a full subscriber made the producer stop waiting
        self.publisher.setsockopt(zmq.XPUB_NODROP, 1 if self._paced else 0)
        next_offset = 0
        # Offsets below _reserved may be assigned: the identity file holds a
        # bound at least this high (see dafka.core.resume).  An outbox is the
        # authority of its partition instead, and without an identity file
        # there is nothing to continue.
        self._reserving = self._identity_path is not None and self._outbox is None
        self._reserved = 0 if self._reserving else NO_RESERVATION
        self._reserve_block = RESERVE_MIN
        self._reserve_failures = 0
        self._rate_at = 0.0
        self._rate_next = 0
        self._identity_lock = threading.Lock()  # one writer of the identity file at a time
        self._hole: tuple[int, int] | None = None  # offsets the resume skipped (see _on_fetch)
        self._resume_state: Resume | None = None
        self._resume_error: ResumeError | None = None
        self._resumed_at: float | None = None  # when a resume from an identity file ended
        self.bad_acks = 0  # ACKs beyond what was published (protocol violations)
        if saved and self._outbox is not None and self._outbox.authoritative:
            self._resumed_at = time.monotonic()  # (a twin noticed soon after still stops us)
        elif saved:
            next_offset = int(saved["acked"]) + 1
            # Always ask the stores how far they got: the file may be behind them.
            self._resume_state = Resume(
                int(saved["acked"]),
                int(saved["next"]),
                time.monotonic(),
                resume_timeout,
                self.config.beacon_interval,
                resume,
                need_store=acks,
                reserved=None if saved.get("reserved") is None else int(saved["reserved"]),
            )
            # Silent until we know no other process beacons this address.
            self.beacon_held = True
        self.window = UnackedWindow(capacity, next_offset, ring=not acks)
        # Publishing loops take this lock per chunk; FairLock lets the I/O
        # thread (ACKs, FETCHes, timers) in between instead of starving it.
        self._lock = FairLock()
        self._cond = threading.Condition(self._lock)  # type: ignore[arg-type]
        self._closed = False
        self._failure: PublishError | None = None
        self._failed_from = 1 << 64  # offsets >= this failed with _failure
        self._callbacks: list[tuple[int, int, Receipt, Callable[[Receipt], None]]] = []
        self._callback_seq = 0
        self._last_saved = -2
        self._head_sent_at = 0.0
        self._saved_at = 0.0
        self.fetches_served = 0
        self.answers_cut = 0  # FETCH answers stopped after pace_limit: the requester reads slowly
        # store address -> (writing, reason, when): what stores said (STORE-STATUS)
        self.store_status: dict[str, tuple[bool, str, float]] = {}
        if self._identity_path is not None and saved is None:
            # A new identity goes to disk before anything is published: a crash
            # before the first ACK still restarts as the same partition, and a
            # twin started at once finds the address it must not reuse.
            if self._reserving:
                self._extend_reservation(RESERVE_MIN)
            else:
                self._save_identity(force=True)

        # How live records go out: (header prefix, send function), as batches
        # while every reader takes them (see _tick_paced and dafka.core.audience).
        self._record_header = wire.record_prefix(wire.RECORD, topic, self.address, topic)
        self._live = self.route(self._record_header)
        self._subscriptions_due = 0.0  # see _check_subscriptions
        self.subscribe(wire.P_ACK + self.address.encode())
        self.subscribe(wire.P_FETCH + self.address.encode())
        self.subscribe(wire.P_GET_HEADS + topic.encode())
        self.subscribe(wire.P_STORE_STATUS + self.address.encode())
        if self._resume_state is not None:
            self.subscribe(wire.P_DIRECT_HEAD + self.address.encode())
        self.every(head_interval, self._send_head)
        if self._outbox is not None:
            self._outbox.attach(_OutboxPort(self), resuming=self._resume_state is not None)
            # Records go to the disk first: the outbox sends them once they are durable.
            self.publish = self._publish_to_outbox  # type: ignore[method-assign]
            self.publish_many = self._publish_many_to_outbox  # type: ignore[method-assign]
        self.start()
        if self._resume_state is not None:
            self._resume()

    # ---------------------------------------------------------------- public API

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()

    @property
    def next_offset(self) -> int:
        """The offset the next publish gets."""
        return self.window.next

    @property
    def acked_offset(self) -> int:
        """The highest offset a store has acknowledged (-1: none)."""
        return self.window.acked

    @property
    def batching(self) -> bool:
        """Whether live records go out in batches (every reader takes them; see dafka.core.audience)."""
        return self._live[1] is _SEND_BATCHES

    @property
    def unacked(self) -> int:
        """How many published records wait for an acknowledgement."""
        return len(self.window)

    def publish(
        self,
        content: Any,
        callback: Callable[[Receipt], None] | None = None,
        *,
        offset: int | None = None,
        timeout: float | None = -1.0,
    ) -> Receipt:
        """Publish ``content``; return its :class:`Receipt` (offset + outcome).

        ``offset`` makes resends idempotent: an offset below ``next_offset``
        was already published and is not sent again; it must never be above.
        ``timeout`` overrides ``publish_timeout`` for waiting on a full buffer.
        Raises :class:`ResumeError` if the producer could not resume its partition,
        TypeError if ``content`` is not bytes-like (a str must be encoded first).
        ``content`` is bytes, or a value for the producer's ``serializer``.
        """
        if self._serialize is not None:
            content = values.encode(self._serialize, content)
        if content.__class__ is not bytes:
            check_content(content)
        if self._resume_error is not None:
            raise self._resume_error
        if len(content) > self.config.max_record_bytes:
            raise self._too_large(len(content))
        lock = self._lock
        if lock.waiters:
            lock.let_waiters_in()
        with lock.raw:
            window = self.window
            if offset is not None and offset != window.next:
                if offset > window.next:
                    raise ValueError(f"offset {offset} is beyond next offset {window.next}")
                receipt = Receipt(self, offset)  # already published: not sent again
            elif not self._live_waiting and not self._closed and (window.ring or len(window) < window.capacity):
                # The common case without _push_locked's loop: room for one record.
                if window.next >= self._reserved:
                    self._reserve_locked(1)
                seq = window.push(content)
                self._send_run(self._live, seq, (content,), 0, 1)
                receipt = Receipt(self, seq)
            else:
                receipt = Receipt(self, self._push_locked((content,), timeout))
        if callback is not None:
            self._add_callback(receipt, callback)
        return receipt

    def publish_many(self, contents: Iterable[Any], *, timeout: float | None = -1.0) -> Receipt | None:
        """Publish several records; return the receipt of the last one (None if empty).

        ACKs are cumulative, so the last receipt resolving means all did.
        Cheaper per record than :meth:`publish`: one lock hold per chunk.
        A record that is not bytes-like raises TypeError before its chunk of
        up to 1024 records is published (the chunks before it are).
        A record over ``max_record_bytes`` raises :class:`RecordTooLargeError`
        before its chunk (up to 1024 records) is published; earlier chunks were.
        With a ``serializer``, values are serialized a chunk at a time: one
        that cannot be raises before its chunk is published.
        """
        last = -1
        it = iter(contents)
        serialize = self._serialize
        if serialize is not None:
            it = (values.encode(serialize, value) for value in it)
        while True:
            batch = list(islice(it, 1024))  # chunks taken at C level
            if not batch:
                break
            last = self._publish_chunk(batch, timeout)
        return Receipt(self, last) if last >= 0 else None

    def _publish_to_outbox(
        self,
        content: Any,
        callback: Callable[[Receipt], None] | None = None,
        *,
        offset: int | None = None,
        timeout: float | None = -1.0,
    ) -> Receipt:
        """:meth:`publish` with an outbox (see :mod:`dafka.outbox`'s sync modes)."""
        outbox = self._outbox
        assert outbox is not None
        if offset is not None and offset != self.window.next:
            if offset > self.window.next:
                raise ValueError(f"offset {offset} is beyond next offset {self.window.next}")
            receipt = Receipt(self, offset)
        else:
            receipt = Receipt(self, outbox.append(content, timeout))
        if callback is not None:
            self._add_callback(receipt, callback)
        return receipt

    def _publish_many_to_outbox(self, contents: Iterable[Any], *, timeout: float | None = -1.0) -> Receipt | None:
        """:meth:`publish_many` with an outbox: it waits for the disk once, at the end."""
        outbox = self._outbox
        assert outbox is not None
        last = outbox.append_many(contents, timeout=timeout)
        return Receipt(self, last) if last >= 0 else None

    def _too_large(self, size: int) -> RecordTooLargeError:
        return RecordTooLargeError(
            f"record of {size} bytes is larger than max_record_bytes={self.config.max_record_bytes}"
            " ([node] max_record_bytes); nothing of it was published"
        )

    def _publish_chunk(self, batch: list[bytes], timeout: float | None) -> int:
        if not _ONLY_BYTES.issuperset(map(type, batch)):  # one C-level pass
            for content in batch:
                if content.__class__ is not bytes:
                    check_content(content)  # nothing of the chunk is published
        if self._resume_error is not None:
            raise self._resume_error
        biggest = max(map(len, batch))
        if biggest > self.config.max_record_bytes:
            raise self._too_large(biggest)  # the whole chunk: nothing of it was published
        lock = self._lock
        if lock.waiters:
            lock.let_waiters_in()
        with lock.raw:
            return self._push_locked(batch, timeout)

    def _push_locked(self, batch: list[bytes] | tuple[bytes, ...], timeout: float | None) -> int:
        """Assign offsets to ``batch`` and send it (lock held); the last offset."""
        if self._closed:
            raise ClosedError("producer is closed")
        window = self.window
        wait = self.publish_timeout if timeout == -1.0 else timeout
        n = len(batch)
        done = 0
        while self._live_waiting:  # another thread's records wait for room: they go first
            self._cond.wait(PACE_STEP)
            if self._closed:
                raise ClosedError("producer is closed")
        while done < n:
            # Offsets for as many records as the window has room for, then one
            # batch send (a compiled loop when the extension is active).
            room = n - done if window.ring else window.capacity - len(window)
            if room <= 0:
                self._wait_for_room(wait)
                continue
            stop = min(n, done + room)
            if window.next + (stop - done) > self._reserved:
                self._reserve_locked(stop - done)
            first = window.push_many(batch, done, stop)
            self._send_run(self._live, first, batch, done, stop)
            done = stop
        return window.next - 1 if n else -1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every published record is acknowledged; False on timeout."""
        if not self.acks:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.window.acked < self.window.next - 1 and self._failure is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._failure is None

    def close(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` for ACKs, then stop.

        Returns True when everything published was acknowledged.  Records
        still unacknowledged fail with a PublishError.
        """
        with self._lock:
            if self._closed:
                return self._failure is None
        ok = self.flush(timeout)
        with self._lock:
            self._closed = True
            if ok and self.acks and self.window.acked < self.window.next - 1:
                ok = False  # published by another thread after the flush: not acknowledged
            if not ok and self._failure is None:
                self._fail(PublishError(f"not acknowledged by a store within {timeout}s"))
            self._cond.notify_all()
        self.stop()
        if self._outbox is not None:
            self._outbox.close()  # what is unacknowledged stays in it for the next start
        if self._reserving:
            with self._identity_lock:
                # Nothing more is published: the exact end is the bound (no hole next time).
                self._reserved = min(self._reserved, self.window.next)
        self._save_identity(force=True)
        self._run_callbacks()
        return ok

    def _close_with_loop(self) -> None:
        self.close(0)

    # ---------------------------------------------------------------- receipts

    def _acked_upto(self) -> int:
        return self.window.next - 1 if not self.acks else self.window.acked

    def _failure_for(self, offset: int) -> PublishError | None:
        if self._outbox is not None and (evicted := self._outbox.failure_for(offset)) is not None:
            return evicted
        if self._failure is not None and offset >= self._failed_from and offset > self._acked_upto():
            return self._failure
        return None

    def _wait_for(self, offset: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._acked_upto() < offset:
                failure = self._failure_for(offset)
                if failure is not None:
                    raise PublishError(str(failure), offset)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if self._outbox is not None and (evicted := self._outbox.failure_for(offset)) is not None:
                raise evicted
            return True

    def _wait_for_room(self, timeout: float | None) -> None:
        # Called with the lock held; waiting releases it, so re-check closed.
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.window.full and not self._closed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise BufferFullError(
                    f"{len(self.window)} records wait for an ACK (capacity {self.window.capacity})"
                )
            self._cond.wait(remaining)
        if self._closed:
            raise ClosedError("producer is closed")

    def _run_callbacks(self) -> None:
        due = []
        with self._lock:
            heap = self._callbacks
            upto = self._acked_upto()
            while heap and (heap[0][0] <= upto or self._failure_for(heap[0][0]) is not None):
                due.append(heapq.heappop(heap))
        for _, _, receipt, fn in due:
            self._call(fn, receipt)

    def _fail(self, failure: PublishError) -> None:
        # Called with the lock held.
        self._failure = failure
        self._failed_from = self.window.acked + 1

    # ---------------------------------------------------------------- I/O thread

    def on_data(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except ProtocolError as exc:
            self.bad_input("message", exc)
            return
        if isinstance(msg, wire.Ack):
            if msg.topic == self.address and msg.subject == self.topic and not self.untrusted():
                self._on_ack(msg.sequence)
        elif isinstance(msg, wire.Fetch):
            if msg.topic == self.address and msg.subject == self.topic:
                self._on_fetch(msg)
        elif isinstance(msg, wire.GetHeads):
            # In secure mode only stores' DIRECT-HEADs are believed: the HEAD
            # every head_interval tells consumers the same.
            if msg.topic == self.topic and self._resume_state is None and not self.secure:
                with self._lock:
                    # Under the lock: read before it, the head could be a burst's last
                    # offset, sent once the burst waited for room (see _announced).
                    last = self._announced()
                    if last >= 0 and not self._closed:
                        # Never waits for a full queue (NODROP): the HEAD tick tells it again.
                        fastio.send_frames(
                            self.publisher, wire.encode(wire.DirectHead(msg.address, self.address, self.topic, last))
                        )
        elif isinstance(msg, wire.DirectHead):
            resume = self._resume_state
            if resume is not None and msg.address == self.address and msg.subject == self.topic and not self.untrusted():
                resume.on_head(msg.sequence, time.monotonic())
        elif isinstance(msg, wire.StoreStatus):
            if msg.topic == self.address and msg.subject == self.topic and not self.untrusted():
                self._on_store_status(msg)

    def _on_ack(self, seq: int) -> None:
        resume = self._resume_state
        if resume is not None:
            # Still resuming (the window is a placeholder): a store's ACK says
            # what its DIRECT-HEAD would, that it holds the partition up to seq.
            resume.on_head(seq, time.monotonic())
            return
        with self._lock:
            last = self.window.last
            beyond = seq > last
            newly = 0 if beyond else self.window.ack(seq)
            if newly:
                self._cond.notify_all()
                if self._outbox is not None:
                    self._outbox.on_acked()
        if beyond:
            # A store claims offsets we never published: its copy of the partition
            # is not ours (another process with this identity?). Acknowledge nothing.
            self.bad_acks += 1
            if self.bad_acks <= 20 or self.bad_acks % 1000 == 0:
                log.error(
                    "producer %s: ACK of offset %d beyond the last published offset %d of %s"
                    " ignored (%d so far)",
                    self.address,
                    seq,
                    last,
                    self.topic,
                    self.bad_acks,
                )
            return
        if newly:
            if self._callbacks:
                self._run_callbacks()
            self._save_identity()

    def _on_store_status(self, msg: wire.StoreStatus) -> None:
        writing = bool(msg.writing)
        before = self.store_status.get(msg.address)
        self.store_status[msg.address] = (writing, msg.reason, time.monotonic())
        if not writing and (before is None or before[0]):
            log.warning("producer %s: %s (no ACKs from it until it can)", self.address[:8], msg.reason)
        elif writing and before is not None and not before[0]:
            log.info("producer %s: store %s writes again", self.address[:8], msg.address[:8])

    def diagnose(self, recent: float = 5.0) -> str:
        """Why records are not acknowledged, as far as this producer can tell."""
        now = time.monotonic()
        fresh = {a: (w, r) for a, (w, r, t) in list(self.store_status.items()) if now - t <= recent}
        failing = [reason for writing, reason in fresh.values() if not writing]
        if failing:
            # The store is there (it says so) and says why it does not ACK.
            others = len(fresh) - len(failing)
            tail = f"; {others} other store(s) write but did not acknowledge" if others else ""
            return "; ".join(f"a store is up but not acknowledging: {r}" for r in failing) + tail
        if fresh:
            return (
                f"{len(fresh)} store(s) on the mesh receive this partition and write, but did not"
                " acknowledge everything yet (still catching up?)"
            )
        if self.store_status:
            return "stores were seen, but none reported in the last few seconds (stopped or unreachable?)"
        towers = ", ".join(t.beacon_in for t in self.config.towers) or "none configured"
        if not self.tower_watch.reached:
            return f"no tower reached (tried {towers}), so no store could be found"
        if len(self.peers) == 0:
            return "no other node on the mesh: no store seen (is a store running, using the same tower?)"
        unreached = self._unreached_peers()
        if unreached:
            return (
                f"no store reported; this producer cannot connect to {len(unreached)} of the"
                f" {len(self.peers)} node(s) on the mesh: {'; '.join(unreached[:5])}. A store among them"
                " cannot be reached from here (bound to loopback on another host, a wrong --advertise,"
                " or a firewall?): `dafka doctor` on its host checks it"
            )
        return (
            f"no store on the mesh: this producer reached all {len(self.peers)} other node(s) and none"
            " reported as a store (is a store running, using the same tower?)"
        )

    def _unreached_peers(self) -> list[str]:
        """Peers our data SUB has no connection to: endpoint, who, and how it went."""
        out = []
        for address, endpoint in self.peers.items():
            if endpoint in self.links.up:
                continue
            role = self.peer_role(address)
            who = f"a {role}" if role else "node"
            fails = self.links.failing.get(endpoint, 0)
            how = f"{fails} failed connection attempt(s)" if fails else "not connected yet"
            out.append(f"{endpoint} ({who} {address[:8]}, {how})")
        return out

    def _on_fetch(self, fetch: wire.Fetch) -> None:
        header = wire.record_prefix(wire.DIRECT_RECORD, fetch.address, self.address, self.topic)
        with self._lock:
            if self._closed:
                return
            # The requester's subscriptions may not be read yet: its answer's form depends on them.
            self._read_subscriptions_locked()
            route = self.route(header, answer=True)
            seq, count = fetch.sequence, fetch.count
            hole = self._hole
            if hole is not None and hole[0] <= seq <= hole[1]:
                # Reserved offsets a crashed run left unused: this run never
                # publishes them.  Say so (VOID kind 1; C readers never subscribe
                # to it): a dafka reader passes them as soon as every store it
                # knows said it holds none of them (a previous run's records
                # can only be in a store now).  In a secure mesh it is believed
                # only from the key our address is bound to.
                void = wire.Void(fetch.address, self.address, self.topic, hole[0], hole[1], self.address, wire.VOID_RESTART)
                fastio.send_frames(self.publisher, wire.encode(void))  # (lock held, not closed)
            if hole is not None and hole[0] <= seq <= hole[1] and seq + count <= hole[1] + 1:
                # As a store answers for a hole, send what follows (one record):
                # the reader holds it, and skips the hole after its skip_after
                # unless a store that was away still has some (or at once, above).
                seq, count = hole[1] + 1, 1
            count = count if self._outbox is None else self._outbox.sendable(seq, count)
            runs = self.window.runs(seq, count)  # the publisher may push meanwhile
        for first, contents in runs:
            # Runs hold up to unacked.CHUNK records: the lock is released between them.
            with self._lock:
                if self._closed:
                    return
                if not self._send_run(route, first, contents, 0, len(contents), answer=True):
                    break  # cut short (the requester reads slowly): no wait for each later run
        self.fetches_served += 1

    def _send_run(
        self, route: Route, seq: int, contents: Sequence[bytes], start: int, stop: int, answer: bool = False
    ) -> bool:
        """Send ``contents[start:stop]`` as records from ``seq`` (lock held); False if an answer was cut short.

        ``route`` is a header prefix and the send function for it (:meth:`Node.route`).

        A burst larger than the high-water marks would overflow a reader's
        queue (and in secure mode CURVE encryption is slower than the
        publisher): instead of dropping (to be fetched later) wait for room,
        the lock released meanwhile so ACKs and FETCHes go on (see
        :meth:`_send_waiting`).  A subscriber that takes nothing for
        ``pace_limit`` is stuck: then drop for everyone's queue that is full,
        as a PUB does, for a hold (see :meth:`_tick_paced`).  FETCH
        ``answer``s wait for room even then, up to ``pace_limit``; an answer
        that times out is cut short and starts no hold.
        """
        if route[1] is _SEND_BATCHES and not answer and not self.batches:  # (secure: always batches)
            now = _monotonic()
            if now >= self._subscriptions_due:
                route = self._check_subscriptions(now)
        if not self._paced:
            if answer and self.pace_limit:
                return self._send_answer(route, seq, contents, start, stop)
            # Lossy: what a full queue cannot take is dropped.  (Never a
            # wait: while an answer has NODROP on, the rest is dropped.)
            route[1](self.publisher, route[0], seq, contents, start, stop, True)
            return True
        reached = self._send_waiting(route, seq, contents, start, stop, live=not answer)
        if reached >= stop or self._closed:
            return True
        seq += reached - start
        if self._paced and answer:
            # Only the requester's queue takes DIRECT-RECORDs, and a replay may
            # read slowly without being stuck: cut the answer short (it asks
            # again for the rest) rather than drop live records for everyone.
            self.answers_cut += 1
            return False
        if self._paced:  # waited in vain: a subscriber is stuck
            self._start_hold(time.monotonic())
            route[1](self.publisher, route[0], seq, contents, reached, stop, True)
            return True
        # Another sender gave up waiting meanwhile.
        return self._send_run(route, seq, contents, reached, stop, answer)

    def _send_waiting(
        self, route: Route, seq: int, contents: Sequence[bytes], start: int, stop: int, live: bool
    ) -> int:
        """Send, waiting for room with the lock released (lock held); the index reached.

        Stops when everything went, on close, when another sender gives up
        waiting (the producer turns lossy), or when waiting is over: for
        ``live`` records after ``pace_limit`` with no progress (a slow reader
        is not stuck); for FETCH answers, sent by the I/O thread, after
        ``pace_limit`` in all, so that ACKs and timers are not held up long.
        """
        paced = self._paced
        prefix, send = route
        deadline = time.monotonic() + self.pace_limit
        while True:
            sent = send(self.publisher, prefix, seq, contents, start, stop, True)
            start += sent
            seq += sent
            if start >= stop:
                return start
            now = time.monotonic()
            if live and sent:  # stuck means no progress, not a slow reader
                deadline = now + self.pace_limit
            elif now >= deadline:
                return start
            if live:
                self._unsent_from = seq  # (read by _announced, lock held, while we wait)
                self._live_waiting = True  # other publishers wait their turn meanwhile
                try:
                    self._cond.wait(PACE_STEP)
                finally:
                    self._live_waiting = False
            else:
                self._cond.wait(PACE_STEP)
            if self._closed or (paced and not self._paced):
                return start

    def _start_hold(self, now: float) -> None:
        """A subscriber stayed stuck: drop for full queues (as a PUB does) for a hold."""
        self.pace_timeouts += 1
        # Stuck again soon after the last hold: hold longer this time.
        if now - self._paced_since < 2 * self._lossy_hold:
            self._lossy_hold = min(self._lossy_hold * 2, MAX_LOSSY_HOLD)
        else:
            self._lossy_hold = LOSSY_HOLD
        if self.pace_timeouts <= 20 or self.pace_timeouts % 1000 == 0:
            log.warning(
                "producer %s: a subscriber took nothing for %.2fs; dropping for it for %.0fs"
                " (it fetches what it missed); %d times so far",
                self.address[:8],
                self.pace_limit,
                self._lossy_hold,
                self.pace_timeouts,
            )
        self._paced = False
        self._lossy_until = now + self._lossy_hold
        self.publisher.setsockopt(zmq.XPUB_NODROP, 0)

    def _send_answer(self, route: Route, seq: int, contents: Sequence[bytes], start: int, stop: int) -> bool:
        """A FETCH answer during a lossy hold (lock held): still wait for room; False if cut short.

        A DIRECT-RECORD matches only the queue of the consumer that asked, so
        NODROP, on for this answer alone, waits for that reader only, not for
        the stuck one that caused the hold.  Dropping an answer would cost the
        requester a retry interval.  Up to ``pace_limit``; then the rest is
        dropped and the requester asks again.
        """
        self.publisher.setsockopt(zmq.XPUB_NODROP, 1)
        try:
            whole = self._send_waiting(route, seq, contents, start, stop, live=False) >= stop or self._closed
        finally:
            if not self._paced and not self._closed:
                self.publisher.setsockopt(zmq.XPUB_NODROP, 0)
        if not whole:
            self.answers_cut += 1
        return whole

    def _send_locked(self, frames: list[bytes]) -> None:
        with self._lock:
            if not self._closed:
                # Never wait for a full queue (NODROP): HEADs and
                # DIRECT-HEADs are sent again anyway.
                fastio.send_frames(self.publisher, frames)

    def _announced(self) -> int:
        """The last offset HEADs and DIRECT-HEADs announce (-1: none yet).

        After a resume that skipped a hole, until this run published, the
        offset before the hole (acknowledged, or a store's head): a head at
        the hole's end would make readers wait for offsets nobody publishes.
        """
        last = self.window.next - 1 if self._outbox is None else self._outbox.last_sendable
        if self._live_waiting:
            # A send waits for room (paced): its records from _unsent_from have their
            # offsets but are on no reader's queue yet.  Announced, a reader would
            # FETCH what is on its way (a DIRECT-HEAD answering GET-HEADS did).
            last = min(last, self._unsent_from - 1)
        hole = self._hole
        return hole[0] - 1 if hole is not None and last <= hole[1] else last

    def _send_head(self, now: float) -> None:
        with self._lock:
            if self._live_waiting or self._closed:
                # A burst's records have their offsets but wait for room (paced):
                # they go out still, and say what this HEAD would.  Announced now,
                # readers would FETCH what is on its way (the lock is free only
                # while a sender waits, so this sees every wait).
                return
            last = self._announced()
            if last != self._head_tick_last:
                # Records went out since the last tick: they said what this HEAD would.
                # It goes at the first tick after they stop, so a lost tail shows within
                # two intervals.  A HEAD a second beside each device's record was a
                # message a second at every store and consumer (a seventh of a
                # 1,000-device mesh's CPU).
                self._head_tick_last = last
                return
            if last >= 0 and self._resume_state is None and self._resume_error is None:
                # Never waits for a full queue (NODROP): HEADs are sent again anyway.
                fastio.send_frames(self.publisher, wire.encode(wire.Head(self.topic, self.address, self.topic, last)))

    def _tick_paced(self, now: float) -> None:
        """Read the XPUB's subscription messages (the batch audience); end a lossy hold."""
        with self._lock:
            if self._closed:
                return
            self._read_subscriptions_locked()
            self._refresh_live()
            if not self._paced and self.pace_limit > 0 and now >= self._lossy_until:
                self.publisher.setsockopt(zmq.XPUB_NODROP, 1)
                self._paced = True
                self._paced_since = now

    def _refresh_live(self) -> None:
        """After subscriptions were read: how live records go out now (lock held)."""
        live = self.route(self._record_header)  # (the audience keeps its verdicts)
        if live[1] is not self._live[1]:
            log.info(
                "producer %s: records go out %s",
                self.address[:8],
                "in batches (every reader takes them)"
                if live[1] is _SEND_BATCHES
                else "one a message (a reader that takes no batches subscribed)",
            )
        self._live = live

    def _check_subscriptions(self, now: float) -> Route:
        """While batching: take subscriptions the XPUB holds (lock held); the live route then.

        The tick reads them every 50 ms; a C reader that subscribed meanwhile
        would get batches it drops (and fetches again) until then.  Checked
        at most every millisecond from the publishing path, so the window is
        about that long.
        """
        self._subscriptions_due = now + SUBSCRIPTION_CHECK
        if self.publisher.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._read_subscriptions_locked()
            self._refresh_live()
        return self._live

    def _read_subscriptions_locked(self) -> None:
        """Take the XPUB's pending (un)subscriptions into the audience (lock held)."""
        for subscribe, prefix in read_subscriptions(self.publisher, 1000):
            self.on_subscription(subscribe, prefix)

    def publisher_lock(self) -> FairLock:
        return self._lock

    def close_publisher(self) -> None:
        with self._lock:
            self._closed = True
            self.publisher.close()

    def lazy_beacons(self) -> bool:
        """Once it met a peer, a producer reads beacons at its next turn (an
        ACK, a timer: within a second) instead of being woken by each.  The
        store's, each consumer's and the towers' hellos woke a device producer
        three times a second, most of its turns; a new consumer or store is
        met up to a second later (the consumer reads its records meanwhile:
        it connects to us at once).  Not while resuming (the twin check)."""
        return len(self.peers) > 0 and self._resume_state is None and not self.peers.interest.watch_peers

    def tick_interval(self) -> float:
        """Slow ticks while nothing waits for one: no lossy hold to end, no
        identity to save, no resume, no failure to report, no outbox waiting;
        then 1 s when every record is acked, else 250 ms (ACKs and their
        callbacks come in as they arrive, not at a tick).  A publish checks the
        XPUB's subscriptions itself while batching, so a reader that subscribes
        meanwhile is seen in time.  Ticking every 50 ms while records were in
        flight made 250 producers of one process tick 5,000 times a second
        when their store fell behind, and that load kept it behind."""
        in_flight = bool(self._callbacks or len(self.window))
        if (
            self._paced != (self.pace_limit > 0)
            or self._resume_state is not None
            or (self._identity_path is not None and self.window.acked != self._last_saved)
            or self._failure is not None
            or (in_flight and self._outbox is not None)
        ):
            return super().tick_interval()
        return BUSY_TICK if in_flight else IDLE_TICK

    def on_tick(self, now: float) -> None:
        self._tick_paced(now)
        if self._outbox is not None:
            self._outbox.on_tick(now)
        if self._callbacks:
            self._run_callbacks()
        if self._reserving:
            self._renew_reservation(now)
        if self._identity_path is not None and self.window.acked != self._last_saved:
            self._save_identity()

    # ---------------------------------------------------------------- identity

    def _resume(self) -> None:
        """Check the identity is ours alone, then learn the stores' head of our partition."""
        state = self._resume_state
        assert state is not None
        get_heads = wire.encode(wire.GetHeads(self.topic, self.address))
        asked_at = 0.0
        while True:
            now = time.monotonic()
            reached = self.tower_watch.reached_at
            if reached is not None:
                state.on_tower(reached)
            if self.beacon_held and state.may_beacon(now):
                # Before the done check: a producer without stores is done as soon
                # as it may beacon, and must not stay silent for good.
                self.beacon_held = False
                self.call_soon(lambda: self._send_beacon(time.monotonic()))
            if state.done(now):
                break
            if state.may_beacon(now) and now - asked_at >= 0.2:
                asked_at = now
                self._send_locked(get_heads)
            time.sleep(0.02)
        next_offset, error = state.decide()
        if error is not None:
            failing = [r for writing, r, _ in list(self.store_status.values()) if not writing]
            if failing and state.duplicate is None:
                error += "; " + "; ".join(failing)
            log.error("producer %s of %s refuses to publish: %s", self.address, self.topic, error)
            self._resume_error = ResumeError(error)
            return  # beacons stay held after a duplicate: the other process keeps the partition
        with self._lock:
            if next_offset != self.window.next:
                self.window = UnackedWindow(self.window.capacity, next_offset, ring=not self.acks)
            self._resume_state = None
            self._resumed_at = time.monotonic()
            if self._reserving:
                self._reserved = next_offset  # nothing more until it is reserved anew
        if self._outbox is not None:
            self._outbox.resumed(self.window)
        hole = state.hole if state.reserved is not None else None
        self._hole = hole
        if hole is not None:
            log.warning(
                "producer %s: offsets %d..%d of %s were reserved by a run that did not close"
                " cleanly; a store that did not answer may hold some of them, so they are never"
                " assigned again (readers skip what nobody has after their skip_after)",
                self.address,
                hole[0],
                hole[1],
                self.topic,
            )
        elif state.head is not None and next_offset < state.saved_next:
            log.warning(
                "producer %s: offsets %d..%d of %s were published before the restart but no store"
                " has them; they are assigned again",
                self.address,
                next_offset,
                state.saved_next - 1,
                self.topic,
            )
        log.info(
            "producer %s resumes %s at offset %d (store head %s)",
            self.address,
            self.topic,
            next_offset,
            state.head,
        )
        if self._reserving:
            self._extend_reservation(next_offset + self._reserve_block)
        else:
            self._save_identity(force=True)

    def interest(self) -> beacon.Interest:
        """Stores and the consumers of our topic; while an identity may have a
        live twin (resuming, and on probation after), the producers of our
        topic too, to hear beacons with our address."""
        return beacon.Interest.producer(self.topic, watch_peers=self._watching_twins())

    def _watching_twins(self) -> bool:
        if getattr(self, "_identity_path", None) is None:
            return False
        resumed = getattr(self, "_resumed_at", None)
        return resumed is None or time.monotonic() - resumed < PROBATION * self.config.beacon_interval

    def _check_twin_watch(self, now: float) -> None:
        """Timer: stop hearing other producers' beacons once probation is over."""
        if self.peers.interest.watch_peers and not self._watching_twins():
            self.refresh_interest()

    def on_duplicate_address(self, endpoint: str) -> None:
        state = self._resume_state
        if state is not None:
            state.on_duplicate(endpoint)
        elif (
            self._resumed_at is not None
            and self._resume_error is None
            and time.monotonic() - self._resumed_at < PROBATION * self.config.beacon_interval
        ):
            # We only just resumed: we are the newcomer. Stop, leave the partition to the other.
            self._resume_error = ResumeError(
                f"another live producer uses this identity (beacons from {endpoint}), noticed just"
                " after this one resumed: it stops publishing"
            )
            self.beacon_held = True
            log.error("producer %s of %s: %s", self.address, self.topic, self._resume_error)
        super().on_duplicate_address(endpoint)

    def _load_identity(self) -> dict[str, Any] | None:
        path = self._identity_path
        assert path is not None
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"identity file {path} is unreadable: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(
                f"identity file {path} is not a producer identity: a JSON object was expected,"
                f" not {type(data).__name__}"
            )
        if data.get("topic") != self.topic:
            raise ValueError(f"identity file {path} belongs to topic {data.get('topic')!r}")
        if not isinstance(data.get("address"), str):
            raise ValueError(f"identity file {path} has no valid address: {data.get('address')!r}")
        for key, optional in (("acked", False), ("next", False), ("reserved", True)):
            value = data.get(key)
            if value is None and optional:
                continue
            if type(value) is not int or value < -1 or value >= NO_RESERVATION:
                raise ValueError(f"identity file {path}: {key!r} must be an offset, not {value!r}")
        return data

    def _save_identity(self, force: bool = False) -> None:
        path = self._identity_path
        if path is None or self._resume_state is not None or self._resume_error is not None:
            return  # not resumed (yet): the file may belong to a live twin; keep it as it is
        acked = self.window.acked
        now = time.monotonic()
        # Throttled: an fsync per ACK would slow the I/O thread down.
        if not force and (acked == self._last_saved or now - self._saved_at < 0.5):
            return
        self._last_saved = acked
        self._saved_at = now
        with self._identity_lock:
            try:
                self._write_identity(self._reserved if self._reserving else None)
            except OSError:
                log.exception("cannot save producer identity to %s", path)

    def _write_identity(self, reserved: int | None) -> None:
        """Write the identity file durably (identity lock held): temp file, fsync, rename, fsync dir."""
        path = self._identity_path
        assert path is not None
        data: dict[str, Any] = {
            "address": self.address,
            "topic": self.topic,
            "acked": self.window.acked,
            "next": self.window.next,
        }
        if reserved is not None:
            data["reserved"] = reserved
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        try:
            fd = os.open(path.parent, os.O_RDONLY)
        except OSError:
            return  # (a platform without directory fsync)
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- reservation

    def _extend_reservation(self, upto: int) -> OSError | None:
        """Make ``upto`` the durable bound of assignable offsets; the error if it cannot be saved."""
        if self._resume_state is not None or self._resume_error is not None:
            return OSError("not resumed")  # the file may belong to a live twin
        with self._identity_lock:
            if upto <= self._reserved:
                return None
            try:
                self._write_identity(upto)
            except OSError as exc:
                self._reserve_failures += 1
                if self._reserve_failures <= 20 or self._reserve_failures % 1000 == 0:
                    log.error(
                        "producer %s: cannot reserve offsets up to %d in identity file %s: %s"
                        " (publish fails once the reserved ones are used)",
                        self.address[:8],
                        upto,
                        self._identity_path,
                        exc,
                    )
                return exc
            self._reserved = upto
            self._last_saved = self.window.acked
            self._saved_at = time.monotonic()
        return None

    def _reserve_locked(self, n: int) -> None:
        """A publish of ``n`` records outran the reservation (lock held): reserve now or raise."""
        if self._resume_error is not None:
            raise self._resume_error
        # Renewed here rather than by the I/O thread: the block was too small for this rate.
        self._reserve_block = min(self._reserve_block * 2, RESERVE_MAX)
        error = self._extend_reservation(self.window.next + n + self._reserve_block)
        if error is not None:
            raise PublishError(
                f"cannot reserve offsets in identity file {self._identity_path}: {error};"
                " nothing of it was published"
            )

    def _renew_reservation(self, now: float) -> None:
        """I/O thread: size the block by the publish rate; renew it once half is used."""
        if self._resume_state is not None or self._resume_error is not None or self._closed:
            return
        nxt = self.window.next
        if now - self._rate_at >= RESERVE_RATE_INTERVAL:
            if self._rate_at:
                rate = (nxt - self._rate_next) / (now - self._rate_at)
                block = int(rate * RESERVE_SECONDS)
                # Grow at once with the rate; shrink slowly (holes stay small at low rates).
                self._reserve_block = max(RESERVE_MIN, min(RESERVE_MAX, max(block, self._reserve_block // 2)))
            self._rate_at, self._rate_next = now, nxt
        if self._reserved - nxt < self._reserve_block // 2:
            self._extend_reservation(nxt + self._reserve_block)
