"""The bound of any store that acknowledges only synced writes, at a client's window.

``dafka bench tank --bound`` runs this before each gateway run, with the same client, bundles
and window.  A minimal Tank store in a process of its own reads frames from its connections;
a produce request's payload (its bundle, unparsed) goes into LMDB as one value (append order,
sync on) in group commits (everything that arrived while the last commit ran), and each
request is answered "no error" once the commit holding it returned.  A CreateTopic is
answered "created", a new connection greeted with a Ping; anything else closes the connection.

Nothing is validated, indexed or kept per partition, so what this makes is what a store that
answers only after its writes are synced can make on this disk, at this window, with this
client: the yardstick the gateway's synced publish is read against, beside the disk's
``dd``-like measure (one sync for the whole write), which no such store can reach with a few
hundred KB in flight.  It answers one topic of one partition a request: the bench's.
"""

from __future__ import annotations

import multiprocessing as mp
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dafka.tank.codec import FRAME_HEADER, FRAME_HEADER_SIZE, U32
from dafka.tank.messages import CreateTopicRequest, CreateTopicResponse, MsgId, Ping, decode_request

_DEADLINE = 300.0  # seconds: no run of this bench is meant to take longer
_MAX_FRAME = 64 << 20


@dataclass(frozen=True)
class SyncedStore:
    """What the minimal store did over its life: produce requests made durable and answered,
    and the group commits that did it."""

    requests: int
    commits: int


def _store_process(directory: str, port: Any, done: Any, result: Any) -> None:
    """The minimal store: a selector loop (this thread) reading frames, and a writer thread."""
    import lmdb

    env = lmdb.open(directory, map_size=16 << 30, sync=True, metasync=True, writemap=False)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port.put(listener.getsockname()[1])
    pending: list[tuple[socket.socket, int, bytes]] = []
    ready = threading.Condition()
    counts = {"requests": 0, "commits": 0}
    stop = threading.Event()

    def write() -> None:
        key = 0
        while not stop.is_set():
            with ready:
                if not ready.wait_for(lambda: bool(pending) or stop.is_set(), timeout=1.0):
                    continue
                taken = pending[:]
                pending.clear()
            if not taken:
                continue
            with env.begin(write=True) as txn:  # commits with sync on, on leaving
                for _, _, payload in taken:
                    txn.put(key.to_bytes(8, "big"), payload, append=True)
                    key += 1
            counts["commits"] += 1
            counts["requests"] += len(taken)
            for conn, req_id, _ in taken:
                try:  # one partition without error (the answer follows the request's order)
                    conn.sendall(FRAME_HEADER.pack(MsgId.PRODUCE, 5) + U32.pack(req_id) + b"\x00")
                except OSError:
                    pass  # the client went away: its reader closes it

    writer = threading.Thread(target=write, name="minimal-store-writer")
    writer.start()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    buffers: dict[socket.socket, bytearray] = {}

    def on_frame(conn: socket.socket, msg_id: int, payload: bytes) -> bool:
        if msg_id in (MsgId.PRODUCE, MsgId.PRODUCE_WITH_SEQNUM):
            # version u16, request id u32, client id str8, acks u8, timeout u32, topics u8
            client_len = payload[6]
            topics_at = 7 + client_len + 5
            name_len = payload[topics_at + 1]
            if payload[topics_at] != 1 or payload[topics_at + 2 + name_len] != 1:
                return False  # the answer is one partition's
            with ready:
                pending.append((conn, U32.unpack_from(payload, 2)[0], payload))
                ready.notify()
            return True
        if msg_id == MsgId.CREATE_TOPIC:
            req = decode_request(msg_id, payload)
            assert isinstance(req, CreateTopicRequest)
            conn.sendall(CreateTopicResponse(req.req_id, req.topic).encode())
            return True
        return False

    deadline = time.monotonic() + _DEADLINE
    try:
        while not done.is_set() and time.monotonic() < deadline:
            for key, _ in sel.select(0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    conn, _ = listener.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.sendall(Ping().encode())  # the greeting Tank clients wait for
                    buffers[conn] = bytearray()
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                if not _read_frames(sock, buffers[sock], on_frame):
                    sel.unregister(sock)
                    del buffers[sock]
                    sock.close()
    finally:
        stop.set()
        with ready:
            ready.notify()
        writer.join(_DEADLINE)
        for sock in buffers:
            sock.close()
        listener.close()
        env.close()
        result.put(SyncedStore(counts["requests"], counts["commits"]))


def _read_frames(conn: socket.socket, buf: bytearray, on_frame: Callable[[socket.socket, int, bytes], bool]) -> bool:
    """Read what ``conn`` has and hand over its whole frames; False: close it."""
    try:
        got = conn.recv(1 << 20)
    except BlockingIOError:
        return True
    except OSError:
        return False
    if not got:
        return False
    buf += got
    while len(buf) >= FRAME_HEADER_SIZE:
        msg_id, size = FRAME_HEADER.unpack_from(buf)
        if size > _MAX_FRAME:
            return False
        if len(buf) < FRAME_HEADER_SIZE + size:
            break
        payload = bytes(buf[FRAME_HEADER_SIZE:FRAME_HEADER_SIZE + size])
        del buf[:FRAME_HEADER_SIZE + size]
        if not on_frame(conn, msg_id, payload):
            return False
    return True


class MinimalSyncedStore:
    """A minimal Tank store that syncs before it answers, in a process of its own, its
    database in a new directory under ``directory`` (removed on leaving)::

        with MinimalSyncedStore() as store:
            rate = publish(store.port)      # any Tank produce client, one partition a request
        store.result.requests, store.result.commits
    """

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self.port = 0
        self.result: SyncedStore | None = None

    def __enter__(self) -> MinimalSyncedStore:
        ctx = mp.get_context("spawn")
        self._db = tempfile.mkdtemp(prefix="dafka-bench-synced-", dir=self.directory)
        port = ctx.Queue()
        self._done, self._result = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_store_process, args=(self._db, port, self._done, self._result),
                                    daemon=True)
        self._process.start()
        try:
            self.port = port.get(timeout=60)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        self._done.set()
        try:
            self.result = self._result.get(timeout=60)
        except Exception:  # (queue.Empty: the process died; its error is on its stderr)
            self.result = None
        self._process.join(60)
        if self._process.is_alive():
            self._process.kill()
        shutil.rmtree(self._db, ignore_errors=True)


__all__ = ["MinimalSyncedStore", "SyncedStore"]
