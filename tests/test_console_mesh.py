"""The console's record browser over the mesh (no ``--db``): pages FETCHed from the
stores as a consumer reads them, bounded in records, bytes and time, against a
real tower, a store process, producers, and hand-driven hostile peers."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.config import NodeConfig
from dafka.console import server
from dafka.console.model import SHOWN_BYTES, ConsoleModel, PageFetch
from dafka.console.server import Console
from dafka.core import wire
from dafka.nodes.producer import Producer
from tests.conftest import RawPeer, start_store_process, wait_until
from tests.test_console import get, get_json, publish

pytestmark = pytest.mark.timeout(120)

TOPIC = "<img src=x onerror=alert(1)>t"


def records(base: str, **q: Any) -> tuple[int, Any]:
    status, _, body = get(base + "api/records?" + urllib.parse.urlencode(q))
    return status, json.loads(body)


def test_records_over_the_mesh_from_a_console_attached_to_a_tower_only(cfg: NodeConfig, tmp_path: Path) -> None:
    store = start_store_process(cfg, tmp_path / "db")
    producer = Producer(TOPIC, cfg)
    try:
        wait_until(lambda: len(producer.peers))
        huge = b"z" * 900_000  # under max_record_bytes (1 MiB)
        publish(producer, [b"r%d" % i for i in range(46)] + [b'{"n": 46}', huge, bytes(range(256)), b"<script>x</script>"])
        with Console(cfg, interval=0.2) as console:
            base = console.url
            wait_until(lambda: records(base, topic=TOPIC, partition=producer.address)[0] == 200, timeout=20)
            status, page = records(base, topic=TOPIC, partition=producer.address, limit=4)
            assert status == 200 and page["source"] == "mesh", page
            assert [r["offset"] for r in page["records"]] == [46, 47, 48, 49]
            r46, r47, r48, r49 = (r["content"] for r in page["records"])
            assert r46["as"] == "json" and '"n": 46' in r46["text"]
            assert r47["as"] == "text" and r47["truncated"] and r47["size"] == 900_000 and len(r47["text"]) == SHOWN_BYTES
            assert r48["as"] == "hex" and r48["text"].startswith("00 01 02")
            assert r49["text"] == "<script>x</script>"  # as data: the page renders it as text
            assert page["records"][0]["ts_ms"] is None and page["records"][0]["key"] is None  # not on the wire
            assert page["next"] == 50 and page["last"] == 49 and not page["cut"] and not page["timed_out"]
            # From an offset, in another format; a page bounded in records.
            status, page = records(base, topic=TOPIC, partition=producer.address, offset=10, limit=3, format="hex")
            assert [(r["offset"], r["content"]["text"]) for r in page["records"]] == [(10, "72 31 30"), (11, "72 31 31"), (12, "72 31 32")]
            assert page["next"] == 13
            status, page = records(base, topic=TOPIC, partition=producer.address, offset=0, limit=500)
            assert len(page["records"]) == 50  # at most MAX_PAGE (100), and the head bounds it
            # Past the head: an empty page at once, not a wait.
            status, page = records(base, topic=TOPIC, partition=producer.address, offset=60)
            assert status == 200 and page["records"] == [] and page["next"] == 60
            # A time needs timestamps, which the mesh does not carry.
            assert records(base, topic=TOPIC, partition=producer.address, time=1)[0] == 400
            assert records(base, topic=TOPIC, partition="nope")[0] == 404
            assert records(base, topic=TOPIC, partition=producer.address, offset="x")[0] == 400
    finally:
        producer.close(0)
        store.terminate()
        store.wait(10)


def test_a_page_over_the_mesh_stops_at_its_byte_bound(cfg: NodeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = start_store_process(cfg, tmp_path / "db")
    producer = Producer("big", cfg)
    try:
        wait_until(lambda: len(producer.peers))
        publish(producer, [bytes([65 + i]) * 600_000 for i in range(10)])
        monkeypatch.setattr(server, "MAX_PAGE_BYTES", 1_500_000)
        with Console(cfg, interval=0.2) as console:
            wait_until(lambda: records(console.url, topic="big", partition=producer.address)[0] == 200, timeout=20)
            status, page = records(console.url, topic="big", partition=producer.address, offset=0, limit=10)
            assert status == 200 and page["cut"], page
            offsets = [r["offset"] for r in page["records"]]
            assert offsets[:3] == [0, 1, 2] and len(offsets) <= 4  # stopped asking past 1.5 MB
            assert page["next"] == offsets[-1] + 1
    finally:
        producer.close(0)
        store.terminate()
        store.wait(10)


def test_a_partition_nobody_answers_for_times_out_and_the_console_keeps_serving(
    cfg: NodeConfig, raw_peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that tells its head but never answers FETCH (nor does any store):
    the page ends at its deadline with what came, other requests are served meanwhile,
    and records sent unasked (other offsets, floods of copies) are dropped."""
    monkeypatch.setattr(server, "FETCH_TIMEOUT", 1.5)
    silent: RawPeer = raw_peer([])
    with Console(cfg, interval=0.2) as console:
        base = console.url

        def known() -> bool:
            silent.send(wire.Head("mute", silent.address, "mute", 99))
            silent.pump(0.05)
            return records(base, topic="mute", partition=silent.address, limit=1)[0] != 404

        wait_until(known, timeout=20)
        probe = console._probe
        assert probe is not None
        out: dict[str, Any] = {}

        def ask() -> None:
            t0 = time.monotonic()
            out["page"] = records(base, topic="mute", partition=silent.address, limit=20)
            out["took"] = time.monotonic() - t0

        asker = threading.Thread(target=ask)
        asker.start()
        # Meanwhile: the console answers; the peer floods records nobody asked for.
        status, _, _ = get(base + "api/state")
        assert status == 200
        for i in range(200):
            silent.send(wire.DirectRecord(probe.address, silent.address, "mute", 10_000 + i, b"unasked"))
        fetches = silent.wait_for(lambda p: p.messages(wire.Fetch), timeout=10)
        # The FETCH went to the partition, a few records at a time, retried while waiting.
        assert all(f.topic == silent.address and f.count <= 8 and 80 <= f.sequence <= 99 for f in fetches)
        asker.join(15)
        status, page = out["page"]
        assert status == 200 and page["timed_out"] and page["records"] == [], page
        assert out["took"] >= 1.0  # it waited for the page's deadline (status 200: not the server's guard)
        assert get(base + "api/state")[0] == 200


