"""The I/O shell every mesh node shares: a background thread with a poller.

A node has

* a beacon PUB connected to every tower's beacon-in port, and a beacon SUB
  (subscribed to ``W`` and ``B``) connected to every tower's beacon-out port;
* a data SUB that it connects to each peer the towers announce;
* a data publisher (PUB or XPUB) bound on an ephemeral port, which the
  beacon advertises.

The loop runs in one thread, owns every socket except the ones a subclass
documents as shared, and calls the subclass hooks.  Protocol decisions live in
the sans-IO objects (``PeerTable``, ``PartitionTracker``, ``UnackedWindow``);
this module only moves bytes and time.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import zmq

from dafka import fastio, wire
from dafka.config import NodeConfig, default_node_config
from dafka.errors import ProtocolError
from dafka.peers import Connect, PeerAction, PeerTable

DRAIN = 4096  # messages read from a socket before looking at the others again
TICK = 0.05  # seconds between calls of on_tick


def new_address() -> str:
    """A node address: a UUID as 32 uppercase hex characters (as the C nodes)."""
    return uuid.uuid4().hex.upper()


class ErrorLog:
    """Counts bad input and logs it without flooding the log."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.count = 0

    def __call__(self, what: str, exc: BaseException | str) -> None:
        self.count += 1
        n = self.count
        if n <= 20 or n % 1000 == 0:
            self.log.warning("dropped malformed %s (%s); %d so far", what, exc, n)


