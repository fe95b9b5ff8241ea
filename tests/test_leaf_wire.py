"""The leaf connection's codec (dafka.core.leafwire): round trips, refusals, fuzz."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.core import leafwire, wire
from dafka.errors import ProtocolError

ADDR = "0123456789ABCDEF0123456789ABCDEF"


@pytest.mark.parametrize(
    "msg",
    [
        leafwire.LeafHello(ADDR, "telemetry", -1, 0),
        leafwire.LeafHello(ADDR, "telemetry", 41, 100),
        leafwire.LeafHello(ADDR, "t", 2**64 - 3, 2**64 - 2),
        leafwire.LeafWelcome(ADDR, "telemetry", -1, 1000, 1 << 20),
        leafwire.LeafWelcome(ADDR, "telemetry", 99, 1, 0),
        wire.Record("telemetry", ADDR, "telemetry", 7, b"x"),
        wire.RecordBatch("telemetry", ADDR, "telemetry", 7, (b"x", b"yz")),
        wire.Head("telemetry", ADDR, "telemetry", 7),
        wire.Ack(ADDR, "telemetry", 7),
        wire.StoreStatus(ADDR, "S" * 32, "telemetry", 0, "disk full"),
    ],
)
def test_round_trip(msg: leafwire.LeafMessage) -> None:
    assert leafwire.decode(leafwire.encode(msg)) == msg


def test_new_commands_do_not_collide_with_the_mesh() -> None:
    assert not set(leafwire.LEAF_NAMES) & set(wire.COMMAND_NAMES)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"F" + ADDR.encode() + b"\x00\x01"],  # a mesh command with no place on a leaf connection
        wire.encode(wire.Fetch(ADDR, "R" * 32, "t", 0, 1)),
        wire.encode(wire.GetHeads("t", ADDR)),
        [b"Ixx"],  # no terminator
        [b"I" + ADDR.encode() + b"\x00\x02\x01t" + bytes(16)],  # version 2
        [b"I" + ADDR.encode() + b"\x00\x01\x01t" + bytes(15)],  # truncated
        [b"I" + ADDR.encode() + b"\x00\x01\x01t" + bytes(17)],  # trailing
        leafwire.encode(leafwire.LeafHello(ADDR, "t", -1, 0)) + [b"extra"],
        # acked (5) not below next (5)
        [wire.header(leafwire.LEAF_HELLO, ADDR) + b"\x01t" + wire.pack_u64(6) + wire.pack_u64(5)],
        [wire.header(leafwire.LEAF_WELCOME, ADDR) + b"\x01t" + b"\xff" * 8 + bytes(8)],
    ],
)
def test_refused(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        leafwire.decode(frames)


def test_encode_refuses_out_of_range() -> None:
    with pytest.raises(ProtocolError):
        leafwire.encode(leafwire.LeafHello(ADDR, "t", 5, 5))
    with pytest.raises(ProtocolError):
        leafwire.encode(leafwire.LeafWelcome(ADDR, "t", -1, 2**32, 0))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=80), min_size=0, max_size=3))
def test_fuzz_decode_only_raises_protocol_error(frames: list[bytes]) -> None:
    try:
        msg = leafwire.decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, leafwire.FROM_LEAF + leafwire.FROM_ENDPOINT)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([
    leafwire.encode(leafwire.LeafHello(ADDR, "telemetry", 3, 10))[0],
    leafwire.encode(leafwire.LeafWelcome(ADDR, "telemetry", 3, 10, 100))[0],
]), st.integers(0, 80), st.binary(min_size=1, max_size=3))
def test_fuzz_mutated_leaf_messages(frame: bytes, at: int, bits: bytes) -> None:
    mutated = bytearray(frame)
    for i, b in enumerate(bits):
        mutated[(at + i) % len(mutated)] ^= b or 1
    try:
        msg = leafwire.decode([bytes(mutated)])
    except ProtocolError:
        return
    assert leafwire.decode(leafwire.encode(msg)) == msg
