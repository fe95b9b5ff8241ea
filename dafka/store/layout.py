"""Byte layout of the store's LMDB keys and values (format version 2).

Pure functions and precompiled :class:`struct.Struct` objects, no LMDB.
The layout itself is documented in :mod:`dafka.store.db`; in short::

    meta        b"format"              -> version:u32
    partitions  tlen:u8 topic plen:u8 partition
                                       -> pid:u32 first:u64 last:u64 count:u64 bytes:u64
    pids        pid:u32                -> the partition key above
    blocks      pid:u32 first:u64      -> a block (dafka.store.block), CODEC_STORE blocks
                                          holding format-1 values:
                                          ts_ms:u64 flags:u8 [klen:u8 key] content
    positions   glen:u8 group tlen:u8 topic plen:u8 partition
                                       -> offset:u64 (optional; created by the first commit)

All integers are big-endian so that LMDB's bytewise key order is numeric order.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

FORMAT_VERSION = 2
#: The format before blocks (one LMDB entry per record); converted on a writable open.
FORMAT_1 = 1

#: Value flag: a Tank message key follows the flags byte.
FLAG_KEY = 0x01
#: Value flag: ``ts_ms`` was supplied by the producer (Tank), not stamped by the store.
FLAG_PRODUCER_TS = 0x02
#: Value flag (with FLAG_KEY): the key slot holds a Kafka record's key and headers
#: as the record carries them (``zigzag(keyLength) key headerCount headers...``).
#: Readers that know only FLAG_KEY skip the slot and still get the content.
FLAG_KAFKA = 0x04
#: Value flag: the content (empty) is a Kafka null value, a tombstone, not an empty one.
#: Readers that do not know it see an empty content.  Only the gateway that took the record
#: keeps it: the mesh carries contents alone.
FLAG_NULL = 0x08
#: Value flag (with FLAG_KEY, the content empty): a Kafka transaction's control record (a
#: commit or abort marker); the key slot holds ``producer_id:i64 epoch:i16 type:u8`` (0 abort,
#: 1 commit).  Only the gateway that wrote it keeps it: the mesh carries an empty content.
FLAG_CONTROL = 0x10

MAX_NAME = 255  # topic, partition and key lengths are one byte
# LMDB's key size limit (MDB_MAXKEYSIZE, 511): with both names at 255 bytes a
# partition key would be 512 bytes, so topic + partition may total 509 bytes.
MAX_PARTITION_KEY = 511
MAX_U64 = (1 << 64) - 1
#: The highest offset a partition may reach: its next offset (a Kafka high watermark) still
#: fits a signed 64-bit integer.  Offsets past it from the mesh are refused where they arrive.
MAX_OFFSET = (1 << 63) - 2

VALUE_HEADER_SIZE = 9  # ts_ms:u64 + flags:u8
RECORD_KEY_SIZE = 12  # pid:u32 + offset:u64

U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
RECORD_KEY = struct.Struct(">IQ")
VALUE_HEADER = struct.Struct(">QB")
PARTITION_INFO = struct.Struct(">IQQQQ")

META_FORMAT = b"format"
#: Present while a format-1 database is being converted (dafka.store.upgrade).
META_CONVERTING = b"converting"


class PartitionInfo(NamedTuple):
    """What the store knows about one partition.

    ``last`` is the head: the highest offset ever stored, kept even after
    retention removed every record.  ``first`` is the oldest offset still
    stored; ``first == last + 1`` (and ``count == 0``) when none is left.
    ``bytes`` is the payload total (content plus Tank key) of the stored records.
    """

    topic: str
    partition: str
    pid: int
    first: int
    last: int
    count: int
    bytes: int


def encode_name(name: str, what: str) -> bytes:
    """UTF-8 encode a topic or partition name, checking the one-byte length limit."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be str, not {type(name).__name__}")
    raw = name.encode("utf-8")
    if len(raw) > MAX_NAME:
        raise ValueError(f"{what} is {len(raw)} bytes long, at most {MAX_NAME} allowed")
    return raw


def pack_partition_key(topic: str, partition: str) -> bytes:
    """``tlen:u8 topic plen:u8 partition``; topics must not contain NUL.

    Each name is at most 255 bytes of UTF-8 and both together at most 509.
    """
    t = encode_name(topic, "topic")
    if b"\x00" in t:
        raise ValueError("topic must not contain NUL")
    p = encode_name(partition, "partition")
    if len(t) + len(p) + 2 > MAX_PARTITION_KEY:
        raise ValueError(
            f"topic and partition total {len(t) + len(p)} bytes, "
            f"at most {MAX_PARTITION_KEY - 2} allowed (LMDB key size)"
        )
    return bytes((len(t),)) + t + bytes((len(p),)) + p


def unpack_partition_key(key: bytes) -> tuple[str, str]:
    """Inverse of :func:`pack_partition_key`; raises ValueError on malformed keys."""
    if len(key) < 2 or len(key) < key[0] + 2:
        raise ValueError(f"malformed partition key {key!r}")
    tlen = key[0]
    t_end = 1 + tlen
    plen = key[t_end]
    if len(key) != t_end + 1 + plen or b"\x00" in key[1:t_end]:
        # (No NUL in a topic, as pack_partition_key refuses: a key it could not have made.)
        raise ValueError(f"malformed partition key {key!r}")
    return key[1:t_end].decode("utf-8"), key[t_end + 1 :].decode("utf-8")


