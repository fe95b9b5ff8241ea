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
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq

from dafka import fastio
from dafka.config import DEFAULT_MAX_RECORD_BYTES, NodeConfig, default_node_config, loopback_trap
from dafka.core import beacon, reach, wire, zmtp
from dafka.core.audience import BatchAudience
from dafka.core.peers import Connect, PeerAction, PeerTable, TowerWatch, refused_hint
from dafka.errors import ConfigError, ProtocolError
from dafka.nodes import security

if TYPE_CHECKING:
    from dafka.nodes.loop import NodeLoop

POLLIN = int(zmq.POLLIN)
DRAIN = 4096  # messages read from a socket before looking at the others again
TICK = 0.05  # seconds between calls of on_tick
TIMER_SLACK = 0.001  # a timer due this soon runs with the ones due now
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
_STORE_ONLY_IDS = frozenset(p[0] for p in STORE_ONLY)
# Secure mode: what is believed from a partition's owner or a store only.
_OWNED_IDS = frozenset((wire.RECORD, wire.HEAD, wire.DIRECT_RECORD))
RECORD_IDS = (wire.P_RECORD, wire.P_DIRECT_RECORD)  # subscriptions that get a batch twin
# How records go out: a header prefix and the fastio function that sends records with it.
Route = tuple[bytes, Callable[..., int]]
_MONITOR_EVENT = struct.Struct("=HI")  # a socket monitor's first frame: event, value
RETRY_REFUSED = 1.0  # seconds before connecting again where a secure handshake was refused
# Monitor events read besides refused handshakes: who completed a handshake with
# our publisher (peers reach us), and which peers our data SUB reaches (dafka.core.reach).
INBOUND_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
OUTBOUND_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
REACH_GRACE = 5  # beacon intervals with peers and none reaching us before a warning
# The largest frame a data SUB assembles (ZMQ_MAXMSGSIZE, per frame): a record of
# max_record_bytes alone in a batch (8 bytes of framing), a full batch (128
# records, 16 KiB: far less), and control messages (COMMIT, POSITIONS...) as
# large as with the default limit, with room to spare.  A bigger frame makes
# ZeroMQ cut the connection (see reach.CutWatch): the node connects again.
FRAME_SLACK = 64 * 1024
# Data SUBs (see data_socket_options): first retry after 100 ms (ZeroMQ's
# default), doubling up to 5 s; a TCP connect gives up after 5 s.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000
CONNECT_TIMEOUT_MS = 5_000
FAILED_LINKS_MAX = 10_000  # failed attempts waiting to be judged (more are dropped unjudged)
CUT_GRACE = 0.25  # seconds: a DISCONNECTED with no CONNECT_RETRIED after it was a cut

# Nodes this process closed: (address, port) -> when.  A beacon a node sent just
# before it closed can reach the next node of its address (a producer reopened
# with its identity file) seconds later through a busy tower; it is no live
# twin's, since this process closed that node.  Kept CLOSED_MEMORY seconds.
CLOSED_MEMORY = 60.0
_closed_here: dict[tuple[str, int], float] = {}
_closed_lock = threading.Lock()


def _note_closed(address: str, port: int) -> None:
    now = time.monotonic()
    with _closed_lock:
        for key in [k for k, at in _closed_here.items() if now - at > CLOSED_MEMORY]:
            del _closed_here[key]
        _closed_here[(address, port)] = now


def closed_here(address: str, endpoint: str) -> bool:
    """Whether ``endpoint`` is where a node of ``address`` that this process closed was."""
    now = time.monotonic()
    with _closed_lock:
        return any(
            a == address and endpoint.endswith(f":{port}") and now - at <= CLOSED_MEMORY
            for (a, port), at in _closed_here.items()
        )
CUT_IDLE = 3600.0  # seconds between cut checks while no disconnection is pending
# Bytes of messages read early before a disconnection (see Node._hold_one) that
# may wait while reading is paused; beyond it one is dropped (fetched again).
HELD_MAX_BYTES = 8 * 1024 * 1024


