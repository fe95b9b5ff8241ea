"""One I/O thread for many nodes of a process: :class:`NodeLoop`.

By default every node runs its own I/O thread (``Node._run``).  An app that
hosts many nodes (a fleet simulator, a box serving many devices, the scale
benchmark) can give them one ``NodeLoop`` instead.  A thousand producers in
four processes are otherwise a thousand threads, each waking a few times a
second for beacons and timers; profiled, such a process spent most of its CPU
in the kernel switching between them and handing the GIL over, not in dafka.

The loop waits in one epoll on the sockets of all its nodes.  A ZeroMQ socket
is watched through its ZMQ_FD, which fires when the socket's state *may* have
changed and is edge-triggered: ZMQ_EVENTS tells whether a message really
waits, and a read that stopped early (DRAIN), or any other call on the socket
(a subscribe, a connect), can leave messages behind that will not fire it
again.  So after a node did anything in a turn, the loop asks ZMQ_EVENTS of
each of that node's sockets that are also used otherwise than read (monitors
are only read, to the end) and reads, in the next turn, those that hold
something; at a node's timer turns every socket of it gets that look.  A node's timers are one entry in a heap (its earliest due one);
everything else is the node's own loop steps (``Node._loop_*``), unchanged.

A node's callbacks (a producer's ACK callbacks, a consumer's ``on_assign``) run
in the loop's thread: a slow one delays every node of the loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from dafka import fastio


class LoopNode(Protocol):
    """What a node offers the loop that runs it: the steps of its loop turn and the state they share.

    :class:`dafka.nodes.node.Node` offers it (its own I/O thread, ``Node._run``, drives
    it through the same steps); the loop is written against this, not against the node.
    """

    @property
    def kind(self) -> str:
        """What the node is, for log lines (``producer``, ``store``, ...)."""

    @property
    def log(self) -> logging.Logger: ...

    @property
    def beacon_sub(self) -> Any:
        """The socket beacons come in on (read after data when much is ready)."""

    loop_turns: int  # wake-ups of the node's loop (counted by whoever runs it)
    _poller: Any  # what the node registers its sockets with: the loop puts a _Poller here
    _readers: dict[object, Callable[[], None]]  # socket (or file number) -> its reader

    @property
    def _stop(self) -> threading.Event:
        """Set when the node is asked to stop."""

    @property
    def _ended(self) -> threading.Event:
        """Set once the loop has closed the node."""

    def _loop_monitors(self) -> set[Any]:
        """The node's monitor sockets: read only by their readers, which empty them."""

    def _loop_begin(self) -> None:
        """Register the sockets with ``_poller``, start; before the first turn."""

    def _loop_timers(self, now: float) -> float:
        """Run the timers that are due; seconds until the next one (at most 1)."""

    def _loop_spins(self) -> bool:
        """Whether work waits that needs no input (the loop must not sleep)."""

    def _loop_after(self) -> None:
        """After the input of a turn."""

    def _loop_end(self) -> None:
        """After the last turn: shut down and close the sockets."""

    def _run_commands(self) -> None:
        """Run what other threads asked of the I/O thread (``call_soon``)."""

    def _close_with_loop(self) -> None:
        """Close as the application would, waiting for no peer (:meth:`NodeLoop.close`)."""

    def before_wait(self) -> None:
        """Just before the loop waits for input (a subclass hook)."""

log = logging.getLogger("dafka.loop")

MAX_WAIT = 1.0  # seconds: the loop looks at its timers at least this often
TIMER_SLACK = 0.001  # as Node: a timer due this soon runs now
SLOW_PER_TURN = 16  # beacon and monitor sockets read in one turn at most (see _run)


_events = fastio.events  # ZMQ_EVENTS, compiled where available
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)


