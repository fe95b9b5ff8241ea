"""dafka.store.linger: the rest after a small read (sans-IO, times passed in)."""

from __future__ import annotations

from dafka.store.linger import SLOW_GAP, SLOW_LINGER, TrickleLinger


def test_reads_of_slow_partitions_only_rest_longer() -> None:
    t = TrickleLinger()
    # A fleet: partitions each heard of once in a while.
    assert t.rest(0.001, [1, 2], 100.0) == SLOW_LINGER  # never seen: slow
    assert t.rest(0.001, [3], 100.0 + SLOW_GAP / 2) == SLOW_LINGER
    assert t.rest(0.001, [1], 100.0 + 1.5 * SLOW_GAP) == SLOW_LINGER  # silent for over SLOW_GAP


def test_a_busy_partition_in_the_read_keeps_the_configured_linger() -> None:
    t = TrickleLinger()
    t.rest(0.001, [7], 10.0)
    assert t.rest(0.001, [7], 10.0 + SLOW_GAP / 10) == 0.001  # a stream
    assert t.rest(0.001, [8, 7], 10.0 + SLOW_GAP / 5) == 0.001  # one busy partition is enough
    # Each read counts as the partition's last: the busy one stays busy.
    assert t.rest(0.001, [7], 10.0 + SLOW_GAP / 5 + SLOW_GAP * 0.9) == 0.001


def test_off_unknown_and_longer_lingers_are_left_alone() -> None:
    t = TrickleLinger()
    assert t.rest(0.0, [1], 1.0) == 0.0  # linger_ms = 0: never rests
    assert t.rest(0.001, [], 1.0) == 0.001  # no stored run in the read (new partitions)
    assert t.rest(0.02, [2], 1.0) == 0.02  # configured longer than SLOW_LINGER
