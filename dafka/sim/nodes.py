"""Simulated nodes: the real protocol code with the sockets and clocks replaced.

Stores and consumers are the real :class:`dafka.store.node.Store` and
:class:`dafka.consumer.Consumer`, run without their I/O thread: the
:class:`Simulated` mixin swaps their data SUB and publisher for a pair of
in-process ZeroMQ sockets the simulator writes into and reads from, and the
simulator calls what the node loop would (``_read_data``, the timers,
``call_soon`` commands, ``do_work``) at simulated times.  A store's writer
thread is replaced by the simulator too: when the store stages a transaction
(``_to_write``, see :mod:`dafka.store.pipeline`) it schedules the write, and
when the schedule says the write finishes it takes what is staged then
(``_take_work``) and calls the store's own ``_commit``, so a kill in between
loses exactly what was not durable.
Everything else -- decoding, the fast receive path, trackers, FETCH retries,
skips, LMDB writes, ACKs, FETCH answers -- is the shipped code.

Producers are driven through their sans-IO cores (:class:`UnackedWindow` and
:class:`Resume`): :class:`SimProducer` is the glue the real producer's I/O
thread is (ACK, FETCH, GET-HEADS, DIRECT-HEAD handling, HEAD every second,
the identity file saved every half second).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.core.gaps import PartitionTracker
from dafka.core.resume import STRICT, Resume
from dafka.core.unacked import UnackedWindow
from dafka.errors import ProtocolError
from dafka.nodes.consumer import Consumer
from dafka.nodes.node import new_address
from dafka.outbox.core import OutboxCore
from dafka.outbox.db import OutboxDB
from dafka.store.db import RecordDB
from dafka.store.node import Store

log = logging.getLogger("dafka.sim")

SIM_CONFIG = NodeConfig(towers=(), bind="127.0.0.1", batches=False)
# Timers the simulator does not run: beacons and towers (the sim has no tower;
# the network is the mesh) and the periodic statistics log.
_SKIPPED_TIMERS = frozenset({"_send_beacon", "_check_towers", "_expire_peers", "_log_stats"})
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no enum arithmetic per call
HWM = 1_000_000  # in-process socket queues: the simulator, not ZeroMQ, decides what is lost


def content_for(name: str, incarnation: int, offset: int, pad: int) -> bytes:
    """A record's content: says who published it at which offset (checked on delivery)."""
    return b"%s|%d|%d|" % (name.encode(), incarnation, offset) + b"x" * pad


def parse_content(content: bytes) -> tuple[str, int, int] | None:
    """``(producer name, incarnation, offset)`` of a :func:`content_for` content, or None."""
    try:
        name, inc, off, _ = content.split(b"|", 3)
        return name.decode(), int(inc), int(off)
    except ValueError:
        return None


