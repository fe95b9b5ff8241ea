"""A producer's window of published but not yet acknowledged records, sans-IO.

Offsets are assigned here.  Records stay until a store acknowledges them; ACKs
are cumulative (ACK n acknowledges every offset <= n), so one ACK may cover any
number of publishes.  FETCH requests are answered from the window, each offset
with its own content.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class UnackedWindow:
    """Offsets ``[acked + 1, next)`` with their contents.

    ``capacity`` bounds how many records may wait for an ACK.  With
    ``keep_acked_history`` (for producers running without stores) the window
    instead keeps the newest ``capacity`` records and evicts the oldest, which
    is the only case where records leave without an ACK.
    """

    __slots__ = ("capacity", "next", "acked", "records", "ring", "bytes")

    def __init__(self, capacity: int, next_offset: int = 0, *, ring: bool = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.next = next_offset  # offset the next publish gets
        self.acked = next_offset - 1  # highest acknowledged offset (-1: none)
        self.records: dict[int, bytes] = {}
        self.ring = ring
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.records)

    @property
    def full(self) -> bool:
        return not self.ring and len(self.records) >= self.capacity

    @property
    def last(self) -> int:
        """The last published offset (-1 when nothing was published)."""
        return self.next - 1

    def push(self, content: bytes) -> int:
        """Assign the next offset to ``content``; the caller checks ``full`` first."""
        seq = self.next
        records = self.records
        records[seq] = content
        self.next = seq + 1
        self.bytes += len(content)
        if self.ring and len(records) > self.capacity:
            old = seq - self.capacity
            self.bytes -= len(records.pop(old))
            if old > self.acked:
                self.acked = old  # evicted unacknowledged: only in ring mode
        return seq

    def push_many(self, contents: Sequence[bytes], start: int = 0, stop: int | None = None) -> int:
        """Assign consecutive offsets to ``contents[start:stop]``; the first one.

        The caller checks there is room for all of them (ring windows evict).
        """
        stop = len(contents) if stop is None else stop
        first = self.next
        if self.ring:
            for i in range(start, stop):
                self.push(contents[i])
            return first
        chunk = contents[start:stop]
        # C-level passes: no Python statement per record.
        self.records.update(zip(range(first, first + len(chunk)), chunk, strict=True))
        self.bytes += sum(map(len, chunk))
        self.next = first + len(chunk)
        return first

    def ack(self, seq: int) -> int:
        """Apply a cumulative ACK; return how many offsets became acknowledged.

        An ACK beyond the last published offset acknowledges nothing (the
        caller counts and logs it).
        """
        if seq <= self.acked:
            return 0
        if seq >= self.next:
            return 0  # beyond what was published: a protocol violation, acknowledges nothing
        records = self.records
        pop = records.pop
        freed = 0
        for offset in range(self.acked + 1, seq + 1):
            content = pop(offset, None)
            if content is not None:
                freed += len(content)
        self.bytes -= freed
        newly = seq - self.acked
        self.acked = seq
        return newly

    def get(self, seq: int) -> bytes | None:
        return self.records.get(seq)

    def fetch(self, seq: int, count: int) -> Iterator[tuple[int, bytes]]:
        """Records held for ``[seq, seq + count)``, in ascending order."""
        records = self.records
        start = max(seq, self.acked + 1)
        stop = min(seq + count, self.next)
        for offset in range(start, stop):
            content = records.get(offset)
            if content is not None:
                yield offset, content
