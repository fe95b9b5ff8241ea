"""The tower: where nodes find each other.

An XSUB takes node beacons in (``B, address, host, port``) and an XPUB sends
tower beacons out (``B, address, tcp://host:port``) to every node; when the
node gave no host, the connection's Peer-Address is used.  Subscriptions that
arrive on the XPUB are forwarded to the XSUB (so the nodes' beacon PUBs send
their beacons), except the ``W`` welcome subscriptions.  New subscribers get a
one-frame ``W`` welcome message.  Unlike the reference tower, nothing here
needs a network interface besides loopback.

In secure mode (a :class:`~dafka.nodes.security.SecurityConfig`) both sockets are
CURVE servers checked against the allow-list; a node beacon carries the
node's public key as a 5th frame and is relayed (with the key as a 4th frame)
only when that key is the one the node authenticated with (ZAP User-Id) and
the node's address is bound to that key (:func:`dafka.nodes.security.address_bound`):
nobody can beacon, and so squat, an address that belongs to another key.

Dafka only: interest beacons (``X...``, see :mod:`dafka.core.beacon`) are
relayed by their own prefix, and those of one first frame that come within
``BATCH_WINDOW`` of its last relay go out together as one batch message
(:class:`~dafka.core.beacon.RelayBatcher`); ``B`` beacons go out one by one,
as C nodes read them.

A plain tower's beacon-out port is not a libzmq XPUB but
:class:`~dafka.nodes.tower_front.PlainXpub`, the same bytes on the wire with
bounded subscriptions (libzmq's XPUB stores every one a subscriber sends);
a secure tower keeps libzmq's (CURVE: allowed keys only).  Only subscriptions
that can select a node beacon the tower does not already take (``B``, and the
empty one) are forwarded to the XSUB, so none reaches nodes' beacon PUBs in vain.

Dafka only: region bridges (:mod:`dafka.core.bridge`).  The crossing interest
beacons of our own nodes (stores, consumers, groups) are also published as
exports (``Y`` + first frame) for the bridges of other regions' towers; a
tower given ``bridges`` (other towers' beacon-out endpoints) takes their
exports on a SUB each and relays them to its nodes, never exporting them again.

Dafka only: a node that subscribed its REFLECTION gets, after each of its
beacons, how this tower sees it (the peer address, the endpoint relayed) and
whether the tower could open a TCP connection to that endpoint (plain mode;
see :mod:`dafka.core.reach`).  C nodes never ask, and never get one.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

import zmq

from dafka.core import beacon, bridge, reach, wire
from dafka.errors import ConfigError, ProtocolError
from dafka.fastio import events as zmq_events
from dafka.fastio import send_frames
from dafka.nodes import security
from dafka.nodes.node import ErrorLog
from dafka.nodes.tower_front import PlainXpub

_POLLIN = int(zmq.POLLIN)

log = logging.getLogger("dafka.tower")
# The longest frame the beacons-in XSUB takes (ZMQ_MAXMSGSIZE): a beacon's are
# at most a few hundred bytes; the CURVE handshake's about 300.
BEACON_FRAME_MAX = 4096
XPUB_CLOSE_LINGER_MS = 200  # see _close_sockets
PROBE_TIMEOUT = 2.0  # seconds a TCP connection to an announced endpoint may take


def forwarded(subscription: bytes) -> bool:
    """Whether an (un)subscription frame from the beacon-out port goes on to the nodes' beacon PUBs.

    Nodes send ``B`` beacons and interest beacons (``X...``), and the tower
    subscribes all of ``X`` itself: only a prefix of ``B`` (``B`` or the empty
    one) changes what they send.  Anything else would only be stored, by the
    XSUB and by every node's beacon PUB (ZeroMQ keeps them all).
    """
    return len(subscription) <= 2 and subscription[:1] in (b"\x00", b"\x01") and wire.BEACON.startswith(subscription[1:])


def check_bound(address: str, key: bytes) -> None:
    """Secure mode: ProtocolError unless the beacon's address is bound to its key."""
    if not security.address_bound(address, key):
        raise ProtocolError(f"beacon address {address[:40]!r} is not bound to the key it came with")


