"""A gate the store's receive thread and its writer take in turns.

py-lmdb gives up the GIL around every single put, and the compiled receive
loop holds the GIL while it drains; left alone, each put would wait for a
whole drain.  So the two never run together: the writer puts a chunk of
records while holding the gate, the receive loop drains while holding it.
They take turns when both wait, so neither starves the other: a big group
commit can no longer stop the receive for the whole of its puts (which let a
burst overflow the high-water marks and be fetched again).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

DRAIN = "drain"
WRITE = "write"


class TurnGate:
    """Mutual exclusion between a drain side and a write side that alternates under contention."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._busy = False
        self._waiting = {DRAIN: 0, WRITE: 0}
        self._last: str | None = None  # the side that held the gate last

    def _enter(self, side: str, other: str) -> None:
        with self._cond:
            self._waiting[side] += 1
            try:
                # After our own turn, a waiting other side goes first.
                while self._busy or (self._last == side and self._waiting[other]):
                    self._cond.wait()
            finally:
                self._waiting[side] -= 1
            self._busy = True

    def _leave(self, side: str) -> None:
        with self._cond:
            self._busy = False
            self._last = side
            self._cond.notify_all()

    @contextmanager
    def drain(self) -> Iterator[None]:
        """Held by the receive thread while it drains."""
        self._enter(DRAIN, WRITE)
        try:
            yield
        finally:
            self._leave(DRAIN)

    def __enter__(self) -> TurnGate:
        """Held by the writer around one chunk of puts."""
        self._enter(WRITE, DRAIN)
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave(WRITE)