def test_page_fetch_asks_a_few_at_a_time_drops_copies_and_strays() -> None:
    page = PageFetch("t", "P", 100, 20, "auto", now=0.0, chunk=8, retry=0.5, timeout=5.0)
    assert page.asks(0.0) == [(100, 8)]
    assert page.asks(0.1) == []  # waiting for them
    page.on_record(99, b"before")  # not asked
    page.on_record(108, b"not asked yet")
    for o in range(100, 104):
        page.on_record(o, b"x")
        page.on_record(o, b"copy from another store")
    assert page.asks(0.2) == []
    assert page.asks(0.7) == [(104, 4)]  # the missing ones again
    for o in range(104, 108):
        page.on_record(o, b"x")
    assert page.asks(0.8) == [(108, 8)]
    assert sorted(page.records) == list(range(100, 108)) and page.bytes == 8
    for o in range(108, 116):
        page.on_record(o, b"x")
    assert page.asks(0.9) == [(116, 4)]
    for o in range(116, 120):
        page.on_record(o, b"x")
    assert page.done and page.why == "complete"
    result = page.result(None, 119)
    assert [r["offset"] for r in result["records"]] == list(range(100, 120)) and result["next"] == 120
    assert result["missing"] == 0 and not result["cut"] and not result["timed_out"]


