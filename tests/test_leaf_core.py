"""Leaf sessions, sans-IO (dafka.core.leaf): the device's link and the endpoint's port."""

from __future__ import annotations

from dafka.core import leafwire, wire
from dafka.core.leaf import Connect, LeafLink, LeafPort, Relay, Reply, RestartHole, Send, Take
from dafka.core.unacked import UnackedWindow

ADDR = "0123456789ABCDEF0123456789ABCDEF"
T = "telemetry"


def welcome(window: int = 3, held: int = -1) -> list[bytes]:
    return leafwire.encode(leafwire.LeafWelcome(ADDR, T, held, window, 1 << 20))


def ack(seq: int) -> list[bytes]:
    return wire.encode(wire.Ack(ADDR, T, seq))


def link(window: UnackedWindow, *endpoints: str, **kw: float) -> LeafLink:
    return LeafLink(T, ADDR, window, list(endpoints or ["a:1"]), **kw)


# ---------------------------------------------------------------- device side


def test_start_connects_and_says_hello_with_what_is_acknowledged() -> None:
    w = UnackedWindow(100, 5)  # a resumed leaf: offsets 0..4 acknowledged earlier
    actions = link(w, "a:1", "b:2").start(0.0)
    assert actions[0] == Connect("a:1")
    assert isinstance(actions[1], Send)
    assert leafwire.decode(actions[1].frames) == leafwire.LeafHello(ADDR, T, 4, 5)


def test_nothing_is_sent_before_the_welcome_then_at_most_the_window() -> None:
    w = UnackedWindow(100)
    lk = link(w)
    lk.start(0.0)
    for i in range(5):
        w.push(b"r%d" % i)
    assert lk.sendable() is None
    lk.on_message(welcome(window=3), 0.1)
    assert lk.sendable() == (0, 2)  # acked -1 + window 3
    lk.sent(2, 0.1)
    assert lk.sendable() is None
    lk.on_message(ack(1), 0.2)
    assert w.acked == 1
    assert lk.sendable() == (3, 4)


def test_acks_for_another_partition_or_beyond_the_last_offset_acknowledge_nothing() -> None:
    w = UnackedWindow(100)
    lk = link(w)
    lk.start(0.0)
    lk.on_message(welcome(), 0.0)
    w.push(b"x")
    lk.on_message(wire.encode(wire.Ack("F" * 32, T, 0)), 0.1)
    lk.on_message(ack(5), 0.1)
    lk.on_message([b"garbage"], 0.1)
    assert w.acked == -1
    assert lk.bad_acks == 1 and lk.bad_input == 2


def test_no_welcome_in_time_fails_over_to_the_next_endpoint_and_around() -> None:
    lk = link(UnackedWindow(10), "a:1", "b:2", connect_timeout=5.0)
    lk.start(0.0)
    assert lk.on_tick(4.9) == []
    actions = lk.on_tick(5.0)
    assert actions[0] == Connect("b:2")
    assert lk.on_tick(15.0)[0] == Connect("a:1")  # (the second waits twice as long: backoff)
    assert lk.failovers == 2


def test_a_refusing_endpoint_is_left_after_the_dwell() -> None:
    lk = link(UnackedWindow(10), "a:1", "b:2", connect_timeout=5.0, min_dwell=1.0)
    lk.start(0.0)
    lk.on_message(wire.encode(wire.StoreStatus(ADDR, "S" * 32, T, 0, "disk full")), 0.2)
    assert lk.status == (False, "disk full")
    assert lk.on_tick(0.5) == []
    assert lk.on_tick(1.0)[0] == Connect("b:2")


def test_no_ack_progress_fails_over_and_resends_everything_unacknowledged() -> None:
    w = UnackedWindow(100)
    lk = link(w, "a:1", "b:2", ack_timeout=10.0)
    lk.start(0.0)
    lk.on_message(welcome(window=100), 0.0)
    for i in range(4):
        w.push(b"r%d" % i)
    lk.sent(3, 1.0)
    lk.on_message(ack(1), 5.0)  # progress: the clock starts again
    assert [a for a in lk.on_tick(14.9) if isinstance(a, Connect)] == []
    actions = lk.on_tick(15.0)
    assert actions[0] == Connect("b:2")
    assert leafwire.decode(actions[1].frames) == leafwire.LeafHello(ADDR, T, 1, 4)  # type: ignore[union-attr]
    lk.on_message(welcome(window=100), 15.1)
    assert lk.sendable() == (2, 3)  # offsets 2 and 3 go again, to b


