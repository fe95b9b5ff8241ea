"""Python's cyclic garbage collector in long-running server processes.

A store with thousands of leaf sessions and partition trackers holds tens of
thousands of long-lived objects, which every full collection of the cyclic GC
walks while it holds the GIL: every record in flight in the process waits
meanwhile (measured at 10,000 leaves: full collections of 0.2-0.7 s on a loaded
machine, in the store and in each process of the bench's devices).  Reference
counting frees almost everything the per-record path makes; the cyclic GC only
has to find cycles.  So, once a process has started:

* :func:`gc.freeze` moves every object made so far (modules, classes, the
  node's own structures) to the permanent generation, which collections no
  longer walk (they are not garbage: a cycle among them stays, as it would
  until the next full collection anyway);
* the youngest generation is collected after ``GEN0`` net allocations instead
  of 700, so that what a record's path makes dies by reference counting before
  a collection promotes it to an older generation (and so fewer full
  collections come due).
"""

from __future__ import annotations

import gc

GEN0 = 10_000  # allocations between collections of the youngest generation (CPython's default: 700)


def settle() -> None:
    """After start-up: freeze what exists, collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0, gen1, gen2)
