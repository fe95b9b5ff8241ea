"""A consumer's per-partition delivery state, sans-IO.

For one (subject, partition) it decides which records to deliver, in offset
order with no gap and no duplicate, and when to FETCH what is missing:

* a record at ``next`` is delivered, then any held records that follow it;
* an older record is a duplicate and dropped;
* a record ahead of ``next`` is held in a bounded window (the reference drops
  it) and a FETCH from ``next`` is requested;
* a HEAD / DIRECT-HEAD at or beyond ``next`` requests a FETCH up to it;
* while records are missing, the FETCH is re-sent after ``retry_interval``
  without progress, backing off (doubling, up to 8x) while retries bring
  nothing (the reference has no retry and can stall); for a hole before held
  records, which may be given up, at most ``skip_after / HOLE_PROBES`` apart;
* a long catch-up is fetched in ranges of FETCH_CHUNK, the next range asked
  for once the current one is half delivered (pipelined);
* a restarted producer's hole (offsets it reserved before a crash and never
  used) is passed at once when the producer said it is one (VOID kind 1) and
  every store the reader knows said since that it holds none of it (VOID
  kind 0); see :meth:`PartitionTracker.pass_restart_hole`;
* if the missing records never come while later ones are held (a store's
  retention removed them), after ``skip_after`` seconds the tracker skips
  forward to the first held record and reports the skipped range; never
  before it asked for the hole once more after the first later record came
  (the records before it may be one FETCH away) and gave the answer
  ``retry_interval`` to come; the ``skip_after`` seconds count from when
  the missing offset was first known to exist (not from an earlier
  progress), and a last FETCH goes out right before the hole is given up;
* a record over the reader's size limit is never delivered: at ``next`` it
  is skipped at once (every copy of a record has its size, so fetching it
  again cannot help); ahead of ``next`` it only says the offset exists, and
  is skipped when the FETCH of what precedes it brings it again;
* after the reader's connection to a peer was cut (ZeroMQ refused a frame
  over its size limit: the record in it was never seen), a partition
  stalled for ``skip_after`` skips only its next offset, not up to the
  first held record: the other missing records are then FETCHed again.

Times are passed in by the caller; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Collection

FETCH_CHUNK = 100_000  # largest count asked for in one FETCH
MAX_RETRY_BACKOFF = 8  # retries without progress wait up to this many retry intervals
# ... and, while later records are held (the hole may be given up), at most skip_after / this:
# a hole is asked for this many times in the skip_after before it is given up.
HOLE_PROBES = 8
# A hole is given up only after a FETCH at most this many retry intervals old
# (see PartitionTracker.skip_if_stalled).
FINAL_CALL = 2


class PartitionTracker:
    """Delivery state of one partition of one subject."""

    __slots__ = (
        "subject",
        "address",
        "next",
        "known",
        "held",
        "max_held",
        "retry_interval",
        "retry_wait",
        "retry_asap",
        "sent_at",
        "skip_after",
        "fetch_upto",
        "progress_next",
        "progress_at",
        "fetches",
        "skipped",
        "pid",
        "cut",
        "held_at",
        "unheard_at",
        "missing_at",
        "missing_next",
        "missing_upto",
        "restart_hole",
        "voids",
    )

    def __init__(
        self,
        subject: str,
        address: str,
        next_offset: int | None,
        *,
        max_held: int = 100_000,
        retry_interval: float = 0.5,
        skip_after: float = 10.0,
    ) -> None:
        self.subject = subject
        self.address = address
        # Next offset to deliver; None until the first record or head is seen
        # (offset reset "latest").
        self.next = next_offset
        self.known = -1 if next_offset is None else next_offset - 1  # highest offset known to exist
        self.held: dict[int, bytes] = {}
        self.max_held = max_held
        self.retry_interval = retry_interval
        self.retry_wait = retry_interval  # doubles while retries make no progress
        self.retry_asap = False  # a new peer answers FETCHes: ask again at once
        self.sent_at = float("-inf")  # when the last FETCH went out
        self.skip_after = skip_after
        self.fetch_upto = -1  # last offset asked for by the outstanding FETCH
        self.progress_next = -1  # next as of the last progress check
        self.progress_at = 0.0  # when next last moved (or a FETCH was sent)
        self.fetches = 0
        self.skipped = 0  # offsets skipped forward in total
        # The store's LMDB partition id once the partition is stored (records
        # then go to LMDB as ready key/value pairs, see fastio.drain_pairs).
        self.pid: int | None = None
        # The reader's connection to a peer was cut while records were missing
        # (see skip_if_stalled): a stall then skips one offset.
        self.cut = False
        self.held_at: float | None = None  # when records ahead of a hole were first seen held
        # Last time the partition's producer was alive but could not hear our
        # FETCHes (see unheard): the time to give a hole up counts from then.
        self.unheard_at = float("-inf")
        # When the offset at ``next`` was first seen missing (with ``next`` as
        # it was then, see _missing_since): a hole's time to be given up
        # counts from then, never from before anyone knew of it.
        self.missing_at = float("-inf")
        self.missing_next = -1
        # The last offset of that hole as it was then: what lies beyond it went
        # missing later and gets its own skip_after (see skip_if_stalled).
        self.missing_upto = -1
        # The partition's producer said it resumed past these offsets (VOID kind
        # 1): this run never publishes them (see pass_restart_hole).
        self.restart_hole: tuple[int, int] | None = None
        # Stores that said they hold none of a range since then: store -> range.
        self.voids: dict[str, tuple[int, int]] = {}

    @property
    def missing(self) -> bool:
        """Whether records below ``known`` have not been delivered yet."""
        return self.next is not None and self.known >= self.next

    def on_record(self, seq: int, content: bytes, out: list[tuple[int, bytes]]) -> bool:
        """A (DIRECT-)RECORD arrived.  Deliverable records are appended to ``out``.

        Returns True when records are missing (the caller should call
        :meth:`fetch_request`).
        """
        nxt = self.next
        if nxt is None:
            nxt = seq  # "latest": start at the first record seen
        if seq == nxt:
            out.append((seq, content))
            nxt += 1
            held = self.held
            if held:
                pop = held.pop
                while True:
                    c = pop(nxt, None)
                    if c is None:
                        break
                    out.append((nxt, c))
                    nxt += 1
            self.next = nxt
            if seq > self.known:
                self.known = seq
            return self.known >= nxt
        self.next = nxt
        if seq < nxt:
            return self.known >= nxt  # duplicate
        if seq > self.known:
            self.known = seq
        held = self.held
        # When the window is full the newest records are the ones dropped:
        # they are furthest from next and will be fetched again.
        if len(held) < self.max_held:
            held[seq] = content
        return True

    def drop_too_large(self, seq: int, out: list[tuple[int, bytes]]) -> bool:
        """Record ``seq`` arrived over the size limit: it is never delivered.

        At ``next`` (or as the first record seen, offset reset "latest") it
        is skipped now and the held records after it are appended to ``out``;
        returns True then.  Ahead of ``next`` it only makes ``known`` reach it
        (what precedes it is FETCHed, and the answer brings it again at
        ``next``); an older one is a duplicate.  See :attr:`missing` after.
        """
        nxt = self.next
        if nxt is None:
            nxt = seq
        if seq > self.known:
            self.known = seq
        if seq != nxt:
            self.next = nxt
            return False
        nxt += 1
        held = self.held
        if held:
            pop = held.pop
            while True:
                c = pop(nxt, None)
                if c is None:
                    break
                out.append((nxt, c))
                nxt += 1
        self.next = nxt
        return True

    def on_head(self, seq: int) -> bool:
        """A HEAD / DIRECT-HEAD says the partition's last offset is ``seq``.

        Returns True when records are missing.
        """
        if self.next is None:
            # "latest": skip everything published so far.
            self.next = seq + 1
            self.known = seq
            return False
        if seq > self.known:
            self.known = seq
        return self.known >= self.next

    def fetch_request(self, now: float) -> tuple[int, int] | None:
        """(offset, count) of a FETCH to send now, or None.

        Cheap enough to call after every record: a FETCH goes out when records
        are missing and no FETCH covering ``next`` is outstanding, or when
        neither progress nor a FETCH happened for ``retry_wait`` (which starts
        at ``retry_interval`` and doubles while retries bring nothing).
        """
        nxt = self.next
        if nxt is None or self.known < nxt:
            return None
        self._missing_since(nxt, now)
        if self.held:
            if self.held_at is None:
                self.held_at = now
        else:
            self.held_at = None
        if self.fetch_upto >= nxt:
            ahead = self.fetch_upto
            if self.known > ahead and ahead - nxt < FETCH_CHUNK // 2 and not self.held:
                # Pipelining: the outstanding range is half delivered, so ask
                # for the next one now and the answerer never idles between ranges.
                count = min(self.known - ahead, FETCH_CHUNK)
                self.fetch_upto = ahead + count
                self.sent_at = now
                self.fetches += 1
                return ahead + 1, count
            if nxt != self.progress_next:
                self.progress_next = nxt
                self.progress_at = now
                self.retry_wait = self.retry_interval
                self.retry_asap = False
                return None
            if self.retry_asap:
                self.retry_asap = False
            elif now - max(self.progress_at, self.sent_at) < self.retry_wait:
                return None
            else:
                # A retry: back off while retries bring nothing, so a slow reader
                # is not buried under answers to FETCHes it asked for again.  Less
                # for a hole before held records (a small FETCH, given up after
                # skip_after): retries 2 s and 4 s apart missed both the producer's
                # and then a store's time up with the record, and it was given up
                # acknowledged (simulator seed 6023562).
                cap = MAX_RETRY_BACKOFF * self.retry_interval
                if self.held:
                    cap = min(cap, max(self.retry_interval, self.skip_after / HOLE_PROBES))
                self.retry_wait = min(self.retry_wait * 2, cap)
        upto = self.known
        if self.held:
            # Ask only for the hole before the first held record.
            first_held = min(self.held)
            if first_held > nxt:
                upto = first_held - 1
        count = min(upto - nxt + 1, FETCH_CHUNK)
        self.fetch_upto = nxt + count - 1
        self.retry_asap = False
        self.sent_at = now
        if nxt != self.progress_next:
            self.progress_next = nxt
            self.progress_at = now
        self.fetches += 1
        return nxt, count

    def _missing_since(self, nxt: int, now: float) -> float:
        """When the offset ``nxt`` (= ``next``, known missing) was first seen missing.

        ``known`` never decreases, so while ``next`` stays where it was the
        offset stays missing; a new ``next`` that is missing is a new hole:
        its retries start again at ``retry_interval`` (the backoff of an
        earlier hole says nothing about this one).
        """
        if self.missing_next != nxt:
            self.missing_next = nxt
            self.missing_at = now
            self.missing_upto = min(self.held) - 1 if self.held else self.known
            self.retry_wait = self.retry_interval
        return self.missing_at

    def on_restart_hole(self, first: int, last: int) -> None:
        """The partition's producer says it resumed past ``first..last`` (VOID kind 1).

        A previous run of it may have published some of them; they can only be
        in a store now (the producer is a new process).  What the stores said
        before counts no more.
        """
        if self.restart_hole != (first, last):
            self.restart_hole = (first, last)
            self.voids.clear()
            # Ask again at once: the stores' answers to the FETCH that brought
            # this one may have come first, and counted for nothing.
            self.retry_now()

    def on_store_void(self, store: str, first: int, last: int, max_stores: int = 1024) -> None:
        """Store ``store`` says it holds none of ``first..last`` (VOID kind 0).

        Counted only after the producer stated a restart hole: a store may say
        so of offsets a live producer's records are on their way to it with.
        """
        if self.restart_hole is None:
            return
        if store in self.voids or len(self.voids) < max_stores:
            self.voids[store] = (first, last)

    def pass_restart_hole(
        self, now: float, stores: Collection[str], out: list[tuple[int, bytes]], *, own_word: bool = False
    ) -> tuple[int, int] | None:
        """Pass a restarted producer's hole at once, if nothing of it can be had.

        The hole before the first held record is passed when (1) the producer
        said all of it is its restart hole (never published by this run, so a
        record there can only be a previous run's, in a store), and (2) every
        store in ``stores`` (those the reader knows) said since that it holds
        none of it: nothing acknowledged can be there, unless in a store the
        reader does not know.  A consumer needs at least one store's word; a
        store (``own_word``) is one itself, and holds none of it (it is
        missing here), so other stores are needed only as far as it knows
        some.  A store that passes offsets another store it did not know holds
        records them as a hole and fetches them when that store appears
        (:class:`dafka.store.holes.HoleRepair`).  Otherwise the hole waits for
        :meth:`skip_if_stalled` (``skip_after``).  Returns the skipped range
        and appends the now deliverable records to ``out``.
        """
        nxt = self.next
        hole = self.restart_hole
        if nxt is None or hole is None or not self.held or not (stores or own_word):
            return None
        first_held = min(self.held)
        last = first_held - 1
        if not (hole[0] <= nxt <= last <= hole[1]):
            return None
        voids = self.voids
        for store in stores:
            said = voids.get(store)
            if said is None or not (said[0] <= nxt and last <= said[1]):
                return None
        self.skipped += first_held - nxt
        self.next = first_held
        self.on_record(first_held, self.held.pop(first_held), out)
        self.progress_next = self.next
        self.progress_at = now
        self.held_at = now if self.held else None
        self.fetch_upto = -1  # what follows, if missing, is asked for at once
        return nxt, last

    def pass_compacted(self, first: int, last: int, now: float,
                       out: list[tuple[int, bytes]]) -> tuple[int, int] | None:
        """A store compacted ``first..last`` away (VOID kind 2): their records were superseded
        by later ones of the same keys, which it holds.  When ``next`` is in the range, it
        moves past it at once (to a held record inside it first: another store may still
        hold the older records, and they are delivered when they come), and the now
        deliverable records are appended to ``out``.  Returns the passed range, or None.
        """
        nxt = self.next
        if nxt is None or not first <= nxt <= last:
            return None
        new = last + 1
        if self.held:
            new = min(new, min(self.held))
        self.next = new
        if new > self.known + 1:
            self.known = new - 1
        held = self.held.pop(new, None)
        if held is not None:
            self.on_record(new, held, out)
        self.progress_next = self.next
        self.progress_at = now
        self.held_at = now if self.held else None
        self.fetch_upto = -1  # what follows, if missing, is asked for at once
        return nxt, new - 1

    def unheard(self, now: float) -> None:
        """Nobody could answer our FETCHes until ``now``: the partition's producer
        is alive but does not hear them (yet), or this reader could not ask.

        It may still hold what the hole lacks: a hole is given up only after
        ``skip_after`` seconds of FETCHes it could hear.  Given up while it held
        them, its records would be acknowledged without being stored (a store
        ACKs past a hole it gave up).
        """
        self.unheard_at = now

    def retry_now(self) -> None:
        """Let the next :meth:`fetch_request` re-send at once (a new peer joined)."""
        # Not by moving progress_at: that would also make a hole look stalled
        # long enough to skip, and a new store must never cause a skip.
        self.retry_asap = True
        self.retry_wait = self.retry_interval

    def skip_if_stalled(self, now: float, out: list[tuple[int, bytes]]) -> tuple[int, int] | None:
        """Give up on a hole that nobody can fill (records removed by retention).

        Only when later records are held and ``next`` has not moved for
        ``skip_after`` seconds of FETCH retries.  Returns the skipped range
        ``(first, last)`` and appends the now deliverable records to ``out``.
        After a cut connection (:attr:`cut`) only ``next`` is skipped, held
        records or not, as long as it is known to exist.
        """
        nxt = self.next
        cut_case = self.cut and nxt is not None and self.known >= nxt
        if not self.held:
            self.held_at = None
            if not cut_case:
                return None
        elif self.held_at is None:
            self.held_at = now
        if nxt is None or nxt != self.progress_next:
            return None
        # The stall counts from the last progress, from when the missing
        # offset was first known to exist (a record lost on its way to us long
        # after the last progress is one FETCH away: issue 40), and from when
        # the producer last could not hear us.
        since = max(self.progress_at, self._missing_since(nxt, now), self.unheard_at)
        remaining = self.skip_after - (now - since)
        if remaining > 0:
            if (
                remaining <= self.retry_interval
                and self.held
                and now - self.sent_at > FINAL_CALL * self.retry_interval
            ):
                # The last call (below), sent early so its answer can come in time.
                self.retry_asap = True
            return None
        if self.cut:
            self.cut = False
            self.skipped += 1
            first = nxt
            nxt += 1
            pop = self.held.pop
            while True:
                c = pop(nxt, None)
                if c is None:
                    break
                out.append((nxt, c))
                nxt += 1
            self.next = self.progress_next = nxt
            self.progress_at = now
            self.fetch_upto = -1  # the rest of the hole is asked for again at once
            self.held_at = now if self.held else None
            return first, first
        # Waiting with nothing held proves little (a HEAD may have announced
        # offsets that were never published, such as a producer's restart hole,
        # and the records after it may just have come): ask for the hole once
        # more since later records are held, and let the answer come.
        if self.sent_at < self.held_at:
            self.retry_asap = True
            return None
        # A last call: the FETCHes back off (up to 8 retry intervals apart), so
        # the last one may be seconds old, asked while the store that holds the
        # records could not answer yet (received, not committed; stopped).  Ask
        # once more right before giving up, and let the answer come.  "Right
        # before" is fixed to the deadline, not to now: a reader late at every
        # check (a starved thread) makes its last call once, then gives up.
        if self.sent_at < since + self.skip_after - FINAL_CALL * self.retry_interval:
            self.retry_asap = True
            return None
        if now - self.sent_at < self.retry_interval:
            return None
        first_held = min(self.held)
        upto = self.missing_upto
        if nxt <= upto < first_held - 1:
            # Only what was missing skip_after ago: the offsets after it went
            # missing later (the records held after them were lost, as when a
            # store restarts; a FETCH may still bring them) and wait their own
            # skip_after from now.  (Issue 40, seed 201185: a store gave up
            # offsets missing for half a second with a hole missing for 10 s,
            # and its ACK released one of them from the producer.)
            self.skipped += upto - nxt + 1
            self.next = self.progress_next = upto + 1
            self.progress_at = self.held_at = now
            self.fetch_upto = -1  # the rest is asked for at once
            return nxt, upto
        skipped = (nxt, first_held - 1)
        self.skipped += first_held - nxt
        self.next = first_held
        content = self.held.pop(first_held)
        self.on_record(first_held, content, out)
        self.progress_next = self.next
        self.progress_at = now
        self.held_at = now if self.held else None
        return skipped


class KnownStores:
    """The stores a reader knows: who must have said it holds none of a
    restarted producer's hole before it is passed (see
    :meth:`PartitionTracker.pass_restart_hole`).  Sans-IO.

    A store is met when it shows itself (it subscribes to its CONSUMER-HELLOs
    on our publisher, or greets us); it is gone when its beacons stop, and
    still counts for ``keep`` seconds after (it may hold part of a hole, and
    be back), then is forgotten.  Remembers at most ``limit`` stores (anyone
    can subscribe as one); once a store was turned away for want of room,
    the roster counts one more store that never answers (:data:`UNREMEMBERED`),
    so a flood of made-up stores can make holes wait ``skip_after``, never
    make a reader pass what a store it could not remember holds.
    """

    __slots__ = ("keep", "limit", "_gone_at", "turned_away")

    def __init__(self, keep: float, limit: int = 1024) -> None:
        self.keep = keep
        self.limit = limit
        self._gone_at: dict[str, float | None] = {}  # store -> when its beacons stopped (None: alive)
        self.turned_away = 0  # stores not remembered (no room), ever

    def __contains__(self, store: object) -> bool:
        return store in self._gone_at

    def __len__(self) -> int:
        return len(self._gone_at)

    def met(self, store: str) -> None:
        """``store`` showed itself (again, if it was gone)."""
        if store in self._gone_at or len(self._gone_at) < self.limit:
            self._gone_at[store] = None
        else:
            self.turned_away += 1

    def gone(self, store: str, now: float) -> None:
        """``store``'s beacons stopped."""
        if store in self._gone_at:
            self._gone_at[store] = now

    def all_gone(self) -> bool:
        """Whether stores were met and every one of them is gone now (not yet forgotten)."""
        gone_at = self._gone_at
        return bool(gone_at) and None not in gone_at.values()

    def current(self, now: float) -> Collection[str]:
        """The stores that count at ``now``: alive, or gone less than ``keep`` ago."""
        gone_at = self._gone_at
        if any(gone is not None for gone in gone_at.values()):
            forget = now - self.keep
            for store, gone in list(gone_at.items()):
                if gone is not None and gone < forget:
                    del gone_at[store]
        if self.turned_away:
            return {*gone_at, UNREMEMBERED}
        return gone_at.keys()


