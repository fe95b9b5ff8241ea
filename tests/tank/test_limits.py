"""Hostile Tank clients against the real gateway (real TCP on 127.0.0.1, real LMDB).

Each test plays an attacker that, before the limits, could make the gateway
hold hundreds of MiB or a connection forever, and checks that a normal client
is served all along (issue 21, item 4).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.errors import ConfigError
from dafka.tank.bundle import CODEC_NONE, encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.codec import frame_header
from dafka.tank.gateway import TANK_VERSION, Gateway
from dafka.tank.limits import GatewayLimits, answer_budget, slowest_holder, too_slow
from dafka.tank.messages import (
    ConsumeFlag,
    ConsumePartition,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopic,
    CreateTopicError,
    CreateTopicRequest,
    CreateTopicResponse,
    DiscoverPartitionsRequest,
    MsgId,
    StatusRequest,
)
from tests.conftest import wait_until
from tests.tank.test_gateway import (
    HOST,
    connect_raw,
    consume_all,
    intact,
    produce_frame,
    read_until_closed,
    recv_frame,
    values,
    witness,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def make(tmp_path: Path) -> Any:
    made: list[Gateway] = []

    def start(**limits: Any) -> Gateway:
        gw = Gateway(
            tmp_path / f"gw{len(made)}", NodeConfig(towers=()), listen=(HOST, 0), limits=GatewayLimits(**limits)
        )
        made.append(gw)
        return gw

    yield start
    for gw in made:
        gw.close()


def served(gw: Gateway, kept: list[bytes], w: TankClient) -> bool:
    """The normal client's connection answers, and a new one reads the acknowledged data."""
    return w.status().version == TANK_VERSION and intact(gw, kept)


def peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (the peak resident set)
        return True
    except OSError:
        return False


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# ---------------------------------------------------------------- consume answers


def test_one_partition_named_240_times_is_served_once(make: Any) -> None:
    gw = make()
    w, kept = witness(gw)
    try:
        w.create_topic("big", 1)
        records = [os.urandom(100_000) for _ in range(12)]  # 1.2 MB, incompressible
        for r in records:  # a bundle each: answers hold whole bundles
            assert w.produce("big", 0, [r], codec=CODEC_NONE) == 0
        # The outsider's 3.4 KB request: one partition 240 times, 1 MiB each.
        req = ConsumeRequest(7, [ConsumeTopic("big", [ConsumePartition(0, 1, 1 << 20)] * 240)])
        frame = req.encode()
        assert len(frame) < 3500
        s = connect_raw(gw.tank_port)
        try:
            tracked = peak_rss_reset()
            before = peak_rss()
            s.sendall(frame)
            msg_id, payload = recv_frame(s)
            grown = peak_rss() - before
        finally:
            s.close()
        assert msg_id == MsgId.CONSUME
        # Before: 240 copies, 240 MB.  Now one partition's answer (<= 1 MiB + one bundle).
        assert len(payload) < (1 << 20) + 200_000, len(payload)
        resp = ConsumeResponse.decode(payload)
        parts = resp.topics[0].partitions
        assert len(parts) == 240  # the answer keeps the request's shape
        got = [bytes(r[3]) for r in parts[0].decode_chunk(1).records]
        assert 10 <= len(got) <= 11 and got == records[: len(got)]  # whole bundles, up to fetch_size
        assert all(p.flags == ConsumeFlag.OK and not p.chunk and p.hwm == 12 for p in parts[1:])
        if tracked:
            assert grown < 100 << 20, f"peak RSS grew {grown >> 20} MiB"
        assert served(gw, kept, w)
    finally:
        w.close()


