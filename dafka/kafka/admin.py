"""The Kafka admin API on a mesh, sans-IO: configs, partitions, records, groups, the cluster.

A mixin of :class:`~dafka.kafka.serving.KafkaServer` (its handlers take the
same arguments and return the same :class:`~dafka.kafka.serving.Outcome`).
What each request means on a mesh, where the gateway is one store among
others and producers own their partitions:

* **DescribeConfigs**: a topic's ``retention.ms`` / ``retention.bytes`` are
  this store's retention of the topic (``retention.bytes`` bounds the whole
  topic in this store, all partitions together, not each partition as in
  Kafka), ``max.message.bytes`` the node's ``max_record_bytes``,
  ``cleanup.policy`` and ``delete.retention.ms`` this store's compaction of
  the topic (:mod:`dafka.store.compaction`); the other keys frameworks look for carry
  Kafka's defaults, read-only.  The broker (``0``) shows the store's default
  retention and the gateway's settings.
* **AlterConfigs / IncrementalAlterConfigs**: only a topic's
  ``retention.ms``, ``retention.bytes``, ``cleanup.policy`` (``delete``,
  ``compact`` or ``compact,delete``) and ``delete.retention.ms`` change (kept
  in the gateway's database directory, applied by the store's retention and
  compaction; also at CreateTopics); any other key, and
  every broker key, is INVALID_CONFIG with a message naming it.
* **CreatePartitions**: new partitions are gateway-owned (as CreateTopics').
* **DeleteTopics**: TOPIC_DELETION_DISABLED, as a Kafka broker with
  ``delete.topic.enable=false``: other stores hold replicas, mesh producers
  own partitions, and a Kafka partition index must always name the same
  partition (the map is append-only).  DeleteRecords empties partitions.
* **DeleteRecords**: advances the start of a gateway-owned partition (the
  records below the offset are deleted from this store, as retention
  deletes); a mesh producer's partition is POLICY_VIOLATION.
* **ListGroups / DescribeGroups**: the groups the coordinator holds (with
  members); **DeleteGroups / OffsetDelete**: forget committed offsets in this
  store (other stores keep the copies the mesh COMMIT gave them: the Dafka
  wire has no message to delete a position); a group with members is
  NON_EMPTY_GROUP / GROUP_SUBSCRIBED_TO_TOPIC.
* **DescribeCluster**: one broker, node 0, also the controller.

Bounds: at most :data:`MAX_ADMIN_ITEMS` resources, topics or groups per
request (the rest answered POLICY_VIOLATION without work); config values of
at most :data:`MAX_CONFIG_VALUE` characters; DescribeGroups answers stop at
the Metadata answer budget (groups past it: POLICY_VIOLATION); DeleteRecords
deletes at most :data:`MAX_DELETE_RECORDS` records per request (in
transactions of :data:`DELETE_STEP`; a partition not done answers
REQUEST_TIMED_OUT with its start so far: ask again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dafka.kafka.codec import Err, N
from dafka.tank.mapping import shown

log = logging.getLogger("dafka.kafka")

#: Resources, topics or groups one admin request may name (the rest: POLICY_VIOLATION).
MAX_ADMIN_ITEMS = 1000
#: Characters of a config value set by AlterConfigs.
MAX_CONFIG_VALUE = 64
#: Groups known only by their committed offsets that ListGroups names (the coordinator's come too).
MAX_LISTED_GROUPS = 10_000
#: Records one DeleteRecords request deletes at most, over all its partitions.
MAX_DELETE_RECORDS = 200_000
#: ... in LMDB transactions of this many.
DELETE_STEP = 20_000

TOPIC, BROKER = 2, 4
# ConfigSource (KIP-226)
DYNAMIC_TOPIC, STATIC_BROKER, DEFAULT = 1, 4, 5
# ConfigType (KIP-336)
BOOLEAN, STRING, INT, LONG, LIST = 1, 2, 3, 5, 7
# IncrementalAlterConfigs operations
SET, DELETE = 0, 1

RETENTION_KEYS = ("retention.ms", "retention.bytes")
CLEANUP_KEYS = ("cleanup.policy", "delete.retention.ms")
#: The keys a topic's AlterConfigs and CreateTopics may set.
ALTERABLE_KEYS = RETENTION_KEYS + CLEANUP_KEYS
#: cleanup.policy values, as written -> as kept.
CLEANUP_POLICIES = {"delete": "delete", "compact": "compact", "compact,delete": "compact,delete",
                    "delete,compact": "compact,delete"}
_TOO_MANY = f"at most {MAX_ADMIN_ITEMS} items per request"

#: Kafka's defaults of topic keys frameworks read, read-only here: (value, type).
TOPIC_DEFAULTS: dict[str, tuple[str, int]] = {
    "compression.type": ("producer", STRING),
    "delete.retention.ms": ("86400000", LONG),
    "file.delete.delay.ms": ("60000", LONG),
    "flush.messages": ("9223372036854775807", LONG),
    "flush.ms": ("9223372036854775807", LONG),
    "index.interval.bytes": ("4096", INT),
    "max.compaction.lag.ms": ("9223372036854775807", LONG),
    "message.timestamp.type": ("CreateTime", STRING),
    "min.cleanable.dirty.ratio": ("0.5", 6),
    "min.compaction.lag.ms": ("0", LONG),
    "min.insync.replicas": ("1", INT),
    "preallocate": ("false", BOOLEAN),
    "segment.bytes": ("1073741824", INT),
    "segment.ms": ("604800000", LONG),
    "unclean.leader.election.enable": ("false", BOOLEAN),
}


def _retention_value(v: int | None) -> str:
    return "-1" if v is None else str(v)


def parse_retention(name: str, value: str | None) -> tuple[int | None, str | None]:
    """A retention key's value as the store keeps it (None: keep everything), or an error."""
    if value is None:
        return None, f"{name} needs a value"
    if len(value) > MAX_CONFIG_VALUE:
        return None, f"{name}: a value of {len(value)} characters"
    try:
        n = int(value.strip())
    except ValueError:
        return None, f"{name}={value[:MAX_CONFIG_VALUE]!r} is not an integer"
    if n == -1:
        return None, None
    if not 0 <= n < 1 << 63:
        return None, f"{name}={n}: -1 or 0..2^63-1"
    return n, None


