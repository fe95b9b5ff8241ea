"""Large Tank requests received in place (the gateway's zero-copy read of bundles).

A request frame over 64 KiB that the request budget admitted is received into a buffer of
its own and its bundles are sealed from there (no copy on the way).  These tests send such
frames the ways a client or an attacker can (in small pieces, cut short, malformed once
complete, pipelined behind and before small requests, frames of other kinds) to a real
gateway over real TCP, and check the answers, what was stored and that the budget is given
back.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.tank.bundle import CODEC_NONE, encode_bundle
from dafka.tank.client import TankClient
from dafka.tank.codec import encode_frame, frame_header
from dafka.tank.gateway import DIRECT_MAX, Gateway
from dafka.tank.limits import SMALL_REQUEST, GatewayLimits
from dafka.tank.messages import (
    DiscoverPartitionsRequest,
    MsgId,
    ProduceError,
    ProducePartition,
    ProduceRequest,
    ProduceTopic,
    StatusRequest,
)
from tests.conftest import wait_until
from tests.tank.test_gateway import (
    HOST,
    TS,
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

PRODUCE_OK = 0


@pytest.fixture
def gw(tmp_path: Path) -> Any:
    g = Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0), limits=GatewayLimits(request_timeout=2))
    yield g
    g.close()


def _bundle(n: int, size: int, tag: bytes = b"") -> tuple[bytes, list[bytes]]:
    msgs = [tag + b"%06d" % i + os.urandom(size) for i in range(n)]
    return encode_bundle([(None, TS, None, m) for m in msgs], codec=CODEC_NONE), msgs


def _produce_answer(payload: bytes) -> int:
    return payload[4]  # req_id:u32, then the one partition's error byte


def test_a_large_produce_in_small_pieces_is_stored_exact(gw: Gateway) -> None:
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("big", 1)
    bundle, msgs = _bundle(700, 150)
    frame = produce_frame(7, "big", 0, bundle)
    assert SMALL_REQUEST < len(frame) <= DIRECT_MAX
    s = connect_raw(gw.tank_port)
    try:
        for i in range(0, len(frame), 7001):  # pieces across the header and the bundle
            s.sendall(frame[i : i + 7001])
            time.sleep(0.002)
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.PRODUCE and _produce_answer(payload) == PRODUCE_OK
    finally:
        s.close()
    with TankClient(HOST, gw.tank_port) as c:
        assert values(consume_all(c, "big", 0)) == msgs
    wait_until(lambda: gw._reserved == 0)


def test_large_and_small_requests_pipelined_are_answered_in_order(gw: Gateway) -> None:
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("big", 1)
    frames = []
    expected: list[bytes] = []
    for i in range(6):
        bundle, msgs = _bundle(500 + 50 * i, 200, b"%d-" % i)
        frames.append(produce_frame(100 + i, "big", 0, bundle))
        frames.append(StatusRequest(200 + i).encode())
        expected += msgs
    stream = b"".join(frames)
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(stream)  # all at once: the gateway's reads cut it anywhere
        answers = [recv_frame(s) for _ in range(12)]
    finally:
        s.close()
    # Statuses are answered at once, produces after their commit: each kind keeps its order.
    produced = [int.from_bytes(p[:4], "little") for m, p in answers if m == MsgId.PRODUCE]
    statuses = [int.from_bytes(p[:4], "little") for m, p in answers if m == MsgId.STATUS]
    assert produced == [100 + i for i in range(6)] and statuses == [200 + i for i in range(6)]
    assert all(_produce_answer(p) == PRODUCE_OK for m, p in answers if m == MsgId.PRODUCE)
    with TankClient(HOST, gw.tank_port) as c:
        assert values(consume_all(c, "big", 0)) == expected
    wait_until(lambda: gw._reserved == 0)


def _bad_large_bundle() -> bytes:
    bundle, _ = _bundle(600, 150)
    return bundle[:-1]  # the last message is one byte short: malformed once complete


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(produce_frame(1, "keep", 0, _bad_large_bundle()), id="malformed-large-bundle"),
        pytest.param(produce_frame(1, "keep", 0, _bundle(600, 150)[0])[:-1000], id="cut-short-then-closed"),
        pytest.param(encode_frame(MsgId.STATUS, b"\0" * (SMALL_REQUEST + 100)), id="large-status"),
        pytest.param(frame_header(MsgId.PRODUCE, SMALL_REQUEST + 1000) + os.urandom(SMALL_REQUEST + 1000),
                     id="large-random-produce"),
    ],
)
def test_a_bad_large_frame_closes_only_its_connection_and_stores_nothing(gw: Gateway, data: bytes) -> None:
    w, kept = witness(gw)
    try:
        bad_before = gw.bad_input.count
        s = connect_raw(gw.tank_port)
        s.sendall(data)
        cut = data[0] == MsgId.PRODUCE and int.from_bytes(data[1:5], "little") + 5 > len(data)
        if cut:
            wait_until(lambda: gw._reserved > 0)
            s.close()  # cut short: the connection ends half way through the frame
        else:
            assert read_until_closed(s) == b""
            s.close()
            wait_until(lambda: gw.bad_input.count > bad_before)
        wait_until(lambda: gw.connections == 1 and gw._reserved == 0)
        assert intact(gw, kept)  # nothing of it was stored; the witness goes on
        assert w.produce("keep", 0, [b"more"]) == 0
    finally:
        w.close()


def test_a_large_request_of_another_kind_is_served(gw: Gateway) -> None:
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("wide", 3)
    frame = DiscoverPartitionsRequest(9, "wide", list(range(40_000))).encode()  # 80 KB
    assert SMALL_REQUEST < len(frame) <= DIRECT_MAX
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(frame[:30_000])
        time.sleep(0.05)
        s.sendall(frame[30_000:])
        msg_id, payload = recv_frame(s)
        assert msg_id == MsgId.DISCOVER_PARTITIONS and int.from_bytes(payload[:4], "little") == 9
    finally:
        s.close()
    wait_until(lambda: gw._reserved == 0)


def _spy_seals(gw: Gateway, monkeypatch: Any) -> list[tuple[str, Any]]:
    """How each block the gateway commits was sealed: ("in place", the block: a view of the
    buffer its request was received into) or ("copied", its type).  Seen where the blocks
    are committed, whichever path sealed them (the compiled produce or the general one)."""
    seen: list[tuple[str, Any]] = []
    append = gw.db.append_blocks

    def spy(blocks: Any, **kw: Any) -> Any:
        for _topic, _partition, block in blocks:
            if type(block) is memoryview:
                assert type(block.obj) is bytearray  # (the request's own buffer)
                seen.append(("in place", block))
            else:
                seen.append(("copied", type(block)))
        return append(blocks, **kw)

    monkeypatch.setattr(gw.db, "append_blocks", spy)
    return seen


def test_a_produce_bundle_is_sealed_in_the_received_buffer(gw: Gateway, monkeypatch: Any) -> None:
    # The point of receiving in place: the bundle reaches the block unchanged and uncopied
    # (its header written in the room in front of the request), for a frame over
    # SMALL_REQUEST; a small frame's bundle is copied behind its header.
    seen = _spy_seals(gw, monkeypatch)
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("big", 1)
        bundle, msgs = _bundle(700, 150)
        small, few = _bundle(3, 10)
        s = connect_raw(gw.tank_port)
        try:
            s.sendall(produce_frame(1, "big", 0, bundle) + produce_frame(2, "big", 0, small))
            assert [_produce_answer(recv_frame(s)[1]) for _ in range(2)] == [PRODUCE_OK, PRODUCE_OK]
        finally:
            s.close()
        assert values(consume_all(c, "big", 0)) == msgs + few
    assert [kind for kind, _ in seen] == ["in place", "copied"]
    assert seen[1][1] is bytes


def _produce_raw(gw: Gateway, topic: str, parts: list[ProducePartition]) -> bytes:
    """One produce request of ``parts`` to ``topic`` on a connection of its own: its answer's payload."""
    s = connect_raw(gw.tank_port)
    try:
        s.sendall(ProduceRequest(1, [ProduceTopic(topic, parts)]).encode())
        return recv_frame(s)[1]
    finally:
        s.close()


