"""The protocol state machines, driven deterministically (no sockets, no clocks)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.core.gaps import FETCH_CHUNK, UNREMEMBERED, KnownStores, PartitionTracker
from dafka.core.peers import Connect, Disconnect, PeerTable, TowerWatch
from dafka.core.resume import START_ANYWAY, Resume
from dafka.core.unacked import UnackedWindow


def deliver(t: PartitionTracker, seq: int) -> list[int]:
    out: list[tuple[int, bytes]] = []
    t.on_record(seq, b"%d" % seq, out)
    return [s for s, _ in out]


# ---------------------------------------------------------------- tracker


def test_latest_starts_at_first_record() -> None:
    t = PartitionTracker("s", "p", None)
    assert deliver(t, 42) == [42]
    assert deliver(t, 43) == [43]
    assert t.fetch_request(0.0) is None


def test_latest_head_skips_history() -> None:
    t = PartitionTracker("s", "p", None)
    assert t.on_head(10) is False
    assert t.next == 11
    assert deliver(t, 11) == [11]


def test_earliest_record_one_fetches_zero_then_delivers_both() -> None:
    t = PartitionTracker("s", "p", 0)
    assert deliver(t, 1) == []
    assert t.fetch_request(0.0) == (0, 1)
    assert deliver(t, 0) == [0, 1]
    assert not t.missing


def test_gap_in_middle_is_held_and_filled() -> None:
    t = PartitionTracker("s", "p", 0)
    assert deliver(t, 0) == [0]
    assert deliver(t, 3) == []
    assert deliver(t, 4) == []
    assert t.fetch_request(0.0) == (1, 2)  # only the hole before the held records
    assert deliver(t, 1) == [1]
    assert deliver(t, 2) == [2, 3, 4]
    assert deliver(t, 3) == []  # duplicate


def test_fetch_is_not_repeated_while_progressing_but_retried_when_stalled() -> None:
    t = PartitionTracker("s", "p", 0, retry_interval=0.5)
    t.on_head(99)
    assert t.fetch_request(0.0) == (0, 100)
    assert t.fetch_request(0.1) is None
    deliver(t, 0)
    assert t.fetch_request(0.2) is None  # progress: no new FETCH
    assert t.fetch_request(0.6) is None  # progress was at 0.2
    assert t.fetch_request(0.71) == (1, 99)  # stalled for 0.5 s: retry
    assert t.fetches == 2


def test_fetch_count_is_capped() -> None:
    t = PartitionTracker("s", "p", 0)
    t.on_head(10 * FETCH_CHUNK)
    assert t.fetch_request(0.0) == (0, FETCH_CHUNK)


def test_held_window_is_bounded() -> None:
    t = PartitionTracker("s", "p", 0, max_held=3)
    for seq in range(5, 20):
        deliver(t, seq)
    assert len(t.held) == 3
    assert sorted(t.held) == [5, 6, 7]  # the records closest to next are kept


def test_skip_forward_when_hole_cannot_be_filled() -> None:
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=2.0)
    deliver(t, 5)
    deliver(t, 6)
    assert t.fetch_request(0.0) == (0, 5)
    out: list[tuple[int, bytes]] = []
    assert t.skip_if_stalled(1.0, out) is None
    # Stalled for 2 s, but the last FETCH is 2.5 s old: a last call first.
    assert t.skip_if_stalled(2.5, out) is None
    assert t.fetch_request(2.5) == (0, 5)
    assert t.skip_if_stalled(2.9, out) is None  # the answer may still come
    assert t.skip_if_stalled(3.0, out) == (0, 4)
    assert [s for s, _ in out] == [5, 6]
    assert t.skipped == 5 and t.next == 7


def test_a_reader_late_at_every_check_makes_one_last_call_then_gives_the_hole_up() -> None:
    # The last call is fixed to the deadline: a reader whose every check comes
    # seconds late (a starved thread) asks once more, then gives up; it does
    # not ask again at every check for ever (a last call that is always "too
    # old" when it is looked at).
    t = PartitionTracker("s", "p", 0, retry_interval=0.05, skip_after=1.0)
    deliver(t, 5)
    assert t.fetch_request(0.0) == (0, 5)
    out: list[tuple[int, bytes]] = []
    skipped, now, calls = None, 0.0, 0
    while skipped is None and now < 30.0:  # bounded
        now += 1.5
        skipped = t.skip_if_stalled(now, out)
        if skipped is None and t.fetch_request(now) is not None:
            calls += 1
    assert skipped == (0, 4) and now == 3.0 and calls == 1
    assert [s for s, _ in out] == [5]


def test_a_hole_is_not_given_up_while_its_producer_cannot_hear_the_fetches() -> None:
    # A store ACKs past a hole it gave up, which releases the producer's copy:
    # while the producer is alive but not subscribed to its FETCHes here, the
    # time to give up does not run.
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=2.0)
    deliver(t, 5)
    assert t.fetch_request(0.0) == (0, 5)
    out: list[tuple[int, bytes]] = []
    for now in (1.0, 2.0, 3.0, 4.0):
        t.unheard(now)
        assert t.skip_if_stalled(now, out) is None
        t.fetch_request(now)  # retries still go out (another store may have it)
    assert t.fetches > 1
    assert t.skip_if_stalled(5.5, out) is None  # heard for 1.5 s only
    assert t.skip_if_stalled(6.5, out) is None  # 2.5 s of FETCHes it could hear: a last call
    assert t.fetch_request(6.5) == (0, 5)
    assert t.skip_if_stalled(7.0, out) == (0, 4)
    assert [s for s, _ in out] == [5]


def test_a_record_too_large_at_next_is_skipped_at_once() -> None:
    t = PartitionTracker("s", "p", 0)
    assert deliver(t, 0) == [0]
    assert deliver(t, 2) == [] and deliver(t, 3) == []  # 1 missing, 2 and 3 held
    out: list[tuple[int, bytes]] = []
    assert t.drop_too_large(1, out) is True
    assert [s for s, _ in out] == [2, 3] and t.next == 4 and not t.missing
    out.clear()
    assert t.drop_too_large(1, out) is False and out == [] and t.next == 4  # a duplicate
    assert t.skipped == 0  # counted by the reader as too large, not as "nobody had them"


def test_a_record_too_large_ahead_of_next_waits_for_its_fetch() -> None:
    t = PartitionTracker("s", "p", 0)
    out: list[tuple[int, bytes]] = []
    assert t.drop_too_large(3, out) is False and out == []
    assert t.missing and t.fetch_request(0.0) == (0, 4)  # 0..3: the answer brings 3 again at next
    for seq in range(3):
        deliver(t, seq)
    assert t.drop_too_large(3, out) is True and t.next == 4 and not t.missing
    assert PartitionTracker("s", "p", None).drop_too_large(7, out) is True  # "latest": starts after it


def test_after_a_cut_a_stall_skips_one_offset() -> None:
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=2.0)
    deliver(t, 0)
    deliver(t, 3)  # 1 (cut, never seen) and 2 missing
    assert t.fetch_request(0.0) == (1, 2)
    t.cut = True
    out: list[tuple[int, bytes]] = []
    assert t.skip_if_stalled(1.0, out) is None
    assert t.skip_if_stalled(2.5, out) == (1, 1) and out == [] and t.next == 2 and not t.cut
    assert t.fetch_request(2.5) == (2, 1)  # the rest of the hole is asked for at once
    assert deliver(t, 2) == [2, 3]
    # Nothing held: a HEAD alone says the unseen record exists; it is skipped too.
    t = PartitionTracker("s", "p", 0, skip_after=2.0)
    deliver(t, 0)
    assert t.on_head(1)
    t.fetch_request(0.0)
    assert t.skip_if_stalled(3.0, out) is None  # no cut: nothing held, nothing to skip to
    t.cut = True
    assert t.skip_if_stalled(3.0, out) == (1, 1) and t.next == 2 and not t.missing


def test_cut_watch_tells_a_cut_from_a_peer_gone() -> None:
    import zmq

    from dafka.core.reach import CutWatch

    w = CutWatch(0.25)
    for key in ("a", "b", "c"):
        w.on_event(key, zmq.EVENT_HANDSHAKE_SUCCEEDED, 0.0)
    w.on_event("a", zmq.EVENT_DISCONNECTED, 1.0)  # cut: nothing after it
    w.on_event("b", zmq.EVENT_DISCONNECTED, 1.0)  # peer gone: ZeroMQ retries
    w.on_event("b", zmq.EVENT_CONNECT_RETRIED, 1.0)
    w.on_event("d", zmq.EVENT_DISCONNECTED, 1.0)  # never established (a refused handshake)
    assert w.pending and w.cut(1.1) == []
    assert w.cut(1.3) == ["a"] and w.cut(5.0) == [] and not w.pending
    w.on_event("c", zmq.EVENT_DISCONNECTED, 2.0)
    w.forget("c")
    assert w.cut(9.0) == []


def test_cut_watch_due_only_while_a_disconnection_is_pending() -> None:
    """An idle node schedules no cut check: due() is None until a DISCONNECTED."""
    import zmq

    from dafka.core.reach import CutWatch

    w = CutWatch(0.25)
    assert w.due() is None
    w.on_event("a", zmq.EVENT_HANDSHAKE_SUCCEEDED, 0.0)
    w.on_event("b", zmq.EVENT_HANDSHAKE_SUCCEEDED, 0.0)
    assert w.due() is None
    w.on_event("b", zmq.EVENT_DISCONNECTED, 2.0)
    w.on_event("a", zmq.EVENT_DISCONNECTED, 1.0)
    assert w.due() == 1.25  # the earliest
    assert w.cut(1.25) == ["a"] and w.due() == 2.25
    w.on_event("b", zmq.EVENT_CONNECT_RETRIED, 2.1)
    assert w.due() is None


@settings(max_examples=200)
@given(st.permutations(list(range(30))), st.integers(0, 29))
def test_any_arrival_order_delivers_in_order_without_duplicates(order: list[int], dup: int) -> None:
    t = PartitionTracker("s", "p", 0)
    got: list[int] = []
    for seq in order + [dup]:
        got += deliver(t, seq)
    assert got == list(range(30))


# ---------------------------------------------------------------- window


def test_window_cumulative_acks_and_fetch_content() -> None:
    w = UnackedWindow(5000)
    for i in range(3000):
        w.push(b"r%d" % i)
    assert w.ack(999) == 1000
    assert w.ack(500) == 0  # older ACK: nothing new
    got = list(w.fetch(1500, 3))
    assert got == [(1500, b"r1500"), (1501, b"r1501"), (1502, b"r1502")]
    assert list(w.fetch(0, 2)) == []  # acknowledged records are gone
    assert w.ack(10**9) == 0  # beyond what was published: acknowledges nothing
    assert w.acked == 999 and len(w) == 2000
    assert w.ack(2999) == 2000
    assert len(w) == 0 and w.bytes == 0


def test_window_full_and_ring_mode() -> None:
    w = UnackedWindow(3)
    for _ in range(3):
        w.push(b"x")
    assert w.full
    r = UnackedWindow(3, ring=True)
    for i in range(10):
        r.push(b"%d" % i)
    assert not r.full and len(r) == 3
    assert list(r.fetch(0, 100)) == [(7, b"7"), (8, b"8"), (9, b"9")]


def test_window_resumes_at_offset() -> None:
    w = UnackedWindow(10, 100)
    assert w.push(b"a") == 100 and w.acked == 99


# ---------------------------------------------------------------- peers


def test_peer_table_connects_once_and_expires() -> None:
    t = PeerTable("ME", timeout=4.0)
    assert t.on_beacon("ME", "tcp://x:1", 0.0) == []
    assert t.on_beacon("A", "tcp://a:1", 0.0) == [Connect("tcp://a:1", "A")]
    assert t.on_beacon("A", "tcp://a:1", 1.0) == []
    assert t.on_beacon("A", "tcp://a:2", 2.0) == [Disconnect("tcp://a:1", "A"), Connect("tcp://a:2", "A")]
    assert t.expire(5.9) == []
    assert t.expire(6.0) == [Disconnect("tcp://a:2", "A")]
    assert len(t) == 0


def test_peers_are_not_expired_for_a_silence_of_the_towers() -> None:
    # A starved node (or a lagging tower) hears nobody for a while: that says
    # nothing of the peers, and none may drop the moment beacons flow again.
    watch = TowerWatch(started=0.0, grace=5.0)
    assert watch.quiet(0.0, 2.5)  # never heard
    watch.on_heard(1.0)
    assert not watch.quiet(3.5, 2.5) and watch.quiet(3.6, 2.5)
    t = PeerTable("ME", timeout=4.0)
    t.on_beacon("A", "tcp://a:1", 1.0)
    t.on_beacon("B", "tcp://b:1", 1.0)
    t.postpone(30.0)  # quiet from 3.6 s to 30 s
    assert t.expire(33.9) == []
    t.on_beacon("A", "tcp://a:1", 31.0)  # A beacons again; B is gone
    assert t.expire(34.0) == [Disconnect("tcp://b:1", "B")]
    assert t.expire(35.0) == [Disconnect("tcp://a:1", "A")]


def test_catch_up_is_pipelined_half_way_through_a_range() -> None:
    t = PartitionTracker("s", "p", 0)
    t.on_head(3 * FETCH_CHUNK - 1)
    assert t.fetch_request(0.0) == (0, FETCH_CHUNK)
    half = FETCH_CHUNK // 2
    t.next = half  # the first half of the range was delivered
    assert t.fetch_request(0.1) == (FETCH_CHUNK, FETCH_CHUNK)
    assert t.fetch_request(0.1) is None  # one range ahead at most
    t.next = FETCH_CHUNK + half
    assert t.fetch_request(0.2) == (2 * FETCH_CHUNK, FETCH_CHUNK)
    t.next = 3 * FETCH_CHUNK - 10
    assert t.fetch_request(0.3) is None  # nothing known beyond what was asked


def test_retries_back_off_and_a_new_peer_never_causes_a_skip() -> None:
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    deliver(t, 5)  # 0..4 missing, 5 held
    assert t.fetch_request(0.0) == (0, 5)
    assert t.fetch_request(0.6) == (0, 5)  # no progress for 0.5 s
    assert t.fetch_request(1.2) is None  # backing off: now 1 s
    assert t.fetch_request(1.7) == (0, 5)
    t.retry_now()  # a new store subscribed: ask it at once ...
    assert t.fetch_request(1.8) == (0, 5)
    out: list[tuple[int, bytes]] = []
    assert t.skip_if_stalled(2.0, out) is None  # ... but that is no reason to skip
    assert t.skip_if_stalled(10.1, out) is None  # stalled, the last FETCH is old: a last call
    assert t.fetch_request(10.1) == (0, 5)
    assert t.skip_if_stalled(10.6, out) == (0, 4)


def retry_times(t: PartitionTracker, until: float, step: float = 0.05) -> list[float]:
    """When ``t`` re-sends its FETCH (polled every ``step`` s, nothing ever answering)."""
    times = []
    now = 0.0
    while now <= until:
        if t.fetch_request(now) is not None:
            times.append(round(now, 2))
        now += step
    return times


def test_a_hole_before_held_records_is_asked_for_at_least_eight_times_before_it_is_given_up() -> None:
    # Retries 2 s and 4 s apart (the backoff's bound, 8 retry intervals) missed the producer's
    # and then a store's time up with the record, and it was given up acknowledged
    # (simulator seed 6023562, pinned in tests/test_sim.py).
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    deliver(t, 1)  # 0 missing, 1 held
    times = retry_times(t, 10.0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 10.0 / 8 + 0.06, times  # at most skip_after / 8 apart
    assert len(times) >= 8
    # Nothing held (a long catch-up, not a hole about to be given up): the full backoff, so a
    # slow reader is not buried under answers to FETCHes it asked for again.
    u = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    u.on_head(99)
    times = retry_times(u, 20.0)
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) >= 4.0, times


# ---------------------------------------------------------------- producer resume


def test_resume_always_continues_after_the_highest_store_head() -> None:
    # The file says acked 1875 / next 1876, the stores hold up to 2023.
    r = Resume(1875, 1876, started=0.0, timeout=3.0, beacon_interval=0.2)
    assert not r.done(0.1) and not r.may_beacon(0.1)  # no tower heard yet
    r.on_tower(0.1)
    assert not r.may_beacon(0.5)  # listening for a twin's beacons first
    assert r.may_beacon(0.61)
    assert not r.done(0.7)  # no head yet
    r.on_head(2000, 0.7)
    r.on_head(2023, 0.8)
    assert not r.done(0.9)  # a grace period for slower stores
    assert r.done(1.01)
    assert r.decide() == (2024, None)


def test_resume_head_behind_the_saved_next_reuses_unacked_offsets() -> None:
    # Published up to 2099 but the stores hold 2023: 2024.. were never
    # acknowledged, and skipping them would leave a hole nobody can fill.
    r = Resume(1900, 2100, started=0.0, timeout=3.0, beacon_interval=0.2)
    r.on_tower(0.0)
    r.on_head(2023, 0.5)
    assert r.decide() == (2024, None)
    stale = Resume(1900, 2100, started=0.0, timeout=3.0, beacon_interval=0.2)
    stale.on_head(1500, 0.5)  # a store that lags behind what was acknowledged
    assert stale.decide() == (1901, None)


def test_resume_without_any_store_refuses_unless_asked_to_start_anyway() -> None:
    r = Resume(10, 12, started=0.0, timeout=1.0, beacon_interval=0.2)
    r.on_tower(0.0)
    assert not r.done(0.99) and r.done(1.0)
    offset, error = r.decide()
    assert error is not None and "no store answered" in error and "start_anyway" in error
    silent = Resume(10, 12, started=0.0, timeout=1.0, beacon_interval=0.2)
    assert "no tower answered" in (silent.decide()[1] or "")
    anyway = Resume(10, 12, started=0.0, timeout=1.0, beacon_interval=0.2, policy=START_ANYWAY)
    assert anyway.decide() == (12, None)  # after everything the file knew of
    no_stores = Resume(10, 12, started=0.0, timeout=1.0, beacon_interval=0.2, need_store=False)
    no_stores.on_tower(0.0)
    assert no_stores.done(0.51) and no_stores.decide() == (12, None)
    with pytest.raises(ValueError):
        Resume(10, 12, started=0.0, timeout=1.0, beacon_interval=0.2, policy="maybe")


def test_resume_refuses_when_a_twin_beacons_our_address() -> None:
    r = Resume(5, 6, started=0.0, timeout=3.0, beacon_interval=0.2, policy=START_ANYWAY)
    r.on_tower(0.0)
    r.on_duplicate("tcp://127.0.0.1:40000")
    assert not r.may_beacon(1.0) and r.done(0.01)
    r.on_head(100, 0.02)
    offset, error = r.decide()
    assert error is not None and "another live producer" in error and "tcp://127.0.0.1:40000" in error


def test_tower_watch_warns_after_grace_then_at_a_low_rate() -> None:
    w = TowerWatch(started=0.0, grace=3.0, repeat=30.0)
    assert not w.warning_due(2.9)
    assert w.warning_due(3.0)
    assert not w.warning_due(4.0) and not w.warning_due(32.9)
    assert w.warning_due(33.0)
    w.on_heard(34.0)
    assert w.reached and not w.warning_due(100.0)
    heard = TowerWatch(started=0.0, grace=3.0)
    heard.on_heard(0.5)
    assert not heard.warning_due(5.0)


@given(
    chunks=st.lists(st.lists(st.binary(max_size=5), max_size=8), max_size=6),
    ring=st.booleans(),
    capacity=st.integers(1, 20),
)
def test_window_push_many_equals_pushes(chunks: list[list[bytes]], ring: bool, capacity: int) -> None:
    one, many = UnackedWindow(capacity, 5, ring=ring), UnackedWindow(capacity, 5, ring=ring)
    for chunk in chunks:
        if not ring:
            chunk = chunk[: capacity - len(one)]  # the caller makes room first
        for c in chunk:
            one.push(c)
        assert many.push_many([b"skip"] + chunk + [b"skip"], 1, 1 + len(chunk)) == one.next - len(chunk)
        held = (one.next, one.acked, list(one.fetch(0, 10**6)), one.bytes)
        assert held == (many.next, many.acked, list(many.fetch(0, 10**6)), many.bytes)


class WindowModel:
    """The window's contract, one dict entry per record (the obviously right version)."""

    def __init__(self, capacity: int, next_offset: int, ring: bool) -> None:
        self.capacity, self.next, self.acked, self.ring = capacity, next_offset, next_offset - 1, ring
        self.records: dict[int, bytes] = {}

    def push(self, content: bytes) -> int:
        seq = self.next
        self.records[seq] = content
        self.next += 1
        if self.ring and len(self.records) > self.capacity:
            old = min(self.records)
            del self.records[old]
            self.acked = max(self.acked, old)
        return seq

    def ack(self, seq: int) -> int:
        if seq <= self.acked or seq >= self.next:
            return 0
        for offset in range(self.acked + 1, seq + 1):
            self.records.pop(offset, None)
        newly, self.acked = seq - self.acked, seq
        return newly


