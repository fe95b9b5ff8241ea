"""The bound of any store that acknowledges only synced writes, at a client's window.

``dafka bench tank --bound`` runs this before each gateway run, with the same client, bundles
and window.  A minimal Tank store in a process of its own reads frames from its connections;
a produce request's payload (its bundle, unparsed) goes into LMDB as one value (append order,
sync on) in group commits (everything that arrived while the last commit ran), and each
request is answered "no error" once the commit holding it returned.  A CreateTopic is
answered "created", a new connection greeted with a Ping; anything else (or a frame
too short for what it says, or a connection past the first eight) closes the connection.

Nothing is validated, indexed or kept per partition, so what this makes is what a store that
answers only after its writes are synced can make on this disk, at this window, with this
client: the yardstick the gateway's synced publish is read against, beside the disk's
``dd``-like measure (one sync for the whole write), which no such store can reach with a few
hundred KB in flight.  It answers one topic of one partition a request: the bench's.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import struct
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
_MAX_CONNECTIONS = 8  # accepted over the store's life (the bench opens one); more are closed
_MAX_PENDING = 256 << 20  # bytes received and not yet committed: a reader waits past it


@dataclass(frozen=True)
class SyncedStore:
    """What the minimal store did over its life: produce requests made durable and answered,
    and the group commits that did it."""

    requests: int
    commits: int


def _store_process(directory: str, port: Any, done: Any, result: Any) -> None:
    """The minimal store: an accepting loop (this thread), a reader thread a connection, a writer thread."""
    import lmdb

    env = lmdb.open(directory, map_size=16 << 30, sync=True, metasync=True, writemap=False)
    listener = socket.create_server(("127.0.0.1", 0))
    port.put(listener.getsockname()[1])
    pending: list[tuple[socket.socket, int, bytearray]] = []
    ready = threading.Condition()
    counts = {"requests": 0, "commits": 0, "pending": 0}
    stop = threading.Event()

    def write() -> None:
        key = 0
        while not stop.is_set():
            with ready:
                if not ready.wait_for(lambda: bool(pending) or stop.is_set(), timeout=1.0):
                    continue
                taken = pending[:]
                pending.clear()
                counts["pending"] = 0
                ready.notify_all()  # (readers waiting for room)
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

    def on_frame(conn: socket.socket, msg_id: int, payload: bytearray) -> bool:
        """Queue a produce request, answer a CreateTopic; False (close it): anything else, or
        a frame too short for what it says."""
        try:
            if msg_id in (MsgId.PRODUCE, MsgId.PRODUCE_WITH_SEQNUM):
                # version u16, request id u32, client id str8, acks u8, timeout u32, topics u8
                client_len = payload[6]
                topics_at = 7 + client_len + 5
                name_len = payload[topics_at + 1]
                if payload[topics_at] != 1 or payload[topics_at + 2 + name_len] != 1:
                    return False  # the answer is one partition's
                req_id = U32.unpack_from(payload, 2)[0]
                with ready:
                    if not ready.wait_for(lambda: counts["pending"] < _MAX_PENDING or stop.is_set(), _DEADLINE):
                        return False
                    pending.append((conn, req_id, payload))
                    counts["pending"] += len(payload)
                    ready.notify_all()
                return True
            if msg_id == MsgId.CREATE_TOPIC:
                req = decode_request(msg_id, bytes(payload))
                assert isinstance(req, CreateTopicRequest)
                conn.sendall(CreateTopicResponse(req.req_id, req.topic).encode())
                return True
        except (IndexError, struct.error, ValueError):  # (ProtocolError is a ValueError)
            return False
        return False

    conns: list[socket.socket] = []
    deadline = time.monotonic() + _DEADLINE
    listener.settimeout(0.2)
    try:
        while not done.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if len(conns) >= _MAX_CONNECTIONS:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(Ping().encode())  # the greeting Tank clients wait for
            conns.append(conn)
            threading.Thread(target=_read_frames, args=(conn, on_frame), daemon=True).start()
    finally:
        stop.set()
        with ready:
            ready.notify()
        writer.join(_DEADLINE)
        for conn in conns:
            conn.close()
        listener.close()
        env.close()
        result.put(SyncedStore(counts["requests"], counts["commits"]))


def _read_exactly(conn: socket.socket, buf: bytearray) -> bool:
    """Fill ``buf`` from ``conn`` (received in place: one copy, as the gateway's large frames)."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def _read_frames(conn: socket.socket, on_frame: Callable[[socket.socket, int, bytearray], bool]) -> None:
    """A connection's reader thread: its frames to ``on_frame`` until it ends, an error, or
    ``on_frame`` refuses one (the connection is then shut)."""
    head = bytearray(FRAME_HEADER_SIZE)
    try:
        while _read_exactly(conn, head):
            msg_id, size = FRAME_HEADER.unpack(head)
            payload = bytearray(size if size <= _MAX_FRAME else 0)
            if size > _MAX_FRAME or not _read_exactly(conn, payload) or not on_frame(conn, msg_id, payload):
                break
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # (closed by the store's end, or the client's)


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
