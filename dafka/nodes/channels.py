"""A node's data connections: in secure mode one channel (a CURVE SUB) per peer, the checks of what
each peer may say, their monitors, cut connections, and messages held across a disconnection.
"""

from __future__ import annotations

import selectors
import time
from collections import deque
from typing import Any

import zmq

from dafka import fastio
from dafka.config import DEFAULT_MAX_RECORD_BYTES
from dafka.core import wire
from dafka.errors import ProtocolError
from dafka.nodes import security
from dafka.nodes.sockets import DRAIN, POLLIN
from dafka.nodes.timers import TIMER_SLACK

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
# Monitor events read besides refused handshakes: who completed a handshake with
# our publisher (peers reach us), and which peers our data SUB reaches (dafka.core.reach).
INBOUND_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
OUTBOUND_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
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
CUT_IDLE = 3600.0  # seconds between cut checks while no disconnection is pending
# Bytes of messages read early before a disconnection (see Node._hold_one) that
# may wait while reading is paused; beyond it one is dropped (fetched again).
HELD_MAX_BYTES = 8 * 1024 * 1024


def frame_limit(max_record_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE of the data SUBs of a node with this ``max_record_bytes``."""
    return max(max_record_bytes, DEFAULT_MAX_RECORD_BYTES) + FRAME_SLACK


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


class ChannelsMixin:
    """Data channels of a :class:`~dafka.nodes.node.Node` (state set up by ``Node.__init__``)."""

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
