"""The bound of any store that acknowledges only synced writes, at a client's window.

``dafka bench tank --bound`` runs this before each gateway run.  A minimal store in a
process of its own reads length-prefixed frames from one loopback TCP connection, puts
each into LMDB as one value (append order, sync on) in group commits (everything that
arrived while the last commit ran), and answers each commit with the count of frames it
made durable.  The client here keeps ``window`` frames unanswered, as the Tank bench's
client keeps its produce requests, and sends the same bundles.

Nothing is parsed, validated or indexed and no offsets are kept, so what this makes is
what a store that answers only after its writes are synced can make on this disk, at this
window, with a Python client: the yardstick the gateway's synced publish is read against,
beside the disk's ``dd``-like measure (one sync for the whole write), which no store that
syncs before it answers can reach with a few hundred KB in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

_COUNT = struct.Struct(">I")
_DEADLINE = 300.0  # seconds: no run of this bench is meant to take longer


@dataclass(frozen=True)
class SyncedRun:
    """One run of the minimal store: frames sent and made durable, and how."""

    frames: int
    seconds: float
    commits: int  # group commits the store made

    def per_second(self, per_frame: int) -> float:
        """Units a second, ``per_frame`` units a frame (records, or record bytes)."""
        return self.frames * per_frame / self.seconds


def _store_process(directory: str, port: Any, result: Any) -> None:
    """The minimal store: one connection, an I/O thread (this one) and a writer thread."""
    import lmdb

    env = lmdb.open(directory, map_size=16 << 30, sync=True, metasync=True, writemap=False)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    port.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    listener.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(_DEADLINE)
    pending: list[bytes | None] = []
    ready = threading.Condition()
    counts = {"frames": 0, "commits": 0}

    def write() -> None:
        try:
            commit_all()
        finally:  # an LMDB error, say: the client sees the connection end, not a silence
            conn.shutdown(socket.SHUT_RDWR)

    def commit_all() -> None:
        key = 0
        while True:
            with ready:
                if not ready.wait_for(lambda: bool(pending), timeout=_DEADLINE):
                    return
                taken = pending[:]
                pending.clear()
            frames = [frame for frame in taken if frame is not None]
            if frames:
                with env.begin(write=True) as txn:  # commits with sync on, on leaving
                    for frame in frames:
                        txn.put(key.to_bytes(8, "big"), frame, append=True)
                        key += 1
                counts["frames"] += len(frames)
                counts["commits"] += 1
                conn.sendall(_COUNT.pack(len(frames)))
            if len(frames) < len(taken):  # the client is done
                return

    writer = threading.Thread(target=write, name="minimal-store-writer")
    writer.start()
    reader = conn.makefile("rb", buffering=1 << 20)
    try:
        while True:
            head = reader.read(4)
            if len(head) < 4:
                break
            frame = reader.read(_COUNT.unpack(head)[0])
            with ready:
                pending.append(frame)
                ready.notify()
    finally:
        with ready:
            pending.append(None)
            ready.notify()
        writer.join(_DEADLINE)
        conn.close()
        env.close()
        result.put((counts["frames"], counts["commits"]))


def synced_store_run(frames: list[bytes], count: int, window: int, directory: str | None = None) -> SyncedRun:
    """Send ``count`` frames (``frames`` in turn) to a minimal store in a process of its own,
    ``window`` unanswered at most, its database in a new directory under ``directory``;
    the time from the first send to the last answer."""
    if count < 1 or window < 1:
        raise ValueError("count and window must be positive")
    ctx = mp.get_context("spawn")
    db = tempfile.mkdtemp(prefix="dafka-bench-synced-", dir=directory)
    port, result = ctx.Queue(), ctx.Queue()
    store = ctx.Process(target=_store_process, args=(db, port, result), daemon=True)
    store.start()
    try:
        wire = [_COUNT.pack(len(frame)) + frame for frame in frames]
        with socket.create_connection(("127.0.0.1", port.get(timeout=60)), timeout=_DEADLINE) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sent = answered = 0
            unread = b""
            start = time.perf_counter()
            deadline = time.monotonic() + _DEADLINE
            while answered < count:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the minimal store answered {answered} of {count} frames")
                while sent < count and sent - answered < window:
                    conn.sendall(wire[sent % len(wire)])
                    sent += 1
                got = conn.recv(4096)
                if not got:
                    raise ConnectionError(f"the minimal store closed after {answered} of {count} frames")
                unread += got
                whole = len(unread) // 4 * 4
                answered += sum(n for (n,) in _COUNT.iter_unpack(unread[:whole]))
                unread = unread[whole:]
            seconds = time.perf_counter() - start
        stored, commits = result.get(timeout=60)
        if stored != count:
            raise RuntimeError(f"the minimal store made {stored} of {count} frames durable")
        return SyncedRun(count, seconds, commits)
    finally:
        store.join(60)
        if store.is_alive():
            store.kill()
        shutil.rmtree(db, ignore_errors=True)

