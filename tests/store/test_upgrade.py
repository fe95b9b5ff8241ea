"""Upgrade of a format-1 record database (one entry per record) to format 2 (blocks), on real LMDB.

The format-1 databases are written here with plain py-lmdb, byte for byte as format 1 laid them
out (meta, partitions, pids, records and holes), since this code writes format 2 only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from dafka.store import layout
from dafka.store.block import CODEC_STORE, decode_header
from dafka.store.db import RecordDB, StorageError
from dafka.store.upgrade import RECORDS_DB

P1 = "A" * 32
P2 = "B" * 32


def _value(ts: int, content: bytes, key: bytes | None = None, flags: int = 0) -> bytes:
    if key is None:
        return layout.VALUE_HEADER.pack(ts, flags) + content
    return layout.VALUE_HEADER.pack(ts, flags | layout.FLAG_KEY) + bytes((len(key),)) + key + content


def write_format1(path: Path, parts: dict[tuple[str, str], dict[int, bytes]], holes: bool = True) -> None:
    """A format-1 database holding ``parts``: per partition, offset -> stored value."""
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn)
            pdb = env.open_db(b"partitions", txn=txn)
            pids = env.open_db(b"pids", txn=txn)
            rdb = env.open_db(RECORDS_DB, txn=txn)
            hdb = env.open_db(b"holes", txn=txn) if holes else None
            txn.put(b"format", layout.U32.pack(1), db=meta)
            for pid, ((topic, partition), recs) in enumerate(sorted(parts.items())):
                pkey = layout.pack_partition_key(topic, partition)
                offs = sorted(recs)
                nbytes = sum(layout.value_payload_size(v) for v in recs.values())
                txn.put(pkey, layout.pack_info(pid, offs[0], offs[-1], len(offs), nbytes), db=pdb)
                txn.put(layout.U32.pack(pid), pkey, db=pids)
                cur = txn.cursor(db=rdb)
                cur.putmulti(((layout.pack_record_key(pid, o), recs[o]) for o in offs), append=True)
                if hdb is not None:
                    for a, b in zip(offs, offs[1:], strict=False):
                        if b > a + 1:
                            txn.put(layout.pack_record_key(pid, a + 1), layout.U64.pack(b - 1), db=hdb)
    finally:
        env.close()


def _tables(path: Path) -> tuple[int | None, int | None, bytes | None, bool]:
    """``(records entries, blocks entries, format, converting)``, read by another environment."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=True, map_size=0)
    try:
        with env.begin() as txn:
            out = []
            for name in (RECORDS_DB, b"blocks"):
                try:
                    out.append(int(txn.stat(env.open_db(name, txn=txn, create=False))["entries"]))
                except lmdb.NotFoundError:
                    out.append(None)
            meta = env.open_db(b"meta", txn=txn, create=False)
            return out[0], out[1], txn.get(b"format", db=meta), txn.get(b"converting", db=meta) is not None
    finally:
        env.close()


