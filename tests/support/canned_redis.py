"""A hostile stand-in for Redis over a real TCP socket: it answers a fast-path job with canned
bytes (any length line, any truncation, any number of replies), records what the client sent,
and runs the same job through both fast paths so a test can compare them byte for byte.

Buffers come from :func:`exact_buffer`: each is an allocation of exactly its length (numpy
allocates with ``malloc``), so under AddressSanitizer (``scripts/asan.sh``) a write one byte
past a buffer is reported instead of landing in allocator slack.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hma_redis.core.redis import wire

TIMEOUT_S = 5.0
PATHS: dict[str, tuple[Callable[..., list[Any]], Callable[..., list[Any]]]] = {
    "native": (wire.native_load_values, wire.native_store_values),
    "python": (wire.python_load_values, wire.python_store_values),
}
# What a job may raise on a bad reply or bad arguments (the same type on both paths).
JOB_ERRORS = (ConnectionError, TimeoutError, OSError, ValueError, TypeError)


def exact_buffer(nbytes: int, seed: int) -> np.ndarray:
    """A writable buffer of exactly ``nbytes`` bytes of deterministic junk."""
    out = np.empty(nbytes, dtype=np.uint8)
    out[:] = np.frombuffer(random.Random(seed).randbytes(nbytes), dtype=np.uint8)
    return out


def bulk(value: bytes) -> bytes:
    """``value`` as a RESP bulk string reply."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


@dataclass
class Outcome:
    """What one path did: its results or the type of what it raised, every buffer's bytes
    afterwards, and the bytes the server received."""

    results: list[Any] | None
    error: type[BaseException] | None
    buffers: list[bytes]
    sent: bytes


# A job's buffers and arguments, built fresh for each path: (targets or values, buffers).
Make = Callable[[], tuple[Sequence[Any], Sequence[Any]]]


class _Server:
    """One accepted connection: sends ``reply`` (in ``pieces`` with a pause between, when
    given), closes its sending side, and records what the client sends until it closes. A
    reply of up to 64 KiB sent at once is in the client's socket before the job starts, so
    what each receive returns does not depend on timing."""

    def __init__(self, reply: bytes, pieces: Sequence[int]) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.client = socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S)
            self._conn, _ = listener.accept()
        self.received = bytearray()
        if not pieces and len(reply) <= 1 << 16:
            self._conn.sendall(reply)
            reply = b""
        self._thread = threading.Thread(target=self._serve, args=(reply, pieces), daemon=True)
        self._thread.start()

    def _serve(self, reply: bytes, pieces: Sequence[int]) -> None:
        at = 0
        for size in pieces:
            self._conn.sendall(reply[at : at + size])
            at += size
            time.sleep(0.05)  # the client reads what came so far before the rest arrives
        try:
            self._conn.sendall(reply[at:])
            self._conn.shutdown(socket.SHUT_WR)
            while chunk := self._conn.recv(1 << 16):
                self.received += chunk
        except OSError:  # the client closed with the reply unread (a reset, not connected)
            pass

    def close(self) -> bytes:
        """Everything the client sent. Its sending side is closed first, so the server reads
        it all before a close with unread reply bytes could reset the connection."""
        with contextlib.suppress(OSError):
            self.client.shutdown(socket.SHUT_WR)
        self._thread.join(5)  # longer only while the server is still sending its reply
        self.client.close()
        self._thread.join(30)
        self._conn.close()
        return bytes(self.received)


def run_path(
    reply: bytes,
    job: Callable[[socket.socket, Sequence[Any]], list[Any]],
    make: Make,
    pieces: Sequence[int] = (),
) -> Outcome:
    """Run ``job`` (given the client socket and the fresh targets) against a server that
    answers ``reply``."""
    args, buffers = make()
    server = _Server(reply, pieces)
    results: list[Any] | None = None
    error: type[BaseException] | None = None
    try:
        results = job(server.client, args)
    except JOB_ERRORS as exc:
        error = type(exc)
    sent = server.close()
    return Outcome(results, error, [bytes(memoryview(b).cast("B")) for b in buffers], sent)


def load_both(
    reply: bytes,
    commands: Sequence[bytes],
    make: Make,
    window: int = 0,
    timeout_s: float = TIMEOUT_S,
    pieces: Sequence[int] = (),
    piece_bytes: int = 0,
) -> Outcome:
    """A load job through both paths against ``reply`` (with ``piece_bytes``, targets longer
    than that read in pieces); asserts the same results (or the same exception type), the same
    bytes in every buffer and on the wire; returns the outcome."""
    outcomes = {}
    for name, (load, _) in PATHS.items():

        def job(sock: socket.socket, targets: Sequence[Any], load: Any = load) -> list[Any]:
            return list(load(sock, commands, targets, timeout_s, window, piece_bytes=piece_bytes))

        outcomes[name] = run_path(reply, job, make, pieces)
    return same(outcomes)


def store_both(reply: bytes, make: Make, timeout_s: float = TIMEOUT_S) -> Outcome:
    """A store job through both paths against ``reply`` (see :func:`load_both`)."""
    outcomes = {}
    for name, (_, store) in PATHS.items():

        def job(sock: socket.socket, values: Sequence[Any], store: Any = store) -> list[Any]:
            return list(store(sock, values, timeout_s))

        outcomes[name] = run_path(reply, job, make)
    return same(outcomes)


def same(outcomes: dict[str, Outcome]) -> Outcome:
    """Assert the native and the Python outcome are identical; return the native one."""
    native, python = outcomes["native"], outcomes["python"]
    assert native.error == python.error, (native.error, python.error)
    assert native.results == python.results
    for idx, (a, b) in enumerate(zip(native.buffers, python.buffers, strict=True)):
        assert a == b, f"buffer {idx} differs between the native and the Python path"
    assert native.sent == python.sent, "the paths sent different bytes"
    return native