def test_heads_only_while_records_wait() -> None:
    w = UnackedWindow(100)
    lk = link(w, head_interval=1.0)
    lk.start(0.0)
    lk.on_message(welcome(window=10), 0.0)
    assert lk.on_tick(5.0) == []
    w.push(b"x")
    lk.sent(0, 5.0)
    assert lk.on_tick(5.5) == []
    (send,) = lk.on_tick(6.0)
    assert leafwire.decode(send.frames) == wire.Head(T, ADDR, T, 0)  # type: ignore[union-attr]
    lk.on_message(ack(0), 6.1)
    assert lk.on_tick(8.0) == []


# ---------------------------------------------------------------- endpoint side


def hello(acked: int = -1, nxt: int = 0, addr: str = ADDR) -> list[bytes]:
    return leafwire.encode(leafwire.LeafHello(addr, T, acked, nxt))


def record(seq: int, content: bytes = b"v", addr: str = ADDR) -> list[bytes]:
    return wire.encode(wire.Record(T, addr, T, seq, content))


class Heads(dict[tuple[str, str], int]):
    def __call__(self, subject: str, partition: str) -> int:
        return self.get((subject, partition), -1)


def port(**kw: object) -> tuple[LeafPort, Heads]:
    heads = Heads()
    return LeafPort(heads, address="S" * 32, **kw), heads  # type: ignore[arg-type]


def test_hello_is_welcomed_with_the_stores_head() -> None:
    p, heads = port(window=50)
    heads[(T, ADDR)] = 9
    (reply,) = p.on_message(b"c1", hello(), 0.0)
    assert isinstance(reply, Reply) and reply.peer == b"c1"
    assert leafwire.decode(reply.frames) == leafwire.LeafWelcome(ADDR, T, 9, 50, 1 << 20)


def test_records_are_taken_relayed_and_acked_after_the_commit_only() -> None:
    p, heads = port()
    p.on_message(b"c1", hello(), 0.0)
    out = p.on_message(b"c1", record(0, b"a"), 0.0)
    assert out == [Take(T, ADDR, 0, b"a"), Relay(record(0, b"a"))]
    p.on_message(b"c1", record(1, b"b"), 0.0)
    heads[(T, ADDR)] = 1
    (reply,) = p.on_commit({(T, ADDR): 1})
    assert reply.peer == b"c1" and wire.decode(reply.frames) == wire.Ack(ADDR, T, 1)  # type: ignore[union-attr]
    assert p.on_commit({(T, ADDR): 1}) == []  # said once


def test_the_ack_is_capped_at_what_this_connection_sent() -> None:
    p, heads = port()
    p.on_message(b"c1", hello(), 0.0)
    p.on_message(b"c1", record(0), 0.0)
    (reply,) = p.on_commit({(T, ADDR): 7})  # 1..7 came from elsewhere (the mesh)
    assert wire.decode(reply.frames) == wire.Ack(ADDR, T, 0)  # type: ignore[union-attr]


def test_resent_records_already_committed_are_acked_at_once() -> None:
    p, heads = port()
    heads[(T, ADDR)] = 5  # replicated here from the old endpoint
    p.on_message(b"c1", hello(acked=2, nxt=6), 0.0)
    out = p.on_message(b"c1", record(3), 0.0)
    assert Reply(b"c1", wire.encode(wire.Ack(ADDR, T, 3))) in out


def test_a_head_repeats_the_ack() -> None:
    p, heads = port()
    p.on_message(b"c1", hello(), 0.0)
    p.on_message(b"c1", record(0), 0.0)
    heads[(T, ADDR)] = 0
    assert len(p.on_commit({(T, ADDR): 0})) == 1
    out = p.on_message(b"c1", wire.encode(wire.Head(T, ADDR, T, 0)), 1.0)
    assert out[0] == Relay(wire.encode(wire.Head(T, ADDR, T, 0)))
    assert Reply(b"c1", wire.encode(wire.Ack(ADDR, T, 0))) in out


def test_a_new_connection_of_the_partition_takes_the_acks_over() -> None:
    p, heads = port()
    p.on_message(b"c1", hello(), 0.0)
    p.on_message(b"c1", record(0), 0.0)
    p.on_message(b"c2", hello(), 1.0)
    p.on_message(b"c2", record(0), 1.0)
    (reply,) = p.on_commit({(T, ADDR): 0})
    assert reply.peer == b"c2"
    assert len(p) == 1


