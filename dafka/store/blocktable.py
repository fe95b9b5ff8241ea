"""Format-2 blocks in an LMDB sub-database: put, find the block holding an offset, retention by block.

Work in progress (issue 36): the store does not use this yet; see
``docs/concepts/store.md`` ("Format 2").  No threads and no environment of
its own: every function works inside a transaction the caller owns, so a
writer can put blocks, update its partitions and delete the oldest blocks in
one commit.

Keys are ``pid:u32 first_offset:u64`` (:func:`dafka.store.block.block_key`),
values are blocks (:mod:`dafka.store.block`).  The table's invariant: a
partition's blocks never overlap (for neighbours A then B, ``A.last < B.first``)
and each is stored under its own first offset; :func:`put_block` refuses a
block that would break it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from dafka.store.block import BLOCK_KEY, BlockHeader, decode_header

__all__ = ["Dropped", "OverlapError", "drop_front", "find", "iter_blocks", "put_block"]

_pack = BLOCK_KEY.pack
_unpack = BLOCK_KEY.unpack


class OverlapError(ValueError):
    """A block's offsets overlap a stored block of its partition (or its key is taken)."""


class Dropped(NamedTuple):
    """What :func:`drop_front` removed."""

    blocks: int
    records: int
    bytes: int  # block values, headers included
    first: int | None  # the first offset still stored, None when no block is left


def put_block(txn: Any, db: Any, pid: int, value: bytes, *, append: bool = False) -> BlockHeader:
    """Store ``value`` (a block) for partition ``pid`` under its first offset.

    Raises :class:`OverlapError` when it would overlap a stored block and
    :class:`~dafka.errors.ProtocolError` when it is not a block.  ``append``
    (MDB_APPEND) is for a block known to sort after every key of the table
    (the highest pid's newest block); it is checked, not trusted: ValueError
    when it does not.
    """
    hdr = decode_header(value)
    key = _pack(pid, hdr.first_offset)
    cur = txn.cursor(db=db)
    if cur.set_range(key):
        npid, nfirst = _unpack(cur.key())
        if npid == pid and nfirst <= hdr.last_offset:
            raise OverlapError(f"block {hdr.first_offset}..{hdr.last_offset} of pid {pid} overlaps the one at {nfirst}")
        before = cur.prev()
    else:
        before = cur.last()
    if before:
        ppid, _pfirst = _unpack(cur.key())
        if ppid == pid and decode_header(cur.value()).last_offset >= hdr.first_offset:
            raise OverlapError(f"block {hdr.first_offset}..{hdr.last_offset} of pid {pid} overlaps the one before it")
    if not txn.put(key, value, db=db, append=append, overwrite=False):
        if append:  # LMDB refuses an MDB_APPEND key that does not sort last
            raise ValueError(f"block {hdr.first_offset} of pid {pid} does not sort after every key (append)")
        raise OverlapError(f"pid {pid} already has a block at {hdr.first_offset}")
    return hdr


def find(txn: Any, db: Any, pid: int, offset: int) -> tuple[BlockHeader, Any] | None:
    """The block of ``pid`` holding ``offset``, else the first one after it: ``(header, value)``.

    One cursor seek, one step back when the block found starts after
    ``offset`` (and one more seek only when ``offset`` is in a hole or before
    the partition's first block).  None when ``pid`` has no block at or after
    ``offset``.  ``value`` is what the transaction returns (a zero-copy buffer
    in a ``buffers=True`` transaction, valid until it ends).
    """
    cur = txn.cursor(db=db)
    key = _pack(pid, offset)
    after = cur.set_range(key)
    if after and bytes(cur.key()) == key:
        value = cur.value()
        return decode_header(value), value
    # The entry before ``key`` may be a block of pid that holds offset.
    if cur.prev() if after else cur.last():
        if _unpack(cur.key())[0] == pid:
            value = cur.value()
            hdr = decode_header(value)
            if hdr.last_offset >= offset:
                return hdr, value
    if not after or not cur.set_range(key) or _unpack(cur.key())[0] != pid:
        return None
    value = cur.value()
    return decode_header(value), value


def iter_blocks(txn: Any, db: Any, pid: int, offset: int) -> Iterator[tuple[BlockHeader, Any]]:
    """``(header, value)`` of the block holding ``offset`` (or the next one) and every later one of ``pid``."""
    found = find(txn, db, pid, offset)
    if found is None:
        return
    cur = txn.cursor(db=db)
    cur.set_key(_pack(pid, found[0].first_offset))
    yield found
    while cur.next():
        if _unpack(cur.key())[0] != pid:
            return
        value = cur.value()
        yield decode_header(value), value


def drop_front(
    txn: Any, db: Any, pid: int, drop: Callable[[BlockHeader, int], bool], *, max_blocks: int = 1_000
) -> Dropped:
    """Delete ``pid``'s oldest blocks while ``drop(header, value_size)`` says so (retention by block).

    Stops at the first block ``drop`` keeps, so what is left stays one run
    from the new first offset; at most ``max_blocks`` are deleted per call.
    """
    cur = txn.cursor(db=db)
    blocks = records = nbytes = 0
    if not cur.set_range(_pack(pid, 0)):
        return Dropped(0, 0, 0, None)
    while blocks < max_blocks:
        key = cur.key()
        if not key or _unpack(key)[0] != pid:
            return Dropped(blocks, records, nbytes, None)
        value = cur.value()
        hdr = decode_header(value)
        if not drop(hdr, len(value)):
            return Dropped(blocks, records, nbytes, hdr.first_offset)
        blocks += 1
        records += hdr.record_count
        nbytes += len(value)
        cur.delete()  # the cursor moves to the next entry, if any
    if cur.key() and _unpack(cur.key())[0] == pid:
        return Dropped(blocks, records, nbytes, _unpack(cur.key())[1])
    return Dropped(blocks, records, nbytes, None)

