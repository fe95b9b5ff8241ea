"""What must hold in every simulated world, checked as the world runs.

Safety (checked after every step, and at the moments named):

``ack-before-commit``
    a store sends ACK n for a partition whose committed head is below n.
``acked-not-durable``
    a producer's window advances on a store's ACK, and that store's database
    does not hold exactly the contents the producer published at those
    offsets (checked at once, or when the store is back if it died meanwhile:
    a kill must not lose what was acknowledged).
``duplicate`` / ``reorder``
    a consumer delivers an offset of a partition twice, or a lower one after
    a higher one.
``corrupt``
    a delivered or stored record is not what its producer published at that
    offset.
``acked-reassigned``
    a producer's window advances on an ACK over an offset that an earlier
    incarnation had seen acknowledged with other contents (acked means
    durable: one offset, one record, for good).
``offset-reassigned``
    a restarted producer publishes at an offset an earlier incarnation of it
    had published (a store that did not answer its resume may hold it; a
    producer without ACKs would see its new record dropped as a duplicate).
``acked-record-skipped``
    a consumer skips forward over an offset some store had acknowledged.
    (A record whose only holder is away past skip_after is skipped by design:
    the world never makes a store that is so away, see World.only_holder.
    A producer may be, cut off with records no store has: a record no store
    had committed when the reader made its last call before giving the hole
    up, right before the skip, is counted as ``acked-after-last-call``, an
    observation, when the returning producer gets it acknowledged in
    between: see Checker._unheld_at_last_call.)
``outbox-lost``
    a device's outbox, opened again after a kill, lacks a record it had
    accepted (committed: its publish returned) that no store acknowledged,
    or holds another content at its offset.
``writer-failed``
    a store's commit fails for another reason than a full disk (which makes
    the store stop acknowledging every partition).
``exception``
    a node's handler raised (the real loop logs it and loses the rest of the
    input it was reading).

Liveness (checked once the world healed: every node up, the network calm,
disks free, time passed):

``not-acknowledging``
    a store has not acknowledged the last offset of an acknowledged
    producer's partition (a store stopped acknowledging healthy partitions).
``unfilled-gap``
    a store lacks a record that is still to be had from a producer or
    another store (a gap that can be filled was not filled).  For producers
    without ACKs (rings) a store's recorded hole whose records another store
    holds is counted as an observation instead (stores repair their holes
    from peers with a backoff that may not have come round yet; consumers
    still get the records).
``consumer-missing``
    a consumer has not delivered such a record.
``diverged``
    two stores hold different records at one offset of a partition with ACKs.
``acked-not-replicated``
    a store lacks an acknowledged record another store holds (every store
    holds every acknowledged record once repair had time: catch-up FETCHes
    and the repair of recorded holes from peers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dafka.core.gaps import FINAL_CALL
from dafka.sim.hosts import StoreHost, WorldView
from dafka.sim.nodes import SimDevice, parse_content
from dafka.store.db import StorageFullError

SAFETY = (
    "ack-before-commit",
    "acked-not-durable",
    "duplicate",
    "reorder",
    "corrupt",
    "acked-reassigned",
    "offset-reassigned",
    "acked-record-skipped",
    "writer-failed",
    "exception",
    "outbox-lost",
)
LIVENESS = ("not-acknowledging", "unfilled-gap", "consumer-missing", "diverged", "acked-not-replicated")


@dataclass(slots=True)
class Violation:
    kind: str
    step: int  # schedule step (-1: after healing)
    time: float
    detail: str

    def __str__(self) -> str:
        where = "after healing" if self.step < 0 else f"step {self.step}"
        return f"{self.kind} at {where} (t={self.time:.3f}s): {self.detail}"


@dataclass
class Checker:
    """Records what was published and acknowledged; reports what breaks."""

    world: WorldView
    violations: list[Violation] = field(default_factory=list)
    checks: int = 0
    # (partition address, offset) -> contents ever published there (one per incarnation)
    published: dict[tuple[str, int], set[bytes]] = field(default_factory=dict)
    acked: dict[tuple[str, int], bytes] = field(default_factory=dict)  # what producers saw acknowledged
    # per store host: partition -> highest ACK it sent
    acks_sent: dict[tuple[str, str], int] = field(default_factory=dict)
    # ACKs whose store died before the check: (host name, partition, [(offset, content)])
    deferred: list[tuple[str, str, list[tuple[int, bytes]]]] = field(default_factory=list)
    # per consumer incarnation: partition -> last delivered offset
    delivered: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    # Findings that are not violations (see final): kind -> count
    observations: dict[str, int] = field(default_factory=dict)
    # When each offset was (last) published, and per partition the longest a
    # consumer took to deliver a record after its publish (simulated seconds).
    published_at: dict[tuple[str, int], float] = field(default_factory=dict)
    max_delay: dict[str, float] = field(default_factory=dict)
    # When a store first committed each record of a partition with ACKs, and
    # the offsets published there that no store has committed yet.
    stored_at: dict[tuple[str, int], float] = field(default_factory=dict)
    unstored: dict[str, set[int]] = field(default_factory=dict)
    # Per consumer incarnation: partition -> holes it gave up after skip_after,
    # as (first, last, when its last FETCH before went out, the skip's time, retry_interval).
    given_up: dict[tuple[str, int], dict[str, list[tuple[int, int, float, float, float]]]] = field(
        default_factory=dict
    )

    def observe(self, kind: str, n: int = 1) -> None:
        if n:
            self.observations[kind] = self.observations.get(kind, 0) + n

    def fail(self, kind: str, detail: str) -> None:
        w = self.world
        self.violations.append(Violation(kind, w.step_index, w.now, detail))

    # ------------------------------------------------------------ events

    def on_publish(self, partition: str, first: int, contents: list[bytes]) -> None:
        reported = False
        now = self.world.now
        for i, c in enumerate(contents):
            self.published_at[(partition, first + i)] = now
            was = self.published.setdefault((partition, first + i), set())
            if was and c not in was and not reported:
                reported = True  # once per publish
                self.fail(
                    "offset-reassigned",
                    f"{partition}@{first + i} published again as {c[:30]!r}, was {min(was)[:30]!r}",
                )
            was.add(c)
        if not self.world.host(self.world.partition_names[partition]).ring:
            self.unstored.setdefault(partition, set()).update(range(first, first + len(contents)))

    def on_store_commit(self, host: StoreHost) -> None:
        """Store ``host`` committed: note when each published record was first stored anywhere."""
        store = host.store
        if store is None or not self.unstored:
            return
        now = self.world.now
        topic = self.world.topic
        for partition, offsets in self.unstored.items():
            if not offsets:
                continue
            for start, end in _runs(sorted(offsets)):
                for r in store.db.read(topic, partition, start, end - start + 1):
                    if r.offset > end:
                        break
                    key = (partition, r.offset)
                    if r.offset in offsets and r.content in self.published.get(key, ()):
                        self.stored_at[key] = now
                        offsets.discard(r.offset)

    def on_given_up(self, consumer: str, incarnation: int, skips: list[tuple[str, int, int, float, float]]) -> None:
        """Consumer ``consumer`` gave these holes up after skip_after (not restart holes)."""
        mine = self.given_up.setdefault((consumer, incarnation), {})
        now = self.world.now
        for partition, first, last, asked_at, retry_interval in skips:
            mine.setdefault(partition, []).append((first, last, asked_at, now, retry_interval))

    def _unheld_at_last_call(self, consumer: str, incarnation: int, partition: str, off: int) -> bool:
        """Whether the consumer gave ``off`` up after skip_after, and no store held it
        when the consumer asked for it the last time before (its last call, which
        goes out right before a hole is given up: gaps.FINAL_CALL).

        Such a record's only holder (its producer: cut off, or a store away)
        was away for skip_after, the reader's whole wait but its last moments:
        skipped by design, also when it is stored and acknowledged between the
        last call and the skip (seed 3100454).
        """
        stored = self.stored_at.get((partition, off))
        if stored is None:
            return False  # acknowledged and never seen stored: no excuse
        for first, last, asked_at, at, retry_interval in self.given_up.get((consumer, incarnation), {}).get(partition, ()):
            if (
                first <= off <= last
                and at - (FINAL_CALL + 1) * retry_interval <= asked_at < stored
            ):
                return True
        return False

    def on_store_ack(self, host: StoreHost, topic: str, partition: str, seq: int) -> None:
        self.checks += 1
        key = (host.name, partition)
        if seq > self.acks_sent.get(key, -1):
            self.acks_sent[key] = seq
        head = host.store.db.head(topic, partition) if host.store is not None else None
        if head is None or head < seq:
            self.fail("ack-before-commit", f"store {host.name} sent ACK {seq} of {partition}, committed head {head}")

    def on_producer_ack(self, host: StoreHost | None, topic: str, partition: str, expected: list[tuple[int, bytes]]) -> None:
        """A producer's window advances over ``expected`` on ``host``'s ACK."""
        reported = False
        for off, content in expected:
            was = self.acked.setdefault((partition, off), content)
            if was != content:
                if not reported:  # once per ACK
                    reported = True
                    self.fail(
                        "acked-reassigned",
                        f"{partition}@{off} acknowledged as {content[:30]!r}, earlier as {was[:30]!r}",
                    )
                self.acked[(partition, off)] = content
        if host is None:
            return  # not from a store (a hostile ACK is not simulated)
        if host.store is None:
            self.deferred.append((host.name, partition, expected))
            return
        self.check_held(host, topic, partition, expected, "acked-not-durable")

    def check_held(
        self, host: StoreHost, topic: str, partition: str, expected: list[tuple[int, bytes]], kind: str
    ) -> None:
        assert host.store is not None
        self.checks += 1
        if not expected:
            return
        first = expected[0][0]
        db = host.store.db
        have = {r.offset: r.content for r in db.read(topic, partition, first, expected[-1][0] - first + 1)}
        for off, content in expected:
            got = have.get(off)
            if got != content:
                self.fail(
                    kind,
                    f"store {host.name} acknowledged {partition}@{off} but holds "
                    f"{'nothing' if got is None else got[:40]!r} there",
                )
                return

    def on_store_up(self, host: StoreHost, topic: str) -> None:
        """A store (re)started: everything it acknowledged before must still be there."""
        keep = []
        for name, partition, expected in self.deferred:
            if name == host.name:
                self.check_held(host, topic, partition, expected, "acked-not-durable")
            else:
                keep.append((name, partition, expected))
        self.deferred = keep

    def on_delivered(self, consumer: str, incarnation: int, records: list[tuple[str, str, int, bytes]]) -> None:
        last = self.delivered.setdefault((consumer, incarnation), {})
        real = self.world.partition_names
        for _topic, partition, off, content in records:
            self.checks += 1
            prev = last.get(partition, -1)
            if off == prev:
                self.fail("duplicate", f"consumer {consumer} delivered {partition}@{off} twice")
            elif off < prev:
                self.fail("reorder", f"consumer {consumer} delivered {partition}@{off} after @{prev}")
            elif off > prev + 1 and partition in real:
                lo = prev + 1
                skipped = [k for k in range(lo, off) if (partition, k) in self.acked]
                late = [k for k in skipped if self._unheld_at_last_call(consumer, incarnation, partition, k)]
                if late:
                    self.observe("acked-after-last-call", len(late))
                    skipped = [k for k in skipped if k not in late]
                if skipped:
                    self.fail(
                        "acked-record-skipped",
                        f"consumer {consumer} skipped {partition}@{lo}..{off - 1}, "
                        f"of which {len(skipped)} were acknowledged (first {skipped[0]})",
                    )
            last[partition] = max(prev, off)
            if partition not in real:
                continue  # a hostile node's partition: only order is checked
            at = self.published_at.get((partition, off))
            if at is not None and self.world.now - at > self.max_delay.get(partition, 0.0):
                self.max_delay[partition] = self.world.now - at
            parsed = parse_content(content)
            if (
                parsed is None
                or parsed[2] != off
                or real[partition] != parsed[0]
                or content not in self.published.get((partition, off), ())
            ):
                self.fail("corrupt", f"consumer {consumer} delivered {content[:40]!r} as {partition}@{off}")

    def on_device_up(self, device: SimDevice) -> None:
        """A device (re)opened its outbox: what it accepted before is there or was acknowledged."""
        image = device.loaded
        partition = device.address
        self.checks += 1
        self.observe("outbox-reloaded", len(image.records))
        kept = {off: content for off, _, content in image.records}
        for (part, off), contents in self.published.items():
            if part != partition:
                continue
            # Accepted (committed) records are published once per offset: one content.
            content = min(contents)
            if off in kept:
                if kept[off] not in contents:
                    self.fail("outbox-lost", f"outbox of {partition} holds {kept[off][:30]!r} at {off}, accepted {content[:30]!r}")
                    return
            elif self.acked.get((part, off)) != content:
                self.fail(
                    "outbox-lost",
                    f"outbox of {partition} accepted {off} ({content[:30]!r}); it is neither in the outbox "
                    f"(offsets {image.floor}..{image.next - 1}) nor acknowledged",
                )
                return

    # ------------------------------------------------------------ after every step

    def after_step(self) -> None:
        for host in self.world.stores:
            store = host.store
            if store is None:
                continue
            self.checks += 1
            err = store.storage_error
            if err is not None and not isinstance(err, StorageFullError):
                self.fail("writer-failed", f"store {host.name} cannot write: {err}")

    # ------------------------------------------------------------ after healing

    def _held(self) -> dict[str, dict[str, dict[int, bytes]]]:
        """Per live store, per partition: the records it holds."""
        w = self.world
        return {
            host.name: {
                p: {r.offset: r.content for r in host.store.db.read(w.topic, p, 0, 1 << 40)}
                for p in w.partition_names
            }
            for host in w.stores
            if host.store is not None
        }

    def repair_pending(self) -> bool:
        """Whether a live store lacks an acknowledged record another holds (its repair may still come)."""
        held = self._held()
        for (partition, off), content in self.acked.items():
            have = [h[partition].get(off) == content for h in held.values()]
            if any(have) and not all(have):
                return True
        return False

    def final(self) -> None:
        w = self.world
        held = self._held()
        assert len(held) == len(w.stores)
        for host in w.stores:
            store = host.store
            assert store is not None
            self.checks += 1
            if store.storage_error is not None:
                self.fail("writer-failed", f"store {host.name} still cannot write: {store.storage_error}")
        for prod in w.producers:
            p = prod.node
            if p is None:
                continue
            available = {off: c for off, c in enumerate_window(p)}
            for name in held:
                available.update(held[name][p.address])
            # Only what this incarnation published: a resumed producer starts
            # after the stores' heads, which count records they received but
            # never committed (lost with the old incarnation: nothing to ACK).
            if not p.ring and p.ready and p.window.last >= p.start_offset:
                for host in w.stores:
                    self.checks += 1
                    sent = self.acks_sent.get((host.name, p.address), -1)
                    if sent < p.window.last:
                        self.fail(
                            "not-acknowledging",
                            f"store {host.name} acknowledged {p.address}@{sent}, the producer is at "
                            f"{p.window.last}",
                        )
            for host in w.stores:
                self.checks += 1
                missing = sorted(set(available) - set(held[host.name][p.address]))
                if missing and p.ring:
                    # acks=False: two stores may skip different ranges while the
                    # ring evicts, and the repair of a recorded hole from a peer
                    # that holds the records backs off. Consumers still get them
                    # (consumer-missing below); reported, not a violation.
                    self.observations["ring-hole-held-elsewhere"] = (
                        self.observations.get("ring-hole-held-elsewhere", 0) + len(missing)
                    )
                elif missing:
                    self.fail(
                        "unfilled-gap",
                        f"store {host.name} lacks {len(missing)} records of {p.address} to be had "
                        f"elsewhere ({fmt_ranges(missing)})",
                    )
            for c in w.consumers:
                if c.node is None:
                    continue
                self.checks += 1
                got = self.delivered.get((c.name, c.incarnation), {}).get(p.address, -1)
                missing = [k for k in available if k > got]
                if missing:
                    self.fail(
                        "consumer-missing",
                        f"consumer {c.name} delivered {p.address} up to {got}, "
                        f"{len(missing)} more to be had ({fmt_ranges(sorted(missing))})",
                    )
        for p_addr in w.partition_names:
            if w.host(w.partition_names[p_addr]).ring:
                continue
            views = [held[n][p_addr] for n in held]
            for off, content in views[0].items():
                others = [v[off] for v in views[1:] if off in v and v[off] != content]
                if others:
                    self.checks += 1
                    self.fail(
                        "diverged",
                        f"stores hold different records at {p_addr}@{off}: {content[:30]!r} / {others[0][:30]!r}",
                    )
                    break
        for off_key, content in self.acked.items():
            self.checks += 1
            partition, off = off_key
            holders = [n for n in held if held[n][partition].get(off) == content]
            if not holders:
                self.fail("acked-not-durable", f"{partition}@{off} was acknowledged and no store holds it")
                break
            if len(holders) < len(held):
                # Every store holds every acknowledged record once repair had time.
                lacking = sorted(set(held) - set(holders))
                self.fail(
                    "acked-not-replicated",
                    f"{partition}@{off} was acknowledged; stores {', '.join(lacking)} lack it after healing "
                    f"(hole repair from {holders[0]} did not fill it)",
                )
                break


def enumerate_window(p: object) -> list[tuple[int, bytes]]:
    window = p.window  # type: ignore[attr-defined]
    return list(window.fetch(window.acked + 1, len(window)))


def _runs(offsets: list[int]) -> list[tuple[int, int]]:
    """``[1, 2, 3, 7]`` -> ``[(1, 3), (7, 7)]`` (sorted offsets)."""
    out: list[tuple[int, int]] = []
    for o in offsets:
        if out and o == out[-1][1] + 1:
            out[-1] = (out[-1][0], o)
        else:
            out.append((o, o))
    return out


def fmt_ranges(offsets: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1..3, 7"`` (at most 5 ranges)."""
    out = [f"{a}..{b}" if b != a else f"{a}" for a, b in _runs(offsets)]
    return ", ".join(out[:5]) + (" ..." if len(out) > 5 else "")
