"""Prometheus metrics: a store process scraped over HTTP, embedded nodes, the histogram."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dafka.config import NodeConfig
from dafka.nodes.consumer import Consumer
from dafka.nodes.metrics import Histogram
from dafka.nodes.producer import Producer
from dafka.nodes.tower import Tower
from tests.conftest import dafka_cmd, subprocess_env, tower_flag, wait_until


def scrape(port: int) -> dict[str, float]:
    """Every sample of http://127.0.0.1:port/metrics as name{labels} -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_store_process_metrics_move_with_records(cfg: NodeConfig, tmp_path: Path) -> None:
    store = subprocess.Popen(
        dafka_cmd(
            "store",
            "--tower",
            tower_flag(cfg),
            "--db",
            str(tmp_path / "db"),
            "--bind",
            "127.0.0.1",
            "--metrics",
            "127.0.0.1:0",
        ),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout.readline().startswith("store up:")
        line = store.stdout.readline()  # "metrics on http://127.0.0.1:PORT/metrics"
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        before = scrape(port)
        assert before["dafka_records_stored_total"] == 0
        assert before["dafka_partitions"] == 0
        assert before["dafka_store_commit_failing"] == 0
        assert before["dafka_commit_seconds_count"] == 0
        with Producer("metrics-t", cfg) as producer:
            wait_until(lambda: len(producer.peers) > 0)
            producer.publish_many(b"r%d" % i for i in range(500))
            assert producer.flush(20)
        after = wait_until(
            lambda: (m := scrape(port))["dafka_acks_sent_total"] > 0 and m, timeout=10
        )
        assert after["dafka_records_stored_total"] == 500
        assert after["dafka_stored_records"] == 500
        assert after["dafka_stored_bytes"] > 0
        assert after["dafka_partitions"] == 1
        assert after["dafka_commit_batch_records_count"] >= 1
        assert after["dafka_commit_batch_records_sum"] == 500
        assert after["dafka_commit_seconds_count"] == after["dafka_commit_batch_records_count"]
        assert after["dafka_ack_latency_seconds_count"] >= 1
        assert after["dafka_peers"] >= 1
        assert after["dafka_malformed_input_total"] == 0
    finally:
        store.terminate()
        assert store.wait(15) == 0


def test_embedded_nodes_each_serve_their_own_registry(cfg: NodeConfig, tower: Tower) -> None:
    from dafka.nodes import metrics

    consumer = Consumer("metrics-e", cfg)
    producer = Producer("metrics-e", cfg, acks=False)
    tower_server = metrics.serve(tower)
    try:
        cport, pport = consumer.serve_metrics(), producer.serve_metrics()
        assert cport != pport
        wait_until(lambda: len(producer.peers) > 0 and len(consumer.peers) > 0)
        wait_until(lambda: (producer.publish(b"x"), consumer.poll(0.1))[1] is not None, timeout=10)
        producer.publish_many([b"y"] * 9)
        cm = wait_until(lambda: (m := scrape(cport))["dafka_records_delivered_total"] >= 10 and m)
        assert cm[f"dafka_node{{address={consumer.address},kind=consumer}}"] == 1
        assert cm[f"dafka_consumer_lag{{partition={producer.address},topic=metrics-e}}"] == 0
        assert "dafka_records_stored_total" not in cm
        pm = scrape(pport)
        assert pm["dafka_records_published"] >= 10
        assert pm["dafka_pace_timeouts_total"] == 0
        assert pm["dafka_fetch_answers_cut_total"] == 0
        assert pm["dafka_producer_batching"] == 1  # its one reader is a dafka consumer
        assert "dafka_records_delivered_total" not in pm
        tm = scrape(tower_server.port)
        assert tm["dafka_beacons_relayed_total"] > 0
        assert tm["dafka_subscribers_cut_total"] == 0
        assert tm["dafka_subscription_bytes"] > 0  # the nodes' W, XT...
    finally:
        tower_server.close()
        producer.close(0)
        consumer.close()
    assert consumer.metrics_server is None  # stopping the node stopped its endpoint


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.001, 0.01))
    for v in (0.0005, 0.001, 0.005, 2.0):
        h.observe(v)
    fam = h.family("x_seconds", "doc")
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name == "x_seconds_bucket"}
    assert buckets == {"0.001": 2, "0.01": 3, "+Inf": 4}
    assert h.count == 4 and abs(h.sum - 2.0065) < 1e-9
