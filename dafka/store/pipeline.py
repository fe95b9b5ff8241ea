"""The store's pipelined group commit: what goes into which write transaction (sans-IO).

A store has two threads: the I/O thread receives records (the mesh, a gateway's clients) and
queues them; the writer thread puts them in LMDB, one write transaction at a time (LMDB allows
only one), and commits (an fsync by default).  Only after that commit returns are the records
answered (ACK, a Tank or Kafka produce answer).

Without a pipeline the writer hands its result to the I/O thread, which answers, then hands
over what it queued meanwhile: the writer waits idle for that round trip (a wake-up of the I/O
thread, its turn at the GIL, the answers), a third of the time on a quiet machine and most of it
under load.  With it, the I/O thread **stages** the next :class:`Work` while a commit runs and
keeps adding what it receives to that staged work (it **merges**), and the writer **takes** the
staged work the moment its commit returns: everything that arrived during a sync goes into the
next transaction, whatever the I/O thread is doing then.

:class:`CommitPipe` holds the rules; the store calls it under one lock and does the I/O:

* at most one work commits and at most one is staged;
* a work is merged into the staged one only while the merged work stays within
  ``max_records`` and ``max_bytes`` (a transaction's bounds; the staged work itself may be
  larger, when that much was queued while nothing could take it) and only when the merge keeps
  every partition's records in offset order in the transaction (the writer applies a
  partition's record tuples, then its ready pairs, then its blocks: staged pairs or blocks of a
  partition with new tuples of it, or staged blocks with new pairs, would go out of order);
  otherwise the new records are **held** by the I/O thread for the transaction after;
* after a commit that failed or refused a partition the pipe **halts**: the writer takes
  nothing more until the I/O thread has seen that result (it takes back the staged work, keeps
  everything in order, and resumes), so nothing queued behind a failure is written before it.

A work is answered (its produces, its ACKs) when the I/O thread handles its commit's result,
in commit order; nothing of a work is answered before the commit that holds it returned.

**When the writer takes the staged work** (:meth:`CommitPipe.due`).  Records that kept coming
while the commit ran (the staged work grew in its second half, or within ``quiet`` before it
returned: a stream that fills the pipe by itself, the mesh store's) go at once.  Otherwise the senders are waiting for answers
(a client with a window of produces in flight: a Tank client's 8 bundles, a Kafka producer's
requests): taking at once would split that window between two transactions, each paying a
whole commit's flushes, while the client's next requests are one round trip behind the
answers.  So the writer **lingers**: until the I/O thread has answered the commit (``report``),
then until as many records as that commit held have come since (each answered request is
sent again), or records have come and then none for ``quiet``, at most ``linger`` of the last
commit's duration and :data:`MAX_LINGER`.  A linger costs at most that
much latency; the simulator takes with :meth:`CommitPipe.take` directly.  An offer held
back (the staged work at its bounds, or out of order) ends the linger: what is held cannot
join the staged work until it is taken.

**The linger is a bet, and the pipe keeps its odds.**  Lingering leaves the disk idle until
the refill has come; taking at once splits the refill over one more commit, which costs one
more commit's fixed part (its syncs, whatever it writes).  So the writer lingers only while
the refills it has seen (from a commit's return until as many records as it held had come
again, the median of the last :data:`RECENT`) came sooner than the shortest of the last
:data:`RECENT` commits took (an upper bound of that fixed part).  A client with a few requests
in flight refills faster than a sync and gets its window into one commit; one with many (32 Tank
bundles of 100 KB: 1.5 ms to refill) has the staged work taken at once, as lingering for it
left the disk idle for a fifth of its fsync'd publish.  Before any refill was seen the writer
lingers.  Answers are counted one a commit, in commit order (two commits may be answered in
one turn of the I/O thread): the records offered after them refill the oldest answered commit
first, each refill timed from its own commit's return; nothing is timed across a failed or
refusing commit (the I/O thread then offers again what it took back, no refill).
"""

from __future__ import annotations

import enum
from collections import deque
from statistics import median
from typing import Any

__all__ = ["MAX_LINGER", "MAX_TXN_BYTES", "MAX_TXN_RECORDS", "QUIET", "RECENT", "CommitPipe", "Offer", "Work"]

#: Records one merge may grow a staged transaction to (see :class:`CommitPipe`).
MAX_TXN_RECORDS = 200_000
#: Bytes of ready values and blocks one merge may grow a staged transaction to.
MAX_TXN_BYTES = 32 << 20
#: Seconds at most the writer lingers for a client's refills after a commit (see the module doc).
MAX_LINGER = 0.005
#: ... and at most this share of the last commit's duration.
LINGER_SHARE = 0.5
#: Seconds without new records that end a burst (the staged work is complete).
QUIET = 0.002
#: Commits and refills the linger's bet looks back on (see the module doc).
RECENT = 16

Fill = tuple[str, str, int, bytes | None, int]
Block = tuple[str, str, bytes | memoryview]  # a block: its bytes, or a view of the buffer it came in (Tank)
Seg = tuple[str, str, int, int, int, int]