def test_a_consume_answer_holds_at_most_max_answer_bytes(make: Any) -> None:
    gw = make(max_answer_bytes=2 << 20)
    w, kept = witness(gw)
    try:
        w.create_topic("wide", 12)
        for pid in range(12):
            assert w.produce("wide", pid, [os.urandom(500_000), os.urandom(500_000)], codec=CODEC_NONE) == 0
        req = ConsumeRequest(9, [ConsumeTopic("wide", [ConsumePartition(pid, 1, 4 << 20) for pid in range(12)])])
        s = connect_raw(gw.tank_port)
        try:
            s.sendall(req.encode())
            _, payload = recv_frame(s)
        finally:
            s.close()
        # Before: 12 MB.  Now 2 MiB of records, then empty answers the client asks again for.
        assert len(payload) < (2 << 20) + 100_000, len(payload)
        parts = ConsumeResponse.decode(payload).topics[0].partitions
        with_data = [p for p in parts if p.chunk]
        assert len(with_data) == 2 and [p.partition for p in with_data] == [0, 1]
        assert all(p.flags == ConsumeFlag.OK and p.hwm == 2 for p in parts)
        # The client asks again from where it is: partition 11 is served.
        assert len(w.consume("wide", 11, 1, 4 << 20).messages) == 2
        assert served(gw, kept, w)
    finally:
        w.close()


def test_parked_fetches_of_one_connection_are_bounded(make: Any) -> None:
    gw = make()
    w, kept = witness(gw)
    try:
        w.create_topic("quiet", 200)
        # 40 long polls of 200 partitions each: 8000 entries, over the 4096 a connection may park.
        tail = [ConsumePartition(pid, 1, 1 << 20) for pid in range(200)]
        s = connect_raw(gw.tank_port)
        try:
            s.sendall(b"".join(ConsumeRequest(i, [ConsumeTopic("quiet", tail)], "", 60_000).encode() for i in range(40)))
            answered = [ConsumeResponse.decode(recv_frame(s)[1]).req_id for _ in range(20)]
            assert answered == list(range(20, 40))  # the ones past the bound, at once
            assert sum(len(p.request.topics[0].partitions) for p in gw._parked_all) == 4000
        finally:
            s.close()
        wait_until(lambda: not gw._parked_all)
        assert served(gw, kept, w)
    finally:
        w.close()


# ---------------------------------------------------------------- requests in flight


def test_a_slow_loris_frame_is_closed(make: Any) -> None:
    gw = make(request_timeout=0.5, min_request_rate=1000)
    w, kept = witness(gw)
    try:
        s = connect_raw(gw.tank_port)
        s.sendall(frame_header(MsgId.PRODUCE, 1 << 20))  # announces 1 MiB ...
        started = time.monotonic()
        closed = False
        try:
            for _ in range(100):  # ... and sends a byte every 0.1 s: never silent 0.5 s
                s.sendall(b"\0")
                time.sleep(0.1)
                assert w.status().version == TANK_VERSION  # others are served meanwhile
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        if not closed:
            assert read_until_closed(s, timeout=2) == b""
        assert time.monotonic() - started < 5, "the trickling sender was kept"
        s.close()
        assert gw.connections == 1 and served(gw, kept, w)
    finally:
        w.close()


def test_a_slow_but_steady_request_is_served(make: Any) -> None:
    gw = make(request_timeout=0.3, min_request_rate=1000)
    w, kept = witness(gw)
    try:
        frame = DiscoverPartitionsRequest(5, "keep", list(range(10_000))).encode()  # 20 KB
        s = connect_raw(gw.tank_port)
        try:
            for i in range(0, len(frame), 2000):  # 20 KB/s over a second
                s.sendall(frame[i : i + 2000])
                time.sleep(0.1)
            msg_id, payload = recv_frame(s)
            assert msg_id == MsgId.DISCOVER_PARTITIONS and len(payload) > 16 * 10_000
        finally:
            s.close()
        assert served(gw, kept, w)
    finally:
        w.close()


def test_an_announced_frame_over_the_limit_is_refused_at_once(tmp_path: Path) -> None:
    # The default limits (max_request_bytes 64 MiB; it was Tank's 256 MiB).
    with Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0)) as gw:
        w, kept = witness(gw)
        _refused_at_once(gw, w, kept)


def _refused_at_once(gw: Gateway, w: TankClient, kept: list[bytes]) -> None:
    try:
        s = connect_raw(gw.tank_port)
        started = time.monotonic()
        s.sendall(frame_header(MsgId.PRODUCE, 200 << 20) + b"\0" * 1000)
        assert read_until_closed(s, timeout=5) == b""
        assert time.monotonic() - started < 2
        s.close()
        assert served(gw, kept, w)
    finally:
        w.close()


