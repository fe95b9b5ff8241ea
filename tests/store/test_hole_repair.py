"""Refilling recorded holes: the sans-IO HoleRepair, then the real Store on real LMDB.

The store part runs the shipped Store code driven deterministically (the
simulator's SimStore: in-process ZeroMQ sockets, simulated time, the writer
called in line), so every FETCH it sends can be counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dafka.core import wire
from dafka.core.audience import BatchAudience
from dafka.sim.nodes import SimStore
from dafka.sim.world import SimClock, simulated_time
from dafka.store.db import Hole, RecordDB
from dafka.store.holes import HoleRepair

P = "0123456789ABCDEF0123456789ABCDEF"
PEER = "FEDCBA9876543210FEDCBA9876543210"
KEY = ("t", P)


# ---------------------------------------------------------------- HoleRepair alone


def test_a_new_hole_is_asked_for_after_one_interval_then_backs_off() -> None:
    r = HoleRepair(interval=1.0, max_wait=8.0)
    r.sync([("t", P, 5, 9)], now=0.0)
    assert r.due(0.5) == []
    assert r.due(1.0) == [("t", P, 5, 5)]
    # Answers bring nothing: 1, 2, 4 seconds apart, then every 8 (asked at 1, 2, 4, 8, 16, ... 40).
    asked = [1.0]
    t = 1.0
    while t < 40:
        t += 0.25
        if r.due(t):
            asked.append(t)
    assert [b - a for a, b in zip(asked, asked[1:], strict=False)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]


def test_progress_resets_the_wait_and_asks_for_what_is_left() -> None:
    r = HoleRepair(interval=1.0, max_wait=64.0, max_ask=3)
    r.sync([("t", P, 5, 9)], now=0.0)
    for t in (1.0, 2.0, 4.0):
        assert r.due(t) == [("t", P, 5, 3)]  # max_ask offsets from the start
    # 5..7 came: what is left is asked for one interval after the last ask.
    r.sync([("t", P, 8, 9)], now=4.2)
    assert r.due(4.9) == []
    assert r.due(5.0) == [("t", P, 8, 2)]
    assert r.due(6.0) == [("t", P, 8, 2)]  # the wait started over


def test_covers_exactly_the_tracked_holes() -> None:
    r = HoleRepair()
    r.sync([("t", P, 5, 9), ("t", P, 15, 15), ("u", P, 0, 3)], now=0.0)
    assert [o for o in range(20) if r.covers(KEY, o)] == [5, 6, 7, 8, 9, 15]
    assert r.covers(("u", P), 0) and not r.covers(("u", P), 4)
    assert not r.covers(("t", PEER), 5)
    r.sync([], now=1.0)
    assert not r and not r.covers(KEY, 5)


def test_rounds_are_bounded_and_fair() -> None:
    """Many holes: at most per_round FETCHes per interval, the longest due first."""
    r = HoleRepair(interval=1.0, per_round=4, max_wait=1000.0)
    r.sync([("t", P, 10 * i, 10 * i + 1) for i in range(10)], now=0.0)
    first = r.due(1.0)
    assert len(first) == 4
    assert r.due(1.5) == []  # not before the next round
    second, third = r.due(2.0), r.due(3.0)
    assert len(second) == 4 and len(third) == 4
    # Holes never asked for go first: all ten were asked for within three rounds.
    assert {a[2] for a in first + second + third} == {10 * i for i in range(10)}


def test_at_most_max_holes_are_tracked() -> None:
    r = HoleRepair(max_holes=3)
    r.sync([("t", P, 10 * i, 10 * i) for i in range(1000)], now=0.0)
    assert len(r) == 3 and r.holes() == [("t", P, 0, 0), ("t", P, 10, 10), ("t", P, 20, 20)]


def test_a_peer_joining_makes_holes_due_but_never_in_a_tight_loop() -> None:
    r = HoleRepair(interval=1.0, max_wait=100.0)
    r.sync([("t", P, 5, 9)], now=0.0)
    t, asked = 1.0, 0
    while t < 60:  # backed off to 32 s
        asked += len(r.due(t))
        t += 1.0
    assert asked == 6
    # A peer joins many times a second: one ask per interval at most.
    asked = 0
    for i in range(1000):
        now = 60.0 + i * 0.01
        r.peer_joined(now)
        asked += len(r.due(now))
    assert 9 <= asked <= 11


def test_a_start_hole_a_peer_holds_none_of_is_asked_no_more_until_a_peer_joins() -> None:
    """A hole from offset 0 that a peer store VOIDs (retention removed it there):
    asked past what was said, then not at all; a peer joining asks again."""
    r = HoleRepair(interval=1.0, max_wait=8.0, max_ask=10)
    r.sync([("t", P, 0, 24), ("t", P, 40, 44)], now=0.0)
    assert r.due(1.0) == [("t", P, 0, 10), ("t", P, 40, 5)]
    r.on_void(KEY, 0, 9)
    r.on_void(KEY, 40, 44)  # not a start hole: its backoff goes on
    assert r.due(2.0) == [("t", P, 10, 10), ("t", P, 40, 5)]
    r.on_void(KEY, 0, 9)  # a stale answer to the first ask changes nothing
    r.on_void(KEY, 10, 19)
    assert r.due(4.0) == [("t", P, 20, 5), ("t", P, 40, 5)]
    r.on_void(KEY, 20, 24)
    asked = []
    for i in range(100):
        asked += r.due(5.0 + i)
    assert asked and all(a[2] == 40 for a in asked)  # the start hole: never again
    assert r.covers(KEY, 3)  # still tracked: a record that comes fills it
    r.peer_joined(200.0)
    assert r.due(200.0) == [("t", P, 0, 10), ("t", P, 40, 5)]


def test_a_start_hole_is_asked_until_every_known_peer_store_holds_none_of_it() -> None:
    """One peer store's VOID is not enough: another may hold the records (and answer
    after it).  The simulator's 3-store hole repair found it: the first VOID stopped
    the asks, and the holes of a store back from a freeze were never filled."""
    r = HoleRepair(interval=1.0, max_wait=8.0, max_ask=10)
    r.sync([("t", P, 0, 24)], now=0.0)
    assert r.due(1.0) == [("t", P, 0, 10)]
    r.on_void(KEY, 0, 30, "s1", stores=("s1", "s2"))
    assert r.due(2.0) == [("t", P, 0, 10)]  # s2 has not said: still asked from 0
    r.on_void(KEY, 0, 30, "s1", stores=("s1", "s2"))  # s1 again changes nothing
    assert r.due(4.0) == [("t", P, 0, 10)]
    r.on_void(KEY, 0, 9, "s2", stores=("s1", "s2"))  # s2: none of 0..9
    assert r.due(8.0) == [("t", P, 10, 10)]  # what both said is asked no more
    r.on_void(KEY, 10, 30, "s2", stores=("s1", "s2"))
    assert r.due(16.0) == [("t", P, 10, 10)]  # s1's word was about asks from 0
    r.on_void(KEY, 10, 30, "s1", stores=("s1", "s2"))
    assert all(not r.due(20.0 + i) for i in range(20))  # both: never again
    r.peer_joined(100.0)
    assert r.due(100.0) == [("t", P, 0, 10)]
    r.on_void(KEY, 0, 30, "s1", stores=("s1", "s2", ""))  # a store turned away (UNREMEMBERED) never says
    r.on_void(KEY, 0, 30, "s2", stores=("s1", "s2", ""))
    assert r.due(101.0) == [("t", P, 0, 10)]


def test_a_void_not_from_where_a_start_hole_is_asked_changes_nothing() -> None:
    r = HoleRepair(interval=1.0, max_wait=8.0)
    r.sync([("t", P, 0, 9)], now=0.0)
    r.on_void(KEY, 1, 100)  # not from its start
    r.on_void(("t", PEER), 0, 100)  # another partition
    r.on_void(KEY, 0, 5)  # a part: the rest is asked
    assert r.due(1.0) == [("t", P, 6, 4)]
    # Records came (the hole shrank): asked from its start again.
    r.sync([("t", P, 0, 7)], now=1.5)
    assert r.due(2.0) == [("t", P, 0, 8)]


def test_acks_stop_below_a_hole_until_it_is_filled_or_released() -> None:
    """"Acked means durable": an ACK never passes a recorded hole its producer may still hold."""
    r = HoleRepair(interval=1.0, release_after=10.0)
    assert r.cap(KEY, 14) == 14  # no hole, no cap
    r.sync([("t", P, 5, 9), ("t", P, 20, 24), ("u", P, 0, 3)], now=0.0)
    assert r.cap(KEY, 4) == 4 and r.cap(KEY, 14) == 4 and r.cap(KEY, 30) == 4
    assert r.cap(("t", PEER), 14) == 14  # another partition's holes do not count
    # Records came for the first hole: the cap moves to what is left.
    r.sync([("t", P, 8, 9), ("t", P, 20, 24), ("u", P, 0, 3)], now=1.0)
    assert r.cap(KEY, 14) == 7
    r.sync([("t", P, 20, 24), ("u", P, 0, 3)], now=2.0)
    assert r.cap(KEY, 14) == 14 and r.cap(KEY, 30) == 19
    assert r.cap(("u", P), 10) == -1  # below the first offset: nothing to ACK


def test_a_producer_heard_again_is_asked_for_its_holes_at_once_and_releases_them_after_release_after() -> None:
    r = HoleRepair(interval=1.0, max_wait=8.0, release_after=10.0, heard_gap=3.0)
    r.sync([("t", P, 5, 9), ("t", P, 20, 24)], now=0.0)
    # Its HEAD: both holes asked for at once, not after a round's interval.
    assert r.owner_heard(KEY, 0.1) == [("t", P, 5, 5), ("t", P, 20, 5)]
    assert r.owner_heard(KEY, 0.2) == []  # asked already
    assert r.due(1.0) == [] and r.due(1.1) == [("t", P, 5, 5), ("t", P, 20, 5)]
    # Part of the first hole came: what is left keeps its clock (0.1 s so far).
    r.sync([("t", P, 7, 9), ("t", P, 20, 24)], now=1.5)
    assert r.cap(KEY, 30) == 6
    # HEADs a second apart: asked again at each (an interval passed); 9.4 s heard so far.
    asked = sum(len(r.owner_heard(KEY, t)) for t in (2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5))
    assert r.cap(KEY, 30) == 6 and asked == 16
    # A live producer that heard our FETCHes for release_after and sent nothing does not hold them.
    assert r.owner_heard(KEY, 10.5) == []
    assert r.cap(KEY, 30) == 30
    # Still asked for (a peer store may hold them), but they cap no more.
    r.sync([("t", P, 7, 9), ("t", P, 20, 24)], now=11.0)
    assert r.cap(KEY, 30) == 30 and r.owner_heard(KEY, 12.0) == []
    assert r.due(40.0) != []


def test_a_silence_between_heads_counts_heard_gap_at_most() -> None:
    r = HoleRepair(interval=1.0, release_after=10.0, heard_gap=3.0)
    r.sync([("t", P, 5, 9)], now=0.0)
    assert r.owner_heard(KEY, 0.0) == [("t", P, 5, 5)]
    # 20 s without a HEAD (it may have been cut off): 3 s counted, and asked again.
    assert r.owner_heard(KEY, 20.0) == [("t", P, 5, 5)]
    for t in range(21, 27):
        r.owner_heard(KEY, float(t))
    assert r.cap(KEY, 30) == 4  # 9 s heard
    r.owner_heard(KEY, 27.0)
    assert r.cap(KEY, 30) == 30


def test_only_the_first_holes_are_asked_for_on_a_head() -> None:
    r = HoleRepair(interval=1.0, per_round=2)
    r.sync([("t", P, o, o) for o in range(0, 100, 2)], now=0.0)
    assert [f[2] for f in r.owner_heard(KEY, 0.0)] == [0, 2]


def test_a_restart_hole_the_producer_states_caps_acks_no_more() -> None:
    r = HoleRepair(interval=1.0, release_after=10.0)
    r.sync([("t", P, 5, 9), ("t", P, 12, 19), ("t", P, 30, 34)], now=0.0)
    # Its current run began at 20: everything up to 19 it never holds.  A hole
    # reaching past what it stated (30..34 against 25) still caps.
    r.on_restart_hole(KEY, 12, 19)
    assert r.cap(KEY, 40) == 29
    r.on_restart_hole(KEY, 25, 32)
    assert r.cap(KEY, 40) == 29
    r.on_restart_hole(("t", PEER), 0, 100)  # another partition's: nothing here
    assert r.cap(KEY, 40) == 29
    # Stated before the store gave the offsets up (a reader passes a restart
    # hole at once, then records it): the hole caps nothing once recorded.
    r.on_restart_hole(("u", P), 15, 19)
    r.sync([("u", P, 15, 19), ("u", P, 25, 26)], now=1.0)
    assert r.cap(("u", P), 30) == 24


def test_an_offset_given_up_is_asked_for_no_more_until_the_database_has_it_out_of_its_holes() -> None:
    """give_up: the shell's fill without content is on its way to the database;
    until a sync shows it committed, the offset is neither asked for, nor caps an
    ACK, nor covered, whatever syncs come meanwhile (the database still holds it)."""
    r = HoleRepair(interval=1.0, max_wait=8.0, max_given_up=3)
    db = [("t", P, 2, 5), ("t", P, 9, 9)]
    r.sync(db, now=0.0)
    r.give_up([(KEY, 3), (KEY, 9), (KEY, 7)], now=0.5)  # 7 is in no hole: nothing to give up
    assert r.holes() == [("t", P, 2, 2), ("t", P, 4, 5)]
    assert not r.covers(KEY, 3) and not r.covers(KEY, 9) and r.covers(KEY, 4)
    assert r.cap(KEY, 10) == 1
    r.sync(db, now=0.6)  # another commit, the give-up not in it yet
    assert r.holes() == [("t", P, 2, 2), ("t", P, 4, 5)]
    asked = [f for t in range(1, 60) for f in r.due(float(t))]
    assert asked and set(asked) == {("t", P, 2, 1), ("t", P, 4, 2)}
    # The give-up committed (3 and 9 out of the holes): nothing is remembered of them.
    r.sync([("t", P, 2, 2), ("t", P, 4, 5)], now=60.0)
    r.sync([("t", P, 2, 5), ("t", P, 9, 9)], now=61.0)  # (never so, but it would be asked again)
    assert r.holes() == [("t", P, 2, 5), ("t", P, 9, 9)]
    # Bounded: at most max_given_up offsets remembered; one beyond is asked for as before.
    r.give_up([(KEY, 2), (KEY, 3), (KEY, 4), (KEY, 5)], now=62.0)
    assert r.holes() == [("t", P, 5, 5), ("t", P, 9, 9)]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        HoleRepair(interval=0)
    with pytest.raises(ValueError):
        HoleRepair(per_round=0)


# ---------------------------------------------------------------- the store, deterministically


@contextlib.contextmanager
def sim_store(path: Path) -> Iterator[tuple[SimStore, SimClock]]:
    clock = SimClock()
    clock.now = 1000.0
    with simulated_time(clock):
        store = SimStore(RecordDB(path, sync=False), "A" * 32, clock.now)
        try:
            yield store, clock
        finally:
            store.sim_close_sockets()
            store.db.close()


def run(store: SimStore, clock: SimClock, seconds: float = 0.0, frames: list[list[bytes]] = ()) -> list[Any]:
    """Feed ``frames``, let ``seconds`` pass tick by tick, commit; what the store sent."""
    sent: list[Any] = []

    def turn() -> None:
        if store.sim_pending_input():
            store._read_data()
        store.sim_run_commands()
        while store.has_work():
            store.do_work()
        if store._to_write is not None:
            store._commit(store._take_work())
            store.sim_run_commands()
        sent.extend(wire.decode(f) for f in store.sim_outbox())

    for f in frames:
        store.sim_feed(f)
    turn()
    end = clock.now + seconds
    while clock.now < end:
        clock.now += 0.05
        store.sim_timers(clock.now)
        turn()
    return sent


def records(first: int, n: int, tag: bytes = b"r") -> list[list[bytes]]:
    return [wire.encode(wire.Record("t", P, "t", o, tag + b"%d" % o)) for o in range(first, first + n)]


def answers(store: SimStore, first: int, n: int, tag: bytes = b"r") -> list[list[bytes]]:
    return [wire.encode(wire.DirectRecord(store.address, P, "t", o, tag + b"%d" % o)) for o in range(first, first + n)]


def hole_fetches(sent: list[Any]) -> list[tuple[int, int]]:
    return [(m.sequence, m.count) for m in sent if isinstance(m, wire.Fetch)]


def recorded_hole(store: SimStore, clock: SimClock) -> None:
    """0..4 stored, 5..9 given up (nobody answered for skip_after), 10..14 stored."""
    run(store, clock, 0.1, records(0, 5))
    run(store, clock, store.skip_after + 2, records(10, 5))
    assert store.db.holes() == [Hole("t", P, 5, 9)]
    assert [r.offset for r in store.db.read("t", P, 0, 100)] == [0, 1, 2, 3, 4, *range(10, 15)]


def test_a_store_asks_for_its_hole_and_fills_it(tmp_path: Path) -> None:
    with sim_store(tmp_path / "db") as (store, clock):
        recorded_hole(store, clock)
        sent = run(store, clock, 1.0)
        assert (5, 5) in hole_fetches(sent)
        run(store, clock, 0.1, answers(store, 5, 5))
        got = [(r.offset, r.content) for r in store.db.read("t", P, 0, 100)]
        assert got == [(o, b"r%d" % o) for o in range(15)]
        info = store.db.info("t", P)
        assert info.count == 15 and info.last == 14
        assert store.db.holes() == [] and not store.repair
        assert store.holes_filled == 5 and store.heads() == {KEY: 14}
        # Nothing more is asked for.
        assert hole_fetches(run(store, clock, 30.0)) == []
    # The filled partition reads as one without holes after a restart too.
    with RecordDB(tmp_path / "db") as db:
        assert db.fetch("t", P, 0, 100)[1] == [b"r%d" % o for o in range(15)]


def test_the_hole_survives_a_restart_and_records_not_asked_for_fill_it_too(tmp_path: Path) -> None:
    with sim_store(tmp_path / "db") as (store, clock):
        recorded_hole(store, clock)
    with sim_store(tmp_path / "db") as (store, clock):
        assert store.repair.holes() == [("t", P, 5, 9)]
        # A producer's RECORDs (not a FETCH answer) for offsets in the hole: as welcome.
        run(store, clock, 0.1, records(6, 2))
        assert store.db.holes() == [Hole("t", P, 5, 5), Hole("t", P, 8, 9)]
        assert store.db.info("t", P).count == 12


def test_a_peer_cannot_overwrite_nor_make_the_store_fetch_in_a_loop(tmp_path: Path) -> None:
    with sim_store(tmp_path / "db") as (store, clock):
        recorded_hole(store, clock)
        before = list(store.db.read("t", P, 0, 100))
        # Answers for stored offsets, past the head, over the size limit in the hole.
        evil = answers(store, 0, 5, b"EVIL") + answers(store, 10, 5, b"EVIL")
        big = wire.encode(wire.DirectRecord(store.address, P, "t", 7, b"x" * (store.max_record_bytes + 1)))
        run(store, clock, 0.2, [*evil, big])
        after = list(store.db.read("t", P, 0, 100))
        assert after == before
        # The record over the limit is never written; its offset is given up for good.
        assert store.db.holes() == [Hole("t", P, 5, 6), Hole("t", P, 8, 9)]
        # Nobody answers: over ten minutes a handful of FETCHes per hole, not a loop.
        sent = run(store, clock, 600.0)
        fetches = hole_fetches(sent)
        assert 4 <= len(fetches) <= 2 * 12, fetches
        assert set(fetches) == {(5, 2), (8, 2)}


def test_a_hole_below_the_retention_floor_is_forgotten(tmp_path: Path) -> None:
    from dafka.store.db import Retention, RetentionPolicy

    with sim_store(tmp_path / "db") as (store, clock):
        recorded_hole(store, clock)
        store.retention = RetentionPolicy(Retention(max_age_ms=0))
        store._enforce_retention()
        store.sim_run_commands()
        assert store.db.holes() == [] and not store.repair
        assert hole_fetches(run(store, clock, 30.0)) == []


def test_a_store_asks_for_offsets_it_gave_up_before_its_first_record(tmp_path: Path) -> None:
    """Issue 40, seed 205892: a store that held nothing of a partition gave up
    0..4 (nobody answered for skip_after) and began at 5.  That is a hole it asks
    its peers for, and fills; unless a peer store says it holds none of it
    (retention removed it there), then it asks no more."""
    with sim_store(tmp_path / "db") as (store, clock):
        run(store, clock, store.skip_after + 2, records(5, 5))
        assert store.db.holes() == [Hole("t", P, 0, 4)]
        sent = run(store, clock, 1.0)
        assert (0, 5) in hole_fetches(sent)
        run(store, clock, 0.1, answers(store, 3, 2))
        assert store.db.holes() == [Hole("t", P, 0, 2)]
        assert [r.offset for r in store.db.read("t", P, 0, 100)] == list(range(3, 10))
        assert store.db.info("t", P).first == 3
        # A peer store holds none of the rest: not asked for again.
        run(store, clock, 1.0)
        void = wire.Void(store.address, P, "t", 0, 2, PEER, wire.VOID_STORE)
        run(store, clock, 0.1, [wire.encode(void)])
        assert hole_fetches(run(store, clock, 300.0)) == []
        assert store.db.holes() == [Hole("t", P, 0, 2)]


def test_a_store_that_began_after_others_retention_does_not_fetch_it_again_and_again(tmp_path: Path) -> None:
    """A new store whose peer's retention removed 0..499: the peer answers with what
    follows and says it holds none of 0..499.  The store gives 0..499 up after
    skip_after (a hole), asks for it once more, hears the VOID again, and then
    never asks: it does not fetch the records after it over and over."""
    with sim_store(tmp_path / "db") as (store, clock):
        void = wire.encode(wire.Void(store.address, P, "t", 0, 499, PEER, wire.VOID_STORE))
        run(store, clock, 0.1, [*answers(store, 500, 3), void])
        run(store, clock, store.skip_after + 2, records(503, 2))
        assert store.db.holes() == [Hole("t", P, 0, 499)]
        # Asked for again (within the repair's backoff: the reader's last retries come at
        # most skip_after / 8 apart, so the hole is given up nearer skip_after and the first
        # asks of the repair may fall inside the window above).
        assert (0, 500) in hole_fetches(run(store, clock, 3.0))
        run(store, clock, 0.1, [void])
        assert hole_fetches(run(store, clock, 600.0)) == []
        # A peer joining (it may hold them) is asked again.
        store.retry_missing_now()
        assert set(hole_fetches(run(store, clock, 2.0))) == {(0, 500)}


def acks(sent: list[Any]) -> list[int]:
    return [m.sequence for m in sent if isinstance(m, wire.Ack)]


def test_a_store_acks_its_producer_back_only_up_to_its_hole_and_asks_it_at_once(tmp_path: Path) -> None:
    """tests/test_sim.py ACK_PAST_HOLE_SCHEDULE, on the store alone: 5..9 given up
    while the producer was away; when it is back, its HEAD gets no ACK past 4
    (it may still hold 5..9) but a FETCH for them at once; its answer fills the
    hole, and only then is 14 acknowledged."""
    with sim_store(tmp_path / "db") as (store, clock):
        sent = run(store, clock, 0.1, records(0, 5))
        assert acks(sent)[-1] == 4
        sent = run(store, clock, store.skip_after + 2, records(10, 5))
        assert store.db.holes() == [Hole("t", P, 5, 9)]
        assert all(a <= 4 for a in acks(sent)), acks(sent)
        head = wire.encode(wire.Head("t", P, "t", 14))
        store.sim_producer_hears(P)  # back: subscribed to its FETCHes here
        store.repair._round_at = float("inf")  # no round of the usual repair: the HEAD alone asks
        sent = run(store, clock, 0.0, [head])
        assert all(a <= 4 for a in acks(sent)), acks(sent)
        assert (5, 5) in hole_fetches(sent)
        store.repair._round_at = float("-inf")
        sent = run(store, clock, 0.1, answers(store, 5, 5))
        assert store.db.holes() == [] and acks(sent)[-1] == 14


def test_an_offset_dropped_over_the_size_limit_is_asked_for_no_more_while_its_give_up_commits(tmp_path: Path) -> None:
    """A record over the store's size limit is skipped (a hole) and given up for good
    at once (a fill without content): every copy has its size.  Until that give-up
    commits, the hole is in the database, but the repair must not ask for it: a
    commit slow for a second (a loaded disk) made it FETCH the offset four times
    (tests/test_record_size.py, a full run on a loaded machine), each answer
    dropped and counted again."""
    big = b"x" * (64 * 1024 + 1)
    with sim_store(tmp_path / "db") as (store, clock):
        store.max_record_bytes = 64 * 1024
        live = [*records(0, 2), wire.encode(wire.Record("t", P, "t", 3, big)), *records(4, 1)]
        sent = run(store, clock, 0.0, live)
        assert hole_fetches(sent) == [(2, 2)]  # the tracker asks for 2 and 3 at once
        two = answers(store, 2, 1)
        three = wire.encode(wire.DirectRecord(store.address, P, "t", 3, big))
        run(store, clock, 0.0, [*two, three])  # 3 dropped again: skipped, 4 follows, a hole at 3
        assert store.db.holes() == [Hole("t", P, 3, 3)]
        assert store._to_write is not None and store._to_write.fills  # the give-up, handed to the writer
        # The writer is slow: the give-up commits only after 5 s.
        held = store._take_work()
        assert held is not None
        sent = []
        end = clock.now + 5.0
        while clock.now < end:
            clock.now += 0.05
            store.sim_timers(clock.now)
            store.sim_run_commands()
            sent.extend(wire.decode(f) for f in store.sim_outbox())
        assert hole_fetches(sent) == []
        store._commit(held)
        store.sim_run_commands()
        assert store.db.holes() == [] and not store.repair
        assert hole_fetches(run(store, clock, 30.0)) == []
        assert store.records_dropped_too_large == 2
        assert [r.offset for r in store.db.read("t", P, 0, 100)] == [0, 1, 2, 4]


def test_a_fetch_answer_goes_in_batches_only_once_the_requester_is_known_to_take_them(tmp_path: Path) -> None:
    """A FETCH may come before the requester's subscriptions are read (ZeroMQ
    attaches them first, even during a send): the answer goes as single records
    until they say the requester takes batches, then the rest in batches.  It went
    in batches ("nobody subscribes"), and a requester taking none got them
    (test_a_store_answers_in_batches_only_requesters_that_take_them, pure pass)."""
    requester = "R" * 32
    with sim_store(tmp_path / "db") as (store, clock):
        store.audience = BatchAudience()  # (the simulator's nodes take no batches: a mesh's do)
        run(store, clock, 0.1, records(0, 5000))
        store.sim_feed(wire.encode(wire.Fetch(P, requester, "t", 0, 5000)))
        store._read_data()
        store.do_work()  # the first slice
        first = [wire.decode(f) for f in store.sim_outbox()]
        assert first and all(type(m) is wire.DirectRecord for m in first), {type(m) for m in first}
        # Its subscriptions are read now: a dafka reader's (twin first).
        store.on_subscription(True, wire.BATCH_CAPABLE + b"D" + requester.encode())
        store.on_subscription(True, b"D" + requester.encode())
        while store.has_work():
            store.do_work()
        rest = [wire.decode(f) for f in store.sim_outbox()]
        assert rest and all(type(m) is wire.DirectRecordBatch for m in rest), {type(m) for m in rest}
        got = [m.sequence for m in first] + [m.sequence + i for m in rest for i in range(len(m.contents))]
        assert got == list(range(5000))
