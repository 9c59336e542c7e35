"""The transfer fast path: a job's per-byte work (socket I/O, RESP parsing, CRC32C) in one call.

Two implementations of the same functions, giving identical results and identical bytes in the
caller's buffers:

* native: the C extension ``hma_redis.core.redis._wire`` (built by ``pip install`` with the
  system compiler), which runs the whole job with the GIL released, so a Python thread that
  holds the GIL (vLLM's step loop while a request waits for its KV) does not stall it;
* pure Python: the twin in this module, over the socket object. It is the test oracle of the
  native code and THE fallback: it runs every job where the extension was not built, is
  disabled (``HMA_REDIS_NATIVE=0``), or cannot serve the socket: TLS sockets always take it
  (the native code needs a plain fd; encryption stays in Python's ``ssl``). There is no third
  way for a value to travel.

One INFO line says which path runs and why: the transfer engine's at start-up (:func:`announce`),
or this module's at first use.

The types a load job shares with the transfer engine (:class:`LoadTarget`, :class:`LoadResult`,
:class:`LoadStatus`, :class:`Landed`) are :mod:`hma_redis.core.medium`'s; the rules below are
how the wire job meets their contract.

A job runs on one socket or on several (the job's connections, 1 to 64, distinct): value i
travels on socket i mod k, each socket's replies are read in the order of its values, and
``window`` counts per socket. The C load job reads each socket on a thread of its own (started
for the call and joined before it returns), so one receives while Redis prepares another's
reply; the twin and every store job use the calling thread alone, reading the sockets in turn
(Redis reads the value just sent on one while the next is sent on another). On two cores a
thread per connection made 512 KiB loads 1.25x faster than one thread reading two connections,
and gained stores nothing (docs/performance.md). :func:`job_connections` says how many a job
takes.

A load job (:func:`load_values`) sends one command per target (a ``GET``; at most ``window``
unanswered at once per socket) and reads one reply per target: RESP2 ``$len``/``$-1``, RESP3
``_``, or an error. ``window`` counts commands, not targets: a value read in pieces (below)
has its ``STRLEN`` and each ``GETRANGE`` sent one by one, the next as a reply's first line
arrives. Each value of ``len`` bytes lands by these rules, in this order:

1. ``len > max_len``: drained in bounded pieces (never held whole), ``oversized``.
2. Its first ``min(len, 48)`` bytes (the codec's prefix) go to ``head[0:]``. If ``len >= 48``
   the prefix's header length ``H`` is read and, if ``48 + H`` fits both the value and
   ``head``, the next ``H`` bytes (the msgpack header) go to ``head[48:48 + H]``.
3. The header equals ``expected_header`` (and the prefix starts with ``expected_prefix``, when
   one is given: magic, version, flags and header length) and ``len == 48 + H + sum(dests)``:
   the body goes to ``dests`` in order (an ``int`` in ``dests`` is that many bytes checksummed
   and dropped; a :class:`~hma_redis.core.medium.Pages` is its pages in ``Pages.views``
   order), ``ok`` / ``pages``.
4. The header (and prefix) are the expected ones but the length is not: drained,
   ``layout-mismatch``.
5. Anything else (another header or prefix, a value too short for a prefix, a header that does
   not fit ``head``): with a ``staging`` buffer of at least ``len`` bytes the whole value is
   copied or received into ``staging[0:len]`` for Python to decode, ``ok`` / ``staging``;
   without one, drained, ``layout-mismatch``.

``crc_ok`` says, for values that landed (``pages`` or ``staging``) and are at least 48 bytes,
whether CRC32C of the bytes after the prefix (header ‖ body) equals the prefix's CRC field. It
is only the checksum: the MAC, and magic, version and flags unless ``expected_prefix`` holds
them, are the caller's to check (the header bytes being equal to the expected ones covers key,
group and layout).

With ``piece_bytes`` P, a target whose ``max_len`` exceeds P is asked for in pieces
(:func:`load_command`): ``STRLEN key``, then ``GETRANGE key i*P (i+1)*P-1`` for each piece of
``max_len`` bytes (the last ending at ``max_len - 1``). STRLEN's integer N is the value's
length: 0 is ``missing`` (Redis answers 0 for a missing key), ``N > max_len`` is ``oversized``
(the pieces, ``max_len`` bytes, drained), otherwise the pieces' bytes back to back are the
value and land by the rules above. A piece whose length is not the one N announces, or a nil or
an error in its place, means the key changed between the commands: the value is ``missing``
(recomputed, never deleted: it may be a valid value written meanwhile), or ``error`` with the
first error reply in a piece's place (NOPERM: a user without GETRANGE; MOVED, ASK); whatever of
it landed is the caller's to discard, and every piece is still read to its end. An error reply
to STRLEN is ``error``.

A timeout (no progress for ``timeout_s``, or the job not done within ``budget_s`` seconds of
its start when a budget is given), an EOF or a malformed reply (among them a reply line that
does not fit :data:`MAX_REPLY_LINE` bytes with its CRLF, found before more than that is held)
raises (``TimeoutError``,
``ConnectionError``, :class:`ProtocolError`): the streams are then at unknown positions and the
caller must drop every connection of the job. Destination memory may have been written by then.

:func:`store_values` takes each value as a :class:`StoreValue`: the command's framing up to the
value (``*4 $3 SET $<keylen> key $<valuelen>``), the head (the codec's prefix and msgpack
header, every field filled but the CRC), the pages read in place from the KV cache, and the
tail (``\r\n`` and the ``NX`` / ``EX`` arguments); the pages may be a
:class:`~hma_redis.core.medium.Pages`, cut as for a load. For each value it writes CRC32C of
header ‖ pages into the head's CRC field (bytes 12-16, big-endian), then sends the pieces back
to back with ``sendmsg`` (no copy of its own); then it reads one reply per value: ``+OK``
stored, nil existed, an error. One call, one GIL release for the whole job: a per-value checksum
call would wait for the GIL once per value while another thread holds it.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import Any, NamedTuple, TypeAlias

import crc32c as _crc32c

from hma_redis.core.codec import CRC_AT, HEADER_LEN_AT, PREFIX_BYTES
from hma_redis.core.deadline import MAX_WAIT_S, Deadline
from hma_redis.core.medium import Landed, LoadResult, LoadStatus, LoadTarget, Pages, body_pieces

logger = logging.getLogger(__name__)

# Set to "0" to run the pure-Python path even where the extension is built.
NATIVE_ENV = "HMA_REDIS_NATIVE"
# Set to N to read every value that may exceed N bytes in pieces of N (0: always GETs); an A/B
# switch for benchmarks and tests (:func:`piece_bytes_for`).
PIECES_ENV = "HMA_REDIS_PIECE_BYTES"

# The longest reply line, CRLF included, that either path accepts (the native reader's buffer).
MAX_REPLY_LINE = 64 * 1024
# Buffers per sendmsg call (Linux' IOV_MAX is 1024).
_IOV_MAX = 1024

_LINE_READ = MAX_REPLY_LINE  # bytes received at a time while looking for a reply line
_SCRATCH_BYTES = 256 * 1024  # bytes received at a time when dropped or only checksummed
_MAX_VALUE = 512 << 20  # Redis' proto-max-bulk-len default: a longer bulk length is bogus
# GETs unanswered at once in a load job (the next is sent as soon as a reply's first line
# arrives, so Redis prepares it while this value is received). With every GET sent first,
# Redis builds all the replies in its output buffer before the socket drains it; two in flight
# measured faster at 512 KiB and 2 MiB values (benchmarks/fastpath_bench.py). Values that may
# exceed ONE_AT_A_TIME_BYTES go one at a time: two such replies overflow Linux's default
# largest TCP send buffer (tcp_wmem, 4 MiB), and 4 MiB values loaded 25-70 % faster one at a
# time, 8 MiB ones 1-4 %, while 2 MiB ones were 0-13 % slower (docs/performance.md, issue 12,
# fourth round).
DEFAULT_WINDOW = 2
ONE_AT_A_TIME_BYTES = 3 << 20
# The C job's status and landing names as the medium's enums (a dict lookup per value, where
# calling the enum costs ten times as much).
_LOAD_STATUS = {status.value: status for status in LoadStatus}
_LANDED = {landed.value: landed for landed in Landed}

# A job whose values may exceed PIECED_ABOVE reads them in pieces of PIECE_BYTES: ``STRLEN``,
# then one ``GETRANGE`` per piece. Redis 7.0 copies a GET's whole value into one reply buffer of
# its size, and its jemalloc serves 8 MiB and larger from an arena that unmaps memory as soon as
# it is freed (``opt.oversize_threshold``), so each such reply faults in fresh pages: 0.84 s of
# server CPU per GB read against 0.36-0.38 in 512 KiB-1 MiB ranges, and 8 MiB values loaded
# 1.7x as fast in 1 MiB pieces. Smaller reply buffers stay in the server core's cache while the
# socket drains them: in 256 KiB pieces 2 MiB values loaded 1.14-1.41x and 8 MiB ones
# 1.22-1.26x as fast as before (1 MiB pieces above 3 MiB, GETs below; 26-29 of 30 pairs), 128
# KiB pieces no faster, 512 KiB ones level at 2 MiB and 0.93x at 8 MiB; 512 KiB values stay
# faster as GETs (docs/performance.md, issue 39, 2026-12-06 late).
PIECE_BYTES = 256 << 10
PIECED_ABOVE = 1 << 20
# Commands unanswered at once per socket in a native job that reads values in pieces: Redis
# then holds two pieces' replies per connection rather than two whole values (32 values of 4 MiB
# from a fresh server: 520-780 page faults against 2 070 with a value's commands sent together;
# a fresh engine's first load 1 290 against 3 870; warm 8 MiB loads level; docs/performance.md).
PIECE_WINDOW = 2

# The most connections one job runs on (the C code's limit).
MAX_JOB_CONNECTIONS = 64

# One socket, or the job's connections (value i on socket i mod their number).
Sockets: TypeAlias = socket.socket | Sequence[socket.socket]

# The extension (untyped: its surface is wrapped, with types, by the functions below).
_native: Any
_IMPORT_ERROR: str | None = None
try:
    _native = importlib.import_module("hma_redis.core.redis._wire")
except ImportError as exc:  # not built (no compiler at install time), or a broken build
    _native = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def _protocol_error_class() -> type[ConnectionError]:
    """The extension's ProtocolError where it is built: both paths raise one class."""
    if _native is not None:
        cls: type[ConnectionError] = _native.ProtocolError
        return cls

    class ProtocolError(ConnectionError):
        """Redis sent bytes that are not the expected RESP reply; drop the connection."""

    return ProtocolError


