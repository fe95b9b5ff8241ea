"""``dafka tank ...``: a Tank client on the command line (for a gateway or a Tank broker).

    dafka tank create TOPIC [PARTITIONS]
    dafka tank produce TOPIC [-p N] [-k KEY] [MESSAGE ...]      (else one per stdin line)
    dafka tank consume TOPIC [-p N] [--from first|tail|SEQ] [--count N] [--follow] [-v]
    dafka tank topics | partitions TOPIC | status

``consume`` reads every partition of the topic (in partition order) unless
``-p`` names one.  Without ``--broker`` the client talks to the gateway of the
configuration (``[gateway] listen``, a wildcard host read as 127.0.0.1), else
to 127.0.0.1:11011.  Errors print one ``error:`` line: exit 1 for what the
broker said or an unreachable broker, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dafka.config import parse_listen, parse_topic
from dafka.errors import ConfigError
from dafka.tank.client import TankClient, TankConnectionError, TankError, UnknownTopicError
from dafka.tank.codec import UINT64_MAX
from dafka.tank.messages import ConsumeFlag

DEFAULT_PORT = 11011
DEFAULT_BROKER = f"127.0.0.1:{DEFAULT_PORT}"


def _arg(parse: Any) -> Any:
    """An argparse ``type=`` turning ConfigError/ValueError into a usage error."""

    def check(text: str) -> Any:
        try:
            return parse(text)
        except (ConfigError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def _int_in(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise ValueError(f"{value} is not in {low}..{high}")
        return value

    return _arg(parse)


def _start(text: str) -> int:
    """``first`` (0), ``tail`` (UINT64_MAX) or a sequence number."""
    named = {"first": 0, "tail": UINT64_MAX}.get(text)
    if named is not None:
        return named
    try:
        seq = int(text)
    except ValueError:
        raise ValueError(f"{text!r}: use first, tail or a sequence number") from None
    if not 0 <= seq < UINT64_MAX:
        raise ValueError(f"sequence number {seq} out of range")
    return seq


def _timeout(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(f"{text!r}: must be more than 0 seconds")
    return value


broker_arg = _arg(lambda t: parse_listen(t, DEFAULT_PORT, minimum_port=1))
partition_arg = _int_in(0, 65534)  # u16 ids; 0xffff marks an unknown topic
topic_arg = _arg(parse_topic)  # Tank's str8: at most 255 bytes


def _intermixed(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """``base`` parsing options between positionals too (``produce news -p 1 msg``).

    argparse fills ``TOPIC MESSAGE*`` at the first positional it meets, so
    anything after an option would be "unrecognized"; intermixed parsing takes
    the options first, then the positionals.
    """

    class Intermixed(base):  # type: ignore[valid-type, misc]
        _mixing = False

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            if self._mixing:  # parse_known_intermixed_args calls back in here
                return super().parse_known_args(args, namespace)
            self._mixing = True
            try:
                return self.parse_known_intermixed_args(args, namespace)
            finally:
                self._mixing = False

    return Intermixed


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tank", help="Tank client: talk to a dafka gateway (or a Tank broker)")
    p.add_argument(
        "--broker",
        type=broker_arg,
        help=f"HOST[:PORT] (default: the config's [gateway] listen, else {DEFAULT_BROKER})",
    )
    p.add_argument("--timeout", type=_arg(_timeout), default=10.0, help="seconds per request")
    tank = p.add_subparsers(
        dest="tank_command", required=True, metavar="ACTION", parser_class=_intermixed(type(p))
    )

    q = tank.add_parser("create", help="create a topic with gateway-owned partitions")
    q.add_argument("topic", type=topic_arg)
    q.add_argument("partitions", type=_int_in(1, 65534), nargs="?", default=1)

    q = tank.add_parser("produce", help="publish messages (arguments, else stdin lines)")
    q.add_argument("topic", type=topic_arg)
    q.add_argument("messages", nargs="*")
    q.add_argument("-p", "--partition", type=partition_arg, default=0)
    q.add_argument("-k", "--key", help="key of every message")
    q.add_argument("--batch", type=_int_in(1, 1 << 30), default=1000, help="messages per produce request")

    q = tank.add_parser("consume", help="print messages, one per line")
    q.add_argument("topic", type=topic_arg)
    q.add_argument("-p", "--partition", type=partition_arg, help="only this partition (default: all, in order)")
    q.add_argument("--from", dest="start", type=_arg(_start), default="first", help="first, tail or a sequence number")
    q.add_argument("--count", type=_int_in(1, 1 << 62), help="stop after this many messages")
    q.add_argument("--follow", action="store_true", help="wait for new messages at the end")
    q.add_argument("-v", "--verbose", action="store_true", help="prefix partition, seq, timestamp and key")

    tank.add_parser("topics", help="list topics")
    q = tank.add_parser("partitions", help="first and last sequence number of each partition")
    q.add_argument("topic", type=topic_arg)
    tank.add_parser("status", help="the broker's status")


def default_broker(gateway_listen: str | None) -> tuple[str, int]:
    """The broker when ``--broker`` is not given: the configured gateway's Tank port, else the default."""
    if not gateway_listen:
        return broker_arg(DEFAULT_BROKER)
    host, port = parse_listen(gateway_listen, DEFAULT_PORT)
    return ("127.0.0.1" if host in ("*", "0.0.0.0", "") else host), port


