"""A refused owned partition's blocks queued after the refused commit (red-team 50).

When the database refuses an owned partition, the gateway fails every produce in flight
for it (their connections close) and the partition goes on from its committed head.  The
blocks of those produces that were not in the refused commit (staged behind it, or queued)
must go too: kept, they were committed later, a gap (refused again, and whatever produce
shared their commit with them) or, when a new produce filled that gap, stored although
their produces had failed, and the next produce then overlapped them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dafka.config import NodeConfig
from dafka.tank.client import TankClient
from dafka.tank.gateway import Gateway
from dafka.tank.messages import ProduceResponse
from tests.conftest import wait_until
from tests.tank.test_gateway import HOST
from tests.tank.test_pipelined_commit import bundle_of, produce_request

pytestmark = pytest.mark.timeout(120)


def test_produces_queued_behind_a_refused_commit_are_dropped_with_it(cfg: NodeConfig, tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "gw", cfg, listen=(HOST, 0), sync=True)
    try:
        with TankClient(HOST, gw.tank_port, timeout=30) as c:
            c.create_topic("bad", 1)
            assert c.produce("bad", 0, [b"first"]) == 0
            key = next(k for k in gw._owned if k[0] == "bad")
            append = gw.db.append
            go = threading.Event()
            calls: list[int] = []

            def refuse_the_first(batch: Any, **kw: Any) -> Any:
                if not calls and any((b[0], b[1]) == key for b in kw.get("blocks", ())):
                    calls.append(1)
                    go.wait(20)  # the next produce is staged meanwhile
                    time.sleep(1.0)  # a slow disk's stand-in: the commit takes a second
                    kw["rejected"][key] = "refused by the test"
                    kw["blocks"] = [b for b in kw["blocks"] if (b[0], b[1]) != key]
                return append(batch, **kw)

            gw.db.append = refuse_the_first  # type: ignore[method-assign]
            # The writer lingers after the refused commit (it took long) for refills, so a
            # produce sent right after the refusal joins the next transaction.
            gw._pipe.quiet, gw._pipe.max_linger = 0.5, 2.0
            b = TankClient(HOST, gw.tank_port, timeout=30)
            try:
                b.send(produce_request(b, "bad", bundle_of(1, 5)))  # in the refused commit
                wait_until(lambda: calls == [1])
                b.send(produce_request(b, "bad", bundle_of(2, 5)))  # staged behind it
                wait_until(lambda: gw._pipe.staged is not None)
                go.set()
                wait_until(lambda: gw.records_refused >= 5)
                # A new client's produce: the partition goes on from its committed head (0).
                with TankClient(HOST, gw.tank_port, timeout=10) as n:
                    resp = n.wait(n.send(produce_request(n, "bad", bundle_of(3, 5))))
                    assert isinstance(resp, ProduceResponse)
                    assert resp.topics[0].partitions[0].error == 0
                    resp = n.wait(n.send(produce_request(n, "bad", bundle_of(4, 5))))
                    assert isinstance(resp, ProduceResponse)
                    assert resp.topics[0].partitions[0].error == 0
            finally:
                b.close()
        wait_until(lambda: gw._pipe.staged is None and not gw._outstanding)
        # Stored: what was answered, nothing of the failed produces (b1, b2).
        stored = gw.db.fetch("bad", key[1], 0, 100)[1]
        assert stored == [b"first"] + [b"b3-m%d" % j for j in range(5)] + [b"b4-m%d" % j for j in range(5)]
        assert not [blk for blk in gw._blocks if (blk[0], blk[1]) == key]
    finally:
        gw.close()
