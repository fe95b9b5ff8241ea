"""A lock that a publishing loop cannot starve the I/O thread of.

``threading.Lock`` hands nothing over on release: a thread that releases and
takes it again at once (an application calling ``publish`` in a tight loop)
nearly always wins against a waiter that must first be scheduled, and the
producer's I/O thread can wait seconds for the lock it needs to handle ACKs,
FETCHes and its timers.  Here a blocked waiter makes itself known, and the
publishing side lets it in first (:meth:`FairLock.let_waiters_in`), then
takes :attr:`FairLock.raw`, the plain lock, with no Python-level overhead.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# A waiter normally gets the lock within tens of microseconds of being let in;
# never hold a publisher back longer than this.
YIELD_LIMIT = 0.002


class FairLock:
    """A non-reentrant lock (usable by ``threading.Condition``) with waiter hand-over."""

    __slots__ = ("raw", "waiters")

    def __init__(self) -> None:
        self.raw = threading.Lock()
        self.waiters: list[int] = []  # blocked in acquire; append/remove are atomic under the GIL

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.raw.acquire(False):
            return True
        if not blocking:
            return False
        me = threading.get_ident()
        self.waiters.append(me)
        try:
            return self.raw.acquire(True, timeout)
        finally:
            self.waiters.remove(me)

    def release(self) -> None:
        self.raw.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.raw.release()

    def let_waiters_in(self) -> None:
        """Called without the lock, before taking it: first let a blocked waiter have it."""
        deadline = time.monotonic() + YIELD_LIMIT
        while self.waiters and time.monotonic() < deadline:
            time.sleep(0)  # gives up the GIL and the CPU to the waiter
