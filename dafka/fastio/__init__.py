"""The hot I/O functions of the mesh nodes: batch send and frame-exact batch receive.

Two implementations of the same functions: a compiled one (Cython, calling
the libzmq that pyzmq already loaded, holding the GIL for non-blocking work
and releasing it only to wait) and a pure-Python twin.  The compiled one is
chosen at import when it was built and passes its checks;
``DAFKA_NO_EXTENSIONS=1`` forces pure Python.  :data:`IMPLEMENTATION` says
which one is active and :data:`REASON` why.
"""

from __future__ import annotations

import logging
import os
import warnings

from dafka.fastio import _pure
from dafka.tank.codec import FrameBuffer as _FrameBuffer

log = logging.getLogger("dafka.fastio")


def _load() -> tuple[object, str]:
    if os.environ.get("DAFKA_NO_EXTENSIONS", "").strip() not in ("", "0"):
        return _pure, "DAFKA_NO_EXTENSIONS is set"
    from importlib.util import find_spec

    if find_spec("dafka.fastio._compiled") is None:
        return _pure, "the compiled extension is not built"
    try:
        from dafka.fastio import _compiled  # type: ignore[attr-defined]
    except ImportError as exc:
        return _pure, f"the compiled extension does not load ({exc})"
    missing = [name for name in ("drain_records", "drain_pairs", "drain_blocks", "send_records", "send_batches", "send_values", "recv_messages", "events", "send_frames",
                                     "store_blocks", "block_slice", "fetch_blocks", "tank_scan", "tank_values",
                                     "new_bytearray", "view_start", "tank_produce", "FrameBuffer")
               if not hasattr(_compiled, name)]
    if missing:  # built from an older source: rebuild it
        return _pure, f"the compiled extension is out of date (no {', '.join(missing)}); rebuild it"
    try:
        from dafka.fastio._bind import bind

        bind(_compiled)
    except Exception as exc:  # any doubt about the libzmq binding: pure Python
        warnings.warn(
            f"dafka: compiled I/O disabled, using pure Python ({exc})", RuntimeWarning, stacklevel=3
        )
        return _pure, f"the compiled extension failed its checks ({exc})"
    return _compiled, "compiled extension loaded and bound to pyzmq's libzmq"


_impl, REASON = _load()
IMPLEMENTATION: str = _impl.IMPLEMENTATION  # type: ignore[attr-defined]
COMPILED = IMPLEMENTATION == "compiled"

recv_messages = _impl.recv_messages  # type: ignore[attr-defined]
drain_records = _impl.drain_records  # type: ignore[attr-defined]
drain_pairs = _impl.drain_pairs  # type: ignore[attr-defined]
drain_blocks = _impl.drain_blocks  # type: ignore[attr-defined]
send_records = _impl.send_records  # type: ignore[attr-defined]
send_batches = _impl.send_batches  # type: ignore[attr-defined]
send_values = _impl.send_values  # type: ignore[attr-defined]
events = _impl.events  # type: ignore[attr-defined]
send_frames = _impl.send_frames  # type: ignore[attr-defined]
store_blocks = _impl.store_blocks  # type: ignore[attr-defined]
block_slice = _impl.block_slice  # type: ignore[attr-defined]
fetch_blocks = _impl.fetch_blocks  # type: ignore[attr-defined]
tank_scan = _impl.tank_scan  # type: ignore[attr-defined]
tank_values = _impl.tank_values  # type: ignore[attr-defined]
new_bytearray = _impl.new_bytearray  # type: ignore[attr-defined]
view_start = _impl.view_start  # type: ignore[attr-defined]
tank_produce = _impl.tank_produce  # type: ignore[attr-defined]

#: Tank frames from a byte stream (:class:`dafka.tank.codec.FrameBuffer`), compiled when built.
FrameBuffer: type[_FrameBuffer] = _impl.FrameBuffer if COMPILED else _FrameBuffer  # type: ignore[attr-defined]

_warned = False


def describe() -> str:
    """What ``dafka --version`` / ``dafka doctor`` print about the I/O implementation."""
    import sys

    import zmq

    return (
        f"I/O: {IMPLEMENTATION} ({REASON})\n"
        f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
        f"Python {sys.version.split()[0]} ({sys.implementation.name})"
    )


def warn_if_pure(logger: logging.Logger) -> None:
    """Log once per process that nodes run without the compiled extension."""
    global _warned
    if not COMPILED and not _warned:
        _warned = True
        logger.warning("running without the compiled I/O extension (%s): slower, "
                       "and much slower beside busy Python threads", REASON)


__all__ = [
    "COMPILED",
    "IMPLEMENTATION",
    "REASON",
    "block_slice",
    "describe",
    "drain_blocks",
    "drain_pairs",
    "fetch_blocks",
    "drain_records",
    "recv_messages",
    "send_batches",
    "send_records",
    "send_values",
    "store_blocks",
    "warn_if_pure",
]
