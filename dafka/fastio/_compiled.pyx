# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :mod:`dafka.fastio._pure` (same functions, same results).

Calls libzmq directly, through function pointers bound at import to the
libzmq that pyzmq loaded (:mod:`dafka.fastio._bind`).  GIL policy: every
non-blocking libzmq call runs with the GIL held, so a busy Python thread
cannot stall a batch between records; the GIL is released only to wait (a
send the socket cannot take yet).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM


cdef extern from "Python.h":
    PyObject *PyType_GenericAlloc(PyTypeObject *type, Py_ssize_t nitems)
    void PyObject_GC_UnTrack(void *op)
from libc.errno cimport EAGAIN, EINTR
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.string cimport memchr, memcmp, memcpy, memset

import zmq

IMPLEMENTATION = "compiled"


cdef extern from "zmq_api.h" nogil:
    ctypedef union dafka_zmq_msg_t:
        pass
    ctypedef int (*dafka_msg_init_fn)(dafka_zmq_msg_t *msg)
    ctypedef int (*dafka_msg_close_fn)(dafka_zmq_msg_t *msg)
    ctypedef int (*dafka_msg_recv_fn)(dafka_zmq_msg_t *msg, void *socket, int flags)
    ctypedef void *(*dafka_msg_data_fn)(dafka_zmq_msg_t *msg)
    ctypedef size_t (*dafka_msg_size_fn)(const dafka_zmq_msg_t *msg)
    ctypedef int (*dafka_msg_more_fn)(const dafka_zmq_msg_t *msg)
    ctypedef int (*dafka_send_fn)(void *socket, const void *buf, size_t len, int flags)
    ctypedef int (*dafka_errno_fn)()
    ctypedef void (*dafka_version_fn)(int *major, int *minor, int *patch)
    ctypedef int (*dafka_getsockopt_fn)(void *socket, int option, void *optval, size_t *optvallen)
    int DAFKA_ZMQ_DONTWAIT
    int DAFKA_ZMQ_SNDMORE
    int DAFKA_ZMQ_TYPE
    int DAFKA_ZMQ_EVENTS


cdef dafka_msg_init_fn z_msg_init = NULL
cdef dafka_msg_close_fn z_msg_close = NULL
cdef dafka_msg_recv_fn z_msg_recv = NULL
cdef dafka_msg_data_fn z_msg_data = NULL
cdef dafka_msg_size_fn z_msg_size = NULL
cdef dafka_msg_more_fn z_msg_more = NULL
cdef dafka_send_fn z_send = NULL
cdef dafka_errno_fn z_errno = NULL
cdef dafka_version_fn z_version = NULL
cdef dafka_getsockopt_fn z_getsockopt = NULL
cdef bint bound = False

FUNCTIONS = (
    "zmq_msg_init", "zmq_msg_close", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size",
    "zmq_msg_more", "zmq_send", "zmq_errno", "zmq_version", "zmq_getsockopt",
)

cdef object _tuple_new = tuple.__new__
cdef object ZMQError = zmq.ZMQError


def set_functions(dict addresses):
    """Bind the libzmq functions (name -> address); :mod:`dafka.fastio._bind` checks them."""
    global z_msg_init, z_msg_close, z_msg_recv, z_msg_data, z_msg_size, z_msg_more
    global z_send, z_errno, z_version, z_getsockopt, bound
    for name in FUNCTIONS:
        if not addresses.get(name):
            raise ValueError(f"no address for {name}")
    z_msg_init = <dafka_msg_init_fn><uintptr_t>addresses["zmq_msg_init"]
    z_msg_close = <dafka_msg_close_fn><uintptr_t>addresses["zmq_msg_close"]
    z_msg_recv = <dafka_msg_recv_fn><uintptr_t>addresses["zmq_msg_recv"]
    z_msg_data = <dafka_msg_data_fn><uintptr_t>addresses["zmq_msg_data"]
    z_msg_size = <dafka_msg_size_fn><uintptr_t>addresses["zmq_msg_size"]
    z_msg_more = <dafka_msg_more_fn><uintptr_t>addresses["zmq_msg_more"]
    z_send = <dafka_send_fn><uintptr_t>addresses["zmq_send"]
    z_errno = <dafka_errno_fn><uintptr_t>addresses["zmq_errno"]
    z_version = <dafka_version_fn><uintptr_t>addresses["zmq_version"]
    z_getsockopt = <dafka_getsockopt_fn><uintptr_t>addresses["zmq_getsockopt"]
    bound = True


def libzmq_version():
    """``(major, minor, patch)`` of the bound libzmq."""
    cdef int major = 0, minor = 0, patch = 0
    _check_bound()
    z_version(&major, &minor, &patch)
    return (major, minor, patch)


def socket_type(sock):
    """The ZMQ_TYPE of a pyzmq socket, read through the bound libzmq."""
    cdef int value = -1
    cdef size_t size = sizeof(int)
    cdef void *s = _handle(sock)
    if z_getsockopt(s, DAFKA_ZMQ_TYPE, &value, &size) != 0:
        raise ZMQError(z_errno())
    return value


def events(sock):
    """ZMQ_EVENTS of a pyzmq socket (POLLIN 1 | POLLOUT 2): a shared loop asks it
    of every socket a node's turn may have touched, and pyzmq's ``get`` costs
    several times more (it converts the answer to an enum)."""
    cdef int value = 0
    cdef size_t size = sizeof(int)
    cdef void *s = _handle(sock)
    if z_getsockopt(s, DAFKA_ZMQ_EVENTS, &value, &size) != 0:
        raise ZMQError(z_errno())
    return value


cdef inline int _check_bound() except -1:
    if not bound:
        raise RuntimeError("dafka.fastio._compiled is not bound to libzmq")
    return 0


cdef void *_handle(object sock) except NULL:
    _check_bound()
    if sock.closed:
        raise ZMQError(zmq.ENOTSOCK)
    cdef uintptr_t address = sock.underlying
    if address == 0:
        raise ZMQError(zmq.ENOTSOCK)
    return <void *>address


cdef inline bytes _bytes_of(dafka_zmq_msg_t *msg):
    return PyBytes_FromStringAndSize(<char *>z_msg_data(msg), z_msg_size(msg))


cdef int _recv(dafka_zmq_msg_t *msg, void *s) except -2:
    """One frame without waiting: 1, or 0 when none is there."""
    cdef int err
    while z_msg_recv(msg, s, DAFKA_ZMQ_DONTWAIT) < 0:
        err = z_errno()
        if err == EAGAIN:
            return 0
        if err == EINTR:
            PyErr_CheckSignals()
            continue
        raise ZMQError(err)
    return 1


cdef int _recv_part(dafka_zmq_msg_t *msg, void *s) except -1:
    """A further frame of a message being read: its parts arrive together."""
    if not _recv(msg, s):
        raise ZMQError(EAGAIN)
    return 0


cdef list _rest(dafka_zmq_msg_t *msg, void *s, list frames):
    """Read the remaining frames of a message into ``frames`` (``msg`` holds the last one read)."""
    while z_msg_more(msg):
        _recv_part(msg, s)
        frames.append(_bytes_of(msg))
    return frames


def recv_messages(sock, int limit):
    """Up to ``limit`` whole messages waiting on ``sock`` (never blocks), each a list of frames."""
    cdef void *s = _handle(sock)
    cdef dafka_zmq_msg_t msg
    cdef list out = []
    cdef int i
    z_msg_init(&msg)
    try:
        for i in range(limit):
            if not _recv(&msg, s):
                break
            out.append(_rest(&msg, s, [_bytes_of(&msg)]))
    finally:
        z_msg_close(&msg)
    return out


cdef inline uint64_t _be64(const unsigned char *p) noexcept nogil:
    return ((<uint64_t>p[0] << 56) | (<uint64_t>p[1] << 48) | (<uint64_t>p[2] << 40)
            | (<uint64_t>p[3] << 32) | (<uint64_t>p[4] << 24) | (<uint64_t>p[5] << 16)
            | (<uint64_t>p[6] << 8) | <uint64_t>p[7])


