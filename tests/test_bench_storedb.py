"""``dafka bench storedb``: the database layer's append and read rates, in CPU time."""

from __future__ import annotations

import argparse

from dafka.bench.storedb import bench_storedb


def test_bench_storedb_measures_append_and_reads() -> None:
    got = bench_storedb(argparse.Namespace(records=5000, runs=2, size=100, sync=False))
    assert set(got) == {"append_pairs", "fetch_raw 1024", "fetch_raw 1 (us)"}
    assert all(len(v) == 2 and min(v) > 0 for v in got.values())
