"""A producer's window of published but not yet acknowledged records, sans-IO.

Offsets are assigned here.  Records stay until a store acknowledges them; ACKs
are cumulative (ACK n acknowledges every offset <= n), so one ACK may cover any
number of publishes.  FETCH requests are answered from the window, each offset
with its own content.

The window always holds exactly the offsets ``[acked + 1, next)``, so it is
kept as runs ("chunks") of consecutive contents rather than one entry per
record: pushing a batch, acknowledging and ring eviction cost a few Python
statements per chunk; the per-record work (slicing, summing lengths) runs in C.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterator, Sequence

CHUNK = 4096
"""Most records one chunk holds: bounds the acknowledged contents a partly
acknowledged head chunk keeps alive, and the slicing a partial ACK does."""


class UnackedWindow:
    """Offsets ``[acked + 1, next)`` with their contents.

    ``capacity`` bounds how many records may wait for an ACK.  With ``ring``
    (for producers running without stores) the window instead keeps the
    newest ``capacity`` records and evicts the oldest, which is the only case
    where records leave without an ACK.
    """

    __slots__ = ("capacity", "next", "acked", "ring", "bytes", "_chunks", "_firsts", "_skip")

    def __init__(self, capacity: int, next_offset: int = 0, *, ring: bool = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.next = next_offset  # offset the next publish gets
        self.acked = next_offset - 1  # highest acknowledged offset (-1: none)
        self.ring = ring
        self.bytes = 0
        # _chunks[k] holds the contents of offsets _firsts[k], _firsts[k] + 1, ...;
        # the head chunk's first _skip entries are already gone (acked/evicted).
        self._chunks: deque[list[bytes]] = deque()
        self._firsts: deque[int] = deque()
        self._skip = 0

    def __len__(self) -> int:
        return self.next - self.acked - 1

    @property
    def full(self) -> bool:
        return not self.ring and len(self) >= self.capacity

    @property
    def last(self) -> int:
        """The last published offset (-1 when nothing was published)."""
        return self.next - 1

    def push(self, content: bytes) -> int:
        """Assign the next offset to ``content``; the caller checks ``full`` first."""
        seq = self.next
        chunks = self._chunks
        if chunks and len(chunks[-1]) < CHUNK:
            chunks[-1].append(content)
        else:
            chunks.append([content])
            self._firsts.append(seq)
        self.next = seq + 1
        self.bytes += len(content)
        if self.ring and seq - self.acked > self.capacity:
            self._drop_upto(seq - self.capacity)  # evicted unacknowledged: only in ring mode
        return seq

    def push_many(self, contents: Sequence[bytes], start: int = 0, stop: int | None = None) -> int:
        """Assign consecutive offsets to ``contents[start:stop]``; the first one.

        The caller checks there is room for all of them (ring windows evict).
        """
        stop = len(contents) if stop is None else stop
        first = self.next
        if stop <= start:
            return first
        chunks = self._chunks
        pos, offset = start, first
        if chunks:
            tail = chunks[-1]
            room = CHUNK - len(tail)
            if room > 0:
                # Top up the last chunk (single publishes would make one chunk each).
                take = min(room, stop - pos)
                tail.extend(contents[pos : pos + take])
                pos += take
                offset += take
        while pos < stop:
            take = min(CHUNK, stop - pos)
            chunk = contents[pos : pos + take]  # a copy: the caller may reuse its list
            chunks.append(chunk if type(chunk) is list else list(chunk))
            self._firsts.append(offset)
            pos += take
            offset += take
        self.bytes += sum(map(len, contents[start:stop]))
        self.next = offset
        if self.ring and offset - self.acked - 1 > self.capacity:
            self._drop_upto(offset - self.capacity - 1)  # evicted unacknowledged: only in ring mode
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
        newly = seq - self.acked
        self._drop_upto(seq)
        return newly

    def _drop_upto(self, seq: int) -> None:
        """Forget offsets ``<= seq`` (``acked < seq < next``) and mark them acknowledged."""
        chunks, firsts = self._chunks, self._firsts
        skip = self._skip
        freed = 0
        while chunks:
            chunk = chunks[0]
            base = firsts[0]
            if base + len(chunk) - 1 <= seq:
                freed += sum(map(len, chunk[skip:] if skip else chunk))
                chunks.popleft()
                firsts.popleft()
                skip = 0
            else:
                upto = seq + 1 - base
                # (one record, as a device's ACK mostly frees: no slice)
                freed += len(chunk[skip]) if upto == skip + 1 else sum(map(len, chunk[skip:upto]))
                skip = upto
                break
        self._skip = skip
        self.bytes -= freed
        self.acked = seq

    def get(self, seq: int) -> bytes | None:
        if not self.acked < seq < self.next:
            return None
        firsts = self._firsts
        k = bisect_right(firsts, seq) - 1
        return self._chunks[k][seq - firsts[k]]

    def runs(self, seq: int, count: int) -> list[tuple[int, list[bytes]]]:
        """Records held for ``[seq, seq + count)`` as ``(first offset, contents)`` runs.

        One run per chunk touched, in ascending order: what a FETCH answer
        sends with one batch call each.
        """
        start = max(seq, self.acked + 1)
        stop = min(seq + count, self.next)
        if start >= stop:
            return []
        chunks, firsts = self._chunks, self._firsts
        k = bisect_right(firsts, start) - 1
        out = []
        offset = start
        while offset < stop:
            base = firsts[k]
            chunk = chunks[k]
            end = min(stop, base + len(chunk))
            out.append((offset, chunk[offset - base : end - base]))
            offset = end
            k += 1
        return out

    def fetch(self, seq: int, count: int) -> Iterator[tuple[int, bytes]]:
        """Records held for ``[seq, seq + count)``, in ascending order."""
        for first, contents in self.runs(seq, count):
            yield from enumerate(contents, first)

    def truncate(self, next_offset: int) -> None:
        """Take back offsets ``>= next_offset`` (``acked < next_offset <= next``), never sent.

        For an outbox whose commit failed: the records it could not keep are
        forgotten and their offsets are assigned again by the next publish.
        """
        if not self.acked < next_offset <= self.next:
            raise ValueError(f"cannot truncate to {next_offset}: window holds {self.acked + 1}..{self.next - 1}")
        chunks, firsts = self._chunks, self._firsts
        while chunks and firsts[-1] >= next_offset:
            chunk = chunks.pop()
            firsts.pop()
            self.bytes -= sum(map(len, chunk[self._skip if not chunks else 0 :]))
            if not chunks:
                self._skip = 0
        if chunks:
            tail = chunks[-1]
            keep = next_offset - firsts[-1]
            if keep < len(tail):
                self.bytes -= sum(map(len, tail[keep:]))
                del tail[keep:]
        self.next = next_offset
