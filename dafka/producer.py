"""The public import path of the producer: ``from dafka.producer import Producer``.

The producer lives in :mod:`dafka.nodes.producer` (with the other node I/O
shells); this module only re-exports its public names, and the errors its
methods raise, so the import path users and the docs know keeps working.
"""

from dafka.errors import (
    BufferFullError,
    ClosedError,
    PublishError,
    RecordTooLargeError,
    ResumeError,
)
from dafka.nodes.producer import Producer, Receipt

__all__ = [
    "BufferFullError",
    "ClosedError",
    "Producer",
    "PublishError",
    "Receipt",
    "RecordTooLargeError",
    "ResumeError",
]
