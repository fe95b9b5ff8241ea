"""The public import path of the consumer: ``from dafka.consumer import Consumer``.

The consumer lives in :mod:`dafka.nodes.consumer` (with the other node I/O
shells); this module only re-exports its public names, and the errors its
methods raise, so the import path users and the docs know keeps working.
"""

from dafka.errors import ClosedError, CommitError, DeserializationError
from dafka.nodes.consumer import Consumer, ConsumerRecord

__all__ = [
    "ClosedError",
    "CommitError",
    "Consumer",
    "ConsumerRecord",
    "DeserializationError",
]