_window_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.lists(st.binary(max_size=4), max_size=12)),
        st.tuples(st.just("one"), st.binary(max_size=4)),
        st.tuples(st.just("ack"), st.integers(-3, 40)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(ops=_window_ops, ring=st.booleans(), capacity=st.integers(1, 25), start=st.integers(0, 5))
def test_window_matches_dict_model(ops: list[tuple[str, object]], ring: bool, capacity: int, start: int) -> None:
    import dafka.core.unacked as unacked

    old_chunk = unacked.CHUNK
    unacked.CHUNK = 3  # many chunk boundaries in small examples
    try:
        w, model = UnackedWindow(capacity, start, ring=ring), WindowModel(capacity, start, ring)
        for op, arg in ops:
            if op == "ack":
                seq = model.acked + int(arg)  # type: ignore[call-overload]
                assert w.ack(seq) == model.ack(seq)
                continue
            batch = [arg] if op == "one" else list(arg)  # type: ignore[call-overload]
            if not ring:
                batch = batch[: capacity - len(model.records)]  # the caller makes room first
            first = model.next
            for content in batch:
                model.push(content)
            if op == "one" and batch:
                assert w.push(batch[0]) == first
            else:
                assert w.push_many([b"-", *batch, b"-"], 1, 1 + len(batch)) == first
            assert w.full == (not ring and len(model.records) >= capacity)
        assert (w.next, w.acked, w.last, len(w)) == (model.next, model.acked, model.next - 1, len(model.records))
        assert w.bytes == sum(map(len, model.records.values()))
        for seq in range(start - 2, model.next + 2):
            assert w.get(seq) == model.records.get(seq)
        for seq in range(start - 2, model.next + 1, 2):
            for count in (0, 1, 2, 5, 100):
                want = [(o, model.records[o]) for o in range(seq, seq + count) if o in model.records]
                assert list(w.fetch(seq, count)) == want
                runs = w.runs(seq, count)
                assert [(first + i, c) for first, cs in runs for i, c in enumerate(cs)] == want
    finally:
        unacked.CHUNK = old_chunk


# ---------------------------------------------------------------- resume with a reservation


def _resume(acked: int, nxt: int, reserved: int | None, **kw: Any) -> Resume:
    r = Resume(acked, nxt, started=0.0, timeout=3.0, beacon_interval=0.2, reserved=reserved, **kw)
    r.on_tower(0.0)
    return r


def test_resume_never_reuses_offsets_a_silent_store_may_hold() -> None:
    # Defect A: a stopped store acknowledged up to 1506; the answering store is
    # at 1350, the file (saved every 0.5 s) says next 1400. The reservation
    # (1400 + a block) bounds whatever the crashed run assigned.
    r = _resume(1340, 1400, 11_400)
    r.on_head(1350, 0.6)
    assert not r.done(0.8) and r.done(0.91)
    assert r.decide() == (11_400, None)
    assert r.hole == (1351, 11_399)
    # Without a reservation (a file from before them) the old rule reassigns 1351..
    old = _resume(1340, 1400, None)
    old.on_head(1350, 0.6)
    assert old.decide() == (1351, None)


def test_resume_takes_a_store_head_beyond_the_reservation() -> None:
    # A head above the reservation (a restored backup of the file): never below a head.
    r = _resume(10, 12, 100)
    r.on_head(500, 0.6)
    assert r.decide() == (501, None) and r.hole is None


def test_resume_after_a_clean_close_has_no_hole() -> None:
    # close() saves the exact end as the reservation.
    r = _resume(41, 45, 45)
    r.on_head(41, 0.6)
    assert r.decide() == (45, None)
    assert r.hole == (42, 44)  # published, never acknowledged: nobody may have them
    clean = _resume(44, 45, 45)
    clean.on_head(44, 0.6)
    assert clean.decide() == (45, None) and clean.hole is None


def test_resume_with_a_reservation_keeps_the_policies() -> None:
    # strict still wants a store's answer; start_anyway now overwrites nothing.
    r = _resume(10, 12, 10_012)
    assert not r.done(2.99) and r.done(3.0)
    assert "no store answered" in (r.decide()[1] or "") and r.hole is None
    silent = Resume(10, 12, started=0.0, timeout=1.0, beacon_interval=0.2, reserved=10_012)
    assert silent.done(1.0) and "no tower answered" in (silent.decide()[1] or "")
    anyway = Resume(
        10, 12, started=0.0, timeout=1.0, beacon_interval=0.2, reserved=10_012, policy=START_ANYWAY
    )
    assert anyway.decide() == (10_012, None) and anyway.hole == (11, 10_011)


def test_resume_without_acks_continues_after_the_reservation() -> None:
    # Defect B: acks=False producers never asked stores; the 0.5 s-old file
    # made them assign again what they had published just before a crash.
    r = _resume(-1, 300, 10_300, need_store=False)
    assert r.done(0.51) and r.decide() == (10_300, None)
    legacy = _resume(-1, 300, None, need_store=False)
    assert legacy.done(0.51) and legacy.decide() == (300, None)


def test_resume_with_a_reservation_still_refuses_a_twin() -> None:
    r = _resume(5, 6, 10_006)
    r.on_duplicate("tcp://127.0.0.1:40000")
    assert r.done(0.01)
    assert "another live producer" in (r.decide()[1] or "") and r.hole is None


def test_a_record_lost_long_after_the_last_progress_is_waited_for_in_full() -> None:
    # Issue 40: a restart hole 1..15 is skipped (16 delivered, next = 17), which
    # leaves the retries backed off; 6 s later 18 and 19 come but 17 was lost on
    # the way.  The FETCH at once finds the stores with 17 received, not yet
    # committed: no answer.  Before the fix the hole counted from the skip (not
    # from when 17 was known to exist), the next retry was 4 s away, and 17 --
    # acknowledged meanwhile -- was skipped 4 s after it went missing.
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    out: list[tuple[int, bytes]] = []
    deliver(t, 0)
    deliver(t, 16)

    def tick(now: float) -> tuple[int, int] | None:
        """What the reader's check_missing does on a tick."""
        skipped = t.skip_if_stalled(now, out)
        t.fetch_request(now)
        return skipped

    now = 0.0
    skipped = None
    while skipped is None and now < 30:
        now = round(now + 0.1, 1)
        skipped = tick(now)
    assert skipped == (1, 15) and [s for s, _ in out] == [16] and t.next == 17
    out.clear()
    lost_at = round(now + 6.0, 1)
    while now < lost_at:
        now = round(now + 0.1, 1)
        assert tick(now) is None
    deliver(t, 18)
    deliver(t, 19)
    asks = [now] if t.fetch_request(now) == (17, 1) else []
    end = lost_at + 10.0
    while now < round(end - 0.1, 1):
        now = round(now + 0.1, 1)
        assert t.skip_if_stalled(now, out) is None, f"skipped at {now}, 17 missing since {lost_at}"
        if t.fetch_request(now) is not None:
            asks.append(now)
    assert asks[0] == lost_at and asks[1] - asks[0] <= 0.6  # retries start again at retry_interval
    assert len(asks) >= 5
    assert deliver(t, 17) == [17, 18, 19]  # committed late, it comes
    assert t.skipped == 15


def test_a_long_wait_with_nothing_held_asks_once_more_before_skipping() -> None:
    # A HEAD announced 0..9, nobody had them (nothing held) for 20 s; then
    # record 15 comes: 10..14 may be one FETCH away (a restarted producer's
    # records after its hole). Ask once more, then skip only what did not come.
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    t.on_head(9)
    assert t.fetch_request(0.0) == (0, 10)
    out: list[tuple[int, bytes]] = []
    deliver(t, 15)
    assert t.skip_if_stalled(20.0, out) is None  # not asked since 15 came
    assert t.fetch_request(20.0) == (0, 15)  # at once, for the hole before 15
    assert t.skip_if_stalled(20.3, out) is None  # the answer may still come
    for seq in range(10, 15):
        deliver(t, seq)
    assert t.skip_if_stalled(20.5, out) == (0, 9)
    assert [s for s, _ in out] == [10, 11, 12, 13, 14, 15]


# ---------------------------------------------------------------- a restarted producer's hole (issue 34)


def test_a_restart_hole_is_passed_once_every_known_store_said_it_holds_none() -> None:
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    out: list[tuple[int, bytes]] = []
    deliver(t, 0)
    deliver(t, 16)  # the restarted producer's first record; 1..15 reserved by the crashed run
    deliver(t, 17)
    stores = {"s0", "s1"}
    assert t.fetch_request(0.0) == (1, 15)
    t.on_store_void("s0", 1, 15)  # before the producer said it is a restart hole: not counted
    t.on_restart_hole(1, 15)
    assert t.pass_restart_hole(0.1, stores, out) is None  # no store said anything since
    t.on_store_void("s0", 1, 15)
    assert t.pass_restart_hole(0.1, stores, out) is None  # s1 silent: it may hold some
    t.on_store_void("s1", 3, 15)
    assert t.pass_restart_hole(0.1, stores, out) is None  # s1 may hold 1..2
    assert t.pass_restart_hole(0.1, set(), out) is None  # no store known: skip_after decides
    t.on_store_void("s1", 1, 20)
    assert t.pass_restart_hole(0.2, stores, out) == (1, 15)
    assert [s for s, _ in out] == [16, 17] and t.next == 18 and t.skipped == 15 and not t.missing
    out.clear()
    assert t.pass_restart_hole(0.3, stores, out) is None  # nothing more to pass


def test_a_store_passes_a_restart_hole_on_its_own_word_and_the_stores_it_knows() -> None:
    # A store is one itself: it holds none of what it is missing.  With no
    # other store known the producer's word is enough (a store it did not know
    # that holds some is asked again when it appears: HoleRepair); with others
    # known, all must have said they hold none of it.
    out: list[tuple[int, bytes]] = []
    t = PartitionTracker("s", "p", 5)
    deliver(t, 20)
    assert t.fetch_request(0.0) == (5, 15)
    assert t.pass_restart_hole(0.0, set(), out, own_word=True) is None  # the producer said nothing
    t.on_restart_hole(5, 19)
    assert t.fetch_request(0.0) == (5, 15)  # asked again at once: stores' answers before it counted nothing
    assert t.pass_restart_hole(0.0, {"s1"}, out, own_word=True) is None  # s1 silent
    t.on_store_void("s1", 5, 19)
    assert t.pass_restart_hole(0.0, {"s1", "s2"}, out, own_word=True) is None  # s2 silent
    assert t.pass_restart_hole(0.0, {"s1"}, out, own_word=True) == (5, 19) and [s for s, _ in out] == [20]
    t = PartitionTracker("s", "p", 5)
    deliver(t, 20)
    t.on_restart_hole(5, 19)
    assert t.pass_restart_hole(0.0, set(), out) is None  # a consumer needs a store's word
    assert t.pass_restart_hole(0.0, set(), out, own_word=True) == (5, 19)
    # Never what lies before the restart hole (the previous run's records).
    t = PartitionTracker("s", "p", 0)
    deliver(t, 20)
    t.on_restart_hole(5, 19)
    assert t.pass_restart_hole(0.0, set(), out, own_word=True) is None and t.next == 0


def test_known_stores_keep_a_gone_store_for_a_while_and_are_bounded() -> None:
    stores = KnownStores(keep=10.0, limit=2)
    stores.met("a")
    stores.met("b")
    assert set(stores.current(0.0)) == {"a", "b"}
    stores.gone("a", 1.0)
    stores.gone("zz", 1.0)  # never met: nothing
    assert set(stores.current(10.9)) == {"a", "b"}  # gone, but it may hold some and be back
    assert set(stores.current(11.1)) == {"b"}
    stores.met("c")
    stores.gone("b", 12.0)
    stores.met("b")  # back
    assert set(stores.current(30.0)) == {"b", "c"}
    # Full: a store turned away counts as one that never answers (a flood of
    # made-up stores must not hide a real one that holds part of a hole).
    stores.met("d")
    assert set(stores.current(30.0)) == {"b", "c", UNREMEMBERED}
    t = PartitionTracker("s", "p", 5)
    deliver(t, 20)
    t.on_restart_hole(5, 19)
    out: list[tuple[int, bytes]] = []
    for store in ("b", "c", "d"):
        t.on_store_void(store, 5, 19)
    assert t.pass_restart_hole(0.0, stores.current(30.0), out, own_word=True) is None


def test_a_restart_hole_passes_only_what_lies_inside_it() -> None:
    out: list[tuple[int, bytes]] = []
    # Records before the restart hole are missing too (live records of the
    # previous run, in the stores): not passed.
    t = PartitionTracker("s", "p", 0)
    deliver(t, 20)
    t.on_restart_hole(5, 19)
    t.on_store_void("s0", 0, 19)
    assert t.pass_restart_hole(0.0, {"s0"}, out) is None and t.next == 0
    # A hole that runs past the restart hole (a record after it lost): not passed.
    t = PartitionTracker("s", "p", 5)
    deliver(t, 25)
    t.on_restart_hole(5, 19)
    t.on_store_void("s0", 5, 24)
    assert t.pass_restart_hole(0.0, {"s0"}, out) is None and t.next == 5
    # A new statement (the producer crashed again) clears what the stores said.
    t = PartitionTracker("s", "p", 5)
    deliver(t, 20)
    t.on_restart_hole(5, 19)
    t.on_store_void("s0", 5, 19)
    t.on_restart_hole(5, 30)
    assert t.pass_restart_hole(0.0, {"s0"}, out) is None
    t.on_store_void("s0", 5, 30)
    assert t.pass_restart_hole(0.0, {"s0"}, out) == (5, 19) and [s for s, _ in out] == [20]


def test_store_voids_of_a_live_hole_never_pass_it() -> None:
    # Without the producer's word, "none here" may be said of a record on its
    # way to the store (it is acknowledged just after): only skip_after decides.
    t = PartitionTracker("s", "p", 0, retry_interval=0.5, skip_after=10.0)
    out: list[tuple[int, bytes]] = []
    deliver(t, 0)
    deliver(t, 2)
    assert t.fetch_request(0.0) == (1, 1)
    t.on_store_void("s0", 1, 1)
    assert t.pass_restart_hole(0.1, {"s0"}, out) is None and t.next == 1 and not t.voids


def test_offsets_missing_for_less_than_skip_after_are_not_given_up_with_an_older_hole() -> None:
    # Issue 40, seed 201185: a store restarted with its partition at 44 and
    # heard a HEAD of 57 (44..57 missing, nobody has them); 10 s later 75..82
    # came, 58..74 (acknowledged by the other store, 74 still in the
    # producer's window) lost on the way.  Before the fix the stall of 44
    # gave up 44..74 half a second later, and the store's ACK of 82 released
    # 74 from the producer though no store held it.
    t = PartitionTracker("s", "p", 44, retry_interval=0.5, skip_after=10.0)
    out: list[tuple[int, bytes]] = []
    t.on_head(57)
    assert t.fetch_request(0.0) == (44, 14)
    now = 0.0
    while now < 9.5:
        now = round(now + 0.1, 1)
        assert t.skip_if_stalled(now, out) is None
        t.fetch_request(now)
    for seq in range(75, 83):
        deliver(t, seq)
    t.fetch_request(now)  # (44..74 asked for once the retry is due)
    skipped = None
    while skipped is None and now < 12:
        now = round(now + 0.1, 1)
        skipped = t.skip_if_stalled(now, out)
        t.fetch_request(now) if skipped is None else None
    assert skipped == (44, 57) and out == [] and t.next == 58  # only what was missing 10 s
    assert t.fetch_request(now) == (58, 17)  # the rest is asked for at once
    while now < 19.0:
        now = round(now + 0.1, 1)
        assert t.skip_if_stalled(now, out) is None, now
        t.fetch_request(now)
    for seq in range(58, 75):
        deliver(t, seq)
    assert t.next == 83 and t.skipped == 14
