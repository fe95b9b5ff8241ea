"""What Dafka mesh readers get of a Kafka gateway partition written by transactions (sans-IO).

Kafka's ``read_committed`` consumers never see an aborted transaction's records
nor the control records (markers) that end transactions, nor anything past the
last stable offset (LSO: the first offset of the oldest transaction still
open).  The gateway gives the mesh's readers the same view:

* records of a transaction are not published live; neither is any record of a
  partition while a transaction is open there (their offsets would sit past
  the LSO);
* the HEAD announced for such a partition stops before the LSO
  (:func:`stable_head`), so readers FETCH only what is stable;
* a FETCH answer (:func:`mesh_steps`) carries the committed records and says
  of every run of aborted records and markers that it holds none for readers
  (a VOID kind 2, the one compacted offsets use): a Dafka consumer passes them
  at once, as it passes a compacted gap.  A reader that does not subscribe to
  VOIDs (a C reference node) gets every stable record instead, markers as
  empty records: it has no way to pass an offset it is not sent.

No clock, no socket: the gateway's shell sends what these functions decide.
"""

from __future__ import annotations

from collections.abc import Sequence

from dafka.store.layout import FLAG_CONTROL, VALUE_HEADER_SIZE

_FLAGS_AT = VALUE_HEADER_SIZE - 1  # a stored value's flags byte

#: One step of a FETCH answer: ``(first, last, values)`` sends those records,
#: ``(first, last, None)`` says the offsets hold none (VOID kind 2).
Step = tuple[int, int, "list[bytes] | None"]


def stable_head(head: int, open_firsts: Sequence[int] | None) -> int:
    """The HEAD to announce on the mesh: ``head`` (the last committed offset), but
    below the first offset of any open transaction (-1: nothing stable yet)."""
    if not open_firsts:
        return head
    return min(head, min(open_firsts) - 1)


def is_marker(value: bytes) -> bool:
    """Whether a stored value is a transaction's control record."""
    return len(value) > _FLAGS_AT and bool(value[_FLAGS_AT] & FLAG_CONTROL)


def mesh_steps(start: int, values: Sequence[bytes], stable_end: int,
               aborted: Sequence[tuple[int, int]], hide: bool = True) -> list[Step]:
    """Split stored ``values`` of offsets ``start, start + 1, ...`` into the steps of a
    FETCH answer, in offset order, none at or past ``stable_end`` (the LSO).

    Offsets in an ``aborted`` range (sorted ``(first, last)`` pairs, as
    :meth:`dafka.kafka.txn.TxnCoordinator.aborted_between` gives them) and
    control records are hidden: runs of them become void steps; runs of the
    others become record steps.  Adjacent hidden offsets make one step.
    ``hide=False`` (a reader that does not take VOIDs: a C reference node, which
    would otherwise stall at the first hidden offset) hides nothing: every
    stable record goes, markers as empty records.
    """
    n = min(len(values), stable_end - start)
    steps: list[Step] = []
    if n <= 0:
        return steps
    if not hide:
        return [(start, start + n - 1, list(values[:n]))]
    ranges = list(aborted)
    ri = 0
    run_first = start
    run_hidden: bool | None = None
    run: list[bytes] = []
    for i in range(n):
        off = start + i
        while ri < len(ranges) and ranges[ri][1] < off:
            ri += 1
        value = values[i]
        hidden = (ri < len(ranges) and ranges[ri][0] <= off) or is_marker(value)
        if hidden != run_hidden:
            if run_hidden is not None:
                steps.append((run_first, off - 1, None if run_hidden else run))
            run_first, run_hidden, run = off, hidden, []
        if not hidden:
            run.append(value)
    steps.append((run_first, start + n - 1, None if run_hidden else run))
    return steps