class Tower:
    """A tower bound on ``beacon_in`` (XSUB) and ``beacon_out`` (XPUB).

    Use as a context manager or call :meth:`start` / :meth:`close`.  Ports may
    be 0 to bind ephemeral ones (see :attr:`in_port` / :attr:`out_port`).
    """

    def __init__(
        self,
        bind: str = "*",
        in_port: int = 5556,
        out_port: int = 5557,
        security_config: security.SecurityConfig | None = None,
        bridges: Sequence[str] = (),
        bridge_keys: Sequence[bytes] = (),
    ) -> None:
        if bridges and security_config is not None and not bridge_keys:
            raise ConfigError("a secure tower's bridges need the other towers' public keys (--bridge-key)")
        if len(bridges) > bridge.MAX_BRIDGES:
            raise ConfigError(f"at most {bridge.MAX_BRIDGES} bridges, not {len(bridges)}")
        self.security = security_config
        self.guard = security.guard_for(security_config) if security_config else None
        self.ctx = self.guard.ctx if self.guard else zmq.Context.instance()
        self.xsub = self.ctx.socket(zmq.XSUB)
        self.xsub.setsockopt(zmq.LINGER, 0)
        self.xsub.setsockopt(zmq.RCVHWM, beacon.BEACON_HWM)
        # Beacon frames are short: a longer one cuts its connection before ZeroMQ
        # assembles it (else BEACON_HWM messages of any size could wait here).
        self.xsub.setsockopt(zmq.MAXMSGSIZE, BEACON_FRAME_MAX)
        # Beacons out: libzmq's XPUB in secure mode (CURVE), else our own (see tower_front).
        self.front: PlainXpub | None = None
        self.xpub: zmq.Socket | None = None
        if security_config is not None:
            self.xpub = self.ctx.socket(zmq.XPUB)
            self.xpub.setsockopt(zmq.LINGER, 0)
            self.xpub.setsockopt(zmq.XPUB_WELCOME_MSG, wire.WELCOME)
            self.xpub.setsockopt(zmq.SNDHWM, beacon.TOWER_HWM)  # per subscriber (see TOWER_HWM)
        self._refusals: list[security.RefusalLog] = []
        self._known_keys = set(self.guard.roles) if self.guard else set()
        if security_config is not None:
            keys = security.own_keys(security_config)
            for sock, what in ((self.xsub, "tower beacons in"), (self.xpub, "tower beacons out")):
                security.make_server(sock, keys)
                self._refusals.append(security.RefusalLog(sock, what, log))
        try:
            self.in_port = self._bind(self.xsub, bind, in_port)
            if self.xpub is not None:
                self.out_port = self._bind(self.xpub, bind, out_port)
            else:
                self.front = PlainXpub(bind, out_port, wire.WELCOME)
                self.out_port = self.front.port
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._bound = [self.xsub.getsockopt_string(zmq.LAST_ENDPOINT)]
        if self.xpub is not None:
            self._bound.append(self.xpub.getsockopt_string(zmq.LAST_ENDPOINT))
        self._publish: Callable[[Sequence[bytes]], object] = (
            self.front.send if self.front is not None else lambda frames: send_frames(self.xpub, frames)
        )
        self.bad_input = ErrorLog(log)
        self.beacons = 0
        self.reflections = 0
        # Plain mode: TCP connections to announced endpoints (a secure node would log
        # a raw connection as a refused handshake, so secure towers do not probe).
        self.probes = reach.ProbePlan()
        self._probing: dict[int, tuple[socket.socket, tuple[str, int], float]] = {}  # fd -> (sock, key, deadline)
        # Interest beacons (dafka.core.beacon): relayed by their own prefix; a B beacon of a
        # node that sends none (a C node) also as X U; a hello so nodes know we do this.
        self.relay = beacon.RelayBook()
        self.batches = beacon.RelayBatcher()
        self._stride = 3 if security_config is not None else 2  # a relayed beacon: address, endpoint (, key)
        self.tower_id = uuid.uuid4().hex.upper()
        self._hello = beacon.tower_hello(self.tower_id)
        self._greet = False  # a node subscribed: say hello soon (see run)
        self.hellos = 0
        # Every interest beacon reaches us, wanted by a node or not: the relay
        # book must know every dafka address to tell C nodes' B beacons apart.
        self.xsub.send(b"\x01" + beacon.PREFIX)
        # Region bridges (dafka.core.bridge): a SUB on each other region's beacon-out
        # port takes what its tower exports; our own nodes' crossing beacons are exported.
        self.imports = bridge.Import()
        if security_config is not None:
            self.imports.key_length = security.KEY_LENGTH
            self.imports.bound = security.address_bound
        self._bridge_keys: dict[str, bytes] = {}
        self.bridge_errors = ErrorLog(log)
        self.bridges: dict[zmq.Socket, tuple[str, bridge.Liveness]] = {}
        self.bridges_renewed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            for i, endpoint in enumerate(bridges):
                self.add_bridge(endpoint, bridge_keys[i if len(bridge_keys) > 1 else 0] if bridge_keys else None)
        except ConfigError:
            self._close_sockets()
            raise
        log.info(
            "tower: beacons in on %s:%d, out on %s:%d%s",
            bind,
            self.in_port,
            bind,
            self.out_port,
            " (secure)" if security_config else "",
        )

    def add_bridge(self, endpoint: str, key: bytes | None = None) -> None:
        """Bridge to another region's tower (its beacon-out ``tcp://host:port``; ``key``: its
        public key, which a secure tower needs); before :meth:`start`."""
        if self._thread is not None:
            raise RuntimeError("bridges are added before the tower starts")
        if self.security is not None:
            if not key:
                raise ConfigError(f"a secure tower's bridge to {endpoint} needs that tower's public key (--bridge-key)")
            self._bridge_keys[endpoint] = key
        if len(self.bridges) >= bridge.MAX_BRIDGES:
            raise ConfigError(f"at most {bridge.MAX_BRIDGES} bridges")
        try:
            sub = self._bridge_socket(endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"bad bridge endpoint {endpoint!r}: {exc}") from None
        self.bridges[sub] = (endpoint, bridge.Liveness(time.monotonic()))
        log.info("tower: bridged to %s (stores, consumers and groups cross; producers do not)", endpoint)

    def _bridge_socket(self, endpoint: str) -> zmq.Socket:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, beacon.BEACON_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, BEACON_FRAME_MAX)  # a longer frame cuts the connection
        for prefix in bridge.SUBSCRIPTIONS:
            sub.setsockopt(zmq.SUBSCRIBE, prefix)
        if self.security is not None:
            # A CURVE client with our tower key (the other region must allow it) and theirs.
            security.make_client(sub, security.own_keys(self.security))
            sub.setsockopt(zmq.CURVE_SERVERKEY, self._bridge_keys[endpoint])
        try:
            sub.connect(endpoint)
        except zmq.ZMQError:
            sub.close(0)
            raise
        return sub

    def _renew_bridges(self, poller: zmq.Poller, now: float) -> None:
        """Make silent bridges' connections anew (see dafka.core.bridge.Liveness)."""
        for sub, (endpoint, liveness) in list(self.bridges.items()):
            if not liveness.renew_due(now):
                continue
            poller.unregister(sub)
            sub.close(0)
            del self.bridges[sub]
            fresh = self._bridge_socket(endpoint)
            self.bridges[fresh] = (endpoint, liveness)
            poller.register(fresh, zmq.POLLIN)
            self.bridges_renewed += 1
            if self.bridges_renewed <= 20 or self.bridges_renewed % 1000 == 0:
                log.warning("tower: bridge to %s heard nothing for %.0fs: connecting anew", endpoint, liveness.wait)

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port(f"tcp://{host}")
        sock.bind(f"tcp://{host}:{port}")
        return port

    def __enter__(self) -> Tower:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="dafka-tower", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for refusals in self._refusals:
            refusals.close()  # stop the monitors while their sockets are open
        for sub in getattr(self, "bridges", ()):
            sub.close(0)
        self.xsub.close(0)
        if self.xpub is not None:
            # A linger, not 0: libzmq 4.3.5 aborts the process when a subscriber's
            # connection breaks while its session, midway through a multipart beacon,
            # is terminated without one (nodes stopping with their tower, as `dafka up`
            # does on Ctrl-C); with a linger the session can still read the rest.
            self.xpub.close(XPUB_CLOSE_LINGER_MS)
        if self.front is not None:
            self.front.close()

    def run(self) -> None:
        """Serve until :meth:`close` (blocking; :meth:`start` runs it in a thread)."""
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        out: zmq.Socket | int = self.xpub if self.xpub is not None else self.front.fileno()  # type: ignore[union-attr]
        poller.register(out, zmq.POLLIN)
        monitors = {refusals.monitor: refusals for refusals in self._refusals}
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        for sub in self.bridges:
            poller.register(sub, zmq.POLLIN)
        check_at = 0.0
        self._poller = poller
        hello_at = 0.0
        said_hello = -1e18
        try:
            while not self._stop.is_set():
                if self._greet:
                    # A new node: hello now, so it knows our kind at once (at most one per HELLO_ANSWER).
                    self._greet = False
                    hello_at = min(hello_at, said_hello + beacon.HELLO_ANSWER)
                if time.monotonic() >= hello_at:
                    said_hello = time.monotonic()
                    hello_at = said_hello + beacon.HELLO_INTERVAL
                    self._publish(self._hello)
                    self.hellos += 1
                if self.guard is not None and time.monotonic() >= check_at:
                    check_at = time.monotonic() + self.security.reload_interval  # type: ignore[union-attr]
                    self._check_allow_list()
                self._expire_probes(time.monotonic())
                if self.bridges:
                    self._renew_bridges(poller, time.monotonic())
                wait = min(200, max(0, int((hello_at - time.monotonic()) * 1000) + 1))
                batch_due = self.batches.due()
                if batch_due is not None:
                    wait = min(wait, max(0, int((batch_due - time.monotonic()) * 1000) + 1))
                for sock, _ in poller.poll(min(wait, 100) if self._probing else wait):
                    try:
                        if sock is self.xsub:
                            self._relay_beacons()
                        elif sock is out or sock == out:
                            self._forward_subscriptions()
                        elif sock in self.bridges:
                            self._import(sock)
                        elif isinstance(sock, int):
                            self._probe_done(sock)
                        else:
                            monitors[sock].read()
                    except zmq.ZMQError as exc:
                        if exc.errno == zmq.ETERM:
                            return
                        log.exception("tower socket error")
                if batch_due is not None or self.batches.due() is not None:
                    for batch in self.batches.flush(time.monotonic()):
                        self._publish(batch)
                if self.front is not None:
                    self.front.flush()  # one write per subscriber for the whole turn
        finally:
            for fd in list(self._probing):
                self._probing.pop(fd)[0].close()
            self._close_sockets()

    def _relay_beacons(self) -> None:
        for _ in range(1000):
            if not zmq_events(self.xsub) & _POLLIN:
                return  # (cheaper than ending on zmq.Again, once a wake-up)
            try:
                first = self.xsub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [first.bytes]
            while self.xsub.getsockopt(zmq.RCVMORE):
                frames.append(self.xsub.recv())
            if frames[0][:1] == beacon.ECHO:
                continue  # a node's probe (someone subscribed everything here): for C towers only
            key = b""
            try:
                if self.guard is not None:
                    frames, key = security.split_key(frames, 4, "node beacon")
                    if key != first.get("User-Id").encode():
                        raise ProtocolError("beacon names another key than the one it came with")
                head, address, host, port = beacon.decode_node_beacon(frames)
                if key:
                    check_bound(address, key)
            except ProtocolError as exc:
                self.bad_input("node beacon", exc)
                continue
            try:
                seen = first.get("Peer-Address")
            except zmq.ZMQError:
                seen = ""  # inproc/ipc peers have no address
            if not host:
                host = seen or "127.0.0.1"
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"  # IPv6 literal
            endpoint = f"tcp://{host}:{port}"
            now = time.monotonic()
            for relayed in self.relay.on_beacon(head, address, endpoint, now):
                for message in self.batches.add(relayed + [key] if key else relayed, now, self._stride):
                    self._publish(message)
                exported = bridge.export(relayed + [key] if key else relayed)
                if exported is not None:
                    for message in self.batches.add(exported, now, self._stride):
                        self._publish(message)
            self.beacons += 1
            if self.probes.wants(address):
                self._reflect(address, seen, endpoint)

    def _import(self, sub: zmq.Socket) -> None:
        """What a bridged tower exports: relayed to our nodes as our own nodes' beacons
        (never exported again, see dafka.core.bridge)."""
        for _ in range(1000):
            if not zmq_events(sub) & _POLLIN:
                return
            try:
                first = sub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [first.bytes]
            while sub.getsockopt(zmq.RCVMORE):
                frames.append(sub.recv())
            try:
                seen = first.get("Peer-Address")
            except zmq.ZMQError:
                seen = ""
            self.bridges[sub][1].on_heard(time.monotonic())
            refused = self.imports.refused
            relayed = self.imports.on_message(frames, str(seen))
            if self.imports.refused != refused:
                self.bridge_errors("bridge import", self.imports.errors[-1])
            now = time.monotonic()
            for beacon_frames in relayed:
                for message in self.batches.add(beacon_frames, now, self._stride):
                    self._publish(message)

    def _reflect(self, address: str, seen: str, endpoint: str) -> None:
        """Tell a node how this tower sees it, probing its endpoint now and then."""
        if self.guard is not None:
            probe = "not checked: a secure tower does not probe"
        else:
            probe, start = self.probes.on_beacon(seen, endpoint, time.monotonic())
            if start is not None:
                self._start_probe(start)
        if not self.probes.should_reflect(address, (seen, endpoint, probe), time.monotonic()):
            return
        self._publish(reach.encode_reflection(reach.Reflection(address, seen, endpoint, probe)))
        self.reflections += 1

    def _start_probe(self, key: tuple[str, int]) -> None:
        host, port = key
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self.probes.on_result(key, f"cannot probe: {exc.strerror or exc}", time.monotonic())
            return
        sock.setblocking(False)
        code = sock.connect_ex((host, port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self.probes.on_result(key, os.strerror(code).lower(), time.monotonic())
            return
        self._probing[sock.fileno()] = (sock, key, time.monotonic() + PROBE_TIMEOUT)
        self._poller.register(sock.fileno(), zmq.POLLOUT)

    def _probe_done(self, fd: int) -> None:
        sock, key, _ = self._probing.pop(fd)
        self._poller.unregister(fd)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        sock.close()
        self.probes.on_result(key, reach.PROBE_OK if code == 0 else os.strerror(code).lower(), time.monotonic())

    def _expire_probes(self, now: float) -> None:
        for fd, (sock, key, deadline) in list(self._probing.items()):
            if now >= deadline:
                del self._probing[fd]
                self._poller.unregister(fd)
                sock.close()
                self.probes.on_result(key, f"no answer within {PROBE_TIMEOUT:.0f}s (a firewall dropping it?)", now)

    def _check_allow_list(self) -> None:
        """Secure mode: reload the allow-list; when a key was removed, bind both
        sockets anew, which drops every connection: nodes reconnect at once and
        pass ZAP again, the removed ones fail."""
        assert self.guard is not None
        self.guard.refresh()
        removed = self._known_keys - set(self.guard.roles)
        self._known_keys = set(self.guard.roles)
        if not removed:
            return
        for sock, endpoint in zip((self.xsub, self.xpub), self._bound, strict=True):
            assert sock is not None
            sock.unbind(endpoint)
            for _ in range(200):  # the old listener closes asynchronously
                try:
                    sock.bind(endpoint)
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)
            else:
                log.error("tower could not bind %s again", endpoint)
        log.info("tower: a key left the allow-list; connections re-authenticated")

    def _subscription_frames(self) -> Iterable[bytes]:
        """(Un)subscriptions that came on the beacon-out port (as an XPUB gives them)."""
        if self.front is not None:
            self.front.process()
            yield from self.front.subscriptions()
            return
        assert self.xpub is not None
        for _ in range(1000):
            if not zmq_events(self.xpub) & _POLLIN:
                return
            try:
                yield self.xpub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _forward_subscriptions(self) -> None:
        for frame in self._subscription_frames():
            # Welcome and reflection subscriptions stay here; those that select B beacons reach the nodes' PUBs.
            if len(frame) >= 2 and frame[1:2] == wire.WELCOME:
                continue
            wanted = reach.wanted_reflection(frame)
            if wanted is not None:
                self.probes.on_subscription(*wanted)
                self._greet = self._greet or wanted[0]  # every node subscribes its own: a new node
                continue
            if not frame or frame[0] > 1:
                self.bad_input("subscription", "not a (un)subscribe frame")
                continue
            if forwarded(frame):
                self.xsub.send(frame)
