"""A leaf device for tests/test_leaf_mesh.py: publishes ``rec-<i>`` through leaf endpoints.

    python tests/leaf_device.py ENDPOINTS IDENTITY TOTAL PAUSE ACK_TIMEOUT

Publishes records up to ``TOTAL`` (continuing the identity file's partition; ``+N``:
``N`` records from where it starts),
pausing ``PAUSE`` seconds between them, and prints ``start <next> <address>``,
then ``acked <offset>`` whenever the acknowledged offset moves, ``endpoint
<HOST:PORT>`` when it fails over, and ``done`` once everything is acknowledged.
Tests kill it, or its endpoints, with SIGKILL at any point.
"""

from __future__ import annotations

import sys
import time

from dafka.nodes.producer import Producer


def main() -> int:
    endpoints, identity, count = sys.argv[1], sys.argv[2], sys.argv[3]
    pause, ack_timeout = float(sys.argv[4]), float(sys.argv[5])
    producer = Producer("readings", leaf=endpoints, identity=identity, ack_timeout=ack_timeout,
                        connect_timeout=ack_timeout, head_interval=0.2)
    total = producer.next_offset + int(count[1:]) if count.startswith("+") else int(count)
    print(f"start {producer.next_offset} {producer.address}", flush=True)
    acked, endpoint = producer.acked_offset, producer.endpoint  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if producer.next_offset < total:
            producer.publish(b"rec-%d" % producer.next_offset)
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