class _Watch:
    """One socket of one node that the loop waits on."""

    __slots__ = ("events", "fd", "hot", "key", "node", "slow", "sock", "zmq")

    def __init__(self, node: LoopNode, sock: Any, events: int) -> None:
        self.node = node
        self.sock = sock
        self.events = int(events)
        self.zmq = isinstance(sock, zmq.Socket)
        # Monitors are read only by their readers, which empty them: their edges
        # are never taken by another call.  Other sockets of the node are also
        # subscribed, connected or sent on: looked at after each of its turns.
        monitors = node._loop_monitors()
        self.hot = self.zmq and sock not in monitors
        # Beacons and monitors wait behind data when many are ready at once (see _run).
        self.slow = sock is node.beacon_sub or sock in monitors
        if self.zmq:
            self.fd: int = sock.getsockopt(zmq.FD)
        else:
            self.fd = sock if isinstance(sock, int) else sock.fileno()
        # How the node's readers are keyed (as for its own zmq.Poller).
        self.key: object = sock if self.zmq else self.fd

    def selector_events(self) -> int:
        if self.zmq:
            return selectors.EVENT_READ  # the ZMQ_FD: readable when the state may have changed
        mask = selectors.EVENT_READ if self.events & _POLLIN else 0
        return mask | (selectors.EVENT_WRITE if self.events & _POLLOUT else 0)


class _Poller:
    """What a node of a shared loop has for a poller: zmq.Poller's register,
    modify and unregister, forwarded to the loop (I/O thread only)."""

    def __init__(self, loop: NodeLoop, node: LoopNode) -> None:
        self._loop = loop
        self._node = node

    def register(self, sock: Any, flags: int = zmq.POLLIN) -> None:
        self._loop._watch(self._node, sock, flags)

    modify = register

    def unregister(self, sock: Any) -> None:
        self._loop._unwatch(self._node, sock)


