"""What consumers and stores share: assembling partitions from RECORDs.

A :class:`PartitionReader` keeps one :class:`PartitionTracker` per (subject,
partition), recognises a known partition's RECORD / DIRECT-RECORD by its header
prefix, turns arrivals and HEADs into in-order records, FETCHes what is missing
(with retries) and skips forward over holes nobody can fill.  Subclasses say
where in-order records go (:meth:`emit`) and how a new partition starts
(:meth:`new_tracker`).

The per-record fast path (a known partition's next record) runs inside
:func:`dafka.fastio.drain_records`, frame-exact, a batch per call; each
subclass's ``_read_data`` only says what item a record becomes.

A record whose content is longer than the node's ``max_record_bytes`` is
dropped and counted (:attr:`PartitionReader.records_dropped_too_large`), never
delivered nor stored: a hole in its partition (see
:meth:`~dafka.core.gaps.PartitionTracker.drop_too_large`).
"""

from __future__ import annotations

import time
from collections.abc import Collection

import zmq

from dafka import fastio
from dafka.core import wire
from dafka.core.gaps import PartitionTracker
from dafka.errors import ProtocolError
from dafka.nodes import security
from dafka.nodes.node import Node
from dafka.store.layout import MAX_OFFSET
from dafka.tank.mapping import shown

NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags are slower
READER_STALL = 1.0  # seconds between two checks of the holes that say the I/O thread was starved
BEHIND_GRACE = 10.0  # seconds a reader with data waiting at every tick holds its holes open
# A hole whose producer does not hear our FETCHes (see owner_hears) waits at
# most this many times skip_after since its last progress: the producer may be
# hostile, or reach no publisher of ours, and must not hold it open forever.
UNHEARD_LIMIT = 10
_RECORDS = wire.Record | wire.DirectRecord | wire.RecordBatch | wire.DirectRecordBatch
_BATCHES = wire.RecordBatch | wire.DirectRecordBatch


def unheard_may_wait(tracker: PartitionTracker, now: float) -> bool:
    """Whether a hole of a producer that does not hear our FETCHes may still wait
    for it (bounded: see UNHEARD_LIMIT)."""
    return now - tracker.progress_at < UNHEARD_LIMIT * tracker.skip_after


