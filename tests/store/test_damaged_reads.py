"""A damaged stored block (bit rot, a bug of an older version: blocks are checked when they
are written, not when read) costs its partition's answer, nothing more.

Each case plants a healthy block, a damaged one and a healthy one in a partition of a real
LMDB store, and a healthy block in another partition; then asks for them over the mesh (a
FETCH, real ZeroMQ sockets).
"""

from __future__ import annotations

import gzip
import logging
import struct
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest
import zmq
from crc32c import crc32c

from dafka.config import NodeConfig
from dafka.core import leafwire, wire
from dafka.kafka._codec import encode_batch
from dafka.nodes.leafread import LeafConsumer
from dafka.store.block import (
    CODEC_TANK,
    COMPRESSION_GZIP,
    COMPRESSION_SNAPPY,
    HEADER_SIZE,
    _seal,
    block_key,
    decode_header,
    kafka_block,
    store_block,
)
from dafka.store.db import RecordDB
from dafka.store.layout import VALUE_HEADER
from dafka.store.node import Store
from dafka.tank.bundle import CODEC_SNAPPY, encode_bundle

pytestmark = pytest.mark.timeout(120)

TS = 1_700_000_000_000
DAMAGED = "D" * 32
HEALTHY = "H" * 32


def value(content: bytes) -> bytes:
    return VALUE_HEADER.pack(TS, 0) + content


def healthy(first: int, contents: list[bytes]) -> bytes:
    return store_block(first, [value(c) for c in contents], sum(map(len, contents)))


def _reseal(block: bytes, body: bytes) -> bytes:
    """``block`` with another body, its header's fields kept and its CRC right (so that
    only decoding the records finds the damage)."""
    h = decode_header(block)
    return _seal(h.codec, h.compression, h.first_offset, h.last_offset, h.record_count, h.first_ts, h.max_ts, body)


def _kafka_batch(first: int, contents: list[bytes], gzipped: bool = False) -> bytes:
    batch = encode_batch(first, [value(c) for c in contents])
    if gzipped:
        records = gzip.compress(batch[61:])
        head = bytearray(batch[:61])
        struct.pack_into(">i", head, 8, 49 + len(records))
        struct.pack_into(">h", head, 21, struct.unpack_from(">h", head, 21)[0] | COMPRESSION_GZIP)
        rest = bytes(head[21:]) + records
        batch = bytes(head[:17]) + struct.pack(">I", crc32c(rest)) + rest
    return batch