def test_only_the_first_bundle_of_a_request_is_sealed_in_place(gw: Gateway, monkeypatch: Any) -> None:
    # A header written in front of a second bundle would land on the end of the first one,
    # already a block: three bundles of one request, to three partitions, the first one
    # refused (an unknown partition), are stored exact.
    seen = _spy_seals(gw, monkeypatch)
    first, _ = _bundle(5, 150, b"a")
    second, msgs2 = _bundle(500, 150, b"b")
    third, msgs3 = _bundle(100, 150, b"c")
    parts = [ProducePartition(9, first), ProducePartition(0, second), ProducePartition(1, third)]
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("three", 2)
        answer = _produce_raw(gw, "three", parts)
        assert answer[4:7] == bytes([ProduceError.UNKNOWN_PARTITION, PRODUCE_OK, PRODUCE_OK]), answer
        assert values(consume_all(c, "three", 0)) == msgs2
        assert values(consume_all(c, "three", 1)) == msgs3
    assert [kind for kind, _ in seen] == ["in place", "copied"]


def test_a_small_first_bundle_of_a_large_request_is_copied(gw: Gateway, monkeypatch: Any) -> None:
    # A block that is a view keeps the whole request's buffer until it is committed: a tiny
    # first bundle in front of a large one (here refused: an unknown partition) is copied
    # out instead, and the large buffer goes at once.
    seen = _spy_seals(gw, monkeypatch)
    tiny, msgs = _bundle(1, 10, b"t")
    large, _ = _bundle(600, 150, b"l")
    parts = [ProducePartition(0, tiny), ProducePartition(7, large)]
    with TankClient(HOST, gw.tank_port) as c:
        c.create_topic("small", 1)
        answer = _produce_raw(gw, "small", parts)
        assert answer[4:6] == bytes([PRODUCE_OK, ProduceError.UNKNOWN_PARTITION]), answer
        assert values(consume_all(c, "small", 0)) == msgs
    assert [kind for kind, _ in seen] == ["copied"]


