"""A node's timers: ``Node.every`` and the loop step that runs what is due.

A node keeps its timers in a list of ``(interval, last run, fn)``; timers of one
interval run in step (one wake-up, not one each), and the loop looks at them
only when the earliest is due (``_timers_due``) or one changed (``_timers_gen``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

TICK = 0.05  # seconds between calls of on_tick
TIMER_SLACK = 0.001  # a timer due this soon runs with the ones due now


class TimersMixin:
    """Timers of a :class:`~dafka.nodes.node.Node` (its state is set up by ``Node.__init__``)."""

    def every(self, interval: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(now)`` in the I/O thread every ``interval`` seconds.

        In step with the node's timers of the same interval (the first call may
        come sooner than ``interval``): they run in one wake-up, not one each.
        """
        self._timers.append((interval, self._in_step(interval, time.monotonic()), fn))
        self._timer_changed()

    def _timer_changed(self) -> None:
        """A timer was added or rescheduled: the next loop turn looks at them all."""
        self._timers_gen += 1
        self._timers_due = 0.0

    def _in_step(self, interval: float, now: float) -> float:
        """The last run to give a timer of ``interval`` so that it runs with the
        node's others of that interval (``now`` if there are none)."""
        for other, last, _ in self._timers:
            if other == interval and last <= now:
                return last + interval * math.floor((now - last) / interval)
        return now

    def _loop_timers(self, now: float) -> float:
        """Run the timers that are due; seconds until the next one (at most 1)."""
        earliest = self._timers_due
        if now + TIMER_SLACK < earliest:
            wait = min(1.0, earliest - now)  # none due: as the last look found them
        else:
            timers = self._timers
            gen = self._timers_gen
            earliest = math.inf
            for i, (interval, last, fn) in enumerate(timers):
                due = last + interval
                # Timers due within a millisecond run together (and stay in step
                # after, as their last run is the same ``now``): one wake-up a
                # second for a node's 1 s timers instead of one each.
                if due <= now + TIMER_SLACK:
                    timers[i] = (interval, now, fn)
                    try:
                        fn(now)
                    except Exception:
                        self.log.exception("%s timer failed", self.kind)
                    interval, last, fn = timers[i]  # (a timer may reschedule itself)
                    due = last + interval
                earliest = min(earliest, due)
            # Kept only if no timer changed meanwhile (one may move another).
            self._timers_due = earliest if gen == self._timers_gen else 0.0
            wait = min(1.0, earliest - now)
        if self._linger_until:
            if now >= self._linger_until:
                self._linger_until = 0.0
                self._watch_data()
            else:
                wait = min(wait, self._linger_until - now)
        return wait
