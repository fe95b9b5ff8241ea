"""dafka.aio on real nodes: a tower, an in-process store, real ZeroMQ on 127.0.0.1.

Coroutine tests run on anyio's pytest plugin with its asyncio backend.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from dafka import aio
from dafka.config import NodeConfig
from dafka.errors import BufferFullError, ClosedError, PublishError, SerializationError
from dafka.store.node import Store

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def until(predicate: Any, timeout: float = 10.0) -> None:
    """Await until ``predicate()`` is truthy (bounded, without blocking the loop)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


@pytest.mark.anyio
async def test_publish_acknowledged_and_read_back(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(tmp_path / "db", cfg):
        async with (
            aio.Producer("a", cfg, serializer="msgpack") as producer,
            aio.Consumer("a", cfg, offset_reset="earliest", deserializer="msgpack") as consumer,
        ):
            assert await producer.publish({"n": 0}) == 0
            receipts = [producer.publish_nowait({"n": i}) for i in range(1, 100)]
            assert not receipts[-1].done() and receipts[-1].offset is None
            assert await receipts[-1] == 99
            assert [await r for r in receipts] == list(range(1, 100))
            assert receipts[5].done() and receipts[5].result() == 6 and receipts[5].offset == 6
            assert await producer.flush(5)
            with pytest.raises(SerializationError):
                producer.publish_nowait({1, 2})
            async with aio.Producer("a", cfg) as raw:
                with pytest.raises(TypeError):
                    raw.publish_nowait("text")  # plain bytes producer
                await raw.publish(msgpack.packb({"raw": True}))
            got = []
            async for record in consumer:
                got.append(record)
                if len(got) == 101:
                    break
        assert sorted(r.value["n"] for r in got if "n" in r.value) == list(range(100))
        assert [r.value for r in got if "raw" in r.value] == [{"raw": True}]


@pytest.mark.anyio
async def test_poll_timeout_and_close_ends_iteration(cfg: NodeConfig) -> None:
    async with aio.Consumer("idle", cfg) as consumer:
        t0 = time.monotonic()
        assert await consumer.poll(0.2) is None
        assert 0.15 <= time.monotonic() - t0 < 2.0
        assert await consumer.poll_batch(10, 0.05) == []
        ended = asyncio.Event()

        async def iterate() -> None:
            async for _ in consumer:
                pass
            ended.set()

        task = asyncio.ensure_future(iterate())
        await asyncio.sleep(0.1)
        await consumer.close()
        await asyncio.wait_for(ended.wait(), 5)
        await task
        with pytest.raises(ClosedError):
            await consumer.poll(0)


@pytest.mark.anyio
async def test_unacknowledged_records_fail_and_buffer_bounds(cfg: NodeConfig) -> None:
    # No store: nothing is ever acknowledged.
    producer = aio.Producer("lonely", cfg, capacity=3, publish_timeout=0)
    with pytest.raises(ClosedError):
        producer.publish_nowait(b"before start")
    await producer.start()
    receipts = [producer.publish_nowait(b"x%d" % i) for i in range(3)]
    with pytest.raises(BufferFullError):
        producer.publish_nowait(b"one too many")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(producer.publish(b"waits for room"), 0.3)
    assert not await producer.flush(0.3)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(receipts[0], 0.1)  # cancelling a wait leaves the record alone
    assert not await producer.close(0.3)
    for i, receipt in enumerate(receipts):
        assert receipt.done()
        with pytest.raises(PublishError) as info:
            await receipt
        assert info.value.offset == i
    with pytest.raises(ClosedError):
        producer.publish_nowait(b"after close")


@pytest.mark.anyio
async def test_event_loop_never_blocked(cfg: NodeConfig, tmp_path: Path) -> None:
    """A 10 ms ticker on the same loop never waits > 100 ms while 2,000 records
    are published (acknowledged) and read back."""
    n = 2000
    with Store(tmp_path / "db", cfg):
        async with (
            aio.Producer("tick", cfg) as producer,
            aio.Consumer("tick", cfg, offset_reset="earliest") as consumer,
        ):
            await until(lambda: len(producer.node.peers) >= 2 and len(consumer.node.peers) >= 2)
            lateness: list[float] = []
            stop = False

            async def ticker() -> None:
                while not stop:
                    t0 = time.monotonic()
                    await asyncio.sleep(0.01)
                    lateness.append(time.monotonic() - t0 - 0.01)

            async def read() -> list[int]:
                offsets = []
                async for record in consumer:
                    offsets.append(record.offset)
                    if len(offsets) == n:
                        break
                return offsets

            tick = asyncio.ensure_future(ticker())
            reader = asyncio.ensure_future(read())
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            for i in range(0, n, 100):
                if i % 500 == 0:
                    await producer.publish(b"r%d" % i)  # waits for its ACK
                    start = i + 1
                else:
                    start = i
                for j in range(start, i + 100):
                    producer.publish_nowait(b"r%d" % j)
                await asyncio.sleep(0)
            assert await producer.flush(30)
            offsets = await asyncio.wait_for(reader, 30)
            elapsed = time.monotonic() - t0
            stop = True
            await tick
        assert offsets == list(range(n))
        assert len(lateness) >= 5, (len(lateness), elapsed)
        assert max(lateness) < 0.1, f"ticker waited {max(lateness) * 1000:.0f} ms (of {len(lateness)} ticks)"


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Counts the event loop's wake-ups (one select() per turn of the loop)."""

    selects = 0

    def select(self, timeout: float | None = None) -> Any:
        CountingSelector.selects += 1
        return super().select(timeout)


def test_idle_consumer_costs_no_wakeups(cfg: NodeConfig, tmp_path: Path) -> None:
    """An idle ``async for`` waits on a future the I/O thread resolves: no polling.

    Over one idle second the loop turns a handful of times (an asyncio.sleep
    alone is 2); a consumer polling every 10 ms would turn it ~100 times.  Its
    thread's CPU stays near zero.  Then one record wakes it at once.
    """
    from dafka.nodes.producer import Producer

    async def scenario() -> tuple[int, float, float]:
        async with aio.Consumer("quiet", cfg) as consumer:
            got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

            async def iterate() -> None:
                async for record in consumer:
                    got.set_result(record)
                    return

            task = asyncio.ensure_future(iterate())
            await asyncio.sleep(0.3)  # settle: node started, iteration waiting
            before, cpu0 = CountingSelector.selects, time.thread_time()
            await asyncio.sleep(1.0)
            turns, cpu = CountingSelector.selects - before, time.thread_time() - cpu0
            with Producer("quiet", cfg, acks=False) as producer:
                await until(lambda: len(consumer.node.peers) >= 1 and producer.peers)
                await asyncio.sleep(0.5)  # its subscription reaches the producer
                t0 = time.monotonic()
                producer.publish(b"wake up")
                record = await asyncio.wait_for(got, 10)
                latency = time.monotonic() - t0
            await task
            assert record.content == b"wake up"
            return turns, cpu, latency

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(CountingSelector())) as runner:
        turns, cpu, latency = runner.run(scenario())
    assert turns <= 10, f"the idle loop woke {turns} times in 1 s"
    assert cpu < 0.05, f"the idle loop's thread used {cpu * 1000:.0f} ms of CPU in 1 s"
    assert latency < 1.0


@pytest.mark.anyio
async def test_group_members_share_and_commit(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(tmp_path / "db", cfg) as store:
        async with aio.Producer("g", cfg) as producer:
            for i in range(20):
                producer.publish_nowait(b"g%d" % i)
            assert await producer.flush(10)
            key = ("g", producer.address)
        async with aio.Consumer("g", cfg, group="grp", offset_reset="earliest") as member:
            got = [await member.poll(10) for _ in range(12)]
            assert [r.offset for r in got if r] == list(range(12))
            assert member.assignment() == frozenset({key})
            assert await member.commit() == {key: 12}
            assert store.db.positions("grp") == {key: 12}
        async with aio.Consumer("g", cfg, group="grp", offset_reset="earliest") as again:
            record = await again.poll(10)
            assert record is not None and record.offset == 12
        async with aio.Consumer("g", cfg) as plain:
            with pytest.raises(ValueError):
                await plain.commit()
