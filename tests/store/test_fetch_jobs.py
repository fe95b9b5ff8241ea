"""A store's FETCH answers in progress are bounded, whatever a peer sends.

Driven deterministically through the simulator's SimStore (the real Store,
real LMDB, no I/O thread): the FETCHes are read and nothing is served between
them, as when the requester reads nothing and the store's sends block.
"""

from __future__ import annotations

from pathlib import Path

from dafka.core import wire
from dafka.store.node import MAX_JOBS_PER_REQUESTER
from tests.store.test_hole_repair import KEY, P, records, run, sim_store

REQUESTER = "B" * 32


def test_a_peer_cannot_queue_an_answer_per_fetch_it_sends(tmp_path: Path) -> None:
    with sim_store(tmp_path / "db") as (store, clock):
        run(store, clock, 0.1, records(0, 100))
        assert store.heads() == {KEY: 99}
        # An answer in progress at 99, then ranges below it: each would be an
        # answer of its own (4,000 of them).  Read, not served.
        store.sim_feed(wire.encode(wire.Fetch(P, REQUESTER, "t", 99, 1)))
        for i in range(4000):
            store.sim_feed(wire.encode(wire.Fetch(P, REQUESTER, "t", i % 98, 1)))
        store._read_data()
        store.sim_run_commands()
        assert 0 < len(store._jobs) <= MAX_JOBS_PER_REQUESTER
        assert store.fetches_refused >= 4000 - MAX_JOBS_PER_REQUESTER
        # Served, then a FETCH is answered again.
        sent = run(store, clock, 0.2)
        assert not store._jobs and not store._job_counts
        sent = run(store, clock, 0.1, [wire.encode(wire.Fetch(P, REQUESTER, "t", 42, 3))])
        assert [m.sequence for m in sent if isinstance(m, wire.DirectRecord)] == [42, 43, 44]
