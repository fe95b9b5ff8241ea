# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :mod:`dafka.kafka._pure` (same functions, same results, same errors).

The per-record loops of Kafka record batches v2: decoding what producers
send, encoding what fetches get.  Pure computation on bytes, no I/O; every
read is bounds-checked against the record it belongs to.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy


cdef extern from "Python.h":
    PyObject *PyType_GenericAlloc(PyTypeObject *type, Py_ssize_t nitems)
    void PyObject_GC_UnTrack(void *op)
    bint PyBytes_CheckExact(object o)


from crc32c import crc32c as _crc32c

from dafka.errors import ProtocolError

IMPLEMENTATION = "compiled"
RECORDS_ABI = 3  # dafka.kafka._pure.RECORDS_ABI

cdef int64_t I64_MAX = 0x7FFFFFFFFFFFFFFF
cdef unsigned char FLAG_KEY = 0x01  # dafka.store.layout.FLAG_KEY
cdef unsigned char FLAG_KAFKA = 0x04  # dafka.store.layout.FLAG_KAFKA
cdef unsigned char FLAG_NULL = 0x08  # dafka.store.layout.FLAG_NULL
cdef bytes NO_HEADERS = b"\x00"
cdef bytes EMPTY = b""


# ---------------------------------------------------------------- varints

cdef Py_ssize_t _varint(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end, int64_t *out) except -1:
    """A zigzag varint at ``pos`` into ``out``: the next position; at most 10 bytes, 64 bits."""
    cdef uint64_t v
    cdef unsigned char b
    cdef int shift = 7
    if pos >= end:
        raise ProtocolError("record truncated inside a varint")
    b = buf[pos]
    if b < 0x80:
        out[0] = <int64_t>(b >> 1) ^ -<int64_t>(b & 1)
        return pos + 1
    v = b & 0x7F
    pos += 1
    while True:
        if pos >= end:
            raise ProtocolError("malformed varint in a record")
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise ProtocolError("malformed varint in a record")
        v |= (<uint64_t>(b & 0x7F)) << shift
        if b < 0x80:
            out[0] = <int64_t>(v >> 1) ^ -<int64_t>(v & 1)
            return pos
        shift += 7


cdef inline int _zzsize(int64_t n) noexcept nogil:
    cdef uint64_t v = (<uint64_t>n << 1) ^ <uint64_t>(n >> 63)
    cdef int size = 1
    while v >= 0x80:
        v >>= 7
        size += 1
    return size


cdef inline unsigned char *_putzz(unsigned char *p, int64_t n) noexcept nogil:
    cdef uint64_t v = (<uint64_t>n << 1) ^ <uint64_t>(n >> 63)
    while v >= 0x80:
        p[0] = <unsigned char>((v & 0x7F) | 0x80)
        p += 1
        v >>= 7
    p[0] = <unsigned char>v
    return p + 1


