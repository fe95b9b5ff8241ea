"""A consumer whose whole network is cut, towers included, holds its holes (issue 40).

Peers are not expired while no tower is heard (discovery), so such a consumer never
learns that its stores are gone; its towers' silence must count as that, or a hole it
knows would be skipped after ``skip_after`` over records its stores hold.
"""

from __future__ import annotations

import time

from dafka.config import NodeConfig
from dafka.nodes.consumer import Consumer
from tests.conftest import wait_until


def test_a_consumer_whose_towers_fall_silent_counts_its_holes_unheard(cfg: NodeConfig) -> None:
    with Consumer("cut", cfg) as c:
        assert c.owner_hears("P")
        wait_until(lambda: c.tower_watch.heard_at is not None, timeout=10)  # the tower is heard
        assert c.owner_hears("P")
        c.tower_watch.heard_at = time.monotonic() - 10 * c._quiet_limit  # silent for long
        assert not c.owner_hears("P")
        wait_until(lambda: c.owner_hears("P"), timeout=10)  # heard again: holes go on as before


def test_a_consumer_without_towers_is_not_held_by_their_silence() -> None:
    with Consumer("cut", NodeConfig(towers=(), bind="127.0.0.1")) as c:
        assert c.tower_watch.heard_at is None
        assert c.owner_hears("P")
