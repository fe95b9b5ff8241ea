"""Reachability, sans-IO: where a node says it is, how the tower sees it, who reached whom.

* :func:`beacon_host`: the host a node puts in its beacon.  A node bound to
  one interface names it (so no tower has to guess, and the C tower, which
  replaces a Peer-Address of 127.0.0.1 with its own first interface address,
  cannot announce it where nothing listens); a node bound to every interface
  leaves it empty, as the C nodes do, and the tower fills in the address it
  sees.
* The REFLECTION (dafka only): after relaying a node's beacon, a dafka tower
  tells that node how it sees it, on its beacon-out XPUB::

      [b"R" + node address] [seen host] [announced endpoint] [probe]

  ``seen host`` is the Peer-Address of the beacon's connection ("" if none),
  ``announced endpoint`` the ``tcp://host:port`` the tower relays to every
  peer, ``probe`` what the tower found when it connected to that endpoint:
  "" (not checked yet), ``ok``, or why not (``connection refused``, ...,
  ``not checked: ...``).  A node subscribes ``b"R" + its address`` on its
  beacon SUB; the tower sends a reflection only to an address subscribed so,
  and probes only for those.  C nodes subscribe ``W`` and ``B`` only, so
  reflections never reach them; a C tower never sends any (the node then
  knows nothing of how it is seen, and says so).  Every frame is ASCII of at
  most 255 bytes.
* :class:`ProbePlan`: which announced endpoints a tower connects to, and how
  often (a hostile node must not turn the tower into a port scanner).
* :class:`ReachWatch`: a node's view (reflections, peers that completed a
  handshake with its publisher) and, when no peer reached it for a while,
  why it may be unreachable.
* :class:`Links`: per endpoint, whether a socket's connection is up, from its
  monitor events (the producer's diagnosis and ``dafka doctor``).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from dafka.errors import ProtocolError

REFLECTION = b"R"
MAX_FRAME = 255
PROBE_OK = "ok"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` (an IPv6 host without brackets); ValueError if not one."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp endpoint: {endpoint!r}")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"no port in {endpoint!r}")
    return host.strip("[]"), int(port)


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("*", "0.0.0.0", "::", "")


def is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def beacon_host(advertise: str, bound_endpoint: str) -> str:
    """The host a node beacons: ``advertise`` if set, else the interface it is bound to, else ""."""
    if advertise:
        return advertise
    try:
        host, _ = split_endpoint(bound_endpoint)
    except ValueError:
        return ""
    return "" if is_wildcard(host) else host


# ---------------------------------------------------------------- the REFLECTION message


@dataclass(frozen=True, slots=True)
class Reflection:
    """How a tower sees a node."""

    address: str
    seen: str  # the Peer-Address of the node's beacon connection ("" if unknown)
    endpoint: str  # what the tower announces to peers
    probe: str  # "" (not checked yet), "ok", or why the tower could not connect


def reflection_topic(address: str) -> bytes:
    """What a node subscribes on its beacon SUB to get its reflections."""
    return REFLECTION + address.encode()


def _frame(text: str) -> bytes:
    return text.encode("ascii", "replace")[:MAX_FRAME]


def encode_reflection(r: Reflection) -> list[bytes]:
    return [reflection_topic(r.address), _frame(r.seen), _frame(r.endpoint), _frame(r.probe)]


def decode_reflection(frames: Sequence[bytes]) -> Reflection:
    """A reflection from its frames; ProtocolError if malformed."""
    if len(frames) != 4 or bytes(frames[0][:1]) != REFLECTION:
        raise ProtocolError("reflection must be 4 frames, the first starting with R")
    if any(len(f) > MAX_FRAME + 1 for f in frames):
        raise ProtocolError("reflection frame too long")
    try:
        address, seen, endpoint, probe = (bytes(f).decode("ascii") for f in frames)
    except UnicodeDecodeError:
        raise ProtocolError("reflection is not ASCII") from None
    return Reflection(address[1:], seen, endpoint, probe)


def wanted_reflection(subscription: bytes) -> tuple[bool, str] | None:
    """``(subscribe?, address)`` if an XPUB (un)subscription frame asks for reflections."""
    if len(subscription) < 3 or subscription[0] > 1 or subscription[1:2] != REFLECTION:
        return None
    try:
        return subscription[0] == 1, subscription[2:].decode("ascii")
    except UnicodeDecodeError:
        return None


# ---------------------------------------------------------------- the tower's probes


class ProbePlan:
    """Which announced endpoints a tower connects to, to tell nodes whether they are reachable.

    Only nodes that asked (subscribed their reflection) are probed, and only at
    the address their beacon came from: a node that announces another host is
    told "not checked", so no beacon can make the tower connect to a third
    machine.  Each endpoint at most once per ``ttl`` seconds, at most
    ``max_in_flight`` at a time; at most ``max_nodes`` addresses and
    ``max_results`` results are remembered (the oldest go first).  A node is
    told again only when what it is told changed, or after ``repeat`` seconds.
    """

    def __init__(
        self,
        ttl: float = 30.0,
        max_in_flight: int = 16,
        max_nodes: int = 4096,
        max_results: int = 4096,
        repeat: float = 30.0,
    ) -> None:
        self.ttl = ttl
        self.max_in_flight = max_in_flight
        self.max_nodes = max_nodes
        self.max_results = max_results
        self.wanting: OrderedDict[str, None] = OrderedDict()
        self.results: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()  # -> (result, when)
        self.in_flight: set[tuple[str, int]] = set()
        # address -> (what it was last told, when): an unchanged reflection is
        # said again only every ``repeat`` seconds, not at every beacon (a
        # thousand nodes would otherwise get a thousand reflections a second).
        self.repeat = repeat
        self.reflected: OrderedDict[str, tuple[tuple[str, str, str], float]] = OrderedDict()

    def should_reflect(self, address: str, told: tuple[str, str, str], now: float) -> bool:
        """Whether to send ``address`` its reflection ``told`` (seen, endpoint, probe) now."""
        last = self.reflected.get(address)
        if last is not None and last[0] == told and now < last[1] + self.repeat:
            return False
        self.reflected[address] = (told, now)
        self.reflected.move_to_end(address)
        while len(self.reflected) > self.max_nodes:
            self.reflected.popitem(last=False)
        return True

    def on_subscription(self, subscribe: bool, address: str) -> None:
        self.reflected.pop(address, None)  # (re)subscribed: told at its next beacon
        if subscribe:
            self.wanting[address] = None
            self.wanting.move_to_end(address)
            while len(self.wanting) > self.max_nodes:
                self.wanting.popitem(last=False)
        else:
            self.wanting.pop(address, None)

    def wants(self, address: str) -> bool:
        return address in self.wanting

    def on_beacon(self, seen: str, endpoint: str, now: float) -> tuple[str, tuple[str, int] | None]:
        """(what to report now, the (host, port) to probe now or None)."""
        try:
            host, port = split_endpoint(endpoint)
        except ValueError:
            return "not checked: not a tcp endpoint", None
        if not seen:
            return "not checked: the tower does not know the node's address", None
        if host != seen and not (is_loopback_ip(host) and is_loopback_ip(seen)):
            return f"not checked: the node announces {host}, but its beacons come from {seen}", None
        key = (host, port)
        known = self.results.get(key)
        if key in self.in_flight:
            return (known[0] if known else ""), None
        if known is not None and now - known[1] < self.ttl:
            return known[0], None
        if len(self.in_flight) >= self.max_in_flight:
            return (known[0] if known else ""), None
        self.in_flight.add(key)
        return (known[0] if known else ""), key

    def on_result(self, key: tuple[str, int], result: str, now: float) -> None:
        self.in_flight.discard(key)
        self.results[key] = (result, now)
        self.results.move_to_end(key)
        while len(self.results) > self.max_results:
            self.results.popitem(last=False)


# ---------------------------------------------------------------- a node's view


class Links:
    """Per endpoint, whether a socket's connection to it is up (from monitor events).

    ``up`` holds endpoints with a completed handshake; ``failing`` the endpoints
    whose last attempt failed, with the number of failures since the last
    success.  Bounded by the endpoints the owner connects to (it calls
    :meth:`forget` when it disconnects).
    """

    def __init__(self) -> None:
        self.up: set[str] = set()
        self.failing: dict[str, int] = {}
        self.handshakes = 0  # completed handshakes, ever (inbound on a bound socket)
        self.open = 0  # connections with a completed handshake, now (bound socket)

    def on_event(self, event: int, endpoint: str) -> None:
        import zmq

        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshakes += 1
            self.open += 1
            self.up.add(endpoint)
            self.failing.pop(endpoint, None)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.failing[endpoint] = self.failing.get(endpoint, 0) + 1
        elif event == zmq.EVENT_DISCONNECTED:
            self.open = max(0, self.open - 1)
            self.up.discard(endpoint)

    def forget(self, endpoint: str) -> None:
        self.up.discard(endpoint)
        self.failing.pop(endpoint, None)

    def unreached(self, endpoints: Sequence[str]) -> list[str]:
        """Those of ``endpoints`` not connected (failing, or never reached yet)."""
        return [e for e in endpoints if e not in self.up]


class CutWatch:
    """Connections ZeroMQ cut for good (a frame over ZMQ_MAXMSGSIZE), from monitor events; sans-IO.

    libzmq 4.3.5 (measured, plain and CURVE): a peer that sends a frame over
    the receiving socket's ZMQ_MAXMSGSIZE is a protocol error; the monitor
    shows EVENT_DISCONNECTED and nothing after it, and ZeroMQ never connects
    to that endpoint again.  A connection lost otherwise (the peer went away)
    shows EVENT_DISCONNECTED then at once EVENT_CONNECT_RETRIED: ZeroMQ
    reconnects by itself.  So an established connection (its handshake
    succeeded) whose DISCONNECTED no CONNECT_RETRIED follows within ``grace``
    seconds was cut, and the owner must connect again itself.  Keys are what
    the owner likes (a socket and an endpoint); bounded by the connections it
    makes (it calls :meth:`forget` when it disconnects).
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._up: set[object] = set()
        self._down: dict[object, float] = {}  # disconnected at, no retry seen yet

    def on_event(self, key: object, event: int, now: float) -> None:
        import zmq

        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up.add(key)
            self._down.pop(key, None)
        elif event == zmq.EVENT_DISCONNECTED:
            if key in self._up:
                self._up.discard(key)
                self._down[key] = now
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._down.pop(key, None)

    @property
    def pending(self) -> bool:
        """Whether a disconnection waits to be told apart (see :meth:`cut`)."""
        return bool(self._down)

    def due(self) -> float | None:
        """When the earliest pending disconnection can be told apart (None: none
        pending): the owner checks then, and not at all while nothing is pending."""
        return min(self._down.values()) + self.grace if self._down else None

    def cut(self, now: float) -> list[object]:
        """The connections found cut since the last call (each reported once)."""
        due = [key for key, at in self._down.items() if now - at >= self.grace]
        for key in due:
            del self._down[key]
        return due

    def forget(self, key: object) -> None:
        self._up.discard(key)
        self._down.pop(key, None)


