"""Transaction tooling (KIP-664), sans-IO: a mixin of :class:`~dafka.kafka.serving.KafkaServer`.

What ``kafka-transactions.sh`` and the admin clients' ``list_transactions``,
``describe_transactions`` and ``describe_producers`` ask, answered from the
gateway's real state:

* **DescribeProducers** (61): per partition, the producers whose batches the
  gateway's idempotence check remembers there (the producer ids it gave, and
  those it took from their first batch), with their epoch, the last sequence
  and the largest timestamp of their last batch; a transactional producer's
  coordinator epoch is 0 (the gateway's one coordinator never moves; an
  idempotent producer's is -1) and its current transaction's first offset in
  the partition (-1 when none is open there).  A partition written by mesh
  producers has no Kafka producers: an empty list.  The idempotence state
  lives in memory: after a restart a producer appears again with its next batch.
* **DescribeTransactions** (65): state, timeout, start time (wall clock, in
  milliseconds; a transaction open across a restart shows the restart: its
  timeout starts again there), producer id and epoch, the partitions of an
  open transaction (while it ends: those whose marker is not yet committed).
  An id the coordinator does not know is TRANSACTIONAL_ID_NOT_FOUND.
* **ListTransactions** (66) v0-v1: every transactional id, filtered by state,
  producer id and (v1) how long it has run; unknown state names come back in
  ``unknown_state_filters``.  v2's regular-expression filter is not served
  (a client's pattern would run on the gateway's I/O thread unbounded in time).

Bounds (each past one answered with an error code, without work):
:data:`MAX_DESCRIBED_PARTITIONS` partitions per DescribeProducers and
:data:`MAX_DESCRIBED_PRODUCERS` producers in its answer;
:data:`~dafka.kafka.admin.MAX_ADMIN_ITEMS` ids per DescribeTransactions and
:data:`MAX_TXN_ANSWER_BYTES` in its answer; :data:`~dafka.kafka.admin.MAX_ADMIN_ITEMS`
filters of each kind per ListTransactions, state filters of at most
:data:`MAX_STATE_FILTER` characters (its answer is bounded by the coordinator's
transactional ids, :data:`~dafka.kafka.txn.MAX_TRANSACTIONAL_IDS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dafka.kafka.admin import MAX_ADMIN_ITEMS
from dafka.kafka.codec import Err, N
from dafka.kafka.outcome import Outcome
from dafka.kafka.txn import (
    COMPLETE_ABORT,
    COMPLETE_COMMIT,
    EMPTY,
    ONGOING,
    PREPARE_ABORT,
    PREPARE_COMMIT,
    Key,
    Txn,
    TxnCoordinator,
)

#: Partitions one DescribeProducers may name, over all its topics (the rest: POLICY_VIOLATION).
MAX_DESCRIBED_PARTITIONS = 1000
#: Producers one DescribeProducers answer lists (37 bytes each); a partition that would pass
#: it is answered POLICY_VIOLATION.
MAX_DESCRIBED_PRODUCERS = 100_000
#: Bytes of one DescribeTransactions answer, estimated before it is built (the ids past it:
#: POLICY_VIOLATION).
MAX_TXN_ANSWER_BYTES = 8 << 20
#: Characters of a ListTransactions state filter (the longest state name is 14).
MAX_STATE_FILTER = 64

TRANSACTIONAL_ID_NOT_FOUND = 105
#: The states ListTransactions filters on (Kafka's names; the gateway's coordinator uses the
#: first six, the others are known and match nothing).
STATES = frozenset({EMPTY, ONGOING, PREPARE_COMMIT, PREPARE_ABORT, COMPLETE_COMMIT, COMPLETE_ABORT,
                    "Dead", "PrepareEpochFence"})
_ENDING = (PREPARE_COMMIT, PREPARE_ABORT)
_PRODUCER_BYTES = 37  # one DescribeProducers entry: 8 + 4 + 4 + 8 + 4 + 8 + a tag byte


def _head(head: int | None) -> int:
    return -1 if head is None else head


class TxnAdminHandlers:
    """DescribeProducers, DescribeTransactions and ListTransactions (a mixin)."""

    backend: Any
    txn: TxnCoordinator
    _producers: Any
    _adopted: Any
    _producers_of: dict[Key, dict[int, None]]

    if TYPE_CHECKING:  # KafkaServer's
        def _reply(self, corr: int, api_key: int, version: int, **fields: Any) -> Outcome: ...
        def _partitions_of(self, topic: str) -> Any: ...

    # ---------------------------------------------------------------- DescribeProducers

    def _describe_producers(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        seen = 0
        room = MAX_DESCRIBED_PRODUCERS
        topics = []
        for t in req.topics:
            parts = self._partitions_of(t.name)
            out = []
            for index in t.partition_indexes:
                seen += 1
                part = parts[index] if parts and 0 <= index < len(parts) else None
                if seen > MAX_DESCRIBED_PARTITIONS:
                    out.append(N(partition_index=index, error_code=Err.POLICY_VIOLATION,
                                 error_message=f"at most {MAX_DESCRIBED_PARTITIONS} partitions per request",
                                 active_producers=[]))
                    continue
                if part is None:
                    out.append(N(partition_index=index, error_code=Err.UNKNOWN_TOPIC_OR_PARTITION,
                                 error_message=None, active_producers=[]))
                    continue
                pids = self._producers_of.get((part.topic, part.address), {})
                if len(pids) > room:  # checked before anything is built
                    out.append(N(partition_index=index, error_code=Err.POLICY_VIOLATION,
                                 error_message=f"the answer would list more than {MAX_DESCRIBED_PRODUCERS}"
                                               " producers", active_producers=[]))
                    continue
                active = self._active_producers((part.topic, part.address), pids)
                room -= len(active)
                out.append(N(partition_index=index, error_code=Err.NONE, error_message=None,
                             active_producers=active))
            topics.append(N(name=t.name, partitions=out))
        return self._reply(corr, 61, v, throttle_time_ms=0, topics=topics)

    def _active_producers(self, key: Key, pids: dict[int, None]) -> list[Any]:
        out = []
        for pid in pids:
            state = self._producers.get(pid) or self._adopted.get(pid)
            recent = state.batches.get(key) if state is not None else None
            if not recent:
                continue
            txn = self.txn.by_pid.get(pid)
            start = -1
            if txn is not None:
                first = txn.first_offset(key)
                start = -1 if first is None else first
            out.append(N(producer_id=pid, producer_epoch=state.epoch, last_sequence=recent[-1][1],
                         last_timestamp=state.stamps.get(key, -1),
                         coordinator_epoch=-1 if txn is None else 0, current_txn_start_offset=start))
        return out

    # ---------------------------------------------------------------- DescribeTransactions

    def _describe_transactions(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        budget = MAX_TXN_ANSWER_BYTES
        wall = self.backend.wall_ms()
        states = []
        for i, tid in enumerate(req.transactional_ids):
            txn = None
            code = Err.POLICY_VIOLATION  # past the count, or the answer's bytes
            topics: list[Any] = []
            if i < MAX_ADMIN_ITEMS:
                txn = self.txn.txns.get(tid)
                if txn is None:
                    code = TRANSACTIONAL_ID_NOT_FOUND
                else:
                    listed = self._txn_partitions(txn)
                    cost = 64 + len(tid) * 4 + sum(8 + len(name) * 4 + 4 * len(ps) for name, ps in listed.items())
                    if cost > budget:  # estimated before the answer is built
                        txn = None
                    else:
                        budget -= cost
                        code = Err.NONE
                        topics = [N(topic=name, partitions=ps) for name, ps in listed.items()]
            if txn is None:
                states.append(N(error_code=code, transactional_id=tid, transaction_state="",
                                transaction_timeout_ms=0, transaction_start_time_ms=-1, producer_id=-1,
                                producer_epoch=-1, topics=[]))
                continue
            started = -1 if txn.started is None else int(wall - (now - txn.started) * 1000)
            states.append(N(error_code=code, transactional_id=tid, transaction_state=txn.state,
                            transaction_timeout_ms=txn.timeout_ms, transaction_start_time_ms=started,
                            producer_id=txn.pid, producer_epoch=txn.epoch, topics=topics))
        return self._reply(corr, 65, v, throttle_time_ms=0, transaction_states=states)

    def _txn_partitions(self, txn: Txn) -> dict[str, list[int]]:
        """An open transaction's partitions by topic (Kafka indexes); while it ends, only those
        whose marker is not committed yet."""
        if txn.state == ONGOING:
            keys = list(txn.parts)
        elif txn.state in _ENDING:
            keys = [k for k, off in txn.markers.items() if off < 0 or _head(self.backend.head(*k)) < off]
        else:
            return {}
        pmap = self.backend.pmap
        out: dict[str, list[int]] = {}
        for topic, address in keys:
            part = pmap.lookup(topic, address)
            if part is not None:
                out.setdefault(topic, []).append(part.pid)
        return out

    # ---------------------------------------------------------------- ListTransactions

    def _list_transactions(self, token: Any, v: int, corr: int, cid: Any, req: Any, now: float) -> Outcome:
        wanted = list(req.state_filters)
        pids = list(req.producer_id_filters)
        if len(wanted) > MAX_ADMIN_ITEMS or len(pids) > MAX_ADMIN_ITEMS or any(
                len(s) > MAX_STATE_FILTER for s in wanted):
            return self._reply(corr, 66, v, throttle_time_ms=0, error_code=Err.POLICY_VIOLATION,
                               unknown_state_filters=[], transaction_states=[])
        unknown = [s for s in dict.fromkeys(wanted) if s not in STATES]
        states = set(wanted)
        pid_set = set(pids)
        longer = req.duration_filter if v >= 1 else -1
        out = []
        for tid, txn in self.txn.txns.items():
            if states and txn.state not in states:
                continue
            if pid_set and txn.pid not in pid_set:
                continue
            if longer >= 0 and (txn.started is None or (now - txn.started) * 1000 <= longer):
                continue
            out.append(N(transactional_id=tid, producer_id=txn.pid, transaction_state=txn.state))
        return self._reply(corr, 66, v, throttle_time_ms=0, error_code=Err.NONE,
                           unknown_state_filters=unknown, transaction_states=out)
