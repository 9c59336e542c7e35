"""``hma-redis purge``: UNLINK the keys of one namespace (``--namespace``) or every key under
the prefix (``--all``), on every node, after confirmation (or ``--yes``); ``--dry-run`` only
counts them."""

from __future__ import annotations

import argparse
import sys

from hma_redis.tools.cli.admin import PurgeResult, RedisAdmin
from hma_redis.tools.cli.options import checked_namespace
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
from hma_redis.tools.cli.text import printable, table

NAME = "purge"
HELP = "UNLINK a namespace's keys, or all under the prefix"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--namespace`` or ``--all`` (one of them), ``--dry-run``, ``--yes``, ``--by-node``."""
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", help="the namespace to delete")
    which.add_argument("--all", action="store_true", help="every key under the prefix")
    parser.add_argument("--dry-run", action="store_true", help="only count the keys")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    parser.add_argument("--by-node", action="store_true", help="the count of each node")


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Delete on every node, with the same guards everywhere: the namespace validated as the
    tier validates it, only keys under the prefix, confirmation (or ``--yes``), and every node
    reached before the first key goes."""
    namespace = None if args.all else checked_namespace(admin, args.namespace)
    pattern = admin.pattern(namespace)
    if args.dry_run:
        matching = admin.purge(namespace, dry_run=True)
        _purge_report(args, pattern, matching, dry_run=True)
        return _purge_exit(namespace, matching)
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError(
                "purge needs --yes when stdin is not a terminal (nothing deleted)", EXIT_USAGE
            )
        matching = admin.purge(namespace, dry_run=True)
        if matching.count == 0:
            _purge_report(args, pattern, matching, dry_run=False)
            return _purge_exit(namespace, matching)
        if not confirm(
            f"UNLINK {matching.count} keys matching {pattern!r} on {admin.cfg.redacted_url} "
            f"({admin.deployment()})?"
        ):
            raise CliError("purge cancelled (nothing deleted)")
    deleted = admin.purge(namespace)
    _purge_report(args, pattern, deleted, dry_run=False)
    return _purge_exit(namespace, deleted)


def _purge_exit(namespace: str | None, result: PurgeResult) -> int:
    """1 when a named namespace has no key (a typo, or purged already): nothing was there to
    delete; else 0. ``--all`` on an empty prefix is a success."""
    if namespace is not None and result.count == 0:
        print(f"{PROG}: no keys in namespace {printable(namespace)!r}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _purge_report(
    args: argparse.Namespace, pattern: str, result: PurgeResult, dry_run: bool
) -> None:
    """The count (matching, or deleted), as text with each node's under ``--by-node``, or
    ``--json``."""
    if args.json:
        key = "matching" if dry_run else "deleted"
        print_json(
            {"pattern": pattern, "dry_run": dry_run, key: result.count, "by_node": result.by_node}
        )
        return
    if dry_run:
        emit(f"{result.count} keys match {pattern!r} (dry run: nothing deleted)")
    else:
        emit(f"deleted {result.count} keys matching {pattern!r}")
    if args.by_node:
        rows = [[node, count] for node, count in result.by_node.items()]
        emit(*table(["node", "keys"], rows, {1}, "  "))
