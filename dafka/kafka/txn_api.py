"""The Kafka transaction requests (KIP-98), sans-IO: a mixin of :class:`~dafka.kafka.serving.KafkaServer`.

FindCoordinator of key type 1 names the gateway; InitProducerId with a
transactional id, AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit and
EndTxn go to the :class:`~dafka.kafka.txn.TxnCoordinator`.  TxnOffsetCommit v3+ names the
consumer's member id and generation (KIP-447): a member the group does not have, or of
another generation, is refused (UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION) as an OffsetCommit is.  Every change of
its state is journalled by the backend (:meth:`txn_log`, fsync'ed) before
the gateway acts on it: before records of a transaction are queued, before
markers are written, before an answer goes.

EndTxn writes one control record (a marker) in each partition of the
transaction, at an offset of its own as in Kafka; its answer waits until
every marker is committed (as a produce's does), and the transaction is
complete then.  A commit makes the transaction's TxnOffsetCommit offsets the
group's committed offsets (and sends them to the mesh, as OffsetCommit does)
when it is decided, before its markers are written.

Fencing errors: PRODUCER_FENCED for the request versions that know it
(KIP-588), INVALID_PRODUCER_EPOCH before them.

Bounds: the coordinator's (ids, partitions, groups, offsets, ranges, aborted
ranges, timeout); :data:`MAX_TIDS_PER_CONNECTION` transactional ids
initialised per connection; :data:`MAX_TXN_TOPICS` topics and
:data:`MAX_TXN_REQUEST_PARTITIONS` partitions per request (the rest refused
without work).
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from dafka.kafka.codec import Err, N
from dafka.kafka.outcome import Outcome
from dafka.kafka.txn import EndPlan, Key, TxnCoordinator
from dafka.tank.mapping import shown

log = logging.getLogger("dafka.kafka")

#: Transactional ids one connection may initialise (a client has one, or a few).
MAX_TIDS_PER_CONNECTION = 64
#: Topics, and partitions over them, one AddPartitionsToTxn or TxnOffsetCommit may name.
MAX_TXN_TOPICS = 1000
MAX_TXN_REQUEST_PARTITIONS = 10_000
#: Bytes of a group id in AddOffsetsToTxn / TxnOffsetCommit (the store's name slot).
MAX_GROUP_BYTES = 255

#: The first version of each request that knows PRODUCER_FENCED (older: INVALID_PRODUCER_EPOCH).
_FENCED_FROM = {22: 4, 24: 2, 25: 2, 26: 2, 28: 3}


def _fenced(code: int, api_key: int, v: int) -> int:
    if code == Err.PRODUCER_FENCED and v < _FENCED_FROM[api_key]:
        return Err.INVALID_PRODUCER_EPOCH
    return code


class TxnHandlers:
    """The transaction requests of :class:`~dafka.kafka.serving.KafkaServer` (a mixin)."""

    backend: Any
    coordinator: Any
    txn: TxnCoordinator
    _producers: Any
    _conn_tids: dict[Any, set[str]]
    _limited: Any

    if TYPE_CHECKING:  # KafkaServer's
        def _reply(self, corr: int, api_key: int, version: int, **fields: Any) -> Outcome: ...
        def _partitions_of(self, topic: str) -> Any: ...
        def _set_producer_state(self, pid: int, epoch: int) -> None: ...

    # ---------------------------------------------------------------- helpers

    def _txn_flush(self) -> None:
        """Make the coordinator's new journal records durable (before acting on them)."""
        recs = self.txn.take_journal()
        if recs:
            self.backend.txn_log(recs)

    def _owned_key(self, topic: str, index: int) -> tuple[int, Key | None]:
        parts = self._partitions_of(topic)
        part = parts[index] if parts and 0 <= index < len(parts) else None
        if part is None:
            return Err.UNKNOWN_TOPIC_OR_PARTITION, None
        if not part.owned:
            return Err.POLICY_VIOLATION, None  # a mesh producer writes it
        return Err.NONE, (part.topic, part.address)

    def run_plan(self, plan: EndPlan, recovering: bool = False) -> dict[Key, int]:
        """Carry out an end of transaction: journal it, make a commit's offsets the groups',
        write the markers.  Returns the marker offsets (for an answer to wait on)."""
        markers = {k: self.backend.next_offset(*k) for k in plan.keys}
        if recovering:
            self.txn.remark(plan, markers)
        else:
            self.txn.ending(plan, markers)
        self._txn_flush()
        for group, held in plan.offsets.items():
            if not held:
                continue
            try:
                self.backend.put_positions(group, held)
                self.backend.broadcast_positions(group, held)
            except Exception as exc:  # the transaction stands; its offsets are logged lost
                self._limited.emit(logging.ERROR, "txn-offsets", "cannot commit the offsets of group %s"
                                   " of transaction %s: %s", shown(group), shown(plan.tid), exc)
        for key in plan.keys:
            got = self.backend.append_marker(key, plan.pid, plan.epoch, plan.commit)
            if got != markers[key]:  # the journal said another offset: a bug, loudly
                log.error("transaction %s: marker of %s at %d, journalled at %d", shown(plan.tid), key,
                          got, markers[key])
        if not plan.keys:
            self._txn_flush()
        return markers

    def txn_tick(self, now: float) -> None:
        for plan in self.txn.tick(now):
            log.warning("transaction %s timed out: aborted, its producer fenced", shown(plan.tid))
            self.run_plan(plan)

    def txn_committed(self, heads: dict[Key, int]) -> None:
        if self.txn.committed(heads):
            self._txn_flush()

    def txn_recover(self, heads: dict[Key, int], now: float) -> None:
        """At start, after the journal's replay."""
        plans = self.txn.recover(heads, now)
        self._txn_flush()
        for plan in plans:
            if plan.keys:
                log.info("transaction %s: %d markers written again after a restart", shown(plan.tid), len(plan.keys))
                self.run_plan(plan, recovering=True)
            elif plan.offsets:  # a commit decided before the restart: its offsets again (idempotent)
                for group, held in plan.offsets.items():
                    try:
                        self.backend.put_positions(group, held)
                    except Exception as exc:
                        log.error("cannot commit the offsets of group %s: %s", shown(group), exc)
        self.txn_committed(heads)

    def forget_connection(self, conn: Any) -> None:
        self._conn_tids.pop(conn, None)

    # ---------------------------------------------------------------- InitProducerId

    def _init_transactional(self, token: Any, v: int, corr: int, req: Any, now: float) -> Outcome:
        tid = req.transactional_id
        conn = getattr(token, "conn", token)
        mine = self._conn_tids.setdefault(conn, set())
        if tid not in mine and len(mine) >= MAX_TIDS_PER_CONNECTION:
            self._limited.warning("txn-ids", "a Kafka connection asked for more than %d transactional ids",
                                  MAX_TIDS_PER_CONNECTION)
            return self._reply(corr, 22, v, throttle_time_ms=0, error_code=Err.POLICY_VIOLATION,
                               producer_id=-1, producer_epoch=-1)
        pid_in = req.producer_id if v >= 3 else -1
        epoch_in = req.producer_epoch if v >= 3 else -1
        new_pid = secrets.randbits(63)
        while new_pid in self._producers or new_pid in self.txn.by_pid:
            new_pid = secrets.randbits(63)
        code, pid, epoch, plan = self.txn.init_producer(tid, req.transaction_timeout_ms, new_pid, now,
                                                        pid_in, epoch_in)
        self._txn_flush()
        if plan is not None:
            log.info("transaction %s: a new producer of its id aborts it", shown(tid))
            self.run_plan(plan)
        if code == Err.NONE:
            mine.add(tid)
            self._set_producer_state(pid, epoch)
        return self._reply(corr, 22, v, throttle_time_ms=0, error_code=_fenced(code, 22, v),
                           producer_id=pid, producer_epoch=epoch)

    # ---------------------------------------------------------------- AddPartitionsToTxn

    def _add_partitions_to_txn(self, token: Any, v: int, corr: int, cid: Any, req: Any,
                               now: float) -> Outcome:
        keys: list[Key] = []
        codes: list[tuple[str, list[tuple[int, int]]]] = []
        bad = False
        seen = 0
        for i, t in enumerate(req.v3_and_below_topics):
            out = []
            for index in t.partitions:
                seen += 1
                if i >= MAX_TXN_TOPICS or seen > MAX_TXN_REQUEST_PARTITIONS:
                    code, key = Err.POLICY_VIOLATION, None
                else:
                    code, key = self._owned_key(t.name, index)
                if key is None:
                    bad = True
                else:
                    keys.append(key)
                out.append((index, code))
            codes.append((t.name, out))
        if bad:
            top = Err.NONE
        else:
            top = self.txn.add_partitions(req.v3_and_below_transactional_id, req.v3_and_below_producer_id,
                                          req.v3_and_below_producer_epoch, keys, now)
            self._txn_flush()
        results = []
        for name, out in codes:
            parts = []
            for index, code in out:
                if bad:
                    code = code or Err.OPERATION_NOT_ATTEMPTED
                else:
                    code = _fenced(top, 24, v)
                parts.append(N(partition_index=index, partition_error_code=code))
            results.append(N(name=name, results_by_partition=parts))
        return self._reply(corr, 24, v, throttle_time_ms=0, results_by_topic_v3_and_below=results)

    # ---------------------------------------------------------------- AddOffsetsToTxn

    def _add_offsets_to_txn(self, token: Any, v: int, corr: int, cid: Any, req: Any,
                            now: float) -> Outcome:
        if not req.group_id or len(req.group_id.encode()) > MAX_GROUP_BYTES:
            code = Err.INVALID_GROUP_ID
        else:
            code = self.txn.add_offsets(req.transactional_id, req.producer_id, req.producer_epoch, req.group_id, now)
            self._txn_flush()
        return self._reply(corr, 25, v, throttle_time_ms=0, error_code=_fenced(code, 25, v))

    # ---------------------------------------------------------------- TxnOffsetCommit

    def _txn_offset_commit(self, token: Any, v: int, corr: int, cid: Any, req: Any,
                           now: float) -> Outcome:
        positions: dict[Key, int] = {}
        plan: list[tuple[str, list[tuple[int, int]]]] = []
        seen = 0
        for i, t in enumerate(req.topics):
            parts = self._partitions_of(t.name)
            out = []
            for p in t.partitions:
                seen += 1
                part = parts[p.partition_index] if parts and 0 <= p.partition_index < len(parts) else None
                if i >= MAX_TXN_TOPICS or seen > MAX_TXN_REQUEST_PARTITIONS:
                    out.append((p.partition_index, Err.POLICY_VIOLATION))
                elif part is None:
                    out.append((p.partition_index, Err.UNKNOWN_TOPIC_OR_PARTITION))
                elif p.committed_offset < 0:
                    out.append((p.partition_index, Err.INVALID_REQUEST))
                else:
                    positions[(part.topic, part.address)] = p.committed_offset
                    out.append((p.partition_index, -1))  # the transaction's answer
            plan.append((t.name, out))
        if not req.group_id or len(req.group_id.encode()) > MAX_GROUP_BYTES:
            code = Err.INVALID_GROUP_ID
        else:
            code = Err.NONE
            if v >= 3 and (req.generation_id >= 0 or req.member_id):
                # KIP-447: a consumer that lost its partitions (a zombie) cannot commit them.
                code = self.coordinator.check_member(req.group_id, req.member_id, req.generation_id)
                if code == Err.REBALANCE_IN_PROGRESS:
                    code = Err.NONE  # as Kafka: a transactional commit does not wait on a rebalance
            if code == Err.NONE:
                code = self.txn.txn_offsets(req.transactional_id, req.producer_id, req.producer_epoch,
                                            req.group_id, positions)
                self._txn_flush()
        code = _fenced(code, 28, v)
        topics = [N(name=name, partitions=[N(partition_index=i, error_code=code if c < 0 else c) for i, c in out])
                  for name, out in plan]
        return self._reply(corr, 28, v, throttle_time_ms=0, topics=topics)

    # ---------------------------------------------------------------- EndTxn

    def _end_txn(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        code, plan = self.txn.end_txn(req.transactional_id, req.producer_id, req.producer_epoch,
                                      bool(req.committed), now)
        self._txn_flush()
        data = self._reply(corr, 26, v, throttle_time_ms=0, error_code=_fenced(code, 26, v)).data
        if plan is None:
            return Outcome(data)
        markers = self.run_plan(plan)
        # The answer waits for every marker's commit (as a produce's for its records).
        return Outcome(data, markers or None)
