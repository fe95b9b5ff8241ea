"""A node's data sockets: what the data SUB subscribes to, pausing and lingering its reading,
the sockets the loop watches, and how records go out (routes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import zmq

from dafka import fastio
from dafka.core import wire

POLLIN = int(zmq.POLLIN)
DRAIN = 4096  # messages read from a socket before looking at the others again
RECORD_IDS = (wire.P_RECORD, wire.P_DIRECT_RECORD)  # subscriptions that get a batch twin
# How records go out: a header prefix and the fastio function that sends records with it.
Route = tuple[bytes, Callable[..., int]]


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


class SocketsMixin:
    """Subscriptions and watched sockets of a :class:`~dafka.nodes.node.Node` (state set up by ``Node.__init__``)."""

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

    def batches_for(self, header: bytes, answer: bool = False) -> bool:
        """Whether records with this single-record header prefix go out as batches
        (``answer``: DIRECT-RECORDs to one requester, see
        :meth:`~dafka.core.audience.BatchAudience.answers_in_batches`)."""
        if self.batches:
            return True
        audience = self.audience
        return audience.answers_in_batches(header) if answer else audience.takes_batches(header)

    def route(self, header: bytes, answer: bool = False) -> Route:
        """How records with this single-record header prefix go out: as batches or one a message."""
        if self.batches_for(header, answer):
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
