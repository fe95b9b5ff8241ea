"""A leaf device with an outbox, for tests/test_leaf_outbox.py: publishes ``rec-<offset>`` records.

    python tests/leaf_outbox_device.py ENDPOINTS OUTBOX TOTAL PAUSE ACK_TIMEOUT

Continues the outbox's partition (a new outbox starts one) until offset ``TOTAL - 1``, pausing
``PAUSE`` seconds between records. Prints ``start <next> <address>``, then ``durable <offset>``
once ``publish`` returned for an offset (on the outbox's disk, fsync'ed), ``acked <offset>`` when
the acknowledged offset moves, ``endpoint <HOST:PORT>`` when it fails over, and ``done`` once
everything is acknowledged. Tests kill it, or its endpoints, with SIGKILL at any point.
"""

from __future__ import annotations

import sys
import time

from dafka.nodes.producer import Producer


def main() -> int:
    endpoints, outbox, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pause, ack_timeout = float(sys.argv[4]), float(sys.argv[5])
    producer = Producer("readings", leaf=endpoints, outbox=outbox, ack_timeout=ack_timeout,
                        connect_timeout=ack_timeout, head_interval=0.2)
    print(f"start {producer.next_offset} {producer.address}", flush=True)
    acked, endpoint = producer.acked_offset, producer.endpoint  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if producer.next_offset < total:
            offset = producer.next_offset
            producer.publish(b"rec-%d" % offset)
            print(f"durable {offset}", flush=True)
        if producer.acked_offset != acked:
            acked = producer.acked_offset
            print(f"acked {acked}", flush=True)
        if producer.endpoint != endpoint:  # type: ignore[attr-defined]
            endpoint = producer.endpoint  # type: ignore[attr-defined]
            print(f"endpoint {endpoint}", flush=True)
        if acked == total - 1:
            break
        time.sleep(pause)
    print("done" if acked == total - 1 else "not acked", flush=True)
    producer.close(5)
    return 0 if acked == total - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
