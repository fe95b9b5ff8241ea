"""The console's observer: ``dafka status``'s probe that also reads records over the mesh.

:class:`ConsoleProbe` is a :class:`dafka.cli.status.StatusProbe` (one mesh
identity, the same sockets: the record browser adds no node to the mesh) whose
peer subscriptions also take DIRECT-RECORDs sent to it.  The web server hands
it pages to read (:meth:`ConsoleProbe.submit`, from any thread); its own
thread sends their FETCHes on its publisher, as a consumer does, and feeds the
answers to each :class:`~dafka.console.model.PageFetch`, which bounds what a
page reads and how long it waits.  A finished page goes to its callback (called
on the probe's thread).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

import zmq

from dafka.cli.status import StatusProbe
from dafka.config import NodeConfig
from dafka.core import wire
from dafka.errors import ProtocolError
from dafka.nodes.node import frame_limit

from .model import PageFetch

log = logging.getLogger("dafka.console")

MAX_PAGES = 16  # pages being read at once (more are refused: "busy")
Done = Callable[[dict[str, Any]], None]


class ConsoleProbe(StatusProbe):
    """See the module docstring (single-threaded but for :meth:`submit`)."""

    def __init__(self, config: NodeConfig, max_pages: int = MAX_PAGES) -> None:
        super().__init__(config)
        self.max_pages = max_pages
        self._submitted: queue.SimpleQueue[tuple[PageFetch, int | None, int | None, Done]] = queue.SimpleQueue()
        self._pages: list[tuple[PageFetch, int | None, int | None, Done]] = []
        self.records_received = 0  # DIRECT-RECORDs sent to us (all copies)

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock = super()._socket(kind)
        if kind == zmq.SUB:
            # The largest frame a peer may send us, as any data SUB of a node takes
            # (a bigger one cuts the connection): a record of max_record_bytes.
            sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(self.config.max_record_bytes))
        return sock

    def submit(self, page: PageFetch, first: int | None, last: int | None, done: Done) -> None:
        """Read ``page`` (any thread); ``done(result)`` is called on the probe's thread."""
        self._submitted.put((page, first, last, done))

    def _connect_peer(self, address: str, endpoint: str, key: bytes | None = None) -> None:
        super()._connect_peer(address, endpoint, key)
        sub = self.peer_subs.get(address)
        if sub is not None:
            sub.setsockopt(zmq.SUBSCRIBE, wire.P_DIRECT_RECORD + self.address.encode())

    def _may_tell(self, sender: str, msg: wire.Message) -> bool:
        if isinstance(msg, wire.DirectRecord | wire.DirectRecordBatch) and msg.address == sender:
            return True  # a producer answering from its own buffer
        return super()._may_tell(sender, msg)

    def on_peer_message(self, sender: str, msg: wire.Message) -> None:
        if isinstance(msg, wire.DirectRecord | wire.DirectRecordBatch):
            if msg.topic != self.address:
                return
            contents = (msg.content,) if isinstance(msg, wire.DirectRecord) else msg.contents
            self.records_received += len(contents)
            for page, _, _, _ in self._pages:
                if page.topic == msg.subject and page.partition == msg.address:
                    for i, content in enumerate(contents):
                        page.on_record(msg.sequence + i, content)
            return
        super().on_peer_message(sender, msg)

    def tick(self, now: float) -> None:
        for _ in range(self.max_pages * 4):  # bounded per turn
            try:
                item = self._submitted.get_nowait()
            except queue.Empty:
                break
            if len(self._pages) >= self.max_pages:
                item[3]({"error": f"the console is reading {self.max_pages} pages already: try again", "status": 503})
                continue
            self._pages.append(item)
        if not self._pages:
            return
        keep = []
        for item in self._pages:
            page, first, last, done = item
            for sequence, count in page.asks(now):
                fetch = wire.Fetch(page.partition, self.address, page.topic, sequence, count)
                try:
                    self.publisher.send_multipart(wire.encode(fetch), zmq.NOBLOCK)
                except (zmq.ZMQError, ProtocolError) as exc:
                    log.debug("console: FETCH not sent: %s", exc)
            if page.done:
                try:
                    done(page.result(first, last))
                except Exception:  # noqa: BLE001 (a page the server gave up on must not stop the observer)
                    log.exception("console: a page's callback failed")
            else:
                keep.append(item)
        self._pages = keep

    def close(self) -> None:
        for page, first, last, done in self._pages:
            page.why = page.why or "timeout"
            try:
                done(page.result(first, last))
            except Exception:  # noqa: BLE001
                log.exception("console: a page's callback failed")
        self._pages = []
        super().close()

