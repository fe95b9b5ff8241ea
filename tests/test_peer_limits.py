"""PeerTable's bounds (issue 35.12), sans-IO: what a tower's beacons can make a node do."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.core.beacon import PRODUCER, Interest
from dafka.core.peers import Connect, Disconnect, PeerLimits, PeerTable


def table(**limits: float) -> PeerTable:
    return PeerTable("ME", 4.0, Interest.consumer(["t"]), PeerLimits(**limits))  # type: ignore[arg-type]


def beacon(t: PeerTable, i: int, now: float) -> list:
    return t.on_beacon(f"P{i:031d}", f"tcp://10.0.0.1:{1000 + i}", now, PRODUCER, b"t")


def connects(actions: list) -> int:
    return sum(isinstance(a, Connect) for a in actions)


def test_new_connections_are_rate_limited_and_the_rest_wait() -> None:
    t = table(connect_rate=10.0, connect_burst=5, max_unverified=1000)
    assert sum(connects(beacon(t, i, 0.0)) for i in range(20)) == 5  # the burst
    assert len(t) == 5 and t.waiting == 15 and t.refused == 15
    assert connects(t.admit_waiting(0.5)) == 5  # 10 a second
    assert connects(t.admit_waiting(0.5)) == 0
    # The most recently heard wait least: a live peer beacons again, a made-up one may not.
    beacon(t, 10, 0.6)
    assert [a.address for a in t.admit_waiting(0.7)] == [f"P{10:031d}"]


def test_a_handshake_gives_the_token_back_so_a_real_mesh_joins_at_once() -> None:
    t = table(connect_rate=1.0, connect_burst=5, max_unverified=1000)
    joined = 0
    for i in range(1000):
        actions = beacon(t, i, 0.0)
        joined += connects(actions)
        for a in actions:
            t.on_verified(a.endpoint)  # the peer answered
    assert joined == 1000 and t.unverified == 0 and t.waiting == 0


def test_unverified_connections_in_flight_are_capped() -> None:
    t = table(max_unverified=3, connect_burst=100)
    assert sum(connects(beacon(t, i, 0.0)) for i in range(10)) == 3
    t.on_verified("tcp://10.0.0.1:1000")
    assert t.verified(f"P{0:031d}") and t.unverified == 2
    assert connects(t.admit_waiting(0.1)) == 1


def test_the_peer_table_is_capped() -> None:
    t = table(max_peers=4, connect_burst=100)
    for i in range(10):
        for a in beacon(t, i, 0.0):
            t.on_verified(a.endpoint)
    assert len(t) == 4 and t.waiting == 6
    assert t.admit_waiting(0.1) == []  # verified peers are never evicted for newcomers


def test_the_waiting_list_is_capped_forgetting_the_least_recently_heard() -> None:
    t = table(max_unverified=0, max_waiting=3)
    for i in range(5):
        beacon(t, i, float(i))
    assert t.waiting == 3
    assert list(t._waiting) == [f"P{i:031d}" for i in (2, 3, 4)]


def test_an_unverified_peer_that_keeps_failing_is_dropped_and_benched() -> None:
    t = table(max_failures=3, max_failures_alone=20, bench=30.0, max_unverified=1)
    beacon(t, 1, 0.0)
    endpoint = "tcp://10.0.0.1:1001"
    assert t.on_failed(endpoint, 3, 0.5) == []  # nobody waits: it may keep trying (diagnostics name it)
    beacon(t, 2, 0.5)  # now one waits
    assert t.on_failed(endpoint, 2, 0.5) == []
    assert t.on_failed(endpoint, 3, 0.6) == [Disconnect(endpoint, f"P{1:031d}")]
    assert len(t) == 0 and t.dropped_unverified == 1
    assert beacon(t, 1, 10.0) == [] and t.benched_beacons == 1  # benched
    assert connects(beacon(t, 1, 31.0)) == 1  # the bench is over


def test_a_verified_peer_is_not_dropped_for_failures() -> None:
    t = table(max_failures=1)
    beacon(t, 1, 0.0)
    t.on_verified("tcp://10.0.0.1:1001")
    assert t.on_failed("tcp://10.0.0.1:1001", 5, 1.0) == []  # a live peer's blip: ZeroMQ reconnects


def test_a_slow_unverified_peer_gives_its_slot_up_to_waiting_ones() -> None:
    t = table(max_unverified=1, verify_within=10.0)
    beacon(t, 1, 0.0)
    beacon(t, 2, 0.0)
    assert t.waiting == 1
    assert t.admit_waiting(5.0) == []  # still within its time
    beacon(t, 2, 9.0)  # (it beacons on)
    actions = t.admit_waiting(10.5)
    assert actions == [Disconnect("tcp://10.0.0.1:1001", f"P{1:031d}"), Connect("tcp://10.0.0.1:1002", f"P{2:031d}")]


def test_waiting_and_benched_peers_expire() -> None:
    t = table(max_unverified=0, bench=1.0)
    beacon(t, 1, 0.0)
    assert t.waiting == 1
    t.expire(5.0)
    assert t.waiting == 0


def test_a_flood_of_made_up_peers_costs_a_bounded_number_of_attempts() -> None:
    """5,000 made-up producers relayed every second for 30 s, every connection failing:
    the attempts ZeroMQ makes stay near connect_rate x (max_failures + 1)."""
    lim = PeerLimits()
    t = PeerTable("ME", 4.0, Interest.consumer(["t"]), lim)
    attempts = 0
    in_flight: dict[str, int] = {}
    now = 0.0
    for step in range(30 * 20):  # 50 ms ticks
        now = step * 0.05
        if step % 20 == 0:
            for i in range(5_000):
                for a in beacon(t, i, now):
                    if isinstance(a, Connect):
                        in_flight[a.endpoint] = 0
        for endpoint in list(in_flight):  # every attempt fails once a tick (worse than ZeroMQ's backoff)
            in_flight[endpoint] += 1
            attempts += 1
            for a in t.on_failed(endpoint, in_flight[endpoint], now):
                in_flight.pop(a.endpoint, None)
        for a in t.admit_waiting(now):
            if isinstance(a, Connect):
                in_flight[a.endpoint] = 0
            else:
                in_flight.pop(a.endpoint, None)
    assert len(t) <= lim.max_peers and t.unverified <= lim.max_unverified
    assert attempts / 30 < (lim.connect_burst / 30 + lim.connect_rate) * (lim.max_failures + 1)
    assert t.waiting <= lim.max_waiting


def test_a_failing_unverified_peer_is_dropped_alone_after_more_attempts() -> None:
    t = table(max_failures=3, max_failures_alone=20)
    beacon(t, 1, 0.0)
    assert t.on_failed("tcp://10.0.0.1:1001", 19, 60.0) == []
    assert t.on_failed("tcp://10.0.0.1:1001", 20, 61.0) == [Disconnect("tcp://10.0.0.1:1001", f"P{1:031d}")]


def test_peers_sharing_an_endpoint_are_verified_by_its_one_handshake() -> None:
    """ZeroMQ makes one connection an endpoint: a handshake there answers for every address at it."""
    t = table(max_unverified=2, connect_burst=2, connect_rate=0.001)
    for i in range(2):
        t.on_beacon(f"P{i:031d}", "tcp://10.0.0.1:9", 0.0, PRODUCER, b"t")
    t.on_verified("tcp://10.0.0.1:9")
    assert t.unverified == 0
    for i in range(2, 50):
        assert connects(t.on_beacon(f"P{i:031d}", "tcp://10.0.0.1:9", 0.0, PRODUCER, b"t")) == 1
    assert len(t) == 50 and t.unverified == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["beacon", "verified", "failed", "admit", "expire", "forget"]),
                  st.integers(0, 40), st.integers(0, 25)),
        max_size=300,
    )
)
def test_the_bounds_hold_whatever_the_events(events: list[tuple[str, int, int]]) -> None:
    lim = PeerLimits(max_peers=12, max_unverified=5, connect_rate=3.0, connect_burst=4, max_failures=2,
                     max_failures_alone=4, verify_within=1.0, bench=2.0, max_waiting=7)
    t = PeerTable("ME", 2.0, Interest.consumer(["t"]), lim)
    now = 0.0
    connected: set[str] = set()
    for op, i, n in events:
        now += 0.1
        endpoint = f"tcp://10.0.0.1:{1000 + i % 30}"  # some addresses share an endpoint
        if op == "beacon":
            actions = t.on_beacon(f"P{i:031d}", endpoint, now, PRODUCER, b"t")
        elif op == "verified":
            t.on_verified(endpoint)
            actions = []
        elif op == "failed":
            actions = t.on_failed(endpoint, n, now)
        elif op == "admit":
            actions = t.admit_waiting(now)
        elif op == "expire":
            actions = t.expire(now + n * 0.2)
        else:
            actions = t.forget(f"P{i:031d}")
        for a in actions:
            if isinstance(a, Connect):
                connected.add(a.address)
            else:
                connected.discard(a.address)
        assert len(t) <= lim.max_peers and t.unverified <= lim.max_unverified and t.waiting <= lim.max_waiting
        assert set(t._peers) == connected  # every peer held was connected, every one dropped disconnected
        assert set(t._unverified) <= set(t._peers)
        assert not set(t._waiting) & set(t._peers)  # a peer waits or is held, never both
