"""LMDB record storage of a Dafka store: every record of every partition.

No sockets and no threads: the store node calls :class:`RecordDB` from its own
threads (any number of readers, one writer at a time), and other processes
(the PySpark connector, ``dafka topics``) open the same directory with
``readonly=True`` while the store writes.

Layout (format version 2)
=========================

One LMDB environment (a directory holding ``data.mdb`` and ``lock.mdb``) with
four named sub-databases, plus ``positions`` once a consumer group committed.
The modules of the store, one per concept: :mod:`dafka.store.layout` (keys and
values), :mod:`dafka.store.block` (the block), :mod:`dafka.store.writer` (what
the group commit packs), :mod:`dafka.store.reader` (finding and slicing
blocks), :mod:`dafka.store.retention`, :mod:`dafka.store.upgrade` (format 1 to
2); this module opens the environment and runs their transactions.
All integers are unsigned big-endian, so LMDB's bytewise key order is numeric
order.

``meta``
    ``b"format"`` -> ``version:u32`` (2).  A writable open of a format-1 store
    converts it (:mod:`dafka.store.upgrade`; ``b"converting"`` is present
    meanwhile); any other version raises :class:`StorageError`.

``partitions`` -- one entry per partition ever stored
    key:   ``topic_len:u8  topic  partition_len:u8  partition`` (UTF-8;
    topics contain no NUL; each name at most 255 bytes, both together at
    most 509 because LMDB keys are at most 511 bytes)

    value: ``pid:u32  first:u64  last:u64  count:u64  bytes:u64`` (36 bytes)

    ``pid`` is the compact partition id used in record keys, ``last`` is the
    head (highest offset ever stored; it stays when retention removes every
    record, so the store never re-fetches them), ``first`` the oldest offset
    still stored (``last + 1`` when none is left), ``count`` the number of
    stored records and ``bytes`` their payload total (content plus Tank key,
    headers excluded).  ``count`` is ``last - first + 1`` unless the
    partition has holes: offsets the store gave up because nobody could
    supply them (see ``skips`` in :meth:`RecordDB.append`).  A hole is
    recorded by the head moving past it with no record stored; readers asking
    for an offset in a hole get the next offset held, as after retention.
    The store fills its holes later when a peer brings the records (see
    ``holes`` and :meth:`RecordDB.fill_holes`); ``count`` then grows.
    Compaction (:mod:`dafka.store.compaction`) leaves gaps too, never
    recorded as holes (and ``first`` stays where it was).

``pids``
    ``pid:u32`` -> the partition key above (reverse map; pids are allocated in
    increasing order, the next one is the last key + 1, never reused).

``blocks``
    key:   ``pid:u32  first_offset:u64`` (12 bytes): one partition's blocks are
    one contiguous key range in offset order, never overlapping, and the
    newest partition appends at the very end.

    value: a block (:mod:`dafka.store.block`): a 52-byte header (offset
    range, record count, timestamps, codec, CRC-32C) and the records.  The
    group commit writes CODEC_STORE blocks of at most 64 KiB of records, one
    or more per partition and commit, each record a format-1 value
    ``ts_ms:u64  flags:u8  [key_len:u8  key  if flags & 1]  content``.
    ``ts_ms`` is when the store received the record, except for records
    published through the Tank gateway, whose Tank timestamp is kept
    (``flags & 2``: "timestamp supplied by the producer").  The key is the
    optional Tank message key (or a Kafka record's key and headers,
    ``flags & 4``).  The block holding an offset is one cursor seek away.

``records``
    Format 1's table of one entry per record, kept empty (see
    :mod:`dafka.store.upgrade` for why).

``positions`` -- committed positions of consumer groups (optional)
    key:   ``group_len:u8  group`` then the partition key above (at most 511
    bytes in all)

    value: ``offset:u64``, the next offset the group delivers

    A commit overwrites the entries in place, so a group's positions are one
    key range whose size is the number of partitions it consumed, however
    many commits were made.  Stores written before this table existed open
    unchanged: the table is created by the first commit, and read as empty
    until then.

``holes`` -- the holes a store recorded and may still fill (optional)
    key:   ``pid:u32  first:u64`` (like a record key)

    value: ``last:u64``

    One entry per range of offsets given up (``skips``) that no record
    holds, written in the transaction that moves the head past it.  Filling
    an offset (:meth:`RecordDB.fill_holes`) writes its record and shrinks or
    splits the entry; retention deletes the entries below a partition's
    ``first``.  Created by the first hole; a writable open of a store with
    holes and no table (written before the table existed) builds it once
    from the block headers (after converting a format-1 store).

Durability and concurrency
==========================

* :meth:`RecordDB.append` (and :meth:`RecordDB.append_runs`) writes a whole
  batch in one write transaction and commits it (fsync'ed unless
  ``sync=False``) before returning; a crash (even SIGKILL) keeps every batch
  whose ``append`` returned and nothing of a batch whose ``append`` did not.
* Blocks go in with MDB_APPEND when they sort after every stored key (the
  newest partition), else with ordinary puts.  Older partitions written in
  the middle of the key space fill their B-tree pages only about half, so a
  store with many concurrently written partitions uses up to ~1.5-1.8x the
  space of one written partition by partition.
* Readers use short read-only transactions (never held across a ``yield``),
  so they see a consistent snapshot and never block the writer or retention.
* The map grows on demand (doubling, up to ``max_map_size``); other processes
  adopt the new size on their next transaction.
* The environment is opened without ``writemap``, so a full disk surfaces as a
  failed write (:class:`StorageFullError`), never as a SIGBUS.
* LMDB allows one open environment per directory per process: share one
  :class:`RecordDB` between the threads of a process, and do not carry one
  across ``fork()``.
* Retention (:meth:`RecordDB.enforce_retention`) deletes whole blocks from
  the front of partitions in bounded write transactions; call it again while
  it reports ``more``.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple, TypeVar

import lmdb

from dafka.errors import ClosedError, ProtocolError, StorageError, StorageFullError
from dafka.fastio import store_blocks
from dafka.store.block import (
    BLOCK_KEY,
    HEADER_SIZE,
    BlockHeader,
    decode_header,
    store_payload,
)
from dafka.store.blocktable import OverlapError, put_block
from dafka.store.compaction import Cleaned, Planner, Scanned, clean_txn, scan_txn
from dafka.store.layout import (
    FLAG_CONTROL,
    FLAG_KEY,
    FORMAT_1,
    FORMAT_VERSION,
    META_CONVERTING,
    META_FORMAT,
    PARTITION_INFO,
    U32,
    U64,
    VALUE_HEADER,
    PartitionInfo,
    group_prefix,
    pack_partition_key,
    pack_position_key,
    topic_prefix,
    unpack_partition_key,
)
from dafka.store.lockfile import WriterLock
from dafka.store.reader import (
    block_after,
    block_payload,
    block_reads,
    block_run,
    convert_block,
    fetch_blocks_past_gaps,
    kafka_batches,
    seek,
)
from dafka.store.retention import (
    Retention,
    RetentionPolicy,
    RetentionResult,
    delete_front_txn,
    retention_txn,
)
from dafka.store.upgrade import RECORDS_DB, convert
from dafka.store.writer import (
    BLOCK_BYTES,
    PartState,
    Run,
    Skip,
    Unit,
    blocks_of,
    group,
    pack_contents,
    pack_records,
    run_of,
    skip_checker,
)

__all__ = [
    "DEFAULT_MAP_SIZE",
    "Hole",
    "PartitionInfo",
    "ReadRecord",
    "RecordDB",
    "Retention",
    "RetentionPolicy",
    "RetentionResult",
    "StorageError",
    "StorageFullError",
    "StoreRecord",
]

log = logging.getLogger(__name__)

DEFAULT_MAP_SIZE = 64 << 20  # initial map; grows by doubling
MAX_DBS = 8
MAX_READERS = 512  # concurrent read transactions over all processes
READ_CHUNK = 1024  # records per read transaction in read()
_PKEY_CACHE_MAX = 65536
_MAX_U64 = (1 << 64) - 1

# errno values that mean "the write did not fit" (LMDB reports short writes as EIO).
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})

_T = TypeVar("_T")


class StoreRecord(NamedTuple):
    """One record for :meth:`RecordDB.append`.

    Plain tuples of 5, 6 or 7 items in this order are accepted too (and are
    the cheapest to build): ``(topic, partition, offset, content, ts_ms)``
    with optional ``key`` and ``ts_from_producer``.
    """

    topic: str
    partition: str
    offset: int
    content: bytes
    ts_ms: int
    key: bytes | None = None
    ts_from_producer: bool = False


class Hole(NamedTuple):
    """A recorded hole: offsets ``first..last`` of a partition that no record holds."""

    topic: str
    partition: str
    first: int
    last: int


class ReadRecord(NamedTuple):
    """One record yielded by :meth:`RecordDB.read`."""

    offset: int
    ts_ms: int
    key: bytes | None
    content: bytes


class _Gate:
    """Counts this process's open read transactions so the map can be resized
    (or the environment reopened) only when none is open, as LMDB requires."""

    __slots__ = ("_cond", "_lock", "_readers", "_exclusive")

    def __init__(self) -> None:
        # Readers take the condition's lock directly (a Condition's own __enter__ is a
        # Python call: a single-record read is a few microseconds, this is part of them).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._readers = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._readers += 1

    def leave(self) -> None:
        with self._lock:
            self._readers -= 1
            # Only exclusive() waits for the readers to go (and it sets _exclusive first);
            # readers waiting in enter() are woken when exclusive() ends.
            if self._readers == 0 and self._exclusive:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True  # stops new readers from entering
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


#: Freed heap memory a writing process keeps rather than giving back to the OS (glibc's
#: ``M_TRIM_THRESHOLD``, see :func:`_keep_freed_heap`).
KEEP_FREED_HEAP = 32 << 20
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_heap_kept = False


#: Records of a client's block converted at once for a slice that does not take them all ...
CONVERT_WINDOW = 65_536
#: ... of which no more than this many bytes are kept for the next slices ...
CONVERT_WINDOW_BYTES = 4 << 20
#: ... in at most this many windows (readers of different blocks at once), the oldest
#: dropped first.
CONVERT_WINDOWS = 4
#: Records at most of the window a slice of fewer than 64 records converts (an eager reader:
#: a Tank client's small fetch_size).  Readers of more blocks than there are windows find
#: theirs dropped every time: each slice of one record converted the rest of its block (up to
#: CONVERT_WINDOW records, 4 MiB) for one.
EAGER_WINDOW = 4096

#: ``(database, partition (its pid, or its key), block header) -> (first offset, values,
#: whether they run to the block's end)``.
_windows: dict[tuple[int, int | bytes, bytes], tuple[int, list[bytes], bool]] = {}
_windows_lock = threading.Lock()


class _WindowConvert:
    """:func:`dafka.store.reader.convert_block` for :meth:`RecordDB.fetch_raw`'s slices.

    A client's block (a Tank bundle, a Kafka batch) is not sliced where it lies: each
    conversion inflates and walks it from its start.  Read in slices (a mesh FETCH answer
    takes 2,000 records a turn), a bundle of millions of messages was walked whole once a
    slice.  So a slice converts a window of up to :data:`CONVERT_WINDOW` records, kept for
    the next slices of the same block (its database, its partition and its header, whose
    CRC covers its records)."""

    __slots__ = ("db", "eager", "pid")

    def __init__(self, db: int, pid: int | bytes, eager: bool = False) -> None:
        self.db = db
        self.pid = pid
        self.eager = eager  # a window even for a slice of fewer than 64 records (not a look at one)

    def __call__(self, value: Any, offset: int, n: int) -> list[bytes]:
        key = (self.db, self.pid, bytes(value[:HEADER_SIZE]))
        win = _windows.get(key)
        if win is not None and win[0] <= offset:
            i = offset - win[0]
            if i + n <= len(win[1]) or (win[2] and i < len(win[1])):
                return win[1][i : i + n]
        values = convert_block(value, offset, n)
        if n >= CONVERT_WINDOW or (n < 64 and not self.eager) or len(values) < n:
            return values  # all of it at once, a look at one record, or the block's end
        # The window holds as many records as CONVERT_WINDOW_BYTES does, at the slice's mean
        # size (converting CONVERT_WINDOW records of 1 KB to keep 4 MiB of them converted the
        # rest of the block again at every window; a compressed block's header cannot tell).
        want = min(CONVERT_WINDOW, CONVERT_WINDOW_BYTES // max(1, sum(map(len, values)) // n))
        if n < 64:
            want = min(want, EAGER_WINDOW)  # (eager): see EAGER_WINDOW
        if want <= n:
            return values
        hdr = decode_header(value)
        if hdr.record_count == hdr.last_offset - hdr.first_offset + 1:
            values += convert_block(value, offset + n, want - n)  # dense: the rest follows on
        else:
            values = convert_block(value, offset, want)
        if len(values) > n:
            kept, size = len(values), sum(map(len, values))
            while kept > n and size > CONVERT_WINDOW_BYTES:
                kept -= 1
                size -= len(values[kept])
            # (It runs to the block's end only if the conversion gave fewer than asked: a
            # window taken for the end would cut the next slices short, and a reader would
            # go on at the next block.)
            entry = (offset, values[:kept] if kept < len(values) else values, kept == len(values) < want)
            with _windows_lock:
                _windows.pop(key, None)
                while len(_windows) >= CONVERT_WINDOWS:
                    del _windows[next(iter(_windows))]
                _windows[key] = entry
        return values[:n]


def _keep_freed_heap() -> None:
    """Let this process keep up to :data:`KEEP_FREED_HEAP` of freed heap (glibc only; once).

    A commit allocates its blocks (about 64 KiB each) and LMDB its dirty pages for them
    (one allocation per block), and frees both when it ends.  By default glibc gives the
    freed top of the heap back to the OS (past 128 KiB) and the next commit takes it again,
    page by page: 1.5-2 more page faults per 4 KiB written, about a tenth of a store's CPU
    (``dafka bench store``: 170k against 110k minor faults for 1M records, 0.55 s against
    0.37 s of system time).  Format 1 wrote single pages, which LMDB recycles itself.
    """
    global _heap_kept
    if _heap_kept:
        return
    _heap_kept = True
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return
    if not mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_HEAP):
        log.debug("mallopt(M_TRIM_THRESHOLD) refused")


class _NotPlain(Exception):
    """Raised in :meth:`RecordDB.append_plain_blocks`'s transaction: not its case (aborted)."""


