"""Upgrade of a format-1 record database (one LMDB entry per record) to format 2 (blocks).

Run by a writable :class:`dafka.store.db.RecordDB` open of a format-1 database, before it
serves anything.  Crash-safe in bounded write transactions:

1. the first transaction sets ``meta format`` to 2 and writes ``meta converting``, and creates
   the ``blocks`` table; from then on an old version refuses the database (it reads format 1
   only) and a read-only open of this version refuses it until the conversion is done;
2. each later transaction moves runs of one partition's records at consecutive offsets (up to
   :data:`~dafka.store.writer.BLOCK_BYTES` of values a block, :data:`TXN_BYTES` a transaction)
   into CODEC_STORE blocks and deletes those records, so after a kill -9 at any point every
   record is in exactly one of the two tables, and the next open goes on where it stopped;
3. the last transaction empties the ``records`` table (kept empty, so that a format-1
   version, which opens it before reading the format, refuses the database saying it is
   format 2) and deletes ``meta converting``.

A format-1 value is the record as a CODEC_STORE block keeps it, so no record is decoded.
``partitions``, ``pids``, ``positions`` and ``holes`` keep their meaning and are not touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from dafka.errors import StorageError
from dafka.store.block import BLOCK_KEY, store_block
from dafka.store.layout import (
    FLAG_KEY,
    FORMAT_VERSION,
    META_CONVERTING,
    META_FORMAT,
    RECORD_KEY,
    U32,
    VALUE_HEADER_SIZE,
    value_payload_size,
)
from dafka.store.writer import BLOCK_BYTES

__all__ = ["RECORDS_DB", "TXN_BYTES", "convert"]

log = logging.getLogger(__name__)

RECORDS_DB = b"records"  # format 1's table of records
TXN_BYTES = 256 << 10  # values moved per transaction


def _damaged(key: bytes, value: bytes) -> str | None:
    """What is wrong with a format-1 record entry (None: nothing): the damage a conversion
    refuses (StorageError) rather than storing a block no reader could decode."""
    if len(key) != RECORD_KEY.size:
        return f"a record key of {len(key)} bytes, not {RECORD_KEY.size} (key {key[:32].hex()})"
    pid, offset = RECORD_KEY.unpack(key)
    if len(value) < VALUE_HEADER_SIZE:
        why = f"{len(value)} bytes, shorter than its {VALUE_HEADER_SIZE}-byte header"
    elif value[VALUE_HEADER_SIZE - 1] & FLAG_KEY and (
        len(value) == VALUE_HEADER_SIZE or VALUE_HEADER_SIZE + 1 + value[VALUE_HEADER_SIZE] > len(value)
    ):
        why = "its key runs past its end"
    else:
        return None
    return f"the record of partition id {pid} at offset {offset} is damaged: {why}"


def convert(env: Any, write: Callable[[Callable[[Any], Any]], Any], path: str) -> None:
    """Convert the format-1 (or half-converted) database in ``env`` to format 2.

    ``write(body)`` runs ``body(txn)`` in one committed write transaction (the store's own
    :meth:`~dafka.store.db.RecordDB._write`: map growth, full disk).  A damaged record entry
    stops the conversion with a StorageError naming it (its transaction is not committed:
    every record is still in one of the two tables, and the next open goes on from there).
    """
    started = time.monotonic()

    def begin(txn: Any) -> tuple[Any, Any, Any, int]:
        meta = env.open_db(b"meta", txn=txn, create=False)
        records = env.open_db(RECORDS_DB, txn=txn, create=False)
        blocks = env.open_db(b"blocks", txn=txn, create=True)
        txn.put(META_FORMAT, U32.pack(FORMAT_VERSION), db=meta)
        resumed = txn.get(META_CONVERTING, db=meta) is not None
        txn.put(META_CONVERTING, b"1", db=meta)
        left = int(txn.stat(records)["entries"])
        return meta, records, blocks, left if not resumed else -left

    meta, records, blocks, left = write(begin)
    if left >= 0:
        log.warning("record database %s: converting format 1 to format %d (%d records); an older "
                    "dafka cannot open it from now on", path, FORMAT_VERSION, left)
    else:
        log.warning("record database %s: resuming its conversion to format %d (%d records left)",
                    path, FORMAT_VERSION, -left)

    def step(txn: Any) -> tuple[int, int]:
        """Move up to TXN_BYTES of records into blocks; ``(records, blocks)`` moved."""
        cur = txn.cursor(db=records)
        moved = made = size_txn = 0
        if not cur.first():
            return 0, 0
        unpack = RECORD_KEY.unpack
        while size_txn < TXN_BYTES:
            key = cur.key()
            if not key:
                break
            if len(key) != RECORD_KEY.size:
                raise StorageError(f"{path}: cannot convert it to format {FORMAT_VERSION}: "
                                   f"{_damaged(key, b'')}")
            pid, first = unpack(key)
            values: list[bytes] = []
            size = 0
            while True:
                key = cur.key()
                if not key:
                    break
                value = cur.value()
                damage = _damaged(key, value)
                if damage is not None:
                    raise StorageError(f"{path}: cannot convert it to format {FORMAT_VERSION}: {damage}")
                kpid, off = unpack(key)
                if kpid != pid or off != first + len(values):
                    break  # another partition, or a hole: the block ends here
                if values and size + len(value) > BLOCK_BYTES:
                    break
                values.append(value)
                size += len(value)
                cur.delete()  # moves the cursor to the next record
            payload = sum(map(value_payload_size, values))
            if not txn.put(BLOCK_KEY.pack(pid, first), store_block(first, values, payload), overwrite=False, db=blocks):
                raise RuntimeError(f"{path}: a block at {first} of pid {pid} exists while converting")
            moved += len(values)
            made += 1
            size_txn += size
        return moved, made

    total = nblocks = 0
    while True:
        moved, made = write(step)
        if not moved:
            break
        total += moved
        nblocks += made

    def finish(txn: Any) -> None:
        txn.drop(records, delete=False)
        txn.delete(META_CONVERTING, db=meta)

    write(finish)
    log.warning("record database %s: converted to format %d (%d records into %d blocks in %.1f s)",
                path, FORMAT_VERSION, total, nblocks, time.monotonic() - started)
