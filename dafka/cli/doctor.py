"""``dafka doctor``: can the mesh reach a node started here, and can it reach the mesh?

It joins the mesh as a node would with the same configuration (towers, bind,
advertise, security) and reports, one line each:

* the towers: reached or not (and why);
* where this node listens and what it beacons;
* how the tower sees it and whether the tower could connect to the endpoint
  it announces (a dafka tower's REFLECTION, see :mod:`dafka.core.reach`; a C tower
  sends none, and that is said);
* whether the peers on the mesh connected to it (handshakes on its
  publisher), and whether it connected to each of them, naming the address
  and port of every failure.

What the tower says (its kind, how it sees this node, whether it could connect,
which peers are on the mesh) is marked as the tower's word: a hostile or wrong
tower can say anything, and only the connections the doctor made or received
itself are checked here.  Past ``SHOWN`` peers the lists are summarised: counts,
and a few examples of each outcome.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from dafka.cli.args import add_node_flags, positive_seconds_arg
from dafka.cli.common import EXIT_FAILURE, node_config, unreached_towers
from dafka.config import NodeConfig, Settings
from dafka.core import reach
from dafka.nodes.node import Node

SHOWN = 10  # peers listed one a line; beyond it, counts and EXAMPLES of each outcome
EXAMPLES = 3
TOWER_SAYS = "(the tower's word, not checked here)"


class DoctorNode(Node):
    """A node that only beacons and connects (it subscribes to nothing)."""

    kind = "doctor"


def _where(endpoint: str) -> str:
    try:
        host, port = reach.split_endpoint(endpoint)
    except ValueError:
        return _clip(endpoint)
    return f"address {_clip(host)} port {port}"


def _clip(text: str, limit: int = 80) -> str:
    """What a tower or a peer said, printable and short (it may say anything)."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(cfg: NodeConfig, wait: float, say: Callable[[str], None], unreached_towers: list[str]) -> bool:
    """Run the checks (about ``wait`` seconds); True when every check passed."""
    ok = True
    for line in unreached_towers:
        say(f"FAIL tower {line}")
        ok = False
    logging.getLogger(f"dafka.{DoctorNode.kind}").setLevel(logging.ERROR)  # the lines below say it
    node = DoctorNode(cfg)
    node.start()
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            r = node.reach.reflection
            peers = node.peers.items()
            if (
                r is not None
                and r.probe
                and peers
                and node.inbound.handshakes >= len(peers)
                and not node.links.unreached([e for _, e in peers])
            ):
                break
            time.sleep(0.05)
        waited = wait - max(0.0, deadline - time.monotonic())
        if not node.tower_watch.reached:
            say(f"FAIL no tower answered within {waited:.1f}s")
            return False
        say(f"ok   tower reached ({', '.join(t.beacon_in for t in cfg.towers)})")
        kind = node.census.kind(time.monotonic())
        if kind == "c":
            say("info a tower relays what nodes send, as the C reference tower does (this node's probe came back)")
        elif kind == "dafka":
            say(f"info the tower is a dafka tower: it said hello {TOWER_SAYS}")
        host = node.beacon_host
        say(
            f"info this node listens on {node._bound} and beacons "
            + (f"host {host}" if host else "no host (the tower fills in the address it sees)")
        )
        r = node.reach.reflection
        if r is None:
            say("info the tower did not say how it sees this node (a C tower or an older dafka tower): no tower-side check")
        else:
            say(
                f"info the tower says it sees this host as {_clip(r.seen) or '(unknown)'} and announces this node"
                f" as {_clip(r.endpoint)} {TOWER_SAYS}"
            )
            if r.probe == reach.PROBE_OK:
                say(f"ok   reachable from the tower's side: the tower says it connected to {_where(r.endpoint)} {TOWER_SAYS}")
            elif not r.probe:
                say(f"info the tower has not probed {_clip(r.endpoint)} yet")
            elif r.probe.startswith("not checked"):
                say(f"info tower-side check {_clip(r.probe)}")
            else:
                say(
                    f"FAIL not reachable from the tower's side: {_where(r.endpoint)}: {_clip(r.probe)}"
                    f" {TOWER_SAYS}"
                )
                ok = False
        peers = node.peers.items()
        announced = r.endpoint if r is not None else node._bound
        # Peers dropped after failing while others waited were announced and tried too.
        benched = node.peers.benched
        if not peers and not benched:
            say(
                "info no other node on the mesh: the peer checks need one"
                " (start a node, or run `dafka doctor` on another host at the same time)"
            )
            return ok
        waiting = node.peers.waiting
        tried = len(peers) + benched
        say(
            f"info the tower announced {tried + waiting} peer(s) {TOWER_SAYS}; this node tried"
            f" {tried}" + (f", {waiting} more wait (a node's connection limits)" if waiting else "")
            + (f"; {benched} failed and are kept out for now" if benched else "")
        )
        connected = node.inbound.handshakes
        if connected:
            say(f"ok   reachable from peers: {connected} connection(s) from the {len(peers)} peer(s) on the mesh")
        elif not peers:
            # Every announced peer failed and was dropped (a tower announcing only peers nobody
            # can reach said "no other node" and passed once the wait outlasted them).
            say("info no announced peer is left to connect to this node: every one failed (not checked)")
        else:
            say(
                f"FAIL not reachable from any peer: {len(peers)} peer(s) on the mesh, none connected to"
                f" {_where(announced)}" + (" (as the tower announces it)" if r is not None else "") + f" in {waited:.1f}s"
            )
            for why in node.reach.reasons(node._bound, host, [e for _, e in peers]):
                say(f"     {_clip(why, 200)}")
            ok = False
        reached: list[str] = []
        unreached: list[str] = []
        for address, endpoint in peers:
            role = node.peer_role(address)
            who = f"{role} {_clip(address[:8])}" if role else f"node {_clip(address[:8])}"
            if endpoint in node.links.up:
                reached.append(f"ok   reaches peer {who} at {_clip(endpoint)}")
            else:
                fails = node.links.failing.get(endpoint, 0)
                unreached.append(
                    f"FAIL cannot reach peer {who} at {_where(endpoint)}"
                    + (f" ({fails} failed attempt(s))" if fails else " (no connection yet)")
                )
        if unreached or benched:
            ok = False
        if tried <= SHOWN:
            for line in reached + unreached:
                say(line)
            if benched:
                say(f"FAIL cannot reach {benched} more peer(s): dropped after failed attempts")
            return ok
        not_reached = len(unreached) + benched
        say(f"info {tried} peers: {len(reached)} reached, {not_reached} not; examples:")
        for line in reached[:EXAMPLES] + unreached[:EXAMPLES]:
            say(line)
        if not_reached:
            say(
                f"FAIL cannot reach {not_reached} of {tried} peer(s) announced by the tower"
                " (made-up peers, or a firewall?)"
            )
        return ok
    finally:
        node.stop()


def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    """The I/O implementation; with a tower named, whether a node started here reaches the mesh and is reached."""
    from dafka import fastio

    print(fastio.describe(), flush=True)
    if not (args.tower or os.environ.get("DAFKA_TOWERS") or "towers" in settings.node_keys):
        print("mesh not checked: name a tower (--tower HOST, $DAFKA_TOWERS or [node] towers)")
        return 0
    cfg = node_config(args, settings)
    unreached = unreached_towers(cfg.towers)
    passed = check(cfg, args.wait, lambda line: print(line, flush=True), unreached)
    return 0 if passed else EXIT_FAILURE


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="the I/O implementation in use; with a tower: whether nodes started here reach the mesh and are reached",
    )
    add_node_flags(p)
    p.add_argument("--wait", type=positive_seconds_arg, default=5.0, help="seconds to wait for peers (default 5)")
