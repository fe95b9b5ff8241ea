"""``dafka console``: the sans-IO model, and the JSON and HTML of a console over a real mesh
(tower, store, producers, a consumer group) with hostile names and contents."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest

from dafka.cli.status import MAX_GROUPS, MeshView, render_text
from dafka.config import NodeConfig
from dafka.console import server
from dafka.console.model import SHOWN_BYTES, ConsoleModel, History, offset_at_time, show_bytes
from dafka.console.server import STATIC, Console
from dafka.core import wire
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.db import RecordDB
from dafka.store.node import Store
from tests.conftest import (
    dafka_cmd,
    spawned,
    start_store_process,
    subprocess_env,
    tower_flag,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

OWN = "0" * 32
PROD = "A" * 32
STORE = "B" * 32
MEMBER = "D" * 32
HOSTILE_TOPIC = "<script>window.pwned=1</script>"
HOSTILE_GROUP = 'g"><img src=x onerror="window.pwned=2">'


# ---------------------------------------------------------------- sans-IO


def test_view_tracks_groups_positions_and_lag() -> None:
    view = MeshView(OWN, [], timeout=4.0)
    view.on_message(STORE, wire.Head("t", PROD, "t", 49))  # the store holds 0..49
    view.on_message(MEMBER, wire.Member("g", MEMBER, False, ("t",), (("t", PROD),)), 1.0)
    view.on_message(STORE, wire.Positions(OWN, STORE, "g", 1, (("t", PROD, 20),)))
    view.on_message(STORE, wire.Positions("X" * 32, STORE, "g", 1, (("t", PROD, 45),)))  # not ours
    view.on_message(MEMBER, wire.Member("g", "E" * 32, False, ("t",), ()), 1.0)  # speaks for another
    snap = view.snapshot(1.0)
    (group,) = snap["groups"]
    assert "GROUPS (1)" in render_text(snap) and render_text(snap).rstrip().endswith("30")
    assert group["lag"] == 30 and [m["address"] for m in group["members"]] == [MEMBER]
    assert group["partitions"] == [
        {"topic": "t", "partition": PROD, "head": 49, "committed": 20, "lag": 30, "owner": MEMBER}
    ]
    view.expire(5.5)  # the member stopped heartbeating; the group stays a while
    assert view.snapshot(5.5)["groups"][0]["members"] == []
    view.expire(41.0)
    assert view.snapshot(41.0)["groups"] == []


def test_view_bounds_groups() -> None:
    view = MeshView(OWN, [], timeout=4.0)
    for i in range(MAX_GROUPS + 5):
        address = f"{i:032d}"
        view.on_message(address, wire.Member(f"g{i}", address, False, ("t",), ()), 0.0)
    assert len(view.groups) == MAX_GROUPS and view.dropped_groups == 5


def test_show_bytes_text_json_msgpack_hex_and_bounds() -> None:
    assert show_bytes(b"hello") == {"as": "text", "text": "hello", "truncated": False, "size": 5}
    assert show_bytes(b'{"a": [1, 2]}')["as"] == "json"
    packed = msgpack.packb({"k": [1, "two", b"\x00"]})
    shown = show_bytes(packed)
    assert shown["as"] == "msgpack" and '"two"' in shown["text"]
    binary = bytes(range(256)) * 100
    shown = show_bytes(binary)
    assert shown["as"] == "hex" and shown["truncated"] and shown["size"] == 25600
    assert shown["text"].startswith("00 01 02") and len(shown["text"].split()) == SHOWN_BYTES
    huge = b"x" * 1_000_000
    shown = show_bytes(huge)
    assert shown["as"] == "text" and shown["truncated"] and len(shown["text"]) == SHOWN_BYTES
    assert show_bytes(b"plain", "hex")["text"] == "70 6c 61 69 6e"
    assert show_bytes(b"\xff\xfe", "text")["as"] == "hex"  # not UTF-8: hex whatever was asked
    assert show_bytes(b"[" * 100_000, "json")["as"] in ("hex", "text", "msgpack")  # deep: no crash
    assert show_bytes(b"", "bogus")["as"] == "text"


def test_history_rings_are_bounded() -> None:
    h = History(size=10, max_series=3)
    for t in range(1000):
        for name in ("a", "b", "c", "d"):
            h.add(name, float(t), float(t * 5))
    assert sorted(h.series) == ["a", "b", "c"] and all(len(r) == 10 for r in h.series.values())
    assert h.rates("a") == [(float(t), 5.0) for t in range(991, 1000)]
    h.retain(["a"])
    assert list(h.series) == ["a"]
    model = ConsoleModel(history=5)
    snap = {"towers": [], "nodes": [], "partitions": [], "groups": [{"group": "g", "members": [], "partitions": [], "lag": 3}]}
    for t in range(100):
        model.update(snap, float(t))
    assert len(model.lags.points("g")) == 5


# ---------------------------------------------------------------- over a real mesh


def get(url: str) -> tuple[int, str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def get_json(url: str) -> Any:
    status, ctype, body = get(url)
    assert "application/json" in ctype, (status, body)
    return json.loads(body)


def publish(producer: Producer, contents: list[bytes]) -> None:
    for c in contents:
        producer.publish(c)
    assert producer.flush(20), "the store did not acknowledge"


def test_console_over_a_mesh_with_hostile_names(cfg: NodeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = str(tmp_path / "db")
    # A store process: the console reads its database as another process does (LMDB
    # allows one environment per database and process).
    store_proc = start_store_process(cfg, Path(db))
    producer = Producer(HOSTILE_TOPIC, cfg)
    other = Producer(HOSTILE_TOPIC, cfg)
    try:
        wait_until(lambda: len(producer.peers) and len(other.peers))
        huge = b"y" * 300_000
        binary = bytes(range(256))
        publish(producer, [b"r%d" % i for i in range(47)] + [b'{"n": 47}', huge, binary])  # 50
        publish(other, [msgpack.packb({"seq": i}) for i in range(5)])
        with Consumer(HOSTILE_TOPIC, cfg, group=HOSTILE_GROUP, offset_reset="earliest") as member:
            got = []
            wait_until(lambda: got.extend(r for r in [member.poll(0.1)] if r and r.partition == producer.address) or len(got) >= 20, timeout=20)
            # Keep only the first 20 of the producer's records polled: commit position 20 there.
            committed = member.commit()
            assert committed[(HOSTILE_TOPIC, producer.address)] == 20, committed
            with Console(cfg, db=db, interval=0.2) as console:
                base = console.url

                def landing_ready() -> Any:
                    d = get_json(base + "api/state")
                    groups = [g for g in d["groups"] if g["group"] == HOSTILE_GROUP]
                    topics = [t for t in d["topics"] if t["topic"] == HOSTILE_TOPIC]
                    if not groups or not topics:
                        return None
                    lags = {p["partition"]: p["lag"] for p in groups[0]["partitions"]}
                    if lags.get(producer.address) != 30 or groups[0]["members"] != 1:
                        return None
                    return d, topics[0], groups[0]

                d, topic, group = wait_until(landing_ready, timeout=20)
                assert topic["partitions"] == 2 and topic["records"] == 55
                sizes = [len(b"r%d" % i) for i in range(47)] + [9, len(huge), len(binary)]
                sizes += [len(msgpack.packb({"seq": i})) for i in range(5)]
                assert topic["bytes"] == sum(sizes)
                (store_node,) = d["nodes"]["store"]
                heads = {h["partition"]: h["head"] for h in topic["heads"]}
                assert heads == {producer.address: 49, other.address: 4}
                assert store_node["alive"] and store_node["endpoint"].startswith("tcp://127.0.0.1:")
                assert {producer.address, other.address} <= {n["address"] for n in d["nodes"]["producer"]}
                assert member.address in {n["address"] for n in d["nodes"]["consumer"]}
                assert d["nodes"]["tower"][0]["alive"]
                # The mesh picture: the store linked to the topic's producers, the topic to the group.
                links = {tuple(link) for link in d["mesh"]["links"]}
                assert ("store:" + store_node["address"], "topic:" + HOSTILE_TOPIC) in links
                assert ("topic:" + HOSTILE_TOPIC, "group:" + HOSTILE_GROUP) in links
                box = next(b for b in d["mesh"]["boxes"] if b["id"] == "topic:" + HOSTILE_TOPIC)
                assert sorted(box["members"]) == sorted([producer.address, other.address])
                # The group's lag summed: 30 on one partition, 5 on the other (nothing committed).
                assert group["lag"] == 30 + 5 - committed.get((HOSTILE_TOPIC, other.address), 0)

                # The HTML: names escaped, only the console's own scripts, a strict CSP.
                quoted = urllib.parse.quote(HOSTILE_TOPIC, safe="")
                status, ctype, html = get(base + "topics/" + quoted)
                assert status == 200 and "text/html" in ctype
                assert "<script>window" not in html and "&lt;script&gt;window.pwned=1&lt;/script&gt;" in html
                status, _, html = get(base + "groups/" + urllib.parse.quote(HOSTILE_GROUP, safe=""))
                assert status == 200 and "<img" not in html and 'data-name="g&quot;&gt;&lt;img' in html
                with urllib.request.urlopen(base, timeout=10) as resp:
                    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
                    assert "<script>" not in resp.read().decode().replace("<script src=", "")

                # The topic page's data, and records only when asked for.
                t = get_json(base + "api/topic?name=" + quoted)
                part = next(p for p in t["partitions"] if p["partition"] == producer.address)
                assert (part["first"], part["head"], part["records"]) == (0, 49, 50)
                assert "records" not in json.dumps(d["topics"]).replace('"records": 55', "")
                q = {"topic": HOSTILE_TOPIC, "partition": producer.address, "limit": "4"}
                page = get_json(base + "api/records?" + urllib.parse.urlencode(q))
                assert [r["offset"] for r in page["records"]] == [46, 47, 48, 49]
                r46, r47, r48, r49 = (r["content"] for r in page["records"])
                assert (r46["as"], r46["text"]) == ("text", "r46")
                assert r47["as"] == "json" and '"n": 47' in r47["text"]
                assert r48["as"] == "text" and r48["truncated"] and r48["size"] == 300_000
                assert len(r48["text"]) == SHOWN_BYTES
                assert r49["as"] == "hex" and r49["text"].startswith("00 01 02")
                assert page["next"] == 50 and not page["cut"]
                # A page stops once its contents passed the bound (here 100 kB, one record a read).
                monkeypatch.setattr(server, "MAX_PAGE_BYTES", 100_000)
                monkeypatch.setattr(server, "READ_AT_ONCE", 1)
                page = get_json(base + "api/records?" + urllib.parse.urlencode({**q, "offset": "46"}))
                assert [r["offset"] for r in page["records"]] == [46, 47, 48] and page["cut"] and page["next"] == 49
                monkeypatch.undo()
                page = get_json(base + "api/records?" + urllib.parse.urlencode({**q, "offset": "10", "limit": "2", "format": "hex"}))
                assert [(r["offset"], r["content"]["text"]) for r in page["records"]] == [(10, "72 31 30"), (11, "72 31 31")]
                # From a time: the first record stamped then or later.
                stamps = {r["offset"]: r["ts_ms"] for r in get_json(base + "api/records?" + urllib.parse.urlencode({**q, "offset": "0", "limit": "50", "format": "hex"}))["records"]}
                page = get_json(base + "api/records?" + urllib.parse.urlencode({**q, "time": str(stamps[30])}))
                start = page["records"][0]["offset"]
                assert start <= 30 and stamps[start] == stamps[30] and (start == 0 or stamps[start - 1] < stamps[30])
                assert get(base + "api/records?" + urllib.parse.urlencode({**q, "time": "yesterday"}))[0] == 400
                q2 = {"topic": HOSTILE_TOPIC, "partition": other.address, "limit": "1"}
                (last,) = get_json(base + "api/records?" + urllib.parse.urlencode(q2))["records"]
                assert last["content"]["as"] == "msgpack" and '"seq": 4' in last["content"]["text"]
                # Bad requests are answered, the console keeps serving.
                assert get(base + "api/records?" + urllib.parse.urlencode({**q, "offset": "x"}))[0] == 400
                assert get(base + "api/records?" + urllib.parse.urlencode({**q, "format": "<b>"}))[0] == 400
                assert get(base + "api/records?" + urllib.parse.urlencode({**q, "partition": "nope"}))[0] == 404
                assert get(base + "api/records?topic=&partition=")[0] in (400, 404)
                assert get(base + "api/topic?name=unknown")[0] == 404
                g = get_json(base + "api/group?name=" + urllib.parse.quote(HOSTILE_GROUP, safe=""))
                assert g["members"][0]["address"] == member.address and g["history"]
                assert get(base + "static/uPlot.iife.min.js")[0] == 200
                assert get(base + "static/../model.py")[0] == 404 or get(base + "static/../model.py")[0] == 403

                # Live: the event stream carries the new heads when more records arrive.
                publish(producer, [b"more"] * 10)
                with urllib.request.urlopen(base + "events", timeout=10) as stream:
                    assert stream.headers["Content-Type"].startswith("text/event-stream")

                    def next_heads() -> Any:
                        line = stream.readline().decode()
                        if not line.startswith("data: "):
                            return None
                        data = json.loads(line[6:])
                        topic = next((t for t in data["topics"] if t["topic"] == HOSTILE_TOPIC), None)
                        heads = {h["partition"]: h["head"] for h in topic["heads"]} if topic else {}
                        return heads.get(producer.address) == 59 and data

                    data = wait_until(next_heads, timeout=15)
                    group = next(g for g in data["groups"] if g["group"] == HOSTILE_GROUP)
                    assert next(p for p in group["partitions"] if p["partition"] == producer.address)["lag"] == 40
    finally:
        producer.close(0)
        other.close(0)
        store_proc.terminate()
        store_proc.wait(10)


def test_console_static_files_are_in_the_package() -> None:
    names = {p.name for p in STATIC.iterdir()}
    assert {"console.js", "console.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"} <= names


def test_console_refuses_a_public_listen_without_insecure(cfg: NodeConfig) -> None:
    out = subprocess.run(
        dafka_cmd("console", "--tower", tower_flag(cfg), "--listen", "0.0.0.0:0"),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "--insecure" in out.stderr and "Traceback" not in out.stderr


def test_console_command_serves_and_stops_on_sigterm(cfg: NodeConfig) -> None:
    proc = spawned(
        subprocess.Popen(
            dafka_cmd("console", "--tower", tower_flag(cfg), "--listen", "127.0.0.1:0", "--interval", "0.2"),
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    line = proc.stdout.readline()
    assert line.startswith("console up: http://127.0.0.1:"), line
    url = line.split()[2]
    wait_until(lambda: any(t["alive"] for t in get_json(url + "api/state")["nodes"]["tower"]), timeout=15)
    status, ctype, body = get(url)
    assert status == 200 and "text/html" in ctype and 'data-page="landing"' in body
    status, _, body = get(url + "api/records?topic=t&partition=p")
    assert status == 404 and "no such partition" in body  # read over the mesh: an unknown one is said, not a crash
    proc.terminate()
    assert proc.wait(15) == 0, proc.stderr.read()


def test_model_charts_partitions_rates_and_lags() -> None:
    model = ConsoleModel(history=50)
    for t in range(10):
        snap = {
            "towers": [],
            "nodes": [],
            "partitions": [
                {"topic": "t", "partition": p, "producer_head": None, "producer_alive": True,
                 "stores": [{"address": STORE, "head": 10 * t * (i + 1), "lag": 0}]}
                for i, p in enumerate((PROD, MEMBER))
            ],
            "groups": [
                {"group": "g", "members": [], "lag": 3 * t,
                 "partitions": [{"topic": "t", "partition": PROD, "head": 0, "committed": 0, "lag": 3 * t, "owner": None},
                                {"topic": "t", "partition": MEMBER, "head": None, "committed": None, "lag": None, "owner": None}]}
            ],
        }
        model.update(snap, float(t))
    topic = model.topic("t")
    assert topic is not None and [p["rate"] for p in topic["partitions"]] == [10.0, 20.0]
    assert topic["rate"][-1] == (9.0, 30.0)
    group = model.group("g")
    assert group is not None and group["history"][-1] == (9.0, 27.0)
    (hist,) = group["partition_history"]  # the partition without a lag is not charted
    assert hist["partition"] == PROD and hist["points"] == [(float(t), 3.0 * t) for t in range(10)]
    model.update({"towers": [], "nodes": [], "partitions": [], "groups": []}, 10.0)
    assert not model.part_rates.series and not model.part_lags.series and not model.lags.series


def test_view_keeps_stores_not_acknowledging_and_why() -> None:
    view = MeshView(OWN, [], timeout=4.0)
    view.on_message(STORE, wire.StoreStatus(PROD, STORE, "t", 0, "disk full"), 1.0)
    view.on_message(STORE, wire.StoreStatus(MEMBER, STORE, "t", 0, "disk full"), 1.0)
    view.on_message(PROD, wire.StoreStatus(PROD, STORE, "t", 0, "forged"), 1.0)  # not the store
    assert view.snapshot(1.0)["not_writing"] == [
        {"store": STORE, "reason": "disk full", "partitions": [["t", PROD], ["t", MEMBER]]}
    ]
    model = ConsoleModel()
    model.update(view.snapshot(1.0), 1.0)
    assert f"store {STORE[:8]} is not acknowledging 2 partition(s): disk full" in model.alerts()
    view.on_message(STORE, wire.StoreStatus(PROD, STORE, "t", 1, ""), 2.0)  # writing again
    view.expire(11.5)  # the other was not said again for NOT_WRITING_FOR
    assert view.snapshot(11.5)["not_writing"] == []


def test_console_alerts_a_full_store(cfg: NodeConfig, tmp_path: Path) -> None:
    db = RecordDB(tmp_path / "db", map_size=256 << 10, max_map_size=1 << 20)  # a full disk, for real
    with Store(db, cfg):
        producer = Producer("full", cfg, publish_timeout=0.1)
        try:
            wait_until(lambda: len(producer.peers))
            with Console(cfg, interval=0.2) as console:
                producer.publish_many(b"%06d-" % i + b"x" * 1000 for i in range(3000))  # 3 MB

                def alert() -> Any:
                    return [a for a in get_json(console.url + "api/state")["alerts"] if "not acknowledging" in a]

                (line,) = wait_until(alert, timeout=20)
                assert "cannot write" in line and "max_map_size" in line, line
        finally:
            producer.close(0)  # its records will never be acknowledged: no waiting


def test_landing_of_a_thousand_producers_is_cut_with_whole_counts() -> None:
    view = MeshView(OWN, [], timeout=4.0)
    producers = [f"{i + 1:032X}" for i in range(1000)]  # (0 is OWN)
    view.on_beacon(STORE, "tcp://h:1", 0.0)
    for i, address in enumerate(producers):
        view.on_beacon(address, f"tcp://h:{i + 2}", 0.0)
        view.on_message(address, wire.Head("t", address, "t", i), 0.0)
        view.on_message(STORE, wire.Head("t", address, "t", i), 0.0)
    view.on_message(MEMBER, wire.Member("g", MEMBER, False, ("t",), ()), 0.0)
    model = ConsoleModel()
    model.update(view.snapshot(0.0), 0.0)
    d = model.landing()
    assert d["node_counts"]["producer"] == 1000 and len(d["nodes"]["producer"]) == 200
    (topic,) = d["topics"]
    assert topic["partitions"] == 1000 and topic["records"] == sum(range(1, 1001)) and len(topic["heads"]) == 20
    (group,) = d["groups"]
    assert group["partition_count"] == 1000 and group["lag"] == sum(range(1, 1001))
    assert [p["lag"] for p in group["partitions"]] == list(range(1000, 980, -1))  # most lagging first
    box = next(b for b in d["mesh"]["boxes"] if b["id"] == "topic:t")
    assert box["count"] == 1000 and len(box["members"]) == 50
    assert len(json.dumps(d)) < 100_000  # sent to every open page every interval


def test_offset_at_time_bisects_with_holes() -> None:
    stamps = {o: 1000 + 10 * o for o in range(100) if not 40 <= o < 60}  # a hole 40..59

    def read_one(o: int) -> tuple[int, int] | None:
        held = [k for k in stamps if k >= o]
        return (min(held), stamps[min(held)]) if held else None

    assert offset_at_time(read_one, 0, 99, 0) == 0
    assert offset_at_time(read_one, 0, 99, 1305) == 31
    # In or right after the hole: an offset of the hole may come back, reading from it gives 60.
    for ts in (1400, 1600):
        found = offset_at_time(read_one, 0, 99, ts)
        assert found in range(40, 61) and read_one(found) == (60, 1600)
    assert offset_at_time(read_one, 0, 99, 1601) == 61
    assert offset_at_time(read_one, 0, 99, 99_999) == 100
    calls = []
    offset_at_time(lambda o: calls.append(o) or (o, 0), 0, 10**12, 1)
    assert len(calls) <= 64