cdef inline void _put_be64(unsigned char *p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(7, -1, -1):
        p[i] = v & 0xFF
        v >>= 8


cdef inline uint64_t _be32(const unsigned char *p) noexcept nogil:
    return (<uint64_t>p[0] << 24) | (<uint64_t>p[1] << 16) | (<uint64_t>p[2] << 8) | <uint64_t>p[3]


cdef inline void _put_be32(unsigned char *p, uint64_t v) noexcept nogil:
    p[0] = (v >> 24) & 0xFF
    p[1] = (v >> 16) & 0xFF
    p[2] = (v >> 8) & 0xFF
    p[3] = v & 0xFF


cdef enum:
    BATCH_VERSION = 2
    BATCH_RECORDS = 128
    BATCH_BYTES = 16384


cdef inline bint _is_batch(const unsigned char *prefix, size_t plen) noexcept nogil:
    """Whether a known RECORD / DIRECT-RECORD header prefix is a batch's (version 2)."""
    if plen < 2:
        return False
    cdef const unsigned char *nul = <const unsigned char *>memchr(prefix + 1, 0, plen - 1)
    return nul != NULL and <size_t>(nul + 1 - prefix) < plen and nul[1] == BATCH_VERSION


cdef Py_ssize_t _batch_count(const unsigned char *p, size_t size, uint64_t first) noexcept nogil:
    """The number of records in a batch's content frame, or -1 if it is malformed."""
    cdef uint64_t count, i, n
    cdef size_t pos = 4
    if size < 4:
        return -1
    count = _be32(p)
    if count == 0 or count > (size - 4) // 4 or count - 1 > <uint64_t>0xFFFFFFFFFFFFFFFF - first:
        return -1
    for i in range(count):
        if pos + 4 > size:
            return -1
        n = _be32(p + pos)
        if n > size - pos - 4:
            return -1
        pos += 4 + n
    return <Py_ssize_t>count if pos == size else -1


# A run's next offset once it took the last one (2**64 - 1): its u64 wrapped to 0; the tracker
# gets this, as from the pure twin's Python ints, and the run ends there.
_PAST_LAST = 1 << 64


cdef class _Cursor:
    """The tracker of the partition being read, its ``next`` kept in C between callbacks."""

    cdef object tracker
    cdef bint fast  # next is an int and nothing is held: records at next take the fast path
    cdef uint64_t next
    cdef uint64_t start  # next when loaded: written back only if it moved

    cdef int load(self, object tracker) except -1:
        self.tracker = tracker
        nxt = tracker.next
        self.fast = False
        # Offsets near 2**64 stay on the Python-int path (no wrap-around here).
        if nxt is not None and not tracker.held and 0 <= nxt < 0xFFFFFFFFFFFFFFFF:
            self.fast = True
            self.next = self.start = nxt
        return 0

    cdef int flush(self) except -1:
        """Write ``next`` (and ``known``) back to the tracker before anyone else looks."""
        if self.tracker is not None and self.fast and self.next != self.start:
            # (next 0: the run took the last offset, 2**64 - 1, and its u64 wrapped)
            nxt = self.next if self.next else _PAST_LAST
            self.tracker.next = nxt
            last = nxt - 1
            if last > self.tracker.known:
                self.tracker.known = last
            self.start = self.next
        return 0


cdef size_t _max_size(object max_size) except? 0:
    """A ``max_size`` argument in C: None is no limit."""
    if max_size is None:
        return <size_t>-1
    if max_size < 0:
        raise ValueError("max_size must not be negative")
    return <size_t>max_size


def drain_records(sock, int limit, dict by_prefix, out, record_type, ts, on_record, on_message,
                  max_size=None, on_too_large=None):
    """See :func:`dafka.fastio._pure.drain_records`."""
    cdef void *s = _handle(sock)
    cdef size_t limit_size = _max_size(max_size)
    cdef bint check
    cdef dafka_zmq_msg_t head, body
    cdef int queued = 0
    cdef Py_ssize_t i = 0
    cdef size_t hsize, plen
    cdef const unsigned char *hdata
    cdef bytes key = None
    cdef object tracker = None, subject = None, address = None
    cdef object content
    cdef uint64_t seq
    cdef _Cursor cur = _Cursor()
    cdef bint batch = False
    cdef Py_ssize_t count, j
    cdef size_t bsize, pos, n
    cdef const unsigned char *bdata
    cdef PyTypeObject *rtype = NULL
    if record_type is not None:
        if not isinstance(record_type, type) or not issubclass(record_type, tuple):
            raise TypeError("record_type must be a tuple subclass")
        rtype = <PyTypeObject *>record_type
    append = out.append
    z_msg_init(&head)
    z_msg_init(&body)
    try:
        while i < limit:
            i += 1
            if not _recv(&head, s):
                break
            if not z_msg_more(&head):
                cur.flush()
                key = None  # a callback may change the trackers
                on_message([_bytes_of(&head)])
                continue
            _recv_part(&body, s)
            if z_msg_more(&body):
                cur.flush()
                key = None
                on_message(_rest(&body, s, [_bytes_of(&head), _bytes_of(&body)]))
                continue
            hsize = z_msg_size(&head)
            hdata = <const unsigned char *>z_msg_data(&head)
            if hsize < 9:
                cur.flush()
                key = None
                on_message([_bytes_of(&head), _bytes_of(&body)])
                continue
            plen = hsize - 8
            # Consecutive records mostly share a partition: compare bytes
            # before building a key and looking it up.
            if key is None or <size_t>PyBytes_GET_SIZE(key) != plen or memcmp(
                PyBytes_AS_STRING(key), hdata, plen
            ) != 0:
                cur.flush()
                key = PyBytes_FromStringAndSize(<const char *>hdata, plen)
                tracker = by_prefix.get(key)
                if tracker is None:
                    key = None
                    cur.tracker = None
                    on_message([_bytes_of(&head), _bytes_of(&body)])
                    continue
                cur.load(tracker)
                subject = tracker.subject
                address = tracker.address
                batch = _is_batch(hdata, plen)
            seq = _be64(hdata + plen)
            if batch:
                # Many records in one message: the same steps for each (kept
                # apart so that the one-record path stays short).
                bsize = z_msg_size(&body)
                bdata = <const unsigned char *>z_msg_data(&body)
                count = _batch_count(bdata, bsize, seq)
                if count < 0:
                    cur.flush()
                    key = None
                    on_message([_bytes_of(&head), _bytes_of(&body)])
                    continue
                i += count - 1  # a batch counts as its records against limit
                # Only a body this long can hold a record over the limit.
                check = bsize - 8 > limit_size
                pos = 4
                for j in range(count):
                    n = <size_t>_be32(bdata + pos)
                    if check and n > limit_size:
                        pos += 4 + n
                        cur.flush()
                        key = None
                        cur.fast = False  # after a callback: the rest of this batch takes the slow path
                        on_too_large(tracker, seq, n)
                        seq += 1
                        continue
                    content = PyBytes_FromStringAndSize(<const char *>(bdata + pos + 4), n)
                    pos += 4 + n
                    if cur.fast and seq == cur.next:
                        cur.next = seq + 1
                        append(_queued_record(rtype, subject, address, seq, content, ts))
                        queued += 1
                        if cur.next == 0:  # the last offset taken: the run ends (see _PAST_LAST)
                            cur.flush()
                            key = None
                            cur.fast = False
                    else:
                        cur.flush()
                        key = None
                        cur.fast = False  # after a callback: the rest of this batch takes the slow path
                        on_record(tracker, seq, content)
                    seq += 1
                continue
            if z_msg_size(&body) > limit_size:
                cur.flush()
                key = None
                on_too_large(tracker, seq, z_msg_size(&body))
                continue
            content = _bytes_of(&body)
            if cur.fast and seq == cur.next:
                cur.next = seq + 1
                append(_queued_record(rtype, subject, address, seq, content, ts))
                queued += 1
                if cur.next == 0:  # the last offset taken: the run ends (see _PAST_LAST)
                    cur.flush()
                    key = None
                    cur.fast = False
            else:
                cur.flush()
                key = None
                on_record(tracker, seq, content)
    finally:
        cur.flush()
        z_msg_close(&head)
        z_msg_close(&body)
    return queued


cdef inline object _queued_record(PyTypeObject *rtype, object subject, object address, uint64_t seq,
                                  object content, object ts):
    """What drain_records queues for a record: ``rtype`` or the plain tuple with ``ts``."""
    cdef object seq_obj = seq
    if rtype == NULL:
        item = (subject, address, seq_obj, content, ts)
    else:
        item = _new_record(rtype, subject, address, seq_obj, content)
    # Only str, int and bytes inside: no cycle can pass through the record, so
    # the cyclic GC need not scan the (possibly huge) queues of them again and again.
    PyObject_GC_UnTrack(<PyObject *>item)
    return item


cdef inline object _new_record(PyTypeObject *rtype, object a, object b, object c, object d):
    """``rtype((a, b, c, d))`` for a tuple subclass without fields of its own (a NamedTuple)."""
    cdef PyObject *obj = PyType_GenericAlloc(rtype, 4)  # what tuple.__new__ does for subclasses
    if obj == NULL:
        raise MemoryError()
    cdef object result = <object>obj  # a second reference: give the allocation's back
    Py_DECREF(result)
    # PyTuple_SET_ITEM steals a reference.
    Py_INCREF(a)
    PyTuple_SET_ITEM(result, 0, a)
    Py_INCREF(b)
    PyTuple_SET_ITEM(result, 1, b)
    Py_INCREF(c)
    PyTuple_SET_ITEM(result, 2, c)
    Py_INCREF(d)
    PyTuple_SET_ITEM(result, 3, d)
    return result


cdef int _send(void *s, const char *buf, size_t size, int flags, bint block) except -1:
    """Send one frame: 1, or 0 when the socket cannot take it now and ``block`` is false.

    Tried without waiting first, with the GIL held; only a wait releases it.
    """
    cdef int rc, err
    rc = z_send(s, buf, size, flags | DAFKA_ZMQ_DONTWAIT)
    while rc < 0:
        err = z_errno()
        if err == EAGAIN:
            if not block:
                return 0
            with nogil:
                rc = z_send(s, buf, size, flags)
            continue
        if err == EINTR:
            PyErr_CheckSignals()
            rc = z_send(s, buf, size, flags | DAFKA_ZMQ_DONTWAIT)
            continue
        raise ZMQError(err)
    return 1


def send_frames(sock, list frames):
    """Send ``frames`` (bytes) as one message without waiting: True, or False when
    the socket cannot take it now (nothing sent).  For small control messages
    such as beacons: pyzmq's ``send_multipart`` costs a few microseconds a frame."""
    cdef void *s = _handle(sock)
    cdef Py_ssize_t n = len(frames), i
    cdef bytes frame
    if n == 0:
        raise ValueError("a message has at least one frame")
    for i in range(n):
        frame = frames[i]
        if not _send(s, PyBytes_AS_STRING(frame), PyBytes_GET_SIZE(frame),
                     DAFKA_ZMQ_SNDMORE if i < n - 1 else 0, False):
            if i == 0:
                return False
            raise ZMQError(EAGAIN)  # cannot happen: the first frame decides for the message
    return True


cdef enum:
    HEADER_MAX = 1024


def send_records(sock, bytes prefix, seq, contents, Py_ssize_t start=0, stop=None,
                 bint noblock=False):
    """See :func:`dafka.fastio._pure.send_records`."""
    cdef void *s = _handle(sock)
    cdef unsigned char header[HEADER_MAX]
    cdef Py_ssize_t plen = len(prefix), i, end
    cdef uint64_t first = seq
    cdef Py_ssize_t sent = 0
    cdef object content
    cdef const unsigned char[::1] view
    cdef const char *data
    cdef Py_ssize_t size
    cdef const char *empty = ""
    if plen + 8 > HEADER_MAX:
        raise ValueError("record header too long")
    memcpy(header, PyBytes_AS_STRING(prefix), plen)
    end = len(contents) if stop is None else stop
    for i in range(start, end):
        content = contents[i]
        # The content's buffer first: a bad one must fail before the header
        # goes out, or the next message would be glued onto this one.
        if PyBytes_Check(content):
            data = PyBytes_AS_STRING(content)
            size = PyBytes_GET_SIZE(content)
        else:
            view = content
            size = view.shape[0]
            data = <const char *>&view[0] if size else empty
        _put_be64(header + plen, first + <uint64_t>sent)
        if not _send(s, <const char *>header, plen + 8, DAFKA_ZMQ_SNDMORE, not noblock):
            break
        # The rest of a message is never refused once its first part was taken.
        _send(s, data, size, 0, True)
        sent += 1
    return sent


cdef Py_ssize_t _stored_skip(const unsigned char *data, Py_ssize_t size) except -1:
    """Where the content starts in a stored LMDB value (``ts:u64 flags:u8 [klen:u8 key] content``)."""
    cdef Py_ssize_t skip = 9
    if size < 9:
        raise ValueError("stored value too short")
    if data[8] & 1:
        skip = 10 + (data[9] if size > 9 else 0)
    if skip > size:
        raise ValueError("stored value too short for its key")
    return skip


cdef Py_ssize_t _part_size(object item, bint stored) except -1:
    """The size of a record's content: ``item`` itself, or the content of a stored value."""
    cdef Py_buffer buf
    PyObject_GetBuffer(item, &buf, PyBUF_SIMPLE)
    try:
        return buf.len - (_stored_skip(<const unsigned char *>buf.buf, buf.len) if stored else 0)
    finally:
        PyBuffer_Release(&buf)


cdef unsigned char *_put_part(unsigned char *p, unsigned char *end, object item, bint stored) except NULL:
    """Write ``length:4 content`` of a record at ``p`` (within ``end``); the position after it."""
    cdef Py_buffer buf
    cdef Py_ssize_t skip = 0, size
    PyObject_GetBuffer(item, &buf, PyBUF_SIMPLE)
    try:
        if stored:
            skip = _stored_skip(<const unsigned char *>buf.buf, buf.len)
        size = buf.len - skip
        if size > end - p - 4:
            raise ValueError("a record changed size while it was being sent")
        _put_be32(p, size)
        memcpy(p + 4, <const char *>buf.buf + skip, size)
    finally:
        PyBuffer_Release(&buf)
    return p + 4 + size


def send_batches(sock, bytes prefix, seq, contents, Py_ssize_t start=0, stop=None,
                 bint noblock=False, Py_ssize_t max_records=BATCH_RECORDS,
                 Py_ssize_t max_bytes=BATCH_BYTES, bint stored=False):
    """See :func:`dafka.fastio._pure.send_batches`."""
    cdef void *s = _handle(sock)
    cdef unsigned char header[HEADER_MAX]
    cdef Py_ssize_t plen = len(prefix), i, j, k, end, total, size
    cdef uint64_t first = seq
    cdef Py_ssize_t sent = 0
    cdef unsigned char *p
    cdef unsigned char *body_end
    cdef bytes body
    if plen + 8 > HEADER_MAX:
        raise ValueError("record header too long")
    memcpy(header, PyBytes_AS_STRING(prefix), plen)
    end = len(contents) if stop is None else stop
    i = start
    while i < end:
        # The batch: records i..j-1, at least one, within both limits.
        j = i
        total = 0
        while j < end and j - i < max_records:
            size = _part_size(contents[j], stored)
            if j > i and total + size > max_bytes:
                break
            total += size
            j += 1
        body = PyBytes_FromStringAndSize(NULL, 4 + 4 * (j - i) + total)
        p = <unsigned char *>PyBytes_AS_STRING(body)
        body_end = p + PyBytes_GET_SIZE(body)
        _put_be32(p, j - i)
        p += 4
        for k in range(i, j):
            p = _put_part(p, body_end, contents[k], stored)
        if p != body_end:
            raise ValueError("a record changed size while it was being sent")
        _put_be64(header + plen, first + <uint64_t>sent)
        if not _send(s, <const char *>header, plen + 8, DAFKA_ZMQ_SNDMORE, not noblock):
            break
        _send(s, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body), 0, True)
        sent += j - i
        i = j
    return sent


