"""The classic group coordinator, sans-IO: times passed in, answers out."""

from __future__ import annotations

from dafka.kafka.codec import Err
from dafka.kafka.groups import Coordinator

P = [("range", b"meta")]


def join(c: Coordinator, token: str, now: float, member: str = "", protocols=P, session: float = 10.0):
    return {a.token: a.fields for a in c.join(token, now, "g", member, token, "consumer", protocols, session, 5.0)}


def test_two_members_one_leader_assignments_relayed() -> None:
    c = Coordinator()
    a = join(c, "a", 0.0)["a"]
    assert a["error_code"] == 0 and a["generation_id"] == 1 and a["leader"] == a["member_id"]
    ma = a["member_id"]
    assert c.sync("sa", 0.1, "g", ma, 1, [(ma, b"all")])[0].fields["assignment"] == b"all"
    # b joins: a rebalance; a learns it from its heartbeat, rejoins, and both get answers.
    assert join(c, "b", 1.0) == {}
    assert c.heartbeat(1.1, "g", ma, 1) == Err.REBALANCE_IN_PROGRESS
    answers = join(c, "a2", 1.2, ma)
    assert set(answers) == {"a2", "b"}
    mb = answers["b"]["member_id"]
    assert answers["a2"]["generation_id"] == answers["b"]["generation_id"] == 2
    assert answers["a2"]["leader"] == ma and len(answers["a2"]["members"]) == 2 and answers["b"]["members"] == []
    assert c.sync("sb", 1.3, "g", mb, 2, []) == []  # waits for the leader
    out = {x.token: x.fields for x in c.sync("sa2", 1.4, "g", ma, 2, [(ma, b"p0"), (mb, b"p1")])}
    assert out["sa2"]["assignment"] == b"p0" and out["sb"]["assignment"] == b"p1"
    assert c.heartbeat(1.5, "g", mb, 2) == Err.NONE
    assert c.heartbeat(1.5, "g", mb, 1) == Err.ILLEGAL_GENERATION


def test_a_silent_member_times_out_and_the_group_rebalances() -> None:
    c = Coordinator()
    ma = join(c, "a", 0.0, session=2.0)["a"]["member_id"]
    c.sync("sa", 0.0, "g", ma, 1, [(ma, b"x")])
    join(c, "b", 0.5, session=2.0)
    answers = join(c, "a2", 0.6, ma, session=2.0)
    mb = answers["b"]["member_id"]
    c.sync("sa2", 0.7, "g", ma, 2, [(ma, b"p0"), (mb, b"p1")])
    c.sync("sb", 0.7, "g", mb, 2, [])
    # a goes silent; b heartbeats.
    for t in (1.0, 1.5, 2.0, 2.5):
        assert c.heartbeat(t, "g", mb, 2) == Err.NONE
        assert c.tick(t) == []
    assert c.tick(2.8) == []  # a expired (2.0 s after 0.7): a rebalance starts
    assert ma not in c.groups["g"].members
    assert c.heartbeat(2.9, "g", mb, 2) == Err.REBALANCE_IN_PROGRESS
    again = join(c, "b2", 3.0, mb, session=2.0)["b2"]
    assert again["generation_id"] == 3 and again["leader"] == mb


def test_leave_and_errors() -> None:
    c = Coordinator()
    ma = join(c, "a", 0.0)["a"]["member_id"]
    assert join(c, "x", 0.0, "nobody")["x"]["error_code"] == Err.UNKNOWN_MEMBER_ID
    assert join(c, "y", 0.0, protocols=[("other", b"")])["y"]["error_code"] == Err.INCONSISTENT_GROUP_PROTOCOL
    assert c.check_member("g", ma, 1) == Err.NONE
    assert c.check_member("g", "", -1) == Err.ILLEGAL_GENERATION  # a live group
    codes, _ = c.leave(1.0, "g", [ma, "ghost"])
    assert codes == [Err.NONE, Err.UNKNOWN_MEMBER_ID]
    assert c.check_member("g", "", -1) == Err.NONE  # empty now: simple commits allowed


def test_a_member_that_does_not_rejoin_is_dropped_at_the_rebalance_timeout() -> None:
    c = Coordinator()
    ma = join(c, "a", 0.0)["a"]["member_id"]
    c.sync("sa", 0.0, "g", ma, 1, [(ma, b"x")])
    assert join(c, "b", 1.0) == {}
    answers = {x.token: x.fields for x in c.tick(6.5)}  # rebalance timeout 5 s: a dropped
    assert answers["b"]["error_code"] == 0 and answers["b"]["leader"] == answers["b"]["member_id"]


def test_a_huge_rebalance_timeout_is_cut_to_the_coordinators_cap() -> None:
    """A JoinGroup's rebalance timeout was taken as given: 2^31-1 ms held the group's next
    rebalance for ~24 days, every other member waiting on a member that never rejoins."""
    c = Coordinator()
    c.max_rebalance_timeout = 60.0
    [a] = c.join("a", 0.0, "g", "", "a", "consumer", P, 10.0, (2**31 - 1) / 1000.0)
    ma = a.fields["member_id"]
    c.sync("sa", 0.0, "g", ma, 1, [(ma, b"x")])
    assert c.join("b", 1.0, "g", "", "b", "consumer", P, 10.0, 5.0) == []  # a rebalance starts
    for t in range(2, 61, 3):  # a heartbeats (told to rejoin) but never rejoins
        assert c.heartbeat(float(t), "g", ma, 1) == Err.REBALANCE_IN_PROGRESS
        assert c.tick(t + 0.5) == []
    answers = {x.token: x.fields for x in c.tick(62.0)}  # 1 s + the 60 s cap: a is dropped
    assert answers["b"]["error_code"] == 0 and answers["b"]["leader"] == answers["b"]["member_id"]


def test_the_rebalance_cap_defaults_to_five_minutes() -> None:
    assert Coordinator().max_rebalance_timeout == 300.0
