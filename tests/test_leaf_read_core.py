"""Leaf readers, sans-IO (dafka.core.leafread): the endpoint's ReadPort and the device's LeafReader."""

from __future__ import annotations

from dafka.core import leafwire, wire
from dafka.core.leaf import Connect, LeafPort, Reply, Send, Serve
from dafka.core.leafread import READ_AGAIN, Failover, LeafReader, ReadPort

R = "READER0123456789ABCDEF0123456789"  # the reader's address
P = "P" * 32
Q = "Q" * 32
T = "commands/dev-1"
PEER = b"\x00peer1"


class Held:
    """What the store holds: partitions of topics, as ReadPort asks."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, tuple[int, int]]] = {}
        self.asked = 0

    def __call__(self, subject: str, limit: int) -> list[tuple[str, int, int]]:
        self.asked += 1
        return [(p, f, last) for p, (f, last) in sorted(self.parts.get(subject, {}).items())][:limit]


def port(held: Held | None = None, **kw: object) -> tuple[LeafPort, ReadPort]:
    leaf = LeafPort(lambda s, p: -1, address="S" * 32, bad_limit=kw.pop("bad_limit", 16))  # type: ignore[arg-type]
    reads = ReadPort(held or Held(), strike=leaf._strike, address="S" * 32, **kw)  # type: ignore[arg-type]
    leaf.reads = reads
    return leaf, reads


def read(subject: str = T, reader: str = R) -> list[bytes]:
    return leafwire.encode(leafwire.LeafRead(reader, subject))


def decoded(actions: list) -> list:  # type: ignore[type-arg]
    return [leafwire.decode(a.frames) if isinstance(a, Reply) else a for a in actions]


# ---------------------------------------------------------------- endpoint side


def test_read_lists_the_partitions_held_then_commits_push_new_records() -> None:
    held = Held()
    held.parts[T] = {P: (0, 9)}
    leaf, reads = port(held)
    [reading] = decoded(leaf.on_message(PEER, read(), 0.0))
    assert reading == leafwire.LeafReading(R, T, 32, (leafwire.ReadPartition(P, 0, 9),))
    # A commit of the partition: the new records pushed; another topic's: nothing.
    assert reads.on_commit({(T, P): 12, ("other", P): 5}) == [Serve(PEER, R, T, P, 10, 3, reads.max_answer_bytes)]
    assert reads.on_commit({(T, P): 12}) == []  # nothing new
    # A partition new to the topic: from its first record.
    assert reads.on_commit({(T, Q): 1}) == [Serve(PEER, R, T, Q, 0, 2, reads.max_answer_bytes)]


def test_a_commit_of_more_than_max_push_is_announced_not_pushed() -> None:
    leaf, reads = port(max_push=4)
    leaf.on_message(PEER, read(), 0.0)
    [head] = decoded(reads.on_commit({(T, P): 10}))
    assert head == wire.DirectHead(R, P, T, 10)
    assert reads.heads_sent == 1


def test_fetch_answered_bounded_and_only_for_the_readers_partitions() -> None:
    held = Held()
    held.parts[T] = {P: (0, 1000)}
    leaf, reads = port(held)
    leaf.on_message(PEER, read(), 0.0)
    [serve] = leaf.on_message(PEER, wire.encode(wire.Fetch(P, R, T, 5, 100_000)), 0.0)
    assert serve == Serve(PEER, R, T, P, 5, 32, reads.max_answer_bytes)  # count clipped to max_answer
    # Huge positions are just offsets nobody holds (the database answers nothing).
    [serve] = leaf.on_message(PEER, wire.encode(wire.Fetch(P, R, T, 2**64 - 1, 2**32 - 1)), 0.0)
    assert serve.first == 2**64 - 1 and serve.count == 32
    # Another reader address on the connection: hostile, not answered.
    bad = leaf.bad
    assert leaf.on_message(PEER, wire.encode(wire.Fetch(P, "X" * 32, T, 0, 1)), 0.0) == []
    assert leaf.bad == bad + 1
    # A partition it does not hold: not answered (an honest reader that failed over may ask).
    assert leaf.on_message(PEER, wire.encode(wire.Fetch(Q, R, T, 0, 1)), 0.0) == []
    # No session for the topic (the endpoint restarted, it expired): told to say LEAF-READ again.
    for peer, subject in ((PEER, "other"), (b"\x00other", T)):
        [again] = decoded(leaf.on_message(peer, wire.encode(wire.Fetch(P, R, subject, 0, 1)), 0.0))
        assert again == wire.StoreStatus(R, "S" * 32, subject, 0, READ_AGAIN)
    assert leaf.bad == bad + 1 and reads.unknown == 3 and b"\x00other" not in reads.buckets


def test_a_fetch_flood_is_answered_at_the_rate_and_the_rest_dropped() -> None:
    held = Held()
    held.parts[T] = {P: (0, 10)}
    leaf, reads = port(held, fetch_rate=10.0)
    leaf.on_message(PEER, read(), 0.0)
    fetch = wire.encode(wire.Fetch(P, R, T, 0, 5))
    answered = sum(len(leaf.on_message(PEER, fetch, 0.0)) for _ in range(10_000))
    assert answered == 9 and reads.fetches_dropped == 9_991  # (the LEAF-READ took one of the 10)
    # The budget refills with time; an honest reader asks again.
    assert len(leaf.on_message(PEER, fetch, 0.5)) == 1
    assert leaf.bad == 0  # a flood of the reader's own partition is not hostile, only dropped


def test_a_read_flood_lists_partitions_at_the_rate_only() -> None:
    held = Held()
    held.parts[T] = {P: (0, 10)}
    leaf, reads = port(held, fetch_rate=10.0)
    answered = sum(len(leaf.on_message(PEER, read(), 0.0)) for _ in range(10_000))
    assert answered == 10 and held.asked == 10 and reads.reads_dropped == 9_990
    # FETCHes share the budget: none left now.
    assert leaf.on_message(PEER, wire.encode(wire.Fetch(P, R, T, 0, 1)), 0.0) == []


def test_unknown_or_forbidden_topics_and_too_many_topics_are_refused() -> None:
    leaf = LeafPort(lambda s, p: -1, address="S" * 32, keeps=lambda s: s != "not-kept")
    reads = ReadPort(Held(), strike=leaf._strike, may_read=lambda key, s: not s.startswith("secret"),
                     max_per_connection=2)
    leaf.reads = reads
    [status] = decoded(leaf.on_message(PEER, read("not-kept"), 0.0))
    assert isinstance(status, wire.StoreStatus) and status.writing == 0 and "does not keep" in status.reason
    [status] = decoded(leaf.on_message(PEER, read("secret/x"), 0.0))
    assert status.writing == 0 and "may not be read" in status.reason
    assert leaf.bad == 1  # a forbidden topic counts as hostile; a topic not kept does not
    assert isinstance(decoded(leaf.on_message(PEER, read("a"), 0.0))[0], leafwire.LeafReading)
    assert isinstance(decoded(leaf.on_message(PEER, read("b"), 0.0))[0], leafwire.LeafReading)
    [status] = decoded(leaf.on_message(PEER, read("c"), 0.0))
    assert "at most 2 topics" in status.reason
    assert isinstance(decoded(leaf.on_message(PEER, read("a"), 1.0))[0], leafwire.LeafReading)  # again: fine
    assert len(reads) == 2


def test_a_session_reads_at_most_max_partitions() -> None:
    held = Held()
    held.parts[T] = {f"{i:032d}": (0, 0) for i in range(10)}
    leaf, reads = port(held, max_partitions=4)
    [reading] = decoded(leaf.on_message(PEER, read(), 0.0))
    assert len(reading.partitions) == 4 and reads.partitions_over == 1
    assert reads.on_commit({(T, "new"): 3}) == []  # no room for a new one
    assert reads.partitions_over == 2


def test_sessions_are_bounded_expire_and_go_with_a_hostile_connection() -> None:
    leaf, reads = port(max_sessions=3, bad_limit=3)
    for i in range(5):
        leaf.on_message(b"peer%d" % i, read(), float(i))
    assert len(reads) == 3 and reads.evicted == 2
    assert reads.expire(400.0) == 3 and len(reads) == 0 and not reads.by_subject
    leaf.on_message(PEER, read(), 500.0)
    for _ in range(3):
        leaf.on_message(PEER, [b"garbage"], 500.0)
    assert len(reads) == 0  # ignored: its sessions dropped
    assert leaf.on_message(PEER, read(), 501.0) == []  # and nothing more taken from it


def test_reads_and_the_producer_session_share_a_connection() -> None:
    leaf, reads = port()
    hello = leafwire.encode(leafwire.LeafHello(P, "telemetry", -1, 0))
    assert isinstance(decoded(leaf.on_message(PEER, hello, 0.0))[0], leafwire.LeafWelcome)
    assert isinstance(decoded(leaf.on_message(PEER, read(), 0.0))[0], leafwire.LeafReading)
    assert len(leaf) == 1 and len(reads) == 1


def test_a_port_without_readers_refuses_them_as_hostile() -> None:
    leaf = LeafPort(lambda s, p: -1)
    assert leaf.on_message(PEER, read(), 0.0) == [] and leaf.bad == 1


# ---------------------------------------------------------------- device side


def reading(*parts: tuple[str, int, int], reader: str = R, max_answer: int = 32) -> list[bytes]:
    return leafwire.encode(leafwire.LeafReading(reader, T, max_answer,
                                                tuple(leafwire.ReadPartition(*p) for p in parts)))


def record(seq: int, partition: str = P) -> list[bytes]:
    return wire.encode(wire.DirectRecord(R, partition, T, seq, b"c%d" % seq))


def fetches(actions: list) -> list[tuple[str, int, int]]:  # type: ignore[type-arg]
    out = []
    for a in actions:
        if isinstance(a, Send):
            msg = leafwire.decode(a.frames)
            if isinstance(msg, wire.Fetch):
                out.append((msg.topic, msg.sequence, msg.count))
    return out


def test_reader_says_read_fetches_what_it_lacks_in_answers_sized_chunks_then_takes_pushes() -> None:
    rd = LeafReader(T, R, ["a:1", "b:2"])
    start = rd.start(0.0)
    assert start[0] == Connect("a:1") and leafwire.decode(start[1].frames) == leafwire.LeafRead(R, T)
    out: list[tuple[str, int, bytes]] = []
    assert fetches(rd.on_message(reading((P, 0, 99), max_answer=10), 0.1, out)) == [(P, 0, 10)]
    for i in range(9):
        assert rd.on_message(record(i), 0.2, out) == []
    assert fetches(rd.on_message(record(9), 0.2, out)) == [(P, 10, 10)]  # the next chunk once one is in
    assert [o for _, o, _ in out] == list(range(10))
    # A push ahead of what it has: held, and the hole fetched.
    out.clear()
    assert fetches(rd.on_message(record(100), 0.3, out)) == [(P, 10, 10)] or rd.trackers[P].fetch_upto >= 10
    assert out == []


def test_reader_resumes_at_its_position_and_earliest_or_latest_for_new_partitions() -> None:
    out: list[tuple[str, int, bytes]] = []
    rd = LeafReader(T, R, ["a:1"], positions={P: 50})
    rd.start(0.0)
    assert fetches(rd.on_message(reading((P, 0, 60), (Q, 5, 7)), 0.1, out)) == [(P, 50, 11), (Q, 5, 3)]
    latest = LeafReader(T, R, ["a:1"], earliest=False)
    latest.start(0.0)
    assert fetches(latest.on_message(reading((P, 0, 60)), 0.1, out)) == []
    assert latest.positions() == {P: 61}
    # A partition that appears after the READ is read from its first record, latest or not.
    latest.on_message(record(0, Q), 0.2, out)
    assert out == [(Q, 0, b"c0")]


def test_reader_fails_over_when_read_is_not_answered_and_polls_after_silence() -> None:
    rd = LeafReader(T, R, ["a:1", "b:2"], connect_timeout=2.0, poll_interval=5.0)
    rd.start(0.0)
    out: list[tuple[str, int, bytes]] = []
    assert rd.on_tick(1.9, out) == []
    actions = rd.on_tick(2.0, out)
    assert actions[0] == Connect("b:2") and rd.failovers == 1
    rd.on_message(reading((P, 0, -1)), 2.5, out)
    assert rd.on_tick(7.0, out) == []
    again = rd.on_tick(7.5, out)  # 5 s of silence: LEAF-READ again on the same connection
    assert [leafwire.decode(a.frames) for a in again] == [leafwire.LeafRead(R, T)]
    # Not answered within connect_timeout (backoff reset by the READING): the next endpoint.
    assert rd.on_tick(9.5, out)[0] == Connect("a:1")


def test_reader_refused_moves_on_after_the_dwell_and_ignores_foreign_messages() -> None:
    rd = LeafReader(T, R, ["a:1", "b:2"])
    rd.start(0.0)
    out: list[tuple[str, int, bytes]] = []
    refusal = wire.encode(wire.StoreStatus(R, "S" * 32, T, 0, "not allowed"))
    rd.on_message(refusal, 0.1, out)
    assert rd.status == (False, "not allowed")
    assert rd.on_tick(1.0, out)[0] == Connect("b:2")
    rd.on_message(wire.encode(wire.DirectRecord("X" * 32, P, T, 0, b"x")), 1.1, out)  # another reader's
    rd.on_message(wire.encode(wire.Ack(P, T, 3)), 1.1, out)  # a producer's
    rd.on_message([b"garbage"], 1.1, out)
    assert rd.bad_input == 3 and out == []


def test_reader_told_its_session_is_gone_says_read_again_on_the_same_connection() -> None:
    rd = LeafReader(T, R, ["a:1", "b:2"])
    rd.start(0.0)
    out: list[tuple[str, int, bytes]] = []
    rd.on_message(reading((P, 0, 5)), 0.1, out)
    again = rd.on_message(wire.encode(wire.StoreStatus(R, "S" * 32, T, 0, READ_AGAIN)), 0.2, out)
    assert [leafwire.decode(a.frames) for a in again] == [leafwire.LeafRead(R, T)]
    assert rd.failovers == 0 and rd.endpoint == "a:1"


def test_shared_connection_reader_never_connects_and_asks_the_owner_to_fail_over_only_on_silence() -> None:
    rd = LeafReader(T, R, None, connect_timeout=1.0)
    assert [leafwire.decode(a.frames) for a in rd.connected(0.0)] == [leafwire.LeafRead(R, T)]
    silent = rd.on_tick(1.0, [])  # no answer: the endpoint is gone, the producer it rides should move on
    assert isinstance(silent[0], Failover) and [leafwire.decode(a.frames) for a in silent[1:]] == [leafwire.LeafRead(R, T)]
    # A refusal proves the endpoint alive: only LEAF-READ again (after the dwell), no failover.
    rd.on_message(wire.encode(wire.StoreStatus(R, "S" * 32, T, 0, "not allowed")), 1.5, [])
    refused = rd.on_tick(2.5, [])
    assert refused and all(isinstance(a, Send) for a in refused)
    assert not any(isinstance(a, Connect) for a in silent + refused)


# ---------------------------------------------------------------- fuzz: any message sequence, bounds hold

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PEERS = [b"p0", b"p1", b"p2"]
_SUBJECTS = [T, "other", "x" * 255]
_message = st.one_of(
    st.builds(lambda r, s: read(s, r), st.sampled_from([R, "X" * 32, ""]), st.sampled_from(_SUBJECTS)),
    st.builds(lambda p, r, s, q, c: wire.encode(wire.Fetch(p, r, s, q, c)), st.sampled_from([P, Q, "z"]),
              st.sampled_from([R, "X" * 32]), st.sampled_from(_SUBJECTS), st.integers(0, 2**64 - 1),
              st.integers(0, 2**32 - 1)),
    st.lists(st.binary(max_size=40), min_size=1, max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_PEERS), _message, st.floats(0, 1000)), max_size=60),
       st.dictionaries(st.tuples(st.sampled_from(_SUBJECTS), st.sampled_from([P, Q, "new"])),
                       st.integers(-1, 2**40), max_size=4))
def test_fuzz_the_read_port_never_raises_and_stays_bounded(
    steps: list[tuple[bytes, list[bytes], float]], heads: dict[tuple[str, str], int]
) -> None:
    held = Held()
    held.parts[T] = {P: (0, 100), Q: (5, 4)}
    leaf, reads = port(held, max_sessions=4, max_per_connection=2, max_partitions=2, fetch_rate=5.0)
    for peer, frames, now in sorted(steps, key=lambda s: s[2]):
        for act in leaf.on_message(peer, frames, now):
            if isinstance(act, Serve):
                assert act.count <= reads.max_answer and act.max_bytes == reads.max_answer_bytes
        for act in reads.on_commit(heads):
            if isinstance(act, Serve):
                assert act.count <= reads.max_push
        assert len(reads) <= 4 and all(n <= 2 for n in reads.per_peer.values())
        assert all(len(s.pushed) <= 2 for s in reads.sessions.values())
        assert set(reads.buckets) <= set(reads.per_peer) | {b""}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.lists(st.binary(max_size=40), min_size=1, max_size=3),
    st.builds(lambda parts: reading(*parts), st.lists(st.tuples(st.text(max_size=8).filter(lambda t: "\x00" not in t),
                                                                 st.integers(0, 2**63), st.integers(-1, 2**63)),
                                                       max_size=4)),
    st.builds(lambda p, q: wire.encode(wire.DirectRecord(R, p, T, q, b"x")), st.sampled_from([P, Q, ""]),
              st.integers(0, 2**64 - 1)),
    st.builds(lambda p, q: wire.encode(wire.DirectHead(R, p, T, q)), st.sampled_from([P, Q]),
              st.integers(0, 2**64 - 1)),
), max_size=40))
def test_fuzz_the_reader_never_raises_and_delivers_in_order(messages: list[list[bytes]]) -> None:
    rd = LeafReader(T, R, ["a:1"], max_held=50, max_partitions=3)
    rd.start(0.0)
    out: list[tuple[str, int, bytes]] = []
    now = 0.0
    for frames in messages:
        now += 0.1
        for act in rd.on_message(frames, now, out) + rd.on_tick(now, out):
            if isinstance(act, Send):
                msg = leafwire.decode(act.frames)
                if isinstance(msg, wire.Fetch):
                    assert 1 <= msg.count <= rd.max_answer
    assert len(rd.trackers) <= 3
    for partition in {p for p, _, _ in out}:
        offsets = [o for p, o, _ in out if p == partition]
        assert offsets == sorted(set(offsets))  # in order, never twice
