"""The consumer: receives the records of one or more topics, per partition in order.

Subscriptions (as the reference): ``D``+own address, ``E``+own address,
``L``+own address, and per topic ``M``+topic and ``H``+topic.  Because ZeroMQ
matches prefixes, every message's subject is checked exactly: a consumer of
``hello`` never delivers ``hello2`` records.

The I/O thread decodes, runs each partition's :class:`PartitionTracker` and
appends deliverable records to a queue; ``poll`` / iteration take them from
there in the caller's thread.  When the queue is full the I/O thread stops
reading (ZeroMQ then buffers, and whatever the publishers drop is fetched
again later), so memory stays bounded.

Start positions (``start=``) and consumer groups (``group=``) hook in where a
partition is first seen (:meth:`Consumer.new_tracker`, :meth:`Consumer.owns`),
never on the per-record path.  A group member exchanges MEMBER heartbeats,
COMMIT / COMMITTED and GET-POSITIONS / POSITIONS with the mesh; the decisions
are taken by :class:`dafka.core.groups.GroupState` and friends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from itertools import repeat, starmap
from typing import Any, Literal, Protocol

import zmq

from dafka import fastio
from dafka.config import NodeConfig, default_node_config
from dafka.core import beacon, wire
from dafka.core.gaps import LIVE_SETTLE_MIN, KnownStores, LiveEdge, PartitionTracker
from dafka.core.groups import GroupState, Key, PendingCommits, PositionsQuery
from dafka.errors import ClosedError, CommitError
from dafka.nodes.consumed import ConsumerRecord, record_type
from dafka.nodes.loop import NodeLoop
from dafka.nodes.node import DRAIN, read_subscriptions
from dafka.nodes.reader import PartitionReader
from dafka.values import Deserializer

log = logging.getLogger("dafka.consumer")


_new_record = tuple.__new__


class Sleeper(Protocol):
    """What waits in ``poll`` for records: released once some are queued (a lock, or
    :mod:`dafka.aio`'s waker of a coroutine)."""

    def release(self) -> None: ...

COMMIT_MEMORY = 60.0  # seconds an unconfirmed commit is remembered
POSITIONS_GRACE = 0.1  # seconds to wait for more stores after the first POSITIONS
MAX_KNOWN_STORES = 1024  # store addresses remembered (bounds what STORE-HELLOs can make us hold)


class Consumer(PartitionReader):
    """Consume ``topics`` from the mesh.

    ``offset_reset="latest"`` (default) delivers everything published after
    the consumer subscribed: a partition that existed then starts at the
    first record (or after the first HEAD) seen, a partition first seen later
    (a new producer) from offset 0 (see :class:`dafka.core.gaps.LiveEdge`);
    ``"earliest"`` starts every partition at offset 0, asking stores and
    producers for heads (GET-HEADS) and fetching what exists.

    ``start={(topic, partition): offset}`` starts the listed partitions at
    those offsets (the others follow ``offset_reset``).

    ``group="name"`` makes the consumer a member of a consumer group: the
    members of a group share the partitions of their topics (each partition
    delivered by one member), and a partition resumes at the group's position
    committed in the stores (:meth:`commit`, ``auto_commit_interval``); with
    no committed position, ``start`` then ``offset_reset`` apply.
    ``on_assign(partitions)`` is called (in the I/O thread) whenever the set of
    partitions this member delivers changes.

    ``deserializer`` ("bytes", the default, "msgpack", "json" or a callable
    taking bytes) decodes each record's ``value`` from its ``content`` when
    ``value`` is read; a record it cannot decode raises
    :class:`~dafka.errors.DeserializationError` there, and is not lost.

    ``loop``: a :class:`~dafka.nodes.loop.NodeLoop` to run this consumer's I/O
    in, shared with other nodes (one thread for all); None: its own thread.

    ``leaf="HOST:PORT[,HOST:PORT...]"``: be a *leaf* reader instead of a mesh
    node: one connection to a regional endpoint (a store started with
    ``--leaves``), no tower; returns a
    :class:`dafka.nodes.leafread.LeafConsumer` of one topic, whose position
    is kept on the device (``position=PATH``; see ``docs/concepts/leaves.md``).
    """

    kind = "consumer"

    def __new__(cls, *args: Any, leaf: str | Sequence[str] | None = None, **kwargs: Any) -> Any:
        # A leaf consumer (one connection to a regional endpoint, no mesh side) is another
        # class with the same API where it applies: dafka.nodes.leafread.LeafConsumer.
        if leaf is not None:
            from dafka.nodes.leafread import LeafConsumer

            return LeafConsumer(*args, leaf=leaf, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        topics: str | Iterable[str],
        config: NodeConfig | None = None,
        *,
        towers: str | list[str] | None = None,
        offset_reset: Literal["latest", "earliest"] = "latest",
        max_queued: int = 200_000,
        max_held: int = 100_000,
        retry_interval: float = 0.5,
        skip_after: float = 10.0,
        start: Mapping[tuple[str, str], int] | None = None,
        group: str | None = None,
        auto_commit_interval: float | None = None,
        on_assign: Callable[[frozenset[Key]], None] | None = None,
        deserializer: str | Deserializer | None = None,
        loop: NodeLoop | None = None,
        leaf: None = None,  # taken by __new__: see dafka.nodes.leafread
    ) -> None:
        self._record_type = record_type(deserializer)
        if offset_reset not in ("latest", "earliest"):
            raise ValueError("offset_reset must be 'latest' or 'earliest'")
        starts = {(str(t), str(p)): int(o) for (t, p), o in (start or {}).items()}
        if any(o < 0 for o in starts.values()):
            raise ValueError("start offsets must be >= 0")
        if group is not None and (not group or len(group.encode()) > wire.MAX_STRING or "\x00" in group):
            raise ValueError("group must be 1..255 bytes without NUL")
        if auto_commit_interval is not None and (group is None or auto_commit_interval <= 0):
            raise ValueError("auto_commit_interval needs a group and must be > 0")
        config = (config or default_node_config()).with_towers(towers)
        super().__init__(config, loop=loop)
        self.offset_reset = offset_reset
        self.earliest = offset_reset == "earliest"
        # "latest": which partitions existed when a topic was subscribed.
        self._live: LiveEdge | None = None
        self._live_told: set[str] = set()  # topics whose settling was logged as over
        if not self.earliest:
            self._live = LiveEdge(max(2 * self.config.beacon_interval, LIVE_SETTLE_MIN))
            if not self.config.towers:
                self._live.on_tower(time.monotonic())  # peers come another way: settle from now
        self.max_queued = max_queued
        self._tracker_options: dict[str, Any] = {
            "max_held": max_held,
            "retry_interval": retry_interval,
            "skip_after": skip_after,
        }
        self.topics: list[str] = []
        self._queue: deque[ConsumerRecord] = deque()
        # Locks of application threads waiting in poll, each held until released
        # by the I/O thread (before_wait) or close(): a handoff in which the I/O
        # thread never waits for a lock an application thread may hold.
        self._sleepers: list[Sleeper] = []
        self._closed = False
        self.delivered = 0
        self.skipped = 0
        self._starts = starts
        self.group = group
        self.on_assign = on_assign
        self._committed: dict[Key, int] = {}  # positions read from the stores, until used
        self._group: GroupState | None = None
        self._owned_now: frozenset[Key] = frozenset()  # what poll delivers (group members)
        self._polled: dict[Key, int] = {}  # next offset per partition, as polled by the caller
        self._last_commit: dict[Key, int] = {}
        self._commits = PendingCommits()
        self._commit_done: dict[int, threading.Event] = {}
        self._release_on: dict[int, list[Key]] = {}
        self._queries: dict[int, tuple[PositionsQuery, list[Key]]] = {}
        # Set once any store showed itself (STORE-HELLO, its CONSUMER-HELLO
        # subscription, a POSITIONS or COMMITTED answer): commit() says so when none did.
        self._store_seen = threading.Event()
        self._next_request = 1
        # RECORD header prefix (before the sequence) of partitions other members
        # deliver: their records are dropped without decoding.
        self._not_mine: dict[bytes, Key] = {}
        own = self.address.encode()
        for prefix in (wire.P_DIRECT_RECORD, wire.P_DIRECT_HEAD, wire.P_STORE_HELLO, wire.P_VOID):
            self.subscribe(prefix + own)
        # Stores met (STORE-HELLO, their CONSUMER-HELLO subscription) -> when their
        # beacons stopped (None: alive).  A restarted producer's hole is passed
        # once all said they hold none of it (see PartitionReader.known_stores);
        # a store gone counts for skip_after more (it may hold some, and be back).
        self._stores = KnownStores(self._tracker_options["skip_after"], MAX_KNOWN_STORES)
        # Since when every store met is gone (None: one is alive, or none met).
        self._lonely_since: float | None = None
        topic_list = [topics] if isinstance(topics, str) else list(topics)
        if group is not None:
            cfg = self.config
            self._group = GroupState(
                group,
                self.address,
                topic_list,
                timeout=cfg.beacon_timeout,
                settle=min(cfg.beacon_timeout, 3 * cfg.beacon_interval),
                release_timeout=cfg.beacon_timeout,
                now=time.monotonic(),
            )
            for prefix in (wire.P_COMMITTED, wire.P_POSITIONS):
                self.subscribe(prefix + own)
            self.subscribe(wire.P_MEMBER + group.encode())
            self.every(cfg.beacon_interval, self._group_heartbeat)
            if auto_commit_interval is not None:
                self.every(auto_commit_interval, self._auto_commit)
        for topic in topic_list:
            self._add_topic(topic)
        self.start()

    # ---------------------------------------------------------------- public API

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[ConsumerRecord]:
        """Yield records until the consumer is closed (also from another thread)."""
        while not self._closed:
            try:
                record = self.poll(0.5)
            except ClosedError:
                return  # closed while we waited: the iteration simply ends
            if record is not None:
                yield record

    def subscribe_topic(self, topic: str) -> None:
        """Add a topic (thread-safe)."""
        self.call_soon(lambda: self._add_topic(topic))

    def poll(self, timeout: float | None = None) -> ConsumerRecord | None:
        """The next record, waiting up to ``timeout`` seconds (None: forever)."""
        if self._group is None:
            return self._poll(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            record = self._poll(remaining)
            if record is None:
                return None
            key = (record.topic, record.partition)
            if key in self._owned_now:
                self._polled[key] = record.offset + 1
                return record
            # Queued before its partition was handed over: the new owner delivers it.

    def _poll(self, timeout: float | None) -> ConsumerRecord | None:
        queue = self._queue
        if queue:
            if self.data_paused and len(queue) < self.max_queued // 2:
                self._wake()
            return queue.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            sleeper = threading.Lock()
            sleeper.acquire()
            # Listed before the queue is checked: records queued after the check
            # find it in the list and release it.
            self._sleepers.append(sleeper)
            try:
                if queue:
                    return queue.popleft()
                if self._closed:
                    raise ClosedError("consumer is closed")
                if self.data_paused:
                    self._wake()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                sleeper.acquire(True, -1 if remaining is None else remaining)
            finally:
                try:
                    self._sleepers.remove(sleeper)
                except ValueError:
                    pass  # taken out by whoever released it

    def poll_batch(self, max_records: int = 10_000, timeout: float | None = None) -> list[ConsumerRecord]:
        """Up to ``max_records`` records; waits up to ``timeout`` for the first."""
        first = self.poll(timeout)
        if first is None:
            return []
        batch = [first]
        queue = self._queue
        # Only this thread takes from the queue, so this many are there: popped
        # by a C-level loop, no Python statement per record.
        batch.extend(starmap(queue.popleft, repeat((), min(len(queue), max_records - 1))))
        if self._group is not None:
            owned, polled = self._owned_now, self._polled
            batch = [r for r in batch if (r.topic, r.partition) in owned]
            for r in batch:
                polled[(r.topic, r.partition)] = r.offset + 1
        return batch

    def close(self, timeout: float = 5.0) -> None:
        """Stop the consumer; records not yet polled are discarded.

        A group member first commits what was polled and says goodbye, so the
        others take its partitions over at once, where it stopped.
        """
        if self._closed:
            return
        if self._group is not None and self.running and self._in_io_thread():
            # From a callback (on_assign): the commit's confirmation and the
            # goodbye would wait for this very thread, so they are only sent.
            positions = self._positions_to_commit()
            if positions:
                self._send_commit(positions, None)
            self._leave(threading.Event())
        elif self._group is not None and self.running:
            try:
                if self._positions_to_commit():  # nothing polled: no store to wait for
                    self.commit(min(timeout, 2.0))
            except CommitError as exc:
                log.warning("consumer %s: final commit failed: %s", self.address, exc)
            left = threading.Event()
            self.call_soon(lambda: self._leave(left))
            left.wait(1.0)
        self._closed = True
        self._release_sleepers()
        self.stop(timeout)

    def _close_with_loop(self) -> None:
        self.close()

    def positions(self) -> dict[tuple[str, str], int]:
        """Next offset to deliver per (topic, partition) known so far."""
        return {k: t.next for k, t in list(self._trackers.items()) if t.next is not None}

    def assignment(self) -> frozenset[Key]:
        """The (topic, partition)s this group member delivers now (without a group: every known one)."""
        if self._group is None:
            return frozenset(self._trackers.copy())  # copy(): atomic against the I/O thread
        return self._owned_now

    def commit(self, timeout: float = 5.0) -> dict[Key, int]:
        """Record the group's positions (the next offset after what was polled)
        durably in the stores; blocks until one store confirmed it.

        Returns the committed positions ({} when nothing was polled since the
        partitions were taken).  Raises :class:`CommitError` when no store
        confirmed within ``timeout`` seconds, or, with nothing to commit, when
        no store showed itself on the mesh within ``timeout`` (a group's
        positions live in the stores: without one nothing is kept);
        ValueError without a group.
        """
        if self._group is None:
            raise ValueError("commit() needs a consumer group (group=...)")
        if self._closed or not self.running:
            raise ClosedError("consumer is closed")
        started = time.monotonic()
        positions = self._positions_to_commit()
        if not positions:
            if not self._store_seen.wait(timeout):
                raise CommitError(self._no_store(timeout))
            return {}
        done = threading.Event()
        self.call_soon(lambda: self._send_commit(positions, done))
        if not done.wait(timeout):
            if not self._store_seen.is_set():
                raise CommitError(self._no_store(time.monotonic() - started))
            raise CommitError(f"no store confirmed the commit of group {self.group!r} within {timeout}s")
        return positions

    def _no_store(self, waited: float) -> str:
        return (
            f"cannot commit the positions of group {self.group!r}: no store on the mesh"
            f" (none seen in {waited:.3g}s; a group's positions are kept by the stores: start `dafka store`)"
        )

    # ---------------------------------------------------------------- I/O thread

    def _add_topic(self, topic: str) -> None:
        if topic in self.topics:
            return
        if not topic or len(topic.encode()) > wire.MAX_STRING or "\x00" in topic:
            raise ValueError("topic must be 1..255 bytes without NUL")
        self.topics.append(topic)
        if self._live is not None:
            self._live.subscribe(topic, time.monotonic())
        self.refresh_interest()
        self.subscribe(wire.P_RECORD + topic.encode())
        self.subscribe(wire.P_HEAD + topic.encode())
        if self._group is not None:
            self._group.add_topic(topic)
        if self._asks_heads(topic) and self.running:
            self.send(wire.GetHeads(topic, self.address))

    def interest(self) -> beacon.Interest:
        """Stores, the producers of our topics and our group's members."""
        return beacon.Interest.consumer(getattr(self, "topics", ()), getattr(self, "group", None))

    def sockets(self) -> list[tuple[zmq.Socket[Any], Callable[[], None]]]:
        return [(self.publisher, self._read_subscriptions)]

    def on_start(self) -> None:
        for topic in self.topics:
            if self._asks_heads(topic):
                self.send(wire.GetHeads(topic, self.address))

    def new_tracker(self, subject: str, partition: str) -> PartitionTracker:
        key = (subject, partition)
        # Committed (group) position, then start position, then offset reset.
        first = self._committed.pop(key, None)
        if first is None:
            first = self._starts.get(key)
        if first is None and self.earliest:
            first = 0
        if first is None and self._live is not None:
            first = self._latest_start(key)
        return PartitionTracker(subject, partition, first, **self._tracker_options)

    def wants(self, subject: str) -> bool:
        return subject in self.topics

    def owns(self, subject: str, partition: str) -> bool:
        # "Not ours to deliver": a group member ignores the partitions of the
        # others; this runs only for partitions without a tracker (slow path).
        group = self._group
        if group is None:
            return False
        key = (subject, partition)
        if group.add_partition(key):
            if self._live is not None:
                self._latest_start(key)  # first seen now: existing, or new since we subscribed
            self._rebalance(time.monotonic())
        if key in group.owned:
            return False
        for prefix in wire.record_prefixes(wire.RECORD, subject, partition, subject):
            self._not_mine[prefix] = key
        return True

    def on_message(self, frames: list[bytes]) -> None:
        not_mine = self._not_mine
        if not_mine and frames[0][:-8] in not_mine:
            return  # another member's partition: dropped by its header, not decoded
        super().on_message(frames)

    def _wants_heads(self) -> bool:
        """Whether to ask for heads: to fetch from a position rather than the live edge."""
        return self.earliest or bool(self._starts) or self._group is not None

    def _asks_heads(self, topic: str) -> bool:
        """Whether to send GET-HEADS for ``topic`` now: always when heads are
        wanted, and while "latest" learns which partitions exist (settling)."""
        if self._wants_heads():
            return True
        live = self._live
        return live is not None and live.settling(topic, time.monotonic())

    def _latest_start(self, key: Key) -> int | None:
        """Offset reset "latest": None (live edge) for a partition that existed
        when its topic was subscribed, 0 for one created since."""
        live = self._live
        assert live is not None
        reached = self.tower_watch.reached_at
        if reached is not None:
            live.on_tower(reached)
        return live.start(key, time.monotonic())

    def _check_settled(self, now: float) -> None:
        """Log once per topic when "latest" has learnt which partitions exist."""
        live = self._live
        if live is None or len(self._live_told) == len(self.topics):
            return
        reached = self.tower_watch.reached_at
        if reached is not None:
            live.on_tower(reached)
        for topic in self.topics:
            if topic not in self._live_told and not live.settling(topic, now):
                self._live_told.add(topic)
                log.info(
                    "consumer %s: subscribed to %s; partitions that appear from now on are read from their start",
                    self.address[:8],
                    topic,
                )

    def emit(self, tracker: PartitionTracker, records: list[tuple[int, bytes]]) -> None:
        append = self._queue.append
        subject, partition = tracker.subject, tracker.address
        rtype = self._record_type
        for seq, content in records:
            append(_new_record(rtype, (subject, partition, seq, content)))
        # Waiting pollers are woken after the drain or at the end of the loop turn, not per call.
        self.delivered += len(records)

    def read_data(self, sock: zmq.Socket[Any], prefixes: dict[bytes, Any] | None) -> None:
        # The hot path: a batch of messages, frame-exact; the next records of
        # known partitions are queued inside drain_records, the rest come back
        # through track / on_message in arrival order.
        queue = self._queue
        fast = fastio.drain_records(
            sock, DRAIN, prefixes, queue, self._record_type, 0, self.track, self.on_message,
            self.max_record_bytes, self.too_large,
        )
        if self._missing:
            self.fetch_missing()
        self.delivered += fast
        if self._sleepers and queue:
            # Woken at once: the waking overlaps the rest of this loop turn.
            self._release_sleepers()
        if len(queue) >= self.max_queued:
            self.pause_data(True)

    def before_wait(self) -> None:
        # Records queued elsewhere in the turn (FETCH answers, skips on a tick)
        # wake waiting pollers here, once, before the I/O thread waits.
        if self._sleepers and self._queue:
            self._release_sleepers()

    def _release_sleepers(self) -> None:
        sleepers, self._sleepers = self._sleepers, []
        for sleeper in sleepers:
            try:
                sleeper.release()
            except RuntimeError:
                pass  # released by the other side (close and the I/O thread at once)

    def on_other(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.StoreHello) and msg.topic == self.address and not self.untrusted():
            self._store_seen.set()
            self._hello(msg.address)
        elif self._group is not None:
            self._on_group_message(msg)

    def known_stores(self) -> Collection[str]:
        return self._stores.current(time.monotonic())

    def on_peer_gone(self, address: str) -> None:
        if address in self._stores:
            now = time.monotonic()
            self._stores.gone(address, now)
            if self._lonely_since is None and self._stores.all_gone():
                self._lonely_since = now

    def owner_hears(self, partition: str) -> bool:
        """Whether our FETCHes can be answered: not while every store we met is gone.

        Every store gone at once is most likely our own network cut off: a
        hole then waits for them (:meth:`PartitionTracker.unheard`, bounded
        by UNHEARD_LIMIT) rather than be skipped after ``skip_after``, which
        would pass records every store holds and acknowledged (issue 40, the
        simulator's ``offline`` of a consumer).  Likewise while the towers we
        had heard are silent: peers are not expired then (discovery), so a cut
        of our whole network, towers included, would never say our stores are
        gone, and a known hole would be skipped after ``skip_after`` over
        records the stores hold.
        """
        if self._lonely_since is not None:
            return False
        watch = self.tower_watch
        return not (
            self.config.towers and watch.heard_at is not None and watch.quiet(time.monotonic(), self._quiet_limit)
        )

    def _hello(self, store: str) -> None:
        self._lonely_since = None
        self._stores.met(store)  # (back, if it was gone)
        subjects = tuple(self.topics) if self._wants_heads() else ()
        self.send(wire.ConsumerHello(store, self.address, subjects))

    def _read_subscriptions(self) -> None:
        """Our XPUB saw a (un)subscription from a peer."""
        for subscribe, prefix in read_subscriptions(self.publisher):
            if not subscribe or not prefix:
                continue
            if prefix[:1] == wire.P_CONSUMER_HELLO and len(prefix) > 1:
                # A store wants our CONSUMER-HELLO.
                self._store_seen.set()
                try:
                    self._hello(prefix[1:].decode())
                except UnicodeDecodeError:
                    self.bad_input("subscription", "store address is not UTF-8")
            elif prefix == wire.P_GET_POSITIONS and self._group is not None:
                # A store connected: ask it too (what was asked before it came was lost).
                self._ask_positions_again()
            elif prefix[:1] == wire.P_MEMBER and self._group is not None:
                # A peer listens to group heartbeats: tell it about us now.
                if self._group.group.encode().startswith(prefix[1:]):
                    self._group_heartbeat(time.monotonic(), check=False)
            elif prefix[:1] == wire.P_GET_HEADS:
                # A new store or producer listens for GET-HEADS: ask it now,
                # the GET-HEADS sent before it connected was lost.
                for topic in self.topics:
                    if topic.encode().startswith(prefix[1:]) and self._asks_heads(topic):
                        self.send(wire.GetHeads(topic, self.address))
            elif prefix[:1] == wire.P_FETCH:
                self.retry_missing_now()

    def on_skipped(self, tracker: PartitionTracker, first: int, last: int) -> None:
        self.skipped += last - first + 1
        log.warning(
            "consumer %s: offsets %d..%d of %s/%s are nowhere to be had (removed by retention,"
            " a hole a store recorded, or never published: a producer restarted after a crash);"
            " skipping ahead",
            self.address,
            first,
            last,
            tracker.subject,
            tracker.address,
        )

    def on_tick(self, now: float) -> None:
        if self.data_paused and len(self._queue) < self.max_queued // 2:
            self.pause_data(False)
            self.read_all_data()
        self.check_missing(now)
        if self._queries:
            self._finish_queries(now)
        if self._live is not None:
            self._check_settled(now)

    # ---------------------------------------------------------------- I/O thread: groups

    def _on_group_message(self, msg: wire.Message) -> None:
        group = self._group
        assert group is not None
        now = time.monotonic()
        if isinstance(msg, wire.Member):
            if msg.topic == group.group and group.on_member(
                msg.address, msg.topics, msg.claims, msg.leaving, now
            ):
                self._rebalance(now)
        elif isinstance(msg, wire.Committed):
            if msg.topic == self.address and not self.untrusted():
                self._store_seen.set()
                self._on_committed(msg.commit_id)
        elif isinstance(msg, wire.Positions):
            if msg.topic == self.address and msg.group == group.group and not self.untrusted():
                self._store_seen.set()
                entry = self._queries.get(msg.request_id)
                if entry is not None:
                    entry[0].on_answer(msg.positions, now)

    def _group_heartbeat(self, now: float, check: bool = True) -> None:
        """Timer: say we are here (with our claims), forget silent members, rebalance."""
        group = self._group
        if group is None:
            return
        if check and self.data_paused:
            # The caller is not polling and we read nothing: hold the view as it is.
            group.keep_alive(now)
        elif check:
            group.expire(now)
            late = group.release_overdue(now)
            if late:
                log.warning(
                    "consumer %s: no store confirmed the hand-over commit of %d partitions; "
                    "releasing them anyway",
                    self.address,
                    len(late),
                )
            self._commits.forget_older(now, COMMIT_MEMORY)
            for commit_id in [c for c in self._commit_done if c < self._commits.next_id - 1000]:
                del self._commit_done[commit_id]
            # Every heartbeat re-checks the assignment (expiries, late releases, settling).
            self._rebalance(now, heartbeat=False)
            self._ask_positions_again()
        self.send(wire.Member(group.group, self.address, False, tuple(self.topics), tuple(group.claims())))

    def _rebalance(self, now: float, heartbeat: bool = True) -> None:
        group = self._group
        assert group is not None
        plan = group.rebalance(now)
        if plan.revoke:
            self._owned_now = frozenset(group.owned)  # poll stops delivering them at once
            polled = self._polled.copy()
            handed = {k: polled[k] for k in plan.revoke if k in polled}
            for key in plan.revoke:
                self._drop_tracker(key)
                self._polled.pop(key, None)
                self._committed.pop(key, None)
            group.released([k for k in plan.revoke if k not in handed])
            if handed:
                commit_id = self._send_commit(handed, None)
                self._release_on[commit_id] = list(handed)
            self._assignment_changed(set(), set(plan.revoke))
        if plan.acquire:
            request_id = self._next_request
            self._next_request += 1
            # Long enough for a store to connect; an answer ends the wait sooner.
            timeout = max(2.0, 2 * self.config.beacon_timeout)
            grace = min(POSITIONS_GRACE, self.config.beacon_interval)
            self._queries[request_id] = (PositionsQuery(request_id, now, timeout, grace), plan.acquire)
            self.send(wire.GetPositions(group.group, self.address, request_id))
        if heartbeat and (plan.revoke or plan.acquire):
            self._group_heartbeat(now, check=False)

    def _ask_positions_again(self) -> None:
        """Re-send the GET-POSITIONS nobody answered yet (the stores may not be connected)."""
        group = self._group
        assert group is not None
        for request_id, (query, _keys) in self._queries.items():
            if not query.answers:
                self.send(wire.GetPositions(group.group, self.address, request_id))

    def _finish_queries(self, now: float) -> None:
        group = self._group
        assert group is not None
        for request_id, (query, keys) in list(self._queries.items()):
            if not query.done(now) or (self.data_paused and not query.answers):
                continue  # (not reading: an answer may be waiting unread)
            del self._queries[request_id]
            if not query.answers:
                log.warning(
                    "consumer %s: no store answered for the positions of group %r; "
                    "partitions without one follow start/offset_reset",
                    self.address,
                    group.group,
                )
            for key in keys:
                if key in query.positions and key in group.acquiring:
                    self._committed[key] = query.positions[key]
                    self._drop_tracker(key)  # none expected: the next record starts it there
            taken = group.acquired(keys)
            if taken:
                for key in taken:
                    self._polled.pop(key, None)  # a late poll of an earlier ownership
                    for prefix in wire.record_prefixes(wire.RECORD, key[0], key[1], key[0]):
                        self._not_mine.pop(prefix, None)
                self._owned_now = frozenset(group.owned)
                for topic in sorted({t for t, _ in taken}):
                    # Heads of the taken partitions, so a backlog is fetched even when idle.
                    self.send(wire.GetHeads(topic, self.address))
                self._assignment_changed(set(taken), set())
                self._group_heartbeat(now, check=False)

    def _assignment_changed(self, added: set[Key], removed: set[Key]) -> None:
        owned = self._owned_now
        log.info(
            "consumer %s group %r: delivers %d partitions (+%d -%d)",
            self.address[:8],
            self.group,
            len(owned),
            len(added),
            len(removed),
        )
        if self.on_assign is not None:
            try:
                self.on_assign(owned)
            except Exception:
                log.exception("on_assign callback failed")

    def _drop_tracker(self, key: Key) -> None:
        """Forget a partition's delivery state (it is handed over or restarts)."""
        tracker = self._trackers.pop(key, None)
        if tracker is None:
            return
        subject, partition = key
        prefixes = wire.record_prefixes
        for prefix in (
            *prefixes(wire.RECORD, subject, partition, subject),
            *prefixes(wire.DIRECT_RECORD, self.address, partition, subject),
        ):
            self.forget_prefix(prefix)
        self._missing.pop(tracker, None)

    def _positions_to_commit(self) -> dict[Key, int]:
        owned = self._owned_now
        return {k: v for k, v in self._polled.copy().items() if k in owned}

    def _send_commit(self, positions: Mapping[Key, int], done: threading.Event | None) -> int:
        commit_id = self._commits.new(positions, time.monotonic())
        if done is not None:
            self._commit_done[commit_id] = done
        entries = tuple((t, p, o) for (t, p), o in sorted(positions.items()))
        assert self.group is not None
        self.send(wire.Commit(self.group, self.address, commit_id, entries))
        return commit_id

    def _on_committed(self, commit_id: int) -> None:
        positions = self._commits.confirmed(commit_id)
        if positions is None:
            return  # another store confirmed it first
        self._last_commit.update(positions)
        done = self._commit_done.pop(commit_id, None)
        if done is not None:
            done.set()
        keys = self._release_on.pop(commit_id, None)
        if keys and self._group is not None:
            self._group.released(keys)
            self._group_heartbeat(time.monotonic(), check=False)

    def _auto_commit(self, now: float) -> None:
        positions = self._positions_to_commit()
        last = self._last_commit
        if any(last.get(k) != v for k, v in positions.items()):
            self._send_commit(positions, None)

    def _leave(self, left: threading.Event) -> None:
        group = self._group
        if group is not None:
            group.leave()
            self._owned_now = frozenset()
            self.send(wire.Member(group.group, self.address, True, tuple(self.topics), ()))
        left.set()
