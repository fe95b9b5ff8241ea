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
        leafwire.LeafRead(ADDR, "commands/dev-1"),
        leafwire.LeafReading(ADDR, "commands/dev-1", 32, ()),
        leafwire.LeafReading(ADDR, "c", 0, (leafwire.ReadPartition("P" * 32, 0, -1),
                                            leafwire.ReadPartition("Q", 2**64 - 1, 2**64 - 2))),
        wire.Fetch("P" * 32, ADDR, "commands/dev-1", 2**64 - 1, 2**32 - 1),
        wire.DirectRecord(ADDR, "P" * 32, "commands/dev-1", 7, b"reboot"),
        wire.DirectHead(ADDR, "P" * 32, "commands/dev-1", 7),
    ],
)
def test_round_trip(msg: leafwire.LeafMessage) -> None:
    assert leafwire.decode(leafwire.encode(msg)) == msg


def test_a_leaf_states_its_restart_hole_with_the_meshs_void() -> None:
    void = wire.Void(ADDR, ADDR, "t", 5, 19, ADDR, wire.VOID_RESTART)
    assert leafwire.decode(leafwire.encode(void)) == void
    assert isinstance(void, leafwire.FROM_LEAF)


def test_new_commands_do_not_collide_with_the_mesh() -> None:
    assert not set(leafwire.LEAF_NAMES) & set(wire.COMMAND_NAMES)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"F" + ADDR.encode() + b"\x00\x01"],  # a FETCH without its fields
        wire.encode(wire.GetHeads("t", ADDR)),  # a mesh command with no place on a leaf connection
        [wire.encode(wire.Void(ADDR, "P", "t", 1, 5, "S", 1))[0][:-1] + b"\x07"],  # a VOID of no known kind
        [b"R" + ADDR.encode() + b"\x00\x01\x01t" + b"x"],  # LEAF-READ with trailing bytes
        [b"R" + ADDR.encode() + b"\x00\x01\x05t"],  # LEAF-READ truncated subject
        leafwire.encode(leafwire.LeafRead(ADDR, "t")) + [b"extra"],
        # LEAF-READING: more partitions than it may list, or than it holds
        [wire.header(leafwire.LEAF_READING, ADDR) + b"\x01t" + bytes(4) + wire._U32.pack(leafwire.MAX_READING + 1)],
        [wire.header(leafwire.LEAF_READING, ADDR) + b"\x01t" + bytes(4) + wire._U32.pack(2) + b"\x01p" + bytes(16)],
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
    with pytest.raises(ProtocolError):
        leafwire.encode(leafwire.LeafReading(ADDR, "t", 2**32, ()))
    with pytest.raises(ProtocolError):
        leafwire.encode(leafwire.LeafReading(ADDR, "t", 1, (leafwire.ReadPartition("p", 0, 2**64 - 1),)))
    with pytest.raises(ProtocolError):
        leafwire.encode(leafwire.LeafRead(ADDR, "t" * 256))


def test_reader_frames_byte_exact() -> None:
    """The layouts docs/reference/wire.md gives, byte for byte."""
    assert leafwire.encode(leafwire.LeafRead("A", "cmd")) == [b"RA\x00\x01\x03cmd"]
    reading = leafwire.LeafReading("A", "cmd", 32, (leafwire.ReadPartition("P", 3, 9), leafwire.ReadPartition("Q", 0, -1)))
    assert leafwire.encode(reading) == [
        b"SA\x00\x01\x03cmd" + b"\x00\x00\x00\x20" + b"\x00\x00\x00\x02"
        + b"\x01P" + (3).to_bytes(8, "big") + (10).to_bytes(8, "big")
        + b"\x01Q" + bytes(8) + bytes(8)
    ]
    one = leafwire.LeafReading("A", "cmd", 32, (leafwire.ReadPartition("P", 3, 9),))
    assert leafwire.encode(one)[0] == bytes.fromhex("5341000103636d64000000200000000101 50".replace(" ", "")) + (
        (3).to_bytes(8, "big") + (10).to_bytes(8, "big"))


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
    leafwire.encode(leafwire.LeafRead(ADDR, "commands/dev-1"))[0],
    leafwire.encode(leafwire.LeafReading(ADDR, "commands/dev-1", 32, (leafwire.ReadPartition("P" * 32, 0, 5),)))[0],
    wire.encode(wire.Fetch("P" * 32, ADDR, "commands/dev-1", 3, 32))[0],
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


@settings(max_examples=300, deadline=None)
@given(
    st.text(min_size=1, max_size=40).filter(lambda t: "\x00" not in t),
    st.text(min_size=0, max_size=40).filter(lambda t: "\x00" not in t),
    st.integers(0, 2**32 - 1),
    st.lists(st.tuples(st.text(max_size=40).filter(lambda t: "\x00" not in t), st.integers(0, 2**64 - 1),
                       st.integers(-1, 2**64 - 2)), max_size=5),
)
def test_fuzz_reading_round_trip(topic: str, subject: str, max_answer: int,
                                 parts: list[tuple[str, int, int]]) -> None:
    msg = leafwire.LeafReading(topic, subject, max_answer, tuple(leafwire.ReadPartition(*p) for p in parts))
    assert leafwire.decode(leafwire.encode(msg)) == msg


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([b"R", b"S", b"F", b"D", b"E"]), st.binary(max_size=120), st.lists(st.binary(max_size=20), max_size=2))
def test_fuzz_reader_commands_only_raise_protocol_error(cmd: bytes, body: bytes, more: list[bytes]) -> None:
    try:
        msg = leafwire.decode([cmd + body, *more])
    except ProtocolError:
        return
    assert isinstance(msg, leafwire.FROM_LEAF + leafwire.FROM_ENDPOINT)
    assert leafwire.decode(leafwire.encode(msg)) == msg
