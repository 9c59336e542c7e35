"""``hma-redis``: look at and clean up what hma_redis keeps in Redis.

    hma-redis info [--by-node]          namespaces: fingerprint, sizes per group, counters
    hma-redis ls [--namespace NS]       keys with size and TTL, one SCAN page at a time
    hma-redis inspect KEY               a block's header, checksum and key echo
    hma-redis purge --namespace NS      UNLINK a namespace (or --all) after confirmation
    hma-redis pins [--namespace NS]     pinned chunks and their deadlines
    hma-redis unpin --ttl SECONDS       give pinned chunks their TTL back
    hma-redis quota ls|get|set|unset|reconcile   per-tenant byte budgets and what each holds
    hma-redis doctor                    is this Redis set up well for a KV-cache tier?
    hma-redis events [--endpoint E]     publish stores and removals as vLLM KV events (ZMQ)
    hma-redis bench [--quick|--smoke]   the tier benchmark (hma_redis.tools.bench.tier)

The connection is configured as the tier's (``--url`` else ``HMA_REDIS_URL`` else ``REDIS_URL``,
validated by :class:`~hma_redis.core.config.RedisTierConfig`): one server, a Redis Cluster (every
master is scanned, sizes are summed; ``--by-node`` shows each master's share) or Sentinel (the
master the sentinels name). The options may come before or after the command
(:mod:`~hma_redis.tools.cli.options`). This module assembles the parser and runs the command
named; each command is a module of :mod:`hma_redis.tools.cli.commands`. Every Redis command
goes through :class:`~hma_redis.tools.cli.admin.RedisAdmin` and ``doctor`` judges in
:mod:`~hma_redis.tools.cli.doctor`. Everything printed goes through
:mod:`~hma_redis.tools.cli.output`: text passes :func:`~hma_redis.tools.cli.text.printable`
(what Redis holds may contain terminal escape sequences); errors are one line on stderr, with
any password redacted, and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from redis.exceptions import RedisError

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.cli.admin import PurgeRefused, RedisAdmin
from hma_redis.tools.cli.commands import (
    Command,
    bench,
    doctor,
    events,
    info,
    inspect,
    ls,
    pins,
    purge,
    quota,
    unpin,
)
from hma_redis.tools.cli.options import add_global_options, build_config, config_message
from hma_redis.tools.cli.output import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    StdoutClosed,
    fail,
    silence_stdout,
)
from hma_redis.tools.cli.text import printable, redis_error_message, scrub

# The commands that run with a connection, in the order --help lists them (bench follows).
COMMANDS: tuple[Command, ...] = (info, ls, inspect, purge, pins, unpin, quota, doctor, events)

_EPILOG = """\
connection: --url, else $HMA_REDIS_URL, else $REDIS_URL, else redis://127.0.0.1:6379/0;
  redis+cluster://host:port[,host:port]/ reaches every master of a Redis Cluster,
  redis+sentinel://host:port[,host:port]/<service> the master the sentinels name;
  prefer $HMA_REDIS_PASSWORD to --password (command lines are visible to other users).
options may be given before or after the command (hma-redis info --json).
exit codes: 0 success; 1 Redis error, a doctor FAIL, an invalid block, a purge cancelled
  or of a namespace without keys; 2 usage or configuration error."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and args.command != bench.NAME:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # argparse has printed usage and the error already
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == bench.NAME:
        return bench.run(args, rest, as_program=argv is None)
    report = functools.partial(fail, as_json=args.json)
    try:
        cfg = build_config(args, os.environ)
    except ValueError as exc:
        return report(config_message(exc, args.url is not None), EXIT_USAGE)
    return _run(cfg, args, report)


def _run(cfg: RedisTierConfig, args: argparse.Namespace, report: Callable[[str, int], int]) -> int:
    """Run the command ``args`` names against the Redis ``cfg`` names; every failure is one
    message through ``report``, with its exit code."""
    admin: RedisAdmin | None = None
    try:
        admin = RedisAdmin(cfg)
        handler: Callable[[RedisAdmin, argparse.Namespace], int] = args.handler
        if args.command != doctor.NAME:  # doctor reports it among its checks
            _refuse_one_cluster_master(admin)
        return handler(admin, args)
    except StdoutClosed:
        silence_stdout()
        return EXIT_OK
    except CliError as exc:
        return report(scrub(str(exc), cfg), exc.code)
    except PurgeRefused as exc:
        return report(scrub(str(exc), cfg), EXIT_FAIL)
    except ValueError as exc:  # an option re-validated by RedisTierConfig (e.g. --namespace)
        return report(config_message(exc), EXIT_USAGE)
    except (RedisError, OSError) as exc:
        return report(scrub(redis_error_message(exc, cfg), cfg), EXIT_FAIL)
    except KeyboardInterrupt:
        return report("interrupted", 130)
    finally:
        if admin is not None:
            admin.close()


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line and a hint instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {printable(message)} (see: {self.prog} --help)\n")


def _version() -> str:
    """The installed package's version."""
    try:
        return importlib.metadata.version("hma_redis")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; the global options are accepted after the command too."""
    parser = _Parser(
        prog=PROG,
        description="Inspect and maintain the hma_redis KV-cache tier in Redis.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    add_global_options(parser, after_command=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        cmd = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        add_global_options(cmd, after_command=True)
        command.add_arguments(cmd)
        cmd.set_defaults(handler=command.run)
    # bench's own options (``--json FILE``, --help, ...) are the tier benchmark's; only the
    # connection options are the CLI's.
    bench_cmd = sub.add_parser(bench.NAME, add_help=False, allow_abbrev=False, help=bench.HELP)
    bench.add_arguments(bench_cmd)
    return parser


def _refuse_one_cluster_master(admin: RedisAdmin) -> None:
    """A ``redis://`` URL at one master of a Redis Cluster would show (or purge) that master's
    share as if it were everything: refused, with the URL to use."""
    if not admin.is_one_cluster_master():
        return
    host = admin.nodes()[0].name
    raise CliError(
        f"{admin.cfg.redacted_url} is one master of a Redis Cluster (cluster mode is on): "
        f"use redis+cluster://{host}/ to reach every master",
        EXIT_USAGE,
    )


if __name__ == "__main__":
    sys.exit(main())
