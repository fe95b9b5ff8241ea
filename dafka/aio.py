"""asyncio API: :class:`Producer` and :class:`Consumer` for coroutines.

Both are async context managers over the same nodes as the threaded API
(:mod:`dafka.producer`, :mod:`dafka.consumer`), and never block the event
loop:

- A :class:`Producer` hands what ``publish_nowait`` takes to a sender thread
  of its own, one chunk per turn of the loop (up to :data:`CHUNK` records),
  which publishes it with :meth:`dafka.producer.Producer.publish_many`; when a
  store acknowledges a chunk, the node's I/O thread resolves its receipts on
  the loop through ``loop.call_soon_threadsafe``.  Waiting for room in a full
  buffer or for a slow reader happens in the sender thread, never in the loop.
- A :class:`Consumer` takes records from the node's queue without waiting;
  when it is empty, the coroutine waits on a future that the node's I/O thread
  resolves (``call_soon_threadsafe``) once records are queued.  An idle
  ``async for`` costs nothing: no timer, no polling.

Commits and closing (which wait for stores) run in the loop's default
executor.  Works under any asyncio loop, anyio's asyncio backend included.

Example::

    async with dafka.aio.Producer("readings", serializer="msgpack") as producer:
        offset = await producer.publish({"device": "d1", "temp": 21.5})

    async with dafka.aio.Consumer("readings", deserializer="msgpack") as consumer:
        async for record in consumer:
            print(record.offset, record.value)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any, Literal

from dafka import values
from dafka.config import NodeConfig
from dafka.core.groups import Key
from dafka.errors import BufferFullError, ClosedError, PublishError
from dafka.nodes import consumer as _consumer
from dafka.nodes import producer as _producer
from dafka.nodes.consumed import ConsumerRecord

__all__ = ["Consumer", "ConsumerRecord", "Producer", "Receipt"]

log = logging.getLogger("dafka.aio")

CHUNK = 4096  # records handed to the sender thread at most at once
YIELD_EVERY = 512  # records an ``async for`` delivers before it lets other tasks run


class _Chunk:
    """Records published together; resolved once, on the loop."""

    __slots__ = ("contents", "count", "first", "published", "acked", "error", "done", "waiters")

    def __init__(self) -> None:
        self.contents: list[bytes] = []
        self.count = 0  # records in it, once handed to the sender
        self.first = -1  # offset of contents[0] once published
        self.published = 0  # how many got an offset
        self.acked = -1  # highest offset acknowledged when resolved
        self.error: BaseException | None = None
        self.done = False
        self.waiters: list[asyncio.Future[None]] = []

    def outcome(self, index: int) -> int:
        """The offset of record ``index`` if acknowledged; else raises why not (resolved only)."""
        if index >= self.published:
            error = self.error or PublishError("not published")
            raise error
        offset = self.first + index
        if offset <= self.acked or self.error is None:
            return offset
        if isinstance(self.error, PublishError):
            raise PublishError(str(self.error), offset) from self.error
        raise self.error


class Receipt:
    """The outcome of one :meth:`Producer.publish_nowait`: await it for the offset.

    ``await receipt`` returns the record's offset once a store acknowledged it,
    or raises :class:`~dafka.errors.PublishError`.  Cancelling an ``await``
    cancels the wait only, never the record.
    """

    __slots__ = ("_chunk", "_index")

    def __init__(self, chunk: _Chunk, index: int) -> None:
        self._chunk = chunk
        self._index = index

    def __repr__(self) -> str:
        chunk = self._chunk
        if not chunk.done:
            return "<Receipt pending>"
        try:
            return f"<Receipt offset={chunk.outcome(self._index)} acked>"
        except BaseException as exc:
            return f"<Receipt failed: {exc}>"

    def done(self) -> bool:
        """Whether the record was acknowledged or failed."""
        return self._chunk.done

    @property
    def offset(self) -> int | None:
        """The record's offset once it was published (None before)."""
        chunk = self._chunk
        if not chunk.done or self._index >= chunk.published:
            return None
        return chunk.first + self._index

    def result(self) -> int:
        """The offset of a resolved receipt (raises its error; InvalidStateError if pending)."""
        if not self._chunk.done:
            raise asyncio.InvalidStateError("receipt is pending")
        return self._chunk.outcome(self._index)

    def __await__(self) -> Generator[Any, None, int]:
        chunk = self._chunk
        if not chunk.done:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            chunk.waiters.append(waiter)
            yield from waiter
        return chunk.outcome(self._index)


