"""Input lines in batches as they arrive: what ``dafka produce`` publishes.

A batch goes out when it holds :data:`MAX_LINES` lines or ``linger``
seconds after its first line arrived, whichever comes first, and at the end
of the input.  Fast input (a file, a busy pipe) fills batches; a slow one
(``tail -f app.log``, a terminal) sends each line within ``linger``.

:class:`LineBatcher` is the logic (bytes and times in, batches out, no I/O);
:func:`read_batches` is the shell that reads a file descriptor.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Iterator

LINGER = 0.005  # seconds a batch waits for more lines after its first one
MAX_LINES = 1024  # lines in a batch (publish_many's chunk)
READ_BYTES = 1 << 16
IDLE_WAIT = 0.2  # seconds between looks at the stop flag while no input comes


class LineBatcher:
    """Splits chunks of bytes into lines (without their line end) and groups them into batches."""

    def __init__(self, linger: float = LINGER, max_lines: int = MAX_LINES) -> None:
        self.linger = linger
        self.max_lines = max_lines
        self._partial = b""  # the start of a line whose end has not come yet
        self._lines: list[bytes] = []
        self._first_at: float | None = None  # when the oldest waiting line arrived

    def feed(self, chunk: bytes, now: float) -> None:
        parts = (self._partial + chunk).split(b"\n")
        self._partial = parts.pop()
        if parts:
            self._lines.extend(line.rstrip(b"\r") for line in parts)
            if self._first_at is None:
                self._first_at = now

    def wait(self, now: float) -> float | None:
        """Seconds until the waiting lines are due (0: now); None when no line waits."""
        if self._first_at is None:
            return None
        if len(self._lines) >= self.max_lines:
            return 0.0
        return max(0.0, self._first_at + self.linger - now)

    def take(self) -> list[bytes]:
        """The waiting lines (up to ``max_lines``); the rest wait on, due at once."""
        batch, self._lines = self._lines[: self.max_lines], self._lines[self.max_lines :]
        if not self._lines:
            self._first_at = None
        return batch

    def end(self) -> list[bytes]:
        """At the end of the input: every waiting line, and a last one without a line end."""
        if self._partial:
            self._lines.append(self._partial.rstrip(b"\r"))
            self._partial = b""
        lines, self._lines, self._first_at = self._lines, [], None
        return lines


def read_batches(
    fd: int,
    stop: threading.Event,
    clock: Callable[[], float],
    on_bytes: Callable[[int], None] = lambda n: None,
    linger: float = LINGER,
) -> Iterator[list[bytes]]:
    """Batches of the lines read from ``fd`` as they arrive, until its end or ``stop``.

    At ``stop`` the complete lines read so far are still given; a line
    without its end yet is dropped (it was not finished).
    """
    batcher = LineBatcher(linger)
    while not stop.is_set():
        wait = batcher.wait(clock())
        if wait == 0.0:
            yield batcher.take()
            continue
        ready, _, _ = select.select([fd], [], [], IDLE_WAIT if wait is None else min(wait, IDLE_WAIT))
        if not ready:
            continue
        chunk = os.read(fd, READ_BYTES)
        if not chunk:
            lines = batcher.end()
            while lines:
                yield lines[:MAX_LINES]
                lines = lines[MAX_LINES:]
            return
        on_bytes(len(chunk))
        batcher.feed(chunk, clock())
    while (lines := batcher.take()):
        yield lines
