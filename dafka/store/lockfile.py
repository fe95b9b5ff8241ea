"""One writer per record database: an exclusive lock file beside ``data.mdb``.

LMDB lets several processes write one environment (it serialises their
transactions), so a second store started on a ``--db`` already in use would
run silently beside the first, both acknowledging into one database.  The
writer therefore holds an exclusive ``flock`` on ``DIR/writer.lock``, which
names the holder (pid and host).  The kernel releases the lock when the
holder exits, even when it is killed: a stale file never blocks a restart.
Read-only openers (``dafka topics``, the Spark reader) take no lock.
"""

from __future__ import annotations

import contextlib
import os
import socket

from dafka.errors import DafkaError

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: no lock
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "writer.lock"


class DatabaseInUseError(DafkaError):
    """Another process (or another store of this process) writes this database."""


class WriterLock:
    """The exclusive writer lock of the database directory ``path`` (held until :meth:`release`)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.join(path, LOCK_NAME)
        self._fd: int | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise DatabaseInUseError(
                        f"database {path} is in use by another store ({self._holder(fd)}); "
                        "two stores must not share a database: give each its own --db"
                    ) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @staticmethod
    def _holder(fd: int) -> str:
        with contextlib.suppress(OSError):
            text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            if text:
                return text
        return "holder unknown"

    def release(self) -> None:
        """Give the lock up (idempotent); the file stays, the kernel lock goes."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock
