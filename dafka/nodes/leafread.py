"""Leaf consumers: a device reads a topic through its regional endpoint.

``Consumer(topic, leaf="HOST:PORT[,HOST:PORT...]")`` returns a
:class:`LeafConsumer` (see ``docs/concepts/leaves.md``, "Leaf consumers"): one
DEALER connection to an endpoint (a store or gateway started with
``--leaves``), no tower, no mesh.  It reads every partition of the topic the
endpoint holds (a device's ``commands/<device>``, or a shared commands topic):
records are pushed after each commit, and what it lacks it FETCHes.  The
decisions are :class:`dafka.core.leafread.LeafReader`'s; this module is the
shell: the connection (driven by a :class:`~dafka.nodes.leaf.LeafLoop`,
shareable with leaf producers), the queue of delivered records, and the
position file.

A device that publishes too reads on its producer's connection:
``producer.reader(topic)`` (``LeafConsumer(topic, via=producer)``) rides the
leaf producer's DEALER (the endpoint keeps a reader session next to the
producer's session on that connection); it follows the producer's failovers,
and is closed before its producer.

The position is the device's: ``position=PATH`` keeps the next offset of each
partition of the records :meth:`LeafConsumer.poll` returned, saved every
``auto_commit_interval`` seconds, by :meth:`LeafConsumer.commit`, and at
:meth:`LeafConsumer.close`; a restarted consumer resumes there.  So nothing is
lost across a restart, and a record returned after the last save may be
returned again (at least once).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import zmq

from dafka import fastio
from dafka.config import NodeConfig, default_node_config
from dafka.core import leaf as leafcore
from dafka.core import leafread, wire
from dafka.core.leaf import Connect
from dafka.errors import ClosedError
from dafka.nodes import security
from dafka.nodes.consumed import ConsumerRecord, record_type
from dafka.nodes.leafloop import MAX_CLOSED_READERS, SNDHWM, LeafLoop, parse_endpoints
from dafka.nodes.node import new_address
from dafka.values import Deserializer


class RiddenProducer(Protocol):
    """What a leaf consumer riding a producer's connection uses of it (a
    :class:`dafka.nodes.leaf.LeafProducer`; named structurally so this module
    does not import the producer's, which makes readers with ``reader()``)."""

    config: NodeConfig
    endpoints: list[str]
    link: leafcore.LeafLink
    sock: zmq.Socket[Any] | None
    armed: bool  # (see LoopMember.armed: a reader's send on the connection sets it False)
    _loop: LeafLoop
    _lock: threading.Lock
    _readers: dict[str, Any]

    def _apply(self, actions: list[Any]) -> None: ...
    def _read(self, now: float) -> None: ...

log = logging.getLogger("dafka.leaf")

MAX_ENDPOINT_MESSAGE = 64 * 1024  # LEAF-READING, heads, statuses: small (records are bounded apart)


