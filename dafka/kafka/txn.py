"""The Kafka transaction coordinator (KIP-98), sans-IO: no sockets, no clocks, no files.

A transactional id maps to a producer id and an epoch; each id has at most
one transaction, in one of the states

    EMPTY -> ONGOING -> PREPARE_COMMIT -> COMPLETE_COMMIT (-> ONGOING ...)
                     -> PREPARE_ABORT  -> COMPLETE_ABORT

A transaction is ONGOING from its first AddPartitionsToTxn or
AddOffsetsToTxn; EndTxn (or its timeout, or a new producer of the same id)
moves it to PREPARE_*, which asks the gateway to write one control record (a
marker) in each of its partitions; once every marker is committed it is
COMPLETE_*.  While it is PREPARE_*, requests of the id are
CONCURRENT_TRANSACTIONS (the clients retry).

**Fencing**: InitProducerId of an id bumps its epoch; requests with an older
epoch are fenced (PRODUCER_FENCED, or INVALID_PRODUCER_EPOCH for the request
versions from before KIP-588: the shell picks).  A transaction past its
timeout is aborted and the epoch bumped, so its producer is fenced too.

**State is event-sourced**: every change is a journal record (a small
dict) that :meth:`TxnCoordinator.apply` applies; live changes go through
the same ``apply`` as a replay at start, and the records to write are left
in :attr:`TxnCoordinator.journal` for the shell, which makes them durable
*before* it acts on them (appends the records, answers).  A range of
offsets is journalled before the records are queued: at start
:meth:`TxnCoordinator.recover` clips every range and marker past the
committed head (those offsets were never stored and will be given again),
journalling the clipping, and asks again for the markers lost that way.

**The data it keeps per partition**: where each unfinished transaction
starts (the last stable offset is the smallest of them), and the offset
ranges of aborted transactions (a read_committed fetch leaves them out),
pruned as the partition's start passes them.

**Bounds** (each refusal a Kafka error code, never unbounded growth):
transactional ids (:data:`MAX_TRANSACTIONAL_IDS`, the least recently used
idle one is forgotten to make room, else COORDINATOR_NOT_AVAILABLE),
partitions and groups per transaction, offset ranges per transaction,
aborted ranges kept over the gateway, the transaction timeout.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dafka.kafka.codec import Err

log = logging.getLogger("dafka.kafka")

EMPTY = "Empty"
ONGOING = "Ongoing"
PREPARE_COMMIT = "PrepareCommit"
PREPARE_ABORT = "PrepareAbort"
COMPLETE_COMMIT = "CompleteCommit"
COMPLETE_ABORT = "CompleteAbort"
_PREPARE = (PREPARE_COMMIT, PREPARE_ABORT)
_IDLE = (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT)

#: Transactional ids known over the gateway (idle ones are forgotten, least recently used first).
MAX_TRANSACTIONAL_IDS = 10_000
#: Bytes of a transactional id.
MAX_ID_BYTES = 249
#: Partitions one transaction may write.
MAX_TXN_PARTITIONS = 1_000
#: Groups one transaction may commit offsets of, and offsets it may hold pending.
MAX_TXN_GROUPS = 100
MAX_TXN_OFFSETS = 10_000
#: Offset ranges (produce batches, merged when adjacent) one transaction may write.
MAX_TXN_RANGES = 100_000
#: Aborted offset ranges kept over the gateway (a read_committed fetch skips them); past it, new
#: transactions are refused (COORDINATOR_NOT_AVAILABLE) until retention prunes some.
MAX_ABORTED_RANGES = 200_000
#: Over every transaction open at once: partitions, offset ranges, pending offsets.  Past the
#: first, AddPartitionsToTxn is COORDINATOR_NOT_AVAILABLE (retried by clients, room comes as
#: others end); past the others, a produce or TxnOffsetCommit is POLICY_VIOLATION.
MAX_OPEN_PARTITIONS = 100_000
MAX_OPEN_RANGES = 1_000_000
MAX_OPEN_OFFSETS = 1_000_000
#: Kafka's transaction.max.timeout.ms default: a longer timeout is INVALID_TRANSACTION_TIMEOUT.
MAX_TIMEOUT_MS = 900_000
MAX_EPOCH = 32_766  # past it a new producer id is given (epochs are int16)

Key = tuple[str, str]  # (topic, partition address) in the store


@dataclass(slots=True)
class Txn:
    """One transactional id and its current transaction."""

    tid: str
    pid: int
    epoch: int
    timeout_ms: int
    state: str = EMPTY
    #: partitions written -> their offset ranges [first, last] (merged when adjacent)
    parts: dict[Key, list[list[int]]] = field(default_factory=dict)
    groups: dict[str, dict[Key, int]] = field(default_factory=dict)  # pending offsets per group
    markers: dict[Key, int] = field(default_factory=dict)  # PREPARE_*: marker offset per partition
    started: float | None = None  # when it became ONGOING (the shell's monotonic clock)
    nranges: int = 0
    noffsets: int = 0

    def first_offset(self, key: Key) -> int | None:
        ranges = self.parts.get(key)
        return ranges[0][0] if ranges else None


@dataclass(slots=True)
class EndPlan:
    """Markers to write: ``keys`` in this order, a commit or an abort, for ``tid``; for a
    commit, ``offsets`` to make visible (group -> {key: offset})."""

    tid: str
    commit: bool
    pid: int
    epoch: int
    keys: list[Key]
    offsets: dict[str, dict[Key, int]]


class TxnCoordinator:
    """Transactional ids, their transactions, and the per-partition data they leave."""

    def __init__(self, *, max_ids: int = MAX_TRANSACTIONAL_IDS, max_partitions: int = MAX_TXN_PARTITIONS,
                 max_ranges: int = MAX_TXN_RANGES, max_aborted: int = MAX_ABORTED_RANGES,
                 max_timeout_ms: int = MAX_TIMEOUT_MS) -> None:
        self.max_ids = max_ids
        self.max_partitions = max_partitions
        self.max_ranges = max_ranges
        self.max_aborted = max_aborted
        self.max_timeout_ms = max_timeout_ms
        self.txns: OrderedDict[str, Txn] = OrderedDict()
        self.by_pid: dict[int, Txn] = {}
        #: partition -> {tid: first offset} of transactions not complete that wrote it
        self.open: dict[Key, dict[str, int]] = {}
        #: partition -> sorted aborted ranges (first, last)
        self.aborted: dict[Key, list[tuple[int, int]]] = {}
        self.naborted = 0
        #: partitions ever written by a transaction (their fetches look for markers)
        self.touched: set[Key] = set()
        #: ids whose transaction is ONGOING or PREPARE_* (the timer and commits look at these only)
        self.active: dict[str, None] = {}
        #: partitions, offset ranges and pending offsets over every transaction not idle
        self.open_parts = self.open_ranges = self.open_offsets = 0
        self.max_open_partitions = MAX_OPEN_PARTITIONS
        self.max_open_ranges = MAX_OPEN_RANGES
        self.max_open_offsets = MAX_OPEN_OFFSETS
        #: records to make durable before acting on them (the shell takes them)
        self.journal: list[dict[str, Any]] = []
        self.timeouts = 0

    # ---------------------------------------------------------------- journal

    def _do(self, rec: dict[str, Any]) -> None:
        self.apply(rec)
        self.journal.append(rec)

    def rebuild(self, records: list[dict[str, Any]], now: float) -> None:
        """Forget the state and apply ``records`` (the durable journal): after a journal write
        failed, the state goes back to what is on disk.  Open transactions keep running
        (their timeouts start again)."""
        limits = (self.max_ids, self.max_partitions, self.max_ranges, self.max_aborted, self.max_timeout_ms,
                  self.max_open_partitions, self.max_open_ranges, self.max_open_offsets, self.timeouts)
        self.__init__()  # type: ignore[misc]
        (self.max_ids, self.max_partitions, self.max_ranges, self.max_aborted, self.max_timeout_ms,
         self.max_open_partitions, self.max_open_ranges, self.max_open_offsets, self.timeouts) = limits
        for rec in records:
            self.apply(rec)
        self.journal = []
        for tid in self.active:
            txn = self.txns[tid]
            if txn.state == ONGOING:
                txn.started = now

    def take_journal(self) -> list[dict[str, Any]]:
        out, self.journal = self.journal, []
        return out

    def apply(self, rec: dict[str, Any]) -> None:
        """Apply one journal record (live, or replayed at start)."""
        tid = rec.get("tid")
        before = self._held(self.txns.get(tid)) if tid is not None else None
        self._apply(rec)
        if tid is not None and before is not None:
            txn = self.txns.get(tid)
            if txn is not None and txn.state not in _IDLE:
                self.active[tid] = None
            else:
                self.active.pop(tid, None)
            after = self._held(txn)
            self.open_parts += after[0] - before[0]
            self.open_ranges += after[1] - before[1]
            self.open_offsets += after[2] - before[2]

    @staticmethod
    def _held(txn: Txn | None) -> tuple[int, int, int]:
        if txn is None or txn.state in _IDLE:
            return 0, 0, 0
        return len(txn.parts), txn.nranges, txn.noffsets

    def _apply(self, rec: dict[str, Any]) -> None:
        op = rec["op"]
        if op == "init":
            txn = self.txns.get(rec["tid"])
            if txn is not None:
                self.by_pid.pop(txn.pid, None)
            txn = Txn(rec["tid"], rec["pid"], rec["epoch"], rec["timeout"])
            self.txns[txn.tid] = txn
            self.txns.move_to_end(txn.tid)
            self.by_pid[txn.pid] = txn
        elif op == "forget":
            txn = self.txns.pop(rec["tid"], None)
            if txn is not None:
                self.by_pid.pop(txn.pid, None)
        elif op == "add":
            txn = self.txns[rec["tid"]]
            self._begin(txn)
            for t, a in rec["keys"]:
                txn.parts.setdefault((t, a), [])
        elif op == "group":
            txn = self.txns[rec["tid"]]
            self._begin(txn)
            txn.groups.setdefault(rec["group"], {})
        elif op == "offsets":
            txn = self.txns[rec["tid"]]
            held = txn.groups.setdefault(rec["group"], {})
            for t, a, off in rec["pos"]:
                if (t, a) not in held:
                    txn.noffsets += 1
                held[(t, a)] = off
        elif op == "range":
            txn = self.txns[rec["tid"]]
            key = (rec["key"][0], rec["key"][1])
            ranges = txn.parts.setdefault(key, [])
            first, last = rec["first"], rec["last"]
            if ranges and ranges[-1][1] + 1 == first:
                ranges[-1][1] = last
            else:
                ranges.append([first, last])
                txn.nranges += 1
            self.open.setdefault(key, {}).setdefault(txn.tid, ranges[0][0])
            self.touched.add(key)
        elif op == "end":
            txn = self.txns[rec["tid"]]
            txn.state = PREPARE_COMMIT if rec["commit"] else PREPARE_ABORT
            if rec.get("epoch") is not None:
                txn.epoch = rec["epoch"]
            txn.markers = {(t, a): off for t, a, off in rec["markers"]}
            for key in txn.markers:
                self.touched.add(key)
            if not rec["commit"] and not rec.get("replay"):
                for key, ranges in txn.parts.items():
                    for first, last in ranges:
                        self._add_aborted(key, first, last)
        elif op == "marker":  # a marker lost at a crash, given a new offset at start
            txn = self.txns[rec["tid"]]
            txn.markers[(rec["key"][0], rec["key"][1])] = rec["off"]
        elif op == "done":
            txn = self.txns[rec["tid"]]
            txn.state = COMPLETE_COMMIT if txn.state == PREPARE_COMMIT else COMPLETE_ABORT
            for key in txn.parts:
                opened = self.open.get(key)
                if opened is not None:
                    opened.pop(txn.tid, None)
                    if not opened:
                        del self.open[key]
            txn.parts = {}
            txn.groups = {}
            txn.markers = {}
            txn.started = None
            txn.nranges = txn.noffsets = 0
        elif op == "clip":  # offsets past the committed head were never stored
            self._clip((rec["key"][0], rec["key"][1]), rec["head"])
        elif op == "prune":
            key = (rec["key"][0], rec["key"][1])
            self._prune(key, rec["below"])
        elif op == "idle":
            txn = self.txns[rec["tid"]]
            if rec["state"] not in _IDLE:
                raise ValueError(f"not an idle state: {rec['state']!r}")
            txn.state = rec["state"]
        elif op == "touched":
            for t, a in rec["keys"]:
                self.touched.add((t, a))
        elif op == "aborted":
            self._add_aborted((rec["key"][0], rec["key"][1]), rec["first"], rec["last"])
        else:
            raise ValueError(f"unknown transaction journal record {op!r}")

    def _begin(self, txn: Txn) -> None:
        if txn.state != ONGOING:
            txn.state = ONGOING
            txn.parts, txn.groups, txn.markers = {}, {}, {}
            txn.nranges = txn.noffsets = 0
            txn.started = None

    def _add_aborted(self, key: Key, first: int, last: int) -> None:
        ranges = self.aborted.setdefault(key, [])
        bisect.insort(ranges, (first, last))
        self.naborted += 1

    def _clip(self, key: Key, head: int) -> None:
        for tid in self.active:
            self.open_ranges -= self.txns[tid].nranges
        self._clip_ranges(key, head)
        for tid in self.active:
            self.open_ranges += self.txns[tid].nranges

    def _clip_ranges(self, key: Key, head: int) -> None:
        for txn in self.txns.values():
            ranges = txn.parts.get(key)
            if ranges:
                kept = []
                for r in ranges:
                    if r[0] > head:
                        txn.nranges -= 1
                        continue
                    kept.append([r[0], min(r[1], head)])
                txn.parts[key] = kept
                opened = self.open.get(key)
                if opened is not None and txn.tid in opened:
                    if kept:
                        opened[txn.tid] = kept[0][0]
                    else:
                        del opened[txn.tid]
                        if not opened:
                            del self.open[key]
            off = txn.markers.get(key)
            if off is not None and off > head:
                txn.markers[key] = -1  # lost: written again (see recover)
        ranges2 = self.aborted.get(key)
        if ranges2:
            kept2 = [(a, min(b, head)) for a, b in ranges2 if a <= head]
            self.naborted -= len(ranges2) - len(kept2)
            self.aborted[key] = kept2

    def _prune(self, key: Key, below: int) -> None:
        ranges = self.aborted.get(key)
        if not ranges:
            return
        kept = [r for r in ranges if r[1] >= below]
        self.naborted -= len(ranges) - len(kept)
        if kept:
            self.aborted[key] = kept
        else:
            del self.aborted[key]

    def snapshot(self) -> list[dict[str, Any]]:
        """Journal records that rebuild the present state (for compacting the journal)."""
        out: list[dict[str, Any]] = []
        if self.touched:
            out.append({"op": "touched", "keys": sorted([t, a] for t, a in self.touched)})
        for key, ranges in self.aborted.items():
            for first, last in ranges:
                out.append({"op": "aborted", "key": list(key), "first": first, "last": last})
        for txn in self.txns.values():
            out.append({"op": "init", "tid": txn.tid, "pid": txn.pid, "epoch": txn.epoch, "timeout": txn.timeout_ms})
            if txn.state in _IDLE:
                if txn.state != EMPTY:  # a retried EndTxn of what is done is still NONE
                    out.append({"op": "idle", "tid": txn.tid, "state": txn.state})
                continue
            out.append({"op": "add", "tid": txn.tid, "keys": [list(k) for k in txn.parts]})
            for g, held in txn.groups.items():
                out.append({"op": "group", "tid": txn.tid, "group": g})
                if held:
                    out.append({"op": "offsets", "tid": txn.tid, "group": g,
                                "pos": [[t, a, o] for (t, a), o in held.items()]})
            for key, spans in txn.parts.items():
                for first, last in spans:
                    out.append({"op": "range", "tid": txn.tid, "key": list(key), "first": first, "last": last})
            if txn.state in _PREPARE:
                # The aborted ranges of a PREPARE_ABORT are already in the index (above): an
                # "end" would add them twice, so the markers go as records of their own.
                out.append({"op": "end", "tid": txn.tid, "commit": txn.state == PREPARE_COMMIT,
                            "markers": [[t, a, o] for (t, a), o in txn.markers.items()], "epoch": txn.epoch,
                            "replay": True})
        return out

    # ---------------------------------------------------------------- requests

    def _find(self, tid: str, pid: int, epoch: int) -> tuple[int, Txn | None]:
        txn = self.txns.get(tid)
        if txn is None or txn.pid != pid:
            return Err.INVALID_PRODUCER_ID_MAPPING, None
        if epoch < txn.epoch:
            return Err.PRODUCER_FENCED, None
        if epoch > txn.epoch:
            return Err.INVALID_PRODUCER_EPOCH, None
        self.txns.move_to_end(tid)
        return Err.NONE, txn

    def init_producer(self, tid: str, timeout_ms: int, new_pid: int, now: float,
                      pid: int = -1, epoch: int = -1) -> tuple[int, int, int, EndPlan | None]:
        """InitProducerId of ``tid``: ``(error, producer id, epoch, abort to carry out)``.

        ``new_pid`` is used for a new id (or when its epoch is used up).  An
        ongoing transaction of the id is aborted (its producer fenced) and the
        answer is CONCURRENT_TRANSACTIONS until that abort completes.
        """
        if not tid or len(tid.encode()) > MAX_ID_BYTES:
            return Err.INVALID_REQUEST, -1, -1, None
        if not 0 < timeout_ms <= self.max_timeout_ms:
            return Err.INVALID_TRANSACTION_TIMEOUT, -1, -1, None
        txn = self.txns.get(tid)
        if txn is None:
            if len(self.txns) >= self.max_ids and not self._forget_idle():
                return Err.COORDINATOR_NOT_AVAILABLE, -1, -1, None
            self._do({"op": "init", "tid": tid, "pid": new_pid, "epoch": 0, "timeout": timeout_ms})
            return Err.NONE, new_pid, 0, None
        if pid >= 0 and (pid != txn.pid or epoch != txn.epoch):
            # KIP-360: a producer asking for its own epoch to be bumped must be the current one.
            return (Err.PRODUCER_FENCED if pid == txn.pid and epoch < txn.epoch
                    else Err.INVALID_PRODUCER_ID_MAPPING), -1, -1, None
        if txn.state in _PREPARE:
            return Err.CONCURRENT_TRANSACTIONS, -1, -1, None
        if txn.state == ONGOING:
            plan = self._end(txn, False, bump=True, now=now)
            return Err.CONCURRENT_TRANSACTIONS, -1, -1, plan
        self.txns.move_to_end(tid)
        if txn.epoch >= MAX_EPOCH:
            self._do({"op": "init", "tid": tid, "pid": new_pid, "epoch": 0, "timeout": timeout_ms})
        else:
            self._do({"op": "init", "tid": tid, "pid": txn.pid, "epoch": txn.epoch + 1, "timeout": timeout_ms})
        t = self.txns[tid]
        return Err.NONE, t.pid, t.epoch, None

    def _forget_idle(self) -> bool:
        for tid, txn in self.txns.items():
            if txn.state in _IDLE:
                self._do({"op": "forget", "tid": tid})
                return True
        return False

    def add_partitions(self, tid: str, pid: int, epoch: int, keys: list[Key], now: float) -> int:
        """AddPartitionsToTxn: one error code for the lot (Kafka answers it per partition)."""
        code, txn = self._find(tid, pid, epoch)
        if txn is None:
            return code
        if txn.state in _PREPARE:
            return Err.CONCURRENT_TRANSACTIONS
        if txn.state != ONGOING and self.naborted >= self.max_aborted:
            return Err.COORDINATOR_NOT_AVAILABLE
        have = txn.parts if txn.state == ONGOING else {}
        new = [k for k in dict.fromkeys(keys) if k not in have]
        if len(have) + len(new) > self.max_partitions:
            return Err.POLICY_VIOLATION
        if new and self.open_parts + len(new) > self.max_open_partitions:
            return Err.COORDINATOR_NOT_AVAILABLE
        if new or txn.state != ONGOING:
            self._do({"op": "add", "tid": tid, "keys": [list(k) for k in new]})
        if txn.started is None:
            txn.started = now
        return Err.NONE

    def add_offsets(self, tid: str, pid: int, epoch: int, group: str, now: float) -> int:
        code, txn = self._find(tid, pid, epoch)
        if txn is None:
            return code
        if txn.state in _PREPARE:
            return Err.CONCURRENT_TRANSACTIONS
        if txn.state != ONGOING and self.naborted >= self.max_aborted:
            return Err.COORDINATOR_NOT_AVAILABLE
        if (txn.state != ONGOING or group not in txn.groups) and (
                txn.state == ONGOING and len(txn.groups) >= MAX_TXN_GROUPS):
            return Err.POLICY_VIOLATION
        if txn.state != ONGOING or group not in txn.groups:
            self._do({"op": "group", "tid": tid, "group": group})
        if txn.started is None:
            txn.started = now
        return Err.NONE

    def txn_offsets(self, tid: str, pid: int, epoch: int, group: str, positions: dict[Key, int]) -> int:
        """TxnOffsetCommit: the offsets wait in the transaction until it commits."""
        code, txn = self._find(tid, pid, epoch)
        if txn is None:
            return code
        if txn.state != ONGOING or group not in txn.groups:
            return Err.INVALID_TXN_STATE
        held = txn.groups[group]
        more = sum(1 for k in positions if k not in held)
        if txn.noffsets + more > MAX_TXN_OFFSETS or self.open_offsets + more > self.max_open_offsets:
            return Err.POLICY_VIOLATION
        if positions:
            self._do({"op": "offsets", "tid": tid, "group": group,
                      "pos": [[t, a, o] for (t, a), o in positions.items()]})
        return Err.NONE

    def check_produce(self, pid: int, epoch: int, key: Key) -> int:
        """Whether a transactional batch of ``pid`` may go to ``key``."""
        txn = self.by_pid.get(pid)
        if txn is None:
            return Err.INVALID_PRODUCER_ID_MAPPING
        if epoch < txn.epoch:
            return Err.INVALID_PRODUCER_EPOCH
        if epoch > txn.epoch:
            return Err.INVALID_PRODUCER_EPOCH
        if txn.state != ONGOING or key not in txn.parts:
            return Err.INVALID_TXN_STATE
        if txn.nranges >= self.max_ranges or self.open_ranges >= self.max_open_ranges:
            return Err.POLICY_VIOLATION
        return Err.NONE

    def appending(self, pid: int, key: Key, first: int, last: int) -> None:
        """A checked transactional batch takes offsets ``first..last`` (journal it first)."""
        txn = self.by_pid[pid]
        self._do({"op": "range", "tid": txn.tid, "key": list(key), "first": first, "last": last})

    def end_txn(self, tid: str, pid: int, epoch: int, commit: bool, now: float) -> tuple[int, EndPlan | None]:
        """EndTxn: ``(error, markers to write)``; a retry of an end already done is NONE."""
        code, txn = self._find(tid, pid, epoch)
        if txn is None:
            return code, None
        if txn.state == (COMPLETE_COMMIT if commit else COMPLETE_ABORT):
            return Err.NONE, None
        if txn.state in _PREPARE:
            return Err.CONCURRENT_TRANSACTIONS if txn.state == (PREPARE_COMMIT if commit else PREPARE_ABORT) \
                else Err.INVALID_TXN_STATE, None
        if txn.state != ONGOING:
            return Err.INVALID_TXN_STATE, None
        return Err.NONE, self._end(txn, commit, bump=False, now=now)

    def _end(self, txn: Txn, commit: bool, bump: bool, now: float) -> EndPlan:
        keys = list(txn.parts)
        return EndPlan(txn.tid, commit, txn.pid, txn.epoch + 1 if bump else txn.epoch, keys,
                       {g: dict(h) for g, h in txn.groups.items()} if commit else {})

    def ending(self, plan: EndPlan, markers: dict[Key, int]) -> None:
        """The plan's markers take these offsets (journal it before writing them)."""
        txn = self.txns[plan.tid]
        self._do({"op": "end", "tid": plan.tid, "commit": plan.commit,
                  "markers": [[t, a, o] for (t, a), o in markers.items()],
                  "epoch": plan.epoch if plan.epoch != txn.epoch else None})
        if not markers:
            self._do({"op": "done", "tid": plan.tid})

    def committed(self, heads: dict[Key, int]) -> list[str]:
        """Markers committed up to ``heads``: the transactions now complete (journalled)."""
        done = []
        for tid in self.active:
            txn = self.txns[tid]
            if txn.state in _PREPARE and txn.markers and all(
                    off >= 0 and heads.get(k, -1) >= off for k, off in txn.markers.items()):
                done.append(txn.tid)
        for tid in done:
            self._do({"op": "done", "tid": tid})
        return done

    def tick(self, now: float) -> list[EndPlan]:
        """Transactions past their timeout: aborted, their producers fenced (epoch bumped)."""
        plans = []
        for tid in self.active:
            txn = self.txns[tid]
            if txn.state == ONGOING and txn.started is not None and now - txn.started > txn.timeout_ms / 1000.0:
                self.timeouts += 1
                plans.append(self._end(txn, False, bump=True, now=now))
        return plans

    # ---------------------------------------------------------------- start

    def recover(self, heads: dict[Key, int], now: float) -> list[EndPlan]:
        """After the journal is replayed: clip what was never stored, restart timeouts, and
        the markers to write again (lost past the head, or never written)."""
        keys = set(self.open) | set(self.aborted)
        for txn in self.txns.values():
            keys.update(txn.parts)
            keys.update(txn.markers)
        for key in sorted(keys):
            head = heads.get(key, -1)
            if self._past(key, head):
                self._do({"op": "clip", "key": list(key), "head": head})
        plans = []
        for txn in self.txns.values():
            if txn.state == ONGOING:
                txn.started = now  # a restart gives it its whole timeout again
            elif txn.state in _PREPARE:
                lost = [k for k, off in txn.markers.items() if off < 0]
                plans.append(EndPlan(txn.tid, txn.state == PREPARE_COMMIT, txn.pid, txn.epoch, lost,
                                     {g: dict(h) for g, h in txn.groups.items()}
                                     if txn.state == PREPARE_COMMIT else {}))
        return plans

    def clip(self, key: Key, head: int) -> None:
        """The store refused ``key`` past ``head``: those offsets will be given again (journalled)."""
        if key in self.touched:
            self._do({"op": "clip", "key": list(key), "head": head})

    def lost_markers(self) -> list[EndPlan]:
        """Ending transactions whose markers were lost (their partition refused by the store):
        the markers to write again."""
        plans = []
        for tid in self.active:
            txn = self.txns[tid]
            lost = [k for k, off in txn.markers.items() if off < 0]
            if txn.state in _PREPARE and lost:
                plans.append(EndPlan(tid, txn.state == PREPARE_COMMIT, txn.pid, txn.epoch, lost, {}))
        return plans

    def _past(self, key: Key, head: int) -> bool:
        for txn in self.txns.values():
            ranges = txn.parts.get(key)
            if ranges and ranges[-1][1] > head:
                return True
            off = txn.markers.get(key)
            if off is not None and off > head:
                return True
        ranges2 = self.aborted.get(key)
        return ranges2 is not None and any(b > head for _, b in ranges2)

    def remark(self, plan: EndPlan, markers: dict[Key, int]) -> None:
        """Lost markers of a recovered plan take new offsets (journal it before writing them)."""
        for (t, a), off in markers.items():
            self._do({"op": "marker", "tid": plan.tid, "key": [t, a], "off": off})

    # ---------------------------------------------------------------- reads

    def lso(self, key: Key, hwm: int) -> int:
        """The last stable offset: the first offset of the oldest unfinished transaction."""
        opened = self.open.get(key)
        if not opened:
            return hwm
        return min(hwm, min(opened.values()))

    def aborted_between(self, key: Key, first: int, last: int) -> list[tuple[int, int]]:
        """Aborted ranges meeting ``first..last``."""
        ranges = self.aborted.get(key)
        if not ranges:
            return []
        return [(a, b) for a, b in ranges if a <= last and b >= first]

    def prune(self, key: Key, below: int) -> None:
        """The partition's start passed ``below``: aborted ranges under it go (journalled)."""
        ranges = self.aborted.get(key)
        if ranges and ranges[0][1] < below:
            self._do({"op": "prune", "key": list(key), "below": below})


