"""The connector's planning code, without Spark: offsets, options, the sink's commit log."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dafka.errors import ConfigError, DafkaError
from dafka.spark.offsets import (
    EARLIEST,
    LATEST,
    Loss,
    PartitionState,
    ReadRange,
    admit,
    canonical,
    cap,
    latest_offsets,
    parse_offset_spec,
    plan_ranges,
    resolve,
    split_range,
)
from dafka.spark.options import parse_gateway, parse_read_options, parse_write_options
from dafka.spark.sinklog import (
    base_record,
    commit_record,
    fold,
    log_topic,
    merge_ends,
    parse_record,
    suffix_complete,
)

A, B, C = "A" * 32, "B" * 32, "C" * 32
PARTS = [
    PartitionState("t", A, 0, 100),
    PartitionState("t", B, 40, 50),
    PartitionState("u", C, 5, 5),
]


# ---------------------------------------------------------------- offset specs


def test_spec_keywords() -> None:
    assert parse_offset_spec(None, "startingOffsets", ["t"], default="earliest").default == EARLIEST
    assert parse_offset_spec(" LATEST ", "startingOffsets", ["t"], default="earliest").default == LATEST
    with pytest.raises(ValueError, match="endingOffsets"):
        parse_offset_spec("earliest", "endingOffsets", ["t"], default="latest", ending=True)


def test_spec_json_per_partition_and_per_topic() -> None:
    spec = parse_offset_spec(
        json.dumps({"t": {A: 7, B: -1}, "u": -2}), "startingOffsets", ["t", "u"], default="latest"
    )
    assert resolve(spec, PARTS) == {"t": {A: 7, B: 50}, "u": {C: 5}}


def test_spec_json_unnamed_partitions_start_earliest_end_latest() -> None:
    start = parse_offset_spec(json.dumps({"t": {A: 3}}), "s", ["t", "u"], default="latest")
    assert resolve(start, PARTS) == {"t": {A: 3, B: 40}, "u": {C: 5}}
    end = parse_offset_spec(json.dumps({"t": {A: 500}}), "e", ["t", "u"], default="latest", ending=True)
    # An ending offset past the head is capped: a batch cannot read the future.
    assert resolve(end, PARTS, ending=True) == {"t": {A: 100, B: 50}, "u": {C: 5}}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "expected earliest, latest or JSON"),
        ("[1, 2]", "object of topics"),
        ('{"zzz": -2}', "not subscribed"),
        ('{"t": {"p": -3}}', "negative"),
        ('{"t": {"p": "5"}}', "integer"),
        ('{"t": true}', "integer"),
    ],
)
def test_spec_errors_name_the_option(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_offset_spec(text, "startingOffsets", ["t"], default="earliest")
    assert "startingOffsets" in str(info.value)


def test_ending_spec_rejects_earliest_in_json() -> None:
    with pytest.raises(ValueError, match="earliest"):
        parse_offset_spec('{"t": -2}', "endingOffsets", ["t"], default="latest", ending=True)


def test_canonical_sorts_for_spark_string_compare() -> None:
    a = canonical({"u": {C: 1}, "t": {B: 2, A: 3}})
    assert json.dumps(a) == json.dumps({"t": {A: 3, B: 2}, "u": {C: 1}})
    assert latest_offsets(reversed(PARTS)) == {"t": {A: 100, B: 50}, "u": {C: 5}}


# ---------------------------------------------------------------- admission control


def test_admit_everything_without_limit() -> None:
    start = {"t": {A: 10}}
    latest = {"t": {A: 100, B: 50}}
    # B is new: it starts at 0, but only its stored records (from 40) count.
    assert admit(start, latest, {("t", B): 40}, None) == {"t": {A: 100, B: 50}}


def test_admit_water_fills_exactly_max_rows() -> None:
    start = {"t": {A: 0, B: 0}, "u": {C: 0}}
    latest = {"t": {A: 1000, B: 3}, "u": {C: 1000}}
    end = admit(start, latest, {}, 101)
    # B's small backlog is taken whole; the rest is shared evenly.
    assert end == {"t": {A: 49, B: 3}, "u": {C: 49}}
    assert sum(end["t"].values()) + sum(end["u"].values()) == 101


def test_admit_no_new_data_returns_start_unchanged() -> None:
    start = {"t": {A: 100, B: 50}, "u": {C: 5}}
    end = admit(start, latest_offsets(PARTS), {(p.topic, p.partition): p.first for p in PARTS}, 10)
    assert json.dumps(end) == json.dumps(canonical(start))


def test_admit_never_moves_backwards_and_keeps_vanished_partitions() -> None:
    start = {"t": {A: 200, B: 10}}
    assert admit(start, {"t": {A: 100}}, {}, None) == {"t": {A: 200, B: 10}}


def test_admit_rejects_non_positive_limit() -> None:
    with pytest.raises(ValueError):
        admit({}, {}, {}, 0)


@given(
    backlogs=st.lists(st.integers(0, 500), min_size=1, max_size=6),
    starts=st.lists(st.integers(0, 50), min_size=6, max_size=6),
    max_rows=st.integers(1, 2000),
)
def test_admit_properties(backlogs: list[int], starts: list[int], max_rows: int) -> None:
    names = [f"p{i}" for i in range(len(backlogs))]
    start = {"t": {n: starts[i] for i, n in enumerate(names)}}
    latest = {"t": {n: starts[i] + backlogs[i] for i, n in enumerate(names)}}
    end = admit(start, latest, {}, max_rows)
    taken = [end["t"][n] - start["t"][n] for n in names]
    assert sum(taken) == min(max_rows, sum(backlogs))
    assert all(0 <= t <= b for t, b in zip(taken, backlogs, strict=True))
    assert admit(start, latest, {}, max_rows) == end  # deterministic


def test_cap_for_available_now() -> None:
    latest = {"t": {A: 100, B: 50}, "u": {C: 5}}
    target = {"t": {A: 60}}
    # B and u appeared after the target was taken: not read by this availableNow run.
    assert cap(latest, target) == {"t": {A: 60}}


# ---------------------------------------------------------------- ranges


def test_split_range_even_pieces() -> None:
    assert split_range(0, 10, 4) == [(0, 4), (4, 7), (7, 10)]
    assert split_range(5, 5, 4) == []
    assert split_range(0, 3, 10) == [(0, 3)]
    with pytest.raises(ValueError):
        split_range(0, 1, 0)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 10**5))
def test_split_range_covers_exactly(a: int, n: int, m: int) -> None:
    pieces = split_range(a, a + n, m)
    assert sum(e - s for s, e in pieces) == n
    assert all(0 < e - s <= m for s, e in pieces)
    assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:], strict=False))
    if pieces:
        assert max(e - s for s, e in pieces) - min(e - s for s, e in pieces) <= 1


def test_plan_ranges_splits_and_clamps() -> None:
    parts = {(p.topic, p.partition): p._replace(pid=i) for i, p in enumerate(PARTS)}
    ranges, losses = plan_ranges({"t": {A: 0, B: 10}}, {"t": {A: 100, B: 50}}, parts, 40)
    assert ranges == [
        ReadRange("t", A, 0, 34, 0),
        ReadRange("t", A, 34, 67, 0),
        ReadRange("t", A, 67, 100, 0),
        ReadRange("t", B, 40, 50, 1),
    ]
    assert losses == [Loss("t", B, 10, 40)]
    assert "10..39" in losses[0].describe()


def test_plan_ranges_new_partition_starts_at_zero() -> None:
    parts = {("t", B): PartitionState("t", B, 0, 50)}
    ranges, losses = plan_ranges({}, {"t": {B: 50}}, parts, 1000)
    assert ranges == [ReadRange("t", B, 0, 50)] and losses == []


def test_plan_ranges_all_lost() -> None:
    parts = {("t", B): PartitionState("t", B, 40, 50)}
    ranges, losses = plan_ranges({"t": {B: 0}}, {"t": {B: 30}}, parts, 1000)
    assert ranges == [] and losses == [Loss("t", B, 0, 30)]


# ---------------------------------------------------------------- options


def test_read_options_defaults() -> None:
    batch = parse_read_options({"subscribe": "a, b,a", "path": "/x"}, streaming=False)
    assert batch.topics == ("a", "b") and batch.transport.path == "/x"
    assert batch.starting.default == EARLIEST and batch.ending is None
    assert batch.fail_on_data_loss and batch.max_offsets_per_trigger is None
    stream = parse_read_options(
        {"SUBSCRIBE": "a", "Gateway": "h:11011", "maxOffsetsPerTrigger": "5"}, streaming=True
    )
    assert stream.starting.default == LATEST and stream.max_offsets_per_trigger == 5
    assert (stream.transport.host, stream.transport.port) == ("h", 11011)


@pytest.mark.parametrize(
    ("options", "streaming", "match"),
    [
        ({"path": "/x"}, False, "'subscribe' is required"),
        ({"subscribe": " , "}, False, "names no topic"),
        ({"subscribe": "a"}, False, "missing option: give 'path'"),
        ({"subscribe": "a", "path": "/x", "gateway": "h:1"}, False, "only one"),
        ({"subscribe": "a", "gateway": "nohost"}, False, "host:port"),
        ({"subscribe": "a", "path": "/x", "endingOffsets": "latest"}, True, "batch reads only"),
        ({"subscribe": "a", "path": "/x", "maxOffsetsPerTrigger": "5"}, False, "streaming"),
        ({"subscribe": "a", "path": "/x", "maxOffsetsPerTrigger": "0"}, True, "at least 1"),
        ({"subscribe": "a", "path": "/x", "failOnDataLoss": "maybe"}, True, "failOnDataLoss"),
        ({"subscribe": "a", "path": "/x", "startingOffsets": "soon"}, True, "startingOffsets"),
        ({"subscribePattern": "a.*", "path": "/x"}, True, "use 'subscribe'"),
    ],
)
def test_read_option_errors(options: dict, streaming: bool, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_read_options(options, streaming=streaming)


def test_write_options() -> None:
    w = parse_write_options({"gateway": "[::1]:9", "topic": "out", "numPartitions": "2"})
    assert (w.transport.host, w.transport.port, w.topic, w.num_partitions) == ("::1", 9, "out", 2)
    with pytest.raises(ConfigError, match="'gateway'.*required.*read-only"):
        parse_write_options({"path": "/x"})
    with pytest.raises(ConfigError, match="host:port"):
        parse_gateway("h:70000")


# ---------------------------------------------------------------- sink commit log


def recs(*raw: bytes) -> list[dict]:
    return [parse_record(r) for r in raw]


def test_fold_bases_then_commits() -> None:
    log = recs(
        base_record("x", {0: 5, 1: 0}),
        commit_record(0, {"x": {0: 9, 1: 0}}),
        base_record("y", {0: 0}),
        commit_record(1, {"x": {0: 12, 1: 3}, "y": {0: 4}}),
    )
    assert fold(log[:1], 0).ends == {"x": {0: 5, 1: 0}}
    assert fold(log[:3], 1).ends == {"x": {0: 9, 1: 0}, "y": {0: 0}}
    s2 = fold(log, 2)
    assert s2.ends == {"x": {0: 12, 1: 3}, "y": {0: 4}} and not s2.committed
    # Batch 1 re-run: the state before it, and it is known as committed.
    s1 = fold(log, 1)
    assert s1.committed and s1.last_batch == 1


def test_fold_first_base_wins_and_commits_merge() -> None:
    log = recs(
        base_record("x", {0: 5}),
        base_record("x", {0: 8}),
        commit_record(0, {"y": {0: 2}}),  # made before a late base of x was seen
    )
    assert fold(log, 1).ends == {"x": {0: 5}, "y": {0: 2}}


def test_fold_refuses_a_log_ahead_of_the_query() -> None:
    log = recs(commit_record(7, {"x": {0: 1}}))
    with pytest.raises(DafkaError, match="new sinkId"):
        fold(log, 3)


def test_suffix_complete_and_parse_errors() -> None:
    log = recs(base_record("x", {0: 0}), commit_record(4, {"x": {0: 1}}))
    assert suffix_complete(log, 5) and not suffix_complete(log, 4)
    with pytest.raises(DafkaError):
        parse_record(b'{"kind": "other"}')
    with pytest.raises(DafkaError):
        parse_record(b"\xff")


def test_log_topic_and_merge() -> None:
    assert log_topic("3e6f-ab cd/ef") == "_dafka_sink_3e6f-ab_cd_ef"
    assert not log_topic("q").startswith("__")  # the gateway reserves "__" names
    assert merge_ends({"x": {0: 5}}, {"x": {0: 3, 1: 1}}) == {"x": {0: 5, 1: 1}}


def test_arrow_batches_match_the_spark_schema() -> None:
    """Spark checks each Arrow batch against the declared schema, field by field."""
    pytest.importorskip("pyspark")
    from pyspark.sql.pandas.types import to_arrow_schema

    from dafka.spark.source import SCHEMA
    from dafka.spark.transport import ARROW_SCHEMA

    assert to_arrow_schema(SCHEMA, timezone="UTC").equals(ARROW_SCHEMA)
