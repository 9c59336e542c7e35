"""``hma-redis doctor``: is this Redis set up well for a KV-cache tier? Every check
(:func:`~hma_redis.tools.cli.doctor.doctor_checks`: the client's setup, the deployment, each
server) as one line ``OK``, ``WARN`` or ``FAIL``; exit 1 when any failed."""

from __future__ import annotations

import argparse
import os

from hma_redis.tools.cli.admin import RedisAdmin
from hma_redis.tools.cli.doctor import Verdict, doctor_checks
from hma_redis.tools.cli.output import EXIT_FAIL, EXIT_OK, emit, print_json

NAME = "doctor"
HELP = "check every server's setup for a cache tier"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """doctor has no options of its own."""


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Run every check and report each verdict (as text, or ``--json``); exit 1 on a FAIL."""
    checks = doctor_checks(admin, os.environ)
    failed = any(c.verdict is Verdict.FAIL for c in checks)
    if args.json:
        print_json(
            {
                "url": admin.cfg.redacted_url,
                "checks": [
                    {
                        "check": c.name,
                        "verdict": c.verdict.value,
                        "detail": c.detail,
                        "node": c.node,
                    }
                    for c in checks
                ],
                "failed": failed,
            }
        )
    else:
        width = max(len(c.name) for c in checks)
        emit(
            *(
                f"{c.verdict.value:<4}  {c.name:<{width}}  "
                f"{'' if c.node is None else c.node + ': '}{c.detail}"
                for c in checks
            )
        )
    return EXIT_FAIL if failed else EXIT_OK
