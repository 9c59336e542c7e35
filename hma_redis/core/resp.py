"""A raw RESP reply reader for the block store's bulk path.

:class:`RawReplies` reads the replies to GET, SET and HINCRBY straight from a redis-py
connection's socket, bypassing its parser, so a value is received once, into the caller's
buffer; :func:`send_all` sends a command's pieces without joining them.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError

# Bytes read at a time while looking for a reply's first line (bodies go straight to buffers).
_LINE_READ = 4096
# GETs in flight on a bulk read (see RedisBlockStore.get_into).
# Buffers per sendmsg call (Linux' IOV_MAX is 1024).
_IOV_MAX = 1024
# Bytes received at a time into scratch memory when a value too long to accept is dropped.
_DISCARD_PIECE = 256 * 1024
# A refusal of each kind is logged at most once per this many seconds (the rest are counted).


@dataclass(frozen=True)
class OversizedValue:
    """What :meth:`RedisBlockStore.get_into` returns for a value longer than its bound: the value
    was not received (its bytes were dropped as they arrived)."""

    nbytes: int  # its length (on a cluster: at least this many bytes)


def send_all(sock: Any, parts: Sequence[memoryview]) -> None:
    """Send ``parts`` back to back: ``sendmsg`` (scatter-gather, no joining) where the socket
    has it, TLS piece by piece."""
    if sock is None:
        raise RedisConnectionError("connection closed")
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            sock.sendall(part)
        return
    pending = [part for part in parts if part.nbytes]  # sendmsg of only empty parts sends 0
    first = 0
    while first < len(pending):
        sent = sock.sendmsg(pending[first : first + _IOV_MAX])
        while sent:
            size = pending[first].nbytes
            if sent < size:
                pending[first] = pending[first][sent:]
                break
            sent -= size
            first += 1


def no_bulk(nbytes: int) -> memoryview:
    raise InvalidResponse(f"unexpected {nbytes}-byte bulk reply")


class RawReplies:
    """Replies to GET, SET and HINCRBY (RESP2 or RESP3) read from a redis-py connection's
    socket, bypassing its parser.

    A bulk string is received by ``recv_into`` straight into the caller's buffer; reply lines
    are read in small pieces, so little of a body passes through Python ``bytes``. The first
    ``skip`` replies (counter increments sent ahead) are read and handed to ``on_skipped``.
    """

    def __init__(
        self, conn: Any, skip: int = 0, on_skipped: Callable[[Any], None] | None = None
    ) -> None:
        self._conn = conn
        self._buf = b""
        self.skip = skip
        self._on_skipped = on_skipped

    def _recv(self) -> bytes:
        sock = self._conn._sock
        if sock is None:
            raise RedisConnectionError("connection closed")
        chunk: bytes = sock.recv(_LINE_READ)
        if not chunk:
            raise RedisConnectionError("Connection closed by server")
        return chunk

    def read(
        self, alloc: Callable[[int], memoryview], max_bytes: int | None = None
    ) -> memoryview | bytes | ResponseError | OversizedValue | None:
        """The next reply: a bulk string (in ``alloc``'d memory), a line, an error or None.
        A bulk string longer than ``max_bytes`` is received in bounded pieces and dropped
        (:class:`OversizedValue`): ``alloc`` is never asked for it."""
        while self.skip:
            skipped = self._read(no_bulk, None)
            self.skip -= 1
            if self._on_skipped is not None:
                self._on_skipped(skipped)
        return self._read(alloc, max_bytes)

    def _read(
        self, alloc: Callable[[int], memoryview], max_bytes: int | None
    ) -> memoryview | bytes | ResponseError | OversizedValue | None:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._buf += self._recv()
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind in (b"+", b":"):
            return rest
        if kind == b"_":  # RESP3 null (redis-py 8 negotiates RESP3 where the server has it)
            return None
        if kind != b"$":
            raise InvalidResponse(f"unexpected reply {line[:40]!r}")
        try:
            nbytes = int(rest)
        except ValueError:
            raise InvalidResponse(f"bad bulk length {line[:40]!r}") from None
        if nbytes < 0:
            return None
        out: memoryview | OversizedValue
        if max_bytes is not None and nbytes > max_bytes:
            out = OversizedValue(nbytes)
            self._drop(nbytes)
        else:
            out = alloc(nbytes)
            self._receive(nbytes, out)
        while len(self._buf) < 2:
            self._buf += self._recv()
        if self._buf[:2] != b"\r\n":
            raise InvalidResponse("bulk string not terminated by CRLF")
        self._buf = self._buf[2:]
        return out

    def _receive(self, nbytes: int, into: memoryview) -> None:
        """The next ``nbytes`` of the stream, into ``into``."""
        have = min(nbytes, len(self._buf))
        into[:have] = memoryview(self._buf)[:have]
        self._buf = self._buf[have:]
        while have < nbytes:
            have += self._recv_into(into[have:], nbytes - have)

    def _drop(self, nbytes: int) -> None:
        """Skip the next ``nbytes`` of the stream, received into a scratch buffer of at most
        ``_DISCARD_PIECE`` bytes: a value too long to accept is never held whole."""
        have = min(nbytes, len(self._buf))
        self._buf = self._buf[have:]
        scratch = memoryview(bytearray(min(_DISCARD_PIECE, nbytes - have)))
        while have < nbytes:
            have += self._recv_into(scratch, min(nbytes - have, scratch.nbytes))

    def _recv_into(self, target: memoryview, nbytes: int) -> int:
        got: int = self._conn._sock.recv_into(target, nbytes)
        if not got:
            raise RedisConnectionError("Connection closed by server")
        return got
