"""Record values: serializers (value -> bytes) and deserializers (bytes -> value).

A record's content is bytes on the wire.  A :class:`~dafka.producer.Producer`
built with ``serializer=`` turns what ``publish`` gets into those bytes; a
:class:`~dafka.consumer.Consumer` built with ``deserializer=`` gives each
record a ``.value`` decoded from its ``.content`` (on access, never on the
per-record receive path).

Formats by name: ``"bytes"`` (the default: content as it is), ``"msgpack"``
(compact, the format for structured records), ``"json"`` (UTF-8).  Any
callable works too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgpack

Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]

FORMATS = ("bytes", "msgpack", "json")


def _pack_msgpack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack_msgpack(content: bytes) -> Any:
    # strict_map_key=False: integer keys (as maps from Go or C clients have) are fine.
    return msgpack.unpackb(content, raw=False, strict_map_key=False)


def _dump_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _load_json(content: bytes) -> Any:
    return json.loads(content)


_SERIALIZERS: dict[str, Serializer | None] = {"bytes": None, "msgpack": _pack_msgpack, "json": _dump_json}
_DESERIALIZERS: dict[str, Deserializer | None] = {
    "bytes": None,
    "msgpack": _unpack_msgpack,
    "json": _load_json,
}


def serializer(spec: str | Serializer | None) -> Serializer | None:
    """The function for ``spec`` (a format name or a callable); None for plain bytes."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return _SERIALIZERS[spec]
        except KeyError:
            raise ValueError(f"serializer must be one of {FORMATS} or a callable, not {spec!r}") from None
    if not callable(spec):
        raise TypeError(f"serializer must be one of {FORMATS} or a callable, not {type(spec).__name__}")
    return spec


def deserializer(spec: str | Deserializer | None) -> Deserializer | None:
    """The function for ``spec`` (a format name or a callable); None for plain bytes."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return _DESERIALIZERS[spec]
        except KeyError:
            raise ValueError(f"deserializer must be one of {FORMATS} or a callable, not {spec!r}") from None
    if not callable(spec):
        raise TypeError(f"deserializer must be one of {FORMATS} or a callable, not {type(spec).__name__}")
    return spec


def encode(serialize: Serializer, value: Any) -> bytes:
    """``serialize(value)`` as bytes, or a :class:`~dafka.errors.SerializationError`."""
    from dafka.errors import SerializationError

    try:
        content = serialize(value)
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(f"cannot serialize a {type(value).__name__} value: {exc}") from exc
    if type(content) is not bytes:
        if isinstance(content, bytearray | memoryview):
            return bytes(content)
        raise SerializationError(
            f"the serializer returned a {type(content).__name__}, not bytes"
        )
    return content

