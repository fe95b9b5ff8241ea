"""A store's FETCH hearers (Store.owner_hears) may delay giving a hole up, never forever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.nodes.node import new_address
from dafka.store.node import Store
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_producer_that_never_hears_its_fetches_cannot_keep_its_hole_open_forever(
    cfg: NodeConfig, tmp_path: Path, raw_peer
) -> None:
    # A producer that beacons but never subscribes F<address> (hostile, or
    # reaching no store's publisher) kept every hole of its partition, and the
    # records held after it (up to max_held each), in the store for good.
    deaf = raw_peer([], hears_fetches=False)
    with Store(tmp_path / "db", cfg, skip_after=0.2, retry_interval=0.05) as store:
        deaf.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        deaf.send(wire.Record("h", deaf.address, "h", 5, b"h5"))  # 0..4 missing
        deaf.wait_for(lambda p: store.fetches_sent > 3, 5)
        t0 = time.monotonic()
        deaf.wait_for(lambda p: store.skipped == 5, 30)  # beaconing all along
        assert time.monotonic() - t0 > 0.5  # not at skip_after: it waited for the producer a while


def test_subscribing_a_gone_producers_fetches_again_and_again_cannot_keep_its_hole_open(
    cfg: NodeConfig, tmp_path: Path, raw_peer
) -> None:
    # Any peer may subscribe F<someone else's address> on a store's publisher.
    # Each first subscription restarted the give-up clock of that partition's
    # holes, also for a producer the store does not know alive: a peer doing it
    # every skip_after kept the holes (and what is held after them) forever.
    toggler = raw_peer([])
    gone = new_address()  # a producer no beacon says alive (crashed, expired)
    with Store(tmp_path / "db", cfg, skip_after=0.5, retry_interval=0.05) as store:
        toggler.wait_for(lambda p: len(p.peers) >= 1 and p.subscribed(b"M"))
        toggler.send(wire.Record("h", gone, "h", 5, b"h5"))  # 0..4 missing (the gone producer's)
        toggler.wait_for(lambda p: store.fetches_sent > 0, 5)
        prefix = wire.P_FETCH + gone.encode()
        t0 = time.monotonic()
        while store.skipped < 5:
            assert time.monotonic() - t0 < 4.0, "the hole was never given up"
            toggler.sub.setsockopt(zmq.SUBSCRIBE, prefix)
            toggler.pump(0.05)
            toggler.sub.setsockopt(zmq.UNSUBSCRIBE, prefix)
            toggler.pump(0.05)
        assert store.skipped == 5


def test_a_store_remembers_only_address_sized_fetch_subscriptions(cfg: NodeConfig, tmp_path: Path) -> None:
    # A subscription may be up to zmtp.MAX_SUBSCRIPTION bytes (a longer one cuts the
    # connection: tests/test_subscription_bounds.py): a peer subscribing long F... ones
    # over and over must not make the store keep those as FETCH hearers.
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    with Store(tmp_path / "db", cfg) as store:
        try:
            sub.connect(f"tcp://127.0.0.1:{store.port}")
            for i in range(50):
                sub.setsockopt(zmq.SUBSCRIBE, wire.P_FETCH + b"%04d" % i + b"X" * 900)
            marker = new_address()
            sub.setsockopt(zmq.SUBSCRIBE, wire.P_FETCH + marker.encode())  # read after the others
            wait_until(lambda: marker in store._fetch_hearers)
            assert list(store._fetch_hearers) == [marker]
        finally:
            sub.close(0)
