"""The edge outbox's decisions, sans-IO: what to keep, evict, make durable and send.

An outbox keeps every record a producer published until a store acknowledged
it, on local disk (see :mod:`dafka.outbox.db`).  :class:`OutboxCore` holds the
bookkeeping; it owns the producer's :class:`~dafka.core.unacked.UnackedWindow`, so
the in-memory window and the outbox cannot diverge: every offset the window
holds is either *pending* (published, not yet committed to disk, never sent)
or *durable* (committed; only durable records go on the wire, so no store can
ever hold an offset the outbox does not know of).

Events in (with the time passed by the caller), decisions out:

* :meth:`admit` -- may ``n`` more records of ``nbytes`` go in now?  (room,
  wait, or which offsets to evict first under ``drop_oldest``);
* :meth:`pushed` -- the window assigned offsets: they are pending;
* :meth:`take` -- the pending runs one group commit writes, with what to
  delete (acknowledged or evicted offsets) in the same transaction;
* :meth:`committed` / :meth:`commit_failed` -- the outcome of that commit:
  records to send, or the offsets rolled back;
* :meth:`acked` / :meth:`expired` -- what a store's ACK or ``max_age`` frees.

No sockets, no clocks, no files.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dafka.core.unacked import UnackedWindow

BLOCK = "block"
DROP_OLDEST = "drop_oldest"
OUTBOX_POLICIES = (BLOCK, DROP_OLDEST)
SYNC_EACH = "each"  # publish returns once its records are committed with fsync
SYNC_BATCH = "batch"  # publish returns at once; the next group commit makes them durable
SYNC_MODES = (SYNC_EACH, SYNC_BATCH)

RECORD_OVERHEAD = 16
"""Bytes an outbox record costs beyond its content (offset key, timestamp), as counted
against ``max_bytes`` (LMDB's page overhead comes on top)."""

MAX_PENDING = 65_536
"""In batch mode, most records published but not yet committed: bounds what a
crash can lose and what publishers may run ahead of the disk."""

MAX_EVICTED_RANGES = 64  # evicted ranges remembered for receipts (oldest forgotten)


@dataclass(slots=True)
class Admission:
    """What :meth:`OutboxCore.admit` decided: go, wait, or evict up to an offset first."""

    ok: bool
    evict_upto: int = -1  # evict offsets <= this first (drop_oldest); -1: nothing
    why: str = ""  # when not ok: why there is no room


@dataclass(slots=True)
class Take:
    """One group commit's work: the pending runs and what to delete."""

    runs: list[tuple[int, list[bytes]]]  # (first offset, contents), ascending, contiguous
    floor: int  # every offset below this is deleted (acknowledged or evicted)
    next: int  # the next offset after this commit
    ts_ms: list[int]  # one timestamp per run (when it was published)


class OutboxCore:
    """Outbox bookkeeping of one producer partition.

    ``max_bytes`` bounds the bytes kept (content + :data:`RECORD_OVERHEAD` per
    record); ``max_age`` the age in seconds of the oldest kept record (None:
    no limit).  ``policy`` says what happens at a limit: ``block`` (publish
    waits, then fails) or ``drop_oldest`` (the oldest unacknowledged records
    are evicted and counted).
    """

    def __init__(
        self,
        window: UnackedWindow,
        *,
        max_bytes: int | None = None,
        max_age: float | None = None,
        policy: str = BLOCK,
        sync: str = SYNC_EACH,
        durable_upto: int | None = None,
        group_times: Sequence[tuple[int, float]] = (),
    ) -> None:
        if policy not in OUTBOX_POLICIES:
            raise ValueError(f"outbox_policy must be one of {OUTBOX_POLICIES}, not {policy!r}")
        if sync not in SYNC_MODES:
            raise ValueError(f"outbox_sync must be one of {SYNC_MODES}, not {sync!r}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("outbox_max_bytes must be positive")
        if max_age is not None and max_age <= 0:
            raise ValueError("outbox_max_age must be positive")
        self.window = window
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.policy = policy
        self.sync = sync
        # Offsets <= durable are committed; (durable, window.next) are pending.
        self.durable = window.next - 1 if durable_upto is None else durable_upto
        self._pending: list[tuple[int, list[bytes], float]] = []
        # (first offset, publish time) of each group of records, oldest first: the age.
        self._groups: deque[tuple[int, float]] = deque(group_times)
        self.floor_written = window.acked + 1  # what the disk's floor says
        self.epoch = 0  # bumped by each rollback: waiting publishers fail
        self.error: Exception | None = None  # the last commit's failure (until one succeeds)
        self.evicted = 0  # records evicted unacknowledged (drop_oldest)
        self._evicted_ranges: deque[tuple[int, int]] = deque()
        self.commits = 0

    # ------------------------------------------------------------ state

    @property
    def records(self) -> int:
        """Records kept (pending and durable, unacknowledged)."""
        return len(self.window)

    @property
    def bytes(self) -> int:
        """Bytes kept, as counted against ``max_bytes``."""
        return self.window.bytes + RECORD_OVERHEAD * len(self.window)

    @property
    def pending(self) -> int:
        """Records published but not yet committed."""
        return self.window.next - 1 - self.durable

    def oldest_age(self, now: float) -> float:
        """Seconds since the oldest kept record was published (0 when empty)."""
        self._trim_groups()
        if not len(self.window) or not self._groups:
            return 0.0
        return max(0.0, now - self._groups[0][1])

    def _trim_groups(self) -> None:
        groups, first = self._groups, self.window.acked + 1
        while len(groups) > 1 and groups[1][0] <= first:
            groups.popleft()
        if groups and not len(self.window):
            groups.clear()

    def sendable(self, seq: int, count: int) -> int:
        """How many of ``[seq, seq + count)`` may go on the wire (only durable records)."""
        return max(0, min(count, self.durable + 1 - seq))

    def evicted_at(self, offset: int) -> bool:
        """Whether ``offset`` was evicted unacknowledged (as far as remembered)."""
        return any(first <= offset <= last for first, last in self._evicted_ranges)

    # ------------------------------------------------------------ publishing

    def admit(self, n: int, nbytes: int, now: float) -> Admission:
        """Whether ``n`` records of ``nbytes`` content may be published now."""
        window = self.window
        if self.sync == SYNC_BATCH and self.pending + n > MAX_PENDING and self.pending:
            return Admission(False, why=f"{self.pending} records wait for the disk")
        need = nbytes + RECORD_OVERHEAD * n
        over_bytes = self.max_bytes is not None and self.bytes + need > self.max_bytes and len(window) > 0
        over_age = self.max_age is not None and self.oldest_age(now) > self.max_age
        too_many = len(window) + n > window.capacity and len(window) > 0
        if not (over_bytes or over_age or too_many):
            return Admission(True)
        if self.policy == BLOCK:
            if too_many:
                return Admission(False, why=f"{len(window)} records wait for an ACK (capacity {window.capacity})")
            if over_bytes:
                return Admission(
                    False, why=f"outbox holds {self.bytes} bytes (outbox_max_bytes {self.max_bytes})"
                )
            return Admission(
                False,
                why=f"the oldest outbox record is {self.oldest_age(now):.1f}s old (outbox_max_age {self.max_age:g})",
            )
        upto = self._evict_target(n, need, now)
        return Admission(True, evict_upto=upto)

    def _evict_target(self, n: int, need: int, now: float) -> int:
        """The highest offset to evict so ``n`` records of ``need`` bytes fit (durable ones only)."""
        window = self.window
        upto = window.acked
        freed = 0
        # Only durable records are evicted: pending ones are not on disk yet and
        # evicting them would reorder what the writer holds.
        limit = self.durable
        over = (self.bytes + need - self.max_bytes) if self.max_bytes is not None else 0
        count_over = len(window) + n - window.capacity
        for first, contents in window.runs(window.acked + 1, limit - window.acked):
            for i, content in enumerate(contents):
                if freed >= over and upto - window.acked >= count_over:
                    break
                freed += len(content) + RECORD_OVERHEAD
                upto = first + i
            else:
                continue
            break
        if self.max_age is not None:
            upto = max(upto, self._aged_upto(now))
        return min(upto, limit)

    def _aged_upto(self, now: float) -> int:
        """The highest durable offset published more than ``max_age`` ago (acked: none)."""
        assert self.max_age is not None
        upto = self.window.acked
        groups = list(self._groups)
        for k, (_first, at) in enumerate(groups):
            if now - at <= self.max_age:
                break
            nxt = groups[k + 1][0] if k + 1 < len(groups) else self.window.next
            upto = nxt - 1
        return min(upto, self.durable)

    def expired(self, now: float) -> int:
        """Under ``drop_oldest`` with ``max_age``: the highest offset to evict now (-1: none)."""
        if self.policy != DROP_OLDEST or self.max_age is None:
            return -1
        upto = self._aged_upto(now)
        return upto if upto > self.window.acked else -1

    def evict(self, upto: int) -> int:
        """Evict durable unacknowledged offsets ``<= upto``; how many went."""
        window = self.window
        upto = min(upto, self.durable)
        if upto <= window.acked:
            return 0
        first = window.acked + 1
        window._drop_upto(upto)  # noqa: SLF001 -- the window's own eviction (as a ring does)
        n = upto - first + 1
        self.evicted += n
        ranges = self._evicted_ranges
        if ranges and ranges[-1][1] + 1 == first:
            ranges[-1] = (ranges[-1][0], upto)
        else:
            ranges.append((first, upto))
            if len(ranges) > MAX_EVICTED_RANGES:
                ranges.popleft()
        self._trim_groups()
        return n

    def pushed(self, first: int, contents: list[bytes], now: float) -> None:
        """The window assigned ``first..`` to ``contents``: they wait for the next commit."""
        if not contents:
            return
        self._pending.append((first, contents, now))
        groups = self._groups
        if not groups or now - groups[-1][1] >= 0.001:
            groups.append((first, now))

    # ------------------------------------------------------------ committing

    def has_work(self) -> bool:
        """Whether a commit would change the disk (records to add or offsets to delete)."""
        return bool(self._pending) or self.window.acked + 1 > self.floor_written

    def take(self) -> Take:
        """The work of one group commit; the pending records leave the queue."""
        pending, self._pending = self._pending, []
        runs = [(first, contents) for first, contents, _ in pending]
        ts = [int(at * 1000) for _, _, at in pending]
        nxt = pending[-1][0] + len(pending[-1][1]) if pending else self.durable + 1
        return Take(runs, self.window.acked + 1, nxt, ts)

    def committed(self, take: Take) -> list[tuple[int, list[bytes]]]:
        """``take`` is on disk: the runs to send now (their offsets are durable)."""
        self.commits += 1
        self.error = None
        self.floor_written = max(self.floor_written, take.floor)
        if take.runs:
            self.durable = max(self.durable, take.next - 1)
        return take.runs

    def commit_failed(self, take: Take, error: Exception) -> int:
        """``take`` did not reach the disk.  Returns the offset the window rolls back to (-1: none).

        ``each``: the records were never sent and their publishers are told:
        the offsets (and any pending after them) are taken back, so the next
        publish reuses them.  ``batch``: publish already returned, so the
        records are kept and retried; publishing fails until a commit works.
        """
        self.error = error
        if not take.runs:
            return -1
        if self.sync == SYNC_BATCH:
            self._pending = [(f, c, ts / 1000) for (f, c), ts in zip(take.runs, take.ts_ms, strict=True)] + self._pending
            return -1
        back = take.runs[0][0]
        self._pending = []
        self.epoch += 1
        groups = self._groups
        while groups and groups[-1][0] >= back:
            groups.pop()
        return back

    def acked(self) -> None:
        """The window applied an ACK (the next commit deletes what it freed)."""
        self._trim_groups()