def test_request_bytes_in_flight_are_bounded_over_all_connections(make: Any, caplog: Any) -> None:
    gw = make(max_request_bytes=1 << 20, max_buffered_bytes=1 << 20, request_timeout=5, min_request_rate=0)
    w, kept = witness(gw)
    first = b"".join(
        [frame_header(MsgId.PRODUCE, 1 << 20), os.urandom(1 << 20)]
    )  # malformed once complete: closes its connection
    second = StatusRequest(4).encode()
    a = connect_raw(gw.tank_port)
    b = connect_raw(gw.tank_port)
    try:
        with caplog.at_level(logging.WARNING, logger="dafka.gateway"):
            a.sendall(first[: 600_000])
            wait_until(lambda: gw._reserved == 1 << 20)
            # b's large request cannot be reserved: it waits, unread, and is not closed.
            big = frame_header(MsgId.PRODUCE, 700_000)
            b.sendall(big + b"\0" * 100)
            wait_until(lambda: gw._budget_waiting)
            assert "max_buffered_bytes" in caplog.text
            assert gw._reserved == 1 << 20
            assert served(gw, kept, w)
            a.sendall(first[600_000:])
            assert read_until_closed(a) == b""  # a's request was not a produce request
            wait_until(lambda: not gw._budget_waiting and gw._reserved == 700_000)
        b.close()
        wait_until(lambda: gw._reserved == 0)
        c = connect_raw(gw.tank_port)
        c.sendall(second)
        assert recv_frame(c)[0] == MsgId.STATUS
        c.close()
        assert served(gw, kept, w)
    finally:
        a.close()
        b.close()
        w.close()


def test_senders_just_above_the_minimum_rate_cannot_hold_the_budget(make: Any) -> None:
    # Four connections announce large produce frames, reserving the whole request budget, and
    # trickle them just above min_request_rate: without a rule they would hold it for as long
    # as their frames take (64 MiB at 16 KiB/s: 68 minutes) while every other large request
    # waits.  Once a request has waited request_timeout, the slowest holder is cut, one a timeout.
    gw = make(max_request_bytes=1 << 20, max_buffered_bytes=4 << 20, request_timeout=1.5, min_request_rate=1024)
    w, kept = witness(gw)
    evil = [connect_raw(gw.tank_port) for _ in range(4)]
    honest = connect_raw(gw.tank_port)
    try:
        for s in evil:
            s.sendall(frame_header(MsgId.PRODUCE, (1 << 20) - 10) + b"\2\0")
        wait_until(lambda: gw._reserved == 4 * ((1 << 20) - 10))
        honest.sendall(frame_header(MsgId.STATUS, 900_000) + b"\0" * 900_000)  # large: it must reserve
        wait_until(lambda: gw._budget_waiting)
        deadline = time.monotonic() + 20
        cut: set[int] = set()
        while gw._budget_waiting and time.monotonic() < deadline:
            for i, s in enumerate(evil):  # 2 KiB/s each: above min_request_rate
                if i not in cut:
                    try:
                        s.sendall(b"\0" * 512)
                    except OSError:
                        cut.add(i)
            time.sleep(0.25)
        assert not gw._budget_waiting, "the honest request still waits for the budget"
        assert gw.budget_evictions >= 1
        assert served(gw, kept, w)
    finally:
        for s in evil:
            s.close()
        honest.close()
        w.close()


def test_an_unread_answer_closes_its_connection_after_the_timeout(make: Any) -> None:
    gw = make(request_timeout=0.5, max_output_bytes=1 << 20)
    w, kept = witness(gw)
    try:
        w.create_topic("big", 1)
        assert w.produce("big", 0, [os.urandom(1 << 20) for _ in range(8)], codec=CODEC_NONE) == 0
        s = connect_raw(gw.tank_port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"".join(ConsumeRequest(i, [ConsumeTopic("big", [ConsumePartition(0, 1, 8 << 20)])]).encode() for i in range(8)))
        wait_until(lambda: gw.connections == 1, timeout=10)  # closed, never having read
        s.close()
        assert served(gw, kept, w)
    finally:
        w.close()


