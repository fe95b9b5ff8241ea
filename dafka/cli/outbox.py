"""``dafka outbox``: what a producer's edge outbox holds (read-only)."""

from __future__ import annotations

import argparse
from typing import Any

from dafka.config import Settings


def cmd_outbox(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from dafka.outbox import describe

    info = describe(args.dir, show=args.show)
    if args.json:
        print(json.dumps(info))
        return 0
    age = "-" if info["oldest_age"] is None else f"{info['oldest_age']:.1f}s"
    print(f"outbox {info['path']}")
    print(f"  topic      {info['topic'] or '(unused)'}")
    print(f"  partition  {info['partition'] or '(unused)'}")
    if info["records"]:
        print(f"  offsets    {info['first']}..{info['next'] - 1} unacknowledged (next {info['next']})")
    else:
        print(f"  offsets    none unacknowledged (next {info['next']})")
    print(f"  records    {info['records']}  bytes {info['bytes']}  oldest {age}")
    for r in info["shown"]:
        print(f"  {r['offset']:>10}  {r['content']}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("outbox", help="show what a producer's edge outbox holds (read-only)")
    p.add_argument("dir", help="the outbox directory")
    p.add_argument("--show", type=int, default=0, help="also print the first N records")
    p.add_argument("--json", action="store_true", help="print JSON")