def damaged(kind: str, first: int) -> bytes:
    """A block of 3 records at ``first`` that passes a header check and cannot be read."""
    if kind == "count-varint":  # a Tank bundle whose count varint runs over 5 bytes
        return _seal(CODEC_TANK, 0, first, first + 2, 3, TS, TS, b"\x00" + b"\x80" * 13)
    if kind == "truncated-bundle":
        bundle = encode_bundle([(None, TS, None, b"m%d" % i * 20) for i in range(3)], codec=0)
        return _seal(CODEC_TANK, 0, first, first + 2, 3, TS, TS, bundle[:-15])
    if kind == "snappy-payload":
        bundle = encode_bundle([(None, TS, None, b"s%d" % i * 400) for i in range(3)], codec=CODEC_SNAPPY)
        bad = bytearray(bundle)
        for i in range(len(bad) // 2, len(bad)):
            bad[i] ^= 0x5A
        return _seal(CODEC_TANK, COMPRESSION_SNAPPY, first, first + 2, 3, TS, TS, bytes(bad))
    if kind == "kafka-records":  # a Kafka batch whose records do not decode
        block = kafka_block(_kafka_batch(first, [b"k0", b"k1", b"k2"]), first)
        body = bytearray(block[HEADER_SIZE:])
        body[61:] = b"\xff" * (len(body) - 61)
        return _reseal(block, bytes(body))
    if kind == "kafka-gzip":  # a gzipped Kafka batch, its compressed bytes altered
        block = kafka_block(_kafka_batch(first, [b"g0" * 50, b"g1" * 50, b"g2" * 50], gzipped=True), first)
        body = bytearray(block[HEADER_SIZE:])
        for i in range(75, len(body) - 8):
            body[i] ^= 0x33
        return _reseal(block, bytes(body))
    if kind == "store-ends":  # a store block whose ends table goes backwards
        block = bytearray(healthy(first, [b"e0", b"e1", b"e2"]))
        base = HEADER_SIZE + 8
        struct.pack_into(">I", block, base + 4, struct.unpack_from(">I", block, base + 4)[0] + 100)
        return _reseal(bytes(block), bytes(block[HEADER_SIZE:]))
    if kind == "store-short":  # a store block whose records are shorter than a value's header
        block = bytearray(healthy(first, [b"e0", b"e1", b"e2"]))
        base = HEADER_SIZE + 8
        lo = base + 12
        struct.pack_into(">III", block, base, lo + 3, lo + 6, len(block))
        return _reseal(bytes(block), bytes(block[HEADER_SIZE:]))
    if kind == "store-crossed":  # a store block whose first two ends are swapped: each inside the block
        block = bytearray(healthy(first, [b"c0" * 8, b"c1" * 8, b"c2" * 8]))
        base = HEADER_SIZE + 8
        e0, e1 = struct.unpack_from(">II", block, base)
        struct.pack_into(">II", block, base, e1, e0)
        return _reseal(bytes(block), bytes(block[HEADER_SIZE:]))
    if kind == "store-count":  # a store block of 4 values whose header says 3: its table is read short
        block = healthy(first, [b"n0" * 8, b"n1" * 8, b"n2" * 8, b"n3" * 8])
        h = decode_header(block)
        return _seal(h.codec, h.compression, first, first + 2, 3, h.first_ts, h.max_ts, block[HEADER_SIZE:])
    if kind == "header":  # planted sound, then altered (see plant): append_blocks checks headers
        return healthy(first, [b"h0", b"h1", b"h2"])
    raise AssertionError(kind)


KINDS = ["count-varint", "truncated-bundle", "snappy-payload", "kafka-records", "kafka-gzip", "store-ends", "header",
         "store-short", "store-crossed", "store-count"]


def plant(path: Path, kind: str, topic: str = "t", partitions: tuple[str, str] = (DAMAGED, HEALTHY)) -> None:
    """Partition DAMAGED: offsets 0-1 healthy, 2-4 damaged, 5-6 healthy; HEALTHY: 0-2."""
    bad, good = partitions
    with RecordDB(path, sync=False) as db:
        db.append_blocks([
            (topic, bad, healthy(0, [b"a0", b"a1"])),
            (topic, bad, damaged(kind, 2)),
            (topic, bad, healthy(5, [b"a5", b"a6"])),
            (topic, good, healthy(0, [b"b0", b"b1", b"b2"])),
        ])
        assert db.head(topic, bad) == 6 and db.head(topic, good) == 2
        if kind == "header":  # its header too: not a block (its magic bit-rotten)
            pid = db.info(topic, bad).pid
            db._write(lambda txn: txn.put(block_key(pid, 2), b"XB" + damaged("store-ends", 2)[2:],
                                          db=db._dbs.blocks))


def got(peer: Any, partition: str) -> list[tuple[int, bytes]]:
    return [(m.sequence, m.content) for m in peer.messages(wire.DirectRecord) if m.address == partition]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_block_costs_its_fetch_answer_only(cfg: NodeConfig, tmp_path: Path, raw_peer: Any,
                                                    caplog: pytest.LogCaptureFixture, kind: str) -> None:
    """A FETCH reaching the damaged block: the node lives, the other partition, the records
    before the damage and those past it are served, the error is logged (not once a FETCH).

    Before: the damage raised out of the store's loop, its answer in progress was left
    unserved but not forgotten, and every later FETCH of the partition by that reader joined
    it: none was answered again.  The records before the damage, read in the same slice,
    never went (but when the damage raised as they were sent)."""
    plant(tmp_path / "db", kind)
    caplog.set_level(logging.ERROR)
    with Store(tmp_path / "db", cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 0, 10))
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 10))
        peer.wait_for(lambda q: len(got(q, HEALTHY)) >= 3)
        assert got(peer, HEALTHY) == [(0, b"b0"), (1, b"b1"), (2, b"b2")]
        # The records before the damage go (they were read with it, in one slice).
        peer.wait_for(lambda q: (0, b"a0") in got(q, DAMAGED) and (1, b"a1") in got(q, DAMAGED))
        def sixes(q: Any) -> int:
            return sum(off == 6 for off, _ in got(q, DAMAGED))

        # From the damage on (the answer stopped before it, as at a hole: a reader asks on
        # from there): a VOID for the damaged offsets (this store has none of them: a reader
        # asks another, or passes them), and the records past them in the same answer.  A
        # block whose header is damaged too ("header") is passed by its key: where it ends is
        # not known, so the VOID covers up to just before the next block.  Before, that
        # answer ended at it with no VOID.
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))
        peer.wait_for(lambda q: (5, b"a5") in got(q, DAMAGED) and (6, b"a6") in got(q, DAMAGED))
        voids = [(v.first, v.last, v.kind) for v in peer.messages(wire.Void) if v.address == DAMAGED]
        assert (2, 4, wire.VOID_STORE) in voids
        n = sixes(peer)
        for _ in range(30):  # a reader asking for the damaged records again and again
            peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 1, 1))
        peer.wait_for(lambda q: sixes(q) > n and store.unreadable_reads >= 2 and (1, b"b1") in got(q, HEALTHY))
        if kind == "header":  # from inside it too (the read steps back onto its header)
            peer.send(wire.Fetch(DAMAGED, peer.address, "t", 3, 3))
            peer.wait_for(lambda q: any(v.address == DAMAGED and (v.first, v.last) == (3, 4)
                                        for v in q.messages(wire.Void)))
        # Past the damage: answered (a FETCH of the same requester and partition).
        n = sixes(peer)
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 5, 2))
        peer.wait_for(lambda q: sixes(q) > n)
        assert not any(off in (2, 3, 4) for off, _ in got(peer, DAMAGED))
        assert store.running
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors, "the damaged block is not logged"
        assert len(errors) <= 10, [r.getMessage() for r in errors]
        assert not [r for r in errors if r.getMessage().startswith("store failed")]  # (the loop's catch-alls)


def test_a_last_block_whose_header_is_damaged_is_voided_up_to_the_head(cfg: NodeConfig, tmp_path: Path,
                                                                        raw_peer: Any) -> None:
    """The partition's last block, its header damaged: no next block to go on at.  The VOID
    covers from the offset asked for up to the head the store has stored (those offsets lie in
    that block), never past it (this store may yet receive those: a producer goes on), and the
    answer ends.  Before, it ended with no VOID."""
    path = tmp_path / "db"
    with RecordDB(path, sync=False) as db:
        db.append_blocks([("t", DAMAGED, healthy(0, [b"a0", b"a1"])), ("t", DAMAGED, damaged("header", 2)),
                          ("t", HEALTHY, healthy(0, [b"b0"]))])
        pid = db.info("t", DAMAGED).pid
        db._write(lambda txn: txn.put(block_key(pid, 2), b"XB" + damaged("store-ends", 2)[2:], db=db._dbs.blocks))
        assert db.head("t", DAMAGED) == 4
        assert db.past_block("t", DAMAGED, 2) == db.past_block("t", DAMAGED, 3) == 5
        assert db.past_block("t", DAMAGED, 0) is None and db.past_block("t", "nobody", 0) is None  # (0-1 read)
    with Store(path, cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 0, 10))
        peer.wait_for(lambda q: got(q, DAMAGED) == [(0, b"a0"), (1, b"a1")])
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))
        peer.wait_for(lambda q: any(v.address == DAMAGED for v in q.messages(wire.Void)))
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 1))  # answered after it: the answer ended
        peer.wait_for(lambda q: got(q, HEALTHY) == [(0, b"b0")])
        assert [(v.first, v.last, v.kind) for v in peer.messages(wire.Void)
                if v.address == DAMAGED] == [(2, 4, wire.VOID_STORE)]
        assert got(peer, DAMAGED) == [(0, b"a0"), (1, b"a1")]
        assert store.running and not store._jobs


