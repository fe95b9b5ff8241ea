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

In secure mode (``config.security``, see :mod:`dafka.security`) every socket
speaks CURVE: the publisher is a server checked by ZAP against the allow-list,
the others are clients that connect only to allow-listed keys; beacons carry
the node's public key; ACK, DIRECT-HEAD and STORE-HELLO are read from two more
SUBs (``trusted_sub`` connected to store-role peers, ``suspect_sub`` to the
rest) so that only stores are believed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from dafka import beacon, fastio, security, wire
from dafka.audience import BatchAudience
from dafka.config import NodeConfig, default_node_config
from dafka.errors import ProtocolError
from dafka.peers import Connect, PeerAction, PeerTable, TowerWatch

DRAIN = 4096  # messages read from a socket before looking at the others again
TICK = 0.05  # seconds between calls of on_tick
TIMER_SLACK = 0.001  # a timer due this soon runs with the ones due now
# What only a store may say: ACK, DIRECT-HEAD, STORE-HELLO (honoured in secure
# mode only when they arrive from a store-role key, on the trusted SUB).
# What only stores may say: ACK, DIRECT-HEAD, STORE-HELLO, and the dafka-only
# STORE-STATUS and consumer-group answers (COMMITTED, POSITIONS).
STORE_ONLY = (
    wire.P_ACK,
    wire.P_DIRECT_HEAD,
    wire.P_STORE_HELLO,
    wire.P_STORE_STATUS,
    wire.P_COMMITTED,
    wire.P_POSITIONS,
)
RECORD_IDS = (wire.P_RECORD, wire.P_DIRECT_RECORD)  # subscriptions that get a batch twin
# How records go out: a header prefix and the fastio function that sends records with it.
Route = tuple[bytes, Callable[..., int]]
RETRY_REFUSED = 1.0  # seconds before connecting again where a secure handshake was refused