def send_values(sock, bytes prefix, seq, values, bint noblock=True):
    """See :func:`dafka.fastio._pure.send_values`."""
    cdef void *s = _handle(sock)
    cdef unsigned char header[HEADER_MAX]
    cdef Py_ssize_t plen = len(prefix), size, skip
    cdef uint64_t first = seq
    cdef Py_ssize_t sent = 0
    cdef const unsigned char *data
    cdef const unsigned char *empty = <const unsigned char *>""
    cdef const unsigned char[::1] view
    if plen + 8 > HEADER_MAX:
        raise ValueError("record header too long")
    memcpy(header, PyBytes_AS_STRING(prefix), plen)
    for value in values:
        if PyBytes_Check(value):
            data = <const unsigned char *>PyBytes_AS_STRING(value)
            size = PyBytes_GET_SIZE(value)
        else:
            view = value
            size = view.shape[0]
            data = &view[0] if size else empty
        skip = _stored_skip(data, size)
        _put_be64(header + plen, first + <uint64_t>sent)
        if not _send(s, <const char *>header, plen + 8, DAFKA_ZMQ_SNDMORE, not noblock):
            break
        _send(s, <const char *>(data + skip), size - skip, 0, True)
        sent += 1
    return sent


cdef class _PairCursor:
    """As :class:`_Cursor` for :func:`drain_pairs`: also the partition's pid and the open run."""

    cdef object tracker
    cdef bint fast
    cdef uint64_t next
    cdef uint64_t start
    cdef uint64_t nbytes
    cdef unsigned int pid

    cdef int load(self, object tracker) except -1:
        self.tracker = tracker
        nxt = tracker.next
        pid = tracker.pid
        self.fast = False
        if (nxt is not None and pid is not None and not tracker.held
                and 0 <= nxt < 0xFFFFFFFFFFFFFFFF and 0 <= pid <= 0xFFFFFFFF):
            self.fast = True
            self.next = self.start = nxt
            self.pid = pid
            self.nbytes = 0
        return 0

    cdef int flush(self, list segs) except -1:
        if self.tracker is not None and self.fast and self.next != self.start:
            # (next 0: the run took the last offset, 2**64 - 1, and its u64 wrapped)
            nxt = self.next if self.next else _PAST_LAST
            self.tracker.next = nxt
            last = nxt - 1
            if last > self.tracker.known:
                self.tracker.known = last
            segs.append((self.tracker.subject, self.tracker.address, self.pid, self.start, last, self.nbytes))
            self.start = self.next
            self.nbytes = 0
        return 0


cdef bytes _value(uint64_t ts, const unsigned char *data, size_t size):
    """The stored format-1 value (ts_ms:u64 flags:u8 = 0, content) of a record."""
    cdef bytes value = PyBytes_FromStringAndSize(NULL, 9 + size)
    cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(value)
    _put_be64(p, ts)
    p[8] = 0
    memcpy(p + 9, data, size)
    return value


def drain_pairs(sock, int limit, dict by_prefix, list out, list segs, ts, on_record, on_message,
                max_size=None, on_too_large=None):
    """See :func:`dafka.fastio._pure.drain_pairs`."""
    cdef void *s = _handle(sock)
    cdef size_t limit_size = _max_size(max_size)
    cdef bint check
    cdef dafka_zmq_msg_t head, body
    cdef int queued = 0
    cdef Py_ssize_t i = 0
    cdef size_t hsize, plen, bsize
    cdef const unsigned char *hdata
    cdef unsigned char *p
    cdef bytes key = None
    cdef object tracker = None
    cdef object content, item, rkey, value
    cdef uint64_t seq
    cdef uint64_t ts64 = ts
    cdef _PairCursor cur = _PairCursor()
    cdef bint batch = False
    cdef Py_ssize_t count, j
    cdef size_t pos, n
    cdef const unsigned char *bdata
    z_msg_init(&head)
    z_msg_init(&body)
    try:
        while i < limit:
            i += 1
            if not _recv(&head, s):
                break
            if not z_msg_more(&head):
                cur.flush(segs)
                key = None
                on_message([_bytes_of(&head)])
                continue
            _recv_part(&body, s)
            if z_msg_more(&body):
                cur.flush(segs)
                key = None
                on_message(_rest(&body, s, [_bytes_of(&head), _bytes_of(&body)]))
                continue
            hsize = z_msg_size(&head)
            hdata = <const unsigned char *>z_msg_data(&head)
            if hsize < 9:
                cur.flush(segs)
                key = None
                on_message([_bytes_of(&head), _bytes_of(&body)])
                continue
            plen = hsize - 8
            if key is None or <size_t>PyBytes_GET_SIZE(key) != plen or memcmp(
                PyBytes_AS_STRING(key), hdata, plen
            ) != 0:
                cur.flush(segs)
                key = PyBytes_FromStringAndSize(<const char *>hdata, plen)
                tracker = by_prefix.get(key)
                if tracker is None:
                    key = None
                    cur.tracker = None
                    on_message([_bytes_of(&head), _bytes_of(&body)])
                    continue
                cur.load(tracker)
                batch = _is_batch(hdata, plen)
            seq = _be64(hdata + plen)
            if batch:
                # Many records in one message (see drain_records).
                bsize = z_msg_size(&body)
                bdata = <const unsigned char *>z_msg_data(&body)
                count = _batch_count(bdata, bsize, seq)
                if count < 0:
                    cur.flush(segs)
                    key = None
                    on_message([_bytes_of(&head), _bytes_of(&body)])
                    continue
                i += count - 1
                check = bsize - 8 > limit_size  # see drain_records
                pos = 4
                for j in range(count):
                    n = <size_t>_be32(bdata + pos)
                    pos += 4
                    if check and n > limit_size:
                        cur.flush(segs)
                        key = None
                        cur.fast = False
                        on_too_large(tracker, seq, n)
                    elif cur.fast and seq == cur.next:
                        cur.next = seq + 1
                        item = _value(ts64, bdata + pos, n)
                        cur.nbytes += n
                        out.append(item)
                        queued += 1
                        if cur.next == 0:  # the last offset taken: the run ends (see _PAST_LAST)
                            cur.flush(segs)
                            key = None
                            cur.fast = False
                    else:
                        cur.flush(segs)
                        key = None
                        cur.fast = False
                        on_record(tracker, seq, PyBytes_FromStringAndSize(<const char *>(bdata + pos), n))
                    pos += n
                    seq += 1
                continue
            bsize = z_msg_size(&body)
            if bsize > limit_size:
                cur.flush(segs)
                key = None
                on_too_large(tracker, seq, bsize)
            elif cur.fast and seq == cur.next:
                cur.next = seq + 1
                item = _value(ts64, <const unsigned char *>z_msg_data(&body), bsize)
                cur.nbytes += bsize
                out.append(item)
                queued += 1
                if cur.next == 0:  # the last offset taken: the run ends (see _PAST_LAST)
                    cur.flush(segs)
                    key = None
                    cur.fast = False
            else:
                cur.flush(segs)
                key = None
                on_record(tracker, seq, _bytes_of(&body))
    finally:
        cur.flush(segs)
        z_msg_close(&head)
        z_msg_close(&body)
    return queued


