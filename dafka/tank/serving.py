"""Pure pieces of the gateway's answers: where a consume starts, stored records as a bundle.

No sockets, no clocks, no database handles: the gateway passes bounds and
stored values in and sends what comes out.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import snappy

from dafka.store.layout import FLAG_CONTROL, FLAG_KAFKA, FLAG_KEY, without_kafka_extras
from dafka.tank.bundle import BUNDLE_COUNT_SHIFT, CODEC_SNAPPY, MAX_INLINE_COUNT
from dafka.tank.codec import UINT64_MAX, encode_varint

#: Snappy is tried on message sets at least this large ...
COMPRESS_MIN = 4096
#: ... and kept only when it saves at least a quarter.
COMPRESS_KEEP = 0.75
#: Bytes compressed first to find out (records of one partition look alike).
COMPRESS_PROBE = 32 << 10

_KAFKA_SLOT = FLAG_KAFKA | FLAG_CONTROL  # stored values whose key slot Tank readers do not see as is

_BYTE = tuple(bytes((i,)) for i in range(256))
_TS_BE = struct.Struct(">Q").unpack_from
_FLAGS_TS = struct.Struct("<BQ").pack
_SAME_TS = 0x02
_HAS_KEY = 0x01
_SAME_TS_SHORT = tuple(bytes((_SAME_TS, n)) for n in range(128))
_NO_HEADER = bytes(8) + b"\xff"  # no stored value starts with this (flags are 0..3)


class Bounds(NamedTuple):
    """A partition in Tank sequence numbers (seq = Dafka offset + 1)."""

    first_avail: int  # first stored seq (hwm + 1 when nothing is stored)
    hwm: int  # last stored seq (0: never anything)

    @classmethod
    def of(cls, first_offset: int | None, last_offset: int | None) -> Bounds:
        """From Dafka offsets as the store has them (None: nothing ever stored)."""
        if last_offset is None:
            return cls(1, 0)
        first = last_offset + 1 if first_offset is None else first_offset
        return cls(first + 1, last_offset + 1)

    def discover(self) -> tuple[int, int]:
        """What DiscoverPartitions reports: 0/0 for a partition that is empty."""
        if self.first_avail > self.hwm:
            return (0, 0) if self.hwm == 0 else (self.hwm + 1, self.hwm)
        return self.first_avail, self.hwm


class Start(NamedTuple):
    """Where a consume of one partition begins.

    kind "data": records from ``seq`` are there; "tail": nothing yet (the
    request may park); "boundary": ``seq`` is outside the partition, the
    answer carries first_avail and the client moves there.
    """

    kind: str
    seq: int


def consume_start(requested: int, bounds: Bounds) -> Start:
    """Tank's rules: 0 is the first available, UINT64_MAX the tail (hwm + 1)."""
    first, hwm = bounds
    if requested == 0:
        seq = first
    elif requested == UINT64_MAX:
        seq = hwm + 1
    else:
        seq = requested
        if seq < first or seq > hwm + 1:
            return Start("boundary", seq)  # below: removed by retention
    return Start("data" if seq <= hwm else "tail", seq)


def stored_bundle(values: list[bytes], compress: bool = True) -> bytes:
    """One Tank bundle of stored record values (``ts:u64be flags:u8 [klen key] content``).

    Keys and producer timestamps kept beside a record come back as they went
    in; records from Dafka producers carry the store's receive time.
    """
    parts: list[bytes] = []
    app = parts.append
    byte = _BYTE
    same_short = _SAME_TS_SHORT
    ts_of = _TS_BE
    flags_ts = _FLAGS_TS
    last_ts = b""
    # Stored header (ts, flags) of a keyless record at the last timestamp.  It
    # starts as one no stored value has (flags 0xff are never stored), so the
    # first message always gets its timestamp, whatever its bytes.
    plain = _NO_HEADER
    for v in values:
        if v.startswith(plain):
            # The common case: no key, same timestamp as the previous message.
            n = len(v) - 9
            app(same_short[n] if n < 128 else byte[_SAME_TS] + encode_varint(n))
            app(v[9:])
            continue
        if v[8] & _KAFKA_SLOT:
            # A Kafka record: Tank sees its key, not its headers; a transaction marker: nothing.
            v = without_kafka_extras(v)
        ts = v[:8]
        if v[8] & FLAG_KEY:
            kl = v[9]
            content = v[10 + kl :]
            if ts == last_ts:
                app(byte[_SAME_TS | _HAS_KEY])
            else:
                last_ts, plain = ts, ts + b"\0"
                app(flags_ts(_HAS_KEY, ts_of(ts)[0]))
            app(v[9 : 10 + kl])
        else:
            content = v[9:]
            last_ts, plain = ts, v[:9]  # flags 0 or 2 (Tank timestamp): both keyless
            app(flags_ts(0, ts_of(ts)[0]))
        n = len(content)
        app(byte[n] if n < 128 else encode_varint(n))
        app(content)
    count = len(values)
    codec = 0
    msgset = b"".join(parts)
    if compress and len(msgset) >= COMPRESS_MIN and _compresses(msgset[:COMPRESS_PROBE]):
        packed = snappy.compress(msgset)
        if len(packed) < len(msgset) * COMPRESS_KEEP:
            codec, msgset = CODEC_SNAPPY, packed
    if count <= MAX_INLINE_COUNT:
        head = byte[codec | count << BUNDLE_COUNT_SHIFT]
    else:
        head = byte[codec] + encode_varint(count)
    return head + msgset


def _compresses(sample: bytes) -> bool:
    """Whether snappy pays, judged on a sample: incompressible data costs only the probe."""
    return len(snappy.compress(sample)) < len(sample) * COMPRESS_KEEP


def chunk_of(bundle: bytes) -> bytes:
    """A consume chunk holding one bundle (an answer built from stored values).

    Stored Tank bundles are sent several to a chunk, whole, as the broker sends
    its log (:meth:`dafka.tank.gateway.Gateway._consume_partition`); the C++ and
    Java clients' parsing of such chunks is checked in
    ``tests/tank/test_client_compat.py`` (the Java client stops its walk of a
    chunk after a snappy bundle and asks again from there: nothing is lost).
    """
    return encode_varint(len(bundle)) + bundle
