"""Progress bars for long CLI work (tqdm), on stderr and only on a terminal.

Scripts and pipes never see a bar: when stderr is not a TTY the bar is
disabled and costs nothing but a check.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

CHUNK = 1 << 16  # bytes read between bar updates (an update per line would cost more)


def enabled(stream: IO[Any] | None = None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal."""
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def bar(
    total: float | None = None,
    desc: str = "",
    *,
    unit: str = "rec",
    bytes_: bool = False,
    show: bool | None = None,
) -> tqdm:
    """A bar on stderr, disabled unless stderr is a TTY (or ``show`` says otherwise)."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B" if bytes_ else unit,
        unit_scale=bytes_,
        unit_divisor=1024 if bytes_ else 1000,
        file=sys.stderr,
        disable=not (enabled() if show is None else show),
        leave=False,
        dynamic_ncols=True,
        mininterval=0.2,
    )


def read_lines(source: Iterable[bytes], progress: tqdm) -> Iterator[bytes]:
    """``source``'s lines without their line end, counting bytes read on ``progress``."""
    if progress.disable:
        for line in source:
            yield line.rstrip(b"\r\n")
        return
    pending = 0
    for line in source:
        pending += len(line)
        if pending >= CHUNK:
            progress.update(pending)
            pending = 0
        yield line.rstrip(b"\r\n")
    progress.update(pending)
