"""Leaf producers: one DEALER connection to a regional endpoint, no tower, no beacons.

``Producer(topic, leaf="HOST:PORT[,HOST:PORT...]")`` returns a
:class:`LeafProducer` (see ``docs/concepts/leaves.md``).  The decisions (what
to send, when to fail over) are :class:`dafka.core.leaf.LeafLink`'s; this
module is the shell: the connection, the producer's window and receipts, the
identity file.  A :class:`LeafLoop` drives any number of leaf producers from
one thread (a device has one; a benchmark thousands): it polls their DEALERs
and a wake-up socket, applies what each link decides, and runs their timers.

The identity file is the mesh producer's (address, topic, acked, next,
reserved): offsets are reserved a block at a time, durably, before use, and a
restarted leaf continues at the reservation, so it never assigns an offset
twice and needs no endpoint to answer first (a clean close saves the exact end).
It also names the endpoint in use (``endpoint``), written before any record
goes to a new one: the only endpoint that may have acknowledged beyond the
file's ``acked``, so a restarted leaf knows its restart hole once that
endpoint welcomes it (see :meth:`dafka.core.leaf.LeafLink._restart_void`).
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
from dafka.core import leaf as leafcore
from dafka.core import wire
from dafka.core.unacked import UnackedWindow
from dafka.errors import BufferFullError, ClosedError, PublishError, RecordTooLargeError
from dafka.nodes import security
from dafka.nodes.leafloop import SNDHWM, LeafLoop, parse_endpoints
from dafka.nodes.node import new_address
from dafka.nodes.receipt import Receipt, ReceiptCallbacks, check_content
from dafka.outbox.host import ProducerPort

log = logging.getLogger("dafka.leaf")

RESERVE_BLOCK = 10_000  # offsets reserved in the identity file at a time (renewed at half)
SAVE_EVERY = 0.5  # seconds between identity saves after ACKs
READ_LIMIT = 1024  # messages read from the connection in one go
# Producer arguments that mean nothing to a leaf (it has no mesh side).
_MESH_ONLY = frozenset(("towers", "pace_limit", "resume", "resume_timeout"))


# What an endpoint sends a reader (DIRECT-RECORD, DIRECT-HEAD, LEAF-READING, and STORE-STATUS
# when the zmq topic is a reader's address): routed to the readers riding a producer's connection.
_FOR_READERS = frozenset((b"D", b"E", b"S", b"Y"))


def _addressee(frame: bytes) -> str:
    """The zmq topic (the addressee) of a Dafka message's first frame ("" if it has none)."""
    nul = frame.find(b"\x00", 1)
    return frame[1:nul].decode(errors="replace") if nul > 0 else ""


class _LeafOutboxPort(ProducerPort):
    """What a leaf producer offers its outbox (:class:`dafka.outbox.host.OutboxHost`)."""

    __slots__ = ()
    _producer: LeafProducer

    @property
    def window(self) -> UnackedWindow:
        return self._producer.window

    @window.setter
    def window(self, window: UnackedWindow) -> None:
        # A reopened outbox's records: the link sends from the same window.
        self._producer.window = window
        self._producer.link.window = window

    @property
    def resume_error(self) -> None:
        return None  # a leaf needs no endpoint to resume: its identity file or outbox decides

    def prepare(self, batch: list[Any]) -> list[bytes]:
        producer = self._producer
        if producer._serialize is not None:
            batch = [values.encode(producer._serialize, content) for content in batch]
        for i, content in enumerate(batch):
            if content.__class__ is not bytes:
                check_content(content)
                batch[i] = bytes(content)
        biggest = max(map(len, batch))
        if biggest > producer.config.max_record_bytes:
            raise producer._too_large(biggest)
        return batch

    def send_live(self, first: int, contents: Sequence[bytes]) -> None:
        self._producer._loop.wake(self._producer)  # durable now: the loop sends them

    def hold_beacons(self) -> None:
        """Another process took the outbox over (fenced): a leaf has no beacons; its publishes fail."""


