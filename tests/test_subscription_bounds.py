"""Hostile: subscriptions flooding a plain tower's beacon-out port, and oversize ones on nodes' ports.

ZeroMQ's XPUB keeps every subscription a subscriber sends, about 50 bytes per
byte of a random prefix, before the application reads any: 20 MB of them took
a tower past 1 GB.  A plain tower reads them itself (dafka.nodes.tower_front)
and bounds them; this test floods a real `dafka tower` process over raw TCP
(ZMTP 3.0 and 3.1 subscriptions) and checks its peak memory and that a
producer and a consumer still meet through it meanwhile.  Nodes' publishers
(libzmq XPUBs and PUBs) and the tower's beacons-in XSUB cut a connection whose
frame is longer than they ever need (ZMQ_MAXMSGSIZE).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from dafka.config import NodeConfig, TowerAddress
from dafka.core import beacon, wire, zmtp
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from tests.conftest import dafka_cmd, poll_record, spawned, subprocess_env, wait_until

pytestmark = pytest.mark.timeout(60)

RSS_LIMIT_MB = 200
FLOOD_BYTES = 30_000_000  # in all, over every connection
FLOOD_SECONDS = 6.0
SUBSCRIPTION = 64  # bytes of random prefix each

_GREETING_TAIL = b"NULL".ljust(20, b"\0") + bytes(32)
_READY_SUB = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def zmtp_sub(port: int, minor: int, timeout: float = 5.0) -> socket.socket:
    """A raw TCP connection that has done the ZMTP 3.<minor> NULL handshake as a SUB."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(b"\xff" + bytes(7) + b"\x01\x7f" + bytes((3, minor)) + _GREETING_TAIL)
    sock.sendall(b"\x04" + bytes((len(_READY_SUB),)) + _READY_SUB)
    got = b""
    # Greeting (64) and the server's READY: send nothing more before it came
    # (libzmq refuses commands that arrive before its own handshake is done).
    while len(got) < 66 or len(got) < 66 + got[65]:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        got += chunk
    return sock


def subscriptions(minor: int, n: int, size: int = SUBSCRIPTION) -> bytes:
    """``n`` random subscriptions of ``size`` bytes, as a libzmq SUB sends them to a ZMTP 3.<minor> peer."""
    body = os.urandom(n * size)
    if size <= 245:  # by hand, the short frames a flooder sends most
        if minor >= 1:  # ZMTP 3.1: a SUBSCRIBE command
            head = b"\x04" + bytes((size + 10,)) + b"\x09SUBSCRIBE"
        else:  # ZMTP 3.0: a message of 0x01 + the prefix
            head = b"\x00" + bytes((size + 1,)) + b"\x01"
        return b"".join(head + body[i : i + size] for i in range(0, len(body), size))
    if minor >= 1:
        return b"".join(zmtp.command(b"SUBSCRIBE", body[i : i + size]) for i in range(0, len(body), size))
    return b"".join(zmtp.frame(b"\x01" + body[i : i + size]) for i in range(0, len(body), size))