def topic_prefix(topic: str) -> bytes:
    """The common prefix of every partition key of ``topic``."""
    t = encode_name(topic, "topic")
    return bytes((len(t),)) + t


def pack_position_key(group: str, topic: str, partition: str) -> bytes:
    """``glen:u8 group`` then the partition key: one group's positions are one key range."""
    g = encode_name(group, "group")
    key = bytes((len(g),)) + g + pack_partition_key(topic, partition)
    if len(key) > MAX_PARTITION_KEY:
        raise ValueError(f"group, topic and partition total {len(key)} bytes, at most {MAX_PARTITION_KEY}")
    return key


def group_prefix(group: str) -> bytes:
    """The common prefix of every position key of ``group``."""
    g = encode_name(group, "group")
    return bytes((len(g),)) + g


def pack_record_key(pid: int, offset: int) -> bytes:
    """``pid:u32 offset:u64``, 12 bytes."""
    return RECORD_KEY.pack(pid, offset)


def unpack_record_key(key: bytes) -> tuple[int, int]:
    """Inverse of :func:`pack_record_key`: ``(pid, offset)``."""
    pid, offset = RECORD_KEY.unpack(key)
    return pid, offset


def pack_value(
    ts_ms: int, content: bytes, key: bytes | None = None, ts_from_producer: bool = False
) -> bytes:
    """``ts_ms:u64 flags:u8 [klen:u8 key] content``."""
    flags = FLAG_PRODUCER_TS if ts_from_producer else 0
    if key is None:
        return VALUE_HEADER.pack(ts_ms, flags) + content
    if len(key) > MAX_NAME:
        raise ValueError(f"record key is {len(key)} bytes long, at most {MAX_NAME} allowed")
    return VALUE_HEADER.pack(ts_ms, flags | FLAG_KEY) + bytes((len(key),)) + key + content


def unpack_value(value: bytes) -> tuple[int, int, bytes | None, bytes]:
    """Inverse of :func:`pack_value`: ``(ts_ms, flags, key or None, content)``."""
    ts_ms, flags = VALUE_HEADER.unpack_from(value)
    if flags & FLAG_KEY:
        klen = value[9]
        return ts_ms, flags, bytes(value[10 : 10 + klen]), bytes(value[10 + klen :])
    return ts_ms, flags, None, bytes(value[9:])


def without_kafka_extras(value: bytes) -> bytes:
    """A stored value whose key slot holds a Kafka key and headers (FLAG_KAFKA) as one
    that holds the key alone, or no key for a null one: what a reader of keys sees.
    A Kafka transaction marker (FLAG_CONTROL) comes back as an empty record with no key.

    Other values come back unchanged; a slot that does not parse stays the key.
    """
    flags = value[8] if len(value) > 9 else 0
    if flags & FLAG_CONTROL and flags & FLAG_KEY:  # a transaction marker: no key, an empty content
        return value[:8] + bytes((flags & ~(FLAG_KEY | FLAG_CONTROL),)) + value[min(10 + value[9], len(value)):]
    if not flags & FLAG_KAFKA or not flags & FLAG_KEY:
        return value
    end = min(10 + value[9], len(value))
    # zigzag(keyLength) as a varint, then the key (then the headers, dropped here).
    zz = shift = 0
    p = 10
    while p < end and shift <= 63:
        b = value[p]
        zz |= (b & 0x7F) << shift
        p += 1
        if b < 0x80:
            klen = (zz >> 1) ^ -(zz & 1)
            if klen < 0:
                return value[:8] + bytes((flags & ~(FLAG_KAFKA | FLAG_KEY),)) + value[end:]
            if p + klen <= end:
                return value[:8] + bytes((flags & ~FLAG_KAFKA, klen)) + value[p : p + klen] + value[end:]
            break
        shift += 7
    return value[:8] + bytes((flags & ~FLAG_KAFKA,)) + value[9:]


def value_content(value: bytes) -> bytes:
    """Only the content of a stored value (what a plain Dafka consumer gets); ValueError if too short."""
    size = len(value)
    if size < VALUE_HEADER_SIZE:
        raise ValueError("stored value too short")
    if value[8] & FLAG_KEY:
        if size < VALUE_HEADER_SIZE + 1 or VALUE_HEADER_SIZE + 1 + value[9] > size:
            raise ValueError("stored value too short for its key")
        return value[10 + value[9] :]
    return value[9:]


def value_payload_size(value: bytes) -> int:
    """Bytes a stored value adds to a partition's ``bytes`` total (content + key)."""
    if value[8] & FLAG_KEY:
        return len(value) - 10
    return len(value) - 9


def pack_info(pid: int, first: int, last: int, count: int, nbytes: int) -> bytes:
    """Value of the ``partitions`` table."""
    return PARTITION_INFO.pack(pid, first, last, count, nbytes)


def unpack_info(value: bytes) -> tuple[int, int, int, int, int]:
    """Inverse of :func:`pack_info`: ``(pid, first, last, count, bytes)``."""
    pid, first, last, count, nbytes = PARTITION_INFO.unpack(value)
    return pid, first, last, count, nbytes
