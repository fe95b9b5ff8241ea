"""The store's re-announce of heads, spread over its interval (dafka.store.announce)."""

from __future__ import annotations

from dafka.store.announce import HeadsRota


def test_every_head_is_announced_once_per_interval_in_slices() -> None:
    held = {("t", f"p{i}"): i for i in range(10_000)}
    rota = HeadsRota(lambda: held, interval=30.0, step=1.0)
    slices = [rota.due(float(s)) for s in range(30)]
    assert max(len(s) for s in slices) == 334  # ceil(10,000 / 30), not 10,000 in one turn
    assert sorted(k for s in slices for k in s) == sorted(held)  # each once in the round
    assert rota.due(30.0) != [] and rota.due(29.5 + 30.0)  # the next round, from 30 s on


def test_a_round_takes_the_partitions_held_when_it_starts() -> None:
    held: dict[tuple[str, str], int] = {}
    rota = HeadsRota(lambda: held, interval=3.0, step=1.0)
    assert rota.due(0.0) == []  # nothing held: the round is empty
    held[("t", "a")] = 1
    assert rota.due(1.0) == [] and rota.due(2.9) == []  # the next round begins at 3.0
    assert rota.due(3.0) == [("t", "a")]
    assert rota.due(4.0) == [] and rota.due(6.0) == [("t", "a")]