def test_format1_is_converted_on_open_and_reads_the_same(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kafka_slot = b"\x06abc\x00"  # zigzag(3) "abc", no headers: a Kafka key as format 1 kept it
    parts = {
        ("t", P1): {o: _value(1000 + o, b"r%d" % o) for o in [*range(0, 50), *range(60, 70)]},  # a hole
        ("t", P2): {
            5: _value(7, b"keyed", key=b"k", flags=layout.FLAG_PRODUCER_TS),
            6: _value(8, b"kafka", key=kafka_slot, flags=layout.FLAG_KAFKA),
            7: _value(9, b"", flags=layout.FLAG_NULL),
        },
        ("u", P1): {o: _value(5, b"x" * 3000) for o in range(100)},  # several blocks
    }
    write_format1(tmp_path / "db", parts)
    with caplog.at_level(logging.WARNING, logger="dafka.store.upgrade"):
        db = RecordDB(tmp_path / "db")
    try:
        assert any("converting format 1 to format 2 (163 records)" in r.getMessage() for r in caplog.records)
        assert any("converted to format 2 (163 records into" in r.getMessage() for r in caplog.records)
        for (topic, partition), recs in parts.items():
            info = db.info(topic, partition)
            assert info is not None and (info.first, info.last, info.count) == (min(recs), max(recs), len(recs))
            got: dict[int, bytes] = {}
            off = 0
            for _ in range(100):
                start, values = db.fetch_raw(topic, partition, off, 1000)
                if not values:
                    break
                got.update(zip(range(start, start + len(values)), values, strict=True))
                off = start + len(values)
            assert got == recs
        assert [(h.first, h.last) for h in db.holes()] == [(50, 59)]
        db.append([("t", P1, 70, b"after", 1)])
        assert db.fetch("t", P1, 70, 1) == (70, [b"after"])
    finally:
        db.close()
    records, blocks, fmt, converting = _tables(tmp_path / "db")
    assert records == 0 and blocks and fmt == layout.U32.pack(2) and not converting
    # 3000-byte records: 64 KiB blocks hold 21 of them.
    with RecordDB(tmp_path / "db", readonly=True) as ro:
        assert ro.fetch("u", P1, 0, 1000)[1] == [b"x" * 3000] * 100
        env = ro._live_env()
        with env.begin() as txn:
            cur = txn.cursor(db=ro._dbs.blocks)  # type: ignore[union-attr]
            hdrs = [decode_header(v) for v in cur.iternext(keys=False)]
        assert {h.codec for h in hdrs} == {CODEC_STORE}
        assert max(h.body_size for h in hdrs) <= (64 << 10) + 8 + 4 * 21


def test_readonly_open_of_a_format1_database_is_refused_clearly(tmp_path: Path) -> None:
    write_format1(tmp_path / "db", {("t", P1): {0: _value(1, b"x")}})
    with pytest.raises(StorageError, match="format 1.*converts it to format 2"):
        RecordDB(tmp_path / "db", readonly=True)
    assert _tables(tmp_path / "db")[:2] == (1, None)  # untouched


def test_a_newer_format_is_refused_clearly(tmp_path: Path) -> None:
    with RecordDB(tmp_path / "db") as db:
        db.append([("t", P1, 0, b"x", 1)])
    env = lmdb.open(str(tmp_path / "db"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format", layout.U32.pack(3), db=env.open_db(b"meta", txn=txn))
    env.close()
    for readonly in (False, True):
        with pytest.raises(StorageError, match="format 3, this code reads format 2.*newer dafka"):
            RecordDB(tmp_path / "db", readonly=readonly)


_CONVERT = """
import sys
from dafka.store.db import RecordDB
RecordDB(sys.argv[1]).close()
"""


@pytest.mark.timeout(120)
def test_kill9_mid_conversion_loses_nothing(tmp_path: Path) -> None:
    """A store killed (SIGKILL) while converting: every record is in one of the two tables, and
    the next open finishes the conversion with every record as it was."""
    path = tmp_path / "db"
    parts = {
        (topic, p): {o: _value(o, os.urandom(8) + b"c" * 92) for o in range(n)}
        for topic, p, n in (("t", P1, 150_000), ("t", P2, 50_000), ("u", P1, 3))
    }
    write_format1(path, parts)
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", _CONVERT, str(path)], env=env)
    killed_mid_way = False
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            records, blocks, _fmt, converting = _tables(path)
            if converting and blocks and records:
                os.kill(proc.pid, signal.SIGKILL)
                killed_mid_way = True
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert killed_mid_way, "the conversion ended before the test could kill it"
    records, blocks, fmt, converting = _tables(path)
    assert records and blocks and converting and fmt == layout.U32.pack(2)
    with pytest.raises(StorageError, match="being converted"):
        RecordDB(path, readonly=True)
    with RecordDB(path) as db:
        for (topic, partition), recs in parts.items():
            start, values = db.fetch_raw(topic, partition, 0, 10**6)
            assert start == 0 and values == [recs[o] for o in range(len(recs))]
            info = db.info(topic, partition)
            assert info is not None and info.count == len(recs)
    records, blocks, fmt, converting = _tables(path)
    assert records == 0 and blocks and not converting


def test_a_format1_version_refuses_a_format2_database_saying_so(tmp_path: Path) -> None:
    """Format-1 versions open meta, partitions, pids and records, then refuse any format but 1.
    (Checked by hand against the code before format 2: "record database format 2, this code
    reads 1", read-only or not.)  The empty ``records`` table keeps that message."""
    with RecordDB(tmp_path / "db") as db:
        db.append([("t", P1, 0, b"x", 1)])
    env = lmdb.open(str(tmp_path / "db"), max_dbs=8, readonly=True, lock=True, map_size=0)
    try:
        meta, *_others = (env.open_db(name, create=False) for name in (b"meta", b"partitions", b"pids", b"records"))
        with env.begin() as txn:
            assert txn.get(b"format", db=meta) == layout.U32.pack(2)
    finally:
        env.close()
