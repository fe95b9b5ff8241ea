"""Start positions, committed positions and consumer groups on a real mesh.

Group members run as separate ``dafka consume --group`` processes printing
``topic partition offset content`` lines to a file; stores and producers run
in the test process (or as ``dafka store`` processes where one is killed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.core import wire
from dafka.errors import CommitError
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from dafka.store.node import Store
from tests.conftest import dafka_cmd, subprocess_env, tower_flag, wait_until

pytestmark = pytest.mark.timeout(180)

Key = tuple[str, str]


class Member:
    """A ``dafka consume --group`` process writing what it delivers to a file."""

    def __init__(self, tmp: Path, cfg: NodeConfig, name: str, *args: str) -> None:
        self.out = tmp / f"{name}.out"
        self.err = tmp / f"{name}.err"
        conf = tmp / "node.toml"
        conf.write_text(f"[node]\nbeacon_interval = {cfg.beacon_interval}\nbeacon_timeout = {cfg.beacon_timeout}\n")
        with self.out.open("ab") as out, self.err.open("ab") as err:
            self.proc = subprocess.Popen(
                dafka_cmd("--config", str(conf), "consume", *args, "--tower", tower_flag(cfg), "-v"),
                stdout=out,
                stderr=err,
                env=subprocess_env(),
            )

    def records(self) -> list[tuple[str, int]]:
        """(partition, offset) of every complete line delivered so far."""
        lines = self.out.read_bytes().split(b"\n")[:-1]
        return [(p.decode(), int(o)) for _t, p, o, *_ in (line.split(b" ", 3) for line in lines)]

    def owned(self) -> int:
        """The partition count of the member's last assignment log line (-1: none yet)."""
        found = re.findall(r"delivers (\d+) partitions", self.err.read_text())
        return int(found[-1]) if found else -1

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)


@pytest.fixture
def members(tmp_path: Path, cfg: NodeConfig) -> Any:
    started: list[Member] = []

    def make(name: str, *args: str) -> Member:
        member = Member(tmp_path, cfg, name, *args)
        started.append(member)
        return member

    yield make
    for m in started:
        if m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait(10)


def publish(producer: Producer, start: int, count: int) -> None:
    for i in range(start, start + count):
        producer.publish(b"r%d" % i)
    assert producer.flush(20), "the store did not acknowledge"


def test_start_positions_in_process(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "db"), cfg) as store:
        a, b = Producer("t", cfg), Producer("t", cfg)
        wait_until(lambda: store.peers and len(a.peers) and len(b.peers))
        publish(a, 0, 50)
        publish(b, 0, 50)
        # a at 40; b not listed: latest (nothing of what exists), then what comes.
        with Consumer("t", cfg, start={("t", a.address): 40}) as c:
            got: list[tuple[str, int]] = []
            wait_until(lambda: got.extend((r.partition, r.offset) for r in c.poll_batch(100, 0.1)) or len(got) >= 10)
            assert got == [(a.address, i) for i in range(40, 50)]
            wait_until(lambda: (("t", b.address)) in c.positions())
            publish(b, 50, 1)
            wait_until(lambda: got.extend((r.partition, r.offset) for r in c.poll_batch(100, 0.1)) or len(got) >= 11)
            assert got[10:] == [(b.address, 50)]
        a.close(0)
        b.close(0)


def test_auto_commit_on_assign_and_commit_errors(cfg: NodeConfig, tmp_path: Path) -> None:
    assigned: list[frozenset[Key]] = []
    store = Store(str(tmp_path / "db"), cfg)
    try:
        producer = Producer("t", cfg)
        wait_until(lambda: len(producer.peers))
        publish(producer, 0, 60)
        key = ("t", producer.address)
        with Consumer("t", cfg, group="g", offset_reset="earliest", auto_commit_interval=0.1, on_assign=assigned.append) as c:
            got = [c.poll(10) for _ in range(50)]
            assert [r.offset for r in got if r] == list(range(50))
            assert c.assignment() == frozenset({key}) and assigned == [frozenset({key})]
            wait_until(lambda: store.db.positions("g") == {key: 50})  # committed without asking
            assert c.commit() == {key: 50}
            store.close()
            assert c.poll(10).offset == 50
            with pytest.raises(CommitError):
                c.commit(timeout=0.5)
        with Consumer("t", cfg) as plain, pytest.raises(ValueError):
            plain.commit()
        with pytest.raises(ValueError):
            Consumer("t", cfg, auto_commit_interval=1.0)
        producer.close(0)
    finally:
        store.close()


