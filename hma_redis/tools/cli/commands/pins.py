"""``hma-redis pins``: the chunks pinned through ``kv_transfer_params`` (kept past their TTL
until a deadline), with each deadline and the time left."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import time

from hma_redis.tools.cli.admin import RedisAdmin
from hma_redis.tools.cli.options import checked_namespace
from hma_redis.tools.cli.output import EXIT_OK, emit, print_json
from hma_redis.tools.cli.text import table

NAME = "pins"
HELP = "pinned chunks and their deadlines (kv_transfer_params pins)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--namespace``."""
    parser.add_argument("--namespace", help="only this namespace")


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """List the pinned chunks (as text, or ``--json``); exit 0."""
    namespace = checked_namespace(admin, args.namespace)
    entries = admin.pins(namespace)
    now = time.time()
    if args.json:
        print_json(
            {
                "now": now,
                "pins": [
                    {**dataclasses.asdict(e), "remaining_s": max(0, int(e.deadline - now))}
                    for e in entries
                ],
            }
        )
        return EXIT_OK
    if not entries:
        emit("no pinned chunks")
        return EXIT_OK
    rows = [[_deadline_text(e.deadline, now), e.namespace, e.key] for e in entries]
    emit(*table(["pinned until", "namespace", "key"], rows, set()))
    return EXIT_OK


def _deadline_text(deadline: float, now: float) -> str:
    """A pin's deadline in UTC, and how long is left (``ended`` once past: the next sweep
    gives the chunk its TTL back)."""
    when = datetime.datetime.fromtimestamp(deadline, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    left = int(deadline - now)
    return f"{when} ({left}s left)" if left > 0 else f"{when} (ended)"