class Node:
    """Base class of producers, consumers and stores (the I/O shell)."""

    kind = "node"
    publisher_type = zmq.PUB

    def __init__(self, config: NodeConfig | None = None, *, address: str | None = None) -> None:
        self.config = config or default_node_config()
        self.address = address or new_address()
        self.log = logging.getLogger(f"dafka.{self.kind}")
        self.bad_input = ErrorLog(self.log)
        fastio.warn_if_pure(self.log)
        self.ctx = zmq.Context.instance()
        self.peers = PeerTable(self.address, self.config.beacon_timeout)
        self._commands: deque[Callable[[], None]] = deque()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_lock = threading.Lock()
        self._timers: list[tuple[float, float, Callable[[float], None]]] = []
        self.data_paused = False
        self._readers: dict[object, Callable[[], None]] = {}

        cfg = self.config
        self.publisher = self.ctx.socket(self.publisher_type)
        self.publisher.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.publisher.setsockopt(zmq.LINGER, 2000)
        if self.publisher_type == zmq.XPUB:
            self.publisher.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.port = self.publisher.bind_to_random_port(f"tcp://{cfg.bind}")

        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, cfg.hwm)
        self.sub.setsockopt(zmq.LINGER, 0)

        self.beacon_pub = self.ctx.socket(zmq.PUB)
        self.beacon_pub.setsockopt(zmq.LINGER, 0)
        self.beacon_sub = self.ctx.socket(zmq.SUB)
        self.beacon_sub.setsockopt(zmq.LINGER, 0)
        self.beacon_sub.setsockopt(zmq.SUBSCRIBE, wire.WELCOME)
        self.beacon_sub.setsockopt(zmq.SUBSCRIBE, wire.BEACON)
        for tower in cfg.towers:
            # connect() never fails for a tower that is not up yet: ZeroMQ
            # keeps retrying, so a node may start before its tower.
            self.beacon_pub.connect(tower.beacon_in)
            self.beacon_sub.connect(tower.beacon_out)
        self._beacon = wire.node_beacon(self.address, cfg.advertise, self.port)

        wake_endpoint = f"inproc://dafka-wake-{self.address}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_endpoint)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_endpoint)

        self.every(cfg.beacon_interval, self._send_beacon)
        self.every(min(1.0, cfg.beacon_timeout / 4), self._expire_peers)
        self.every(TICK, self.on_tick)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the I/O thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"dafka-{self.kind}-{self.address[:8]}", daemon=True
        )
        self._thread.start()
        self._started.wait(5.0)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread and close its sockets."""
        if self._thread is None:
            self._close_sockets()
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.log.error("%s I/O thread did not stop within %.1fs", self.kind, timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the I/O thread (thread-safe)."""
        self._commands.append(fn)
        self._wake()

    def every(self, interval: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(now)`` in the I/O thread every ``interval`` seconds."""
        self._timers.append((interval, time.monotonic(), fn))

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # closed, or already a wake-up pending

    # ---------------------------------------------------------------- hooks

    def sockets(self) -> list[tuple[zmq.Socket, Callable[[], None]]]:
        """Extra sockets the loop polls, with their reader."""
        return []

    def on_start(self) -> None:
        """Called in the I/O thread before the loop."""

    def on_tick(self, now: float) -> None:
        """Called in the I/O thread every TICK seconds."""

    def on_data(self, frames: list[bytes]) -> None:
        """A whole message arrived on the data SUB (exactly its frames)."""

    def on_peer(self, endpoint: str, address: str) -> None:
        """A new peer was connected."""

    def has_work(self) -> bool:
        """Whether :meth:`do_work` has something to do (the loop then spins)."""
        return False

    def do_work(self) -> None:
        """A slice of background work (answering FETCHes), between polls."""

    def on_shutdown(self) -> None:
        """Called in the I/O thread after the loop, before sockets close."""

    # ---------------------------------------------------------------- loop

    def _run(self) -> None:
        poller = self._poller = zmq.Poller()
        readers = self._readers = {
            self.sub: self._read_data,
            self.beacon_sub: self._read_beacons,
            self._wake_rx: self._read_wake,
        }
        for sock in readers:
            poller.register(sock, zmq.POLLIN)
        for sock, reader in self.sockets():
            self.watch(sock, reader)
        try:
            self.on_start()
            self._send_beacon(time.monotonic())
        except Exception:
            self.log.exception("%s failed to start", self.kind)
        self._started.set()
        timers = self._timers
        stop = self._stop
        while not stop.is_set():
            now = time.monotonic()
            wait = 1.0
            for i, (interval, last, fn) in enumerate(timers):
                due = last + interval
                if due <= now:
                    timers[i] = (interval, now, fn)
                    try:
                        fn(now)
                    except Exception:
                        self.log.exception("%s timer failed", self.kind)
                    due = now + interval
                wait = min(wait, due - now)
            if self.has_work():
                wait = min(wait, 0.001)
            try:
                events = poller.poll(max(0, int(wait * 1000)))
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    break
                raise
            for sock, _ in events:
                reader = readers.get(sock)
                if reader is None:
                    continue  # unwatched by an earlier reader of this round
                try:
                    reader()
                except Exception:
                    # A bug must not kill the node; bad input is handled inside readers.
                    self.log.exception("%s failed handling input", self.kind)
            if self.has_work():
                try:
                    self.do_work()
                except Exception:
                    self.log.exception("%s failed doing work", self.kind)
        try:
            self.on_shutdown()
        except Exception:
            self.log.exception("%s shutdown hook failed", self.kind)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self.sub, self.beacon_pub, self.beacon_sub, self._wake_rx, self._wake_tx):
            sock.close(0)
        self.close_publisher()

    def close_publisher(self) -> None:
        self.publisher.close()

    def _read_wake(self) -> None:
        rx = self._wake_rx
        try:
            while True:
                rx.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass
        commands = self._commands
        while commands:
            fn = commands.popleft()
            try:
                fn()
            except Exception:
                self.log.exception("%s command failed", self.kind)

    def _read_data(self) -> None:
        on_data = self.on_data
        for frames in fastio.recv_messages(self.sub, DRAIN):
            on_data(frames)

    # ---------------------------------------------------------------- beacons

    def _send_beacon(self, now: float) -> None:
        try:
            self.beacon_pub.send_multipart(self._beacon, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no tower connected yet; the next interval retries

    def _read_beacons(self) -> None:
        sock = self.beacon_sub
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames == [wire.WELCOME]:
                # A tower (re)appeared: tell it about us right away.
                self._send_beacon(time.monotonic())
                continue
            try:
                address, endpoint = wire.decode_tower_beacon(frames)
            except ProtocolError as exc:
                self.bad_input("tower beacon", exc)
                continue
            actions = self.peers.on_beacon(address, endpoint, time.monotonic())
            for action in actions:
                self._apply_peer_action(action)

    def _apply_peer_action(self, action: PeerAction) -> None:
        if isinstance(action, Connect):
            try:
                self.sub.connect(action.endpoint)
            except zmq.ZMQError as exc:
                self.bad_input("peer endpoint", exc)
                return
            self.log.debug("connected to peer %s at %s", action.address, action.endpoint)
            # Tell the newcomer about us at once so it connects back quickly.
            self._send_beacon(time.monotonic())
            self.on_peer(action.endpoint, action.address)
        else:
            try:
                self.sub.disconnect(action.endpoint)
            except zmq.ZMQError:
                pass
            self.log.debug("dropped silent peer %s", action.address)

    def _expire_peers(self, now: float) -> None:
        for action in self.peers.expire(now):
            self._apply_peer_action(action)

    def pause_data(self, paused: bool) -> None:
        """Stop (or restart) reading the data SUB (I/O thread only).

        While paused, ZeroMQ buffers up to the high-water mark and publishers
        drop beyond it; what they drop is fetched again later.
        """
        if paused != self.data_paused:
            self.data_paused = paused
            self._poller.modify(self.sub, 0 if paused else zmq.POLLIN)

    def watch(self, sock: object, reader: Callable[[], None], events: int = zmq.POLLIN) -> None:
        """Poll another socket (ZeroMQ or plain, e.g. a TCP client) from now on (I/O thread only)."""
        # The poller reports plain sockets by file descriptor.
        self._readers[sock if isinstance(sock, zmq.Socket) else sock.fileno()] = reader  # type: ignore[attr-defined]
        self._poller.register(sock, events)

    def watch_events(self, sock: object, events: int) -> None:
        """Change what a watched socket is polled for (0: nothing, for now)."""
        self._poller.modify(sock, events)

    def unwatch(self, sock: object) -> None:
        """Stop polling a socket :meth:`watch` added."""
        self._readers.pop(sock if isinstance(sock, zmq.Socket) else sock.fileno(), None)  # type: ignore[attr-defined]
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass

    def subscribe(self, prefix: bytes) -> None:
        """Subscribe the data SUB (I/O thread only)."""
        self.sub.setsockopt(zmq.SUBSCRIBE, prefix)

    def unsubscribe(self, prefix: bytes) -> None:
        self.sub.setsockopt(zmq.UNSUBSCRIBE, prefix)
