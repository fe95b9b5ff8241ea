"""Kafka frameworks run unchanged against a real gateway process: a quixstreams
Application (at-least-once, killed with SIGKILL mid-run and restarted), a quixstreams
stateful count (exactly-once, killed, its state recovered from its compacted changelog
topic), and aiokafka consumers in a group with commits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer as CKConsumer
from confluent_kafka import Producer as CKProducer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import subprocess_env, wait_until
from tests.kafka.test_admin import gateway  # noqa: F401  (the gateway process, module-scoped)

pytest.importorskip("quixstreams")
pytest.importorskip("aiokafka")
pytestmark = pytest.mark.timeout(180)

APP = """
import json, sys, time
from quixstreams import Application

bootstrap, state, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
app = Application(broker_address=bootstrap, consumer_group="qs", auto_offset_reset="earliest",
                  processing_guarantee="at-least-once", commit_interval=0.3, state_dir=state,
                  # the killed member's session ends sooner than quixstreams' default 45 s
                  consumer_extra_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
orders = app.topic("qs-orders", value_deserializer="json")
big = app.topic("qs-big", value_serializer="json")


def slowly(order):
    time.sleep(linger)  # the first run is killed half way
    return {"id": order["id"], "total": order["total"] * 10}


sdf = app.dataframe(orders)
sdf = sdf.filter(lambda order: order["total"] % 2 == 0).apply(slowly)
sdf.to_topic(big)
app.run(timeout=4.0)
"""


def out_records(bs: str, topic: str, timeout: float = 30.0) -> list[dict]:
    """Every record of partition 0 of ``topic``, read from its start."""
    c = CKConsumer({"bootstrap.servers": bs, "group.id": "reader", "auto.offset.reset": "earliest"})
    got: list[dict] = []
    try:
        hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
        c.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while len(got) < hi and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                got.append(json.loads(m.value()))
    finally:
        c.close()
    return got


def test_a_quixstreams_application_runs_at_least_once_through_a_sigkill(gateway: str, tmp_path: Path) -> None:  # noqa: F811
    admin = AdminClient({"bootstrap.servers": gateway})
    for t in admin.create_topics([NewTopic("qs-orders", 1, 1), NewTopic("qs-big", 1, 1)]).values():
        t.result(20)
    p = CKProducer({"bootstrap.servers": gateway, "linger.ms": 5})
    for i in range(200):
        p.produce("qs-orders", key=str(i), value=json.dumps({"id": i, "total": i}).encode())
    assert p.flush(30) == 0
    script = tmp_path / "app.py"
    script.write_text(APP)
    env = subprocess_env()

    def run(linger: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(script), gateway, str(tmp_path / "state"), str(linger)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    first = run(0.05)  # 100 outputs take 5 s at least: it is killed well before
    try:
        def outputs() -> int:
            c = CKConsumer({"bootstrap.servers": gateway, "group.id": "probe"})
            try:
                return int(c.get_watermark_offsets(TopicPartition("qs-big", 0), timeout=10)[1])
            finally:
                c.close()

        wait_until(lambda: outputs() >= 20, 60, 0.2)
        os.kill(first.pid, signal.SIGKILL)  # half way, between commits
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    killed_at = outputs()
    assert killed_at < 100, "the first run was not stopped half way"
    second = run(0.0)
    try:
        _, err = second.communicate(timeout=90)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(10)
    assert second.returncode == 0, err.decode()[-3000:]
    got = out_records(gateway, "qs-big")
    expected = {(i, i * 10) for i in range(0, 200, 2)}
    assert {(r["id"], r["total"]) for r in got} == expected  # every output, at least once
    assert len(got) >= 100
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": "qs"})
    try:
        assert c.committed([TopicPartition("qs-orders", 0)], timeout=20)[0].offset == 200
    finally:
        c.close()


def test_aiokafka_consumers_share_a_group_and_resume_from_their_commits(gateway: str) -> None:  # noqa: F811
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.structs import TopicPartition as ATP

    admin = AdminClient({"bootstrap.servers": gateway})
    admin.create_topics([NewTopic("aio", 4, 1)])["aio"].result(20)

    async def produce(start: int, n: int) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=gateway, acks="all")
        await producer.start()
        try:
            for i in range(start, start + n):
                await producer.send_and_wait("aio", b"%d" % i, partition=i % 4)
        finally:
            await producer.stop()

    async def consume(consumers: list[AIOKafkaConsumer], n: int) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        deadline = time.monotonic() + 60
        while sum(map(len, got.values())) < n and time.monotonic() < deadline:
            for i, c in enumerate(consumers):
                batches = await c.getmany(timeout_ms=200)
                for records in batches.values():
                    got.setdefault(i, []).extend(int(r.value) for r in records)
                if batches:
                    await c.commit()
        return got

    async def main() -> None:
        members = [AIOKafkaConsumer("aio", bootstrap_servers=gateway, group_id="aio-group",
                                    auto_offset_reset="earliest", enable_auto_commit=False,
                                    session_timeout_ms=6000, heartbeat_interval_ms=500) for _ in range(2)]
        for c in members:
            await c.start()
        try:
            # Both members hold partitions before any record is there to take.  Wait for the
            # rebalance to settle, not just for both to hold some: a member that has not yet
            # read its SyncGroup answer still shows the last generation's (all four).
            def split() -> list[int]:
                return sorted(p.partition for c in members for p in c.assignment())

            deadline = time.monotonic() + 60
            while not (all(c.assignment() for c in members) and split() == [0, 1, 2, 3]) \
                    and time.monotonic() < deadline:
                for c in members:
                    await c.getmany(timeout_ms=100)
            assert split() == [0, 1, 2, 3]
            await produce(0, 100)
            got = await consume(members, 100)
            assert sorted(v for vs in got.values() for v in vs) == list(range(100))
            assert len(got) == 2, "both members got partitions"
            committed = {p: await members[0].committed(ATP("aio", p)) for p in range(4)}
            assert committed == {p: 25 for p in range(4)}
        finally:
            for c in members:
                await c.stop()
        # A new member of the group resumes from the commits: only the new records.
        await produce(100, 8)
        again = AIOKafkaConsumer("aio", bootstrap_servers=gateway, group_id="aio-group",
                                 auto_offset_reset="earliest", enable_auto_commit=False)
        await again.start()
        try:
            got = await consume([again], 8)
            assert sorted(got[0]) == list(range(100, 108))
        finally:
            await again.stop()

    asyncio.run(main())


# ---------------------------------------------------------------- quixstreams state, exactly once

COUNT_APP = """
import sys, time
from quixstreams import Application

bootstrap, state, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
app = Application(broker_address=bootstrap, consumer_group="qs-count", auto_offset_reset="earliest",
                  processing_guarantee="exactly-once", commit_interval=0.3, state_dir=state,
                  consumer_extra_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
                  # the killed run's open transaction is aborted by the gateway after this
                  producer_extra_config={"transaction.timeout.ms": 3000})
orders = app.topic("st-orders", value_deserializer="json")
counts = app.topic("st-counts", value_serializer="json")


def count(order, state):
    time.sleep(linger)  # the first run is killed half way
    n = state.get("orders", 0) + 1
    state.set("orders", n)
    return {"id": order["id"], "total": order["total"], "n": n}


sdf = app.dataframe(orders)
sdf = sdf.filter(lambda order: order["total"] % 2 == 0)
sdf = sdf.apply(lambda order: {"id": order["id"], "total": order["total"] * 10})
sdf = sdf.apply(count, stateful=True)  # per customer (the message key), in a changelogged store
sdf.to_topic(counts)
app.run(timeout=3.0)
"""
CHANGELOG = "changelog__qs-count--st-orders--default"


def committed_records(bs: str, topic: str, timeout: float = 20.0) -> list[tuple[int, bytes | None, bytes | None]]:
    """(offset, key, value) of every record of partition 0 of ``topic`` a read_committed reader gets."""
    c = CKConsumer({"bootstrap.servers": bs, "group.id": "counts-reader", "isolation.level": "read_committed",
                    "enable.partition.eof": True, "enable.auto.commit": False})
    got: list[tuple[int, bytes | None, bytes | None]] = []
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error():
                break  # the end of the partition
            got.append((m.offset(), m.key(), m.value()))
        else:
            raise AssertionError(f"{topic} not read to its end")
    finally:
        c.close()
    return got


def test_a_quixstreams_stateful_count_recovers_from_its_compacted_changelog_exactly_once(tmp_path: Path) -> None:
    """A counting application (filter, map, a stateful count per key, to_topic) with
    exactly-once processing, killed with SIGKILL mid-run and started again on an empty state
    directory (as on another machine): its state comes back from the changelog topic that
    quixstreams created compacted, and every count is written exactly once. The gateway then
    compacts the changelog, and a third run, again on an empty state directory, recovers from the
    compacted changelog (offset gaps and all) and counts on."""
    from tests.kafka.test_compaction import start_gateway, stored_count, topic_configs

    db = tmp_path / "gw"
    proc, bs = start_gateway(db)
    try:
        admin = AdminClient({"bootstrap.servers": bs})
        for t in admin.create_topics([NewTopic("st-orders", 1, 1), NewTopic("st-counts", 1, 1)]).values():
            t.result(20)
        src = CKProducer({"bootstrap.servers": bs, "linger.ms": 5})

        def orders(ids: range) -> None:
            for i in ids:  # five customers; the even totals are counted
                src.produce("st-orders", key=f"c{i % 5}", value=json.dumps({"id": i, "total": i}).encode())
            assert src.flush(30) == 0

        orders(range(200))
        script = tmp_path / "app.py"
        script.write_text(COUNT_APP)

        def run(state: str, linger: float) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, str(script), bs, str(tmp_path / state), str(linger)],
                                    env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def finish(app: subprocess.Popen[bytes]) -> None:
            try:
                _, err = app.communicate(timeout=90)
            finally:
                if app.poll() is None:
                    app.kill()
                    app.wait(10)
            assert app.returncode == 0, err.decode()[-3000:]

        def written() -> int:
            c = CKConsumer({"bootstrap.servers": bs, "group.id": "probe"})
            try:
                return int(c.get_watermark_offsets(TopicPartition("st-counts", 0), timeout=10)[1])
            finally:
                c.close()

        def committed_at() -> int:
            c = CKConsumer({"bootstrap.servers": bs, "group.id": "qs-count"})
            try:
                return int(c.committed([TopicPartition("st-orders", 0)], timeout=10)[0].offset)
            finally:
                c.close()

        first = run("state-1", 0.05)  # 100 counts take 5 s at least: killed well before
        try:
            # Killed once some counts are committed (the next run must recover them), and
            # with more written than committed (an open transaction to abort).
            wait_until(lambda: committed_at() >= 20 and written() >= 20, 60, 0.2)
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(10)
        assert committed_at() < 200, "the first run was not stopped half way"
        # quixstreams made its changelog topic compacted, through CreateTopics.
        assert topic_configs(bs, CHANGELOG)["cleanup.policy"].value == "compact"
        finish(run("state-2", 0.0))  # a state directory of its own: the changelog is all it has

        def expected(ids: range) -> list[tuple[int, int, int]]:
            seen: dict[int, int] = {}
            out = []
            for i in ids:
                if i % 2 == 0:
                    seen[i % 5] = seen.get(i % 5, 0) + 1
                    out.append((i, i * 10, seen[i % 5]))
            return out

        def outputs() -> list[tuple[int, int, int]]:
            return [(r["id"], r["total"], r["n"]) for r in
                    (json.loads(v or b"") for _o, _k, v in committed_records(bs, "st-counts"))]

        want = expected(range(200))
        assert sorted(outputs()) == want  # each count once, and right through the kill
        # The gateway compacts the changelog (in the background): one committed record per
        # customer is left, offsets keeping their numbers, with gaps.
        def compacted() -> bool:
            keys = [k for _o, k, _v in committed_records(bs, CHANGELOG)]
            return len(keys) == len(set(keys)) == 5

        wait_until(compacted, 60, 0.5)
        c = CKConsumer({"bootstrap.servers": bs, "group.id": "probe"})
        try:
            end = int(c.get_watermark_offsets(TopicPartition(CHANGELOG, 0), timeout=10)[1])
        finally:
            c.close()
        offsets = [o for o, _k, _v in committed_records(bs, CHANGELOG)]
        assert offsets[0] > 0 and stored_count(db, CHANGELOG) < end  # superseded records gone
        # Recovered from the compacted changelog alone, the counts go on.
        orders(range(200, 210))
        finish(run("state-3", 0.0))
        assert sorted(outputs()) == sorted(want + [(i, i * 10, 21) for i in range(200, 210, 2)])
        c = CKConsumer({"bootstrap.servers": bs, "group.id": "qs-count"})
        try:
            assert c.committed([TopicPartition("st-orders", 0)], timeout=20)[0].offset == 210
        finally:
            c.close()
    finally:
        proc.kill()
        proc.wait(10)
