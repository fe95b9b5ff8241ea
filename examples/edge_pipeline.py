"""Edge to analytics in one command: devices -> mesh -> Spark -> mesh -> a console.

    .venv/bin/python examples/edge_pipeline.py [--devices 4] [--seconds 60] [--parquet DIR]

What runs (all on 127.0.0.1, data in a temporary directory unless --data):

* a tower and a Tank gateway (the gateway is also the store of the mesh);
* simulated edge devices, each its own process with an embedded Producer,
  publishing one reading every 100 ms as msgpack: device id, event time,
  temperature, humidity;
* ``device-edge``, a device with an edge outbox: it starts with the mesh out
  of reach, loses power (SIGKILL) a third into the run, boots with the mesh
  back and sends what its outbox kept: every reading it took reaches Spark;
* a Spark Structured Streaming job that reads the readings from the mesh
  (format "dafka" through the gateway, decoded into a ``data`` column by the
  source: valueFormat msgpack with a valueSchema), averages them per device over
  10-second event-time windows (5 s watermark), and writes one JSON result
  per device and window to the topic ``device-stats`` (and, with
  --parquet, to Parquet files too);
* a Dafka consumer that prints the results as they arrive.

A result is written once its window is closed by the watermark, so the
first lines appear about 35-55 s after start (Spark's start-up included).  The
last windows of a run are never closed (event time only moves with new
readings), so they are never written.

Ctrl-C stops everything cleanly (exit 130); a temporary data directory is
removed at the end of every run, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

READINGS = "readings"
RESULTS = "device-stats"


def device(name: str, cfg: Any, seconds: float, stop: Any) -> None:
    """One edge device: a reading every 100 ms, published by an embedded producer."""
    from dafka.producer import Producer

    rng = random.Random(name)
    base = rng.uniform(18.0, 26.0)
    deadline = time.monotonic() + seconds
    with Producer(READINGS, cfg, serializer="msgpack") as producer:
        while time.monotonic() < deadline and not stop.is_set():
            reading = {
                "device": name,
                "ts": int(time.time() * 1000),
                "temperature": round(base + rng.gauss(0.0, 0.5), 2),
                "humidity": round(rng.uniform(30.0, 60.0), 1),
            }
            producer.publish(reading)
            stop.wait(0.1)
        producer.flush(10)


def edge_device(name: str, cfg: Any, outbox: str, seconds: float, stop: Any, result: Any = None) -> None:
    """A device with an edge outbox: its readings survive a reboot while the mesh is out of reach."""
    from dafka.producer import Producer

    rng = random.Random(name)
    deadline = time.monotonic() + seconds
    with Producer(READINGS, cfg, outbox=outbox, outbox_sync="batch", serializer="msgpack") as producer:
        while time.monotonic() < deadline and not stop.is_set():
            reading = {
                "device": name,
                "ts": int(time.time() * 1000),
                "temperature": round(22.0 + rng.gauss(0.0, 0.5), 2),
                "humidity": round(rng.uniform(30.0, 60.0), 1),
            }
            producer.publish(reading)
            stop.wait(0.1)
        ok = producer.flush(30)
        if result is not None:
            result.put((producer.address, producer.next_offset, ok))


def offline_then_reboot(ctx: Any, cfg: Any, data: Path, seconds: float, stop: Any) -> tuple[Any, Any]:
    """``device-edge``: offline for a third of the run (no tower reachable), then it loses
    power (SIGKILL) and boots with the mesh back; returns its process and result queue."""
    from dafka.config import NodeConfig, TowerAddress

    outbox = str(data / "device-edge-outbox")
    offline = NodeConfig(towers=(TowerAddress("127.0.0.1", 9, 9),), bind="127.0.0.1")  # nothing listens there
    # Its own stop event: killing a process that waits on a shared multiprocessing
    # Event would leave that Event's lock broken for everybody else.
    first = ctx.Process(target=edge_device, args=("device-edge", offline, outbox, seconds, ctx.Event()), daemon=True)
    first.start()
    stop.wait(seconds / 3)
    first.kill()  # a power cut: nothing is flushed or closed
    first.join(10)
    print("device-edge rebooted after a power cut while offline", flush=True)
    result = ctx.Queue()
    second = ctx.Process(
        target=edge_device, args=("device-edge", cfg, outbox, seconds * 2 / 3, stop, result), daemon=True
    )
    second.start()
    return second, result


def start_stream(spark: Any, gateway: str, checkpoints: Path, parquet: str | None) -> list[Any]:
    """The Spark job: readings -> per-device 10 s window averages -> ``device-stats``."""
    from pyspark.sql import functions as F

    readings = (
        spark.readStream.format("dafka")
        .option("gateway", gateway)
        .option("subscribe", READINGS)
        .option("startingOffsets", "earliest")
        .option("valueFormat", "msgpack")  # decoded per Arrow batch into the data column
        .option("valueSchema", "device STRING, ts BIGINT, temperature DOUBLE, humidity DOUBLE")
        .load()
        .select("data.*")
        .withColumn("event_time", F.timestamp_millis("ts"))
    )
    stats = (
        readings.withWatermark("event_time", "5 seconds")
        .groupBy(F.window("event_time", "10 seconds"), "device")
        .agg(
            F.count("*").alias("readings"),
            F.round(F.avg("temperature"), 2).alias("avg_temperature"),
            F.max("temperature").alias("max_temperature"),
            F.round(F.avg("humidity"), 1).alias("avg_humidity"),
        )
        .select(
            F.col("device").cast("binary").alias("key"),
            F.to_json(
                F.struct(
                    "device",
                    F.col("window.start").cast("string").alias("window_start"),
                    "readings",
                    "avg_temperature",
                    "max_temperature",
                    "avg_humidity",
                )
            )
            .cast("binary")
            .alias("value"),
        )
    )
    queries = [
        stats.writeStream.format("dafka")
        .option("gateway", gateway)
        .option("topic", RESULTS)
        .option("checkpointLocation", str(checkpoints / "stats"))
        .outputMode("append")
        .trigger(processingTime="5 seconds")
        .start()
    ]
    if parquet:
        queries.append(
            stats.select(F.col("value").cast("string").alias("json"))
            .writeStream.format("parquet")
            .option("path", parquet)
            .option("checkpointLocation", str(checkpoints / "parquet"))
            .outputMode("append")
            .trigger(processingTime="5 seconds")
            .start()
        )
    return queries


class Console:
    """Prints every result the Spark job writes back to the mesh."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.results = 0
        self.last_result = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from dafka.consumer import Consumer

        with Consumer(RESULTS, self.cfg, offset_reset="earliest") as consumer:
            while not self.stop.is_set():
                record = consumer.poll(0.5)
                if record is not None:
                    print("result:", record.content.decode(), flush=True)
                    self.results += 1
                    self.last_result = time.monotonic()

    def wait_quiet(self, quiet: float, limit: float) -> None:
        """Until results came and then none for ``quiet`` seconds (at most ``limit``)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.results and time.monotonic() - self.last_result > quiet:
                return
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def spark_session() -> Any:
    from dafka.spark.session import local_session

    return local_session("dafka-edge-pipeline", log_level="WARN")


def start_devices(ctx: Any, count: int, cfg: Any, seconds: float, stop: Any) -> list[Any]:
    """One process per device.  They ignore Ctrl-C: the parent stops them through ``stop``."""
    # A child started while SIGINT is ignored ignores it from its first
    # instruction on (Python keeps an inherited SIG_IGN), so no device prints
    # a KeyboardInterrupt traceback, however early the Ctrl-C comes.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        devices = [
            ctx.Process(target=device, args=(f"device-{i}", cfg, seconds, stop), daemon=True)
            for i in range(count)
        ]
        for p in devices:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    return devices


def stop_devices(devices: list[Any], stop: Any, timeout: float = 15.0) -> None:
    stop.set()
    deadline = time.monotonic() + timeout
    for p in devices:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in devices:
        if p.is_alive():
            p.terminate()
            p.join(5)


def run(args: argparse.Namespace, data: Path) -> int:
    from dafka.config import NodeConfig, TowerAddress
    from dafka.nodes.tower import Tower
    from dafka.tank.gateway import Gateway

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    devices: list[Any] = []
    with Tower("127.0.0.1", 0, 0) as tower:
        cfg = NodeConfig(
            towers=(TowerAddress("127.0.0.1", tower.in_port, tower.out_port),), bind="127.0.0.1"
        )
        with Gateway(data / "gateway", cfg, listen=("127.0.0.1", 0)) as gateway:
            address = f"127.0.0.1:{gateway.tank_port}"
            print(f"tower and gateway up (Tank on {address}); data in {data}", flush=True)
            console: Console | None = None
            spark = None
            queries: list[Any] = []
            try:
                devices = start_devices(ctx, args.devices, cfg, args.seconds, stop)
                console = Console(cfg)
                spark = spark_session()
                queries = start_stream(spark, address, data / "checkpoints", args.parquet)
                print(f"streaming job running; devices publish for {args.seconds:.0f}s", flush=True)
                edge, edge_result = offline_then_reboot(ctx, cfg, data, args.seconds, stop)
                devices.append(edge)
                for p in devices:
                    p.join(args.seconds + 30)
                partition, published, acked = edge_result.get(timeout=30)
                info = gateway.db.info(READINGS, partition)
                stored = 0 if info is None else info.count
                print(
                    f"device-edge: {published} readings published across the reboot, all acknowledged: {acked},"
                    f" {stored} held by the gateway Spark reads from",
                    flush=True,
                )
                # The windows the watermark closed come out over the next
                # micro-batches (the last windows stay open: event time only
                # moves with new readings).
                console.wait_quiet(quiet=12, limit=120)
            finally:
                stop_devices(devices, stop)
                if spark is not None:
                    # Stopping a query mid-batch makes Spark log Java stack
                    # traces at WARN; they say nothing about this run.
                    spark.sparkContext.setLogLevel("ERROR")
                for q in queries:
                    q.stop()
                if spark is not None:
                    spark.stop()
                if console is not None:
                    console.close()
    print("done", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the devices publish")
    parser.add_argument("--data", help="data directory (default: a temporary one, removed at the end)")
    parser.add_argument("--parquet", help="also write the results as Parquet files here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    temporary = args.data is None
    data = Path(args.data or tempfile.mkdtemp(prefix="dafka-pipeline-"))
    try:
        data.mkdir(parents=True, exist_ok=True)
        return run(args, data)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        if temporary:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
