"""Which recorded holes a store asks its peers for, and when (sans-IO).

A store gives offsets up (records a hole, see :mod:`dafka.store.db`) when
nobody supplied them for ``skip_after`` seconds; the peer holding them may
just have been stopped or cut off.  :class:`HoleRepair` decides how the
store asks for them again:

* it tracks at most ``max_holes`` holes (the database may hold more; the
  shell loads the first ``max_holes`` again whenever the set changes);
* each round (at most one per ``interval``) asks for at most ``per_round``
  due holes, each FETCH for at most ``max_ask`` offsets from the hole's
  start (what arrives fills it; the rest is asked for next);
* a hole asked for is due again after its wait, which starts at
  ``interval`` and doubles, up to ``max_wait``, while answers bring nothing;
  a hole that shrank (records came) waits ``interval`` again;
* a peer that joins (it may hold the records) makes every hole due at once,
  though never sooner than ``interval`` after the hole was last asked for;
* a hole at the partition's start (from offset 0: no record below it) that
  every peer store the store knows says it holds none of (VOID,
  :meth:`HoleRepair.on_void`) is not asked for again until a peer joins
  (one peer's word is not enough: another may hold the records, and answer
  after it): the records before the first one
  a store holds were most likely removed by its retention, and asking
  again would only bring what follows them once more.  (Such a hole exists
  because the store gave those offsets up after ``skip_after``, see
  :meth:`dafka.store.db.RecordDB.append`; a store that merely began after
  others' retention has none.)

ACKs are capped below the holes (:meth:`HoleRepair.cap`): an ACK tells a
producer that a store holds every record it published up to there, so it
releases them.  A store that gave offsets up while their producer was cut off
(or away) must not ACK past them before it asked that producer for them: the
producer may still hold them, and would drop records no store holds.  So the
ACK of a partition stops below its first tracked hole that is not *released*;
when the partition's producer is heard again (its HEAD, while it hears our
FETCHes, :meth:`HoleRepair.owner_heard`) the store asks it for those holes at
once.  What it sends fills them (and the ACKs move on); a hole is released
(no longer caps) when the producer says it is its restart hole (VOID kind 1,
:meth:`HoleRepair.on_restart_hole`: never published by its current run), or
when the producer heard our FETCHes for ``release_after`` (the store's
``skip_after``; counted between its HEADs, at most ``heard_gap`` each) while
it was asked for the hole and sent nothing for it: a live producer that hears
our FETCHes answers them long before, so it does not hold them (another store acknowledged them, or they were lost with a run of
it that crashed).  A hole the database holds beyond the ``max_holes``
tracked is not capped for.

The shell feeds it the holes the database holds (:meth:`HoleRepair.sync`,
after every commit that changed them), asks whether an arriving record's
offset is in a tracked hole (:meth:`HoleRepair.covers`) and sends the
FETCHes :meth:`HoleRepair.due` returns.  Times are passed in; nothing here
reads a clock or touches a socket.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

INTERVAL = 0.5  # seconds: a hole's first wait, and the least time between rounds
MAX_WAIT = 120.0  # seconds: the longest wait of a hole whose answers bring nothing
PER_ROUND = 4  # holes asked for per round
MAX_ASK = 10_000  # offsets asked for per FETCH
MAX_HOLES = 1024  # holes tracked at once
MAX_GIVEN_UP = 10_000  # offsets given up for good, remembered until the database has them out of its holes

Key = tuple[str, str]  # (topic, partition)


@dataclass(slots=True)
class _Hole:
    first: int
    last: int
    wait: float  # the wait after the next ask
    due_at: float  # when it may be asked for next
    asked_at: float  # when it was last asked for (-inf: never)
    voided: bool = False  # a start hole a peer store holds none of: not asked until a peer joins
    ask_from: int = 0  # a start hole: where its next ask starts (past what every peer store holds none of)
    # A start hole: the peer stores that said they hold none of it from ask_from, and up to where.
    voiders: dict[str, int] = field(default_factory=dict)
    released: bool = False  # caps ACKs no more (see HoleRepair.cap)
    heard_at: float | None = None  # when its producer was last heard while it capped ACKs
    heard_for: float = 0.0  # how long its producer heard our FETCHes meanwhile (see owner_heard)


class HoleRepair:
    """The holes a store is filling, and the FETCHes that fill them (see the module docstring)."""

    def __init__(
        self,
        *,
        interval: float = INTERVAL,
        max_wait: float = MAX_WAIT,
        per_round: int = PER_ROUND,
        max_ask: int = MAX_ASK,
        max_holes: int = MAX_HOLES,
        max_given_up: int = MAX_GIVEN_UP,
        release_after: float = 10.0,
        heard_gap: float = 5.0,
    ) -> None:
        if interval <= 0 or max_wait < interval or per_round < 1 or max_ask < 1 or max_holes < 1:
            raise ValueError("HoleRepair needs interval > 0, max_wait >= interval and positive limits")
        self.interval = interval
        self.max_wait = max_wait
        self.per_round = per_round
        self.max_ask = max_ask
        self.max_holes = max_holes
        self.max_given_up = max_given_up
        self.release_after = release_after
        self.heard_gap = heard_gap
        self._holes: dict[Key, list[_Hole]] = {}  # per partition, sorted by first
        self._firsts: dict[Key, list[int]] = {}  # the holes' firsts, for bisect
        self._round_at = float("-inf")  # the next round may start then
        # Per partition: the end of the restart hole its producer stated (VOID
        # kind 1): holes up to it cap ACKs no more, also those recorded after.
        self._restart_ends: dict[Key, int] = {}
        # Per partition, sorted: offsets given up for good (see give_up) that the
        # database may still hold as holes (their fill has not committed yet).
        self._given_up: dict[Key, list[int]] = {}
        self._synced: list[tuple[str, str, int, int]] = []  # the database's holes, as last synced
        self.asks = 0  # FETCHes returned by due(), in total

    def __len__(self) -> int:
        return sum(len(h) for h in self._holes.values())

    def __bool__(self) -> bool:
        return bool(self._holes)

    def holes(self) -> list[tuple[str, str, int, int]]:
        """The tracked holes, ``(topic, partition, first, last)``."""
        return [(k[0], k[1], h.first, h.last) for k, hs in self._holes.items() for h in hs]

    def sync(self, holes: Iterable[tuple[str, str, int, int]], now: float) -> None:
        """The holes the database holds now (the first ``max_holes`` are tracked).

        A hole unchanged since the last sync keeps its wait; one that shrank
        or split (records came) waits ``interval`` after its last ask; a new
        one is first asked for ``interval`` from now.
        """
        holes = list(holes)
        self._synced = holes
        given_up = self._given_up
        if given_up:
            holes, self._given_up = _without(holes, given_up)
        old = self._holes
        new: dict[Key, list[_Hole]] = {}
        n = 0
        for topic, partition, first, last in holes:
            if n >= self.max_holes:
                break
            if last < first:
                continue
            n += 1
            key = (topic, partition)
            hole = None
            for prev in old.get(key, ()):
                if prev.first <= last and first <= prev.last:  # overlaps: what is left of it
                    if prev.first == first and prev.last == last:
                        hole = prev  # (unchanged: a voided one stays so)
                    else:
                        asked = prev.asked_at
                        hole = _Hole(first, last, self.interval, max(now, asked + self.interval), asked)
                        # What is left of it keeps its release clock.
                        hole.released, hole.heard_at, hole.heard_for = prev.released, prev.heard_at, prev.heard_for
                    break
            if hole is None:
                hole = _Hole(first, last, self.interval, now + self.interval, float("-inf"))
            if last <= self._restart_ends.get(key, -1):
                hole.released = True
            new.setdefault(key, []).append(hole)
        for hs in new.values():
            hs.sort(key=lambda h: h.first)
        self._holes = new
        self._firsts = {k: [h.first for h in hs] for k, hs in new.items()}

    def give_up(self, offsets: Iterable[tuple[Key, int]], now: float) -> None:
        """These offsets can never be had (their record is over the store's size
        limit: every copy has that size).  The shell writes them out of the
        database's holes (a fill without content); until that commits, and
        whatever syncs come meanwhile, they are asked for no more, cap no ACK
        and are no longer :meth:`covered <covers>`.  Only offsets in tracked
        holes count; at most ``max_given_up`` are remembered (one beyond is
        asked for until its give-up commits, as before)."""
        given_up = self._given_up
        total = sum(len(v) for v in given_up.values())
        added = False
        for key, offset in offsets:
            if total >= self.max_given_up or not self.covers(key, offset):
                continue
            offs = given_up.setdefault(key, [])
            i = bisect.bisect_left(offs, offset)
            if i < len(offs) and offs[i] == offset:
                continue
            offs.insert(i, offset)
            total += 1
            added = True
        if added:
            self.sync(self._synced, now)

    def covers(self, key: Key, offset: int) -> bool:
        """Whether ``offset`` of partition ``key`` is in a tracked hole."""
        firsts = self._firsts.get(key)
        if firsts is None:
            return False
        i = bisect.bisect_right(firsts, offset) - 1
        return i >= 0 and offset <= self._holes[key][i].last

    def cap(self, key: Key, head: int) -> int:
        """The ACK partition ``key`` may get for committed head ``head``: below
        its first tracked hole that is not released (``head`` if none)."""
        for h in self._holes.get(key, ()):
            if h.first > head:
                break
            if not h.released:
                return h.first - 1
        return head

    def owner_heard(self, key: Key, now: float) -> list[tuple[str, str, int, int]]:
        """Partition ``key``'s producer hears our FETCHes at ``now`` (the shell calls
        this on a HEAD of the partition while the producer is subscribed to them).

        For its first ``per_round`` holes that still cap ACKs: each counts the
        time since the last call (at most ``heard_gap``: a longer silence may
        have been a cut) and is released once that reaches ``release_after``;
        the others are asked for at once if not asked for ``interval``.
        Returns those FETCHes, ``(topic, partition, offset, count)``.
        """
        out = []
        n = 0
        for h in self._holes.get(key, ()):
            if h.released:
                continue
            if n >= self.per_round:
                break
            n += 1
            if h.heard_at is not None:
                h.heard_for += min(max(now - h.heard_at, 0.0), self.heard_gap)
                if h.heard_for >= self.release_after:
                    h.released = True
                    continue
            h.heard_at = now
            if now - h.asked_at >= self.interval:
                out.append((key[0], key[1], h.first, min(h.last - h.first + 1, self.max_ask)))
                h.asked_at = now
                h.wait = self.interval
                h.due_at = now + self.interval
        self.asks += len(out)
        return out

    def on_restart_hole(self, key: Key, first: int, last: int) -> None:
        """Partition ``key``'s producer says ``first..last`` is its restart hole
        (VOID kind 1): its current run never published them, it holds none of
        them, so holes within ``..last`` cap ACKs no more, also those recorded
        later (the shell passes only partitions it reads: one entry each)."""
        if last > self._restart_ends.get(key, -1):
            self._restart_ends[key] = last
        for h in self._holes.get(key, ()):
            if h.first > last:
                break
            if h.last <= last:
                h.released = True

    def acked_elsewhere(self, key: Key, upto: int) -> None:
        """Partition ``key``'s owner, a leaf (``dafka.core.leaf``), says every offset
        up to ``upto`` was acknowledged by an endpoint: it holds none of them, so
        holes within ``..upto`` cap its ACKs no more, also those recorded later
        (they are asked of the other stores as any hole)."""
        self.on_restart_hole(key, 0, upto)

    def on_void(
        self, key: Key, first: int, last: int, source: str = "peer", stores: Collection[str] = ()
    ) -> None:
        """Peer store ``source`` says it holds none of ``first..last`` of partition ``key``.

        ``stores`` are the peer stores known now (any may hold the records).
        For a tracked hole at the partition's start (its first offset 0), once
        every one of them and ``source`` said so from where that hole is asked,
        what all said is asked no more; once all of the hole was, it is not
        asked for again until a peer joins (see the module docstring).  Other
        holes are unaffected (their backoff goes on).
        """
        hs = self._holes.get(key)
        if not hs:
            return
        h = hs[0]  # sorted by first: a start hole is the first
        if h.first != 0 or not first <= h.ask_from <= last:
            return
        voiders = h.voiders
        voiders[source] = max(last, voiders.get(source, last))
        if any(store not in voiders for store in stores):
            return  # a store that may hold some has not said
        upto = min(voiders.values())
        voiders.clear()
        if upto >= h.last:
            h.voided = True
        else:
            h.ask_from = upto + 1

    def peer_joined(self, now: float) -> None:
        """A peer that may hold the records joined: every hole is due again soon, its wait reset."""
        for hs in self._holes.values():
            for h in hs:
                h.voided = False
                h.ask_from = h.first
                h.voiders.clear()
                h.wait = self.interval
                h.due_at = min(h.due_at, max(now, h.asked_at + self.interval))

    def due(self, now: float) -> list[tuple[str, str, int, int]]:
        """FETCHes to send now: ``(topic, partition, offset, count)``, at most ``per_round``."""
        if now < self._round_at or not self._holes:
            return []
        ready = [(h.due_at, k, h) for k, hs in self._holes.items() for h in hs if h.due_at <= now and not h.voided]
        if not ready:
            return []
        ready.sort(key=lambda item: item[0])  # longest due first (a stable sort: fair between equals)
        out = []
        for _, key, h in ready[: self.per_round]:
            start = max(h.first, h.ask_from)
            out.append((key[0], key[1], start, min(h.last - start + 1, self.max_ask)))
            h.asked_at = now
            h.due_at = now + h.wait
            h.wait = min(h.wait * 2, self.max_wait)
        self._round_at = now + self.interval
        self.asks += len(out)
        return out


def _without(
    holes: list[tuple[str, str, int, int]], given_up: dict[Key, list[int]]
) -> tuple[list[tuple[str, str, int, int]], dict[Key, list[int]]]:
    """``holes`` less the ``given_up`` offsets (a hole split around them), and the
    given-up offsets still in a hole (the others' give-up has committed)."""
    out: list[tuple[str, str, int, int]] = []
    kept: dict[Key, list[int]] = {}
    for hole in holes:
        topic, partition, first, last = hole
        offs = given_up.get((topic, partition))
        if not offs:
            out.append(hole)
            continue
        i = bisect.bisect_left(offs, first)
        j = bisect.bisect_right(offs, last)
        if i == j:
            out.append(hole)
            continue
        start = first
        for off in offs[i:j]:
            if off > start:
                out.append((topic, partition, start, off - 1))
            start = off + 1
        if start <= last:
            out.append((topic, partition, start, last))
        kept.setdefault((topic, partition), []).extend(offs[i:j])
    for offs in kept.values():
        offs.sort()  # the database's holes come sorted; this keeps any order right
    return out, kept