def test_a_read_failing_otherwise_ends_its_answer_without_a_void(cfg: NodeConfig, tmp_path: Path, raw_peer: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails other than by decoding (an LMDB error) says nothing of the records:
    they may be sound.  Its answer ends (a reader asks again), and the next is served."""
    plant(tmp_path / "db", "store-ends")
    with Store(tmp_path / "db", cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        fetch_raw = store.db.fetch_raw

        def failing(*args: Any) -> Any:
            monkeypatch.setattr(store.db, "fetch_raw", fetch_raw)  # once
            raise lmdb.ReadersFullError("readers full")

        monkeypatch.setattr(store.db, "fetch_raw", failing)
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 10))
        peer.wait_for(lambda q: store.unreadable_reads >= 1)
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 10))
        peer.wait_for(lambda q: len(got(q, HEALTHY)) >= 3)
        assert got(peer, HEALTHY) == [(0, b"b0"), (1, b"b1"), (2, b"b2")]
        assert not [v for v in peer.messages(wire.Void) if v.address == HEALTHY]


def _records(reader: Any, n: int) -> list[Any]:
    """The DIRECT-RECORDs ``reader`` gets: ``n`` of them, waited for with a deadline (not
    the first silence: a loaded machine pauses longer), then whatever else comes in a
    short while (more than ``n`` is more than was asked for)."""
    got: list[Any] = []
    deadline = time.monotonic() + 20
    while sum(isinstance(m, wire.DirectRecord) for m in got) < n and time.monotonic() < deadline:
        msg = reader.recv(1.0)
        if msg is not None:
            got.append(msg)
    got += reader.drain(0.3)
    return [m for m in got if isinstance(m, wire.DirectRecord)]


@pytest.mark.parametrize("kind", ["kafka-records", "snappy-payload", "store-short", "header"])
def test_a_damaged_block_costs_a_leaf_reader_its_answer_only(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             kind: str) -> None:
    """A leaf reader (the store's leaf port, a DEALER) asking for the damaged records again
    and again: the port lives, answers the other partition and other readers, takes a leaf
    producer's records, and logs the damage a bounded number of times.  Each answer from the
    damage goes on past it (the records after it, never more than asked for, never one of
    the damaged offsets), as the mesh's does after its VOID: the port keeps nothing for it
    and counts each (``unreadable_reads``).  Before, an answer starting at the damage was
    empty: a leaf reader never got past it."""
    from tests.test_leaf_read import CMD, RawReader, publish_leaf

    plant(tmp_path / "db", kind, CMD)
    caplog.set_level(logging.ERROR)
    ctx = zmq.Context()
    store = Store(str(tmp_path / "db"), leaves="127.0.0.1:0")
    try:
        r = RawReader(ctx, store)
        assert isinstance(r.read(), leafwire.LeafReading)
        for _ in range(12):  # (within the connection's burst of 50 FETCHes, the answers within its queue of 64)
            r.send(wire.Fetch(DAMAGED, r.address, CMD, 2, 1))
            r.send(wire.Fetch(HEALTHY, r.address, CMD, 0, 10))
        got = [(m.address, m.sequence) for m in _records(r, 12 + 12 * 3)]
        assert sorted(set(got)) == [(DAMAGED, 5), (HEALTHY, 0), (HEALTHY, 1), (HEALTHY, 2)]
        assert got.count((DAMAGED, 5)) == 12  # one record each: no more than asked for
        assert store.unreadable_reads >= 12
        other = RawReader(ctx, store)
        assert isinstance(other.read(), leafwire.LeafReading)
        other.send(wire.Fetch(DAMAGED, other.address, CMD, 0, 10))
        got = [(m.address, m.sequence) for m in _records(other, 2)]
        assert got == [(DAMAGED, 0), (DAMAGED, 1)]  # before the damage: the read stops before it
        other.send(wire.Fetch(DAMAGED, other.address, CMD, 2, 10))
        got = [(m.address, m.sequence, m.content) for m in _records(other, 2)]
        assert got == [(DAMAGED, 5, b"a5"), (DAMAGED, 6, b"a6")]  # from the damage: past it
        publish_leaf(store, "telemetry", 3)  # acknowledged
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert errors and len(errors) <= 10, [rec.getMessage() for rec in errors]
        assert store.running
    finally:
        store.close()
        ctx.destroy(0)


@pytest.mark.parametrize("kind", ["kafka-records", "header"])
def test_block_after_passes_a_damaged_block_by_its_keys(tmp_path: Path, kind: str) -> None:
    """Where a read goes on past the block it reached first: the next block's first offset,
    from inside the damaged block, from a hole before it, from below the partition's first;
    None past the partition's last block, and when the block reached reads."""
    plant(tmp_path / "db", kind)
    with RecordDB(tmp_path / "db", sync=False) as db:
        for offset in (2, 3, 4):
            assert db.block_after("t", DAMAGED, offset) == 5
        assert db.block_after("t", DAMAGED, 0) is None  # the block reached (0-1) reads: never passed
        assert db.block_after("t", DAMAGED, 5) is None
        assert db.block_after("t", DAMAGED, 99) is None
        assert db.block_after("t", HEALTHY, 0) is None
        assert db.block_after("t", "nobody", 0) is None
    with RecordDB(tmp_path / "hole", sync=False) as db:  # 0-1, a hole 2-9, damaged 10-12, 13-14
        db.append_blocks([("t", DAMAGED, healthy(0, [b"a0", b"a1"])), ("t", DAMAGED, damaged("kafka-records", 10)),
                          ("t", DAMAGED, healthy(13, [b"a13", b"a14"]))], skips=[("t", DAMAGED, 2, 9)])
        assert db.block_after("t", DAMAGED, 4) == 13  # the read from the hole reaches the damaged block
        assert db.block_after("t", DAMAGED, 11) == 13


def test_past_block_passes_a_block_whose_header_is_damaged_and_no_other(tmp_path: Path) -> None:
    """Where a mesh answer goes on past a block whose header cannot be read: the next
    block's key, from the block, from inside it, from a hole before it; None when the block
    a read reaches reads (a healthy one, or a damaged one whose header reads: the caller
    has its header's range): the answer then ends rather than pass records that are held."""
    plant(tmp_path / "db", "header")
    with RecordDB(tmp_path / "db", sync=False) as db:
        assert [db.past_block("t", DAMAGED, o) for o in (2, 3, 4)] == [5, 5, 5]
        assert db.past_block("t", DAMAGED, 0) is None  # 0-1 read
        assert db.past_block("t", DAMAGED, 5) is None and db.past_block("t", HEALTHY, 0) is None
    with RecordDB(tmp_path / "hole", sync=False) as db:  # 0-1, a hole 2-9, header-damaged 10-12, 13-14
        db.append_blocks([("t", DAMAGED, healthy(0, [b"a0", b"a1"])), ("t", DAMAGED, healthy(10, [b"x", b"y", b"z"])),
                          ("t", DAMAGED, healthy(13, [b"a13", b"a14"]))], skips=[("t", DAMAGED, 2, 9)])
        pid = db.info("t", DAMAGED).pid
        db._write(lambda txn: txn.put(block_key(pid, 10), b"XB" + damaged("store-ends", 10)[2:], db=db._dbs.blocks))
        assert db.past_block("t", DAMAGED, 4) == db.past_block("t", DAMAGED, 11) == 13
    plant(tmp_path / "rec", "kafka-records")
    with RecordDB(tmp_path / "rec", sync=False) as db:
        assert db.past_block("t", DAMAGED, 2) is None


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_the_spark_path_transport_names_a_damaged_block_or_skips_it(tmp_path: Path, fail_on_data_loss: bool,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Spark's ``path`` transport reading a partition with a damaged block: the error named
    neither the partition nor the offset (a bare 'malformed or truncated varint').  Now it is
    data loss as retention's is: DataLossError naming them, or, for failOnDataLoss=false, a
    warning and the records past the block."""
    pytest.importorskip("pyarrow")
    from dafka.spark.offsets import DataLossError, ReadRange
    from dafka.spark.transport import _read_store

    plant(tmp_path / "db", "count-varint")
    batches = _read_store(str(tmp_path / "db"), ReadRange("t", DAMAGED, 0, 7), fail_on_data_loss)
    got: list[tuple[int, bytes]] = []
    if fail_on_data_loss:
        with pytest.raises(DataLossError, match=f"t/{DAMAGED}: the stored block holding offset 2 .*records 2..4"):
            for b in batches:
                got += zip(b.column("offset").to_pylist(), b.column("value").to_pylist(), strict=True)
        assert got == [(0, b"a0"), (1, b"a1")]
    else:
        caplog.set_level(logging.WARNING)
        for b in batches:
            got += zip(b.column("offset").to_pylist(), b.column("value").to_pylist(), strict=True)
        assert got == [(0, b"a0"), (1, b"a1"), (5, b"a5"), (6, b"a6")]
        assert any("records 2..4, a damaged block" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("impl", ["pure", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_fetch_blocks_stops_before_a_damaged_block_and_raises_from_it(tmp_path: Path, impl: str, kind: str) -> None:
    """Both twins of fetch_blocks: from before the damage, the records before it; from it, its
    error (a ValueError: ProtocolError is one); past it, the records past it."""
    from dafka.fastio import _pure
    from dafka.store.reader import convert_block

    fetch_blocks = _pure.fetch_blocks if impl == "pure" else pytest.importorskip("dafka.fastio._compiled").fetch_blocks
    plant(tmp_path / "db", kind)
    with RecordDB(tmp_path / "db", sync=False) as db, db._read_txn(buffers=True) as (txn, dbs):
        pid = db.info("t", DAMAGED).pid

        def read(start: int) -> tuple[int, list[bytes]]:
            got: tuple[int, list[bytes]] = fetch_blocks(txn.cursor(db=dbs.blocks), pid, start, 6, 7 - start,
                                                        convert_block)
            return got

        assert read(0) == (0, [value(b"a0"), value(b"a1")])
        with pytest.raises(ValueError):
            read(2)
        assert read(5) == (5, [value(b"a5"), value(b"a6")])


@pytest.mark.parametrize("kind", ["snappy-payload", "header"])
def test_a_consumer_gets_the_records_around_a_damaged_block(cfg: NodeConfig, tmp_path: Path, kind: str) -> None:
    """A Dafka consumer of a partition with a damaged block, from a store that holds no other
    copy: it gets the records before and after it, passing the damaged offsets after
    ``skip_after`` as any gap nobody fills (a VOID kind 0 makes a reader pass nothing but a
    restarted producer's hole).  Before, it got neither: the store's answer stopped for good.
    A block whose header is damaged too ("header"): the answer goes on at the next block's key
    (:meth:`RecordDB.past_block`); before, it ended there, and the consumer got only the
    records before the block, for good."""
    from dafka.nodes.consumer import Consumer

    plant(tmp_path / "db", kind)
    with Store(tmp_path / "db", cfg) as store, Consumer("t", cfg, offset_reset="earliest", skip_after=2.0) as c:
        got: list[tuple[str, int, bytes]] = []
        deadline = time.monotonic() + 30
        while len([r for r in got if r[0] == DAMAGED]) < 4 and time.monotonic() < deadline:
            got += [(r.partition, r.offset, bytes(r.content)) for r in c.poll_batch(100, 0.2)]
        assert sorted(r for r in got if r[0] == DAMAGED) == [(DAMAGED, 0, b"a0"), (DAMAGED, 1, b"a1"),
                                                             (DAMAGED, 5, b"a5"), (DAMAGED, 6, b"a6")]
        assert sorted(r for r in got if r[0] == HEALTHY) == [(HEALTHY, i, b"b%d" % i) for i in range(3)]
        assert store.unreadable_reads >= 1


def _plant_wide(path: Path, topic: str) -> None:
    """As :func:`plant`, the damaged block 100 records wide (more than a leaf reader's FETCH
    asks for: 32): DAMAGED 0-1 healthy, 2-101 damaged, 102-103 healthy; HEALTHY 0-2."""
    block = kafka_block(_kafka_batch(2, [b"w%d" % i for i in range(100)]), 2)  # (converted whole)
    body = bytearray(block[HEADER_SIZE:])
    body[61:] = b"\xff" * (len(body) - 61)
    with RecordDB(path, sync=False) as db:
        db.append_blocks([
            (topic, DAMAGED, healthy(0, [b"a0", b"a1"])),
            (topic, DAMAGED, _reseal(block, bytes(body))),
            (topic, DAMAGED, healthy(102, [b"a102", b"a103"])),
            (topic, HEALTHY, healthy(0, [b"b0", b"b1", b"b2"])),
        ])


@pytest.mark.parametrize("kind", ["snappy-payload", "kafka-records", "header", "wide"])
def test_a_leaf_consumer_gets_the_records_around_a_damaged_block(tmp_path: Path, kind: str) -> None:
    """A leaf consumer (the device's LeafConsumer, a real store's leaf port) of a partition
    with a damaged block, from a store that holds no other copy: it gets the records before
    and after the block, passing its offsets after ``skip_after`` as any gap nobody fills
    (not at once: another endpoint may hold them).  Before, it got the records before the
    block and then nothing: an answer starting at the block was empty, so the reader never
    held a record past the gap to give it up for, and asked again forever."""
    from tests.test_leaf_read import CMD

    if kind == "wide":
        _plant_wide(tmp_path / "db", CMD)
        after = [(102, b"a102"), (103, b"a103")]
    else:
        plant(tmp_path / "db", kind, CMD)
        after = [(5, b"a5"), (6, b"a6")]
    want = [(0, b"a0"), (1, b"a1"), *after]
    store = Store(str(tmp_path / "db"), leaves="127.0.0.1:0")
    try:
        assert store.leaves is not None
        endpoint = f"127.0.0.1:{store.leaves.port}"
        started = time.monotonic()
        with LeafConsumer(CMD, leaf=endpoint, skip_after=1.5, retry_interval=0.2) as c:
            got: list[tuple[str, int, bytes]] = []
            deadline = time.monotonic() + 20
            while len([r for r in got if r[0] == DAMAGED]) < len(want) and time.monotonic() < deadline:
                got += [(r.partition, r.offset, bytes(r.content)) for r in c.poll_batch(100, 0.2)]
            assert [(o, v) for p, o, v in got if p == DAMAGED] == want
            assert [(o, v) for p, o, v in got if p == HEALTHY] == [(i, b"b%d" % i) for i in range(3)]
            assert time.monotonic() - started >= 1.5  # passed after skip_after, not at once
            assert c.reader.skipped == want[2][0] - 2
        assert store.unreadable_reads >= 1
    finally:
        store.close()


def _rotten_length(bundle: bytes, claim: int) -> bytes:
    """``bundle`` (snappy) with its message set's length varint saying ``claim`` bytes."""
    from dafka.tank.bundle import decode_varint, parse_bundle_header

    h = parse_bundle_header(bundle)
    _size, end = decode_varint(bundle, h.msgset_start, h.end)
    enc = bytearray()
    while claim >= 0x80:
        enc.append((claim & 0x7F) | 0x80)
        claim >>= 7
    enc.append(claim)
    return bundle[:h.msgset_start] + bytes(enc) + bundle[end:]


@pytest.mark.parametrize("sparse", [False, True])
def test_a_rotten_snappy_length_is_refused_at_the_stored_budget_not_24_times_the_body(tmp_path: Path,
                                                                                     sparse: bool) -> None:
    """A stored Tank bundle whose snappy length field rotted to claim more than the budget it
    was checked against when stored (64 MiB, ``block.DEFAULT_BUDGET``), though less than 24
    times its body (all the read bound before): every read of it (a mesh or leaf FETCH, a
    Tank consume's slice, a Kafka fetch, Spark) allocated the claimed size before failing, 90
    MiB for a 4 MiB bundle here (1.5 GiB for one of the 64 MiB request limit), again at each
    ask of a hostile reader.  Now refused before inflating, by both twins of the walk and by
    the per-record path of a sparse bundle with gaps; a read of it fails as any damaged
    block's (a ValueError: the mesh VOIDs it and goes on past it)."""
    import os
    import tracemalloc

    from dafka.errors import ProtocolError
    from dafka.fastio import _pure
    from dafka.store.block import DEFAULT_BUDGET, records
    from dafka.store.reader import block_values

    n = 1000
    seqs = [*range(1, 501), *range(502, n + 2)] if sparse else [None] * n
    msgs = [(s, TS, None, os.urandom(4000)) for s in seqs]  # 4 MB that do not compress
    bundle = _rotten_length(encode_bundle(msgs, codec=CODEC_SNAPPY, sparse=sparse), 90 << 20)
    assert DEFAULT_BUDGET < 90 << 20 < 24 * len(bundle)
    last = 2 + (n if sparse else n - 1)
    block = _seal(CODEC_TANK, COMPRESSION_SNAPPY, 2, last, n, TS, TS, bundle)
    over = "over the budget of 67108864"
    with RecordDB(tmp_path / "db", sync=False) as db:
        db.append_blocks([("t", DAMAGED, healthy(0, [b"a0", b"a1"])), ("t", DAMAGED, block)])
        assert db.fetch_raw("t", DAMAGED, 0, 10) == (0, [value(b"a0"), value(b"a1")])
        tracemalloc.start()
        try:
            for _ in range(3):  # a reader asking again and again
                with pytest.raises(ValueError):
                    db.fetch_raw("t", DAMAGED, 2, 10)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 << 20, peak  # (the block's 4 MB value, copied; not the 90 MiB claimed)
        with pytest.raises(ValueError, match=over):
            db.fetch_raw("t", DAMAGED, 2, 10)
    hdr = decode_header(block)
    with pytest.raises(ProtocolError, match=over):
        block_values(block, hdr, 2, 10)  # the compiled walk (or its pure twin), or records() when sparse
    with pytest.raises(ProtocolError, match=over):
        list(records(block))
    if not sparse:
        with pytest.raises(ProtocolError, match=over):
            _pure.tank_values(bundle, 0, 10)
        compiled = pytest.importorskip("dafka.fastio._compiled")
        with pytest.raises(ProtocolError, match=over):
            compiled.tank_values(bundle, 0, 10)


_PLANTED = {"store-ends": [b"e0", b"e1", b"e2"], "store-short": [b"e0", b"e1", b"e2"],
            "store-crossed": [b"c0" * 8, b"c1" * 8, b"c2" * 8], "store-count": [b"n0" * 8, b"n1" * 8, b"n2" * 8]}


@pytest.mark.parametrize("kind", sorted(_PLANTED))
def test_a_damaged_ends_table_is_refused_by_every_slicer_not_read_as_other_records(kind: str) -> None:
    """A CODEC_STORE block's ends table, damaged with its entries inside the block (crossed, or
    a header whose count is not the table's), is never sliced into other records: every slicer
    (the pure-Python ``store_values`` the Tank and Kafka gateways convert through, both twins
    of ``block_slice``) either refuses a slice with a ProtocolError (a ValueError, what every
    reader of stored blocks serves around) or gives the records planted there, and all give
    the same.  A slice is checked by its own entries and the table's last (the whole table
    at every read cost a tenth of a bulk read).  Before, ``store_values`` checked nothing: it
    read ``store-count``'s first record from inside the ends table and ``store-crossed``'s
    first two records as one, silently."""
    from dafka.errors import ProtocolError
    from dafka.fastio import _pure
    from dafka.store.block import store_values
    from dafka.store.reader import block_values

    slicers: list[Any] = [lambda v, at, n: _pure.block_slice(v, at, n)[2]]
    try:
        from dafka.fastio import _compiled  # type: ignore[attr-defined]

        slicers.append(lambda v, at, n: _compiled.block_slice(v, at, n)[2])
    except ImportError:
        pass
    block = damaged(kind, 2)
    hdr = decode_header(block)
    slicers += [lambda v, at, n: store_values(v, hdr, at, n), lambda v, at, n: block_values(v, hdr, at, n)]
    planted = [value(c) for c in _PLANTED[kind]]
    refused = 0
    for at in range(2, 5):
        for n in range(1, 4):
            outcomes = set()
            for slicer in slicers:
                for v in (block, memoryview(block)):
                    try:
                        outcomes.add(tuple(bytes(x) for x in slicer(v, at, n)))
                    except ProtocolError:
                        outcomes.add(None)
            assert len(outcomes) == 1, (at, n, outcomes)  # every slicer gives the same
            got = outcomes.pop()
            if got is None:
                refused += 1
            else:
                assert list(got) == planted[at - 2:at - 2 + n], (at, n)  # never other records
    assert refused  # the damage is found where it is read
    # Sound blocks are sliced as before, from any offset, bytes or a zero-copy view.
    sound = healthy(2, [b"x" * k for k in range(5)])
    want = [value(b"x" * k) for k in range(5)]
    for at in range(2, 7):
        for n in range(1, 6):
            for v in (sound, memoryview(sound)):
                assert store_values(v, decode_header(sound), at, n) == want[at - 2:at - 2 + n]
            for slicer in slicers[:-2]:
                assert slicer(sound, at, n) == want[at - 2:at - 2 + n]


@pytest.mark.parametrize("kind", ["kafka-records", "store-ends", "store-count", "snappy-payload"])
def test_unreadable_block_is_only_a_block_that_cannot_be_read(tmp_path: Path, kind: str) -> None:
    """``RecordDB.unreadable_block`` gives the header a mesh answer VOIDs past when a read
    failed: only for a block that cannot be read, and none for a sound block nor once
    retention removed the damaged one (the block a read reaches then is sound, its offsets
    held)."""
    plant(tmp_path / "db", kind)
    with RecordDB(tmp_path / "db", sync=False) as db:
        for at in (2, 3):
            hdr = db.unreadable_block("t", DAMAGED, at)
            assert hdr is not None and (hdr.first_offset, hdr.last_offset) == (2, 4)
        assert db.unreadable_block("t", DAMAGED, 0) is None  # sound blocks: never passed
        assert db.unreadable_block("t", DAMAGED, 5) is None
        assert db.unreadable_block("t", HEALTHY, 0) is None
        db.delete_front("t", DAMAGED, 5)  # retention: the damaged block is gone
        assert db.unreadable_block("t", DAMAGED, 2) is None  # (the read would reach 5-6, sound)
        assert db.unreadable_block("t", DAMAGED, 5) is None


def _plant_hole_after(path: Path, kind: str, topic: str = "t") -> None:
    """Partition DAMAGED: 0-1 healthy, 2-4 damaged (its header reads), a hole 5-7, 8-9 and
    10-11 healthy; HEALTHY: 0-2."""
    with RecordDB(path, sync=False) as db:
        db.append_blocks([
            (topic, DAMAGED, healthy(0, [b"a0", b"a1"])),
            (topic, DAMAGED, damaged(kind, 2)),
            (topic, DAMAGED, healthy(8, [b"a8", b"a9"])),
            (topic, DAMAGED, healthy(10, [b"a10", b"a11"])),
            (topic, HEALTHY, healthy(0, [b"b0", b"b1", b"b2"])),
        ], skips=[(topic, DAMAGED, 5, 7)])
        assert db.head(topic, DAMAGED) == 11


HOLE_KINDS = ["count-varint", "truncated-bundle", "snappy-payload", "kafka-gzip", "store-ends", "store-count"]


@pytest.mark.parametrize("impl", ["pure", "compiled"])
@pytest.mark.parametrize("kind", HOLE_KINDS)
def test_a_read_from_a_hole_after_a_damaged_block_does_not_decode_it(tmp_path: Path, impl: str, kind: str) -> None:
    """A read starting in a hole after a damaged block (its header reads) steps back onto
    that block only to see that it ends before the read: the records after the hole are
    read.  Before, both twins converted the block stepped back onto (a Tank bundle, a Kafka
    batch) whatever the offset, or checked its ends table (a store block), and its damage
    raised from a read that holds none of its offsets; the callers took the block after the
    hole for the damaged one (below), or refused every reader from the hole again and again."""
    from dafka.fastio import _pure
    from dafka.store.reader import convert_block

    fetch_blocks = _pure.fetch_blocks if impl == "pure" else pytest.importorskip("dafka.fastio._compiled").fetch_blocks
    _plant_hole_after(tmp_path / "db", kind)
    with RecordDB(tmp_path / "db", sync=False) as db, db._read_txn(buffers=True) as (txn, dbs):
        pid = db.info("t", DAMAGED).pid
        for start in (5, 6, 7):
            assert fetch_blocks(txn.cursor(db=dbs.blocks), pid, start, 11, 10, convert_block) == (
                8, [value(b"a8"), value(b"a9"), value(b"a10"), value(b"a11")])
        with pytest.raises(ValueError):
            fetch_blocks(txn.cursor(db=dbs.blocks), pid, 3, 11, 10, convert_block)


@pytest.mark.parametrize("kind", ["count-varint", "snappy-payload", "store-ends"])
def test_a_mesh_answer_past_a_damaged_block_and_a_hole_voids_no_held_record(cfg: NodeConfig, tmp_path: Path,
                                                                            raw_peer: Any, kind: str) -> None:
    """A FETCH from the damaged block (2) and one from the hole after it (5): the VOIDs
    cover the damaged offsets and the hole, never 8-9 or 10-11, which this store holds and
    serves.  Before, the read from the hole raised (the block stepped back onto was decoded)
    and the VOID was cut from the block ``read_blocks`` found from there: the healthy 8-9,
    a VOID kind 0 (readers pass it after skip_after: acknowledged records skipped)."""
    _plant_hole_after(tmp_path / "db", kind)
    with Store(tmp_path / "db", cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        for n, start in enumerate((2, 5), 1):
            peer.send(wire.Fetch(DAMAGED, peer.address, "t", start, 10))
            peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 1))  # (answered after: the store went on)
            peer.wait_for(lambda q, n=n: sum(off == 11 for off, _ in got(q, DAMAGED)) >= n
                          and sum(off == 0 for off, _ in got(q, HEALTHY)) >= n)
        voids = [(v.first, v.last) for v in peer.messages(wire.Void) if v.address == DAMAGED]
        assert not [v for v in voids if v[1] >= 8], voids
        assert [off for off, _ in got(peer, DAMAGED)] == [8, 9, 10, 11, 8, 9, 10, 11]
        assert store.running


@pytest.mark.parametrize("kind", ["count-varint", "snappy-payload"])
def test_a_leaf_answer_from_a_hole_after_a_damaged_block_skips_no_held_record(tmp_path: Path, kind: str) -> None:
    """A leaf reader asking from the hole after the damaged block gets 8-11.  Before, the
    read from the hole raised (the block before it was decoded), the port took the block it
    reached (8-9) for the damaged one and went on at 10: 8 and 9 were never sent."""
    from tests.test_leaf_read import CMD, RawReader

    _plant_hole_after(tmp_path / "db", kind, CMD)
    ctx = zmq.Context()
    store = Store(str(tmp_path / "db"), leaves="127.0.0.1:0")
    try:
        r = RawReader(ctx, store)
        assert isinstance(r.read(), leafwire.LeafReading)
        r.send(wire.Fetch(DAMAGED, r.address, CMD, 5, 4))
        assert [(m.address, m.sequence) for m in _records(r, 4)] == [(DAMAGED, o) for o in (8, 9, 10, 11)]
        assert store.running
    finally:
        store.close()
        ctx.destroy(0)


def _retention_after_failed_read(monkeypatch: pytest.MonkeyPatch, db: RecordDB, topic: str, before: int) -> list[int]:
    """``db.fetch_raw`` of DAMAGED from 2 fails (the damaged block) and, before its caller
    looks where to go on, retention deletes the partition's front below ``before`` (the
    store's writer thread commits between two read transactions of the serving thread)."""
    fetch_raw, done = db.fetch_raw, []

    def racing(t: str, p: str, offset: int, count: int) -> Any:
        try:
            return fetch_raw(t, p, offset, count)
        except ValueError:
            if p == DAMAGED and not done:
                done.append(db.delete_front(topic, DAMAGED, before)[0])
            raise

    monkeypatch.setattr(db, "fetch_raw", racing)
    return done


def test_retention_between_a_failed_read_and_its_void_voids_no_held_record(
        cfg: NodeConfig, tmp_path: Path, raw_peer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The damaged block (2-4) is deleted by retention (the front moves to 8) between the
    read that failed at it and the look for its range: the block found from 2 now is the
    healthy 8-9.  No VOID covers 8-9 (it is not the block that failed: the answer ends, the
    reader asks again and gets 8-11).  Before, the VOID said 8-9 (``read_blocks`` from the
    offset asked for, no check that the block found is the one that cannot be read), and the
    answer went on at 10: held, acknowledged records passed by every reader."""
    _plant_hole_after(tmp_path / "db", "snappy-payload")
    with Store(tmp_path / "db", cfg) as store:
        done = _retention_after_failed_read(monkeypatch, store.db, "t", 8)
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))
        peer.send(wire.Fetch(HEALTHY, peer.address, "t", 0, 1))
        peer.wait_for(lambda q: done == [8] and (0, b"b0") in got(q, HEALTHY))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))  # (asks again)
        peer.wait_for(lambda q: (11, b"a11") in got(q, DAMAGED))
        voids = [(v.first, v.last) for v in peer.messages(wire.Void) if v.address == DAMAGED]
        assert not [v for v in voids if v[1] >= 8], voids
        assert (8, b"a8") in got(peer, DAMAGED) and (9, b"a9") in got(peer, DAMAGED)
        assert store.running


def test_retention_between_a_failed_leaf_read_and_its_step_skips_no_held_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, for the leaf port: after the read from 2 fails, retention moves the front to
    8; the port's step past the damaged block must not take the healthy 8-9 for it.  Before,
    ``block_after`` from 2 (now 8) went on at 10: the answer was 10-11, 8 and 9 never sent."""
    from tests.test_leaf_read import CMD, RawReader

    _plant_hole_after(tmp_path / "db", "snappy-payload", CMD)
    ctx = zmq.Context()
    store = Store(str(tmp_path / "db"), leaves="127.0.0.1:0")
    try:
        done = _retention_after_failed_read(monkeypatch, store.db, CMD, 8)
        r = RawReader(ctx, store)
        assert isinstance(r.read(), leafwire.LeafReading)
        r.send(wire.Fetch(DAMAGED, r.address, CMD, 2, 4))
        first = [m.sequence for m in _records(r, 0)]
        assert done == [8]
        assert 10 not in first and 11 not in first, first
        r.send(wire.Fetch(DAMAGED, r.address, CMD, 2, 4))  # (asks again)
        assert [m.sequence for m in _records(r, 4)] == [8, 9, 10, 11]
        assert store.running
    finally:
        store.close()
        ctx.destroy(0)


def test_a_damaged_block_whose_header_claims_too_far_voids_no_later_block(cfg: NodeConfig, tmp_path: Path,
                                                                         raw_peer: Any) -> None:
    """A damaged block (2-4, its records unreadable) whose header still has the shape of a
    header but claims offsets up to 6 (rot there too: a header is checked for shape, not
    against its CRC, on reads): the next block is keyed at 5, so the block holds at most
    2-4.  The VOID ends before the next block's key; 5-6 are served.  Before, the VOID said
    2-6 from the rotten header and the answer went on at 7: held records passed."""
    path = tmp_path / "db"
    with RecordDB(path, sync=False) as db:
        db.append_blocks([("t", DAMAGED, healthy(0, [b"a0", b"a1"])), ("t", DAMAGED, damaged("count-varint", 2)),
                          ("t", DAMAGED, healthy(5, [b"a5", b"a6"])), ("t", DAMAGED, healthy(7, [b"a7"]))])
        pid = db.info("t", DAMAGED).pid
        rotten = bytearray(damaged("count-varint", 2))
        struct.pack_into(">Q", rotten, 16, 6)  # its last offset
        assert decode_header(bytes(rotten)).last_offset == 6
        db._write(lambda txn: txn.put(block_key(pid, 2), bytes(rotten), db=db._dbs.blocks))
    with Store(path, cfg) as store:
        peer = raw_peer([wire.P_DIRECT_RECORD, wire.P_VOID])
        peer.wait_for(lambda q: len(q.peers) >= 1 and len(store.peers) >= 1)
        peer.wait_for(lambda q: q.subscribed(b"F") and q.subscribed(b"W" + store.address.encode()))
        peer.send(wire.Fetch(DAMAGED, peer.address, "t", 2, 10))
        peer.wait_for(lambda q: (7, b"a7") in got(q, DAMAGED))
        voids = [(v.first, v.last) for v in peer.messages(wire.Void) if v.address == DAMAGED]
        assert voids == [(2, 4)], voids
        assert [off for off, _ in got(peer, DAMAGED)] == [5, 6, 7]


def test_retention_between_a_failed_spark_read_and_its_skip_skips_no_held_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Spark's ``path`` transport, failOnDataLoss=false: retention moves the front to 8 (the
    store's process, on the same LMDB) between the read that failed at the damaged block and
    the look for its range.  The records 8-11 are read (2-7 are reported lost, as retention's
    loss); before, the range skipped was cut from the block found from 2 now, the healthy
    8-9: "records 8..9, a damaged block", and they were never read."""
    pytest.importorskip("pyarrow")
    from dafka.spark import transport

    _plant_hole_after(tmp_path / "db", "snappy-payload")
    caplog.set_level(logging.WARNING)
    with RecordDB(tmp_path / "db", sync=False) as db:
        done = _retention_after_failed_read(monkeypatch, db, "t", 8)
        monkeypatch.setattr(transport, "shared_db", lambda path: db)
        got: list[int] = []
        for b in transport._read_store(str(tmp_path / "db"), transport.ReadRange("t", DAMAGED, 0, 12), False):
            got += b.column("offset").to_pylist()
        assert done == [8]
        assert got == [0, 1, 8, 9, 10, 11]
        assert not [r for r in caplog.records if "records 8..9" in r.getMessage()]
