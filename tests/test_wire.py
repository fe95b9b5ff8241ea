"""Dafka wire codec: captured bytes from the reference, round trips, fuzzing."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.core import wire
from dafka.errors import ProtocolError

UUID_A = "0123456789ABCDEF0123456789ABCDEF"
UUID_B = "FEDCBA9876543210FEDCBA9876543210"


def test_head_capture() -> None:
    # 48 'hello' 00 01 20 <uuid> 05 'hello' 0000000000000002
    raw = b"\x48hello\x00\x01\x20" + UUID_A.encode() + b"\x05hello" + bytes.fromhex("0000000000000002")
    msg = wire.decode([raw])
    assert msg == wire.Head("hello", UUID_A, "hello", 2)
    assert wire.encode(msg) == [raw]


def test_fetch_capture() -> None:
    # 46 <partition uuid> 00 01 20 <consumer uuid> 05 'hello' 0000000000000002 0001869e
    raw = (
        b"\x46" + UUID_A.encode() + b"\x00\x01\x20" + UUID_B.encode() + b"\x05hello"
        + bytes.fromhex("0000000000000002") + bytes.fromhex("0001869e")
    )
    msg = wire.decode([raw])
    assert msg == wire.Fetch(UUID_A, UUID_B, "hello", 2, 99998)
    assert wire.encode(msg) == [raw]


def test_ack_capture() -> None:
    # 4b <producer uuid> 00 01 05 'hello' <sequence:8>  (no address field)
    raw = b"\x4b" + UUID_A.encode() + b"\x00\x01\x05hello" + (7).to_bytes(8, "big")
    msg = wire.decode([raw])
    assert msg == wire.Ack(UUID_A, "hello", 7)
    assert wire.encode(msg) == [raw]


def test_consumer_hello_capture() -> None:
    # 57 <store uuid> 00 01 20 <consumer uuid> 00000000
    raw = b"\x57" + UUID_A.encode() + b"\x00\x01\x20" + UUID_B.encode() + b"\x00\x00\x00\x00"
    msg = wire.decode([raw])
    assert msg == wire.ConsumerHello(UUID_A, UUID_B, ())
    assert wire.encode(msg) == [raw]


def test_store_status_layout() -> None:
    # 59 <producer uuid> 00 01 20 <store uuid> 05 'hello' <writing:1> <reason:string>
    raw = (
        b"\x59" + UUID_A.encode() + b"\x00\x01\x20" + UUID_B.encode() + b"\x05hello"
        + b"\x00" + b"\x09disk full"
    )
    msg = wire.decode([raw])
    assert msg == wire.StoreStatus(UUID_A, UUID_B, "hello", 0, "disk full")
    assert wire.encode(msg) == [raw]
    ok = wire.StoreStatus(UUID_A, UUID_B, "hello", 1, "")
    assert wire.encode(ok) == [raw[: -len(b"\x00\x09disk full")] + b"\x01\x00"]
    # Only dafka producers subscribe to it: no C node's prefix matches it.
    for c_prefix in (b"M", b"H", b"F", b"G", b"D", b"E", b"L", b"W", b"K"):
        assert not raw.startswith(c_prefix)
    with pytest.raises(ProtocolError):
        wire.encode(wire.StoreStatus(UUID_A, UUID_B, "hello", 2, ""))
    assert len(wire.reason_text("\u00e9" * 200).encode()) == 254  # whole characters only
    # A reason with a NUL (an error message from anywhere) is sent without it: decoders refuse NULs.
    said = wire.StoreStatus(UUID_A, UUID_B, "hello", 0, wire.reason_text("disk\x00 full"))
    assert wire.decode(wire.encode(said)) == said._replace(reason="disk full")


def test_void_layout() -> None:
    # 56 <requester uuid> 00 01 20 <partition uuid> 05 'hello' <first:8> <last:8> 20 <store uuid> <kind:1>
    raw = (
        b"\x56" + UUID_A.encode() + b"\x00\x01\x20" + UUID_B.encode() + b"\x05hello"
        + (1).to_bytes(8, "big") + (15).to_bytes(8, "big") + b"\x20" + UUID_A.encode() + b"\x00"
    )
    msg = wire.decode([raw])
    assert msg == wire.Void(UUID_A, UUID_B, "hello", 1, 15, UUID_A, wire.VOID_STORE)
    assert wire.encode(msg) == [raw]
    # Only dafka readers subscribe to it: no C node's prefix matches it.
    for c_prefix in (b"M", b"H", b"F", b"G", b"D", b"E", b"L", b"W", b"K"):
        assert not raw.startswith(c_prefix)
    compacted = wire.decode([raw[:-1] + b"\x02"])  # kind 2: compacted away (issue 37)
    assert compacted == msg._replace(kind=wire.VOID_COMPACTED) and wire.encode(compacted) == [raw[:-1] + b"\x02"]
    for bad in (raw[:-1] + b"\x03", raw[: -42] + (0).to_bytes(8, "big") + raw[-34:]):
        with pytest.raises(ProtocolError):
            wire.decode([bad])  # an unknown kind; last < first
    with pytest.raises(ProtocolError):
        wire.encode(wire.Void(UUID_A, UUID_B, "hello", 5, 4, UUID_B, 1))


def test_record_layout_and_prefix() -> None:
    frames = wire.encode(wire.Record("hello", UUID_A, "hello", 5, b"content"))
    assert frames[0] == b"Mhello\x00\x01\x20" + UUID_A.encode() + b"\x05hello" + (5).to_bytes(8, "big")
    assert frames[1] == b"content"
    prefix = wire.record_prefix(wire.RECORD, "hello", UUID_A, "hello")
    assert frames[0] == prefix + wire.pack_u64(5)


def test_consumer_hello_with_subjects_layout() -> None:
    frames = wire.encode(wire.ConsumerHello(UUID_A, UUID_B, ("a", "bc")))
    assert frames[0].endswith(b"\x00\x00\x00\x02\x00\x00\x00\x01a\x00\x00\x00\x02bc")


def test_beacons() -> None:
    assert wire.node_beacon(UUID_A, "", 49155) == [b"B", UUID_A.encode(), b"", b"49155"]
    assert wire.decode_node_beacon([b"B", UUID_A.encode(), b"", b"49155"]) == (UUID_A, "", 49155)
    assert wire.decode_tower_beacon([b"B", UUID_A.encode(), b"tcp://1.2.3.4:5"]) == (UUID_A, "tcp://1.2.3.4:5")
    for bad in ([b"B", b"x", b"", b"port"], [b"B", b"x", b""], [b"X", b"x", b"", b"1"], [b"B", b"x", b"", b"70000"]):
        with pytest.raises(ProtocolError):
            wire.decode_node_beacon(bad)
    with pytest.raises(ProtocolError):
        wire.decode_tower_beacon([b"B", b"x", b"udp://a:1"])


@pytest.mark.parametrize(
    "frames,why",
    [
        ([b"Mhello\x00\x03\x01a\x01a" + bytes(8), b"x"], "wrong version"),
        ([b"Hhello\x00\x02\x01a\x01a" + bytes(8)], "batch version on a head"),
        ([b"Mhello\x00\x02\x01a\x01a" + bytes(8), bytes(4)], "empty batch"),
        ([b"Mhello\x00\x02\x01a\x01a" + bytes(8), b"\x00\x00\x00\x01\x00\x00\x00\x02a"], "truncated batch record"),
        ([b"Mhello\x00\x02\x01a\x01a" + bytes(8), b"\x00\x00\x00\x01\x00\x00\x00\x01ab"], "batch trailing bytes"),
        ([b"Mhello\x00\x02\x01a\x01a" + bytes(8), b"\x00\x00\x00\x02\x00\x00\x00\x01a"], "batch count too high"),
        ([b"Mhello\x00\x02\x01a\x01a" + b"\xff" * 8, b"\x00\x00\x00\x02" + bytes(8)], "batch past the last offset"),
        ([b"Mhello\x00\x02\x01a\x01a" + bytes(8)], "batch without content"),
        ([b"Hhello\x00\x01\x20" + b"A" * 10], "truncated string"),
        ([b"Hhello\x00\x01\x05hello\x05hello\x00\x00"], "truncated number"),
        ([b"Xhello\x00\x01"], "unknown command"),
        ([b"Hhello"], "no terminator"),
        ([b"Hhello\x00\x01\x01a\x01a" + bytes(8) + b"junk"], "trailing bytes"),
        ([b"Mhello\x00\x01\x01a\x01a" + bytes(8)], "record without content"),
        ([b"Hhello\x00\x01\x01a\x01a" + bytes(8), b"extra"], "head with content"),
        ([], "empty"),
        ([b"Whello\x00\x01\x01a\xff\xff\xff\xff"], "absurd subject count"),
        ([b"Yp\x00\x01\x01s\x01t\x02\x00"], "status writing not 0/1"),
        ([b"Yp\x00\x01\x01s\x01t\x01"], "status without reason"),
        ([b"Yp\x00\x01\x01s\x01t\x01\x00", b"extra"], "status with content"),
    ],
)
def test_strict_decoding(frames: list[bytes], why: str) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(frames)


def test_record_batch_bytes() -> None:
    """A batch is a RECORD with version 2 and the records packed in its content frame."""
    a = "A" * 32
    frames = wire.encode(wire.RecordBatch("hello", a, "hello", 7, (b"one", b"")))
    single = wire.encode(wire.Record("hello", a, "hello", 7, b"one"))
    assert frames[0] == single[0].replace(b"hello\x00\x01", b"hello\x00\x02", 1)
    assert frames[1] == b"\x00\x00\x00\x02" + b"\x00\x00\x00\x03one" + b"\x00\x00\x00\x00"
    prefix = wire.record_prefix(wire.RECORD, "hello", a, "hello")
    assert wire.batch_prefix(prefix) + wire.pack_u64(7) == frames[0]
    # The same subscription prefix as a single RECORD: a subscriber needs nothing new.
    assert frames[0].startswith(wire.P_RECORD + b"hello")


def test_overlong_string_is_refused() -> None:
    with pytest.raises(ProtocolError):
        wire.encode(wire.Head("t", "A" * 256, "t", 0))


names = st.text(min_size=1, max_size=60).filter(lambda s: "\x00" not in s and len(s.encode()) <= 255)
seqs = st.integers(min_value=0, max_value=2**64 - 1)
messages = st.one_of(
    st.builds(wire.Record, names, names, names, seqs, st.binary(max_size=300)),
    st.builds(wire.DirectRecord, names, names, names, seqs, st.binary(max_size=300)),
    st.builds(wire.RecordBatch, names, names, names, st.integers(0, 2**64 - 8), st.lists(st.binary(max_size=60), min_size=1, max_size=7).map(tuple)),
    st.builds(wire.DirectRecordBatch, names, names, names, st.integers(0, 2**64 - 8), st.lists(st.binary(max_size=60), min_size=1, max_size=7).map(tuple)),
    st.builds(wire.Fetch, names, names, names, seqs, st.integers(0, 2**32 - 1)),
    st.builds(wire.Ack, names, names, seqs),
    st.builds(wire.Head, names, names, names, seqs),
    st.builds(wire.DirectHead, names, names, names, seqs),
    st.builds(wire.GetHeads, names, names),
    st.builds(wire.ConsumerHello, names, names, st.lists(names, max_size=5).map(tuple)),
    st.builds(wire.StoreHello, names, names),
    st.builds(wire.StoreStatus, names, names, names, st.integers(0, 1), st.text(max_size=80).map(wire.reason_text)),
    st.builds(wire.Void, names, names, names, st.integers(0, 2**63), st.integers(2**63, 2**64 - 1), names, st.integers(0, 1)),
    st.builds(wire.Commit, names, names, seqs, st.lists(st.tuples(names, names, seqs), max_size=4).map(tuple)),
    st.builds(wire.Committed, names, names, seqs),
    st.builds(wire.GetPositions, names, names, seqs),
    st.builds(wire.Positions, names, names, names, seqs, st.lists(st.tuples(names, names, seqs), max_size=4).map(tuple)),
    st.builds(
        wire.Member,
        names,
        names,
        st.booleans(),
        st.lists(names, max_size=3).map(tuple),
        st.lists(st.tuples(names, names), max_size=4).map(tuple),
    ),
)


@given(messages)
def test_round_trip(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg)) == msg


@settings(max_examples=500)
@given(st.lists(st.binary(max_size=120), min_size=0, max_size=3))
def test_random_bytes_only_raise_protocol_error(frames: list[bytes]) -> None:
    try:
        wire.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300)
@given(messages, st.data())
def test_mutated_messages_only_raise_protocol_error(msg: wire.Message, data: st.DataObject) -> None:
    frames = wire.encode(msg)
    raw = bytearray(frames[0])
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        wire.decode([bytes(raw[:cut]), *frames[1:]])
    except ProtocolError:
        pass


@given(st.lists(st.binary(max_size=40), max_size=5))
def test_beacon_decoders_only_raise_protocol_error(frames: list[bytes]) -> None:
    for decoder in (wire.decode_node_beacon, wire.decode_tower_beacon):
        try:
            decoder(frames)
        except ProtocolError:
            pass


def test_group_messages_bytes() -> None:
    """The consumer-group messages' layout (ids no C node subscribes to)."""
    a, b = "A" * 32, "B" * 32
    frames = wire.encode(wire.Commit("billing", a, 7, (("hello", b, 5),)))
    assert frames == [
        b"Cbilling\x00\x01\x20" + a.encode() + (7).to_bytes(8, "big") + (1).to_bytes(4, "big")
        + b"\x05hello\x20" + b.encode() + (5).to_bytes(8, "big")
    ]
    assert wire.encode(wire.Committed(a, b, 7)) == [b"A" + a.encode() + b"\x00\x01\x20" + b.encode() + (7).to_bytes(8, "big")]
    member = wire.encode(wire.Member("billing", a, False, ("hello",), ()))
    assert member == [
        b"Jbilling\x00\x01\x20" + a.encode() + b"\x00" + (1).to_bytes(4, "big") + (5).to_bytes(4, "big")
        + b"hello" + (0).to_bytes(4, "big")
    ]
    # None of the new ids is one the reference uses.
    for cmd in (wire.COMMIT, wire.COMMITTED, wire.GET_POSITIONS, wire.POSITIONS, wire.MEMBER):
        assert chr(cmd) not in "MDFKHEGWL"
    with pytest.raises(ProtocolError):
        wire.decode([member[0][:-1]])
    with pytest.raises(ProtocolError):
        wire.decode([b"Jbilling\x00\x01\x01a\x02" + bytes(8)])  # unknown flags