def test_commit_restart_resumes_after_the_last_commit(cfg: NodeConfig, tmp_path: Path, members) -> None:
    with Store(str(tmp_path / "db"), cfg) as store:
        producer = Producer("t", cfg)
        wait_until(lambda: len(producer.peers))
        publish(producer, 0, 300)
        # A clean exit commits exactly what was printed.
        first = members("first", "t", "--group", "g", "--from-beginning", "--count", "100", "--timeout", "60")
        assert first.proc.wait(90) == 0, first.err.read_text()
        assert first.records() == [(producer.address, i) for i in range(100)]
        assert store.db.positions("g") == {("t", producer.address): 100}
        # Killed while committing every 0.2 s: resumes at its last commit.
        second = members("second", "t", "--group", "g", "--commit-interval", "0.2")
        wait_until(lambda: len(second.records()) >= 100, timeout=60)
        publish(producer, 300, 100)
        wait_until(lambda: len(second.records()) >= 250, timeout=60)
        wait_until(lambda: store.db.positions("g")[("t", producer.address)] > 150, timeout=30)
        second.kill()
        time.sleep(0.3)  # a commit in flight when it died lands (or not) now
        committed = store.db.positions("g")[("t", producer.address)]
        delivered = [o for _, o in second.records()]
        assert delivered == list(range(100, 100 + len(delivered)))  # resumed at 100, no gap
        assert committed <= 100 + len(delivered)
        third = members("third", "t", "--group", "g", "--commit-interval", "0.2")
        publish(producer, 400, 50)
        wait_until(lambda: len(third.records()) >= 450 - committed, timeout=60)
        assert third.stop() == 0
        redelivered = [o for _, o in third.records()]
        assert redelivered == list(range(committed, 450))  # nothing lost, repeats only after the commit
        producer.close(0)


def test_member_started_before_the_store_still_resumes(cfg: NodeConfig, tmp_path: Path, members) -> None:
    db = str(tmp_path / "db")
    producer = Producer("t", cfg)
    with Store(db, cfg):
        wait_until(lambda: len(producer.peers))
        publish(producer, 0, 100)
        first = members("first", "t", "--group", "g", "--from-beginning", "--count", "40", "--timeout", "60")
        assert first.proc.wait(90) == 0, first.err.read_text()
    late = members("late", "t", "--group", "g", "--count", "60", "--timeout", "60")
    # Ordering, not waiting for a result: the member settles and asks for positions
    # before any store is up; its question must be asked again when the store comes.
    time.sleep(1.5)
    with Store(db, cfg):
        assert late.proc.wait(90) == 0, late.err.read_text()
    assert late.records() == [(producer.address, i) for i in range(40, 100)]
    producer.close(0)


