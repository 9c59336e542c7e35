"""``hma-redis bench``: the tier benchmark (:mod:`hma_redis.tools.bench.tier`) against
redis-py and redis-benchmark. Its options (``--quick``, ``--smoke``, ``--json FILE``, its own
``--help``, ...) are the benchmark's; only the connection options are the CLI's, and they reach
the benchmark as a config, never on a command line."""

from __future__ import annotations

import argparse
import os

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.cli.options import add_connection_options, build_config, config_message
from hma_redis.tools.cli.output import EXIT_FAIL, EXIT_OK, EXIT_USAGE, fail
from hma_redis.tools.cli.text import scrub

NAME = "bench"
HELP = "tier benchmark vs redis-py and redis-benchmark (see hma-redis bench --help)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection options (the parser has no ``--help`` or ``--json``: the benchmark's)."""
    add_connection_options(parser, after_command=True)


def run(args: argparse.Namespace, rest: list[str], as_program: bool = False) -> int:
    """Run the tier benchmark; the connection options (``--url``, ``--password``, TLS, ...)
    are the CLI's and reach the benchmark as a config, never on a command line. Any failure is
    one line without the password. ``as_program``: this process is ``hma-redis bench`` itself,
    which ``--syscalls`` starts again with the bench's copy counter preloaded."""
    from hma_redis.tools.bench import copies, tier

    if as_program and "--syscalls" in rest:
        copies.reexec_preloaded()

    cfg: RedisTierConfig | None = None
    if args.url is not None:
        try:
            cfg = build_config(args, os.environ)
        except ValueError as exc:
            return fail(config_message(exc, args.url is not None), EXIT_USAGE)
    if args.json and not any(arg.split("=")[0] == "--json" for arg in rest):
        rest = [*rest, "--json", "-"]  # hma-redis --json bench: the report's JSON on stdout
    try:
        return tier.main(rest, cfg=cfg)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        message = f"bench: {str(exc.code).removeprefix('bench: ')}"
        return fail(scrub(message, cfg), EXIT_FAIL)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as exc:
        return fail(scrub(f"bench: {type(exc).__name__}: {exc}", cfg), EXIT_FAIL)