def test_hostile_messages_are_dropped_and_a_connection_is_ignored_after_the_limit() -> None:
    p, heads = port(bad_limit=4)
    assert p.on_message(b"h", wire.encode(wire.Ack(ADDR, T, 0)), 0.0) == []  # an endpoint's message
    assert p.on_message(b"h", [b"\xff\x00garbage"], 0.0) == []
    assert p.on_message(b"h", wire.encode(wire.Fetch(ADDR, "R" * 32, T, 0, 5)), 0.0) == []
    assert p.bad == 3
    p.on_message(b"h", hello(), 0.0)
    assert p.on_message(b"h", record(0, addr="F" * 32), 0.0) == []  # another partition: 4th strike
    assert b"h" in p.ignored and len(p) == 0
    assert p.on_message(b"h", hello(), 0.0) == []  # ignored from now on
    # An honest neighbour is unaffected.
    assert len(p.on_message(b"ok", hello(), 0.0)) == 1


def test_records_beyond_the_window_and_oversized_are_refused() -> None:
    p, heads = port(window=2, max_record_bytes=10)
    p.on_message(b"c", hello(), 0.0)
    assert p.on_message(b"c", record(1), 0.0) != []  # acked -1 + window 2
    assert p.on_message(b"c", record(2), 0.0) == []
    assert p.over_window == 1
    assert p.on_message(b"c", record(0, b"x" * 11), 0.0) == []
    assert p.bad == 1


def test_sessions_are_bounded_the_one_silent_longest_goes_and_must_say_hello_again() -> None:
    p, heads = port(max_sessions=2)
    p.on_message(b"a", hello(addr="A" * 32), 0.0)
    p.on_message(b"b", hello(addr="B" * 32), 1.0)
    p.on_message(b"a", record(0, addr="A" * 32), 2.0)  # a was heard last
    p.on_message(b"c", hello(addr="C" * 32), 3.0)
    assert set(p.sessions) == {b"a", b"c"} and p.evicted == 1
    (reply,) = p.on_message(b"b", record(0, addr="B" * 32), 4.0)
    status = wire.decode(reply.frames)  # type: ignore[union-attr]
    assert isinstance(status, wire.StoreStatus) and status.writing == 0 and status.topic == "B" * 32
    assert p.bad == 0 and p.unknown == 1  # not hostile: it says HELLO again


def test_a_leaf_told_it_has_no_session_says_hello_again_on_the_same_connection() -> None:
    w = UnackedWindow(100)
    lk = link(w, "a:1", "b:2")
    lk.start(0.0)
    lk.on_message(welcome(window=10), 0.0)
    w.push(b"x")
    lk.sent(0, 0.5)
    actions = lk.on_message(wire.encode(wire.StoreStatus(ADDR, "S" * 32, T, 0, "no session")), 1.0)
    assert [type(a) for a in actions] == [Send]
    assert leafwire.decode(actions[0].frames) == leafwire.LeafHello(ADDR, T, -1, 1)  # type: ignore[union-attr]
    lk.on_message(welcome(window=10), 1.1)
    assert lk.sendable() == (0, 0)


def test_a_store_that_cannot_write_refuses_the_hello() -> None:
    heads = Heads()
    p = LeafPort(heads, refusal=lambda: "disk full")
    (reply,) = p.on_message(b"a", hello(), 0.0)
    assert wire.decode(reply.frames).writing == 0  # type: ignore[union-attr]
    assert len(p) == 0


def test_silent_sessions_expire() -> None:
    p, heads = port(idle=10.0)
    p.on_message(b"a", hello(addr="A" * 32), 0.0)
    p.on_message(b"b", hello(addr="B" * 32), 5.0)
    assert p.expire(12.0) == 1
    assert list(p.sessions) == [b"b"]
    assert p.on_commit({(T, "A" * 32): 3}) == []


def test_strikes_are_remembered_within_a_bound() -> None:
    p, heads = port(bad_limit=100)
    for i in range(5000):
        p.on_message(b"x%d" % i, [b"junk"], 0.0)
    assert len(p.strikes) <= 4096


