"""A raw RESP reply reader for the block store's bulk path.

:class:`RawReplies` reads the replies to GET, SET and HINCRBY straight from a redis-py
connection's socket, bypassing its parser, so a value is received once, into the caller's
buffer; :func:`send_all` sends a command's pieces without joining them.

Every reader of replies (this one, and both paths of :mod:`hma_redis.core.fastpath`) takes a
reply line (a status, an error, a bulk length) of at most :data:`MAX_REPLY_LINE` bytes with its
CRLF; a longer one is a :class:`ProtocolError` (the connection must be dropped), found before
more than that is held.
"""

from __future__ import annotations

import importlib
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError

from hma_redis.core.deadline import Deadline

# The longest reply line, CRLF included, that a reader accepts (the native reader's buffer).
MAX_REPLY_LINE = 64 * 1024
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


def _protocol_error_class() -> type[ConnectionError]:
    """The native extension's ProtocolError where it is built (both paths raise one class)."""
    try:
        native: Any = importlib.import_module("hma_redis.core._fastpath")
    except ImportError:

        class ProtocolError(ConnectionError):
            """Redis sent bytes that are not the expected RESP reply; drop the connection."""

        return ProtocolError
    cls: type[ConnectionError] = native.ProtocolError
    return cls


ProtocolError = _protocol_error_class()


def send_all(
    sock: Any, parts: Sequence[memoryview], before_send: Callable[[], None] | None = None
) -> None:
    """Send ``parts`` back to back: ``sendmsg`` (scatter-gather, no joining) where the socket
    has it, TLS piece by piece. ``before_send`` runs before each socket call (to bound it)."""
    if sock is None:
        raise RedisConnectionError("connection closed")
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            if before_send is not None:
                before_send()
            sock.sendall(part)
        return
    pending = [part for part in parts if part.nbytes]  # sendmsg of only empty parts sends 0
    first = 0
    while first < len(pending):
        if before_send is not None:
            before_send()
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

    With a ``deadline``, every wait on the socket lasts at most the connection's timeout and at
    most until the deadline (TimeoutError once it has passed); the caller restores the
    socket's own timeout (:meth:`restore_timeout`).
    """

    def __init__(
        self,
        conn: Any,
        skip: int = 0,
        on_skipped: Callable[[Any], None] | None = None,
        deadline: Deadline | None = None,
    ) -> None:
        self._conn = conn
        self._buf = bytearray()
        self.skip = skip
        self._on_skipped = on_skipped
        self._deadline = deadline

    def arm(self) -> None:
        """Bound the next call on the socket by the deadline (see the class docstring)."""
        sock = self._conn._sock
        if self._deadline is not None and sock is not None:
            sock.settimeout(self._deadline.wait_s(self._conn.socket_timeout))

    def restore_timeout(self) -> None:
        """Give the socket back its connection's timeout (after a call with a deadline)."""
        sock = self._conn._sock
        if self._deadline is not None and sock is not None:
            sock.settimeout(self._conn.socket_timeout)

    def _recv(self) -> None:
        sock = self._conn._sock
        if sock is None:
            raise RedisConnectionError("connection closed")
        self.arm()
        chunk: bytes = sock.recv(_LINE_READ)
        if not chunk:
            raise RedisConnectionError("Connection closed by server")
        self._buf += chunk

    def _line(self) -> bytes:
        """The next reply line without its CRLF: ProtocolError when it (with its CRLF) does not
        fit MAX_REPLY_LINE bytes; each byte is scanned once."""
        start = 0
        while (end := self._buf.find(b"\r\n", start)) < 0:
            if len(self._buf) >= MAX_REPLY_LINE:
                raise ProtocolError("reply line too long")
            start = max(0, len(self._buf) - 1)
            self._recv()
        if end + 2 > MAX_REPLY_LINE:
            raise ProtocolError("reply line too long")
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

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
        line = self._line()
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
            self._recv()
        if self._buf[:2] != b"\r\n":
            raise InvalidResponse("bulk string not terminated by CRLF")
        del self._buf[:2]
        return out

    def _receive(self, nbytes: int, into: memoryview) -> None:
        """The next ``nbytes`` of the stream, into ``into``."""
        have = min(nbytes, len(self._buf))
        into[:have] = self._buf[:have]
        del self._buf[:have]
        while have < nbytes:
            have += self._recv_into(into[have:], nbytes - have)

    def _drop(self, nbytes: int) -> None:
        """Skip the next ``nbytes`` of the stream, received into a scratch buffer of at most
        ``_DISCARD_PIECE`` bytes: a value too long to accept is never held whole."""
        have = min(nbytes, len(self._buf))
        del self._buf[:have]
        scratch = memoryview(bytearray(min(_DISCARD_PIECE, nbytes - have)))
        while have < nbytes:
            have += self._recv_into(scratch, min(nbytes - have, scratch.nbytes))

    def _recv_into(self, target: memoryview, nbytes: int) -> int:
        self.arm()
        got: int = self._conn._sock.recv_into(target, nbytes)
        if not got:
            raise RedisConnectionError("Connection closed by server")
        return got
