"""The I/O shell every mesh node shares: a background thread with a poller.

A node has

* a beacon PUB connected to every tower's beacon-in port, and a beacon SUB
  (subscribed to ``W`` and ``B``) connected to every tower's beacon-out port;
* a data SUB that it connects to each peer the towers announce;
* a data publisher (PUB or XPUB) bound on an ephemeral port, which the
  beacon advertises.

The loop runs in one thread, owns every socket except the ones a subclass
documents as shared, and calls the subclass hooks.  That thread is the node's
own, or one a :class:`~dafka.nodes.loop.NodeLoop` shares among many nodes of a
process (many producers of one app: one thread, not one each).  Protocol decisions live in
the sans-IO objects (``PeerTable``, ``PartitionTracker``, ``UnackedWindow``);
this module only moves bytes and time.

In secure mode (``config.security``, see :mod:`dafka.nodes.security`) every socket
speaks CURVE: the publisher is a server checked by ZAP against the allow-list,
the others are clients that connect only to allow-listed keys; beacons carry
the node's public key, and the node's address is bound to that key
(:func:`dafka.nodes.security.bound_address`).  Data is read from one SUB per peer (a
:class:`Channel`), connected with the peer's key as the CURVE server key, so
every message is known to come from that key: what only stores may say (ACK,
DIRECT-HEAD, STORE-HELLO...) is believed only from store-role keys, and a
RECORD, HEAD or DIRECT-RECORD of partition P only from P's owner (the key P is
bound to) or a store or gateway key (see :meth:`Node.may_write`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import selectors
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from dafka import fastio
from dafka.config import NodeConfig, default_node_config, loopback_trap
from dafka.core import beacon, reach, wire, zmtp
from dafka.core.audience import BatchAudience
from dafka.core.peers import PeerTable, TowerWatch
from dafka.errors import ConfigError
from dafka.nodes import security
from dafka.nodes.channels import (
    CUT_GRACE,
    CUT_IDLE,
    INBOUND_EVENTS,
    OUTBOUND_EVENTS,
    Channel,
    ChannelsMixin,
    data_socket_options,
    frame_limit,
)
from dafka.nodes.discovery import REACH_GRACE, RETRY_REFUSED, DiscoveryMixin, _note_closed
from dafka.nodes.sockets import DRAIN, POLLIN, Route, SocketsMixin, read_subscriptions
from dafka.nodes.timers import TICK, TimersMixin

if TYPE_CHECKING:
    from dafka.nodes.loop import NodeLoop

# Names other modules import from here (they moved with their concept).
__all__ = [
    "DRAIN",
    "OUTBOUND_EVENTS",
    "RETRY_REFUSED",
    "Channel",
    "ErrorLog",
    "Node",
    "Route",
    "new_address",
    "read_subscriptions",
]


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


class Node(DiscoveryMixin, ChannelsMixin, SocketsMixin, TimersMixin):
    """Base class of producers, consumers and stores (the I/O shell)."""

    kind = "node"
    publisher_type = zmq.PUB

    def __init__(
        self,
        config: NodeConfig | None = None,
        *,
        address: str | None = None,
        loop: NodeLoop | None = None,
    ) -> None:
        self.config = config or default_node_config()
        # None: the node runs its own I/O thread; else the shared loop runs it.
        self._loop = loop
        self._ended = threading.Event()  # a shared loop has closed the node
        self.log = logging.getLogger(f"dafka.{self.kind}")
        # Secure mode (a [security] config): CURVE on every mesh socket.
        sec = self.config.security
        self.keys = security.own_keys(sec) if sec else None
        self.address = self._own_address(address)
        self.bad_input = ErrorLog(self.log)
        fastio.warn_if_pure(self.log)
        self.ctx = zmq.Context.instance()
        self.guard = security.guard_for(sec) if sec else None
        if self.guard is not None:
            self.ctx = self.guard.ctx  # the context whose ZAP handler checks the allow-list
        self.secure = self.keys is not None
        # A secure mesh holds only dafka nodes (C nodes have no CURVE): records
        # always go out in batches there (wire.RecordBatch).  On a plain mesh they
        # do where every reader of a message took batches (its subscriptions'
        # batch twins, counted by the audience); C readers get one record a message.
        self.batches = self.secure
        self.audience = BatchAudience(enabled=self.config.batches)
        self.from_store = False  # secure: set while a message from a store-role peer is handled
        self.sender: Channel | None = None  # secure: the peer whose message is being handled
        self.forged = 0  # store-only messages (ACK, STORE-HELLO) from peers without a store key
        self.not_owner = 0  # secure: RECORDs, HEADs, DIRECT-RECORDs from a key not entitled to them
        self._peer_keys: dict[str, bytes] = {}  # secure: peer address -> its public key
        # Secure: peer address -> its data channel, and the SUBs' subscriptions (a multiset, as ZeroMQ's).
        self._channels: dict[str, Channel] = {}
        self._channel_socks: dict[zmq.Socket, Channel] = {}
        self._subscriptions: collections.Counter[bytes] = collections.Counter()
        # Channels are watched through OS selectors on their ZMQ_FDs, not in the
        # ZeroMQ poller, whose every wait costs about a microsecond per socket:
        # a loop turn costs what is ready, not the number of peers.
        self._channel_selector: selectors.BaseSelector | None = None
        self._monitor_selector: selectors.BaseSelector | None = None
        self._busy: set[Channel] = set()  # channels that may hold unread messages
        # Messages read just before a disconnection (see _hold_one): (channel or
        # None for the plain data SUB, frames), handled before what follows them.
        self._held: deque[tuple[Channel | None, list[bytes]]] = deque()
        self._held_bytes = 0
        self.held_dropped = 0
        self._refused_peers: set[str] = set()
        self._refusals: list[security.RefusalLog] = []
        self.peers = PeerTable(self.address, self.config.beacon_timeout)  # (its bounds: PeerLimits)
        self._failed_links: list[str] = []  # endpoints whose connection attempt failed, to judge
        self._commands: deque[Callable[[], object]] = deque()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_lock = threading.Lock()
        self._timers: list[tuple[float, float, Callable[[float], None]]] = []
        # The earliest timer's due time, as the last full look found it (0: look
        # again); _timer_changed invalidates it.  A loop turn then costs nothing
        # for timers not due: a shared loop runs a node's turns for every input.
        self._timers_due = 0.0
        self._timers_gen = 0
        self.data_paused = False
        self._linger_until = 0.0  # data reading rests until then (see linger_data)
        self.loop_turns = 0  # wake-ups of the I/O loop (input, timers or work)
        self.metrics_server: Any = None  # see serve_metrics
        self._readers: dict[object, Callable[[], None]] = {}
        self._poller: Any = None  # a zmq.Poller, or a shared loop's stand-in for one

        cfg = self.config
        self.publisher = self.ctx.socket(self.publisher_type)
        self.publisher.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.publisher.setsockopt(zmq.LINGER, 2000)
        # Peers send it subscriptions only: one longer than this cuts its connection.
        self.publisher.setsockopt(zmq.MAXMSGSIZE, zmtp.SUBSCRIPTION_FRAME_MAX)
        if self.publisher_type == zmq.XPUB:
            # Every subscribe and unsubscribe (a peer leaving too): the audience counts them.
            self.publisher.setsockopt(zmq.XPUB_VERBOSER, 1)
        # Who reaches us (handshakes on the publisher) and whom we reach (the data SUB).
        self.inbound = reach.Links()
        self.links = reach.Links()
        if self.keys is not None:
            security.make_server(self.publisher, self.keys)
        self._refusals.append(
            security.RefusalLog(
                self.publisher,
                f"{self.kind} publisher",
                self.log,
                events=INBOUND_EVENTS,
                on_event=self.inbound.on_event,
                refusals=self.keys is not None,  # plain: the tower's probe closes before a handshake
            )
        )
        try:
            self.port = self.publisher.bind_to_random_port(f"tcp://{cfg.bind}")
            self._bound = self.publisher.getsockopt_string(zmq.LAST_ENDPOINT)
            trap = loopback_trap(cfg, reach.split_endpoint(self._bound)[0], self.kind)
            if trap:
                raise ConfigError(trap)
        except BaseException:
            for refusals in self._refusals:
                refusals.close()
            self.publisher.close(0)
            raise

        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, cfg.hwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        # A peer's frame over this is never assembled: ZeroMQ cuts the connection.
        self.frame_limit = frame_limit(cfg.max_record_bytes)
        self.sub.setsockopt(zmq.MAXMSGSIZE, self.frame_limit)
        data_socket_options(self.sub)
        self.cuts = reach.CutWatch(CUT_GRACE)
        self.connections_cut = 0  # data connections ZeroMQ cut (an oversize frame), made again

        self.beacon_pub = self.ctx.socket(zmq.PUB)
        self.beacon_pub.setsockopt(zmq.LINGER, 0)
        self.beacon_pub.setsockopt(zmq.MAXMSGSIZE, zmtp.SUBSCRIPTION_FRAME_MAX)  # towers forward subscriptions
        self.beacon_sub = self.ctx.socket(zmq.SUB)
        self.beacon_sub.setsockopt(zmq.LINGER, 0)
        self.beacon_sub.setsockopt(zmq.RCVHWM, beacon.BEACON_HWM)
        self.beacon_sub.setsockopt(zmq.SUBSCRIBE, wire.WELCOME)
        # How the tower sees us (dafka towers only; see dafka.core.reach).
        self.beacon_sub.setsockopt(zmq.SUBSCRIBE, reach.reflection_topic(self.address))
        # Interest beacons (dafka.core.beacon): which beacons we subscribe, which we send.
        self._beacon_subs: set[bytes] = set()
        self._interest_beacons: list[list[bytes]] = []
        self._beacon_wanted = False
        self._lazy_beacons = False  # the beacon SUB wakes the node (see lazy_beacons)
        self.census = beacon.TowerCensus(len(cfg.towers), time.monotonic())
        if self.keys is not None:
            # Data comes in on one channel per peer (see Channel): a SUB cannot
            # tell which connection a message came from, but it can tell which
            # socket.  self.sub stays unconnected.
            self._channel_selector = selectors.DefaultSelector()
            self._monitor_selector = selectors.DefaultSelector()
            for sock in (self.beacon_pub, self.beacon_sub):
                sock.setsockopt(zmq.LINGER, 0)
                security.make_client(sock, self.keys)
        # The beacon sockets' monitors are attached before they connect: a monitor
        # sees only what happens after it is attached, and on loopback a tower
        # refuses a handshake within a millisecond of the connect, before the rest
        # of this constructor has run (the refusal was then never seen).
        if self.keys is not None:
            # The connecting side logs refused handshakes too (a plain tower cannot
            # tell why a secure node fails) and retries them.
            for sock, what in (
                (self.beacon_sub, "beacons"),
                (self.beacon_pub, "beacons out"),
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
        # A plain node at a secure tower: the handshake fails (mechanism mismatch)
        # and ZeroMQ gives the connection up.  Watched, to say so and retry.
        self._tower_monitors: list[tuple[zmq.Socket, zmq.Socket]] = []
        if sec is None and cfg.towers:
            for sock in (self.beacon_sub, self.beacon_pub):
                monitor = sock.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                    f"inproc://dafka-tower-handshakes-{new_address()}",
                )
                self._tower_monitors.append((sock, monitor))
        for i, tower in enumerate(cfg.towers):
            # connect() never fails for a tower that is not up yet: ZeroMQ
            # keeps retrying, so a node may start before its tower.
            if sec is not None:
                security.connect(self.beacon_pub, tower.beacon_in, sec.tower_key(i))
                security.connect(self.beacon_sub, tower.beacon_out, sec.tower_key(i))
                continue
            self.beacon_pub.connect(tower.beacon_in)
            self.beacon_sub.connect(tower.beacon_out)
        # The host we name: the interface we are bound to, else (bound to all) the
        # tower fills in the address it sees, as for C nodes (see dafka.core.reach).
        self.beacon_host = reach.beacon_host(cfg.advertise, self._bound)
        self._beacon = wire.node_beacon(self.address, self.beacon_host, self.port)
        self._probe = beacon.probe(self._beacon, self.address)
        self._probe_at = 0.0  # when to probe again after a welcome (0: no burst under way)
        self._probe_step = beacon.PROBE_FIRST
        self._echoed = False  # (set while reading beacons)
        self.reach = reach.ReachWatch(time.monotonic(), REACH_GRACE * cfg.beacon_interval)
        # Diagnostics: warn while no tower answers; notice another node with our address.
        self.tower_watch = TowerWatch(time.monotonic(), 3 * cfg.beacon_interval)
        self.beacon_held = False  # a subclass may stay silent for a while (see producer resume)
        self.duplicates_seen = 0
        if self.keys is not None:
            self._beacon = security.secure_node_beacon(self._beacon, self.keys.public)
        else:
            self._refusals.append(
                security.RefusalLog(
                    self.sub,
                    f"{self.kind} data",
                    self.log,
                    events=OUTBOUND_EVENTS,
                    on_event=lambda event, endpoint: self._on_data_event(self.sub, event, endpoint),
                    refusals=False,
                )
            )
        if sec is not None:
            self._tower_keys: dict[tuple[zmq.Socket, str], bytes] = {}
            for i, tower in enumerate(cfg.towers):
                self._tower_keys[(self.beacon_pub, tower.beacon_in)] = sec.tower_key(i)  # type: ignore[union-attr]
                self._tower_keys[(self.beacon_sub, tower.beacon_out)] = sec.tower_key(i)  # type: ignore[union-attr]

        self.refresh_interest()

        # Other threads wake the I/O thread through a PAIR of sockets; a shared
        # NodeLoop has one wake-up of its own for all its nodes.
        self._wake_rx: zmq.Socket | None = None
        self._wake_tx: zmq.Socket | None = None
        if self._loop is None:
            # Unique per instance: a restart with the same address may bind before the old one is reaped.
            wake_endpoint = f"inproc://dafka-wake-{self.address}-{new_address()}"
            self._wake_rx = self.ctx.socket(zmq.PAIR)
            self._wake_rx.bind(wake_endpoint)
            self._wake_tx = self.ctx.socket(zmq.PAIR)
            self._wake_tx.setsockopt(zmq.LINGER, 0)
            self._wake_tx.connect(wake_endpoint)

        self.every(cfg.beacon_interval, self._send_beacon)
        self.every(min(1.0, cfg.beacon_timeout / 4), self._expire_peers)
        # No tower heard for this long: expiry waits (a dafka tower says hello
        # every HELLO_INTERVAL; behind a C tower a node hears its own beacon come back).
        self._quiet_limit = max(cfg.beacon_timeout / 2, 2.5 * beacon.HELLO_INTERVAL, 2.5 * cfg.beacon_interval)
        self._tick_timer = len(self._timers)
        self.every(TICK, self._tick)
        self.every(cfg.beacon_interval, self._check_towers)
        self.every(cfg.beacon_interval, self._check_reach)
        # Only while a disconnection waits to be told apart (see _schedule_cuts):
        # idle, a node wakes once a second for all its timers, not 4 times.
        self._cut_timer = len(self._timers)
        self.every(CUT_IDLE, self._check_cuts)
        if self.keys is not None:
            self.every(cfg.beacon_interval, self._sweep_channel_monitors)
        self._tower_refused: set[tuple[zmq.Socket, str]] = set()  # to connect again
        if sec is not None:
            self._check_own_role()
            self._allow_version = self.guard.version  # type: ignore[union-attr]
            self._known_keys = set(self.guard.roles)  # type: ignore[union-attr]
            self.every(sec.reload_interval, self._check_allow_list)
            self.every(RETRY_REFUSED / 4, self._retry_refused)

    def _own_address(self, address: str | None) -> str:
        """This node's address: given or new; in secure mode bound to our key."""
        if self.keys is None:
            return address or new_address()
        if address is None:
            return security.bound_address(self.keys.public)
        if not security.address_bound(address, self.keys.public):
            raise ConfigError(
                f"address {address} is not bound to this node's key ({self.config.security.key}):"  # type: ignore[union-attr]
                " on a secure mesh a node's address is made from its public key, so towers and"
                " peers refuse any other (an identity from a plain mesh, or from another key?)"
            )
        return address

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the I/O thread, or join the shared loop (idempotent)."""
        if self._loop is not None:
            if not self._started.is_set() and not self._stop.is_set():
                self._loop.attach(self)
                if not self._started.wait(5.0):
                    self.log.error("%s: the shared loop did not take the node within 5s", self.kind)
            return
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"dafka-{self.kind}-{self.address[:8]}", daemon=True
        )
        self._thread.start()
        self._started.wait(5.0)

    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Expose this node's Prometheus metrics on ``http://host:port/metrics``; the port."""
        from dafka.nodes import metrics

        if self.metrics_server is None:
            self.metrics_server = metrics.serve(self, host, port)
        return self.metrics_server.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread and close its sockets."""
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self._loop is not None:
            self._stop.set()
            if not self._started.is_set():
                self._close_sockets()
            elif not self._loop.detach(self, timeout):
                self.log.error(
                    "%s: the shared loop did not close the node within %.1fs", self.kind, timeout
                )
            return
        if self._thread is None:
            self._close_sockets()
            return
        self._stop.set()
        self._wake()
        if threading.current_thread() is self._thread:
            return  # a callback: the thread closes the sockets after this turn
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.log.error("%s I/O thread did not stop within %.1fs", self.kind, timeout)

    def _close_with_loop(self) -> None:
        """Close as the application would, waiting for no peer (NodeLoop.close)."""
        self.stop()

    def _in_io_thread(self) -> bool:
        """Whether the caller is the thread that runs this node (its own, or its
        shared loop's): there, waiting for what that thread delivers waits in vain."""
        if self._loop is not None:
            return self._loop._in_loop()
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        if self._loop is not None:
            return self._started.is_set() and not self._ended.is_set()
        return self._thread is not None and self._thread.is_alive()

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in the I/O thread (thread-safe)."""
        self._commands.append(fn)
        self._wake()

    def _wake(self) -> None:
        if self._wake_tx is None:
            assert self._loop is not None
            self._loop.wake(self)
            return
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

    def on_peer_gone(self, address: str) -> None:
        """A peer went silent (no beacon for ``beacon_timeout``) and was dropped."""

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
        """The node's own I/O thread (a node without a shared :class:`~dafka.nodes.loop.NodeLoop`)."""
        poller = self._poller = zmq.Poller()
        self._loop_begin()
        readers = self._readers
        stop = self._stop
        while not stop.is_set():
            self.loop_turns += 1
            try:
                wait = self._loop_timers(time.monotonic())
            except Exception:  # (each timer is guarded; this is the loop's own bookkeeping)
                self.log.exception("%s failed running its timers", self.kind)
                wait = 0.05  # looked at again soon, not never
            try:
                self.before_wait()
            except Exception:  # as a command's (and NodeLoop's): a bug must not end the I/O thread
                self.log.exception("%s failed before waiting", self.kind)
            # After before_wait: it may answer commits (a Tank gateway's inline ones), which
            # can resume paused input that is already held here.
            if self._loop_spins():
                wait = 0.0  # more work waits: only look for input, never sleep
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
            try:
                self._loop_after()
            except Exception:  # a subclass's hook (has_work...): logged, the thread goes on
                self.log.exception("%s failed in its loop turn", self.kind)
        self._loop_end()

    # The steps of a loop turn: the node's own thread (_run) and a shared
    # NodeLoop both drive a node through these, in the I/O thread only.

    def _loop_begin(self) -> None:
        """Register the sockets with ``self._poller``, run on_start, send the first beacon."""
        poller = self._poller
        readers = self._readers = {
            self.sub: self._read_data,
            self.beacon_sub: self._read_beacons,
        }
        if self._wake_rx is not None:
            readers[self._wake_rx] = self._read_wake
        for refusals in self._refusals:
            readers[refusals.monitor] = refusals.read
        for sock, monitor in self._tower_monitors:
            readers[monitor] = lambda s=sock, m=monitor: self._read_tower_handshakes(s, m)
        for sock in readers:
            poller.register(sock, zmq.POLLIN)
        if self._channel_selector is not None and self._monitor_selector is not None:
            self.watch(self._channel_selector, self._read_channels)
            self.watch(self._monitor_selector, self._read_channel_monitors)
        for sock, reader in self.sockets():
            self.watch(sock, reader)
        try:
            self.on_start()
            self._send_beacon(time.monotonic())
        except Exception:
            self.log.exception("%s failed to start", self.kind)
        self._started.set()

    def _loop_monitors(self) -> set[Any]:
        """The node's monitor sockets: read only by their readers, which empty them."""
        return {r.monitor for r in self._refusals} | {m for _, m in self._tower_monitors}

    def _loop_spins(self) -> bool:
        """Whether work waits that needs no input: the loop then must not sleep."""
        try:
            work = self.has_work()
        except Exception:  # a subclass's hook: as no work (spinning on a bug would hold a core)
            self.log.exception("%s failed telling whether it has work", self.kind)
            work = False
        return work or bool((self._busy or self._held) and not self.data_paused and not self._linger_until)

    def _loop_after(self) -> None:
        """After the input of a turn: channels still holding messages, background work."""
        if self._lazy_beacons:
            self._read_waiting_beacons()  # (see lazy_beacons: they wait for any turn)
        if self._held and self.keys is None and not self.data_paused and not self._linger_until:
            try:
                self._read_data()  # handles what was held first
            except Exception:
                self.log.exception("%s failed handling input", self.kind)
        if self._busy:
            try:
                self._read_busy()
            except Exception:
                self.log.exception("%s failed handling input", self.kind)
        try:
            if self.has_work():
                self.do_work()
        except Exception:
            self.log.exception("%s failed doing work", self.kind)

    def _loop_end(self) -> None:
        """After the last turn: on_shutdown, then close every socket."""
        try:
            self.on_shutdown()
        except Exception:
            self.log.exception("%s shutdown hook failed", self.kind)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for refusals in self._refusals:
            refusals.close()  # stop the monitors while their sockets are open
        for sock, monitor in self._tower_monitors:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)
        for sock in (self.sub, self.beacon_pub, self.beacon_sub):
            sock.close(0)
        if self._wake_rx is not None and self._wake_tx is not None:
            self._wake_rx.close(0)
            # Other threads wake the loop (stop, call_soon) at any time, also while
            # it shuts down: a socket closed during another thread's send crashes
            # libzmq (an assertion), so the wake socket closes under their lock.
            with self._wake_lock:
                self._wake_tx.close(0)
        for address in list(self._channels):
            self._close_channel(address)
        for selector in (self._channel_selector, self._monitor_selector):
            if selector is not None:
                selector.close()
        self.close_publisher()
        _note_closed(self.address, self.port)

    def close_publisher(self) -> None:
        self.publisher.close()

    def _read_wake(self) -> None:
        rx = self._wake_rx
        assert rx is not None
        events = fastio.events
        try:
            while events(rx) & POLLIN:  # (not ending on zmq.Again: see read_subscriptions)
                rx.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._run_commands()

    def _run_commands(self) -> None:
        """Run what other threads asked for (call_soon), in the I/O thread."""
        commands = self._commands
        while commands:
            fn = commands.popleft()
            try:
                fn()
            except Exception:
                self.log.exception("%s command failed", self.kind)

    def _read_data(self) -> None:
        if self._held:
            self._handle_held(None)
        on_data = self.on_data
        for frames in fastio.recv_messages(self.sub, DRAIN):
            on_data(frames)

