"""Red-team probes of the Tank gateway that stores bundles as sent (real TCP, real LMDB, a real tower).

Each test plays a hostile client and checks what it can make the gateway hold,
and that acknowledged data stays and other clients are served all along.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from dafka.core import wire
from dafka.tank.bundle import CODEC_NONE, CODEC_SNAPPY, encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from dafka.tank.limits import GatewayLimits, answer_budget
from dafka.tank.messages import (
    ConsumePartition,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopic,
    MsgId,
    ProduceError,
    ProducePartition,
    ProduceRequest,
    ProduceResponse,
    ProduceTopic,
)
from tests.conftest import wait_until
from tests.tank.test_gateway import (
    HOST,
    TS,
    connect_raw,
    consume_all,
    intact,
    make_gateway,
    recv_frame,
    values,
    witness,
)
from tests.tank.test_limits import peak_rss, peak_rss_reset

pytestmark = pytest.mark.timeout(120)
__all__ = ["make_gateway"]  # the fixture


def test_snappy_bundles_for_live_readers_hold_a_bounded_inflated_size(
    make_gateway: Any, raw_peer: Any
) -> None:
    # 22 MiB of snappy bundles inflate to 448 MiB of contents.  With a reader subscribed
    # on the mesh, each bundle's contents were kept for the live RECORDs until the commit:
    # a request of 22 MiB made the gateway hold 0.9 GiB.
    gw: Gateway = make_gateway()
    w, kept = witness(gw)
    try:
        w.create_topic("bomb", 1)
        address = gw.pmap.get("bomb", 0).address
        header = wire.record_prefix(wire.RECORD, "bomb", address, "bomb")
        peer = raw_peer([wire.P_RECORD + b"bomb", wire.P_HEAD + b"bomb"])
        peer.wait_for(lambda q: q.peers)
        wait_until(lambda: gw.audience.readers(header) >= 1)
        content = bytes((1 << 20) - 64)  # a megabyte of zeros: ~48 KiB as snappy
        bundle = encode_bundle([(None, TS, None, content)] * 64, codec=CODEC_SNAPPY)
        n = 7  # 22 MiB
        req = ProduceRequest(7, [ProduceTopic("bomb", [ProducePartition(0, bundle) for _ in range(n)])])
        s = connect_raw(gw.tank_port)
        s.settimeout(60)  # inflating 448 MiB and committing 22 MiB take a while on a loaded machine
        try:
            tracked = peak_rss_reset()
            before = peak_rss()
            s.sendall(req.encode())
            msg_id, payload = recv_frame(s)
            grown = peak_rss() - before
        finally:
            s.close()
        assert msg_id == MsgId.PRODUCE
        assert all(p.error == ProduceError.OK for p in ProduceResponse.decode(payload, [n]).topics[0].partitions)
        if tracked:
            # Before: ~2 * n * 64 MiB (0.9 GiB).  Now about 4 times the bound (the reader is in this process).
            assert grown < 500 << 20, f"peak RSS grew {grown >> 20} MiB for {n} bundles"
        # Every acknowledged record is stored, the reader learns of them by the HEAD
        # (and FETCHes them), and live publishing goes on once the bound has room.
        peer.wait_for(lambda q: any(h.sequence == n * 64 - 1 for h in q.messages(wire.Head)))
        published = gw.records_published
        assert w.produce("bomb", 0, [b"after"]) == 0
        wait_until(lambda: gw.records_published == published + 1)
        got = consume_all(w, "bomb", 0, n * 64 - 1)
        assert [(r[0], r[3]) for r in got[-2:]] == [(n * 64, content), (n * 64 + 1, b"after")]  # Tank seqs from 1
        assert intact(gw, kept)
    finally:
        w.close()


def test_answers_held_for_clients_that_never_read_are_bounded_over_all_connections(make_gateway: Any) -> None:
    # Each connection may hold max_output_bytes (32 MiB) of unsent answers, and there may be
    # max_connections (256) of them: 8 GiB.  Twelve clients that ask and never read made the
    # gateway hold 400 MiB; now at most max_total_output_bytes (256 MiB) over all of them,
    # and a client that reads is still served (one record at least) while they hold it.
    gw: Gateway = make_gateway(limits=GatewayLimits(request_timeout=60.0))
    w, kept = witness(gw)
    sockets: list[socket.socket] = []
    try:
        w.create_topic("wide", 4)
        for pid in range(4):
            assert w.produce("wide", pid, [os.urandom(1 << 20) for _ in range(4)], codec=CODEC_NONE) == 0
        ask = ConsumeRequest(9, [ConsumeTopic("wide", [ConsumePartition(pid, 1, 4 << 20) for pid in range(4)])])
        frames = ask.encode() * 4
        for _ in range(12):
            s = connect_raw(gw.tank_port)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(frames)
            sockets.append(s)

        def held() -> int:
            return sum(c.out_size for c in list(gw._conns.values()))

        def settled() -> bool:
            """Every hostile request answered, or its connection no longer read."""
            conns = [c for c in list(gw._conns.values()) if c.out_size]
            return len(conns) == 12 and all(not c.reading or not c.frames.buffered for c in conns)

        wait_until(settled, timeout=30)
        assert held() <= (256 + 16 + 4) << 20, f"{held() >> 20} MiB of unsent answers held"
        assert values(consume_all(w, "keep", 0)) == kept  # served all along
        assert w.consume("wide", 3, 1, 4 << 20).messages  # at least one record
    finally:
        for s in sockets:
            s.close()
        w.close()
    wait_until(lambda: gw.connections == 0)
    assert intact(gw, kept)


def test_the_answer_budget_over_all_connections() -> None:
    limits = GatewayLimits(max_answer_bytes=100, max_output_bytes=1000, max_total_output_bytes=5000)
    assert answer_budget(0, limits, 0) == 100 and answer_budget(0, limits, 4950) == 50
    assert answer_budget(0, limits, 5000) == 1 and answer_budget(0, limits, 9000) == 1  # one record: progress
    assert answer_budget(10, limits, 4990) == 10 and answer_budget(10, limits, 5000) == 0 and answer_budget(10, limits, 9000) == 0  # holds some: none


def test_an_answer_at_a_bundle_larger_than_its_budget_is_sliced_not_sent_whole(make_gateway: Any) -> None:
    # A stored bundle went whole into an answer, whatever its size (up to max_request_bytes,
    # 64 MiB): a client asking for 1 byte got 40 MiB, so 256 connections that never read could
    # make the gateway hold 256 such bundles past every output bound.  Now a bundle over the
    # answer's budget goes as a bundle of its records from the one asked for, within the budget
    # (one record at least), as the partial front block does.
    gw: Gateway = make_gateway(limits=GatewayLimits(max_answer_bytes=4 << 20))
    w, kept = witness(gw)
    try:
        w.create_topic("huge", 1)
        records = [os.urandom((1 << 20) - 100) for _ in range(40)]
        assert w.produce("huge", 0, records, codec=CODEC_NONE) == 0  # one bundle of 40 MiB
        s = connect_raw(gw.tank_port)
        try:
            s.sendall(ConsumeRequest(3, [ConsumeTopic("huge", [ConsumePartition(0, 1, 1)])]).encode())
            msg_id, payload = recv_frame(s)
        finally:
            s.close()
        assert msg_id == MsgId.CONSUME
        assert len(payload) < 2 << 20, f"{len(payload) >> 20} MiB for a 1-byte fetch"
        part = ConsumeResponse.decode(payload).topics[0].partitions[0]
        assert [bytes(r[3]) for r in part.decode_chunk(1).records] == records[:1]
        got = consume_all(w, "huge", 0, 1, fetch_size=3 << 20)  # each answer within its budget
        assert [r[0] for r in got] == list(range(1, 41)) and [r[3] for r in got] == records
        got = consume_all(w, "huge", 0, 17, fetch_size=1)  # from the middle, a record at a time
        assert [r[3] for r in got] == records[16:]
        assert intact(gw, kept)
    finally:
        w.close()


@pytest.mark.parametrize(("codec", "n", "fetch_size"), [(CODEC_NONE, 30_000, 64 << 10), (CODEC_SNAPPY, 30_000, 64 << 10),
                                                      (CODEC_NONE, 3_000, 1)])
def test_a_bundle_over_the_answer_budget_consumed_in_pieces_is_walked_once_a_window_not_once_a_consume(
    make_gateway: Any, monkeypatch: pytest.MonkeyPatch, codec: int, n: int, fetch_size: int
) -> None:
    # A bundle over the answer's budget goes sliced (above), and each consume converted its
    # slice afresh: the walk (and a snappy bundle's inflation) from the bundle's start to the
    # seq asked for, then up to 16,384 records of which fetch_size kept a few hundred.  Read in
    # N consumes, a bundle of R records cost about N x R / 2 records walked (here ~25 x R).
    # Now a consume converts a window of the bundle's records, kept for the next consumes
    # (db._WindowConvert, as fetch_raw and fetch_kafka do): about R walked in all.
    from dafka.store import reader

    walked: list[tuple[int, int]] = []  # per walk of the bundle: (records skipped, records converted)
    tank_values = reader.tank_values

    def spy(bundle: Any, skip: int, n: int) -> list[bytes]:
        got: list[bytes] = tank_values(bundle, skip, n)
        walked.append((skip, len(got)))
        return got

    gw: Gateway = make_gateway(limits=GatewayLimits(max_answer_bytes=256 << 10))
    records = [b"%05d" % i + os.urandom(95) for i in range(n)]  # 3 MB (0.3 MB), snappy or not: over the budget
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("big", 1)
        assert c.produce("big", 0, records, codec=codec) == 0
        monkeypatch.setattr(reader, "tank_values", spy)
        got = consume_all(c, "big", 0, 1, fetch_size=fetch_size)  # about 50 consumes (3,000: a record each)
    assert [r[0] for r in got] == list(range(1, n + 1)) and [r[3] for r in got] == records
    # Before: 788,128 records walked in 50 walks (64 KiB), 4.5 million in 3,000 (a record each).
    assert sum(s + k for s, k in walked) <= 2 * n, walked
    assert len(walked) <= 4, walked


def test_readers_of_more_bundles_than_the_windows_a_record_a_consume_convert_little_each(
    make_gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window of a bundle's records is kept for the next consumes, in at most 4 windows (the
    # oldest dropped first).  A consume of one record (fetch_size 1) made a window too
    # (0fbe8b0): as many records as 4 MiB holds, up to 65,536.  Five readers of five bundles
    # in turn find none of theirs kept, every time: each consume of one record converted the
    # rest of its bundle (here 20,000 records, 2 MB; 1.3 ms a consume where the walk to the
    # record took 0.3).  A slice of a few records now converts a window of at most 4,096.
    from dafka.store import reader

    converted: list[int] = []
    tank_values = reader.tank_values

    def spy(bundle: Any, skip: int, n: int) -> list[bytes]:
        got: list[bytes] = tank_values(bundle, skip, n)
        converted.append(len(got))
        return got

    gw: Gateway = make_gateway(limits=GatewayLimits(max_answer_bytes=256 << 10))
    n = 20_000
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("five", 5)
        bundles = [[b"%d:%05d" % (p, i) + bytes(93) for i in range(n)] for p in range(5)]
        for p, records in enumerate(bundles):
            assert c.produce("five", p, records, codec=CODEC_NONE) == 0  # 2 MB each: over the budget
        monkeypatch.setattr(reader, "tank_values", spy)
        for seq in range(1, 21):
            for p in range(5):
                r = c.consume("five", p, seq, fetch_size=1)
                assert [bytes(m[3]) for m in r.messages][:1] == [bundles[p][seq - 1]]
    assert len(converted) <= 2 * 100
    assert sum(converted) <= 100 * 4_097, f"{sum(converted):,} records converted for 100 consumes of one"