# ---------------------------------------------------------------- connections and topics


def test_connections_over_the_limit_are_refused(make: Any, caplog: Any) -> None:
    gw = make(max_connections=4)
    w, kept = witness(gw)  # one of the four
    held: list[socket.socket] = []
    try:
        held = [connect_raw(gw.tank_port) for _ in range(3)]
        with caplog.at_level(logging.WARNING, logger="dafka.gateway"):
            extra = socket.create_connection((HOST, gw.tank_port), timeout=10)
            assert read_until_closed(extra, timeout=5) == b""  # not even the greeting
            extra.close()
            assert "max_connections" in caplog.text
        assert gw.connections_refused == 1
        assert w.status().version == TANK_VERSION
        held.pop().close()
        wait_until(lambda: gw.connections == 3)
        assert served(gw, kept, w)  # a new connection is taken again
    finally:
        for s in held:
            s.close()
        w.close()


def create(gw: Gateway, topic: str, partitions: int) -> int:
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(CreateTopicRequest(3, topic, partitions).encode())
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.CREATE_TOPIC
        return CreateTopicResponse.decode(payload).error
    finally:
        s.close()


def test_create_topic_partitions_are_capped(make: Any, caplog: Any) -> None:
    gw = make()
    w, kept = witness(gw)
    try:
        with caplog.at_level(logging.WARNING, logger="dafka.gateway"):
            assert create(gw, "huge", 65_282) == CreateTopicError.INVALID
        assert "max_partitions_per_topic" in caplog.text
        assert gw.pmap.partitions("huge") is None and len(gw.pmap) == 1
        assert create(gw, "fits", 1024) == CreateTopicError.OK
        assert served(gw, kept, w)
    finally:
        w.close()
    small = make(max_partitions_per_topic=8)
    assert create(small, "nine", 9) == CreateTopicError.INVALID
    assert create(small, "eight", 8) == CreateTopicError.OK


def test_topics_created_over_all_are_capped(make: Any, caplog: Any) -> None:
    """Many small topics (each within max_partitions_per_topic) cost a HEAD each every announce
    interval and a line of the map: the gateway's own partitions are bounded over all topics."""
    gw = make(max_owned_partitions=40)
    w, kept = witness(gw)  # its topic holds one owned partition
    try:
        with caplog.at_level(logging.WARNING, logger="dafka.gateway"):
            results = [create(gw, f"t{i}", 8) for i in range(6)]
        assert results[:4] == [CreateTopicError.OK] * 4  # 1 + 4 x 8 = 33 of 40
        assert results[4:] == [CreateTopicError.INVALID] * 2
        assert "max_owned_partitions" in caplog.text and gw.topics_refused == 2
        assert gw.pmap.partitions("t4") is None
        assert create(gw, "last", 7) == CreateTopicError.OK  # what is left still fits
        assert served(gw, kept, w)
    finally:
        w.close()


# ---------------------------------------------------------------- configuration and rules


def test_limits_from_the_gateway_table_and_flags() -> None:
    from dafka.cli import build_parser

    assert GatewayLimits.from_settings({}) == GatewayLimits()
    limits = GatewayLimits.from_settings({"max_connections": 10, "request_timeout": 5})
    assert (limits.max_connections, limits.request_timeout) == (10, 5.0)
    args = build_parser().parse_args(["gateway", "--db", "x", "--max-connections", "3", "--min-request-rate", "0"])
    limits = GatewayLimits.from_settings({"max_connections": 10, "max_answer_bytes": 5000}, args)
    assert (limits.max_connections, limits.max_answer_bytes, limits.min_request_rate) == (3, 5000, 0)
    for bad in ({"max_connections": "many"}, {"max_connections": 0}, {"request_timeout": -1},
                {"max_request_bytes": 10, "max_buffered_bytes": 5}, {"max_partitions_per_topic": 70_000},
                {"max_answer_bytes": 1.5}, {"max_connections": True}):
        with pytest.raises(ConfigError, match=r"\[gateway\]"):
            GatewayLimits.from_settings(bad)


