"""The thread that drives leaf connections: one epoll over many DEALERs.

A :class:`LeafLoop` serves any number of members (leaf producers, and leaf
consumers riding their own connection or a producer's): it polls their DEALERs
and a wake-up pipe, applies what each member's link decides and runs their
timers.  Kept apart from :mod:`dafka.nodes.leaf` so producers and readers both
build on it without needing each other.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import zmq

from dafka import fastio

log = logging.getLogger("dafka.leaf")

TICK = 0.2  # seconds between link ticks (of the members with something pending)
LINGER = 0.004  # seconds a shared loop rests after a turn that did a little (see LeafLoop)
LINGER_BELOW = 64  # members touched in a turn below which it is a little
SNDHWM = 10_000  # messages a DEALER queues (the endpoint's window bounds what is in flight)
MAX_SOCKETS = 32_768  # ZeroMQ sockets of a LeafLoop's context (one DEALER per member)
MAX_CLOSED_READERS = 16  # closed readers whose address a connection still recognises
_events = fastio.events
_POLLIN = int(zmq.POLLIN)
_GONE: Any = object()  # (an fd that is no member's any more)



class LoopMember(Hashable, Protocol):
    """What a :class:`LeafLoop` needs of a member (a leaf producer or a leaf consumer).

    ``armed``: the member's socket was read to the end (or its ZMQ_EVENTS looked
    at) and nothing was sent on it since, so its ZMQ_FD fires for the next message
    and the loop need not look at ZMQ_EVENTS after a turn that touched it (a send
    may take the edge: see LeafLoop).  The loop sets it True after a look that
    found nothing to read; the member sets it False at each send.  A member that
    cannot tell always answers False.
    """

    armed: bool

    @property
    def sock(self) -> zmq.Socket[Any] | None: ...

    def next_due(self) -> float | None:
        """When the member next has something to do on a tick (None: nothing until it is
        woken or read): its link's timers, and what else it keeps (an outbox's ages)."""

    def _tick(self, now: float) -> None: ...
    def _act(self, now: float) -> None: ...
    def _read(self, now: float) -> None: ...
    def _detach(self) -> None: ...


def _fd(sock: zmq.Socket[Any]) -> int:
    fd = sock.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    return fd


def parse_endpoints(leaf: str | Sequence[str]) -> list[str]:
    """``"HOST:PORT,HOST:PORT"`` (or a list of them) as a list of ``HOST:PORT``; ValueError if malformed."""
    items = leaf.split(",") if isinstance(leaf, str) else list(leaf)
    out = []
    for item in items:
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"a leaf endpoint is HOST:PORT, not {item!r}")
        out.append(f"{host}:{int(port)}")
    if not out:
        raise ValueError("a leaf needs at least one endpoint")
    return out


class LeafLoop:
    """One thread driving many leaf producers (see the module docstring).

    It waits in one epoll on its members' DEALERs (through ZMQ_FD, which is
    edge-triggered: a socket is read to the end when it fires, and after a turn
    every member it touched that sent since its socket was read to the end has
    ZMQ_EVENTS looked at, since a send can take the edge: see
    ``LoopMember.armed``) and on a pipe that :meth:`wake` writes to.  Only members with
    something pending (records unacknowledged, a HELLO unanswered) get ticks:
    a fleet of idle devices costs nothing between their records.  After a turn
    that touched fewer than LINGER_BELOW members the loop rests ``linger``
    seconds (4 ms; a producer's own loop: 0), so that a fleet's records and
    ACKs, each of another device, share turns instead of taking one each (each
    turn has a fixed cost: the rest, the wait, the GIL handed between the app's
    thread and this one, ZeroMQ's I/O thread woken for the sends; 4 ms instead
    of 2 took about a fifth off the device processes' CPU at 3,000 devices, see
    docs/concepts/leaves.md; a record and its ACK wait up to ``linger`` each).  A publish while the loop is
    awake (in a turn, or resting) joins the turn without a write to the pipe.
    """

    def __init__(self, name: str = "", *, linger: float = LINGER) -> None:
        self.linger = linger
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()
        self._woken = False
        # One epoll, and its fds' members (None: the wake-up pipe), read without selectors'
        # per-event keys and tuples: a turn of a fleet reads hundreds of sockets.
        self._epoll = select.epoll()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._by_fd: dict[int, LoopMember | None] = {self._wake_r: None}
        self._members: dict[int, LoopMember] = {}
        self._ticking: dict[LoopMember, float] = {}  # members with something due, and when
        self._dirty: deque[LoopMember] = deque()  # members with records or commands to act on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dafka-leaves{name}", daemon=True)
        self._thread.start()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def wake(self, member: LoopMember) -> None:
        """``member`` has something to send: act on it in the loop (thread-safe)."""
        with self._wake_lock:
            self._dirty.append(member)
            if self._woken:
                return
            self._woken = True
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass  # full (a wake-up is pending) or closed

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass
        if not self.in_loop():
            self._thread.join(timeout)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        next_tick = 0.0
        ready: list[LoopMember] = []
        events = _events
        poll = self._epoll.poll
        by_fd = self._by_fd
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                touched: dict[LoopMember, None] = {}
                if now >= next_tick:
                    next_tick = now + TICK
                    # Only the members whose link has something due (a HEAD, a failover):
                    # thousands waiting a few ms for their ACK cost nothing here.
                    for member, due in list(self._ticking.items()):
                        if due <= now:
                            member._tick(now)
                            self._pending(member)
                            touched[member] = None
                with self._wake_lock:
                    dirty, self._dirty = self._dirty, deque()
                    # Awake until it is about to wait again (below): a publish meanwhile
                    # only joins _dirty, it writes nothing to the pipe.
                    self._woken = True
                for member in dict.fromkeys(dirty):
                    member._act(now)
                    touched[member] = None
                for member in ready:
                    member._read(now)
                    touched[member] = None
                if self.linger and touched and len(touched) < LINGER_BELOW and not self._stop.is_set():
                    # A trickle (devices of a fleet, each a record now and then): rest, so
                    # that the next publishes and ACKs share one turn, one wake-up.
                    time.sleep(self.linger)
                with self._wake_lock:
                    self._woken = False  # from now on a publish writes the pipe: the wait ends
                    pending = bool(self._dirty)
                wait = 0.0 if ready or pending else max(0.0, next_tick - time.monotonic())
                fired = poll(wait)
                if fired:
                    now = time.monotonic()
                    for fd, _ in fired:
                        got = by_fd.get(fd, _GONE)
                        if got is None:
                            # One read: wake() writes a byte only when the loop was not woken
                            # already, so a few bytes at most wait here (a full read: more).
                            try:
                                while len(os.read(self._wake_r, 4096)) == 4096:
                                    pass
                            except OSError:
                                pass
                            continue
                        if got is not _GONE:
                            got._read(now)
                            touched[got] = None
                # A send may have taken a socket's edge (ZMQ_FD fires for commands, and a
                # send processes them): the members that sent since their socket was read
                # to the end have ZMQ_EVENTS looked at; those read to the end since, not.
                ready = []
                for m in touched:
                    sock = m.sock
                    if sock is None or m.armed:
                        continue
                    if events(sock) & _POLLIN:
                        ready.append(m)
                    else:
                        m.armed = True  # (the look processed its commands: its edge is set again)
        except Exception:
            log.exception("leaf loop failed")
        finally:
            for member in list(self._members.values()):
                member._detach()
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self.ctx.term()

    # called in the loop thread by members
    def _register(self, sock: zmq.Socket[Any], member: LoopMember) -> None:
        fd = _fd(sock)
        if fd in self._by_fd:
            raise KeyError(f"fd {fd} is already registered")
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd] = member

    def _unregister(self, sock: zmq.Socket[Any]) -> None:
        try:
            fd = _fd(sock)
        except zmq.ZMQError:
            return
        if self._by_fd.get(fd, _GONE) is _GONE or fd == self._wake_r:
            return
        del self._by_fd[fd]
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass

    def _pending(self, member: LoopMember) -> None:
        """Tick ``member`` when it next has something due (its ``next_due``; never if nothing is)."""
        due = member.next_due() if member.sock is not None else None
        if due is None:
            self._ticking.pop(member, None)
        else:
            self._ticking[member] = due
