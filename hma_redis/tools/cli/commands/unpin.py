"""``hma-redis unpin --ttl SECONDS``: give pinned chunks their TTL back, as the tier's sweep
does for pins past their deadline, or for every pin (``--all``, after confirmation)."""

from __future__ import annotations

import argparse
import sys

from hma_redis.tools.cli.admin import RedisAdmin
from hma_redis.tools.cli.options import checked_namespace, positive
from hma_redis.tools.cli.output import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    confirm,
    emit,
    print_json,
)
from hma_redis.tools.cli.text import printable

NAME = "unpin"
HELP = "give pinned chunks their TTL back: ended pins, or every pin"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--namespace``, ``--ttl`` (required), ``--all``, ``--yes``."""
    parser.add_argument("--namespace", help="only this namespace (default: every namespace)")
    parser.add_argument(
        "--ttl",
        type=positive,
        required=True,
        metavar="SECONDS",
        help="the TTL the chunks get back: the tier's ttl_s",
    )
    parser.add_argument(
        "--all", action="store_true", help="end every pin, also those before their deadline"
    )
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation (--all)")


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """End pins like the tier's sweep (past their deadline), or every pin with ``--all``
    (asks first, like ``purge``). Exit 1 when a named namespace has no pins."""
    namespace = checked_namespace(admin, args.namespace)
    namespaces = admin.pinned_namespaces(namespace)
    if args.all and not args.yes and namespaces:
        if not sys.stdin.isatty():
            raise CliError(
                "unpin --all needs --yes when stdin is not a terminal (nothing changed)",
                EXIT_USAGE,
            )
        count = sum(admin.pin_count(ns) for ns in namespaces)
        if not confirm(f"end {count} pins in {len(namespaces)} namespace(s)?"):
            raise CliError("unpin cancelled (nothing changed)")
    results = admin.unpin(namespaces, args.ttl, every=args.all)
    if args.json:
        print_json(
            {
                "all": bool(args.all),
                "namespaces": {
                    ns: {"unpinned": r.expired, "renewed": r.renewed, "dropped": r.dropped}
                    for ns, r in results.items()
                },
            }
        )
    else:
        for ns, r in results.items():
            emit(f"{ns}: {r.expired} chunks unpinned (TTL {args.ttl}s), {r.renewed} renewed")
            if r.dropped:
                emit(
                    f"{ns}: {r.dropped} members of the pins set were not chunk keys of the "
                    "namespace: removed from the set, the keys they name left alone"
                )
        if not results:
            emit("no pinned chunks")
    if namespace is not None and not namespaces:
        print(f"{PROG}: no pins in namespace {printable(namespace)!r}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK
