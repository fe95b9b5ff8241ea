"""Which subscribers of a publisher take record batches: a sans-IO counter.

Batches (RECORD / DIRECT-RECORD version 2, :class:`dafka.core.wire.RecordBatch`)
are this implementation's; the C reference drops them.  A dafka reader says
it takes them by subscribing, beside each record subscription (``M...``,
``D...``), the same prefix behind :data:`dafka.core.wire.BATCH_CAPABLE` (its
"batch twin"; no message starts with that byte, so the twin never matches
anything).  A publisher XPUB with ``XPUB_VERBOSER`` passes every subscribe
and unsubscribe of every peer on to the application, including those of a
peer that disconnects, so the publisher can count them: a message may go as
a batch only when every subscription that matches its header has its twin.
A C node's subscription has none, so a mesh with a C reader gets the
reference's one record a message, and a plain mesh of dafka nodes gets
batches.

Readers subscribe the twin first and unsubscribe it last, so a dafka reader
is never counted without it; a C node that subscribes is seen at the next
read of the publisher's subscriptions (what it got as batches before that
it drops, and fetches as single records like any other gap).
"""

from __future__ import annotations

from dafka.core import wire


class BatchAudience:
    """Counts an XPUB's subscriptions; says whether a header's readers all take batches.

    ``enabled=False`` (``[node] batches = false``) never allows batches.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._plain: dict[bytes, int] = {}  # subscription prefix -> how many peers hold it
        self._twins: dict[bytes, int] = {}  # the same, for batch twins (marker removed)
        self._verdicts: dict[bytes, bool] = {}  # header prefix -> takes_batches (cleared on change)
        self._heard: dict[bytes, bool] = {}  # header prefix -> has_readers (cleared on change)

    def on_subscription(self, subscribe: bool, prefix: bytes) -> None:
        """One (un)subscription read off the XPUB."""
        if prefix[:1] == wire.BATCH_CAPABLE:
            counts, prefix = self._twins, prefix[1:]
        else:
            counts = self._plain
        n = counts.get(prefix, 0) + (1 if subscribe else -1)
        if n > 0:
            counts[prefix] = n
        else:
            counts.pop(prefix, None)  # never negative: an unmatched unsubscribe is ignored
        self._verdicts.clear()
        self._heard.clear()

    def takes_batches(self, header: bytes) -> bool:
        """Whether every subscriber that a message starting with ``header`` reaches takes batches.

        ``header`` is the single-record header prefix (:func:`dafka.core.wire.record_prefix`):
        a subscription that reaches single records but not batches has no twin.
        True when nobody subscribes at all: nobody can be harmed.
        """
        verdict = self._verdicts.get(header)
        if verdict is None:
            twins = self._twins
            verdict = self.enabled and all(
                twins.get(prefix, 0) >= count
                for prefix, count in self._plain.items()
                if header.startswith(prefix)
            )
            self._verdicts[header] = verdict
        return verdict

    def has_readers(self, header: bytes) -> bool:
        """Whether any subscription reaches a message starting with ``header`` (I/O thread;
        remembered until the subscriptions change)."""
        heard = self._heard.get(header)
        if heard is None:
            heard = self._heard[header] = any(header.startswith(prefix) for prefix in self._plain)
        return heard

    def answers_in_batches(self, header: bytes) -> bool:
        """As :meth:`takes_batches`, for an answer to one requester (DIRECT-RECORDs):
        False also while no subscription that reaches ``header`` was read.

        ZeroMQ attaches a subscriber's subscription before the application
        reads it (even during the send that the verdict chose the form of), so
        "nobody subscribes" only means the requester's subscription was not
        read yet: a requester that takes no batches (a C node) would get them.
        """
        return self.has_readers(header) and self.takes_batches(header)

    def readers(self, header: bytes) -> int:
        """How many subscriptions reach ``header`` (for diagnostics and tests; any thread)."""
        plain = list(self._plain.items())  # a snapshot: the I/O thread may be counting meanwhile
        return sum(count for prefix, count in plain if header.startswith(prefix))
