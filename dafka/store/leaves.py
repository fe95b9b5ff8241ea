"""The store's leaf port: leaf devices dial it over one DEALER/ROUTER connection each.

The I/O shell around :class:`dafka.core.leaf.LeafPort` (the decisions), run in
the store's I/O thread (see ``docs/concepts/leaves.md``):

* a ROUTER bound on ``HOST:PORT`` in a ZeroMQ context of its own, whose ZAP
  handler (polled here) refuses a handshake while ``max_connections`` are
  open (counted from the socket's monitor: accepted minus disconnected);
  ``ZMQ_MAXMSGSIZE`` cuts a connection that sends a frame over the record
  size limit, ``ZMQ_RCVHWM`` stops reading a connection whose queue is full,
  ``ZMQ_SNDHWM`` bounds what a leaf that does not read holds (the ROUTER
  drops beyond it; ACKs are cumulative and repeated);
* a leaf's records enter the store where the mesh's do (its partition's
  tracker), so they are ordered, committed and acknowledged alike; each record
  and HEAD is relayed unchanged on the store's data publisher, so the mesh sees
  the leaf's partition as any producer's;
* after each commit the sessions of the committed partitions get their ACK.

Leaf *readers* (:mod:`dafka.core.leafread`) are a second session kind on the
same connections: a LEAF-READ names a topic; after each commit the new records
of its partitions are pushed to the sessions reading it, and their FETCHes
answered, both read from the store's database here (a few records each,
bounded).  Who may read what: ``read_topics`` (``[store] leaf_read``), topic
patterns (``fnmatch``; ``{key}`` stands for the connection's CURVE key);
``None``: every topic the store keeps in plain mode, none in secure mode.

In a secure store (``[security]``) the ROUTER is a CURVE server with the
store's key; the ZAP handler also refuses a client key that is not in the
allow-list, and names the key (``User-Id``) of each connection, so a HELLO is
taken only for a partition address bound to the key of its connection
(:func:`dafka.nodes.security.address_bound`): a key writes only its own
partitions, as on the mesh.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq
import zmq.utils.z85

from dafka.core import leaf, leafread, wire
from dafka.errors import ConfigError
from dafka.fastio import recv_messages, send_frames
from dafka.nodes import security
from dafka.nodes.node import frame_limit
from dafka.store.db import StorageError
from dafka.store.layout import value_content

log = logging.getLogger("dafka.store.leaves")

MAX_CONNECTIONS = 20_000
RCVHWM = 256  # messages queued per connection before libzmq stops reading it
SNDHWM = 64  # messages (ACKs, WELCOMEs) queued for a leaf that does not read
DRAIN = 2048  # messages read before the loop looks at the other sockets
LINGER_BELOW = 64  # a read of fewer messages than this is small: the port rests (see read)
TICK = 0.5
UNREADABLE_STEPS = 8  # damaged stored blocks in a row one reader's answer goes on past (see _read)
HOLE_WATCH = 60.0  # seconds a leaf's stated restart hole is watched for records beyond it (see _pass_holes)
ZAP_DOMAIN = b"dafka-leaves"
_EVENT = struct.Struct("=HI")
_COUNTED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
NOBLOCK = int(zmq.NOBLOCK)
RCVMORE = int(zmq.RCVMORE)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (PORT 0: any free port) as (host, port); ConfigError if not."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"a leaf endpoint is HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def read_policy(patterns: Sequence[str] | None, secure: bool) -> Callable[[str, str], bool]:
    """Whether a connection (its CURVE key, Z85; "" in plain mode) may read a topic.

    ``patterns``: ``fnmatch`` patterns of topics, ``{key}`` in one standing for
    the connection's key (``commands/{key}``: each device its own topic).
    ``None``: every topic in plain mode, none in secure mode.
    """
    if patterns is None:
        return (lambda key, subject: False) if secure else (lambda key, subject: True)
    pats = [str(p) for p in patterns]

    def may_read(key: str, subject: str) -> bool:
        for pattern in pats:
            if "{key}" in pattern:
                if not key:
                    continue
                pattern = pattern.replace("{key}", glob.escape(key))
            if fnmatch.fnmatchcase(subject, pattern):
                return True
        return False

    return may_read


def _owns(key: str, partition: str) -> bool:
    """Whether the Z85 ``key`` owns the partition address (see security.address_bound)."""
    return bool(key) and security.address_bound(partition, key.encode())


class LeafHost(Protocol):
    """What a store offers its leaf port (:class:`dafka.store.node.Store` is one).

    The port feeds records in where the mesh's enter, so it shares the store's
    read-side state; written against this, not the store, so the store owns the
    port and not the other way round.
    """

    secure: bool
    config: Any
    address: str
    max_record_bytes: int
    data_paused: bool
    storage_error: Any
    publisher: Any
    _heads: dict[tuple[str, str], int]
    _ts: int
    _put_gate: Any
    db: Any
    _missing: Any
    _trickle: Any
    repair: Any
    linger: float
    unreadable_reads: int
    _read_limited: Any

    def every(self, interval: float, fn: Callable[[float], None]) -> None: ...
    def watch_events(self, sock: object, events: int) -> None: ...
    def linger_data(self, seconds: float) -> None: ...
    def fetch_missing(self) -> None: ...
    def batch_full(self) -> bool: ...
    def pause_data(self, paused: bool) -> None: ...
    def _flush_batch(self, retry: bool = False) -> None: ...
    def tracker(self, subject: str, partition: str) -> Any: ...
    def wants(self, subject: str) -> bool: ...
    def track(self, tracker: Any, seq: int, content: bytes) -> None: ...
    def on_believed_void(self, msg: wire.Void) -> None: ...
    def _pass_restart_hole(self, tracker: Any, now: float) -> None: ...


class LeafEndpoint:
    """A store's leaf port (see the module docstring).  Made and used in the store's I/O thread."""

    def __init__(
        self,
        store: LeafHost,
        bind: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        window: int = leaf.WINDOW,
        rcvhwm: int = RCVHWM,
        sndhwm: int = SNDHWM,
        bad_limit: int = leaf.BAD_LIMIT,
        idle: float = leaf.IDLE,
        read_topics: Sequence[str] | None = None,
        read_limits: dict[str, Any] | None = None,
    ) -> None:
        host, port = parse_endpoint(bind)
        self.store = store
        # Secure mode: CURVE, the allow-list's keys only, a key's own partitions only.
        self.secure = bool(store.secure)
        self.guard: security.Guard | None = None
        if self.secure:
            self.guard = security.guard_for(store.config.security)
            own = security.own_keys(store.config.security)
        self.max_connections = max_connections
        self.ctx = zmq.Context()  # its own: its ZAP handler is this port's alone
        self.zap = self.ctx.socket(zmq.ROUTER)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind("inproc://zeromq.zap.01")
        sock = self.sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(store.max_record_bytes))
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        if self.secure:
            security.make_server(sock, own)
        self.monitor = sock.get_monitor_socket(_COUNTED)
        if port == 0:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.endpoint = f"{host}:{self.port}"
        self.live = 0  # connections open (accepted minus disconnected)
        self.disconnects = 0
        self.refused_connections = 0
        self.refused_keys = 0  # secure mode: handshakes of keys not in the allow-list
        self.revoked = 0  # secure mode: messages of connections whose key left the allow-list since
        self.relays_dropped = 0  # relays a full subscriber queue refused (readers FETCH them)
        self.paused = False
        self.resting = False  # resting with the store's data socket (see rest)
        self._pids: list[int] = []  # stored partitions of the records read (see read)
        # Relays of the records a read took, sent together once it has taken them all (see
        # _send_relays); None outside a read: a relay goes at once.
        self._relays: list[list[bytes]] | None = None
        # Trackers of partitions whose leaf stated a restart hole: (tracker, watched until).
        self._holes: dict[tuple[str, str], tuple[Any, float]] = {}
        self._holes_due: set[tuple[str, str]] = set()  # of those, partitions that took records this turn
        self._bad_logged = 0
        self.core = leaf.LeafPort(
            self._head,
            refusal=self._refusal,
            window=window,
            max_record_bytes=store.max_record_bytes,
            bad_limit=bad_limit,
            idle=idle,
            address=store.address,
            max_sessions=max_connections,
            keeps=store.wants,
            authorize=_owns if self.secure else None,
            cap=self._cap,
            acked_elsewhere=self._acked_elsewhere,
        )
        # Readers: a second session kind on the same connections (dafka.core.leafread).
        self.reads = leafread.ReadPort(
            self._partitions_of,
            may_read=read_policy(read_topics, self.secure),
            strike=self.core._strike,
            address=store.address,
            idle=idle,
            **(read_limits or {}),
        )
        self.core.reads = self.reads
        self.served = 0  # records sent to readers (pushed, or answering FETCHes)
        store.every(TICK, self._on_tick)
        log.info("store %s takes leaves on %s", store.address[:8], self.endpoint)

    # ------------------------------------------------------------ store hooks

    def sockets(self) -> list[tuple[zmq.Socket[Any], Any]]:
        return [(self.sock, self.read), (self.zap, self._read_zap), (self.monitor, self._read_monitor)]

    def _head(self, subject: str, partition: str) -> int:
        return self.store._heads.get((subject, partition), -1)

    def _cap(self, subject: str, partition: str, ack: int) -> int:
        repair = self.store.repair
        return repair.cap((subject, partition), ack) if repair else ack  # (no holes, no lookup)

    def _acked_elsewhere(self, subject: str, partition: str, acked: int) -> None:
        self.store.repair.acked_elsewhere((subject, partition), acked)

    def _partitions_of(self, subject: str, limit: int) -> list[tuple[str, int, int]]:
        try:
            infos = self.store.db.partitions(subject, limit=limit)
        except StorageError:
            return []
        return [(i.partition, i.first, i.last) for i in infos]

    def _serve(self, act: leaf.Serve, read: dict[tuple[str, str, int, int], tuple[int, list[bytes]]]) -> None:
        """A reader's records from the database: DIRECT-RECORDs, without blocking (a
        full queue drops them: gaps the reader FETCHes).  ``read``: what this turn read
        already (a commit of a topic many devices read is read once, sent to each)."""
        key = (act.subject, act.partition, act.first, act.count)
        got = read.get(key)
        if got is None:
            got = read[key] = self._read(act)
        start, values = got
        prefix = wire.record_prefix(wire.DIRECT_RECORD, act.reader, act.partition, act.subject)
        budget = act.max_bytes
        sock, peer = self.sock, act.peer
        for i, value in enumerate(values):
            try:
                content = bytes(value_content(value))
            except ValueError as exc:  # a stored value shorter than its header: a damaged block
                self._unreadable(act, start + i, exc)
                return
            if i and len(content) > budget:
                break
            budget -= len(content)
            try:
                send_frames(sock, [peer, prefix + wire.pack_u64(start + i), content])
            except zmq.ZMQError:
                return
            self.served += 1

    def _read(self, act: leaf.Serve) -> tuple[int, list[bytes]]:
        """``(start, values)`` of ``act`` from the database (:meth:`RecordDB.fetch_raw`).

        A stored block that cannot be decoded (bit rot, a bug of an older version: blocks
        are checked when written, not when read) is passed, as a mesh FETCH's answer goes on
        past it after its VOID (``Store._unreadable``): the records before it came in the
        read that stopped before it (the reader asks on from there), so a read starting at it
        goes on with ``act.count`` records from the next block (beyond the offsets asked for
        when the block is wider: a reader asks for at most ``max_answer``).  The reader holds
        them, and passes the damaged offsets after its ``skip_after`` as any gap nobody fills
        (another endpoint may hold them; the leaf wire carries no VOID to readers, and a
        VOID kind 0 passes nothing at once anyway).  At most :data:`UNREADABLE_STEPS` blocks
        in a row are passed in one answer.  An error of another kind (LMDB's) says nothing
        of the block: the answer ends, the reader asks again.  Counted in the store's
        ``unreadable_reads``, logged rate-limited (a reader asks again and again)."""
        db = self.store.db
        first = act.first
        for _ in range(UNREADABLE_STEPS):
            try:
                got: tuple[int, list[bytes]] = db.fetch_raw(act.subject, act.partition, first, act.count)
                return got
            except StorageError as exc:
                self.store._read_limited.emit(logging.ERROR, "leaf-storage", "cannot serve leaf reader %s of %s/%s:"
                                              " %s", act.reader[:8], act.subject, act.partition, exc)
                return first, []
            except (ValueError, struct.error, IndexError) as exc:  # (ProtocolError is a ValueError)
                self._unreadable(act, first, exc)
                try:
                    after = db.block_after(act.subject, act.partition, first)
                except Exception:  # (StorageError, LMDB's: the answer ends)
                    after = None
                if after is None or after <= first:
                    return first, []
                first = after
            except Exception as exc:  # an LMDB error: the block may be sound
                # Raised, it cost the rest of the turn's actions: other readers' answers,
                # leaf producers' records and ACKs.
                self._unreadable(act, first, exc)
                return first, []
        return first, []

    def _unreadable(self, act: leaf.Serve, offset: int, exc: Exception) -> None:
        self.store._read_limited.emit(logging.ERROR, "unreadable", "cannot serve leaf reader %s of %s/%s from %d: a"
                                      " stored block cannot be read (%s: %s)", act.reader[:8], act.subject,
                                      act.partition, offset, type(exc).__name__, exc)
        self.store.unreadable_reads += 1

    def _refusal(self) -> str:
        error = self.store.storage_error
        return "" if error is None else f"store {self.store.address[:8]} cannot write: {error}"

    def on_commit(self, heads: dict[tuple[str, str], int]) -> None:
        """ACK the sessions of these committed partitions; push their new records to readers."""
        self._apply(self.core.on_commit(heads))
        if self.reads.by_subject:
            self._apply(self.reads.on_commit(heads))

    def sessions(self) -> dict[tuple[str, str], bytes]:
        """The partitions with a session here: (subject, partition) -> connection."""
        return self.core.by_partition

    def close(self) -> None:
        for sock in (self.monitor, self.sock, self.zap):
            sock.close(0)
        self.ctx.term()

    # ------------------------------------------------------------ input

    def read(self) -> None:
        """Leaf messages: decided by the core, applied here."""
        store = self.store
        if self.secure:
            self._read_secure()
            return
        if store.data_paused or store.storage_error is not None:
            # The store holds all it may, or cannot write (its mesh socket is then
            # read with records left out, see dafka.store.node._SHED; leaves wait
            # as before): their queues fill, then their sends block.
            self.paused = True
            store.watch_events(self.sock, 0)
            return
        sock, core = self.sock, self.core
        now = time.monotonic()
        store._ts = int(time.time() * 1000)
        bad = core.bad
        # As the mesh's drain (Store.read_data): taking turns with the writer's puts.
        # Without it every pyzmq call here (each gives the GIL up) waited for the
        # writer thread's lmdb puts (each gives it up too): 20-50 µs a call, a
        # fifth of the records/s.
        on_message = core.on_message
        apply = self._apply
        with store._put_gate:
            # Whole messages, compiled where built (fastio: one C call, the GIL held
            # meanwhile; per-frame pyzmq calls each gave the GIL up and waited for it).
            msgs = recv_messages(sock, DRAIN)
            self._relays = []
            try:
                for frames in msgs:
                    apply(on_message(frames[0], frames[1:], now))
            finally:
                self._send_relays()
        if core.bad != bad:
            self._log_bad()
        if self._holes_due:
            self._pass_holes(now)
        if len(msgs) < LINGER_BELOW and store.linger:
            # A trickle (a fleet of devices, each a record now and then): rest from
            # reading, the mesh's data socket with it, as after a small read of it
            # (dafka.store.linger), so that the next records share this turn's
            # wake-up, commit and ACK pass.
            pids, self._pids = self._pids, []
            store.linger_data(store._trickle.rest(store.linger, pids, now))
        else:
            self._pids.clear()
        if store._missing:
            store.fetch_missing()
        if store.batch_full():
            store.pause_data(True)
        store._flush_batch()

    def _read_secure(self) -> None:
        """As :meth:`read`, each message's first frame read with its connection's key (ZAP
        ``User-Id``): a HELLO names a partition, and the key must own it."""
        store = self.store
        if store.data_paused or store.storage_error is not None:
            self.paused = True
            store.watch_events(self.sock, 0)
            return
        sock, core, guard = self.sock, self.core, self.guard
        assert guard is not None
        now = time.monotonic()
        store._ts = int(time.time() * 1000)
        bad = core.bad
        with store._put_gate:
            self._relays = []
            try:
                self._drain_secure(sock, core, guard, now)
            finally:
                self._send_relays()
        if core.bad != bad:
            self._log_bad()
        if self._holes_due:
            self._pass_holes(now)
        if store._missing:
            store.fetch_missing()
        if store.batch_full():
            store.pause_data(True)
        store._flush_batch()

    def _drain_secure(self, sock: zmq.Socket[Any], core: leaf.LeafPort, guard: security.Guard, now: float) -> None:
        for _ in range(DRAIN):
            try:
                peer = sock.recv(NOBLOCK)
            except zmq.Again:
                break
            frames: list[bytes] = []
            key = ""
            if sock.getsockopt(RCVMORE):
                first = sock.recv(NOBLOCK, copy=False)
                key = str(first.get("User-Id"))
                frames.append(first.bytes)
                while sock.getsockopt(RCVMORE):
                    frames.append(sock.recv(NOBLOCK))
            if guard.role(key.encode()) is None:
                # Its key left the allow-list since the handshake (a ROUTER cannot cut one
                # connection): nothing it sends is taken any more.
                self.revoked += 1
                continue
            self._apply(core.on_message(peer, frames, now, key))

    def _send_relays(self) -> None:
        """Relay the records a read took, together: back to back they share the ZeroMQ
        I/O thread's wake-ups (sent one at a time between the records' work, each could
        wake it); the order of each partition's records is kept."""
        relays, self._relays = self._relays, None
        if not relays:
            return
        publisher = self.store.publisher
        for frames in relays:
            # Without blocking: a full subscriber queue drops it (readers FETCH it).
            try:
                if not send_frames(publisher, frames):
                    self.relays_dropped += 1
            except zmq.ZMQError:
                self.relays_dropped += 1

    def _restart_hole(self, act: leaf.RestartHole) -> None:
        """A leaf stated its restart hole: our partition reader takes it as the mesh's
        VOID kind 1 from a producer (holes within it cap its ACKs no more), and passes
        it once records beyond it are here (:meth:`_pass_holes`)."""
        store = self.store
        tracker = store.tracker(act.subject, act.partition)
        store.on_believed_void(wire.Void(store.address, act.partition, act.subject, act.first, act.last,
                                         act.partition, wire.VOID_RESTART))
        holes = self._holes
        holes[(act.subject, act.partition)] = (tracker, time.monotonic() + HOLE_WATCH)
        while len(holes) > self.core.max_sessions:
            del holes[next(iter(holes))]

    def _pass_holes(self, now: float) -> None:
        """Pass the stated restart holes that records taken this turn wait behind, as a
        store passes a producer's (every other store it knows said it holds none of it;
        with none, at once).  A mesh producer's VOID comes when the store FETCHes; a
        leaf's came before its records, so it is looked at once they are here."""
        store, holes = self.store, self._holes
        for key in self._holes_due:
            tracker = holes[key][0]
            if tracker.held and tracker.missing:
                store._pass_restart_hole(tracker, now)
            hole = tracker.restart_hole
            if hole is None or (tracker.next is not None and tracker.next > hole[1]):
                del holes[key]  # passed
        self._holes_due.clear()

    def _apply(self, actions: Sequence[leaf.PortAction]) -> None:
        store = self.store
        read: dict[tuple[str, str, int, int], tuple[int, list[bytes]]] = {}
        for act in actions:
            if isinstance(act, leaf.Take):
                tracker = store.tracker(act.subject, act.partition)
                store.track(tracker, act.sequence, act.content)
                if tracker.pid is not None:
                    self._pids.append(tracker.pid)
                if self._holes and (act.subject, act.partition) in self._holes:
                    self._holes_due.add((act.subject, act.partition))  # (only while a restart hole is watched)
            elif isinstance(act, leaf.Relay):
                if self._relays is not None:
                    self._relays.append(act.frames)  # sent when the read has taken them all
                    continue
                # Without blocking: a full subscriber queue drops it (readers FETCH it).
                try:
                    if not send_frames(store.publisher, act.frames):
                        self.relays_dropped += 1
                except zmq.ZMQError:
                    self.relays_dropped += 1
            elif isinstance(act, leaf.Serve):
                self._serve(act, read)
            elif isinstance(act, leaf.RestartHole):
                self._restart_hole(act)
            else:
                try:
                    send_frames(self.sock, [act.peer, *act.frames])
                except zmq.ZMQError:
                    pass  # gone, or its queue is full: ACKs are cumulative and repeated

    def _log_bad(self) -> None:
        n = self.core.bad
        if self._bad_logged < 20 or n // 1000 != self._bad_logged // 1000:
            log.warning("leaf port %s: %d hostile message(s) dropped, latest: %s", self.endpoint, n,
                        self.core.last_error)
        self._bad_logged = n

    def _read_monitor(self) -> None:
        for _ in range(DRAIN):
            try:
                frames = self.monitor.recv_multipart(NOBLOCK)
            except zmq.Again:
                return
            event, _value = _EVENT.unpack_from(frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self.live += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.live = max(0, self.live - 1)
                self.disconnects += 1

    def _read_zap(self) -> None:
        """ZAP (RFC 27) for the leaf port: a handshake is refused while the port is full."""
        self._read_monitor()  # the count first: the ACCEPTED of this connection is queued before
        for _ in range(DRAIN):
            try:
                frames = self.zap.recv_multipart(NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 4 or frames[1] != b"":
                continue
            envelope, request_id = frames[:2], frames[3] if len(frames) > 3 else b""
            user = b""
            if self.live > self.max_connections:
                self.refused_connections += 1
                status, text = b"400", b"the leaf port is full"
            elif self.guard is not None:
                # Secure: CURVE only, a key of the allow-list only; its Z85 form names the connection.
                mechanism = frames[7] if len(frames) > 8 else b""
                credential = frames[8] if len(frames) > 8 else b""
                key = zmq.utils.z85.encode(credential) if mechanism == b"CURVE" and len(credential) == 32 else b""
                if key and self.guard.role(key) is not None:
                    status, text, user = b"200", b"OK", key
                else:
                    self.refused_keys += 1
                    if self.refused_keys <= 20 or self.refused_keys % 1000 == 0:
                        log.warning("leaf port %s: refused a %s handshake (%d so far)", self.endpoint,
                                    "key not in the allow-list" if key else "non-CURVE", self.refused_keys)
                    status, text = b"400", b"key not allowed"
            else:
                status, text = b"200", b"OK"
            try:
                self.zap.send_multipart([*envelope, b"1.0", request_id, status, text, user, b""], NOBLOCK)
            except zmq.ZMQError:
                pass

    def rest(self, resting: bool) -> None:
        """Rest from reading (or read again) with the store's data socket (see Store.linger_data)."""
        if resting != self.resting:
            self.resting = resting
            if not self.paused:
                self.store.watch_events(self.sock, 0 if resting else zmq.POLLIN)

    def _on_tick(self, now: float) -> None:
        if self.paused and not self.store.data_paused and self.store.storage_error is None:
            self.paused = False
            if not self.resting:
                self.store.watch_events(self.sock, zmq.POLLIN)
        self.core.expire(now)
        self.reads.expire(now)
        if self._holes:
            for key in [k for k, (_, until) in self._holes.items() if now > until]:
                del self._holes[key]  # not passed within HOLE_WATCH: left to skip_after

    def stats(self) -> dict[str, int]:
        core = self.core
        return {
            "leaf_sessions": len(core),
            "leaf_connections": self.live,
            "leaf_records": core.taken,
            "leaf_acks": core.acks,
            "leaf_hostile": core.bad,
            "leaf_over_window": core.over_window,
            "leaf_refused": core.refused + self.refused_connections + self.refused_keys + self.revoked,
            "leaf_relays_dropped": self.relays_dropped,
            "leaf_resends": core.resends,
            "leaf_read_sessions": len(self.reads),
            "leaf_reads": self.reads.reads,
            "leaf_reads_refused": self.reads.refused,
            "leaf_read_fetches": self.reads.fetches,
            "leaf_read_fetches_dropped": self.reads.fetches_dropped,
            "leaf_read_served": self.served,
        }
