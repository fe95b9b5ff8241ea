"""``dafka keys``: make and list CURVE key pairs for a secure mesh."""

from __future__ import annotations

import argparse
from typing import Any

from dafka.config import Settings


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    from dafka.nodes import security

    if args.keys_command == "new":
        public, secret = security.new_keys(args.name, args.role, args.dir)
        print(f"{public}  (public: copy it into the allow-list directory of every node)")
        print(f"{secret}  (secret: only for the {args.role} that uses it)")
        return 0
    certs = security.list_certificates(args.dir)
    print(f"{'name':<24} {'role':<10} {'kind':<7} public key")
    for cert in certs:
        kind = "secret" if cert.secret else "public"
        print(f"{cert.name:<24} {cert.role or '?':<10} {kind:<7} {cert.public.decode()}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("keys", help="make and list CURVE key pairs for a secure mesh")
    ksub = p.add_subparsers(dest="keys_command", required=True, metavar="new|list")
    k = ksub.add_parser("new", help="create NAME.key (public) and NAME.key_secret")
    k.add_argument("name")
    k.add_argument("--role", required=True, choices=["tower", "store", "producer", "consumer", "gateway"])
    k.add_argument("--dir", default=".", help="where to write them (default .)")
    k = ksub.add_parser("list", help="certificates in a directory, with role and public key")
    k.add_argument("--dir", default=".", help="directory (default .)")
