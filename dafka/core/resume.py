"""How a producer restarted from an identity file continues its partition, sans-IO.

A producer's identity file holds its address (the partition) and the offsets
it had published and had acknowledged, saved at most every half second, so
after a crash the stores may hold more than the file says.  Before it assigns
a new offset the restarted producer therefore always

1. listens to the towers' beacons for a while *without* beaconing itself: a
   beacon carrying its own address from another endpoint means another live
   process uses the same identity, and it refuses to start (so it does not
   disturb the first one); a twin noticed only shortly after the resume
   (``PROBATION``) stops the newcomer all the same;
2. beacons, asks the stores for the head of its partition (GET-HEADS, each
   store answers DIRECT-HEAD) and continues after the highest head any store
   answered within a short grace period after the first answer.

Heads alone are not enough: a store that does not answer (stopped, paused on a
full disk, cut off) may hold, and have acknowledged, offsets beyond every head
that did answer.  So the identity file also holds a *reservation* (``reserved``):
an exclusive upper bound on the offsets the producer may assign, made durable
before any offset at or beyond the old bound is used (see
:class:`dafka.producer.Producer`).  A producer resumed from such a file
continues at ``max(store heads + 1, reserved)``: no offset a previous
incarnation may have assigned is ever assigned again, whoever answers.  The
offsets between the previous incarnation's real end and ``reserved`` are never
published: a hole, which readers wait for (a stopped store may still hold part
of it) and then skip as a recorded hole.  A producer that closed cleanly saved
its exact end as the bound, so it resumes without a hole.  The policies stay as
they were: ``strict`` still wants a store's answer (which also tells that the
stores are there and writing), and ``start_anyway`` now overwrites nothing.

:class:`Resume` holds that decision; the producer feeds it events with their
times and asks it what to do.  No sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRICT = "strict"  # no store answered: refuse to publish
START_ANYWAY = "start_anyway"  # no store answered: continue after the saved offsets
POLICIES = (STRICT, START_ANYWAY)

HEAD_GRACE = 0.3  # seconds to wait for more stores after the first DIRECT-HEAD
DUPLICATE_WINDOW = 2.5  # beacon intervals listened to before beaconing ourselves
# A twin's beacon can still come late (a starved machine): seen within this many
# beacon intervals after the resume, the newcomer stops publishing too.
PROBATION = 10.0


@dataclass(slots=True)
class Resume:
    """The resume of one producer from ``(saved_acked, saved_next)``.

    ``timeout`` bounds the whole resume; ``beacon_interval`` sizes the window
    in which another process's beacons with our address must show up;
    ``policy`` says what to do when no store answers in time (``strict`` or
    ``start_anyway``); ``need_store`` is False for producers without stores
    (``acks=False``), which do not wait for heads.  ``reserved`` is the
    identity file's reservation (None: a file from before reservations).
    """

    saved_acked: int
    saved_next: int
    started: float
    timeout: float
    beacon_interval: float
    policy: str = STRICT
    need_store: bool = True
    reserved: int | None = None  # exclusive bound on offsets any earlier incarnation assigned
    tower_at: float | None = None  # when a tower was first heard
    first_head_at: float | None = None
    head: int | None = None  # highest head a store answered
    duplicate: str | None = None  # endpoint of another process with our address
    heads: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"resume must be one of {POLICIES}, not {self.policy!r}")

    # ------------------------------------------------------------ events

    def on_tower(self, now: float) -> None:
        """A tower answered (its welcome or any beacon arrived)."""
        if self.tower_at is None:
            self.tower_at = now

    def on_duplicate(self, endpoint: str) -> None:
        """A beacon with our address came from another endpoint than ours."""
        if self.duplicate is None:
            self.duplicate = endpoint

    def on_head(self, head: int, now: float) -> None:
        """A store answered DIRECT-HEAD for our partition."""
        self.heads.append(head)
        if self.head is None or head > self.head:
            self.head = head
        if self.first_head_at is None:
            self.first_head_at = now

    # ------------------------------------------------------------ questions

    def may_beacon(self, now: float) -> bool:
        """Whether the duplicate-identity window has passed without a duplicate."""
        if self.duplicate is not None or self.tower_at is None:
            return False
        return now >= self.tower_at + DUPLICATE_WINDOW * self.beacon_interval

    def done(self, now: float) -> bool:
        """Whether the decision can be taken now."""
        if self.duplicate is not None or now >= self.started + self.timeout:
            return True
        if not self.may_beacon(now):
            return False
        if self.first_head_at is not None:
            return now >= self.first_head_at + HEAD_GRACE
        return not self.need_store

    @property
    def hole(self) -> tuple[int, int] | None:
        """Offsets the decision skips (``(first, last)``), or None.

        From just after the highest store head (or what was acknowledged) up
        to the reservation: a previous incarnation may have published some
        of them, which only a store that did not answer can hold.
        """
        nxt, error = self.decide()
        if error is not None:
            return None
        known = max(self.saved_acked, -1 if self.head is None else self.head)
        return (known + 1, nxt - 1) if nxt > known + 1 else None

    def decide(self) -> tuple[int, str | None]:
        """``(next offset, error)``: the offset to continue at, or why not to publish.

        With a reservation, at ``max(reserved, highest head + 1, acked + 1)``:
        nothing an earlier incarnation assigned is assigned again (a store
        that did not answer may hold acknowledged records beyond every head
        that did); without any head only as the policy allows.  Without one (a
        file from before reservations): with a store head right after it (or
        after what it had acknowledged, if that is higher), the offsets
        between the head and the saved ``next`` being reassigned; without
        any head ``start_anyway`` continues after the highest offset the
        file says it ever used, which overwrites nothing the file knew of.
        """
        safe = max(self.saved_acked + 1, self.saved_next)
        if self.duplicate is not None:
            return safe, (
                f"another live producer uses this identity (beacons from {self.duplicate});"
                " two processes must not publish into one partition"
            )
        if self.reserved is not None and (
            self.head is not None or not self.need_store or self.policy == START_ANYWAY
        ):
            head = -1 if self.head is None else self.head
            return max(safe, self.reserved, head + 1), None
        if self.head is not None:
            return max(self.saved_acked + 1, self.head + 1), None
        if not self.need_store or self.policy == START_ANYWAY:
            return safe, None
        if self.tower_at is None:
            why = "no tower answered"
        else:
            why = "no store answered GET-HEADS"
        return safe, (
            f"cannot resume the partition: {why} within {self.timeout:g}s, so the offset to"
            " continue at is unknown (start a store, or pass resume='start_anyway' /"
            " `dafka produce --start-anyway` to continue after the saved offsets)"
        )