# ---------------------------------------------------------------- store format 2 blocks

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE

from crc32c import crc32c as _crc32c

from dafka.errors import ProtocolError
from dafka.store.block import decode_header as _decode_header

cdef enum:
    _HEADER_SIZE = 52
    _CRC_AT = 48
    _STORE_BASE = 60  # a CODEC_STORE block's ends table: after the header and payload:u64
    _CODEC_STORE = 4
cdef uint64_t _I64_MAX = 0x7FFFFFFFFFFFFFFF


cdef inline object _store_value(object item, int field):
    """The format-1 value of one item (a value, or a tuple holding it at ``field``), checked."""
    cdef object v = item
    if field < 0 and PyTuple_Check(item):
        field = 1  # a format-1 (key, value) pair among values (the Kafka gateway queues those)
    if field >= 0:
        if not PyTuple_Check(item) or PyTuple_GET_SIZE(item) <= field:
            raise TypeError("a stored item is not a tuple holding its value")
        v = <object>PyTuple_GET_ITEM(item, field)
    if not PyBytes_Check(v):
        raise TypeError(f"a stored value is {type(v).__name__}, not bytes")
    if PyBytes_GET_SIZE(v) < 9:
        raise ProtocolError("a stored value is shorter than its header")
    return v


cdef int _seal_store_block(bytes block, uint64_t first, Py_ssize_t n, uint64_t body, uint64_t first_ts,
                           uint64_t max_ts, uint64_t payload) except -1:
    """A new CODEC_STORE block's header, payload count and CRC, written in place (its ends
    table and values are already there; no one has seen it yet)."""
    cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(block)
    p[0] = 68  # b"DB"
    p[1] = 66
    p[2] = 2  # version
    p[3] = _CODEC_STORE
    p[4] = 0  # compression
    p[5] = 0  # flags
    p[6] = 0  # reserved
    p[7] = 0
    _put_be64(p + 8, first)
    _put_be64(p + 16, first + <uint64_t>(n - 1))
    _put_be32(p + 24, <uint64_t>n)
    _put_be32(p + 28, body)
    _put_be64(p + 32, first_ts)
    _put_be64(p + 40, max_ts)
    _put_be64(p + _HEADER_SIZE, payload)
    mv = memoryview(block)
    cdef uint64_t crc = _crc32c(mv[_HEADER_SIZE:], _crc32c(mv[:_CRC_AT]))
    mv.release()
    _put_be32(p + _CRC_AT, crc)
    return 0


cdef object _store_block(list items, Py_ssize_t i, Py_ssize_t j, Py_ssize_t size,
                         unsigned int pid, uint64_t first, int field):
    """One CODEC_STORE block of the (checked) values of ``items[i:j]``, ``size`` bytes of them."""
    cdef Py_ssize_t n = j - i, k
    cdef Py_ssize_t body = 8 + 4 * n + size
    if <uint64_t>(_HEADER_SIZE + body) > 0xFFFFFFFF:
        raise ProtocolError(f"a block body of {body} bytes is over 4 GiB")
    if first + <uint64_t>(n - 1) < first:
        raise ProtocolError(f"block offsets {first}..{first + (n - 1)} out of range")
    cdef bytes block = PyBytes_FromStringAndSize(NULL, _HEADER_SIZE + body)
    cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(block)
    cdef unsigned char *ends = p + _STORE_BASE
    cdef unsigned char *out = ends + 4 * n
    cdef const unsigned char *src
    cdef Py_ssize_t vlen
    cdef uint64_t ts, first_ts = 0, max_ts = 0, payload = 0
    cdef object v
    for k in range(n):
        v = _store_value(<object>PyList_GET_ITEM(items, i + k), field)
        src = <const unsigned char *>PyBytes_AS_STRING(v)
        vlen = PyBytes_GET_SIZE(v)
        ts = _be64(src)
        if k == 0:
            first_ts = max_ts = ts
        elif ts > max_ts:
            max_ts = ts
        payload += <uint64_t>(vlen - 9 - (src[8] & 1))
        memcpy(out, src, vlen)
        out += vlen
        _put_be32(ends + 4 * k, <uint64_t>(out - p))
    if out - p != _HEADER_SIZE + body:
        raise RuntimeError("stored values changed size while a block was built")
    # Format-1 timestamps are u64, the header's i64 (see dafka.store.block.store_block).
    if first_ts > _I64_MAX:
        first_ts = _I64_MAX
    if max_ts > _I64_MAX:
        max_ts = _I64_MAX
    _seal_store_block(block, first, n, <uint64_t>body, first_ts, max_ts, payload)
    cdef bytes key = PyBytes_FromStringAndSize(NULL, 12)
    p = <unsigned char *>PyBytes_AS_STRING(key)
    _put_be32(p, pid)
    _put_be64(p + 4, first)
    return (key, block)


def store_blocks(list items, Py_ssize_t lo, Py_ssize_t hi, unsigned int pid, uint64_t first_offset,
                 Py_ssize_t block_bytes, int field):
    """See :func:`dafka.fastio._pure.store_blocks`."""
    cdef list out = []
    cdef Py_ssize_t i, j, size, vlen
    if lo < 0 or hi > PyList_GET_SIZE(items) or lo > hi:
        raise IndexError("store_blocks: range outside the items")
    i = lo
    while i < hi:
        size = PyBytes_GET_SIZE(_store_value(<object>PyList_GET_ITEM(items, i), field))
        j = i + 1
        while j < hi:
            vlen = PyBytes_GET_SIZE(_store_value(<object>PyList_GET_ITEM(items, j), field))
            if size + vlen > block_bytes:
                break
            size += vlen
            j += 1
        out.append(_store_block(items, i, j, size, pid, first_offset + <uint64_t>(i - lo), field))
        i = j
    return out


cdef tuple _slice(object value, uint64_t offset, Py_ssize_t n):
    cdef Py_buffer view
    PyObject_GetBuffer(value, &view, PyBUF_SIMPLE)
    cdef const unsigned char *p = <const unsigned char *>view.buf
    cdef Py_ssize_t size = view.len
    cdef uint64_t first, last, count, i, j, k, base, a, b
    cdef int64_t ts0, tsmax
    cdef list out
    try:
        if (size < _HEADER_SIZE or p[0] != 68 or p[1] != 66 or p[2] != 2 or p[3] < 1 or p[3] > 4
                or p[5] or p[6] or p[7] or _be32(p + 28) != <uint64_t>(size - _HEADER_SIZE)):
            _decode_header(value)  # raises its ProtocolError
            raise ProtocolError("bad block header")
        first = _be64(p + 8)
        last = _be64(p + 16)
        count = _be32(p + 24)
        ts0 = <int64_t>_be64(p + 32)
        tsmax = <int64_t>_be64(p + 40)
        if count < 1 or last < first or last - first < count - 1 or tsmax < ts0:
            _decode_header(value)
            raise ProtocolError("bad block header")
        if offset > last:  # (nothing of it is served: see the pure twin)
            return first, last, []
        if p[3] != _CODEC_STORE:
            return first, last, None
        out = []
        i = offset - first if offset > first else 0
        if n <= 0 or i >= count:
            return first, last, out
        j = i + <uint64_t>n if <uint64_t>n < count - i else count
        base = _STORE_BASE + 4 * count
        if base > <uint64_t>size:
            raise ProtocolError("a CODEC_STORE block's ends table runs past its end")
        if _be32(p + base - 4) != <uint64_t>size:  # (the header's count is not the table's)
            raise ProtocolError("a CODEC_STORE block's ends table does not end at the block's end")
        a = base
        for k in range(count):  # the whole table, whatever the slice (see the pure twin)
            b = _be32(p + _STORE_BASE + 4 * k)
            if b < a + 9:  # (9: a stored value's header, dafka.store.layout)
                raise ProtocolError("a CODEC_STORE block's ends table points outside it")
            a = b
        a = base if i == 0 else _be32(p + _STORE_BASE + 4 * (i - 1))
        for k in range(i, j):
            b = _be32(p + _STORE_BASE + 4 * k)
            out.append(PyBytes_FromStringAndSize(<const char *>(p + a), <Py_ssize_t>(b - a)))
            a = b
        return first, last, out
    finally:
        PyBuffer_Release(&view)


def block_slice(value, uint64_t offset, Py_ssize_t n):
    """See :func:`dafka.fastio._pure.block_slice`."""
    return _slice(value, offset, n)


cdef tuple _block_values(object value, uint64_t offset, Py_ssize_t n, object convert):
    cdef tuple found = _slice(value, offset, n)
    if found[2] is None:
        first = found[0]
        if offset > <uint64_t>found[1]:  # (see dafka.fastio._pure._block_values)
            return (first, found[1], [])
        found = (first, found[1], convert(value, offset if offset > first else first, n))
    return found


cdef int _key_pid(object key, unsigned int pid, uint64_t *first) except -1:
    """1 if ``key`` (a block key, bytes or a buffer) is of partition ``pid`` (its first offset
    then in ``first``), else 0."""
    cdef Py_buffer view
    cdef int same
    PyObject_GetBuffer(key, &view, PyBUF_SIMPLE)
    try:
        if view.len != 12:
            raise ProtocolError(f"a block key of {view.len} bytes")
        same = _be32(<const unsigned char *>view.buf) == pid
        first[0] = _be64(<const unsigned char *>view.buf + 4)
        return same
    finally:
        PyBuffer_Release(&view)