class LeafConsumer:
    """A consumer of one topic over a leaf connection (see the module docstring).

    The API is the mesh :class:`~dafka.nodes.consumer.Consumer`'s where it
    applies: :meth:`poll`, :meth:`poll_batch`, iteration, :meth:`positions`,
    :meth:`commit`, :meth:`close`, a context manager; thread-safe.
    ``offset_reset``: where a partition without a saved position starts,
    ``"earliest"`` (default: a device's commands published before it first
    connected are delivered) or ``"latest"``.  ``leaf`` lists the endpoints,
    tried in turn: the next one when a LEAF-READ is not answered within
    ``connect_timeout`` (a reader says LEAF-READ again after
    ``poll_interval`` seconds without a word from its endpoint).
    """

    kind = "leaf-consumer"

    def __init__(
        self,
        topic: str,
        config: NodeConfig | None = None,
        *,
        leaf: str | Sequence[str] | None = None,
        via: RiddenProducer | None = None,
        position: str | os.PathLike[str] | None = None,
        offset_reset: Literal["latest", "earliest"] = "earliest",
        poll_interval: float = leafread.POLL_INTERVAL,
        connect_timeout: float = leafread.CONNECT_TIMEOUT,
        retry_interval: float = 0.5,
        skip_after: float = 10.0,
        max_queued: int = 100_000,
        auto_commit_interval: float = 1.0,
        deserializer: str | Deserializer | None = None,
        loop: LeafLoop | None = None,
    ) -> None:
        if not topic or len(topic.encode()) > wire.MAX_STRING or "\x00" in topic:
            raise ValueError("topic must be 1..255 bytes without NUL")
        if offset_reset not in ("latest", "earliest"):
            raise ValueError("offset_reset must be 'latest' or 'earliest'")
        if max_queued < 1 or auto_commit_interval <= 0:
            raise ValueError("max_queued must be >= 1 and auto_commit_interval > 0")
        if loop is not None and not isinstance(loop, LeafLoop):
            raise TypeError("a leaf consumer's loop is a dafka.nodes.leaf.LeafLoop")
        if (leaf is None) == (via is None):
            raise ValueError("a leaf consumer needs either leaf= (its own connection) or via= (a leaf producer's)")
        if via is not None and (not isinstance(getattr(via, "_loop", None), LeafLoop) or loop is not None):
            raise TypeError("via= is a dafka.nodes.leaf.LeafProducer (whose loop the consumer then shares)")
        self.topic = topic
        self._via = via
        self.config = config or (via.config if via is not None else default_node_config())
        self.endpoints = parse_endpoints(leaf) if leaf is not None else list(via.endpoints)  # type: ignore[union-attr]
        self.max_queued = max_queued
        self.auto_commit_interval = auto_commit_interval
        self._record = record_type(deserializer)
        self._path = Path(position) if position is not None else None
        sec = self.config.security
        self._keys: security.OwnKeys | None = None
        self._endpoint_keys: list[bytes] = []
        if sec is not None and via is None:
            self._keys = security.own_keys(sec)
            self._endpoint_keys = [sec.leaf_key(i) for i in range(len(self.endpoints))]
        saved = self._load() if self._path is not None else None
        self.address = saved["address"] if saved else new_address()
        start: dict[str, int] = dict(saved["positions"]) if saved else {}
        self._saved: dict[str, int] = dict(start)
        self._polled: dict[str, int] = {}
        self.reader = leafread.LeafReader(
            topic, self.address, self.endpoints if via is None else None, positions=start, earliest=offset_reset == "earliest",
            poll_interval=poll_interval, connect_timeout=connect_timeout, retry_interval=retry_interval,
            skip_after=skip_after,
        )
        self._queue: deque[ConsumerRecord] = deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._full = False  # the queue was full: the socket is not read until it drains
        self._saved_at = time.monotonic()
        self._sock: zmq.Socket[Any] | None = None
        self.dropped_full = 0  # reader messages dropped on a shared connection while the queue was full
        self.delivered = 0
        self._started = False
        self._attached = threading.Event()
        self._detached = threading.Event()
        self._own_loop = loop is None and via is None
        self._loop = via._loop if via is not None else loop or LeafLoop(f"-r{self.address[:8]}", linger=0.0)
        self._loop.wake(self)  # type: ignore[arg-type]  # (a LeafLoop member, as a LeafProducer)
        if not self._attached.wait(5.0):
            raise RuntimeError("the leaf loop did not take the consumer within 5 s")

    # ------------------------------------------------------------ public API

    def __enter__(self) -> LeafConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[ConsumerRecord]:
        """Yield records until the consumer is closed (also from another thread)."""
        while not self._closed:
            try:
                record = self.poll(0.5)
            except ClosedError:
                return
            if record is not None:
                yield record

    def __repr__(self) -> str:
        return f"<LeafConsumer {self.topic} via {self.reader.endpoint}>"

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        return self._via.link.endpoint if self._via is not None else self.reader.endpoint

    @property
    def sock(self) -> zmq.Socket[Any] | None:
        """The connection: its own, or the producer's it rides."""
        return self._via.sock if self._via is not None else self._sock

    @property
    def armed(self) -> bool:
        """Never: the loop looks at ZMQ_EVENTS after every turn that touched a reader
        (see :class:`~dafka.nodes.leafloop.LoopMember`)."""
        return False

    @armed.setter
    def armed(self, armed: bool) -> None:
        pass

    def poll(self, timeout: float | None = None) -> ConsumerRecord | None:
        """The next record, waiting up to ``timeout`` seconds (None: forever); None on timeout."""
        batch = self.poll_batch(1, timeout)
        return batch[0] if batch else None

    def poll_batch(self, max_records: int = 10_000, timeout: float | None = None) -> list[ConsumerRecord]:
        """Up to ``max_records`` records; waits up to ``timeout`` for the first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                if self._closed:
                    raise ClosedError("consumer is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._cond.wait(remaining)
            queue = self._queue
            batch = [queue.popleft() for _ in range(min(max_records, len(queue)))]
            for r in batch:
                self._polled[r.partition] = r.offset + 1
            wake = self._full and len(queue) <= self.max_queued // 2
        if wake:
            self._loop.wake(self)  # type: ignore[arg-type]
        return batch

    def positions(self) -> dict[str, int]:
        """The next offset of each partition after the records :meth:`poll` returned (and those saved)."""
        with self._lock:
            return {**self._saved, **self._polled}

    def commit(self) -> dict[str, int]:
        """Save the position (what :meth:`poll` returned) to the position file now; the positions saved."""
        positions = self.positions()
        self._save(positions)
        return positions

    def close(self, timeout: float = 5.0) -> None:
        """Stop; records not yet polled are discarded (fetched again after a restart); the position saved."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._loop.wake(self)  # type: ignore[arg-type]
        if not self._loop.in_loop():
            self._detached.wait(timeout)
        if self._own_loop:
            self._loop.close()
        self._save(self.positions())

    def diagnose(self) -> str:
        """Where the reader stands (for logs and the CLI)."""
        rd = self.reader
        parts = [f"endpoint {self.endpoint} ({rd.state})", f"{len(rd.trackers)} partition(s)"]
        if rd.status is not None and not rd.status[0]:
            parts.append(f"endpoint says: {rd.status[1]}")
        if rd.failovers:
            parts.append(f"{rd.failovers} failover(s)")
        if rd.skipped:
            parts.append(f"{rd.skipped} offset(s) given up")
        return ", ".join(parts)

    # ------------------------------------------------------------ position file

    def _load(self) -> dict[str, Any] | None:
        path = self._path
        assert path is not None
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"position file {path} is unreadable: {exc}") from exc
        if (
            not isinstance(data, dict)
            or data.get("topic") != self.topic
            or not isinstance(data.get("address"), str)
            or not isinstance(data.get("positions"), dict)
        ):
            raise ValueError(f"position file {path} is not a position of topic {self.topic!r}")
        for partition, offset in data["positions"].items():
            if not isinstance(partition, str) or type(offset) is not int or not 0 <= offset < 1 << 64:
                raise ValueError(f"position file {path}: {partition!r} must map to an offset, not {offset!r}")
        return data

    def _save(self, positions: dict[str, int]) -> None:
        path = self._path
        if path is None:
            return
        with self._lock:
            if positions == self._saved and path.exists():
                return
        data = {"topic": self.topic, "address": self.address, "positions": positions}
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        except OSError:
            log.exception("cannot save leaf consumer position to %s", path)
            return
        with self._lock:
            self._saved = dict(positions)

    # ------------------------------------------------------------ the loop thread (LeafLoop member)

    def _apply(self, actions: list[leafread.ReaderAction]) -> None:
        for act in actions:
            if isinstance(act, Connect):
                self._open(act.endpoint)
            elif isinstance(act, leafread.Failover):
                via = self._via
                if via is not None:
                    # The endpoint is silent: the producer we ride moves on (its next
                    # endpoint; its readers, us included, say LEAF-READ there).
                    log.info("leaf consumer %s: endpoint %s silent, the producer fails over", self.address[:8],
                             via.link.endpoint)
                    with via._lock:
                        moved = via.link.failover(time.monotonic())
                    via._apply(moved)
                    return  # (the LEAF-READ that followed went on the new connection already)
            elif self.sock is not None:
                if self._via is not None:
                    self._via.armed = False  # a send on the producer's connection (see LoopMember.armed)
                try:
                    fastio.send_frames(self.sock, act.frames)
                except zmq.ZMQError:
                    pass  # a full queue: LEAF-READ and FETCH are sent again by the reader's timers

    def _open(self, endpoint: str) -> None:
        loop = self._loop
        if self._sock is not None:
            loop._unregister(self._sock)
            self._sock.close(0)
            log.info("leaf consumer %s: %s", self.address[:8], self.diagnose())
        sock = self._sock = loop.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        # A DIRECT-RECORD is a record: the node's record limit, plus room for the header.
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_record_bytes + MAX_ENDPOINT_MESSAGE)
        if self._keys is not None:
            security.make_client(sock, self._keys)
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._endpoint_keys[self.endpoints.index(endpoint)])
        sock.connect(f"tcp://{endpoint}")
        loop._register(sock, self)  # type: ignore[arg-type]

    def _act(self, now: float) -> None:
        if not self._started:
            self._started = True
            self._loop._members[id(self)] = self  # type: ignore[assignment]
            if self._via is None:
                self._apply(self.reader.start(now))
            else:
                self._via._readers[self.address] = self  # the producer routes our messages to _on_frames
                if self._via.sock is not None:
                    self._connected(now)
            self._loop._pending(self)  # type: ignore[arg-type]
            self._attached.set()
        if self._closed:
            self._detach()
            return
        if self._full:
            self._read(now)  # the app made room

    def _connected(self, now: float) -> None:
        """The producer we ride opened a connection (called in the loop thread)."""
        self._apply(self.reader.connected(now))
        self._loop._pending(self)  # type: ignore[arg-type]

    def _on_frames(self, frames: list[bytes], now: float) -> None:
        """A message for this reader on the producer's connection (the producer read it)."""
        with self._lock:
            full = len(self._queue) >= self.max_queued
        if full:
            self.dropped_full += 1  # a gap, fetched once the app made room
            return
        out: list[tuple[str, int, bytes]] = []
        self._apply(self.reader.on_message(frames, now, out))
        self._deliver(out)
        self._loop._pending(self)  # type: ignore[arg-type]

    def _read(self, now: float) -> None:
        if self._via is not None:
            self._via._read(now)  # the producer reads the connection; ours come to _on_frames
            return
        sock = self.sock
        if sock is None:
            return
        with self._lock:
            room = self.max_queued - len(self._queue)
        if room <= 0:
            self._full = True  # not read until the app makes room: the endpoint drops, gaps are fetched
            return
        self._full = False
        out: list[tuple[str, int, bytes]] = []
        reader = self.reader
        for frames in fastio.recv_messages(sock, min(1024, room)):
            self._apply(reader.on_message(frames, now, out))
        self._deliver(out)
        self._loop._pending(self)  # type: ignore[arg-type]

    def _deliver(self, out: list[tuple[str, int, bytes]]) -> None:
        if not out:
            return
        make, topic = self._record, self.topic
        with self._cond:
            self._queue.extend(make(topic, partition, offset, content) for partition, offset, content in out)
            self.delivered += len(out)
            self._cond.notify_all()

    def next_due(self) -> float:
        """When the loop should tick this member next: the reader's timers, the position's save."""
        due = self.reader.next_due()
        if self._path is not None and self._polled and self._polled != self._saved:
            due = min(due, self._saved_at + self.auto_commit_interval)
        return due

    def _tick(self, now: float) -> None:
        if self.sock is None:
            return
        out: list[tuple[str, int, bytes]] = []
        self._apply(self.reader.on_tick(now, out))
        self._deliver(out)
        self._loop._pending(self)  # type: ignore[arg-type]
        if now - self._saved_at >= self.auto_commit_interval:
            self._saved_at = now
            self._save(self.positions())

    def _detach(self) -> None:
        self._loop._members.pop(id(self), None)
        self._loop._ticking.pop(self, None)  # type: ignore[call-overload]
        if self._via is not None:
            readers = self._via._readers
            readers.pop(self.address, None)
            readers[self.address] = None  # the endpoint pushes until the session expires: dropped quietly
            closed = [a for a, r in readers.items() if r is None]
            for a in closed[: max(0, len(closed) - MAX_CLOSED_READERS)]:
                del readers[a]
        elif self._sock is not None:
            self._loop._unregister(self._sock)
            self._sock.close(0)
            self._sock = None
        self._detached.set()