class Work:
    """What one write transaction commits, in the order the writer applies it: record tuples
    (``batch``), ready pairs and their runs (``pairs``, ``segs``), ready-made blocks
    (``blocks``, ``held`` records in them), offsets given up (``skips``) and records for
    recorded holes (``fills``, written first, in a transaction of their own).

    ``records`` and ``nbytes`` (of the pairs' runs and the blocks) bound merges; ``marks`` is
    for the store's subclasses (e.g. how many of a gateway's records to publish once it
    commits)."""

    __slots__ = ("batch", "pairs", "segs", "skips", "fills", "blocks", "held", "records", "nbytes", "marks")

    def __init__(
        self,
        batch: list[Any] | None = None,
        pairs: list[Any] | None = None,
        segs: list[Seg] | None = None,
        skips: list[tuple[str, str, int, int]] | None = None,
        fills: list[Fill] | None = None,
        blocks: list[Block] | None = None,
        held: int = 0,
    ) -> None:
        self.batch: list[Any] = batch if batch is not None else []
        self.pairs: list[Any] = pairs if pairs is not None else []
        self.segs: list[Seg] = segs if segs is not None else []
        self.skips: list[tuple[str, str, int, int]] = skips if skips is not None else []
        self.fills: list[Fill] = fills if fills is not None else []
        self.blocks: list[Block] = blocks if blocks is not None else []
        self.held = held
        self.records = len(self.batch) + len(self.pairs) + len(self.fills) + held
        self.nbytes = sum(s[5] for s in self.segs) + sum(len(b[2]) for b in self.blocks)
        self.marks: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.batch or self.pairs or self.fills or self.blocks or self.skips)

    def __repr__(self) -> str:
        return (f"Work({len(self.batch)} tuples, {len(self.pairs)} pairs, {len(self.blocks)} blocks,"
                f" {len(self.fills)} fills, {len(self.skips)} skips)")

    def merge(self, other: Work) -> None:
        """Append ``other`` (queued after this work) to it."""
        self.batch.extend(other.batch)
        self.pairs.extend(other.pairs)
        self.segs.extend(other.segs)
        self.skips.extend(other.skips)
        self.fills.extend(other.fills)
        self.blocks.extend(other.blocks)
        self.held += other.held
        self.records += other.records
        self.nbytes += other.nbytes


def out_of_order(staged: Work, new: Work) -> bool:
    """Whether merging ``new`` into ``staged`` would put a partition's records out of order
    (the writer applies a partition's tuples, then its pairs, then its blocks)."""
    if new.batch and (staged.segs or staged.blocks):
        later = {(s[0], s[1]) for s in staged.segs}
        later.update((b[0], b[1]) for b in staged.blocks)
        if any((r[0], r[1]) in later for r in new.batch):
            return True
    if new.segs and staged.blocks:
        blocked = {(b[0], b[1]) for b in staged.blocks}
        if any((s[0], s[1]) in blocked for s in new.segs):
            return True
    return False


class Offer(enum.Enum):
    """What :meth:`CommitPipe.offer` did with the I/O thread's queued records."""

    STAGED = "staged"  # a new staged work: the writer takes it when it is free
    MERGED = "merged"  # appended to the staged work
    HELD = "held"  # not taken: the I/O thread keeps them for a later transaction