def test_device_and_endpoint_together_lose_nothing_across_a_failover() -> None:
    """A whole exchange, both sides sans-IO: endpoint A acknowledges 0..2 and dies
    before acknowledging 3..4; B (which got 0..2 by replication) takes the rest."""
    w = UnackedWindow(100)
    lk = link(w, "a:1", "b:2", ack_timeout=10.0)
    a, a_heads = port(window=100)
    b, b_heads = port(window=100)
    wire_out = lk.start(0.0)

    def deliver(p: LeafPort, peer: bytes, actions: list, now: float) -> list[Take]:
        taken = []
        for act in actions:
            if isinstance(act, Send):
                for r in p.on_message(peer, act.frames, now):
                    if isinstance(r, Reply):
                        lk.on_message(r.frames, now)
                    elif isinstance(r, Take):
                        taken.append(r)
        return taken

    deliver(a, b"d", wire_out, 0.0)
    for i in range(5):
        w.push(b"r%d" % i)
    first, last = lk.sendable()  # type: ignore[misc]
    frames = [Send(wire.encode(wire.Record(T, ADDR, T, s, w.get(s) or b""))) for s in range(first, last + 1)]
    lk.sent(last, 1.0)
    taken = deliver(a, b"d", frames, 1.0)
    assert [t.sequence for t in taken] == [0, 1, 2, 3, 4]
    a_heads[(T, ADDR)] = 2
    for r in a.on_commit({(T, ADDR): 2}):
        lk.on_message(r.frames, 1.1)  # type: ignore[union-attr]
    assert w.acked == 2
    b_heads[(T, ADDR)] = 2  # replicated
    actions = lk.on_tick(11.1)  # A never acknowledges 3..4
    assert actions[0] == Connect("b:2")
    deliver(b, b"d", actions, 11.1)
    first, last = lk.sendable()  # type: ignore[misc]
    assert (first, last) == (3, 4)
    frames = [Send(wire.encode(wire.Record(T, ADDR, T, s, w.get(s) or b""))) for s in range(first, last + 1)]
    lk.sent(last, 11.2)
    taken = deliver(b, b"d", frames, 11.2)
    assert [t.sequence for t in taken] == [3, 4]
    b_heads[(T, ADDR)] = 4
    for r in b.on_commit({(T, ADDR): 4}):
        lk.on_message(r.frames, 11.3)  # type: ignore[union-attr]
    assert w.acked == 4 and len(w) == 0


def test_failovers_without_progress_back_off_and_progress_resets() -> None:
    w = UnackedWindow(100)
    lk = link(w, "a:1", "b:2", connect_timeout=5.0, ack_timeout=10.0)
    lk.start(0.0)
    assert lk.on_tick(5.0)[0] == Connect("b:2")  # 5 s
    assert lk.on_tick(14.9) == []
    assert lk.on_tick(15.0)[0] == Connect("a:1")  # then 10 s
    assert lk.on_tick(34.9) == []
    assert lk.on_tick(35.0)[0] == Connect("b:2")  # then 20 s
    lk.on_message(welcome(window=10), 35.1)
    w.push(b"x")
    lk.sent(0, 35.1)
    lk.on_message(ack(0), 35.2)  # progress: back to the plain timeouts
    w.push(b"y")
    lk.sent(1, 36.0)
    assert [a for a in lk.on_tick(45.9) if isinstance(a, Connect)] == []
    assert lk.on_tick(46.0)[0] == Connect("a:1")


def test_random_failovers_drops_and_crashes_never_lose_an_acknowledged_offset() -> None:
    """Device and two endpoints, sans-IO, under random message loss, endpoint crashes
    (what is not committed is lost) and replication between the endpoints: an offset the
    leaf saw acknowledged is always committed at an endpoint, and in the end every
    offset is, each with its one content."""

    for seed in range(60):
        _random_exchange(seed)


