"""dafka: a decentralized streaming platform (RFC 46 Dafka over ZeroMQ) in Python."""

from dafka.errors import (
    BufferFullError,
    ClosedError,
    ConfigError,
    DafkaError,
    ProtocolError,
    PublishError,
)

__version__ = "0.1.0"

__all__ = [
    "BufferFullError",
    "ClosedError",
    "ConfigError",
    "DafkaError",
    "ProtocolError",
    "PublishError",
    "__version__",
]
