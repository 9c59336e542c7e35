"""``hma-redis ls``: the keys under the prefix (or of one namespace, one KV group), with type,
size, memory and TTL (a pinned chunk's deadline), one SCAN page at a time: the next page's
cursor and the command line that shows it."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import time

from hma_redis.core.config import EndpointKind
from hma_redis.tools.cli.admin import KeyEntry, RedisAdmin
from hma_redis.tools.cli.options import checked_namespace, kv_group, non_negative, positive
from hma_redis.tools.cli.output import EXIT_OK, emit, print_json
from hma_redis.tools.cli.text import table

NAME = "ls"
HELP = "keys with size and TTL, one SCAN page at a time"
LS_LIMIT = 50


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--namespace``, ``--group``, ``--limit``, ``--cursor``."""
    parser.add_argument("--namespace", help="only this namespace")
    parser.add_argument(
        "--group", type=kv_group, metavar="g<N>", help="only this KV group (g1, or just 1)"
    )
    parser.add_argument(
        "--limit",
        type=positive,
        default=LS_LIMIT,
        help=f"stop after at least N keys (default {LS_LIMIT})",
    )
    parser.add_argument("--cursor", type=non_negative, default=0, help="continue a previous page")


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Show one page of keys (as text, or ``--json``) and where the next one starts; exit 0."""
    namespace = checked_namespace(admin, args.namespace)
    pattern = admin.pattern(namespace, args.group)
    page = admin.page(pattern, cursor=args.cursor, limit=args.limit)
    if args.json:
        print_json(
            {
                "pattern": pattern,
                "keys": [dataclasses.asdict(e) for e in page.entries],
                "cursor": page.cursor,
            }
        )
        return EXIT_OK
    with_node = admin.kind is EndpointKind.CLUSTER
    rows = [_key_row(e, with_node) for e in sorted(page.entries, key=lambda e: e.key)]
    header = ["type", "value bytes", "memory", "ttl", *(["node"] if with_node else []), "key"]
    if rows:
        emit(*table(header, rows, {1, 2, 3}))
    else:
        emit(f"no keys matching {pattern!r} in this page")
    if page.cursor:
        emit(f"next cursor: {page.cursor} (continue with: {_ls_again(args, page.cursor)})")
    else:
        emit("end of scan (cursor 0)")
    return EXIT_OK


def _ls_again(args: argparse.Namespace, cursor: int) -> str:
    """The ``ls`` command line that shows the next page: the same filters, the next cursor."""
    words = ["ls"]
    if args.namespace is not None:
        words += ["--namespace", shlex.quote(args.namespace)]
    if args.group is not None:
        words += ["--group", f"g{args.group}"]
    if args.limit != LS_LIMIT:
        words += ["--limit", str(args.limit)]
    return " ".join([*words, "--cursor", str(cursor)])


def _key_row(entry: KeyEntry, with_node: bool) -> list[object]:
    return [
        entry.type,
        "-" if entry.value_bytes is None else entry.value_bytes,
        "?" if entry.memory_bytes is None else entry.memory_bytes,
        _ttl_text(entry),
        *([entry.node] if with_node else []),
        entry.key,
    ]


def _ttl_text(entry: KeyEntry) -> str:
    """The ttl column: seconds, ``-`` (none), or a pinned chunk's deadline."""
    if entry.pinned_until is not None:
        left = int(entry.pinned_until - time.time())
        return f"pinned {left}s" if left > 0 else "pinned (ended)"
    return "-" if entry.ttl_s is None else f"{entry.ttl_s}s"
