"""The persisted Tank partition id <-> Dafka partition map."""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dafka.tank.mapping import (
    FILE_NAME,
    FORMAT_VERSION,
    MAX_PARTITIONS,
    PARTITIONS_TOPIC,
    MappingError,
    PartitionMap,
    TankPartition,
    valid_topic_name,
)


def counter_addresses():
    c = itertools.count()
    return lambda: f"ADDR{next(c):028d}"


def snapshot(pmap: PartitionMap) -> list[tuple[str, int, str, bool]]:
    return [(p.topic, p.pid, p.address, p.owned) for p in pmap.order]


def test_create_topic_gives_owned_ids_from_zero() -> None:
    pmap = PartitionMap()
    new = counter_addresses()
    assert pmap.create_topic("t", 3, new)
    parts = pmap.partitions("t")
    assert parts is not None
    assert [(p.pid, p.owned, p.topic) for p in parts] == [(0, True, "t"), (1, True, "t"), (2, True, "t")]
    assert len({p.address for p in parts}) == 3
    assert list(pmap.owned()) == parts
    assert not pmap.create_topic("t", 2, new)  # exists: nothing changes
    assert len(pmap) == 3 and pmap.topics() == ["t"]
    for bad in (0, MAX_PARTITIONS + 1, -1):
        with pytest.raises(ValueError):
            pmap.create_topic("u", bad, new)
    assert pmap.partitions("u") is None


def test_mesh_partitions_get_the_next_free_id_and_are_never_renumbered() -> None:
    pmap = PartitionMap()
    pmap.create_topic("t", 2, counter_addresses())
    a = pmap.add("t", "MESH-A")
    b = pmap.add("other", "MESH-A")  # the same address in another topic is another partition
    c = pmap.add("t", "MESH-C")
    assert (a.pid, a.owned, b.pid, c.pid) == (2, False, 0, 3)
    assert pmap.add("t", "MESH-A") is a  # known: the same partition back
    assert pmap.lookup("t", "MESH-C") is c and pmap.lookup("t", "nope") is None
    assert pmap.get("t", 3) is c and pmap.get("t", 4) is None and pmap.get("x", 0) is None
    assert [p.address for p in pmap.owned()] == [p.address for p in pmap.partitions("t")[:2]]
    assert snapshot(pmap)[-3:] == [("t", 2, "MESH-A", False), ("other", 0, "MESH-A", False), ("t", 3, "MESH-C", False)]


def test_a_full_topic_gives_no_more_ids(caplog: pytest.LogCaptureFixture) -> None:
    pmap = PartitionMap()
    assert pmap.create_topic("big", MAX_PARTITIONS, counter_addresses())
    parts = pmap.partitions("big")
    assert parts[-1].pid == MAX_PARTITIONS - 1 == 0xFFFE  # 0xffff marks an unknown topic
    with caplog.at_level(logging.ERROR, "dafka.gateway"):
        assert pmap.add("big", "late-1") is None
        assert pmap.add("big", "late-2") is None
    assert len([r for r in caplog.records if "big" in r.getMessage()]) == 1  # logged once
    assert pmap.lookup("big", "late-1") is None and len(pmap) == MAX_PARTITIONS
    assert pmap.add("small", "x").pid == 0  # other topics are not affected


def test_describe_is_the_partitions_topic_value() -> None:
    part = TankPartition("events", 4, "ABC", True)
    assert json.loads(part.describe()) == {"address": "ABC", "owned": True, "partition": 4, "topic": "events"}
    assert part.describe().startswith(b'{"address"')  # sorted keys: stable bytes


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("events", True),
        ("a", True),
        ("x" * 255, True),
        ("é" * 127, True),  # 254 bytes of UTF-8
        ("", False),
        ("x" * 256, False),
        ("é" * 128, False),  # 256 bytes
        ("a\0b", False),
        ("__reserved", False),
        (PARTITIONS_TOPIC, False),
        ("_single", True),
    ],
)
def test_valid_topic_name(name: str, ok: bool) -> None:
    assert valid_topic_name(name) is ok