def _random_exchange(seed: int) -> None:
    import random

    rng = random.Random(seed)
    w = UnackedWindow(1000)
    lk = link(w, "a:1", "b:2", connect_timeout=2.0, ack_timeout=3.0, head_interval=0.5)
    committed: dict[str, dict[int, bytes]] = {"a:1": {}, "b:2": {}}
    pending: dict[str, dict[int, bytes]] = {"a:1": {}, "b:2": {}}

    def heads_of(ep: str) -> Heads:
        h = Heads()
        held = committed[ep]
        n = 0
        while n in held:
            n += 1
        if n:
            h[(T, ADDR)] = n - 1
        return h

    ports = {ep: LeafPort(heads_of(ep), window=50) for ep in committed}
    conn = {"ep": "", "id": 0}
    inbox: list[list[bytes]] = []
    now = 0.0

    def to_endpoint(frames: list[bytes]) -> None:
        ep = conn["ep"]
        if rng.random() < 0.05:
            return  # lost
        p = ports[ep]
        p.head = heads_of(ep)
        for act in p.on_message(b"c%d" % conn["id"], frames, now):
            if isinstance(act, Take):
                pending[ep][act.sequence] = act.content
            elif isinstance(act, Reply) and rng.random() > 0.05:
                inbox.append(act.frames)

    def apply(actions: list) -> None:
        for act in actions:
            if isinstance(act, Connect):
                conn["ep"], conn["id"] = act.endpoint, conn["id"] + 1
                inbox.clear()
            else:
                to_endpoint(act.frames)

    apply(lk.start(now))
    for _step in range(400):
        now += rng.choice((0.01, 0.1, 0.5))
        r = rng.random()
        if r < 0.3 and w.next < 60:
            w.push(b"c%d" % w.next)
        elif r < 0.45:  # a commit at one endpoint
            ep = rng.choice(list(committed))
            committed[ep].update(pending[ep])
            pending[ep].clear()
            p = ports[ep]
            p.head = heads_of(ep)
            h = p.head(T, ADDR)
            for act in p.on_commit({(T, ADDR): h} if h >= 0 else {}):
                if conn["ep"] == ep and rng.random() > 0.05:
                    inbox.append(act.frames)  # type: ignore[union-attr]
        elif r < 0.5:  # replication between the endpoints (committed records only)
            src, dst = rng.sample(list(committed), 2)
            committed[dst].update(committed[src])
        elif r < 0.53:  # an endpoint crashes: what it did not commit is gone
            ep = rng.choice(list(committed))
            pending[ep].clear()
            ports[ep] = LeafPort(heads_of(ep), window=50)
            if conn["ep"] == ep:
                inbox.clear()
        while inbox:
            apply(lk.on_message(inbox.pop(0), now))
        span = lk.sendable()
        if span is not None:
            first, last = span
            for seq in range(first, last + 1):
                to_endpoint(wire.encode(wire.Record(T, ADDR, T, seq, w.get(seq) or b"")))
            lk.sent(last, now)
        apply(lk.on_tick(now))
        for seq in range(w.acked + 1):
            assert any(committed[ep].get(seq) == b"c%d" % seq for ep in committed), (seq, seed)
    # Quiet now: no loss, commits everywhere, until everything is acknowledged.
    rng = random.Random(0)
    for _ in range(300):
        if w.acked == w.next - 1:
            break
        now += 0.5
        for ep in committed:
            committed[ep].update(pending[ep])
            pending[ep].clear()
            p = ports[ep]
            p.head = heads_of(ep)
            h = p.head(T, ADDR)
            for act in p.on_commit({(T, ADDR): h} if h >= 0 else {}):
                if conn["ep"] == ep:
                    inbox.append(act.frames)  # type: ignore[union-attr]
        while inbox:
            apply(lk.on_message(inbox.pop(0), now))
        span = lk.sendable()
        if span is not None:
            for seq in range(span[0], span[1] + 1):
                to_endpoint(wire.encode(wire.Record(T, ADDR, T, seq, w.get(seq) or b"")))
            lk.sent(span[1], now)
        apply(lk.on_tick(now))
    assert w.acked == w.next - 1, seed
    merged = {**committed["a:1"], **committed["b:2"]}
    assert all(merged.get(s) == b"c%d" % s for s in range(w.next)), seed


def test_a_hole_caps_the_leafs_ack_and_asks_it_to_send_again_which_fills_it() -> None:
    """As a mesh producer's ACK (dafka.store.holes): never past a recorded hole the
    leaf may hold.  The store gave 2..3 up; the leaf sent 0..5 (they came, 2..3 too
    late: after the hole was recorded).  The ACK stops at 1 and the leaf is asked to
    send again; its HELLO and resend fill the hole, then the ACK reaches 5."""
    holes = {(T, ADDR): (2, 3)}

    def cap(subject: str, partition: str, ack: int) -> int:
        hole = holes.get((subject, partition))
        return hole[0] - 1 if hole is not None and hole[0] <= ack else ack

    p, heads = port(window=100, cap=cap)
    w = UnackedWindow(100)
    lk = link(w)
    for act in lk.start(0.0):
        if isinstance(act, Send):
            (r,) = p.on_message(b"d", act.frames, 0.0)
            lk.on_message(r.frames, 0.0)  # type: ignore[union-attr]
    for i in range(6):
        w.push(b"r%d" % i)
    first, last = lk.sendable()  # type: ignore[misc]
    for s in range(first, last + 1):
        p.on_message(b"d", record(s), 0.1)
    lk.sent(last, 0.1)
    heads[(T, ADDR)] = 5
    out = p.on_commit({(T, ADDR): 5})
    assert [wire.decode(r.frames) for r in out] == [wire.Ack(ADDR, T, 1)]  # type: ignore[union-attr]
    # Its HEAD (the ACK stalls) is answered with the capped ACK and a request to send again.
    out = p.on_message(b"d", wire.encode(wire.Head(T, ADDR, T, 5)), 1.1)
    replies = [wire.decode(r.frames) for r in out if isinstance(r, Reply)]
    assert replies[0] == wire.Ack(ADDR, T, 1)
    assert isinstance(replies[1], wire.StoreStatus) and replies[1].writing == 0 and p.resends == 1
    for r in out:
        if isinstance(r, Reply):
            for act in lk.on_message(r.frames, 1.1):
                (welcome_,) = p.on_message(b"d", act.frames, 1.1)  # type: ignore[union-attr]
                lk.on_message(welcome_.frames, 1.1)  # type: ignore[union-attr]
    assert w.acked == 1 and lk.sendable() == (2, 5)  # everything unacknowledged goes again
    # Asked again at most once per resend_wait.
    out = p.on_message(b"d", wire.encode(wire.Head(T, ADDR, T, 5)), 1.2)
    assert [wire.decode(r.frames) for r in out if isinstance(r, Reply)] == [wire.Ack(ADDR, T, 1)]
    taken = [t.sequence for s in range(2, 6) for t in p.on_message(b"d", record(s), 1.2) if isinstance(t, Take)]
    assert taken == [2, 3, 4, 5]
    del holes[(T, ADDR)]  # the resent 2..3 filled it (committed)
    for r in p.on_commit({(T, ADDR): 5}):
        lk.on_message(r.frames, 1.3)  # type: ignore[union-attr]
    assert w.acked == 5