# ---------------------------------------------------------------- the shell's journal file


class TxnLog:
    """The coordinator's journal in a file of the gateway's database directory: JSON lines,
    appended and fsync'ed; a torn last line (a crash mid-write) is cut off at load; rewritten
    whole (tmp, fsync, rename) from a snapshot once it is long.  I/O, not sans-IO: the shell's."""

    #: Lines past which the journal is rewritten from a snapshot (when that is much shorter).
    COMPACT_LINES = 20_000

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines = 0
        self._f: Any = None

    def load(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        good = 0
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return out
        for line in data.split(b"\n"):
            if not line:
                good += 1
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or "op" not in rec:
                    raise ValueError("not a journal record")
            except ValueError:
                log.error(
                    "%s: unreadable record after %d good ones (a torn write?): cut off there", self.path, len(out))
                break
            out.append(rec)
            good += len(line) + 1
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(min(good, len(data)))
                os.fsync(f.fileno())
        self.lines = len(out)
        return out

    def write(self, recs: list[dict[str, Any]]) -> None:
        if not recs:
            return
        if self._f is None:
            self._f = open(self.path, "ab")  # noqa: SIM115 - kept open for appends
        self._f.write(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in recs))
        self._f.flush()
        os.fsync(self._f.fileno())
        self.lines += len(recs)

    def rewrite(self, recs: list[dict[str, Any]]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())
        self.close()
        os.replace(tmp, self.path)
        fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.lines = len(recs)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
