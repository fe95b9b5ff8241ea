"""Exception types shared by every dafka module."""

from __future__ import annotations


class DafkaError(Exception):
    """Base class of every dafka error."""


class ProtocolError(DafkaError, ValueError):
    """Bytes that do not follow the Dafka or Tank wire format.

    Raised by decoders for wrong versions, truncated fields, unknown commands,
    over-long strings and the like.  A node that receives one logs it, counts
    it and keeps serving.
    """


class RecordTooLargeError(DafkaError, ValueError):
    """A record is larger than the node's ``max_record_bytes`` (as Kafka's
    ``message.max.bytes``): refused at publish; readers drop such records."""


class PublishError(DafkaError):
    """A record was not acknowledged by a store (timeout, closed producer, ...)."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


class ResumeError(PublishError):
    """A producer restarted from an identity file cannot safely continue its partition.

    Either no store told it the partition's head within the resume timeout
    (pass ``resume="start_anyway"`` to continue regardless), or another live
    process uses the same identity.
    """


class BufferFullError(PublishError):
    """The producer's unacked buffer is full and the publish timeout passed."""


class CommitError(DafkaError):
    """No store confirmed a consumer group's commit in time."""


class ClosedError(DafkaError):
    """The node has been closed."""


class ConfigError(DafkaError):
    """A configuration value is missing or invalid."""


class SerializationError(DafkaError, TypeError, ValueError):
    """A value the producer's serializer cannot turn into bytes (raised by ``publish``).

    Both a TypeError (a type the format has no form for) and a ValueError (a
    value out of its range, such as NaN in JSON), so either ``except`` catches it.
    """


class DeserializationError(DafkaError, ValueError):
    """A record whose content the consumer's deserializer cannot decode.

    Raised by ``record.value``; the record stays readable as bytes
    (``record.content``) and the consumer goes on with the next records.
    ``topic``, ``partition`` and ``offset`` name the record.
    """

    def __init__(self, message: str, topic: str, partition: str, offset: int) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset


class StorageError(DafkaError):
    """The record database cannot do what was asked (wrong format, read-only, corrupt)."""


class StorageFullError(StorageError):
    """A write did not fit: the disk is full or ``max_map_size`` was reached.

    Nothing of the failed batch was committed and everything committed before
    is intact; the database stays usable (reads, retention, smaller writes).
    """
