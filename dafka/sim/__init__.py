"""Deterministic fault simulation of the mesh (see issue 22).

The real stores (LMDB in temporary directories), consumers and producer
cores run together on a simulated clock and a simulated network that drops,
duplicates, delays and reorders messages; a seeded schedule also kills and
restarts nodes, skips offsets, fills disks and sends hostile messages; it
cuts nodes off and stops stores past skip_after (hole repair between 2 or 3
stores), and runs an edge device whose outbox survives its kills.
Invariants are checked after every step; a failing seed replays exactly and
shrinks to a short schedule.

Modules: :mod:`~dafka.sim.network` (the wire and its faults),
:mod:`~dafka.sim.nodes` (the real nodes without their threads),
:mod:`~dafka.sim.schedule` (schedules), :mod:`~dafka.sim.hosts` (the
machines, and the view of the world the invariants read), :mod:`~dafka.sim.world`
(the scheduler), :mod:`~dafka.sim.invariants` (written against the view: it
does not import the scheduler), :mod:`~dafka.sim.shrink`,
:mod:`~dafka.sim.runner` (the command line), :mod:`~dafka.sim.chaos` (the
soak with real processes).
"""
