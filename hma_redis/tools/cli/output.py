"""How every ``hma-redis`` command ends up on the terminal: text lines and JSON on stdout (each
text line through :func:`~hma_redis.tools.cli.text.printable`), a failure as one line on
stderr (or the ``error`` object under ``--json``) with its exit code, and the question a
destructive command asks first."""

from __future__ import annotations

import json
import os
import sys

from hma_redis.tools.cli.text import printable

PROG = "hma-redis"
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class StdoutClosed(Exception):
    """Whoever reads our stdout has closed it (``hma-redis info | head -1``)."""


class CliError(Exception):
    """A failure reported as one line on stderr, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


def emit(*lines: str) -> None:
    """Print text lines, each through :func:`printable` (the one way text reaches stdout)."""
    for line in lines:
        _write(printable(line))


def _write(text: str) -> None:
    """One line to stdout, flushed; :class:`StdoutClosed` when the reader has gone."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise StdoutClosed from None


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def fail(message: str, code: int, as_json: bool = False) -> int:
    """Report a failure: one line on stderr, or under ``--json`` the error object
    (:data:`~hma_redis.tools.cli.schemas.ERROR`) on stdout; returns ``code``."""
    line = " ".join(message.split())
    if as_json:
        try:
            print_json({"error": {"message": line, "exit_code": code}})
        except StdoutClosed:
            silence_stdout()
        return code
    print(f"{PROG}: {printable(line)}", file=sys.stderr)
    return code


def print_json(data: object) -> None:
    """``data`` as indented JSON on stdout."""
    # json.dumps escapes every control character (and, ensure_ascii, all non-ASCII).
    _write(json.dumps(data, indent=2))


def confirm(question: str) -> bool:
    """Ask ``question`` on stderr and read the answer from stdin: True only for y or yes."""
    print(f"{printable(question)} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")