def test_a_hello_says_what_the_leaf_holds_none_of() -> None:
    said: list[tuple[str, str, int]] = []
    p, heads = port(acked_elsewhere=lambda s, a, n: said.append((s, a, n)))
    p.on_message(b"d", hello(acked=-1), 0.0)
    p.on_message(b"d", hello(acked=7, nxt=9), 0.1)
    assert said == [(T, ADDR, 7)]


def test_next_due_says_when_a_tick_has_something_to_do() -> None:
    w = UnackedWindow(100)
    lk = link(w, connect_timeout=5.0, ack_timeout=10.0, head_interval=1.0)
    lk.start(0.0)
    assert lk.next_due() == 5.0  # no WELCOME by then: the next endpoint
    lk.on_message(welcome(), 0.5)
    assert lk.next_due() is None  # welcomed, nothing to send: no tick until a publish
    w.push(b"a")
    lk.sent(0, 2.0)
    assert lk.next_due() == 3.0  # a HEAD if no ACK came by then
    assert lk.on_tick(2.9) == [] and len(lk.on_tick(3.0)) == 1
    lk.on_message(ack(0), 3.5)
    assert lk.next_due() is None
    assert lk.on_message([wire.encode(wire.Ack(ADDR, T, 0))[0]], 3.6) == []  # (the fast path: an old ACK)
    assert w.acked == 0 and lk.bad_acks == 0


def test_expiry_goes_by_when_a_session_was_last_heard_not_when_it_began() -> None:
    p, heads = port(idle=10.0)
    p.on_message(b"a", hello(addr="A" * 32), 0.0)
    p.on_message(b"b", hello(addr="B" * 32), 1.0)
    p.on_message(b"a", record(0, addr="A" * 32), 9.0)
    assert p.expire(11.5) == 1 and list(p.sessions) == [b"a"]
    assert p.expire(18.9) == 0 and p.expire(19.0) == 1 and len(p) == 0


def test_heads_without_ack_progress_back_off_and_an_ack_resets_them() -> None:
    """An endpoint that is only behind is not sent a HEAD a second by every leaf
    waiting on it (at 10,000 leaves that doubled its load once it fell a second behind)."""
    w = UnackedWindow(100)
    lk = link(w, ack_timeout=100.0, head_interval=1.0)
    lk.start(0.0)
    lk.on_message(welcome(window=10), 0.0)
    w.push(b"a")
    lk.sent(0, 0.0)
    heads = [t / 10 for t in range(1, 300) if lk.on_tick(t / 10)]
    assert heads == [1.0, 3.0, 7.0, 11.0, 15.0, 19.0, 23.0, 27.0]  # 1, 2, 4, then every 4 s
    lk.on_message(ack(0), 29.0)
    w.push(b"b")
    lk.sent(1, 29.0)
    assert lk.next_due() == 30.0


# ---------------------------------------------------------------- restart holes


def restart_void(first: int, last: int, addr: str = ADDR, kind: int = wire.VOID_RESTART) -> list[bytes]:
    return wire.encode(wire.Void(addr, addr, T, first, last, addr, kind))


def test_a_restarted_leaf_states_its_restart_hole_at_the_welcome_of_the_endpoint_its_file_names() -> None:
    # The file: acked 4, reservation 20, endpoint a:1 (the only one that may have
    # acknowledged beyond 4).  a:1 holds up to 7: 8..19 were acknowledged by nobody.
    w = UnackedWindow(100, 20)
    lk = link(w, "a:1", "b:2", resumed=(4, 20, "a:1"))  # type: ignore[arg-type]
    lk.start(0.0)
    (void,) = lk.on_message(welcome(held=7), 0.1)
    assert isinstance(void, Send)
    assert wire.decode(void.frames) == wire.Void(ADDR, ADDR, T, 8, 19, ADDR, wire.VOID_RESTART)
    # Stated again to every endpoint that welcomes it from now on.
    assert lk.failover(1.0)[0] == Connect("b:2")
    assert lk.on_message(welcome(held=3), 1.1) == [void]


