"""When a store repeats an unchanged ACK (sans-IO).

A store sends one cumulative ACK per partition per commit.  An ACK sent before
its producer's subscription reached the store's publisher is lost (a PUB sends
nothing to a reader that did not subscribe yet), so the store answers the
producer's HEADs (one a second) with the committed head again.  On a fleet of
idle producers that answer is most of the store's output and one wake-up a
second for every producer, so an ACK the producer already got is repeated less
and less often: after 1 s, 2 s, 4 s ... up to :data:`MAX_GAP`.  A producer
subscribing to its ACKs (connecting, or connecting again) makes the next HEAD
answered at once.
"""

from __future__ import annotations

FIRST_GAP = 1.0  # seconds before an unchanged ACK is repeated the first time
MAX_GAP = 16.0  # the longest wait between repeats


class AckRepeats:
    """Per partition: the last ACK sent, and when an unchanged one may go again.

    Holds one entry per partition an ACK was sent for (the store's own
    partitions): a hostile subscription only removes entries.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float, float]] = {}  # partition -> (head, next repeat, gap)

    def __len__(self) -> int:
        return len(self._last)

    def sent(self, partition: str, head: int, now: float) -> None:
        """An ACK of ``head`` went out (a new head starts the gaps anew)."""
        last = self._last.get(partition)
        if last is None or last[0] != head:
            self._last[partition] = (head, now + FIRST_GAP, FIRST_GAP)

    def due(self, partition: str, head: int, now: float) -> bool:
        """Whether an ACK of ``head`` should answer a HEAD now (if so, the next
        unchanged repeat waits twice as long)."""
        last = self._last.get(partition)
        if last is None or last[0] != head:
            return True
        if now < last[1]:
            return False
        gap = min(last[2] * 2, MAX_GAP)
        self._last[partition] = (head, now + gap, gap)
        return True

    def forget(self, partition: str) -> None:
        """The producer (re)subscribed, or the partition was dropped: answer its next HEAD."""
        self._last.pop(partition, None)
