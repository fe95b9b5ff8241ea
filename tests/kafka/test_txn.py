"""The sans-IO transaction coordinator: states, fencing, timeouts, bounds, journal replay."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dafka.kafka.codec import Err
from dafka.kafka.txn import (
    COMPLETE_ABORT,
    COMPLETE_COMMIT,
    EMPTY,
    ONGOING,
    PREPARE_ABORT,
    PREPARE_COMMIT,
    TxnCoordinator,
)

K1 = ("t", "p1")
K2 = ("t", "p2")


def replayed(c: TxnCoordinator, journal: list[dict]) -> TxnCoordinator:
    """A coordinator rebuilt from a journal, as the gateway does at start (through JSON)."""
    r = TxnCoordinator()
    for rec in journal:
        r.apply(json.loads(json.dumps(rec)))
    return r


def init(c: TxnCoordinator, tid: str = "tx", pid: int = 7, now: float = 0.0) -> tuple[int, int]:
    code, p, e, plan = c.init_producer(tid, 60_000, pid, now)
    assert code == Err.NONE and plan is None
    return p, e


def test_commit_walks_the_states_and_releases_offsets_only_at_commit():
    c = TxnCoordinator()
    pid, epoch = init(c)
    assert c.add_partitions("tx", pid, epoch, [K1, K2], 1.0) == Err.NONE
    assert c.txns["tx"].state == ONGOING
    assert c.add_offsets("tx", pid, epoch, "g", 1.0) == Err.NONE
    assert c.txn_offsets("tx", pid, epoch, "g", {K1: 5}) == Err.NONE
    assert c.check_produce(pid, epoch, K1) == Err.NONE
    c.appending(pid, K1, 10, 12)
    assert c.lso(K1, 13) == 10 and c.lso(K2, 4) == 4
    code, plan = c.end_txn("tx", pid, epoch, True, 2.0)
    assert code == Err.NONE and plan is not None and plan.offsets == {"g": {K1: 5}}
    c.ending(plan, {K1: 13, K2: 4})
    assert c.txns["tx"].state == PREPARE_COMMIT
    assert c.lso(K1, 14) == 10  # until the markers are committed
    assert c.committed({K1: 13}) == []
    assert c.committed({K1: 13, K2: 4}) == ["tx"]
    assert c.txns["tx"].state == COMPLETE_COMMIT
    assert c.lso(K1, 14) == 14 and not c.aborted_between(K1, 0, 100)
    # A retried EndTxn of a commit done is NONE; an abort now is not.
    assert c.end_txn("tx", pid, epoch, True, 3.0) == (Err.NONE, None)
    assert c.end_txn("tx", pid, epoch, False, 3.0)[0] == Err.INVALID_TXN_STATE


def test_abort_keeps_the_aborted_ranges_and_drops_pending_offsets():
    c = TxnCoordinator()
    pid, epoch = init(c)
    c.add_partitions("tx", pid, epoch, [K1], 0.0)
    c.add_offsets("tx", pid, epoch, "g", 0.0)
    c.txn_offsets("tx", pid, epoch, "g", {K1: 3})
    c.appending(pid, K1, 0, 1)
    c.appending(pid, K1, 2, 4)  # adjacent: merged
    c.appending(pid, K1, 8, 9)  # another producer wrote 5..7
    code, plan = c.end_txn("tx", pid, epoch, False, 1.0)
    assert code == Err.NONE and plan is not None and plan.offsets == {}
    c.ending(plan, {K1: 10})
    assert c.txns["tx"].state == PREPARE_ABORT
    assert c.aborted_between(K1, 0, 100) == [(0, 4), (8, 9)]
    assert c.aborted_between(K1, 5, 7) == []
    c.committed({K1: 10})
    assert c.txns["tx"].state == COMPLETE_ABORT
    c.prune(K1, 6)
    assert c.aborted_between(K1, 0, 100) == [(8, 9)]


def test_a_new_producer_fences_the_old_one_and_aborts_its_transaction():
    c = TxnCoordinator()
    pid, e0 = init(c)
    c.add_partitions("tx", pid, e0, [K1], 0.0)
    c.appending(pid, K1, 0, 0)
    code, _, _, plan = c.init_producer("tx", 60_000, 99, 1.0)
    assert code == Err.CONCURRENT_TRANSACTIONS and plan is not None and not plan.commit
    c.ending(plan, {K1: 1})
    # The zombie is fenced at once, on every request.
    assert c.check_produce(pid, e0, K1) == Err.INVALID_PRODUCER_EPOCH
    assert c.end_txn("tx", pid, e0, True, 1.0)[0] == Err.PRODUCER_FENCED
    assert c.add_partitions("tx", pid, e0, [K2], 1.0) == Err.PRODUCER_FENCED
    assert c.init_producer("tx", 60_000, 99, 1.0)[0] == Err.CONCURRENT_TRANSACTIONS  # abort not done
    c.committed({K1: 1})
    code, p2, e2, plan = c.init_producer("tx", 60_000, 99, 2.0)
    assert code == Err.NONE and p2 == pid and e2 == e0 + 2 and plan is None
    assert c.aborted_between(K1, 0, 0) == [(0, 0)]


def test_timeout_aborts_and_fences():
    c = TxnCoordinator()
    pid, e0 = init(c)
    c.add_partitions("tx", pid, e0, [K1], 10.0)
    c.appending(pid, K1, 0, 2)
    assert c.tick(69.0) == []
    plans = c.tick(70.5)
    assert len(plans) == 1 and not plans[0].commit and plans[0].epoch == e0 + 1
    c.ending(plans[0], {K1: 3})
    assert c.tick(1000.0) == []  # not again
    c.committed({K1: 3})
    assert c.end_txn("tx", pid, e0, True, 71.0)[0] == Err.PRODUCER_FENCED
    assert c.aborted_between(K1, 0, 3) == [(0, 2)]


def test_requests_of_unknown_ids_and_states_are_refused():
    c = TxnCoordinator()
    assert c.add_partitions("nope", 1, 0, [K1], 0.0) == Err.INVALID_PRODUCER_ID_MAPPING
    pid, e = init(c)
    assert c.add_partitions("tx", pid + 1, e, [K1], 0.0) == Err.INVALID_PRODUCER_ID_MAPPING
    assert c.add_partitions("tx", pid, e + 1, [K1], 0.0) == Err.INVALID_PRODUCER_EPOCH
    assert c.check_produce(pid, e, K1) == Err.INVALID_TXN_STATE  # not added
    assert c.check_produce(12345, 0, K1) == Err.INVALID_PRODUCER_ID_MAPPING
    assert c.end_txn("tx", pid, e, True, 0.0)[0] == Err.INVALID_TXN_STATE  # nothing ongoing
    assert c.txn_offsets("tx", pid, e, "g", {K1: 1}) == Err.INVALID_TXN_STATE  # group not added
    assert c.init_producer("tx2", 0, 8, 0.0)[0] == Err.INVALID_TRANSACTION_TIMEOUT
    assert c.init_producer("tx2", 900_001, 8, 0.0)[0] == Err.INVALID_TRANSACTION_TIMEOUT
    assert c.init_producer("x" * 250, 1000, 8, 0.0)[0] == Err.INVALID_REQUEST
    assert c.init_producer("", 1000, 8, 0.0)[0] == Err.INVALID_REQUEST


def test_bounds_ids_partitions_ranges_aborted():
    c = TxnCoordinator(max_ids=2, max_partitions=3, max_ranges=2, max_aborted=1)
    p1, e1 = init(c, "a", 1)
    p2, e2 = init(c, "b", 2)
    c.add_partitions("a", p1, e1, [K1], 0.0)
    c.add_partitions("b", p2, e2, [K1], 0.0)
    # Both ongoing: no room for a third id.
    assert c.init_producer("c", 1000, 3, 0.0)[0] == Err.COORDINATOR_NOT_AVAILABLE
    assert c.add_partitions("a", p1, e1, [("t", str(i)) for i in range(5)], 0.0) == Err.POLICY_VIOLATION
    c.appending(p1, K1, 0, 0)
    c.appending(p1, K1, 5, 5)
    assert c.check_produce(p1, e1, K1) == Err.POLICY_VIOLATION  # ranges used up
    code, plan = c.end_txn("a", p1, e1, False, 0.0)
    c.ending(plan, {K1: 9})
    c.committed({K1: 9})
    # "a" is idle now: a third id forgets it.
    assert c.init_producer("c", 1000, 3, 0.0)[0] == Err.NONE
    assert "a" not in c.txns
    # Aborted ranges past their bound: no new transaction starts.
    p3 = c.txns["c"].pid
    assert c.add_partitions("c", p3, 0, [K2], 0.0) == Err.COORDINATOR_NOT_AVAILABLE
    c.prune(K1, 100)
    assert c.add_partitions("c", p3, 0, [K2], 0.0) == Err.NONE


def test_the_journal_rebuilds_the_state_and_so_does_a_snapshot():
    c = TxnCoordinator()
    journal: list[dict] = []
    pid, e = init(c, "a", 1)
    c.add_partitions("a", pid, e, [K1, K2], 0.0)
    c.add_offsets("a", pid, e, "g", 0.0)
    c.txn_offsets("a", pid, e, "g", {K2: 8})
    c.appending(pid, K1, 0, 3)
    q, f = init(c, "b", 2)
    c.add_partitions("b", q, f, [K1], 0.0)
    c.appending(q, K1, 4, 4)
    _, plan = c.end_txn("b", q, f, False, 0.0)
    c.ending(plan, {K1: 5})
    journal += c.take_journal()
    for r in (replayed(c, journal), replayed(c, c.snapshot())):
        assert r.txns["a"].state == ONGOING and r.txns["a"].parts == {K1: [[0, 3]], K2: []}
        assert r.txns["a"].groups == {"g": {K2: 8}}
        assert r.txns["b"].state == PREPARE_ABORT and r.txns["b"].markers == {K1: 5}
        assert r.aborted_between(K1, 0, 10) == [(4, 4)]
        assert r.lso(K1, 6) == 0 and r.touched == {K1}
        assert r.by_pid[1].tid == "a"


def test_recover_clips_what_was_never_stored_and_writes_lost_markers_again():
    c = TxnCoordinator()
    pid, e = init(c, "a", 1)
    c.add_partitions("a", pid, e, [K1], 0.0)
    c.appending(pid, K1, 0, 3)
    c.appending(pid, K1, 6, 9)  # journalled, then the gateway died before storing 8..9
    q, f = init(c, "b", 2)
    c.add_partitions("b", q, f, [K2], 0.0)
    c.add_offsets("b", q, f, "g", 0.0)
    c.txn_offsets("b", q, f, "g", {K2: 1})
    c.appending(q, K2, 0, 0)
    _, plan = c.end_txn("b", q, f, True, 0.0)
    c.ending(plan, {K2: 1})  # the marker at 1 never reached the disk
    r = replayed(c, c.take_journal())
    plans = r.recover({K1: 7, K2: 0}, 100.0)
    assert r.txns["a"].parts[K1] == [[0, 3], [6, 7]]
    assert r.txns["a"].started == 100.0
    assert len(plans) == 1 and plans[0].tid == "b" and plans[0].keys == [K2] and plans[0].commit
    assert plans[0].offsets == {"g": {K2: 1}}
    r.remark(plans[0], {K2: 1})
    # The clipping is journalled: a later restart with a higher head does not re-grow the range.
    j = r.take_journal()
    full = TxnCoordinator()
    for rec in [*c.snapshot(), *j]:
        full.apply(rec)
    assert full.txns["a"].parts[K1] == [[0, 3], [6, 7]]
    assert full.committed({K2: 1}) == ["b"]


def _state(c: TxnCoordinator) -> tuple:
    txns = {t: (x.pid, x.epoch, x.state, {k: [list(r) for r in v] for k, v in x.parts.items()},
                x.groups, x.markers) for t, x in c.txns.items()}
    active = {t for t, x in c.txns.items() if x.state not in (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT)}
    assert set(c.active) == active
    held = [x for x in c.txns.values() if x.state not in (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT)]
    assert c.open_parts == sum(len(x.parts) for x in held)
    assert c.open_ranges == sum(x.nranges for x in held) == sum(len(r) for x in held for r in x.parts.values())
    assert c.open_offsets == sum(x.noffsets for x in held) == sum(len(g) for x in held for g in x.groups.values())
    return txns, {k: dict(v) for k, v in c.open.items()}, {k: list(v) for k, v in c.aborted.items() if v}, c.touched


_OPS = st.lists(st.tuples(st.sampled_from(["init", "add", "offsets", "produce", "commit", "abort", "done",
                                            "tick", "clip"]),
                          st.sampled_from(["a", "b", "c"]), st.sampled_from([K1, K2]), st.integers(1, 4)),
                max_size=60)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_any_sequence_replays_to_the_same_state_and_the_lso_stays_below_open_data(ops: list) -> None:
    """The journal (and a snapshot of it) rebuilds exactly the live state, whatever the
    requests were; the last stable offset is never past the first offset of open data."""
    c = TxnCoordinator()
    heads = {K1: -1, K2: -1}
    now = 0.0
    journal: list[dict] = []
    for op, tid, key, n in ops:
        now += 1.0
        txn = c.txns.get(tid)
        pid, epoch = (txn.pid, txn.epoch) if txn else (-1, -1)
        if op == "init":
            _, _, _, plan = c.init_producer(tid, 5_000, hash(tid) & 0xFFFF, now)
            if plan is not None:
                c.ending(plan, {k: heads[k] + 1 for k in plan.keys})
                for k in plan.keys:
                    heads[k] += 1
        elif op == "add":
            c.add_partitions(tid, pid, epoch, [key], now)
        elif op == "offsets":
            if c.add_offsets(tid, pid, epoch, "g", now) == Err.NONE:
                c.txn_offsets(tid, pid, epoch, "g", {key: n})
        elif op == "produce":
            if c.check_produce(pid, epoch, key) == Err.NONE:
                c.appending(pid, key, heads[key] + 1, heads[key] + n)
                heads[key] += n
        elif op in ("commit", "abort"):
            code, plan = c.end_txn(tid, pid, epoch, op == "commit", now)
            if plan is not None:
                c.ending(plan, {k: heads[k] + 1 for k in plan.keys})
                for k in plan.keys:
                    heads[k] += 1
        elif op == "done":
            c.committed(heads)
        elif op == "tick":
            for plan in c.tick(now + 10.0):
                c.ending(plan, {k: heads[k] + 1 for k in plan.keys})
                for k in plan.keys:
                    heads[k] += 1
        elif op == "clip":
            c.recover(heads, now)  # nothing past the heads: clips nothing
        for k in (K1, K2):
            lso = c.lso(k, heads[k] + 1)
            for t in c.txns.values():
                first = t.first_offset(k)
                if first is not None and t.state not in (COMPLETE_COMMIT, COMPLETE_ABORT):
                    assert lso <= first
        journal += c.take_journal()
    assert _state(replayed(c, journal)) == _state(c)
    assert _state(replayed(c, c.snapshot())) == _state(c)
    assert replayed(c, journal).naborted == c.naborted == sum(len(v) for v in c.aborted.values())


def test_partitions_ranges_and_offsets_are_bounded_over_all_open_transactions():
    c = TxnCoordinator()
    c.max_open_partitions, c.max_open_ranges, c.max_open_offsets = 2, 2, 1
    pa, ea = init(c, "a", 1)
    pb, eb = init(c, "b", 2)
    assert c.add_partitions("a", pa, ea, [K1, K2], 0.0) == Err.NONE
    assert c.add_partitions("b", pb, eb, [K1], 0.0) == Err.COORDINATOR_NOT_AVAILABLE
    c.appending(pa, K1, 0, 0)
    c.appending(pa, K2, 0, 0)
    assert c.check_produce(pa, ea, K1) == Err.POLICY_VIOLATION
    c.add_offsets("a", pa, ea, "g", 0.0)
    assert c.txn_offsets("a", pa, ea, "g", {K1: 1}) == Err.NONE
    assert c.txn_offsets("a", pa, ea, "g", {K2: 1}) == Err.POLICY_VIOLATION
    _, plan = c.end_txn("a", pa, ea, True, 0.0)
    c.ending(plan, {K1: 1, K2: 1})
    c.committed({K1: 1, K2: 1})
    assert (c.open_parts, c.open_ranges, c.open_offsets) == (0, 0, 0)
    assert c.add_partitions("b", pb, eb, [K1], 0.0) == Err.NONE  # room again


def test_markers_lost_with_a_refused_partition_are_asked_for_again():
    c = TxnCoordinator()
    pid, epoch = init(c)
    c.add_partitions("tx", pid, epoch, [K1, K2], 0.0)
    c.appending(pid, K1, 0, 1)
    c.appending(pid, K2, 0, 0)
    _, plan = c.end_txn("tx", pid, epoch, False, 0.0)
    c.ending(plan, {K1: 2, K2: 1})
    assert c.lost_markers() == []
    c.clip(K1, 0)  # the store refused K1's commit past offset 0: 1 and the marker at 2 are gone
    assert c.aborted_between(K1, 0, 5) == [(0, 0)]
    [again] = c.lost_markers()
    assert again.keys == [K1] and not again.commit and again.tid == "tx"
    c.remark(again, {K1: 1})
    assert c.lost_markers() == [] and c.committed({K1: 1, K2: 1}) == ["tx"]
    c.clip(("other", "x"), 0)  # never written by a transaction: nothing journalled
    assert not any(r["key"] == ["other", "x"] for r in c.take_journal() if r["op"] == "clip")



def test_txn_encode_makes_control_batches_of_markers_and_counts_without_gaps():
    import struct

    from dafka.kafka.records import MARKER_SLOT, batch_spans, decode_batches, txn_count, txn_encode

    def plain(v: bytes) -> bytes:
        return struct.pack(">QB", 1000, 0) + v

    marker = struct.pack(">QB", 1000, 0x11) + bytes((MARKER_SLOT.size,)) + MARKER_SLOT.pack(42, 3, 0)
    values = [plain(b"a"), plain(b"b"), marker, plain(b"c"), marker]
    data = txn_encode(10, values, 1 << 20)
    batches = decode_batches(data)
    assert [(b.base_offset, b.control, b.producer_id) for b in batches] == [
        (10, False, -1), (12, True, 42), (13, False, -1), (14, True, 42)]
    assert [r.value for b in batches if not b.control for r in b.records] == [b"a", b"b", b"c"]
    assert batches[1].records[0].key == b"\x00\x00\x00\x00"  # version 0, type 0: abort
    assert txn_count(data) == 5
    assert [(s[2], s[3]) for s in batch_spans(data)] == [(10, 11), (12, 12), (13, 13), (14, 14)]
    # A byte limit stops after the batch that reaches it (one record at least).
    small = txn_encode(10, values, 1)
    assert txn_count(small) == 1 and decode_batches(small)[0].records[0].value == b"a"
