"""Edge outbox: a producer's unacknowledged records kept on local disk.

``Producer(topic, outbox=DIR)`` writes every published record to an LMDB
outbox (:mod:`dafka.outbox.db`) before it goes on the wire, and removes it
once a store acknowledged it.  A device that loses its link and reboots
keeps what it published: reopened with the same outbox it continues its
partition at once (the outbox is the authority for the next offset; no store
needs to answer), re-announces its head and answers FETCHes from the records
kept, at their original offsets.

Three parts, as the store has them: :mod:`dafka.outbox.core` decides (sans-IO,
it owns the producer's in-memory window, so window and outbox never
diverge), :mod:`dafka.outbox.db` is the LMDB file, and :class:`Outbox` here is
the thin shell: a writer thread doing group commits, and the hooks the
producer calls.

Sync modes (``outbox_sync``):

``"each"`` (default)
    ``publish`` returns once its records are committed and fsync'ed: a
    returned receipt survives a crash or power cut.  Concurrent publishers
    share commits (group commit); ``publish_many`` waits once, at its end.
``"batch"``
    ``publish`` returns at once; the writer commits continuously, each group
    commit taking everything published while the previous one ran, so a
    record is durable within about two commit times (a few ms; at most
    :data:`~dafka.outbox.core.MAX_PENDING` records wait for the disk, beyond
    that ``publish`` waits).  A crash loses at most those not yet committed.

In both modes a record goes on the wire only once committed, so a store never
holds an offset the outbox lost: a restart never reassigns an offset a store
may hold.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from itertools import islice
from typing import Any

import lmdb

from dafka.core.unacked import UnackedWindow
from dafka.errors import BufferFullError, ClosedError, PublishError
from dafka.outbox.core import (
    BLOCK,
    DROP_OLDEST,
    OUTBOX_POLICIES,
    SYNC_BATCH,
    SYNC_EACH,
    SYNC_MODES,
    OutboxCore,
)
from dafka.outbox.db import (
    OutboxDamagedError,
    OutboxDB,
    OutboxError,
    OutboxFencedError,
    OutboxFullError,
    OutboxImage,
)
from dafka.outbox.host import OutboxHost

__all__ = [
    "BLOCK",
    "DROP_OLDEST",
    "OUTBOX_POLICIES",
    "SYNC_BATCH",
    "SYNC_EACH",
    "SYNC_MODES",
    "Outbox",
    "OutboxDamagedError",
    "OutboxError",
    "OutboxFencedError",
    "OutboxFullError",
    "describe",
]

log = logging.getLogger("dafka.outbox")

DELETE_INTERVAL = 0.2  # seconds between commits that only delete acknowledged records
RETRY_INTERVAL = 0.5  # seconds between retries of a failed commit (batch mode)
CHUNK = 1024  # records per lock hold in publish_many


class Outbox:
    """The outbox of one producer: its LMDB file, its core and its writer thread."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        topic: str,
        *,
        max_bytes: int | None = None,
        max_age: float | None = None,
        policy: str = BLOCK,
        sync: str = SYNC_EACH,
        max_map_size: int | None = None,
    ) -> None:
        if policy not in OUTBOX_POLICIES:
            raise ValueError(f"outbox_policy must be one of {OUTBOX_POLICIES}, not {policy!r}")
        if sync not in SYNC_MODES:
            raise ValueError(f"outbox_sync must be one of {SYNC_MODES}, not {sync!r}")
        self.path = os.fspath(path)
        self.db = OutboxDB(self.path, max_map_size=max_map_size)
        try:
            self.image: OutboxImage | None = self.db.load()
        except BaseException:
            self.db.close()
            raise
        if self.image.topic is not None and self.image.topic != topic:
            self.db.close()
            raise OutboxError(f"outbox {self.path} belongs to topic {self.image.topic!r}, not {topic!r}")
        self.topic = topic
        self._limits = {"max_bytes": max_bytes, "max_age": max_age, "policy": policy, "sync": sync}
        self.sync = sync
        self.core: OutboxCore | None = None
        self._producer: OutboxHost | None = None
        self._cond: threading.Condition | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_commit = 0.0
        self._failures = 0
        self._evict_logged = 0
        self._fenced: OutboxFencedError | None = None  # another process opened the outbox after us

    @property
    def address(self) -> str | None:
        """The partition this outbox holds (None: a new outbox)."""
        return self.image.address if self.image is not None else None

    @property
    def authoritative(self) -> bool:
        """Whether the outbox knows where the partition continues (it was used before)."""
        return self.address is not None

    def saved_identity(self) -> dict[str, Any] | None:
        """The outbox's partition as an identity file would hold it (None: new outbox)."""
        image = self.image
        if image is None or image.address is None:
            return None
        return {"address": image.address, "topic": image.topic, "acked": image.floor - 1, "next": image.next}

    # ------------------------------------------------------------ producer hooks

    def attach(self, producer: OutboxHost, resuming: bool) -> None:
        """Take over the producer's window (lock not needed: nothing runs yet).

        The producer publishes through :meth:`append` and :meth:`append_many` from here on.
        """
        self._producer = producer
        self._cond = threading.Condition(producer.lock)
        image = self.image
        if image is not None and image.address is not None:
            if image.address != producer.address:
                raise OutboxError(
                    f"outbox {self.path} belongs to partition {image.address}, not {producer.address}"
                )
            window = UnackedWindow(producer.window.capacity, image.floor)
            window.push_many([c for _, _, c in image.records])
            producer.window = window
            groups: list[tuple[int, float]] = []
            last_ts = None
            for offset, ts, _ in image.records:
                if ts != last_ts:
                    groups.append((offset, ts / 1000))
                    last_ts = ts
            # Publish times are wall-clock on disk; ages are reckoned on the monotonic clock.
            shift = time.monotonic() - time.time()
            self.core = OutboxCore(window, group_times=[(o, t + shift) for o, t in groups], **self._limits)
            if image.records:
                log.info(
                    "outbox %s: %d unacknowledged records of %s (offsets %d..%d) to send again",
                    self.path,
                    len(image.records),
                    self.topic,
                    image.floor,
                    image.next - 1,
                )
        elif not resuming:
            self.db.claim(self.topic, producer.address, producer.window.next)
            self.core = OutboxCore(producer.window, **self._limits)
        self.image = None  # the contents now live in the window
        self._thread = threading.Thread(target=self._run, name="dafka-outbox-writer", daemon=True)
        self._thread.start()

    def resumed(self, window: UnackedWindow) -> None:
        """A producer resumed from its identity file (a new outbox): it continues at ``window.next``."""
        producer = self._producer
        assert producer is not None and self._cond is not None
        self.db.claim(self.topic, producer.address, window.next)
        with self._cond:
            self.core = OutboxCore(window, **self._limits)
            self._cond.notify_all()

    def sendable(self, seq: int, count: int) -> int:
        """FETCH answers and HEADs carry durable records only."""
        core = self.core
        return 0 if core is None else core.sendable(seq, count)

    @property
    def last_sendable(self) -> int:
        core = self.core
        return -1 if core is None else core.durable

    def on_acked(self) -> None:
        """A store's ACK freed records (lock held): the writer deletes them soon."""
        core = self.core
        if core is not None:
            core.acked()
            assert self._cond is not None
            self._cond.notify_all()

    def on_tick(self, now: float) -> None:
        """From the producer's I/O thread: evict what ``max_age`` expired (drop_oldest)."""
        core, cond = self.core, self._cond
        if core is None or cond is None:
            return
        with cond:
            upto = core.expired(now)
            if upto >= 0:
                self._evict(upto, "older than outbox_max_age")

    def expires_at(self) -> float | None:
        """When (monotonic) :meth:`on_tick` next evicts by age: the oldest kept record
        passes ``max_age`` (drop_oldest); None: never (no such limit, nothing kept)."""
        core, cond = self.core, self._cond
        if core is None or cond is None or core.max_age is None or core.policy != DROP_OLDEST:
            return None
        with cond:
            if not len(core.window):
                return None
            now = time.monotonic()
            return now - core.oldest_age(now) + core.max_age

    def failure_for(self, offset: int) -> PublishError | None:
        core = self.core
        if core is not None and core.evicted_at(offset):
            return PublishError(f"offset {offset} was evicted from the outbox unacknowledged", offset)
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is pending, stop the writer, close the file."""
        cond = self._cond
        if cond is not None:
            with cond:
                self._stopping = True
                cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("outbox %s: writer did not stop within %ss", self.path, timeout)
                return
        self.db.close()

    # ------------------------------------------------------------ stats

    @property
    def records(self) -> int:
        return 0 if self.core is None else self.core.records

    @property
    def bytes(self) -> int:
        return 0 if self.core is None else self.core.bytes

    def oldest_age(self) -> float:
        return 0.0 if self.core is None else self.core.oldest_age(time.monotonic())

    @property
    def evicted(self) -> int:
        return 0 if self.core is None else self.core.evicted

    # ------------------------------------------------------------ publishing

    def append(self, content: Any, timeout: float | None = -1.0) -> int:
        """One record of :meth:`Producer.publish` through the outbox; its offset (see the module's sync modes)."""
        return self._publish([content], timeout, wait=True)

    def append_many(self, contents: Iterable[Any], *, timeout: float | None = -1.0) -> int:
        """:meth:`Producer.publish_many` through the outbox; the last offset (-1: none); waits for the disk once, at the end."""
        last = -1
        it = iter(contents)
        while True:
            batch = list(islice(it, CHUNK))
            if not batch:
                break
            last = self._publish(batch, timeout, wait=False)
        if last >= 0 and self.sync == SYNC_EACH:
            self._wait_durable(last, self.core.epoch if self.core else 0, timeout)  # type: ignore[union-attr]
        return last

    def _publish(self, batch: list[bytes], timeout: float | None, wait: bool) -> int:
        producer = self._producer
        cond = self._cond
        assert producer is not None and cond is not None
        if producer.resume_error is not None:
            raise producer.resume_error
        if self._fenced is not None:
            raise self._fenced
        # The checks of Producer.publish, which this replaces: values through the
        # serializer, bytes-like contents, max_record_bytes (nothing published).
        batch = producer.prepare(batch)
        wait_s = producer.publish_timeout if timeout == -1.0 else timeout
        deadline = None if wait_s is None else time.monotonic() + wait_s
        n = len(batch)
        nbytes = sum(map(len, batch))
        with cond:
            while True:
                if self._fenced is not None:
                    raise self._fenced
                if producer.closed or self._stopping:
                    raise ClosedError("producer is closed")
                core = self.core
                if core is None:
                    raise ClosedError("outbox not ready")
                if core.error is not None and self.sync == SYNC_BATCH:
                    raise OutboxFullError(f"outbox cannot write, nothing published: {core.error}")
                now = time.monotonic()
                verdict = core.admit(n, nbytes, now)
                if verdict.ok:
                    break
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    raise BufferFullError(f"outbox full: {verdict.why}")
                cond.wait(remaining if remaining is None else min(remaining, 0.1))
            if verdict.evict_upto >= 0:
                self._evict(verdict.evict_upto, "outbox_max_bytes reached")
            window = core.window
            first = window.push_many(batch)
            core.pushed(first, batch if type(batch) is list else list(batch), now)
            epoch = core.epoch
            cond.notify_all()
            last = first + n - 1
            if wait and self.sync == SYNC_EACH:
                self._wait_durable_locked(last, epoch, deadline)
        return last

    def _wait_durable(self, last: int, epoch: int, timeout: float | None) -> None:
        producer = self._producer
        assert producer is not None and self._cond is not None
        wait_s = producer.publish_timeout if timeout == -1.0 else timeout
        with self._cond:
            self._wait_durable_locked(last, epoch, None if wait_s is None else time.monotonic() + wait_s)

    def _wait_durable_locked(self, last: int, epoch: int, deadline: float | None) -> None:
        core, cond = self.core, self._cond
        assert core is not None and cond is not None
        while core.durable < last:
            if self._fenced is not None:
                raise self._fenced
            if core.epoch != epoch:
                raise OutboxFullError(f"outbox could not keep the record, nothing published: {core.error}", last)
            if self._thread is None or not self._thread.is_alive():
                raise ClosedError("outbox writer stopped")
            # The disk, not the caller's patience, decides: a commit either
            # ends or fails; the deadline only bounds a hung disk.
            remaining = None if deadline is None else deadline - time.monotonic() + 30.0
            if remaining is not None and remaining <= 0:
                raise PublishError(f"outbox commit of offset {last} did not finish", last)
            cond.wait(0.5 if remaining is None else min(remaining, 0.5))

    def _evict(self, upto: int, why: str) -> None:
        """Evict durable unacknowledged records ``<= upto`` (lock held); count and log."""
        core = self.core
        assert core is not None and self._cond is not None
        first = core.window.acked + 1
        n = core.evict(upto)
        if not n:
            return
        self._cond.notify_all()
        self._evict_logged += 1
        if self._evict_logged <= 20 or self._evict_logged % 1000 == 0:
            log.warning(
                "outbox %s: %s: evicted %d unacknowledged records of %s (offsets %d..%d; %d in all)",
                self.path,
                why,
                n,
                self.topic,
                first,
                first + n - 1,
                core.evicted,
            )

    # ------------------------------------------------------------ writer thread

    def _run(self) -> None:
        producer, cond = self._producer, self._cond
        assert producer is not None and cond is not None
        retry_at = 0.0
        while True:
            with cond:
                while True:
                    core = self.core
                    now = time.monotonic()
                    if self._stopping and (core is None or core.error is not None):
                        return  # (what could not be written stays unsent: nothing is lost)
                    if core is not None and now >= retry_at:
                        if core._pending:
                            break
                        if core.window.acked + 1 > core.floor_written and (
                            self._stopping or now - self._last_commit >= DELETE_INTERVAL
                        ):
                            break
                    if self._stopping:
                        return
                    if core is not None and now < retry_at:
                        wait = retry_at - now
                    elif core is not None and core.window.acked + 1 > core.floor_written:
                        wait = self._last_commit + DELETE_INTERVAL - now
                    else:
                        wait = 1.0
                    cond.wait(max(0.0005, wait))
                take = core.take()
                old_floor = core.floor_written
            try:
                shift = int((time.time() - time.monotonic()) * 1000)  # publish times go to disk as wall clock
                self.db.commit(take.runs, [t + shift for t in take.ts_ms], old_floor, take.floor, take.next)
            except OutboxFencedError as exc:
                # Another process opened the outbox after us: it owns the partition now.
                # Nothing of ours is written from here on; publishing fails; beacons stop.
                log.error("%s", exc)
                with cond:
                    self._fenced = exc
                    back = core.commit_failed(take, exc)
                    if back >= 0:
                        core.window.truncate(back)
                    producer.hold_beacons()
                    cond.notify_all()
                return
            except Exception as exc:
                self._failures += 1
                if self._failures <= 20 or self._failures % 1000 == 0:
                    log.error("outbox %s: commit failed (%d so far): %s", self.path, self._failures, exc)
                with cond:
                    back = core.commit_failed(take, exc if isinstance(exc, OutboxFullError) else OutboxFullError(str(exc)))
                    if back >= 0:
                        core.window.truncate(back)
                    retry_at = time.monotonic() + RETRY_INTERVAL
                    cond.notify_all()
                continue
            self._last_commit = time.monotonic()
            retry_at = 0.0
            with cond:
                runs = core.committed(take)
                cond.notify_all()
                if runs and not producer.closed:
                    for first, contents in runs:
                        producer.send_live(first, contents)


def describe(path: str | os.PathLike[str], show: int = 0, now: float | None = None) -> dict[str, Any]:
    """What the outbox at ``path`` holds (read-only; works while a producer runs)."""
    try:
        db = OutboxDB(path, readonly=True)
    except lmdb.Error as exc:
        raise OutboxError(f"cannot read outbox {os.fspath(path)}: {exc}") from exc
    try:
        image = db.load()
    finally:
        db.close()
    now = time.time() if now is None else now
    oldest = image.records[0][1] if image.records else None
    return {
        "path": os.fspath(path),
        "topic": image.topic,
        "partition": image.address,
        "first": image.floor,
        "next": image.next,
        "records": len(image.records),
        "bytes": image.bytes,
        "oldest_age": None if oldest is None else max(0.0, now - oldest / 1000),
        "shown": [
            {"offset": o, "ts_ms": ts, "content": c.decode("utf-8", "backslashreplace")}
            for o, ts, c in image.records[:show]
        ],
    }