class Simulated:
    """Mixin for a real Node subclass: in-process sockets, simulated time, no I/O thread."""

    address: str
    ctx: Any
    publisher: Any
    sub: Any
    _timers: list[tuple[float, float, Callable[[float], None]]]

    def _sim_init(self) -> None:
        self.sim_prefixes: list[bytes] = []
        self.sim_commands: deque[Callable[[], None]] = deque()

    def _sim_swap(self, now: float) -> None:
        """Replace the data SUB and the publisher by in-process pairs (after __init__)."""
        ctx = self.ctx
        self.publisher.close(0)
        self.sub.close(0)
        inbound = f"inproc://dafka-sim-in-{self.address}-{new_address()}"
        outbound = f"inproc://dafka-sim-out-{self.address}-{new_address()}"
        self.sub = ctx.socket(zmq.PAIR)
        self.sim_in = ctx.socket(zmq.PAIR)
        self.publisher = ctx.socket(zmq.PAIR)
        self.sim_out = ctx.socket(zmq.PAIR)
        for sock in (self.sub, self.sim_in, self.publisher, self.sim_out):
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.RCVHWM, HWM)
            sock.setsockopt(zmq.LINGER, 0)
        self.sub.bind(inbound)
        self.sim_in.connect(inbound)
        self.sim_out.bind(outbound)
        self.publisher.connect(outbound)
        # Timers start now, in simulated time.
        self._timers = [(interval, now, fn) for interval, _, fn in self._timers]

    # -- what the I/O shell did, now done by the simulator

    def start(self) -> None:
        """No I/O thread: the simulator runs the node."""

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.sim_commands.append(fn)

    def _watch_data(self) -> None:
        """Reading pauses are honoured by the simulator (it does not read a paused node)."""

    def subscribe(self, prefix: bytes) -> None:
        self.sim_prefixes.append(prefix)

    def unsubscribe(self, prefix: bytes) -> None:
        if prefix in self.sim_prefixes:
            self.sim_prefixes.remove(prefix)

    def _read_subscriptions(self) -> None:
        """Peers' subscriptions are announced by the simulator (see World.joined)."""

    # -- simulator side

    def sim_feed(self, frames: list[bytes]) -> None:
        self.sim_in.send_multipart(frames, zmq.NOBLOCK)

    def sim_outbox(self) -> list[list[bytes]]:
        # Asked with EVENTS rather than a receive until zmq.Again: most pumps
        # find nothing, and an exception a call was a tenth of the sim's time.
        out = []
        sock = self.sim_out
        while sock.get(_EVENTS) & _POLLIN:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        return out

    def sim_pending_input(self) -> bool:
        return bool(self.sub.get(_EVENTS) & _POLLIN)

    def sim_run_commands(self) -> None:
        commands = self.sim_commands
        while commands:
            commands.popleft()()

    def sim_timers(self, now: float) -> None:
        """Fire the node's due timers as its loop would."""
        timers = self._timers
        for i, (interval, last, fn) in enumerate(timers):
            if last + interval <= now:
                timers[i] = (interval, now, fn)
                if getattr(fn, "__name__", "") not in _SKIPPED_TIMERS:
                    fn(now)

    def sim_close_sockets(self) -> None:
        for sock in (self.sim_in, self.sim_out):
            sock.close(0)
        self._close_sockets()  # type: ignore[attr-defined]


class SimStore(Simulated, Store):
    """A real store; the simulator is its I/O thread and its writer thread."""

    def __init__(self, db: RecordDB, address: str, now: float) -> None:
        self._sim_init()
        super().__init__(db, SIM_CONFIG, address=address, linger=0.0)
        self._sim_swap(now)

    def _write_loop(self) -> None:
        """The writer thread exits at once: the simulator commits (see World)."""

    def sim_peer_joined(self, kind: str, address: str) -> None:
        """What the store's subscription reader does when a peer subscribes to it."""
        if kind == "consumer":
            self.send(wire.StoreHello(address, self.address))
            self.retry_missing_now()
        elif kind == "store":
            self._stores.met(address)  # (its CONSUMER-HELLO subscription)
            self.retry_missing_now()
            self._announce_heads(0.0)
        elif kind == "producer":
            self.sim_producer_hears(address)
            self.retry_missing_now()

    def producer_hears(self, partition: str) -> bool:
        # (No beacons here: the world adds and drops the subscription, cuts included.)
        return partition in self._fetch_hearers

    def sim_producer_hears(self, address: str) -> None:
        """Producer ``address`` subscribed to its FETCHes here (see Store.owner_hears)."""
        self._fetch_hearers[address] = 1

    def on_peer_gone(self, address: str) -> None:
        self._fetch_hearers.pop(address, None)  # (a producer's subscription went with it)
        super().on_peer_gone(address)


