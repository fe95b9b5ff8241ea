"""Consumer groups, sans-IO: assignment, membership expiry, hand-over, positions."""

from __future__ import annotations

import tempfile

from hypothesis import given
from hypothesis import strategies as st

from dafka.core.groups import GroupState, PendingCommits, PositionsQuery, assign
from dafka.store.db import RecordDB

PARTS = [("t", f"P{i}") for i in range(6)]


def state(me: str, now: float = 0.0, settle: float = 1.0) -> GroupState:
    return GroupState("g", me, ["t"], timeout=2.0, settle=settle, release_timeout=2.0, now=now)


def test_assign_round_robin_per_topic() -> None:
    owners = assign({"B": ["t"], "A": ["t"], "C": ["t"]}, PARTS)
    assert [owners[k] for k in PARTS] == ["A", "B", "C", "A", "B", "C"]
    # A member without the topic gets none of its partitions.
    owners = assign({"A": ["t"], "B": ["u"]}, [*PARTS, ("u", "X")])
    assert {owners[k] for k in PARTS} == {"A"} and owners[("u", "X")] == "B"
    assert assign({}, PARTS) == {}


@given(
    st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=6, unique=True),
    st.lists(st.text(min_size=1, max_size=4), max_size=20, unique=True),
)
def test_assign_is_a_function_of_the_view(members: list[str], partitions: list[str]) -> None:
    keys = [("t", p) for p in partitions]
    owners = assign({m: ["t"] for m in members}, keys)
    # Every partition has exactly one owner, the same whatever the order of the inputs.
    assert set(owners) == set(keys) and set(owners.values()) <= set(members)
    assert owners == assign({m: ["t"] for m in reversed(members)}, list(reversed(keys)))
    counts = [list(owners.values()).count(m) for m in members]
    assert max(counts) - min(counts) <= 1


def test_settle_then_take_everything_alone() -> None:
    g = state("A")
    for k in PARTS:
        g.add_partition(k)
    assert not g.add_partition(PARTS[0]) and not g.add_partition(("other", "x"))
    assert g.rebalance(0.5).acquire == []  # still settling: others may be there
    plan = g.rebalance(1.0)
    assert plan.acquire == PARTS and plan.revoke == []
    assert g.acquired(PARTS) == PARTS and g.owned == set(PARTS)
    assert g.rebalance(1.1).acquire == []


def test_hand_over_to_a_joining_member_waits_for_the_release() -> None:
    a, b = state("A"), state("B", now=5.0)
    for g in (a, b):
        for k in PARTS:
            g.add_partition(k)
    a.acquired(a.rebalance(1.0).acquire)
    # B joins: it hears A (claiming all) and A hears B.
    assert b.on_member("A", ["t"], a.claims(), False, 6.0)
    assert a.on_member("B", ["t"], b.claims(), False, 6.0)
    assert b.rebalance(5.5).acquire == []  # settling
    assert b.rebalance(6.5).acquire == []  # settled, but A still claims them
    plan = a.rebalance(6.1)
    assert plan.revoke == [("t", "P1"), ("t", "P3"), ("t", "P5")]
    assert a.owned == {("t", "P0"), ("t", "P2"), ("t", "P4")}
    assert set(a.claims()) == set(PARTS)  # still claimed until the commit is confirmed
    a.released(plan.revoke)
    b.on_member("A", ["t"], a.claims(), False, 7.6)
    plan = b.rebalance(7.6)
    assert plan.acquire == [("t", "P1"), ("t", "P3"), ("t", "P5")]
    b.acquired(plan.acquire)
    assert a.owned.isdisjoint(b.owned) and a.owned | b.owned == set(PARTS)


def test_killed_member_expires_and_its_partitions_move() -> None:
    a = state("A")
    for k in PARTS:
        a.add_partition(k)
    a.on_member("B", ["t"], [("t", "P1")], False, 0.5)
    a.acquired(a.rebalance(1.0).acquire)
    assert a.owned == {("t", "P0"), ("t", "P2"), ("t", "P4")}
    assert a.expire(2.0) == []
    assert a.expire(2.5) == ["B"]
    assert a.rebalance(2.5).acquire == [("t", "P1"), ("t", "P3"), ("t", "P5")]


def test_keep_alive_while_not_reading() -> None:
    a = state("A")
    a.on_member("B", ["t"], [], False, 0.0)
    a.keep_alive(1.5)  # paused reading: B's heartbeats wait unread
    assert a.expire(3.0) == [] and a.expire(3.5) == ["B"]


def test_leave_and_overdue_release() -> None:
    a = state("A")
    a.add_partition(PARTS[0])
    a.on_member("B", ["t"], [], False, 0.0)
    assert a.on_member("B", ["t"], [], True, 0.1)  # goodbye
    assert not a.on_member("B", ["t"], [], True, 0.2)
    assert a.members() == ["A"]
    a.acquired(a.rebalance(1.0).acquire)
    a.on_member("C", ["t"], [], False, 1.0)  # C < A? no: "A" < "C", P0 stays with A
    assert a.rebalance(1.1).revoke == []
    a.on_member("0", ["t"], [], False, 1.2)  # "0" sorts first and takes P0
    plan = a.rebalance(1.2)
    assert plan.revoke == [PARTS[0]]
    assert a.release_overdue(3.0) == [] and a.release_overdue(3.2) == [PARTS[0]]
    assert a.claims() == []
    assert a.leave() == []


def test_positions_query_takes_the_highest_and_waits_a_grace() -> None:
    q = PositionsQuery(1, now=0.0, timeout=2.0, grace=0.1)
    assert not q.done(1.9) and q.done(2.0)
    q = PositionsQuery(1, now=0.0, timeout=2.0, grace=0.1)
    q.on_answer([("t", "p", 5), ("t", "q", 9)], 0.5)
    assert not q.done(0.55)
    q.on_answer([("t", "p", 7), ("t", "q", 3)], 0.55)
    assert q.done(0.6) and q.positions == {("t", "p"): 7, ("t", "q"): 9} and q.answers == 2


def test_pending_commits() -> None:
    c = PendingCommits()
    one = c.new({("t", "p"): 3}, 0.0)
    two = c.new({("t", "p"): 4}, 1.0)
    assert c.confirmed(one) == {("t", "p"): 3}
    assert c.confirmed(one) is None  # a second store's confirmation
    c.forget_older(100.0, 60.0)
    assert len(c) == 0 and c.confirmed(two) is None


def test_positions_table_overwrites_in_place_and_old_stores_open() -> None:
    path = tempfile.mkdtemp()
    db = RecordDB(path)
    db.append([("t", "p", 0, b"x", 1)])
    db.close()
    # A store written before the table existed opens, read-only too, and reads no positions.
    ro = RecordDB(path, readonly=True)
    assert ro.positions("g") == {}
    ro.close()
    db = RecordDB(path)
    assert db.positions("g") == {}
    for i in range(50):
        db.put_positions("g", {("t", "p"): i, ("t", "q"): 2 * i})
    db.put_positions("g2", {("t", "p"): 1})
    db.put_positions("g", {})
    assert db.positions("g") == {("t", "p"): 49, ("t", "q"): 98}
    assert db.positions("g2") == {("t", "p"): 1} and db.positions("h") == {}
    with db._read_txn() as (txn, _):
        assert txn.stat(db._positions_db)["entries"] == 3  # not one per commit
    db.close()
    db = RecordDB(path)
    assert db.positions("g") == {("t", "p"): 49, ("t", "q"): 98}
    db.close()