def run(args: argparse.Namespace, gateway_listen: str | None = None) -> int:
    """Run one ``dafka tank`` action; ``gateway_listen`` is the config's ``[gateway] listen``."""
    broker = args.broker if args.broker is not None else default_broker(gateway_listen)
    host, port = broker if isinstance(broker, tuple) else broker_arg(broker)
    try:
        with TankClient(host, port, timeout=args.timeout) as client:
            return _ACTIONS[args.tank_command](client, args)
    except TankConnectionError as exc:
        refused = isinstance(exc.__cause__, ConnectionRefusedError)
        hint = " (is a gateway running? see `dafka gateway` / `dafka up`)" if refused else ""
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 1
    except TankError as exc:
        unknown_partition = exc.code == ConsumeFlag.UNKNOWN_PARTITION and str(exc).startswith("consume")
        if unknown_partition and not isinstance(exc, UnknownTopicError):
            print(f"error: unknown partition {exc.partition} of topic {exc.topic!r}", file=sys.stderr)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 1


def _create(client: TankClient, args: argparse.Namespace) -> int:
    client.create_topic(args.topic, args.partitions)
    print(f"created {args.topic} with {args.partitions} partitions")
    return 0


def _produce(client: TankClient, args: argparse.Namespace) -> int:
    lines = args.messages or (line.rstrip("\n") for line in sys.stdin)
    key = args.key.encode() if args.key is not None else None
    batch: list[Any] = []
    sent = 0
    for line in lines:
        batch.append(line.encode() if key is None else (key, line.encode()))
        if len(batch) >= args.batch:
            client.produce(args.topic, args.partition, batch)
            sent += len(batch)
            batch = []
    if batch:
        client.produce(args.topic, args.partition, batch)
        sent += len(batch)
    print(f"{sent} messages acknowledged", file=sys.stderr)
    return 0


def _consume(client: TankClient, args: argparse.Namespace) -> int:
    start = args.start if isinstance(args.start, int) else _start(args.start)
    bounds = client.discover_partitions(args.topic)  # raises for an unknown topic
    known = sorted(bounds)
    if args.partition is None:
        partitions = known
    elif args.partition in known:
        partitions = [args.partition]
    else:
        have = f"partitions 0..{known[-1]}" if known else "no partitions"
        print(f"error: unknown partition {args.partition} of topic {args.topic!r} (it has {have})", file=sys.stderr)
        return 1
    # "tail" is where each partition ends now, fixed once: asked for again on
    # every turn, it would skip what came while the other partitions were read.
    seqs = {p: bounds[p].hwm + 1 if start == UINT64_MAX else start for p in partitions}
    done: set[int] = set()  # drained partitions (without --follow)
    printed = 0
    out = sys.stdout.buffer
    # Without --follow, each partition is read to its end in turn; with it,
    # the partitions are long-polled in turn (so each waits at most ~1 s).
    wait = max(100, 1000 // max(1, len(partitions))) if args.follow else 0
    rounds = 0
    while (args.count is None or printed < args.count) and len(done) < len(partitions):
        active = [p for p in partitions if p not in done]
        pid = active[rounds % len(active)] if args.follow else active[0]
        rounds += 1
        seq = seqs[pid]
        result = client.consume(args.topic, pid, seq, max_wait_ms=wait)
        if result.boundary_check:
            # Below what is kept: go to the first kept; past the end: go to the end.
            below = result.first_avail is not None and seq < result.first_avail
            seqs[pid] = result.first_avail if below else (result.hwm or 0) + 1  # type: ignore[assignment]
            if seqs[pid] == seq:
                done.add(pid)  # guard: the broker keeps sending the same boundary
            continue
        for s, ts, key, value in result.messages:
            if args.verbose:
                k = key.decode(errors="replace") if key is not None else "-"
                out.write(f"{pid}\t{s}\t{ts}\t{k}\t".encode())
            out.write(value + b"\n")
            printed += 1
            if args.count is not None and printed >= args.count:
                break
        out.flush()
        if result.messages:
            seqs[pid] = result.next_seq
        elif not args.follow:
            done.add(pid)
    return 0


def _topics(client: TankClient, args: argparse.Namespace) -> int:
    for t in client.discover_topics():
        print(f"{t.name}\t{t.partitions} partitions")
    return 0


def _partitions(client: TankClient, args: argparse.Namespace) -> int:
    for pid, bounds in client.discover_partitions(args.topic).items():
        print(f"{pid}\tfirst {bounds.first_avail}\thwm {bounds.hwm}")
    return 0


def _status(client: TankClient, args: argparse.Namespace) -> int:
    s = client.status()
    print(f"version {s.version}, {s.topics} topics, {s.partitions} partitions, up since {s.startup_ts}")
    return 0


_ACTIONS = {
    "create": _create,
    "produce": _produce,
    "consume": _consume,
    "topics": _topics,
    "partitions": _partitions,
    "status": _status,
}
