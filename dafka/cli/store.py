"""``dafka store`` (run a store) and ``dafka topics`` (what a store's database holds)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dafka.cli.args import add_node_flags, count_arg, positive_seconds_arg
from dafka.cli.common import (
    StopSignals,
    note_unreached_towers,
    open_error,
    serve_metrics,
    service_node_config,
    tower_names,
    writable_dir,
)
from dafka.config import Settings, shorten
from dafka.errors import ConfigError, DafkaError


def retention_policy(section: dict[str, Any], age: float | None = None, size: int | None = None) -> Any:
    """[store.retention] max_age_s / max_bytes, plus [store.retention.topics.NAME]."""
    from dafka.store.db import Retention, RetentionPolicy

    def one(d: dict[str, Any]) -> Retention:
        max_age = d.get("max_age_s")
        return Retention(
            None if max_age is None else int(float(max_age) * 1000),
            None if d.get("max_bytes") is None else int(d["max_bytes"]),
        )

    default = one(section)
    if age is not None:
        default = default._replace(max_age_ms=int(age * 1000))
    if size is not None:
        default = default._replace(max_bytes=size)
    topics = {name: one(d) for name, d in section.get("topics", {}).items()}
    return RetentionPolicy(default=default, topics=topics)


def storage_options(args: argparse.Namespace, section: dict[str, Any], name: str) -> tuple[str, bool, Any]:
    """``(db, sync, retention policy)`` of a store or gateway, from its flags and [name] section."""
    db = args.db or section.get("db")
    if not db:
        raise ConfigError(f"--db DIR (or [{name}] db) is required")
    writable_dir(db)
    sync = not args.no_sync and bool(section.get("sync", True))
    policy = retention_policy(section.get("retention", {}), args.retention_age, args.retention_bytes)
    return db, sync, policy


def compaction_policy(args: argparse.Namespace, section: dict[str, Any]) -> Any:
    """``--compact-topics a,b`` / ``[store] compact_topics`` (the topics whose stores keep the
    latest record per key) and ``--delete-retention-ms`` / ``delete_retention_ms`` (how long a
    tombstone stays; Kafka's default, a day, when unset)."""
    from dafka.store.compaction import DEFAULT_DELETE_RETENTION_MS, CompactionPolicy

    value = args.compact_topics if args.compact_topics is not None else section.get("compact_topics")
    topics: list[str] = []
    if value is not None:
        items = value.split(",") if isinstance(value, str) else [i for v in value for i in v.split(",")]
        topics = [t.strip() for t in items if t.strip()]
    tomb = args.delete_retention_ms if args.delete_retention_ms is not None else section.get("delete_retention_ms")
    return CompactionPolicy(frozenset(topics), {},
                            DEFAULT_DELETE_RETENTION_MS if tomb is None else int(tomb))


def add_compaction_flags(p: Any) -> None:
    """``--compact-topics`` and ``--delete-retention-ms`` of a store or gateway."""
    p.add_argument(
        "--compact-topics", metavar="T1,T2",
        help="compact these topics (or compact_topics): keep the latest record per key, offsets keep their numbers",
    )
    p.add_argument(
        "--delete-retention-ms", type=count_arg, metavar="MS",
        help="how long a tombstone (a key with a null value) of a compacted topic stays (default a day)",
    )


def check_leaf_port(leaves: str | None, insecure: bool, secure: bool) -> None:
    """``--leaves HOST:PORT`` of a store or gateway: beyond loopback only with [security] or --insecure."""
    if not leaves:
        return
    from dafka.config import is_loopback
    from dafka.store.leaves import parse_endpoint

    if not is_loopback(parse_endpoint(leaves)[0]) and not insecure and not secure:
        raise ConfigError(
            f"--leaves {leaves}: a plain store's leaf port has no authentication; configure [security]"
            " (CURVE: allowed keys, each writing its own partitions) or add --insecure"
        )


def store_topics(value: str | list[str] | None) -> list[str] | None:
    """``--topics a,b`` or ``[store] topics = [...]``: the topics a store keeps (None: all)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [i for v in value for i in v.split(",")]
    topics = [t.strip() for t in items if t.strip()]
    if not topics:
        raise ConfigError("--topics (or [store] topics) names no topic")
    return topics


def leaf_read_topics(value: str | list[str] | None) -> list[str] | None:
    """``--leaf-read P1,P2`` or ``leaf_read = [...]``: the topic patterns leaf readers may read (None: the default)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [i for v in value for i in v.split(",")]
    return [t.strip() for t in items if t.strip()]


def leaf_options(args: argparse.Namespace, section: dict[str, Any]) -> dict[str, Any]:
    """The store's ``leaf_limits`` from ``--leaf-read`` / ``leaf_read``."""
    patterns = leaf_read_topics(getattr(args, "leaf_read", None) or section.get("leaf_read"))
    return {} if patterns is None else {"leaf_limits": {"read_topics": patterns}}


def cmd_store(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.gctune import settle
    from dafka.store.node import Store, linger_setting

    db, sync, policy = storage_options(args, settings.section("store"), "store")
    section = settings.section("store")
    linger = linger_setting(section)
    signals = StopSignals()
    cfg = service_node_config(args, settings, "store")
    check_leaf_port(args.leaves, args.insecure, cfg.security is not None)
    kept = store_topics(args.topics or section.get("topics"))
    try:
        store = Store(db, cfg, sync=sync, retention=policy, linger=linger, leaves=args.leaves, topics=kept,
                      compaction=compaction_policy(args, section), **leaf_options(args, section))
    except lmdb.Error as exc:
        raise open_error(db, exc) from None
    with store:
        settle()  # its start-up objects out of the cyclic GC's way (dafka.gctune)
        print(
            f"store up: {store.address} db {db} (sync={'on' if sync else 'OFF'}), tower {tower_names(cfg.towers)}"
            + (f", leaves on {store.leaves.endpoint}" if store.leaves is not None else "")
            + (f", keeps {', '.join(sorted(kept))}" if kept is not None else ""),
            flush=True,
        )
        serve_metrics(args, section, store)
        note_unreached_towers(cfg.towers)
        return signals.wait()


TOPIC_ROWS = 20  # partitions of a topic listed by `dafka topics` without --all


def cmd_topics(args: argparse.Namespace, settings: Settings) -> int:
    import lmdb

    from dafka.store.db import RecordDB

    db = args.db or settings.section("store").get("db")
    if not db:
        raise ConfigError("--db DIR (or [store] db) is required")
    if not os.path.exists(db):
        raise DafkaError(f"{db}: no such directory")
    if not os.path.isdir(db):
        raise DafkaError(f"{db}: not a directory")
    if not os.path.exists(os.path.join(db, "data.mdb")):
        raise DafkaError(f"{db}: no store database here (no data.mdb); give the --db of a store or gateway")
    try:
        with RecordDB(db, readonly=True) as records:
            rows = records.partitions(args.topic)
            held = sorted({r.topic for r in records.partitions()}) if args.topic and not rows else []
    except lmdb.Error as exc:
        raise DafkaError(f"cannot read the database in {db}: {exc}") from None
    if args.topic and not rows:
        names = ", ".join(map(shorten, held[:10])) + (f", ... ({len(held)} in all)" if len(held) > 10 else "")
        raise DafkaError(f"no topic {shorten(args.topic)} in {db} (" + (f"it holds {names})" if held else "it holds none)"))
    print(f"{'topic':<24} {'partition':<34} {'first':>12} {'last':>12} {'records':>12} {'bytes':>14}")
    by_topic: dict[str, list[Any]] = {}
    for r in rows:
        by_topic.setdefault(r.topic, []).append(r)
    for topic, parts in by_topic.items():
        shown = parts
        if not args.all and len(parts) > TOPIC_ROWS:
            shown = sorted(parts, key=lambda r: r.count, reverse=True)[:TOPIC_ROWS]
        for r in shown:
            print(f"{r.topic:<24} {r.partition:<34} {r.first:>12} {r.last:>12} {r.count:>12} {r.bytes:>14}")
        if len(shown) < len(parts):
            rest = [r for r in parts if r not in shown]
            print(
                f"{topic:<24} {f'... {len(rest)} more partitions':<34} {'':>12} {'':>12}"
                f" {sum(r.count for r in rest):>12} {sum(r.bytes for r in rest):>14}  (--all lists them)"
            )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("store", help="run a store (persists every record in LMDB)")
    add_node_flags(p)
    p.add_argument("--insecure", action="store_true", help="allow binding beyond loopback without security")
    p.add_argument("--db", help="LMDB directory (or [store] db)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync commits (UNSAFE: acked data can be lost on power failure)")
    p.add_argument("--retention-age", type=positive_seconds_arg, help="default retention: seconds to keep records")
    p.add_argument("--retention-bytes", type=count_arg, help="default retention: bytes to keep per topic")
    add_compaction_flags(p)
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics over HTTP here")
    p.add_argument(
        "--topics", metavar="T1,T2",
        help="keep only these topics (or [store] topics): records and HEADs of others are not stored, leaves of others refused",
    )
    p.add_argument(
        "--leaves", metavar="HOST:PORT",
        help="take leaf devices (dafka produce --leaf) on this port (0: any free port); beyond loopback needs"
        " [security] or --insecure",
    )
    p.add_argument(
        "--leaf-read", metavar="PATTERN[,PATTERN...]",
        help="topics leaf readers (dafka consume --leaf) may read, fnmatch patterns, {key} the connection's key"
        " (or [store] leaf_read; default: every topic in plain mode, none in secure mode)",
    )


def add_topics_parser(sub: Any) -> None:
    p = sub.add_parser("topics", help="list topics and partitions of a store's database")
    p.add_argument("--db", help="LMDB directory of a store (read-only)")
    p.add_argument("topic", nargs="?", help="only this topic")
    p.add_argument("--all", action="store_true", help=f"every partition (default: the {TOPIC_ROWS} largest of each topic)")
