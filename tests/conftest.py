"""Shared fixtures: a tower on ephemeral loopback ports and a raw ZeroMQ test peer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, settings

from dafka.config import NodeConfig, TowerAddress
from dafka.core import wire
from dafka.nodes.node import new_address
from dafka.nodes.tower import Tower

ROOT = Path(__file__).resolve().parent.parent

# Fuzz tests check behaviour, not speed: no per-example deadline, so a loaded
# 2-core CI machine cannot make them flaky.
settings.register_profile("dafka", deadline=None, suppress_health_check=[HealthCheck.too_slow])
# `make fuzz-deep`: many more examples per fuzz test, to find what a CI run would only
# meet by chance (a run draws fresh examples each time).
settings.register_profile("deep", parent=settings.get_profile("dafka"), max_examples=2000)
settings.load_profile(os.environ.get("DAFKA_HYPOTHESIS_PROFILE", "dafka"))

# A shell starts a background job (`make test > log &`, `nohup make test &`) with
# SIGINT ignored, and an ignored signal stays ignored across fork and exec: every
# process the tests start then ignored the Ctrl-C a test sends it (Python raises
# KeyboardInterrupt only where SIGINT was not ignored at its start), and the Ctrl-C
# tests failed however the code behaved (`dafka consume` never exited, `dafka bench`
# ran to its end).  The tests play a user at a terminal: what they start gets SIGINT
# at its default (a handler is reset to the default by exec; an ignored signal is not).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it is truthy or ``timeout`` passes (then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)



def poll_record(consumer: Any, timeout: float = 10.0) -> Any:
    """The consumer's next record, polled for at most ``timeout`` seconds (None if none came)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = consumer.poll(0.2)
        if record is not None:
            return record
    return None

@pytest.fixture
def tower() -> Any:
    with Tower("127.0.0.1", 0, 0) as t:
        yield t


@pytest.fixture
def cfg(tower: Tower) -> NodeConfig:
    return NodeConfig(
        towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
        beacon_timeout=2.0,
    )


def tower_flag(cfg: NodeConfig) -> str:
    t = cfg.towers[0]
    return f"{t.host}:{t.in_port}:{t.out_port}"


def dafka_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dafka.cli", *args]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("DAFKA_TOWERS", None)
    env.pop("DAFKA_CONFIG", None)
    return env



# Processes a test started (spawned): killed after the test, so a failing test
# never leaves nodes running that would disturb the next ones.
_SPAWNED: list[subprocess.Popen] = []