def fetch_blocks(cur, unsigned int pid, uint64_t start, last, Py_ssize_t n, convert):
    """See :func:`dafka.fastio._pure.fetch_blocks`."""
    cdef bytes key = PyBytes_FromStringAndSize(NULL, 12)
    cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(key)
    cdef uint64_t kfirst = 0, expect, block_last
    cdef tuple found = None, got
    cdef list values, more
    # The block holding start is the last one keyed at or below (pid, start): seek to the
    # first key above (pid, start) and step back (:func:`dafka.fastio._pure.fetch_blocks`
    # seeks (pid, start) and steps back only when it lands past it: the same blocks).
    _put_be32(p, pid)
    _put_be64(p + 4, start + 1)
    cdef bint landed = start != 0xFFFFFFFFFFFFFFFF and cur.set_range(key)
    cdef bint on_b = cur.prev() if landed else cur.last()
    cdef tuple item
    if on_b:
        item = cur.item()  # one call for key and value
    if on_b and _key_pid(item[0], pid, &kfirst):
        found = _block_values(item[1], start, n, convert)
        if found[1] < start:  # start is in a hole after this block: the next block, if of pid
            if not landed or not cur.next() or not _key_pid(cur.key(), pid, &kfirst):
                return last + 1, []
            found = _block_values(cur.value(), start, n, convert)
    else:  # no block of pid at or below start: the first one after it, if any
        if not landed:
            return last + 1, []
        if not (cur.next() if on_b else cur.set_range(key)) or not _key_pid(cur.key(), pid, &kfirst):
            return last + 1, []
        found = _block_values(cur.value(), start, n, convert)
    values = found[2]
    if found[0] > start:
        start = found[0]  # in a hole, or before the first block
    block_last = found[1]
    expect = start + <uint64_t>len(values)
    while len(values) < n and expect == block_last + 1 and cur.next():
        if not _key_pid(cur.key(), pid, &kfirst) or kfirst != expect:
            break  # another partition, or a hole: the next call starts past it
        try:
            got = _block_values(cur.value(), kfirst, n - len(values), convert)
        except Exception:
            break  # a damaged block (see fetch_blocks): what precedes it goes, the next call raises
        more = got[2]
        if not more:
            break
        block_last = got[1]
        values.extend(more)
        expect += <uint64_t>len(more)
    return (start, values) if values else (last + 1, [])


# ---------------------------------------------------------------- Tank bundles

try:
    # cramjam.snappy is an attribute of the compiled cramjam module, not a module one can
    # import from ("from cramjam.snappy import ..." fails): taken as an attribute, it inflates
    # into a buffer of its own, where python-snappy's uncompress() copies that into bytes again.
    import cramjam as _cramjam
    from cramjam import DecompressionError as _SnappyError
    _snappy_raw = _cramjam.snappy.decompress_raw
    _snappy_raw_into = _cramjam.snappy.decompress_raw_into
except (ImportError, AttributeError):  # python-snappy without cramjam: its own function, its own errors
    from snappy import uncompress as _snappy_raw
    _snappy_raw_into = None
    _SnappyError = Exception

# A bundle is inflated into this buffer, kept from one walk to the next (into a new one of
# ~100 KB a bundle, the walk took half again as long); None while a walk uses it.  Not kept
# past this size.
cdef object _inflate_scratch = bytearray()
cdef enum:
    _SCRATCH_KEPT = 4 << 20

cdef enum:
    _SNAPPY_MAX_RATIO = 24

# What a stored bundle's snappy message set may claim to inflate to when read (tank_values):
# the budget every stored bundle was checked against (the Tank gateway's INFLATE_BUDGET).
# Only 24x the stored body bounded it: a bit-rotten length of a 4 MiB bundle claimed 90 MiB,
# allocated at every read of it (1.5 GiB for a bundle of the 64 MiB request limit).
from dafka.store.block import DEFAULT_BUDGET as _READ_BUDGET


cdef inline uint64_t _le64(const unsigned char *p) noexcept nogil:
    return (<uint64_t>p[0] | <uint64_t>p[1] << 8 | <uint64_t>p[2] << 16 | <uint64_t>p[3] << 24
            | <uint64_t>p[4] << 32 | <uint64_t>p[5] << 40 | <uint64_t>p[6] << 48 | <uint64_t>p[7] << 56)