def test_page_fetch_bounds_bytes_and_time() -> None:
    page = PageFetch("t", "P", 0, 50, "auto", now=0.0, max_bytes=1000, chunk=8)
    assert page.asks(0.0) == [(0, 8)]
    page.on_record(0, b"a" * 300)
    page.on_record(1, b"a" * 300)
    page.on_record(2, b"a" * 300)
    page.on_record(3, b"a" * 300)
    assert page.why == "bytes" and page.result(None, None)["cut"]
    # Later records first (another store's or the producer's answer): the bound counts the
    # records without a gap before them, and the page cut there leaves out none it skipped.
    page = PageFetch("t", "P", 0, 50, "auto", now=0.0, max_bytes=1000, chunk=8)
    assert page.asks(0.0) == [(0, 8)]
    for o in (0, 6, 7, 5):
        page.on_record(o, b"a" * 300)
    assert not page.done  # 1,200 bytes came, but 1-4 are not in yet
    assert page.asks(0.6) == [(1, 7)]  # the missing ones again
    page.on_record(1, b"a" * 300)
    page.on_record(2, b"a" * 300)
    page.on_record(3, b"a" * 300)
    assert page.why == "bytes"
    result = page.result(None, None)
    assert [r["offset"] for r in result["records"]] == [0, 1, 2, 3] and result["next"] == 4
    assert result["cut"] and result["missing"] == 0
    # Big records: fewer asked at once.
    page = PageFetch("t", "P", 0, 50, "auto", now=0.0, max_bytes=1000, chunk=8)
    assert page.asks(0.0) == [(0, 8)]
    for o in range(8):
        page.on_record(o, b"b" * 10)
    assert page.asks(0.1) == [(8, 8)]
    page = PageFetch("t", "P", 0, 50, "auto", now=0.0, max_bytes=1000, chunk=8)
    page.asks(0.0)
    for o in range(8):
        page.on_record(o, b"b" * 100)
    assert page.asks(0.1) == [(8, 2)]  # 200 bytes left, 100 a record
    # A hole, then the deadline: what came, with the hole counted.
    page = PageFetch("t", "P", 0, 5, "auto", now=0.0, timeout=2.0)
    page.asks(0.0)
    page.on_record(0, b"x")
    page.on_record(2, b"x")
    assert page.asks(1.0) == [(1, 4)]
    assert page.asks(2.0) == [] and page.why == "timeout"
    page.on_record(1, b"late")  # after the end: dropped
    result = page.result(None, 4)
    assert [r["offset"] for r in result["records"]] == [0, 2] and result["missing"] == 1 and result["next"] == 3
    assert result["timed_out"]


def test_partition_head_of_the_model() -> None:
    model = ConsoleModel()
    part = {"topic": "t", "partition": "P", "producer_head": 7, "producer_alive": True, "stores": [{"address": "S", "head": 5, "lag": 2}]}
    model.update({"towers": [], "nodes": [], "partitions": [part], "groups": []}, 1.0)
    assert model.partition_head("t", "P") == (True, 5)  # what a store holds
    assert model.partition_head("t", "Q") == (False, None)


def test_a_topic_of_thousands_of_partitions_is_paged(cfg: NodeConfig, raw_peer: Any) -> None:
    """A peer telling heads of 3,000 partitions of one topic: the landing lists 20 heads,
    the topic page 200 partitions a page (the count whole), the pages go on by ``from``."""
    teller: RawPeer = raw_peer([])
    parts = sorted("%032X" % (0xC0FFEE00 + i) for i in range(3000))
    with Console(cfg, interval=0.2) as console:
        base = console.url

        def all_told() -> Any:
            for i, p in enumerate(parts):
                teller.send(wire.Head("wide", p, "wide", i))
            teller.pump(0.05)
            t = get_json(base + "api/topic?name=wide")
            return t if t.get("partition_count") == 3000 else None

        t = wait_until(all_told, timeout=30, interval=0.5)
        assert len(t["partitions"]) == 200 and t["from"] == 0
        assert [p["partition"] for p in t["partitions"]] == parts[:200]
        t = get_json(base + "api/topic?name=wide&from=2900")
        assert [p["partition"] for p in t["partitions"]] == parts[2900:]
        t = get_json(base + "api/topic?name=wide&from=99999")  # past the end: the last one
        assert [p["partition"] for p in t["partitions"]] == parts[-1:]
        assert get(base + "api/topic?name=wide&from=x")[0] == 400
        (topic,) = [x for x in get_json(base + "api/state")["topics"] if x["topic"] == "wide"]
        assert topic["partitions"] == 3000 and len(topic["heads"]) == 20


