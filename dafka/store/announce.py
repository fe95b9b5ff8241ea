"""Which heads a store re-announces now (sans-IO).

A store re-announces the head of every partition it holds every
``interval`` seconds (``HEADS_INTERVAL``, 30 s), so that other stores and
readers fetch tails they missed.  All at once, that was one turn of 10,000
HEADs every 30 s for a store of 10,000 leaf devices (30-50 ms in which
nothing else was read or acknowledged), 100,000 for 100,000.  A
:class:`HeadsRota` spreads them instead: each call of :meth:`HeadsRota.due`
(the shell calls it every ``step`` seconds) returns the next slice, so each
partition is still announced once per ``interval``, and a turn sends at most
``ceil(n * step / interval)`` of them.  Times are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

Key = tuple[str, str]  # (topic, partition)


class HeadsRota:
    """The partitions whose heads to announce at each step (see the module docstring)."""

    def __init__(self, keys: Callable[[], Iterable[Key]], *, interval: float = 30.0, step: float = 1.0) -> None:
        if interval <= 0 or step <= 0:
            raise ValueError("HeadsRota needs interval > 0 and step > 0")
        self.keys = keys  # the partitions held now (taken anew at the start of each round)
        self.interval = interval
        self.step = step
        self._round: list[Key] = []
        self._at = 0  # next index into _round
        self._per_step = 0
        self._next_round = float("-inf")  # when the next round may start

    def due(self, now: float) -> list[Key]:
        """The partitions to announce now (a round begins at most once per ``interval``)."""
        if self._at >= len(self._round):
            if now < self._next_round:
                return []
            self._round = list(self.keys())
            self._at = 0
            self._next_round = now + self.interval
            steps = max(1, round(self.interval / self.step))
            self._per_step = max(1, math.ceil(len(self._round) / steps))
        out = self._round[self._at : self._at + self._per_step]
        self._at += len(out)
        return out
