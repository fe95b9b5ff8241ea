"""A mesh consumer for tests/test_multihost.py's regions: reads partitions until it has them whole.

    python tests/region_reader.py TOWER BIND TIMEOUT PARTITION=COUNT [PARTITION=COUNT ...]

Reads topic ``readings`` from the beginning through the tower ``TOWER`` (its region's only one),
bound on ``BIND``, until it holds offsets ``0..COUNT-1`` of every named partition or ``TIMEOUT``
seconds pass. Prints ``ready`` once started, then one line per partition:
``PARTITION got N dup D bad B`` (D: offsets delivered twice, B: contents other than ``rec-<offset>``),
and exits 0 only when every partition is whole without a duplicate or a bad record.
"""

from __future__ import annotations

import sys
import time

from dafka.config import NodeConfig, parse_towers
from dafka.consumer import Consumer


def main() -> int:
    tower, bind, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    wanted = {p: int(n) for p, n in (arg.split("=") for arg in sys.argv[4:])}
    got: dict[str, set[int]] = {p: set() for p in wanted}
    dup = dict.fromkeys(wanted, 0)
    bad = dict.fromkeys(wanted, 0)
    cfg = NodeConfig(towers=parse_towers(tower), bind=bind)
    with Consumer("readings", cfg, offset_reset="earliest") as consumer:
        print("ready", flush=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(len(got[p]) < n for p, n in wanted.items()):
            record = consumer.poll(0.2)
            if record is None or record.partition not in wanted:
                continue
            p = record.partition
            if record.offset in got[p]:
                dup[p] += 1
            got[p].add(record.offset)
            if record.content != b"rec-%d" % record.offset:
                bad[p] += 1
    for p, n in wanted.items():
        print(f"{p} got {len(got[p] & set(range(n)))} dup {dup[p]} bad {bad[p]}", flush=True)
    whole = all(got[p] >= set(range(n)) and not dup[p] and not bad[p] for p, n in wanted.items())
    return 0 if whole else 1


if __name__ == "__main__":
    sys.exit(main())
