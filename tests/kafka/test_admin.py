"""The Kafka admin API: confluent-kafka's AdminClient and kafka-python's KafkaAdminClient
against a real gateway process (real TCP, real LMDB), and hostile admin requests written
by hand against a gateway in the test's process."""

from __future__ import annotations

import dataclasses
import io
import re
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as CKConsumer
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka import Producer as CKProducer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import TopicPartition as KTopicPartition
from kafka.admin import ConfigResource as KConfigResource
from kafka.admin import ConfigResourceType, KafkaAdminClient
from kafka.admin import NewPartitions as KNewPartitions
from kafka.errors import GroupIdNotFoundError, InvalidPartitionsError, TopicDeletionDisabledError
from kafka.protocol.admin import (
    AlterConfigsRequest,
    CreatePartitionsRequest,
    DeleteGroupsRequest,
    DeleteRecordsRequest,
    DeleteTopicsRequest,
    DescribeConfigsRequest,
    DescribeGroupsRequest,
    IncrementalAlterConfigsRequest,
)
from kafka.protocol.consumer import OffsetDeleteRequest, OffsetFetchRequest
from kafka.protocol.metadata import ApiVersionsRequest, FindCoordinatorRequest

from dafka.config import NodeConfig
from dafka.kafka import admin, serving
from dafka.kafka.codec import API, Err
from dafka.kafka.gateway import CONFIGS_FILE, KafkaGateway
from dafka.kafka.serving import _HANDLERS
from dafka.nodes.consumer import Consumer
from dafka.store.db import RecordDB, Retention
from dafka.tank.client import TankClient
from tests.conftest import dafka_cmd, subprocess_env, wait_until
from tests.kafka.test_gateway import HOST, ck_produce, read_frame

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- a real gateway process


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a `dafka gateway` process with a Kafka listener (no mesh needed)."""
    db = tmp_path_factory.mktemp("admin") / "gw"
    proc = subprocess.Popen(
        dafka_cmd("gateway", "--db", str(db), "--listen", f"{HOST}:0", "--kafka-listen", f"{HOST}:0",
                  "--tower", "127.0.0.1:1:2"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env(),
    )
    try:
        assert proc.stdout is not None
        up = proc.stdout.readline()
        found = re.search(r"Kafka on 127\.0\.0\.1:(\d+)", up)
        assert found, up
        yield f"{HOST}:{found.group(1)}"
    finally:
        proc.kill()
        proc.wait(10)


def ck_admin(bs: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bs})


def kp_admin(bs: str) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=bs, request_timeout_ms=20_000)


def produce(bs: str, topic: str, n: int, partition: int = 0) -> None:
    p = CKProducer({"bootstrap.servers": bs, "linger.ms": 5})
    for i in range(n):
        p.produce(topic, b"v%d" % i, partition=partition)
    assert p.flush(30) == 0


def configs_of(admin_: AdminClient, resource: ConfigResource) -> dict[str, Any]:
    return admin_.describe_configs([resource])[resource].result(20)  # type: ignore[no-any-return]


def test_confluent_describes_and_alters_topic_and_broker_configs(gateway: str) -> None:
    a = ck_admin(gateway)
    a.create_topics([NewTopic("cfg", 2, 1, config={"retention.ms": "3600000"})])["cfg"].result(20)
    topic = ConfigResource("topic", "cfg")
    got = configs_of(a, topic)
    assert got["retention.ms"].value == "3600000"
    assert got["retention.bytes"].value == "-1"
    assert got["cleanup.policy"].value == "delete" and not got["cleanup.policy"].is_read_only
    assert got["max.message.bytes"].value == str(1 << 20)
    assert got["min.insync.replicas"].value == "1"
    broker = configs_of(a, ConfigResource("broker", "0"))
    assert broker["delete.topic.enable"].value == "false"
    assert broker["log.retention.ms"].value == "-1"
    # Incremental: one key changes, the other stays.
    r = ConfigResource("topic", "cfg", incremental_configs=[
        ConfigEntry("retention.bytes", "5000000", incremental_operation=AlterConfigOpType.SET)])
    a.incremental_alter_configs([r])[r].result(20)
    got = configs_of(a, topic)
    assert (got["retention.ms"].value, got["retention.bytes"].value) == ("3600000", "5000000")
    # AlterConfigs replaces the set: retention.bytes, not named, goes back to its default.
    r = ConfigResource("topic", "cfg", set_config={"retention.ms": "7200000"})
    a.alter_configs([r])[r].result(20)
    got = configs_of(a, topic)
    assert (got["retention.ms"].value, got["retention.bytes"].value) == ("7200000", "-1")
    # What cannot change is refused, with the key named, and nothing changes.
    for bad in (ConfigResource("topic", "cfg", set_config={"segment.ms": "1"}),
                ConfigResource("broker", "0", set_config={"log.retention.ms": "1"})):
        with pytest.raises(KafkaException) as err:
            a.alter_configs([bad])[bad].result(20)
        assert err.value.args[0].code() == KafkaError.INVALID_CONFIG
        assert "read-only" in err.value.args[0].str()
    assert configs_of(a, topic)["retention.ms"].value == "7200000"
    unknown = ConfigResource("topic", "nosuch")
    with pytest.raises(KafkaException):
        configs_of(a, unknown)


def test_confluent_grows_topics_refuses_deletion_and_deletes_records(gateway: str) -> None:
    a = ck_admin(gateway)
    a.create_topics([NewTopic("grow", 1, 1)])["grow"].result(20)
    a.create_partitions([NewPartitions("grow", 3)])["grow"].result(20)
    assert len(a.list_topics("grow", timeout=20).topics["grow"].partitions) == 3
    produce(gateway, "grow", 5, partition=2)  # a new partition takes records
    with pytest.raises(KafkaException) as err:
        a.create_partitions([NewPartitions("grow", 2)])["grow"].result(20)
    assert err.value.args[0].code() == KafkaError.INVALID_PARTITIONS
    with pytest.raises(KafkaException) as err:
        a.delete_topics(["grow"])["grow"].result(20)
    assert err.value.args[0].code() == KafkaError.TOPIC_DELETION_DISABLED
    tp = TopicPartition("grow", 2, 3)
    assert a.delete_records([tp])[tp].result(20).low_watermark == 3
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": "after-delete", "auto.offset.reset": "earliest"})
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition("grow", 2), timeout=20)
        assert (lo, hi) == (3, 5)
        c.assign([TopicPartition("grow", 2)])
        m = wait_until(lambda: c.poll(0.2), 20)
        assert (m.offset(), m.value()) == (3, b"v3")
    finally:
        c.close()
    past = TopicPartition("grow", 2, 99)
    with pytest.raises(KafkaException) as err:
        a.delete_records([past])[past].result(20)
    assert err.value.args[0].code() == KafkaError.OFFSET_OUT_OF_RANGE


def test_confluent_lists_describes_and_deletes_groups_and_describes_the_cluster(gateway: str) -> None:
    a = ck_admin(gateway)
    a.create_topics([NewTopic("grp", 1, 1)])["grp"].result(20)
    produce(gateway, "grp", 3)
    c = CKConsumer({"bootstrap.servers": gateway, "group.id": "watched", "auto.offset.reset": "earliest",
                    "client.id": "watcher"})
    try:
        c.subscribe(["grp"])
        wait_until(lambda: c.poll(0.2) is not None, 30)
        c.commit(asynchronous=False)
        listed = a.list_consumer_groups().result(20)
        assert "watched" in {g.group_id for g in listed.valid}
        desc = a.describe_consumer_groups(["watched"])["watched"].result(20)
        assert str(desc.state).endswith("STABLE")
        assert [m.client_id for m in desc.members] == ["watcher"]
        assert desc.members[0].host == "/127.0.0.1"
        assert [tp.topic for tp in desc.members[0].assignment.topic_partitions] == ["grp"]
        with pytest.raises(KafkaException) as err:
            a.delete_consumer_groups(["watched"])["watched"].result(20)
        assert err.value.args[0].code() == KafkaError.NON_EMPTY_GROUP
    finally:
        c.close()
    # Empty once its member left: deleting it forgets its committed offset.
    def empty() -> bool:
        states = {g.group_id: str(g.state) for g in a.list_consumer_groups().result(20).valid}
        return "watched" not in states or states["watched"].endswith("EMPTY")

    wait_until(empty, 20)
    a.delete_consumer_groups(["watched"])["watched"].result(20)
    with pytest.raises(KafkaException) as err:
        a.delete_consumer_groups(["watched"])["watched"].result(20)
    assert err.value.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND
    cluster = a.describe_cluster().result(20)
    assert cluster.cluster_id == "dafka"
    assert [(n.id, n.port) for n in cluster.nodes] == [(0, int(gateway.rsplit(":", 1)[1]))]


def test_kafka_python_admin_client_does_the_same(gateway: str) -> None:
    k = kp_admin(gateway)
    try:
        k.create_topics([__import__("kafka.admin", fromlist=["NewTopic"]).NewTopic("kp-admin", 1, 1)])
        desc = k.describe_configs([KConfigResource(ConfigResourceType.TOPIC, "kp-admin")], config_filter="all")
        assert desc["topic"]["kp-admin"]["retention.ms"]["value"] == "-1"
        assert desc["topic"]["kp-admin"]["cleanup.policy"]["value"] == "delete"
        broker = k.describe_configs([KConfigResource(ConfigResourceType.BROKER, "0")], config_filter="all")
        assert broker["broker"]["0"]["delete.topic.enable"]["value"] == "false"
        k.alter_configs([KConfigResource(ConfigResourceType.TOPIC, "kp-admin", configs={"retention.ms": "60000"})])
        desc = k.describe_configs([KConfigResource(ConfigResourceType.TOPIC, "kp-admin")])
        assert desc["topic"]["kp-admin"]["retention.ms"]["value"] == "60000"
        k.create_partitions({"kp-admin": KNewPartitions(2)})
        (topic,) = k.describe_topics(["kp-admin"])
        assert sorted(p["partition_index"] for p in topic["partitions"]) == [0, 1]
        with pytest.raises(InvalidPartitionsError):  # fewer than it has
            k.create_partitions({"kp-admin": KNewPartitions(1)})
        with pytest.raises(TopicDeletionDisabledError):
            k.delete_topics(["kp-admin"])
        produce(gateway, "kp-admin", 4)
        deleted = k.delete_records({KTopicPartition("kp-admin", 0): 2})
        assert deleted[KTopicPartition("kp-admin", 0)]["low_watermark"] == 2
        # A group known by its committed offsets only: its offsets go.
        from kafka import KafkaConsumer

        c = KafkaConsumer(bootstrap_servers=gateway, group_id="kp-group", enable_auto_commit=False)
        c.assign([KTopicPartition("kp-admin", 0)])
        c.commit({KTopicPartition("kp-admin", 0): __import__("kafka").OffsetAndMetadata(3, "", -1)})
        c.close()
        assert k.list_group_offsets("kp-group")["kp-group"][KTopicPartition("kp-admin", 0)].offset == 3
        # Known by its offsets alone: listed and described as Empty, as Kafka does (lag monitors).
        assert ("kp-group", "Empty") in [(g["group_id"], g["group_state"]) for g in k.list_groups()]
        assert k.describe_groups(["kp-group"])["kp-group"]["group_state"] == "Empty"
        out = k.delete_group_offsets("kp-group", [KTopicPartition("kp-admin", 0)])
        assert all(e.errno == 0 for e in out.values()), out
        assert KTopicPartition("kp-admin", 0) not in k.list_group_offsets("kp-group").get("kp-group", {})
        assert k.describe_groups(["kp-group"])["kp-group"]["group_state"] == "Dead"
        with pytest.raises(GroupIdNotFoundError):
            k.delete_group_offsets("no-such-group", [KTopicPartition("kp-admin", 0)])
        assert k.list_groups() is not None
        assert k.describe_cluster()["cluster_id"] == "dafka"
    finally:
        k.close()


def test_kafka_python_alters_configs_both_ways_and_deletes_groups(gateway: str) -> None:
    """kafka-python's IncrementalAlterConfigs (SET and DELETE), its AlterConfigs (incremental=False),
    ListGroups filtered by state (and confluent-kafka's) and DeleteGroups, each checked by what
    the gateway answers afterwards."""
    from kafka import KafkaConsumer, OffsetAndMetadata
    from kafka.admin import AlterConfigOp
    from kafka.admin import NewTopic as KNewTopic

    k = kp_admin(gateway)
    try:
        k.create_topics([KNewTopic("kp-alter", 1, 1)])
        res = KConfigResource(ConfigResourceType.TOPIC, "kp-alter")

        def current() -> tuple[str, str]:
            got = k.describe_configs([res], config_filter="all")["topic"]["kp-alter"]
            return got["retention.ms"]["value"], got["retention.bytes"]["value"]

        def alter_(configs: dict[str, Any], incremental: bool, check: bool = True) -> Any:
            return k.alter_configs([KConfigResource(ConfigResourceType.TOPIC, "kp-alter", configs=configs)],
                                   incremental=incremental, raise_on_unknown=check)["topic"]["kp-alter"]

        assert alter_({"retention.ms": "60000"}, True) == "OK"
        assert alter_({"retention.bytes": (AlterConfigOp.SET, "9000000")}, True) == "OK"
        assert current() == ("60000", "9000000")  # incremental: the other key stays
        assert alter_({"retention.bytes": (AlterConfigOp.DELETE, None)}, True) == "OK"
        assert current() == ("60000", "-1")  # deleted: back to its default
        assert alter_({"retention.ms": "120000", "retention.bytes": "7000000"}, False) == "OK"
        assert current() == ("120000", "7000000")
        with pytest.raises(ValueError):  # kafka-python's own check: not an alterable key
            alter_({"segment.ms": "1"}, False)
        refused = alter_({"segment.ms": "1"}, False, check=False)  # the gateway's answer
        assert refused != "OK" and "read-only" in refused, refused
        assert current() == ("120000", "7000000")
        assert alter_({"cleanup.policy": "compact"}, True) == "OK"
        got = k.describe_configs([res], config_filter="all")["topic"]["kp-alter"]
        assert got["cleanup.policy"]["value"] == "compact" and got["retention.ms"]["value"] == "120000"
        # DeleteGroups: an empty group (known by its offsets) goes, a live one stays.
        produce(gateway, "kp-alter", 3)
        c = KafkaConsumer(bootstrap_servers=gateway, group_id="kp-gone", enable_auto_commit=False)
        c.assign([KTopicPartition("kp-alter", 0)])
        c.commit({KTopicPartition("kp-alter", 0): OffsetAndMetadata(2, "", -1)})
        c.close()
        live = CKConsumer({"bootstrap.servers": gateway, "group.id": "kp-live", "auto.offset.reset": "earliest"})
        try:
            live.subscribe(["kp-alter"])
            wait_until(lambda: live.poll(0.2) is not None, 30, 0)  # a member with partitions
            # ListGroups filtered by state (KIP-518), as lag monitors ask, from both clients.
            def listed(states: list[str]) -> set[str]:
                return {g["group_id"] for g in k.list_groups(states_filter=states)} & {"kp-gone", "kp-live"}

            assert (listed(["Stable"]), listed(["Empty"]), listed(["Stable", "Empty"])) == (
                {"kp-live"}, {"kp-gone"}, {"kp-gone", "kp-live"})
            from confluent_kafka import ConsumerGroupState

            ck = ck_admin(gateway)  # alive until its answer came
            empty = ck.list_consumer_groups(states={ConsumerGroupState.EMPTY}).result(20)
            assert {g.group_id for g in empty.valid} & {"kp-gone", "kp-live"} == {"kp-gone"}, empty.errors
            out = k.delete_groups(["kp-gone", "kp-live", "kp-never"])
            assert out == {"kp-gone": "OK", "kp-live": "NonEmptyGroupError", "kp-never": "GroupIdNotFoundError"}
            assert k.list_group_offsets("kp-gone").get("kp-gone", {}) == {}
            assert k.describe_groups(["kp-gone"])["kp-gone"]["group_state"] == "Dead"
            assert k.describe_groups(["kp-live"])["kp-live"]["group_state"] == "Stable"
        finally:
            live.close()
    finally:
        k.close()


# ---------------------------------------------------------------- by hand, in process


def test_the_store_lists_groups_deletes_positions_and_the_front(tmp_path: Path) -> None:
    db = RecordDB(tmp_path / "db")
    try:
        names = ["a", "b" * 200, "\u00ff\u00ff", "é", "z"]
        for g in names:
            db.put_positions(g, {("t", "p1"): 1, ("t", "p2"): 2, ("u", "p"): 3})
        assert sorted(db.position_groups(100)) == sorted(names)
        assert len(db.position_groups(2)) == 2
        assert db.delete_positions("a", [("t", "p1"), ("t", "nope")]) == 1
        assert db.positions("a") == {("t", "p2"): 2, ("u", "p"): 3}
        assert db.delete_positions("a") == 2 and db.positions("a") == {}
        assert db.positions("é") == {("t", "p1"): 1, ("t", "p2"): 2, ("u", "p"): 3}  # neighbours untouched
        db.append([("t", "p", i, b"x" * 10, 1) for i in range(10)])
        db.append([("t", "q", i, b"y", 1) for i in range(3)])
        assert db.delete_front("t", "p", 4, max_records=3) == (3, False)
        assert db.delete_front("t", "p", 4) == (4, True)
        info = db.info("t", "p")
        assert (info.first, info.last, info.count) == (4, 9, 6)
        assert db.fetch_raw("t", "p", 0, 1)[0] == 4
        assert db.delete_front("t", "p", 99) == (10, True)  # past the head: all, the head stays
        assert (db.info("t", "p").count, db.head("t", "p")) == (0, 9)
        assert db.info("t", "q").count == 3
    finally:
        db.close()


@pytest.fixture
def kgw(cfg: NodeConfig, tmp_path: Path) -> Iterator[KafkaGateway]:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    yield gw
    gw.close()


def kcall(port: int, api_key: int, version: int, req: Any, corr: int = 7) -> Any:
    """One request (flexible header when the version is), its decoded answer."""
    spec = API[api_key]
    flexible = spec.request.flexible_version_q(version)
    head = struct.pack(">hhih", api_key, version, corr, 4) + b"test" + (b"\x00" if flexible else b"")
    payload = head + bytes(req.encode(version=version))
    with socket.create_connection((HOST, port)) as s:
        s.sendall(struct.pack(">i", len(payload)) + payload)
        answer = read_frame(s, 30)
    assert struct.unpack(">i", answer[:4])[0] == corr
    body = answer[5:] if flexible and api_key != 18 else answer[4:]
    return spec.response.decode(io.BytesIO(body), version=version)


def test_api_versions_advertises_what_is_served_and_nothing_else(kgw: KafkaGateway) -> None:
    r = kcall(kgw.kafka_port, 18, 3, ApiVersionsRequest[3](client_software_name="t", client_software_version="1"))
    advertised = {k.api_key: (k.min_version, k.max_version) for k in r.api_keys}
    assert advertised == {s.key: (s.min_version, s.max_version) for s in API.values()}
    assert set(advertised) == set(_HANDLERS)
    for key, (lo, hi) in advertised.items():  # every version advertised is one the codec has
        assert API[key].request.min_version <= lo and hi <= API[key].request.max_version


def _error_codes(value: Any) -> Iterator[int]:
    """Every ``error_code`` of a decoded answer, at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "error_code" and isinstance(v, int):
                yield v
            else:
                yield from _error_codes(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _error_codes(v)


def test_every_advertised_version_is_answered(kgw: KafkaGateway) -> None:
    """Each (API, version) the gateway advertises, asked on one connection per API: each gets
    its answer, never UNSUPPORTED_VERSION (35) and never a closed connection (what a version not
    served gets). A Produce asks for acks (acks=0 has no answer) and the reads name a topic."""
    kgw.create_topic("av", 1)
    r = kcall(kgw.kafka_port, 18, 3, ApiVersionsRequest[3](client_software_name="t", client_software_version="1"))
    fetch_req, list_req = API[1].request, API[2].request
    fetch_topic = fetch_req.FetchTopic(topic="av", partitions=[
        fetch_req.FetchTopic.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=1000)])
    list_topic = list_req.ListOffsetsTopic(name="av", partitions=[
        list_req.ListOffsetsTopic.ListOffsetsPartition(partition_index=0, timestamp=-1)])
    special: dict[int, dict[str, Any]] = {
        0: {"acks": 1, "timeout_ms": 1000},
        1: {"topics": [fetch_topic], "max_wait_ms": 0},
        2: {"topics": [list_topic]},
        3: {"topics": [API[3].request.MetadataRequestTopic(name="av")]},
    }
    answered = 0
    for k in r.api_keys:
        spec = API[k.api_key]
        with socket.create_connection((HOST, kgw.kafka_port)) as s:
            for v in range(k.min_version, k.max_version + 1):
                req = spec.request[v](**special.get(k.api_key, {}))
                flexible = spec.request.flexible_version_q(v)
                corr = 1000 + v
                head = struct.pack(">hhih", k.api_key, v, corr, 4) + b"test" + (b"\x00" if flexible else b"")
                payload = head + bytes(req.encode(version=v))
                s.sendall(struct.pack(">i", len(payload)) + payload)
                answer = read_frame(s, 30)  # a version not served closes the connection
                assert struct.unpack(">i", answer[:4])[0] == corr
                body = answer[5:] if flexible and k.api_key != 18 else answer[4:]
                decoded = spec.response.decode(io.BytesIO(body), version=v)
                codes = list(_error_codes(decoded.to_dict()))
                assert Err.UNSUPPORTED_VERSION not in codes, (k.api_key, v, decoded)
                answered += 1
    assert answered == sum(k.max_version - k.min_version + 1 for k in r.api_keys) > 100
    # And a version past the advertised ones, or below them, or an API not advertised, is not
    # served: the connection closes (ApiVersions: error 35 and the versions, KIP-511); the
    # gateway goes on serving.
    outside = [(k.api_key, k.max_version + 1) for k in r.api_keys if k.api_key != 18]
    outside += [(k.api_key, k.min_version - 1) for k in r.api_keys if k.min_version > 0]
    outside += [(key, 0) for key in (4, 5, 6, 7, 17, 23, 27, 29, 36, 43, 48, 50, 68)]  # not served at all
    for key, v in outside:
        payload = struct.pack(">hhih", key, v, 5, 4) + b"test" + b"\x00" * 64
        with socket.create_connection((HOST, kgw.kafka_port)) as s:
            s.sendall(struct.pack(">i", len(payload)) + payload)
            with pytest.raises(ConnectionError):
                read_frame(s, 30)
    assert kcall(kgw.kafka_port, 18, 4, ApiVersionsRequest[3](client_software_name="t",
                                                              client_software_version="1")).error_code == 35


def test_admin_requests_past_the_item_bound_are_answered_without_work(
    kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request naming thousands of resources, topics or groups: the first
    MAX_ADMIN_ITEMS are served, the rest answered POLICY_VIOLATION."""
    monkeypatch.setattr(admin, "MAX_ADMIN_ITEMS", 5)
    monkeypatch.setattr(serving, "MAX_ADMIN_ITEMS", 5)
    kgw.create_topic("many", 1)
    res = [DescribeConfigsRequest[4].DescribeConfigsResource(resource_type=2, resource_name="many",
                                                              configuration_keys=None)] * 2000
    r = kcall(kgw.kafka_port, 32, 4, DescribeConfigsRequest[4](resources=res, include_synonyms=False,
                                                               include_documentation=False))
    codes = [x.error_code for x in r.results]
    assert codes == [0] * 5 + [Err.POLICY_VIOLATION] * 1995
    assert all(not x.configs for x in r.results[5:])
    groups = [f"g{i}" for i in range(50)]
    r = kcall(kgw.kafka_port, 15, 5, DescribeGroupsRequest[5](groups=groups, include_authorized_operations=False))
    assert [g.error_code for g in r.groups] == [0] * 5 + [Err.POLICY_VIOLATION] * 45
    past = [0] * 5 + [Err.POLICY_VIOLATION] * 45
    port = kgw.kafka_port
    r = kcall(port, 20, 5, DeleteTopicsRequest[5](topic_names=["many"] * 50, timeout_ms=1000))
    assert [t.error_code for t in r.responses] == [Err.TOPIC_DELETION_DISABLED] * 5 + past[5:]
    r = kcall(port, 42, 2, DeleteGroupsRequest[2](groups_names=groups))
    assert [g.error_code for g in r.results] == [Err.GROUP_ID_NOT_FOUND] * 5 + past[5:]
    kgw.db.put_positions("g0", {("many", kgw.pmap.get("many", 0).address): 1})
    od = OffsetDeleteRequest[0]
    r = kcall(port, 47, 0, od(group_id="g0", topics=[od.OffsetDeleteRequestTopic(name="many", partitions=[
        od.OffsetDeleteRequestTopic.OffsetDeleteRequestPartition(partition_index=0)] * 50)]))
    assert [p.error_code for p in r.topics[0].partitions] == past
    ac = AlterConfigsRequest[2]
    r = kcall(port, 33, 2, ac(resources=[ac.AlterConfigsResource(resource_type=2, resource_name="many", configs=[])] * 50,
                              validate_only=True))
    assert [x.error_code for x in r.responses] == past
    cp = CreatePartitionsRequest[3]
    r = kcall(port, 37, 3, cp(topics=[cp.CreatePartitionsTopic(name="many", count=2, assignments=None)] * 50,
                              timeout_ms=1000, validate_only=True))
    assert [x.error_code for x in r.results] == [0] * 5 + [Err.THROTTLING_QUOTA_EXCEEDED] * 45
    dr = DeleteRecordsRequest[2]
    r = kcall(port, 21, 2, dr(topics=[dr.DeleteRecordsTopic(name="many", partitions=[
        dr.DeleteRecordsTopic.DeleteRecordsPartition(partition_index=0, offset=0)] * 50)], timeout_ms=1000))
    assert [x.error_code for x in r.topics[0].partitions] == past
    r = kcall(port, 10, 4, FindCoordinatorRequest[4](key_type=0, coordinator_keys=groups))
    assert [c.error_code for c in r.coordinators] == past
    kgw.db.put_positions("g1", {("many", kgw.pmap.get("many", 0).address): 1})
    of = OffsetFetchRequest[8]
    r = kcall(port, 9, 8, of(groups=[of.OffsetFetchRequestGroup(group_id=g, topics=None) for g in groups],
                             require_stable=False))
    assert [g.error_code for g in r.groups] == past
    assert [[p.committed_offset for p in t.partitions] for t in r.groups[1].topics] == [[1]]  # served


def alter(port: int, topic: str, configs: list[tuple[str, str | None]], incremental: bool = False,
          op: int = 0) -> tuple[int, str | None]:
    if incremental:
        cls = IncrementalAlterConfigsRequest[1]
        entries = [cls.AlterConfigsResource.AlterableConfig(name=n, config_operation=op, value=v) for n, v in configs]
        req = cls(resources=[cls.AlterConfigsResource(resource_type=2, resource_name=topic, configs=entries)],
                  validate_only=False)
        r = kcall(port, 44, 1, req)
    else:
        cls = AlterConfigsRequest[2]
        entries = [cls.AlterConfigsResource.AlterableConfig(name=n, value=v) for n, v in configs]
        req = cls(resources=[cls.AlterConfigsResource(resource_type=2, resource_name=topic, configs=entries)],
                  validate_only=False)
        r = kcall(port, 33, 2, req)
    return r.responses[0].error_code, r.responses[0].error_message


@pytest.mark.parametrize("configs", [
    [("retention.ms", "9" * 5000)],  # a huge value
    [("retention.ms", "-5")],
    [("retention.ms", "1e9")],
    [("retention.bytes", None)],
    [("retention.ms", str(1 << 63))],
    [("retention.ms", "1000"), ("segment.ms", "1")],  # one bad key spoils the resource
])
def test_bad_config_values_are_refused_and_change_nothing(kgw: KafkaGateway, configs: list[Any]) -> None:
    kgw.create_topic("conf", 1)
    for incremental in (False, True):
        code, msg = alter(kgw.kafka_port, "conf", configs, incremental)
        assert code == Err.INVALID_CONFIG, msg
        assert msg is not None and len(msg) < 300
    assert kgw.topic_retention("conf") == (None, None, 5)
    assert kgw.retention.for_topic("conf") == Retention()


def test_list_operations_are_refused(kgw: KafkaGateway) -> None:
    kgw.create_topic("conf", 1)
    code, msg = alter(kgw.kafka_port, "conf", [("retention.ms", "5")], incremental=True, op=2)  # APPEND
    assert code == Err.INVALID_CONFIG and "SET or DELETE" in (msg or "")


def test_altered_retention_is_applied_kept_and_survives_a_restart(cfg: NodeConfig, tmp_path: Path) -> None:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        gw.create_topic("kept", 1)
        assert alter(gw.kafka_port, "kept", [("retention.ms", "60000"), ("retention.bytes", "1000")]) == (0, None)
        assert gw.retention.for_topic("kept") == Retention(60000, 1000)
        # DELETE goes back to the configuration's value.
        assert alter(gw.kafka_port, "kept", [("retention.bytes", None)], incremental=True, op=1) == (0, None)
        assert gw.retention.for_topic("kept") == Retention(60000, None)
    finally:
        gw.close()
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        assert gw.topic_retention("kept") == (60000, None, 1)
        assert gw.retention.for_topic("kept") == Retention(60000, None)
    finally:
        gw.close()
    (tmp_path / "gw" / CONFIGS_FILE).write_text('{"retention": {"kept": [-3, "x"]}}')
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:  # a damaged file is logged and left out; the gateway serves
        assert gw.topic_retention("kept") == (None, None, 5)
    finally:
        gw.close()


def delete_records(port: int, topic: str, offset: int, partition: int = 0) -> tuple[int, int]:
    cls = DeleteRecordsRequest[2]
    req = cls(topics=[cls.DeleteRecordsTopic(name=topic, partitions=[
        cls.DeleteRecordsTopic.DeleteRecordsPartition(partition_index=partition, offset=offset)])], timeout_ms=5000)
    p = kcall(port, 21, 2, req).topics[0].partitions[0]
    return p.error_code, p.low_watermark


def test_delete_records_deletes_a_bounded_number_per_request(kgw: KafkaGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a long partition holds the gateway's I/O thread: one request deletes at most
    MAX_DELETE_RECORDS (here 1,000), then answers REQUEST_TIMED_OUT with where it got; asking
    again goes on."""
    monkeypatch.setattr(admin, "MAX_DELETE_RECORDS", 1000)
    monkeypatch.setattr(admin, "DELETE_STEP", 300)
    kgw.create_topic("long", 1)
    address = kgw.pmap.get("long", 0).address
    kgw.db.append([("long", address, i, b"x", 1) for i in range(2500)])
    wait_until(lambda: kgw.db.head("long", address) == 2499)
    kgw._heads[("long", address)] = 2499  # as the commit hook sets it
    assert delete_records(kgw.kafka_port, "long", -1) == (Err.REQUEST_TIMED_OUT, 1000)
    assert delete_records(kgw.kafka_port, "long", -1) == (Err.REQUEST_TIMED_OUT, 2000)
    assert delete_records(kgw.kafka_port, "long", -1) == (Err.NONE, 2500)
    assert kgw.db.first("long", address) == 2500 and kgw.db.info("long", address).count == 0
    assert delete_records(kgw.kafka_port, "long", 2501) == (Err.OFFSET_OUT_OF_RANGE, 2500)
    assert delete_records(kgw.kafka_port, "long", 5, partition=9) == (Err.UNKNOWN_TOPIC_OR_PARTITION, -1)


def test_delete_records_leaves_a_mesh_producers_partition_alone(kgw: KafkaGateway) -> None:
    kgw.db.append([("mesh", "peer-partition", i, b"x", 1) for i in range(3)])
    kgw.pmap.add("mesh", "peer-partition")
    assert delete_records(kgw.kafka_port, "mesh", 2)[0] == Err.POLICY_VIOLATION
    assert kgw.db.first("mesh", "peer-partition") == 0


def test_create_partitions_is_bounded(kgw: KafkaGateway) -> None:
    kgw.create_topic("wide", 1)
    cls = CreatePartitionsRequest[3]

    def grow(count: int) -> int:
        req = cls(topics=[cls.CreatePartitionsTopic(name="wide", count=count, assignments=None)],
                  timeout_ms=5000, validate_only=False)
        return int(kcall(kgw.kafka_port, 37, 3, req).results[0].error_code)

    assert grow(kgw.kafka.max_partitions + 1) == Err.INVALID_PARTITIONS
    assert grow(1) == Err.INVALID_PARTITIONS
    kgw.limits = dataclasses.replace(kgw.limits, max_owned_partitions=len(kgw._owned) + 2)
    assert grow(10) == Err.INVALID_PARTITIONS  # past max_owned_partitions: nothing added
    assert len(kgw.pmap.partitions("wide") or ()) == 1
    assert grow(3) == Err.NONE
    assert len(kgw.pmap.partitions("wide") or ()) == 3 and all(p.owned for p in kgw.pmap.partitions("wide") or ())


def test_describe_groups_answers_stop_at_their_byte_budget(kgw: KafkaGateway) -> None:
    c = kgw.kafka.coordinator
    meta = [("range", bytes(100_000))]
    for i in range(5):
        c.join(object(), 0.0, f"big{i}", "", "evil", "consumer", meta, 300.0, 300.0)
    for g in c.groups.values():  # made stable by hand: a leader that assigned nothing
        g.state, g.protocol = "Stable", "range"
    kgw.kafka.max_metadata_bytes = 250_000
    r = kcall(kgw.kafka_port, 15, 5, DescribeGroupsRequest[5](groups=[f"big{i}" for i in range(5)],
                                                             include_authorized_operations=False))
    assert [g.error_code for g in r.groups] == [0, 0, Err.POLICY_VIOLATION, Err.POLICY_VIOLATION, Err.POLICY_VIOLATION]


ADMIN_KEYS = [15, 16, 20, 21, 32, 33, 37, 42, 44, 47, 60]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(ADMIN_KEYS), version=st.integers(0, 6), body=st.binary(max_size=200))
def test_garbage_admin_requests_never_hurt_the_gateway(kgw: KafkaGateway, key: int, version: int, body: bytes) -> None:
    flexible = key in API and API[key].request.flexible_version_q(version)
    payload = struct.pack(">hhih", key, version, 1, 1) + b"x" + (b"\x00" if flexible else b"") + body
    with socket.create_connection((HOST, kgw.kafka_port)) as s:
        s.sendall(struct.pack(">i", len(payload)) + payload)
        s.settimeout(10)
        try:
            s.recv(1 << 16)  # an answer, or the connection closed
        except (ConnectionResetError, TimeoutError):
            pass
    # The gateway still serves.
    r = kcall(kgw.kafka_port, 18, 0, ApiVersionsRequest[0]())
    assert r.error_code == 0


def test_deleted_records_and_altered_retention_reach_every_reader(kgw: KafkaGateway, cfg: NodeConfig) -> None:
    """DeleteRecords moves the start for Tank clients and Dafka consumers too, and a retention
    a Kafka client sets is the store's: its retention deletes by it."""
    ck_produce(kgw, "shared", [(None, b"v%d" % i, None) for i in range(20)])
    address = kgw.pmap.get("shared", 0).address
    assert delete_records(kgw.kafka_port, "shared", 5) == (Err.NONE, 5)
    with TankClient(HOST, kgw.tank_port) as t:
        r = t.consume("shared", 0, 0, 1 << 20)
    assert [bytes(v) for _s, _ts, _k, v in r.messages][:1] == [b"v5"]
    with Consumer("shared", cfg, offset_reset="earliest") as consumer:
        got: list[Any] = []
        deadline = time.monotonic() + 20
        while len(got) < 15 and time.monotonic() < deadline:
            got += consumer.poll_batch(100, 0.2)
    assert [bytes(r.content) for r in got] == [b"v%d" % i for i in range(5, 20)]
    assert alter(kgw.kafka_port, "shared", [("retention.ms", "1")], incremental=True) == (0, None)
    wait_until(lambda: kgw.db.first("shared", address) == 20, 20)  # retention runs every second
