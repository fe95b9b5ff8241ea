"""An edge device for tests/test_outbox.py: publishes ``rec-<i>`` into an outbox.

    python tests/outbox_device.py TOWER OUTBOX TOTAL SYNC [PAUSE]

Continues at the outbox's next offset, publishes records up to ``TOTAL`` one
``publish`` at a time (printing ``published <offset>`` once each returned),
pausing ``PAUSE`` seconds between them, then waits for every ACK and prints
``acked``.  Tests kill it with SIGKILL at any point.
"""

from __future__ import annotations

import sys
import time

from dafka.config import NodeConfig, TowerAddress
from dafka.nodes.producer import Producer


def main() -> int:
    tower, outbox, total, sync = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    host, tin, tout = tower.split(":")
    cfg = NodeConfig(towers=(TowerAddress(host, int(tin), int(tout)),), bind="127.0.0.1", beacon_interval=0.2)
    producer = Producer("readings", cfg, outbox=outbox, outbox_sync=sync, head_interval=0.2)
    print(f"start {producer.next_offset} {producer.address}", flush=True)
    while producer.next_offset < total:
        receipt = producer.publish(b"rec-%d" % producer.next_offset)
        print(f"published {receipt.offset}", flush=True)
        if pause:
            time.sleep(pause)
    ok = producer.flush(120)
    print("acked" if ok else "not acked", flush=True)
    producer.close(5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
