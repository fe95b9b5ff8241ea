"""Which version of each API a Kafka client asks for when offered more than the gateway serves.

    python -m tests.kafka.version_probe CLIENT KEYS      e.g.  ck 0,1,3,8,9

CLIENT: ``ck`` (confluent-kafka: idempotent produce, consume in a group, commit), ``ckadmin``
(its AdminClient, one call per key), ``cktxn`` (a transaction with send_offsets), ``kp``
(kafka-python), ``aio`` (aiokafka).  For each key, a gateway in this process advertises
version 99 of that API only (the others as served) and records the highest version the
client sent; a version the gateway does not serve closes the connection, so the client's
work stops there (its request was recorded).  Prints ``CLIENT KEY served MAX asks V``.
Used for the table of docs/tutorials/kafka.md; not part of the suite.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from dafka.config import NodeConfig, TowerAddress
from dafka.kafka import codec, serving
from dafka.kafka import gateway as gateway_module
from dafka.kafka.gateway import KafkaGateway

_seen: dict[int, int] = {}
_probed: list[int] = [-1]
_decode = gateway_module.decode_request
_api_keys = codec.api_keys


def _spy(frame: bytes) -> Any:
    header, _pos = codec.parse_header(frame)
    _seen[header.api_key] = max(_seen.get(header.api_key, -1), header.version)
    return _decode(frame)


def _offered() -> list[Any]:
    out = _api_keys()
    for k in out:
        if k.api_key == _probed[0]:
            k.max_version = 99
    return out


def _ck(bs: str, key: int) -> None:
    from confluent_kafka import Consumer, Producer

    p = Producer({"bootstrap.servers": bs, "enable.idempotence": True, "message.timeout.ms": 8000})
    p.produce("pt", b"x")
    p.flush(8)
    c = Consumer({"bootstrap.servers": bs, "group.id": "g", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe(["pt"])
    end = time.monotonic() + 8
    while time.monotonic() < end:
        m = c.poll(0.2)
        if m is not None and not m.error():
            c.commit(m, asynchronous=False)
            break
    c.close()


def _ck_txn(bs: str, key: int) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition

    p = Producer({"bootstrap.servers": bs, "transactional.id": "t"})
    p.init_transactions(8)
    p.begin_transaction()
    p.produce("pt", b"x")
    c = Consumer({"bootstrap.servers": bs, "group.id": "g2"})
    p.send_offsets_to_transaction([TopicPartition("pt", 0, 1)], c.consumer_group_metadata(), 8)
    p.commit_transaction(8)


def _ck_admin(bs: str, key: int) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewPartitions,
        NewTopic,
        OffsetSpec,
    )

    a = AdminClient({"bootstrap.servers": bs})
    topic = ConfigResource("topic", "pt")
    calls: dict[int, Callable[[], Any]] = {
        2: lambda: a.list_offsets({TopicPartition("pt", 0): OffsetSpec.latest()}),
        15: lambda: a.describe_consumer_groups(["g"]),
        16: lambda: a.list_consumer_groups(),
        19: lambda: a.create_topics([NewTopic("nt", 1, 1)]),
        20: lambda: a.delete_topics(["pt"]),
        21: lambda: a.delete_records([TopicPartition("pt", 0, 0)]),
        32: lambda: a.describe_configs([topic]),
        33: lambda: a.alter_configs([ConfigResource("topic", "pt", set_config={"retention.ms": "1000"})]),
        37: lambda: a.create_partitions([NewPartitions("pt", 2)]),
        42: lambda: a.delete_consumer_groups(["g"]),
        44: lambda: a.incremental_alter_configs([ConfigResource("topic", "pt", incremental_configs=[
            ConfigEntry("retention.ms", "1000", incremental_operation=AlterConfigOpType.SET)])]),
        60: lambda: a.describe_cluster(),
    }
    if key not in calls:
        return
    got = calls[key]()
    for f in (got.values() if isinstance(got, dict) else [got]):
        try:
            f.result(6)
        except Exception:  # noqa: BLE001 - the request was recorded; its answer does not matter
            pass


def _kp(bs: str, key: int) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    p = KafkaProducer(bootstrap_servers=bs, acks="all", enable_idempotence=True, max_block_ms=8000,
                      request_timeout_ms=5000)
    p.send("pt", b"x").get(8)
    p.close(1)
    c = KafkaConsumer("pt", bootstrap_servers=bs, group_id="g", auto_offset_reset="earliest",
                      enable_auto_commit=False, consumer_timeout_ms=8000)
    for _m in c:
        c.commit()
        break
    c.close()


def _aio(bs: str, key: int) -> None:
    import aiokafka

    async def go() -> None:
        p = aiokafka.AIOKafkaProducer(bootstrap_servers=bs, enable_idempotence=True, request_timeout_ms=5000)
        await p.start()
        await p.send_and_wait("pt", b"x")
        await p.stop()
        c = aiokafka.AIOKafkaConsumer("pt", bootstrap_servers=bs, group_id="g", auto_offset_reset="earliest",
                                      enable_auto_commit=False)
        await c.start()
        try:
            await asyncio.wait_for(c.getone(), 8)
            await c.commit()
        finally:
            await c.stop()

    asyncio.run(go())


CLIENTS: dict[str, Callable[[str, int], None]] = {"ck": _ck, "ckadmin": _ck_admin, "cktxn": _ck_txn, "kp": _kp,
                                                   "aio": _aio}


def probe(client: str, key: int) -> int | None:
    _seen.clear()
    _probed[0] = key
    cfg = NodeConfig(towers=(TowerAddress("127.0.0.1", 1, 2),), bind="127.0.0.1")
    gw = KafkaGateway(tempfile.mkdtemp() + "/gw", cfg, listen=("127.0.0.1", 0), kafka_listen=("127.0.0.1", 0))
    try:
        gw.create_topic("pt", 1)
        work = threading.Thread(target=CLIENTS[client], args=(f"127.0.0.1:{gw.kafka_port}", key), daemon=True)
        work.start()
        work.join(15)  # a client stuck on a closed connection is left behind (a daemon thread)
    finally:
        gw.close()
    return _seen.get(key)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.CRITICAL)
    gateway_module.decode_request = _spy  # type: ignore[assignment]
    serving.api_keys = _offered  # type: ignore[assignment]
    client, keys = argv[0], [int(k) for k in argv[1].split(",")]
    for key in keys:
        print(client, key, "served", codec.API[key].max_version, "asks", probe(client, key), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