def test_three_members_share_six_partitions_and_take_over_a_killed_one(
    cfg: NodeConfig, tmp_path: Path, members
) -> None:
    with Store(str(tmp_path / "db"), cfg) as store:
        producers = [Producer("t", cfg) for _ in range(6)]
        wait_until(lambda: all(len(p.peers) for p in producers))
        for p in producers:
            publish(p, 0, 10)
        group = [members(f"m{i}", "t", "--group", "g", "--from-beginning", "--commit-interval", "0.2") for i in range(3)]
        wait_until(lambda: [m.owned() for m in group] == [2, 2, 2], timeout=60)
        for p in producers:
            publish(p, 10, 200)
        expected = {(p.address, o) for p in producers for o in range(210)}

        def union() -> Counter[tuple[str, int]]:
            return Counter(r for m in group for r in m.records())

        wait_until(lambda: set(union()) >= expected, timeout=60)
        # While stable, every record after the first 10 of each partition is delivered once.
        stable = Counter({r: n for r, n in union().items() if r[1] >= 10})
        assert set(stable.values()) == {1}, [r for r, n in stable.items() if n > 1][:5]
        # Each member delivered whole partitions (no partition split between members).
        owners = {p: {i for i, m in enumerate(group) for q, o in m.records() if q == p and o >= 10} for p, _ in expected}
        assert all(len(o) == 1 for o in owners.values())

        # kill -9 one member: its partitions go to the others, from the last commit.
        victim = group[0]
        lost = {p for p, o in victim.records()}
        victim.kill()
        time.sleep(0.3)
        committed = {p: o for (t, p), o in store.db.positions("g").items()}
        killed_at = time.monotonic()
        for p in producers:
            publish(p, 210, 50)
        expected = {(p.address, o) for p in producers for o in range(260)}
        wait_until(lambda: set(union()) >= expected, timeout=60)
        took = time.monotonic() - killed_at
        counts = union()
        for (partition, offset), n in counts.items():
            if n > 1:
                assert partition in lost and offset >= committed[partition], (partition, offset, n)
        wait_until(lambda: sorted(m.owned() for m in group[1:]) == [3, 3], timeout=30)
        assert took < 3 * cfg.beacon_timeout + 5  # generous: a loaded 2-core machine

        # A new producer's partition is assigned as it appears.
        newcomer = Producer("t", cfg)
        producers.append(newcomer)
        wait_until(lambda: len(newcomer.peers) >= 3)
        publish(newcomer, 0, 20)
        wait_until(lambda: sorted(m.owned() for m in group[1:]) == [3, 4], timeout=30)
        wait_until(lambda: {(newcomer.address, o) for o in range(20)} <= set(union()), timeout=30)

        # A clean leave commits what it printed and hands over at once, without repeats.
        before = union()
        assert group[1].stop() == 0
        left_at = time.monotonic()
        wait_until(lambda: group[2].owned() == 7, timeout=30)
        assert time.monotonic() - left_at < cfg.beacon_timeout + 2
        for p in producers[:-1]:
            publish(p, 260, 50)
        publish(newcomer, 20, 50)
        expected = {(p.address, o) for p in producers[:-1] for o in range(310)}
        expected |= {(newcomer.address, o) for o in range(70)}
        wait_until(lambda: set(union()) >= expected, timeout=60)
        repeated = [r for r, n in union().items() if n > 1 and n != before[r]]
        assert not repeated, repeated[:5]
        assert group[2].stop() == 0
        for p in producers:
            p.close(0)


