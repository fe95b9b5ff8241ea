"""What mesh readers get of a partition written by Kafka transactions (dafka.kafka.meshtxn, sans-IO)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dafka.kafka.meshtxn import is_marker, mesh_steps, stable_head
from dafka.store.layout import FLAG_CONTROL, FLAG_KEY, VALUE_HEADER


def rec(content: bytes = b"v") -> bytes:
    return VALUE_HEADER.pack(1, 0) + content


def marker() -> bytes:
    return VALUE_HEADER.pack(1, FLAG_KEY | FLAG_CONTROL) + b"\x0b" + bytes(11)


def test_markers_are_told_by_their_flag() -> None:
    assert is_marker(marker())
    assert not is_marker(rec())
    assert not is_marker(b"")  # too short to be a stored value: not a marker


def test_the_stable_head_stops_before_the_oldest_open_transaction() -> None:
    assert stable_head(9, None) == 9
    assert stable_head(9, []) == 9
    assert stable_head(9, [7, 4]) == 3
    assert stable_head(2, [7]) == 2
    assert stable_head(9, [0]) == -1  # nothing stable yet


def test_committed_runs_are_sent_and_aborted_runs_and_markers_voided_together() -> None:
    values = [rec(b"c1"), rec(b"c2"), marker(), rec(b"x1"), rec(b"x2"), marker(), rec(b"c3")]
    steps = mesh_steps(10, values, 100, [(13, 14)])
    assert steps == [(10, 11, [values[0], values[1]]), (12, 15, None), (16, 16, [values[6]])]


def test_nothing_at_or_past_the_last_stable_offset() -> None:
    values = [rec(), marker(), rec(), rec()]
    assert mesh_steps(0, values, 2, []) == [(0, 0, [values[0]]), (1, 1, None)]
    assert mesh_steps(5, values, 5, []) == []
    assert mesh_steps(5, values, 3, []) == []


def test_aborted_ranges_before_or_past_the_slice_change_nothing() -> None:
    values = [rec(), rec()]
    assert mesh_steps(5, values, 100, [(0, 4), (7, 9)]) == [(5, 6, values)]
    assert mesh_steps(5, values, 100, [(0, 5)]) == [(5, 5, None), (6, 6, [values[1]])]


@given(st.lists(st.sampled_from(["r", "m"]), max_size=40), st.integers(0, 50), st.integers(0, 60),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 5)), max_size=5))
def test_steps_cover_each_stable_offset_once_and_hide_exactly_markers_and_aborted(
        kinds: list[str], start: int, end: int, spans: list[tuple[int, int]]) -> None:
    values = [marker() if k == "m" else rec(str(i).encode()) for i, k in enumerate(kinds)]
    aborted = sorted((a, a + n) for a, n in spans)
    steps = mesh_steps(start, values, end, aborted)
    covered = []
    for first, last, run in steps:
        assert first <= last
        if run is not None:
            assert run == values[first - start:last - start + 1]
        covered += [(off, run is None) for off in range(first, last + 1)]
    n = max(0, min(len(values), end - start))
    assert [off for off, _ in covered] == list(range(start, start + n))
    for off, hidden in covered:
        assert hidden == (is_marker(values[off - start]) or any(a <= off <= b for a, b in aborted))
    for (_, _, r1), (_, _, r2) in zip(steps, steps[1:], strict=False):
        assert (r1 is None) != (r2 is None)  # runs alternate: adjacent ones are merged


def test_a_reader_that_takes_no_void_gets_every_stable_record() -> None:
    values = [rec(b"c1"), marker(), rec(b"x1"), marker(), rec(b"open")]
    assert mesh_steps(0, values, 4, [(2, 2)], hide=False) == [(0, 3, values[:4])]
    assert mesh_steps(4, values, 4, [], hide=False) == []
