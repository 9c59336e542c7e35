"""A loopback TCP proxy that breaks a connection part way: a network that stalls or drops
in the middle of a value.

Each new connection forwards at most ``limit`` bytes of the server's replies and at most
``request_limit`` bytes of the client's requests, then either stops forwarding that way while
keeping the connection open (``"stall"``) or closes it (``"close"``). ``None`` forwards
everything. Settings apply to connections accepted after they are changed, so a client that
reconnects can be let through.

``byte_delay_s`` (applies at once, to every connection) makes it a slow server: replies are
forwarded one byte at a time, that many seconds apart, so no single wait is long but the whole
reply is. ``reply_delay_s`` (a pause before each piece of a reply is forwarded) and
``request_delay_s`` (the same for each piece of a request) also apply at once to every
connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Literal

from tests.support.loopback import LoopbackServer


class BreakingProxy(LoopbackServer):
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.limit: int | None = None
        self.request_limit: int | None = None
        self.mode: Literal["stall", "close"] = "stall"
        self.byte_delay_s: float | None = None
        self.reply_delay_s = 0.0
        self.request_delay_s = 0.0
        self.connections = 0
        # Each upstream connection's local address as Redis's CLIENT LIST names it ("ip:port"),
        # so a test can tell this proxy's connections from any other client of the same server.
        self.upstream_addrs: list[str] = []
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        server = self._keep(socket.create_connection(("127.0.0.1", self.upstream_port)))
        host, port = server.getsockname()[:2]
        self.upstream_addrs.append(f"{host}:{port}")
        self.connections += 1
        threading.Thread(
            target=self._pump, args=(conn, server, self.request_limit), daemon=True
        ).start()
        threading.Thread(
            target=self._pump, args=(server, conn, self.limit, True), daemon=True
        ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, limit: int | None, replies: bool = False
    ) -> None:
        sent = 0
        mode = self.mode
        with contextlib.suppress(OSError):
            while limit is None or sent < limit:
                data = src.recv(65536 if limit is None else min(65536, limit - sent))
                if not data:
                    break
                delay = self.reply_delay_s if replies else self.request_delay_s
                if delay:
                    time.sleep(delay)
                self._forward(dst, data, replies)
                sent += len(data)
        # Also when a socket failed: a server that closed a connection and then got a request on
        # it answers with RST, so recv raises instead of returning b"". A real network passes that
        # on as a close; this proxy left the client to wait out its read timeout instead.
        if mode == "close" or limit is None:
            src.close()
            dst.close()
        # "stall": keep both sockets open and forward nothing more.

    def _forward(self, dst: socket.socket, data: bytes, replies: bool) -> None:
        for at in range(len(data)):
            delay = self.byte_delay_s if replies else None
            if delay is None:
                dst.sendall(data[at:])
                return
            time.sleep(delay)
            dst.sendall(data[at : at + 1])