def test_console_alerts_the_holes_of_its_local_store(cfg: NodeConfig, tmp_path: Path) -> None:
    """With --db, the holes the store recorded (offsets given up) are alerts: the first
    HOLES_SHOWN said, the rest counted."""
    from dafka.console.model import HOLES_SHOWN
    from dafka.store.db import RecordDB

    db = RecordDB(tmp_path / "db")
    parts = ["%032X" % (0xAB00 + i) for i in range(HOLES_SHOWN + 3)]
    for p in parts:
        db.append([("holed", p, 0, b"a", 1), ("holed", p, 5, b"b", 2)], skips=[("holed", p, 1, 4)])
    db.close()
    with Console(cfg, db=str(tmp_path / "db"), interval=0.2) as console:

        def alerts() -> Any:
            got = [a for a in get_json(console.url + "api/state")["alerts"] if "hole" in a]
            return got if len(got) > HOLES_SHOWN else None

        got = wait_until(alerts, timeout=15)
        assert f"partition holed/{parts[0]}: offsets 1..4 are a hole in the local store (given up)" in got
        assert got[-1] == "... 3 more holes in the local store"


def test_topic_page_charts_the_lag_of_each_group_on_the_topic() -> None:
    model = ConsoleModel()

    def snap(lags: dict[str, list[int]]) -> dict[str, Any]:
        parts = [{"topic": "t", "partition": p, "producer_head": 99, "producer_alive": True, "stores": []} for p in "PQ"]
        groups = [
            {"group": g, "members": [], "lag": sum(v), "partitions": [
                {"topic": "t", "partition": "P", "lag": v[0]}, {"topic": "t", "partition": "Q", "lag": v[1]},
                {"topic": "other", "partition": "R", "lag": 1000}]}
            for g, v in lags.items()
        ]
        return {"towers": [], "nodes": [], "partitions": parts, "groups": groups}

    model.update(snap({"a": [10, 5], "b": [1, 1]}), 1.0)
    model.update(snap({"a": [8, 4], "b": [0, 1]}), 2.0)
    t = model.topic("t")
    assert t is not None
    assert t["lag"] == [
        {"group": "a", "now": 12, "points": [(1.0, 15.0), (2.0, 12.0)]},
        {"group": "b", "now": 1, "points": [(1.0, 2.0), (2.0, 1.0)]},
    ]


def test_event_streams_dropped_by_their_pages_are_let_go(cfg: NodeConfig) -> None:
    """MAX_STREAMS pages hold the event stream open, one more is refused (503); they
    all go away abruptly: each stream ends at its next writes, the count of open
    streams comes back to zero and new pages get their streams again, twice over."""
    import socket

    def open_stream(port: int) -> tuple[socket.socket, bytes]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"data: " not in got and b" 503 " not in got.split(b"\r\n", 1)[0]:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        return sock, got.split(b"\r\n", 1)[0]

    with Console(cfg, interval=0.1) as console:
        port = int(console.url.rsplit(":", 1)[1].strip("/"))
        for _ in range(2):
            socks = []
            try:
                for _ in range(server.MAX_STREAMS):
                    sock, status = open_stream(port)
                    socks.append(sock)
                    assert b" 200 " in status, status
                sock, status = open_stream(port)
                socks.append(sock)
                assert b" 503 " in status, status
            finally:
                for sock in socks:
                    sock.close()  # mid-stream
            wait_until(lambda: console._streams == 0, timeout=10)


