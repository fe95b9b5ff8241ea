"""What a parked long poll is answered on (sans-IO), for both gateways.

A Tank consume or a Kafka fetch waiting at a partition's end for ``min_bytes`` is not built
again at every commit (that let a client make each produce cost the gateway as many answers
as it had polls parked): it goes once the partitions it waits on can have made ``min_bytes``
since it parked, by their metadata, or at ``max_wait``.  :func:`arrived` is one partition's
share of that estimate; an estimate in doubt errs to answering early, never late.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Mark", "arrived"]

#: A partition as a poll parked on it: (its last readable offset, its stored bytes, the
#: poll's byte limit on it).
Mark = tuple[int, int, int]


def arrived(mark: Mark, last: int, stored: Callable[[], int], packed: Callable[[], bool],
            per_record: int, overhead: int) -> int:
    """About the bytes one partition adds to a parked answer since ``mark``, within its limit.

    ``last``: its last readable offset now (-1: none); ``stored()``: its stored bytes now;
    ``packed()``: whether a compressed block of another protocol's codec came since (stored
    as a fraction of what it is answered as); both asked only when something came.  Its
    stored bytes since, plus ``per_record`` a record and ``overhead``, estimate it.  When
    they cannot (its stored bytes went down: DeleteRecords, retention or compaction removed
    some; compressed blocks of the other codec; its last offset went back: deleted and
    created again) it counts as its whole limit once anything is readable."""
    head, nbytes, cap = mark
    if last > head:
        now = stored()
        if now < nbytes or packed():
            return cap
        return min(cap, now - nbytes + per_record * (last - head) + overhead)
    return cap if 0 <= last < head else 0
