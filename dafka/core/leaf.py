"""Leaf sessions, sans-IO: the device's link to its endpoints, and the endpoint's port.

See ``docs/concepts/leaves.md`` for the protocol.  Two plain objects, no
sockets and no clocks (times are passed in):

:class:`LeafLink` (device side)
    Which endpoint to talk to, the session's state (HELLO sent / welcomed),
    which offsets of the producer's :class:`~dafka.core.unacked.UnackedWindow`
    to send next (never more than the endpoint's window beyond the last ACK),
    when to send a HEAD, and when to give an endpoint up and fail over to the
    next one (no WELCOME within ``connect_timeout``; no ACK progress within
    ``ack_timeout`` while records wait).  The shell opens the connection a
    :class:`Connect` names and sends what a :class:`Send` holds.

:class:`LeafPort` (endpoint side)
    One session per connection (routing id): the HELLO names the partition;
    records and HEADs of that partition are taken (:class:`Take`) and relayed
    (:class:`Relay`); ACKs (:class:`Reply`) follow the store's commits, capped at
    what the session sent; everything else is hostile, counted per connection,
    and a connection that sends ``bad_limit`` of them is ignored from then on.
    Bounded: sessions (``max_sessions``; beyond it the one silent longest is
    dropped: the shell bounds live connections, so it is most likely one whose
    connection is gone), records in flight per session (``window``), record
    size, the connections remembered as bad.  A record or HEAD from a
    connection without a session (dropped, or expired) is answered
    STORE-STATUS ``writing=0``: the leaf says HELLO again.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dafka.core import leafwire, wire
from dafka.core.unacked import UnackedWindow
from dafka.errors import ProtocolError

CONNECT_TIMEOUT = 5.0  # seconds from a connect to the WELCOME before the next endpoint is tried
ACK_TIMEOUT = 10.0  # seconds records may wait without ACK progress before the next endpoint is tried
MIN_DWELL = 1.0  # seconds an endpoint is kept at least (one that refuses is not hammered)
HEAD_INTERVAL = 1.0  # seconds between HEADs while records wait for an ACK
MAX_BACKOFF = 8  # most the timeouts are multiplied by after failovers without progress
MAX_HEAD_WAIT = 4  # most head_interval is multiplied by between HEADs without ACK progress

WINDOW = 1_000  # records a leaf may have unacknowledged on one connection
MAX_SESSIONS = 20_000
BAD_LIMIT = 16  # hostile messages from one connection before it is ignored
IDLE = 300.0  # seconds a silent session is kept
BAD_REMEMBERED = 4_096  # connections with strikes (or ignored) remembered at most
NO_SESSION = "no session: send LEAF-HELLO"
RESEND = "a hole here: send LEAF-HELLO and your unacknowledged records again"
RESEND_WAIT = 1.0  # seconds before a session is first asked again to send what fills a hole
MAX_RESEND_WAIT = 32.0  # the longest wait (it doubles while the ACK does not move)
_U64 = struct.Struct(">Q")


@dataclass(slots=True)
class Connect:
    """Close the current connection (if any) and connect to ``endpoint``."""

    endpoint: str


@dataclass(slots=True)
class Send:
    """Send these frames on the current connection."""

    frames: list[bytes]


LinkAction = Connect | Send

HELLO, ACTIVE = "hello", "active"


class LeafLink:
    """The device side of a leaf connection (see the module docstring).

    ``window`` is the producer's window (shared: the producer pushes into it,
    the link acknowledges).  Call :meth:`start` once, then :meth:`on_message`
    with each message received, :meth:`on_tick` now and then, and
    :meth:`sendable` / :meth:`sent` to send records.
    """

    def __init__(
        self,
        topic: str,
        address: str,
        window: UnackedWindow,
        endpoints: list[str],
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        ack_timeout: float = ACK_TIMEOUT,
        head_interval: float = HEAD_INTERVAL,
        min_dwell: float = MIN_DWELL,
        resumed: tuple[int, int, str] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a leaf needs at least one endpoint")
        self.topic = topic
        self.address = address
        self.window = window
        self.endpoints = list(endpoints)
        self.connect_timeout = connect_timeout
        self.ack_timeout = ack_timeout
        self.head_interval = head_interval
        self.min_dwell = min_dwell
        self.index = -1
        self.state = HELLO
        self.connected_at = 0.0
        self.give_up_at = 0.0
        self.credit = 0  # the endpoint's window (0 until welcomed)
        self.max_record_bytes = 0
        self.sent_upto = -1  # highest offset sent on this connection
        self.waiting_since: float | None = None  # records wait for an ACK since (progress resets it)
        self.head_at = 0.0
        # Seconds from the last send or HEAD to the next HEAD: head_interval, doubled
        # after each HEAD without ACK progress (up to MAX_HEAD_WAIT): an endpoint that is
        # only behind is not sent a HEAD a second by every leaf waiting on it.
        self.head_wait = head_interval
        self.failovers = 0
        self.backoff = 1  # multiplies the timeouts after failovers without progress
        self.bad_input = 0  # messages from the endpoint that do not decode or do not fit
        self.bad_acks = 0  # ACKs beyond what was published
        self.status: tuple[bool, str] | None = None  # the endpoint's last STORE-STATUS (writing, reason)
        self.welcomed_held = -1  # the endpoint's head at the WELCOME
        # A restart from an identity file: (acked, next, endpoint) as the file had them, the
        # endpoint the only one that may have acknowledged beyond ``acked`` (see on_message).
        self.resumed = resumed if resumed is not None and resumed[0] + 1 < resumed[1] else None
        # The restart hole, once known: ``(first, last)``, offsets this run never publishes
        # and no endpoint acknowledged; stated (VOID kind 1) after each WELCOME.
        self.restart_hole: tuple[int, int] | None = None
        # An ACK of this partition as endpoints send it, up to the sequence: most of
        # what a leaf hears, recognised without decoding (as the port's records are).
        self._ack_prefix = wire.encode(wire.Ack(address, topic, 0))[0][:-8]

    @property
    def endpoint(self) -> str:
        return self.endpoints[self.index]

    def start(self, now: float) -> list[LinkAction]:
        """Connect to the first endpoint."""
        return self._connect(0, now)

    def _connect(self, index: int, now: float) -> list[LinkAction]:
        self.index = index % len(self.endpoints)
        return [Connect(self.endpoint), *self._hello(now)]

    def _hello(self, now: float) -> list[LinkAction]:
        self.state = HELLO
        self.connected_at = now
        self.give_up_at = now + self.connect_timeout * self.backoff  # without a WELCOME by then: the next endpoint
        self.credit = 0
        self.sent_upto = self.window.acked  # everything unacknowledged goes again
        self.waiting_since = None
        self.head_wait = self.head_interval
        self.status = None
        hello = leafwire.LeafHello(self.address, self.topic, self.window.acked, self.window.next)
        return [Send(leafwire.encode(hello))]

    def failover(self, now: float) -> list[LinkAction]:
        """Give the current endpoint up: connect to the next one.

        Each failover without ACK progress since the last one doubles the
        timeouts (up to ``MAX_BACKOFF`` times): endpoints that are only slow
        (overloaded) are not made slower by every leaf reconnecting and sending
        its window again; progress resets them.
        """
        self.failovers += 1
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        return self._connect(self.index + 1, now)

    def on_message(self, frames: list[bytes], now: float) -> list[LinkAction]:
        """A message from the endpoint; returns what to do (an ACK may free room: see ``window``)."""
        if len(frames) == 1 and self.state == ACTIVE:
            frame, prefix = frames[0], self._ack_prefix
            if len(frame) == len(prefix) + 8 and frame.startswith(prefix):
                return self._on_ack(_U64.unpack_from(frame, len(prefix))[0], now)
        try:
            msg = leafwire.decode(frames)
        except ProtocolError:
            self.bad_input += 1
            return []
        if isinstance(msg, leafwire.LeafWelcome):
            if msg.topic != self.address or msg.subject != self.topic or msg.window < 1:
                self.bad_input += 1
                return []
            self.state = ACTIVE
            self.credit = msg.window
            self.max_record_bytes = msg.max_record_bytes
            self.welcomed_held = msg.held
            self.sent_upto = self.window.acked
            self.waiting_since = now if len(self.window) else None
            return self._restart_void(msg.held)
        if isinstance(msg, wire.Ack):
            if msg.topic != self.address or msg.subject != self.topic or self.state != ACTIVE:
                self.bad_input += 1
                return []
            return self._on_ack(msg.sequence, now)
        if isinstance(msg, wire.StoreStatus):
            if msg.topic != self.address:
                self.bad_input += 1
                return []
            self.status = (bool(msg.writing), msg.reason)
            if not msg.writing and self.state == ACTIVE:
                # No session there any more, or it stopped writing: HELLO again on this
                # connection (a refusal of it then moves on to the next endpoint).
                return self._hello(now)
            if not msg.writing and self.state == HELLO:
                # Refused (cannot write, full): try the next one once the dwell is over.
                self.give_up_at = min(self.give_up_at, max(now, self.connected_at + self.min_dwell))
            return []
        self.bad_input += 1  # a leaf's own messages coming back
        return []

    def _restart_void(self, held: int) -> list[LinkAction]:
        """After a WELCOME: state the restart hole, once it is known (VOID kind 1).

        A leaf restarted from its identity file continues at the reservation; the
        offsets between what the previous run may have had acknowledged and the
        reservation are a hole that no run ever publishes from now on.  Which
        were acknowledged?  Those up to the file's ``acked``, and beyond it only
        by the endpoint the file names (the file is written before any record
        goes to a new endpoint), whose committed head (the WELCOME's ``held``)
        covers every ACK it sent.  So the hole is known at a WELCOME from that
        endpoint: ``max(acked, held) + 1 .. next - 1``; it holds no acknowledged
        record.  From then on it is stated to every endpoint welcoming us, which
        answers readers' FETCHes of it with it, so they pass it at once rather
        than after ``skip_after``.  Before such a WELCOME (another endpoint
        first, or a file that names none) nothing is stated.
        """
        resumed = self.resumed
        if resumed is not None and self.endpoint == resumed[2]:
            self.resumed = None
            first, last = max(resumed[0], held) + 1, resumed[1] - 1
            if first <= last:
                self.restart_hole = (first, last)
        hole = self.restart_hole
        if hole is None:
            return []
        void = wire.Void(self.address, self.address, self.topic, hole[0], hole[1], self.address, wire.VOID_RESTART)
        return [Send(leafwire.encode(void))]

    def _on_ack(self, sequence: int, now: float) -> list[LinkAction]:
        window = self.window
        if sequence >= window.next:
            self.bad_acks += 1
            return []
        if window.ack(sequence):
            self.waiting_since = now if sequence < window.next - 1 else None  # (records still wait)
            self.backoff = 1
            self.head_at = now  # a HEAD goes only when ACKs stall (it asks for the ACK again)
            self.head_wait = self.head_interval
        return []

    def next_due(self) -> float | None:
        """When :meth:`on_tick` may next have something to do (None: not before
        something else happens, a publish or a message)."""
        if self.state == HELLO:
            return self.give_up_at
        window = self.window
        if window.acked == window.next - 1:
            return None  # (nothing waits for an ACK: the window is empty)
        due = self.head_at + self.head_wait  # (a HEAD, or at least a look, while records wait)
        if self.waiting_since is not None:
            due = min(due, self.waiting_since + self.ack_timeout * self.backoff)
        return due

    def sendable(self) -> tuple[int, int] | None:
        """The offsets to send now, ``(first, last)``, or None."""
        if self.state != ACTIVE:
            return None
        first = max(self.sent_upto, self.window.acked) + 1
        last = min(self.window.next - 1, self.window.acked + self.credit)
        return (first, last) if first <= last else None

    def sent(self, last: int, now: float) -> None:
        """Offsets up to ``last`` went out."""
        self.sent_upto = max(self.sent_upto, last)
        if self.waiting_since is None:
            self.waiting_since = now
        self.head_at = now

    def on_tick(self, now: float) -> list[LinkAction]:
        """Failover when an endpoint does not welcome or acknowledge in time; HEADs while waiting."""
        if self.state == HELLO:
            if now >= self.give_up_at:
                return self.failover(now)
            return []
        if len(self.window) == 0:
            self.waiting_since = None
            return []
        if self.waiting_since is not None and now - self.waiting_since >= self.ack_timeout * self.backoff:
            return self.failover(now)
        if now - self.head_at >= self.head_wait and self.sent_upto >= 0:
            self.head_at = now
            self.head_wait = min(self.head_wait * 2, MAX_HEAD_WAIT * self.head_interval)
            head = wire.Head(self.topic, self.address, self.topic, self.sent_upto)
            return [Send(leafwire.encode(head))]
        return []


# ---------------------------------------------------------------- endpoint side


@dataclass(slots=True)
class Reply:
    """Send ``frames`` to the connection ``peer`` (its routing id)."""

    peer: bytes
    frames: list[bytes]


@dataclass(slots=True)
class Take:
    """Store this record of a leaf's partition (as a mesh record of it would be)."""

    subject: str
    partition: str
    sequence: int
    content: bytes


@dataclass(slots=True)
class Relay:
    """Publish these frames (a RECORD or HEAD, as a mesh producer sends it) on the mesh."""

    frames: list[bytes]


@dataclass(slots=True)
class RestartHole:
    """A leaf's restart hole (its VOID kind 1, checked): no run of it publishes
    ``first .. last`` from now on, and none of them was acknowledged.  The store
    passes it (its own partition reader) and states it to readers that FETCH it."""

    subject: str
    partition: str
    first: int
    last: int


@dataclass(slots=True)
class Serve:
    """Send ``peer`` the records ``first .. first+count-1`` of a partition (those held,
    from the first held at or after ``first``, without a hole) as DIRECT-RECORDs to
    ``reader``, at most ``max_bytes`` of contents (at least one record).  A leaf
    reader's push or FETCH answer (:mod:`dafka.core.leafread`)."""

    peer: bytes
    reader: str
    subject: str
    partition: str
    first: int
    count: int
    max_bytes: int


PortAction = Reply | Take | Relay | Serve | RestartHole


class ReadSessions(Protocol):
    """The reader sessions a port serves beside its producers' (a
    :class:`dafka.core.leafread.ReadPort`, which builds on this module)."""

    def on_read(
        self, peer: bytes, msg: leafwire.LeafRead, now: float, peer_key: str = "", keeps: bool = True
    ) -> Sequence[PortAction]: ...
    def on_fetch(self, peer: bytes, msg: wire.Fetch, now: float) -> Sequence[PortAction]: ...
    def drop_peer(self, peer: bytes) -> None: ...



@dataclass(slots=True)
class LeafSession:
    """One leaf connection's state at the endpoint."""

    peer: bytes
    subject: str
    partition: str
    base: int  # offsets up to this are acknowledged (the HELLO's acked, then ours)
    high: int = -1  # highest offset received on this connection
    acked: int = -1  # highest ACK sent on this connection
    seen: float = 0.0
    prefix: bytes = b""  # a RECORD's first frame up to the sequence, as the leaf sends it
    ack_prefix: bytes = b""  # an ACK's frame up to the sequence
    resend_at: float = float("-inf")  # when it may next be asked to send again (a hole caps its ACK)
    resend_wait: float = RESEND_WAIT
    limit: int = 0  # the HELLO's next: offsets at or beyond it are not the leaf's yet


class LeafPort:
    """The endpoint side of the leaf port (see the module docstring).

    ``head(subject, partition)`` is the store's committed head (-1: none);
    ``refusal()`` says why the store cannot take records now ("" when it can);
    ``keeps(subject)`` whether it keeps that topic at all (a HELLO of another is refused);
    ``authorize(key, partition)`` (secure mode) whether the connection's CURVE key owns the
    HELLO's partition (else the HELLO is refused, and counts as hostile).

    Holes (``dafka.store.holes``), as for a mesh producer: ``cap(subject,
    partition, ack)`` is the ACK the store may give (never past a recorded hole
    the leaf may still hold).  A leaf cannot be sent a FETCH; it is asked instead
    to send again from its last ACK (STORE-STATUS ``writing=0`` with
    :data:`RESEND`: it says HELLO and sends every unacknowledged record), when a
    hole caps an ACK below what it sent, at most once per ``resend_wait``
    (doubling while the ACK does not move).  A HELLO's ``acked`` says the leaf
    holds nothing up to there (an endpoint acknowledged it):
    ``acked_elsewhere(subject, partition, acked)`` tells the store, whose holes
    up to there then cap the leaf's ACKs no more.
    """

    def __init__(
        self,
        head: Callable[[str, str], int],
        *,
        refusal: Callable[[], str] = lambda: "",
        max_sessions: int = MAX_SESSIONS,
        window: int = WINDOW,
        max_record_bytes: int = 1 << 20,
        bad_limit: int = BAD_LIMIT,
        idle: float = IDLE,
        address: str = "",
        keeps: Callable[[str], bool] = lambda subject: True,
        authorize: Callable[[str, str], bool] | None = None,
        cap: Callable[[str, str, int], int] | None = None,
        acked_elsewhere: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.head = head
        self.refusal = refusal
        self.keeps = keeps  # whether the store keeps a subject (a store may keep a subset of topics)
        self.authorize = authorize  # secure mode: whether a key (Z85) owns a partition address
        self.unauthorized = 0  # HELLOs for a partition the connection's key does not own
        self.cap = cap
        self.acked_elsewhere = acked_elsewhere
        self.resends = 0  # sessions asked to send again (a hole capped their ACK)
        # Leaves' restart holes, stated to readers that FETCH them: (subject, partition) ->
        # (first, last); bounded (max_sessions, the oldest stated forgotten first).
        self.restart_holes: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        self.max_sessions = max_sessions
        self.window = window
        self.max_record_bytes = max_record_bytes
        self.bad_limit = bad_limit
        self.idle = idle
        self.address = address  # the store's, for STORE-STATUS
        self.sessions: OrderedDict[bytes, LeafSession] = OrderedDict()  # least recently heard first
        self.by_partition: dict[tuple[str, str], bytes] = {}
        self.strikes: OrderedDict[bytes, int] = OrderedDict()  # bounded: BAD_REMEMBERED
        self.ignored: OrderedDict[bytes, None] = OrderedDict()  # bounded: BAD_REMEMBERED
        self.bad = 0  # hostile messages
        self.over_window = 0  # records beyond a session's window (dropped)
        self.refused = 0  # HELLOs refused (the store cannot write)
        self.evicted = 0  # sessions dropped for a new one (max_sessions)
        self.unknown = 0  # records and HEADs from connections without a session
        self.taken = 0
        self.acks = 0
        self.last_error = ""
        # Readers on leaf connections (dafka.core.leafread), when the endpoint serves them.
        self.reads: ReadSessions | None = None

    def __len__(self) -> int:
        return len(self.sessions)

    # ------------------------------------------------------------ input

    def on_message(self, peer: bytes, frames: list[bytes], now: float, peer_key: str = "") -> list[PortAction]:
        """A message from connection ``peer`` (whose CURVE key is ``peer_key``, in secure mode); what to do."""
        session = self.sessions.get(peer)
        if session is not None and len(frames) == 2:
            # The common case first: the session's next record, recognised by its
            # header (frame-exact, as the mesh's drain does), no decoding.
            head = frames[0]
            prefix = session.prefix
            if len(head) == len(prefix) + 8 and head.startswith(prefix):
                return self._record(session, _U64.unpack_from(head, len(prefix))[0], frames, now)
        if peer in self.ignored:
            self.bad += 1
            return []
        try:
            msg = leafwire.decode(frames)
        except ProtocolError as exc:
            return self._strike(peer, str(exc))
        if isinstance(msg, leafwire.LeafHello):
            return self._hello(peer, msg, session, now, peer_key)
        if isinstance(msg, leafwire.LeafRead | wire.Fetch):
            # A reader's (a second session kind on the same connection).
            reads = self.reads
            if reads is None:
                return self._strike(peer, "this endpoint serves no leaf readers")
            if isinstance(msg, wire.Fetch):
                return list(reads.on_fetch(peer, msg, now))
            return list(reads.on_read(peer, msg, now, peer_key, keeps=self.keeps(msg.subject)))
        if session is None:
            if isinstance(msg, wire.Record | wire.RecordBatch | wire.Head):
                # Its session was dropped (expired, or the port was full): HELLO again.
                self.unknown += 1
                status = wire.StoreStatus(msg.address, self.address, msg.subject, 0, NO_SESSION)
                return [Reply(peer, wire.encode(status))]
            return self._strike(peer, f"{type(msg).__name__} before LEAF-HELLO")
        session.seen = now
        self.sessions.move_to_end(peer)
        if isinstance(msg, wire.Record | wire.RecordBatch):
            if msg.address != session.partition or msg.subject != session.subject or msg.topic != msg.subject:
                return self._strike(peer, "a record of another partition than the HELLO's")
            if isinstance(msg, wire.Record):
                # (a header the fast path did not recognise: any other encoding of the same record)
                return self._record(session, msg.sequence, wire.encode(msg), now)
            contents = msg.contents
            if any(len(c) > self.max_record_bytes for c in contents):
                return self._strike(peer, f"a record over {self.max_record_bytes} bytes")
            last = msg.sequence + len(contents) - 1
            if last > session.base + self.window:
                self.over_window += 1
                return []  # beyond the window it was given: dropped
            out: list[PortAction] = []
            for i, content in enumerate(contents):
                seq = msg.sequence + i
                out.append(Take(session.subject, session.partition, seq, content))
                out.append(Relay(wire.encode(wire.Record(session.subject, session.partition, session.subject, seq, content))))
            self.taken += len(contents)
            session.high = max(session.high, last)
            out.extend(self._ack(session, self.head(session.subject, session.partition), False, now))
            return out
        if isinstance(msg, wire.Head):
            if msg.address != session.partition or msg.subject != session.subject or msg.topic != msg.subject:
                return self._strike(peer, "a HEAD of another partition than the HELLO's")
            out = [Relay(frames)]
            # A HEAD asks again for the ACK (one may have been dropped: a full send queue).
            out.extend(self._ack(session, min(self.head(session.subject, session.partition), msg.sequence), True, now))
            return out
        if isinstance(msg, wire.Void):
            return self._restart_hole(session, msg)
        return self._strike(peer, f"{type(msg).__name__} has no place from a leaf")

    def _restart_hole(self, session: LeafSession, msg: wire.Void) -> list[PortAction]:
        """A leaf states its restart hole (see :meth:`LeafLink._restart_void`).

        Only its own partition's, kind 1, below its HELLO's ``next``; what this
        endpoint committed of it is cut off the front (an acknowledged record is
        never in a stated hole: an honest leaf says so only after our WELCOME's
        head, which this re-checks)."""
        partition, subject = session.partition, session.subject
        if (msg.kind != wire.VOID_RESTART or msg.address != partition or msg.source != partition
                or msg.subject != subject):
            return self._strike(session.peer, "a VOID other than the leaf's own restart hole")
        if msg.last >= session.limit:
            return self._strike(session.peer, f"a restart hole up to {msg.last}, at or past the HELLO's next")
        first = max(msg.first, self.head(subject, partition) + 1)
        if first > msg.last:
            return []
        key = (subject, partition)
        holes = self.restart_holes
        if holes.get(key) == (first, msg.last):
            return []  # said again (each WELCOME): nothing new
        holes[key] = (first, msg.last)
        holes.move_to_end(key)
        while len(holes) > self.max_sessions:
            holes.popitem(last=False)
        return [RestartHole(subject, partition, first, msg.last)]

    def _record(self, session: LeafSession, seq: int, frames: list[bytes], now: float) -> list[PortAction]:
        """One record of the session's partition (``frames`` as a mesh RECORD has them)."""
        content = frames[1]
        if len(content) > self.max_record_bytes:
            return self._strike(session.peer, f"a record over {self.max_record_bytes} bytes")
        if seq > session.base + self.window:
            self.over_window += 1
            return []  # beyond the window it was given: dropped (an honest leaf never sends it)
        session.seen = now
        self.taken += 1
        if seq > session.high:
            session.high = seq
        self.sessions.move_to_end(session.peer)
        out: list[PortAction] = [Take(session.subject, session.partition, seq, content), Relay(frames)]
        if seq <= session.acked:
            return out
        head = self.head(session.subject, session.partition)
        if seq <= head:
            out.extend(self._ack(session, head, False, now))  # committed already (a resend): acknowledged at once
        return out

    def _hello(
        self, peer: bytes, msg: leafwire.LeafHello, session: LeafSession | None, now: float, peer_key: str = ""
    ) -> list[PortAction]:
        if not msg.subject or not msg.topic or len(msg.topic.encode()) > wire.MAX_STRING:
            return self._strike(peer, "LEAF-HELLO without a subject, or a partition address of 0 or over 255 bytes")
        if self.authorize is not None and not self.authorize(peer_key, msg.topic):
            # Secure mode: a key writes only the partitions bound to it, as on the mesh.
            self.unauthorized += 1
            out = self._strike(peer, f"LEAF-HELLO for partition {msg.topic[:40]!r}, not bound to the connection's key")
            if peer in self.ignored:
                return out
            why = f"partition {msg.topic[:40]} is not bound to this connection's key"
            return [Reply(peer, wire.encode(wire.StoreStatus(msg.topic, self.address, msg.subject, 0, why)))]
        if session is not None and (session.subject, session.partition) != (msg.subject, msg.topic):
            return self._strike(peer, "a second partition on one connection")
        why = self.refusal()
        if not why and not self.keeps(msg.subject):
            why = f"store {self.address[:8]} does not keep topic {msg.subject[:64]!r}"
        if why:
            self.refused += 1
            status = wire.StoreStatus(msg.topic, self.address, msg.subject, 0, wire.reason_text(why))
            return [Reply(peer, wire.encode(status))]
        key = (msg.subject, msg.topic)
        old = self.by_partition.get(key)
        if old is not None and old != peer:
            self.sessions.pop(old, None)  # the leaf came back on a new connection
        if session is None:
            while len(self.sessions) >= self.max_sessions:
                self._drop(next(iter(self.sessions)))  # silent longest
                self.evicted += 1
            prefix = wire.record_prefix(wire.RECORD, msg.subject, msg.topic, msg.subject)
            session = LeafSession(peer, msg.subject, msg.topic, msg.acked, prefix=prefix)
            self.sessions[peer] = session
        else:
            self.sessions.move_to_end(peer)
        session.base = max(session.base, msg.acked)
        session.limit = msg.next
        session.seen = now
        self.by_partition[key] = peer
        if msg.acked >= 0 and self.acked_elsewhere is not None:
            self.acked_elsewhere(msg.subject, msg.topic, msg.acked)  # it holds none of them
        held = self.head(msg.subject, msg.topic)
        welcome = leafwire.LeafWelcome(msg.topic, msg.subject, held, self.window, self.max_record_bytes)
        return [Reply(peer, leafwire.encode(welcome))]

    def _strike(self, peer: bytes, why: str) -> list[PortAction]:
        self.bad += 1
        self.last_error = why
        strikes = self.strikes
        n = strikes.pop(peer, 0) + 1
        if n >= self.bad_limit:
            self._ignore(peer)
            return []
        strikes[peer] = n
        while len(strikes) > BAD_REMEMBERED:
            strikes.popitem(last=False)
        return []

    def _ignore(self, peer: bytes) -> None:
        self.strikes.pop(peer, None)
        self._drop(peer)
        if self.reads is not None:
            self.reads.drop_peer(peer)
        self.ignored[peer] = None
        while len(self.ignored) > BAD_REMEMBERED:
            self.ignored.popitem(last=False)

    def _drop(self, peer: bytes) -> None:
        session = self.sessions.pop(peer, None)
        if session is not None and self.by_partition.get((session.subject, session.partition)) == peer:
            del self.by_partition[(session.subject, session.partition)]

    # ------------------------------------------------------------ commits and time

    def _ack(self, session: LeafSession, head: int, again: bool = False, now: float | None = None) -> list[PortAction]:
        ack = min(head, session.high)
        resend: list[PortAction] = []
        if self.cap is not None and ack >= 0:
            capped = self.cap(session.subject, session.partition, ack)
            if capped < ack:
                ack = capped
                if now is not None and now >= session.resend_at:
                    # It may hold what the hole lacks, and sent it already on this
                    # connection: ask it to send everything unacknowledged again.
                    session.resend_at = now + session.resend_wait
                    session.resend_wait = min(session.resend_wait * 2, MAX_RESEND_WAIT)
                    self.resends += 1
                    status = wire.StoreStatus(session.partition, self.address, session.subject, 0, RESEND)
                    resend.append(Reply(session.peer, wire.encode(status)))  # after the ACK
        if ack < 0 or ack < session.acked or (ack == session.acked and not again):
            return resend
        if ack > session.acked:
            session.resend_wait = RESEND_WAIT  # progress
        session.acked = ack
        session.base = max(session.base, ack)
        self.acks += 1
        if not session.ack_prefix:
            session.ack_prefix = wire.encode(wire.Ack(session.partition, session.subject, 0))[0][:-8]
        return [Reply(session.peer, [session.ack_prefix + _U64.pack(ack)]), *resend]

    def on_commit(self, heads: dict[tuple[str, str], int]) -> list[PortAction]:
        """The store committed (synced) these heads: ACK the sessions of those partitions."""
        out: list[PortAction] = []
        by_partition, sessions = self.by_partition, self.sessions
        for key, head in heads.items():
            peer = by_partition.get(key)
            if peer is not None:
                out.extend(self._ack(sessions[peer], head))
        return out

    def expire(self, now: float) -> int:
        """Forget sessions silent for ``idle`` seconds; how many.

        Sessions are kept least recently heard first, so this looks at those
        that expire and one more: a port of 100,000 quiet sessions pays nothing
        per tick for them."""
        sessions = self.sessions
        n = 0
        while sessions:
            peer = next(iter(sessions))
            if now - sessions[peer].seen < self.idle:
                break
            self._drop(peer)
            n += 1
        return n