class ReachWatch:
    """Whether peers reach a node, and why they may not (sans-IO).

    Fed with reflections (how the tower sees the node) and with the count of
    handshakes peers completed on its publisher.  A warning is due when peers
    have been on the mesh for ``grace`` seconds and none ever completed a
    handshake with this node, and again every ``repeat`` seconds while so.
    """

    def __init__(self, started: float, grace: float, repeat: float = 60.0) -> None:
        self.started = started
        self.grace = grace
        self.repeat = repeat
        self.reflection: Reflection | None = None
        self.peers_since: float | None = None
        self._warned_at: float | None = None
        self._reported_probe = ""
        self._probe_warned_at: float | None = None

    def on_reflection(self, reflection: Reflection, now: float) -> str | None:
        """Keep it; a warning to log when the tower's probe newly failed.

        At most one every ``repeat`` seconds: a tower that changes its probe
        text at every beacon (broken or hostile) must not flood the log.
        """
        self.reflection = reflection
        probe = reflection.probe
        if probe == self._reported_probe:
            return None
        self._reported_probe = probe
        if not probe or probe == PROBE_OK or probe.startswith("not checked"):
            return None
        if self._probe_warned_at is not None and now < self._probe_warned_at + self.repeat:
            return None
        self._probe_warned_at = now
        host, port = _host_port(reflection.endpoint)
        return (
            f"the tower could not connect to this node's announced endpoint {reflection.endpoint}"
            f" (address {host}, port {port}): {probe}; peers will not reach it either"
        )

    def warning_due(self, now: float, peers: int, handshakes: int) -> bool:
        if peers == 0 or handshakes > 0:
            self.peers_since = None if peers == 0 else self.peers_since
            return False
        if self.peers_since is None:
            self.peers_since = now
        if now < max(self.peers_since, self.started) + self.grace:
            return False
        if self._warned_at is not None and now < self._warned_at + self.repeat:
            return False
        self._warned_at = now
        return True

    def reasons(self, bound: str, announced: str, peer_endpoints: Sequence[str]) -> list[str]:
        """Why peers may not reach a node bound at ``bound`` that beacons host ``announced``."""
        out = []
        try:
            bound_host, port = split_endpoint(bound)
        except ValueError:
            bound_host, port = "", 0
        remote_peers = sorted({h for h in (_host_port(e)[0] for e in peer_endpoints) if h and not is_loopback_ip(h)})
        if is_loopback_ip(bound_host) and remote_peers:
            out.append(
                f"it listens on {bound_host} only, but peers are at {', '.join(remote_peers[:3])}:"
                " bind an address they reach (--bind ADDR)"
            )
        if announced and is_loopback_ip(announced) and remote_peers:
            out.append(f"it announces {announced}, a loopback address, to peers at {', '.join(remote_peers[:3])}")
        r = self.reflection
        if r is None:
            out.append("the tower did not say how it sees this node (a C tower or an older dafka tower)")
        else:
            # (the tower's word: what it says is repeated as such, never as a fact checked here)
            out.append(f"the tower says it sees it at {r.seen or '(unknown)'} and announces it as {r.endpoint}")
            if r.probe and r.probe != PROBE_OK:
                out.append(f"the tower says its own connection attempt got: {r.probe}")
            elif r.probe == PROBE_OK:
                out.append(
                    "the tower says it could connect to it, so a firewall between the peers and it may block the port"
                )
        if port:
            out.append(f"peers must reach port {port} (an ephemeral port: open it in firewalls)")
        return out


def _host_port(endpoint: str) -> tuple[str, int | str]:
    try:
        return split_endpoint(endpoint)
    except ValueError:
        return endpoint, "?"
