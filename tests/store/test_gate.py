"""The store's turn gate: the writer's chunks of puts and the receive drains take turns."""

from __future__ import annotations

import threading

from dafka.store.gate import DRAIN, WRITE, TurnGate
from tests.conftest import wait_until


def _waiting(gate: TurnGate, side: str) -> int:
    with gate._cond:
        return gate._waiting[side]


def test_a_waiting_drain_goes_before_the_writers_next_chunk() -> None:
    gate = TurnGate()
    order: list[str] = []
    gate.__enter__()  # the writer puts a chunk
    drainer = threading.Thread(target=lambda: _drain(gate, order))
    drainer.start()
    wait_until(lambda: _waiting(gate, DRAIN) == 1)
    gate.__exit__()
    # A plain lock would let the writer take it straight back here.
    with gate:
        order.append("write")
    drainer.join(5)
    assert order == ["drain", "write"]


def test_a_waiting_writer_goes_before_the_next_drain() -> None:
    gate = TurnGate()
    order: list[str] = []
    with gate.drain():
        writer = threading.Thread(target=lambda: _write(gate, order))
        writer.start()
        wait_until(lambda: _waiting(gate, WRITE) == 1)
    with gate.drain():
        order.append("drain")
    writer.join(5)
    assert order == ["write", "drain"]


def test_one_side_alone_never_waits() -> None:
    gate = TurnGate()
    for _ in range(100):
        with gate:
            pass
    for _ in range(100):
        with gate.drain():
            pass


def _drain(gate: TurnGate, order: list[str]) -> None:
    with gate.drain():
        order.append("drain")


def _write(gate: TurnGate, order: list[str]) -> None:
    with gate:
        order.append("write")
