"""A loopback TCP proxy in front of a real Redis that drops any connection whose request names
a chosen key: one part of a job split over connections fails (its Redis call raises), the
others go through."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.loopback import LoopbackServer


class KeyCuttingProxy(LoopbackServer):
    """Forwards everything; a request that contains ``cut`` (bytes, or None for none) closes
    that connection at once instead of being forwarded."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.cut: bytes | None = None
        self.cuts = 0  # connections dropped so far
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        server = self._keep(socket.create_connection(("127.0.0.1", self.upstream_port)))
        threading.Thread(target=self._pump, args=(conn, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if requests and self.cut is not None and self.cut in data:
                    self.cuts += 1
                    break
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
