"""The pure-Python twin of :mod:`dafka.fastio._compiled` (same functions, same results).

Frame-exact: every function consumes exactly the frames of one message at a
time, so a message with a missing or extra frame never shifts frames into the
next one.  ``recv(copy=False)`` gives each frame's ``more`` flag without the
(much slower) ``getsockopt(RCVMORE)`` call.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from dafka.core.wire import BATCH_BYTES, BATCH_RECORDS, BATCH_VERSION, pack_batch, unpack_batch
from dafka.errors import ProtocolError
from dafka.store.layout import value_content

NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags are slower
SNDMORE = int(zmq.SNDMORE)
_u64 = struct.Struct(">Q")
_pack = _u64.pack
_seq_at = _u64.unpack_from
_new_tuple = tuple.__new__
# pyzmq's Socket.send is a Python wrapper (routing_id / group handling for
# draft sockets) around the compiled backend's send: calling the backend
# directly saves a Python frame per frame sent (about 0.5 us a record).
_backend_send = zmq.backend.Socket.send

IMPLEMENTATION = "pure"
_NO_LIMIT = 1 << 64  # max_size None: every record is taken


def _rest(recv: Callable[..., Any], first: list[bytes]) -> list[bytes]:
    """Read the remaining frames of a message whose frames so far are ``first``."""
    while True:
        frame = recv(NOBLOCK, False)
        first.append(frame.bytes)
        if not frame.more:
            return first


def events(sock: zmq.Socket) -> int:
    """ZMQ_EVENTS of a socket (POLLIN 1 | POLLOUT 2)."""
    return int(sock.getsockopt(zmq.EVENTS))


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send ``frames`` as one message without waiting: False when the socket cannot take it now."""
    if not frames:
        raise ValueError("a message has at least one frame")
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def recv_messages(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
    """Up to ``limit`` whole messages waiting on ``sock`` (never blocks), each a list of frames."""
    recv = sock.recv
    out: list[list[bytes]] = []
    for _ in range(limit):
        try:
            frame = recv(NOBLOCK, False)
        except zmq.Again:
            break
        frames = [frame.bytes]
        # The parts of a multi-part message arrive together: no wait after the first.
        out.append(_rest(recv, frames) if frame.more else frames)
    return out


def drain_records(
    sock: zmq.Socket,
    limit: int,
    by_prefix: dict[bytes, Any],
    out: list[Any] | Any,
    record_type: type | None,
    ts: int,
    on_record: Callable[[Any, int, bytes], None],
    on_message: Callable[[list[bytes]], None],
    max_size: int | None = None,
    on_too_large: Callable[[Any, int, int], None] | None = None,
) -> int:
    """Read up to ``limit`` messages from ``sock`` without blocking; the number of records queued.

    A batch message counts as its number of records against ``limit`` (so a
    call handles at most ``limit + BATCH_RECORDS - 1`` records, as a
    caller's back-pressure checks expect).

    A two-frame message whose first frame, less its last 8 bytes (the
    sequence), is a key of ``by_prefix`` is a known partition's RECORD or
    DIRECT-RECORD; the value is its tracker (``next``, ``known``, ``held``).
    When it is the tracker's next record and nothing is held, the tracker is
    advanced and ``out`` gets ``record_type(subject, address, seq, content)``
    (``record_type`` a tuple subclass) or, with ``record_type=None``, the
    tuple ``(subject, address, seq, content, ts)``.  Other records of known
    partitions go to ``on_record(tracker, seq, content)``; every other
    message, malformed ones included, to ``on_message(frames)``, all in
    arrival order.

    A known partition's record whose content is longer than ``max_size``
    (None: no limit) is neither queued nor given to ``on_record``:
    ``on_too_large(tracker, seq, size)`` is called instead, in arrival order.
    """
    recv = sock.recv
    lookup = by_prefix.get
    append = out.append
    queued = 0
    max_size = _max_size(max_size)
    # The run being read (as the compiled cursor): consecutive records with
    # one header prefix; the tracker's next is kept in ``nxt`` and written
    # back before any callback, at a prefix change and at the end.
    pfx: bytes | None = None
    tracker: Any = None
    fast = batch = False
    nxt = start = 0
    subject = address = None
    extra = 0  # the records of batches beyond one a message: they count against limit too
    try:
        for i in range(limit):
            if extra and i + extra >= limit:
                break
            try:
                frame = recv(NOBLOCK, False)
            except zmq.Again:
                break
            header = frame.bytes
            if not frame.more:
                if nxt != start:
                    _advance(tracker, nxt)
                    start = nxt
                pfx = None
                on_message([header])
                continue
            second = recv(NOBLOCK, False)
            content = second.bytes
            if second.more:
                if nxt != start:
                    _advance(tracker, nxt)
                    start = nxt
                pfx = None
                on_message(_rest(recv, [header, content]))
                continue
            key = header[:-8]
            if key != pfx:
                if nxt != start:
                    _advance(tracker, nxt)
                    start = nxt
                pfx = None
                tracker = lookup(key) if len(header) >= 9 else None
                if tracker is None:
                    on_message([header, content])
                    continue
                pfx = key
                nxt = tracker.next
                fast = nxt is not None and not tracker.held and 0 <= nxt < 0xFFFFFFFFFFFFFFFF
                if not fast:
                    nxt = 0
                start = nxt
                subject, address = tracker.subject, tracker.address
                batch = _is_batch(key)
            seq = _seq_at(header, len(key))[0]
            if batch:
                # Many records in one message: the same steps for each (kept
                # apart so that the one-record path stays short).
                contents = _batch_contents(content, seq)
                if contents is None:
                    if nxt != start:
                        _advance(tracker, nxt)
                        start = nxt
                    pfx = None
                    on_message([header, content])
                    continue
                extra += len(contents) - 1
                # One comparison a message: only a body this long can hold a record over max_size.
                check = len(content) - 8 > max_size
                for content in contents:
                    if check and len(content) > max_size:
                        if nxt != start:
                            _advance(tracker, nxt)
                            start = nxt
                        pfx = None
                        fast = False  # after a callback: the rest of this batch takes the slow path
                        on_too_large(tracker, seq, len(content))  # type: ignore[misc]
                    elif fast and seq == nxt:
                        nxt += 1
                        if record_type is None:
                            append((subject, address, seq, content, ts))
                        else:
                            append(_new_tuple(record_type, (subject, address, seq, content)))
                        queued += 1
                    else:
                        if nxt != start:
                            _advance(tracker, nxt)
                            start = nxt
                        pfx = None
                        fast = False  # after a callback: the rest of this batch takes the slow path
                        on_record(tracker, seq, content)
                    seq += 1
                continue
            if len(content) > max_size:
                if nxt != start:
                    _advance(tracker, nxt)
                    start = nxt
                pfx = None
                on_too_large(tracker, seq, len(content))  # type: ignore[misc]
            elif fast and seq == nxt:
                nxt += 1
                if record_type is None:
                    append((subject, address, seq, content, ts))
                else:
                    append(_new_tuple(record_type, (subject, address, seq, content)))
                queued += 1
            else:
                if nxt != start:
                    _advance(tracker, nxt)
                    start = nxt
                pfx = None
                on_record(tracker, seq, content)
    finally:
        if nxt != start:
            _advance(tracker, nxt)
    return queued


def _max_size(max_size: int | None) -> int:
    """A ``max_size`` argument: None is no limit."""
    if max_size is None:
        return _NO_LIMIT
    if max_size < 0:
        raise ValueError("max_size must not be negative")
    return max_size


def _is_batch(prefix: bytes) -> bool:
    """Whether a known RECORD / DIRECT-RECORD header prefix is a batch's (version 2)."""
    return prefix[prefix.index(0, 1) + 1] == BATCH_VERSION


def _batch_contents(body: bytes, first: int) -> tuple[bytes, ...] | None:
    """A batch's contents (:func:`dafka.core.wire.unpack_batch`), or None if it is malformed."""
    try:
        return unpack_batch(body, first)
    except ProtocolError:
        return None


def _advance(tracker: Any, nxt: int) -> None:
    """Write a run's progress back: ``next`` and (if beyond it) ``known``."""
    tracker.next = nxt
    if nxt - 1 > tracker.known:
        tracker.known = nxt - 1


def send_records(
    sock: zmq.Socket,
    prefix: bytes,
    seq: int,
    contents: Sequence[bytes],
    start: int = 0,
    stop: int | None = None,
    noblock: bool = False,
) -> int:
    """Send ``contents[start:stop]`` as records ``prefix + seq`` (seq counting up); how many went.

    ``noblock``: stop at the first record the socket cannot take now;
    otherwise wait for room.
    """
    send = _backend_send.__get__(sock)
    flags = NOBLOCK if noblock else 0
    more = SNDMORE | flags
    stop = len(contents) if stop is None else stop
    sent = 0
    try:
        for i in range(start, stop):
            send(prefix + _pack(seq + sent), more)
            # The rest of a message is never refused once its first part was taken.
            send(contents[i])
            sent += 1
    except zmq.Again:
        pass
    return sent


def send_batches(
    sock: zmq.Socket,
    prefix: bytes,
    seq: int,
    contents: Sequence[bytes],
    start: int = 0,
    stop: int | None = None,
    noblock: bool = False,
    max_records: int = BATCH_RECORDS,
    max_bytes: int = BATCH_BYTES,
    stored: bool = False,
) -> int:
    """As :func:`send_records`, packing consecutive records into batch messages; how many records went.

    ``prefix`` is a batch (version 2) header prefix.  A batch takes up to
    ``max_records`` records and ``max_bytes`` of contents (at least one record).
    ``stored``: the items are stored LMDB values, as for :func:`send_values`.
    """
    send = _backend_send.__get__(sock)
    flags = NOBLOCK if noblock else 0
    more = SNDMORE | flags
    stop = len(contents) if stop is None else stop
    if stored:
        contents = [value_content(v) for v in contents[start:stop]]
        start, stop = 0, len(contents)
    sent = 0
    i = start
    try:
        while i < stop:
            # The batch: records i..j-1, at least one, within both limits.
            size = len(contents[i])
            j = i + 1
            while j < stop and j - i < max_records and size + len(contents[j]) <= max_bytes:
                size += len(contents[j])
                j += 1
            body = pack_batch(contents[i:j])
            send(prefix + _pack(seq + sent), more)
            send(body)
            sent += j - i
            i = j
    except zmq.Again:
        pass
    return sent


def send_values(
    sock: zmq.Socket, prefix: bytes, seq: int, values: Sequence[bytes], noblock: bool = True
) -> int:
    """As :func:`send_records` for stored LMDB values (``ts:u64 flags:u8 [klen:u8 key] content``)."""
    send = _backend_send.__get__(sock)
    flags = NOBLOCK if noblock else 0
    more = SNDMORE | flags
    sent = 0
    try:
        for v in values:
            send(prefix + _pack(seq + sent), more)
            send(v[9:] if not v[8] & 1 else v[10 + v[9] :])
            sent += 1
    except zmq.Again:
        pass
    return sent


_value_header = struct.Struct(">QB").pack  # LMDB record value header: ts_ms:u64 flags:u8


def drain_pairs(
    sock: zmq.Socket,
    limit: int,
    by_prefix: dict[bytes, Any],
    out: list[bytes],
    segs: list[tuple[str, str, int, int, int, int]],
    ts: int,
    on_record: Callable[[Any, int, bytes], None],
    on_message: Callable[[list[bytes]], None],
    max_size: int | None = None,
    on_too_large: Callable[[Any, int, int], None] | None = None,
) -> int:
    """As :func:`drain_records`, for a store: records go out as ready stored values.

    Only partitions whose tracker has a ``pid`` (stored partitions) take the
    fast path: the next record becomes its format-1 value ``ts_ms:u64 0:u8
    content`` in ``out`` (the store's blocks need no key a record), and each run of consecutive records with one
    header prefix adds ``(subject, address, pid, first, last, content_bytes)``
    to ``segs`` when it ends.  Records of partitions without a pid, and
    records out of order, go to ``on_record``; records longer than
    ``max_size`` to ``on_too_large``; other messages to ``on_message``.
    """
    max_size = _max_size(max_size)
    recv = sock.recv
    lookup = by_prefix.get
    append = out.append
    hdr = _value_header(ts, 0)
    queued = 0
    pfx: bytes | None = None  # the open run's header prefix (see drain_records)
    tracker: Any = None
    fast = batch = False
    nxt = start = nbytes = 0
    extra = 0  # see drain_records

    def close() -> None:
        nonlocal start, nbytes
        if nxt != start:
            _advance(tracker, nxt)
            segs.append((tracker.subject, tracker.address, tracker.pid, start, nxt - 1, nbytes))
            start, nbytes = nxt, 0

    try:
        for i in range(limit):
            if extra and i + extra >= limit:
                break
            try:
                frame = recv(NOBLOCK, False)
            except zmq.Again:
                break
            header = frame.bytes
            if not frame.more:
                close()
                pfx = None
                on_message([header])
                continue
            second = recv(NOBLOCK, False)
            content = second.bytes
            if second.more:
                close()
                pfx = None
                on_message(_rest(recv, [header, content]))
                continue
            key = header[:-8]
            if key != pfx:
                close()
                pfx = None
                tracker = lookup(key) if len(header) >= 9 else None
                if tracker is None:
                    on_message([header, content])
                    continue
                pfx = key
                nxt, pid = tracker.next, tracker.pid
                fast = (
                    nxt is not None
                    and pid is not None
                    and not tracker.held
                    and 0 <= nxt < 0xFFFFFFFFFFFFFFFF
                    and 0 <= pid <= 0xFFFFFFFF
                )
                if not fast:
                    nxt = 0
                start, nbytes = nxt, 0
                batch = _is_batch(key)
            seq = _seq_at(header, len(header) - 8)[0]
            if batch:
                # Many records in one message (see drain_records).
                contents = _batch_contents(content, seq)
                if contents is None:
                    close()
                    pfx = None
                    on_message([header, content])
                    continue
                extra += len(contents) - 1
                check = len(content) - 8 > max_size  # see drain_records
                for content in contents:
                    if check and len(content) > max_size:
                        close()
                        pfx = None
                        fast = False
                        on_too_large(tracker, seq, len(content))  # type: ignore[misc]
                    elif fast and seq == nxt:
                        nxt += 1
                        append(hdr + content)
                        nbytes += len(content)
                        queued += 1
                    else:
                        close()
                        pfx = None
                        fast = False
                        on_record(tracker, seq, content)
                    seq += 1
                continue
            if len(content) > max_size:
                close()
                pfx = None
                on_too_large(tracker, seq, len(content))  # type: ignore[misc]
            elif fast and seq == nxt:
                nxt += 1
                append(hdr + content)
                nbytes += len(content)
                queued += 1
            else:
                close()
                pfx = None
                on_record(tracker, seq, content)
    finally:
        close()
    return queued



class _BlockSink:
    """The ``segs`` of :func:`drain_pairs` for :func:`drain_blocks`: each run, as it ends, leaves
    the values it queued as CODEC_STORE blocks (before any callback that follows it)."""

    __slots__ = ("values", "blocks", "block_bytes")

    def __init__(self, blocks: list[tuple[str, str, bytes]], block_bytes: int) -> None:
        self.values: list[bytes] = []
        self.blocks = blocks
        self.block_bytes = block_bytes

    def append(self, seg: tuple[str, str, int, int, int, int]) -> None:
        subject, address, pid, first, last, _nbytes = seg
        values = self.values
        n = last - first + 1
        if n != len(values):
            raise RuntimeError(f"a run of {n} records with {len(values)} values queued")
        self.blocks.extend(
            (subject, address, block) for _key, block in store_blocks(values, 0, n, pid, first, self.block_bytes, -1)
        )
        values.clear()


def drain_blocks(
    sock: zmq.Socket,
    limit: int,
    by_prefix: dict[bytes, Any],
    blocks: list[tuple[str, str, bytes]],
    ts: int,
    on_record: Callable[[Any, int, bytes], None],
    on_message: Callable[[list[bytes]], None],
    max_size: int | None = None,
    on_too_large: Callable[[Any, int, int], None] | None = None,
    block_bytes: int = 65536,
) -> int:
    """As :func:`drain_pairs`, the records of each run going out as CODEC_STORE blocks: each
    run of consecutive records of a stored partition adds ``(subject, address, block)``
    entries to ``blocks`` when it ends, the blocks :func:`store_blocks` builds from the values
    :func:`drain_pairs` would have queued (at most ``block_bytes`` of values each, a larger
    value alone), so that the store's writer only puts them.  Returns the records queued."""
    if block_bytes < 1:
        raise ValueError("block_bytes must be positive")
    sink = _BlockSink(blocks, block_bytes)
    return drain_pairs(sock, limit, by_prefix, sink.values, sink, ts, on_record, on_message,  # type: ignore[arg-type]
                       max_size, on_too_large)


# ---------------------------------------------------------------- store format 2 blocks
# Pure computation on the store's CODEC_STORE blocks (dafka.store.block), here beside the I/O
# so that one switch (compiled or pure) chooses both; the compiled twin does each in one C pass.


def store_blocks(items: Sequence[Any], lo: int, hi: int, pid: int, first_offset: int,
                 block_bytes: int, field: int) -> list[tuple[bytes, bytes]]:
    """LMDB ``(key, block)`` pairs of the CODEC_STORE blocks holding ``items[lo:hi]`` at
    offsets ``first_offset, first_offset + 1, ...`` of partition ``pid``.

    Each item is a format-1 value, or a tuple holding one at ``field`` (at 1, a format-1
    ``(key, value)`` pair, where ``field`` is -1).  A block
    takes values while their bytes stay within ``block_bytes`` (one larger value is a block
    of its own).  Its payload (content plus key bytes) is counted from the values.  Raises
    ProtocolError for a value shorter than its 9-byte header or offsets past 2^64 - 1.
    """
    from dafka.store.block import BLOCK_KEY, store_block

    values = [item[field if field >= 0 else 1] if isinstance(item, tuple) else item for item in items[lo:hi]]
    for v in values:
        if not isinstance(v, bytes):
            raise TypeError(f"a stored value is {type(v).__name__}, not bytes")
        if len(v) < 9:
            raise ProtocolError("a stored value is shorter than its header")
    out = []
    n = len(values)
    i = 0
    while i < n:
        size = len(values[i])
        j = i + 1
        while j < n and size + len(values[j]) <= block_bytes:
            size += len(values[j])
            j += 1
        chunk = values[i:j]
        payload = size - 9 * len(chunk) - sum(v[8] & 1 for v in chunk)
        out.append((BLOCK_KEY.pack(pid, first_offset + i), store_block(first_offset + i, chunk, payload)))
        i = j
    return out


def block_slice(value: Any, offset: int, n: int) -> tuple[int, int, list[bytes] | None]:
    """``(first offset, last offset, values)`` of a stored block: see
    :func:`dafka.store.block.slice_block` (this twin is that function; the compiled one
    gives the same, faster)."""
    from dafka.store.block import slice_block

    return slice_block(value, offset, n)


def _block_values(value: Any, offset: int, n: int,
                  convert: Callable[[Any, int, int], list[bytes]]) -> tuple[int, int, list[bytes]]:
    first, last, values = block_slice(value, offset, n)
    if values is None:
        # A block that ends before ``offset`` (stepped back onto from a hole after it) is not
        # decoded: a damaged one raised from a read holding none of its offsets, and its
        # callers passed the block after the hole for it (a VOID over held records).
        values = convert(value, offset if offset > first else first, n) if offset <= last else []
    return first, last, values


def fetch_blocks(cur: Any, pid: int, start: int, last: int, n: int,
                 convert: Callable[[Any, int, int], list[bytes]]) -> tuple[int, list[bytes]]:
    """Format-1 values of partition ``pid`` from the first offset held at or after ``start``
    (its blocks keyed ``pid:u32 first_offset:u64`` in the LMDB table of cursor ``cur``): up to
    ``n``, stopping at the next hole.  ``(first offset returned, values)``, or
    ``(last + 1, [])`` when nothing is held from ``start`` on.

    One ``set_range`` finds the block (one step back when it lands on the block after it);
    CODEC_STORE blocks are sliced (:func:`block_slice`), others given to
    ``convert(value, offset, n)``.  A block that cannot be read (a damaged store: blocks are
    checked when written) raises what its reading raised when it is the first one read;
    after others, the values stop before it (the next call, starting at it, raises): the
    records before a damaged block are served.
    """
    key = _BLOCK_KEY.pack(pid, start)
    pkey = key[:4]
    if cur.set_range(key):
        if cur.key() == key:
            found = _block_values(cur.value(), start, n, convert)
        else:
            found = None
            if cur.prev():
                if cur.key()[:4] == pkey:
                    got = _block_values(cur.value(), start, n, convert)
                    if got[1] >= start:
                        found = got
                if found is None:
                    cur.next()
            else:  # nothing keyed before: back on the block it landed on
                cur.set_range(key)
            if found is None:
                if cur.key()[:4] != pkey:
                    return last + 1, []
                found = _block_values(cur.value(), start, n, convert)  # the first block after a hole
    else:
        if not cur.last() or cur.key()[:4] != pkey:
            return last + 1, []
        found = _block_values(cur.value(), start, n, convert)
        if found[1] < start:
            return last + 1, []
    first, block_last, values = found
    if first > start:
        start = first  # in a hole, or before the first block
    expect = start + len(values)
    while len(values) < n and expect == block_last + 1 and cur.next():
        kpid, kfirst = _BLOCK_KEY.unpack(cur.key())
        if kpid != pid or kfirst != expect:
            break  # another partition, or a hole: the next call starts past it
        try:
            _first, block_last, got = _block_values(cur.value(), kfirst, n - len(values), convert)
        except Exception:
            break  # a damaged block: what precedes it goes, the next call (starting at it) raises
        if not got:
            break
        values.extend(got)
        expect += len(got)
    return (start, values) if values else (last + 1, [])


_BLOCK_KEY = struct.Struct(">IQ")


def new_bytearray(size: int) -> bytearray:
    """A bytearray of ``size`` bytes for the caller to fill (the compiled twin leaves them
    unset: no zeroing of a buffer that is received into at once)."""
    if size < 0:
        raise ValueError("new_bytearray: negative size")
    return bytearray(size)


def view_start(view: Any) -> int:
    """Where a memoryview's first byte is in the bytearray it views: -1 when it views
    anything else, is empty, or is not a contiguous writable view of bytes."""
    import ctypes

    if type(view) is not memoryview:
        return -1
    obj = view.obj
    if type(obj) is not bytearray or not view.c_contiguous or view.itemsize != 1 or view.readonly:
        return -1
    if not len(view):
        return -1
    at = ctypes.addressof(ctypes.c_char.from_buffer(view)) - ctypes.addressof(ctypes.c_char.from_buffer(obj))
    return at if 0 <= at and at + len(view) <= len(obj) else -1


def tank_scan(bundle: Any, max_record_bytes: int, budget: int,
              contents: bool = False) -> tuple[bool, int, int | None, int | None, int, int, list[bytes] | None]:
    """Validate a Tank bundle's framing without a Python object per message (the compiled twin).

    ``(snappy, message count, first seq, last seq, first timestamp, max timestamp,
    contents)``: the seqs of a sparse bundle's header (None for a plain one), the first
    message's and the largest timestamp, and, with ``contents``, each message's content
    (bytes; else None).  Raises ProtocolError when the bundle is malformed or lies
    (:func:`dafka.store.block.tank_block` lists what is checked), a message (key plus
    content) is over ``max_record_bytes``, or a snappy bundle claims more than ``budget``
    bytes.
    """
    from dafka.store.block import _scan_tank

    out: list[bytes] | None = [] if contents else None
    s = _scan_tank(bundle if isinstance(bundle, bytes) else bytes(bundle), max_record_bytes, budget, out)
    if out is not None:
        out = [c if isinstance(c, bytes) else bytes(c) for c in out]
    return s.snappy, s.record_count, s.first_seq, s.last_seq, s.first_ts, s.max_ts, out


def tank_values(bundle: Any, skip: int, n: int) -> list[bytes]:
    """Format-1 stored values (:mod:`dafka.store.layout`: the producer's timestamp, the key)
    of a Tank bundle's messages ``skip .. skip + n - 1`` (fewer past its end): what readers of
    stored values take from a Tank block.  Raises ProtocolError for a malformed bundle (no
    size bound: the bundle was checked when it was stored; its snappy message set may claim
    at most the budget it was checked against, :data:`dafka.store.block.DEFAULT_BUDGET`: a
    bit-rotten length is refused before inflating)."""
    from dafka.store.block import DEFAULT_BUDGET
    from dafka.store.layout import FLAG_KEY, FLAG_PRODUCER_TS, VALUE_HEADER
    from dafka.tank.bundle import decode_bundle

    if skip < 0 or n < 0:
        raise ValueError("tank_values: negative skip or count")
    tank_scan(bundle, 1 << 62, DEFAULT_BUDGET)  # the same verdict as the compiled walk
    out = []
    for _seq, ts, key, content in decode_bundle(bytes(bundle))[skip:skip + n]:
        if key is None:
            out.append(VALUE_HEADER.pack(ts, FLAG_PRODUCER_TS) + bytes(content))
        else:
            out.append(VALUE_HEADER.pack(ts, FLAG_PRODUCER_TS | FLAG_KEY) + bytes((len(key),)) + bytes(key)
                       + bytes(content))
    return out


_PRODUCE_ANSWER = struct.Struct("<BII")  # frame msg id, payload length, request id
_U64_LIMIT = (1 << 64) - 1


def tank_produce(payload: Any, with_seq: bool, topics: dict[str, list[Any]], next_offset: dict[Any, int],
                 max_record_bytes: int, budget: int, live: Callable[[Any], bool], live_room: int,
                 blocks: list[Any], publish: list[Any], reserved: str) -> tuple[dict[Any, int], bytes, int, int] | None:
    """The Tank gateway's produce request in one call, where it is the common one: every
    partition it names exists and is owned (``topics``: the partitions of each topic by id;
    ``reserved``: a topic never written here), every bundle is well formed and within the
    bounds, every first seq (ProduceWithSeqnum, or a sparse bundle's) continues its
    partition.  Then each bundle is sealed into one block (see
    :func:`dafka.store.block.tank_seal`; the first one where it lies, when it is a view of
    half its buffer or more: :func:`dafka.store.block.tank_seal_in_place`), given its
    offsets from ``next_offset`` (moved on), and appended to ``blocks`` as ``(topic,
    address, block)``; a partition ``live`` says is read on the mesh (while ``live_room``
    content bytes are left) also gets ``(key, first offset, contents)`` in ``publish``.

    Returns ``(needs, answer, records, live bytes)``: the head each partition must reach
    before ``answer`` (the whole produce response frame, every partition OK) goes, the
    records the blocks hold, the content bytes put in ``publish``.
    None, with nothing changed and nothing written: anything else (an unknown or
    not-owned partition, a malformed or refused bundle, a seq that does not continue, a
    request that is not plainly well formed): the caller's general path decides.
    """
    from dafka.store.block import (
        HEADER_SIZE,
        tank_seal,
        tank_seal_in_place,
        tank_seqs_continue,
        tank_span,
    )
    from dafka.tank.messages import ProduceRequest, ProduceWithSeqnumRequest

    cls = ProduceWithSeqnumRequest if with_seq else ProduceRequest
    try:
        req = cls._decode_plain(payload)  # the gateway's own plain decoder: what it cannot take is not common
    except (IndexError, ValueError, struct.error, ProtocolError):
        return None
    plan: list[tuple[Any, Any, tuple[Any, ...], int | None]] = []
    partitions = 0
    for t in req.topics:
        parts = topics.get(t.name) if t.name != reserved else None
        if parts is None:
            return None
        partitions += len(t.partitions)
        for p in t.partitions:
            part = parts[p.partition] if p.partition < len(parts) else None
            if part is None or not part.owned:
                return None
            bundle = p.bundle
            want = live_room > 0 and bool(live(part))
            try:
                scan = tank_scan(bundle, max_record_bytes, budget, want)
            except ProtocolError:
                return None
            if scan[6] is not None:
                live_room -= sum(map(len, scan[6]))
            plan.append((part, bundle, scan, p.first_seq if with_seq else scan[2]))
    # Every seq checked and every offset in range before anything is changed or sealed (a
    # header sealed in place overwrites the request's fields).
    ahead: dict[Any, int] = {}
    for part, _bundle, scan, first in plan:
        key = (part.topic, part.address)
        at = ahead[key] if key in ahead else next_offset.get(key, 0)
        if not tank_seqs_continue(first, at + 1, scan):
            return None
        if at < 0 or at + tank_span(scan) - 1 > _U64_LIMIT:
            return None
        ahead[key] = at + scan[1]
    start = -1
    if plan:
        first_bundle = plan[0][1]
        if type(first_bundle) is memoryview and 2 * len(first_bundle) >= len(first_bundle.obj):  # type: ignore[arg-type]
            start = view_start(first_bundle)
    needs: dict[Any, int] = {}
    records = live_bytes = 0
    for i, (part, bundle, scan, _first) in enumerate(plan):
        key = (part.topic, part.address)
        at = next_offset.get(key, 0)
        block: bytes | memoryview
        if i == 0 and start >= HEADER_SIZE:
            block = tank_seal_in_place(bundle, start, scan, at)
        else:
            block = tank_seal(bundle, scan, at)
        blocks.append((part.topic, part.address, block))
        records += scan[1]
        if scan[6] is not None:
            publish.append((key, at, scan[6]))
            live_bytes += sum(map(len, scan[6]))
        at += scan[1]
        next_offset[key] = at
        needs[key] = at - 1
    answer = _PRODUCE_ANSWER.pack(1, 4 + partitions, req.req_id) + bytes(partitions)
    return needs, answer, records, live_bytes