class Flood:
    """Threads that send random subscriptions, reconnecting when cut, until a byte budget or deadline."""

    def __init__(self, port: int, threads: int = 4) -> None:
        self.port = port
        self.sent = 0
        self.cuts = 0
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + FLOOD_SECONDS
        self.threads = [threading.Thread(target=self.run, args=(i % 2,), daemon=True) for i in range(threads)]

    def start(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        for t in self.threads:
            t.join(FLOOD_SECONDS + 10)

    def run(self, minor: int) -> None:
        for _ in range(10_000):  # connections; bounded by bytes and time too
            if self.sent >= FLOOD_BYTES or time.monotonic() >= self.deadline:
                return
            try:
                sock = zmtp_sub(self.port, minor)
            except OSError:
                time.sleep(0.01)
                continue
            try:
                while self.sent < FLOOD_BYTES and time.monotonic() < self.deadline:
                    chunk = subscriptions(minor, 4096)  # new ones each time: ZeroMQ keeps each once
                    sock.sendall(chunk)
                    with self.lock:
                        self.sent += len(chunk)
            except OSError:
                with self.lock:
                    self.cuts += 1
            finally:
                sock.close()


def memory_mb(pid: int, field: str = "VmHWM") -> int:
    """A process's peak (VmHWM) or current (VmRSS) resident memory."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise AssertionError(f"no {field}")


def unread(port: int) -> int:
    """Bytes sent to 127.0.0.1:``port`` that its process has not read yet: in its sockets' receive
    queues, and still in the senders' send queues (Linux's /proc/net/tcp)."""
    end = f"0100007F:{port:04X}"
    left = 0
    with open("/proc/net/tcp") as f:
        for line in f:
            if end not in line:
                continue
            fields = line.split()
            tx, rx = (int(x, 16) for x in fields[4].split(":"))
            left += rx if fields[1] == end else tx if fields[2] == end else 0
    return left


def read_all(port: int, timeout: float = 20.0) -> None:
    """Wait until the process on ``port`` has read all its clients sent it (and so acted on it)."""
    wait_until(lambda: unread(port) == 0, timeout, 0.05)


def closed(sock: socket.socket) -> bool:
    """Whether the other side has closed ``sock`` (EOF or reset); what it sent before is read and dropped."""
    sock.setblocking(False)
    for _ in range(100):
        try:
            if not sock.recv(65536):
                return True
        except BlockingIOError:
            return False
        except OSError:
            return True
    return False


@pytest.fixture
def tower_proc() -> tuple[subprocess.Popen, NodeConfig]:
    in_port, out_port = free_port(), free_port()
    proc = spawned(
        subprocess.Popen(
            dafka_cmd("tower", "--bind", "127.0.0.1", "--in-port", str(in_port), "--out-port", str(out_port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=subprocess_env(),
        )
    )
    assert b"tower up" in proc.stdout.readline()  # type: ignore[union-attr]
    cfg = NodeConfig(
        towers=(TowerAddress("127.0.0.1", in_port, out_port),),
        bind="127.0.0.1",
        beacon_interval=0.2,
        beacon_timeout=2.0,
    )
    return proc, cfg


def test_subscription_flood_keeps_a_plain_tower_small_and_serving(tower_proc) -> None:
    proc, cfg = tower_proc
    flood = Flood(cfg.towers[0].out_port).start()
    try:
        # While the flood runs: a producer and a consumer still find each other and records flow.
        with Consumer("flooded", cfg, offset_reset="earliest") as consumer, Producer(
            "flooded", cfg, acks=False
        ) as producer:
            wait_until(lambda: producer.address in consumer.peers and consumer.address in producer.peers, 15)
            producer.publish(b"through the flood")
            record = poll_record(consumer)
            assert record is not None and record.content == b"through the flood"
    finally:
        flood.join()
    assert proc.poll() is None, "the tower died"
    assert flood.sent >= 5_000_000, f"the flood sent only {flood.sent} bytes"
    assert flood.cuts >= 1, "no flooding connection was cut: the flood never reached a bound"
    read_all(cfg.towers[0].out_port)
    peak = memory_mb(proc.pid)
    assert peak < RSS_LIMIT_MB, f"tower peaked at {peak} MB after {flood.sent / 1e6:.0f} MB of subscriptions"


def test_many_connections_each_under_its_bound_stay_within_the_total(tower_proc) -> None:
    """Twenty-four connections of 7,000 subscriptions of 300 bytes each (under one connection's
    bounds): those holding the most are cut once all hold more than the total bound; a real
    subscriber keeps hearing."""
    import zmq

    proc, cfg = tower_proc
    out_port = cfg.towers[0].out_port
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, wire.WELCOME)
    sub.setsockopt(zmq.SUBSCRIBE, beacon.HELLO)  # the tower's hello, every 2 s
    sub.connect(f"tcp://127.0.0.1:{out_port}")
    floods: list[socket.socket] = []
    try:
        assert sub.poll(5000)
        assert sub.recv_multipart() == [wire.WELCOME]
        n, size = 7_000, 300
        assert n * (size + zmtp.ENTRY_COST) < zmtp.PEER_BYTES and n < zmtp.PEER_SUBSCRIPTIONS
        fit = zmtp.TOTAL_BYTES // (n * (size + zmtp.ENTRY_COST + zmtp.HOLDING_COST)) + 1
        for i in range(24):
            sock = zmtp_sub(out_port, i % 2)
            floods.append(sock)
            try:
                sock.sendall(subscriptions(i % 2, n, size))
            except OSError:
                pass  # cut already: counted below
        read_all(out_port)
        assert proc.poll() is None
        peak = memory_mb(proc.pid)
        assert peak < RSS_LIMIT_MB, f"tower peaked at {peak} MB"
        # It read every subscription: those over the total are cut (reading the last one and
        # cutting are one step of the tower's, so the count is waited for, in case the test
        # looked between them).
        cut = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            cut = sum(closed(sock) for sock in floods)
            if cut >= 24 - fit:
                break
            time.sleep(0.05)
        assert cut >= 24 - fit, f"only {cut} of 24 connections cut"
        while sub.poll(0):
            sub.recv_multipart()
        assert sub.poll(5000), "the real subscriber was cut too"
    finally:
        sub.close(0)
        for sock in floods:
            sock.close()


def wait_closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other side closed ``sock`` (EOF or reset) within ``timeout``; reads what comes."""
    sock.settimeout(0.05)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_producers_data_port_cuts_an_oversize_subscription(cfg: NodeConfig) -> None:
    with Consumer("bounded", cfg, offset_reset="earliest") as consumer, Producer("bounded", cfg, acks=False) as producer:
        wait_until(lambda: producer.address in consumer.peers and consumer.address in producer.peers)
        longest = b"M" + b"t" * 255 + b"\x00"  # as long as a node's subscriptions get (and a batch twin's)
        kept = zmtp_sub(producer.port, 1)
        kept.sendall(zmtp.command(b"SUBSCRIBE", longest))
        cut = [zmtp_sub(producer.port, minor) for minor in (0, 1)]
        oversize = os.urandom(2000)
        cut[0].sendall(b"\x02" + (len(oversize) + 1).to_bytes(8, "big") + b"\x01" + oversize)
        cut[1].sendall(b"\x06" + (len(oversize) + 10).to_bytes(8, "big") + b"\x09SUBSCRIBE" + oversize)
        try:
            assert all(wait_closed(sock) for sock in cut)
            assert not wait_closed(kept, 0.3)
            producer.publish(b"still serving")
            record = poll_record(consumer)
            assert record is not None and record.content == b"still serving"
        finally:
            kept.close()
            for sock in cut:
                sock.close()


def test_tower_beacons_in_cuts_an_oversize_frame(tower_proc) -> None:
    """A 'beacon' of 100 MB is refused on its header, not assembled."""
    _, cfg = tower_proc
    sock = socket.create_connection(("127.0.0.1", cfg.towers[0].in_port), timeout=5)
    try:
        sock.sendall(b"\xff" + bytes(7) + b"\x01\x7f" + bytes((3, 1)) + _GREETING_TAIL)
        ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"
        sock.sendall(b"\x04" + bytes((len(ready),)) + ready)
        sock.sendall(b"\x02" + (100_000_000).to_bytes(8, "big") + b"B" * 65536)
        assert wait_closed(sock)
    finally:
        sock.close()
