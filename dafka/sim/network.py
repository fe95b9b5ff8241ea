"""The simulated mesh: ZeroMQ-style prefix subscriptions over a seeded, faulty wire.

Every message a simulated node sends is a list of real wire frames (encoded
by :mod:`dafka.core.wire` or by the node's own code).  The network hands a copy to
every other live node with a subscription that is a prefix of the first frame
(ZeroMQ SUB semantics, a node never hears itself), each copy after its own
delay.  Faults are decided per copy by the :class:`random.Random` the world
gives it (seeded by the schedule step), so a schedule replays exactly:

* ``drop``: the copy is lost (a full queue, a reconnect);
* ``dup``: a second copy arrives later (a retry answered twice);
* ``delay`` / ``jitter``: the copy arrives late; different delays reorder
  messages (stricter than ZeroMQ, which keeps one connection's order);
* isolation: a node's traffic in both directions is lost for a while.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

# Fault levels a ``net`` step switches to: (drop, dup, base delay s, jitter s).
NET_MODES: dict[str, tuple[float, float, float, float]] = {
    "calm": (0.0, 0.0, 0.0005, 0.0005),
    "lossy": (0.04, 0.0, 0.0005, 0.002),
    "dup": (0.0, 0.08, 0.0005, 0.004),
    "slow": (0.0, 0.0, 0.05, 0.2),
    "reorder": (0.0, 0.02, 0.0005, 0.05),
    "chaos": (0.03, 0.04, 0.002, 0.1),
}


@dataclass(slots=True)
class Endpoint:
    """A node as the network sees it: its subscriptions and its inbox."""

    name: str  # the sim's name for the node (stable over restarts)
    address: str  # its mesh address (changes when a store restarts)
    prefixes: list[bytes]
    deliver: Callable[[list[bytes], str], None]  # (frames, sender name)
    alive: bool = True
    generation: int = 0  # set by attach: copies in flight to an earlier process of the node are lost

    def subscribed(self, frame: bytes) -> bool:
        # bytes.startswith takes a tuple: one C call instead of a generator per prefix.
        return frame.startswith(tuple(self.prefixes))


class Network:
    """Pending deliveries ordered by (time, sequence): deterministic given the rngs."""

    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self.mode = "calm"
        self.isolated: dict[str, float] = {}  # node name -> isolated until
        self._queue: list[tuple[float, int, str, int, str, list[bytes]]] = []
        self._generation = 0
        self._seq = 0
        self.faults: dict[str, int] = {}
        self.sent = 0
        self.delivered = 0

    def count(self, kind: str, n: int = 1) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + n

    def attach(self, endpoint: Endpoint) -> None:
        self._generation += 1
        endpoint.generation = self._generation
        self.endpoints[endpoint.name] = endpoint

    def detach(self, name: str) -> None:
        """A node died: it receives nothing more; what is in flight to it is lost."""
        self.endpoints.pop(name, None)

    def cut_off(self, name: str, now: float) -> bool:
        until = self.isolated.get(name)
        return until is not None and now < until

    def send(self, sender: str, frames: list[bytes], now: float, rng: random.Random) -> None:
        """Queue copies of ``frames`` for every subscriber but the sender."""
        if not frames:
            return
        self.sent += 1
        drop, dup, base, jitter = NET_MODES[self.mode]
        first = frames[0]
        sender_cut = self.cut_off(sender, now)
        for ep in self.endpoints.values():
            if ep.name == sender or not ep.alive or not ep.subscribed(first):
                continue
            if sender_cut or self.cut_off(ep.name, now):
                self.count("isolated")
                continue
            if drop and rng.random() < drop:
                self.count("drop")
                continue
            copies = 2 if dup and rng.random() < dup else 1
            if copies == 2:
                self.count("duplicate")
            for _ in range(copies):
                delay = base + rng.random() * jitter
                if delay > 0.01:
                    self.count("delay")
                self._seq += 1
                heapq.heappush(self._queue, (now + delay, self._seq, ep.name, ep.generation, sender, list(frames)))

    def last_from(self, sender: str) -> float | None:
        """When the last copy ``sender`` sent that is still on the wire arrives (None: none is)."""
        times = [item[0] for item in self._queue if item[4] == sender]
        return max(times) if times else None

    def next_time(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> tuple[str, str, list[bytes]] | None:
        """The next copy due at or before ``now``: (receiver name, sender name, frames).

        A copy sent to a process that was killed since is lost, also when the
        node is up again (its connections died with it): the receiver name
        is then ``""``.
        """
        if not self._queue or self._queue[0][0] > now:
            return None
        _, _, receiver, generation, sender, frames = heapq.heappop(self._queue)
        ep = self.endpoints.get(receiver)
        if ep is None or ep.generation != generation:
            return "", sender, frames
        return receiver, sender, frames

    def in_flight(self) -> int:
        return len(self._queue)