class PartitionReader(Node):
    """Base of Consumer and Store (see the module docstring)."""

    publisher_type = zmq.XPUB

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._trackers: dict[tuple[str, str], PartitionTracker] = {}
        # Header prefix (everything before the sequence) of a known partition's
        # RECORD and DIRECT-RECORD -> its tracker: one dict lookup per record.
        self._by_prefix: dict[bytes, PartitionTracker] = {}
        # Trackers with records missing, in the order they went missing (a dict:
        # FETCHes then go out in an order that does not depend on memory addresses).
        self._missing: dict[PartitionTracker, None] = {}
        self._out: list[tuple[int, bytes]] = []
        self.fetches_sent = 0
        self._caught_up_at = time.monotonic()  # the last tick that found no data waiting
        self._checked_at = time.monotonic()  # the last check_missing
        self.max_record_bytes = self.config.max_record_bytes
        self.records_dropped_too_large = 0  # records over max_record_bytes from the mesh
        self.compacted_passed = 0  # offsets passed because a store compacted them away (VOID kind 2)

    # ---------------------------------------------------------------- hooks

    def new_tracker(self, subject: str, partition: str) -> PartitionTracker:
        """The tracker of a partition seen for the first time."""
        raise NotImplementedError

    def emit(self, tracker: PartitionTracker, records: list[tuple[int, bytes]]) -> None:
        """In-order records of ``tracker``'s partition, ready to deliver or store."""
        raise NotImplementedError

    def wants(self, subject: str) -> bool:
        """Whether records and heads of ``subject`` concern this node."""
        return True

    def owns(self, subject: str, partition: str) -> bool:
        """Whether this node itself writes that partition (a gateway's own partitions)."""
        return False

    def on_skipped(self, tracker: PartitionTracker, first: int, last: int) -> None:
        """Offsets ``first..last`` could not be had and were skipped."""

    def on_other(self, msg: wire.Message) -> None:
        """A valid message that is neither a record nor a head."""

    def on_too_large_skipped(self, tracker: PartitionTracker, seq: int) -> None:
        """Offset ``seq`` was skipped: its record is over ``max_record_bytes``."""

    def on_producer_head(self, tracker: PartitionTracker, sequence: int) -> None:
        """The partition's producer says its last offset is ``sequence`` (a HEAD)."""

    # A store's own word counts: it holds none of what it is missing (see
    # PartitionTracker.pass_restart_hole).
    holds_records = False

    def known_stores(self) -> Collection[str]:
        """Addresses of the stores this reader knows (alive): a restarted producer's
        hole is passed at once when all of them said they hold none of it.
        Readers that do not keep them return none (the hole waits skip_after)."""
        return ()

    def _pass_restart_hole(self, tracker: PartitionTracker, now: float) -> None:
        out = self._out
        passed = tracker.pass_restart_hole(now, self.known_stores(), out, own_word=self.holds_records)
        if passed is None:
            return
        self.on_skipped(tracker, *passed)
        if out:
            self.emit(tracker, out)
            out.clear()
        if tracker.missing:
            self._missing[tracker] = None

    def void_believed(self, msg: wire.Void) -> bool:
        """Whether a VOID addressed to us may be acted on.

        Kind 1 (a restart hole) only in the partition's producer's name: its source
        is the partition.  In secure mode the peer's key must also own that
        partition (its address is bound to the key), or be a store's while the
        partition's owner is no peer of ours: a leaf's endpoint states its restart
        hole for it, as it relays its RECORDs and HEADs (see ``dafka.core.leaf``);
        a producer on the mesh speaks for itself; kind 0 only from a store's key, and
        for the store whose address is bound to it (one store cannot answer
        for another); kind 2 (compacted away) likewise.  Anything else is ignored, counted as a forgery: the
        hole then waits skip_after as before.
        """
        if msg.topic != self.address:
            return False
        restart = msg.kind == wire.VOID_RESTART
        if restart and msg.source != msg.address:
            return False  # only the partition's producer speaks for its partition
        if self.keys is None:
            return True
        sender = self.sender
        if sender is not None and (
            (security.address_bound(msg.source, sender.key) and (restart or self.from_store))
            or (restart and self.from_store and msg.address not in self.peers)
        ):
            return True
        self.forged += 1
        if self.forged <= 20 or self.forged % 1000 == 0:
            self.log.warning(
                "ignored a forged VOID (kind %d, %s) of partition %s from peer %s: %s; %d so far",
                msg.kind,
                shown(msg.source),
                shown(msg.address),
                "?" if sender is None else sender.address,
                "its key does not own the partition" if restart else "not a store's key, or another store's address",
                self.forged,
            )
        return False

    def on_void(self, msg: wire.Void) -> None:
        """VOID: a store holds none of a range we FETCHed, or the partition's producer
        says it is its restart hole (see PartitionTracker.pass_restart_hole)."""
        if self.void_believed(msg):
            self.on_believed_void(msg)

    def on_believed_void(self, msg: wire.Void) -> None:
        """A VOID :meth:`void_believed` let through."""
        tracker = self._trackers.get((msg.subject, msg.address))
        if tracker is None:
            return  # a FETCH of ours makes a tracker first
        if msg.kind == wire.VOID_RESTART:
            tracker.on_restart_hole(msg.first, msg.last)
        elif msg.kind == wire.VOID_COMPACTED:
            out = self._out
            passed = tracker.pass_compacted(msg.first, msg.last, time.monotonic(), out)
            if passed is not None:
                self.compacted_passed += passed[1] - passed[0] + 1
                if self.holds_records:
                    # A store records the gap as a hole, as after skip_after (another store may
                    # still hold those records: hole repair asks), without waiting for it.
                    self.on_skipped(tracker, *passed)
                if out:
                    self.emit(tracker, out)
                    out.clear()
                if tracker.missing:
                    self._missing[tracker] = None
            return
        else:
            tracker.on_store_void(msg.source, msg.first, msg.last)
        if tracker.missing:
            self._pass_restart_hole(tracker, time.monotonic())

    # ---------------------------------------------------------------- trackers

    def _read_data(self) -> None:
        if self._held:
            self._handle_held(None)
        self.read_data(self.sub, self._by_prefix)

    def on_held(self, frames: list[bytes]) -> None:
        self.on_message(frames)  # the slow path handles every kind of message

    def forget_prefix(self, prefix: bytes) -> None:
        """A record header prefix no longer names a tracker (nor, in secure mode, on any channel)."""
        self._by_prefix.pop(prefix, None)
        for channel in self._channels.values():
            channel.prefixes.pop(prefix, None)

    def tracker(self, subject: str, partition: str) -> PartitionTracker:
        key = (subject, partition)
        tracker = self._trackers.get(key)
        if tracker is None:
            tracker = self.new_tracker(subject, partition)
            self._trackers[key] = tracker
            prefixes = wire.record_prefixes
            for prefix in (
                *prefixes(wire.RECORD, subject, partition, subject),
                *prefixes(wire.DIRECT_RECORD, self.address, partition, subject),
            ):
                self._by_prefix[prefix] = tracker
        return tracker

    def track(self, tracker: PartitionTracker, seq: int, content: bytes) -> None:
        """A record outside the fast path: gaps, held records, FETCHes."""
        if seq > MAX_OFFSET:
            self.bad_input("record", f"offset {seq} of {shown(tracker.subject)}/{tracker.address} is past 2^63")
            return
        out = self._out
        missing = tracker.on_record(seq, content, out)
        if out:
            self.emit(tracker, out)
            out.clear()
        if missing:
            self._missing[tracker] = None  # fetch_missing asks at the end of this drain

    def too_large(self, tracker: PartitionTracker, seq: int, size: int) -> None:
        """A record over ``max_record_bytes``: dropped, counted, logged at a low rate; a hole."""
        self.records_dropped_too_large += 1
        n = self.records_dropped_too_large
        if n <= 20 or n % 1000 == 0:
            self.log.warning(
                "%s %s: dropped record %d of %s/%s: %d bytes is more than max_record_bytes=%d"
                " (it is skipped: a hole for this node); %d dropped so far",
                self.kind,
                self.address[:8],
                seq,
                shown(tracker.subject),
                shown(tracker.address),
                size,
                self.max_record_bytes,
                n,
            )
        out = self._out
        if tracker.drop_too_large(seq, out):
            self.on_too_large_skipped(tracker, seq)
        if out:
            self.emit(tracker, out)
            out.clear()
        if tracker.missing:
            self._missing[tracker] = None  # fetch_missing asks at the end of this drain

    def on_cut(self) -> None:
        """A peer's connection was cut for a frame over the size limit: a record
        was lost unseen.  Partitions missing records now skip one offset at a
        time when they stall (see :attr:`~dafka.core.gaps.PartitionTracker.cut`)."""
        for tracker in self._missing:
            tracker.cut = True

    def maybe_fetch(self, tracker: PartitionTracker, now: float) -> None:
        request = tracker.fetch_request(now)
        if request is not None:
            self.send(wire.Fetch(tracker.address, self.address, tracker.subject, *request))
            self.fetches_sent += 1

    def fetch_missing(self) -> None:
        """After a drain: FETCH what every partition with missing records needs, if due.

        Called once per drain rather than per record, so a burst of out-of-order
        records or HEADs costs one FETCH decision per partition.
        """
        now = time.monotonic()
        for tracker in self._missing:
            self.maybe_fetch(tracker, now)

    def owner_hears(self, partition: str) -> bool:
        """Whether a partition's producer could answer our FETCHes, if alive (see
        :meth:`PartitionTracker.unheard`): readers that do not know say yes."""
        return True

    def retry_missing_now(self) -> None:
        """Someone new answers FETCHes: retry every missing range at once."""
        for tracker in self._missing:
            tracker.retry_now()

    def check_missing(self, now: float) -> None:
        """Timer: re-send stalled FETCHes, skip holes nobody can fill."""
        gap, self._checked_at = now - self._checked_at, now
        if not self._missing:
            self._caught_up_at = now
            return
        if gap > max(READER_STALL, 4 * self.tick_interval()):
            # The I/O thread could not act for a while (starved): the time it
            # could not ask for its holes does not count toward giving them up.
            # Bounded as for a deaf producer: a reader late at every check
            # still gives a hole up.
            for tracker in self._missing:
                if unheard_may_wait(tracker, now):
                    tracker.unheard(now)
        out = self._out
        done = []
        # The answers may be waiting unread (a busy I/O thread): no hole is
        # given up on this tick then, or its records would come just after.
        # Bounded: a reader that never catches up still gives holes up.
        behind = self.data_waiting()
        if not behind:
            self._caught_up_at = now
        elif now - self._caught_up_at >= BEHIND_GRACE:
            behind = False
        for tracker in self._missing:
            if not tracker.missing:
                done.append(tracker)
                continue
            if not self.owner_hears(tracker.address) and unheard_may_wait(tracker, now):
                tracker.unheard(now)
            if tracker.restart_hole is not None:
                self._pass_restart_hole(tracker, now)  # a store known since may have answered
            skipped = None if behind else tracker.skip_if_stalled(now, out)
            if skipped is not None:
                self.on_skipped(tracker, *skipped)
                if out:
                    self.emit(tracker, out)
                    out.clear()
            self.maybe_fetch(tracker, now)
        for tracker in done:
            self._missing.pop(tracker, None)

    # ---------------------------------------------------------------- messages

    def send(self, msg: wire.Message) -> None:
        """Publish ``msg``; a full reader queue drops it (every sender retries)."""
        try:
            fastio.send_frames(self.publisher, wire.encode(msg))
        except zmq.ZMQError as exc:
            self.log.debug("could not send %s: %s", type(msg).__name__, exc)

    def decode_frames(self, frames: list[bytes]) -> wire.Message | None:
        """Decode one whole message; None (counted as bad input) if malformed."""
        try:
            return wire.decode(frames)
        except ProtocolError as exc:
            self.bad_input("message", exc)
            return None

    def on_message(self, frames: list[bytes]) -> None:
        """Anything that is not a known partition's next record (the slow path)."""
        if self.sender is not None and not self.screen(frames):
            return  # secure mode: a store-only message from a key without a store role
        msg = self.decode_frames(frames)
        if msg is None:
            return
        if isinstance(msg, _RECORDS | wire.Head | wire.DirectHead):
            # RECORD/HEAD go to the topic, DIRECT-* to us; the subject is
            # checked exactly because ZeroMQ subscriptions match prefixes.
            direct = isinstance(msg, wire.DirectRecord | wire.DirectRecordBatch | wire.DirectHead)
            if msg.topic != (self.address if direct else msg.subject) or not self.wants(msg.subject):
                return
            if self.owns(msg.subject, msg.address):
                return  # our own partition: we write it, nobody else fills it in
            last = msg.sequence + (len(msg.contents) - 1 if isinstance(msg, _BATCHES) else 0)
            if last > MAX_OFFSET:
                # Kafka readers (and anything signed 64-bit) could not take it: refused where it
                # enters, before it names a partition or moves a head.
                self.bad_input(type(msg).__name__, f"offset {last} of {shown(msg.subject)}/{shown(msg.address)}"
                               " is past 2^63")
                return
            if isinstance(msg, wire.DirectHead) and self.untrusted():
                return  # secure mode: only a store's DIRECT-HEAD is believed
            sender = self.sender
            if sender is not None and not self.may_write(frames[0][0], msg.address):
                return  # secure mode: neither the partition's owner nor a store
            tracker = self.tracker(msg.subject, msg.address)
            if sender is not None and not isinstance(msg, wire.Head | wire.DirectHead):
                # This peer's next records of the partition take the fast path.
                sender.prefixes[bytes(frames[0][:-8])] = tracker
            limit = self.max_record_bytes
            if isinstance(msg, wire.Record | wire.DirectRecord):
                if len(msg.content) > limit:
                    self.too_large(tracker, msg.sequence, len(msg.content))
                else:
                    self.track(tracker, msg.sequence, msg.content)
                return
            if isinstance(msg, wire.RecordBatch | wire.DirectRecordBatch):
                for i, content in enumerate(msg.contents):
                    if len(content) > limit:
                        self.too_large(tracker, msg.sequence + i, len(content))
                    else:
                        self.track(tracker, msg.sequence + i, content)
                return
            if tracker.on_head(msg.sequence):
                self._missing[tracker] = None  # fetch_missing asks at the end of this drain
            if isinstance(msg, wire.Head):
                self.on_producer_head(tracker, msg.sequence)
        elif isinstance(msg, wire.Void):
            self.on_void(msg)
        else:
            self.on_other(msg)