cdef uint64_t _tank_varint(const unsigned char *buf, Py_ssize_t *pos, Py_ssize_t end) except? 0xFFFFFFFFFFFFFFFF:
    """An unsigned LEB128 varint of at most 5 bytes at ``pos[0]`` (moved past it)."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef Py_ssize_t p = pos[0], stop = pos[0] + 5
    cdef unsigned char b
    while True:
        if p >= end or p >= stop:
            raise ProtocolError("malformed or truncated varint")
        b = buf[p]
        p += 1
        v |= <uint64_t>(b & 0x7F) << shift
        if b < 0x80:
            pos[0] = p
            return v
        shift += 7


def new_bytearray(Py_ssize_t size):
    """See :func:`dafka.fastio._pure.new_bytearray`."""
    if size < 0:
        raise ValueError("new_bytearray: negative size")
    return PyByteArray_FromStringAndSize(NULL, size)  # not zeroed: the caller fills it


def view_start(view):
    """See :func:`dafka.fastio._pure.view_start`."""
    cdef Py_buffer buf
    cdef Py_ssize_t at
    if type(view) is not memoryview:
        return -1
    obj = (<memoryview>view).obj
    if (type(obj) is not bytearray or not (<memoryview>view).c_contiguous or (<memoryview>view).itemsize != 1
            or (<memoryview>view).readonly or not len(view)):
        return -1
    PyObject_GetBuffer(view, &buf, PyBUF_SIMPLE)
    try:
        at = <Py_ssize_t>(<char *>buf.buf - PyByteArray_AS_STRING(obj))
        if at < 0 or at + buf.len > PyByteArray_GET_SIZE(obj):
            return -1
        return at
    finally:
        PyBuffer_Release(&buf)


def tank_scan(bundle, Py_ssize_t max_record_bytes, Py_ssize_t budget, bint contents=False):
    """See :func:`dafka.fastio._pure.tank_scan`."""
    return _tank_walk(bundle, max_record_bytes, budget, 1 if contents else 0, 0, 0)


def tank_values(bundle, Py_ssize_t skip, Py_ssize_t n):
    """See :func:`dafka.fastio._pure.tank_values`."""
    if skip < 0 or n < 0:
        raise ValueError("tank_values: negative skip or count")
    return _tank_walk(bundle, 0x3FFFFFFFFFFFFFFF, _READ_BUDGET, 2, skip, n)[6]


cdef tuple _tank_walk(object bundle, Py_ssize_t max_record_bytes, Py_ssize_t budget, int mode,
                      Py_ssize_t skip, Py_ssize_t limit):
    """The walk of :func:`tank_scan`; ``mode`` 1 also collects each message's content, 2 the
    format-1 stored values of messages ``skip .. skip + limit - 1``."""
    cdef Py_buffer view, inflated
    cdef bint have_inflated = False
    PyObject_GetBuffer(bundle, &view, PyBUF_SIMPLE)
    cdef const unsigned char *buf = <const unsigned char *>view.buf
    cdef Py_ssize_t end = view.len, pos = 1, n, klen
    cdef unsigned char flags, f
    cdef uint64_t count, first = 0, last = 0, gap, size, prev = 0, seq, i, last_i
    cdef uint64_t ts, raw_ts = 0, first_ts = 0, max_ts = 0
    cdef bint sparse, snappy
    cdef list out = [] if mode else None
    cdef bytes v
    cdef unsigned char *w
    cdef Py_ssize_t kpos
    cdef object packed = None
    cdef bint scratch = False
    try:
        if not end:
            raise ProtocolError("empty bundle")
        flags = buf[0]
        if flags & 0x80:
            raise ProtocolError("bundle flags bit 7 (extra flags) is set")
        if (flags & 0x03) > 1:
            raise ProtocolError(f"unknown bundle codec {flags & 0x03}")
        snappy = flags & 0x03
        count = (flags >> 2) & 0x0F
        if not count:
            count = _tank_varint(buf, &pos, end)
            if not count:
                raise ProtocolError("bundle with no messages")
        sparse = (flags & 0x40) != 0
        if sparse:
            if pos + 8 > end:
                raise ProtocolError("truncated sparse bundle header")
            first = _le64(buf + pos)
            pos += 8
            last = first
            if count != 1:
                gap = _tank_varint(buf, &pos, end)
                if gap + 1 > 0xFFFFFFFFFFFFFFFF - first:
                    raise ProtocolError("sparse bundle's seq range cannot hold its messages")
                last = first + gap + 1
            if last - first + 1 < count:
                raise ProtocolError("sparse bundle's seq range cannot hold its messages")
        if snappy:
            n = pos
            size = _tank_varint(buf, &n, end)
            if size > <uint64_t>budget or size > <uint64_t>(_SNAPPY_MAX_RATIO * (end - pos)):
                raise ProtocolError(f"a snappy bundle claims {size} bytes, over the budget of {budget}")
            try:
                if _snappy_raw_into is not None:
                    packed = _take_scratch(size)
                    scratch = True
                    if _snappy_raw_into(memoryview(bundle)[pos:], memoryview(packed)[:size]) != size:
                        raise ProtocolError(f"a snappy bundle inflates to other than the {size} bytes it claims")
                else:
                    packed = _snappy_raw(memoryview(bundle)[pos:])
            except _SnappyError as exc:
                raise ProtocolError(f"snappy decompression failed: {exc}") from exc
            PyObject_GetBuffer(packed, &inflated, PyBUF_SIMPLE)
            if inflated.len > <Py_ssize_t>size:
                inflated.len = size  # the scratch may be longer (never made longer: a short one fails)
            have_inflated = True
            buf = <const unsigned char *>inflated.buf
            pos = 0
            end = inflated.len
        if count * 2 > <uint64_t>(end - pos):
            raise ProtocolError(f"message set too short for {count} messages")
        prev = first - 1
        last_i = count - 1
        for i in range(count):
            if pos >= end:
                raise ProtocolError("truncated message set")
            f = buf[pos]
            pos += 1
            if f > 0x07:
                raise ProtocolError(f"unknown message flags 0x{f:02x}")
            if sparse:
                if f & 0x04:
                    seq = prev + 1
                elif i == 0:
                    seq = first
                elif i == last_i:
                    seq = last
                else:
                    gap = _tank_varint(buf, &pos, end)
                    seq = prev + 1 + gap
                if (i == last_i and seq != last) or (i < last_i and seq >= last) or (i and seq <= prev):
                    raise ProtocolError("sparse message seqs disagree with the bundle header")
                prev = seq
            if f & 0x02:
                if i == 0:
                    raise ProtocolError("the first message of a bundle has no timestamp")
            else:
                if pos + 8 > end:
                    raise ProtocolError("truncated message timestamp")
                ts = raw_ts = _le64(buf + pos)
                if ts > _I64_MAX:
                    ts = _I64_MAX  # Tank timestamps are u64: kept in the bundle, counted as 2^63 - 1
                if i == 0:
                    first_ts = max_ts = ts
                elif ts > max_ts:
                    max_ts = ts
                pos += 8
            klen = 0
            kpos = pos
            if f & 0x01:
                if pos >= end:
                    raise ProtocolError("truncated message key")
                klen = buf[pos]
                pos += 1 + klen
            if pos < end and buf[pos] < 0x80:
                n = buf[pos]
                pos += 1
            else:
                n = <Py_ssize_t>_tank_varint(buf, &pos, end)
            if n + klen > max_record_bytes:
                raise ProtocolError(f"a message of {n + klen} bytes is over max_record_bytes {max_record_bytes}")
            if n > end - pos:
                raise ProtocolError("a message runs past the bundle")
            if mode == 1:
                out.append(PyBytes_FromStringAndSize(<const char *>(buf + pos), n))
            elif mode == 2 and <Py_ssize_t>i >= skip and <Py_ssize_t>i - skip < limit:
                # A format-1 value: ts:u64be flags:u8 (producer timestamp, key) [klen key] content.
                v = PyBytes_FromStringAndSize(NULL, 9 + ((1 + klen) if f & 0x01 else 0) + n)
                w = <unsigned char *>PyBytes_AS_STRING(v)
                _put_be64(w, raw_ts)
                w[8] = 0x02 | (f & 0x01)
                w += 9
                if f & 0x01:
                    memcpy(w, buf + kpos, 1 + klen)
                    w += 1 + klen
                memcpy(w, buf + pos, n)
                out.append(v)
            pos += n
        if pos != end:
            raise ProtocolError(f"{end - pos} trailing bytes after the bundle's messages")
        return (snappy, count, first if sparse else None, last if sparse else None,
                <int64_t>first_ts, <int64_t>max_ts, out)
    finally:
        if have_inflated:
            PyBuffer_Release(&inflated)
        PyBuffer_Release(&view)
        if scratch:
            _give_scratch(packed)


cdef bytearray _take_scratch(uint64_t size):
    """The kept inflate buffer, at least ``size`` bytes (a new one if a walk holds it)."""
    global _inflate_scratch
    got = _inflate_scratch
    _inflate_scratch = None
    if got is None or <uint64_t>len(got) < size:
        got = PyByteArray_FromStringAndSize(NULL, <Py_ssize_t>size)
    return got


cdef void _give_scratch(object buf):
    global _inflate_scratch
    if len(buf) <= _SCRATCH_KEPT:
        _inflate_scratch = buf


# ---------------------------------------------------------------- the store's drain, into blocks

from cpython.mem cimport PyMem_Free, PyMem_Realloc


cdef class _BlockCursor:
    """As :class:`_PairCursor` for :func:`drain_blocks`: the open run's values are gathered in
    C (no object a record) and leave as CODEC_STORE blocks of at most ``block_bytes`` of values."""

    cdef object tracker
    cdef bint fast
    cdef uint64_t next
    cdef uint64_t start
    cdef uint64_t ts  # every value of a drain call has its receive time
    cdef Py_ssize_t block_bytes
    cdef list blocks
    # The open block: its values (ts_ms:u64 flags:u8 = 0, content) one after the other, the
    # end of each within them, its first offset and content bytes.
    cdef unsigned char *buf
    cdef size_t size
    cdef size_t cap
    cdef uint64_t *ends
    cdef Py_ssize_t n
    cdef Py_ssize_t ncap
    cdef uint64_t first
    cdef uint64_t payload

    def __dealloc__(self):
        PyMem_Free(self.buf)
        PyMem_Free(self.ends)

    cdef int load(self, object tracker) except -1:
        self.tracker = tracker
        nxt = tracker.next
        pid = tracker.pid
        self.fast = False
        if (nxt is not None and pid is not None and not tracker.held
                and 0 <= nxt < 0xFFFFFFFFFFFFFFFF and 0 <= pid <= 0xFFFFFFFF):
            self.fast = True
            self.next = self.start = nxt
        return 0

    cdef int add(self, const unsigned char *data, size_t size) except -1:
        """The record at ``next``: its value joins the open block (closed first when it would
        pass ``block_bytes``; a larger value is a block of its own)."""
        cdef size_t vlen = 9 + size
        cdef void *grown
        if self.n and self.size + vlen > <size_t>self.block_bytes:
            self.close()
        if self.n == 0:
            self.first = self.next
        if self.size + vlen > self.cap:
            grown = PyMem_Realloc(self.buf, self.size + vlen if self.size + vlen > 2 * self.cap else 2 * self.cap)
            if grown == NULL:
                raise MemoryError()
            self.cap = self.size + vlen if self.size + vlen > 2 * self.cap else 2 * self.cap
            self.buf = <unsigned char *>grown
        if self.n == self.ncap:
            grown = PyMem_Realloc(self.ends, sizeof(uint64_t) * (2 * self.ncap if self.ncap else 1024))
            if grown == NULL:
                raise MemoryError()
            self.ncap = 2 * self.ncap if self.ncap else 1024
            self.ends = <uint64_t *>grown
        _put_be64(self.buf + self.size, self.ts)
        self.buf[self.size + 8] = 0
        memcpy(self.buf + self.size + 9, data, size)
        self.size += vlen
        self.ends[self.n] = self.size
        self.n += 1
        self.payload += size
        self.next += 1
        return 0

    cdef int close(self) except -1:
        """The open block, as :func:`store_blocks` builds it from the same values, goes out as
        ``(subject, address, block)``."""
        cdef Py_ssize_t n = self.n, k
        if n == 0:
            return 0
        cdef uint64_t body = 8 + 4 * <uint64_t>n + self.size
        if _HEADER_SIZE + body > 0xFFFFFFFF:
            raise ProtocolError(f"a block body of {body} bytes is over 4 GiB")
        cdef bytes block = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(_HEADER_SIZE + body))
        cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(block)
        cdef uint64_t base = _STORE_BASE + 4 * <uint64_t>n
        cdef uint64_t ts = self.ts if self.ts <= _I64_MAX else _I64_MAX
        for k in range(n):
            _put_be32(p + _STORE_BASE + 4 * k, base + self.ends[k])
        memcpy(p + base, self.buf, self.size)
        _seal_store_block(block, self.first, n, body, ts, ts, self.payload)
        self.n = 0
        self.size = 0
        self.payload = 0
        self.blocks.append((self.tracker.subject, self.tracker.address, block))
        return 0

    cdef int flush(self) except -1:
        """The run ends: its last block goes out, ``next`` (and ``known``) back to the tracker."""
        if self.tracker is not None and self.fast and self.next != self.start:
            self.close()
            # (next 0: the run took the last offset, 2**64 - 1, and its u64 wrapped)
            nxt = self.next if self.next else _PAST_LAST
            self.tracker.next = nxt
            last = nxt - 1
            if last > self.tracker.known:
                self.tracker.known = last
            self.start = self.next
        return 0


def drain_blocks(sock, int limit, dict by_prefix, list blocks, ts, on_record, on_message,
                 max_size=None, on_too_large=None, Py_ssize_t block_bytes=65536):
    """See :func:`dafka.fastio._pure.drain_blocks`."""
    cdef void *s = _handle(sock)
    cdef size_t limit_size = _max_size(max_size)
    cdef bint check
    cdef dafka_zmq_msg_t head, body
    cdef int queued = 0
    cdef Py_ssize_t i = 0
    cdef size_t hsize, plen, bsize
    cdef const unsigned char *hdata
    cdef bytes key = None
    cdef object tracker = None
    cdef uint64_t seq
    cdef _BlockCursor cur = _BlockCursor()
    cdef bint batch = False
    cdef Py_ssize_t count, j
    cdef size_t pos, n
    cdef const unsigned char *bdata
    if block_bytes < 1:
        raise ValueError("block_bytes must be positive")
    cur.ts = ts
    cur.block_bytes = block_bytes
    cur.blocks = blocks
    z_msg_init(&head)
    z_msg_init(&body)
    try:
        while i < limit:
            i += 1
            if not _recv(&head, s):
                break
            if not z_msg_more(&head):
                cur.flush()
                key = None
                on_message([_bytes_of(&head)])
                continue
            _recv_part(&body, s)
            if z_msg_more(&body):
                cur.flush()
                key = None
                on_message(_rest(&body, s, [_bytes_of(&head), _bytes_of(&body)]))
                continue
            hsize = z_msg_size(&head)
            hdata = <const unsigned char *>z_msg_data(&head)
            if hsize < 9:
                cur.flush()
                key = None
                on_message([_bytes_of(&head), _bytes_of(&body)])
                continue
            plen = hsize - 8
            if key is None or <size_t>PyBytes_GET_SIZE(key) != plen or memcmp(
                PyBytes_AS_STRING(key), hdata, plen
            ) != 0:
                cur.flush()
                key = PyBytes_FromStringAndSize(<const char *>hdata, plen)
                tracker = by_prefix.get(key)
                if tracker is None:
                    key = None
                    cur.tracker = None
                    on_message([_bytes_of(&head), _bytes_of(&body)])
                    continue
                cur.load(tracker)
                batch = _is_batch(hdata, plen)
            seq = _be64(hdata + plen)
            if batch:
                # Many records in one message (see drain_records).
                bsize = z_msg_size(&body)
                bdata = <const unsigned char *>z_msg_data(&body)
                count = _batch_count(bdata, bsize, seq)
                if count < 0:
                    cur.flush()
                    key = None
                    on_message([_bytes_of(&head), _bytes_of(&body)])
                    continue
                i += count - 1
                check = bsize - 8 > limit_size  # see drain_records
                pos = 4
                for j in range(count):
                    n = <size_t>_be32(bdata + pos)
                    pos += 4
                    if check and n > limit_size:
                        cur.flush()
                        key = None
                        cur.fast = False
                        on_too_large(tracker, seq, n)
                    elif cur.fast and seq == cur.next:
                        cur.add(bdata + pos, n)
                        queued += 1
                        if cur.next == 0:  # the last offset taken: the run ends (see _PAST_LAST)
                            cur.flush()
                            key = None
                            cur.fast = False
                    else:
                        cur.flush()
                        key = None
                        cur.fast = False
                        on_record(tracker, seq, PyBytes_FromStringAndSize(<const char *>(bdata + pos), n))
                    pos += n
                    seq += 1
                continue
            bsize = z_msg_size(&body)
            if bsize > limit_size:
                cur.flush()
                key = None
                on_too_large(tracker, seq, bsize)
            elif cur.fast and seq == cur.next:
                cur.add(<const unsigned char *>z_msg_data(&body), bsize)
                queued += 1
                if cur.next == 0:  # the last offset taken: the run ends (see _PAST_LAST)
                    cur.flush()
                    key = None
                    cur.fast = False
            else:
                cur.flush()
                key = None
                on_record(tracker, seq, _bytes_of(&body))
    finally:
        cur.flush()
        z_msg_close(&head)
        z_msg_close(&body)
    return queued


# ---------------------------------------------------------------- the Tank gateway's produce

from cpython.unicode cimport PyUnicode_DecodeUTF8

from dafka.store.block import CODEC_TANK as _BLOCK_CODEC_TANK
from dafka.store.block import COMPRESSION_SNAPPY as _BLOCK_COMPRESSION_SNAPPY
from dafka.store.block import HEADER_SIZE as _BLOCK_HEADER_SIZE

cdef enum:
    _CODEC_TANK = 2
    _COMPRESSION_SNAPPY = 2

# The block header is written here by hand (_seal_tank, _seal_store_block): a layout changed in
# dafka.store.block and not here makes this module refuse to load (fastio then runs pure).
if (_BLOCK_HEADER_SIZE, _BLOCK_CODEC_TANK, _BLOCK_COMPRESSION_SNAPPY) != (_HEADER_SIZE, _CODEC_TANK, _COMPRESSION_SNAPPY):
    raise ImportError("dafka.fastio._compiled does not match dafka.store.block's block header: rebuild it")


cdef inline object _utf8_or_none(const unsigned char *p, Py_ssize_t n):
    try:
        return PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    except UnicodeDecodeError:
        return None


cdef inline bint _bundle_length(const unsigned char *buf, Py_ssize_t *pos, Py_ssize_t end,
                                uint64_t *out) noexcept:
    """A bundle length as the plain decoder reads it (at most 5 bytes, 32 bits): False when
    it is not one.  (Not _tank_varint in a try: a request took about 1 µs longer so, measured.)"""
    cdef uint64_t v = 0
    cdef int shift = 0, k
    cdef unsigned char b
    for k in range(5):
        if pos[0] >= end:
            return False
        b = buf[pos[0]]
        pos[0] += 1
        v |= <uint64_t>(b & 0x7F) << shift
        if b < 0x80:
            if v > 0xFFFFFFFF:
                return False
            out[0] = v
            return True
        shift += 7
    return False


cdef object _seal_tank(object bundle, tuple scan, uint64_t first, Py_ssize_t start):
    """A Tank block of ``bundle`` (walked: ``scan``) at offset ``first``: a copy behind its
    header, or, ``start`` >= 0, its header written into the bytearray it views, in the
    ``HEADER_SIZE`` bytes before ``start`` where it lies, and a view of the block there (as
    :func:`dafka.store.block.tank_seal` and ``tank_seal_in_place``; the caller checked the
    offsets' and the body's range)."""
    cdef Py_buffer view
    cdef unsigned char head[_HEADER_SIZE]
    cdef uint64_t count = <uint64_t>scan[1]
    cdef uint64_t span = count if scan[2] is None else <uint64_t>(scan[3] - scan[2] + 1)
    cdef Py_ssize_t size
    cdef object block
    cdef unsigned char *p
    head[0] = 68  # b"DB"
    head[1] = 66
    head[2] = 2  # version
    head[3] = _CODEC_TANK
    head[4] = _COMPRESSION_SNAPPY if scan[0] else 0
    head[5] = 0  # flags
    head[6] = 0  # reserved
    head[7] = 0
    _put_be64(head + 8, first)
    _put_be64(head + 16, first + span - 1)
    _put_be32(head + 24, count)
    _put_be64(head + 32, <uint64_t><int64_t>scan[4])
    _put_be64(head + 40, <uint64_t><int64_t>scan[5])
    PyObject_GetBuffer(bundle, &view, PyBUF_SIMPLE)
    try:
        size = view.len
        _put_be32(head + 28, <uint64_t>size)
        _put_be32(head + _CRC_AT, _crc32c(bundle, _crc32c(PyBytes_FromStringAndSize(<const char *>head, _CRC_AT))))
        if start >= 0:
            whole = (<memoryview>bundle).obj
            p = <unsigned char *>PyByteArray_AS_STRING(whole)
            memcpy(p + start - _HEADER_SIZE, head, _HEADER_SIZE)
            return memoryview(whole)[start - _HEADER_SIZE : start + size]
        block = PyBytes_FromStringAndSize(NULL, _HEADER_SIZE + size)
        p = <unsigned char *>PyBytes_AS_STRING(block)
        memcpy(p, head, _HEADER_SIZE)
        memcpy(p + _HEADER_SIZE, view.buf, size)
        return block
    finally:
        PyBuffer_Release(&view)


def tank_produce(payload, bint with_seq, dict topics, dict next_offset, Py_ssize_t max_record_bytes,
                 Py_ssize_t budget, live, Py_ssize_t live_room, list blocks, list publish, str reserved):
    """See :func:`dafka.fastio._pure.tank_produce`."""
    cdef Py_buffer view
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    cdef const unsigned char *buf = <const unsigned char *>view.buf
    cdef Py_ssize_t end = view.len, pos, n, start = -1, i
    cdef unsigned int req_id, topic_count, count, pid, t, j, partitions = 0
    cdef uint64_t size
    cdef list plan = [], parts
    cdef tuple scan, entry
    cdef dict ahead, needs
    cdef bint want
    cdef Py_ssize_t records = 0, live_bytes = 0
    cdef bytes answer
    cdef unsigned char *a
    try:
        if end < 7:
            return None
        req_id = <unsigned int>(buf[2] | buf[3] << 8 | buf[4] << 16 | <unsigned int>buf[5] << 24)
        n = buf[6]
        pos = 7 + n
        if pos + 6 > end or _utf8_or_none(buf + 7, n) is None:  # (the client id, not used)
            return None
        topic_count = buf[pos + 5]
        pos += 6
        for t in range(topic_count):
            if pos >= end:
                return None
            n = buf[pos]
            pos += 1
            if pos + n + 1 > end:
                return None
            name = _utf8_or_none(buf + pos, n)
            pos += n
            if name is None or name == reserved:
                return None
            got_parts = topics.get(name)
            if got_parts is None:
                return None
            parts = got_parts
            count = buf[pos]
            pos += 1
            partitions += count
            for j in range(count):
                if pos + 2 > end:
                    return None
                pid = buf[pos] | buf[pos + 1] << 8
                pos += 2
                if not _bundle_length(buf, &pos, end, &size):
                    return None
                seq = None
                if with_seq:
                    if pos + 8 > end:
                        return None
                    seq = _le64(buf + pos)
                    pos += 8
                if size > <uint64_t>(end - pos):
                    return None
                if pid >= <unsigned int>len(parts):
                    return None
                part = parts[pid]
                if part is None or not part.owned:
                    return None
                bundle = payload[pos : pos + <Py_ssize_t>size]
                pos += <Py_ssize_t>size
                want = live_room > 0 and bool(live(part))
                try:
                    scan = _tank_walk(bundle, max_record_bytes, budget, 1 if want else 0, 0, 0)
                except ProtocolError:
                    return None
                if want:
                    for c in <list>scan[6]:
                        live_room -= PyBytes_GET_SIZE(c)
                plan.append((part, bundle, scan, seq if with_seq else scan[2]))
        if pos != end:
            return None
        # Every seq checked and every offset in range before anything is changed or sealed (a
        # header sealed in place overwrites the request's fields).
        ahead = {}
        for entry in plan:
            part, bundle, scan, first = entry
            key = (part.topic, part.address)
            at = ahead[key] if key in ahead else next_offset.get(key, 0)
            # (dafka.store.block.tank_seqs_continue, written out here)
            if first is not None and (first != at + 1 or (scan[2] is not None and (scan[2] != first or scan[3] != first + scan[1] - 1))):
                return None
            if at < 0 or at + (scan[1] if scan[2] is None else scan[3] - scan[2] + 1) - 1 > 0xFFFFFFFFFFFFFFFF:
                return None
            ahead[key] = at + scan[1]
        if plan:
            bundle = (<tuple>plan[0])[1]
            if type(bundle) is memoryview and 2 * len(bundle) >= len((<memoryview>bundle).obj):
                start = view_start(bundle)
                if start < _HEADER_SIZE:
                    start = -1
        needs = {}
        for i in range(len(plan)):
            part, bundle, scan, first = <tuple>plan[i]
            key = (part.topic, part.address)
            at = next_offset.get(key, 0)
            block = _seal_tank(bundle, scan, <uint64_t>at, start if i == 0 else -1)
            blocks.append((part.topic, part.address, block))
            records += <Py_ssize_t>scan[1]
            if scan[6] is not None:
                publish.append((key, at, scan[6]))
                for c in <list>scan[6]:
                    live_bytes += PyBytes_GET_SIZE(c)
            at = at + scan[1]
            next_offset[key] = at
            needs[key] = at - 1
        answer = PyBytes_FromStringAndSize(NULL, 9 + partitions)
        a = <unsigned char *>PyBytes_AS_STRING(answer)
        a[0] = 1  # the produce response
        a[1] = <unsigned char>((4 + partitions) & 0xFF)
        a[2] = <unsigned char>((4 + partitions) >> 8)
        a[3] = 0
        a[4] = 0
        a[5] = <unsigned char>(req_id & 0xFF)
        a[6] = <unsigned char>((req_id >> 8) & 0xFF)
        a[7] = <unsigned char>((req_id >> 16) & 0xFF)
        a[8] = <unsigned char>(req_id >> 24)
        memset(a + 9, 0, partitions)  # every partition OK
        return needs, answer, records, live_bytes
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- Tank frames from a stream

from collections import deque as _deque

from os import strerror as _strerror
from socket import socket as _plain_socket  # (its descriptor is read directly: no TLS socket)

from cpython.bytearray cimport PyByteArray_Resize
from libc.errno cimport errno

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t c_readv "readv" (int fd, const iovec *iov, int iovcnt)

cdef enum:
    _FRAME_HEADER = 5


cdef class FrameBuffer:
    """See :class:`dafka.tank.codec.FrameBuffer` (same methods, same results)."""

    cdef readonly bytearray _buf  # (tests look)
    cdef object _ready
    cdef Py_ssize_t _ready_bytes, _have, _room
    cdef readonly object _big  # (the frame received in place; tests look)
    cdef object _alloc
    cdef public Py_ssize_t max_frame_size

    def __init__(self, Py_ssize_t max_frame_size=268435456, Py_ssize_t room=0, alloc=bytearray):  # (codec.MAX_FRAME_SIZE)
        if room < 0 or max_frame_size < 0:
            raise ValueError("FrameBuffer: negative room or limit")
        self._buf = bytearray()
        self._ready = _deque()
        self._ready_bytes = 0
        self._big = None
        self._have = 0
        self._room = room
        self._alloc = alloc
        self.max_frame_size = max_frame_size

    cdef inline Py_ssize_t _length_at(self, const unsigned char *p) except -1:
        cdef Py_ssize_t length = <Py_ssize_t>(p[1] | p[2] << 8 | p[3] << 16 | <uint64_t>p[4] << 24)
        if length > self.max_frame_size:
            raise ProtocolError(f"frame of {length} bytes is over the {self.max_frame_size}-byte limit")
        return length

    def feed(self, data):
        cdef Py_buffer view
        cdef Py_ssize_t at, take, n
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            n = view.len
            take = 0
            if self._big is not None:
                at = self._room + self._have
                take = min(n, PyByteArray_GET_SIZE(self._big) - at)
                memcpy(PyByteArray_AS_STRING(self._big) + at, view.buf, take)
                self._have += take
                if at + take < PyByteArray_GET_SIZE(self._big):
                    return
                self._big_done()
                if take == n:
                    return
            self._append(<const char *>view.buf + take, n - take)
        finally:
            PyBuffer_Release(&view)
        self._extract()

    cdef int _append(self, const char *p, Py_ssize_t n) except -1:
        cdef Py_ssize_t old = PyByteArray_GET_SIZE(self._buf)
        if n:
            PyByteArray_Resize(self._buf, old + n)
            memcpy(PyByteArray_AS_STRING(self._buf) + old, p, n)
        return 0

    cdef int _big_done(self) except -1:
        cdef object big = self._big
        cdef Py_ssize_t room = self._room
        self._ready.append(((<unsigned char *>PyByteArray_AS_STRING(big))[room],
                            memoryview(big)[room + _FRAME_HEADER:]))
        self._ready_bytes += PyByteArray_GET_SIZE(big) - room
        self._big = None
        self._have = 0
        return 0

    cdef int _extract(self) except -1:
        """Complete frames of the byte buffer to the ready ones (each payload copied once);
        stops, without raising, at a header over the limit (see dafka.tank.codec.FrameBuffer._extract)."""
        cdef Py_ssize_t size = PyByteArray_GET_SIZE(self._buf), pos = 0, length, stop
        cdef const unsigned char *p = <const unsigned char *>PyByteArray_AS_STRING(self._buf)
        while size - pos >= _FRAME_HEADER:
            length = <Py_ssize_t>(p[pos + 1] | p[pos + 2] << 8 | p[pos + 3] << 16 | <uint64_t>p[pos + 4] << 24)
            stop = pos + _FRAME_HEADER + length
            if length > self.max_frame_size or stop > size:
                break
            self._ready.append((p[pos], PyBytes_FromStringAndSize(<const char *>p + pos + _FRAME_HEADER, length)))
            self._ready_bytes += stop - pos
            pos = stop
        if pos:
            del self._buf[:pos]  # what is left is one partial frame: a short move
        return 0

    @property
    def buffered(self):
        return self._ready_bytes + PyByteArray_GET_SIZE(self._buf) + self._have

    cdef Py_ssize_t _partial(self) except -2:
        if self._big is not None:
            return PyByteArray_GET_SIZE(self._big) - self._room - _FRAME_HEADER
        if PyByteArray_GET_SIZE(self._buf) < _FRAME_HEADER:
            return -1
        return self._length_at(<const unsigned char *>PyByteArray_AS_STRING(self._buf))

    def needed(self):
        cdef Py_ssize_t length
        if self._ready:
            return 0
        if self._big is not None:
            return PyByteArray_GET_SIZE(self._big) - self._room - self._have
        length = self._partial()
        if length < 0:
            return _FRAME_HEADER - PyByteArray_GET_SIZE(self._buf)
        return max(0, _FRAME_HEADER + length - PyByteArray_GET_SIZE(self._buf))

    def pending_length(self):
        cdef Py_ssize_t length = self._partial()
        return length if length > 0 else 0

    def peek_msg_id(self):
        if self._ready:
            return self._ready[0][0]
        if self._big is not None:
            return (<unsigned char *>PyByteArray_AS_STRING(self._big))[self._room]
        if PyByteArray_GET_SIZE(self._buf):
            return (<unsigned char *>PyByteArray_AS_STRING(self._buf))[0]
        return None

    cdef int _begin_big(self, Py_ssize_t length) except -1:
        cdef Py_ssize_t room = self._room, have = PyByteArray_GET_SIZE(self._buf)
        big = self._alloc(room + _FRAME_HEADER + length)
        if type(big) is not bytearray or PyByteArray_GET_SIZE(big) != room + _FRAME_HEADER + length:
            raise TypeError("FrameBuffer: alloc must give a bytearray of the size asked")
        memcpy(PyByteArray_AS_STRING(big) + room, PyByteArray_AS_STRING(self._buf), have)
        self._big = big
        self._have = have
        PyByteArray_Resize(self._buf, 0)
        return 0

    def direct(self, Py_ssize_t min_length):
        cdef Py_ssize_t length
        if self._big is None:
            length = self._partial()
            if length <= min_length:
                return None  # small, or no header yet
            self._begin_big(length)
        return memoryview(self._big)[self._room + self._have:]

    def received(self, Py_ssize_t n):
        if self._big is None or not 0 <= n <= PyByteArray_GET_SIZE(self._big) - self._room - self._have:
            raise ValueError(f"received({n}) without room for it from direct()")
        self._have += n
        if self._room + self._have == PyByteArray_GET_SIZE(self._big):
            self._big_done()

    def next_view(self):
        cdef tuple frame
        if self._ready:
            frame = self._ready.popleft()
            self._ready_bytes -= _FRAME_HEADER + len(frame[1])
            return frame
        if self._big is None and PyByteArray_GET_SIZE(self._buf) >= _FRAME_HEADER:
            self._length_at(<const unsigned char *>PyByteArray_AS_STRING(self._buf))  # raises when oversized
        return None

    def next_frame(self):
        got = self.next_view()
        if got is None:
            return None
        msg_id, payload = got
        return msg_id, payload if type(payload) is bytes else bytes(payload)

    def __iter__(self):
        while (frame := self.next_frame()) is not None:
            yield frame

    def recv(self, sock, bint direct, Py_ssize_t min_length, Py_ssize_t probe, Py_ssize_t size):
        """See :meth:`dafka.tank.codec.FrameBuffer.recv`: the same, by the C library's
        ``readv`` on the socket's descriptor, into the frame's own buffer and the tail of the
        byte buffer (no bytes object in between)."""
        if type(sock) is not _plain_socket:
            raise TypeError(f"FrameBuffer.recv reads a plain socket, not {type(sock).__name__}")
        if sock.gettimeout() != 0.0:  # (readv would block holding the GIL, or not wait the timeout)
            raise ValueError("FrameBuffer.recv reads a non-blocking socket")
        cdef int fd = sock.fileno()
        cdef Py_ssize_t want, old = 0, length, got, rest = 0, first
        cdef ssize_t n
        cdef iovec iov[2]
        cdef int parts = 1
        if direct and self._big is None:
            length = self._partial()
            if length > min_length:
                self._begin_big(length)
        if self._big is not None and not direct:  # (not offered in place: fed, as the pure one does; rare)
            want = size if self._partial() > 0 else probe
            try:
                data = sock.recv(want)
            except (BlockingIOError, InterruptedError):
                return -1, want
            if data:
                self.feed(data)
            return len(data), want
        if self._big is not None:
            # The rest of the frame in place, and the start of the next one behind it (the
            # byte buffer is empty while a frame is received in place).
            rest = PyByteArray_GET_SIZE(self._big) - self._room - self._have
            iov[0].iov_base = PyByteArray_AS_STRING(self._big) + self._room + self._have
            iov[0].iov_len = rest
            want = rest + probe
            old = PyByteArray_GET_SIZE(self._buf)
            PyByteArray_Resize(self._buf, old + probe)
            iov[1].iov_base = PyByteArray_AS_STRING(self._buf) + old
            iov[1].iov_len = probe
            parts = 2
        else:
            want = size if self._partial() > 0 else probe
            old = PyByteArray_GET_SIZE(self._buf)
            PyByteArray_Resize(self._buf, old + want)
            iov[0].iov_base = PyByteArray_AS_STRING(self._buf) + old
            iov[0].iov_len = want
        if fd < 0:
            PyByteArray_Resize(self._buf, old)
            raise OSError(9, "Bad file descriptor")
        n = c_readv(fd, iov, parts)
        if n < 0:
            got = errno
            PyByteArray_Resize(self._buf, old)
            if got == EAGAIN or got == EINTR:  # (EWOULDBLOCK is EAGAIN here)
                return -1, want
            raise OSError(got, _strerror(got))  # (its subclass: ConnectionResetError...)
        if parts == 2:
            first = n if n < rest else rest
            PyByteArray_Resize(self._buf, old + (n - first))
            self._have += first
            if self._room + self._have == PyByteArray_GET_SIZE(self._big):
                self._big_done()
        else:
            PyByteArray_Resize(self._buf, old + n)
        if PyByteArray_GET_SIZE(self._buf) > old:
            self._extract()
        return n, want
