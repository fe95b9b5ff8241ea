"""The edge outbox on disk: one LMDB environment per producer partition.

Layout (format version 1), all integers unsigned big-endian:

``meta``
    ``b"format"`` -> ``u32`` (1); ``b"topic"``, ``b"address"`` -> UTF-8 (the
    partition this outbox belongs to); ``b"floor"`` -> ``u64``, every offset
    below it is gone (acknowledged by a store, or evicted); ``b"next"`` ->
    ``u64``, the next offset to assign: the outbox is the authority for where
    the partition continues; ``b"incarnation"`` -> ``u64``, counted up by
    each process that opens the outbox to write; ``b"id"`` -> the outbox's
    id (as in ``outbox.id``).

``records``
    key ``offset:u64`` -> ``ts_ms:u64  content`` for every kept offset
    ``floor .. next - 1`` (contiguous), ``ts_ms`` when it was published.

``DIR/outbox.id`` (JSON, written atomically) names the outbox apart from its
data file: its id, and once a partition claimed it, topic and address.

Durability: :meth:`OutboxDB.commit` writes new records, deletions and the
meta in one transaction, fsync'ed before it returns (data and meta pages, as
the store does: a power cut keeps every commit that returned and never leaves
a torn one).  Deletions after ACKs ride along with the next commit of new
records, or go alone at most every few hundred milliseconds (a crash in
between re-sends a few acknowledged records: stores drop them as
duplicates and acknowledge them again).  A full disk or a
map that reached ``max_map_size`` raises :class:`OutboxFullError`, saying
which and what to do, and leaves the last committed state intact (LMDB is
copy-on-write; no ``writemap``).

Damage is refused, never started over: before LMDB maps ``data.mdb`` its
size is checked against its meta pages (:mod:`dafka.outbox.check`; a cut file
would kill the process with SIGBUS), and an empty or missing ``data.mdb``
next to an ``outbox.id`` that names a partition is damage, not a new outbox.
:class:`OutboxDamagedError` names what is wrong.

One process at a time: :class:`OutboxDB` holds an exclusive ``flock`` on the
directory itself while open (there is no lock file to delete), so a second
producer on the same outbox is refused.  Should exclusion fail all the same
(a filesystem without working ``flock``), each commit checks that the
``incarnation`` is still its own: the older process is fenced off
(:class:`OutboxFencedError`) instead of two processes writing one partition.
``readonly=True`` (``dafka outbox``, ``dafka status --outbox``) takes no lock
and reads a consistent snapshot, also while a producer runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import lmdb

from dafka.errors import BufferFullError, DafkaError
from dafka.outbox import check

log = logging.getLogger("dafka.outbox")

FORMAT_VERSION = 1
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
TS = struct.Struct(">Q")
DEFAULT_MAP_SIZE = 64 << 20
_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
DATA_FILE = "data.mdb"
IDENTITY_FILE = "outbox.id"
# A write that failed with EIO is a full disk when less than this (plus what it
# wrote) was free: LMDB reports a short write on a full disk as EIO.
FULL_MARGIN = 1 << 20
LOCK_FILE_BYTES = 8192  # LMDB's lock.mdb with its default 126 reader slots


class OutboxError(DafkaError):
    """The outbox directory cannot be used (held by another process, another partition, damaged)."""


class OutboxDamagedError(OutboxError):
    """The outbox's files are damaged (truncated, overwritten, missing): it is refused.

    An outbox is never started over by itself: its unacknowledged records
    and its partition's next offset would be lost without a word.
    """


class OutboxFencedError(OutboxError):
    """Another process opened this outbox after this one: this one stops writing."""


class OutboxFullError(BufferFullError):
    """The outbox could not write: the disk (or ``max_map_size``) is full.

    Nothing of the failed write is kept; what was committed before stays.
    """


@dataclass(slots=True)
class OutboxImage:
    """What an outbox held when it was opened."""

    topic: str | None
    address: str | None
    floor: int
    next: int
    records: list[tuple[int, int, bytes]]  # (offset, ts_ms, content), ascending

    @property
    def bytes(self) -> int:
        return sum(len(c) for _, _, c in self.records)


# LMDB errors that mean the file is not what it should be.
_DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.BadDbiError,
    lmdb.IncompatibleError,
)
_LOAD_ERRORS: tuple[type[Exception], ...] = (*_DAMAGE_ERRORS, struct.error, UnicodeDecodeError)


class OutboxDB:
    """The LMDB environment of one outbox directory."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        self.max_map_size = max_map_size
        identity: dict[str, Any] | None = None
        self.incarnation = 0
        self._identity: dict[str, Any] | None = None
        self._dir_fd: int | None = None
        self._identity_due = False
        data = os.path.join(self.path, DATA_FILE)
        if readonly:
            identity = self._identity = self._read_identity()  # (read-only: never written)
            if not os.path.exists(data):
                if identity is None:
                    raise OutboxError(f"no outbox at {self.path}")
                raise self._damaged(identity, f"its {DATA_FILE} is missing")
            if (problem := check.damage(data)) is not None:
                raise self._damaged(identity, f"its {DATA_FILE} {problem}")
            try:
                self.env = lmdb.open(self.path, readonly=True, lock=True, create=False, max_dbs=2, map_size=0)
            except _DAMAGE_ERRORS as exc:
                raise self._damaged(identity, f"LMDB cannot read its {DATA_FILE}: {exc}") from exc
        else:
            os.makedirs(self.path, exist_ok=True)
            self._dir_fd = self._take_lock()
            if max_map_size is not None:
                map_size = min(map_size, max_map_size)
            try:
                identity = self._prepare(data)
                self._allocate_lock_file()
                self.env = lmdb.open(
                    self.path, map_size=map_size, sync=True, metasync=True, writemap=False, max_dbs=2
                )
            except _DAMAGE_ERRORS as exc:
                self._release_lock()
                raise self._damaged(identity, f"LMDB cannot read its {DATA_FILE}: {exc}") from exc
            except (lmdb.Error, OSError) as exc:  # creating files on a full disk, for one
                self._release_lock()
                raise self._write_error(exc, 0) from exc
            except BaseException:
                self._release_lock()
                raise
            # A file bigger than our map (grown last time) sets the map size itself.
        try:
            if readonly:
                self.meta = self.env.open_db(b"meta", create=False)
                self.records = self.env.open_db(b"records", create=False)
            else:
                self.meta = self.env.open_db(b"meta")
                self.records = self.env.open_db(b"records")
                assert identity is not None
                self._begin_incarnation(identity)
            with self.env.begin() as txn:
                raw = txn.get(b"format", db=self.meta)
                if raw is None or raw != U32.pack(FORMAT_VERSION):
                    raise OutboxError(f"{self.path}: not a dafka outbox of format {FORMAT_VERSION}")
        except lmdb.NotFoundError as exc:
            self.close()
            if identity is not None:
                raise self._damaged(identity, f"its {DATA_FILE} holds no outbox") from exc
            raise OutboxError(f"{self.path} holds no dafka outbox") from exc
        except _DAMAGE_ERRORS as exc:
            self.close()
            raise self._damaged(identity, f"LMDB cannot read its {DATA_FILE}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ identity, damage, exclusion

    def _prepare(self, data: str) -> dict[str, Any]:
        """Before LMDB maps anything: the outbox's identity, and its data file checked.

        A new directory gets its identity file first, so that from then on an
        empty or missing data file is known for damage, not taken for a new outbox.
        """
        identity = self._read_identity()
        exists = os.path.exists(data)
        problem = check.damage(data) if exists else None
        if identity is None:
            if problem is not None:
                raise self._damaged(None, f"its {DATA_FILE} {problem}, and it has no {IDENTITY_FILE}")
            identity = {"dafka_outbox": FORMAT_VERSION, "id": os.urandom(8).hex(), "topic": None, "address": None}
            if exists:
                self._identity_due = True  # an outbox from before identity files: written once open
            else:
                self._write_identity(identity)
        elif not exists or problem is not None:
            what = f"its {DATA_FILE} is missing" if not exists else f"its {DATA_FILE} {problem}"
            if identity.get("address") is not None:
                raise self._damaged(identity, what)
            # Never claimed by a partition: it held no record (a crash while it was created).
            # Created again; what was there is kept aside, not deleted.
            log.warning("outbox %s: %s, but it never held a record: created again", self.path, what)
            if exists:
                os.replace(data, f"{data}.damaged-{int(time.time())}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, "lock.mdb"))
        return identity

    def _begin_incarnation(self, identity: dict[str, Any]) -> None:
        """Check the data file is this identity's, and count this opening (fsync'ed).

        Each writer's commits check the count is still theirs: a second
        process that opened the outbox meanwhile (exclusion defeated) fences
        the first one off instead of both writing one partition.
        """
        try:
            with self.env.begin(write=True) as txn:
                if txn.get(b"format", db=self.meta) is None:
                    if txn.get(b"next", db=self.meta) is not None:
                        raise self._damaged(identity, f"its {DATA_FILE} has lost its format record")
                    txn.put(b"format", U32.pack(FORMAT_VERSION), db=self.meta)
                stored = txn.get(b"id", db=self.meta)
                if stored is None:
                    txn.put(b"id", identity["id"].encode(), db=self.meta)
                elif bytes(stored).decode("ascii", "replace") != identity["id"]:
                    if not self._identity_due:
                        raise self._damaged(
                            identity,
                            f"its {DATA_FILE} is another outbox's (id {bytes(stored)!r}, {IDENTITY_FILE} says"
                            f" {identity['id']!r})",
                        )
                    identity["id"] = bytes(stored).decode("ascii", "replace")
                raw = txn.get(b"incarnation", db=self.meta)
                self.incarnation = (U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0) + 1
                txn.put(b"incarnation", U64.pack(self.incarnation), db=self.meta)
                topic, address = txn.get(b"topic", db=self.meta), txn.get(b"address", db=self.meta)
        except (lmdb.Error, OSError) as exc:
            if isinstance(exc, _DAMAGE_ERRORS):
                raise
            raise self._write_error(exc, 0) from exc
        if address is not None and identity.get("address") is None:
            # Claimed, but the identity file was not updated (a crash between the two, or an old outbox).
            identity["topic"], identity["address"] = bytes(topic or b"").decode(), bytes(address).decode()
            self._identity_due = True
        elif address is not None and identity["address"] != bytes(address).decode():
            raise self._damaged(
                identity, f"its {DATA_FILE} holds partition {bytes(address).decode()}, not {identity['address']}"
            )
        self._identity = identity
        if self._identity_due:
            self._save_identity()

    def _read_identity(self) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.path, IDENTITY_FILE), "rb") as f:
                raw = f.read(4096)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise OutboxError(f"outbox {self.path}: cannot read {IDENTITY_FILE}: {exc}") from exc
        try:
            identity = json.loads(raw)
            if not isinstance(identity, dict) or not isinstance(identity.get("id"), str):
                raise ValueError("no id")
        except ValueError as exc:
            raise OutboxDamagedError(
                f"outbox {self.path} is damaged: its {IDENTITY_FILE} is unreadable ({exc}); restore it from a"
                f" backup, or move the directory aside to start a new partition"
            ) from exc
        return identity

    def _write_identity(self, identity: dict[str, Any]) -> None:
        """Replace the identity file atomically (written, fsync'ed, renamed, directory fsync'ed)."""
        tmp = os.path.join(self.path, IDENTITY_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, json.dumps(identity, sort_keys=True).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.path, IDENTITY_FILE))
        assert self._dir_fd is not None
        os.fsync(self._dir_fd)

    def _save_identity(self) -> None:
        """Write the identity file now; on failure, log and try again after the next commit."""
        assert self._identity is not None
        try:
            self._write_identity(self._identity)
            self._identity_due = False
        except OSError as exc:
            self._identity_due = True
            log.error("outbox %s: cannot write %s (%s); trying again at the next commit", self.path, IDENTITY_FILE, exc)

    def _damaged(self, identity: dict[str, Any] | None, what: str) -> OutboxDamagedError:
        held = ""
        if identity is not None and identity.get("address") is not None:
            held = (
                f" It held partition {identity['address']} of topic {identity.get('topic')!r}; its"
                " unacknowledged records (if any) cannot be read."
            )
        return OutboxDamagedError(
            f"outbox {self.path} is damaged: {what}.{held} It is refused, not started over: restore the"
            " directory from a backup, or move it aside to start a new partition (a new address, from offset 0)."
        )

    def _allocate_lock_file(self) -> None:
        """Give LMDB's ``lock.mdb`` its disk blocks before LMDB maps and writes it.

        LMDB writes its lock file through a shared mapping: on a full disk (a
        full tmpfs, for one) the first write to a page without a block is a
        SIGBUS.  Allocated here, a full disk is an ``ENOSPC`` instead.
        """
        fd = os.open(os.path.join(self.path, "lock.mdb"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
        finally:
            os.close(fd)

    def _take_lock(self) -> int:
        """An exclusive ``flock`` on the directory itself (no file one could delete)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OutboxError(
                    f"outbox {self.path} is in use by another process: one producer per outbox"
                ) from exc
            raise OutboxError(f"outbox {self.path}: cannot lock its directory ({exc})") from exc
        return fd

    def _release_lock(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # closing releases the flock
            self._dir_fd = None

    def close(self) -> None:
        """Close; idempotent (every commit was already fsync'ed)."""
        env = getattr(self, "env", None)
        if env is not None:
            self.env = None  # type: ignore[assignment]
            env.close()
        self._release_lock()

    # ------------------------------------------------------------ reading

    def load(self) -> OutboxImage:
        """Everything the outbox holds (a consistent snapshot); damage raises :class:`OutboxDamagedError`."""
        try:
            return self._load()
        except _LOAD_ERRORS as exc:
            raise self._damaged(getattr(self, "_identity", None), f"its records cannot be read ({exc})") from exc

    def _load(self) -> OutboxImage:
        with self.env.begin() as txn:
            topic = txn.get(b"topic", db=self.meta)
            address = txn.get(b"address", db=self.meta)
            floor_raw = txn.get(b"floor", db=self.meta)
            next_raw = txn.get(b"next", db=self.meta)
            floor = U64.unpack(floor_raw)[0] if floor_raw else 0
            nxt = U64.unpack(next_raw)[0] if next_raw else floor
            records = []
            cur = txn.cursor(db=self.records)
            if cur.set_range(U64.pack(floor)):
                for key, value in cur:
                    offset = U64.unpack(key)[0]
                    records.append((offset, TS.unpack_from(value)[0], bytes(value[8:])))
        expected = floor
        for offset, _, _ in records:
            if offset != expected:
                raise self._damaged(getattr(self, "_identity", None), f"offset {expected} is missing (found {offset})")
            expected += 1
        if expected != nxt and records:
            raise self._damaged(getattr(self, "_identity", None), f"its records end at {expected - 1}, its next offset says {nxt}")
        return OutboxImage(
            topic.decode() if topic else None, address.decode() if address else None, floor, nxt, records
        )

    def summary(self) -> tuple[int, int, int | None]:
        """``(records, content bytes, oldest ts_ms or None)`` without loading contents."""
        with self.env.begin() as txn:
            floor_raw = txn.get(b"floor", db=self.meta)
            floor = U64.unpack(floor_raw)[0] if floor_raw else 0
            cur = txn.cursor(db=self.records)
            n = size = 0
            oldest = None
            if cur.set_range(U64.pack(floor)):
                for _, value in cur:
                    if oldest is None:
                        oldest = TS.unpack_from(value)[0]
                    n += 1
                    size += len(value) - 8
        return n, size, oldest

    def iter_records(self, limit: int) -> Iterator[tuple[int, int, bytes]]:
        """Up to ``limit`` kept records ``(offset, ts_ms, content)``, oldest first."""
        image = self.load()
        yield from image.records[:limit]

    # ------------------------------------------------------------ writing

    def claim(self, topic: str, address: str, next_offset: int) -> None:
        """Mark a new outbox as ``topic``/``address``'s, continuing at ``next_offset`` (fsync'ed)."""

        def body(txn: lmdb.Transaction) -> None:
            txn.put(b"topic", topic.encode(), db=self.meta)
            txn.put(b"address", address.encode(), db=self.meta)
            txn.put(b"floor", U64.pack(next_offset), db=self.meta)
            txn.put(b"next", U64.pack(next_offset), db=self.meta)

        self._write(body)
        # From now on the outbox holds records: the identity file says whose, so that a
        # damaged data file is refused (with the partition named), never created again.
        assert self._identity is not None
        self._identity.update(topic=topic, address=address)
        self._save_identity()

    def commit(
        self,
        runs: Sequence[tuple[int, Sequence[bytes]]],
        ts_ms: Sequence[int],
        old_floor: int,
        floor: int,
        next_offset: int,
    ) -> None:
        """Add ``runs``, delete offsets ``old_floor .. floor - 1``; one transaction.

        Fsync'ed.  Raises :class:`OutboxFullError` when
        the disk or the map is full (nothing of it is then committed).
        """
        pack = U64.pack

        def body(txn: lmdb.Transaction) -> None:
            db = self.records
            if floor > old_floor:
                cur = txn.cursor(db=db)
                if cur.set_range(pack(old_floor)):
                    stop = pack(floor)
                    while cur.key() and cur.key() < stop:
                        if not cur.delete():
                            break
            for (first, contents), ts in zip(runs, ts_ms, strict=True):
                head = TS.pack(ts)
                keys = map(pack, range(max(first, floor), first + len(contents)))
                skip = max(0, floor - first)
                values = map(bytes.__add__, repeat(head), contents[skip:] if skip else contents)
                cur = txn.cursor(db=db)
                cur.putmulti(zip(keys, values, strict=False), append=True)
            txn.put(b"floor", pack(floor), db=self.meta)
            txn.put(b"next", pack(next_offset), db=self.meta)

        self._write(body, lambda: sum(len(c) + 32 for _, contents in runs for c in contents))
        if self._identity_due:
            self._save_identity()

    def _write(self, body: Callable[[lmdb.Transaction], None], size: Callable[[], int] = lambda: 0) -> None:
        """Run ``body`` in a write transaction and commit it, if this process still owns the outbox."""
        if self.readonly:
            raise OutboxError(f"outbox {self.path} was opened read-only")
        env = self.env
        if env is None:
            raise OutboxError(f"outbox {self.path} is closed")
        mine = U64.pack(self.incarnation)
        while True:
            txn = env.begin(write=True)
            try:
                if txn.get(b"incarnation", db=self.meta) != mine:
                    raise OutboxFencedError(
                        f"outbox {self.path} was opened by another process after this one (two producers"
                        " with one partition address): this one stops writing and publishing; the other"
                        " keeps the partition"
                    )
                body(txn)
                txn.commit()
            except lmdb.MapFullError:
                txn.abort()
                self._grow()
                continue
            except (lmdb.Error, OSError) as exc:
                txn.abort()
                self._recover()
                raise self._write_error(exc, size()) from exc
            except BaseException:
                txn.abort()
                raise
            break

    def _write_error(self, exc: BaseException, size: int) -> OutboxFullError:
        """What a failed write says: a full disk (named so, and what to do) or another I/O failure."""
        code = getattr(exc, "errno", None)
        text = str(exc)
        try:
            st = os.statvfs(self.path)
            free: int | None = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        full = code in _FULL_ERRNOS or "No space" in text or "Disk quota" in text
        if not full and (code == errno.EIO or "Input/output error" in text):
            # LMDB reports a short write (what a full disk gives) as EIO.
            full = free is not None and free < FULL_MARGIN + 2 * size
        if full:
            room = "" if free is None else f", {free} bytes free"
            return OutboxFullError(
                f"outbox {self.path}: disk full ({text}{room}): nothing of this write was kept, what was"
                " committed before is. Free space on that filesystem (or give the outbox a bigger one);"
                " publishing works again once there is room. Records stores acknowledge leave the outbox."
            )
        return OutboxFullError(
            f"outbox {self.path}: write failed ({text}): nothing of this write was kept, what was committed"
            " before is. Check the disk (the kernel log says more)."
        )

    def _recover(self) -> None:
        """Reopen the environment if a failed commit left it unusable (a meta page write failed).

        LMDB is copy-on-write: reopening reads the last good meta page, the
        state of the last commit that returned.
        """
        env = self.env
        try:
            with env.begin():
                return
        except lmdb.Error:
            log.warning("outbox %s unusable after a failed commit: reopening", self.path)
        size = int(env.info()["map_size"])
        env.close()
        self.env = lmdb.open(self.path, map_size=size, sync=True, metasync=True, writemap=False, max_dbs=2)
        self.meta = self.env.open_db(b"meta")
        self.records = self.env.open_db(b"records")

    def _grow(self) -> None:
        env = self.env
        cur = int(env.info()["map_size"])
        cap = self.max_map_size
        if cap is not None and cur >= cap:
            raise OutboxFullError(
                f"outbox {self.path} is full: it reached outbox_max_map_size ({cap} bytes); nothing of"
                " this write was kept. Publishing works again as stores acknowledge records (they leave"
                " the outbox), or reopen it with a bigger outbox_max_map_size."
            )
        new = cur * 2 if cap is None else min(cur * 2, cap)
        env.set_mapsize(new)
        log.info("outbox %s: map size %d -> %d bytes", self.path, cur, new)
