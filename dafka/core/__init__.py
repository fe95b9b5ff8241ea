"""The sans-IO protocol core of dafka.

Plain objects: events in, actions out.  No sockets, no threads, no clocks
(time comes in as an argument); the I/O shells in :mod:`dafka.nodes` drive
them, and the simulator in :mod:`dafka.sim` runs them deterministically.

* :mod:`~dafka.core.wire`: the Dafka wire codec, byte-exact with the reference C implementation.
* :mod:`~dafka.core.gaps`: a consumer's per-partition delivery state (order, gaps, fetches).
* :mod:`~dafka.core.unacked`: a producer's window of published, not yet acknowledged records.
* :mod:`~dafka.core.peers`: peer discovery from tower beacons.
* :mod:`~dafka.core.groups`: consumer groups: membership, assignment, hand-over, positions.
* :mod:`~dafka.core.resume`: how a producer restarted from an identity file continues its partition.
* :mod:`~dafka.core.audience`: which subscribers of a publisher take record batches.
* :mod:`~dafka.core.beacon`: interest beacons, so that nodes meet only the peers they need.
* :mod:`~dafka.core.reach`: reachability: where a node says it is, how the tower sees it.
"""