def spawned(proc: subprocess.Popen) -> subprocess.Popen:
    """Register ``proc`` to be killed when the current test ends."""
    _SPAWNED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_orphan_processes() -> Any:
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def start_store_process(cfg: NodeConfig, db: Path) -> subprocess.Popen:
    """A `dafka store` process on the test's tower, once it says it is up."""
    proc = spawned(
        subprocess.Popen(
            dafka_cmd("store", "--db", str(db), "--tower", tower_flag(cfg), "--bind", "127.0.0.1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=subprocess_env(),
        )
    )
    line = proc.stdout.readline()
    assert b"store up" in line, line
    return proc


def _tcp_states_to(port: int) -> set[str]:
    """The states (hex, as /proc/net/tcp) of this host's IPv4 connections whose remote port is ``port``."""
    states = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:
                states.add(fields[3])
    return states


def handshakes_end_in_connect(monkeypatch: pytest.MonkeyPatch, refusals: dict[int, Callable[[], int]]) -> None:
    """From now on, a ZeroMQ ``connect()`` to a port of ``refusals`` returns only once
    the connecting side has given that connection up after a refused handshake.

    ``refusals[port]()`` counts the handshakes the listener there refused.  Given up:
    at least one refused, none of our connections open (established, connecting, or
    half closed by the listener), and no new attempt (ZeroMQ reconnects after 0.1 s
    when the connection broke before the handshake could fail) for half a second.
    Only the first connect() to each port waits (a node's later reconnects do not).
    As on a loaded machine, where ZeroMQ's I/O thread runs on while the caller waits
    for the CPU: whatever the caller does after connect() comes after the refusal.
    """
    real_connect = zmq.Socket.connect
    quiet = 0.5

    def connect(sock: zmq.Socket, addr: str) -> Any:
        result = real_connect(sock, addr)
        port = int(addr.rsplit(":", 1)[1]) if addr.startswith("tcp://") else -1
        refused = refusals.pop(port, None)
        if refused is not None:
            state: list[Any] = [None, 0.0]  # the (refusals, open) last seen, since when

            def given_up() -> bool:
                now = (refused(), bool(_tcp_states_to(port) & {"01", "02", "08"}))
                if now != state[0]:
                    state[:] = [now, time.monotonic()]
                return now[0] > 0 and not now[1] and time.monotonic() - state[1] >= quiet

            wait_until(given_up, timeout=10, interval=0.005)
        return result

    monkeypatch.setattr(zmq.Socket, "connect", connect)


class RawPeer:
    """A hand-driven mesh node made of raw ZeroMQ sockets.

    It beacons to the tower, connects to the peers the tower announces and
    records every message it receives, so tests can play a store or a
    producer byte by byte (including malformed bytes).
    """

    def __init__(
        self, cfg: NodeConfig, subscriptions: list[bytes], xpub: bool = True, hears_fetches: bool = True
    ) -> None:
        self.ctx = zmq.Context.instance()
        self.address = new_address()
        if hears_fetches:
            # As every producer: a store gives a live producer's holes up only
            # after FETCHes it could hear (see PartitionTracker.unheard).
            subscriptions = [*subscriptions, wire.P_FETCH + self.address.encode()]
        self.pub = self.ctx.socket(zmq.XPUB if xpub else zmq.PUB)
        if xpub:
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        for s in subscriptions:
            self.sub.setsockopt(zmq.SUBSCRIBE, s)
        self.bpub = self.ctx.socket(zmq.PUB)
        self.bpub.setsockopt(zmq.LINGER, 0)
        self.bsub = self.ctx.socket(zmq.SUB)
        self.bsub.setsockopt(zmq.LINGER, 0)
        self.bsub.setsockopt(zmq.SUBSCRIBE, b"B")
        t = cfg.towers[0]
        self.bpub.connect(t.beacon_in)
        self.bsub.connect(t.beacon_out)
        self.peers: set[str] = set()
        self.received: list[list[bytes]] = []
        self.subscriptions: list[bytes] = []
        self._last_beacon = 0.0
        self.xpub = xpub

    def close(self) -> None:
        for s in (self.pub, self.sub, self.bpub, self.bsub):
            s.close(0)

    def pump(self, duration: float = 0.05) -> None:
        """Beacon, connect to new peers, collect messages for ``duration`` seconds."""
        poller = zmq.Poller()
        poller.register(self.bsub, zmq.POLLIN)
        poller.register(self.sub, zmq.POLLIN)
        if self.xpub:
            poller.register(self.pub, zmq.POLLIN)
        end = time.monotonic() + duration
        while True:
            now = time.monotonic()
            if now - self._last_beacon > 0.2:
                self.bpub.send_multipart(wire.node_beacon(self.address, "", self.port))
                self._last_beacon = now
            remaining = end - now
            if remaining <= 0:
                break
            for sock, _ in poller.poll(max(1, int(remaining * 1000))):
                if sock is self.bsub:
                    frames = self.bsub.recv_multipart()
                    if len(frames) == 3 and frames[1].decode() != self.address:
                        endpoint = frames[2].decode()
                        if endpoint not in self.peers:
                            self.peers.add(endpoint)
                            self.sub.connect(endpoint)
                elif sock is self.sub:
                    self.received.append(self.sub.recv_multipart())
                else:
                    self.subscriptions.append(self.pub.recv())

    def wait_for(self, predicate: Callable[[RawPeer], Any], timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"peer condition not met within {timeout}s; received {self.received[-5:]!r}"
                )
            self.pump(0.05)

    def send(self, msg: wire.Message) -> None:
        self.pub.send_multipart(wire.encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def messages(self, kind: type | None = None) -> list[Any]:
        out = []
        for frames in self.received:
            try:
                msg = wire.decode(frames)
            except Exception:
                continue
            if kind is None or isinstance(msg, kind):
                out.append(msg)
        return out

    def subscribed(self, prefix: bytes) -> bool:
        return any(s[:1] == b"\x01" and s[1:].startswith(prefix) for s in self.subscriptions)


@pytest.fixture
def raw_peer(cfg: NodeConfig) -> Any:
    peers: list[RawPeer] = []

    def make(subscriptions: list[bytes], xpub: bool = True, hears_fetches: bool = True) -> RawPeer:
        peer = RawPeer(cfg, subscriptions, xpub, hears_fetches)
        peers.append(peer)
        return peer

    yield make
    for p in peers:
        p.close()


def misframed_stream(topic: str, address: str, n: int) -> list[list[bytes]]:
    """Records 0..n-1 of a partition, each followed by a one-frame and a
    three-frame RECORD of the next offset: a reader that is not frame-exact
    pairs the one-frame header with the next message's header, or keeps the
    three-frame message's second frame, and delivers wrong content."""
    out: list[list[bytes]] = []
    for i in range(n):
        out.append(wire.encode(wire.Record(topic, address, topic, i, b"good %d" % i)))
        header = wire.encode(wire.Record(topic, address, topic, i + 1, b""))[0]
        out.append([header])
        out.append([header, b"bad", b"third frame"])
    return out


# Tests that must share one worker of a parallel run (pytest-xdist, `-n`): the
# Spark tests share one SparkSession (one JVM a run, not one a worker) and the
# examples that start a Spark of their own wait for it there (two JVMs at once
# on 2 cores starved the edge pipeline's devices); the docs' code blocks all
# start at once from one module fixture (tests/test_docs.py).
XDIST_GROUPS = (("tests/spark/", "spark"), ("tests/test_examples.py", "spark"), ("tests/test_docs.py", "docs"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Load scheduling (each test to the next free worker) that keeps XDIST_GROUPS together.

    xdist's own ``--dist loadgroup`` does not work with pytest 9 (it renames
    ``item._nodeid``, which pytest 9 no longer reads), so the groups are made
    here from the test's path.
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupedLoad(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in XDIST_GROUPS:
                if nodeid.startswith(prefix):
                    return group
            return nodeid

    return GroupedLoad(config, log)
