"""A stand-in for a Redis that answers but does not serve: it speaks RESP2 over a real socket,
accepts the connection set-up (HELLO, PING, CLIENT, SELECT, AUTH) and answers every data command
with one chosen error reply, e.g. ``LOADING Redis is loading the dataset in memory``: the
replies a loading server, a cluster without quorum or a replica cut from its master send."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.loopback import LoopbackServer

# Commands the connection set-up and the breaker's probe send; every other one is data.
_SET_UP = {b"PING": b"+PONG\r\n", b"CLIENT": b"+OK\r\n", b"SELECT": b"+OK\r\n", b"AUTH": b"+OK\r\n"}


# What an empty Redis answers to the data commands that ``ErrorServer(only=...)`` lets through.
_EMPTY = {b"EXISTS": b":0\r\n", b"GET": b"$-1\r\n", b"HINCRBY": b":1\r\n"}


class CommandServer(LoopbackServer):
    """A loopback server that reads RESP commands, each connection on a thread of its own,
    and answers each command with :meth:`_answer`'s bytes."""

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        with contextlib.suppress(OSError, ValueError):
            while command := read_command(stream):
                conn.sendall(self._answer(command))

    def _answer(self, command: list[bytes]) -> bytes:
        raise NotImplementedError


class ErrorServer(CommandServer):
    """Answers every data command (or only those named in ``only``) with ``-<error>``, the
    others as an empty Redis; ``commands`` counts the data commands."""

    def __init__(self, error: str, only: frozenset[bytes] | None = None) -> None:
        self.reply = b"-" + error.encode() + b"\r\n"
        self.only = only
        self.commands = 0
        super().__init__()

    def _answer(self, command: list[bytes]) -> bytes:
        name = command[0].upper()
        if name == b"HELLO":  # the protocol asked for, confirmed in a RESP3 map
            proto = command[1] if len(command) > 1 else b"2"
            return b"%1\r\n$5\r\nproto\r\n:" + proto + b"\r\n"
        if name in _SET_UP:
            return _SET_UP[name]
        self.commands += 1
        if self.only is None or name in self.only:
            return self.reply
        if name == b"EVAL":  # the lookup script: one 0 ("absent") per key
            count = int(command[2])
            return b"*%d\r\n" % count + b":0\r\n" * count
        return _EMPTY.get(name, b"+OK\r\n")


def read_command(stream: object) -> list[bytes] | None:
    """One RESP array of bulk strings (a client's command), or None at EOF."""
    readline = stream.readline  # type: ignore[attr-defined]
    read = stream.read  # type: ignore[attr-defined]
    header = readline()
    if not header:
        return None
    if not header.startswith(b"*"):
        raise ValueError(f"not a command: {header!r}")
    args = []
    for _ in range(int(header[1:])):
        size = int(readline()[1:])
        args.append(read(size + 2)[:-2])
    return args