class NodeLoop:
    """One background I/O thread shared by many nodes (producers, consumers).

    Pass it as ``loop=`` to :class:`~dafka.nodes.producer.Producer` or
    :class:`~dafka.nodes.consumer.Consumer`; close the nodes, then the loop
    (or use it as a context manager, which closes what is left)::

        with NodeLoop() as loop:
            producers = [Producer("sensors", cfg, loop=loop) for _ in range(100)]
            ...
    """

    def __init__(self, name: str = "dafka-loop") -> None:
        self._selector = selectors.DefaultSelector()
        # Other threads wake the loop through a pipe; one byte while a wake-up is pending.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._wake_pending = False
        # Held to write a wake-up and to close the pipe: once closed, its numbers
        # may be another file's, which a late wake-up would write into.
        self._wake_lock = threading.Lock()
        self._woken: deque[LoopNode] = deque()  # nodes with commands (call_soon) to run
        self._calls: deque[Callable[[], None]] = deque()  # attach, detach, close
        self._nodes: dict[LoopNode, dict[object, _Watch]] = {}  # node -> its watched sockets
        self._watches: dict[int, _Watch] = {}  # fd -> the watch registered with the selector
        self._ready: list[_Watch] = []  # ZeroMQ sockets found holding input: read next turn
        self._spinning: set[LoopNode] = set()  # nodes with work that waits for no input
        self._timers: list[tuple[float, int, LoopNode]] = []  # (due, seq, node), a heap
        self._due: dict[LoopNode, float] = {}  # node -> its entry in the heap that counts
        self._seq = itertools.count()
        self._closing = False
        self._closed = threading.Event()
        self.turns = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __enter__(self) -> NodeLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def nodes(self) -> int:
        """How many nodes the loop runs."""
        return len(self._nodes)

    def _in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, timeout: float = 10.0) -> None:
        """Close the nodes still on the loop (without waiting for their ACKs), then stop."""
        if self._closed.is_set():
            return
        if self._in_loop():
            raise RuntimeError("a NodeLoop cannot be closed from its own thread")
        # Each as by its own close(), the loop running meanwhile: what is not
        # acknowledged fails and whoever waits on the node returns.
        for node in self._nodes.copy():
            try:
                node._close_with_loop()
            except Exception:
                log.exception("node loop: closing a %s failed", node.kind)
        self._call(self._shut)  # (and any attached meanwhile)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("node loop: the thread did not stop within %.1fs", timeout)
            return
        self._selector.close()
        with self._wake_lock:
            self._closed.set()
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ---------------------------------------------------------------- called by nodes

    def attach(self, node: LoopNode) -> None:
        """Start running ``node`` (from any thread; ``Node.start`` calls it)."""
        if self._closed.is_set() or self._closing:
            raise RuntimeError("this NodeLoop is closed")
        if self._in_loop():
            self._attach(node)
        else:
            self._call(lambda: self._attach(node))

    def detach(self, node: LoopNode, timeout: float) -> bool:
        """Stop running ``node`` and close its sockets; whether that was done within ``timeout``.

        From the loop's own thread (a callback, maybe inside one of the node's
        readers, which goes on reading its socket after the callback) the
        sockets close right after this turn, as a node's own thread ends its
        turn first."""
        if not self._thread.is_alive():
            self._detach(node)
            return True
        self._call(lambda: self._detach(node))
        return self._in_loop() or node._ended.wait(timeout)

    def wake(self, node: LoopNode) -> None:
        """``node`` has commands for its I/O thread (from any thread)."""
        self._woken.append(node)
        self._signal()

    def _call(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        self._signal()

    def _signal(self) -> None:
        if self._wake_pending:
            return  # the loop has not read the last byte yet: it will see the queues
        with self._wake_lock:
            if self._closed.is_set():
                return
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass  # full: a wake-up is pending anyway

    # ---------------------------------------------------------------- loop thread

    def _attach(self, node: LoopNode) -> None:
        if node in self._nodes or node._stop.is_set():
            return
        self._nodes[node] = {}
        node._poller = _Poller(self, node)
        node._loop_begin()
        node._run_commands()  # any asked for before the loop took it
        self._after(node, time.monotonic())

    def _detach(self, node: LoopNode) -> None:
        watches = self._nodes.pop(node, None)
        if watches is None:
            node._ended.set()
            return
        for watch in watches.values():
            self._drop(watch)
        self._due.pop(node, None)
        self._spinning.discard(node)
        try:
            node._loop_end()
        finally:
            node._ended.set()

    def _shut(self) -> None:
        for node in list(self._nodes):
            node._stop.set()
            self._detach(node)
        self._closing = True

    def _watch(self, node: LoopNode, sock: Any, events: int) -> None:
        watches = self._nodes.get(node)
        if watches is None:
            return  # detached meanwhile
        watch = watches.get(sock)
        if watch is None:
            watch = watches[sock] = _Watch(node, sock, events)
        elif watch.events != events:
            self._drop(watch)
            watch.events = int(events)
        if events and self._watches.get(watch.fd) is not watch:
            stale = self._watches.pop(watch.fd, None)
            if stale is not None:  # a closed socket's descriptor, taken again
                self._selector.unregister(watch.fd)
                self._nodes.get(stale.node, {}).pop(stale.sock, None)
            self._selector.register(watch.fd, watch.selector_events(), watch)
            self._watches[watch.fd] = watch
            if watch.zmq:
                self._ready.append(watch)  # its edge may have passed already: look now
        elif not events:
            self._drop(watch)

    def _unwatch(self, node: LoopNode, sock: Any) -> None:
        watch = self._nodes.get(node, {}).pop(sock, None)
        if watch is not None:
            self._drop(watch)

    def _drop(self, watch: _Watch) -> None:
        if self._watches.get(watch.fd) is watch:
            del self._watches[watch.fd]
            try:
                self._selector.unregister(watch.fd)
            except (KeyError, ValueError, OSError):
                pass

    def _run(self) -> None:
        selector = self._selector
        timers = self._timers
        while not self._closing:
            self.turns += 1
            now = time.monotonic()
            if self._ready or self._spinning:
                wait = 0.0
            elif timers:
                # Whole milliseconds rounded up, as Node._run: rounded down, the
                # last millisecond before a timer would be a busy loop.
                wait = min(MAX_WAIT, math.ceil(max(0.0, timers[0][0] - now) * 1000) / 1000)
            else:
                wait = MAX_WAIT
            try:
                events = selector.select(wait)
            except OSError as exc:  # pragma: no cover - a closed descriptor in the set
                log.error("node loop: select failed (%s); looking at every socket", exc)
                events = []
                self._ready.extend(w for w in self._watches.values() if w.zmq)
            touched: dict[LoopNode, None] = {}
            timed: set[LoopNode] = set()  # nodes whose timers were due: all their sockets get a look
            # Deferred and swept sockets come back here, often twice: a dict keeps
            # each once, so what waits stays bounded by the sockets there are.
            slow: dict[_Watch, None] = {}
            for key, _ in events:
                watch: _Watch | None = key.data
                if watch is None:
                    self._read_wake(touched)
                elif watch.slow:
                    slow[watch] = None
                elif self._watches.get(watch.fd) is watch:
                    self._dispatch(watch, touched)
            if self._ready:
                ready, self._ready = dict.fromkeys(self._ready), []
                for watch in ready:
                    if watch.slow:
                        slow[watch] = None
                    elif self._watches.get(watch.fd) is watch:
                        self._dispatch(watch, touched)
            if slow:
                # A tower's hello reaches every node of the loop at once: read at
                # most SLOW_PER_TURN beacon sockets a turn, so that data (ACKs,
                # FETCHes) that comes meanwhile waits for a few of them, not all.
                waiting = list(slow)
                for watch in waiting[:SLOW_PER_TURN]:
                    if self._watches.get(watch.fd) is watch:
                        self._dispatch(watch, touched)
                self._ready.extend(waiting[SLOW_PER_TURN:])
            for node in self._spinning:
                touched[node] = None
            now = time.monotonic()
            due_nodes = self._due
            while timers and timers[0][0] <= now + TIMER_SLACK:
                due, _, node = heapq.heappop(timers)
                if due_nodes.get(node) == due:
                    del due_nodes[node]
                    touched[node] = None
                    timed.add(node)
            for node in touched:
                if node in self._nodes:
                    try:
                        self._after(node, now, node in timed)
                    except Exception:
                        # A bug of one node (a hook of a subclass) must not stop the others.
                        node.log.exception("%s failed in its loop turn", node.kind)

    def _drain_wake(self) -> None:
        """Empty the wake-up pipe."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _read_wake(self, touched: dict[LoopNode, None]) -> None:
        self._drain_wake()
        # After emptying the pipe, before reading the queues: a wake() from now on
        # writes again.  Cleared before the pipe was read, a wake() in between left
        # the flag set with its byte read here, and every later wake() was lost (a
        # shared loop then slept in select with an attach or a detach queued).
        self._wake_pending = False
        calls = self._calls
        while calls:
            fn = calls.popleft()
            try:
                fn()
            except Exception:
                log.exception("node loop: attaching or detaching a node failed")
        woken = self._woken
        while woken:
            node = woken.popleft()
            if node in self._nodes:  # (a node woken twice finds its queue empty the second time)
                touched[node] = None
                node._run_commands()

    def _dispatch(self, watch: _Watch, touched: dict[LoopNode, None]) -> None:
        node = watch.node
        if watch.zmq:
            try:
                if not _events(watch.sock) & watch.events:
                    return  # the edge said "may have changed"; nothing waits
            except zmq.ZMQError:
                self._drop(watch)  # closed under us
                return
        touched[node] = None
        reader = node._readers.get(watch.key)
        if reader is None:
            return
        try:
            reader()
        except Exception:
            # A bug must not stop the loop; bad input is handled inside readers.
            node.log.exception("%s failed handling input", node.kind)
        if watch.zmq and not watch.hot and self._watches.get(watch.fd) is watch:
            # A monitor's reader stops after so many events: what it left will not fire again.
            try:
                if _events(watch.sock) & watch.events:
                    self._ready.append(watch)
            except zmq.ZMQError:
                self._drop(watch)

    def _after(self, node: LoopNode, now: float, every: bool = False) -> None:
        """The rest of a node's turn: work, timers, a look at its sockets (``every``
        one, or the ones other calls may have taken an edge from), its next due time."""
        if node._stop.is_set():
            return  # stopped in this turn: detached in the next
        node.loop_turns += 1
        try:
            node._loop_after()
        except Exception:  # a subclass's hook: logged; the rest of its turn still runs
            node.log.exception("%s failed in its loop turn", node.kind)
        if node not in self._nodes:
            return  # a reader or work detached it
        try:
            wait = node._loop_timers(now)
        except Exception:  # (each timer is guarded; this is the node's own bookkeeping)
            node.log.exception("%s failed running its timers", node.kind)
            wait = 0.05  # timed again soon, not never
        if node._loop_spins():
            self._spinning.add(node)
        else:
            self._spinning.discard(node)
        for watch in self._nodes[node].values():
            if (
                (watch.hot or (every and watch.zmq))
                and watch.events
                and self._watches.get(watch.fd) is watch
            ):
                try:
                    if _events(watch.sock) & watch.events:
                        self._ready.append(watch)
                except zmq.ZMQError:
                    self._drop(watch)
        try:
            node.before_wait()
        except Exception:
            node.log.exception("%s failed before waiting", node.kind)
        due = now + max(0.0, wait)
        current = self._due.get(node)
        if current is None or due < current - 1e-6:
            self._due[node] = due
            heapq.heappush(self._timers, (due, next(self._seq), node))
