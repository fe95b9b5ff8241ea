"""How long a store rests from reading after a small read (sans-IO).

A store that reads a trickle of records wakes, reads, commits (an fsync)
and acknowledges once a record.  Resting a little after a small read lets the
next records share that work (``[store] linger_ms``, 1 ms by default).

A fleet of devices is a trickle of another kind: a thousand partitions, each
a record now and then.  There the store rests :data:`SLOW_LINGER` (5 ms)
after a read whose every partition had been silent for :data:`SLOW_GAP`
before it: their records then share a commit five at a time instead of one
or two, for a few ms more ACK latency, at most 5% of the time between two
records of theirs.  A read that brings records of a busy partition (one
that sent records within SLOW_GAP: a stream of more than 10 records a
second) rests the configured linger.

Times are passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable

SLOW_GAP = 0.1  # seconds a partition sent nothing for its records to count as a slow partition's
SLOW_LINGER = 0.005  # seconds: the rest after a small read of slow partitions' records only
_NEVER = float("-inf")


class TrickleLinger:
    """The rest after each small read, from the partitions it brought records of."""

    __slots__ = ("_seen_at",)

    def __init__(self) -> None:
        # Bounded by the partitions the store holds (it keeps their heads too).
        self._seen_at: dict[int, float] = {}  # partition id -> when a small read last brought it records

    def rest(self, linger: float, partitions: Iterable[int], now: float) -> float:
        """Seconds to rest after a small read of records of ``partitions`` (their
        ids; none known: ``linger``, the configured rest, as when it is 0: off)."""
        if not linger or linger >= SLOW_LINGER:
            return linger
        seen = self._seen_at
        slow, any_seen = True, False
        for pid in partitions:
            any_seen = True
            if now - seen.get(pid, _NEVER) < SLOW_GAP:
                slow = False
            seen[pid] = now
        return SLOW_LINGER if slow and any_seen else linger