class _Dbs(NamedTuple):
    """Handles of the four sub-databases."""

    meta: Any
    partitions: Any
    pids: Any
    blocks: Any


_DB_NAMES = tuple(name.encode() for name in _Dbs._fields)
POSITIONS_DB = b"positions"
HOLES_DB = b"holes"


class RecordDB:
    """The records of every partition, in one LMDB environment at ``path``.

    ``sync=False`` skips the fsync at each commit (a process crash loses
    nothing, an OS crash may lose the last commits; see :meth:`flush`).
    ``readonly=True`` is for other processes reading while the store writes;
    the directory must already hold a store.  ``map_size`` is the initial map
    size in bytes, doubled whenever a write does not fit, up to
    ``max_map_size`` (``None``: no limit but the disk).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync: bool = True,
        readonly: bool = False,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.sync = sync
        self.readonly = readonly
        self.max_map_size = max_map_size
        if max_map_size is not None:
            map_size = min(map_size, max_map_size)
        self._initial_map_size = map_size
        self._gate = _Gate()
        self._write_lock = threading.RLock()  # reentrant: reopening runs a write
        self._pkeys: dict[tuple[str, str], bytes] = {}
        self._env: lmdb.Environment | None = None
        self._dbs: _Dbs | None = None
        self._positions_db: Any = None  # opened when it exists (see the layout)
        self._holes_db: Any = None  # likewise
        self._new_holes_db: Any = None  # created by the write transaction in progress
        #: Records skipped by :meth:`append` because their offset was <= head.
        self.duplicates = 0
        self._writer_lock: WriterLock | None = None
        if not readonly:
            os.makedirs(self.path, exist_ok=True)
            self._writer_lock = WriterLock(self.path)  # one writer per database
            _keep_freed_heap()
        try:
            self._open()
        except BaseException:
            self._release_writer_lock()
            raise
        if not readonly and self._holes_db is None:
            try:
                self._build_holes()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ open/close

    def _open(self) -> None:
        if self.readonly:
            if not os.path.exists(os.path.join(self.path, "data.mdb")):
                raise FileNotFoundError(f"no record database at {self.path}")
            # map_size=0: take the size the writer recorded; lock=True so our
            # readers register and the writer never reuses pages we still read.
            env = lmdb.open(
                self.path,
                readonly=True,
                lock=True,
                create=False,
                map_size=0,
                max_dbs=MAX_DBS,
                max_readers=MAX_READERS,
            )
            try:
                self._env = env
                self._dbs = self._open_dbs_readonly(env)
                self._positions_db = self._open_positions(env)
                self._holes_db = self._open_optional(env, HOLES_DB)
            except BaseException:
                self._env = None
                env.close()
                raise
            return
        os.makedirs(self.path, exist_ok=True)
        env = lmdb.open(
            self.path,
            map_size=self._initial_map_size,
            sync=self.sync,
            metasync=self.sync,
            writemap=False,
            lock=True,
            max_dbs=MAX_DBS,
            max_readers=MAX_READERS,
        )
        self._env = env
        try:
            stale = env.reader_check()  # reader slots of killed processes
            if stale:
                log.info("cleared %d stale LMDB reader slots in %s", stale, self.path)
            try:
                # An existing store opens without writing anything.
                self._dbs = self._open_dbs_readonly(env)
            except StorageError:
                if env.stat()["entries"]:
                    raise  # named DBs exist but something is off: do not touch it
                self._dbs = self._write(self._create_dbs)
            self._positions_db = self._open_positions(env)
            self._holes_db = self._open_optional(env, HOLES_DB)
        except BaseException:
            self._env = None
            env.close()
            raise

    def _open_dbs_readonly(self, env: lmdb.Environment) -> _Dbs:
        """The tables of an existing store (a format-1 one converted first, when writable)."""
        try:
            meta = env.open_db(b"meta", create=False)
        except lmdb.NotFoundError as exc:
            raise StorageError(f"{self.path} holds no dafka record database (yet)") from exc
        with env.begin() as txn:
            version = self._check_format(txn.get(META_FORMAT, db=meta))
            converting = txn.get(META_CONVERTING, db=meta) is not None
        if version == FORMAT_1 or converting:
            if self.readonly:
                raise StorageError(
                    f"{self.path}: record database format 1{' being converted' if converting else ''}: "
                    f"its store converts it to format {FORMAT_VERSION} when it opens it (open it "
                    "writable once, or start its store, then read it)"
                )
            convert(env, self._write, self.path)
        try:
            return _Dbs(*(env.open_db(name, create=False) for name in _DB_NAMES))
        except lmdb.NotFoundError as exc:
            raise StorageError(f"{self.path} holds no dafka record database (yet)") from exc

    @staticmethod
    def _open_positions(env: lmdb.Environment) -> Any:
        """The ``positions`` table if a commit created it, else None (nothing is written)."""
        return RecordDB._open_optional(env, POSITIONS_DB)

    @staticmethod
    def _open_optional(env: lmdb.Environment, name: bytes) -> Any:
        """An optional table if a write created it, else None (nothing is written)."""
        try:
            return env.open_db(name, create=False)
        except lmdb.NotFoundError:
            return None

    def _holes_table(self, txn: lmdb.Transaction) -> Any:
        """The ``holes`` table, created in write transaction ``txn`` if need be
        (its handle is kept once the transaction committed, see :meth:`_write`)."""
        db = self._holes_db
        if db is None:
            db = self._new_holes_db
            if db is None:
                db = self._new_holes_db = self._live_env().open_db(HOLES_DB, txn=txn, create=True)
        return db

    def _build_holes(self) -> None:
        """Record the holes of a store written before the ``holes`` table existed.

        Only partitions whose count says they have holes are scanned (their
        block headers, once); a store without holes is not written to.
        """
        with self._read_txn() as (txn, dbs):
            holed = [
                PARTITION_INFO.unpack(raw)
                for raw in txn.cursor(db=dbs.partitions).iternext(keys=False)
            ]
        holed = [info for info in holed if info[3] and info[3] != info[2] - info[1] + 1]
        if not holed:
            return

        def body(txn: lmdb.Transaction) -> int:
            dbs = self._dbs
            assert dbs is not None
            hdb = self._holes_table(txn)
            cur = txn.cursor(db=dbs.blocks)
            found = 0
            for pid, first, last, _count, _nbytes in holed:
                expect = first
                # From the block holding ``first`` (a partial front block may start before it).
                if seek(cur, pid, first) is not None:
                    for key, value in cur.iternext():
                        kpid, off = BLOCK_KEY.unpack(key)
                        if kpid != pid or off > last:
                            break
                        if off > expect:
                            txn.put(BLOCK_KEY.pack(pid, expect), U64.pack(off - 1), db=hdb)
                            found += 1
                        expect = decode_header(value).last_offset + 1
                if expect <= last:
                    txn.put(BLOCK_KEY.pack(pid, expect), U64.pack(last), db=hdb)
                    found += 1
            return found

        found = self._write(body)
        log.info("record database %s: recorded %d holes found in its records", self.path, found)

    def _create_dbs(self, txn: lmdb.Transaction) -> _Dbs:
        env = self._env
        assert env is not None
        dbs = _Dbs(*(env.open_db(name, txn=txn, create=True) for name in _DB_NAMES))
        # Format 1's table of records, kept empty: a format-1 version opens its four tables
        # before it reads the format, so with it there that version says "format 2" when
        # it refuses the database, rather than that it holds no database.
        env.open_db(RECORDS_DB, txn=txn, create=True)
        raw = txn.get(META_FORMAT, db=dbs.meta)
        if raw is None:
            txn.put(META_FORMAT, U32.pack(FORMAT_VERSION), db=dbs.meta)
        else:
            self._check_format(raw)
        return dbs

    def _check_format(self, raw: bytes | None) -> int:
        """The format version (1 or 2); StorageError for any other or none."""
        if raw is None:
            raise StorageError(f"{self.path}: record database has no format version")
        if len(raw) != U32.size:
            raise StorageError(f"{self.path}: record database format is damaged ({len(raw)} bytes: {bytes(raw[:16]).hex()})")
        version = int(U32.unpack(raw)[0])
        if version not in (FORMAT_1, FORMAT_VERSION):
            raise StorageError(
                f"{self.path}: record database format {version}, this code reads format "
                f"{FORMAT_VERSION} (and converts format {FORMAT_1}); it was written by a newer dafka"
            )
        return version

    def close(self) -> None:
        """Close the environment (flushing first if ``sync=False``); idempotent."""
        with self._write_lock, self._gate.exclusive():
            env = self._env
            if env is None:
                return
            self._env = None
            self._dbs = None
            try:
                if not self.readonly and not self.sync:
                    env.sync(True)
            finally:
                env.close()
                self._release_writer_lock()

    def _release_writer_lock(self) -> None:
        lock, self._writer_lock = self._writer_lock, None
        if lock is not None:
            lock.release()

    def __enter__(self) -> RecordDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Force everything committed to disk (only useful with ``sync=False``)."""
        if not self.readonly:
            self._live_env().sync(True)

    @property
    def map_size(self) -> int:
        """The current map size in bytes."""
        return int(self._live_env().info()["map_size"])

    def _live_env(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise ClosedError(f"record database {self.path} is closed")
        return env

    # ------------------------------------------------------------------ transactions

    @contextmanager
    def _read_txn(self, buffers: bool = False) -> Iterator[tuple[lmdb.Transaction, _Dbs]]:
        """A short read-only transaction; adopts a map grown by another process.

        ``buffers``: values (and keys) are zero-copy memoryviews, valid only inside it."""
        gate = self._gate
        gate.enter()
        try:
            while True:
                env = self._live_env()
                try:
                    txn = env.begin(buffers=buffers)
                    break
                except lmdb.MapResizedError:
                    # The writer (another process) grew the map past ours: remap,
                    # which LMDB allows only with no transaction open here.
                    gate.leave()
                    try:
                        with gate.exclusive():
                            if self._env is not None:
                                self._env.set_mapsize(0)
                    finally:
                        gate.enter()
            dbs = self._dbs
            assert dbs is not None
            try:
                yield txn, dbs
            finally:
                txn.abort()
        finally:
            gate.leave()

    def _write(self, body: Callable[[lmdb.Transaction], _T]) -> _T:
        """Run ``body`` in one write transaction and commit it.

        On MDB_MAP_FULL the transaction is aborted, the map grown and ``body``
        run again from scratch.  Write errors become :class:`StorageFullError`;
        any exception aborts, so nothing of a failed call is committed.
        """
        if self.readonly:
            raise StorageError(f"record database {self.path} was opened read-only")
        with self._write_lock:
            while True:
                self._new_holes_db = None
                txn = self._live_env().begin(write=True)
                try:
                    result = body(txn)
                except lmdb.MapFullError:
                    self._abort_write(txn)
                    self._grow()
                    continue
                except lmdb.Error as exc:
                    self._abort_write(txn)
                    if getattr(exc, "code", None) in _FULL_ERRNOS:
                        raise StorageFullError(f"write to {self.path} failed: {exc}") from exc
                    raise
                except OSError as exc:
                    self._abort_write(txn)
                    if exc.errno in _FULL_ERRNOS:
                        raise StorageFullError(f"write to {self.path} failed: {exc}") from exc
                    raise
                except BaseException:
                    self._abort_write(txn)
                    raise
                try:
                    txn.commit()
                except lmdb.MapFullError:
                    self._abort_write(txn)  # already aborted by LMDB; harmless
                    self._grow()
                    continue
                except lmdb.Error as exc:
                    # Pages could not be written (ENOSPC, EFBIG, EIO...): LMDB
                    # aborted the transaction and the old meta page still rules.
                    self._abort_write(txn)
                    self._recover_after_failed_commit()
                    raise StorageFullError(
                        f"commit to {self.path} failed (disk full or I/O error): {exc}"
                    ) from exc
                if self._new_holes_db is not None:
                    self._holes_db, self._new_holes_db = self._new_holes_db, None
                return result

    def _abort_write(self, txn: lmdb.Transaction) -> None:
        """Abort a write transaction while no read transaction of this process is open.

        py-lmdb 3.0's ``abort()`` of a write transaction never returns while
        two or more other threads keep beginning read transactions (they
        starve it; commit is not affected), so readers are held off meanwhile.
        """
        with self._gate.exclusive():
            txn.abort()

    def _grow(self) -> None:
        """Double the map (up to ``max_map_size``); called with no transaction open."""
        env = self._live_env()
        cur = int(env.info()["map_size"])
        cap = self.max_map_size
        if cap is not None and cur >= cap:
            raise StorageFullError(f"record database {self.path} reached max_map_size={cap} bytes")
        new = cur * 2
        if cap is not None:
            new = min(new, cap)
        with self._gate.exclusive():
            env.set_mapsize(new)
        log.info("record database %s: map size %d -> %d bytes", self.path, cur, new)

    def _recover_after_failed_commit(self) -> None:
        """Reopen the environment if the failed commit left it unusable.

        LMDB marks the environment fatally broken only when writing the meta
        page failed; reopening then reads the last good meta page from disk.
        """
        env = self._live_env()
        try:
            with env.begin():
                pass
            return
        except lmdb.Error:
            log.warning("record database %s unusable after a failed commit: reopening", self.path)
        with self._gate.exclusive():
            env.close()
            self._env = None
            self._dbs = None
            self._open()  # the store exists, so this writes nothing

    # ------------------------------------------------------------------ helpers

    def _pkey(self, topic: str, partition: str) -> bytes:
        tp = (topic, partition)
        pkey = self._pkeys.get(tp)
        if pkey is None:
            pkey = pack_partition_key(topic, partition)
            if len(self._pkeys) >= _PKEY_CACHE_MAX:
                self._pkeys.clear()  # unbounded names from the network must not grow it
            self._pkeys[tp] = pkey
        return pkey

    def partition_key(self, topic: str, partition: str) -> bytes:
        """The ``partitions`` key of a partition (ValueError for a name no partition can have)."""
        return self._pkey(topic, partition)

    # ------------------------------------------------------------------ append

    def append(
        self,
        batch: Sequence[Sequence[Any]],
        *,
        skips: Sequence[Skip] = (),
        rejected: dict[tuple[str, str], str] | None = None,
        blocks: Sequence[tuple[str, str, bytes | memoryview]] = (),
        gate: AbstractContextManager[Any] | None = None,
    ) -> dict[tuple[str, str], int]:
        """Persist ``batch`` in one committed (and, with ``sync``, fsync'ed) transaction.

        ``batch`` holds :class:`StoreRecord` or plain tuples
        ``(topic, partition, offset, content, ts_ms[, key[, ts_from_producer]])``
        in any mix of partitions.  Fastest: plain 5-tuples, all records of a
        partition at consecutive offsets (they are then packed with C-level
        passes, no per-record Python statements); a common ``ts_ms`` helps.  Per partition, in batch order, each record must be
        at ``head + 1``; a record at or below the head is a duplicate and
        skipped (counted in :attr:`duplicates`).  A record beyond ``head + 1``
        is a gap: allowed when ``skips`` (``(topic, partition, first, last)``
        ranges of offsets given up: nobody could supply them) cover every
        missing offset -- the partition then has a hole, its head moves past
        it -- else the partition is refused.  A partition's very first record
        may be at any offset.

        Refusals (a gap, a malformed record) are per partition: with a
        ``rejected`` dict, each refused partition is put in it with the
        reason, none of its records is written, and the other partitions
        commit.  Without it, any refusal raises (ValueError or TypeError) and
        nothing is committed.

        Returns the head of every partition in the batch that was not refused
        (also of those whose records were all duplicates).  Raises
        :class:`StorageFullError` when the batch does not fit (nothing of it
        is committed then).  ``blocks`` and ``gate``: see :meth:`append_pairs`.
        """
        n = len(batch)
        if not n:
            return self.append_blocks(blocks, skips=skips, rejected=rejected, gate=gate) if blocks else {}
        pkey = self._pkey
        try:
            # Transposing is one C-level pass and checks the tuple shapes.
            cols = tuple(zip(*batch, strict=True))
        except ValueError:
            cols = ()  # mixed tuple lengths: the general path
        units: list[Unit] = []
        if cols and cols[0].count(cols[0][0]) == n and cols[1].count(cols[1][0]) == n:
            groups: Any = (((cols[0][0], cols[1][0]), batch, cols),)  # one partition
        else:
            groups = ((tp, recs, None) for tp, recs in group(batch).items())
        for tp, recs, tcols in groups:
            # Names are validated before the write transaction starts.
            if tcols is None:
                try:
                    tcols = tuple(zip(*recs, strict=True))
                except ValueError:
                    tcols = ()
            run = run_of(tcols) if tcols else None
            if run is None:
                units.append((tp, pkey(tp[0], tp[1]), recs[0][2], recs, None))
            else:
                units.append((tp, pkey(tp[0], tp[1]), run[0], run[1], run[2]))
        return self._append_units(units, skips, rejected, gate=gate, blocks=blocks)

    def append_runs(
        self,
        runs: Sequence[tuple[str, str, int, Sequence[bytes], int | Sequence[int]]],
        *,
        skips: Sequence[Skip] = (),
        rejected: dict[tuple[str, str], str] | None = None,
    ) -> dict[tuple[str, str], int]:
        """The fastest append: runs of consecutive plain records, all in one transaction.

        Each run is ``(topic, partition, first_offset, contents, ts_ms)``:
        ``contents[i]`` is the record at ``first_offset + i``, without Tank
        key, stamped ``ts_ms`` (one int for all, or a sequence of one each).
        Same rules and result as :meth:`append` (the part of a run at or
        below the head is skipped as duplicates, a run starting beyond
        ``head + 1`` is a gap, allowed only where ``skips`` cover it);
        several runs of one partition are applied in order.
        """
        units = []
        for topic, partition, first_offset, contents, ts_ms in runs:
            if contents:
                units.append(
                    (
                        (topic, partition),
                        self._pkey(topic, partition),
                        first_offset,
                        contents,
                        ts_ms,
                    )
                )
        if not units:
            return {}
        return self._append_units(units, skips, rejected)

    def append_pairs(
        self,
        batch: Sequence[Sequence[Any]],
        pairs: list[bytes | tuple[bytes, bytes]],
        segs: Sequence[tuple[str, str, int, int, int, int]],
        gate: AbstractContextManager[Any] | None = None,
        *,
        skips: Sequence[Skip] = (),
        rejected: dict[tuple[str, str], str] | None = None,
        blocks: Sequence[tuple[str, str, bytes | memoryview]] = (),
    ) -> dict[tuple[str, str], int]:
        """:meth:`append` of ``batch``, of ready record pairs and of ``blocks`` (see
        :meth:`append_blocks`), in one transaction.

        ``pairs`` are the stored values of plain records (see the layout above)
        of partitions already stored, as built by :func:`dafka.fastio.drain_pairs`
        (or format 1's ``(key, value)`` pairs, whose keys are not used); ``segs`` describes them: one
        ``(topic, partition, pid, first, last, content_bytes)`` per run of
        consecutive offsets, in order.  ``batch`` is applied first.  Each run
        must continue its partition (``first == head + 1``, or beyond it over
        offsets ``skips`` give up) with the partition's ``pid``, else the
        partition is refused (see :meth:`append` for ``skips`` and
        ``rejected``).

        ``gate`` (a lock) is held while the pairs are put: py-lmdb releases
        the GIL around every single put, so a thread of the caller that runs
        without releasing the GIL for long (a compiled receive loop) would
        make each put wait for it; such a thread takes the gate around its
        work and so waits, GIL released, while the puts run.
        """
        if not pairs:
            if batch:
                return self.append(batch, skips=skips, rejected=rejected, blocks=blocks, gate=gate)
            return self.append_blocks(blocks, skips=skips, rejected=rejected, gate=gate) if blocks else {}
        units: list[Unit] = []
        if batch:
            for tp, recs in group(batch).items():
                units.append((tp, self._pkey(tp[0], tp[1]), recs[0][2], recs, None))
        return self._append_units(units, skips, rejected, pairs, segs, gate, blocks)

    def append_blocks(
        self,
        blocks: Sequence[tuple[str, str, bytes | memoryview]],
        *,
        skips: Sequence[Skip] = (),
        rejected: dict[tuple[str, str], str] | None = None,
        gate: AbstractContextManager[Any] | None = None,
    ) -> dict[tuple[str, str], int]:
        """Store ready-made blocks as they are, in one committed transaction.

        Each entry is ``(topic, partition, block)``: a block of any codec
        (:mod:`dafka.store.block`: a client's Tank bundle or Kafka batch as
        sent, or a ``CODEC_STORE`` block), validated by whoever built it (its
        header is checked for shape here, its records are not walked again).
        Its offsets are the ones its header names (the caller assigned them);
        a partition's blocks are applied in offset order, after the
        partition's records of the same call (:meth:`append_pairs`).  A block
        wholly at or below the head is a duplicate (skipped, counted in
        :attr:`duplicates`); one starting beyond ``head + 1`` is a gap,
        allowed where ``skips`` cover it (a hole); one overlapping the head,
        or any other disagreement, refuses its partition (see :meth:`append`
        for ``rejected``).  A new partition may start anywhere.  Same result
        as :meth:`append`; ``gate``: see :meth:`append_pairs`.
        """
        if not blocks:
            return {}
        if not skips:
            heads = self.append_plain_blocks(blocks, gate)
            if heads is not None:
                return heads
        return self._append_units([], skips, rejected, gate=gate, blocks=blocks)

    def append_plain_blocks(
        self,
        blocks: Sequence[tuple[str, str, bytes | memoryview]],
        gate: AbstractContextManager[Any] | None = None,
    ) -> dict[tuple[str, str], int] | None:
        """:meth:`append_blocks`' common case in a lean transaction: every header well formed,
        every partition stored already, and its blocks, in the order given, continuing its head
        exactly (a Tank produce's blocks).  None when anything else is met, nothing written: the
        general path (:meth:`append_blocks`) decides then, refusals and all.  Raises as
        :meth:`append` does for a write that fails (:class:`StorageFullError`).

        The general path's partition states, refusal bookkeeping and per-partition dicts cost
        the Tank gateway's inline commit about 10 µs a bundle of its 146 (measured in-process)."""
        if not blocks:
            return {}  # (as append_blocks: no transaction)
        runs: dict[tuple[str, str], list[tuple[BlockHeader, bytes | memoryview]]] = {}
        pkeys: dict[tuple[str, str], bytes] = {}
        for topic, partition, block in blocks:
            try:
                hdr = decode_header(block)
            except (ProtocolError, TypeError, struct.error):
                return None
            tp = (topic, partition)
            run = runs.get(tp)
            if run is None:
                try:
                    pkeys[tp] = self._pkey(topic, partition)
                except (ValueError, TypeError):
                    return None  # a name no partition can have: the general path refuses it
                runs[tp] = [(hdr, block)]
            else:
                run.append((hdr, block))
        pack_key, pack_info, unpack_info = BLOCK_KEY.pack, PARTITION_INFO.pack, PARTITION_INFO.unpack

        def body(txn: lmdb.Transaction) -> dict[tuple[str, str], int]:
            dbs = self._dbs
            assert dbs is not None
            parts_db = dbs.partitions
            heads: dict[tuple[str, str], int] = {}
            entries: list[tuple[bytes, bytes | memoryview]] = []
            for tp, run in runs.items():
                pkey = pkeys[tp]
                raw = txn.get(pkey, db=parts_db)
                if raw is None:
                    raise _NotPlain
                pid, first, last, count, nbytes = unpack_info(raw)
                for hdr, block in run:
                    if hdr.first_offset != last + 1:
                        raise _NotPlain  # a duplicate, an overlap or a gap
                    if count == 0:
                        first = hdr.first_offset  # emptied by retention
                    count += hdr.record_count
                    nbytes += block_payload(hdr, block)
                    last = hdr.last_offset
                    entries.append((pack_key(pid, hdr.first_offset), block))
                txn.put(pkey, pack_info(pid, first, last, count, nbytes), db=parts_db)
                heads[tp] = last
            if len(runs) > 1:
                entries.sort(key=itemgetter(0))  # (pid, offset) keys: the general path's order
            self._put_blocks(txn, dbs, entries, gate)
            return heads

        try:
            with self._write_lock:
                return self._write(body)
        except _NotPlain:
            return None

    def _append_units(
        self,
        units: list[Unit],
        skips: Sequence[Skip],
        rejected: dict[tuple[str, str], str] | None,
        pairs: list[bytes | tuple[bytes, bytes]] | None = None,
        segs: Sequence[tuple[str, str, int, int, int, int]] = (),
        gate: AbstractContextManager[Any] | None = None,
        blocks: Sequence[tuple[str, str, bytes | memoryview]] = (),
    ) -> dict[tuple[str, str], int]:
        covered = skip_checker(skips) if skips else None
        # Headers are checked and each partition's blocks put in offset order before the
        # write transaction starts (a malformed block refuses its partition in it).
        by_tp = self._blocks_by_partition(blocks) if blocks else {}
        refusals: dict[tuple[str, str], Exception] = {}

        def body(txn: lmdb.Transaction) -> tuple[dict[tuple[str, str], int], int]:
            refusals.clear()  # a retry after the map grew starts over
            heads, dups = self._append_txn(txn, units, pairs, segs, gate, covered, refusals, by_tp)
            if refusals and rejected is None:
                raise next(iter(refusals.values()))
            return heads, dups

        with self._write_lock:
            heads, dups = self._write(body)
            self.duplicates += dups
        if rejected is not None:
            for tp, exc in refusals.items():
                rejected[tp] = str(exc)
        return heads

    def _append_txn(
        self,
        txn: lmdb.Transaction,
        units: list[Unit],
        pairs: list[bytes | tuple[bytes, bytes]] | None,
        segs: Sequence[tuple[str, str, int, int, int, int]],
        gate: AbstractContextManager[Any] | None,
        covered: Callable[[tuple[str, str], int, int], bool] | None,
        refusals: dict[tuple[str, str], Exception],
        by_tp: dict[tuple[str, str], list[tuple[BlockHeader, bytes | memoryview] | Exception]] | None = None,
    ) -> tuple[dict[tuple[str, str], int], int]:
        dbs = self._dbs
        assert dbs is not None
        parts_db = dbs.partitions
        states: dict[tuple[str, str], PartState] = {}
        puts: dict[int, list[Run]] = {}
        ready: dict[int, list[tuple[bytes, bytes]]] = {}  # blocks of ready pairs, by pid
        given: dict[int, list[tuple[bytes, bytes]]] = {}  # ready-made blocks, by pid
        dups = 0
        next_pid: int | None = None

        def refuse(tp: tuple[str, str], exc: Exception) -> None:
            """Take back everything of ``tp`` this transaction did (its other partitions stay)."""
            refusals[tp] = exc
            st = states.pop(tp, None)
            if st is not None:
                puts.pop(st.pid, None)
                given.pop(st.pid, None)
                if st.new:
                    txn.delete(U32.pack(st.pid), db=dbs.pids)

        def state_of(tp: tuple[str, str], pkey: bytes, start: Any) -> PartState:
            """The partition's state in this transaction, created when it is new."""
            nonlocal next_pid
            st = states.get(tp)
            if st is None:
                raw = txn.get(pkey, db=parts_db)
                if raw is None:
                    # A new partition may start anywhere (its store caught up
                    # from others whose retention removed the beginning).
                    if not isinstance(start, int) or start < 0:
                        raise ValueError(f"bad offset {start!r} for {tp[0]!r}/{tp[1]!r}")
                    # Offsets before it that this store gave up (a skip
                    # from 0: its reader waited skip_after for them) are a
                    # hole it asks its peers for again, as one after a
                    # stored record; without such a skip they are not
                    # (other stores' retention, or where it started).
                    # (Issue 40, seed 205892: a store that gave up 0..14
                    # never asked again for 14, which another store held.)
                    base = start
                    if start > 0 and covered is not None and covered(tp, 0, start - 1):
                        base = 0
                    if next_pid is None:
                        next_pid = self._next_pid(txn, dbs)
                    st = PartState(pkey, next_pid, base, base - 1, 0, 0)
                    st.new = True
                    next_pid += 1
                    txn.put(U32.pack(st.pid), pkey, db=dbs.pids)
                else:
                    st = PartState(pkey, *PARTITION_INFO.unpack(raw))
                states[tp] = st
            return st

        for tp, pkey, start, recs, ts_ms in units:
            if tp in refusals:
                continue
            try:
                st = state_of(tp, pkey, start)
                nxt = st.last + 1
                if ts_ms is None:
                    skipped = None if covered is None else partial(covered, tp)
                    runs, new_nxt, nbytes, d = pack_records(nxt, recs, tp, skipped, st.holes)
                else:
                    if start > nxt:
                        if covered is None or not covered(tp, nxt, start - 1):
                            raise ValueError(
                                f"gap in {tp[0]!r}/{tp[1]!r}: offset {start} after head {nxt - 1} "
                                "(offsets must be contiguous unless skipped)"
                            )
                        st.holes.append((nxt, start - 1))
                        nxt = start  # a hole: the offsets before were given up
                    d = nxt - start  # leading records at or below the head
                    if d > 0:
                        d = min(d, len(recs))
                        recs = recs[d:]
                        if not isinstance(ts_ms, int):
                            ts_ms = ts_ms[d:]
                    if recs:
                        runs, new_nxt, nbytes, _ = pack_contents(nxt, recs, ts_ms)
                    else:
                        runs = []
            except (ValueError, TypeError, struct.error) as exc:
                refuse(tp, exc if not isinstance(exc, struct.error) else ValueError(f"bad record field: {exc}"))
                continue
            dups += d
            if not runs:
                continue
            if st.count == 0:
                st.first = runs[0][0]  # new, emptied by retention, or after a hole
            st.last = new_nxt - 1
            st.count += sum(len(r[1]) for r in runs)
            st.nbytes += nbytes
            st.changed = True
            got = puts.get(st.pid)
            if got is None:
                puts[st.pid] = runs
            else:
                got.extend(runs)
        if pairs:
            if len(pairs) != sum(seg[4] - seg[3] + 1 for seg in segs):
                raise ValueError(f"{len(pairs)} ready records, runs describe another number")
            self._append_pair_runs(txn, states, segs, covered, refusals, refuse)
            # Each run of ready pairs becomes blocks (segs describe them in order), the
            # refused partitions' left out: the blocks are built from the pairs' values in
            # one compiled pass, the pairs' keys are not used.
            i = 0
            for seg in segs:
                n = seg[4] - seg[3] + 1
                if (seg[0], seg[1]) not in refusals:
                    ready.setdefault(seg[2], []).extend(store_blocks(pairs, i, i + n, seg[2], seg[3], BLOCK_BYTES, -1))
                i += n
        if by_tp:
            dups += self._account_blocks(by_tp, state_of, covered, refusals, refuse, given)
        hole_entries: list[tuple[bytes, bytes]] = []
        for st in states.values():
            if st.changed:
                txn.put(st.pkey, st.pack(), db=parts_db)
            if st.holes:
                hole_entries.extend((BLOCK_KEY.pack(st.pid, lo), U64.pack(hi)) for lo, hi in st.holes)
        if hole_entries:
            hdb = self._holes_table(txn)
            for key, value in hole_entries:
                txn.put(key, value, db=hdb)
        blocks: list[tuple[bytes, bytes]] = []
        if puts or ready or given:
            for pid in sorted(puts.keys() | ready.keys() | given.keys()):
                for run in puts.get(pid, ()):
                    blocks.extend(blocks_of(run, pid))
                blocks.extend(ready.get(pid, ()))
                blocks.extend(given.get(pid, ()))
        if blocks:  # (none when every ready-made block was stored already: see _account_blocks)
            self._put_blocks(txn, dbs, blocks, gate)
        return {tp: st.last for tp, st in states.items()}, dups

    def _put_blocks(
        self,
        txn: lmdb.Transaction,
        dbs: _Dbs,
        blocks: Sequence[tuple[bytes, bytes | memoryview]],
        gate: AbstractContextManager[Any] | None,
    ) -> None:
        """Put ``(key, block)`` entries, sorted by key, none present yet."""
        cur = txn.cursor(db=dbs.blocks)
        tail = cur.key() if cur.last() else b""
        # MDB_APPEND is only valid past the last key of the whole table (the newest
        # partition's blocks); older partitions get no-overwrite puts.
        split = bisect.bisect_right(blocks, tail, key=itemgetter(0)) if blocks[0][0] <= tail else 0
        added = 0
        with gate if gate is not None else nullcontext():
            if split:
                added += cur.putmulti(blocks[:split], overwrite=False)[1]
            if split < len(blocks):
                added += cur.putmulti(blocks if not split else blocks[split:], append=True)[1]
        if added != len(blocks):
            raise StorageError(
                f"{self.path}: {len(blocks) - added} blocks already present past a head "
                "(database inconsistent)"
            )

    def _append_pair_runs(
        self,
        txn: lmdb.Transaction,
        states: dict[tuple[str, str], PartState],
        segs: Sequence[tuple[str, str, int, int, int, int]],
        covered: Callable[[tuple[str, str], int, int], bool] | None,
        refusals: dict[tuple[str, str], Exception],
        refuse: Callable[[tuple[str, str], Exception], None],
    ) -> None:
        """Account runs of ready pairs in the partitions' states (checks included)."""
        dbs = self._dbs
        assert dbs is not None
        for topic, partition, pid, first, last, nbytes in segs:
            tp = (topic, partition)
            if tp in refusals:
                continue
            st = states.get(tp)
            if st is None:
                pkey = self._pkey(topic, partition)
                raw = txn.get(pkey, db=dbs.partitions)
                if raw is None:
                    refuse(tp, ValueError(f"ready records of {topic!r}/{partition!r}, which is not stored"))
                    continue
                st = PartState(pkey, *PARTITION_INFO.unpack(raw))
                states[tp] = st
            if (
                pid != st.pid
                or last < first
                or (first != st.last + 1 and (first <= st.last or covered is None or not covered(tp, st.last + 1, first - 1)))
            ):
                refuse(
                    tp,
                    ValueError(
                        f"ready records {first}..{last} (pid {pid}) of {topic!r}/{partition!r} do not "
                        f"continue head {st.last} (pid {st.pid})"
                    ),
                )
                continue
            if first != st.last + 1:
                st.holes.append((st.last + 1, first - 1))
            if st.count == 0:
                st.first = first
            st.count += last - first + 1
            st.last = last
            st.nbytes += nbytes
            st.changed = True

    @staticmethod
    def _blocks_by_partition(
        blocks: Sequence[tuple[str, str, bytes | memoryview]],
    ) -> dict[tuple[str, str], list[tuple[BlockHeader, bytes | memoryview] | Exception]]:
        """Ready-made blocks per partition with their headers, in offset order (an
        Exception in a partition's list: a block that is not one, which refuses it)."""
        by_tp: dict[tuple[str, str], list[tuple[BlockHeader, bytes | memoryview] | Exception]] = {}
        for topic, partition, block in blocks:
            got = by_tp.setdefault((topic, partition), [])
            try:
                got.append((decode_header(block), block))
            except (ProtocolError, TypeError, struct.error) as exc:
                got.append(ValueError(f"not a block: {exc}"))
        for got in by_tp.values():
            if len(got) > 1 and not any(isinstance(g, Exception) for g in got):
                got.sort(key=lambda g: g[0].first_offset)  # type: ignore[union-attr]
        return by_tp

    def _account_blocks(
        self,
        by_tp: dict[tuple[str, str], list[tuple[BlockHeader, bytes | memoryview] | Exception]],
        state_of: Callable[[tuple[str, str], bytes, Any], PartState],
        covered: Callable[[tuple[str, str], int, int], bool] | None,
        refusals: dict[tuple[str, str], Exception],
        refuse: Callable[[tuple[str, str], Exception], None],
        given: dict[int, list[tuple[bytes, bytes]]],
    ) -> int:
        """Check ready-made blocks against their partitions' heads and account them in the
        states; their ``(key, block)`` pairs go into ``given`` by pid.  Duplicates skipped."""
        dups = 0
        pack_key = BLOCK_KEY.pack
        for tp, entries in by_tp.items():
            if tp in refusals:
                continue
            try:
                for entry in entries:
                    if isinstance(entry, Exception):
                        raise entry
                st = state_of(tp, self._pkey(*tp), entries[0][0].first_offset)  # type: ignore[union-attr]
                mine = given.setdefault(st.pid, [])
                for hdr, block in entries:  # type: ignore[misc]
                    nxt = st.last + 1
                    if hdr.last_offset < nxt:
                        dups += hdr.record_count  # a block sent again: stored already
                        continue
                    if hdr.first_offset < nxt:
                        raise ValueError(
                            f"block {hdr.first_offset}..{hdr.last_offset} of {tp[0]!r}/{tp[1]!r} overlaps "
                            f"head {nxt - 1}"
                        )
                    if hdr.first_offset > nxt:
                        if covered is None or not covered(tp, nxt, hdr.first_offset - 1):
                            raise ValueError(
                                f"gap in {tp[0]!r}/{tp[1]!r}: block at {hdr.first_offset} after head {nxt - 1} "
                                "(offsets must be contiguous unless skipped)"
                            )
                        st.holes.append((nxt, hdr.first_offset - 1))
                    if st.count == 0:
                        st.first = hdr.first_offset
                    # A sparse block (a Tank bundle with gaps inside) holds fewer records than
                    # its span: the offsets it skips are not records (its reader skips them).
                    st.count += hdr.record_count
                    st.nbytes += block_payload(hdr, block)
                    st.last = hdr.last_offset
                    st.changed = True
                    mine.append((pack_key(st.pid, hdr.first_offset), block))
            except (ValueError, TypeError) as exc:
                refuse(tp, exc)
        return dups

    @staticmethod
    def _next_pid(txn: lmdb.Transaction, dbs: _Dbs) -> int:
        cur = txn.cursor(db=dbs.pids)
        if cur.last():
            return int(U32.unpack(cur.key())[0]) + 1
        return 0

    # ------------------------------------------------------------------ reads

    def info(self, topic: str, partition: str) -> PartitionInfo | None:
        """What is stored of one partition, or None if it was never seen."""
        pkey = self._pkey(topic, partition)
        with self._read_txn() as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
        if raw is None:
            return None
        return PartitionInfo(topic, partition, *PARTITION_INFO.unpack(raw))

    def head(self, topic: str, partition: str) -> int | None:
        """The highest offset ever stored in the partition, or None."""
        info = self.info(topic, partition)
        return None if info is None else info.last

    def first(self, topic: str, partition: str) -> int | None:
        """The oldest offset still stored (``head + 1`` if retention removed all), or None."""
        info = self.info(topic, partition)
        return None if info is None else info.first

    def partitions(self, topic: str | None = None, limit: int | None = None) -> list[PartitionInfo]:
        """Every partition (of ``topic`` if given), sorted by topic then partition; at most
        ``limit`` (the first in key order: by the partition's length, then its name)."""
        out: list[PartitionInfo] = []
        unpack = PARTITION_INFO.unpack
        prefix = topic_prefix(topic) if topic is not None else b""
        with self._read_txn() as (txn, dbs):
            cur = txn.cursor(db=dbs.partitions)
            if not cur.set_range(prefix):
                return out
            for key, raw in cur.iternext():
                if not key.startswith(prefix) or (limit is not None and len(out) >= limit):
                    break  # the length byte pins the topic, so a prefix match is exact
                t, p = unpack_partition_key(key)
                out.append(PartitionInfo(t, p, *unpack(raw)))
        out.sort(key=lambda i: (i.topic, i.partition))
        return out

    def topics(self) -> list[str]:
        """Every topic with at least one partition, sorted."""
        names: set[str] = set()
        with self._read_txn() as (txn, dbs):
            for key in txn.cursor(db=dbs.partitions).iternext(values=False):
                names.add(bytes(key[1 : 1 + key[0]]).decode("utf-8"))
        return sorted(names)

    # ------------------------------------------------------------------ group positions

    def put_positions(self, group: str, positions: Mapping[tuple[str, str], int]) -> None:
        """Record ``group``'s next offset per (topic, partition), durably, in one transaction.

        Entries overwrite the previous ones in place (the last commit wins).
        Raises ValueError for names that do not fit a key (nothing is written).
        """
        items = [(pack_position_key(group, t, p), U64.pack(off)) for (t, p), off in positions.items()]
        if not items:
            return

        def body(txn: lmdb.Transaction) -> Any:
            db = self._positions_db
            if db is None:
                db = self._live_env().open_db(POSITIONS_DB, txn=txn, create=True)
            for key, value in items:
                txn.put(key, value, db=db)
            return db

        # The handle of a table created in this transaction is kept only once it committed.
        self._positions_db = self._write(body)

    def position_groups(self, limit: int) -> list[str]:
        """The groups with committed positions, at most ``limit``: one seek per group
        (the scan jumps over each group's key range)."""
        out: list[str] = []
        with self._read_txn() as (txn, _dbs):
            db = self._positions_db
            if db is None:
                return out
            cur = txn.cursor(db=db)
            found = cur.first()
            while found and len(out) < limit:
                key = bytes(cur.key())
                prefix = key[: 1 + key[0]]
                out.append(prefix[1:].decode("utf-8", "replace"))
                # The next key past every key starting with ``prefix``.
                nxt = prefix.rstrip(b"\xff")
                if not nxt:
                    break
                found = cur.set_range(nxt[:-1] + bytes((nxt[-1] + 1,)))
        return out

    def delete_positions(self, group: str, keys: Sequence[tuple[str, str]] | None = None) -> int:
        """Forget ``group``'s committed positions (``keys`` None: all of them), in one
        transaction; how many were removed.  (Kafka's DeleteGroups and OffsetDelete.)"""
        prefix = group_prefix(group)

        def body(txn: lmdb.Transaction) -> int:
            db = self._positions_db
            if db is None:
                return 0
            removed = 0
            if keys is not None:
                for t, p in keys:
                    removed += bool(txn.delete(pack_position_key(group, t, p), db=db))
                return removed
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                while bytes(cur.key()).startswith(prefix):
                    removed += 1
                    if not cur.delete():
                        break
            return removed

        return int(self._write(body))

    def positions(self, group: str) -> dict[tuple[str, str], int]:
        """``group``'s committed next offset per (topic, partition): one range scan."""
        out: dict[tuple[str, str], int] = {}
        prefix = group_prefix(group)
        with self._read_txn() as (txn, _dbs):
            db = self._positions_db
            if db is None:
                return out
            cur = txn.cursor(db=db)
            if not cur.set_range(prefix):
                return out
            for key, raw in cur.iternext():
                if not key.startswith(prefix):
                    break  # the length byte pins the group, so a prefix match is exact
                try:
                    out[unpack_partition_key(bytes(key[len(prefix) :]))] = U64.unpack(raw)[0]
                except (ValueError, IndexError, struct.error):
                    log.warning("skipping malformed position key %r", bytes(key))
        return out

    def fetch_raw(
        self, topic: str, partition: str, offset: int, count: int
    ) -> tuple[int, list[bytes]]:
        """Hot-path read: ``(start, values)`` in one read transaction.

        ``start = max(offset, first)`` and ``values`` are the raw stored
        values of offsets ``start, start + 1, ...`` (at most ``count``,
        contiguous; in a partition with holes, ``start`` is the first offset
        held at or after the one asked for, as after retention, and the
        values stop at the next hole); decode them with :func:`dafka.store.layout.unpack_value`
        or :func:`~dafka.store.layout.value_content`.  Unknown partitions and
        offsets past the head give ``(offset, [])``-like empty answers.
        """
        pkey = self._pkey(topic, partition)
        # Zero-copy blocks: only the records asked for are copied out of the map.  The read
        # transaction is opened here rather than by _read_txn (whose generator costs about
        # a fifth of a single-record read); _read_txn when the map must be adopted first.
        gate = self._gate
        gate.enter()
        try:
            env, dbs = self._env, self._dbs
            try:
                txn = env.begin(buffers=True) if env is not None and dbs is not None else None
            except lmdb.MapResizedError:
                txn = None
            if txn is not None and dbs is not None:
                try:
                    return self._fetch_txn(txn, dbs, pkey, offset, count)
                finally:
                    txn.abort()
        finally:
            gate.leave()
        with self._read_txn(buffers=True) as (txn, dbs):  # closed (raises), or remap first
            return self._fetch_txn(txn, dbs, pkey, offset, count)

    @staticmethod
    def _fetch_txn(txn: lmdb.Transaction, dbs: _Dbs, pkey: bytes, offset: int, count: int) -> tuple[int, list[bytes]]:
        raw = txn.get(pkey, db=dbs.partitions)
        if raw is None:
            return offset, []
        pid, first, last, _stored, _bytes = PARTITION_INFO.unpack(raw)
        start = offset if offset > first else first
        n = last - start + 1
        if count < n:
            n = count
        if n <= 0:
            return start, []
        return fetch_blocks_past_gaps(txn.cursor(db=dbs.blocks), pid, start, last, n, _WindowConvert(id(dbs), pid))

    def window_convert(self, topic: str, partition: str) -> Callable[[Any, int, int], list[bytes]]:
        """:func:`dafka.store.reader.convert_block` for a reader that takes a partition's client
        blocks (:meth:`read_blocks`) and converts slices of them itself (the Tank gateway's
        bundles over an answer's budget): a slice converts a window of the block, kept for the
        next slices (:class:`_WindowConvert`), however few records it takes (a Tank client's
        small ``fetch_size``)."""
        return _WindowConvert(id(self._dbs), self._pkey(topic, partition), eager=True)

    def newest_packed(self, topic: str, partition: str, first: int, last: int, codec: int,
                      max_blocks: int = 64) -> int:
        """The last offset of the newest compressed block of another codec than ``codec``
        among the blocks holding offsets ``first..last`` (-1: none).  Such a block stores a
        fraction of the bytes a reader of ``codec`` is answered with (its records converted).
        Headers only; past ``max_blocks`` blocks the rest is taken as compressed (``last``)."""
        pkey = self._pkey(topic, partition)
        newest = -1
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None or first > last:
                return newest
            pid = PARTITION_INFO.unpack(raw)[0]
            cur = txn.cursor(db=dbs.blocks)
            found = seek(cur, pid, first)
            hdr = None if found is None else found[0]
            seen = 0
            while hdr is not None and hdr.first_offset <= last:
                seen += 1
                if seen > max_blocks:
                    return last
                if hdr.compression and hdr.codec != codec:
                    newest = hdr.last_offset
                if not cur.next() or BLOCK_KEY.unpack(cur.key())[0] != pid:
                    break
                hdr = decode_header(cur.value())
        return newest

    def holds_any(self, topic: str, partition: str, first: int, last: int) -> bool:
        """Whether any record of offsets ``first..last`` is stored: the block headers say so
        (one seek), no record is decoded (a client's block is not inflated)."""
        pkey = self._pkey(topic, partition)
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return False
            pid, pfirst, plast, _stored, _bytes = PARTITION_INFO.unpack(raw)
            start = first if first > pfirst else pfirst
            if start > last or start > plast:
                return False
            found = seek(txn.cursor(db=dbs.blocks), pid, start)
            return found is not None and found[0].first_offset <= last

    def block_after(self, topic: str, partition: str, offset: int) -> int | None:
        """Where a reader goes on past a stored block that cannot be read: the first offset
        of the next block after the one a read from ``max(offset, first)`` reaches first
        (:func:`dafka.store.reader.block_after`: keys only, a damaged header is passed too),
        or None when that block is the partition's last (or the partition is unknown), or
        when that block reads (:func:`dafka.store.reader.block_reads`, in the same
        transaction: it is not the block a read failed at a moment ago, which retention or
        compaction replaced meanwhile; passed, its readable records were skipped)."""
        pkey = self._pkey(topic, partition)
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return None
            pid, first = PARTITION_INFO.unpack(raw)[:2]
            start = offset if offset > first else first
            if block_reads(txn.cursor(db=dbs.blocks), pid, start) is not False:
                return None
            return block_after(txn.cursor(db=dbs.blocks), pid, start)

    def unreadable_block(self, topic: str, partition: str, offset: int) -> BlockHeader | None:
        """The header of the block a read from ``max(offset, first)`` reaches first, when its
        records cannot be read (:func:`dafka.store.reader.block_reads`), in one transaction;
        None when it reads (retention or compaction replaced the block a read failed at a
        moment ago), or there is none.  Raises what decoding its header raises when that
        cannot be read either (:meth:`past_block` then)."""
        pkey = self._pkey(topic, partition)
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return None
            pid, first, last = PARTITION_INFO.unpack(raw)[:3]
            start = offset if offset > first else first
            if start > last:
                return None
            cur = txn.cursor(db=dbs.blocks)
            found = seek(cur, pid, start)  # (raises for a damaged header)
            if found is None or block_reads(cur, pid, start) is not False:
                return None
            hdr = seek(cur, pid, start)[0]  # type: ignore[index]  # (back on it)
            # Its header reads but is not checked against its CRC on reads: rot may claim
            # offsets past the next block's key, which the block cannot hold (a VOID cut from
            # that claim passed the next block's held records).
            if cur.next():
                npid, nfirst = BLOCK_KEY.unpack(cur.key())
                if npid == pid and nfirst <= hdr.last_offset:
                    hdr = hdr._replace(last_offset=nfirst - 1)
            return hdr if hdr.first_offset <= hdr.last_offset else None

    def past_block(self, topic: str, partition: str, offset: int) -> int | None:
        """Where a reader goes on past a stored block whose header cannot be read:
        :meth:`block_after`, or, when that block is the partition's last, its ``last`` + 1
        (the head it has stored: the offsets up to it lie in that block or in a hole after
        it, and nothing past it is stored yet), read in the same transaction (a block
        committed meanwhile is not passed).  None for an unknown partition, or when the
        block a read from ``offset`` reaches has a header that reads (it is not the block a
        read failed at a moment ago: retention or compaction replaced it meanwhile, and its
        offsets may be held: the caller's answer ends, the reader asks again)."""
        pkey = self._pkey(topic, partition)
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return None
            pid, first, last = PARTITION_INFO.unpack(raw)[:3]
            cur = txn.cursor(db=dbs.blocks)
            after = block_after(cur, pid, offset if offset > first else first)
            # The block reached: the one keyed just before ``after`` (or the partition's last).
            probe = BLOCK_KEY.pack(pid, _MAX_U64 if after is None else after)
            if not cur.set_range(probe):
                on = cur.last()
            elif after is None and cur.key() == probe:
                on = True
            else:
                on = cur.prev()
            if not on or BLOCK_KEY.unpack(cur.key())[0] != pid:
                return None
            try:
                decode_header(cur.value())
            except (ValueError, struct.error):
                return last + 1 if after is None else after
            return None

    def read_blocks(
        self, topic: str, partition: str, offset: int, max_bytes: int, max_blocks: int = 256
    ) -> tuple[int, int, list[tuple[BlockHeader, bytes]]]:
        """Whole stored blocks from the one holding ``max(offset, first)``: ``(start, first, blocks)``.

        ``blocks`` are ``(header, value)`` of the block holding ``start`` (or, in a
        hole, the first one after it) and of the next ones while they continue
        without a hole, up to ``max_bytes`` of values (at least one block) or
        ``max_blocks`` (:func:`dafka.store.reader.block_run`).  The first block may
        begin before ``start``: a reader that takes whole blocks skips what precedes
        it, as a Tank client does.  ``first`` is the partition's first offset, read in
        the same transaction: a first block beginning below it is the partial front
        block, whose records below ``first`` are deleted and must not go out whole
        (the caller slices it).  Unknown partitions and offsets past the head give
        ``(offset, offset, [])``.
        """
        pkey = self._pkey(topic, partition)
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return offset, offset, []
            pid, first, last, _stored, _bytes = PARTITION_INFO.unpack(raw)
            start = offset if offset > first else first
            if start > last:
                return start, first, []
            return start, first, block_run(txn.cursor(db=dbs.blocks), pid, start, last, max_bytes, max_blocks)

    def fetch_kafka(
        self, topic: str, partition: str, offset: int, limit: int,
        encode: Callable[[int, list[bytes], int], bytes], count: Callable[[bytes], int], exact: bool = False,
        upto: int | None = None,
    ) -> tuple[int, int, list[bytes]]:
        """Kafka record batches from ``max(offset, first)``, in one read transaction:
        ``(start, next offset, batches)`` (:func:`dafka.store.reader.kafka_batches`: a
        Kafka block whole as stored, except the partial front block, sliced from ``start``:
        no record below ``first`` goes out; others encoded with ``encode``), about ``limit`` bytes;
        none starting past ``upto`` when given (a Kafka last stable offset - 1)."""
        pkey = self._pkey(topic, partition)
        with self._read_txn(buffers=True) as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return offset, offset, []
            pid, first, last, _stored, _bytes = PARTITION_INFO.unpack(raw)
            start = offset if offset > first else first
            if upto is not None and upto < last:
                last = upto
            if start > last:
                return start, start, []
            nxt, batches = kafka_batches(txn.cursor(db=dbs.blocks), pid, start, last, limit, encode, count, exact,
                                         first, _WindowConvert(id(dbs), pid))
            # One copy out of the map, while the transaction holds the views (a batch
            # each: a transactional reader drops aborted ones).
            return start, nxt, [bytes(b) for b in batches]

    def fetch(self, topic: str, partition: str, offset: int, count: int) -> tuple[int, list[bytes]]:
        """Like :meth:`fetch_raw` but only the contents (what a Dafka consumer gets):
        record ``i`` of the list is offset ``start + i``."""
        start, values = self.fetch_raw(topic, partition, offset, count)
        # Flags byte 0 (no key) is the common case: one slice per record.
        return start, [v[9:] if not v[8] & FLAG_KEY else v[10 + v[9] :] for v in values]

    def read(self, topic: str, partition: str, offset: int, count: int) -> Iterator[ReadRecord]:
        """Yield at most ``count`` records from ``max(offset, first)`` on.

        Reads in chunks of short transactions, so an abandoned iterator holds
        nothing.  Records that retention removes while the iterator is in
        progress are skipped.
        """
        self._pkey(topic, partition)  # validate now, not at the first next()
        return self._iter_read(topic, partition, offset, count)

    def _iter_read(
        self, topic: str, partition: str, offset: int, count: int
    ) -> Iterator[ReadRecord]:
        unpack_hdr = VALUE_HEADER.unpack_from
        make = ReadRecord._make
        nxt = offset
        remaining = count
        while remaining > 0:
            start, values = self.fetch_raw(
                topic, partition, nxt, remaining if remaining < READ_CHUNK else READ_CHUNK
            )
            if not values:
                return
            off = start
            for v in values:
                ts, flags = unpack_hdr(v)
                if flags & FLAG_KEY:
                    klen = v[9]
                    # a Kafka transaction marker (FLAG_CONTROL): an empty record, no key
                    yield make((off, ts, None if flags & FLAG_CONTROL else v[10 : 10 + klen], v[10 + klen :]))
                else:
                    yield make((off, ts, None, v[9:]))
                off += 1
            remaining -= len(values)
            nxt = off

    # ------------------------------------------------------------------ holes

    def holes(self, limit: int | None = None) -> list[Hole]:
        """The recorded holes (see the ``holes`` table), at most ``limit``, in
        partition-id then offset order: ``(topic, partition, first, last)``."""
        out: list[Hole] = []
        if limit is not None and limit <= 0:
            return out
        names: dict[int, tuple[str, str] | None] = {}
        with self._read_txn() as (txn, dbs):
            hdb = self._holes_db
            if hdb is None:
                return out
            for key, value in txn.cursor(db=hdb).iternext():
                pid, first = BLOCK_KEY.unpack(key)
                if pid in names:
                    name = names[pid]
                else:
                    raw = txn.get(U32.pack(pid), db=dbs.pids)
                    name = names[pid] = None if raw is None else unpack_partition_key(bytes(raw))
                if name is None:
                    continue  # not a stored partition: nothing to fill
                out.append(Hole(name[0], name[1], first, U64.unpack(value)[0]))
                if limit is not None and len(out) >= limit:
                    break
        return out

    def fill_holes(self, records: Sequence[tuple[str, str, int, bytes | None, int]]) -> tuple[int, int]:
        """Write records into recorded holes, in one committed transaction.

        ``records`` are ``(topic, partition, offset, content, ts_ms)``
        (plain records, no Tank key).  Only an offset inside a recorded hole
        of a stored partition is written (the hole shrinks or splits; the
        partition's ``count`` and ``bytes`` grow, and its ``first`` moves
        down if the hole was below it); anything else -- a stored offset, one
        past the head, a partition never stored -- is ignored, so a record is
        never overwritten and a call is idempotent.  A ``None`` content gives
        the offset up for good: it leaves the hole without a record (a record
        that can never be stored, such as one over the size limit).
        Several records at one offset: the last one counts.

        Returns ``(written, given_up)``.  Raises :class:`StorageFullError`
        when the records do not fit (nothing is committed then).
        """
        by_tp: dict[tuple[str, str], dict[int, tuple[bytes | None, int]]] = {}
        for topic, partition, offset, content, ts_ms in records:
            if isinstance(offset, int) and offset >= 0:
                by_tp.setdefault((topic, partition), {})[offset] = (content, ts_ms)
        if not by_tp or self._holes_db is None:
            return 0, 0
        pkeys = {}
        for tp in by_tp:
            try:
                pkeys[tp] = self._pkey(*tp)
            except ValueError:
                continue  # a name no partition can have
        return self._write(partial(self._fill_txn, by_tp, pkeys))

    def _fill_txn(
        self,
        by_tp: dict[tuple[str, str], dict[int, tuple[bytes | None, int]]],
        pkeys: dict[tuple[str, str], bytes],
        txn: lmdb.Transaction,
    ) -> tuple[int, int]:
        dbs = self._dbs
        hdb = self._holes_db
        assert dbs is not None and hdb is not None
        hcur = txn.cursor(db=hdb)
        pack_key = BLOCK_KEY.pack
        written = given_up = 0
        for tp, offsets in by_tp.items():
            pkey = pkeys.get(tp)
            if pkey is None:
                continue
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                continue
            pid, first, last, count, nbytes = PARTITION_INFO.unpack(raw)
            runs: list[Run] = []  # the filled offsets, one block per run of consecutive ones
            for off in sorted(offsets):
                if off > last:
                    break
                hole = self._hole_at(hcur, pid, off)
                if hole is None:
                    continue
                content, ts_ms = offsets[off]
                if content is not None:
                    if not isinstance(content, bytes | bytearray | memoryview):
                        continue
                    content = bytes(content)
                    value = VALUE_HEADER.pack(ts_ms, 0) + content
                    if runs and runs[-1][0] + len(runs[-1][1]) == off:
                        prev = runs[-1]
                        prev[1].append(value)
                        runs[-1] = (prev[0], prev[1], prev[2] + len(content), True)
                    else:
                        runs.append((off, [value], len(content), True))
                else:
                    given_up += 1
                # The cursor is on the hole's entry: replace it by what is left of it.
                hfirst, hlast = hole
                hcur.delete()
                if hfirst < off:
                    txn.put(pack_key(pid, hfirst), U64.pack(off - 1), db=hdb)
                if off < hlast:
                    txn.put(pack_key(pid, off + 1), U64.pack(hlast), db=hdb)
            if not runs:
                continue
            for run in runs:
                for _key, block in blocks_of(run, pid):
                    try:
                        hdr = put_block(txn, dbs.blocks, pid, block)
                    except OverlapError as exc:  # never overwritten; the hole entry was wrong
                        log.error("%s: a recorded hole of pid %d is stored: %s", self.path, pid, exc)
                        continue
                    count += hdr.record_count
                    nbytes += store_payload(block)
                    first = min(first, hdr.first_offset)
                    written += hdr.record_count
            txn.put(pkey, PARTITION_INFO.pack(pid, first, last, count, nbytes), db=dbs.partitions)
        return written, given_up

    @staticmethod
    def _hole_at(hcur: Any, pid: int, offset: int) -> tuple[int, int] | None:
        """``(first, last)`` of the recorded hole holding ``offset`` (the cursor then
        on its entry), or None."""
        key = BLOCK_KEY.pack(pid, offset)
        if hcur.set_range(key):
            if hcur.key() != key and not hcur.prev():
                return None
        elif not hcur.last():
            return None
        kpid, first = BLOCK_KEY.unpack(hcur.key())
        if kpid != pid or offset < first:
            return None
        last = U64.unpack(hcur.value())[0]
        return (first, last) if offset <= last else None

    # ------------------------------------------------------------------ deleting the front

    def delete_front(self, topic: str, partition: str, before: int, max_records: int = 10_000) -> tuple[int, bool]:
        """Delete a partition's records below ``before`` (as retention does, from the
        front), at most ``max_records`` in this one transaction: ``(first offset now held,
        done)``.  The head never changes; ``before`` past it stops at it.  Whole blocks
        below ``before`` leave; the block holding it stays, its records below it hidden
        (:func:`dafka.store.retention.delete_front_txn`).  (Kafka's DeleteRecords.)"""
        pkey = self._pkey(topic, partition)

        def body(txn: lmdb.Transaction) -> tuple[int, bool]:
            dbs = self._dbs
            assert dbs is not None
            return delete_front_txn(txn, dbs.partitions, dbs.blocks, self._holes_db, pkey, before, max_records)

        first, done = self._write(body)
        return int(first), bool(done)

    # ------------------------------------------------------------------ retention

    def enforce_retention(
        self, now_ms: int, policy: RetentionPolicy, *, max_records: int = 10_000,
        damaged: list[tuple[str, str, int]] | None = None,
    ) -> RetentionResult:
        """Delete records that ``policy`` no longer keeps, at most ``max_records``.

        Per topic, first by age: from the front of each partition, records
        with ``ts_ms < now_ms - max_age_ms`` (stopping at the first younger
        one, so offsets stay contiguous).  Then by size: while the topic's
        payload total exceeds ``max_bytes``, the front record with the oldest
        timestamp among the topic's partitions.  Heads never change.

        Runs in one write transaction; call again while ``more`` is true.  A partition whose
        front block cannot be read (bit rot) keeps it and stops there, its ``(topic,
        partition, offset)`` appended to ``damaged`` when given; the others go on.
        """
        if max_records <= 0:
            return RetentionResult(0, 0, False)
        if policy.default == Retention() and not any(
            r != Retention() for r in policy.topics.values()
        ):
            return RetentionResult(0, 0, False)  # keep everything: no write transaction
        def body(txn: lmdb.Transaction) -> RetentionResult:
            dbs = self._dbs
            assert dbs is not None
            if damaged is not None:
                del damaged[:]  # (a transaction run again after the map grew)
            return retention_txn(txn, dbs.partitions, dbs.blocks, self._holes_db, now_ms, policy, max_records,
                                 damaged)

        result = self._write(body)
        if result.deleted:
            log.debug("retention removed %d records (%d bytes) from %s", result.deleted, result.freed_bytes, self.path)
        return result

    # ------------------------------------------------------------------ compaction

    def compaction_scan(self, pid: int, planner: Planner, step_bytes: int,
                        report: Callable[[int, int, str], None] | None = None) -> Scanned:
        """Feed ``planner`` about ``step_bytes`` of partition ``pid``'s blocks, in one read
        transaction (:func:`dafka.store.compaction.scan_txn`; ``report`` is told of a block
        that cannot be read)."""
        with self._read_txn() as (txn, dbs):
            return scan_txn(txn, dbs.blocks, pid, planner, step_bytes, report)

    def compacted_gap(self, topic: str, partition: str, lo: int, hi: int) -> bool:
        """Whether offsets ``lo..hi``, where a read found no record, are a gap compaction left
        rather than records lost: at or past the partition's ``first`` (retention removes
        from the front) and in no recorded hole (:meth:`holes`).  (A hole given up for good
        leaves no entry either; it counts as such a gap.)"""
        pkey = self._pkey(topic, partition)
        with self._read_txn() as (txn, dbs):
            raw = txn.get(pkey, db=dbs.partitions)
            if raw is None:
                return False
            pid, first, last, _count, _bytes = PARTITION_INFO.unpack(raw)
            if lo < first or hi > last:
                return False
            hdb = self._holes_db
            if hdb is None:
                return True
            cur = txn.cursor(db=hdb)
            # The hole starting at or before hi, if any, must end before lo.
            if cur.set_range(BLOCK_KEY.pack(pid, hi + 1)):
                if not cur.prev():
                    return True
            elif not cur.last():
                return True
            hpid, _hfirst = BLOCK_KEY.unpack(cur.key())
            return hpid != pid or U64.unpack(cur.value())[0] < lo

    def compaction_clean(self, pkey: bytes, planner: Planner, offset: int, step_bytes: int,
                         report: Callable[[int, int, str], None] | None = None) -> Cleaned:
        """Rewrite about ``step_bytes`` of a partition's blocks from ``offset`` without what
        ``planner`` drops, in one committed write transaction
        (:func:`dafka.store.compaction.clean_txn`): after a crash, each block is either as it
        was or rewritten."""

        def body(txn: lmdb.Transaction) -> Cleaned:
            dbs = self._dbs
            assert dbs is not None
            # The holes table exists once compaction left a gap: a store without one builds
            # it at open from the gaps between blocks (written before it existed), which
            # would take compaction's gaps for holes.
            self._holes_table(txn)
            return clean_txn(txn, dbs.partitions, dbs.blocks, pkey, planner, offset, step_bytes, report)

        result: Cleaned = self._write(body)
        return result
