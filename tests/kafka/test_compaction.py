"""Compacted Kafka topics: cleanup.policy through the admin API (kept over restarts), and a
real gateway process compacting what kafka-python wrote, read back with offset gaps."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from dafka.config import NodeConfig
from dafka.kafka.codec import Err
from dafka.kafka.gateway import CONFIGS_FILE, KafkaGateway
from dafka.store.db import RecordDB, Retention
from tests.conftest import dafka_cmd, subprocess_env, wait_until
from tests.kafka.test_admin import alter
from tests.kafka.test_gateway import HOST

pytestmark = pytest.mark.timeout(120)


def start_gateway(db: Path, tower: str = "127.0.0.1:1:2") -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        dafka_cmd("gateway", "--db", str(db), "--listen", f"{HOST}:0", "--kafka-listen", f"{HOST}:0",
                  "--tower", tower),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env(),
    )
    assert proc.stdout is not None
    up = proc.stdout.readline()
    found = re.search(r"Kafka on 127\.0\.0\.1:(\d+)", up)
    assert found, up
    return proc, f"{HOST}:{found.group(1)}"


@pytest.fixture
def gateway_db(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "gw"


def topic_configs(bs: str, topic: str) -> dict[str, Any]:
    r = ConfigResource("topic", topic)
    admin = AdminClient({"bootstrap.servers": bs})  # alive until the answer came
    return admin.describe_configs([r])[r].result(20)  # type: ignore[no-any-return]


def stored_count(db: Path, topic: str) -> int:
    with RecordDB(db, readonly=True) as rdb:
        return sum(p.count for p in rdb.partitions(topic))


def test_a_consumer_from_the_start_reads_the_latest_per_key_with_offset_gaps(gateway_db: Path) -> None:
    proc, bs = start_gateway(gateway_db)
    try:
        admin = AdminClient({"bootstrap.servers": bs})
        admin.create_topics([NewTopic("cmp", 1, 1, config={"cleanup.policy": "compact",
                                                           "delete.retention.ms": "0"})])["cmp"].result(20)
        got = topic_configs(bs, "cmp")
        assert got["cleanup.policy"].value == "compact" and not got["cleanup.policy"].is_read_only
        assert got["delete.retention.ms"].value == "0"
        prod = KafkaProducer(bootstrap_servers=bs, linger_ms=5, batch_size=2048)
        for rnd in range(20):
            for k in range(10):
                prod.send("cmp", key=b"k%d" % k, value=b"k%d-%d" % (k, rnd), partition=0)
        prod.send("cmp", key=b"k3", value=None, partition=0)  # a tombstone: k3 goes
        prod.send("cmp", key=b"tail", value=b"end", partition=0)
        prod.flush(30)
        prod.close()
        # The gateway compacts in its writer thread, in the background.
        wait_until(lambda: stored_count(gateway_db, "cmp") == 10, timeout=60, interval=0.2)
        cons = KafkaConsumer(bootstrap_servers=bs, auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=3000)
        tp = TopicPartition("cmp", 0)
        cons.assign([tp])
        seen = []
        for msg in cons:
            seen.append((msg.offset, msg.key, msg.value))
            if msg.key == b"tail":
                break
        assert cons.end_offsets([tp])[tp] == 202
        cons.close()
        latest = {b"k%d" % k: b"k%d-19" % k for k in range(10) if k != 3} | {b"tail": b"end"}
        assert {k: v for _o, k, v in seen} == latest and len(seen) == 10
        offsets = [o for o, _k, _v in seen]
        assert offsets == sorted(offsets) and offsets[-1] == 201 and offsets[0] >= 180  # gaps below
    finally:
        proc.kill()
        proc.wait(10)
    # The policy is kept in the gateway's directory: a restarted gateway still compacts.
    proc, bs = start_gateway(gateway_db)
    try:
        got = topic_configs(bs, "cmp")
        assert got["cleanup.policy"].value == "compact" and got["delete.retention.ms"].value == "0"
    finally:
        proc.kill()
        proc.wait(10)


def test_cleanup_policy_alters_applies_and_survives_a_restart(cfg: NodeConfig, tmp_path: Path) -> None:
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        gw.create_topic("c", 1)
        assert gw.topic_cleanup("c") == ("delete", 86_400_000, 5)
        assert alter(gw.kafka_port, "c", [("cleanup.policy", "compact"), ("retention.ms", "1000")],
                     incremental=True) == (0, None)
        assert gw.compaction.compacts("c")
        assert gw.retention.for_topic("c") == Retention()  # "compact" alone deletes nothing by age
        assert alter(gw.kafka_port, "c", [("cleanup.policy", "delete, compact")], incremental=True) == (0, None)
        assert gw.retention.for_topic("c") == Retention(1000, None) and gw.compaction.compacts("c")
        assert alter(gw.kafka_port, "c", [("delete.retention.ms", "5")], incremental=True) == (0, None)
        assert gw.compaction.tombstone_ms("c") == 5
        for bad in [("cleanup.policy", "shred"), ("delete.retention.ms", "-1"), ("cleanup.policy", "x" * 500),
                    ("delete.retention.ms", None)]:
            code, msg = alter(gw.kafka_port, "c", [bad], incremental=True)
            assert code == Err.INVALID_CONFIG and msg and len(msg) < 300
        assert gw.topic_cleanup("c") == ("compact,delete", 5, 1)
    finally:
        gw.close()
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:
        assert gw.topic_cleanup("c") == ("compact,delete", 5, 1)
        assert gw.compaction.compacts("c") and gw.compaction.tombstone_ms("c") == 5
        # DELETE goes back to the configuration's (delete).  AlterConfigs (not incremental)
        # replaces every dynamic key.
        assert alter(gw.kafka_port, "c", [("cleanup.policy", None)], incremental=True, op=1) == (0, None)
        assert not gw.compaction.compacts("c")
        assert alter(gw.kafka_port, "c", [("cleanup.policy", "compact")]) == (0, None)
        assert gw.topic_cleanup("c") == ("compact", 86_400_000, 1)
    finally:
        gw.close()
    (tmp_path / "gw" / CONFIGS_FILE).write_text('{"retention": {}, "cleanup": {"c": ["burn", -1]}}')
    gw = KafkaGateway(tmp_path / "gw", cfg, listen=(HOST, 0), kafka_listen=(HOST, 0))
    try:  # a damaged file is logged and left out; the gateway serves
        assert gw.topic_cleanup("c")[0] == "delete" and not gw.compaction.compacts("c")
    finally:
        gw.close()


def test_transactions_aborted_records_never_supersede_and_an_open_one_is_left_alone(
        gateway_db: Path, cfg: NodeConfig) -> None:
    """And a Dafka consumer of the mesh reads the committed latest per key only, passing the
    compacted gaps, aborted records and markers at once (well before its skip_after)."""
    import time

    from dafka.nodes.consumer import Consumer
    from tests.conftest import tower_flag
    from tests.kafka.test_transactions import ck_read, txn_producer

    proc, bs = start_gateway(gateway_db, tower_flag(cfg))
    try:
        admin = AdminClient({"bootstrap.servers": bs})
        admin.create_topics([NewTopic("ctx", 1, 1, config={"cleanup.policy": "compact"})])["ctx"].result(20)
        p = txn_producer(bs, "cmp-1")
        for pairs, commit in (([(b"a", b"a1"), (b"b", b"b1")], True), ([(b"a", b"a2-aborted")], False),
                              ([(b"b", b"b2")], True)):
            p.begin_transaction()
            for k, v in pairs:
                p.produce("ctx", key=k, value=v, partition=0)
            p.flush(30)
            if commit:
                p.commit_transaction(30)
            else:
                p.abort_transaction(30)
        p.begin_transaction()
        p.produce("ctx", key=b"a", value=b"a3", partition=0)  # left open: past the last stable offset
        p.flush(30)
        # 0 a1, 1 b1, 2 commit, 3 a2 (aborted), 4 abort, 5 b2, 6 commit, 7 a3 (open): b1 goes, no other.
        wait_until(lambda: stored_count(gateway_db, "ctx") == 7, timeout=60, interval=0.2)
        assert [v for _p, _o, v in ck_read(bs, "ctx", "read_committed")] == [b"a1", b"b2"]
        p.commit_transaction(30)
        # Now a3 (committed) supersedes a1 and the aborted a2.
        wait_until(lambda: stored_count(gateway_db, "ctx") == 7 - 2 + 1, timeout=60, interval=0.2)
        assert [v for _p, _o, v in ck_read(bs, "ctx", "read_committed")] == [b"b2", b"a3"]
        began = time.monotonic()
        with Consumer("ctx", cfg, offset_reset="earliest", skip_after=60.0) as consumer:
            got: list[Any] = []
            while len(got) < 2 and time.monotonic() - began < 20:
                got += consumer.poll_batch(100, 0.1)
            took = time.monotonic() - began
            got += consumer.poll_batch(100, 0.5)
        assert [(r.offset, bytes(r.content)) for r in got] == [(5, b"b2"), (7, b"a3")]
        assert took < 15, took
    finally:
        proc.kill()
        proc.wait(10)
