"""A blocking Tank client over one TCP connection.

The client waits for the broker's greeting Ping before it is usable, sends
requests with increasing ids and matches responses by id: a response for
another id that arrives first (a parked long-poll answered late, a request
sent with :meth:`TankClient.send`) is kept until asked for.  Pings from the
broker are ignored.  A client is not thread-safe: use one per thread.

Errors: :class:`TankError` (the broker answered with an error code, carried
in ``.code``), :class:`UnknownTopicError`, :class:`TankConnectionError`
(connect failed, connection lost) and :class:`TankTimeoutError`.  Malformed
bytes from the broker raise ProtocolError and close the connection when the
framing itself is broken.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dafka.errors import DafkaError, ProtocolError
from dafka.tank.bundle import Record, encode_bundle
from dafka.tank.codec import FrameBuffer
from dafka.tank.messages import (
    SEQ_FIRST_AVAILABLE,
    SEQ_TAIL,
    ConsumeFlag,
    ConsumePartition,
    ConsumeRequest,
    ConsumeResponse,
    ConsumeTopic,
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
    ProduceRequest,
    ProduceResponse,
    ProduceTopic,
    ProduceWithSeqnumRequest,
    ReloadConfRequest,
    ReloadConfResponse,
    Request,
    Response,
    StatusRequest,
    StatusResponse,
    TopicInfo,
    decode_response,
    error_name,
    response_msg_id,
    response_request_id,
)

__all__ = [
    "DEFAULT_FETCH_SIZE",
    "ConsumeResult",
    "MessageLike",
    "TankClient",
    "TankConnectionError",
    "TankError",
    "TankTimeoutError",
    "UnknownTopicError",
    "to_records",
]

log = logging.getLogger(__name__)

DEFAULT_FETCH_SIZE = 1024 * 1024
_RECV_SIZE = 256 * 1024

#: A value, or ``(key, value)``, or ``(key, value, timestamp_ms)``;
#: str is UTF-8 encoded and a None timestamp means "now".
MessageLike = bytes | str | tuple[Any, ...]


class TankError(DafkaError):
    """The broker reported an error; ``code`` is the byte it sent (None if none)."""

    def __init__(
        self,
        message: str,
        code: int | None = None,
        topic: str | None = None,
        partition: int | None = None,
        leader: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.topic = topic
        self.partition = partition
        #: ``(addr, port)`` of the partition's leader for OTHER_LEADER.
        self.leader = leader


class UnknownTopicError(TankError):
    """The broker does not know the topic."""


class TankConnectionError(TankError, ConnectionError):
    """Could not connect, or the connection broke."""


class TankTimeoutError(TankError, TimeoutError):
    """No greeting or no response before the deadline."""


@dataclass(slots=True)
class ConsumeResult:
    """One partition's consume answer.

    ``messages`` are ``(seq, ts_ms, key, value)`` with absolute seqs, none
    below the requested seq.  ``next_seq`` is where to continue.  A boundary
    check (requested seq outside the partition's range) sets
    ``boundary_check`` and ``first_avail`` and returns no messages.
    ``drained`` means the broker sent an empty chunk.  ``partial_size`` is
    set when the chunk ended in a cut bundle of that size: fetch at least that
    much to get past it.
    """

    topic: str
    partition: int
    messages: list[Record]
    next_seq: int
    hwm: int | None
    first_avail: int | None = None
    boundary_check: bool = False
    drained: bool = False
    partial_size: int | None = None
    flags: int = ConsumeFlag.OK


def to_records(messages: Iterable[MessageLike], now_ms: int | None = None) -> list[Record]:
    """Normalise produce input to ``(None, ts_ms, key, value)`` bundle records."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    out: list[Record] = []
    app = out.append
    for m in messages:
        if isinstance(m, bytes):
            app((None, now, None, m))
        elif isinstance(m, str):
            app((None, now, None, m.encode()))
        elif isinstance(m, bytearray | memoryview):
            app((None, now, None, bytes(m)))
        else:
            if len(m) == 3:
                key, value, ts = m
            elif len(m) == 2:
                key, value = m
                ts = None
            else:
                raise ValueError(f"a message is a value, (key, value) or (key, value, ts): {m!r}")
            if isinstance(key, str):
                key = key.encode()
            if isinstance(value, str):
                value = value.encode()
            app((None, now if ts is None else ts, key, value))
    return out


@dataclass(slots=True)
class _Batch:
    topic: str
    partition: int
    messages: Iterable[MessageLike]
    first_seq: int | None = None


class TankClient:
    """Blocking client: ``with TankClient("127.0.0.1", 11011) as c: c.produce(...)``.

    ``timeout`` bounds connecting, the greeting and every request (a consume
    additionally gets its ``max_wait_ms``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = 10.0,
        *,
        client_id: str = "",
        acks: int = 0,
        ack_timeout: int = 0,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.client_id = client_id
        self.acks = acks
        self.ack_timeout = ack_timeout
        self._frames = FrameBuffer()
        self._next_id = 1
        self._inflight: dict[int, Request] = {}
        self._arrived: dict[int, tuple[int, bytes]] = {}
        self._abandoned: set[int] = set()
        self._greeted = False
        self._sock: socket.socket | None = None
        deadline = time.monotonic() + timeout
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TankConnectionError(f"cannot connect to Tank at {host}:{port}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._greeted:
                self._pump(deadline)
        except TankTimeoutError:
            self.close()
            raise TankTimeoutError(
                f"no greeting Ping from {host}:{port} within {timeout}s"
            ) from None
        except BaseException:
            self.close()
            raise
        log.debug("connected to Tank at %s:%d", host, port)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> TankClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether the connection is closed."""
        return self._sock is None

    def close(self) -> None:
        """Close the connection (idempotent)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:  # closing is best effort
                pass

    # ------------------------------------------------------------ transport

    def _live(self) -> socket.socket:
        if self._sock is None:
            raise TankConnectionError(f"connection to {self.host}:{self.port} is closed")
        return self._sock

    def _lost(self, why: str) -> TankConnectionError:
        self.close()
        log.warning("Tank connection to %s:%d lost: %s", self.host, self.port, why)
        return TankConnectionError(f"Tank connection to {self.host}:{self.port} lost: {why}")

    def _pump(self, deadline: float) -> None:
        """Read once (until ``deadline``) and file every complete frame."""
        sock = self._live()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TankTimeoutError("timed out waiting for the broker")
        sock.settimeout(remaining)
        try:
            data = sock.recv(_RECV_SIZE)
        except TimeoutError:
            raise TankTimeoutError("timed out waiting for the broker") from None
        except OSError as exc:
            raise self._lost(str(exc)) from exc
        if not data:
            raise self._lost("closed by the broker")
        self._frames.feed(data)
        try:
            for msg_id, payload in self._frames:
                self._file(msg_id, payload)
        except ProtocolError:
            # The byte stream can no longer be trusted.
            self.close()
            raise

    def _file(self, msg_id: int, payload: bytes) -> None:
        if msg_id == MsgId.PING:
            Ping.decode(payload)
            self._greeted = True
            return
        req_id = response_request_id(msg_id, payload)
        if req_id in self._abandoned:
            self._abandoned.discard(req_id)
            log.debug("dropping late response to abandoned request %d", req_id)
        elif req_id in self._inflight:
            self._arrived[req_id] = (msg_id, payload)
        else:
            log.warning("dropping response 0x%02x for unknown request id %s", msg_id, req_id)

    def next_request_id(self) -> int:
        """Reserve the next request id (u32, wrapping, never 0)."""
        rid = self._next_id
        self._next_id = rid % 0xFFFFFFFF + 1
        return rid

    def send(self, request: Request) -> int:
        """Send ``request`` without waiting; return its id for :meth:`wait`."""
        sock = self._live()
        frame = request.encode()
        req_id = getattr(request, "req_id", None)
        if response_msg_id(request) is not None:
            if req_id in self._inflight:
                raise ValueError(f"request id {req_id} is already in flight")
            self._inflight[req_id] = request  # type: ignore[index]
        sock.settimeout(self.timeout)
        try:
            sock.sendall(frame)
        except TimeoutError:
            self._inflight.pop(req_id, None)  # type: ignore[arg-type]
            raise self._lost("timed out sending") from None
        except OSError as exc:
            self._inflight.pop(req_id, None)  # type: ignore[arg-type]
            raise self._lost(str(exc)) from exc
        return req_id  # type: ignore[return-value]

    def wait(self, req_id: int, timeout: float | None = None) -> Response:
        """Wait for and decode the response to request ``req_id``.

        Responses to other requests that arrive meanwhile are kept.  On
        timeout the request is abandoned: its late response is dropped.
        """
        request = self._inflight.get(req_id)
        if request is None:
            raise ValueError(f"request id {req_id} is not in flight")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while req_id not in self._arrived:
            try:
                self._pump(deadline)
            except TankTimeoutError:
                self._inflight.pop(req_id, None)
                if self._sock is not None:
                    self._abandoned.add(req_id)
                raise TankTimeoutError(
                    f"no response to request {req_id} ({type(request).__name__})"
                ) from None
            except BaseException:
                self._inflight.pop(req_id, None)
                raise
        msg_id, payload = self._arrived.pop(req_id)
        del self._inflight[req_id]
        expected = response_msg_id(request)
        if msg_id != expected:
            raise ProtocolError(f"request {req_id} answered with msgId 0x{msg_id:02x}")
        return decode_response(msg_id, payload, request)

    def request(self, request: Request, timeout: float | None = None) -> Response:
        """Send ``request`` and wait for its response."""
        return self.wait(self.send(request), timeout)

    # ------------------------------------------------------------ produce

    def produce(
        self,
        topic: str,
        partition: int,
        messages: Iterable[MessageLike],
        *,
        codec: int | None = None,
    ) -> int:
        """Produce ``messages`` to one partition; return 0 or raise TankError."""
        return self._produce([_Batch(topic, partition, messages)], codec, True, False)[
            (topic, partition)
        ]

    def produce_with_seqnum(
        self,
        topic: str,
        partition: int,
        first_seq: int,
        messages: Iterable[MessageLike],
        *,
        codec: int | None = None,
    ) -> int:
        """ProduceWithSeqnum (0x5): the messages get seqs ``first_seq, first_seq + 1, ...``."""
        return self._produce([_Batch(topic, partition, messages, first_seq)], codec, True, True)[
            (topic, partition)
        ]

    def produce_many(
        self,
        batches: Mapping[tuple[str, int], Iterable[MessageLike]]
        | Iterable[tuple[str, int, Iterable[MessageLike]]],
        *,
        codec: int | None = None,
        check: bool = True,
    ) -> dict[tuple[str, int], int]:
        """Produce to several (topic, partition)s in one request.

        Returns ``{(topic, partition): error code}``.  With ``check`` (the
        default) the first non-zero code raises TankError instead.
        """
        items = batches.items() if isinstance(batches, Mapping) else batches
        plan = []
        for item in items:
            if isinstance(batches, Mapping):
                (topic, partition), messages = item  # type: ignore[misc]
            else:
                topic, partition, messages = item  # type: ignore[misc]
            plan.append(_Batch(topic, partition, messages))
        return self._produce(plan, codec, check, False)

    def _produce(
        self, batches: list[_Batch], codec: int | None, check: bool, with_seq: bool
    ) -> dict[tuple[str, int], int]:
        if not batches:
            raise ValueError("nothing to produce")
        topics: dict[str, ProduceTopic] = {}
        seen: set[tuple[str, int]] = set()
        now = int(time.time() * 1000)
        for b in batches:
            if (b.topic, b.partition) in seen:
                # The broker cannot take one partition twice in a request.
                raise ValueError(f"partition {b.topic}/{b.partition} appears twice")
            seen.add((b.topic, b.partition))
            records = to_records(b.messages, now)
            part = ProducePartition(b.partition, encode_bundle(records, codec=codec), b.first_seq)
            topics.setdefault(b.topic, ProduceTopic(b.topic)).partitions.append(part)
        cls = ProduceWithSeqnumRequest if with_seq else ProduceRequest
        req = cls(
            self.next_request_id(),
            list(topics.values()),
            self.client_id,
            self.acks,
            self.ack_timeout,
        )
        resp = self.request(req)
        assert isinstance(resp, ProduceResponse)
        results: dict[tuple[str, int], int] = {}
        for topic, partition, code, leader in resp.per_partition(req):
            results[(topic, partition)] = code
            if check and code != ProduceError.OK:
                what = error_name(MsgId.PRODUCE, code)
                cls_err = UnknownTopicError if code == ProduceError.UNKNOWN_TOPIC else TankError
                raise cls_err(
                    f"produce to {topic}/{partition} failed: {what}", code, topic, partition, leader
                )
        return results

    # ------------------------------------------------------------ consume

    def consume(
        self,
        topic: str,
        partition: int,
        seq: int,
        fetch_size: int = DEFAULT_FETCH_SIZE,
        max_wait_ms: int = 0,
        min_bytes: int = 0,
        *,
        timeout: float | None = None,
    ) -> ConsumeResult:
        """Fetch from ``seq`` (0: first available, SEQ_TAIL: wait for new data).

        Raises UnknownTopicError, or TankError for unknown partition, no
        leader, other leader (``.leader``) and system errors.
        """
        req = ConsumeRequest(
            self.next_request_id(),
            [ConsumeTopic(topic, [ConsumePartition(partition, seq, fetch_size)])],
            self.client_id,
            max_wait_ms,
            min_bytes,
        )
        wait = (self.timeout if timeout is None else timeout) + max_wait_ms / 1000.0
        resp = self.request(req, wait)
        assert isinstance(resp, ConsumeResponse)
        if len(resp.topics) != 1 or resp.topics[0].name != topic:
            raise ProtocolError("consume response does not match the request's topic")
        t = resp.topics[0]
        if t.unknown:
            raise UnknownTopicError(f"unknown topic {topic!r}", None, topic, partition)
        if len(t.partitions) != 1 or t.partitions[0].partition != partition:
            raise ProtocolError("consume response does not match the request's partition")
        p = t.partitions[0]
        flags = p.flags
        if flags in (ConsumeFlag.OK, ConsumeFlag.SPARSE_FIRST_BUNDLE):
            # 0 and UINT64_MAX are positions, not seqs: nothing to drop.
            min_seq = 0 if seq in (SEQ_FIRST_AVAILABLE, SEQ_TAIL) else seq
            chunk = p.decode_chunk(min_seq)
            if chunk.bundles and chunk.next_seq is not None:
                next_seq = max(chunk.next_seq, min_seq)
            else:
                next_seq = seq
            return ConsumeResult(
                topic,
                partition,
                chunk.records,
                next_seq,
                p.hwm,
                drained=not p.chunk,
                partial_size=chunk.partial_size,
                flags=flags,
            )
        if flags == ConsumeFlag.BOUNDARY_CHECK:
            return ConsumeResult(
                topic,
                partition,
                [],
                seq,
                p.hwm,
                first_avail=p.first_avail,
                boundary_check=True,
                drained=True,
                flags=flags,
            )
        raise TankError(
            f"consume from {topic}/{partition} failed: {error_name(MsgId.CONSUME, flags)}",
            flags,
            topic,
            partition,
            p.leader,
        )

    # ------------------------------------------------------------ discovery and admin

    def discover_partitions(
        self, topic: str, partitions: Iterable[int] = ()
    ) -> dict[int, PartitionBounds]:
        """``{partition: (first_avail, hwm)}`` for all (or the given) partitions."""
        pids = list(partitions)
        resp = self.request(DiscoverPartitionsRequest(self.next_request_id(), topic, pids))
        assert isinstance(resp, DiscoverPartitionsResponse)
        if resp.unknown_topic:
            raise UnknownTopicError(f"unknown topic {topic!r}", None, topic)
        if pids and len(pids) != len(resp.partitions):
            raise ProtocolError(f"asked for {len(pids)} partitions, got {len(resp.partitions)}")
        keys = pids or range(len(resp.partitions))
        return dict(zip(keys, resp.partitions, strict=True))

    def discover_topics(self) -> list[TopicInfo]:
        """The topics the server holds, with their partition counts."""
        resp = self.request(DiscoverTopicsRequest(self.next_request_id()))
        assert isinstance(resp, DiscoverTopicsResponse)
        return resp.topics

    def discover_topology(self) -> DiscoverTopologyResponse:
        """The server's cluster topology (one node for a dafka gateway)."""
        resp = self.request(DiscoverTopologyRequest(self.next_request_id()))
        assert isinstance(resp, DiscoverTopologyResponse)
        return resp

    def status(self) -> StatusResponse:
        """The server's status counters."""
        resp = self.request(StatusRequest(self.next_request_id()))
        assert isinstance(resp, StatusResponse)
        return resp

    def create_topic(
        self, topic: str, partitions: int, config: str | Mapping[str, object] = ""
    ) -> None:
        """Create ``topic``; ``config`` is ``k=v`` lines or a mapping.  Raises TankError."""
        if isinstance(config, Mapping):
            config = "".join(f"{k}={v}\n" for k, v in config.items())
        resp = self.request(CreateTopicRequest(self.next_request_id(), topic, partitions, config))
        assert isinstance(resp, CreateTopicResponse)
        if resp.error:
            raise TankError(
                f"create topic {topic!r} failed: {error_name(MsgId.CREATE_TOPIC, resp.error)}",
                resp.error,
                topic,
            )

    def reload_conf(self, topic: str, partition: int) -> None:
        """Ask the broker to reload a partition's configuration.  Raises TankError."""
        resp = self.request(ReloadConfRequest(self.next_request_id(), topic, partition))
        assert isinstance(resp, ReloadConfResponse)
        if resp.error:
            raise TankError(
                f"reload conf of {topic}/{partition} failed: error 0x{resp.error:02x}",
                resp.error,
                topic,
                partition,
            )