ProtocolError = _protocol_error_class()


class StoreValue(NamedTuple):
    """One ``SET ... NX`` of a store job (see the module docstring)."""

    framing: bytes | memoryview  # the command up to the value
    head: Any  # writable: the codec's prefix and header; the CRC field is filled here
    pages: Sequence[Any] | Pages  # the body's pieces, sent in place
    tail: bytes | memoryview  # "\r\n" and the arguments after the value


class StoreStatus(Enum):
    STORED = "stored"
    EXISTED = "existed"
    ERROR = "error"


_STORE_STATUS = {status.value: status for status in StoreStatus}  # as _LOAD_STATUS


class StoreResult(NamedTuple):
    status: StoreStatus
    error: str | None


# ---------------------------------------------------------------------------------- the choice

_announce_lock = threading.Lock()
_announced = False


def available() -> bool:
    """Whether the native path is built, importable and not disabled."""
    return _native is not None and os.environ.get(NATIVE_ENV, "1") != "0"


def unavailable_reason() -> str | None:
    """Why the native path does not run, or None when it does."""
    if _native is None:
        return f"the extension is not built ({_IMPORT_ERROR})"
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return f"disabled by {NATIVE_ENV}=0"
    return None


def describe() -> str:
    """One line: which path runs, and why (for logs and ``hma-redis info``)."""
    reason = unavailable_reason()
    if reason is not None:
        return f"pure Python ({reason})"
    assert _native is not None
    crc = crc_engine() or "portable table"
    return f"native, GIL released (CRC32C: {crc}; TLS connections use pure Python)"


