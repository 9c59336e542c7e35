"""One loopback TCP listener for the tests' stand-in servers and proxies: it accepts on its own
thread, keeps every socket it hands out so :meth:`LoopbackServer.close` closes them all, and
passes each new connection to the subclass's :meth:`LoopbackServer._handle`."""

from __future__ import annotations

import contextlib
import socket
import threading


class LoopbackServer:
    """Listens on 127.0.0.1 (a free port); subclasses set their own attributes first, then
    call ``super().__init__()``, and implement :meth:`_handle`."""

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._sockets.append(conn)
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        """Serve ``conn`` (on a thread of its own: the accept loop waits for this to return)."""
        raise NotImplementedError

    def _keep(self, sock: socket.socket) -> socket.socket:
        """Close ``sock`` with the server too."""
        self._sockets.append(sock)
        return sock

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
