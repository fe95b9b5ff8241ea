"""A node's discovery: beacons to and from the towers, the peers they announce (connecting,
expiring, the allow-list), the tower connections and their monitors, and whether peers reach us.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from typing import Any

import zmq

from dafka import fastio
from dafka.core import beacon, reach, wire
from dafka.core.peers import Connect, PeerAction, refused_hint
from dafka.errors import ProtocolError
from dafka.nodes import security
from dafka.nodes.channels import Channel
from dafka.nodes.sockets import DRAIN, POLLIN
from dafka.nodes.timers import TICK

_MONITOR_EVENT = struct.Struct("=HI")  # a socket monitor's first frame: event, value
RETRY_REFUSED = 1.0  # seconds before connecting again where a secure handshake was refused
REACH_GRACE = 5  # beacon intervals with peers and none reaching us before a warning
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


class DiscoveryMixin:
    """Beacons, towers and peers of a :class:`~dafka.nodes.node.Node` (state set up by ``Node.__init__``)."""

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
