"""BatchAudience: who among a publisher's subscribers takes record batches (sans-IO)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dafka.core import wire
from dafka.core.audience import BatchAudience

TWIN = wire.BATCH_CAPABLE
HELLO = wire.record_prefix(wire.RECORD, "hello", "P" * 32, "hello")
HELLO2 = wire.record_prefix(wire.RECORD, "hello2", "Q" * 32, "hello2")


def dafka_reader(audience: BatchAudience, prefix: bytes, subscribe: bool = True) -> None:
    """What a dafka node's SUB sends: the twin first on subscribe, last on unsubscribe."""
    if subscribe:
        audience.on_subscription(True, TWIN + prefix)
        audience.on_subscription(True, prefix)
    else:
        audience.on_subscription(False, prefix)
        audience.on_subscription(False, TWIN + prefix)


def test_nobody_subscribed_takes_batches() -> None:
    assert BatchAudience().takes_batches(HELLO)


def test_an_answer_goes_in_batches_only_once_the_requesters_subscriptions_say_so() -> None:
    # An answer's requester is a subscriber ZeroMQ may attach before its
    # subscription is read (in the very send): "nobody subscribes" is no reason
    # for batches then.  A store answered a FETCH so, and a requester taking no
    # batches got them (test_a_store_answers_in_batches_only_requesters_that_take_them,
    # a full run's pure pass).
    c_req = wire.record_prefix(wire.DIRECT_RECORD, "R" * 32, "P" * 32, "t")
    dafka_req = wire.record_prefix(wire.DIRECT_RECORD, "S" * 32, "P" * 32, "t")
    audience = BatchAudience()
    assert not audience.answers_in_batches(c_req) and not audience.answers_in_batches(dafka_req)
    audience.on_subscription(True, b"D" + b"R" * 32)  # a C node: no twin
    dafka_reader(audience, b"D" + b"S" * 32)
    assert not audience.answers_in_batches(c_req)
    assert audience.answers_in_batches(dafka_req)
    dafka_reader(audience, b"D" + b"S" * 32, subscribe=False)
    assert not audience.answers_in_batches(dafka_req)  # gone: the cached verdict went with it
    assert not BatchAudience(enabled=False).answers_in_batches(dafka_req)


def test_dafka_readers_take_batches_and_a_c_reader_stops_them() -> None:
    audience = BatchAudience()
    dafka_reader(audience, b"Mhello")
    dafka_reader(audience, b"M")  # a store takes every topic
    assert audience.takes_batches(HELLO)
    audience.on_subscription(True, b"Mhello")  # a C consumer: no twin
    assert not audience.takes_batches(HELLO)
    assert audience.readers(HELLO) == 3
    audience.on_subscription(False, b"Mhello")  # it leaves
    assert audience.takes_batches(HELLO)


def test_a_c_store_taking_every_topic_stops_batches_of_all() -> None:
    audience = BatchAudience()
    dafka_reader(audience, b"Mhello")
    audience.on_subscription(True, b"M")
    assert not audience.takes_batches(HELLO)
    assert not audience.takes_batches(HELLO2)


def test_the_topic_prefix_leak_counts_for_the_longer_topic_only() -> None:
    # A C consumer of "hello" also receives "hello2" records (subscriptions
    # match by prefix): it stops batches of both, not of a topic it cannot see.
    audience = BatchAudience()
    dafka_reader(audience, b"Mhello2")
    audience.on_subscription(True, b"Mhello")
    assert not audience.takes_batches(HELLO2)
    hel = wire.record_prefix(wire.RECORD, "hel", "R" * 32, "hel")
    assert audience.takes_batches(hel)


def test_direct_records_are_judged_per_requester() -> None:
    audience = BatchAudience()
    ours, theirs = "A" * 32, "B" * 32
    dafka_reader(audience, wire.P_DIRECT_RECORD + ours.encode())
    audience.on_subscription(True, wire.P_DIRECT_RECORD + theirs.encode())
    assert audience.takes_batches(wire.record_prefix(wire.DIRECT_RECORD, ours, "P" * 32, "t"))
    assert not audience.takes_batches(wire.record_prefix(wire.DIRECT_RECORD, theirs, "P" * 32, "t"))


def test_an_empty_subscription_reaches_everything_and_stops_batches() -> None:
    audience = BatchAudience()
    audience.on_subscription(True, b"")
    assert not audience.takes_batches(HELLO)


def test_a_subscription_to_single_records_only_stops_batches() -> None:
    # Subscribed to exactly version 1 of the topic: batches would never reach it.
    audience = BatchAudience()
    dafka_reader(audience, b"Mhello")
    audience.on_subscription(True, b"Mhello\x00\x01")
    assert not audience.takes_batches(HELLO)


def test_other_subscriptions_do_not_matter_and_unmatched_unsubscribes_are_ignored() -> None:
    audience = BatchAudience()
    for prefix in (b"Hhello", b"K" + b"P" * 32, b"F" + b"P" * 32, b"Ghello"):
        audience.on_subscription(True, prefix)
    audience.on_subscription(False, b"Mhello")  # never subscribed: no negative count
    audience.on_subscription(False, TWIN + b"Mhello")
    assert audience.takes_batches(HELLO)
    audience.on_subscription(True, b"Mhello")
    assert not audience.takes_batches(HELLO)


def test_disabled_never_takes_batches() -> None:
    audience = BatchAudience(enabled=False)
    dafka_reader(audience, b"Mhello")
    assert not audience.takes_batches(HELLO)


readers = st.lists(
    st.tuples(st.booleans(), st.sampled_from([b"M", b"Mhello", b"Mhello2", b"Mhe", b"Hhello", b""])),
    max_size=8,
)


@given(readers, st.data())
def test_the_verdict_is_that_of_the_readers_present(joined: list[tuple[bool, bytes]], data: st.DataObject) -> None:
    # Model: readers (dafka or C) join, and an arbitrary subset leaves again, in
    # any order; the verdict is True exactly when no C reader left reaches the header.
    audience = BatchAudience()
    for capable, prefix in joined:
        if capable:
            dafka_reader(audience, prefix)
        else:
            audience.on_subscription(True, prefix)
    leaving = data.draw(st.sets(st.sampled_from(range(len(joined))) if joined else st.nothing()))
    for i in data.draw(st.permutations(sorted(leaving))):
        capable, prefix = joined[i]
        if capable:
            dafka_reader(audience, prefix, subscribe=False)
        else:
            audience.on_subscription(False, prefix)
    present = [r for i, r in enumerate(joined) if i not in leaving]
    for header in (HELLO, HELLO2):
        c_reached = any(not capable and header.startswith(prefix) for capable, prefix in present)
        assert audience.takes_batches(header) == (not c_reached)
