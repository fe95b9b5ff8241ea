"""Leaf readers, sans-IO: a device reads a topic over its leaf connection.

A second session kind on a leaf connection (see ``docs/concepts/leaves.md``,
"Leaf consumers"), next to the producer's (:mod:`dafka.core.leaf`).  Two plain
objects, no sockets, no clocks, no database (times are passed in; what the
endpoint holds is asked of callables):

:class:`ReadPort` (endpoint side)
    A LEAF-READ names a topic; the reader then reads *every* partition of it
    the endpoint holds (up to ``max_partitions``, the first in the database's key order; a partition
    that appears later is added while there is room).  The endpoint answers
    LEAF-READING (the partitions, their first and last offsets, and the most
    records it answers a FETCH with), then, after each commit of a partition the
    reader reads, pushes the new records (:class:`Serve`: the shell reads them
    from the database and sends DIRECT-RECORDs), or a DIRECT-HEAD when more
    than ``max_push`` came in one commit (the reader FETCHes them).  The ROUTER
    never blocks: what a slow reader's queue cannot take is dropped, a gap the
    reader FETCHes.  FETCHes of the reader's partitions are answered from the
    database, at most ``max_answer`` records each, at most ``fetch_rate`` a
    second per connection (a burst of as many), LEAF-READs counted with them:
    beyond it they are dropped and counted (the reader asks again).  Bounded: reader sessions per connection
    (``max_per_connection``, one per topic), in all (``max_sessions``, the one
    heard from longest ago dropped beyond it), partitions per session,
    records per push and per answer; a session silent for ``idle`` seconds is
    forgotten (a reader says LEAF-READ again every few seconds).

:class:`LeafReader` (device side)
    The reader of one topic: its partitions' delivery state
    (:class:`~dafka.core.gaps.PartitionTracker`: in order, no gap, no
    duplicate, FETCH what is missing), the LEAF-READ to send on a new
    connection and again after ``poll_interval`` without a word from the
    endpoint (which finds a lost last record and a dead endpoint), and, when it
    has a connection of its own, failover to the next endpoint when a
    LEAF-READ is not answered within ``connect_timeout``.  Its position
    (the next offset of each partition) comes in from the caller (a restart
    resumes there) and is read back with :meth:`LeafReader.positions`.

The device keeps the position: the endpoint keeps no reader state that
matters across a restart (a session says where to push from, nothing more).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dafka.core import leafwire, wire
from dafka.core.gaps import PartitionTracker
from dafka.core.leaf import Connect, Reply, Send, Serve
from dafka.errors import ProtocolError

MAX_READ_SESSIONS = 20_000  # reader sessions of a port in all
MAX_PER_CONNECTION = 4  # topics one connection reads
MAX_PARTITIONS = 64  # partitions of a topic one session reads
MAX_PUSH = 32  # records pushed per partition per commit (beyond: a DIRECT-HEAD, the reader FETCHes)
MAX_ANSWER = 32  # records one FETCH is answered with (below the port's SNDHWM of 64 messages)
MAX_ANSWER_BYTES = 256 * 1024  # bytes of contents one answer or push holds (at least one record)
FETCH_RATE = 50.0  # FETCHes answered per second per connection (a burst of as many)
POLL_INTERVAL = 5.0  # seconds of silence from the endpoint before a reader says LEAF-READ again
CONNECT_TIMEOUT = 5.0  # seconds a LEAF-READ may wait for LEAF-READING before the next endpoint
MAX_BACKOFF = 8
MIN_DWELL = 1.0
READ_AGAIN = "no reader session: send LEAF-READ"


ReadAction = Reply | Serve


@dataclass(slots=True)
class ReadSession:
    """One reader session (a connection reading one topic) at the endpoint."""

    peer: bytes
    reader: str  # the reader's address: DIRECT-RECORDs and DIRECT-HEADs go to it
    subject: str
    pushed: dict[str, int] = field(default_factory=dict)  # partition -> last offset pushed or announced
    seen: float = 0.0


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class ReadPort:
    """The endpoint side of leaf readers (see the module docstring).

    ``partitions(subject, limit)`` lists (at most ``limit`` of) the partitions the store
    holds of a topic as ``(partition, first, last)`` sorted by partition; ``may_read(key, subject)``
    whether a connection (CURVE key, "" in plain mode) may read a topic;
    ``strike(peer, why)`` counts a hostile message of a connection (the leaf
    port's count: shared with the producer session's).
    """

    def __init__(
        self,
        partitions: Callable[[str, int], list[tuple[str, int, int]]],
        *,
        may_read: Callable[[str, str], bool] = lambda key, subject: True,
        strike: Callable[[bytes, str], object] = lambda peer, why: None,
        address: str = "",
        max_sessions: int = MAX_READ_SESSIONS,
        max_per_connection: int = MAX_PER_CONNECTION,
        max_partitions: int = MAX_PARTITIONS,
        max_push: int = MAX_PUSH,
        max_answer: int = MAX_ANSWER,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        fetch_rate: float = FETCH_RATE,
        idle: float = 300.0,
    ) -> None:
        self.partitions = partitions
        self.may_read = may_read
        self.strike = strike
        self.address = address
        self.max_sessions = max_sessions
        self.max_per_connection = max_per_connection
        self.max_partitions = max_partitions
        self.max_push = max_push
        self.max_answer = max_answer
        self.max_answer_bytes = max_answer_bytes
        self.fetch_rate = fetch_rate
        self.idle = idle
        self.sessions: OrderedDict[tuple[bytes, str], ReadSession] = OrderedDict()  # least recently heard first
        self.by_subject: dict[str, dict[tuple[bytes, str], ReadSession]] = {}
        self.per_peer: dict[bytes, int] = {}
        self.buckets: dict[bytes, _Bucket] = {}  # FETCH budget per connection (one per live reader peer)
        self.reads = 0  # LEAF-READs answered
        self.refused = 0  # LEAF-READs refused (topic not kept, not allowed, too many on the connection)
        self.fetches = 0  # FETCHes answered
        self.fetches_dropped = 0  # over the connection's FETCH rate
        self.reads_dropped = 0  # LEAF-READs over the same rate (they share it)
        self.unknown = 0  # FETCHes without a session, or of a partition the session does not read
        self.pushed = 0  # records pushed after commits
        self.heads_sent = 0  # DIRECT-HEADs instead of a push (a commit of more than max_push)
        self.partitions_over = 0  # partitions not read: a session reads max_partitions
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.sessions)

    # ------------------------------------------------------------ input

    def on_read(
        self, peer: bytes, msg: leafwire.LeafRead, now: float, peer_key: str = "", keeps: bool = True
    ) -> list[ReadAction]:
        """A LEAF-READ from connection ``peer`` (``keeps``: the store keeps the topic)."""
        if not msg.subject or not msg.topic or len(msg.topic.encode()) > wire.MAX_STRING:
            self.strike(peer, "LEAF-READ without a topic or a reader address")
            return []
        key = (peer, msg.subject)
        session = self.sessions.get(key)
        why = ""
        if not keeps:
            why = f"store {self.address[:8]} does not keep topic {msg.subject[:64]!r}"
        elif not self.may_read(peer_key, msg.subject):
            why = f"topic {msg.subject[:64]!r} may not be read by this connection's key"
            self.strike(peer, why)
        elif session is None and self.per_peer.get(peer, 0) >= self.max_per_connection:
            why = f"a connection reads at most {self.max_per_connection} topics"
            self.strike(peer, why)
        if why:
            self.refused += 1
            status = wire.StoreStatus(msg.topic, self.address, msg.subject, 0, wire.reason_text(why))
            return [Reply(peer, wire.encode(status))]
        if not self._spend(peer, now):
            self.reads_dropped += 1
            return []  # a LEAF-READ flood: each lists partitions from the database; asked again later
        if session is not None and session.reader != msg.topic:
            self._drop(key)  # the same topic under a new reader address: a new session
            session = None
        if session is None:
            while len(self.sessions) >= self.max_sessions:
                self._drop(next(iter(self.sessions)))
                self.evicted += 1
            session = ReadSession(peer, msg.topic, msg.subject)
            self.sessions[key] = session
            self.by_subject.setdefault(msg.subject, {})[key] = session
            self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        else:
            self.sessions.move_to_end(key)
        session.seen = now
        listed: list[leafwire.ReadPartition] = []
        pushed: dict[str, int] = {}
        held = self.partitions(msg.subject, self.max_partitions + 1)  # (one more: whether there are more)
        for partition, first, last in held[: self.max_partitions]:
            listed.append(leafwire.ReadPartition(partition, first, last))
            pushed[partition] = last  # the reader FETCHes up to here, pushes follow from here
        if len(held) > self.max_partitions:
            self.partitions_over += 1
        session.pushed = pushed
        self.reads += 1
        reading = leafwire.LeafReading(msg.topic, msg.subject, self.max_answer, tuple(listed))
        return [Reply(peer, leafwire.encode(reading))]

    def on_fetch(self, peer: bytes, msg: wire.Fetch, now: float) -> list[ReadAction]:
        """A FETCH from connection ``peer``: answered from the database if it is one of its reader's partitions."""
        session = self.sessions.get((peer, msg.subject))
        if session is None:
            # Its session is gone (the endpoint restarted, the session expired or was dropped
            # for a newer one): say LEAF-READ again.  Answers to connections without a
            # session share one budget (no state per stranger).
            self.unknown += 1
            if not self._spend(b"", now):
                return []
            status = wire.StoreStatus(msg.address, self.address, msg.subject, 0, READ_AGAIN)
            return [Reply(peer, wire.encode(status))]
        if session.reader != msg.address:
            self.strike(peer, "a FETCH for another reader than the connection's")
            return []
        if msg.topic not in session.pushed:
            # A partition this endpoint does not hold (yet), or beyond max_partitions: an
            # honest reader that failed over from an endpoint that holds it asks this.
            self.unknown += 1
            return []
        if msg.count == 0:
            return []
        if not self._spend(peer, now):
            self.fetches_dropped += 1
            return []  # asked again by a reader that needs it
        session.seen = now
        self.sessions.move_to_end((peer, msg.subject))
        self.fetches += 1
        count = min(msg.count, self.max_answer)
        return [Serve(peer, session.reader, msg.subject, msg.topic, msg.sequence, count, self.max_answer_bytes)]

    def _spend(self, peer: bytes, now: float) -> bool:
        """Take one of the connection's FETCH / LEAF-READ tokens (``fetch_rate`` a second, a burst of as many)."""
        bucket = self.buckets.get(peer)
        if bucket is None:
            bucket = self.buckets[peer] = _Bucket(self.fetch_rate, now)
        bucket.tokens = min(self.fetch_rate, bucket.tokens + (now - bucket.at) * self.fetch_rate)
        bucket.at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    # ------------------------------------------------------------ commits and time

    def on_commit(self, heads: dict[tuple[str, str], int]) -> list[ReadAction]:
        """The store committed these heads: push the new records to the sessions reading them."""
        by_subject = self.by_subject
        if not by_subject:
            return []
        out: list[ReadAction] = []
        for (subject, partition), head in heads.items():
            readers = by_subject.get(subject)
            if not readers:
                continue
            for session in readers.values():
                pushed = session.pushed
                last = pushed.get(partition)
                if last is None:
                    if len(pushed) >= self.max_partitions:
                        self.partitions_over += 1
                        continue
                    last = -1  # a partition new to the session: from its first record
                if head <= last:
                    continue
                pushed[partition] = head
                n = head - last
                if n <= self.max_push:
                    self.pushed += n
                    out.append(Serve(session.peer, session.reader, subject, partition, last + 1, n,
                                     self.max_answer_bytes))
                else:
                    self.heads_sent += 1
                    direct = wire.DirectHead(session.reader, partition, subject, head)
                    out.append(Reply(session.peer, wire.encode(direct)))
        return out

    def expire(self, now: float) -> int:
        """Forget sessions silent for ``idle`` seconds (least recently heard first); how many."""
        sessions = self.sessions
        n = 0
        while sessions:
            key = next(iter(sessions))
            if now - sessions[key].seen < self.idle:
                break
            self._drop(key)
            n += 1
        return n

    def drop_peer(self, peer: bytes) -> None:
        """Forget every session of a connection (it was found hostile)."""
        for key in [k for k in self.sessions if k[0] == peer] if peer in self.per_peer else []:
            self._drop(key)

    def _drop(self, key: tuple[bytes, str]) -> None:
        session = self.sessions.pop(key, None)
        if session is None:
            return
        readers = self.by_subject.get(session.subject)
        if readers is not None:
            readers.pop(key, None)
            if not readers:
                del self.by_subject[session.subject]
        n = self.per_peer.get(session.peer, 1) - 1
        if n > 0:
            self.per_peer[session.peer] = n
        else:
            self.per_peer.pop(session.peer, None)
            self.buckets.pop(session.peer, None)


