"""Both readers of replies take a reply line of at most 64 KiB with its CRLF and refuse a longer
one with ProtocolError before holding more: the native reader and its pure-Python twin (which
serves TLS and ``HMA_REDIS_NATIVE=0``) draw the line at the same byte. The long lines are real
Redis error replies (a script's ``redis.error_reply``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from hma_redis.core.medium import LoadResult, LoadStatus, LoadTarget
from hma_redis.core.redis import wire
from hma_redis.core.redis.wire import MAX_REPLY_LINE, ProtocolError

# A script whose error reply line is "-ERR " and ARGV[1] x's: 5 + n bytes before the CRLF.
_LONG_ERROR = "return redis.error_reply(string.rep('x', tonumber(ARGV[1])))"
_ERR_PREFIX = 5
# The longest line accepted: it and its CRLF fill MAX_REPLY_LINE bytes.
_BOUND = MAX_REPLY_LINE - 2

Outcome = tuple[str, int]  # ("error", the error text's length) or ("refused", 0)


def _resp(*args: str | int) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def _command(line_bytes: int) -> bytes:
    return _resp("EVAL", _LONG_ERROR, 0, line_bytes - _ERR_PREFIX)


def _fastpath_reader(
    load: Callable[..., list[LoadResult]],
) -> Callable[[str, int], Outcome]:
    def read(url: str, line_bytes: int) -> Outcome:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
            target = LoadTarget(bytearray(100), b"", [], None, 100)
            try:
                (result,) = load(sock, [_command(line_bytes)], [target], 5.0)
            except ProtocolError:
                return "refused", 0
        assert result.status is LoadStatus.ERROR and result.error is not None
        return "error", len(result.error)

    return read


READERS: dict[str, Callable[[str, int], Outcome]] = {
    "native": _fastpath_reader(wire.native_load_values),
    "python-twin": _fastpath_reader(wire.python_load_values),
}


@pytest.fixture(autouse=True)
def _native_required() -> Iterator[None]:
    assert wire.available(), f"native fast path unavailable: {wire.unavailable_reason()}"
    yield


@pytest.mark.parametrize(
    "line_bytes", [_BOUND - 1, _BOUND, _BOUND + 1], ids=["bound-1", "bound", "bound+1"]
)
def test_every_reader_draws_the_reply_line_bound_at_the_same_byte(
    redis_url: str, line_bytes: int
) -> None:
    outcomes = {name: read(redis_url, line_bytes) for name, read in READERS.items()}
    want: Outcome = ("refused", 0) if line_bytes > _BOUND else ("error", line_bytes - 1)
    assert outcomes == dict.fromkeys(READERS, want)


def test_the_twin_refuses_a_huge_reply_line_without_reading_it_all(
    redis_url: str,
) -> None:
    """A 16 MiB error line is refused after its first 64 KiB, at once (the streamed Python path
    this twin replaced once buffered it whole: a 64 MiB line took minutes)."""
    started = time.monotonic()
    assert READERS["python-twin"](redis_url, 16 << 20) == ("refused", 0)
    assert time.monotonic() - started < 10