def test_full_chart_history_is_compact() -> None:
    """The charts' bound in memory: MAX_SERIES series of HISTORY samples (what a mesh
    whose producers come and go reaches, each new producer a new partition) take
    16 bytes a sample, not a tuple of two floats each (about 100)."""
    import tracemalloc

    from dafka.console.model import HISTORY, MAX_SERIES, History

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        h = History()
        for t in range(HISTORY + 5):
            for s in range(MAX_SERIES):
                h.add(f"series {s}", t + 0.5, float(t * s))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    samples = MAX_SERIES * HISTORY
    assert used < samples * 20, f"{used / samples:.1f} bytes a sample"
    assert len(h.points("series 7")) == HISTORY and h.points("series 7")[-1] == (HISTORY + 4.5, 7.0 * (HISTORY + 4))
    assert h.points("series 7")[0] == (5.5, 35.0)


# What a page hears between two asks: answers at offsets relative to what it asked last (copies,
# strays below and far beyond, the missing one last or never), of any size, and time passing.
_answer = st.tuples(st.just("answer"), st.integers(-3, 24), st.integers(0, 600))
_far = st.tuples(st.just("answer"), st.integers(-(10**6), 10**6), st.integers(0, 600))
_tick = st.tuples(st.just("tick"), st.floats(0.0, 0.7), st.just(0))


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.one_of(_answer, _answer, _far, _tick), max_size=120), start=st.integers(0, 50),
       limit=st.integers(1, 100), max_bytes=st.integers(0, 3000), chunk=st.integers(1, 8))
def test_page_fetch_against_hostile_answers(steps: list[Any], start: int, limit: int, max_bytes: int,
                                            chunk: int) -> None:
    """Whatever the stores answer, a page holds the records of ``[start, start + limit)`` once
    each, at most ``chunk`` of them past the first not read, reads at most one record past
    ``max_bytes`` below that, and a page cut at its bound ends at the first record not read."""
    now = 0.0
    page = PageFetch("t", "P", start, limit, "auto", now=now, max_bytes=max_bytes, chunk=chunk, retry=0.5,
                     timeout=5.0)
    sizes: dict[int, int] = {}
    asked: list[tuple[int, int]] = page.asks(now)
    for kind, value, size in steps:
        if kind == "tick":
            now += value
            asked = page.asks(now) or asked
        else:
            base = asked[-1][0] if asked else start
            offset = base + value
            fresh = offset not in page.records and not page.done and start <= offset < page.asked_to
            page.on_record(offset, b"x" * size)
            if fresh:
                sizes[offset] = size
        for first, count in asked:
            assert count >= 1 and start <= first and first + count <= start + limit
        assert set(page.records) == set(sizes) and page.bytes == sum(sizes.values())
        assert all(start <= o < start + limit for o in page.records)
        assert sum(1 for o in page.records if o > page.next) <= chunk
        below = [sizes[o] for o in range(start, page.next)]
        assert page.prefix_bytes == sum(below)
        # Past the bound, at most the one record that crossed it and those that came before
        # the gap under them closed (at most a chunk).
        total, past = 0, 0
        for size in below:
            if total >= max_bytes:
                past += 1
            total += size
        assert past <= chunk
    result = page.result(None, None)
    offsets = [r["offset"] for r in result["records"]]
    assert offsets == sorted(set(offsets)) and all(start <= o < start + limit for o in offsets)
    assert result["offset"] <= result["next"] <= start + limit and result["missing"] >= 0
    assert result["missing"] == (result["next"] - start) - len(offsets)
    if result["cut"]:
        assert offsets == list(range(start, page.next)) and result["next"] == page.next
        assert sum(sizes[o] for o in offsets) >= max_bytes
    if page.why == "complete":
        assert offsets == list(range(start, start + limit))