class CommitPipe:
    """The hand-off between a store's I/O thread and its writer (see the module doc).

    Not thread-safe by itself: the store calls every method under its writer lock."""

    __slots__ = ("committing", "staged", "halted", "max_records", "max_bytes", "merges", "holds",
                 "linger", "max_linger", "quiet", "lingers", "_arrived", "_until", "_streaming", "_reported", "_refilled",
                 "_target", "_durations", "_refills", "_open", "_commits", "_answered", "_full")

    def __init__(
        self,
        max_records: int = MAX_TXN_RECORDS,
        max_bytes: int = MAX_TXN_BYTES,
        linger: float = LINGER_SHARE,
        quiet: float = QUIET,
        max_linger: float = MAX_LINGER,
    ) -> None:
        self.committing: Work | None = None  # taken by the writer, its commit not finished
        self.staged: Work | None = None  # the next transaction, still growing
        self.halted = False  # a commit failed or refused: nothing is taken until resume()
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.linger = linger  # share of the last commit's duration (0: never linger)
        self.max_linger = max_linger  # seconds
        self.quiet = quiet
        self.merges = 0  # offers merged into a staged work
        self.holds = 0  # offers held back (bounds, order, halted)
        self.lingers = 0  # commits after which the writer lingered for refills
        self._arrived = float("-inf")  # when records last went into the staged work
        self._until = float("-inf")  # the writer lingers until then at most
        self._streaming = True  # records kept coming until the last commit returned
        self._reported = True  # the I/O thread has answered the last commit
        self._refilled: float | None = None  # when records last came after that answer
        self._target = 0  # records staged once the answered senders sent as much again
        self._durations: deque[float] = deque(maxlen=RECENT)  # of the last commits, seconds
        self._refills: deque[float] = deque(maxlen=RECENT)  # seconds from a commit's return to its refill
        # The commits whose refills are still to be timed, oldest first: [its number, when it
        # returned, records it held, records offered since its answer].  A refill is that
        # commit's records offered again after its answer: the records offered after answers
        # go to the oldest answered commit first (two commits answered in one turn of the I/O
        # thread are refilled in order, each timed from its own return).
        self._open: deque[list[Any]] = deque()
        self._commits = 0  # commits finished ...
        self._answered = 0  # ... and of them answered (report), in commit order
        self._full = False  # an offer was held back: the staged work can take no more of it

    def offer(self, work: Work, now: float = 0.0) -> Offer:
        """The I/O thread's queued records (the writer has them only unless HELD)."""
        if self.halted:
            self.holds += 1
            return Offer.HELD
        staged = self.staged
        if staged is None:
            self.staged = work
        elif (
            staged.records + work.records > self.max_records
            or staged.nbytes + work.nbytes > self.max_bytes
            or out_of_order(staged, work)
        ):
            self.holds += 1
            self._full = True  # (no linger waits for records that cannot join)
            return Offer.HELD
        else:
            staged.merge(work)
            self.merges += 1
        self._arrived = now
        if self._reported:
            self._refilled = now
        opened = self._open
        if opened and opened[0][0] <= self._answered:
            n = work.records
            while True:
                c = opened[0]
                c[3] += n
                if c[3] < c[2]:
                    break
                self._refills.append(now - c[1])
                n = c[3] - c[2]  # the next answered commit's
                opened.popleft()
                if not opened or opened[0][0] > self._answered:
                    break
        return Offer.STAGED if staged is None else Offer.MERGED

    def report(self, now: float = 0.0) -> None:
        """The I/O thread has answered the last commit (its senders may now send again)."""
        del now  # (for symmetry: what comes after is timed by offer())
        # Answers come in commit order, one per commit: the last one's when all are answered.
        # (One flag set by any report took the answer of the commit before the last for the
        # last one's, when the writer had finished two before the I/O thread answered.)
        if self._answered < self._commits:
            self._answered += 1
        self._reported = self._answered == self._commits

    def due(self, now: float) -> float | None:
        """Seconds the writer waits before taking the staged work (0: take it now; None:
        nothing to take).  See the module doc."""
        if self.peek() is None:
            return None
        if (self._streaming or now >= self._until or self._full
                or self.staged is not None and self.staged.records >= self._target):
            return 0.0
        if not self._reported or self._refilled is None:
            return self._until - now  # (woken by the report and by offers)
        wait = self._refilled + self.quiet - now
        return 0.0 if wait <= 0 else min(wait, self._until - now)

    def peek(self) -> Work | None:
        """The work the writer would take now (None: nothing, or it must wait)."""
        if self.halted or self.committing is not None:
            return None
        return self.staged

    def take(self) -> Work | None:
        """The writer: the staged work becomes the one committing (None: nothing to take)."""
        work = self.peek()
        if work is not None:
            self.committing, self.staged = work, None
            self._full = False
        return work

    def finish(self, work: Work, clean: bool, now: float = 0.0, began: float = 0.0) -> None:
        """The writer: ``work``'s commit (begun at ``began``) returned at ``now``; not
        ``clean`` (it failed, or refused a partition): halt until the I/O thread has seen the
        result."""
        if work is not self.committing:
            raise RuntimeError("finish() of a work that is not the one committing")
        self.committing = None
        if not clean:
            self.halted = True
        # Records still coming in the second half of the commit (or at its end): the senders
        # do not wait for answers.  (Those of a window come right after the last answers, at
        # its start; a stream's may pause at its end, while the writer holds the GIL.)
        arrived = self._arrived
        self._streaming = self.staged is not None and (now - arrived < self.quiet or arrived >= (began + now) / 2)
        took = max(0.0, now - began)
        self._durations.append(took)
        opened = self._open
        while opened and opened[0][0] <= self._answered:  # answered, refill never came whole: at least this long
            self._refills.append(now - opened.popleft()[1])
        self._until = now
        if not self._refills or median(self._refills) < min(self._durations):
            self._until += min(self.max_linger, self.linger * took)
        self._commits += 1
        if not clean:
            # What the I/O thread offers after a failure is the failed work and the staged
            # work it took back (records that came before this commit returned), not the
            # answered senders' refills: nothing is timed across it.
            opened.clear()
        elif work.records:
            opened.append([self._commits, now, work.records, 0])
            if len(opened) > RECENT:  # (commits never answered: a store's simulator, a test)
                opened.popleft()
        self._reported = False
        self._refilled = None
        # Senders with a window send again as much as they were answered.
        self._target = (self.staged.records if self.staged is not None else 0) + work.records
        if not self._streaming and self._until > now:
            self.lingers += 1

    def reclaim(self) -> Work | None:
        """The I/O thread takes back the staged work (after a failure: it goes again, after the
        failed one, when the store writes again)."""
        work, self.staged = self.staged, None
        self._full = False
        return work

    def resume(self) -> None:
        """The I/O thread has handled a failed or refusing commit: the writer may go on."""
        self.halted = False