def test_no_restart_hole_is_stated_before_the_named_endpoint_welcomed_or_without_one() -> None:
    w = UnackedWindow(100, 20)
    lk = link(w, "a:1", "b:2", resumed=(4, 20, "b:2"))  # type: ignore[arg-type]
    lk.start(0.0)
    # a:1 first: b:2 may have acknowledged up to 19 for all a:1 knows.
    assert lk.on_message(welcome(held=4), 0.1) == []
    lk.failover(1.0)
    (void,) = lk.on_message(welcome(held=-1), 1.1)  # b:2 holds nothing: 5..19
    assert wire.decode(void.frames)[3:5] == (5, 19)  # type: ignore[index]
    # The named endpoint holds everything up to the reservation: no hole.
    lk = link(UnackedWindow(100, 20), "a:1", resumed=(4, 20, "a:1"))  # type: ignore[arg-type]
    lk.start(0.0)
    assert lk.on_message(welcome(held=19), 0.1) == [] and lk.restart_hole is None
    # A clean close saved the exact end (acked + 1 == next), or a file naming no endpoint.
    for resumed in ((19, 20, "a:1"), None):
        lk = link(UnackedWindow(100, 20), "a:1", resumed=resumed)  # type: ignore[arg-type]
        lk.start(0.0)
        assert lk.on_message(welcome(held=-1), 0.1) == []


def test_the_port_takes_a_leafs_restart_hole_cut_at_its_head_and_states_it_once() -> None:
    p, heads = port()
    heads[(T, ADDR)] = 9  # committed here: never in a stated hole
    p.on_message(b"c1", hello(acked=19, nxt=20), 0.0)
    assert p.on_message(b"c1", restart_void(5, 19), 0.1) == [RestartHole(T, ADDR, 10, 19)]
    assert p.restart_holes[(T, ADDR)] == (10, 19)
    assert p.on_message(b"c1", restart_void(5, 19), 0.2) == []  # said again: nothing new
    heads[(T, ADDR)] = 19
    assert p.on_message(b"c1", restart_void(5, 19), 0.3) == []  # all of it held here now
    assert p.bad == 0


def test_a_restart_hole_that_is_not_the_leafs_own_is_hostile() -> None:
    p, heads = port(bad_limit=100)
    assert p.on_message(b"c0", restart_void(0, 5), 0.0) == []  # no session
    p.on_message(b"c1", hello(acked=19, nxt=20), 0.0)
    assert p.on_message(b"c1", restart_void(0, 5, addr="F" * 32), 0.0) == []  # another partition
    assert p.on_message(b"c1", restart_void(0, 5, kind=wire.VOID_STORE), 0.0) == []  # not kind 1
    assert p.on_message(b"c1", restart_void(0, 20), 0.0) == []  # at or past the HELLO's next
    other_source = wire.encode(wire.Void(ADDR, ADDR, T, 0, 5, "S" * 32, wire.VOID_RESTART))
    assert p.on_message(b"c1", other_source, 0.0) == []
    assert p.bad == 5 and not p.restart_holes


def test_restart_holes_are_bounded() -> None:
    p, heads = port(max_sessions=3)
    for i in range(10):
        addr = f"{i:032d}"
        p.on_message(b"c%d" % i, hello(acked=9, nxt=10, addr=addr), 0.0)
        p.on_message(b"c%d" % i, restart_void(0, 9, addr=addr), 0.0)
    assert list(p.restart_holes) == [(T, f"{i:032d}") for i in (7, 8, 9)]


def test_random_crashes_and_failovers_never_state_an_acknowledged_offset_as_a_restart_hole() -> None:
    """A leaf killed and restarted from its identity file at random (the file saved at
    random moments, naming the endpoint in use, written before records go to a new one,
    as the shell does), two endpoints committing, replicating and losing what they did
    not commit, messages lost: no restart hole an endpoint takes ever holds an offset
    the leaf saw acknowledged, and some are stated."""
    stated = 0
    for seed in range(80):
        stated += _random_restarts(seed)
    assert stated > 20, stated


