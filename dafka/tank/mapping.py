"""Which Tank partition id stands for which Dafka partition, persisted.

A Tank topic is a Dafka topic.  Every Dafka partition (a producer address) of
a topic gets a stable Tank partition id (u16):

* ``CreateTopic(T, N)`` makes N partitions the gateway itself writes
  ("owned"), ids 0..N-1, each with a fresh producer address;
* every other producer's partition gets the next free id of its topic, in the
  order the gateway first sees it.

Ids are never reused or renumbered.  The map is a plain object; the gateway
makes each new partition durable (:meth:`PartitionMap.sync`: a line appended
to a journal beside the map, ``tank-partitions.json.journal``, and fsync'ed)
before anything that depends on the new id is answered, so a new topic costs
the same however many there are.  At start the gateway writes the whole map
(:meth:`PartitionMap.save`, an atomic replace + fsync) and drops the journal.
Loading reads the map, then the journal; a last journal line cut short by a
crash is left out (it was never acknowledged: its fsync had not returned).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dafka.errors import DafkaError

log = logging.getLogger("dafka.gateway")

#: Ids run 0..0xFFFE: 0xFFFF marks an unknown topic in consume answers.
MAX_PARTITIONS = 0xFFFF
#: The read-only topic whose records list the map (see the gateway docs).
PARTITIONS_TOPIC = "__dafka_partitions"
FORMAT_VERSION = 1
FILE_NAME = "tank-partitions.json"
#: Appended to the map's path: the journal of the partitions added since it was written.
JOURNAL_SUFFIX = ".journal"


@dataclass(frozen=True, slots=True)
class TankPartition:
    """One Tank partition: ``topic``/``pid`` is the Dafka partition ``address``."""

    topic: str
    pid: int
    address: str
    owned: bool  # written by this gateway (CreateTopic), else by a mesh producer

    def describe(self) -> bytes:
        """The JSON value of this partition's record in :data:`PARTITIONS_TOPIC`."""
        return json.dumps(
            {"topic": self.topic, "partition": self.pid, "address": self.address, "owned": self.owned},
            sort_keys=True,
        ).encode()


class MappingError(DafkaError):
    """The saved map cannot be read."""


def shown(name: str) -> str:
    """A name as log lines show it: escaped when it holds a newline or another
    character that is not printable (a name cannot forge a log line)."""
    if name.isprintable():
        return name
    return repr(name)[1:-1]


def valid_topic_name(name: str) -> bool:
    """A topic a Tank client may create: 1..255 UTF-8 bytes, no NUL, not reserved."""
    raw = name.encode()
    return 0 < len(raw) <= 255 and b"\0" not in raw and not name.startswith("__")


