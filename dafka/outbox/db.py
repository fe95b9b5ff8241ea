"""The edge outbox on disk: one LMDB environment per producer partition.

Layout (format version 1), all integers unsigned big-endian:

``meta``
    ``b"format"`` -> ``u32`` (1); ``b"topic"``, ``b"address"`` -> UTF-8 (the
    partition this outbox belongs to); ``b"floor"`` -> ``u64``, every offset
    below it is gone (acknowledged by a store, or evicted); ``b"next"`` ->
    ``u64``, the next offset to assign: the outbox is the authority for where
    the partition continues.

``records``
    key ``offset:u64`` -> ``ts_ms:u64  content`` for every kept offset
    ``floor .. next - 1`` (contiguous), ``ts_ms`` when it was published.

Durability: :meth:`OutboxDB.commit` writes new records, deletions and the
meta in one transaction, fsync'ed before it returns (data and meta pages, as
the store does: a power cut keeps every commit that returned and never leaves
a torn one).  Deletions after ACKs ride along with the next commit of new
records, or go alone at most every few hundred milliseconds (a crash in
between re-sends a few acknowledged records: stores drop them as
duplicates and acknowledge them again).  A full disk or a
map that reached ``max_map_size`` raises :class:`OutboxFullError` and leaves
the last committed state intact (LMDB is copy-on-write; no ``writemap``).

One process at a time: :class:`OutboxDB` holds an exclusive ``flock`` on
``DIR/owner.lock`` while open, so a second producer on the same outbox is
refused.  ``readonly=True`` (``dafka outbox``, ``dafka status --outbox``)
takes no lock and reads a consistent snapshot, also while a producer runs.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat

import lmdb

from dafka.errors import BufferFullError, DafkaError

log = logging.getLogger("dafka.outbox")

FORMAT_VERSION = 1
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
TS = struct.Struct(">Q")
DEFAULT_MAP_SIZE = 64 << 20
_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class OutboxError(DafkaError):
    """The outbox directory cannot be used (held by another process, another partition, damaged)."""


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
        self._lock_fd: int | None = None
        if readonly:
            if not os.path.exists(os.path.join(self.path, "data.mdb")):
                raise OutboxError(f"no outbox at {self.path}")
            self.env = lmdb.open(self.path, readonly=True, lock=True, create=False, max_dbs=2, map_size=0)
        else:
            os.makedirs(self.path, exist_ok=True)
            self._lock_fd = self._take_lock()
            if max_map_size is not None:
                map_size = min(map_size, max_map_size)
            try:
                self.env = lmdb.open(
                    self.path, map_size=map_size, sync=True, metasync=True, writemap=False, max_dbs=2
                )
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
                with self.env.begin(write=True) as txn:
                    raw = txn.get(b"format", db=self.meta)
                    if raw is None:
                        txn.put(b"format", U32.pack(FORMAT_VERSION), db=self.meta)
            with self.env.begin() as txn:
                raw = txn.get(b"format", db=self.meta)
                if raw is None or U32.unpack(raw)[0] != FORMAT_VERSION:
                    raise OutboxError(f"{self.path}: not a dafka outbox of format {FORMAT_VERSION}")
        except lmdb.NotFoundError as exc:
            self.close()
            raise OutboxError(f"{self.path} holds no dafka outbox") from exc
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> int:
        fd = os.open(os.path.join(self.path, "owner.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise OutboxError(
                f"outbox {self.path} is in use by another process: one producer per outbox"
            ) from exc
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def close(self) -> None:
        """Close; idempotent (every commit was already fsync'ed)."""
        env = getattr(self, "env", None)
        if env is not None:
            self.env = None  # type: ignore[assignment]
            env.close()
        self._release_lock()

    # ------------------------------------------------------------ reading

    def load(self) -> OutboxImage:
        """Everything the outbox holds (a consistent snapshot)."""
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
                raise OutboxError(f"outbox {self.path}: offset {expected} missing (found {offset})")
            expected += 1
        if expected != nxt and records:
            raise OutboxError(f"outbox {self.path}: records end at {expected - 1}, next says {nxt}")
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

        self._write(body)

    def _write(self, body: Callable[[lmdb.Transaction], None]) -> None:
        if self.readonly:
            raise OutboxError(f"outbox {self.path} was opened read-only")
        env = self.env
        if env is None:
            raise OutboxError(f"outbox {self.path} is closed")
        while True:
            txn = env.begin(write=True)
            try:
                body(txn)
                txn.commit()
            except lmdb.MapFullError:
                txn.abort()
                self._grow()
                continue
            except (lmdb.Error, OSError) as exc:
                txn.abort()
                self._recover()
                code = getattr(exc, "errno", None) or getattr(exc, "code", None)
                if code in _FULL_ERRNOS or "No space" in str(exc):
                    raise OutboxFullError(f"outbox {self.path}: disk full ({exc})") from exc
                raise OutboxFullError(f"outbox {self.path}: write failed ({exc})") from exc
            except BaseException:
                txn.abort()
                raise
            break

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
            raise OutboxFullError(f"outbox {self.path} reached outbox max map size {cap} bytes")
        new = cur * 2 if cap is None else min(cur * 2, cap)
        env.set_mapsize(new)
        log.info("outbox %s: map size %d -> %d bytes", self.path, cur, new)
