"""Prometheus metrics of towers and nodes, read at scrape time.

Nodes keep plain integer counters (``stored``, ``delivered``, ``fetches_sent``
...) and a few :class:`Histogram` objects observed once per commit; nothing on
a per-record path touches ``prometheus_client``.  A :class:`NodeCollector`
turns those attributes into metric families when Prometheus scrapes, and
:func:`serve` exposes one object's metrics on its own HTTP port with its own
``CollectorRegistry`` (several nodes may live in one process).

Metric names (all prefixed ``dafka_``) are listed in
docs/tutorials/operations.md (Metrics).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("dafka.metrics")

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SIZE_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)


class Histogram:
    """Bucket counts and a sum, observed from one thread, read at scrape time.

    Reads race with observations harmlessly: a scrape may see one observation
    in the count and not yet in the buckets, never a corrupted value.
    """

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), list(self.counts), strict=True):
            running += n
            cumulative.append((_bucket_label(bound), running))
        return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=self.sum)


def _bucket_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


# (metric name, attribute or callable, documentation); a metric is exposed only
# when the object has the attribute, so one table serves every kind of node.
Getter = str | Callable[[Any], float]

COUNTERS: list[tuple[str, Getter, str]] = [
    ("dafka_records_stored", "stored", "Records committed to LMDB"),
    ("dafka_records_served", "records_served", "DIRECT-RECORDs sent in answer to FETCHes"),
    ("dafka_acks_sent", "acks_sent", "ACKs sent after commits"),
    ("dafka_fetches_received", "fetches_received", "FETCHes received for partitions held"),
    ("dafka_fetches_sent", "fetches_sent", "FETCHes sent for missing records"),
    ("dafka_fetches_answered", "fetches_served", "FETCHes answered from the producer's buffer"),
    ("dafka_fetch_answers_cut", "answers_cut", "FETCH answers cut short after pace_limit (the requester asks again)"),
    ("dafka_pace_timeouts", "pace_timeouts", "Times a stuck subscriber made the producer drop for a hold"),
    ("dafka_records_delivered", "delivered", "Records delivered in order to the application"),
    ("dafka_records_skipped", "skipped", "Offsets skipped because nobody had them"),
    ("dafka_records_compacted", "records_compacted", "Store: records compaction removed (superseded keys, old tombstones)"),
    (
        "dafka_compacted_passed",
        "compacted_passed",
        "Offsets passed at once because a store said it compacted them away (VOID kind 2)",
    ),
    ("dafka_tank_records_too_large", "records_too_large", "Tank produces refused: a record over max_record_bytes"),
    (
        "dafka_records_too_large",
        "records_dropped_too_large",
        "Records read from the mesh and dropped: content over max_record_bytes (a hole for this node)",
    ),
    (
        "dafka_connections_cut",
        "connections_cut",
        "Peer connections ZeroMQ cut for a frame over max_record_bytes + framing (connected again)",
    ),
    ("dafka_records_refused", "records_refused", "Records the store's database refused (their partition is read again)"),
    ("dafka_beacons_relayed", "beacons", "Node beacons relayed to the mesh"),
    (
        "dafka_bridge_beacons_imported",
        lambda n: n.imports.imported,
        "Tower: beacons of stores, consumers and group members imported from bridged regions' towers",
    ),
    (
        "dafka_bridge_refused",
        lambda n: n.imports.refused,
        "Tower: bridge messages or entries refused (malformed, or of a kind that does not cross)",
    ),
    ("dafka_bridges_renewed", "bridges_renewed", "Tower: bridge connections made anew after a silence"),
    (
        "dafka_subscribers_cut",
        lambda n: n.front.cut.count,
        "Plain tower: beacon-out connections cut (subscriptions over their bounds, no handshake, too far behind)",
    ),
    ("dafka_malformed_input", lambda n: n.bad_input.count, "Malformed messages dropped"),
    ("dafka_loop_turns", "loop_turns", "Wake-ups of the node's I/O loop (input, timers or work)"),
    ("dafka_outbox_evicted", lambda n: n._outbox.evicted, "Records evicted from the edge outbox unacknowledged (drop_oldest)"),
]

GAUGES: list[tuple[str, Getter, str]] = [
    ("dafka_peers", lambda n: len(n.peers), "Peers currently known through the towers"),
    (
        "dafka_subscription_bytes",
        lambda n: n.front.book.total,
        "Plain tower: subscriptions held on the beacon-out port, counted as bounded (see the security model)",
    ),
    (
        "dafka_partitions",
        lambda n: len(n._heads) if hasattr(n, "_heads") else len(n._trackers),
        "Partitions held (stores) or read (consumers)",
    ),
    (
        "dafka_store_commit_failing",
        lambda n: int(n.storage_error is not None),
        "1 while commits fail (disk full...): no ACKs",
    ),
    (
        "dafka_store_batch_pending",
        lambda n: n.pending_records(),
        "Records received, waiting for the writer",
    ),
    (
        "dafka_records_published",
        lambda n: n.window.next,
        "Offsets assigned by the producer (next offset)",
    ),
    ("dafka_records_acked_offset", lambda n: n.window.acked, "Highest offset a store acknowledged"),
    ("dafka_records_unacked", lambda n: len(n.window), "Records kept waiting for an ACK"),
    (
        "dafka_producer_batching",
        lambda n: int(n.batching),
        "1 while live records go out in batches (every reader takes them), 0: one a message",
    ),
    ("dafka_outbox_records", lambda n: n._outbox.records, "Records in the producer's edge outbox (unacknowledged)"),
    ("dafka_outbox_bytes", lambda n: n._outbox.bytes, "Bytes in the producer's edge outbox"),
    (
        "dafka_outbox_oldest_age_seconds",
        lambda n: n._outbox.oldest_age(),
        "Age of the oldest record in the producer's edge outbox",
    ),
    ("dafka_consumer_queued", lambda n: len(n._queue), "Records delivered, not yet polled"),
    ("dafka_tank_connections", lambda n: len(n._conns), "Open Tank client connections"),
]

HISTOGRAMS: list[tuple[str, str, str]] = [
    ("dafka_commit_batch_records", "commit_sizes", "Records per LMDB commit (group commit)"),
    ("dafka_commit_seconds", "commit_seconds", "LMDB commit time, fsync included"),
    (
        "dafka_ack_latency_seconds",
        "ack_latency",
        "First record of a commit received (the store's receive stamp of mesh records) -> its ACK"
        " sent; gateways' client blocks (Tank bundles, Kafka batches) are not observed",
    ),
]


def _value(obj: Any, getter: Getter) -> float | None:
    try:
        return float(getter(obj) if callable(getter) else getattr(obj, getter))
    except (AttributeError, TypeError, ValueError):
        return None


class NodeCollector(Collector):
    """Metric families of one node, store, gateway, consumer, producer or tower."""

    def __init__(self, node: Any) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        kind = getattr(node, "kind", "tower")
        info = GaugeMetricFamily("dafka_node", "This node (value 1)", labels=["kind", "address"])
        info.add_metric([kind, getattr(node, "address", "")], 1)
        yield info
        for name, getter, doc in COUNTERS:
            value = _value(node, getter)
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)
        for name, getter, doc in GAUGES:
            value = _value(node, getter)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        for name, attr, doc in HISTOGRAMS:
            hist = getattr(node, attr, None)
            if isinstance(hist, Histogram):
                yield hist.family(name, doc)
        yield from self._stored(node)
        yield from self._lag(node)

    @staticmethod
    def _stored(node: Any) -> Iterator[Metric]:
        db = getattr(node, "db", None)
        if db is None or not hasattr(db, "partitions"):
            return
        try:
            parts = db.partitions()
        except Exception as exc:  # closed, or a read failed: skip, the scrape still works
            log.debug("no stored totals: %s", exc)
            return
        yield GaugeMetricFamily(
            "dafka_stored_records", "Records held in LMDB", value=sum(p.count for p in parts)
        )
        yield GaugeMetricFamily(
            "dafka_stored_bytes", "Record bytes held in LMDB", value=sum(p.bytes for p in parts)
        )

    @staticmethod
    def _lag(node: Any) -> Iterator[Metric]:
        if getattr(node, "kind", None) != "consumer":
            return
        lag = GaugeMetricFamily(
            "dafka_consumer_lag",
            "Offsets known to exist and not yet delivered, per partition",
            labels=["topic", "partition"],
        )
        for (topic, partition), tracker in list(node._trackers.items()):
            if tracker.next is not None:
                lag.add_metric([topic, partition], max(0, tracker.known - tracker.next + 1))
        yield lag


class MetricsServer:
    """An HTTP endpoint serving one registry; :meth:`close` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self._httpd, self._thread = start_http_server(port, host, registry=registry)
        self.host = host
        self.port = self._httpd.server_address[1]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def registry_for(obj: Any) -> CollectorRegistry:
    """A fresh registry holding ``obj``'s collector (one per node: no name clashes)."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(obj))
    return registry


def serve(obj: Any, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Expose ``obj``'s metrics on ``http://host:port/metrics`` (port 0: ephemeral)."""
    server = MetricsServer(registry_for(obj), host, port)
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server
