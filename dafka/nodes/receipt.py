"""What one ``publish`` returns (:class:`Receipt`), and the check every record's content passes.

Below the producers that hand receipts out (the mesh producer,
:mod:`dafka.nodes.producer`, and the leaf producer, :mod:`dafka.nodes.leaf`):
a receipt asks its producer through :class:`ReceiptSource`.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import Any, Protocol

from dafka.errors import PublishError

log = logging.getLogger("dafka.producer")


class ReceiptSource(Protocol):
    """What a producer offers the receipts it hands out."""

    _outbox: Any  # None, or an outbox whose ``failure_for(offset)`` says why a record failed

    def _acked_upto(self) -> int: ...
    def _failure_for(self, offset: int) -> Any: ...
    def _wait_for(self, offset: int, timeout: float | None) -> bool: ...
    def _add_callback(self, receipt: Receipt, fn: Callable[[Receipt], None]) -> None: ...


def check_content(content: object) -> None:
    """Raise TypeError unless ``content`` is bytes-like (bytes, bytearray, memoryview, ...)."""
    try:
        memoryview(content)  # type: ignore[arg-type]
    except TypeError:
        hint = " (encode it first, e.g. text.encode())" if isinstance(content, str) else ""
        raise TypeError(f"a record must be bytes-like, not {type(content).__name__}{hint}") from None


class Receipt:
    """The outcome of one ``publish``: its offset, and whether a store acked it.

    Resolves exactly once: acknowledged, or failed with a :class:`PublishError`.
    Costs no memory in the producer until a callback is attached.
    """

    __slots__ = ("offset", "_producer")

    def __init__(self, producer: ReceiptSource, offset: int) -> None:
        self.offset = offset
        self._producer = producer

    def __repr__(self) -> str:
        state = "acked" if self.acked() else "failed" if self.failed() else "pending"
        return f"<Receipt offset={self.offset} {state}>"

    def acked(self) -> bool:
        """Whether a store acknowledged the record (without acks: at once)."""
        producer = self._producer
        return producer._acked_upto() >= self.offset and (
            producer._outbox is None or producer._outbox.failure_for(self.offset) is None
        )

    def failed(self) -> bool:
        """Whether the record failed (a :class:`PublishError`): it will never be acknowledged."""
        return self._producer._failure_for(self.offset) is not None

    def done(self) -> bool:
        """Whether the record was acknowledged or failed."""
        return self.acked() or self.failed()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until resolved; True when acknowledged, False on timeout.

        Raises :class:`PublishError` if the record failed.
        """
        return self._producer._wait_for(self.offset, timeout)

    def result(self, timeout: float | None = None) -> int:
        """The offset once acknowledged; raises PublishError on failure or timeout."""
        if not self.wait(timeout):
            raise PublishError(f"offset {self.offset} not acknowledged within {timeout}s", self.offset)
        return self.offset

    def add_done_callback(self, fn: Callable[[Receipt], None]) -> None:
        """Call ``fn(receipt)`` once resolved (from the producer's I/O thread)."""
        self._producer._add_callback(self, fn)


class ReceiptCallbacks:
    """The callbacks attached to receipts, kept in offset order until resolved.

    Shared by the mesh producer and the leaf producer: each sets ``_lock``,
    ``_callbacks`` and ``_callback_seq`` and runs the due ones itself.
    """

    _lock: Any
    _callbacks: list[tuple[int, int, Receipt, Callable[[Receipt], None]]]
    _callback_seq: int

    def _add_callback(self, receipt: Receipt, fn: Callable[[Receipt], None]) -> None:
        with self._lock:
            if not receipt.done():
                self._callback_seq += 1
                heapq.heappush(self._callbacks, (receipt.offset, self._callback_seq, receipt, fn))
                return
        self._call(fn, receipt)

    def _call(self, fn: Callable[[Receipt], None], receipt: Receipt) -> None:
        try:
            fn(receipt)
        except Exception:
            log.exception("publish callback failed")