class LeafProducer(ReceiptCallbacks):
    """A producer whose partition reaches the mesh through a regional endpoint.

    The public API is the mesh :class:`~dafka.nodes.producer.Producer`'s
    (``publish``, ``publish_many``, ``flush``, ``close``, receipts,
    ``next_offset``, ``acked_offset``, ``unacked``); ``leaf`` lists the
    endpoints (``"HOST:PORT,HOST:PORT"``), tried in turn: the next one is
    used when one does not welcome within ``connect_timeout`` or does not
    acknowledge for ``ack_timeout`` seconds.  ``loop``: a :class:`LeafLoop`
    shared with other leaf producers (default: one of its own).
    """

    kind = "leaf"

    def __init__(
        self,
        topic: str,
        config: NodeConfig | None = None,
        *,
        leaf: str | Sequence[str],
        capacity: int = 1_000_000,
        publish_timeout: float | None = 30.0,
        acks: bool = True,
        identity: str | os.PathLike[str] | None = None,
        head_interval: float = leafcore.HEAD_INTERVAL,
        serializer: str | values.Serializer | None = None,
        outbox: str | os.PathLike[str] | None = None,
        loop: LeafLoop | None = None,
        connect_timeout: float = leafcore.CONNECT_TIMEOUT,
        ack_timeout: float = leafcore.ACK_TIMEOUT,
        outbox_max_bytes: int | None = None,
        outbox_max_age: float | None = None,
        outbox_sync: str = "each",
        outbox_policy: str = "block",
        outbox_max_map_size: int | None = None,
        **mesh_only: Any,
    ) -> None:
        unknown = set(mesh_only) - _MESH_ONLY
        if unknown:
            raise TypeError(f"a leaf producer takes no {', '.join(sorted(unknown))}")
        if not acks:
            raise ValueError("a leaf producer always has acks: its endpoint is a store")
        if not topic or len(topic.encode()) > wire.MAX_STRING or "\x00" in topic:
            raise ValueError("topic must be 1..255 bytes without NUL")
        if loop is not None and not isinstance(loop, LeafLoop):
            raise TypeError("a leaf producer's loop is a dafka.nodes.leaf.LeafLoop")
        self.topic = topic
        self.config = config or default_node_config()
        self.endpoints = parse_endpoints(leaf)
        self.publish_timeout = publish_timeout
        self._serialize = values.serializer(serializer)
        self._identity_path = Path(identity) if identity else None
        # Secure region: a CURVE client with our key; our address bound to it (the endpoint
        # takes a HELLO only for a partition bound to the connection's key, as the mesh does).
        sec = self.config.security
        self._keys: security.OwnKeys | None = None
        self._endpoint_keys: list[bytes] = []
        if sec is not None:
            self._keys = security.own_keys(sec)
            self._endpoint_keys = [sec.leaf_key(i) for i in range(len(self.endpoints))]
        saved = self._load_identity() if self._identity_path else None
        # An outbox (dafka.outbox, as a mesh producer's): every record is on disk before it is
        # sent, and a reopened outbox is the authority on the partition and its next offset.
        self._outbox: Any = None  # (Receipt looks at it)
        if outbox is not None:
            from dafka.outbox import Outbox

            box = Outbox(outbox, topic, max_bytes=outbox_max_bytes, max_age=outbox_max_age, policy=outbox_policy,
                         sync=outbox_sync, max_map_size=outbox_max_map_size)
            kept = box.saved_identity()
            if kept is not None:
                if saved is not None and saved["address"] != kept["address"]:
                    box.db.close()
                    raise ValueError(
                        f"outbox {outbox} belongs to partition {kept['address']}, identity file"
                        f" {self._identity_path} to {saved['address']}"
                    )
                saved = kept
            self._outbox = box
        if saved and self._keys is not None and not security.address_bound(saved["address"], self._keys.public):
            raise ValueError(
                f"identity file {self._identity_path}: address {saved['address'][:32]} is not bound to key"
                f" {sec.key if sec else ''}: a secure leaf publishes only under its own key's addresses"
            )
        if saved:
            self.address = saved["address"]
        else:
            self.address = security.bound_address(self._keys.public) if self._keys is not None else new_address()
        next_offset = 0
        resumed: tuple[int, int, str] | None = None
        if saved:
            reserved = saved.get("reserved")
            next_offset = max(int(saved["next"]), int(reserved) if reserved is not None else 0)
            endpoint = saved.get("endpoint")
            if outbox is None and isinstance(endpoint, str):
                # Offsets saved["acked"]+1 .. next_offset-1 may be a restart hole (the
                # link learns which at that endpoint's WELCOME); an outbox's restart is exact.
                resumed = (int(saved["acked"]), next_offset, endpoint)
        # Offsets below it may be assigned (see _reserve_locked); an outbox needs no reservation:
        # a record is on its disk before it is sent, and it knows the partition's next offset.
        self._reserved = next_offset if self._outbox is None else 1 << 62
        self.window = UnackedWindow(capacity, next_offset)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads in self._cond.wait (see _wait): an ACK notifies only if any
        self._closed = False
        self._failure: PublishError | None = None
        self._failed_from = 1 << 64
        self._callbacks: list[tuple[int, int, Receipt, Callable[[Receipt], None]]] = []
        self._callback_seq = 0
        self._saved_at = 0.0
        self._saved_acked = -2
        self._header = wire.record_prefix(wire.RECORD, topic, self.address, topic)
        self.link = leafcore.LeafLink(
            topic, self.address, self.window, self.endpoints,
            connect_timeout=connect_timeout, ack_timeout=ack_timeout, head_interval=head_interval, resumed=resumed,
        )
        # The endpoint the identity file names (None: none yet; see _note_endpoint).
        self._file_endpoint: str | None = None
        self._endpoint_unsaved = False
        self.sock: zmq.Socket[Any] | None = None
        # See LeafLoop's LoopMember.armed: the connection was read to the end and nothing sent
        # on it since.  A plain attribute (the loop looks at it after every turn that touched
        # us); readers riding our connection set it False at each of their sends too.
        self.armed = False
        self.records_sent = 0
        # Readers riding this producer's connection (dafka.nodes.leafread.LeafConsumer(via=...)):
        # their address -> the consumer (None once closed: what still comes for it is dropped;
        # at most MAX_CLOSED_READERS of those kept).  Touched in the loop thread only.
        self._readers: dict[str, Any] = {}
        self.reader_strays = 0
        if self._identity_path is not None and self._outbox is None:
            self._reserve_locked(0)  # the file exists, with a bound, before the first publish
        if self._outbox is not None:
            try:
                self._outbox.attach(_LeafOutboxPort(self), resuming=False)
            except BaseException:
                self._outbox.db.close()
                raise
            # Records go to the disk first: the loop sends them once they are durable.
            self.publish = self._publish_to_outbox  # type: ignore[method-assign]
            self.publish_many = self._publish_many_to_outbox  # type: ignore[method-assign]
        # When the loop ticks us (LeafLoop._pending): the link's timers, and with an outbox
        # that evicts by age (drop_oldest, max_age) its oldest record's expiry too (else it
        # would wait for the link's next timer: offline, up to connect_timeout * MAX_BACKOFF).
        # Only an outbox under drop_oldest evicts (failing records without an ACK).
        self._evicts = self._outbox is not None and outbox_policy == "drop_oldest"
        self.next_due = self.link.next_due
        if self._evicts and outbox_max_age is not None:
            self.next_due = self._next_due_or_expiry
        self._own_loop = loop is None
        self._loop = loop or LeafLoop(f"-{self.address[:8]}", linger=0.0)  # alone: nothing to share turns with
        self._attached = threading.Event()
        self._detached = threading.Event()
        self._started = False
        self._loop.wake(self)
        if not self._attached.wait(5.0):
            raise RuntimeError("the leaf loop did not take the producer within 5 s")

    # ------------------------------------------------------------ public API

    def __enter__(self) -> LeafProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LeafProducer {self.topic}/{self.address[:8]} via {self.link.endpoint}>"

    @property
    def next_offset(self) -> int:
        return self.window.next

    @property
    def acked_offset(self) -> int:
        return self.window.acked

    @property
    def unacked(self) -> int:
        return len(self.window)

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        return self.link.endpoint

    def publish(
        self,
        content: Any,
        callback: Callable[[Receipt], None] | None = None,
        *,
        offset: int | None = None,
        timeout: float | None = -1.0,
    ) -> Receipt:
        """Publish ``content``: as :meth:`dafka.nodes.producer.Producer.publish`."""
        if self._serialize is not None:
            content = values.encode(self._serialize, content)
        if content.__class__ is not bytes:
            check_content(content)
            content = bytes(content)
        if len(content) > self.config.max_record_bytes:
            raise self._too_large(len(content))
        window = self.window
        with self._lock:
            if offset is not None and offset != window.next:
                if offset > window.next:
                    raise ValueError(f"offset {offset} is beyond next offset {window.next}")
                receipt = Receipt(self, offset)  # type: ignore[arg-type]
            elif window.next - window.acked <= window.capacity and window.next < self._reserved and not self._closed:
                # The common case: room (len(window) < capacity), an offset reserved: one
                # record pushed, nothing waited for.
                receipt = Receipt(self, window.push(content))  # type: ignore[arg-type]
                if callback is not None and self._failure is None:
                    # Not resolved (pending: just published, no failure): kept until its ACK.
                    self._callback_seq += 1
                    heapq.heappush(self._callbacks, (receipt.offset, self._callback_seq, receipt, callback))
                    callback = None
            else:
                receipt = Receipt(self, self._push_locked([content], timeout))  # type: ignore[arg-type]
        self._loop.wake(self)
        if callback is not None:
            self._add_callback(receipt, callback)
        return receipt

    def publish_many(self, contents: Iterable[Any], *, timeout: float | None = -1.0) -> Receipt | None:
        """Publish several records; the receipt of the last one (None if empty)."""
        last = -1
        it = iter(contents)
        serialize = self._serialize
        if serialize is not None:
            it = (values.encode(serialize, value) for value in it)
        while True:
            batch = list(islice(it, 1024))
            if not batch:
                break
            for i, content in enumerate(batch):
                if content.__class__ is not bytes:
                    check_content(content)
                    batch[i] = bytes(content)
            biggest = max(map(len, batch))
            if biggest > self.config.max_record_bytes:
                raise self._too_large(biggest)
            with self._lock:
                last = self._push_locked(batch, timeout)
            self._loop.wake(self)
        return Receipt(self, last) if last >= 0 else None  # type: ignore[arg-type]

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
        if offset is not None and offset != self.window.next:
            if offset > self.window.next:
                raise ValueError(f"offset {offset} is beyond next offset {self.window.next}")
            receipt = Receipt(self, offset)  # type: ignore[arg-type]
        else:
            receipt = Receipt(self, outbox.append(content, timeout))  # type: ignore[arg-type]
        if callback is not None:
            self._add_callback(receipt, callback)
        return receipt

    def _publish_many_to_outbox(self, contents: Iterable[Any], *, timeout: float | None = -1.0) -> Receipt | None:
        """:meth:`publish_many` with an outbox: it waits for the disk once, at the end."""
        last = self._outbox.append_many(contents, timeout=timeout)
        return Receipt(self, last) if last >= 0 else None  # type: ignore[arg-type]

    def reader(self, topic: str, **kwargs: Any) -> Any:
        """A :class:`~dafka.nodes.leafread.LeafConsumer` of ``topic`` on this producer's connection
        (a second session on the same DEALER; it follows this producer's failovers).  Takes
        LeafConsumer's keyword arguments (``position``, ``offset_reset``, ...); close it before
        the producer."""
        from dafka.nodes.leafread import LeafConsumer

        return LeafConsumer(topic, self.config, via=self, **kwargs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every published record is acknowledged; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.window.acked < self.window.next - 1 and self._failure is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._wait(remaining)
            return self._failure is None

    def close(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` for ACKs, then stop; True when everything was acknowledged."""
        with self._lock:
            if self._closed:
                return self._failure is None
        ok = self.flush(timeout)
        with self._lock:
            self._closed = True
            if ok and self.window.acked < self.window.next - 1:
                ok = False  # published by another thread after the flush: not acknowledged
            if not ok and self._failure is None:
                self._failure = PublishError(f"not acknowledged by an endpoint within {timeout}s")
                self._failed_from = self.window.acked + 1
            self._cond.notify_all()
            self._reserved = self.window.next  # the exact end: no hole next time
        self._loop.wake(self)
        if not self._loop.in_loop():
            self._detached.wait(5.0)
        if self._own_loop:
            self._loop.close()
        if self._outbox is not None:
            self._outbox.close()  # what is unacknowledged stays in it for the next start
        self._save_identity(force=True)
        self._run_callbacks()
        return ok

    def diagnose(self) -> str:
        """Why records may not be acknowledged (for logs and the CLI)."""
        link = self.link
        status = link.status
        parts = [f"endpoint {link.endpoint} ({link.state})", f"{len(self.window)} unacknowledged"]
        if status is not None and not status[0]:
            parts.append(f"endpoint says: {status[1]}")
        if link.failovers:
            parts.append(f"{link.failovers} failover(s)")
        return ", ".join(parts)

    # ------------------------------------------------------------ receipts (Receipt calls these)

    def _acked_upto(self) -> int:
        return self.window.acked

    def _failure_for(self, offset: int) -> PublishError | None:
        if self._outbox is not None and (evicted := self._outbox.failure_for(offset)) is not None:
            return evicted  # type: ignore[no-any-return]
        if self._failure is not None and offset >= self._failed_from and offset > self.window.acked:
            return self._failure
        return None

    def _wait_for(self, offset: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.window.acked < offset:
                failure = self._failure_for(offset)
                if failure is not None:
                    raise PublishError(str(failure), offset)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._wait(remaining)
            if self._outbox is not None and (evicted := self._outbox.failure_for(offset)) is not None:
                raise evicted  # passed by the window, never acknowledged (drop_oldest)
            return True

    def _wait(self, timeout: float | None) -> None:
        """``self._cond.wait`` (lock held), counted: the loop notifies after an ACK only
        while someone waits (a Condition's notify is several Python calls)."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _run_callbacks(self) -> None:
        """Resolve what is no longer pending: the waiters woken (only if any wait: a
        Condition's notify is several Python calls), the callbacks now due run (outside the
        lock).  After the ACKs of a read, a close, and an outbox's evictions (drop_oldest),
        which move ``window.acked`` without an ACK."""
        due = []
        with self._lock:
            if self._waiting:
                self._cond.notify_all()
            heap = self._callbacks
            while heap and (heap[0][0] <= self.window.acked or self._failure_for(heap[0][0]) is not None):
                due.append(heapq.heappop(heap))
        for _, _, receipt, fn in due:
            self._call(fn, receipt)

    # ------------------------------------------------------------ publishing (lock held)

    def _too_large(self, size: int) -> RecordTooLargeError:
        return RecordTooLargeError(
            f"record of {size} bytes is larger than max_record_bytes={self.config.max_record_bytes}"
            " ([node] max_record_bytes); nothing of it was published"
        )

    def _push_locked(self, batch: list[bytes], timeout: float | None) -> int:
        if self._closed:
            raise ClosedError("producer is closed")
        window = self.window
        wait = self.publish_timeout if timeout == -1.0 else timeout
        deadline = None if wait is None else time.monotonic() + wait
        done = 0
        while done < len(batch):
            room = window.capacity - len(window)
            if room <= 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BufferFullError(f"{len(window)} records wait for an ACK (capacity {window.capacity})")
                self._wait(remaining)
                if self._closed:
                    raise ClosedError("producer is closed")
                continue
            stop = min(len(batch), done + room)
            if window.next + (stop - done) > self._reserved:
                self._reserve_locked(stop - done)
            window.push_many(batch, done, stop)
            done = stop
        return window.next - 1

    def _reserve_locked(self, n: int) -> None:
        """Make offsets up to ``next + n`` (and a block more) assignable: durable in the identity file first."""
        if self._identity_path is None:
            self._reserved = 1 << 62
            return
        upto = self.window.next + n + RESERVE_BLOCK
        try:
            self._write_identity(upto)
        except OSError as exc:
            raise PublishError(
                f"cannot reserve offsets in identity file {self._identity_path}: {exc}; nothing of it was published"
            ) from exc
        self._reserved = upto

    # ------------------------------------------------------------ identity file

    def _load_identity(self) -> dict[str, Any] | None:
        path = self._identity_path
        assert path is not None
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"identity file {path} is unreadable: {exc}") from exc
        if not isinstance(data, dict) or data.get("topic") != self.topic or not isinstance(data.get("address"), str):
            raise ValueError(f"identity file {path} is not an identity of topic {self.topic!r}")
        for key in ("acked", "next", "reserved"):
            value = data.get(key)
            if value is None and key == "reserved":
                continue
            if type(value) is not int or not -1 <= value < 1 << 62:
                raise ValueError(f"identity file {path}: {key!r} must be an offset, not {value!r}")
        return data

    def _write_identity(self, reserved: int) -> None:
        path = self._identity_path
        assert path is not None
        data: dict[str, Any] = {"address": self.address, "topic": self.topic, "acked": self.window.acked,
                                "next": self.window.next, "reserved": reserved}
        if self._file_endpoint is not None:
            data["endpoint"] = self._file_endpoint
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def _save_identity(self, force: bool = False) -> None:
        if self._identity_path is None:
            return
        now = time.monotonic()
        if not force and (self.window.acked == self._saved_acked or now - self._saved_at < SAVE_EVERY):
            return
        self._saved_at, self._saved_acked = now, self.window.acked
        with self._lock:
            try:
                self._write_identity(self._reserved)
            except OSError:
                log.exception("cannot save leaf identity to %s", self._identity_path)

    # ------------------------------------------------------------ the loop thread

    def _note_endpoint(self, endpoint: str) -> bool:
        """Name ``endpoint`` in the identity file before any record goes to it; False if
        that failed (then no record goes until it is done: see _send_records)."""
        if self._identity_path is None or self._outbox is not None:
            return True
        with self._lock:
            self._file_endpoint = endpoint
            try:
                self._write_identity(self._reserved)
            except OSError:
                if not self._endpoint_unsaved:
                    log.exception("cannot save leaf identity to %s (records wait)", self._identity_path)
                self._endpoint_unsaved = True
                self._saved_at = time.monotonic()
                return False
            self._endpoint_unsaved = False
            return True

    def _apply(self, actions: list[leafcore.LinkAction]) -> None:
        for act in actions:
            if isinstance(act, leafcore.Connect):
                self._note_endpoint(act.endpoint)
                self._open(act.endpoint)
                for reader in list(self._readers.values()):
                    reader._connected(time.monotonic())  # a new connection: its readers say LEAF-READ on it
            elif self.sock is not None:
                self.armed = False
                try:
                    fastio.send_frames(self.sock, act.frames)
                except zmq.ZMQError:
                    pass  # a full queue (False): HELLO and HEAD are sent again by the link's timers

    def _open(self, endpoint: str) -> None:
        loop = self._loop
        if self.sock is not None:
            loop._unregister(self.sock)
            self.sock.close(0)  # what it queued goes again on the next connection
            log.info("leaf %s: %s", self.address[:8], self.diagnose())
        sock = self.sock = loop.ctx.socket(zmq.DEALER)
        self.armed = False
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)  # what an endpoint sends is small
        if self._keys is not None:
            security.make_client(sock, self._keys)
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._endpoint_keys[self.endpoints.index(endpoint)])
        sock.connect(f"tcp://{endpoint}")
        loop._register(sock, self)

    def _act(self, now: float) -> None:
        if not self._started:
            self._started = True
            self._loop._members[id(self)] = self
            self._apply(self.link.start(now))
            self._loop._pending(self)
            self._attached.set()
        if self._closed:
            self._detach()
            return
        if self._evicts:
            self._run_callbacks()  # (a publish may have evicted records: outbox_max_bytes)
        self._send_records(now)
        self._loop._pending(self)

    def _send_records(self, now: float) -> None:
        sock = self.sock
        if sock is None:
            return
        if self._endpoint_unsaved and (now - self._saved_at < SAVE_EVERY or not self._note_endpoint(self.link.endpoint)):
            return  # the identity file must name this endpoint first (it may acknowledge)
        with self._lock:
            span = self.link.sendable()
            if span is None:
                return
            first, last = span
            if self._outbox is not None:
                last = min(last, self._outbox.last_sendable)  # only what is on the outbox's disk
                if last < first:
                    return
            runs = self.window.runs(first, last - first + 1)
        header = self._header
        sent = first - 1
        self.armed = False
        send_records = fastio.send_records
        for start, contents in runs:
            # Compiled where built: the GIL held meanwhile (per-frame pyzmq sends gave it
            # up at every frame, and waited for the app's publishing thread to return it).
            n = send_records(sock, header, start, contents, 0, None, True)  # (noblock: positional, no keywords parsed)
            sent = start + n - 1
            if n < len(contents):
                break  # the queue is full: the rest goes on the next turn
        if sent >= first:
            self.records_sent += sent - first + 1
            self.link.sent(sent, now)

    def _read(self, now: float) -> None:
        sock = self.sock
        if sock is None:
            return
        window = self.window
        acked = window.acked
        readers = self._readers
        link = self.link
        lock = self._lock
        msgs = fastio.recv_messages(sock, READ_LIMIT)
        self.armed = len(msgs) < READ_LIMIT  # read to the end (until a send: see armed)
        for frames in msgs:
            if readers and frames[0][:1] in _FOR_READERS:
                addressee = _addressee(frames[0])
                if addressee in readers:
                    reader = readers[addressee]
                    if reader is not None:
                        reader._on_frames(frames, now)  # a reader's message on this connection
                    else:
                        self.reader_strays += 1  # a reader closed: the endpoint pushes until its session expires
                    continue
            with lock:
                before = window.acked
                actions = link.on_message(frames, now)
                if self._outbox is not None and window.acked != before:
                    self._outbox.on_acked()  # the writer deletes them soon
            if actions:
                self._apply(actions)
        if window.acked != acked:
            self._run_callbacks()  # (the waiters woken, the callbacks now due run)
            if self._identity_path is not None:
                self._save_identity()
        if link.sent_upto < window.next - 1 or self._endpoint_unsaved:
            self._send_records(now)  # (freed credit, or records published meanwhile)
        self._loop._pending(self)

    def _next_due_or_expiry(self) -> float | None:
        due = self.link.next_due()
        expires = self._outbox.expires_at()
        return expires if due is None or (expires is not None and expires < due) else due

    def _tick(self, now: float) -> None:
        """The link's timers, the outbox's ages (the loop calls it when ``next_due`` is past)."""
        if self.sock is None:
            return  # (detached: closed)
        if self._evicts:
            self._outbox.on_tick(now)  # max_age evictions
            self._run_callbacks()  # (their waiters and callbacks: failed now)
        with self._lock:
            actions = self.link.on_tick(now)
        self._apply(actions)
        self._send_records(now)

    def _detach(self) -> None:
        self._loop._members.pop(id(self), None)
        self._loop._ticking.pop(self, None)  # (not ticked once closed: its outbox is closed too)
        if self.sock is not None:
            self._loop._unregister(self.sock)
            self.sock.close(0)
            self.sock = None
        self._detached.set()
