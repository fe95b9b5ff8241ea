"""The estimate a parked long poll is answered on (dafka.gateway.parking), without a gateway."""

from __future__ import annotations

from dafka.gateway.parking import arrived


def _never() -> bool:
    raise AssertionError("asked though nothing came")


def test_nothing_new_adds_nothing_and_asks_nothing() -> None:
    assert arrived((10, 500, 1000), 10, lambda: int(_never()), _never, 8, 61) == 0
    assert arrived((-1, 0, 1000), -1, lambda: int(_never()), _never, 8, 61) == 0  # (still empty)


def test_new_records_count_their_stored_bytes_and_a_little_each_within_the_limit() -> None:
    assert arrived((10, 500, 1000), 12, lambda: 700, lambda: False, 8, 61) == 200 + 16 + 61
    assert arrived((10, 500, 1000), 12, lambda: 700, lambda: False, 1, 0) == 202
    assert arrived((10, 500, 250), 12, lambda: 700, lambda: False, 8, 61) == 250


def test_what_the_stored_bytes_cannot_tell_counts_as_the_whole_limit() -> None:
    assert arrived((10, 500, 1000), 11, lambda: 100, _never, 8, 61) == 1000  # bytes went down
    assert arrived((10, 500, 1000), 11, lambda: 520, lambda: True, 8, 61) == 1000  # compressed, other codec
    assert arrived((10, 500, 1000), 3, lambda: int(_never()), _never, 8, 61) == 1000  # went back