class SimConsumer(Simulated, Consumer):
    """A real consumer ("earliest"); the simulator is its I/O thread."""

    def __init__(self, topics: list[str], now: float) -> None:
        self._sim_init()
        super().__init__(topics, SIM_CONFIG, offset_reset="earliest")
        self._sim_swap(now)
        # Holes given up after skip_after since the last sim_take_skips:
        # (partition, first, last, when the last FETCH before went out, retry_interval).
        self.sim_skips: list[tuple[str, int, int, float, float]] = []
        self._sim_restart_pass = False

    def _pass_restart_hole(self, tracker: PartitionTracker, now: float) -> None:
        self._sim_restart_pass = True
        try:
            super()._pass_restart_hole(tracker, now)
        finally:
            self._sim_restart_pass = False

    def on_skipped(self, tracker: PartitionTracker, first: int, last: int) -> None:
        super().on_skipped(tracker, first, last)
        if not self._sim_restart_pass:
            self.sim_skips.append((tracker.address, first, last, tracker.sent_at, tracker.retry_interval))

    def sim_take_skips(self) -> list[tuple[str, int, int, float, float]]:
        """The holes given up after skip_after since the last call (see Checker.on_given_up)."""
        out, self.sim_skips = self.sim_skips, []
        return out

    def sim_peer_joined(self, kind: str, address: str) -> None:
        """What the consumer's subscription reader does when a peer subscribes to it."""
        if kind == "store":
            self._hello(address)
        if kind in ("store", "producer"):
            for topic in self.topics:
                self.send(wire.GetHeads(topic, self.address))
            self.retry_missing_now()

    def sim_take(self) -> list[tuple[str, str, int, bytes]]:
        """Records delivered since the last call (what ``poll`` would return)."""
        out = [(r[0], r[1], r[2], r[3]) for r in self._queue]
        self._queue.clear()
        return out