def test_progress_and_budget_rules() -> None:
    limits = GatewayLimits(request_timeout=10, min_request_rate=1000)
    assert not too_slow(0, 9.9, limits)  # not judged before the timeout
    assert too_slow(9_999, 10, limits) and not too_slow(10_000, 10, limits)
    assert too_slow(1, 100, limits)
    assert not too_slow(0, 100, GatewayLimits(min_request_rate=0))
    limits = GatewayLimits(max_answer_bytes=100, max_output_bytes=1000)
    assert answer_budget(0, limits) == 100 and answer_budget(950, limits) == 50 and answer_budget(5000, limits) == 0
    assert slowest_holder([]) is None
    assert slowest_holder([(5000, 2.0), (100, 1.0), (300, 1.0)]) == 1


def test_normal_produce_and_consume_under_the_limits(make: Any) -> None:
    gw = make(max_connections=8, max_request_bytes=1 << 20, max_buffered_bytes=1 << 20, max_answer_bytes=1 << 20)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with TankClient(HOST, gw.tank_port) as c:
                for j in range(20):
                    assert c.produce("t", i, [b"%d-%d-%d" % (i, j, k) for k in range(50)]) == 0
        except BaseException as exc:  # reported below
            errors.append(exc)

    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("t", 4)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for pid in range(4):
            assert c.discover_partitions("t")[pid].hwm == 1000


# ---------------------------------------------------------------- produces waiting for the writer


class SlowWriter(Gateway):
    """A gateway whose synced commits take 0.3 s (a slow disk's stand-in), its staged
    transactions kept at 1 MiB, and the most bytes of blocks seen waiting for the writer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.most_queued = 0
        super().__init__(*args, **kwargs)
        self._pipe.max_bytes = 1 << 20

    def _write_work(self, work: Any) -> Any:
        time.sleep(0.3)
        return super()._write_work(work)

    def queue_block(self, topic: str, partition: str, block: Any, records: int) -> None:
        super().queue_block(topic, partition, block, records)
        self.most_queued = max(self.most_queued, sum(len(b[2]) for b in self._blocks))


def test_large_bundles_waiting_for_a_slow_writer_are_bounded_in_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading pauses at MAX_BATCH records waiting for the writer; a client of one-message
    # bundles of 300 KB, pipelined and never waiting, was read until 200,000 of them were
    # held (60 GB) while a synced writer committed a few a second (here 30 MB of them).
    import dafka.store.node as store_node

    monkeypatch.setattr(store_node, "MAX_QUEUED_BYTES", 4 << 20, raising=False)  # (raising: before it was)
    gw = SlowWriter(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0), sync=True)
    try:
        with TankClient(HOST, gw.tank_port, timeout=60) as c:
            c.create_topic("big", 1)
            msgs = [b"%04d" % i + os.urandom(300_000) for i in range(100)]
            bundles = [encode_bundle([(None, 1, None, m)], codec=CODEC_NONE) for m in msgs]
            s = connect_raw(gw.tank_port)
            try:
                sender = threading.Thread(
                    target=lambda: s.sendall(b"".join(produce_frame(i, "big", 0, b) for i, b in enumerate(bundles)))
                )
                sender.start()
                answers = [recv_frame(s) for _ in bundles]
                sender.join(30)
            finally:
                s.close()
            assert all(payload[4] == 0 for _, payload in answers)  # each produce acknowledged
            # The bound, and one read turn past it (at most 16 frames read in a turn).
            assert gw.most_queued <= (4 << 20) + 16 * 300_100, gw.most_queued
            assert values(consume_all(c, "big", 0)) == msgs
    finally:
        gw.close()


def test_a_block_sealed_in_place_counts_its_whole_buffer() -> None:
    # A Tank bundle sealed where it was received is a view that holds its request's buffer
    # until committed: the bytes bound counts the buffer, not the view.
    from dafka.store.node import _held_bytes

    buffer = bytearray(1000)
    assert _held_bytes(memoryview(buffer)[100:700]) == 1000
    assert _held_bytes(bytes(600)) == 600
