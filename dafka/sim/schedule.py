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
``topo s d``      (first step only) the world has s stores (2..3) and d edge
                  devices (0..1): producers with an outbox (:mod:`dafka.outbox`)
``offline n ms``  node n's network is cut for ms, longer than ``isolate``
                  (a store or consumer for up to 25 s, past skip_after; a
                  producer or device for up to PRODUCER_CUT_MAX);
                  a node cut off past the beacon timeout (4 s) is gone for its
                  peers, and meets them again when the cut ends
``freeze s ms``   store s is stopped (SIGSTOP) past skip_after (12..20 s): the
                  other stores give up what only it holds (recorded holes) and
                  repair them from it once it continues.  Applied only while
                  every acknowledged record it holds (an ACK it sent that is
                  still on the wire included) is held by another live store
                  too (otherwise it is a plain ``stop`` of 5 s): a record
                  whose only holder is away past skip_after is skipped by
                  readers by design (skip_after bounds how long they wait).

A schedule without a ``topo`` step runs in :data:`TOPOLOGY` (2 stores, no
device).  :func:`generate` makes schedules with every kind;
:func:`generate_classic` the schedules of the first generator (no ``topo``,
``offline`` or ``freeze``), which the seeds pinned before them were found with.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from dafka.sim.network import NET_MODES

KINDS = ("publish", "lose", "wait", "net", "isolate", "crash", "disk", "hostile", "stop", "topo", "offline", "freeze")
MODES = tuple(NET_MODES)
HOSTILE_KINDS = 8


class Topology(NamedTuple):
    stores: int = 2
    consumers: int = 2
    producers: int = 2  # acknowledged producers (a window of CAPACITY)
    ring_producers: int = 1  # producers without stores' ACKs (a ring of RING_CAPACITY)
    devices: int = 0  # producers with an edge outbox (ACKs; the outbox survives a kill)


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
    """Nodes a ``crash`` / ``isolate`` step can name: stores, consumers, producers, devices."""
    return top.stores + top.consumers + top.producers + top.ring_producers + top.devices


# Generated ``offline`` steps cut a producer (or device) off for at most this
# many ms: past skip_after, so the stores give up its missing offsets (a hole)
# and must ask it for them when it is back before they ACK past them (tests/test_sim.py
# test_a_store_acks_past_a_hole_before_asking_the_producer_back; dafka.store.holes).
PRODUCER_CUT_MAX = 25000
MAX_STORES = 3
MAX_DEVICES = 1


def topology(schedule: list[Step]) -> Topology:
    """The world a schedule runs in: :data:`TOPOLOGY`, or its first step's ``topo``."""
    if schedule and schedule[0].kind == "topo":
        step = schedule[0]
        return TOPOLOGY._replace(
            stores=min(max(step.a, 1), MAX_STORES), devices=min(max(step.b, 0), MAX_DEVICES)
        )
    return TOPOLOGY


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


def _make(rng: random.Random, kind: str, s: int, top: Topology, producers: int) -> Step:
    """One step of ``kind`` with its numbers drawn from ``rng`` (the first generator's draws)."""
    if kind == "publish":
        return Step(kind, rng.randrange(producers), rng.choice((1, 1, 2, 3, 5, 8, 20)), s)
    if kind == "lose":
        return Step(kind, rng.randrange(producers), rng.randint(1, 2 * RING_CAPACITY), s)
    if kind == "wait":
        return Step(kind, rng.choice((20, 100, 300, 1000, 3000, 11000)), 0, s)
    if kind == "net":
        return Step(kind, rng.randrange(len(MODES)), 0, s)
    if kind == "isolate":
        return Step(kind, rng.randrange(node_count(top)), rng.choice((200, 1000, 3000)), s)
    if kind == "crash":
        return Step(kind, rng.randrange(node_count(top)), rng.choice((50, 500, 1500, 3000)), s)
    if kind == "disk":
        return Step(kind, rng.randrange(top.stores), rng.choice((500, 3000, 8000)), s)
    if kind == "stop":
        return Step(kind, rng.randrange(top.stores), rng.choice((500, 2000, 5000)), s)
    if kind == "offline":
        # Mostly a device (the last nodes), else any node.
        if top.devices and rng.random() < 0.7:
            node = node_count(top) - 1 - rng.randrange(top.devices)
        else:
            node = rng.randrange(node_count(top))
        if node >= top.stores + top.consumers:
            # A producer or device: past skip_after too (see PRODUCER_CUT_MAX).
            return Step(kind, node, rng.choice((2000, 12000, PRODUCER_CUT_MAX)), s)
        return Step(kind, node, rng.choice((2000, 12000, 25000)), s)
    if kind == "freeze":
        return Step(kind, rng.randrange(top.stores), rng.choice((12000, 20000)), s)
    return Step(kind, rng.randrange(HOSTILE_KINDS), rng.getrandbits(16), s)


def generate_classic(seed: int, steps: int = 120, top: Topology = TOPOLOGY) -> list[Step]:
    """The schedule of ``seed`` by the first generator: ``steps`` random steps."""
    rng = random.Random(seed)
    kinds = [k for k, _ in _WEIGHTS]
    weights = [w for _, w in _WEIGHTS]
    producers = top.producers + top.ring_producers
    out = []
    for _ in range(steps):
        kind = rng.choices(kinds, weights)[0]
        out.append(_make(rng, kind, rng.getrandbits(32), top, producers))
    return out


_WEIGHTS_V2 = (*_WEIGHTS, ("offline", 3), ("freeze", 2))


def generate(seed: int, steps: int = 120) -> list[Step]:
    """The schedule of ``seed``: a ``topo`` step, then ``steps`` random steps of every kind.

    Half the worlds have 3 stores, half an edge device (independently).
    """
    rng = random.Random(seed ^ 0x5EED_0002)
    top = TOPOLOGY._replace(stores=rng.choice((2, 3)), devices=rng.choice((0, 1)))
    out = [Step("topo", top.stores, top.devices, 0)]
    kinds = [k for k, _ in _WEIGHTS_V2]
    weights = [w for _, w in _WEIGHTS_V2]
    producers = top.producers + top.ring_producers + top.devices
    for _ in range(steps):
        kind = rng.choices(kinds, weights)[0]
        out.append(_make(rng, kind, rng.getrandbits(32), top, producers))
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