def frame_limit(max_record_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE of the data SUBs of a node with this ``max_record_bytes``."""
    return max(max_record_bytes, DEFAULT_MAX_RECORD_BYTES) + FRAME_SLACK


def read_subscriptions(sock: zmq.Socket, limit: int = DRAIN) -> Iterator[tuple[bool, bytes]]:
    """``(subscribe?, prefix)`` of up to ``limit`` (un)subscriptions waiting on an XPUB; never blocks."""
    events = fastio.events
    for _ in range(limit):
        # Looked at first: ending on zmq.Again costs 3.8 µs, ZMQ_EVENTS 0.7 µs
        # (a thousand producers each read theirs every second).
        if not events(sock) & POLLIN:
            return
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


class Channel:
    """Secure mode: the data SUB connected to one peer's publisher, and nothing else.

    It is a CURVE client with the peer's public key as the server key, so what
    arrives on it was sent by the holder of ``key``.  ``prefixes`` are the
    record header prefixes this peer was found entitled to send (see
    :meth:`Node.may_write`): the per-record fast path looks them up here, so
    the check costs nothing per record, once per (peer, partition).
    """

    __slots__ = ("address", "key", "endpoint", "sock", "refusals", "prefixes")

    def __init__(self, address: str, key: bytes, endpoint: str, sock: zmq.Socket) -> None:
        self.address = address
        self.key = key
        self.endpoint = endpoint
        self.sock = sock
        self.refusals: security.RefusalLog | None = None
        self.prefixes: dict[bytes, Any] = {}


def data_socket_options(sock: zmq.Socket) -> None:
    """Reconnect backoff and a connect timeout on a data SUB (see dafka.core.peers.PeerLimits).

    ZeroMQ retries a failed connection every 100 ms by default, forever; an
    endpoint that never answers holds a descriptor until the kernel gives the
    attempt up (minutes).  A peer that failed PeerLimits.max_failures times
    without a handshake is dropped anyway; these bound what it costs meanwhile.
    """
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)


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

    def every(self, interval: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(now)`` in the I/O thread every ``interval`` seconds.

        In step with the node's timers of the same interval (the first call may
        come sooner than ``interval``): they run in one wake-up, not one each.
        """
        self._timers.append((interval, self._in_step(interval, time.monotonic()), fn))
        self._timer_changed()

    def _timer_changed(self) -> None:
        """A timer was added or rescheduled: the next loop turn looks at them all."""
        self._timers_gen += 1
        self._timers_due = 0.0

    def _in_step(self, interval: float, now: float) -> float:
        """The last run to give a timer of ``interval`` so that it runs with the
        node's others of that interval (``now`` if there are none)."""
        for other, last, _ in self._timers:
            if other == interval and last <= now:
                return last + interval * math.floor((now - last) / interval)
        return now

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
            wait = self._loop_timers(time.monotonic())
            if self._loop_spins():
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
            self._loop_after()
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

    def _loop_timers(self, now: float) -> float:
        """Run the timers that are due; seconds until the next one (at most 1)."""
        earliest = self._timers_due
        if now + TIMER_SLACK < earliest:
            wait = min(1.0, earliest - now)  # none due: as the last look found them
        else:
            timers = self._timers
            gen = self._timers_gen
            earliest = math.inf
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
                    interval, last, fn = timers[i]  # (a timer may reschedule itself)
                    due = last + interval
                earliest = min(earliest, due)
            # Kept only if no timer changed meanwhile (one may move another).
            self._timers_due = earliest if gen == self._timers_gen else 0.0
            wait = min(1.0, earliest - now)
        if self._linger_until:
            if now >= self._linger_until:
                self._linger_until = 0.0
                self._watch_data()
            else:
                wait = min(wait, self._linger_until - now)
        return wait

    def _loop_spins(self) -> bool:
        """Whether work waits that needs no input: the loop then must not sleep."""
        return self.has_work() or bool(
            (self._busy or self._held) and not self.data_paused and not self._linger_until
        )

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
        if self.has_work():
            try:
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

    # ---------------------------------------------------------------- disconnections

    def _hold_one(self, sock: zmq.Socket, channel: Channel | None) -> None:
        """Read one whole message from a data SUB about to be disconnected from an endpoint.

        libzmq (4.3) aborts the process (``Assertion failed: !_more (src/fq.cpp:80)``)
        when a SUB is disconnected from the endpoint whose multipart message it has
        begun to read: ZMQ_EVENTS and poll read a message's first frame ahead,
        the disconnection drops the rest, and the next receive finds it gone.
        Reading one whole message first (the one begun, if any) leaves the
        socket between messages.  It is handled before anything read after it.
        """
        try:
            got = fastio.recv_messages(sock, 1)
        except zmq.ZMQError as exc:
            self.log.debug("could not read before disconnecting: %s", exc)
            return
        if not got:
            return
        frames = got[0]
        size = sum(map(len, frames))
        if self._held_bytes + size > HELD_MAX_BYTES:
            # Reading is paused and peers keep leaving: bounded; the stores
            # and producers have it, and gaps are fetched again.
            self.held_dropped += 1
            if self.held_dropped <= 20 or self.held_dropped % 1000 == 0:
                self.log.warning(
                    "%s: dropped a message read before a disconnection while reading is paused"
                    " (%d bytes wait already); %d so far",
                    self.kind,
                    self._held_bytes,
                    self.held_dropped,
                )
            return
        self._held.append((channel, frames))
        self._held_bytes += size
        if channel is not None:
            self._busy.add(channel)  # read (and the held message handled) at the end of the turn

    def _disconnect_data(self, sock: zmq.Socket, endpoint: str) -> None:
        """Disconnect the plain data SUB from ``endpoint`` (see :meth:`_hold_one`)."""
        self._hold_one(sock, None)
        try:
            sock.disconnect(endpoint)
        except zmq.ZMQError:
            pass  # given up by ZeroMQ already

    def _before_tower_disconnect(self, sock: zmq.Socket) -> None:
        """Read the beacons waiting before the beacon SUB leaves a tower (see :meth:`_hold_one`)."""
        if sock is self.beacon_sub:
            try:
                self._read_beacons()  # whole messages: the socket is left between two
            except Exception:
                self.log.exception("%s failed handling beacons", self.kind)

    def _handle_held(self, channel: Channel | None) -> None:
        """Handle the held messages of ``channel`` (None: of the plain data SUB), oldest first."""
        held = self._held
        keep: list[tuple[Channel | None, list[bytes]]] = []
        try:
            while held:
                item = held.popleft()
                if item[0] is not channel:
                    keep.append(item)
                    continue
                frames = item[1]
                self._held_bytes -= sum(map(len, frames))
                self.on_held(frames)
        finally:
            # (also when a handler raised: the others' wait, in their order)
            held.extendleft(reversed(keep))

    def on_held(self, frames: list[bytes]) -> None:
        """A message read before a disconnection (see :meth:`_hold_one`), handled as if read now."""
        if self.sender is not None and not self.screen(frames):
            return
        self.on_data(frames)

    # ---------------------------------------------------------------- secure channels

    def _read_channel(self, channel: Channel) -> None:
        """Secure mode: read what one peer sent, knowing it came from its key."""
        guard = self.guard
        assert guard is not None
        self.sender = channel
        self.from_store = guard.role(channel.key) in security.STORING_ROLES
        try:
            if self._held:
                self._handle_held(channel)
            self.read_data(channel.sock, channel.prefixes)
        finally:
            self.sender = None
            self.from_store = False

    def read_data(self, sock: zmq.Socket, prefixes: dict[bytes, Any] | None) -> None:
        """Read the messages waiting on a data socket (a channel's, in secure mode).

        ``prefixes``: the record header prefixes believed from this socket (see
        :class:`Channel`); readers of records (:class:`~dafka.nodes.reader.PartitionReader`)
        use them, this default ignores them.
        """
        on_data = self.on_data
        screen = self.sender is not None
        for frames in fastio.recv_messages(sock, DRAIN):
            if screen and not self.screen(frames):
                continue
            on_data(frames)

    def screen(self, frames: list[bytes]) -> bool:
        """Secure mode: whether a message from :attr:`sender` may be handled at all.

        Store-only messages from a key without a store role are forged: counted,
        logged at a low rate, dropped.
        """
        first = frames[0]
        if self.from_store or not first or first[0] not in _STORE_ONLY_IDS:
            return True
        self.forged += 1
        if self.forged <= 20 or self.forged % 1000 == 0:
            try:
                what = type(wire.decode(frames)).__name__
            except ProtocolError:
                what = "malformed message"
            self.log.warning("ignored a forged %s from a peer without a store key; %d so far", what, self.forged)
        return False

    def may_write(self, kind: int, partition: str) -> bool:
        """Secure mode: whether :attr:`sender` may send RECORDs / HEADs / DIRECT-RECORDs of ``partition``.

        Only the partition's owner (the key its address is bound to) or a store
        or gateway key (trusted with every partition's data, as with ACKs) may.
        Called once per (peer, partition) and message kind: what passes joins the
        channel's prefixes.  Outside secure mode (no sender) everything may.
        """
        sender = self.sender
        if sender is None or kind not in _OWNED_IDS or self.from_store:
            return True
        if security.address_bound(partition, sender.key):
            return True
        self.not_owner += 1
        if self.not_owner <= 20 or self.not_owner % 1000 == 0:
            self.log.warning(
                "ignored a %s of partition %s from peer %s: its key owns no such partition and is no"
                " store's; %d so far",
                wire.COMMAND_NAMES.get(kind, "message"),
                partition,
                sender.address,
                self.not_owner,
            )
        return False

    def _open_channel(self, address: str, endpoint: str) -> None:
        """Secure mode: a SUB of our own for this peer, with every subscription, connected with its key."""
        self._close_channel(address)
        key = self._peer_keys[address]
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.frame_limit)
        data_socket_options(sock)
        security.make_client(sock, self.keys)  # type: ignore[arg-type]
        for prefix, count in self._subscriptions.items():
            for _ in range(count):
                sock.setsockopt(zmq.SUBSCRIBE, prefix)
        channel = Channel(address, key, endpoint, sock)
        channel.refusals = security.RefusalLog(
            sock,
            f"{self.kind} data from {address[:8]}",
            self.log,
            lambda ep: self._retry_later(sock, ep),
            events=OUTBOUND_EVENTS,  # whom we reach (dafka.core.reach), as the plain data SUB's monitor
            on_event=lambda event, ep: self._on_data_event(sock, event, ep),
        )
        self._channels[address] = channel
        self._channel_socks[sock] = channel
        assert self._channel_selector is not None and self._monitor_selector is not None
        self._channel_selector.register(sock.get(zmq.FD), selectors.EVENT_READ, channel)
        self._monitor_selector.register(channel.refusals.monitor.get(zmq.FD), selectors.EVENT_READ, channel)
        security.connect(sock, endpoint, key)
        self._busy.add(channel)

    def _close_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is None:
            return
        self._channel_socks.pop(channel.sock, None)
        self.cuts.forget((channel.sock, channel.endpoint))
        self._busy.discard(channel)
        if self._held:
            # Its messages read before a disconnection go with it: nothing would
            # ever handle them (_read_channel is gone), and left behind they kept
            # _loop_spins true for good (a loop that never sleeps again).
            kept = [item for item in self._held if item[0] is not channel]
            if len(kept) != len(self._held):
                self._held_bytes = sum(sum(map(len, frames)) for _, frames in kept)
                self._held = deque(kept)
        watched = [(self._channel_selector, channel.sock)]
        if channel.refusals is not None:
            watched.append((self._monitor_selector, channel.refusals.monitor))
        for selector, sock in watched:
            if selector is not None:
                try:
                    selector.unregister(sock.get(zmq.FD))
                except (KeyError, ValueError, zmq.ZMQError):
                    pass  # never registered, or the selector is closed
        if channel.refusals is not None:
            channel.refusals.close()
        channel.sock.close(0)

    def _read_channels(self) -> None:
        """Secure mode: the selector says channels' ZMQ_FDs fired: read them."""
        assert self._channel_selector is not None
        for key, _ in self._channel_selector.select(0):
            self._busy.add(key.data)
        self._read_busy()

    def _read_busy(self) -> None:
        """Read every channel that may hold messages; keep those still holding some.

        A ZMQ_FD fires only when the socket's state changed, so a channel stays
        here until ZMQ_EVENTS says it is empty (a read stops after DRAIN messages).
        Whatever else makes ZeroMQ process a channel's commands (ZMQ_EVENTS,
        connect, disconnect) must put the channel here too (see :meth:`data_waiting`).
        """
        if self.data_paused or self._linger_until:
            return  # they wait; read when reading resumes
        busy, channels = self._busy, self._channels
        for channel in list(busy):
            if channels.get(channel.address) is not channel:
                busy.discard(channel)  # closed meanwhile
                continue
            self._read_channel(channel)
            if self.data_paused or self._linger_until:
                return  # a reader paused: the rest wait (still busy)
            if channels.get(channel.address) is channel and not channel.sock.get(zmq.EVENTS) & zmq.POLLIN:
                busy.discard(channel)

    def _on_data_event(self, sock: zmq.Socket, event: int, endpoint: str) -> None:
        """A monitor event of a data SUB (the plain one, or a channel)."""
        self.links.on_event(event, endpoint)
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.peers.on_verified(endpoint)
        elif event == zmq.EVENT_CONNECT_RETRIED and len(self._failed_links) < FAILED_LINKS_MAX:
            # Judged at the next tick (a channel's monitor is being read here: not closed now).
            self._failed_links.append(endpoint)
        self.cuts.on_event((sock, endpoint), event, time.monotonic())
        self._schedule_cuts()

    def _schedule_cuts(self) -> None:
        """Run :meth:`_check_cuts` when the earliest pending disconnection is due
        (and not at all while none is pending)."""
        due = self.cuts.due()
        interval, last, fn = self._timers[self._cut_timer]
        if due is None:
            if interval != CUT_IDLE:
                self._timers[self._cut_timer] = (CUT_IDLE, last, fn)
                self._timer_changed()
        elif due + TIMER_SLACK < last + interval:
            # (past the slack: run early, the check would find nothing due yet)
            self._timers[self._cut_timer] = (due + TIMER_SLACK - last, last, fn)
            self._timer_changed()

    def _check_cuts(self, now: float) -> None:
        """Timer: connect again to peers whose connection ZeroMQ cut (a frame over
        :attr:`frame_limit`); ZeroMQ itself never would."""
        try:
            self._cut_check(now)
        finally:
            self._schedule_cuts()

    def _cut_check(self, now: float) -> None:
        if not self.cuts.pending:
            return
        # Read the monitors first: a CONNECT_RETRIED may wait unread there.
        if self.keys is None:
            for refusals in self._refusals:
                if refusals.sock is self.sub:
                    refusals.read()
        else:
            for channel in list(self._channels.values()):
                if channel.refusals is not None:
                    channel.refusals.read()
        for sock, endpoint in self.cuts.cut(now):  # type: ignore[misc]
            channel = self._channel_socks.get(sock)
            if channel is not None:
                if channel.endpoint != endpoint or self._channels.get(channel.address) is not channel:
                    continue
                self._hold_one(sock, channel)
                security.reconnect(sock, endpoint, channel.key, self.log)
                self._busy.add(channel)  # the reconnect took any wake-up its ZMQ_FD held
                who = channel.address
            elif sock is self.sub and endpoint in self.peers.endpoints():
                self._disconnect_data(sock, endpoint)
                try:
                    sock.connect(endpoint)
                except zmq.ZMQError as exc:
                    self.log.debug("could not reconnect to %s: %s", endpoint, exc)
                who = endpoint
            else:
                continue  # the peer is gone meanwhile
            self.connections_cut += 1
            n = self.connections_cut
            if n <= 20 or n % 1000 == 0:
                self.log.warning(
                    "%s: the connection to peer %s was cut: it sent a frame over %d bytes (max_record_bytes"
                    " + framing; a record over the limit, never read); connected again; %d cut so far",
                    self.kind,
                    who,
                    self.frame_limit,
                    n,
                )
            self.on_cut()

    def on_cut(self) -> None:
        """A data connection was cut and made again: what was in flight on it is lost."""

    def _read_channel_monitors(self) -> None:
        """Secure mode: refused handshakes on channels (their monitors' ZMQ_FDs fired)."""
        assert self._monitor_selector is not None
        for key, _ in self._monitor_selector.select(0):
            channel = key.data
            if channel.refusals is not None and self._channels.get(channel.address) is channel:
                channel.refusals.read()
                channel.refusals.monitor.get(zmq.EVENTS)  # re-arms the ZMQ_FD

    def _sweep_channel_monitors(self, now: float) -> None:
        """Timer (secure): read every channel's monitor.

        A ZMQ_FD is edge-triggered and can miss an event that arrived while
        the monitor was being set up (a channel's first handshake was seen to
        stay unread): one receive per peer a beacon interval catches it.
        """
        for channel in list(self._channels.values()):
            if channel.refusals is not None:
                channel.refusals.read()

    def read_all_data(self) -> None:
        """Read what waits on the data SUB, or in secure mode on every channel (I/O thread only)."""
        if self.keys is None:
            self._read_data()
            return
        self._busy.update(self._channels.values())
        self._read_busy()

    def data_waiting(self) -> bool:
        """Whether records wait unread on the data SUB (every channel's, in secure mode).

        Secure mode: asking a channel's ZMQ_EVENTS takes the wake-up its ZMQ_FD
        held for the selector (ZeroMQ processes the pending commands), and the
        FD fires again only once the channel was read empty.  So a channel found
        holding input joins the busy ones (read at the end of this loop turn, or
        when reading resumes): left out, it was never read again.
        """
        if self.keys is None:
            return bool(fastio.events(self.sub) & POLLIN)
        for channel in self._channels.values():
            if channel.sock.get(zmq.EVENTS) & zmq.POLLIN:
                self._busy.add(channel)
                return True
        return False

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
        """What this node is and which peers it needs (see :mod:`dafka.core.beacon`)."""
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
            # A busy I/O thread (hundreds of nodes on a loop, a starved process)
            # may not have read the hellos waiting for it yet: read them before
            # taking a tower for a C one.  Taken by mistake, every node of a
            # 1,000-node mesh met every other (20,000 descriptors in a process
            # of 250 producers, its loop busy connecting, its memory growing).
            self._read_waiting_beacons()
            plain = self.census.needs_plain(time.monotonic())
        if plain and wire.BEACON not in self._beacon_subs:
            self._subscribe_plain()
        elif not plain and wire.BEACON in self._beacon_subs:
            self.beacon_sub.setsockopt(zmq.UNSUBSCRIBE, wire.BEACON)
            self._beacon_subs.discard(wire.BEACON)

    def _subscribe_plain(self) -> None:
        self.beacon_sub.setsockopt(zmq.SUBSCRIBE, wire.BEACON)
        self._beacon_subs.add(wire.BEACON)
        why = "relays what nodes send (a C tower)" if self.census.echoed(time.monotonic()) else "says no hello"
        self.log.info("%s %s: a tower %s; meeting every peer", self.kind, self.address[:8], why)

    def _admit_peers(self, now: float) -> None:
        """Drop unverified peers that keep failing; connect waiting ones as the bounds allow."""
        failed, self._failed_links = self._failed_links, []
        for endpoint in failed:
            for action in self.peers.on_failed(endpoint, self.links.failing.get(endpoint, 0), now):
                self._apply_peer_action(action)
        if self.peers.waiting:
            for action in self.peers.admit_waiting(now):
                self._apply_peer_action(action)

    def _tick(self, now: float) -> None:
        if self._failed_links or self.peers.waiting:
            self._admit_peers(now)
        if self._probe_at and now >= self._probe_at:
            self._probe_step *= 2
            self._probe_at = now + self._probe_step if self._probe_step <= self.config.beacon_interval else 0.0
            self._send_probe()
        if self._beacon_wanted:  # new peers since the last tick: one beacon for them all
            self._beacon_wanted = False
            self._send_beacon(now)
        self.on_tick(now)
        interval = self.tick_interval()
        timer = self._timers[self._tick_timer]
        if timer[0] != interval:
            # A slow tick runs with the other timers of its interval (one wake-up).
            last = self._in_step(interval, now) if interval > TICK else timer[1]
            self._timers[self._tick_timer] = (interval, last, timer[2])
            self._timer_changed()

    def tick_interval(self) -> float:
        """Seconds to the next :meth:`on_tick` (an idle node may tick less often:
        on a mesh of a thousand devices the ticks are most of a node's cost)."""
        return TICK

    def _send_beacon(self, now: float) -> None:
        if self.beacon_held:
            return
        send, pub = fastio.send_frames, self.beacon_pub
        try:
            # Interest beacons first: a dafka tower then knows this address is no C node.
            for frames in self._interest_beacons:
                send(pub, frames)
            # Filtered away by the PUB while no C node or probe subscribes B.
            send(pub, self._beacon)
        except zmq.ZMQError:
            pass  # no tower connected yet; the next interval retries
        self._send_probe()

    def _send_probe(self) -> None:
        """Our probe (see dafka.core.beacon): only a tower that forwards our reflection
        subscription (a C tower) gets it, and relays it back to us alone."""
        if self.keys is not None or self.beacon_held:
            return  # (no C tower on a secure mesh)
        try:
            fastio.send_frames(self.beacon_pub, self._probe)
        except zmq.ZMQError:
            pass

    def _read_beacons(self) -> None:
        try:
            self._read_beacon_messages()
        finally:
            if self._echoed:
                self._echoed = False
                self.census.on_echo(time.monotonic())
                self._probe_at = 0.0
                if wire.BEACON not in self._beacon_subs:
                    self._subscribe_plain()

    def _read_beacon_messages(self) -> None:
        # (compiled where available: no exception at the end of each read)
        for frames in fastio.recv_messages(self.beacon_sub, DRAIN):
            self.tower_watch.on_heard(time.monotonic())
            if frames[0][:1] == reach.REFLECTION:
                if beacon.is_echo(frames, self.address):
                    self._echoed = True  # our probe, relayed: a tower that is no dafka tower
                    continue
                self._on_reflection(frames)
                continue
            if frames == [wire.WELCOME]:
                # A tower (re)appeared: tell it about us right away, and probe
                # it a few times more while our subscriptions reach it.
                self.census.on_welcome(time.monotonic())
                self._send_beacon(time.monotonic())
                self._probe_step = beacon.PROBE_FIRST
                self._probe_at = time.monotonic() + self._probe_step
                continue
            tower_id = beacon.parse_hello(frames)
            if tower_id is not None:
                self.census.on_hello(tower_id, time.monotonic())
                continue
            secure = self.guard is not None
            try:
                # One beacon, or a dafka tower's batch of many of one kind and key.
                kind, interest_key, entries, errors = beacon.decode_tower_relay(
                    frames, security.KEY_LENGTH if secure else 0
                )
            except ProtocolError as exc:
                self.bad_input("tower beacon", exc)
                continue
            for error in errors:
                self.bad_input("tower beacon", error)
            now = time.monotonic()
            for address, endpoint, key in entries:
                if secure and not security.address_bound(address, key):
                    # A tower that does not check (ours does): an address squatted by another key.
                    self.bad_input("tower beacon", f"peer address {address[:40]!r} is not bound to its key")
                    continue
                if address == self.address and not self._is_own_endpoint(endpoint):
                    if closed_here(address, endpoint):
                        continue  # a late beacon of our predecessor in this process: not live
                    self.duplicates_seen += 1
                    self.on_duplicate_address(endpoint)
                    continue
                if secure and not self._allowed_peer(address, key):
                    continue
                for action in self.peers.on_beacon(address, endpoint, now, kind, interest_key):
                    self._apply_peer_action(action)

    def _on_reflection(self, frames: list[bytes]) -> None:
        """How the tower sees us (dafka towers; C towers never send it)."""
        try:
            reflection = reach.decode_reflection(frames)
        except ProtocolError as exc:
            self.bad_input("reflection", exc)
            return
        if reflection.address != self.address:
            return  # another node's address with ours as a prefix
        warning = self.reach.on_reflection(reflection, time.monotonic())
        if warning:
            self.log.warning("%s %s: %s", self.kind, self.address[:8], warning)

    def _check_reach(self, now: float) -> None:
        """Timer: warn when peers are on the mesh but none reached our publisher."""
        peers = 0 if self.beacon_held else len(self.peers)
        if not self.reach.warning_due(now, peers, self.inbound.handshakes):
            return
        reasons = self.reach.reasons(self._bound, self.beacon_host, self.peers.endpoints())
        self.log.warning(
            "%s %s may be unreachable: %d peer(s) on the mesh, none connected to its publisher (%s) in %.0fs: %s",
            self.kind,
            self.address[:8],
            peers,
            self._bound,
            now - max(self.reach.peers_since or now, self.reach.started),
            "; ".join(reasons),
        )

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
        if self._tower_refused:
            # ZeroMQ gave the refused connections up: try again (the tower may be plain by now).
            for sock, endpoint in self._tower_refused:
                self._before_tower_disconnect(sock)
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(endpoint)
                with contextlib.suppress(zmq.ZMQError):
                    sock.connect(endpoint)
            self._tower_refused.clear()
        self._check_census(now)
        if self.config.towers and self.tower_watch.warning_due(now):
            self.log.warning(
                "%s %s has reached no tower after %.0fs; trying %s (%s)",
                self.kind,
                self.address[:8],
                now - self.tower_watch.started,
                ", ".join(f"{t.beacon_in} / {t.beacon_out}" for t in self.config.towers),
                self.tower_watch.hint(),
            )

    def _read_tower_handshakes(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        """A plain node's handshake with a tower failed: a secure tower (say so once)."""
        for _ in range(100):
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2 or len(frames[0]) < 6:
                continue
            endpoint = frames[1].decode(errors="replace")
            self._tower_refused.add((sock, endpoint))
            event, value = _MONITOR_EVENT.unpack_from(frames[0])
            if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self.log.debug("handshake with the tower at %s failed (event %d, %#x)", endpoint, event, value)
            elif self.tower_watch.on_refused(endpoint, time.monotonic()):
                self.log.warning("%s %s: %s", self.kind, self.address[:8], refused_hint([endpoint]))

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
        self._open_channel(action.address, action.endpoint)

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
        for channel in self._channels.values():
            # A key may have another role now: what it was believed for is checked again.
            channel.prefixes.clear()
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
            channel: Channel | None = None
            if key is None:
                channel = self._channel_socks.get(sock)
                if channel is not None and channel.endpoint == endpoint:
                    key = channel.key
            if key is None:
                continue  # the peer is gone meanwhile
            if channel is not None:
                self._hold_one(sock, channel)
            else:
                self._before_tower_disconnect(sock)
            security.reconnect(sock, endpoint, key, self.log)
            if channel is not None:
                self._busy.add(channel)  # the reconnect took any wake-up its ZMQ_FD held

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
                self._timer_changed()
            self.on_peer(action.endpoint, action.address)
        else:
            self.links.forget(action.endpoint)
            channel = self._channels.get(action.address)
            if channel is not None:
                if channel.endpoint == action.endpoint:
                    self._close_channel(action.address)
            else:
                self.cuts.forget((self.sub, action.endpoint))
                self._disconnect_data(self.sub, action.endpoint)
            self.log.debug("dropped silent peer %s", action.address)
            try:
                self.on_peer_gone(action.address)
            except Exception:
                self.log.exception("%s failed after dropping a peer", self.kind)

    def _read_waiting_beacons(self) -> None:
        """Read the beacons waiting on the beacon SUB now (at most 8 reads of DRAIN)."""
        for _ in range(8):
            if not fastio.events(self.beacon_sub) & POLLIN:
                break
            self._read_beacons()

    def lazy_beacons(self) -> bool:
        """Whether the beacons this node hears may wait for its next turn (a
        timer, other input) instead of waking it (hook; False: at once).  Its
        peers are then met and renewed up to one timer turn (a second) late."""
        return False

    def _update_lazy_beacons(self) -> None:
        lazy = self.lazy_beacons()
        if lazy != self._lazy_beacons:
            self._lazy_beacons = lazy
            self.watch_events(self.beacon_sub, 0 if lazy else POLLIN)

    def _expire_peers(self, now: float) -> None:
        # Silence is judged on what the towers relayed, not on what we found
        # time to read: a busy or starved I/O thread (or a lagging tower)
        # expired whole meshes at once at 1,000 partitions, each drop tearing
        # a connection down and making it again a beacon later, which kept
        # every node busier still.  So read what waits first, and expire
        # nobody while no tower was heard at all lately.
        self._read_waiting_beacons()
        now = time.monotonic()
        if self.config.towers and self.tower_watch.quiet(now, self._quiet_limit):
            self.peers.postpone(now)
            return
        for action in self.peers.expire(now):
            self._apply_peer_action(action)
            if action.address not in self.peers:
                self._peer_keys.pop(action.address, None)
        self._update_lazy_beacons()

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

    def _data_events(self) -> int:
        return 0 if self.data_paused or self._linger_until else zmq.POLLIN

    def _watch_data(self) -> None:
        events = self._data_events()
        self._poller.modify(self.sub, events)
        if self._channel_selector is not None:
            self._poller.modify(self._channel_selector, events)

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

        Record prefixes get their batch twin first (see :mod:`dafka.core.audience`):
        every reader of ours takes batches.
        """
        if prefix[:1] in RECORD_IDS:
            self._set_subscription(zmq.SUBSCRIBE, wire.BATCH_CAPABLE + prefix)
        self._set_subscription(zmq.SUBSCRIBE, prefix)

    def unsubscribe(self, prefix: bytes) -> None:
        self._set_subscription(zmq.UNSUBSCRIBE, prefix)
        if prefix[:1] in RECORD_IDS:  # the twin last
            self._set_subscription(zmq.UNSUBSCRIBE, wire.BATCH_CAPABLE + prefix)

    def _set_subscription(self, option: int, prefix: bytes) -> None:
        """(Un)subscribe the data SUB, or in secure mode every channel (and remember it for new ones)."""
        if self.keys is None:
            self.sub.setsockopt(option, prefix)
            return
        subscriptions = self._subscriptions
        if option == zmq.SUBSCRIBE:
            subscriptions[prefix] += 1
        elif subscriptions[prefix] > 0:
            subscriptions[prefix] -= 1
            if not subscriptions[prefix]:
                del subscriptions[prefix]
        else:
            subscriptions.pop(prefix, None)
            return  # never subscribed: nothing to take back
        for sock in self._channel_socks:
            sock.setsockopt(option, prefix)