def _random_restarts(seed: int) -> int:
    import random

    rng = random.Random(seed)
    eps = ["a:1", "b:2"]
    committed: dict[str, dict[int, bytes]] = {ep: {} for ep in eps}
    passed: dict[str, set[int]] = {ep: set() for ep in eps}  # restart holes each endpoint passed
    pending: dict[str, dict[int, bytes]] = {ep: {} for ep in eps}
    acked: set[int] = set()  # offsets the leaf saw acknowledged, over all its runs
    stated = 0

    def head_of(ep: str) -> int:
        n = 0
        while n in committed[ep] or n in passed[ep]:
            n += 1
        return n - 1

    def heads_of(ep: str) -> Heads:
        h = Heads()
        if head_of(ep) >= 0:
            h[(T, ADDR)] = head_of(ep)
        return h

    ports = {ep: LeafPort(heads_of(ep), window=50) for ep in eps}
    file = {"acked": -1, "next": 0, "reserved": 0, "endpoint": None}
    conn = {"ep": "", "id": 0}
    inbox: list[list[bytes]] = []
    now = 0.0

    def new_run() -> tuple[UnackedWindow, LeafLink]:
        nxt = max(file["next"], file["reserved"])  # type: ignore[type-var]
        ep = file["endpoint"]
        resumed = (file["acked"], nxt, ep) if isinstance(ep, str) else None
        w = UnackedWindow(1000, nxt)  # type: ignore[arg-type]
        file.update(acked=w.acked, next=w.next, reserved=w.next + 20, endpoint=None)  # the reservation, at start
        lk = LeafLink(T, ADDR, w, eps, connect_timeout=2.0, ack_timeout=3.0, head_interval=0.5, resumed=resumed)  # type: ignore[arg-type]
        return w, lk

    def to_endpoint(frames: list[bytes]) -> None:
        nonlocal stated
        ep = conn["ep"]
        if rng.random() < 0.05:
            return
        p = ports[ep]
        p.head = heads_of(ep)
        for act in p.on_message(b"c%d" % conn["id"], frames, now):
            if isinstance(act, Take):
                pending[ep][act.sequence] = act.content
            elif isinstance(act, RestartHole):
                bad = [s for s in range(act.first, act.last + 1) if s in acked]
                assert not bad, (seed, act, bad[:5])
                stated += 1
                passed[ep].update(range(act.first, act.last + 1))  # the store passes it
            elif isinstance(act, Reply) and rng.random() > 0.05:
                inbox.append(act.frames)

    def apply(actions: list) -> None:
        for act in actions:
            if isinstance(act, Connect):
                # The shell names the endpoint in the file before anything goes to it.
                file.update(acked=w.acked, next=w.next, endpoint=act.endpoint)
                conn["ep"], conn["id"] = act.endpoint, conn["id"] + 1
                inbox.clear()
            else:
                to_endpoint(act.frames)

    w, lk = new_run()
    apply(lk.start(now))
    for _step in range(500):
        now += rng.choice((0.01, 0.1, 0.5))
        r = rng.random()
        if r < 0.3:
            if w.next >= file["reserved"]:  # type: ignore[operator]
                file.update(acked=w.acked, next=w.next, reserved=w.next + 20)
            w.push(b"c%d" % w.next)
        elif r < 0.45:
            ep = rng.choice(eps)
            committed[ep].update(pending[ep])
            pending[ep].clear()
            p = ports[ep]
            p.head = heads_of(ep)
            h = p.head(T, ADDR)
            for act in p.on_commit({(T, ADDR): h} if h >= 0 else {}):
                if conn["ep"] == ep and rng.random() > 0.05:
                    inbox.append(act.frames)  # type: ignore[union-attr]
        elif r < 0.5:
            src, dst = rng.sample(eps, 2)
            committed[dst].update(committed[src])
            passed[dst].update(passed[src])
        elif r < 0.52:
            ep = rng.choice(eps)
            pending[ep].clear()
            ports[ep] = LeafPort(heads_of(ep), window=50)
            if conn["ep"] == ep:
                inbox.clear()
        elif r < 0.56:
            file.update(acked=w.acked, next=w.next)  # a save (after ACKs, now and then)
        elif r < 0.59:
            w, lk = new_run()  # kill -9 and restart: what the file says, no more
            inbox.clear()
            apply(lk.start(now))
            continue
        while inbox:
            before = w.acked
            apply(lk.on_message(inbox.pop(0), now))
            acked.update(range(before + 1, w.acked + 1))
        span = lk.sendable()
        if span is not None:
            for seq in range(span[0], span[1] + 1):
                to_endpoint(wire.encode(wire.Record(T, ADDR, T, seq, w.get(seq) or b"")))
            lk.sent(span[1], now)
        apply(lk.on_tick(now))
    return stated