def hardware_crc() -> bool:
    """Whether the native CRC32C runs on CRC instructions (False without the extension)."""
    return _native is not None and bool(_native.hardware_crc())


def crc_engine() -> str:
    """The instructions the native CRC32C runs on: ``VPCLMULQDQ folding`` (AVX-512 carry-less
    multiplies for runs of 1 KiB and more), ``SSE4.2``, or "" (a table, or no extension)."""
    return str(_native.crc_engine()) if _native is not None else ""


def announce(line: str) -> None:
    """Log ``line`` (which data path a transfer engine runs) at INFO; the generic line of the
    first job (:func:`describe`) is then left out."""
    global _announced
    with _announce_lock:
        _announced = True
    logger.info("%s", line)


def _announce() -> None:
    global _announced
    if _announced:
        return
    with _announce_lock:
        if not _announced:
            _announced = True
            logger.info("hma_redis: transfer data path: %s", describe())


def _sockets(sock: Sockets) -> list[socket.socket]:
    """The job's sockets as a list (one socket is a job on one connection)."""
    return [sock] if isinstance(sock, socket.socket) else list(sock)


def _check_sockets(socks: Sequence[socket.socket]) -> None:
    """The checks the C code makes of a job's sockets."""
    if not 1 <= len(socks) <= MAX_JOB_CONNECTIONS:
        raise ValueError("a job runs on 1 to 64 connections")
    if len({sock.fileno() for sock in socks}) != len(socks):
        raise ValueError("a job's connections must be distinct")


def _native_for(sock: Sockets, native: bool = True) -> bool:
    _announce()
    tls = any(isinstance(s, ssl.SSLSocket) for s in _sockets(sock))
    return native and available() and not tls