class SimProducer:
    """One partition's producer: the real window and resume, with the producer's glue."""

    HEAD_INTERVAL = 1.0
    SAVE_INTERVAL = 0.5
    RESUME_TIMEOUT = 5.0
    RESERVE_BLOCK = 16  # offsets reserved at a time (the producer's RESERVE_MIN, scaled down)

    def __init__(
        self,
        name: str,
        topic: str,
        *,
        ring: bool,
        capacity: int,
        incarnation: int,
        now: float,
        saved: tuple[int, int, int] | None = None,
        address: str | None = None,
    ) -> None:
        self.name = name
        self.topic = topic
        self.address = address or f"{name}-{new_address()[:12]}"
        self.ring = ring
        self.incarnation = incarnation
        self.capacity = capacity
        self.window = UnackedWindow(capacity, 0, ring=ring)
        self.resume: Resume | None = None
        self.resume_error: str | None = None
        self.head_at = now
        self.saved_at = now
        # The identity file: (acked, next, reserved); written at once when the
        # reservation grows (the producer fsyncs it before using the offsets).
        self.saved = saved or (-1, 0, self.RESERVE_BLOCK)
        self.reserved = self.saved[2]
        self.hole: tuple[int, int] | None = None  # offsets the resume skipped
        self.bad_acks = 0
        self.start_offset = 0
        self.get_heads_at = -1.0
        if saved is not None:
            self.resume = Resume(
                saved[0],
                saved[1],
                started=now,
                timeout=self.RESUME_TIMEOUT,
                beacon_interval=1.0,
                policy=STRICT,
                need_store=not ring,
                reserved=saved[2],
            )
            self.resume.on_tower(now)  # the simulated mesh always has a tower
        own = self.address.encode()
        self.prefixes = [
            wire.P_ACK + own,
            wire.P_FETCH + own,
            wire.P_GET_HEADS + topic.encode(),
            wire.P_STORE_STATUS + own,
            wire.P_DIRECT_HEAD + own,
        ]

    @property
    def ready(self) -> bool:
        return self.resume is None and self.resume_error is None

    def publish(self, contents: list[bytes], lost: bool, rng: random.Random) -> tuple[int, list[list[bytes]]]:
        """Push ``contents``; the first offset and the messages to send (none if ``lost``)."""
        room = len(contents) if self.ring else min(len(contents), self.capacity - len(self.window))
        if room <= 0:
            return self.window.next, []
        if self.window.next + room > self.reserved:
            self._reserve(self.window.next + room + self.RESERVE_BLOCK)  # the publisher's own renewal
        first = self.window.push_many(contents[:room])
        if lost:
            return first, []
        return first, self._records(wire.Record, wire.RecordBatch, self.topic, first, contents[:room], rng)

    def _records(
        self, single: Any, batch: Any, topic: str, first: int, contents: list[bytes], rng: random.Random
    ) -> list[list[bytes]]:
        if len(contents) > 1 and rng.random() < 0.5:
            return [wire.encode(batch(topic, self.address, self.topic, first, tuple(contents)))]
        return [
            wire.encode(single(topic, self.address, self.topic, first + i, c)) for i, c in enumerate(contents)
        ]

    def on_frames(
        self, frames: list[bytes], sender: str, now: float, rng: random.Random, on_ack: Callable[..., None]
    ) -> list[list[bytes]]:
        """A message arrived (as the producer's ``on_data``); the messages to send."""
        try:
            msg = wire.decode(frames)
        except ProtocolError:
            return []
        if isinstance(msg, wire.Ack):
            if msg.topic == self.address and msg.subject == self.topic:
                window = self.window
                if msg.sequence > window.last:
                    self.bad_acks += 1
                elif msg.sequence > window.acked:
                    expected = list(window.fetch(window.acked + 1, msg.sequence - window.acked))
                    on_ack(self, sender, expected)
                    window.ack(msg.sequence)
            return []
        if isinstance(msg, wire.Fetch):
            if msg.topic == self.address and msg.subject == self.topic and self.ready:
                out = []
                seq, count = msg.sequence, msg.count
                hole = self.hole
                if hole is not None and hole[0] <= seq <= hole[1]:
                    # The restart hole, said (Producer._on_fetch)
                    void = wire.Void(msg.address, self.address, self.topic, hole[0], hole[1], self.address, wire.VOID_RESTART)
                    out.append(wire.encode(void))
                if hole is not None and hole[0] <= seq <= hole[1] and seq + count <= hole[1] + 1:
                    seq, count = hole[1] + 1, 1  # what follows the hole (Producer._on_fetch)
                for first, contents in self.window.runs(seq, self._sendable(seq, count)):
                    out += self._records(
                        wire.DirectRecord, wire.DirectRecordBatch, msg.address, first, list(contents), rng
                    )
                return out
            return []
        if isinstance(msg, wire.GetHeads):
            if msg.topic == self.topic and self.ready and self._announced() >= 0:
                return [wire.encode(wire.DirectHead(msg.address, self.address, self.topic, self._announced()))]
            return []
        if isinstance(msg, wire.DirectHead):
            if self.resume is not None and msg.address == self.address and msg.subject == self.topic:
                self.resume.on_head(msg.sequence, now)
        return []

    def tick(self, now: float) -> list[list[bytes]]:
        """Timers: the resume, HEAD every second, the identity file."""
        out: list[list[bytes]] = []
        resume = self.resume
        if resume is not None:
            if resume.done(now):
                next_offset, error = resume.decide()
                self.hole = resume.hole
                self.resume = None
                if error is not None:
                    self.resume_error = error
                    return out
                self.window = UnackedWindow(self.capacity, next_offset, ring=self.ring)
                self.start_offset = next_offset
                self.reserved = next_offset
                self._reserve(next_offset + self.RESERVE_BLOCK)
            elif resume.may_beacon(now) and now - self.get_heads_at >= 0.2:
                self.get_heads_at = now
                out.append(wire.encode(wire.GetHeads(self.topic, self.address)))
            return out
        if self.resume_error is not None:
            return out
        if now - self.head_at >= self.HEAD_INTERVAL:
            self.head_at = now
            if self._announced() >= 0:
                out.append(wire.encode(wire.Head(self.topic, self.address, self.topic, self._announced())))
        if self.reserved - self.window.next < self.RESERVE_BLOCK // 2:
            self._reserve(self.window.next + self.RESERVE_BLOCK)  # the I/O thread's renewal
        if now - self.saved_at >= self.SAVE_INTERVAL:
            self.saved_at = now
            self.saved = (self.window.acked, self.window.next, self.reserved)
        return out

    def _announced(self) -> int:
        """The head HEADs announce (Producer._announced): before the hole until this run publishes."""
        hole = self.hole
        last = self._last_sendable()
        return hole[0] - 1 if hole is not None and last <= hole[1] else last

    def _sendable(self, seq: int, count: int) -> int:
        """How many of ``seq..`` a FETCH answer may carry."""
        return count

    def _last_sendable(self) -> int:
        return self.window.last

    def _reserve(self, upto: int) -> None:
        """Reserve offsets below ``upto``: durable (in ``saved``) before any is used."""
        self.reserved = max(self.reserved, upto)
        self.saved = (self.window.acked, self.window.next, self.reserved)


