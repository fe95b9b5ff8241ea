"""Tank requests and responses: captured vectors, layouts, round trips, garbage."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dafka.errors import ProtocolError
from dafka.tank.bundle import decode_bundle, encode_bundle, encode_chunk
from dafka.tank.codec import FrameBuffer, encode_frame
from dafka.tank.codec import FrameBuffer as PyFrameBuffer
from dafka.tank.messages import (
    PRODUCE_PARTITION_ERRORS,
    PRODUCE_TOPIC_ERRORS,
    RESPONSE_TYPES,
    SEQ_TAIL,
    ConsumeFlag,
    ConsumePartition,
    ConsumePartitionResult,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopic,
    ConsumeTopicResult,
    CreateTopicError,
    CreateTopicRequest,
    CreateTopicResponse,
    DiscoverPartitionsRequest,
    DiscoverPartitionsResponse,
    DiscoverTopicsRequest,
    DiscoverTopicsResponse,
    DiscoverTopologyRequest,
    DiscoverTopologyResponse,
    MsgId,
    PartitionBounds,
    Ping,
    ProduceError,
    ProducePartition,
    ProducePartitionResult,
    ProduceRequest,
    ProduceResponse,
    ProduceTopic,
    ProduceTopicResult,
    ProduceWithSeqnumRequest,
    ReloadConfRequest,
    ReloadConfResponse,
    StatusRequest,
    StatusResponse,
    TopicInfo,
    decode_request,
    decode_response,
    error_name,
    response_msg_id,
    response_request_id,
)
from tests.tank.test_codec import FRAME_BUFFERS

TS = struct.pack("<Q", 1_700_000_000_000)  # the captures do not give the timestamp bytes
U64 = struct.Struct("<Q")


def frame_of(data: bytes) -> tuple[int, bytes]:
    fb = FrameBuffer()
    fb.feed(data)
    frame = fb.next_frame()
    assert frame is not None and fb.buffered == 0
    return frame


# ---------------------------------------------------------------- captured: produce

# ``tank-cli produce -s 2 hello world``
CAPTURED_PRODUCE_BUNDLE = b"\x08" + b"\x00" + TS + b"\x05hello" + b"\x02\x05world"
CAPTURED_PRODUCE = (
    bytes.fromhex("01 32000000")
    + bytes.fromhex("0200 01000000") + b"\x03c++" + b"\x00" + bytes.fromhex("00000000")
    + b"\x01" + b"\x06events" + b"\x01" + bytes.fromhex("0000")
    + b"\x17" + CAPTURED_PRODUCE_BUNDLE
)  # fmt: skip
CAPTURED_GREETING = bytes.fromhex("03 00000000")
CAPTURED_PRODUCE_ACK = bytes.fromhex("01 05000000 01000000 00")


def test_captured_produce_request() -> None:
    assert len(CAPTURED_PRODUCE) == 5 + 0x32
    msg_id, payload = frame_of(CAPTURED_PRODUCE)
    req = decode_request(msg_id, payload)
    assert req == ProduceRequest(
        req_id=1,
        topics=[ProduceTopic("events", [ProducePartition(0, CAPTURED_PRODUCE_BUNDLE)])],
        client_id="c++",
        acks=0,
        ack_timeout=0,
        version=2,
    )
    assert type(req) is ProduceRequest
    assert decode_bundle(req.topics[0].partitions[0].bundle, base_seq=1) == [
        (1, 1_700_000_000_000, None, b"hello"),
        (2, 1_700_000_000_000, None, b"world"),
    ]
    assert req.encode() == CAPTURED_PRODUCE
    # and built from scratch, bundle included
    ts = 1_700_000_000_000
    bundle = encode_bundle([(None, ts, None, b"hello"), (None, ts, None, b"world")])
    again = ProduceRequest(1, [ProduceTopic("events", [ProducePartition(0, bundle)])], "c++")
    assert again.encode() == CAPTURED_PRODUCE


def test_captured_broker_replies() -> None:
    assert Ping().encode() == CAPTURED_GREETING
    assert decode_response(*frame_of(CAPTURED_GREETING)) == Ping()
    req = decode_request(*frame_of(CAPTURED_PRODUCE))
    msg_id, payload = frame_of(CAPTURED_PRODUCE_ACK)
    assert response_request_id(msg_id, payload) == 1
    resp = decode_response(msg_id, payload, req)
    assert resp == ProduceResponse(1, [ProduceTopicResult([ProducePartitionResult(0)])])
    assert resp.per_partition(req) == [("events", 0, 0, None)]
    assert resp.encode() == CAPTURED_PRODUCE_ACK
    assert response_msg_id(req) == MsgId.PRODUCE


# ---------------------------------------------------------------- captured: consume

CAPTURED_CHUNK = b"\x0f" + b"\x04" + b"\x00" + TS + b"\x04late"
CAPTURED_CONSUME_RESPONSE = (
    bytes.fromhex("02 38000000 24000000")
    + bytes.fromhex("01000000 01") + b"\x06events" + b"\x01" + bytes.fromhex("0000 00")
    + U64.pack(109) + U64.pack(109) + bytes.fromhex("10000000")
    + CAPTURED_CHUNK
)  # fmt: skip
# The request behind it: ver 2, client id "", max_wait 0xffffffff, min_bytes 0,
# seq UINT64_MAX, fetch size 128 MiB.
CAPTURED_CONSUME_REQUEST = (
    bytes.fromhex("02 2a000000")
    + bytes.fromhex("0200 01000000 00")
    + bytes.fromhex("ffffffff00000000 00000000")
    + b"\x01" + b"\x06events" + b"\x01"
    + bytes.fromhex("0000 ffffffffffffffff 00000008")
)  # fmt: skip


def test_captured_consume_response() -> None:
    assert len(CAPTURED_CONSUME_RESPONSE) == 5 + 0x38
    msg_id, payload = frame_of(CAPTURED_CONSUME_RESPONSE)
    assert response_request_id(msg_id, payload) == 1
    resp = decode_response(msg_id, payload)
    assert resp == ConsumeResponse(
        1,
        [
            ConsumeTopicResult(
                "events",
                [ConsumePartitionResult(0, 0, base_seq=109, hwm=109, chunk=CAPTURED_CHUNK)],
            )
        ],
    )
    assert resp.encode() == CAPTURED_CONSUME_RESPONSE
    chunk = resp.topics[0].partitions[0].decode_chunk()
    assert chunk.records == [(109, 1_700_000_000_000, None, b"late")]
    assert chunk.next_seq == 110


def test_captured_consume_request() -> None:
    req = ConsumeRequest(
        1,
        [ConsumeTopic("events", [ConsumePartition(0, SEQ_TAIL, 128 * 1024 * 1024)])],
        max_wait_ms=0xFFFFFFFF,
    )
    assert req.encode() == CAPTURED_CONSUME_REQUEST
    assert decode_request(*frame_of(CAPTURED_CONSUME_REQUEST)) == req


# ---------------------------------------------------------------- layouts


def test_produce_with_seqnum_layout() -> None:
    bundle = encode_bundle([(None, 5, None, b"x")])
    req = ProduceWithSeqnumRequest(9, [ProduceTopic("t", [ProducePartition(3, bundle, 500)])])
    payload = req.encode_payload()
    # bundle_len counts the bundle only; first_seq sits between it and the bundle
    assert payload.endswith(b"\x03\x00" + bytes([len(bundle)]) + U64.pack(500) + bundle)
    assert req.encode()[0] == 0x05
    assert decode_request(0x05, payload) == req
    assert response_msg_id(req) == MsgId.PRODUCE
    with pytest.raises(ProtocolError):
        ProduceWithSeqnumRequest(1, [ProduceTopic("t", [ProducePartition(0, bundle)])]).encode()
    with pytest.raises(ProtocolError):
        ProduceRequest(1, [ProduceTopic("t", [ProducePartition(0, bundle, 5)])]).encode()


def test_produce_response_topic_level_errors_written_once() -> None:
    req = ProduceRequest(
        7,
        [
            ProduceTopic("gone", [ProducePartition(i, b"\x04") for i in range(3)]),
            ProduceTopic("ok", [ProducePartition(i, b"\x04") for i in range(3)]),
            ProduceTopic("empty", []),
            ProduceTopic("ro", [ProducePartition(0, b"\x04"), ProducePartition(1, b"\x04")]),
        ],
    )
    resp = ProduceResponse(
        7,
        [
            ProduceTopicResult([], ProduceError.UNKNOWN_TOPIC),
            ProduceTopicResult(
                [
                    ProducePartitionResult(0),
                    ProducePartitionResult(ProduceError.OTHER_LEADER, (0x0100007F, 11011)),
                    ProducePartitionResult(ProduceError.INVALID_SEQNUM),
                ]
            ),
            ProduceTopicResult(),
            ProduceTopicResult([], ProduceError.READ_ONLY),
        ],
    )
    payload = resp.encode_payload()
    assert payload == (
        bytes.fromhex("07000000 ff 00 fc") + struct.pack("<IH", 0x0100007F, 11011) + b"\x0a\xfe"
    )
    assert ProduceResponse.decode(payload, req.partition_counts()) == resp
    assert resp.per_partition(req) == [
        ("gone", 0, 0xFF, None),
        ("gone", 1, 0xFF, None),
        ("gone", 2, 0xFF, None),
        ("ok", 0, 0, None),
        ("ok", 1, 0xFC, (0x0100007F, 11011)),
        ("ok", 2, 10, None),
        ("ro", 0, 0xFE, None),
        ("ro", 1, 0xFE, None),
    ]
    with pytest.raises(ProtocolError):
        ProduceResponse.decode(payload + b"\x00", req.partition_counts())
    with pytest.raises(ProtocolError):
        ProduceResponse.decode(payload[:-1], req.partition_counts())
    with pytest.raises(TypeError):
        decode_response(MsgId.PRODUCE, payload)


@pytest.mark.parametrize(
    "resp",
    [
        ProduceResponse(1, [ProduceTopicResult([], 1)]),  # not topic-level
        ProduceResponse(1, [ProduceTopicResult([ProducePartitionResult(0xFF)])]),
        ProduceResponse(1, [ProduceTopicResult([ProducePartitionResult(5)])]),
        ProduceResponse(1, [ProduceTopicResult([ProducePartitionResult(0xFC)])]),  # no leader
        ConsumeResponse(1, [ConsumeTopicResult("t", [ConsumePartitionResult(0, 2, 0, 0)])]),
        ConsumeResponse(1, [ConsumeTopicResult("t", [ConsumePartitionResult(0, 0xFA, 0, 0)])]),
        ConsumeResponse(1, [ConsumeTopicResult("t", [ConsumePartitionResult(0, 1, 0, 0)])]),
        ConsumeResponse(1, [ConsumeTopicResult("t", [ConsumePartitionResult(0, 0xFC)])]),
        ConsumeResponse(1, [ConsumeTopicResult("t", [ConsumePartitionResult(0xFFFF, 0xFF)])]),
        CreateTopicResponse(1, "t", 3),
        DiscoverTopologyResponse(1, b"\xff\xff"),
        ConsumeRequest(1, op_flags=1),  # op_flags need version 3
        StatusRequest(2**32),
        ProduceRequest(1, [ProduceTopic("x" * 256)]),
        ProduceRequest(1, [ProduceTopic(str(i)) for i in range(256)]),
    ],
)
def test_encoders_refuse(resp) -> None:
    with pytest.raises(ProtocolError):
        resp.encode()


def test_consume_response_flag_layouts() -> None:
    chunk = encode_chunk([encode_bundle([(11, 1, None, b"s")], sparse=True)])
    resp = ConsumeResponse(
        5,
        [
            ConsumeTopicResult(
                "a",
                [
                    ConsumePartitionResult(0, 0, base_seq=10, hwm=20, chunk=b""),
                    ConsumePartitionResult(1, 1, base_seq=0, hwm=20, first_avail=4),
                    ConsumePartitionResult(2, 0xFE, hwm=30, chunk=chunk),
                    ConsumePartitionResult(3, 0xFB),
                    ConsumePartitionResult(4, 0xFC, leader=(0x0A000001, 1234)),
                    ConsumePartitionResult(5, 0xFD),
                    ConsumePartitionResult(6, 0xFF),
                ],
            ),
            ConsumeTopicResult("nope", unknown=True, requested_partitions=2),
        ],
    )
    header = (
        bytes.fromhex("05000000 02") + b"\x01a\x07"
        + b"\x00\x00\x00" + U64.pack(10) + U64.pack(20) + struct.pack("<I", 0)
        + b"\x01\x00\x01" + U64.pack(0) + U64.pack(20) + struct.pack("<I", 0) + U64.pack(4)
        + b"\x02\x00\xfe" + U64.pack(30) + struct.pack("<I", len(chunk))
        + b"\x03\x00\xfb"
        + b"\x04\x00\xfc" + struct.pack("<IH", 0x0A000001, 1234)
        + b"\x05\x00\xfd"
        + b"\x06\x00\xff"
        + b"\x04nope\x02\xff\xff"
    )  # fmt: skip
    payload = struct.pack("<I", len(header)) + header + chunk
    assert resp.encode_payload() == payload
    decoded = ConsumeResponse.decode(payload)
    assert decoded == resp
    assert decoded.topics[0].partitions[2].decode_chunk().records == [(11, 1, None, b"s")]
    # a flag value outside the safe set
    bad = payload.replace(b"\x03\x00\xfb", b"\x03\x00\x02")
    with pytest.raises(ProtocolError, match="0x02"):
        ConsumeResponse.decode(bad)
    with pytest.raises(ProtocolError):
        ConsumeResponse.decode(payload + b"\x00")  # trailing after the chunks
    with pytest.raises(ProtocolError):
        ConsumeResponse.decode(payload[:-1])  # chunk cut
    with pytest.raises(ProtocolError):  # header length disagrees with the header
        ConsumeResponse.decode(struct.pack("<I", len(header) + 1) + header + chunk)


def test_consume_request_versions() -> None:
    v3 = ConsumeRequest(3, [ConsumeTopic("t", [ConsumePartition(1, 2, 3)])], "id", 4, 5, 3, 0x80)
    payload = v3.encode_payload()
    assert payload[: 2 + 4 + 3 + 8 + 4 + 1] == (
        struct.pack("<HI", 3, 3) + b"\x02id" + struct.pack("<QI", 4, 5) + b"\x80"
    )
    assert ConsumeRequest.decode(payload) == v3
    v2 = ConsumeRequest(3, [ConsumeTopic("t", [ConsumePartition(1, 2, 3)])], "id", 4, 5, 2)
    assert len(v2.encode_payload()) == len(payload) - 1
    assert ConsumeRequest.decode(v2.encode_payload()) == v2


def test_other_layouts() -> None:
    assert DiscoverPartitionsRequest(1, "t").encode() == bytes.fromhex("06 06000000 01000000 0174")
    assert DiscoverPartitionsRequest(1, "t", [2, 3]).encode_payload() == bytes.fromhex(
        "01000000 0174 0200 0300"
    )
    resp = DiscoverPartitionsResponse(1, "t", [PartitionBounds(1, 10), PartitionBounds(0, 0)])
    assert resp.encode_payload() == (
        bytes.fromhex("01000000 0174 0200") + U64.pack(1) + U64.pack(10) + bytes(16)
    )
    assert DiscoverPartitionsResponse(1, "t").unknown_topic
    assert CreateTopicRequest(2, "t", 8, "retention=1\n").encode_payload() == (
        bytes.fromhex("02000000 0174 0800 0c") + b"retention=1\n"
    )
    assert CreateTopicResponse(2, "t", CreateTopicError.EXISTS).encode_payload() == bytes.fromhex(
        "02000000 0174 01"
    )
    assert ReloadConfRequest(3, "t", 4).encode_payload() == bytes.fromhex("03000000 0174 0400")
    assert ReloadConfResponse(3, "t", 4, 0).encode_payload() == bytes.fromhex(
        "03000000 0174 0400 00"
    )
    assert StatusRequest(4).encode() == bytes.fromhex("0a 04000000 04000000")
    status = StatusResponse(4, 0, False, 2, 16, 3, 5, 1_700_000_000, 400)
    assert len(status.encode_payload()) == 30
    assert StatusResponse.decode(status.encode_payload()) == status
    assert DiscoverTopicsRequest(5).encode() == bytes.fromhex("0b 05000000 05000000 00")
    topics = DiscoverTopicsResponse(5, [TopicInfo("t", True, 8)], False)
    assert topics.encode_payload() == bytes.fromhex("05000000 01000000 00 0174 01 0800")
    assert DiscoverTopologyRequest(6).encode() == bytes.fromhex("0c 05000000 06000000 00")
    standalone = DiscoverTopologyResponse(6)
    assert standalone.encode() == bytes.fromhex("0c 06000000 06000000 ffff")
    assert DiscoverTopologyResponse.decode(bytes.fromhex("06000000 ffff")).standalone
    cluster = DiscoverTopologyResponse.decode(bytes.fromhex("06000000 0100 abcd"))
    assert cluster.cluster == bytes.fromhex("0100 abcd") and not cluster.standalone
    with pytest.raises(ProtocolError):
        DiscoverTopologyResponse.decode(bytes.fromhex("06000000 ffff 00"))


def test_dispatch() -> None:
    for bad in (0x00, 0x04, 0x09, 0x0D, 0xFF):
        with pytest.raises(ProtocolError):
            decode_request(bad, b"")
    with pytest.raises(ProtocolError):
        decode_response(0x05, b"\x00" * 8)
    with pytest.raises(ProtocolError):
        response_request_id(0x02, b"\x00" * 7)
    with pytest.raises(ProtocolError):
        response_request_id(0x04, b"\x00" * 8)
    assert response_request_id(0x03, b"") is None
    assert response_request_id(0x0A, StatusResponse(77).encode_payload()) == 77
    with pytest.raises(ProtocolError):
        Ping.decode(b"\x00")
    assert error_name(MsgId.PRODUCE, 0xFF) == "UNKNOWN_TOPIC"
    assert error_name(MsgId.CONSUME, 1) == "BOUNDARY_CHECK"
    assert error_name(MsgId.RELOAD_CONF, 7) == "error 0x07"


def test_only_safe_codes_are_named() -> None:
    assert {int(f) for f in ConsumeFlag} == {0, 1, 0xFB, 0xFC, 0xFD, 0xFE, 0xFF}
    assert {int(e) for e in ProduceError} == {0, 1, 2, 3, 4, 10, 0xFC, 0xFD, 0xFE, 0xFF}
    assert {int(e) for e in CreateTopicError} == {0, 1, 2, 4, 5, 10, 11}
    assert PRODUCE_TOPIC_ERRORS == {0xFE, 0xFF}


# ---------------------------------------------------------------- strategies

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
names = st.text(max_size=12).filter(lambda s: len(s.encode()) <= 255)
blobs = st.binary(max_size=40)


def short_lists(elem, max_size: int = 3):
    return st.lists(elem, max_size=max_size)


def produce_requests(cls):
    first = u64 if cls is ProduceWithSeqnumRequest else st.none()
    partition = st.builds(ProducePartition, u16, blobs, first)
    topic = st.builds(ProduceTopic, names, short_lists(partition))
    return st.builds(cls, u32, short_lists(topic), names, u8, u32, u16)


@st.composite
def produce_responses(draw: st.DrawFn) -> tuple[ProduceResponse, list[int]]:
    counts = draw(short_lists(st.integers(0, 4)))
    topics = []
    for n in counts:
        if n and draw(st.booleans()):
            topics.append(
                ProduceTopicResult([], draw(st.sampled_from(sorted(PRODUCE_TOPIC_ERRORS))))
            )
            continue
        results = []
        for _ in range(n):
            code = draw(st.sampled_from(sorted(PRODUCE_PARTITION_ERRORS)))
            leader = draw(st.tuples(u32, u16)) if code == ProduceError.OTHER_LEADER else None
            results.append(ProducePartitionResult(code, leader))
        topics.append(ProduceTopicResult(results))
    return ProduceResponse(draw(u32), topics), counts


@st.composite
def consume_requests(draw: st.DrawFn) -> ConsumeRequest:
    version = draw(u16)
    op_flags = draw(u8) if version >= 3 else 0
    partition = st.builds(ConsumePartition, u16, u64, u32)
    topics = draw(short_lists(st.builds(ConsumeTopic, names, short_lists(partition))))
    return ConsumeRequest(draw(u32), topics, draw(names), draw(u64), draw(u32), version, op_flags)


@st.composite
def consume_partition_results(draw: st.DrawFn) -> ConsumePartitionResult:
    pid = draw(st.integers(0, 0xFFFE))
    flags = draw(st.sampled_from(sorted(ConsumeFlag)))
    if flags in (0xFB, 0xFD, 0xFF):
        return ConsumePartitionResult(pid, flags)
    if flags == 0xFC:
        return ConsumePartitionResult(pid, flags, leader=draw(st.tuples(u32, u16)))
    base = None if flags == 0xFE else draw(u64)
    first_avail = draw(u64) if flags == 1 else None
    return ConsumePartitionResult(pid, flags, base, draw(u64), draw(blobs), first_avail)


@st.composite
def consume_topic_results(draw: st.DrawFn) -> ConsumeTopicResult:
    if draw(st.booleans()):
        return ConsumeTopicResult(draw(names), [], True, draw(u8))
    return ConsumeTopicResult(draw(names), draw(short_lists(consume_partition_results())))


topology = st.none() | st.binary(min_size=2, max_size=20).filter(lambda b: b[:2] != b"\xff\xff")

REQUESTS = [
    produce_requests(ProduceRequest),
    produce_requests(ProduceWithSeqnumRequest),
    consume_requests(),
    st.builds(Ping),
    st.builds(DiscoverPartitionsRequest, u32, names, short_lists(u16, 6)),
    st.builds(CreateTopicRequest, u32, names, u16, st.text(max_size=60)),
    st.builds(ReloadConfRequest, u32, names, u16),
    st.builds(StatusRequest, u32),
    st.builds(DiscoverTopicsRequest, u32, u8),
    st.builds(DiscoverTopologyRequest, u32, u8),
]
RESPONSES = [
    st.builds(ConsumeResponse, u32, short_lists(consume_topic_results())),
    st.builds(Ping),
    st.builds(
        DiscoverPartitionsResponse, u32, names, short_lists(st.builds(PartitionBounds, u64, u64))
    ),
    st.builds(CreateTopicResponse, u32, names, st.sampled_from(sorted(CreateTopicError))),
    st.builds(ReloadConfResponse, u32, names, u16, u8),
    st.builds(StatusResponse, u32, u8, st.booleans(), u32, u32, u32, u32, u32, u32),
    st.builds(
        DiscoverTopicsResponse,
        u32,
        short_lists(st.builds(TopicInfo, names, st.booleans(), u16)),
        st.booleans(),
    ),
    st.builds(DiscoverTopologyResponse, u32, topology),
]


# ---------------------------------------------------------------- round trips


@given(st.one_of(REQUESTS))
def test_request_roundtrip(req) -> None:
    frame = req.encode()
    msg_id, payload = frame_of(frame)
    assert msg_id == req.MSG_ID
    assert payload == req.encode_payload()
    decoded = decode_request(msg_id, payload)
    assert type(decoded) is type(req)
    assert decoded == req
    assert decoded.encode() == frame


@given(st.one_of(RESPONSES))
def test_response_roundtrip(resp) -> None:
    frame = resp.encode()
    msg_id, payload = frame_of(frame)
    decoded = decode_response(msg_id, payload)
    assert type(decoded) is type(resp)
    assert decoded == resp
    assert decoded.encode() == frame
    if not isinstance(resp, Ping):
        assert response_request_id(msg_id, payload) == resp.req_id


@given(produce_responses())
def test_produce_response_roundtrip(case) -> None:
    resp, counts = case
    payload = resp.encode_payload()
    assert ProduceResponse.decode(payload, counts) == resp
    assert response_request_id(MsgId.PRODUCE, payload) == resp.req_id


# ---------------------------------------------------------------- garbage in


@given(st.sampled_from(sorted(set(range(16)))), st.binary(max_size=80))
def test_random_bytes_requests(msg_id: int, payload: bytes) -> None:
    try:
        decode_request(msg_id, payload)
    except ProtocolError:
        pass


@given(st.sampled_from(sorted(RESPONSE_TYPES)), st.binary(max_size=80), short_lists(u8, 4))
def test_random_bytes_responses(msg_id: int, payload: bytes, counts: list[int]) -> None:
    try:
        if msg_id == MsgId.PRODUCE:
            ProduceResponse.decode(payload, counts)
        else:
            decode_response(msg_id, payload)
    except ProtocolError:
        pass
    try:
        response_request_id(msg_id, payload)
    except ProtocolError:
        pass


@given(st.one_of(REQUESTS + RESPONSES), st.data())
def test_mutated_messages(msg, data: st.DataObject) -> None:
    payload = bytearray(msg.encode_payload())
    if payload:
        for _ in range(data.draw(st.integers(1, 3))):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(u8)
    cut = data.draw(st.integers(0, len(payload)))
    for blob in (bytes(payload), bytes(payload[:cut]), bytes(payload) + b"\x00"):
        try:
            decode_request(msg.MSG_ID, blob)
        except ProtocolError:
            pass
        try:
            if msg.MSG_ID == MsgId.PRODUCE:
                ProduceResponse.decode(blob, [1, 2])
            else:
                decode_response(msg.MSG_ID, blob)
        except ProtocolError:
            pass


def test_consume_response_garbage_examples() -> None:
    # hdr_len beyond the payload, and undefined flags right after a partition id
    for payload in (
        b"\xff\xff\xff\xff",
        struct.pack("<I", 7) + b"\x01\x00\x00\x00\x01\x01a",
        struct.pack("<I", 11) + b"\x01\x00\x00\x00\x01\x01a\x01\x00\x00\x07",
    ):
        with pytest.raises(ProtocolError):
            ConsumeResponse.decode(payload)
    assert encode_frame(2, b"")[0] == 2


# ---------------------------------------------------------------- request decoder fuzzing (issue 21)

_VALID_REQUESTS = [
    ProduceRequest(1, [ProduceTopic("t", [ProducePartition(0, encode_bundle([(None, 5, b"k", b"v")]))])]).encode(),
    ConsumeRequest(2, [ConsumeTopic("t", [ConsumePartition(0, 1, 100), ConsumePartition(1, 0, 9)])], "c", 10, 1).encode(),
    DiscoverPartitionsRequest(3, "t", [0, 1]).encode(),
    CreateTopicRequest(4, "t", 3, "a=b").encode(),
    StatusRequest(5).encode(),
    Ping().encode(),
]


def _only_protocol_errors(msg_id: int, payload: bytes) -> None:
    try:
        decode_request(msg_id, payload)
    except ProtocolError:
        pass  # the gateway closes that connection


@given(st.integers(0, 255), st.binary(max_size=300))
def test_any_bytes_decode_or_raise_protocol_error(msg_id: int, payload: bytes) -> None:
    _only_protocol_errors(msg_id, payload)


@given(st.sampled_from(_VALID_REQUESTS), st.data())
def test_mutated_requests_decode_or_raise_protocol_error(frame: bytes, data: st.DataObject) -> None:
    payload = bytearray(frame[5:])
    for _ in range(data.draw(st.integers(1, 4))):
        if not payload:
            break
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, payload[i] ^ 0x55]))
    cut = data.draw(st.integers(0, len(payload)))
    _only_protocol_errors(frame[0], bytes(payload[:cut]))
    _only_protocol_errors(frame[0], bytes(payload))


@pytest.mark.parametrize("FB", FRAME_BUFFERS)
@given(st.integers(0, 255), st.integers(0, 0xFFFFFFFF))
def test_a_huge_length_allocates_nothing_before_its_data(FB: type[PyFrameBuffer], msg_id: int, length: int) -> None:
    fb = FB(max_frame_size=64 << 20)
    header = struct.pack("<BI", msg_id, length)
    fb.feed(header)
    if length > 64 << 20:
        with pytest.raises(ProtocolError):
            fb.pending_length()  # refused at the header
        return
    assert fb.pending_length() == (length if length else 0) and fb.buffered == 5
    assert fb.next_frame() == ((msg_id, b"") if length == 0 else None)
    assert len(fb._buf) <= 5  # nothing reserved for the announced payload


def test_counts_in_a_request_are_bounded_by_its_bytes() -> None:
    # A u8 count of 255 topics needs 255 names: a short payload is refused, not looped on.
    with pytest.raises(ProtocolError):
        decode_request(MsgId.CONSUME, struct.pack("<HI", 2, 1) + b"\0" + struct.pack("<QI", 0, 0) + b"\xff")
    # More partition ids than a DiscoverPartitions answer can count (u16).
    with pytest.raises(ProtocolError, match="65535"):
        decode_request(MsgId.DISCOVER_PARTITIONS, struct.pack("<I", 1) + b"\x01t" + b"\0\0" * 65_536)


def _produce_outcome(decode: Any, payload: bytes | memoryview) -> object:
    """What a produce decoder gives: the request's fields (bundles as bytes), or the error's text."""
    try:
        r = decode(payload)
    except ProtocolError as exc:
        return str(exc)
    return (r.version, r.req_id, r.client_id, r.acks, r.ack_timeout,
            [(t.name, [(p.partition, bytes(p.bundle), p.first_seq) for p in t.partitions]) for t in r.topics])


def _produce_requests_of_any_bundle_length(cls: type[ProduceRequest]) -> st.SearchStrategy[ProduceRequest]:
    first = u64 if cls is ProduceWithSeqnumRequest else st.none()
    bundles = st.binary(max_size=300)  # lengths of one varint byte and of two
    partition = st.builds(ProducePartition, u16, bundles, first)
    return st.builds(cls, u32, short_lists(st.builds(ProduceTopic, names, short_lists(partition))), names, u8, u32, u16)


@given(st.one_of(_produce_requests_of_any_bundle_length(ProduceRequest),
                 _produce_requests_of_any_bundle_length(ProduceWithSeqnumRequest)), st.data())
def test_a_produce_decodes_plainly_as_the_checked_reader_does(req: ProduceRequest, data: st.DataObject) -> None:
    # The gateway decodes produces by plain unpacking first (ProduceRequest._decode_plain), the
    # checked reader only where that fails: the same request, or the same error, either way:
    # well formed, cut anywhere, bytes changed (long varints among them), bytes added.
    cls = type(req)
    payload = bytearray(req.encode()[5:])
    assert cls._decode_plain(bytes(payload)) == req  # a well-formed one never needs the reader
    for _ in range(data.draw(st.integers(0, 3))):
        if payload:
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] = data.draw(st.sampled_from([0, 1, 0x7F, 0x80, 0x81, 0xFF, payload[i] ^ 0x55]))
    payload = payload[: data.draw(st.integers(0, len(payload)))] + data.draw(st.binary(max_size=3))
    for given_as in (bytes(payload), memoryview(payload)):
        assert _produce_outcome(cls.decode, given_as) == _produce_outcome(cls._decode_checked, given_as)