# ---------------------------------------------------------------------------------- public API


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` continuing from ``value`` (as the ``crc32c`` package)."""
    if available():
        assert _native is not None
        return int(_native.crc32c(data, value))
    return int(_crc32c.crc32c(data, value))


def crc32c_parts(buffers: Sequence[Any], value: int = 0) -> int:
    """CRC32C of ``buffers`` back to back (one native call, GIL released)."""
    if available():
        assert _native is not None
        return int(_native.crc32c_parts(buffers, value))
    for buf in buffers:
        value = _crc32c.crc32c(buf, value)
    return value


def piece_bytes_for(largest: int) -> int:
    """The pieces a load job whose largest target is ``largest`` bytes reads its values in (0:
    GETs): :data:`PIECE_BYTES` when ``largest`` exceeds :data:`PIECED_ABOVE`; with
    ``HMA_REDIS_PIECE_BYTES=N``, N when it exceeds N (0: never). Read at each job."""
    raw = os.environ.get(PIECES_ENV)
    if raw is None:
        return PIECE_BYTES if largest > PIECED_ABOVE else 0
    if not raw.isdigit() or int(raw) > _MAX_VALUE:
        global _warned_pieces
        if not _warned_pieces:
            _warned_pieces = True
            logger.warning(
                "hma_redis: %s must be a byte count from 0 to %d; ignored", PIECES_ENV, _MAX_VALUE
            )
        return PIECE_BYTES if largest > PIECED_ABOVE else 0
    piece = int(raw)
    return piece if 0 < piece < largest else 0


_warned_pieces = False


def pieces_of(max_len: int, piece_bytes: int) -> int:
    """The GETRANGEs a target of ``max_len`` is read with (0: one GET)."""
    if piece_bytes <= 0 or max_len <= piece_bytes:
        return 0
    return -(-max_len // piece_bytes)


def load_command(key: str, max_len: int, piece_bytes: int = 0) -> bytes:
    """The commands that ask for ``key``'s value for a target of ``max_len`` (the module
    docstring): a GET, or STRLEN and one GETRANGE per piece of ``piece_bytes``."""
    raw = key.encode()
    arg = b"$%d\r\n%s\r\n" % (len(raw), raw)
    pieces = pieces_of(max_len, piece_bytes)
    if not pieces:
        return b"*2\r\n$3\r\nGET\r\n" + arg
    out = [b"*2\r\n$6\r\nSTRLEN\r\n" + arg]
    for idx in range(pieces):
        start = b"%d" % (idx * piece_bytes)
        end = b"%d" % (min((idx + 1) * piece_bytes, max_len) - 1)
        out.append(
            b"*4\r\n$8\r\nGETRANGE\r\n%s$%d\r\n%s\r\n$%d\r\n%s\r\n"
            % (arg, len(start), start, len(end), end)
        )
    return b"".join(out)


def job_connections(
    largest: int, count: int, wanted: int, reader_per_connection: bool = False
) -> int:
    """Connections a job of ``count`` values, each at most ``largest`` bytes, runs on:
    ``wanted`` (``connections_per_thread``), never more than it has values, and one when a
    value may be longer than :data:`ONE_AT_A_TIME_BYTES` unless each connection has a reader
    of its own (``reader_per_connection``: the C load job). A lone reader takes one
    connection's reply whole before the next one's, so Redis holds the others in its reply
    buffers, past Linux' default largest TCP send buffer; with a reader each, 8 MiB loads on
    two connections ran 1.13x as fast as on one (docs/performance.md)."""
    if largest > ONE_AT_A_TIME_BYTES and not reader_per_connection:
        return 1
    return max(1, min(wanted, count))


def window_for(targets: Sequence[LoadTarget], connections: int = 1, piece_bytes: int = 0) -> int:
    """GETs in flight per connection for a job of ``targets`` on ``connections`` sockets:
    :data:`DEFAULT_WINDOW` on one; one when the job has several (each socket's reply is
    prepared while another's is received, and two per socket measured no faster), or when one
    of its values may be longer than :data:`ONE_AT_A_TIME_BYTES`. A job that reads values in
    pieces of ``piece_bytes``: :data:`PIECE_WINDOW` (its commands one by one)."""
    largest = max((target.max_len for target in targets), default=0)
    if piece_bytes and largest > piece_bytes:
        return PIECE_WINDOW
    if largest > ONE_AT_A_TIME_BYTES or connections > 1:
        return 1
    return DEFAULT_WINDOW


def load_values(
    sock: Sockets,
    commands: Sequence[bytes | memoryview],
    targets: Sequence[LoadTarget],
    timeout_s: float,
    window: int | None = None,
    budget_s: float | None = None,
    native: bool = True,
    piece_bytes: int = 0,
) -> list[LoadResult]:
    """Run a load job on ``sock``, one socket or several (see the module docstring):
    ``commands[i]`` asks for the value that goes to ``targets[i]`` (:func:`load_command` of
    the same ``piece_bytes``); at most ``window`` commands are unanswered at once per socket (0:
    all sent first; None: :func:`window_for` the targets); the whole job within ``budget_s``
    seconds when given (TimeoutError at once when it is not > 0). Native unless unavailable, a
    socket is TLS or ``native`` is False; the pure-Python twin otherwise."""
    socks = _sockets(sock)
    if window is None:
        window = window_for(targets, len(socks), piece_bytes)
    if _native_for(socks, native):
        return native_load_values(
            sock, commands, targets, timeout_s, window, budget_s, piece_bytes=piece_bytes
        )
    return python_load_values(sock, commands, targets, timeout_s, window, budget_s, piece_bytes)


def store_values(
    sock: Sockets,
    values: Sequence[StoreValue],
    timeout_s: float,
    budget_s: float | None = None,
    native: bool = True,
) -> list[StoreResult]:
    """Run a store job on ``sock``, one socket or several (see the module docstring):
    checksum each value into its head, send it with its pages in place, then read one reply
    per value; the whole job within ``budget_s`` seconds when given. Native unless
    unavailable, a socket is TLS or ``native`` is False; the pure-Python twin otherwise."""
    if _native_for(sock, native):
        return native_store_values(sock, values, timeout_s, budget_s)
    return python_store_values(sock, values, timeout_s, budget_s)


def native_load_values(
    sock: Sockets,
    commands: Sequence[bytes | memoryview],
    targets: Sequence[LoadTarget],
    timeout_s: float,
    window: int = DEFAULT_WINDOW,
    budget_s: float | None = None,
    one_thread: bool = False,
    piece_bytes: int = 0,
) -> list[LoadResult]:
    """:func:`load_values` on the extension (which must be built; plain sockets only): each
    socket read on a thread of its own, or with ``one_thread`` all of them on the calling
    thread in turn (an A/B switch for benchmarks; the same results and bytes)."""
    if _native is None:
        raise RuntimeError(f"the native fast path is not built ({_IMPORT_ERROR})")
    budget = _check_budget(budget_s)
    fds = [s.fileno() for s in _sockets(sock)]
    raw = _native.load_values(
        fds, commands, targets, timeout_s, window, budget, one_thread, piece_bytes
    )
    return [
        LoadResult(_LOAD_STATUS[status], value_len, header_len, crc_ok, _LANDED.get(landed), error)
        for status, value_len, header_len, crc_ok, landed, error in raw
    ]


def native_store_values(
    sock: Sockets,
    values: Sequence[StoreValue],
    timeout_s: float,
    budget_s: float | None = None,
) -> list[StoreResult]:
    """:func:`store_values` on the extension (which must be built; plain sockets only)."""
    if _native is None:
        raise RuntimeError(f"the native fast path is not built ({_IMPORT_ERROR})")
    budget = _check_budget(budget_s)
    fds = [s.fileno() for s in _sockets(sock)]
    raw = _native.store_values(fds, values, timeout_s, budget)
    return [StoreResult(_STORE_STATUS[status], error) for status, error in raw]


# ---------------------------------------------------------------------------------- pure Python


class _Waits:
    """Every wait of one job on its socket: at most ``timeout_s``, and at most until the job's
    deadline (as the C code's poll)."""

    def __init__(self, sock: socket.socket, timeout_s: float, deadline: Deadline | None) -> None:
        self._sock = sock
        self._timeout_s = timeout_s
        self._deadline = deadline

    def arm(self) -> None:
        """Bound the next socket call (TimeoutError once the deadline has passed)."""
        if self._deadline is not None:
            self._sock.settimeout(self._deadline.wait_s(self._timeout_s))


class _Stream:
    """The reply side of one socket: a small buffer for reply lines, bodies received straight
    into their destination. Mirrors the C connection step by step."""

    changed = False  # a GET's value is one bulk string: it cannot change while read

    def __init__(self, sock: socket.socket, waits: _Waits) -> None:
        self._sock = sock
        self._waits = waits
        self._buf = bytearray()
        self._scratch: memoryview | None = None
        self.feed: _Feed | None = None  # a load's: one more command per reply line read

    def leftover(self) -> int:
        return len(self._buf)

    def _recv(self) -> None:
        self._waits.arm()
        chunk = self._sock.recv(_LINE_READ)
        if not chunk:
            raise ConnectionError("connection closed by Redis")
        self._buf += chunk

    def line(self) -> bytes:
        """The next reply line without its CRLF (line and CRLF within MAX_REPLY_LINE bytes)."""
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

    def crlf(self) -> None:
        while len(self._buf) < 2:
            self._recv()
        if self._buf[:2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        del self._buf[:2]

    def into(self, target: memoryview, crc: int | None = None) -> int | None:
        """Fill ``target`` from the stream; return the CRC32C continued over it (if given)."""
        have = min(len(self._buf), target.nbytes)
        target[:have] = self._buf[:have]
        del self._buf[:have]
        while have < target.nbytes:
            self._waits.arm()
            got = self._sock.recv_into(target[have:])
            if not got:
                raise ConnectionError("connection closed by Redis")
            have += got
        return None if crc is None else _crc32c.crc32c(target, crc)

    def skip(self, nbytes: int, crc: int | None = None) -> int | None:
        """Drop the next ``nbytes`` (bounded scratch); CRC32C continued over them (if given)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        while nbytes:
            piece = min(nbytes, _SCRATCH_BYTES)
            crc = self.into(self._scratch[:piece], crc)
            nbytes -= piece
        return crc


class _Pieces:
    """A value read in pieces (the C ``value_t``): the piece replies' bytes as one stream, with
    ``into`` and ``skip`` as :class:`_Stream`'s; once ``changed`` they fill nothing."""

    def __init__(self, stream: _Stream, piece: int, pieces: int) -> None:
        self._stream = stream
        self._piece = piece
        self._pieces_left = pieces
        self.unclaimed = 0  # value bytes no piece read so far has carried
        self._left = 0  # bytes left in the current piece's body
        self._owe_crlf = False
        self.changed = False
        self.error: str | None = None  # the first error reply in a piece's place

    def _next_piece(self) -> None:
        if self._owe_crlf:
            self._stream.crlf()
        self._owe_crlf = False
        if not self._pieces_left:
            raise ProtocolError("a value outgrew the pieces asked for")
        kind, detail = _reply_line(self._stream)
        self._pieces_left -= 1
        if kind in ("nil", "error"):  # gone, moved or refused since STRLEN
            if kind == "error" and self.error is None:
                assert isinstance(detail, str)
                self.error = detail
            self.changed = True
            return
        if kind != "bulk":
            raise ProtocolError("unexpected reply to GETRANGE")
        assert isinstance(detail, int)
        want = min(self.unclaimed, self._piece)
        self.changed = self.changed or detail != want
        self.unclaimed -= want
        self._left = detail
        self._owe_crlf = True

    def _take(self, nbytes: int, crc: int | None, fill: Any) -> int | None:
        """``fill(offset, count, crc)`` for the next ``nbytes`` of the value, piece by piece."""
        done = 0
        while done < nbytes and not self.changed:
            if not self._left:
                self._next_piece()
                continue
            count = min(self._left, nbytes - done)
            crc = fill(done, count, crc)
            self._left -= count
            done += count
        return crc

    def into(self, target: memoryview, crc: int | None = None) -> int | None:
        return self._take(
            target.nbytes, crc, lambda at, n, c: self._stream.into(target[at : at + n], c)
        )

    def skip(self, nbytes: int, crc: int | None = None) -> int | None:
        return self._take(nbytes, crc, lambda _at, n, c: self._stream.skip(n, c))

    def finish(self) -> None:
        """Read the rest of every piece; the stream is then at the next target's reply."""
        while True:
            if self._left:
                self._stream.skip(self._left)
            self._left = 0
            if not self._pieces_left:
                break
            self._next_piece()
        if self._owe_crlf:
            self._stream.crlf()


def _parse_len(raw: bytes) -> int:
    """A bulk length as the C code accepts it: optional '-', 1-18 characters, digits only."""
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not 0 < len(raw) <= 18 or not digits or not digits.isdigit():
        raise ProtocolError("bad bulk length")
    value = int(raw)
    if value < -1 or value > _MAX_VALUE:
        raise ProtocolError("bad bulk length")
    return value


class _Feed:
    """A load socket's commands, one RESP command at a time (the C job's ``feed_t``): the
    commands of its targets in order, each split into the commands it holds; one more is sent
    per reply line read."""

    def __init__(
        self, sock: socket.socket, commands: Sequence[bytes | memoryview], waits: _Waits
    ) -> None:
        self._sock = sock
        self._waits = waits
        self._commands = [part for command in commands for part in _split_commands(command)]
        self._next = 0

    def send(self, count: int) -> None:
        """Send the next ``count`` commands (0: all that are left)."""
        end = len(self._commands) if count == 0 else min(self._next + count, len(self._commands))
        if end > self._next:
            _send(self._sock, self._commands[self._next : end], self._waits)
            self._next = end


def _split_commands(command: bytes | memoryview) -> list[bytes]:
    """The RESP commands (arrays of bulk strings) ``command`` holds back to back; what is not
    one goes as one with the rest (the C job's ``command_end``). An empty command is one."""
    data = bytes(command)
    parts: list[bytes] = []
    start = 0
    while True:
        end = _command_end(data, start)
        parts.append(data[start:end])
        if end >= len(data):
            return parts
        start = end


def _command_end(data: bytes, start: int) -> int:
    """Where the command at ``start`` ends; ``len(data)`` when what is there is not one."""
    header = _command_field(data, start, b"*")
    if header is None:
        return len(data)
    count, pos = header
    for _ in range(count):
        field = _command_field(data, pos, b"$")
        if field is None or len(data) - field[1] < field[0] + 2:
            return len(data)
        pos = field[1] + field[0] + 2
    return pos


def _command_field(data: bytes, pos: int, kind: bytes) -> tuple[int, int] | None:
    """``kind`` at ``pos``, a length >= 0 as the C code parses one, CRLF: (length, the position
    past the CRLF), or None."""
    if data[pos : pos + 1] != kind:
        return None
    cr = data.find(b"\r", pos + 1)
    if cr < 0 or data[cr + 1 : cr + 2] != b"\n":
        return None
    raw = data[pos + 1 : cr]
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not 0 < len(raw) <= 18 or not digits or not digits.isdigit() or int(raw) < 0:
        return None
    return int(raw), cr + 2


def _reply_line(stream: _Stream) -> tuple[str, int | str | None]:
    """One reply's first line (:func:`_reply_line_only`); on a fed socket, its next command
    goes."""
    reply = _reply_line_only(stream)
    if stream.feed is not None:
        stream.feed.send(1)
    return reply


def _reply_line_only(stream: _Stream) -> tuple[str, int | str | None]:
    """One reply's first line: ("bulk", length), ("nil", None), ("error" | "status", text),
    ("int", value)."""
    line = stream.line()
    if not line:
        raise ProtocolError("empty reply line")
    kind, rest = line[:1], line[1:]
    if kind == b"$":
        length = _parse_len(rest)
        return ("nil", None) if length < 0 else ("bulk", length)
    if kind == b":":
        digits = rest[1:] if rest[:1] == b"-" else rest
        if not 0 < len(rest) <= 18 or not digits or not digits.isdigit():
            raise ProtocolError("bad integer reply")
        return "int", int(rest)
    if kind == b"_":
        if rest:
            raise ProtocolError("bad RESP3 null")
        return "nil", None
    if kind in (b"-", b"+"):
        # The text ends at a NUL byte, as the C code's string does.
        text = rest.split(b"\0", 1)[0].decode("utf-8", "replace")
        return ("error" if kind == b"-" else "status"), text
    raise ProtocolError("unexpected reply type")


def _send(sock: socket.socket, parts: Sequence[Any], waits: _Waits) -> None:
    """Send ``parts`` back to back: ``sendmsg`` (scatter-gather, no joining) where the socket
    has it, TLS piece by piece; each socket call bounded by ``waits``."""
    views = [memoryview(p).cast("B") for p in parts]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            waits.arm()
            sock.sendall(view)
        return
    pending = [view for view in views if view.nbytes]  # sendmsg of only empty parts sends 0
    first = 0
    while first < len(pending):
        waits.arm()
        sent = sock.sendmsg(pending[first : first + _IOV_MAX])
        while sent:
            size = pending[first].nbytes
            if sent < size:
                pending[first] = pending[first][sent:]
                break
            sent -= size
            first += 1


def _be32(view: memoryview, offset: int) -> int:
    return int.from_bytes(view[offset : offset + 4], "big")


def _receive_value(
    stream: _Stream | _Pieces, target: LoadTarget, dests: Sequence[Any], length: int
) -> LoadResult:
    """The Python twin of the C ``receive_value`` (same rules, same writes); ``dests`` are
    the target's destinations as a sequence (:func:`_check_target`)."""
    head = memoryview(target.head).cast("B")
    expected = bytes(target.expected_header)
    got = min(length, PREFIX_BYTES)
    stream.into(head[:got])
    header_len = -1
    crc: int | None = None
    matched = False
    if length >= PREFIX_BYTES and not stream.changed:
        header_len = _be32(head, HEADER_LEN_AT)
        end = PREFIX_BYTES + header_len
        if end <= length and end <= head.nbytes:
            crc = stream.into(head[PREFIX_BYTES:end], 0)
            got = end
            matched = header_len == len(expected) and head[PREFIX_BYTES:end] == expected
            prefix = target.expected_prefix
            if prefix is not None:
                matched = matched and head[: len(prefix)] == bytes(prefix)
    body_len = sum(d if isinstance(d, int) else memoryview(d).nbytes for d in dests)
    landed: Landed
    if matched and length == got + body_len:
        for dest in dests:
            if isinstance(dest, int):
                crc = stream.skip(dest, crc)
            else:
                crc = stream.into(memoryview(dest).cast("B"), crc)
        landed = Landed.PAGES
    elif not matched and target.staging is not None and length <= _nbytes(target.staging):
        staging = memoryview(target.staging).cast("B")
        staging[:got] = head[:got]
        crc = stream.into(staging[got:length], crc)
        if crc is None and length >= PREFIX_BYTES:
            crc = _crc32c.crc32c(staging[PREFIX_BYTES:length])
        landed = Landed.STAGING
    else:
        stream.skip(length - got)
        return LoadResult(LoadStatus.LAYOUT_MISMATCH, length, header_len, False, None, None)
    crc_ok = length >= PREFIX_BYTES and crc == _be32(head, CRC_AT)
    return LoadResult(LoadStatus.OK, length, header_len, crc_ok, landed, None)


def _store_head(value: StoreValue) -> memoryview:
    """The head as a writable byte view (the argument checks the C code makes)."""
    if len(value) != 4:
        raise ValueError("a value is (framing, head, pages, tail)")
    head = memoryview(value.head)
    if head.readonly:
        raise TypeError("head must be a writable contiguous buffer")
    if head.nbytes < PREFIX_BYTES:
        raise ValueError("head must hold at least the 48-byte prefix")
    return head.cast("B")


def _nbytes(buffer: Any) -> int:
    return memoryview(buffer).nbytes


def _store_pages(value: StoreValue) -> Sequence[Any]:
    """A value's body pieces as a sequence (a :class:`Pages`' views; checked as the C code
    checks them, before the head)."""
    if len(value) != 4:
        raise ValueError("a value is (framing, head, pages, tail)")
    return body_pieces(value.pages)


def _check_target(target: LoadTarget) -> Sequence[Any]:
    """The argument checks the C code makes before touching the socket; the target's
    destinations as a sequence (a :class:`Pages`' views)."""
    if memoryview(target.head).readonly:
        raise TypeError("head must be a writable contiguous buffer")
    if _nbytes(target.head) < PREFIX_BYTES:
        raise ValueError("head must hold at least the 48-byte prefix")
    if target.max_len < 0:
        raise ValueError("max_len must be >= 0")
    dests = body_pieces(target.dests)
    for dest in dests:
        if isinstance(dest, int):
            if not 0 <= dest <= _MAX_VALUE:
                raise ValueError("bad skip length")
        elif memoryview(dest).readonly:
            raise TypeError("a destination must be a writable contiguous buffer")
    if target.staging is not None and memoryview(target.staging).readonly:
        raise TypeError("staging must be a writable contiguous buffer")
    if target.expected_prefix is not None and _nbytes(target.expected_prefix) > PREFIX_BYTES:
        raise ValueError("expected_prefix must be at most 48 bytes")
    return dests


@contextmanager
def _timeouts(
    socks: Sequence[socket.socket], timeout_s: float, budget_s: float | None
) -> Iterator[list[_Waits]]:
    """Bound every wait on each of ``socks`` by ``timeout_s``, and the block by ``budget_s``
    from now when given, one deadline for them all (as the C code's poll)."""
    if not 0 < timeout_s <= MAX_WAIT_S:
        raise ValueError("timeout_s must be > 0 and at most a day")
    if budget_s is not None and not 0 <= budget_s <= MAX_WAIT_S:
        raise ValueError("budget_s must be >= 0 and at most a day")
    _check_sockets(socks)
    deadline = Deadline.after(budget_s) if budget_s else None
    before = [sock.gettimeout() for sock in socks]
    try:
        for sock in socks:
            sock.settimeout(timeout_s)
        yield [_Waits(sock, timeout_s, deadline) for sock in socks]
    finally:
        for sock, timeout in zip(socks, before, strict=True):
            sock.settimeout(timeout)


def _check_budget(budget_s: float | None) -> float:
    """``budget_s`` as the extension takes it (0: none); TimeoutError when it is used up."""
    if budget_s is None:
        return 0.0
    if budget_s <= 0:
        raise TimeoutError("Redis did not finish the job within its deadline")
    return budget_s


def python_load_values(
    sock: Sockets,
    commands: Sequence[bytes | memoryview],
    targets: Sequence[LoadTarget],
    timeout_s: float,
    window: int = DEFAULT_WINDOW,
    budget_s: float | None = None,
    piece_bytes: int = 0,
) -> list[LoadResult]:
    """:func:`load_values` in pure Python: the oracle of the native path, and its fallback."""
    _check_budget(budget_s)
    if len(commands) != len(targets):
        raise ValueError("one command per target")
    if window < 0:
        raise ValueError("window must be >= 0")
    if piece_bytes < 0:
        raise ValueError("piece_bytes must be >= 0")
    dest_lists = [_check_target(target) for target in targets]
    count = len(targets)
    socks = _sockets(sock)
    lanes = len(socks)
    out: list[LoadResult] = []
    with _timeouts(socks, timeout_s, budget_s) as waits:
        streams = [_Stream(s, w) for s, w in zip(socks, waits, strict=True)]
        for lane in range(min(lanes, count)):
            feed = _Feed(socks[lane], commands[lane::lanes], waits[lane])
            streams[lane].feed = feed
            feed.send(window)
        for idx, target in enumerate(targets):
            lane = idx % lanes
            kind, detail = _reply_line(streams[lane])
            pieces = pieces_of(target.max_len, piece_bytes)
            if pieces:
                value = _Pieces(streams[lane], piece_bytes, pieces)
                out.append(_take_pieces(value, target, dest_lists[idx], kind, detail))
            else:
                out.append(_load_reply(streams[lane], target, dest_lists[idx], kind, detail))
        _check_drained(streams)
    return out


def _check_drained(streams: Sequence[_Stream]) -> None:
    """No socket of the job holds bytes past its last reply."""
    if any(stream.leftover() for stream in streams):
        raise ProtocolError("unexpected bytes after the last reply")


def _load_reply(
    stream: _Stream,
    target: LoadTarget,
    dests: Sequence[Any],
    kind: str,
    detail: int | str | None,
) -> LoadResult:
    """One GET reply whose first line was read: its value received per ``target`` (its
    body into ``dests``)."""
    if kind == "nil":
        return LoadResult(LoadStatus.MISSING, 0, -1, False, None, None)
    if kind == "error":
        assert isinstance(detail, str)
        return LoadResult(LoadStatus.ERROR, 0, -1, False, None, detail)
    if kind == "status":
        raise ProtocolError("status reply to GET")
    if kind == "int":
        raise ProtocolError("unexpected reply type")
    assert isinstance(detail, int)
    if detail > target.max_len:
        stream.skip(detail)
        result = LoadResult(LoadStatus.OVERSIZED, detail, -1, False, None, None)
    else:
        result = _receive_value(stream, target, dests, detail)
    stream.crlf()
    return result


def _take_pieces(
    value: _Pieces,
    target: LoadTarget,
    dests: Sequence[Any],
    kind: str,
    detail: int | str | None,
) -> LoadResult:
    """A value read in pieces, STRLEN's reply read (the C ``take_pieces``): missing (0),
    oversized, an error, or received; then every piece is read to its end."""
    if kind == "error":
        assert isinstance(detail, str)
        value.finish()
        return LoadResult(LoadStatus.ERROR, 0, -1, False, None, detail)
    if kind != "int":
        raise ProtocolError("unexpected reply to STRLEN")
    assert isinstance(detail, int)
    if not 0 <= detail <= _MAX_VALUE:
        raise ProtocolError("bad STRLEN reply")
    if detail == 0:
        result = LoadResult(LoadStatus.MISSING, 0, -1, False, None, None)
    elif detail > target.max_len:
        value.unclaimed = target.max_len  # the pieces carry max_len bytes, dropped
        value.skip(target.max_len)
        result = LoadResult(LoadStatus.OVERSIZED, detail, -1, False, None, None)
    else:
        value.unclaimed = detail
        result = _receive_value(value, target, dests, detail)
    value.finish()
    if value.changed:
        if value.error is not None:  # NOPERM (no GETRANGE), MOVED, ASK: the target's error
            return LoadResult(LoadStatus.ERROR, 0, -1, False, None, value.error)
        return LoadResult(LoadStatus.MISSING, 0, -1, False, None, None)
    return result


def python_store_values(
    sock: Sockets,
    values: Sequence[StoreValue],
    timeout_s: float,
    budget_s: float | None = None,
) -> list[StoreResult]:
    """:func:`store_values` in pure Python: the oracle of the native path, and its fallback."""
    _check_budget(budget_s)
    bodies: list[Sequence[Any]] = []
    heads: list[memoryview] = []
    for value in values:  # each value's pieces, then its head, as the C code parses them
        bodies.append(_store_pages(value))
        heads.append(_store_head(value))
    socks = _sockets(sock)
    lanes = len(socks)
    out: list[StoreResult] = []
    with _timeouts(socks, timeout_s, budget_s) as waits:
        for idx, (value, head, pages) in enumerate(zip(values, heads, bodies, strict=True)):
            crc = _crc32c.crc32c(head[PREFIX_BYTES:])
            for page in pages:
                crc = _crc32c.crc32c(page, crc)
            head[CRC_AT : CRC_AT + 4] = crc.to_bytes(4, "big")
            lane = idx % lanes
            _send(socks[lane], [value.framing, head, *pages, value.tail], waits[lane])
        streams = [_Stream(s, w) for s, w in zip(socks, waits, strict=True)]
        for idx in range(len(values)):
            kind, detail = _reply_line(streams[idx % lanes])
            if kind == "status":
                if detail != "OK":
                    raise ProtocolError("unexpected status reply to SET")
                out.append(StoreResult(StoreStatus.STORED, None))
            elif kind == "nil":
                out.append(StoreResult(StoreStatus.EXISTED, None))
            elif kind == "error":
                assert isinstance(detail, str)
                out.append(StoreResult(StoreStatus.ERROR, detail))
            else:
                raise ProtocolError(f"{'integer' if kind == 'int' else 'bulk'} reply to SET NX")
        _check_drained(streams)
    return out
