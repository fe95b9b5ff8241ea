"""The shell of a gateway's client connections, shared by the Tank and Kafka listeners.

Sockets only, no protocol: accepting (the allow-list, refusals counted and
logged at a bounded rate), and sending answers without blocking: what the
socket does not take now is queued, in order, and flushed when it can take
more.  Each gateway keeps its own framing, request order and back pressure
(when it stops reading a connection, and when it reads it again).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

#: Buffers given to one ``sendmsg`` (systems allow 1024).
MAX_IOV = 512
#: Connections taken from a listener per readiness (the others wait for the next poll).
ACCEPT_BATCH = 64


@dataclass(eq=False, slots=True)
class Connection:
    """One client: its socket and its unsent answers (``out``, ``out_size`` bytes,
    none of them taken by the socket since ``out_since``, monotonic seconds)."""

    sock: socket.socket
    name: str
    out: deque[Any] = field(default_factory=deque)
    out_size: int = 0
    closed: bool = False
    reading: bool = True
    stalled_since: float | None = None  # half a frame buffered, no progress since
    out_since: float | None = None  # answers unsent, none of them taken since


class Refusals:
    """Clients refused: counted, and logged for the first 20 and every 1000th after."""

    __slots__ = ("count", "log")

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.count = 0

    def note(self, msg: str, *args: Any) -> None:
        self.count += 1
        if self.count <= 20 or self.count % 1000 == 0:
            self.log.warning(msg, *args)


class LogLimiter:
    """Repeated log lines, rate-limited per kind: the first :attr:`burst` of a kind, then at most
    one every :attr:`interval` seconds, saying how many were left out meanwhile."""

    __slots__ = ("burst", "clock", "interval", "log", "_kinds")

    def __init__(self, log: logging.Logger, burst: int = 10, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.burst = burst
        self.interval = interval
        self.clock = clock
        self._kinds: dict[str, list[float]] = {}  # kind -> [lines logged, next due, left out]

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        self.emit(logging.WARNING, kind, msg, *args)

    def emit(self, level: int, kind: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        st = self._kinds.get(kind)
        if st is None:
            if len(self._kinds) >= 1024:  # kinds are the callers' constants; bounded all the same
                self._kinds.clear()
            st = self._kinds[kind] = [0, 0.0, 0]
        now = self.clock()
        if st[0] < self.burst or now >= st[1]:
            if st[2]:
                msg += f" ({int(st[2])} such lines left out)"
                st[2] = 0
            st[0] += 1
            if st[0] >= self.burst:
                st[1] = now + self.interval
            self.log.log(level, msg, *args, exc_info=exc_info)
        else:
            st[2] += 1


def accepted(listener: socket.socket, kind: str, log: logging.Logger) -> Iterator[tuple[socket.socket, Any]]:
    """The connections waiting on a non-blocking listener (at most :data:`ACCEPT_BATCH`)."""
    for _ in range(ACCEPT_BATCH):
        try:
            sock, peer = listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # out of file descriptors, ...
            log.error("cannot accept a %s connection: %s", kind, exc)
            return
        yield sock, peer


def client_allowed(host: str, networks: Iterable[Any]) -> bool:
    """Whether ``host`` (an IPv4-mapped IPv6 address counts as its IPv4 one) is in ``networks``."""
    try:
        ip: Any = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)


def events(conn: Connection) -> int:
    """The poll events a connection waits for: input while it is read, output while answers wait."""
    return (zmq.POLLIN if conn.reading else 0) | (zmq.POLLOUT if conn.out else 0)


def prepare(sock: socket.socket) -> None:
    """An accepted socket as the gateways use it: non-blocking, no Nagle delay."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send(conn: Connection, data: bytes | list[bytes]) -> int:
    """Send ``data`` (one byte string, or several back to back) after what is queued.

    What the socket takes now goes (several buffers in one ``sendmsg``), the
    rest is queued on ``conn.out``.  Returns the bytes sent now; an OSError
    other than would-block is raised for the caller to close the connection.
    """
    parts = data if isinstance(data, list) else [data]
    size = sum(map(len, parts))
    if conn.out:
        conn.out.extend(parts)
        conn.out_size += size
        return 0
    sock = conn.sock
    try:
        n = sock.send(parts[0]) if len(parts) == 1 else sock.sendmsg(parts[:MAX_IOV])
    except (BlockingIOError, InterruptedError):
        n = 0
    if n == size:
        return n
    conn.out_since = time.monotonic()
    conn.out_size += size - n
    left = n
    for part in parts:
        if left >= len(part):
            left -= len(part)
            continue
        conn.out.append(memoryview(part)[left:] if left else part)
        left = 0
    return n


def flush(conn: Connection) -> int:
    """Send queued answers while the socket takes them: the bytes sent (OSError: as :func:`send`).

    ``out_since`` moves when some go, and is None once none wait.
    """
    out = conn.out
    sock = conn.sock
    sent = 0
    while out:
        head = out[0]
        try:
            n = sock.send(head)
        except (BlockingIOError, InterruptedError):
            break
        conn.out_size -= n
        sent += n
        if n == len(head):
            out.popleft()
        else:
            out[0] = memoryview(head)[n:]
            break
    if not out:
        conn.out_since = None
    elif sent:
        conn.out_since = time.monotonic()
    return sent


def unread_for(conn: Connection, now: float) -> float:
    """Seconds the socket has taken none of the connection's waiting answers (0: none wait)."""
    since = conn.out_since
    return now - since if since is not None and conn.out else 0.0


def close_quietly(sock: socket.socket) -> None:
    """Close a client's socket; an error closing it changes nothing."""
    try:
        sock.close()
    except OSError:
        pass