def test_save_and_load(tmp_path: Path) -> None:
    path = str(tmp_path / FILE_NAME)
    assert len(PartitionMap.load(path)) == 0  # nothing saved yet: empty
    pmap = PartitionMap()
    pmap.create_topic("t", 2, counter_addresses())
    pmap.add("t", "MESH")
    pmap.add("ünï", "MESH2")
    pmap.save(path)
    assert sorted(os.listdir(tmp_path)) == [FILE_NAME]  # no temporary file left
    again = PartitionMap.load(path)
    assert snapshot(again) == snapshot(pmap)
    assert [p.pid for p in again.owned()] == [0, 1]
    assert again.lookup("t", "MESH").pid == 2
    doc = json.loads(Path(path).read_text())
    assert doc["format"] == FORMAT_VERSION and len(doc["partitions"]) == 4
    pmap.add("t", "MORE")
    pmap.save(path)  # replaces the old file
    assert snapshot(PartitionMap.load(path)) == snapshot(pmap)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        "{}",
        '{"format": 2, "partitions": []}',
        '{"format": 1}',
        '{"format": 1, "partitions": 5}',
        '{"format": 1, "partitions": ["x"]}',
        '{"format": 1, "partitions": [{"topic": "t", "id": 0, "address": "A"}]}',
        # ids must be 0, 1, ... per topic in the order they were given
        '{"format": 1, "partitions": [{"topic": "t", "id": 1, "address": "A", "owned": true}]}',
        '{"format": 1, "partitions": [{"topic": "t", "id": "zero", "address": "A", "owned": true}]}',
        '{"format": 1, "partitions": [{"topic": "t", "id": 0, "address": "A", "owned": true},'
        ' {"topic": "t", "id": 0, "address": "B", "owned": true}]}',
    ],
)
def test_a_bad_saved_map_is_a_mapping_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(MappingError):
        PartitionMap.from_json(text)
    path = tmp_path / FILE_NAME
    path.write_text(text)
    with pytest.raises(MappingError):
        PartitionMap.load(str(path))


# ---------------------------------------------------------------- properties

topics = st.sampled_from(["a", "b", "ünï", "x" * 255]) | st.text(min_size=1, max_size=8)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("create"), topics, st.integers(1, 5)),
        st.tuples(st.just("add"), topics, st.sampled_from(["P1", "P2", "P3", "P4"])),
    ),
    max_size=30,
)


@given(ops)
def test_ids_stay_dense_stable_and_survive_a_round_trip(operations) -> None:
    pmap = PartitionMap()
    new = counter_addresses()
    given_ids: dict[tuple[str, str], int] = {}
    for op, topic, arg in operations:
        if op == "create":
            existed = pmap.partitions(topic) is not None
            assert pmap.create_topic(topic, arg, new) is not existed
        else:
            part = pmap.add(topic, arg)
            assert part is not None and part.topic == topic and part.address == arg
            assert given_ids.setdefault((topic, arg), part.pid) == part.pid  # never renumbered
    for topic in pmap.topics():
        parts = pmap.partitions(topic)
        assert [p.pid for p in parts] == list(range(len(parts)))
        for p in parts:
            assert pmap.lookup(topic, p.address) is p and pmap.get(topic, p.pid) is p
    assert len(pmap) == sum(len(pmap.partitions(t)) for t in pmap.topics())
    again = PartitionMap.from_json(pmap.to_json())
    assert snapshot(again) == snapshot(pmap)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, FILE_NAME)
        pmap.save(path)
        assert snapshot(PartitionMap.load(path)) == snapshot(pmap)


@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_garbage_text_is_a_mapping_error_or_a_valid_map(text: str) -> None:
    try:
        pmap = PartitionMap.from_json(text)
    except MappingError:
        return
    assert snapshot(PartitionMap.from_json(pmap.to_json())) == snapshot(pmap)


@given(st.data())
def test_mutated_saved_maps_never_raise_anything_but_mapping_error(data: st.DataObject) -> None:
    pmap = PartitionMap()
    pmap.create_topic("t", 3, counter_addresses())
    pmap.add("t", "MESH")
    text = pmap.to_json()
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(text)))
        kind = data.draw(st.sampled_from(["delete", "insert", "replace"]))
        piece = data.draw(st.sampled_from(['"', "{", "}", "[", "]", ",", ":", "1", "-", "true", "null", "x", ""]))
        if kind == "delete":
            text = text[:pos] + text[pos + 1 :]
        elif kind == "insert":
            text = text[:pos] + piece + text[pos:]
        else:
            text = text[:pos] + piece + text[pos + 1 :]
    try:
        again = PartitionMap.from_json(text)
    except MappingError:
        return
    for topic in again.topics():
        assert [p.pid for p in again.partitions(topic)] == list(range(len(again.partitions(topic))))
