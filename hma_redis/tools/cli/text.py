"""How the CLI writes text: printable strings, sizes, aligned tables, and error lines that name
what went wrong without ever carrying a password."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from urllib.parse import quote

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.redis.breaker import MISSING_PASSWORD, needs_password
from hma_redis.tools.cli.admin import NodeError

# Where an operator finds the ACL the CLI's Redis user needs.
ACL_HINT = "ACL; the CLI's user: docs/security.md"


def redis_error_message(exc: BaseException, cfg: RedisTierConfig) -> str:
    """One line saying what went wrong talking to Redis (the URL redacted); on a Cluster or
    under Sentinel, the server that failed (a :class:`NodeError`)."""
    at = f"Redis at {cfg.redacted_url}"
    if isinstance(exc, NodeError):
        deployment = (
            "Redis Cluster" if cfg.endpoint.kind is EndpointKind.CLUSTER else "Sentinel service"
        )
        at = f"the master {exc.node} of the {deployment} at {cfg.redacted_url}"
        exc = exc.cause
    if needs_password(exc):
        return f"{MISSING_PASSWORD} ({at})"
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AuthenticationError):
        return f"{at} refused the credentials: {detail}"
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
        return f"cannot reach {at}: {detail}"
    if isinstance(exc, NoPermissionError):
        return f"{at} refused: {exc} ({ACL_HINT})"
    if isinstance(exc, ResponseError):
        return f"{at} answered with an error: {exc}"
    return f"Redis error at {cfg.redacted_url}: {detail}"


def printable(text: str) -> str:
    """``text`` safe to show on a terminal: every character that is not printable (ESC and
    the other C0 / C1 controls, newline, NUL, DEL, bidirectional overrides, ...) is written as
    its Python escape (``\\x1b``, ``\\n``, ``\\x00``, ``\\u202e``); the rest is unchanged.

    Keys, header fields and info fields come from whoever can write to Redis: printed raw, an
    escape sequence would drive the operator's terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def scrub(text: str, cfg: RedisTierConfig | None) -> str:
    """Belt and braces: no message may carry the password (as given or URL-encoded)."""
    if cfg is None or not cfg.password:
        return text
    for form in {cfg.password, quote(cfg.password, safe="")}:
        text = text.replace(form, "***")
    return text


def size(n: int) -> str:
    """Bytes for people: 1023 B, 1.0 KiB, 512.1 KiB, 1.3 MiB, ..."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def memory_text(used_bytes: int, max_bytes: int) -> str:
    """Redis' used and max memory (INFO memory's used_memory, maxmemory) for people, in the
    words of the gauges: ``used 2.1 MiB of max 256.0 MiB (1%)``; a max of 0 is no limit."""
    if max_bytes == 0:
        return f"used {size(used_bytes)}, max 0 (no limit)"
    return f"used {size(used_bytes)} of max {size(max_bytes)} ({used_bytes / max_bytes:.0%})"


def table(
    header: Sequence[str], rows: Iterable[Sequence[object]], right: set[int], indent: str = ""
) -> list[str]:
    """Aligned columns; ``right`` holds the indices of right-aligned (numeric) columns. Cells
    are made :func:`printable` before they are measured, so escapes keep the columns aligned."""
    cells = [list(header), *[[printable(str(c)) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines
