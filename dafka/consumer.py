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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import repeat, starmap
from typing import Literal, NamedTuple

import zmq

from dafka import fastio, wire
from dafka.config import NodeConfig, default_node_config
from dafka.errors import ClosedError
from dafka.gaps import PartitionTracker
from dafka.node import DRAIN
from dafka.reader import NOBLOCK, PartitionReader

log = logging.getLogger("dafka.consumer")


class ConsumerRecord(NamedTuple):
    """One delivered record."""

    topic: str
    partition: str  # the producer's address
    offset: int
    content: bytes


_new_record = tuple.__new__


class Consumer(PartitionReader):
    """Consume ``topics`` from the mesh.

    ``offset_reset="latest"`` (default) starts each partition at the first
    record (or after the first HEAD) seen; ``"earliest"`` starts every
    partition at offset 0, asking stores and producers for heads (GET-HEADS)
    and fetching what exists.
    """

    kind = "consumer"

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
    ) -> None:
        if offset_reset not in ("latest", "earliest"):
            raise ValueError("offset_reset must be 'latest' or 'earliest'")
        config = (config or default_node_config()).with_towers(towers)
        super().__init__(config)
        self.offset_reset = offset_reset
        self.earliest = offset_reset == "earliest"
        self.max_queued = max_queued
        self._tracker_options = {
            "max_held": max_held,
            "retry_interval": retry_interval,
            "skip_after": skip_after,
        }
        self.topics: list[str] = []
        self._queue: deque[ConsumerRecord] = deque()
        self._ready = threading.Event()
        self._closed = False
        self.delivered = 0
        self.skipped = 0
        own = self.address.encode()
        for prefix in (wire.P_DIRECT_RECORD, wire.P_DIRECT_HEAD, wire.P_STORE_HELLO):
            self.subscribe(prefix + own)
        for topic in [topics] if isinstance(topics, str) else list(topics):
            self._add_topic(topic)
        self.start()

    # ---------------------------------------------------------------- public API

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[ConsumerRecord]:
        """Yield records until the consumer is closed."""
        while not self._closed:
            record = self.poll(0.5)
            if record is not None:
                yield record

    def subscribe_topic(self, topic: str) -> None:
        """Add a topic (thread-safe)."""
        self.call_soon(lambda: self._add_topic(topic))

    def poll(self, timeout: float | None = None) -> ConsumerRecord | None:
        """The next record, waiting up to ``timeout`` seconds (None: forever)."""
        queue = self._queue
        if queue:
            if self.data_paused and len(queue) < self.max_queued // 2:
                self._wake()
            return queue.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._ready.clear()
            if queue:
                return queue.popleft()
            if self._closed:
                raise ClosedError("consumer is closed")
            if self.data_paused:
                self._wake()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._ready.wait(remaining)

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
        return batch

    def close(self, timeout: float = 5.0) -> None:
        """Stop the consumer; records not yet polled are discarded."""
        if self._closed:
            return
        self._closed = True
        self._ready.set()
        self.stop(timeout)

    def positions(self) -> dict[tuple[str, str], int]:
        """Next offset to deliver per (topic, partition) known so far."""
        return {k: t.next for k, t in list(self._trackers.items()) if t.next is not None}

    # ---------------------------------------------------------------- I/O thread

    def _add_topic(self, topic: str) -> None:
        if topic in self.topics:
            return
        if not topic or len(topic.encode()) > wire.MAX_STRING or "\x00" in topic:
            raise ValueError("topic must be 1..255 bytes without NUL")
        self.topics.append(topic)
        self.subscribe(wire.P_RECORD + topic.encode())
        self.subscribe(wire.P_HEAD + topic.encode())
        if self.earliest and self.running:
            self.send(wire.GetHeads(topic, self.address))

    def sockets(self) -> list[tuple[zmq.Socket, object]]:
        return [(self.publisher, self._read_subscriptions)]

    def on_start(self) -> None:
        if self.earliest:
            for topic in self.topics:
                self.send(wire.GetHeads(topic, self.address))

    def new_tracker(self, subject: str, partition: str) -> PartitionTracker:
        return PartitionTracker(
            subject, partition, 0 if self.earliest else None, **self._tracker_options
        )

    def wants(self, subject: str) -> bool:
        return subject in self.topics

    def emit(self, tracker: PartitionTracker, records: list[tuple[int, bytes]]) -> None:
        append = self._queue.append
        subject, partition = tracker.subject, tracker.address
        for seq, content in records:
            append(_new_record(ConsumerRecord, (subject, partition, seq, content)))
        # The poller is woken once per drain (_read_data / on_tick), not per call.
        self.delivered += len(records)

    def _read_data(self) -> None:
        # The hot path: a batch of messages, frame-exact; the next records of
        # known partitions are queued inside drain_records, the rest come back
        # through track / on_message in arrival order.
        queue = self._queue
        before = self.delivered
        fast = fastio.drain_records(
            self.sub, DRAIN, self._by_prefix, queue, ConsumerRecord, 0, self.track, self.on_message
        )
        if self._missing:
            self.fetch_missing()
        self.delivered += fast
        if self.delivered != before:
            self._ready.set()
        if len(queue) >= self.max_queued:
            self.pause_data(True)

    def on_other(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.StoreHello) and msg.topic == self.address:
            self._hello(msg.address)

    def _hello(self, store: str) -> None:
        subjects = tuple(self.topics) if self.earliest else ()
        self.send(wire.ConsumerHello(store, self.address, subjects))

    def _read_subscriptions(self) -> None:
        """Our XPUB saw a (un)subscription from a peer."""
        for _ in range(DRAIN):
            try:
                frame = self.publisher.recv(NOBLOCK)
            except zmq.Again:
                return
            parsed = wire.parse_subscription(frame)
            if parsed is None or not parsed[0] or not parsed[1]:
                continue
            prefix = parsed[1]
            if prefix[:1] == wire.P_CONSUMER_HELLO and len(prefix) > 1:
                # A store wants our CONSUMER-HELLO.
                try:
                    self._hello(prefix[1:].decode())
                except UnicodeDecodeError:
                    self.bad_input("subscription", "store address is not UTF-8")
            elif prefix[:1] == wire.P_GET_HEADS and self.earliest:
                # A new store or producer listens for GET-HEADS: ask it now,
                # the GET-HEADS sent before it connected was lost.
                for topic in self.topics:
                    if topic.encode().startswith(prefix[1:]):
                        self.send(wire.GetHeads(topic, self.address))
            elif prefix[:1] == wire.P_FETCH:
                self.retry_missing_now()

    def on_skipped(self, tracker: PartitionTracker, first: int, last: int) -> None:
        self.skipped += last - first + 1
        log.warning(
            "consumer %s: offsets %d..%d of %s/%s are gone (retention?); skipping ahead",
            self.address,
            first,
            last,
            tracker.subject,
            tracker.address,
        )

    def on_tick(self, now: float) -> None:
        if self.data_paused and len(self._queue) < self.max_queued // 2:
            self.pause_data(False)
            self._read_data()
        before = self.delivered
        self.check_missing(now)
        if self.delivered != before:
            self._ready.set()
