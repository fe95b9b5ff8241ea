"""A damaged format-1 database met by the upgrade to format 2 (real LMDB).

The upgrade must refuse it with a clear StorageError naming what is damaged (the store then
says so and exits), never a bare traceback, and must lose nothing: once the damaged entry is
dealt with, the next open converts every good record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest

from dafka.store import layout
from dafka.store.db import RecordDB, StorageError
from dafka.store.upgrade import RECORDS_DB
from tests.store.test_upgrade import P1, _value, write_format1

GOOD = {o: _value(o, b"c%d" % o) for o in range(10)}
BAD_KEY = layout.pack_record_key(0, 3)


def _damaged(path: Path, damage: Callable[[Any, Any, Any], None]) -> None:
    write_format1(path, {("t", P1): dict(GOOD)})
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            damage(txn, env.open_db(RECORDS_DB, txn=txn), env.open_db(b"meta", txn=txn))
    finally:
        env.close()


DAMAGE: dict[str, tuple[Callable[[Any, Any, Any], None], str, bytes | None]] = {
    "short key": (lambda t, r, m: t.put(b"\x00\x00\x00\x00\x01", _value(1, b"x"), db=r), "key", b"\x00\x00\x00\x00\x01"),
    "long key": (lambda t, r, m: t.put(layout.pack_record_key(0, 20) + b"z", _value(1, b"x"), db=r), "key",
                 layout.pack_record_key(0, 20) + b"z"),
    "empty value": (lambda t, r, m: t.put(BAD_KEY, b"", db=r), "offset 3", BAD_KEY),
    "value shorter than its header": (lambda t, r, m: t.put(BAD_KEY, b"\x01\x02", db=r), "offset 3", BAD_KEY),
    "key slot past the value": (
        lambda t, r, m: t.put(BAD_KEY, layout.VALUE_HEADER.pack(1, layout.FLAG_KEY) + b"\xff" + b"ab", db=r),
        "offset 3", BAD_KEY,
    ),
    "format of 2 bytes": (lambda t, r, m: t.put(b"format", b"\x00\x01", db=m), "format", None),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_format1_database_is_refused_clearly_and_loses_nothing(tmp_path: Path, kind: str) -> None:
    damage, said, bad_key = DAMAGE[kind]
    path = tmp_path / "db"
    _damaged(path, damage)
    with pytest.raises(StorageError, match=said) as err:
        RecordDB(path)
    assert str(path) in str(err.value)
    with pytest.raises(StorageError):
        RecordDB(path)  # and again: nothing was left half done by the refusal
    # The operator deals with the damaged entry; every good record is then converted.
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            if bad_key is None:
                txn.put(b"format", layout.U32.pack(1), db=env.open_db(b"meta", txn=txn))
            else:
                txn.delete(bad_key, db=env.open_db(RECORDS_DB, txn=txn))
    finally:
        env.close()
    with RecordDB(path) as db:
        assert db.fetch_raw("t", P1, 0, 100) == (0, [GOOD[o] for o in range(10)] if bad_key != BAD_KEY
                                                 else [GOOD[o] for o in range(3)])