class PartitionMap:
    """Topic -> partitions by id, and (topic, address) -> partition."""

    def __init__(self) -> None:
        self._topics: dict[str, list[TankPartition]] = {}
        self._by_address: dict[tuple[str, str], TankPartition] = {}
        #: Every partition in the order ids were given (the PARTITIONS_TOPIC records).
        self.order: list[TankPartition] = []
        self._full: set[str] = set()
        #: How many of ``order`` are durable (in the map file or its journal).
        self.saved = 0

    # ---------------------------------------------------------------- queries

    def topics(self) -> list[str]:
        return list(self._topics)

    @property
    def by_topic(self) -> dict[str, list[TankPartition]]:
        """Each topic's partitions by id (the map's own: read, never changed)."""
        return self._topics

    def partitions(self, topic: str) -> list[TankPartition] | None:
        """The partitions of ``topic`` by id, or None for an unknown topic."""
        return self._topics.get(topic)

    def get(self, topic: str, pid: int) -> TankPartition | None:
        parts = self._topics.get(topic)
        if parts is None or pid >= len(parts):
            return None
        return parts[pid]

    def lookup(self, topic: str, address: str) -> TankPartition | None:
        return self._by_address.get((topic, address))

    def owned(self) -> Iterator[TankPartition]:
        return (p for p in self.order if p.owned)

    def __len__(self) -> int:
        return len(self.order)

    # ---------------------------------------------------------------- changes

    def add(self, topic: str, address: str, owned: bool = False) -> TankPartition | None:
        """Give (topic, address) the next id of its topic (None: the topic is full).

        Returns the existing partition if it has one already.
        """
        known = self._by_address.get((topic, address))
        if known is not None:
            return known
        parts = self._topics.setdefault(topic, [])
        if len(parts) >= MAX_PARTITIONS:
            if topic not in self._full:
                self._full.add(topic)
                log.error("topic %s has %d partitions: later ones get no Tank id", topic, len(parts))
            return None
        part = TankPartition(topic, len(parts), address, owned)
        parts.append(part)
        self._by_address[(topic, address)] = part
        self.order.append(part)
        return part

    def create_topic(self, topic: str, count: int, new_address: Callable[[], str]) -> bool:
        """Create ``topic`` with ``count`` owned partitions; False if the topic exists."""
        if topic in self._topics:
            return False
        if not 0 < count <= MAX_PARTITIONS:
            raise ValueError(f"a topic has 1..{MAX_PARTITIONS} partitions, not {count}")
        for _ in range(count):
            self.add(topic, new_address(), owned=True)
        return True

    # ---------------------------------------------------------------- persistence

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_VERSION,
                "partitions": [self._entry(p) for p in self.order],
            },
            indent=1,
        )

    @staticmethod
    def _entry(p: TankPartition) -> dict[str, object]:
        return {"topic": p.topic, "id": p.pid, "address": p.address, "owned": p.owned}

    def _replay(self, entry: object) -> None:
        if not isinstance(entry, dict):
            raise MappingError(f"partition map entry {entry!r} is not an object")
        topic, address, owned = str(entry["topic"]), str(entry["address"]), bool(entry["owned"])
        known = self.lookup(topic, address)
        part = known if known is not None else self.add(topic, address, owned)
        if part is None or part.pid != int(entry["id"]):
            raise MappingError(f"partition map entry {entry} is out of order")

    @classmethod
    def from_json(cls, text: str) -> PartitionMap:
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT_VERSION:
                raise MappingError(f"partition map format {doc.get('format')!r} is not {FORMAT_VERSION}")
            pmap = cls()
            for entry in doc["partitions"]:
                pmap._replay(entry)
            pmap.saved = len(pmap.order)
            return pmap
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MappingError(f"cannot read the partition map: {exc}") from exc

    def save(self, path: str) -> None:
        """Write atomically and durably: a crash leaves the old or the new map.  The journal
        goes after (a crash before that replays entries the map holds: they are skipped)."""
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:
            os.unlink(path + JOURNAL_SUFFIX)
        except FileNotFoundError:
            pass
        _fsync_dir(path)
        self.saved = len(self.order)

    def sync(self, path: str) -> None:
        """Make the partitions added since the last save or sync durable: appended to the
        journal, one JSON line each, and fsync'ed (the cost of what is new, not of the map)."""
        new = self.order[self.saved :]
        if not new:
            return
        journal = path + JOURNAL_SUFFIX
        created = not os.path.exists(journal)
        with open(journal, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(self._entry(p)) + "\n" for p in new))
            f.flush()
            os.fsync(f.fileno())
        if created:
            _fsync_dir(path)
        self.saved = len(self.order)

    @classmethod
    def load(cls, path: str) -> PartitionMap:
        """The map saved at ``path`` and its journal, or an empty one if there is none yet."""
        try:
            with open(path, encoding="utf-8") as f:
                pmap = cls.from_json(f.read())
        except FileNotFoundError:
            pmap = cls()
        try:
            with open(path + JOURNAL_SUFFIX, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return pmap
        # Every complete line ends with a newline: the last piece is "" or a line cut short.
        if lines[-1]:
            log.warning("partition map journal %s ends with a line cut short (a crash while it was"
                        " written): left out", path + JOURNAL_SUFFIX)
        for n, line in enumerate(lines[:-1], 1):
            try:
                pmap._replay(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise MappingError(f"partition map journal line {n}: {exc}") from exc
        pmap.saved = len(pmap.order)
        return pmap


def _fsync_dir(path: str) -> None:
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