def test_group_resumes_from_another_store_when_one_is_killed(cfg: NodeConfig, tmp_path: Path, members) -> None:
    stores = [
        subprocess.Popen(
            dafka_cmd("store", "--db", str(tmp_path / f"s{i}"), "--tower", tower_flag(cfg)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=subprocess_env(),
        )
        for i in range(2)
    ]
    producer = Producer("t", cfg)
    try:
        # Both stores read the records live.  One that subscribed late catches up from
        # the other, and the kill below could leave it a hole (a full-suite failure).
        header = producer._record_header
        wait_until(lambda: len(producer.peers) >= 2 and producer.audience.readers(header) >= 2, timeout=30)
        publish(producer, 0, 100)
        first = members("first", "t", "--group", "g", "--from-beginning", "--count", "60", "--timeout", "60")
        assert first.proc.wait(90) == 0, first.err.read_text()
        stores[0].send_signal(signal.SIGKILL)
        stores[0].wait(10)
        publish(producer, 100, 20)
        # Without the positions this latest-reset member would print nothing of the backlog.
        second = members("second", "t", "--group", "g", "--count", "60", "--timeout", "60")
        assert second.proc.wait(90) == 0, second.err.read_text()
        assert second.records() == [(producer.address, i) for i in range(60, 120)]
    finally:
        producer.close(0)
        for s in stores:
            if s.poll() is None:
                s.send_signal(signal.SIGTERM)
                s.wait(20)


def test_store_keeps_positions_and_survives_bad_group_messages(cfg: NodeConfig, tmp_path: Path, raw_peer) -> None:
    with Store(str(tmp_path / "db"), cfg) as store:
        peer = raw_peer([wire.P_COMMITTED, wire.P_POSITIONS])
        peer.wait_for(lambda p: p.subscribed(wire.P_COMMIT) and p.subscribed(wire.P_GET_POSITIONS))
        me = peer.address
        peer.send_raw([b"Cg\x00\x01\x01a"])  # truncated
        peer.send(wire.Commit("g" * 300, me, 1, (("t", "p", 5),)))  # group too long for a key
        peer.send(wire.Commit("g", me, 2, (("t\x00", "p", 5),)))  # NUL in a topic
        peer.send(wire.GetPositions("g", "bad\x00address", 3))  # answer cannot be addressed
        peer.send(wire.Commit("g", me, 4, (("t", "p", 5), ("t", "q", 7))))
        peer.send(wire.Commit("g", me, 5, (("t", "p", 6),)))
        peer.wait_for(lambda p: [m.commit_id for m in p.messages(wire.Committed)] == [4, 5])
        peer.send(wire.GetPositions("g", me, 9))
        answer = peer.wait_for(lambda p: p.messages(wire.Positions))[0]
        assert answer == wire.Positions(me, store.address, "g", 9, (("t", "p", 6), ("t", "q", 7)))
        assert store.db.positions("g") == {("t", "p"): 6, ("t", "q"): 7}
        assert store.bad_input.count >= 3


def test_plain_consumer_subscribes_as_before_and_members_shrug_off_junk(cfg: NodeConfig, raw_peer) -> None:
    peer = raw_peer([wire.P_MEMBER + b"g"])
    with Consumer("t", cfg) as plain:
        own = plain.address.encode()
        # The reference's subscriptions, the batch twins of the record ones (dafka.core.audience)
        # and VOID (a dafka-only answer to its FETCHes, as no C node sends one).
        old = {b"D" + own, b"E" + own, b"L" + own, b"Mt", b"Ht", wire.BATCH_CAPABLE + b"D" + own, wire.BATCH_CAPABLE + b"Mt",
               wire.P_VOID + own}
        peer.wait_for(lambda p: old <= {s[1:] for s in p.subscriptions if s[:1] == b"\x01"})
        peer.pump(0.3)
        assert {s[1:] for s in peer.subscriptions if s[:1] == b"\x01"} == old  # nothing new without a group
    peer.subscriptions.clear()
    with Consumer("t", cfg, group="g") as member:
        own = member.address.encode()
        peer.wait_for(lambda p: p.subscribed(b"Jg") and p.subscribed(b"A" + own) and p.subscribed(b"Q" + own))
        # The member heartbeats at once to a new listener.
        peer.wait_for(lambda p: any(m.address == member.address for m in p.messages(wire.Member)))
        peer.send_raw([b"Jg\x00\x01\x05junk"])
        peer.send_raw([b"Jg\x00\x01"])
        peer.send(wire.Member("g", "X" * 32, False, ("t",), (("t", "P"),)))  # claims a partition nobody has
        peer.send(wire.Member("gg", "Y" * 32, False, ("t",), ()))  # another group, same prefix
        peer.send(wire.Committed(member.address, "S", 12345))  # a commit it never made
        peer.send(wire.Positions(member.address, "S", "g", 999, (("t", "p", 1),)))  # a question never asked
        wait_until(lambda: member.bad_input.count >= 2)
        wait_until(lambda: member._group is not None and member._group.members() == sorted([member.address, "X" * 32]))
        assert member.running and member.assignment() == frozenset()
        seen = len(peer.messages(wire.Member))
        peer.wait_for(lambda p: len(p.messages(wire.Member)) > seen + 2)  # still beating


def test_cli_start_positions(cfg: NodeConfig, tmp_path: Path) -> None:
    with Store(str(tmp_path / "db"), cfg):
        producer = Producer("t", cfg)
        wait_until(lambda: len(producer.peers))
        publish(producer, 0, 20)
        out = subprocess.run(
            dafka_cmd(
                "consume", "t", "--tower", tower_flag(cfg), "--start", f"t/{producer.address}=15",
                "--count", "5", "--timeout", "60",
            ),
            capture_output=True,
            env=subprocess_env(),
            timeout=90,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [b"r%d" % i for i in range(15, 20)]
        bad = subprocess.run(
            dafka_cmd("consume", "t", "--tower", tower_flag(cfg), "--start", "nope"),
            capture_output=True,
            env=subprocess_env(),
            timeout=60,
        )
        assert bad.returncode == 2 and b"PARTITION=OFFSET" in bad.stderr
        producer.close(0)


if os.name != "posix":  # pragma: no cover
    pytest.skip("kill -9 needs POSIX", allow_module_level=True)
