"""A hostile tower for tests/test_peer_flood.py: the C tower (tests/c_tower.py) that also
announces made-up producers.

Run as ``python tests/rogue_tower.py TOPIC FAKES SINK_PORT [SINK_PORT...]``.  It relays the
real nodes' beacons as the C tower does and, every 0.2 s, relays an interest beacon
(``X P <topic> NUL``, in batches of 16 as a dafka tower sends them) for each of
``FAKES`` made-up producer addresses, at ``tcp://127.0.0.1:<sink port>`` in turn.
The sinks (the test's) accept TCP connections and close them: ZeroMQ connects
again and again.  It prints ``ports IN OUT`` and serves until killed.
"""

from __future__ import annotations

import sys
import time
import uuid

from dafka.core import beacon
from tests.c_tower import CTower


class RogueTower(CTower):
    def __init__(self, topic: str, fakes: int, sinks: list[int]) -> None:
        super().__init__()
        self.head = beacon.head(beacon.PRODUCER, topic.encode())
        self.fakes = [
            (uuid.uuid4().hex.upper().encode(), b"tcp://127.0.0.1:%d" % sinks[i % len(sinks)]) for i in range(fakes)
        ]
        self.next_flood = 0.0

    def poll_ms(self) -> int:
        return 20

    def idle(self) -> None:
        now = time.monotonic()
        if now < self.next_flood:
            return
        self.next_flood = now + 0.2
        for i in range(0, len(self.fakes), beacon.RELAY_BATCH):
            frames = [self.head]
            for address, endpoint in self.fakes[i : i + beacon.RELAY_BATCH]:
                frames += [address, endpoint]
            self.xpub.send_multipart(frames)


def main() -> None:
    topic, fakes, *sinks = sys.argv[1:]
    tower = RogueTower(topic, int(fakes), [int(s) for s in sinks])
    print("ports", tower.in_port, tower.out_port, flush=True)
    tower.run()


if __name__ == "__main__":
    main()
