"""The public import path of the consumer: ``from dafka.consumer import Consumer``.

The consumer lives in :mod:`dafka.nodes.consumer` (with the other node I/O
shells); this module only re-exports its public names, and the errors its
methods raise, so the import path users and the docs know keeps working.
"""

from typing import TYPE_CHECKING, Any

from dafka.errors import ClosedError, CommitError, DeserializationError
from dafka.nodes.consumed import ConsumerRecord
from dafka.nodes.consumer import Consumer

if TYPE_CHECKING:
    from dafka.nodes.leafread import LeafConsumer


def __getattr__(name: str) -> Any:
    # LeafConsumer on first use: a mesh consumer's import pulls in none of the leaf's modules.
    if name == "LeafConsumer":
        from dafka.nodes.leafread import LeafConsumer

        return LeafConsumer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClosedError",
    "CommitError",
    "Consumer",
    "ConsumerRecord",
    "DeserializationError",
    "LeafConsumer",
]