class Producer:
    """Publish records to ``topic`` from coroutines (``async with``).

    Takes the arguments of :class:`dafka.producer.Producer` (``config``,
    ``towers``, ``capacity``, ``acks``, ``identity``, ``serializer``, ...).
    ``capacity`` also bounds the records waiting for an acknowledgement here:
    beyond it ``publish_nowait`` raises :class:`~dafka.errors.BufferFullError`
    and ``publish`` waits for room.
    """

    def __init__(self, topic: str, config: NodeConfig | None = None, **options: Any) -> None:
        self.topic = topic
        self._config = config
        self._options = options
        self.capacity: int = int(options.get("capacity", 1_000_000))
        if self.capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._serialize = values.serializer(options.pop("serializer", None))
        self._sync: _producer.Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: _Chunk | None = None
        self._last: _Chunk | None = None
        self._queued = 0  # records published here and not resolved yet
        self._room: list[asyncio.Future[None]] = []
        self._chunks: queue.SimpleQueue[_Chunk | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._closed = False

    async def start(self) -> Producer:
        """Start the node (in the default executor: a resume may take seconds)."""
        if self._sync is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._sync = await asyncio.to_thread(_producer.Producer, self.topic, self._config, **self._options)
        self._sender = threading.Thread(target=self._send_chunks, name="dafka-aio-sender", daemon=True)
        self._sender.start()
        return self

    async def __aenter__(self) -> Producer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def node(self) -> _producer.Producer:
        """The underlying threaded producer (its address, offsets, peers, diagnose())."""
        if self._sync is None:
            raise ClosedError("producer not started (use `async with` or `await start()`)")
        return self._sync

    @property
    def address(self) -> str:
        """The producer's address: the partition it publishes."""
        return self.node.address

    def publish_nowait(self, value: Any) -> Receipt:
        """Publish ``value`` (bytes, or a value for the ``serializer``); returns an awaitable :class:`Receipt`.

        Never waits: raises :class:`~dafka.errors.BufferFullError` when
        ``capacity`` records already wait for an acknowledgement, and
        :class:`~dafka.errors.SerializationError` for a value that cannot be
        serialized.  Records go out in the order published.
        """
        if self._closed or self._sync is None:
            raise ClosedError("producer is closed" if self._closed else "producer not started")
        serialize = self._serialize
        content = value if serialize is None else values.encode(serialize, value)
        if type(content) is not bytes:
            if not isinstance(content, bytes):
                raise TypeError(f"content must be bytes, not {type(content).__name__} (or pass serializer=)")
        if self._queued >= self.capacity:
            raise BufferFullError(f"{self._queued} records wait for an ACK (capacity {self.capacity})")
        chunk = self._open
        if chunk is None:
            chunk = self._open = _Chunk()
            self._last = chunk
            assert self._loop is not None
            self._loop.call_soon(self._dispatch)  # at the end of this turn of the loop
        contents = chunk.contents
        contents.append(content)
        self._queued += 1
        if len(contents) >= CHUNK:
            self._dispatch()
        return Receipt(chunk, len(contents) - 1)

    async def publish(self, value: Any) -> int:
        """Publish ``value`` and wait until a store acknowledged it; returns its offset.

        Raises :class:`~dafka.errors.PublishError` when it was not
        acknowledged (see :meth:`dafka.producer.Producer.close`).  Waits for
        room when ``capacity`` records wait for an acknowledgement.
        """
        while self._queued >= self.capacity and not self._closed:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._room.append(waiter)
            await waiter
        return await self.publish_nowait(value)

    def publish_many(self, values_: Iterable[Any]) -> Receipt | None:
        """Publish several values; the receipt of the last (ACKs are cumulative), None if empty."""
        receipt = None
        for value in values_:
            receipt = self.publish_nowait(value)
        return receipt

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record published so far is acknowledged; False on timeout or failure."""
        self._dispatch()
        last = self._last
        if last is not None and not last.done:
            try:
                await asyncio.wait_for(_wait_resolved(last), timeout)
            except TimeoutError:
                return False
        sync = self.node
        return not sync.acks or sync.acked_offset >= sync.next_offset - 1

    async def close(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` for acknowledgements, then stop the node.

        Returns True when everything published was acknowledged; the receipts
        of records that were not fail with :class:`~dafka.errors.PublishError`.
        """
        if self._closed:
            return True
        self._closed = True
        self._dispatch()
        sync = self._sync
        if sync is None:
            return True
        self._chunks.put(None)
        sender = self._sender
        if sender is not None:
            await asyncio.to_thread(sender.join)
        ok = await asyncio.to_thread(sync.close, timeout)
        # Resolutions the node posted while closing run before this returns.
        await asyncio.sleep(0)
        for waiter in self._room:
            if not waiter.done():
                waiter.set_result(None)
        return ok

    # ---------------------------------------------------------------- internals

    def _dispatch(self) -> None:
        """Hand the open chunk to the sender thread (on the loop)."""
        chunk = self._open
        if chunk is not None:
            self._open = None
            chunk.count = len(chunk.contents)
            self._chunks.put(chunk)

    def _send_chunks(self) -> None:
        """The sender thread: publish chunks in order; the I/O thread reports their ACKs."""
        sync = self._sync
        assert sync is not None
        while True:
            chunk = self._chunks.get()
            if chunk is None:
                return
            start = sync.next_offset  # only this thread publishes: the chunk's offsets follow
            error: BaseException | None = None
            try:
                sync.publish_many(chunk.contents)
            except Exception as exc:
                error = exc
            published = sync.next_offset - start
            chunk.contents = []
            if not published:
                self._post(chunk, start, 0, -1, error)
                continue
            last = _producer.Receipt(sync, start + published - 1)
            last.add_done_callback(self._on_done(chunk, start, published, error))

    def _on_done(
        self, chunk: _Chunk, start: int, published: int, error: BaseException | None
    ) -> Callable[[_producer.Receipt], None]:
        def done(receipt: _producer.Receipt) -> None:
            # In the node's I/O thread (or the sender's, when resolved at once).
            failure = error
            if receipt.acked():
                acked = receipt.offset
            else:
                acked = self.node.acked_offset
                try:
                    receipt.wait(0)
                    failure = failure or PublishError("not acknowledged", receipt.offset)
                except PublishError as exc:
                    failure = exc
            self._post(chunk, start, published, acked, failure)

        return done

    def _post(self, chunk: _Chunk, start: int, published: int, acked: int, error: BaseException | None) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._resolve, chunk, start, published, acked, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _resolve(self, chunk: _Chunk, start: int, published: int, acked: int, error: BaseException | None) -> None:
        """On the loop: a chunk's outcome is known; wake its waiters and publishers waiting for room."""
        chunk.first, chunk.published, chunk.acked, chunk.error = start, published, acked, error
        chunk.done = True
        for waiter in chunk.waiters:
            if not waiter.done():
                waiter.set_result(None)
        chunk.waiters.clear()
        self._queued -= chunk.count
        room, self._room = self._room, []
        for waiter in room:
            if not waiter.done():
                waiter.set_result(None)


async def _wait_resolved(chunk: _Chunk) -> None:
    if not chunk.done:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        chunk.waiters.append(waiter)
        await waiter


class _Waker:
    """Stands in the consumer's list of sleepers: its I/O thread ``release()``s it
    once records are queued, which resolves ``future`` on the loop."""

    __slots__ = ("_loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.future: asyncio.Future[None] = loop.create_future()

    def release(self) -> None:
        """Wake the waiting coroutine (thread-safe: called by the consumer's I/O thread)."""
        try:
            self._loop.call_soon_threadsafe(self.wake)
        except RuntimeError:  # the loop is closed
            pass

    def wake(self) -> None:
        """On the loop: resolve the future (once)."""
        if not self.future.done():
            self.future.set_result(None)


class Consumer:
    """Consume ``topics`` from coroutines (``async with``, ``async for``).

    Takes the arguments of :class:`dafka.consumer.Consumer` (``config``,
    ``towers``, ``offset_reset``, ``start``, ``group``,
    ``auto_commit_interval``, ``on_assign``, ``deserializer``, ...).
    ``async for record in consumer`` ends when the consumer is closed.
    """

    def __init__(
        self,
        topics: str | Iterable[str],
        config: NodeConfig | None = None,
        *,
        offset_reset: Literal["latest", "earliest"] = "latest",
        **options: Any,
    ) -> None:
        self._topics = topics
        self._config = config
        self._options = dict(options, offset_reset=offset_reset)
        self._sync: _consumer.Consumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streak = 0
        # Records ``async for`` took from the node (no group) and did not hand out yet.
        self._buffer: deque[ConsumerRecord] = deque()
        self._take = self._buffer.popleft

    async def start(self) -> Consumer:
        """Start the node."""
        if self._sync is None:
            self._loop = asyncio.get_running_loop()
            self._sync = await asyncio.to_thread(_consumer.Consumer, self._topics, self._config, **self._options)
        return self

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def node(self) -> _consumer.Consumer:
        """The underlying threaded consumer (address, peers, positions(), ...)."""
        if self._sync is None:
            raise ClosedError("consumer not started (use `async with` or `await start()`)")
        return self._sync

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> ConsumerRecord:
        try:
            return self._take()  # the common case: one C call
        except IndexError:
            pass
        buffer = self._buffer
        sync = self.node
        try:
            if sync._group is None:
                # Taken from the node's queue YIELD_EVERY at a time (one call),
                # handed out from here; the loop's other tasks run in between.
                batch = sync.poll_batch(YIELD_EVERY, 0)
                if batch:
                    buffer.extend(batch)
                    await asyncio.sleep(0)
                    if buffer:
                        return buffer.popleft()
            else:
                # A group member marks a record polled only when the caller takes
                # it (commits must not run ahead of it): one at a time.
                record = sync.poll(0)
                if record is not None:
                    self._streak += 1
                    if self._streak >= YIELD_EVERY:
                        self._streak = 0
                        await asyncio.sleep(0)
                    return record
                self._streak = 0
            record = await self.poll(None)
        except ClosedError:
            raise StopAsyncIteration from None
        assert record is not None
        return record

    async def poll(self, timeout: float | None = None) -> ConsumerRecord | None:
        """The next record, waiting up to ``timeout`` seconds (None: until one comes).

        Raises :class:`~dafka.errors.ClosedError` once the consumer is closed.
        """
        if self._buffer:
            return self._buffer.popleft()
        sync = self.node
        record = sync.poll(0)
        if record is not None:
            return record
        loop = self._loop
        assert loop is not None
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            waker = _Waker(loop)
            # Listed before the queue is checked again: records queued after
            # the check find it in the list and wake it (as the threaded poll).
            sync._sleepers.append(waker)
            timer = None
            try:
                record = sync.poll(0)
                if record is not None:
                    return record
                if deadline is not None:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return None
                    timer = loop.call_later(remaining, waker.wake)
                await waker.future
            finally:
                if timer is not None:
                    timer.cancel()
                try:
                    sync._sleepers.remove(waker)
                except ValueError:
                    pass  # taken out by the I/O thread that woke it

    async def poll_batch(self, max_records: int = 10_000, timeout: float | None = None) -> list[ConsumerRecord]:
        """Up to ``max_records`` records; waits up to ``timeout`` for the first."""
        first = await self.poll(timeout)
        if first is None:
            return []
        batch = [first]
        buffer = self._buffer
        while buffer and len(batch) < max_records:
            batch.append(buffer.popleft())
        if len(batch) < max_records:
            batch += self.node.poll_batch(max_records - len(batch), 0)
        return batch

    async def commit(self, timeout: float = 5.0) -> dict[Key, int]:
        """Commit the group's positions (what was polled); see :meth:`dafka.consumer.Consumer.commit`."""
        return await asyncio.to_thread(self.node.commit, timeout)

    def positions(self) -> dict[tuple[str, str], int]:
        """Next offset to deliver per (topic, partition) known so far."""
        return self.node.positions()

    def assignment(self) -> frozenset[Key]:
        """The partitions this group member delivers now (without a group: every known one)."""
        return self.node.assignment()

    async def close(self, timeout: float = 5.0) -> None:
        """Stop the consumer (a group member commits what was polled and leaves first)."""
        sync = self._sync
        if sync is not None and not sync._closed:
            await asyncio.to_thread(sync.close, timeout)