def parse_cleanup(name: str, value: str | None) -> tuple[str | int | None, str | None]:
    """A ``cleanup.policy`` (normalized) or ``delete.retention.ms`` (ms) value, or an error."""
    if value is None:
        return None, f"{name} needs a value"
    if len(value) > MAX_CONFIG_VALUE:
        return None, f"{name}: a value of {len(value)} characters"
    if name == "cleanup.policy":
        policy = CLEANUP_POLICIES.get(value.replace(" ", "").lower())
        if policy is None:
            return None, f"cleanup.policy={value[:MAX_CONFIG_VALUE]!r}: delete, compact or compact,delete"
        return policy, None
    try:
        n = int(value.strip())
    except ValueError:
        return None, f"{name}={value[:MAX_CONFIG_VALUE]!r} is not an integer"
    if not 0 <= n < 1 << 63:
        return None, f"{name}={n}: 0..2^63-1"
    return n, None


class AdminHandlers:
    """The admin requests of :class:`~dafka.kafka.serving.KafkaServer` (a mixin)."""

    backend: Any
    coordinator: Any
    advertise: tuple[str, int]
    cluster_id: str
    auto_create: bool
    default_partitions: int
    max_partitions: int
    max_created: int
    max_record_bytes: int
    max_metadata_bytes: int
    _limited: Any

    if TYPE_CHECKING:  # KafkaServer's
        def _reply(self, corr: int, api_key: int, version: int, **fields: Any) -> Any: ...
        def _partitions_of(self, topic: str) -> Any: ...
        def _bounds(self, part: Any) -> tuple[int, int]: ...
        def drop_ahead(self, topic: str, address: str) -> None: ...

    # ---------------------------------------------------------------- configs

    def _topic_configs(self, topic: str) -> list[tuple[str, str, bool, int, int]]:
        """``(name, value, read only, source, type)`` of a topic's keys."""
        age, size, source = self.backend.topic_retention(topic)
        policy, tomb_ms, csource = self.backend.topic_cleanup(topic)
        max_bytes = min(self.max_record_bytes, (1 << 31) - 1)
        out = [
            ("cleanup.policy", policy, False, csource, LIST),
            ("delete.retention.ms", str(tomb_ms), False, csource, LONG),
            ("max.message.bytes", str(max_bytes), True, STATIC_BROKER, INT),
            ("retention.bytes", _retention_value(size), False, source, LONG),
            ("retention.ms", _retention_value(age), False, source, LONG),
        ]
        out.extend((k, v, True, DEFAULT, t) for k, (v, t) in TOPIC_DEFAULTS.items() if k != "delete.retention.ms")
        return out

    def _broker_configs(self) -> list[tuple[str, str, bool, int, int]]:
        age, size = self.backend.default_retention()
        source = DEFAULT if age is None and size is None else STATIC_BROKER
        return [
            ("auto.create.topics.enable", str(self.auto_create).lower(), True, STATIC_BROKER, BOOLEAN),
            ("broker.id", "0", True, STATIC_BROKER, INT),
            ("default.replication.factor", "1", True, DEFAULT, INT),
            ("delete.topic.enable", "false", True, STATIC_BROKER, BOOLEAN),
            ("group.max.session.timeout.ms", "300000", True, STATIC_BROKER, INT),
            ("group.min.session.timeout.ms", "100", True, STATIC_BROKER, INT),
            ("log.cleanup.policy", "delete", True, DEFAULT, LIST),
            ("log.retention.bytes", _retention_value(size), True, source, LONG),
            ("log.retention.ms", _retention_value(age), True, source, LONG),
            ("message.max.bytes", str(min(self.max_record_bytes, (1 << 31) - 1)), True, STATIC_BROKER, INT),
            ("min.insync.replicas", "1", True, DEFAULT, INT),
            ("num.partitions", str(self.default_partitions), True, STATIC_BROKER, INT),
            ("offsets.topic.replication.factor", "1", True, DEFAULT, INT),
            ("transaction.state.log.replication.factor", "1", True, DEFAULT, INT),
        ]

    def _resource_error(self, rtype: int, name: str) -> tuple[int, str | None]:
        """The error of a config resource the gateway does not have (NONE: it has it)."""
        if rtype == TOPIC:
            if self._partitions_of(name) is None:
                return Err.UNKNOWN_TOPIC_OR_PARTITION, f"no topic {name[:100]}"
            return Err.NONE, None
        if rtype == BROKER:
            if name not in ("", "0"):
                return Err.INVALID_REQUEST, "this gateway is broker 0, the only one"
            return Err.NONE, None
        return Err.INVALID_REQUEST, f"resource type {rtype}: topics (2) and brokers (4) only"

    def _describe_configs(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        results = []
        for i, r in enumerate(req.resources):
            base = {"resource_type": r.resource_type, "resource_name": r.resource_name}
            if i >= MAX_ADMIN_ITEMS:
                results.append(N(error_code=Err.POLICY_VIOLATION, error_message=_TOO_MANY, configs=[], **base))
                continue
            code, msg = self._resource_error(r.resource_type, r.resource_name)
            if code:
                results.append(N(error_code=code, error_message=msg, configs=[], **base))
                continue
            entries = self._topic_configs(r.resource_name) if r.resource_type == TOPIC else self._broker_configs()
            wanted = None if r.configuration_keys is None else set(r.configuration_keys)
            configs = [
                N(name=k, value=val, read_only=ro, config_source=src, is_default=src == DEFAULT,
                  is_sensitive=False, synonyms=[], config_type=typ, documentation=None)
                for k, val, ro, src, typ in entries
                if wanted is None or k in wanted
            ]
            results.append(N(error_code=Err.NONE, error_message=None, configs=configs, **base))
        return self._reply(corr, 32, v, throttle_time_ms=0, results=results)

    def _alter(self, corr: int, api_key: int, v: int, req: Any, incremental: bool) -> Outcome_:
        responses = []
        for i, r in enumerate(req.resources):
            base = {"resource_type": r.resource_type, "resource_name": r.resource_name}
            if i >= MAX_ADMIN_ITEMS:
                responses.append(N(error_code=Err.POLICY_VIOLATION, error_message=_TOO_MANY, **base))
                continue
            code, msg = self._alter_one(r, incremental, req.validate_only)
            responses.append(N(error_code=code, error_message=msg, **base))
        return self._reply(corr, api_key, v, throttle_time_ms=0, responses=responses)

    def _alter_one(self, r: Any, incremental: bool, validate_only: bool) -> tuple[int, str | None]:
        code, msg = self._resource_error(r.resource_type, r.resource_name)
        if code:
            return code, msg
        if r.resource_type == BROKER:
            if not r.configs:
                return Err.NONE, None
            return Err.INVALID_CONFIG, (f"{r.configs[0].name[:100]}: broker configs are read-only on a dafka gateway"
                                        " (its configuration file sets them)")
        topic = r.resource_name
        age, size, source = self.backend.topic_retention(topic)
        policy, tomb_ms, _csource = self.backend.topic_cleanup(topic)
        if not incremental:  # AlterConfigs replaces every dynamic key: those not named go back
            age, size = self.backend.static_retention(topic)
            policy, tomb_ms = self.backend.static_cleanup(topic)
        changed = cleanup_changed = False
        for c in r.configs[:MAX_ADMIN_ITEMS]:
            if c.name not in ALTERABLE_KEYS:
                return Err.INVALID_CONFIG, (f"{c.name[:100]}: read-only on a dafka gateway (retention.ms,"
                                            " retention.bytes, cleanup.policy and delete.retention.ms can change)")
            op = c.config_operation if incremental else SET
            if op not in (SET, DELETE):
                return Err.INVALID_CONFIG, f"{c.name}: operation {op}: SET or DELETE only"
            if c.name in CLEANUP_KEYS:
                if op == DELETE:
                    static = self.backend.static_cleanup(topic)
                    cvalue: Any = static[CLEANUP_KEYS.index(c.name)]
                else:
                    cvalue, err = parse_cleanup(c.name, c.value)
                    if err is not None:
                        return Err.INVALID_CONFIG, err
                if c.name == "cleanup.policy":
                    policy = cvalue
                else:
                    tomb_ms = cvalue
                cleanup_changed = True
                continue
            if op == DELETE:
                value = self.backend.static_retention(topic)[RETENTION_KEYS.index(c.name) == 1]
            else:
                value, err = parse_retention(c.name, c.value)
                if err is not None:
                    return Err.INVALID_CONFIG, err
            if c.name == "retention.ms":
                age = value
            else:
                size = value
            changed = True
        if len(r.configs) > MAX_ADMIN_ITEMS:
            return Err.POLICY_VIOLATION, _TOO_MANY
        if validate_only:
            return Err.NONE, None
        try:
            if changed or not incremental:
                self.backend.set_topic_retention(topic, age, size)
            if cleanup_changed or not incremental:
                self.backend.set_topic_cleanup(topic, policy, tomb_ms)
        except OSError as exc:
            self._limited.emit(logging.ERROR, "config-failed", "cannot keep the configs of %s: %s",
                               shown(topic), exc)
            return Err.KAFKA_STORAGE_ERROR, f"cannot keep the config: {exc}"
        if changed or cleanup_changed or not incremental:
            log.info("topic %s: retention.ms=%s retention.bytes=%s cleanup.policy=%s delete.retention.ms=%s"
                     " (Kafka AlterConfigs)", shown(topic), _retention_value(age), _retention_value(size), policy,
                     tomb_ms)
        return Err.NONE, None

    def _alter_configs(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        return self._alter(corr, 33, v, req, incremental=False)

    def _incremental_alter_configs(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        return self._alter(corr, 44, v, req, incremental=True)

    # ---------------------------------------------------------------- topics

    def _create_partitions(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        results = []
        added = 0
        for i, t in enumerate(req.topics):
            parts = self._partitions_of(t.name)
            if i >= MAX_ADMIN_ITEMS or added >= self.max_created:
                code, msg = Err.THROTTLING_QUOTA_EXCEEDED, f"at most {self.max_created} topics grown per request"
            elif parts is None:
                code, msg = Err.UNKNOWN_TOPIC_OR_PARTITION, f"no topic {t.name[:100]}"
            elif t.count <= len(parts):
                code, msg = Err.INVALID_PARTITIONS, f"topic {t.name} has {len(parts)} partitions: ask for more"
            elif t.count > self.max_partitions:
                code, msg = Err.INVALID_PARTITIONS, f"at most {self.max_partitions} partitions"
            elif req.validate_only:
                code, msg = Err.NONE, None
            elif self.backend.add_partitions(t.name, t.count - len(parts)):
                added += 1
                code, msg = Err.NONE, None
            else:
                code, msg = Err.INVALID_PARTITIONS, "the gateway owns as many partitions as it may (max_owned_partitions)"
            results.append(N(name=t.name, error_code=code, error_message=msg))
        if added:
            self.backend.sync_topics()
        return self._reply(corr, 37, v, throttle_time_ms=0, results=results)

    def _delete_topics(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        out = []
        for i, name in enumerate(req.topic_names):
            if i >= MAX_ADMIN_ITEMS:
                code, msg = Err.POLICY_VIOLATION, _TOO_MANY
            elif self._partitions_of(name) is None:
                code, msg = Err.UNKNOWN_TOPIC_OR_PARTITION, f"no topic {name[:100]}"
            else:
                code, msg = Err.TOPIC_DELETION_DISABLED, (
                    "topics are not deleted on a mesh (other stores hold replicas, producers own partitions);"
                    " DeleteRecords empties the gateway's partitions")
            out.append(N(name=name, error_code=code, error_message=msg))
        return self._reply(corr, 20, v, throttle_time_ms=0, responses=out)

    def _delete_records(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        budget = [MAX_DELETE_RECORDS]
        items = 0
        topics = []
        for t in req.topics:
            parts = self._partitions_of(t.name)
            out = []
            for p in t.partitions:
                items += 1
                part = parts[p.partition_index] if parts and 0 <= p.partition_index < len(parts) else None
                if items > MAX_ADMIN_ITEMS:
                    code, low = Err.POLICY_VIOLATION, -1
                else:
                    code, low = self._delete_partition(part, p.offset, budget)
                out.append(N(partition_index=p.partition_index, low_watermark=low, error_code=code))
            topics.append(N(name=t.name, partitions=out))
        return self._reply(corr, 21, v, throttle_time_ms=0, topics=topics)

    def _delete_partition(self, part: Any, offset: int, budget: list[int]) -> tuple[int, int]:
        """``(error code, low watermark)`` of one partition of a DeleteRecords; ``budget``:
        records the request may still delete (lowered)."""
        if part is None:
            return Err.UNKNOWN_TOPIC_OR_PARTITION, -1
        if not part.owned:
            return Err.POLICY_VIOLATION, -1  # a mesh producer's partition: its stores keep it
        start, hwm = self._bounds(part)
        if hwm < 0:
            return Err.KAFKA_STORAGE_ERROR, -1
        if offset == -1:  # Kafka's "up to the high watermark"
            offset = hwm
        if not 0 <= offset <= hwm:
            return Err.OFFSET_OUT_OF_RANGE, start
        done = offset <= start
        if not done:
            # Batches read ahead for this partition may hold records this delete hides.
            self.drop_ahead(part.topic, part.address)
        while not done and budget[0] > 0:
            step = min(DELETE_STEP, budget[0])
            try:
                start, done = self.backend.delete_front(part.topic, part.address, offset, step)
            except Exception as exc:  # StorageError and LMDB errors
                self._limited.emit(logging.ERROR, "delete-failed", "cannot delete records of %s: %s",
                                   shown(part.topic), exc)
                return Err.KAFKA_STORAGE_ERROR, -1
            budget[0] -= step
        if not done:
            return Err.REQUEST_TIMED_OUT, start
        low = max(start, offset)
        log.info("partition %d of %s starts at %d (Kafka DeleteRecords)", part.pid, shown(part.topic), low)
        return Err.NONE, low

    # ---------------------------------------------------------------- groups

    def _group_state(self, group_id: str) -> Any:
        return self.coordinator.groups.get(group_id)

    def _list_groups(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        states = {s.lower() for s in req.states_filter} if v >= 4 and req.states_filter else None
        types = {s.lower() for s in req.types_filter} if v >= 5 and req.types_filter else None
        listed: dict[str, tuple[str, str]] = {
            g.group_id: (g.protocol_type or "", g.state) for g in self.coordinator.groups.values()
        }
        # Groups known by their committed offsets alone (no member now) are Empty, as in Kafka.
        try:
            stored = self.backend.position_groups(MAX_LISTED_GROUPS)
        except Exception as exc:
            self._limited.emit(logging.ERROR, "list-groups", "cannot list the groups with offsets: %s", exc)
            stored = []
        for gid in stored:
            listed.setdefault(gid, ("consumer", "Empty"))
        groups = []
        for gid, (ptype, state) in listed.items():
            if states is not None and state.lower() not in states:
                continue
            if types is not None and "classic" not in types:
                continue
            groups.append(N(group_id=gid, protocol_type=ptype, group_state=state, group_type="classic"))
        return self._reply(corr, 16, v, throttle_time_ms=0, error_code=Err.NONE, groups=groups)

    def _describe_groups(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        budget = self.max_metadata_bytes
        out = []
        for i, gid in enumerate(req.groups):
            g = self.coordinator.groups.get(gid)
            if i >= MAX_ADMIN_ITEMS:
                out.append(self._described(gid, Err.POLICY_VIOLATION, "Dead", "", "", []))
                continue
            if g is None:
                state = "Empty" if self._has_offsets(gid) else "Dead"
                out.append(self._described(gid, Err.NONE, state, "consumer" if state == "Empty" else "", "", []))
                continue
            cost = 64 + len(gid) + sum(
                64 + len(m.member_id) + len(m.client_id) + len(m.assignment)
                + len(next((md for n, md in m.protocols if n == g.protocol), b""))
                for m in g.members.values()
            )
            if cost > budget:
                out.append(self._described(gid, Err.POLICY_VIOLATION, g.state, "", "", []))
                continue
            budget -= cost
            members = [
                N(member_id=m.member_id, group_instance_id=None, client_id=m.client_id,
                  client_host=m.client_host or "",
                  member_metadata=next((md for n, md in m.protocols if n == g.protocol), b"")
                  if g.state == "Stable" or g.state == "CompletingRebalance" else b"",
                  member_assignment=m.assignment if g.state == "Stable" else b"")
                for m in g.members.values()
            ]
            out.append(self._described(gid, Err.NONE, g.state, g.protocol_type or "",
                                       (g.protocol or "") if g.state == "Stable" else "", members))
        return self._reply(corr, 15, v, throttle_time_ms=0, groups=out)

    def _has_offsets(self, gid: str) -> bool:
        try:
            return bool(self.backend.positions(gid))
        except Exception:  # a name no key can hold, storage errors: none readable
            return False

    @staticmethod
    def _described(gid: str, code: int, state: str, ptype: str, proto: str, members: list[Any]) -> Any:
        return N(error_code=code, error_message=None, group_id=gid, group_state=state, protocol_type=ptype,
                 protocol_data=proto, members=members, authorized_operations=None)

    def _delete_groups(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        results = []
        for i, gid in enumerate(req.groups_names):
            if i >= MAX_ADMIN_ITEMS:
                code = Err.POLICY_VIOLATION
            else:
                code = self._delete_group(gid)
            results.append(N(group_id=gid, error_code=code))
        return self._reply(corr, 42, v, throttle_time_ms=0, results=results)

    def _delete_group(self, gid: str) -> int:
        g = self.coordinator.groups.get(gid)
        if g is not None and g.members:
            return Err.NON_EMPTY_GROUP
        try:
            removed = self.backend.delete_positions(gid, None)
        except ValueError:
            return Err.INVALID_GROUP_ID  # a name no key can hold
        except Exception as exc:
            self._limited.emit(logging.ERROR, "delete-group", "cannot delete group %s: %s", shown(gid), exc)
            return Err.KAFKA_STORAGE_ERROR
        if g is None and not removed:
            return Err.GROUP_ID_NOT_FOUND
        self.coordinator.groups.pop(gid, None)
        log.info("group %s deleted: %d committed offsets forgotten (Kafka DeleteGroups)", shown(gid), removed)
        return Err.NONE

    def _offset_delete(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        g = self.coordinator.groups.get(req.group_id)
        live = g is not None and bool(g.members)
        if g is None and not self._has_offsets(req.group_id):
            return self._reply(corr, 47, v, throttle_time_ms=0, error_code=Err.GROUP_ID_NOT_FOUND, topics=[])
        keys: list[tuple[str, str]] = []
        topics = []
        items = 0
        for t in req.topics:
            parts = self._partitions_of(t.name)
            out = []
            for p in t.partitions:
                items += 1
                part = parts[p.partition_index] if parts and 0 <= p.partition_index < len(parts) else None
                if items > MAX_ADMIN_ITEMS:
                    code = Err.POLICY_VIOLATION
                elif part is None:
                    code = Err.UNKNOWN_TOPIC_OR_PARTITION
                elif live:
                    code = Err.GROUP_SUBSCRIBED_TO_TOPIC  # while it has members, not checked topic by topic
                else:
                    code = Err.NONE
                    keys.append((part.topic, part.address))
                out.append(N(partition_index=p.partition_index, error_code=code))
            topics.append(N(name=t.name, partitions=out))
        top = Err.NONE
        if keys:
            try:
                self.backend.delete_positions(req.group_id, keys)
            except ValueError:
                top = Err.INVALID_GROUP_ID
            except Exception as exc:
                self._limited.emit(logging.ERROR, "offset-delete", "cannot delete offsets of group %s: %s",
                                   shown(req.group_id), exc)
                top = Err.KAFKA_STORAGE_ERROR
        return self._reply(corr, 47, v, throttle_time_ms=0, error_code=top, topics=topics)

    # ---------------------------------------------------------------- cluster

    def _describe_cluster(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome_:
        host, port = self.advertise
        return self._reply(
            corr, 60, v, throttle_time_ms=0, error_code=Err.NONE, error_message=None, endpoint_type=1,
            cluster_id=self.cluster_id, controller_id=0,
            brokers=[N(broker_id=0, host=host, port=port, rack=None, is_fenced=False)],
            authorized_operations=None,
        )


Outcome_ = Any  # serving.Outcome (imported there; kept loose here to avoid a cycle)