def read_subscriptions(sock: zmq.Socket, limit: int = DRAIN) -> Iterator[tuple[bool, bytes]]:
    """``(subscribe?, prefix)`` of up to ``limit`` (un)subscriptions waiting on an XPUB; never blocks."""
    for _ in range(limit):
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        parsed = wire.parse_subscription(frame)
        if parsed is not None:
            yield parsed


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
        # Secure mode (a [security] config): CURVE on every mesh socket.
        sec = self.config.security
        self.guard = security.guard_for(sec) if sec else None
        self.keys = security.own_keys(sec) if sec else None
        if self.guard is not None:
            self.ctx = self.guard.ctx  # the context whose ZAP handler checks the allow-list
        self.secure = self.keys is not None
        # A secure mesh holds only dafka nodes (C nodes have no CURVE): records
        # always go out in batches there (wire.RecordBatch).  On a plain mesh they
        # do where every reader of a message took batches (its subscriptions'
        # batch twins, counted by the audience); C readers get one record a message.
        self.batches = self.secure
        self.audience = BatchAudience(enabled=self.config.batches)
        self.from_store = False  # set while a message from a store-role peer is handled
        self.forged = 0  # store-only messages (ACK, STORE-HELLO) from peers without a store key
        self._peer_keys: dict[str, bytes] = {}  # secure: peer address -> its public key
        # Secure: peer address -> (trusted_sub or suspect_sub, endpoint) it is connected on.
        self._gated: dict[str, tuple[zmq.Socket, str]] = {}
        self._refused_peers: set[str] = set()
        self._refusals: list[security.RefusalLog] = []
        self.trusted_sub: zmq.Socket | None = None
        self.suspect_sub: zmq.Socket | None = None
        self.peers = PeerTable(self.address, self.config.beacon_timeout)
        self._commands: deque[Callable[[], None]] = deque()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_lock = threading.Lock()
        self._timers: list[tuple[float, float, Callable[[float], None]]] = []
        self.data_paused = False
        self._linger_until = 0.0  # data reading rests until then (see linger_data)
        self.loop_turns = 0  # wake-ups of the I/O loop (input, timers or work)
        self.metrics_server: Any = None  # see serve_metrics
        self._readers: dict[object, Callable[[], None]] = {}

        cfg = self.config
        self.publisher = self.ctx.socket(self.publisher_type)
        self.publisher.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.publisher.setsockopt(zmq.LINGER, 2000)
        if self.publisher_type == zmq.XPUB:
            # Every subscribe and unsubscribe (a peer leaving too): the audience counts them.
            self.publisher.setsockopt(zmq.XPUB_VERBOSER, 1)
        if self.keys is not None:
            security.make_server(self.publisher, self.keys)
            self._refusals.append(security.RefusalLog(self.publisher, f"{self.kind} publisher", self.log))
        self.port = self.publisher.bind_to_random_port(f"tcp://{cfg.bind}")
        self._bound = self.publisher.getsockopt_string(zmq.LAST_ENDPOINT)

        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, cfg.hwm)
        self.sub.setsockopt(zmq.LINGER, 0)

        self.beacon_pub = self.ctx.socket(zmq.PUB)
        self.beacon_pub.setsockopt(zmq.LINGER, 0)
        self.beacon_sub = self.ctx.socket(zmq.SUB)
        self.beacon_sub.setsockopt(zmq.LINGER, 0)
        self.beacon_sub.setsockopt(zmq.SUBSCRIBE, wire.WELCOME)
        # Interest beacons (dafka.beacon): which beacons we subscribe, which we send.
        self._beacon_subs: set[bytes] = set()
        self._interest_beacons: list[list[bytes]] = []
        self._beacon_wanted = False
        self.census = beacon.TowerCensus(len(cfg.towers), time.monotonic())
        if self.keys is not None:
            # What only stores may say (ACK, DIRECT-HEAD, STORE-HELLO) is not
            # subscribed on the data SUB but on two more SUBs: trusted_sub,
            # connected to the store-role peers, and suspect_sub, connected to
            # all others (what arrives there is forged).  A client socket cannot
            # tell which connection a message came from, but it can tell which
            # socket.
            self.trusted_sub = self.ctx.socket(zmq.SUB)
            self.suspect_sub = self.ctx.socket(zmq.SUB)
            for sock in (self.sub, self.trusted_sub, self.suspect_sub, self.beacon_pub, self.beacon_sub):
                sock.setsockopt(zmq.LINGER, 0)
                security.make_client(sock, self.keys)
        for i, tower in enumerate(cfg.towers):
            # connect() never fails for a tower that is not up yet: ZeroMQ
            # keeps retrying, so a node may start before its tower.
            if sec is not None:
                security.connect(self.beacon_pub, tower.beacon_in, sec.tower_key(i))
                security.connect(self.beacon_sub, tower.beacon_out, sec.tower_key(i))
                continue
            self.beacon_pub.connect(tower.beacon_in)
            self.beacon_sub.connect(tower.beacon_out)
        self._beacon = wire.node_beacon(self.address, cfg.advertise, self.port)
        # Diagnostics: warn while no tower answers; notice another node with our address.
        self.tower_watch = TowerWatch(time.monotonic(), 3 * cfg.beacon_interval)
        self.beacon_held = False  # a subclass may stay silent for a while (see producer resume)
        self.duplicates_seen = 0
        if self.keys is not None:
            self._beacon = security.secure_node_beacon(self._beacon, self.keys.public)
            # The connecting side logs refused handshakes too (a plain tower cannot
            # tell why a secure node fails) and retries them.
            for sock, what in (
                (self.beacon_sub, "beacons"),
                (self.beacon_pub, "beacons out"),
                (self.sub, "data"),
                (self.trusted_sub, "data from stores"),
                (self.suspect_sub, "data from others"),
            ):
                self._refusals.append(
                    security.RefusalLog(
                        sock,  # type: ignore[arg-type]
                        f"{self.kind} {what}",
                        self.log,
                        lambda endpoint, s=sock: self._retry_later(s, endpoint),
                    )
                )
            self._retries = security.Retries(RETRY_REFUSED)
            self._tower_keys: dict[tuple[zmq.Socket, str], bytes] = {}
            for i, tower in enumerate(cfg.towers):
                self._tower_keys[(self.beacon_pub, tower.beacon_in)] = sec.tower_key(i)  # type: ignore[union-attr]
                self._tower_keys[(self.beacon_sub, tower.beacon_out)] = sec.tower_key(i)  # type: ignore[union-attr]

        self.refresh_interest()

        # Unique per instance: a restart with the same address may bind before the old one is reaped.
        wake_endpoint = f"inproc://dafka-wake-{self.address}-{new_address()}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_endpoint)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_endpoint)

        self.every(cfg.beacon_interval, self._send_beacon)
        self.every(min(1.0, cfg.beacon_timeout / 4), self._expire_peers)
        self._tick_timer = len(self._timers)
        self.every(TICK, self._tick)
        self.every(cfg.beacon_interval, self._check_towers)
        if sec is not None:
            self._check_own_role()
            self._allow_version = self.guard.version  # type: ignore[union-attr]
            self._known_keys = set(self.guard.roles)  # type: ignore[union-attr]
            self.every(sec.reload_interval, self._check_allow_list)
            self.every(RETRY_REFUSED / 4, self._retry_refused)

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

    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Expose this node's Prometheus metrics on ``http://host:port/metrics``; the port."""
        from dafka import metrics

        if self.metrics_server is None:
            self.metrics_server = metrics.serve(self, host, port)
        return self.metrics_server.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread and close its sockets."""
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
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
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # already a wake-up pending

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

    def before_wait(self) -> None:
        """Called in the I/O thread at the end of every loop turn, right before it
        waits in the poller (e.g. to wake application threads once per turn)."""

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
        if self.trusted_sub is not None and self.suspect_sub is not None:
            readers[self.trusted_sub] = self._read_trusted
            readers[self.suspect_sub] = self._read_suspect
        for refusals in self._refusals:
            readers[refusals.monitor] = refusals.read
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
            self.loop_turns += 1
            now = time.monotonic()
            wait = 1.0
            for i, (interval, last, fn) in enumerate(timers):
                due = last + interval
                # Timers due within a millisecond run together (and stay in step
                # after, as their last run is the same ``now``): one wake-up a
                # second for a node's 1 s timers instead of one each.
                if due <= now + TIMER_SLACK:
                    timers[i] = (interval, now, fn)
                    try:
                        fn(now)
                    except Exception:
                        self.log.exception("%s timer failed", self.kind)
                    due = now + interval
                wait = min(wait, due - now)
            if self._linger_until:
                if now >= self._linger_until:
                    self._linger_until = 0.0
                    self._watch_data()
                else:
                    wait = min(wait, self._linger_until - now)
            if self.has_work():
                wait = 0.0  # more work waits: only look for input, never sleep
            self.before_wait()
            try:
                # Rounded up to the poller's whole milliseconds: rounded down, the
                # last millisecond before every timer would be a busy loop holding
                # the GIL (a 50 ms tick made every node spin 2% of the time, and
                # delivered records waited for it).
                events = poller.poll(max(0, math.ceil(wait * 1000)))
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
        for refusals in self._refusals:
            refusals.close()  # stop the monitors while their sockets are open
        for sock in (self.sub, self.beacon_pub, self.beacon_sub, self._wake_rx):
            sock.close(0)
        # Other threads wake the loop (stop, call_soon) at any time, also while
        # it shuts down: a socket closed during another thread's send crashes
        # libzmq (an assertion), so the wake socket closes under their lock.
        with self._wake_lock:
            self._wake_tx.close(0)
        for sock in (self.trusted_sub, self.suspect_sub):
            if sock is not None:
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

    def _read_trusted(self) -> None:
        """Secure mode: messages from store-role peers (ACK, DIRECT-HEAD, STORE-HELLO)."""
        assert self.trusted_sub is not None
        for frames in fastio.recv_messages(self.trusted_sub, DRAIN):
            if len(frames) != 1:
                self.bad_input("message from a store", "expected one frame")
                continue
            self.from_store = True
            try:
                self.on_trusted(frames)
            finally:
                self.from_store = False

    def on_trusted(self, frames: list[bytes]) -> None:
        """A one-frame message from a store-role peer (``from_store`` is set)."""
        self.on_data(frames)

    def _read_suspect(self) -> None:
        """Secure mode: store-only messages sent by peers without a store key."""
        assert self.suspect_sub is not None
        for frames in fastio.recv_messages(self.suspect_sub, DRAIN):
            self.forged += 1
            if self.forged <= 20 or self.forged % 1000 == 0:
                try:
                    what = type(wire.decode(frames)).__name__
                except ProtocolError:
                    what = "malformed message"
                self.log.warning(
                    "ignored a forged %s from a peer without a store key; %d so far", what, self.forged
                )

    def untrusted(self) -> bool:
        """Secure mode: True when the store-only message being handled did not
        come from a store key (then it must not be acted on)."""
        return self.keys is not None and not self.from_store

    def peer_role(self, address: str) -> str | None:
        """Secure mode: the allow-list role of a peer's key (None: unknown)."""
        key = self._peer_keys.get(address)
        return None if key is None or self.guard is None else self.guard.role(key)

    # ---------------------------------------------------------------- beacons

    def interest(self) -> beacon.Interest:
        """What this node is and which peers it needs (see :mod:`dafka.beacon`)."""
        return beacon.EVERYTHING

    def refresh_interest(self) -> None:
        """Apply :meth:`interest` to the beacons and the beacon SUB (I/O thread, or before start)."""
        interest = self.interest()
        self.peers.interest = interest
        plain = self._beacon
        self._interest_beacons = [[head, *plain[1:]] for head in interest.heads()]
        wanted = interest.subscriptions() | (self._beacon_subs & {wire.BEACON})
        for prefix in self._beacon_subs - wanted:
            self.beacon_sub.setsockopt(zmq.UNSUBSCRIBE, prefix)
        for prefix in wanted - self._beacon_subs:
            self.beacon_sub.setsockopt(zmq.SUBSCRIBE, prefix)
        self._beacon_subs = wanted

    def _check_census(self, now: float) -> None:
        """Subscribe plain ``B`` beacons while not every tower is a dafka tower."""
        plain = self.census.needs_plain(now)
        if plain and wire.BEACON not in self._beacon_subs:
            self.beacon_sub.setsockopt(zmq.SUBSCRIBE, wire.BEACON)
            self._beacon_subs.add(wire.BEACON)
            self.log.info("%s %s: a tower relays no interest beacons; meeting every peer", self.kind, self.address[:8])
        elif not plain and wire.BEACON in self._beacon_subs:
            self.beacon_sub.setsockopt(zmq.UNSUBSCRIBE, wire.BEACON)
            self._beacon_subs.discard(wire.BEACON)

    def _tick(self, now: float) -> None:
        if self._beacon_wanted:  # new peers since the last tick: one beacon for them all
            self._beacon_wanted = False
            self._send_beacon(now)
        self.on_tick(now)
        interval = self.tick_interval()
        timer = self._timers[self._tick_timer]
        if timer[0] != interval:
            self._timers[self._tick_timer] = (interval, timer[1], timer[2])

    def tick_interval(self) -> float:
        """Seconds to the next :meth:`on_tick` (an idle node may tick less often:
        on a mesh of a thousand devices the ticks are most of a node's cost)."""
        return TICK

    def _send_beacon(self, now: float) -> None:
        if self.beacon_held:
            return
        try:
            # Interest beacons first: a dafka tower then knows this address is no C node.
            for frames in self._interest_beacons:
                self.beacon_pub.send_multipart(frames, zmq.NOBLOCK)
            # Filtered away by the PUB while no C node or probe subscribes B.
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
            self.tower_watch.on_heard(time.monotonic())
            if frames == [wire.WELCOME]:
                # A tower (re)appeared: tell it about us right away.
                self.census.on_welcome(time.monotonic())
                self._send_beacon(time.monotonic())
                continue
            tower_id = beacon.parse_hello(frames)
            if tower_id is not None:
                self.census.on_hello(tower_id, time.monotonic())
                continue
            try:
                if self.guard is not None:
                    frames, key = security.split_key(frames, 3, "tower beacon")
                kind, interest_key, address, endpoint = beacon.decode_tower_beacon(frames)
            except ProtocolError as exc:
                self.bad_input("tower beacon", exc)
                continue
            if address == self.address and not self._is_own_endpoint(endpoint):
                self.duplicates_seen += 1
                self.on_duplicate_address(endpoint)
                continue
            if self.guard is not None and not self._allowed_peer(address, key):
                continue
            actions = self.peers.on_beacon(address, endpoint, time.monotonic(), kind, interest_key)
            for action in actions:
                self._apply_peer_action(action)

    def _is_own_endpoint(self, endpoint: str) -> bool:
        """Whether a beacon with our address is our own (else: another process)."""
        # Not the host: each tower may see us under another address. Our port is
        # ours on this host; a twin elsewhere on the very same port goes unnoticed.
        return not self.beacon_held and endpoint.endswith(f":{self.port}")

    def on_duplicate_address(self, endpoint: str) -> None:
        """Another live node beacons our address from ``endpoint`` (logged at a low rate)."""
        n = self.duplicates_seen
        if n <= 3 or n % 100 == 0:
            self.log.error(
                "another node uses this %s's address %s (beacons from %s, ours are on port %d):"
                " two processes share one identity",
                self.kind,
                self.address,
                endpoint,
                self.port,
            )

    def _check_towers(self, now: float) -> None:
        self._check_census(now)
        if self.config.towers and self.tower_watch.warning_due(now):
            self.log.warning(
                "%s %s has reached no tower after %.0fs; trying %s (is a tower running there?)",
                self.kind,
                self.address[:8],
                now - self.tower_watch.started,
                ", ".join(f"{t.beacon_in} / {t.beacon_out}" for t in self.config.towers),
            )

    def _allowed_peer(self, address: str, key: bytes) -> bool:
        """Secure mode: connect only to allow-listed keys, and keep an address's key."""
        if address == self.address:
            return False
        if self.guard is None or self.guard.role(key) is None:
            if address not in self._refused_peers:
                self._refused_peers.add(address)
                self.log.warning("not connecting to peer %s: its key is not in the allow-list", address)
            return False
        known = self._peer_keys.get(address)
        if known is not None and known != key and address in self.peers:
            self.bad_input("tower beacon", f"peer {address} beacons with another key")
            return False
        self._peer_keys[address] = key
        self._refused_peers.discard(address)
        return True

    def _connect_peer(self, action: Connect) -> None:
        if self.keys is None:
            self.sub.connect(action.endpoint)
            return
        security.connect(self.sub, action.endpoint, self._peer_keys[action.address])
        self._gate(action.address, action.endpoint)

    def _gate(self, address: str, endpoint: str) -> None:
        """Connect the trusted or the suspect SUB to a peer, by its key's role."""
        storing = self.peer_role(address) in security.STORING_ROLES
        sock = self.trusted_sub if storing else self.suspect_sub
        assert sock is not None
        security.connect(sock, endpoint, self._peer_keys[address])
        self._gated[address] = (sock, endpoint)

    def _ungate(self, address: str) -> None:
        gated = self._gated.pop(address, None)
        if gated is not None:
            try:
                gated[0].disconnect(gated[1])
            except zmq.ZMQError:
                pass

    def _check_allow_list(self, now: float) -> None:
        """Secure mode: apply allow-list changes (timer).

        Peers whose key was removed are disconnected; if any key was removed,
        the publisher is bound anew, which drops every connection it accepted:
        peers reconnect at once and pass ZAP again, the removed ones fail.
        """
        guard = self.guard
        assert guard is not None
        guard.refresh()
        if guard.version == self._allow_version:
            return
        self._allow_version = guard.version
        removed = self._known_keys - set(guard.roles)
        self._known_keys = set(guard.roles)
        for address, key in list(self._peer_keys.items()):
            role = guard.role(key)
            if role is None:
                self._peer_keys.pop(address, None)
                if address in self.peers:
                    self.log.warning("cutting off peer %s: its key was removed from the allow-list", address)
                for action in self.peers.forget(address):
                    self._apply_peer_action(action)
            elif address in self._gated:
                trusted = self._gated[address][0] is self.trusted_sub
                if (role in security.STORING_ROLES) != trusted:  # the key got another role
                    endpoint = self._gated[address][1]
                    self._ungate(address)
                    self._gate(address, endpoint)
        if removed:
            self.rebind_publisher()

    def _check_own_role(self) -> None:
        """Warn at start when the allow-list would make this node useless."""
        assert self.guard is not None and self.keys is not None
        role = self.guard.role(self.keys.public)
        expected = {
            "store": security.STORING_ROLES,
            "gateway": security.STORING_ROLES,
            "producer": {"producer"},
            "consumer": {"consumer"},
        }.get(self.kind)
        if role is None:
            self.log.warning("this %s's key is not in the allow-list: every peer will refuse it", self.kind)
        elif expected is not None and role not in expected:
            self.log.warning(
                "this %s's key has the role %r in the allow-list (expected %s)%s",
                self.kind,
                role,
                " or ".join(sorted(expected)),
                ": producers will ignore its ACKs" if self.kind in ("store", "gateway") else "",
            )

    def _retry_later(self, sock: zmq.Socket, endpoint: str) -> None:
        """A handshake was refused: ZeroMQ gives that connection up, so retry it later."""
        self._retries.add(sock, endpoint, time.monotonic())

    def _retry_refused(self, now: float) -> None:
        """Timer: connect again where a handshake was refused, if still wanted."""
        for sock, endpoint in self._retries.take_due(now):
            key = self._tower_keys.get((sock, endpoint))
            if key is None:
                for address, (gated, gated_endpoint) in self._gated.items():
                    if gated_endpoint == endpoint and sock in (self.sub, gated):
                        key = self._peer_keys.get(address)
                        break
            if key is None:
                continue  # the peer is gone meanwhile
            security.reconnect(sock, endpoint, key, self.log)

    def publisher_lock(self) -> Any:
        """What must be held to use the publisher outside the I/O thread."""
        return contextlib.nullcontext()

    def rebind_publisher(self) -> None:
        """Bind the publisher anew on its port, dropping every accepted connection."""
        with self.publisher_lock():
            self.publisher.unbind(self._bound)
            for _ in range(200):  # the old listener closes asynchronously
                try:
                    self.publisher.bind(self._bound)
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)
            else:
                self.log.error("could not bind %s again; peers cannot reach this node", self._bound)
                return
        self.log.info("publisher bound anew after an allow-list change")

    def _apply_peer_action(self, action: PeerAction) -> None:
        if isinstance(action, Connect):
            try:
                self._connect_peer(action)
            except zmq.ZMQError as exc:
                self.bad_input("peer endpoint", exc)
                return
            self.log.debug("connected to peer %s at %s", action.address, action.endpoint)
            # Tell the newcomer about us soon (at the next tick, once for many
            # newcomers) so it connects back quickly.
            self._beacon_wanted = True
            interval, last, fn = self._timers[self._tick_timer]
            if interval > TICK:  # an idle node's slow tick: the next one within TICK
                self._timers[self._tick_timer] = (TICK, last, fn)
            self.on_peer(action.endpoint, action.address)
        else:
            try:
                self.sub.disconnect(action.endpoint)
            except zmq.ZMQError:
                pass
            if action.address in self._gated and self._gated[action.address][1] == action.endpoint:
                self._ungate(action.address)
            self.log.debug("dropped silent peer %s", action.address)

    def _expire_peers(self, now: float) -> None:
        for action in self.peers.expire(now):
            self._apply_peer_action(action)
            if action.address not in self.peers:
                self._peer_keys.pop(action.address, None)

    def pause_data(self, paused: bool) -> None:
        """Stop (or restart) reading the data SUB (I/O thread only).

        While paused, ZeroMQ buffers up to the high-water mark and publishers
        drop beyond it; what they drop is fetched again later.
        """
        if paused != self.data_paused:
            self.data_paused = paused
            self._watch_data()

    def linger_data(self, seconds: float) -> None:
        """Rest from reading the data SUB for ``seconds`` (I/O thread only).

        Records that arrive meanwhile are read together: one wake-up for
        several instead of one each, which at low rates leaves the CPU to the
        nodes beside this one.  Commands and timers go on meanwhile.
        """
        self._linger_until = time.monotonic() + seconds
        self._watch_data()

    def _watch_data(self) -> None:
        reading = not self.data_paused and not self._linger_until
        self._poller.modify(self.sub, zmq.POLLIN if reading else 0)

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

    def batches_for(self, header: bytes) -> bool:
        """Whether records with this single-record header prefix go out as batches."""
        return self.batches or self.audience.takes_batches(header)

    def route(self, header: bytes) -> Route:
        """How records with this single-record header prefix go out: as batches or one a message."""
        if self.batches_for(header):
            return wire.batch_prefix(header), fastio.send_batches
        return header, fastio.send_records

    def on_subscription(self, subscribe: bool, prefix: bytes) -> None:
        """A peer (un)subscribed ``prefix`` on our XPUB publisher (I/O thread)."""
        self.audience.on_subscription(subscribe, prefix)

    def subscribe(self, prefix: bytes) -> None:
        """Subscribe the data SUB (I/O thread only).

        Record prefixes get their batch twin first (see :mod:`dafka.audience`):
        every reader of ours takes batches.
        """
        if prefix[:1] in RECORD_IDS:
            self.sub.setsockopt(zmq.SUBSCRIBE, wire.BATCH_CAPABLE + prefix)
        if self.trusted_sub is not None and self.suspect_sub is not None and prefix[:1] in STORE_ONLY:
            self.trusted_sub.setsockopt(zmq.SUBSCRIBE, prefix)
            self.suspect_sub.setsockopt(zmq.SUBSCRIBE, prefix)
            return
        self.sub.setsockopt(zmq.SUBSCRIBE, prefix)

    def unsubscribe(self, prefix: bytes) -> None:
        if self.trusted_sub is not None and self.suspect_sub is not None and prefix[:1] in STORE_ONLY:
            self.trusted_sub.setsockopt(zmq.UNSUBSCRIBE, prefix)
            self.suspect_sub.setsockopt(zmq.UNSUBSCRIBE, prefix)
            return
        self.sub.setsockopt(zmq.UNSUBSCRIBE, prefix)
        if prefix[:1] in RECORD_IDS:  # the twin last
            self.sub.setsockopt(zmq.UNSUBSCRIBE, wire.BATCH_CAPABLE + prefix)