def test_the_wire_page_names_every_command() -> None:
    from tests.conftest import ROOT

    page = (ROOT / "docs" / "reference" / "wire.md").read_text(encoding="utf-8")
    from dafka.core import leafwire

    rows = dict(re.findall(r"^\| `(\w)` \| ([A-Z-]+)", page, re.M))
    names = {**wire.COMMAND_NAMES, **leafwire.LEAF_NAMES}  # the mesh's and the leaf connection's
    assert rows == {chr(cid): name for cid, name in names.items()}


@given(
    st.text(min_size=1, max_size=20).filter(lambda s: "\x00" not in s),
    st.text(min_size=1, max_size=20).filter(lambda s: "\x00" not in s),
    st.integers(0, 2**64 - 1),
)
def test_cached_ack_and_head_frames_are_the_encoders(topic: str, partition: str, sequence: int) -> None:
    # The store's ACKs and the gateway's HEADs go out as a cached prefix and the sequence.
    acks = wire.FramePrefixes(lambda key: wire.Ack(key[1], key[0], 0))
    heads = wire.FramePrefixes(lambda key: wire.Head(key[0], key[1], key[0], 0))
    for _ in range(2):  # made, then from the cache
        assert acks.frame((topic, partition), sequence) == wire.encode(wire.Ack(partition, topic, sequence))[0]
        assert heads.frame((topic, partition), sequence) == wire.encode(wire.Head(topic, partition, topic, sequence))[0]


def test_cached_frames_are_bounded_and_refuse_other_messages() -> None:
    made: list[int] = []

    def make(key: int) -> wire.Message:
        made.append(key)
        return wire.Ack(f"p{key}", "t", 0)

    cache = wire.FramePrefixes(make, limit=3)
    for key in [1, 2, 3, 1, 4, 1]:
        cache.frame(key, 7)
    assert made == [1, 2, 3, 4, 1]  # 4 found the cache full: it started again
    assert len(cache._prefixes) <= 3
    with pytest.raises(ValueError):
        wire.FramePrefixes(lambda key: wire.Ack("p", "t", 5)).frame(0, 1)  # not of sequence 0
    with pytest.raises(ValueError):
        wire.FramePrefixes(lambda key: wire.Record("t", "p", "t", 0, b"x")).frame(0, 1)  # two frames
