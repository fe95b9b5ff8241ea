"""Fault schedules: what happens in a simulated world, step by step.

A schedule is a plain list of :class:`Step`; it is generated from a seed
(:func:`generate`), written as one line of text (:func:`dumps`) and read back
(:func:`loads`), so a failing run replays exactly from its seed or from its
(shrunk) text.  Each step carries its own ``seed``: every random decision
taken while the step runs (the fate of each message, write latencies) comes
from it, so removing a step while shrinking leaves the others' decisions as
they were.

Kinds (``a``, ``b`` are the step's two numbers):

``publish p n``   producer p publishes n records
``lose p n``      producer p publishes n records whose RECORDs are all lost
                  (offsets skipped; a ring producer may evict them before
                  anyone fetched them: a gap nobody can fill)
``wait ms``       time passes
``net mode``      the network's fault mode changes (see network.NET_MODES)
``isolate n ms``  node n's traffic is lost for a while
``crash n ms``    node n is killed (kill -9: what was not committed is lost)
                  and restarted ms later
``disk s ms``     store s's disk is full (its LMDB map cannot grow) for ms
``stop s ms``     store s is stopped (SIGSTOP) for ms: it reads, commits and
                  answers nothing meanwhile; what is sent to it waits (socket
                  buffers) and is read when it continues
``hostile k x``   a hostile node sends malformed or hostile message kind k
"""

from __future__ import annotations

import random
from typing import NamedTuple

from dafka.sim.network import NET_MODES

KINDS = ("publish", "lose", "wait", "net", "isolate", "crash", "disk", "hostile", "stop")
MODES = tuple(NET_MODES)
HOSTILE_KINDS = 8


class Topology(NamedTuple):
    stores: int = 2
    consumers: int = 2
    producers: int = 2  # acknowledged producers (a window of CAPACITY)
    ring_producers: int = 1  # producers without stores' ACKs (a ring of RING_CAPACITY)


TOPOLOGY = Topology()
CAPACITY = 64
RING_CAPACITY = 6


class Step(NamedTuple):
    kind: str
    a: int
    b: int
    seed: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.a}:{self.b}:{self.seed}"


def node_count(top: Topology = TOPOLOGY) -> int:
    """Nodes a ``crash`` / ``isolate`` step can name: stores, consumers, producers."""
    return top.stores + top.consumers + top.producers + top.ring_producers


_WEIGHTS = (
    ("publish", 34),
    ("wait", 22),
    ("lose", 6),
    ("net", 8),
    ("isolate", 5),
    ("crash", 9),
    ("disk", 4),
    ("hostile", 12),
    ("stop", 5),
)


def generate(seed: int, steps: int = 120, top: Topology = TOPOLOGY) -> list[Step]:
    """The schedule of ``seed``: ``steps`` random steps."""
    rng = random.Random(seed)
    kinds = [k for k, _ in _WEIGHTS]
    weights = [w for _, w in _WEIGHTS]
    producers = top.producers + top.ring_producers
    out = []
    for _ in range(steps):
        kind = rng.choices(kinds, weights)[0]
        s = rng.getrandbits(32)
        if kind == "publish":
            out.append(Step(kind, rng.randrange(producers), rng.choice((1, 1, 2, 3, 5, 8, 20)), s))
        elif kind == "lose":
            out.append(Step(kind, rng.randrange(producers), rng.randint(1, 2 * RING_CAPACITY), s))
        elif kind == "wait":
            out.append(Step(kind, rng.choice((20, 100, 300, 1000, 3000, 11000)), 0, s))
        elif kind == "net":
            out.append(Step(kind, rng.randrange(len(MODES)), 0, s))
        elif kind == "isolate":
            out.append(Step(kind, rng.randrange(node_count(top)), rng.choice((200, 1000, 3000)), s))
        elif kind == "crash":
            out.append(Step(kind, rng.randrange(node_count(top)), rng.choice((50, 500, 1500, 3000)), s))
        elif kind == "disk":
            out.append(Step(kind, rng.randrange(top.stores), rng.choice((500, 3000, 8000)), s))
        elif kind == "stop":
            out.append(Step(kind, rng.randrange(top.stores), rng.choice((500, 2000, 5000)), s))
        else:
            out.append(Step(kind, rng.randrange(HOSTILE_KINDS), rng.getrandbits(16), s))
    return out


def dumps(schedule: list[Step]) -> str:
    return ",".join(map(str, schedule))


def loads(text: str) -> list[Step]:
    out = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        kind, a, b, s = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown step kind {kind!r}")
        out.append(Step(kind, int(a), int(b), int(s)))
    return out
