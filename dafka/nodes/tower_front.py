"""A plain tower's beacon-out port: an XPUB spoken in Python, with bounded subscriptions.

libzmq's XPUB stores every subscription before the application sees one (see
:mod:`dafka.core.zmtp`), so a plain tower does not use one: :class:`PlainXpub`
accepts the TCP connections itself and speaks ZMTP 3.0/3.1 with the NULL
mechanism as a libzmq XPUB does (welcome message included), to libzmq SUBs of
any 4.x version (C nodes, pyzmq).  A connection is cut when it sends a
subscription longer than ``MAX_SUBSCRIPTION`` bytes, holds more than
``PEER_SUBSCRIPTIONS`` or ``PEER_BYTES``, or has not finished its handshake
within ``HANDSHAKE_TIMEOUT``; when all connections hold more than
``TOTAL_BYTES``, those holding the most are cut.  Output is bounded as the XPUB's
high-water mark did: a subscriber more than ``OUT_MAX`` bytes behind loses
messages (as ZeroMQ drops at the mark), and when all backlogs pass
``OUT_TOTAL`` the longest is cut.  At most ``MAX_CONNECTIONS`` at once.

The tower's loop polls :meth:`PlainXpub.fileno` (an epoll descriptor),
calls :meth:`PlainXpub.process` when it is ready, :meth:`PlainXpub.send`
to publish, and :meth:`PlainXpub.flush` once per turn (one write per
subscriber however many messages the turn sent).  Secure towers keep libzmq's
XPUB (CURVE), reachable by allowed keys only.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from collections.abc import Sequence

import zmq

from dafka.core import zmtp
from dafka.errors import ProtocolError

log = logging.getLogger("dafka.tower")

HANDSHAKE_TIMEOUT = 30.0  # seconds, as libzmq's ZMQ_HANDSHAKE_IVL
OUT_MAX = 4 * 1024 * 1024  # bytes queued for one subscriber (about what TOWER_HWM messages held)
OUT_TOTAL = 64 * 1024 * 1024  # bytes queued for all of them
MAX_CONNECTIONS = 16_384
READ_SIZE = 65536  # bytes read from one connection per turn
ACCEPTS = 64  # connections accepted per turn
ACCEPT_PAUSE = 0.5  # seconds without accepting after running out of descriptors
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Conn:
    __slots__ = ("sock", "fd", "peer", "session", "out", "sent", "deadline", "writing", "dropped", "alive")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.session = zmtp.Session()
        self.out = bytearray()
        self.sent = 0  # bytes of out already written
        self.deadline = deadline  # handshake deadline (0 once open)
        self.writing = False  # registered for EVENT_WRITE
        self.dropped = 0  # messages dropped at OUT_MAX
        self.alive = True

    @property
    def backlog(self) -> int:
        return len(self.out) - self.sent


class CutLog:
    """Logs cut connections without flooding the log (the first 20, then every 1000th)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, peer: str, reason: str) -> None:
        self.count += 1
        n = self.count
        if n <= 20 or n % 1000 == 0:
            log.warning("tower beacons out: cut %s (%s); %d cut so far", peer, reason, n)


def resolve_bind(host: str) -> str:
    """The IP address libzmq would bind ``host`` to (``*``, an IP, an interface or host name).

    Asked of libzmq itself, so names resolve as they do for the in-port; its
    errors (no such interface...) are raised as they would be by a bind.
    """
    probe: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    try:
        probe.setsockopt(zmq.LINGER, 0)
        probe.bind_to_random_port(f"tcp://{host}", max_tries=1)
        endpoint = str(probe.getsockopt_string(zmq.LAST_ENDPOINT))
    finally:
        probe.close(0)
    address = endpoint.rsplit(":", 1)[0].removeprefix("tcp://")
    return address.strip("[]")