@pytest.mark.timeout(60)
def test_a_large_produce_cut_by_eof_or_reset_stores_nothing_and_gives_its_budget_back(tmp_path: Path) -> None:
    # Received in place (readv into the frame's own buffer and the probe behind it), a frame
    # the peer ends half way (EOF, then a reset) is dropped whole; a complete one before it
    # on the same connection is stored and its reservation goes too.

    gw = Gateway(tmp_path / "gw", NodeConfig(towers=()), listen=(HOST, 0))
    try:
        with TankClient(HOST, gw.tank_port) as c:
            c.create_topic("a", 1)
            whole = ProduceRequest(1, [ProduceTopic("a", [ProducePartition(0, _bundle(700, 150)[0])])]).encode()
            cut = ProduceRequest(2, [ProduceTopic("a", [ProducePartition(0, _bundle(800, 150)[0])])]).encode()
            for how in ("eof", "reset"):
                s = connect_raw(gw.tank_port)
                s.sendall(whole)
                assert recv_frame(s)[1][4:] == bytes([ProduceError.OK])
                s.sendall(cut[: len(cut) // 2])
                wait_until(lambda: gw._reserved > 0)
                if how == "eof":
                    s.shutdown(socket.SHUT_WR)
                else:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
                wait_until(lambda: gw._reserved == 0)
            assert len(consume_all(c, "a", 0)) == 2 * 700
    finally:
        gw.close()