# ---------------------------------------------------------------- device side

@dataclass(slots=True)
class Failover:
    """The endpoint does not answer: the owner of the connection (a producer the reader
    rides) should move to its next endpoint."""


ReaderAction = Connect | Send | Failover
READING, ACTIVE = "reading", "active"


class LeafReader:
    """The device side of a reader (see the module docstring).

    ``positions``: the next offset of each partition to deliver (a restart's
    saved position); a partition without one starts at its first held record
    (``earliest``) or after its last (``latest``).  ``endpoints``: the reader
    has a connection of its own and fails over between them; ``None``: it
    rides another session's connection (:meth:`connected` is called on each
    new one, and the owner decides failover).

    Call :meth:`start` (own connection) or :meth:`connected`, then
    :meth:`on_message` with each message for this reader, and :meth:`on_tick`
    now and then; delivered records are appended to the ``out`` list given, as
    ``(partition, offset, content)``.
    """

    def __init__(
        self,
        subject: str,
        address: str,
        endpoints: list[str] | None = None,
        *,
        positions: dict[str, int] | None = None,
        earliest: bool = True,
        poll_interval: float = POLL_INTERVAL,
        connect_timeout: float = CONNECT_TIMEOUT,
        retry_interval: float = 0.5,
        skip_after: float = 10.0,
        max_held: int = 1_000,
        max_partitions: int = 256,
    ) -> None:
        if endpoints is not None and not endpoints:
            raise ValueError("a reader with a connection of its own needs at least one endpoint")
        self.subject = subject
        self.address = address
        self.endpoints = list(endpoints) if endpoints is not None else None
        self.start_positions = dict(positions or {})
        self.earliest = earliest
        self.poll_interval = poll_interval
        self.connect_timeout = connect_timeout
        self.retry_interval = retry_interval
        self.skip_after = skip_after
        self.max_held = max_held
        self.max_partitions = max_partitions
        self.trackers: dict[str, PartitionTracker] = {}
        self.state = READING
        self.index = -1
        self.read_at = 0.0  # when the last LEAF-READ went out
        self.give_up_at = float("inf")
        self.heard_at = 0.0
        self.max_answer = MAX_ANSWER
        self.backoff = 1
        self.failovers = 0
        self.bad_input = 0
        self.skipped = 0  # offsets given up (retention removed them, or a hole nobody fills)
        self.status: tuple[bool, str] | None = None  # the endpoint's last STORE-STATUS for this reader
        self._read_frames = leafwire.encode(leafwire.LeafRead(address, subject))

    @property
    def endpoint(self) -> str:
        return self.endpoints[self.index] if self.endpoints else ""

    # ------------------------------------------------------------ connections

    def start(self, now: float) -> list[ReaderAction]:
        """Connect to the first endpoint (a reader with a connection of its own)."""
        return self._connect(0, now)

    def _connect(self, index: int, now: float) -> list[ReaderAction]:
        assert self.endpoints is not None
        self.index = index % len(self.endpoints)
        return [Connect(self.endpoints[self.index]), *self.connected(now)]

    def connected(self, now: float) -> list[ReaderAction]:
        """A new connection (or the same after a refusal): say LEAF-READ on it."""
        self.state = READING
        self.status = None
        return self._read(now, self.connect_timeout * self.backoff)

    def _read(self, now: float, wait: float) -> list[ReaderAction]:
        self.read_at = now
        self.give_up_at = now + wait
        return [Send(list(self._read_frames))]

    def failover(self, now: float) -> list[ReaderAction]:
        """Give the current endpoint up: the next one (own connection), doubling the timeouts.

        Riding another session's connection: after a refusal (the endpoint is alive,
        it only does not let us read) say LEAF-READ again later; after silence ask
        the connection's owner to fail over (:class:`Failover`), and say it again."""
        self.failovers += 1
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        if self.endpoints is None:
            refused = self.status is not None and not self.status[0]
            return self.connected(now) if refused else [Failover(), *self.connected(now)]
        return self._connect(self.index + 1, now)

    # ------------------------------------------------------------ input

    def on_message(self, frames: list[bytes], now: float, out: list[tuple[str, int, bytes]]) -> list[ReaderAction]:
        """A message from the endpoint; deliverable records are appended to ``out``."""
        try:
            msg = leafwire.decode(frames)
        except ProtocolError:
            self.bad_input += 1
            return []
        if isinstance(msg, wire.DirectRecord | wire.DirectRecordBatch | wire.DirectHead | leafwire.LeafReading | wire.StoreStatus):
            if msg.topic != self.address or msg.subject != self.subject:
                self.bad_input += 1
                return []
        else:
            self.bad_input += 1
            return []
        self.heard_at = now
        if isinstance(msg, leafwire.LeafReading):
            return self._on_reading(msg, now, out)
        if isinstance(msg, wire.StoreStatus):
            if not msg.writing and msg.reason == READ_AGAIN:
                # The endpoint lost our session (it restarted, or expired it): say it again here.
                return [] if self.state == READING else self.connected(now)
            self.status = (bool(msg.writing), msg.reason)
            if not msg.writing:
                # Refused (not kept, not allowed, too many): the next endpoint once the dwell is over.
                self.state = READING
                self.give_up_at = min(self.give_up_at, max(now, self.read_at + MIN_DWELL))
            return []
        tracker = self._tracker(msg.address, None, now)
        if tracker is None:
            return []
        if isinstance(msg, wire.DirectHead):
            tracker.on_head(msg.sequence)
            return self._fetch(tracker, now)
        delivered: list[tuple[int, bytes]] = []
        if isinstance(msg, wire.DirectRecord):
            missing = tracker.on_record(msg.sequence, msg.content, delivered)
        else:
            missing = False
            for i, content in enumerate(msg.contents):
                missing = tracker.on_record(msg.sequence + i, content, delivered)
        partition = msg.address
        out.extend((partition, seq, content) for seq, content in delivered)
        if missing and (tracker.held or tracker.next is not None and tracker.next > tracker.fetch_upto):
            return self._fetch(tracker, now)
        return []

    def _on_reading(self, msg: leafwire.LeafReading, now: float, out: list[tuple[str, int, bytes]]) -> list[ReaderAction]:
        self.state = ACTIVE
        self.give_up_at = float("inf")
        self.backoff = 1
        self.status = None
        self.max_answer = max(1, msg.max_answer)
        sends: list[ReaderAction] = []
        for p in msg.partitions:
            tracker = self._tracker(p.partition, p, now)
            if tracker is None or p.last < 0:
                continue
            tracker.on_head(p.last)
            sends.extend(self._fetch(tracker, now))
        return sends

    def _tracker(self, partition: str, listed: leafwire.ReadPartition | None, now: float) -> PartitionTracker | None:
        tracker = self.trackers.get(partition)
        if tracker is not None:
            return tracker
        if not partition or len(self.trackers) >= self.max_partitions:
            self.bad_input += 1
            return None
        start = self.start_positions.get(partition)
        if start is None:
            if listed is None or self.earliest:
                # Earliest, or a partition that appeared after the LEAF-READ: from its first record.
                start = listed.first if listed is not None and listed.last >= 0 else 0
            else:
                start = listed.last + 1
        tracker = PartitionTracker(self.subject, partition, start, max_held=self.max_held,
                                   retry_interval=self.retry_interval, skip_after=self.skip_after)
        tracker.progress_at = now
        self.trackers[partition] = tracker
        return tracker

    def _fetch(self, tracker: PartitionTracker, now: float) -> list[ReaderAction]:
        if self.state != ACTIVE:
            return []
        request = tracker.fetch_request(now)
        if request is None:
            return []
        first, count = request
        count = min(count, self.max_answer)  # the endpoint answers no more: ask for the rest after
        tracker.fetch_upto = first + count - 1
        fetch = wire.Fetch(tracker.address, self.address, self.subject, first, count)
        return [Send(wire.encode(fetch))]

    # ------------------------------------------------------------ time

    def next_due(self) -> float:
        """When :meth:`on_tick` next has something to do (at the latest)."""
        if self.state == READING:
            return self.give_up_at
        due = self.heard_at + self.poll_interval
        if any(t.missing for t in self.trackers.values()):
            due = min(due, self.heard_at + self.retry_interval)
        return due

    def on_tick(self, now: float, out: list[tuple[str, int, bytes]]) -> list[ReaderAction]:
        """Failover, LEAF-READ again after silence, FETCH retries, holes given up."""
        if self.state == READING:
            if now >= self.give_up_at:
                return self.failover(now)
            return []
        if now - max(self.heard_at, self.read_at) >= self.poll_interval:
            # Silence: say LEAF-READ again (its answer lists the heads: a lost last record
            # is found; no answer within connect_timeout: the endpoint is gone).
            self.state = READING
            return self._read(now, self.connect_timeout * self.backoff)
        sends: list[ReaderAction] = []
        for partition, tracker in self.trackers.items():
            if not tracker.missing:
                continue
            delivered: list[tuple[int, bytes]] = []
            skipped = tracker.skip_if_stalled(now, delivered)
            if skipped is not None:
                self.skipped += skipped[1] - skipped[0] + 1
                out.extend((partition, seq, content) for seq, content in delivered)
            sends.extend(self._fetch(tracker, now))
        return sends

    def positions(self) -> dict[str, int]:
        """The next offset to deliver of each partition (of those the reader met, and those it was given)."""
        got = dict(self.start_positions)
        for partition, tracker in self.trackers.items():
            if tracker.next is not None:
                got[partition] = tracker.next
        return got