class PlainXpub:
    """The beacon-out port of a plain tower (see the module docstring)."""

    def __init__(self, host: str, port: int, welcome: bytes, book: zmtp.SubscriptionBook[_Conn] | None = None) -> None:
        address = resolve_bind(host)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq
            listener.bind((address, port))
            listener.listen(256)
        except OSError as exc:
            listener.close()
            if exc.errno is not None:
                raise zmq.ZMQError(exc.errno) from exc  # reported as the XPUB's bind errors were
            raise
        listener.setblocking(False)
        self.listener = listener
        self.port: int = listener.getsockname()[1]
        self.endpoint = f"tcp://{'[' + address + ']' if family == socket.AF_INET6 else address}:{self.port}"
        self.welcome = zmtp.message([welcome])
        self.book: zmtp.SubscriptionBook[_Conn] = book if book is not None else zmtp.SubscriptionBook()
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.conns: dict[int, _Conn] = {}
        self._dirty: dict[_Conn, None] = {}
        self._events: list[bytes] = []  # (un)subscriptions as an XPUB reports them
        self.out_total = 0
        self.cut = CutLog()
        self.dropped = 0  # messages dropped for subscribers more than OUT_MAX behind
        self._accept_paused_until = 0.0
        self._next_check = 0.0

    def fileno(self) -> int:
        return self.selector.fileno()

    # ------------------------------------------------------------------ input

    def process(self, now: float | None = None) -> None:
        """Accept, read and write what is ready; cut connections past their handshake deadline."""
        now = time.monotonic() if now is None else now
        for key, mask in self.selector.select(0):
            conn = key.data
            if conn is None:
                self._accept(now)
                continue
            if mask & selectors.EVENT_READ and conn.alive:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and conn.alive:
                self._write(conn)
        if now >= self._next_check:
            self._next_check = now + 1.0
            self._check(now)

    def subscriptions(self) -> list[bytes]:
        """The (un)subscription frames since the last call: ``01`` + prefix when a prefix got its
        first holder, ``00`` + prefix when it lost its last one (as a non-verbose XPUB)."""
        events, self._events = self._events, []
        return events

    def _accept(self, now: float) -> None:
        for _ in range(ACCEPTS):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRNOS:
                    log.warning("tower beacons out: cannot accept (%s); pausing %.1fs", exc.strerror, ACCEPT_PAUSE)
                    self.selector.unregister(self.listener)
                    self._accept_paused_until = now + ACCEPT_PAUSE
                    self._next_check = min(self._next_check, self._accept_paused_until)
                return
            peer = f"{addr[0]}:{addr[1]}"
            if len(self.conns) >= MAX_CONNECTIONS:
                sock.close()
                self.cut(peer, f"more than {MAX_CONNECTIONS} connections")
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as libzmq
            except OSError:
                sock.close()  # gone already
                continue
            conn = _Conn(sock, peer, now + HANDSHAKE_TIMEOUT)
            self.conns[conn.fd] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)
            self._queue_raw(conn, conn.session.output())
            self._write(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, None if exc.errno == errno.ECONNRESET else exc.strerror or str(exc))
            return
        if not data:
            self._drop(conn, None)
            return
        was_open = conn.session.open
        try:
            events = conn.session.receive(data)
        except ProtocolError as exc:
            self._drop(conn, str(exc))
            return
        output = conn.session.output()
        if output:
            self._queue_raw(conn, output)
        if not was_open and conn.session.open:
            conn.deadline = 0.0
            self._queue_raw(conn, self.welcome)  # as ZMQ_XPUB_WELCOME_MSG: to every new subscriber
        book = self.book
        for subscribe, prefix in events:
            if subscribe:
                try:
                    first, cut = book.subscribe(conn, prefix)
                except ProtocolError as exc:
                    self._drop(conn, str(exc))
                    return
                if first:
                    self._events.append(b"\x01" + prefix)
                for other in cut:
                    self._drop(other, f"all connections hold more than {book.total_bytes // 1024} KiB of subscriptions")
                if not conn.alive:
                    return
            elif book.cancel(conn, prefix):
                self._events.append(b"\x00" + prefix)
        if conn.backlog:
            self._dirty[conn] = None

    def _check(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self.selector.register(self.listener, selectors.EVENT_READ, None)
        for conn in [c for c in self.conns.values() if c.deadline and now >= c.deadline]:
            self._drop(conn, f"no handshake within {HANDSHAKE_TIMEOUT:.0f}s")

    # ----------------------------------------------------------------- output

    def send(self, frames: Sequence[bytes]) -> None:
        """Publish a message to every subscriber holding a prefix of its first frame (at :meth:`flush`)."""
        peers = self.book.match(bytes(frames[0]))
        if not peers:
            return
        data = zmtp.message(frames)
        for conn in peers:
            if not conn.alive:
                continue  # cut while this message was queued (OUT_TOTAL)
            if conn.backlog + len(data) > OUT_MAX:
                conn.dropped += 1
                self.dropped += 1
                continue
            self._queue_raw(conn, data)

    def flush(self) -> None:
        """Write what :meth:`send` queued (once per loop turn); cut handshakes past their deadline."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + 1.0
            self._check(now)
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, {}
        for conn in dirty:
            if conn.alive and not conn.writing:
                self._write(conn)

    def _queue_raw(self, conn: _Conn, data: bytes) -> None:
        conn.out += data
        self.out_total += len(data)
        self._dirty[conn] = None
        if self.out_total > OUT_TOTAL:
            worst = max(self.conns.values(), key=lambda c: c.backlog)
            self._drop(worst, f"subscribers are more than {OUT_TOTAL // 1024 // 1024} MB behind; this one most")

    def _write(self, conn: _Conn) -> None:
        backlog = conn.backlog
        if not backlog or not conn.alive:
            return
        try:
            n = conn.sock.send(memoryview(conn.out)[conn.sent :])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            self._drop(conn, None if exc.errno in (errno.ECONNRESET, errno.EPIPE) else exc.strerror or str(exc))
            return
        self.out_total -= n
        if n == backlog:
            conn.out.clear()
            conn.sent = 0
            if conn.writing:
                conn.writing = False
                self.selector.modify(conn.sock, selectors.EVENT_READ, conn)
            return
        conn.sent += n
        if conn.sent > 65536 and conn.sent * 2 > len(conn.out):
            del conn.out[: conn.sent]
            conn.sent = 0
        if not conn.writing:
            conn.writing = True
            self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    # ------------------------------------------------------------------ close

    def _drop(self, conn: _Conn, reason: str | None) -> None:
        """Close ``conn``; its prefixes that lost their last holder are reported cancelled."""
        if not conn.alive:
            return
        conn.alive = False
        del self.conns[conn.fd]
        if reason is not None:
            self.cut(conn.peer, reason)
        self.out_total -= conn.backlog
        self._dirty.pop(conn, None)
        for prefix in self.book.close(conn):
            self._events.append(b"\x00" + prefix)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._drop(conn, None)
        self._events.clear()
        try:
            self.selector.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()
        self.selector.close()
