"""Progress bars for long CLI work (tqdm), on stderr and only on a terminal.

Scripts and pipes never see a bar: when stderr is not a TTY the bar is
disabled and costs nothing but a check.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm


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