class SimDevice(SimProducer):
    """An edge device: a producer whose window an outbox owns (``outbox=`` of the real producer).

    The bookkeeping is the real :class:`~dafka.outbox.core.OutboxCore`, the
    persistence the real :class:`~dafka.outbox.db.OutboxDB` (LMDB, fsync'ed,
    in the world's temporary directory); the simulator is the outbox's writer
    thread: it takes the core's work when the schedule says a commit
    finishes (:meth:`commit`), so a kill before that loses exactly what was
    not committed.  Publishing is ``outbox_sync="each"``: a publish returns
    (the records are *accepted*) once they are committed, and only committed
    records go on the wire.  Opened again after a kill, the outbox is the
    authority of its partition: the window continues from what it holds, no
    resume, no restart hole (as :class:`~dafka.nodes.producer.Producer` does
    with an outbox).
    """

    MAP_SIZE = 1 << 20

    def __init__(
        self, name: str, topic: str, *, capacity: int, incarnation: int, now: float, path: str, address: str
    ) -> None:
        super().__init__(name, topic, ring=False, capacity=capacity, incarnation=incarnation, now=now, address=address)
        self.db = OutboxDB(path, map_size=self.MAP_SIZE)
        try:
            image = self.db.load()
            if image.address is not None:
                window = UnackedWindow(capacity, image.floor)
                window.push_many([c for _, _, c in image.records])
                groups = [(o, ts / 1000) for o, ts, _ in image.records[:1]]
                self.core = OutboxCore(window, group_times=groups)
            else:
                self.db.claim(topic, self.address, 0)
                self.core = OutboxCore(self.window)
        except BaseException:
            self.db.close()
            raise
        self.window = self.core.window
        self.loaded = image  # what this incarnation found in the outbox
        self.lost: set[int] = set()  # offsets whose first send the schedule loses (``lose``)

    def publish(
        self, contents: list[bytes], lost: bool, rng: random.Random, now: float = 0.0
    ) -> tuple[int, list[list[bytes]]]:
        """Push what the outbox admits; nothing is sent before it is committed (:meth:`commit`)."""
        room = min(len(contents), self.capacity - len(self.window))
        if room <= 0 or not self.core.admit(room, sum(map(len, contents[:room])), now).ok:
            return self.window.next, []
        first = self.window.push_many(contents[:room])
        self.core.pushed(first, contents[:room], now)
        if lost:
            self.lost.update(range(first, first + room))
        return first, []

    def has_work(self) -> bool:
        return self.core.has_work()

    def commit(self, rng: random.Random) -> tuple[list[tuple[int, list[bytes]]], list[list[bytes]]]:
        """The writer's group commit: the runs now durable (accepted) and the messages to send."""
        core = self.core
        take = core.take()
        self.db.commit(take.runs, take.ts_ms, core.floor_written, take.floor, take.next)
        runs = core.committed(take)
        out: list[list[bytes]] = []
        for first, contents in runs:
            offsets = range(first, first + len(contents))
            if self.lost.isdisjoint(offsets):
                out += self._records(wire.Record, wire.RecordBatch, self.topic, first, contents, rng)
                continue
            for off, c in zip(offsets, contents, strict=True):
                if off not in self.lost:
                    out += self._records(wire.Record, wire.RecordBatch, self.topic, off, [c], rng)
            self.lost.difference_update(offsets)
        return runs, out

    def on_frames(
        self, frames: list[bytes], sender: str, now: float, rng: random.Random, on_ack: Callable[..., None]
    ) -> list[list[bytes]]:
        acked = self.window.acked
        out = super().on_frames(frames, sender, now, rng, on_ack)
        if self.window.acked != acked:
            self.core.acked()  # the next commit deletes what the ACK freed
        return out

    def _sendable(self, seq: int, count: int) -> int:
        return self.core.sendable(seq, count)

    def _last_sendable(self) -> int:
        return self.core.durable

    def close(self) -> None:
        """Killed (kill -9): what was committed stays on disk, the rest is gone."""
        self.db.close()
