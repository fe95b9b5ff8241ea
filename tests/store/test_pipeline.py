"""The pipelined group commit's rules (dafka.store.pipeline), without threads or LMDB."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.store.pipeline import CommitPipe, Offer, Work

P, Q = ("t", "P" * 32), ("t", "Q" * 32)


def tuples(tp: tuple[str, str], first: int, n: int) -> Work:
    return Work(batch=[(tp[0], tp[1], off, b"x", 0) for off in range(first, first + n)])


def pairs(tp: tuple[str, str], first: int, n: int) -> Work:
    return Work(pairs=[b"v"] * n, segs=[(tp[0], tp[1], 7, first, first + n - 1, n)])


def blocks(tp: tuple[str, str], first: int, n: int, size: int = 100) -> Work:
    # The pipe reads a block only for its size; its records are counted by ``held``.
    return Work(blocks=[(tp[0], tp[1], b"b" * size)], held=n)


def test_what_arrives_while_a_commit_runs_goes_into_the_next_transaction_whole() -> None:
    pipe = CommitPipe()
    first = tuples(P, 0, 3)
    assert pipe.offer(first) is Offer.STAGED
    assert pipe.take() is first  # the writer was idle: it commits at once
    # While it commits, three offers arrive: one staged work, grown twice.
    second = tuples(P, 3, 2)
    assert pipe.offer(second) is Offer.STAGED
    assert pipe.offer(tuples(Q, 0, 1)) is Offer.MERGED
    assert pipe.offer(tuples(P, 5, 1)) is Offer.MERGED
    assert pipe.take() is None  # one transaction at a time: the next waits for the commit
    pipe.finish(first, clean=True)
    got = pipe.take()  # at once, without the I/O thread
    assert got is second
    assert [(r[1][0], r[2]) for r in got.batch] == [("P", 3), ("P", 4), ("Q", 0), ("P", 5)]
    assert got.records == 4
    assert pipe.take() is None
    pipe.finish(got, clean=True)
    assert pipe.staged is None and pipe.committing is None


def test_a_merge_stops_at_the_transaction_bounds() -> None:
    pipe = CommitPipe(max_records=10, max_bytes=1000)
    pipe.take()
    staged = tuples(P, 0, 6)
    assert pipe.offer(staged) is Offer.STAGED
    assert pipe.offer(tuples(P, 6, 4)) is Offer.MERGED  # 10: at the bound
    assert pipe.offer(tuples(P, 10, 1)) is Offer.HELD  # 11 would pass it
    assert staged.records == 10
    pipe2 = CommitPipe(max_records=10**6, max_bytes=1000)
    assert pipe2.offer(blocks(P, 0, 5, size=600)) is Offer.STAGED
    assert pipe2.offer(blocks(P, 5, 5, size=600)) is Offer.HELD  # 1,200 bytes
    assert pipe2.offer(pairs(Q, 0, 3)) is Offer.MERGED  # 3 bytes of contents
    # A staged work may itself be larger than the bounds (all that was queued): it goes whole.
    pipe3 = CommitPipe(max_records=10, max_bytes=1000)
    big = tuples(P, 0, 50)
    assert pipe3.offer(big) is Offer.STAGED and pipe3.take() is big


@pytest.mark.parametrize(
    ("staged", "new", "merged"),
    [
        # The writer applies a partition's tuples, then its pairs, then its blocks.
        (blocks(P, 0, 5), tuples(P, 5, 1), False),
        (pairs(P, 0, 5), tuples(P, 5, 1), False),
        (blocks(P, 0, 5), pairs(P, 5, 1), False),
        (blocks(P, 0, 5), tuples(Q, 0, 1), True),  # another partition: no order between them
        (blocks(P, 0, 5), pairs(Q, 0, 1), True),
        (tuples(P, 0, 5), blocks(P, 5, 1), True),
        (tuples(P, 0, 5), pairs(P, 5, 1), True),  # a partition stored in this commit: pairs next
        (pairs(P, 0, 5), blocks(P, 5, 1), True),
        (blocks(P, 0, 5), blocks(P, 5, 1), True),  # a partition's blocks go in offset order
        (pairs(P, 0, 5), pairs(P, 5, 1), True),
    ],
)
def test_a_merge_never_puts_a_partitions_records_out_of_order(staged: Work, new: Work, merged: bool) -> None:
    pipe = CommitPipe()
    assert pipe.offer(staged) is Offer.STAGED
    assert pipe.offer(new) is (Offer.MERGED if merged else Offer.HELD)


def test_after_a_failed_or_refusing_commit_nothing_is_taken_until_the_io_thread_resumes() -> None:
    pipe = CommitPipe()
    failing = tuples(P, 0, 2)
    pipe.offer(failing)
    assert pipe.take() is failing
    behind = tuples(P, 2, 2)
    assert pipe.offer(behind) is Offer.STAGED
    pipe.finish(failing, clean=False)
    assert pipe.take() is None  # "behind" continues what failed: not written before it
    assert pipe.peek() is None
    assert pipe.offer(tuples(P, 4, 1)) is Offer.HELD
    assert pipe.reclaim() is behind  # the I/O thread queues it again, after the failed work
    pipe.resume()
    assert pipe.take() is None  # nothing staged until it offers again
    again = tuples(P, 0, 5)
    assert pipe.offer(again) is Offer.STAGED
    assert pipe.take() is again


def test_finishing_a_work_that_is_not_committing_is_a_bug() -> None:
    pipe = CommitPipe()
    with pytest.raises(RuntimeError):
        pipe.finish(tuples(P, 0, 1), clean=True)


# A model run: the I/O thread queues records of a few partitions in the three kinds the store
# uses, the writer takes and commits at random moments, some commits fail.  Checked: every
# record is committed exactly once, each partition's in offset order in the writer's apply
# order.

KINDS = ("tuples", "pairs", "blocks")
step = st.one_of(
    st.tuples(st.just("queue"), st.sampled_from([P, Q]), st.sampled_from(KINDS), st.integers(1, 5)),
    st.tuples(st.just("offer")),
    st.tuples(st.just("take")),
    st.tuples(st.just("finish"), st.booleans()),
)


def as_tuples(records: list[tuple[tuple[str, str], int]]) -> Work:
    return Work(batch=[(tp[0], tp[1], off, b"x", 0) for tp, off in records])


def then(a: Work, b: Work) -> Work:
    """``a`` then ``b`` in one work, in the writer's order: where ``b`` has records of a
    partition that ``a`` has in a kind applied later, everything goes as tuples (what the
    gateways' untangling does with such records)."""
    from dafka.store.pipeline import out_of_order

    if out_of_order(a, b):
        return as_tuples(applied(a) + applied(b))
    a.merge(b)
    return a


def applied(work: Work) -> list[tuple[tuple[str, str], int]]:
    """The records of a work in the order the writer applies them: per partition, tuples,
    then pairs, then blocks (offset order); partitions independent."""
    out: list[tuple[tuple[str, str], int]] = []
    for tp in (P, Q):
        out += [(tp, r[2]) for r in work.batch if (r[0], r[1]) == tp]
        for s in work.segs:
            if (s[0], s[1]) == tp:
                out += [(tp, off) for off in range(s[3], s[4] + 1)]
        firsts = sorted(int(b[2].split(b":")[1]) for b in work.blocks if (b[0], b[1]) == tp)
        for first in firsts:
            n = next(int(b[2].split(b":")[2]) for b in work.blocks if int(b[2].split(b":")[1]) == first
                     and (b[0], b[1]) == tp)
            out += [(tp, off) for off in range(first, first + n)]
    return out


@settings(max_examples=300)
@given(st.lists(step, max_size=60))
def test_model_every_record_once_in_order(steps: list[Any]) -> None:
    pipe = CommitPipe(max_records=12, max_bytes=10**6)
    nxt = {P: 0, Q: 0}
    queued = Work()
    committed: list[tuple[tuple[str, str], int]] = []
    arrived: dict[tuple[tuple[str, str], int], int] = {}  # record -> step index it was queued at

    def requeue(work: Work) -> None:
        nonlocal queued
        queued = then(work, queued)  # (the store puts it before what was queued since)

    for i, s in enumerate(steps):
        if s[0] == "queue":
            _, tp, kind, n = s
            first = nxt[tp]
            nxt[tp] += n
            for off in range(first, first + n):
                arrived[(tp, off)] = i
            if kind == "tuples":
                w = tuples(tp, first, n)
            elif kind == "pairs":
                w = pairs(tp, first, n)
            else:
                w = Work(blocks=[(tp[0], tp[1], b"B:%d:%d" % (first, n))], held=n)
            queued = then(queued, w)
        elif s[0] == "offer" and queued:
            if pipe.offer(queued) is not Offer.HELD:
                queued = Work()
        elif s[0] == "take":
            pipe.take()
        elif s[0] == "finish" and pipe.committing is not None:
            work = pipe.committing
            ok = s[1]
            pipe.finish(work, clean=ok)
            if ok:
                committed += applied(work)
            else:
                # The I/O thread: the failed work first, then the staged one, then the rest.
                staged = pipe.reclaim()
                if staged is not None:
                    requeue(staged)
                requeue(work)
                pipe.resume()
    # Drain: everything left commits.
    if pipe.committing is not None:
        work = pipe.committing
        pipe.finish(work, clean=True)
        committed += applied(work)
    for _ in range(100):
        if queued:
            if pipe.offer(queued) is not Offer.HELD:
                queued = Work()
        work = pipe.take()
        if work is None:
            if pipe.committing is None and pipe.staged is None and not queued:
                break
            continue
        pipe.finish(work, clean=True)
        committed += applied(work)
    assert not queued and pipe.staged is None and pipe.committing is None
    assert sorted(committed) == sorted(arrived)  # each once
    for tp in (P, Q):
        offs = [off for t, off in committed if t == tp]
        assert offs == sorted(offs)  # in order


# When the writer takes the staged work: at once for a stream, after a bounded linger for the
# refills of clients that wait for answers (a window of produces in flight).



def test_a_stream_goes_at_once() -> None:
    pipe = CommitPipe(max_linger=1.0, linger=1.0)
    first = tuples(P, 0, 8)
    pipe.offer(first, 0.0)
    assert pipe.take() is first
    for i, t in enumerate((0.002, 0.004, 0.006, 0.0079)):  # records all through the commit
        pipe.offer(tuples(P, 8 + i, 1), t)
    pipe.finish(first, clean=True, now=0.008, began=0.0)
    assert pipe.due(0.008) == 0.0
    assert pipe.lingers == 0


def test_a_windowed_client_gets_its_whole_window_into_one_commit() -> None:
    """8 requests in flight: the commit held 4, the other 4 came at its start; taking them at
    once would split the window for good (4 and 4, each paying a whole commit)."""
    pipe = CommitPipe(max_linger=1.0, linger=1.0)
    first = tuples(P, 0, 4)
    pipe.offer(first, 0.0)
    assert pipe.take() is first
    pipe.offer(tuples(P, 4, 4), 0.0005)  # the rest of the window, early in the commit
    pipe.finish(first, clean=True, now=0.008, began=0.0)
    assert pipe.lingers == 1
    assert pipe.due(0.008) == pytest.approx(0.008)  # until the answers went out, at most the linger
    pipe.offer(tuples(P, 8, 1), 0.0082)  # queued before the answers: no refill
    pipe.report(0.0085)
    assert 0 < (pipe.due(0.0085) or 0)
    pipe.offer(tuples(P, 9, 2), 0.009)  # the answered client sends again ...
    assert 0 < (pipe.due(0.009) or 0) <= pipe.quiet
    pipe.offer(tuples(P, 11, 2), 0.0092)  # ... as much as was answered (4): take
    assert pipe.due(0.0092) == 0.0
    work = pipe.take()
    assert work is not None and work.records == 9


def test_a_linger_ends_after_a_quiet_spell_or_its_bound() -> None:
    pipe = CommitPipe(max_linger=0.004, linger=0.5)
    first = tuples(P, 0, 10)
    pipe.offer(first, 0.0)
    pipe.take()
    pipe.finish(first, clean=True, now=0.010, began=0.0)  # nothing staged, nothing streaming
    assert pipe.due(0.010) is None  # nothing to take
    pipe.report(0.0101)
    pipe.offer(tuples(P, 10, 2), 0.0102)  # a refill smaller than the commit
    assert pipe.due(0.0102) == pytest.approx(pipe.quiet)
    assert pipe.due(0.0102 + pipe.quiet) == 0.0  # nothing more came: go
    # The bound: min(max_linger, share of the commit) after the commit returned.
    pipe2 = CommitPipe(max_linger=0.004, linger=0.5)
    first = tuples(P, 0, 10)
    pipe2.offer(first, 0.0)
    pipe2.take()
    pipe2.finish(first, clean=True, now=0.010, began=0.0)
    pipe2.offer(tuples(P, 10, 1), 0.0101)  # before the report: waits for it ...
    assert pipe2.due(0.0101) == pytest.approx(0.0039)
    assert pipe2.due(0.014) == 0.0  # ... at most 4 ms (half the commit would be 5)
    # A short commit lingers at most half its duration.
    pipe3 = CommitPipe(max_linger=0.004, linger=0.5)
    first = tuples(P, 0, 10)
    pipe3.offer(first, 0.0)
    pipe3.take()
    pipe3.finish(first, clean=True, now=0.001, began=0.0)
    pipe3.offer(tuples(P, 10, 1), 0.0011)
    assert pipe3.due(0.0015) == 0.0


def _cycle(pipe: CommitPipe, first: int, t: float, took: float, refill: float, n: int = 4) -> tuple[int, float]:
    """A windowed client's round with ``pipe``: a commit of its ``n`` records takes ``took``,
    the answer goes at once, and its ``n`` records come again ``refill`` after the commit
    returned.  Returns the next offset and the time the refill came."""
    work = pipe.take()
    assert work is not None
    end = t + took
    pipe.finish(work, clean=True, now=end, began=t)
    pipe.report(end)
    pipe.offer(tuples(P, first, n), end + refill)
    return first + n, end + refill


@pytest.mark.parametrize(("refill", "lingers"), [(0.003, False), (0.0003, True)],
                         ids=["many-bundles-in-flight", "a-few-requests-in-flight"])
def test_the_writer_lingers_only_while_refills_come_sooner_than_a_commit_takes(refill: float, lingers: bool) -> None:
    """Lingering idles the disk until the refill comes; taking at once costs one more commit's
    fixed part.  Refills slower than the shortest recent commit (1 ms here): take at once."""
    pipe = CommitPipe(max_linger=1.0, linger=1.0, quiet=0.0001)
    pipe.offer(tuples(P, 0, 4), 0.0)
    off, t = 4, 0.0
    for _ in range(4):
        off, t = _cycle(pipe, off, t, 0.001, refill)
    before = pipe.lingers
    work = pipe.take()
    assert work is not None
    pipe.offer(tuples(P, off, 2), t + 0.0001)  # part of the refill, at the commit's start
    pipe.finish(work, clean=True, now=t + 0.001, began=t)
    assert ((pipe.due(t + 0.001) or 0) > 0) is lingers  # lingers for the rest of the refill, or takes at once
    assert pipe.lingers == before + lingers


def test_a_refill_that_never_comes_whole_counts_as_slow() -> None:
    """Answered senders that send less than they were answered (a client going quiet): its
    refill is timed as at least until the next commit returned, not as never."""
    pipe = CommitPipe(max_linger=1.0, linger=1.0, quiet=0.0001)
    pipe.offer(tuples(P, 0, 2), 0.0)
    off, t = 2, 0.0
    for _ in range(4):  # commits of 2 records, 1 ms; one record queued before each answer, one after
        work = pipe.take()
        assert work is not None and work.records == 2
        pipe.finish(work, clean=True, now=t + 0.001, began=t)
        pipe.offer(tuples(P, off, 1), t + 0.001)
        pipe.report(t + 0.001)
        pipe.offer(tuples(P, off + 1, 1), t + 0.0011)
        off, t = off + 2, t + 0.0011
    assert pipe.lingers == 1  # only after the first commit, before any refill was timed


def test_nothing_is_due_while_halted() -> None:
    pipe = CommitPipe()
    first = tuples(P, 0, 1)
    pipe.offer(first, 0.0)
    pipe.take()
    pipe.offer(tuples(P, 1, 1), 0.001)
    pipe.finish(first, clean=False, now=0.002, began=0.0)
    assert pipe.due(1.0) is None


def _probe_lingers(pipe: CommitPipe, off: int, t: float) -> bool:
    """A commit of 1 ms with part of a refill at its start (not a stream): does the writer
    linger after it?"""
    work = pipe.take()
    assert work is not None
    pipe.offer(tuples(P, off, 2), t + 0.0001)
    pipe.finish(work, clean=True, now=t + 0.001, began=t)
    return (pipe.due(t + 0.001) or 0) > 0


def test_refills_are_timed_from_the_commit_they_answer() -> None:
    """Two commits of a window in flight (its halves), answered together (the I/O thread was
    busy while the second ran): each half comes again after its own commit returned, 1.8 ms
    and 1.1 ms later, slower than any commit (1 ms): taking at once pays.  The first half's
    refill was timed from the second commit's return (one report marked both answered): 0.8
    ms, a bet won that never was, and the writer lingered."""
    pipe = CommitPipe(max_linger=1.0, linger=1.0, quiet=0.0001)
    pipe.offer(tuples(P, 0, 4), 0.0)
    off, t = 4, 0.0
    for _ in range(12):
        a = pipe.take()
        assert a is not None and a.records == 4
        pipe.offer(tuples(P, off, 4), t + 0.0003)  # the other half (the last one's refill)
        pipe.finish(a, clean=True, now=t + 0.001, began=t)
        b = pipe.take()
        assert b is not None and b.records == 4
        pipe.finish(b, clean=True, now=t + 0.002, began=t + 0.001)
        pipe.report(t + 0.002)  # a's answer ...
        pipe.report(t + 0.002)  # ... and b's, in one turn
        pipe.offer(tuples(P, off + 4, 4), t + 0.0028)  # a's records again, 1.8 ms after it returned
        off, t = off + 8, t + 0.0028
    assert not _probe_lingers(pipe, off, t)


def test_what_a_failed_commit_gives_back_is_no_refill() -> None:
    """After a refused commit the I/O thread takes back the staged work and offers it again at
    once: records that came before the commit returned, no answered sender's refill.  Timed
    as a refill of 0.05 ms, refusals (a client producing to a refused partition) made the
    writer bet on refills that are 3 ms slow."""
    pipe = CommitPipe(max_linger=1.0, linger=1.0, quiet=0.0001)
    pipe.offer(tuples(P, 0, 4), 0.0)
    off, t = 4, 0.0
    for _ in range(4):  # commits of 1 ms, refills of 3 ms
        off, t = _cycle(pipe, off, t, 0.001, 0.003)
    for _ in range(10):  # refused commits, the staged work behind each taken back and offered again
        work = pipe.take()
        assert work is not None
        pipe.offer(tuples(Q, off, 4), t + 0.0002)
        pipe.finish(work, clean=False, now=t + 0.001, began=t)
        staged = pipe.reclaim()
        assert staged is not None
        pipe.resume()
        pipe.report(t + 0.001)
        assert pipe.offer(staged, t + 0.00105) is Offer.STAGED
        off, t = off + 4, t + 0.00105
    assert not _probe_lingers(pipe, off, t)


timed_step = st.one_of(
    st.tuples(st.just("offer"), st.integers(0, 6), st.floats(0, 0.004)),
    st.tuples(st.just("take"), st.floats(0, 0.004)),
    st.tuples(st.just("finish"), st.booleans(), st.floats(0, 0.004)),
    st.tuples(st.just("report"), st.floats(0, 0.004)),
)


@settings(max_examples=300)
@given(st.lists(timed_step, max_size=80))
def test_model_the_linger_is_bounded_whatever_the_timing(steps: list[Any]) -> None:
    """Offers, commits and answers at random moments (answers in commit order, one a commit,
    as the store gives them): the writer never waits past the linger's bound, what is staged
    is taken once that has passed, and the pipe keeps no more than a few commits' timings."""
    pipe = CommitPipe(max_records=20, max_bytes=10**6)
    now = 0.0
    off = 0
    unanswered = 0
    queued: Work | None = None
    for s in steps:
        now += s[-1]
        if s[0] == "offer" and s[1]:
            w = tuples(P, off, s[1]) if queued is None else queued
            if queued is None:
                off += s[1]
            queued = w if pipe.offer(w, now) is Offer.HELD else None
        elif s[0] == "take" and (pipe.due(now) or 0) <= 0:
            pipe.take()
        elif s[0] == "finish" and pipe.committing is not None:
            began = now - s[-1]
            pipe.finish(pipe.committing, clean=s[1], now=now, began=began)
            unanswered += 1
            if not s[1]:
                staged = pipe.reclaim()
                if staged is not None:
                    queued = staged if queued is None else then(staged, queued)
                pipe.resume()
        elif s[0] == "report" and unanswered:
            unanswered -= 1
            pipe.report(now)
        due = pipe.due(now)
        if pipe.peek() is None:
            assert due is None
        else:
            assert due is not None and 0 <= due <= pipe.max_linger
            assert pipe.due(now + pipe.max_linger) == 0.0
        assert len(pipe._open) <= 16 + 1
        assert pipe._answered <= pipe._commits


def test_the_writer_lingers_not_for_records_that_cannot_join_the_staged_work() -> None:
    """A staged work at its bounds: the refill that comes is held back by the I/O thread (no
    merge may pass them) and cannot join it.  The writer lingered all the same, for the whole
    linger (the held offers set no refill time), the disk idle with a full transaction ready."""
    pipe = CommitPipe(max_records=10, max_linger=1.0, linger=1.0, quiet=0.0001)
    first = tuples(P, 0, 4)
    pipe.offer(first, 0.0)
    assert pipe.take() is first
    assert pipe.offer(tuples(P, 4, 8), 0.0005) is Offer.STAGED  # early in the commit: a window
    pipe.finish(first, clean=True, now=0.008, began=0.0)
    pipe.report(0.0081)
    assert pipe.offer(tuples(P, 12, 4), 0.0082) is Offer.HELD  # the refill: over the bounds
    assert pipe.due(0.0082) == 0.0
