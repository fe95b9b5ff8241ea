"""Is an outbox's ``data.mdb`` whole enough to map?  Checked before LMDB maps it.

LMDB maps the file and trusts its header: a file cut shorter than the pages
its last commit uses kills the process with SIGBUS on the first read of a
missing page, and an empty file is taken for a new database.  So before
:func:`lmdb.open` the outbox reads the file's two meta pages itself (with
``pread``: no mapping, no signal) and compares the file's size with what the
newer meta page says the database spans.

A file may legitimately end before that span: pages freed in the same commit
that allocated them at the end of the file are never written.  So a short
file is refused only when a page the database can reach (a branch, leaf or
overflow page of the free list, the main database or a named one) lies past
its end: that page was cut off.

Layout read here (LMDB 0.9, 64-bit little-endian, the format py-lmdb
bundles): a page starts with a 16-byte header (``pgno:u64 pad:u16
flags:u16 lower:u16 upper:u16``, or ``pages:u32`` for overflow pages), then
``lower - 16`` bytes of node offsets (``u16`` each).  Pages 0 and 1 are meta
pages: ``magic:u32 version:u32 address:u64 mapsize:u64``, two database
records of 48 bytes (the free list's, whose first ``u32`` is the page size,
then the main database's, each with its root page number at +40), then
``last_pg:u64 txnid:u64``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

MAGIC = 0xBEEFC0DE
PAGE_HEADER = 16
META_BYTES = PAGE_HEADER + 152  # the meta page's header and fields read here
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2 = 0x01, 0x02, 0x04, 0x20
F_BIGDATA, F_SUBDATA = 0x01, 0x02
P_INVALID = (1 << 64) - 1  # the root of an empty database
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_META = struct.Struct("<II8xQ")  # magic, version, mapsize


@dataclass(slots=True, frozen=True)
class Meta:
    """What one of LMDB's meta pages says."""

    psize: int
    last_pg: int
    txnid: int
    roots: tuple[int, int]  # the free list's and the main database's root pages


def _meta(page: bytes, which: int) -> Meta | str:
    magic, _version, _mapsize = _META.unpack_from(page, PAGE_HEADER)
    if magic != MAGIC:
        return f"has no LMDB header in meta page {which} (overwritten?)"
    psize = _U32.unpack_from(page, PAGE_HEADER + 24)[0]
    if psize < 256 or psize > 65536 or psize & (psize - 1):
        return f"has page size {psize} in meta page {which} (corrupt)"
    free_root = _U64.unpack_from(page, PAGE_HEADER + 24 + 40)[0]
    main_root = _U64.unpack_from(page, PAGE_HEADER + 24 + 48 + 40)[0]
    last_pg, txnid = struct.unpack_from("<QQ", page, PAGE_HEADER + 24 + 96)
    return Meta(psize, last_pg, txnid, (free_root, main_root))


def damage(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the LMDB file at ``path`` (None: it may be mapped).

    Reads with ``pread`` only.  The file must exist.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return "is empty (0 bytes: truncated?)"
        head = os.pread(fd, META_BYTES, 0)
        if len(head) < META_BYTES:
            return f"is truncated to {size} bytes (shorter than LMDB's header)"
        first = _meta(head, 0)
        if isinstance(first, str):
            return first
        psize = first.psize
        if size < 2 * psize:
            return f"is truncated to {size} bytes (LMDB's two meta pages take {2 * psize})"
        second = _meta(os.pread(fd, META_BYTES, psize), 1)
        if isinstance(second, str):
            return second
        if second.psize != psize:
            return f"has meta pages that disagree on the page size ({psize}, {second.psize})"
        meta = second if first.txnid < second.txnid else first  # as LMDB picks
        if size >= (meta.last_pg + 1) * psize:
            return None
        return _cut_page(fd, meta, size)
    finally:
        os.close(fd)


def _cut_page(fd: int, meta: Meta, size: int) -> str | None:
    """In a file shorter than ``meta`` says: a reachable page that is missing or corrupt (None: none)."""
    psize, last = meta.psize, meta.last_pg
    pages = size // psize  # a partly written last page counts as missing
    truncated = f"is truncated to {size} bytes; its last commit spans {(last + 1) * psize}"
    stack = [r for r in meta.roots if r != P_INVALID]
    seen: set[int] = set()
    while stack:
        pgno = stack.pop()
        if pgno in seen:
            continue
        if pgno < 2 or pgno > last:
            return f"refers to page {pgno}, outside 2..{last} (corrupt)"
        if pgno >= pages:
            return f"{truncated} (page {pgno} is cut off)"
        seen.add(pgno)
        page = os.pread(fd, psize, pgno * psize)
        flags = _U16.unpack_from(page, 10)[0]
        lower = _U16.unpack_from(page, 12)[0]
        if not flags & (P_BRANCH | P_LEAF) or lower < PAGE_HEADER or lower > psize:
            return f"page {pgno} is neither a branch nor a leaf (corrupt)"
        if flags & P_LEAF2:
            continue  # fixed-size keys only: no children
        for i in range((lower - PAGE_HEADER) // 2):
            off = _U16.unpack_from(page, PAGE_HEADER + 2 * i)[0]
            if off + _NODE.size > psize:
                return f"page {pgno} is corrupt (node {i} at {off})"
            lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
            if flags & P_BRANCH:
                stack.append(lo | hi << 16 | nflags << 32)
                continue
            data = off + _NODE.size + ksize
            if data + (8 if nflags & F_BIGDATA else 48) > psize and nflags & (F_BIGDATA | F_SUBDATA):
                return f"page {pgno} is corrupt (node {i} at {off})"
            if nflags & F_BIGDATA:
                first = _U64.unpack_from(page, data)[0]
                if first < 2 or first > last:
                    return f"refers to page {first}, outside 2..{last} (corrupt)"
                if first >= pages:
                    return f"{truncated} (page {first} is cut off)"
                head = os.pread(fd, PAGE_HEADER, first * psize)
                span = _U32.unpack_from(head, 12)[0]
                if not _U16.unpack_from(head, 10)[0] & P_OVERFLOW or first + span - 1 > last:
                    return f"overflow page {first} is corrupt"
                if first + span > pages:
                    return f"{truncated} (pages {first}..{first + span - 1} are cut off)"
            elif nflags & F_SUBDATA:
                root = _U64.unpack_from(page, data + 40)[0]
                if root != P_INVALID:
                    stack.append(root)
    return None
