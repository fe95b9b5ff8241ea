"""A consumer process for tests/test_peer_flood.py: ``python tests/flood_consumer.py IN_PORT OUT_PORT TOPIC``.

It consumes TOPIC through the tower at 127.0.0.1:IN_PORT/OUT_PORT and prints
``got <count>`` after every record, and ``peers <n>`` once a second.
"""

from __future__ import annotations

import sys
import time

from dafka.config import NodeConfig, TowerAddress
from dafka.nodes.consumer import Consumer


def main() -> None:
    in_port, out_port, topic = sys.argv[1:4]
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", int(in_port), int(out_port)),),
        bind="127.0.0.1",
        beacon_interval=0.2,
        beacon_timeout=2.0,
    )
    got = 0
    with Consumer(topic, cfg, offset_reset="earliest") as consumer:
        next_report = 0.0
        for _ in range(1_000_000):  # bounded: the test kills it long before
            record = consumer.poll(0.1)
            if record is not None:
                got += 1
                print("got", got, flush=True)
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + 1.0
                print("peers", len(consumer.peers), flush=True)


if __name__ == "__main__":
    main()
