"""The console's sans-IO part: what the pages show, from status snapshots.

:class:`ConsoleModel` is fed the snapshots of :class:`dafka.cli.status.MeshView`
(and, with ``--db``, the partitions of a local store) with the time, keeps
bounded history rings for the charts (records/s per topic, lag per group), and
answers the plain data the pages render.  :func:`show_record` turns one stored
record into what the record browser shows: text, JSON, msgpack decoded or hex,
cut at a bound with a note.  Nothing here touches a socket or reads a clock.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from dafka.store.layout import PartitionInfo

HISTORY = 300  # samples kept per chart series (five minutes at one a second)
MAX_SERIES = 1000  # chart series kept (topics and groups together); more are not charted
SHOWN_BYTES = 4096  # record content (and key) shown at most, per record
MAX_PAGE = 100  # records per page of the record browser
FORMATS = ("auto", "text", "json", "msgpack", "hex")
KINDS = ("tower", "store", "producer", "consumer", "unknown")
# What the landing page (sent every interval to every open page) lists at most; counts are whole.
LANDING_NODES = 200  # nodes per kind
LANDING_HEADS = 20  # partition heads per topic, partitions per group
BOX_MEMBERS = 50  # nodes listed in a box of the mesh picture
PARTITION_PAGE = 200  # partitions per page of a topic's or a group's page
HOLES_READ = 101  # --db: holes read from the local store per update (HOLES_SHOWN alerted, the rest counted)
HOLES_SHOWN = 10


class Ring:
    """The last ``size`` (time, value) samples of one series, in two arrays of
    doubles: 16 bytes a sample (a deque of tuples of floats takes about 100)."""

    __slots__ = ("times", "values", "start", "count")

    def __init__(self, size: int) -> None:
        self.times = array("d")
        self.values = array("d")
        self.start = 0  # index of the oldest sample once full
        self.count = 0

    def append(self, t: float, value: float, size: int) -> None:
        if self.count < size:  # filling: grow (a series that stops early stays small)
            self.times.append(t)
            self.values.append(value)
            self.count += 1
            return
        self.times[self.start] = t
        self.values[self.start] = value
        self.start = (self.start + 1) % size

    def __len__(self) -> int:
        return self.count

    def points(self) -> list[tuple[float, float]]:
        order = list(range(self.start, self.count)) + list(range(self.start))
        return [(self.times[i], self.values[i]) for i in order]


class History:
    """Bounded rings of (time, value) per named series: memory does not grow with time."""

    def __init__(self, size: int = HISTORY, max_series: int = MAX_SERIES) -> None:
        self.size = size
        self.max_series = max_series
        self.series: dict[str, Ring] = {}
        self.refused = 0  # samples of series beyond max_series

    def add(self, name: str, t: float, value: float) -> None:
        ring = self.series.get(name)
        if ring is None:
            if len(self.series) >= self.max_series:
                self.refused += 1
                return
            ring = self.series[name] = Ring(self.size)
        ring.append(t, value, self.size)

    def retain(self, names: Iterable[str]) -> None:
        """Forget the series not named (a topic or group that is gone)."""
        keep = set(names)
        for name in [n for n in self.series if n not in keep]:
            del self.series[name]

    def points(self, name: str) -> list[tuple[float, float]]:
        ring = self.series.get(name)
        return [] if ring is None else ring.points()

    def rates(self, name: str) -> list[tuple[float, float]]:
        """Per second between samples (a counter's rate; a counter going down counts 0)."""
        pts = self.points(name)
        out = []
        for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
            if t1 > t0:
                out.append((t1, max(0.0, (v1 - v0) / (t1 - t0))))
        return out


def _series(*names: str) -> str:
    return "\x00".join(names)  # NUL is in no topic, partition or group name


def _records(head: int | None) -> int:
    return 0 if head is None else head + 1


class ConsoleModel:
    """The data of the pages, from the newest snapshot (times passed in)."""

    def __init__(self, history: int = HISTORY, max_series: int = MAX_SERIES) -> None:
        self.snap: dict[str, Any] = {"towers": [], "nodes": [], "partitions": [], "groups": []}
        self.db_parts: list[PartitionInfo] | None = None  # --db: the local store's partitions
        self.db_error: str | None = None
        self.db_holes: list[tuple[str, str, int, int]] = []  # --db: (topic, partition, first, last)
        self.rates = History(history, max_series)  # "topic NAME": records stored (summed heads)
        self.lags = History(history, max_series)  # per group: its summed lag
        # Per partition (own bounds, so the sums are never crowded out): (topic, partition)
        # -> records stored; (group, topic, partition) -> lag.
        self.part_rates = History(history, max_series)
        self.part_lags = History(history, max_series)
        self.updated = 0.0

    def update(
        self,
        snap: dict[str, Any],
        now: float,
        db_parts: list[PartitionInfo] | None = None,
        db_error: str | None = None,
        db_holes: list[tuple[str, str, int, int]] | None = None,
    ) -> None:
        """A new snapshot (and the local store's partitions and recorded holes, at
        most HOLES_READ of them): sample the charts."""
        self.snap = snap
        self.db_parts = db_parts
        self.db_error = db_error
        self.db_holes = list(db_holes or [])[:HOLES_READ]
        self.updated = now
        topics = self.topics()
        for t in topics:
            self.rates.add(t["topic"], now, t["records"])
        self.rates.retain(t["topic"] for t in topics)
        parts = []
        for (topic, partition), row in self._heads().items():
            name = _series(topic, partition)
            parts.append(name)
            records = row["records"] if row.get("records") is not None else _records(row["head"])
            self.part_rates.add(name, now, records)
        self.part_rates.retain(parts)
        names, lags = [], []
        for g in snap.get("groups", []):
            names.append(g["group"])
            self.lags.add(g["group"], now, g["lag"])
            for p in g["partitions"]:
                if p["lag"] is not None:
                    name = _series(g["group"], p["topic"], p["partition"])
                    lags.append(name)
                    self.part_lags.add(name, now, p["lag"])
        self.lags.retain(names)
        self.part_lags.retain(lags)

    # ------------------------------------------------------------ views

    def _heads(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Per partition: the mesh's heads and the local store's figures."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for p in self.snap.get("partitions", []):
            store_heads = [s["head"] for s in p["stores"]]
            head = max(store_heads) if store_heads else p["producer_head"]
            out[(p["topic"], p["partition"])] = {
                "topic": p["topic"],
                "partition": p["partition"],
                "head": head,
                "producer_head": p["producer_head"],
                "producer_alive": p["producer_alive"],
                "stores": p["stores"],
                "first": None,
                "records": None,
                "bytes": None,
            }
        for info in self.db_parts or []:
            row = out.setdefault(
                (info.topic, info.partition),
                {
                    "topic": info.topic,
                    "partition": info.partition,
                    "head": info.last,
                    "producer_head": None,
                    "producer_alive": False,
                    "stores": [],
                },
            )
            row.update(first=info.first, records=info.count, bytes=info.bytes, db_last=info.last)
            if row["head"] is None or info.last > row["head"]:
                row["head"] = info.last
        return out

    def partition_head(self, topic: str, partition: str) -> tuple[bool, int | None]:
        """Whether the mesh (or the local store) knows the partition, and its head."""
        row = self._heads().get((topic, partition))
        return (False, None) if row is None else (True, row["head"])

    def topics(self) -> list[dict[str, Any]]:
        """Each topic: partitions, records and bytes (records: the local store's
        count with --db, else the offsets the heads cover)."""
        by_topic: dict[str, dict[str, Any]] = {}
        for (topic, _), row in sorted(self._heads().items()):
            t = by_topic.setdefault(
                topic, {"topic": topic, "partitions": 0, "records": 0, "bytes": None, "heads": []}
            )
            t["partitions"] += 1
            t["records"] += row["records"] if row.get("records") is not None else _records(row["head"])
            if row.get("bytes") is not None:
                t["bytes"] = (t["bytes"] or 0) + row["bytes"]
            t["heads"].append({"partition": row["partition"], "head": row["head"]})
        return list(by_topic.values())

    def nodes_by_kind(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
        out["tower"] = [{"address": "", "endpoint": t["endpoint"], "alive": t["reached"]} for t in self.snap["towers"]]
        for n in self.snap["nodes"]:
            out[n["kind"] or "unknown"].append(
                {"address": n["address"], "endpoint": n["endpoint"], "alive": n["alive"], "age": n["last_beacon_age"]}
            )
        return out

    def alerts(self) -> list[str]:
        """What needs a look, from what the mesh already tells."""
        out = []
        for t in self.snap["towers"]:
            if not t["reached"]:
                out.append(f"tower {t['endpoint']} not reached")
        for endpoint in self.snap.get("refused", []):
            out.append(f"{endpoint} refused our handshake (is the console's key in its allow-list?)")
        for p in self.snap["partitions"]:
            if not p["stores"] and p["producer_head"] is not None:
                out.append(f"partition {p['topic']}/{p['partition']}: no store has told its head")
            for s in p["stores"]:
                if s["lag"]:
                    out.append(f"store {s['address'][:8]} is {s['lag']} behind on {p['topic']}/{p['partition']}")
        for s in self.snap.get("not_writing", []):
            n = len(s["partitions"])
            out.append(f"store {s['store'][:8]} is not acknowledging {n} partition(s): {s['reason']}")
        for n in self.snap["nodes"]:
            if not n["alive"]:
                out.append(f"{n['kind'] or 'node'} {n['address'][:8]} stopped beaconing")
        if self.snap.get("malformed"):
            out.append(f"{self.snap['malformed']} malformed message(s) received")
        if self.snap.get("forged"):
            out.append(f"{self.snap['forged']} store-only message(s) from keys without a store role")
        if self.snap.get("dropped_partitions"):
            out.append(f"heads of {self.snap['dropped_partitions']} partition(s) beyond the console's bound were not kept")
        if self.db_error:
            out.append(f"local store: {self.db_error}")
        for topic, partition, first, last in self.db_holes[:HOLES_SHOWN]:
            out.append(f"partition {topic}/{partition}: offsets {first}..{last} are a hole in the local store (given up)")
        if len(self.db_holes) > HOLES_SHOWN:
            more = len(self.db_holes) - HOLES_SHOWN
            out.append(f"... {more}{'+' if len(self.db_holes) >= HOLES_READ else ''} more holes in the local store")
        return out[:100]

    def landing(self) -> dict[str, Any]:
        """Everything of ``/`` (no record content); long lists cut, their counts whole,
        so a mesh of thousands of producers is not sent to every page every second."""
        nodes = self.nodes_by_kind()
        topics = self.topics()
        for t in topics:
            t["heads"] = t["heads"][:LANDING_HEADS]
        mesh = self.mesh()
        for box in mesh["boxes"]:
            box["count"] = len(box["members"])
            box["members"] = box["members"][:BOX_MEMBERS]
        return {
            "nodes": {kind: rows[:LANDING_NODES] for kind, rows in nodes.items()},
            "node_counts": {kind: len(rows) for kind, rows in nodes.items()},
            "topics": topics,
            "groups": [
                {
                    "group": g["group"],
                    "members": len(g["members"]),
                    "lag": g["lag"],
                    "partition_count": len(g["partitions"]),
                    # the most lagging first
                    "partitions": sorted(g["partitions"], key=lambda p: -(p["lag"] or 0))[:LANDING_HEADS],
                }
                for g in self.snap.get("groups", [])
            ],
            "alerts": self.alerts(),
            "mesh": mesh,
            "db": self.db_parts is not None,
        }

    def topic(self, name: str, first: int = 0, count: int = PARTITION_PAGE) -> dict[str, Any] | None:
        """The topic page: ``count`` of its partitions from the ``first`` (in name order,
        with their newest records/s; ``partition_count`` is whole) and the topic's rate."""
        heads = self._heads()
        keys = sorted(k for k in heads if k[0] == name)
        if not keys:
            return None
        first = max(0, min(first, len(keys) - 1))
        rows = [dict(heads[k]) for k in keys[first : first + max(1, min(count, PARTITION_PAGE))]]
        for row in rows:
            rates = self.part_rates.rates(_series(name, row["partition"]))
            row["rate"] = round(rates[-1][1], 1) if rates else None
        return {
            "topic": name,
            "partitions": rows,
            "lag": self.topic_lags(name),
            "partition_count": len(keys),
            "from": first,
            "rate": self.rates.rates(name),
            "db": self.db_parts is not None,
        }

    def topic_lags(self, name: str, charted: int = 8) -> list[dict[str, Any]]:
        """Per group consuming the topic (the ``charted`` most lagging now): its lag on
        the topic's partitions summed, over the charts' sample times."""
        out = []
        for g in self.snap.get("groups", []):
            parts = [p for p in g["partitions"] if p["topic"] == name and p["lag"] is not None]
            if not parts:
                continue
            summed: dict[float, float] = {}
            for p in parts:
                for t, lag in self.part_lags.points(_series(g["group"], name, p["partition"])):
                    summed[t] = summed.get(t, 0.0) + lag
            out.append({"group": g["group"], "now": sum(p["lag"] for p in parts), "points": sorted(summed.items())})
        out.sort(key=lambda x: -x["now"])
        return out[:charted]

    def group(self, name: str, charted: int = 8, first: int = 0) -> dict[str, Any] | None:
        """The group page: the group (PARTITION_PAGE of its partitions from the
        ``first``; ``partition_count`` is whole), its summed lag over time, and the
        lag over time of its ``charted`` most lagging partitions."""
        for g in self.snap.get("groups", []):
            if g["group"] == name:
                first = max(0, min(first, len(g["partitions"]) - 1))
                page = {
                    "partitions": g["partitions"][first : first + PARTITION_PAGE],
                    "partition_count": len(g["partitions"]),
                    "from": first,
                }
                top = sorted((p for p in g["partitions"] if p["lag"] is not None), key=lambda p: -p["lag"])
                history = [
                    {
                        "topic": p["topic"],
                        "partition": p["partition"],
                        "points": self.part_lags.points(_series(name, p["topic"], p["partition"])),
                    }
                    for p in top[:charted]
                ]
                return {**g, **page, "history": self.lags.points(name), "partition_history": history}
        return None

    def mesh(self) -> dict[str, Any]:
        """The picture: one box per store and per (topic, producers) and (group, members),
        links store -- topic where the store told a head of the topic, group -- topic."""
        boxes: list[dict[str, Any]] = []
        links: set[tuple[str, str]] = set()
        kinds = {n["address"]: n["kind"] for n in self.snap["nodes"]}
        producers: dict[str, set[str]] = {}
        for p in self.snap["partitions"]:
            if p["producer_alive"]:
                producers.setdefault(p["topic"], set()).add(p["partition"])
            for s in p["stores"]:
                links.add(("store:" + s["address"], "topic:" + p["topic"]))
        for n in self.snap["nodes"]:
            if n["kind"] == "store" and n["alive"]:
                boxes.append({"id": "store:" + n["address"], "kind": "store", "label": n["address"][:8], "members": [n["address"]]})
        for topic in sorted({p["topic"] for p in self.snap["partitions"]}):
            members = sorted(producers.get(topic, ()))
            boxes.append({"id": "topic:" + topic, "kind": "producer", "label": topic, "members": members})
        grouped: set[str] = set()
        for g in self.snap.get("groups", []):
            members = [m["address"] for m in g["members"]]
            grouped.update(members)
            boxes.append({"id": "group:" + g["group"], "kind": "consumer", "label": g["group"], "members": members})
            for topic in sorted({t for m in g["members"] for t in m["topics"]}):
                links.add(("topic:" + topic, "group:" + g["group"]))
        loose = [a for a, k in kinds.items() if k == "consumer" and a not in grouped]
        if loose:
            boxes.append({"id": "consumers", "kind": "consumer", "label": "consumers", "members": sorted(loose)})
        ids = {b["id"] for b in boxes}
        return {"boxes": boxes, "links": sorted([a, b] for a, b in links if a in ids and b in ids)}


# ---------------------------------------------------------------- records


def _cut(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit], True)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=repr)


def show_bytes(data: bytes, fmt: str = "auto", limit: int = SHOWN_BYTES) -> dict[str, Any]:
    """One record content (or key) as the browser shows it: ``as`` says how it was
    read (text, json, msgpack, hex), ``truncated`` that only ``limit`` characters
    (hex: bytes) of it are sent.  Never raises on any bytes."""
    if fmt not in FORMATS:
        fmt = "auto"
    as_: str | None = None
    text = ""
    if fmt in ("auto", "text", "json"):
        try:
            decoded = data.decode("utf-8")
        except UnicodeDecodeError:
            decoded = None
        if decoded is not None and fmt in ("auto", "json"):
            try:
                text, as_ = _json_text(json.loads(decoded)), "json"
            except (ValueError, RecursionError):
                pass
        if as_ is None and decoded is not None and fmt != "json":
            printable = all(c.isprintable() or c in "\t\r\n" for c in decoded[:limit])
            if printable or fmt == "text":
                text, as_ = decoded, "text"
    if as_ is None and fmt in ("auto", "msgpack"):
        try:
            value = msgpack.unpackb(data, raw=False, strict_map_key=False)
            if fmt == "msgpack" or isinstance(value, dict | list):
                text, as_ = _json_text(value), "msgpack"
        except Exception:  # noqa: BLE001 (any malformed input: show it as hex)
            pass
    if as_ is None:
        cut = data[:limit]
        return {"as": "hex", "text": cut.hex(" "), "truncated": len(data) > limit, "size": len(data)}
    shown, truncated = _cut(text, limit)
    return {"as": as_, "text": shown, "truncated": truncated, "size": len(data)}


def offset_at_time(read_one: Callable[[int], tuple[int, int] | None], first: int, last: int, ts_ms: int) -> int:
    """The first offset of ``first..last`` whose record is stamped ``ts_ms`` or later
    (``last + 1`` if none), by bisection: ``read_one(offset)`` gives the (offset,
    timestamp) of the record held at or after ``offset``, or None past the end.
    In a hole the answer may be an offset of the hole (reading from it gives the
    record).  Timestamps are taken to grow with offsets (a producer's clock going
    back makes the answer one of the offsets around the jump).  At most 64 reads."""
    lo, hi = first, last + 1
    for _ in range(64):
        if lo >= hi:
            break
        mid = (lo + hi) // 2
        got = read_one(mid)
        if got is None:
            hi = mid
        elif got[1] < ts_ms:
            lo = got[0] + 1
        else:
            hi = mid  # the offsets from mid to got[0] are holes or this record
    return lo


def show_record(offset: int, ts_ms: int | None, key: bytes | None, content: bytes, fmt: str) -> dict[str, Any]:
    """A record as the browser shows it (``ts_ms`` and ``key`` None: not known, as over the mesh)."""
    return {
        "offset": offset,
        "ts_ms": ts_ms,
        "key": None if key is None else show_bytes(key, "auto", 256),
        "content": show_bytes(content, fmt),
    }


# ---------------------------------------------------------------- records over the mesh

FETCH_CHUNK = 8  # records a FETCH asks for at most (fewer when records are big)
FETCH_RETRY = 0.5  # seconds without the records asked before asking again
FETCH_TIMEOUT = 5.0  # seconds a page of records is waited for at most
PAGE_BYTES = 8 << 20  # record contents a page reads at most (also with --db)


class PageFetch:
    """One page of the record browser read over the mesh, as a consumer reads a
    partition: FETCH ``[start, start + limit)`` a few records at a time from the
    stores (and the producer's unacknowledged buffer), keep each record as it is
    shown (cut at SHOWN_BYTES: the content itself is not kept), and stop at the
    whole page, at ``max_bytes`` of contents read, or at the deadline (a store that
    never answers: the page is what came).  Records outside what was asked, and
    copies (several stores answer), are dropped.  Sans-IO: :meth:`asks` says what
    to FETCH, :meth:`on_record` takes what came; times are passed in."""

    def __init__(
        self,
        topic: str,
        partition: str,
        start: int,
        limit: int,
        fmt: str,
        now: float,
        *,
        max_bytes: int = PAGE_BYTES,
        timeout: float = FETCH_TIMEOUT,
        chunk: int = FETCH_CHUNK,
        retry: float = FETCH_RETRY,
    ) -> None:
        self.topic, self.partition, self.fmt = topic, partition, fmt
        self.start = start
        self.end = start + max(1, limit)  # exclusive
        self.max_bytes = max_bytes
        self.deadline = now + timeout
        self.chunk = max(1, chunk)
        self.retry = retry
        self.records: dict[int, dict[str, Any]] = {}
        self._sizes: dict[int, int] = {}  # offset -> its content's length
        self.bytes = 0  # contents read (first copies)
        # Contents of the records below ``next``: the byte bound ends the page on these only,
        # so that a page cut short never leaves out records it did not wait for (later
        # records may come first: another store's or the producer's answer).
        self.prefix_bytes = 0
        self.asked_to = start  # offsets below it were asked for
        self.next = start  # the first offset not read (all below it were)
        self.asked_at = -1e18
        self.why: str | None = None  # once done: "complete", "bytes" or "timeout"

    @property
    def done(self) -> bool:
        return self.why is not None

    def asks(self, now: float) -> list[tuple[int, int]]:
        """The FETCHes (first offset, count) to send now; ends the page at its deadline."""
        if self.why is not None:
            return []
        if now >= self.deadline:
            self.why = "timeout"
            return []
        if self.next >= self.asked_to:  # all asked came: ask the next few
            count = min(self._chunk(), self.end - self.asked_to)
            first = self.asked_to
            self.asked_to += count
            self.asked_at = now
            return [(first, count)]
        if now - self.asked_at >= self.retry:  # lost, or a store slow: ask again for what is missing
            self.asked_at = now
            return [(self.next, self.asked_to - self.next)]
        return []

    def _chunk(self) -> int:
        if not self.records:
            return self.chunk
        average = max(1, self.bytes // len(self.records))
        return max(1, min(self.chunk, (self.max_bytes - self.bytes) // average))

    def on_record(self, offset: int, content: bytes) -> None:
        if self.why is not None or not self.start <= offset < self.asked_to or offset in self.records:
            return
        self.records[offset] = show_record(offset, None, None, content, self.fmt)
        self._sizes[offset] = len(content)
        self.bytes += len(content)
        while self.next in self.records:
            self.prefix_bytes += self._sizes[self.next]
            self.next += 1
        if self.next >= self.end:
            self.why = "complete"
        elif self.prefix_bytes >= self.max_bytes:
            self.why = "bytes"

    def result(self, first: int | None, last: int | None) -> dict[str, Any]:
        """The page, as ``/api/records`` answers (``first``/``last``: what the mesh tells of the partition)."""
        offsets = sorted(self.records)
        if self.why == "bytes":  # cut at the bound: the next page goes on from the first record not shown
            offsets = [o for o in offsets if o < self.next]
        shown_to = offsets[-1] + 1 if offsets else self.start
        return {
            "topic": self.topic,
            "partition": self.partition,
            "first": first,
            "last": last,
            "offset": self.start,
            "next": shown_to,  # where the next page starts
            "limit": self.end - self.start,
            "cut": self.why == "bytes",
            "timed_out": self.why == "timeout",
            "missing": (shown_to - self.start) - len(offsets),  # offsets in the page not read (holes)
            "source": "mesh",
            "records": [self.records[o] for o in offsets],
        }