cdef inline unsigned char *_put64(unsigned char *p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(8):
        p[i] = <unsigned char>(v >> (56 - 8 * i))
    return p + 8


cdef inline unsigned char *_put32(unsigned char *p, uint64_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v
    return p + 4


cdef inline unsigned char *_put16(unsigned char *p, uint64_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 8)
    p[1] = <unsigned char>v
    return p + 2


cdef inline int64_t _be64(const unsigned char *p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(8):
        v = (v << 8) | p[i]
    return <int64_t>v


cdef inline int64_t _kafka_ts(const unsigned char *v) noexcept nogil:
    # A stored timestamp as Kafka's: a negative one (a u64 past 2^63 that a
    # Tank client sent) becomes 0, so every delta and base + delta fit int64
    # (a client refuses a batch whose record timestamps overflow).
    cdef int64_t ts = <int64_t>_be64(v)
    return ts if ts >= 0 else 0


# ---------------------------------------------------------------- decode

cdef int _check_headers(const unsigned char *buf, Py_ssize_t p, Py_ssize_t end) except -1:
    cdef int64_t n, klen, vlen, i
    p = _varint(buf, p, end, &n)
    if n < 0:
        raise ProtocolError("negative header count")
    i = 0
    while i < n:
        p = _varint(buf, p, end, &klen)
        if klen < 0 or klen > end - p:
            raise ProtocolError("header key overruns its record")
        p += klen
        p = _varint(buf, p, end, &vlen)
        if vlen > 0:
            if vlen > end - p:
                raise ProtocolError("header value overruns its record")
            p += vlen
        i += 1
    if p != end:
        raise ProtocolError("stray bytes after a record's headers")
    return 0


cdef inline object _new_record(PyTypeObject *rtype, object a, object b, object c, object d):
    """``rtype((a, b, c, d))`` for a tuple subclass without fields of its own (a NamedTuple)."""
    cdef PyObject *obj = PyType_GenericAlloc(rtype, 4)  # what tuple.__new__ does for subclasses
    if obj == NULL:
        raise MemoryError()
    cdef object result = <object>obj  # a second reference: give the allocation's back
    Py_DECREF(result)
    Py_INCREF(a)
    PyTuple_SET_ITEM(result, 0, a)
    Py_INCREF(b)
    PyTuple_SET_ITEM(result, 1, b)
    Py_INCREF(c)
    PyTuple_SET_ITEM(result, 2, c)
    Py_INCREF(d)
    PyTuple_SET_ITEM(result, 3, d)
    # Only ints and bytes inside: the cyclic GC need not scan these records.
    PyObject_GC_UnTrack(<PyObject *>result)
    return result


def decode_records(bytes body, Py_ssize_t start, Py_ssize_t end, Py_ssize_t count,
                   int64_t base_ts, fixed_ts, type rtype):
    """See :func:`dafka.kafka._pure.decode_records`."""
    if not (0 <= start <= end <= PyBytes_GET_SIZE(body)):
        raise ValueError("record range outside the buffer")
    if not issubclass(rtype, tuple):
        raise TypeError("rtype must be a tuple type")
    cdef const unsigned char *buf = <const unsigned char *>PyBytes_AS_STRING(body)
    cdef bint fixed = fixed_ts is not None
    cdef int64_t fts = fixed_ts if fixed else 0
    cdef int64_t rlen, tsd, od, klen, vlen, ts
    cdef int64_t max_slot = 0, slot, kslot
    cdef int64_t min_ts = I64_MAX
    cdef Py_ssize_t nulls = 0
    cdef Py_ssize_t p = start, rend, i
    cdef PyTypeObject *rt = <PyTypeObject *>rtype
    cdef list out = []
    cdef object key, value, headers
    for i in range(count):
        p = _varint(buf, p, end, &rlen)
        if rlen < 6 or rlen > end - p:
            raise ProtocolError("record length overruns its batch")
        rend = p + rlen
        p += 1  # record attributes (unused)
        p = _varint(buf, p, rend, &tsd)
        p = _varint(buf, p, rend, &od)
        p = _varint(buf, p, rend, &klen)
        if klen < 0:
            key = None
            kslot = 1  # the null key's varint
        else:
            if klen > rend - p:
                raise ProtocolError("record key overruns its record")
            key = PyBytes_FromStringAndSize(<const char *>buf + p, klen)
            p += klen
            kslot = _zzsize(klen) + klen
        p = _varint(buf, p, rend, &vlen)
        if vlen < 0:
            value = None
            nulls += 1
        else:
            if vlen > rend - p:
                raise ProtocolError("record value overruns its record")
            value = PyBytes_FromStringAndSize(<const char *>buf + p, vlen)
            p += vlen
        if p == rend or (rend - p == 1 and buf[p] == 0):
            headers = NO_HEADERS
            slot = klen if klen > 0 else 0
        else:
            _check_headers(buf, p, rend)
            headers = PyBytes_FromStringAndSize(<const char *>buf + p, rend - p)
            slot = kslot + (rend - p)
        if slot > max_slot:
            max_slot = slot
        if fixed:
            ts = fts
        else:
            if (tsd > 0 and base_ts > I64_MAX - tsd) or (tsd < 0 and base_ts < -I64_MAX - 1 - tsd):
                raise ProtocolError("record timestamp out of range")
            ts = base_ts + tsd
        if ts < min_ts:
            min_ts = ts
        out.append(_new_record(rt, ts, key, value, headers))
        p = rend
    if p != end:
        raise ProtocolError(f"{end - p} stray bytes after the records of a batch")
    return out, max_slot, min_ts, nulls


# ---------------------------------------------------------------- encode

cdef struct _Parts:
    # A stored value in record form: key part, header part, content (offsets into the value).
    Py_ssize_t kstart, kend  # key part inside the value (kend == kstart: the null key, b"\x01")
    int kprefix  # > 0: write zigzag(kprefix - 1) before the key part (a plain Tank key)
    Py_ssize_t hstart, hend  # header part inside the value (hend == hstart: none, b"\x00")
    Py_ssize_t cstart, size
    bint null  # an empty content flagged FLAG_NULL: a null value


cdef int _parts(const unsigned char *v, Py_ssize_t size, _Parts *out) except -1:
    cdef unsigned char flags
    cdef Py_ssize_t kl, cstart, q
    cdef int64_t klen
    if size < 9:
        raise ValueError("stored value shorter than its header")
    out.size = size
    out.kprefix = 0
    flags = v[8]
    out.null = (flags & FLAG_NULL) != 0
    if not flags & FLAG_KEY:
        out.null = out.null and size == 9
        out.kstart = out.kend = 9
        out.hstart = out.hend = 9
        out.cstart = 9
        return 0
    if size < 10 or 10 + v[9] > size:
        raise ValueError("malformed stored value (its key overruns it)")
    kl = v[9]
    cstart = 10 + kl
    out.cstart = cstart
    out.null = out.null and cstart == size
    if flags & FLAG_KAFKA:
        klen = -2
        q = 0
        try:
            q = _varint(v, 10, cstart, &klen)
        except ProtocolError:
            klen = -2
        if klen == -1 or (klen >= 0 and klen <= cstart - q):
            out.kstart = 10
            out.kend = q + (klen if klen > 0 else 0)
            out.hstart = out.kend
            out.hend = cstart
            return 0
    # A plain key (or a slot that does not parse): zigzag(length) then the slot, whole.
    out.kprefix = kl + 1
    out.kstart = 10
    out.kend = cstart
    out.hstart = out.hend = cstart
    return 0


cdef inline Py_ssize_t _key_size(_Parts *pt) noexcept nogil:
    if pt.kprefix:
        return _zzsize(pt.kprefix - 1) + (pt.kend - pt.kstart)
    if pt.kend == pt.kstart:
        return 1
    return pt.kend - pt.kstart


cdef inline Py_ssize_t _head_size(_Parts *pt) noexcept nogil:
    return 1 if pt.hend == pt.hstart else pt.hend - pt.hstart


def encode_batch(int64_t base_offset, list values, limit=None):
    """See :func:`dafka.kafka._pure.encode_batch`."""
    cdef Py_ssize_t n = PyList_GET_SIZE(values)
    if n == 0:
        return b""
    cdef Py_ssize_t i, body, total = 61, vl
    cdef int64_t base_ts = 0, max_ts = 0, ts, d
    cdef int64_t room = 0, cost = 0
    cdef bint capped = limit is not None
    cdef const unsigned char *v
    cdef object item
    cdef _Parts pt
    if capped:
        room = <int64_t>limit - 61
    for i in range(n):
        item = <object>PyList_GET_ITEM(values, i)
        if not PyBytes_CheckExact(item):
            raise TypeError("stored values must be bytes")
        if capped:
            cost += PyBytes_GET_SIZE(item) + 8
            if cost > room and i > 0:
                n = i  # the records before this one fill the limit
                break
        v = <const unsigned char *>PyBytes_AS_STRING(item)
        _parts(v, PyBytes_GET_SIZE(item), &pt)
        ts = _kafka_ts(v)
        if i == 0:
            base_ts = max_ts = ts
        elif ts > max_ts:
            max_ts = ts
        d = <int64_t>(<uint64_t>ts - <uint64_t>base_ts)
        vl = pt.size - pt.cstart
        body = 1 + _zzsize(d) + _zzsize(i) + _key_size(&pt) + _zzsize(vl) + vl + _head_size(&pt)
        total += _zzsize(body) + body
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef unsigned char *o = <unsigned char *>PyBytes_AS_STRING(out)
    cdef unsigned char *start = o
    o = _put64(o, <uint64_t>base_offset)
    o = _put32(o, <uint64_t>(total - 12))
    o = _put32(o, 0xFFFFFFFF)  # partition leader epoch -1
    o[0] = 2  # magic
    o += 5  # and the CRC, written last
    o = _put16(o, 0)  # attributes
    o = _put32(o, <uint64_t>(n - 1))
    o = _put64(o, <uint64_t>base_ts)
    o = _put64(o, <uint64_t>max_ts)
    o = _put64(o, 0xFFFFFFFFFFFFFFFF)  # producer id -1
    o = _put16(o, 0xFFFF)  # producer epoch -1
    o = _put32(o, 0xFFFFFFFF)  # base sequence -1
    o = _put32(o, <uint64_t>n)
    for i in range(n):
        item = <object>PyList_GET_ITEM(values, i)
        v = <const unsigned char *>PyBytes_AS_STRING(item)
        _parts(v, PyBytes_GET_SIZE(item), &pt)
        d = <int64_t>(<uint64_t>_kafka_ts(v) - <uint64_t>base_ts)
        vl = pt.size - pt.cstart
        body = 1 + _zzsize(d) + _zzsize(i) + _key_size(&pt) + _zzsize(vl) + vl + _head_size(&pt)
        o = _putzz(o, body)
        o[0] = 0  # record attributes
        o = _putzz(o + 1, d)
        o = _putzz(o, i)
        if pt.kprefix:
            o = _putzz(o, pt.kprefix - 1)
            memcpy(o, v + pt.kstart, pt.kend - pt.kstart)
            o += pt.kend - pt.kstart
        elif pt.kend == pt.kstart:
            o[0] = 1  # null key
            o += 1
        else:
            memcpy(o, v + pt.kstart, pt.kend - pt.kstart)
            o += pt.kend - pt.kstart
        o = _putzz(o, -1 if pt.null else vl)  # zigzag(-1) is one byte, as zigzag(0)
        memcpy(o, v + pt.cstart, vl)
        o += vl
        if pt.hend == pt.hstart:
            o[0] = 0  # no headers
            o += 1
        else:
            memcpy(o, v + pt.hstart, pt.hend - pt.hstart)
            o += pt.hend - pt.hstart
    if o - start != total:
        raise AssertionError("record batch size miscounted")
    # The object is ours alone until returned: fill in its CRC-32C (attributes on).
    _put32(start + 17, <uint64_t>_crc32c(memoryview(out)[21:]))
    return out


# ---------------------------------------------------------------- store pairs

cdef unsigned char FLAG_PRODUCER_TS = 0x02  # dafka.store.layout.FLAG_PRODUCER_TS


def store_pairs(list records, uint64_t pid, uint64_t first):
    """See :func:`dafka.kafka._pure.store_pairs`."""
    cdef Py_ssize_t n = PyList_GET_SIZE(records), i, klen, hlen, vlen, slot, size
    cdef list pairs = []
    cdef object rec, ts_obj, key, value, headers
    cdef uint64_t ts, off = first
    cdef int64_t nbytes = 0
    cdef unsigned char flags
    cdef bytes k, v
    cdef unsigned char *o
    cdef bint has_headers, null
    if pid > 0xFFFFFFFF:
        raise ValueError("partition id out of range")
    for i in range(n):
        rec = <object>PyList_GET_ITEM(records, i)
        ts_obj, key, value, headers = rec
        if ts_obj < 0 or ts_obj > 0xFFFFFFFFFFFFFFFF:
            raise ValueError("record field out of range: timestamp")
        ts = ts_obj
        null = value is None
        if null:
            value = EMPTY
        if not PyBytes_CheckExact(value) or not PyBytes_CheckExact(headers):
            raise TypeError("record value and headers must be bytes")
        if key is not None and not PyBytes_CheckExact(key):
            raise TypeError("record key must be bytes or None")
        vlen = PyBytes_GET_SIZE(value)
        hlen = PyBytes_GET_SIZE(headers)
        has_headers = not (hlen == 1 and PyBytes_AS_STRING(headers)[0] == 0)
        klen = -1 if key is None else PyBytes_GET_SIZE(key)
        if has_headers:
            slot = (1 if klen < 0 else _zzsize(klen) + klen) + hlen
            if slot > 255:
                raise ValueError(f"record key and headers of {slot} bytes, at most 255")
            flags = FLAG_KEY | FLAG_PRODUCER_TS | FLAG_KAFKA
        elif klen >= 0:
            slot = klen
            if slot > 255:
                raise ValueError(f"record key of {slot} bytes, at most 255")
            flags = FLAG_KEY | FLAG_PRODUCER_TS
        else:
            slot = -1
            flags = 0
        if null:
            flags |= FLAG_NULL | FLAG_PRODUCER_TS
        size = 9 + (slot + 1 if slot >= 0 else 0) + vlen
        v = PyBytes_FromStringAndSize(NULL, size)
        o = <unsigned char *>PyBytes_AS_STRING(v)
        o = _put64(o, ts)
        o[0] = flags
        o += 1
        if slot >= 0:
            o[0] = <unsigned char>slot
            o += 1
            if has_headers:
                if klen < 0:
                    o[0] = 1
                    o += 1
                else:
                    o = _putzz(o, klen)
                    memcpy(o, PyBytes_AS_STRING(key), klen)
                    o += klen
                memcpy(o, PyBytes_AS_STRING(headers), hlen)
                o += hlen
            else:
                memcpy(o, PyBytes_AS_STRING(key), klen)
                o += klen
            nbytes += slot
        memcpy(o, PyBytes_AS_STRING(value), vlen)
        nbytes += vlen
        k = PyBytes_FromStringAndSize(NULL, 12)
        o = <unsigned char *>PyBytes_AS_STRING(k)
        _put64(_put32(o, pid), off)
        pairs.append((k, v))
        off += 1
    return pairs, nbytes


# ---------------------------------------------------------------- walk (a batch stored as sent)

def walk_records(bytes buf, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t count, int64_t base_ts):
    """See :func:`dafka.kafka._pure.walk_records`."""
    if not (0 <= pos <= end <= PyBytes_GET_SIZE(buf)):
        raise ValueError("record range outside the buffer")
    cdef const unsigned char *b = <const unsigned char *>PyBytes_AS_STRING(buf)
    cdef int64_t rlen, tsd, od, klen, vlen, hcount, hk, hv, ts, j
    cdef int64_t first_ts = base_ts, min_ts = base_ts, max_ts = base_ts, biggest = 0, size
    cdef Py_ssize_t p, rend, hstart, i
    for i in range(count):
        pos = _varint(b, pos, end, &rlen)
        if rlen < 6 or rlen > end - pos:
            raise ProtocolError("a record's length runs outside the batch")
        rend = pos + rlen
        if b[pos]:
            raise ProtocolError(f"record {i} has attributes 0x{b[pos]:02x}")
        p = _varint(b, pos + 1, rend, &tsd)
        p = _varint(b, p, rend, &od)
        if od != i:
            raise ProtocolError(f"record {i} has offset delta {od}")
        if (tsd > 0 and base_ts > I64_MAX - tsd) or (tsd < 0 and base_ts < -I64_MAX - 1 - tsd):
            raise ProtocolError("record timestamp out of range")
        ts = base_ts + tsd
        if i == 0:
            first_ts = ts
            min_ts = ts
            max_ts = ts
        elif ts > max_ts:
            max_ts = ts
        elif ts < min_ts:
            min_ts = ts
        p = _varint(b, p, rend, &klen)
        if klen < -1 or klen > rend - p:
            raise ProtocolError("a record's key runs outside it")
        if klen > 0:
            p += klen
        p = _varint(b, p, rend, &vlen)
        if vlen < -1 or vlen > rend - p:
            raise ProtocolError("a record's value runs outside it")
        if vlen > 0:
            p += vlen
        hstart = p
        p = _varint(b, p, rend, &hcount)
        if hcount < 0 or hcount > (rend - p) // 2:
            raise ProtocolError("a record's header count is out of range")
        j = 0
        while j < hcount:
            p = _varint(b, p, rend, &hk)
            if hk < 0 or hk > rend - p:
                raise ProtocolError("a header key runs outside its record")
            p += hk
            p = _varint(b, p, rend, &hv)
            if hv < -1 or hv > rend - p:
                raise ProtocolError("a header value runs outside its record")
            if hv > 0:
                p += hv
            j += 1
        if p != rend:
            raise ProtocolError("a record's fields disagree with its length")
        size = (klen if klen > 0 else 0) + (vlen if vlen > 0 else 0) + (rend - hstart - 1)
        if size > biggest:
            biggest = size
        pos = rend
    return first_ts, min_ts, max_ts, biggest, pos
