"""What a consumer delivers: :class:`ConsumerRecord`, and the record class for a deserializer.

Shared by the mesh consumer (:mod:`dafka.nodes.consumer`) and the leaf consumer
(:mod:`dafka.nodes.leafread`), which deliver the same records.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from dafka import values
from dafka.errors import DeserializationError
from dafka.values import Deserializer


class ConsumerRecord(NamedTuple):
    """One delivered record: where it comes from and its content (bytes).

    ``value`` is the content as the consumer's ``deserializer`` decodes it
    (the content itself by default).
    """

    topic: str
    partition: str  # the producer's address
    offset: int
    content: bytes

    @property
    def value(self) -> Any:
        """The deserialized content: here the bytes themselves (no deserializer)."""
        return self[3]


def record_type(deserializer: str | Deserializer | None) -> type[ConsumerRecord]:
    """The record class a consumer delivers: ConsumerRecord itself for plain bytes.

    Otherwise a subclass (same fields, no per-record cost on receipt) whose
    ``value`` decodes the content on each access, raising
    :class:`DeserializationError` (naming topic, partition and offset) for
    content it cannot decode.
    """
    found = values.deserializer(deserializer)
    if found is None:
        return ConsumerRecord
    decode: Deserializer = found

    class DecodedRecord(ConsumerRecord):
        __slots__ = ()

        @property
        def value(self) -> Any:
            """The content decoded by the consumer's deserializer (on each access)."""
            try:
                return decode(self[3])
            except Exception as exc:
                raise DeserializationError(
                    f"record {self[2]} of {self[0]}/{self[1]} cannot be deserialized: {exc}",
                    self[0],
                    self[1],
                    self[2],
                ) from exc

    DecodedRecord.__name__ = DecodedRecord.__qualname__ = "ConsumerRecord"
    return DecodedRecord
