"""The ``hma-redis`` commands, one module each, named for the command.

Every command but ``bench`` is a :class:`Command`: :mod:`hma_redis.tools.cli.main` adds its
subparser (``NAME``, with ``HELP`` as help and description, the global options, then the
command's own from ``add_arguments``) and calls ``run`` with a connection. ``bench`` runs the
tier benchmark, which makes its own connections: :mod:`~hma_redis.tools.cli.commands.bench`.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from hma_redis.tools.cli.admin import RedisAdmin


class Command(Protocol):
    """What a command module provides (a module satisfies this protocol)."""

    NAME: str
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's own options to its subparser."""

    def run(self, admin: RedisAdmin, args: argparse.Namespace) -> int:
        """Run the command through ``admin``; returns the exit code. A failure may also raise
        (:class:`~hma_redis.tools.cli.output.CliError`, ``RedisError``, ...): the caller
        reports it."""