# Stands for the stores a full KnownStores turned away: no VOID comes from it
# (no node address is empty; in a secure mesh none is bound to a key).
UNREMEMBERED = ""


# Seconds: a producer's HEAD arrives within it.  A producer skips the HEAD of a
# second in which records went out, so an idle partition may be silent for two
# intervals after its last record (see Producer._send_head).
LIVE_SETTLE_MIN = 2.5


class LiveEdge:
    """Where an offset-reset "latest" reader starts a partition it sees for the first time.

    "Latest" means everything published after the reader subscribed.  A
    partition that existed then starts at its live edge (the first record or
    HEAD seen, as the reference does); a partition first seen later was
    created after the subscription (every producer run is a new partition),
    so it is read from offset 0, and what it published before the reader
    heard of it is FETCHed.

    Which partitions existed is learnt while *settling*: from the moment a
    topic is subscribed (and a tower reached) for ``settle`` seconds.  In that
    window the reader hears every live peer (they beacon back at once when a
    new node appears), connects to them and asks for heads (GET-HEADS: stores
    answer for every partition they hold, producers for theirs), and hears
    the producers' HEADs, sent every second.  Anything seen in the window
    counts as existing; anything first seen after it is new.  The window is
    the only approximation: a producer that starts within it is taken for an
    existing one.  Until a tower is reached nothing can be seen, so the
    window does not end.

    The shell passes times in; nothing here reads a clock.
    """

    __slots__ = ("settle", "tower_at", "_subscribed", "_existing")

    def __init__(self, settle: float) -> None:
        self.settle = settle
        self.tower_at: float | None = None
        self._subscribed: dict[str, float] = {}  # topic -> when subscribed
        self._existing: set[tuple[str, str]] = set()  # (topic, partition) seen while settling

    def subscribe(self, topic: str, now: float) -> None:
        """``topic`` is subscribed (again: no effect)."""
        self._subscribed.setdefault(topic, now)

    def on_tower(self, now: float) -> None:
        """A tower answered (a node without towers calls it at start)."""
        if self.tower_at is None:
            self.tower_at = now

    def settled_at(self, topic: str) -> float | None:
        """When ``topic``'s window ends (None: not yet known, no tower reached)."""
        since = self._subscribed.get(topic)
        if since is None or self.tower_at is None:
            return None
        return max(since, self.tower_at) + self.settle

    def settling(self, topic: str, now: float) -> bool:
        """Whether what is seen of ``topic`` now existed when it was subscribed."""
        end = self.settled_at(topic)
        return end is None or now < end

    def start(self, key: tuple[str, str], now: float) -> int | None:
        """First offset of partition ``key`` = (topic, partition): None for the
        live edge (it existed when subscribed), 0 for a new partition.

        Call it when the partition is first seen; a partition seen while
        settling is remembered, so a later call (a group member taking the
        partition over) answers the same.
        """
        if key in self._existing:
            return None
        if self.settling(key[0], now):
            self._existing.add(key)
            return None
        return 0
