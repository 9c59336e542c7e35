"""System calls of a span of this process's work, counted by ``strace -c -f`` attached to the
process for that span (every thread; the bench's counting run, never a timed one: a traced
process is many times slower).

Standard library only: ``benchmarks/lmcache_peer.py`` loads this file from the checkout with
LMCache's interpreter (which has no hma_redis) and counts its own spans the same way.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

# The calls that move or wait for bytes; the rest are summed into "other".
COUNTED = ("sendmsg", "sendto", "write", "writev", "recvmsg", "recvfrom", "read", "readv",
           "poll", "ppoll", "epoll_wait", "epoll_pwait", "select", "pselect6", "futex")  # fmt: skip
ATTACH_TIMEOUT_S = 10.0


class StraceMissing(RuntimeError):
    """``strace`` is not installed (Debian: apt-get install -y strace)."""


class SyscallCounter:
    """``begin()`` attaches ``strace -c -f`` to this process; ``end()`` detaches it and returns
    the calls per system call name made meanwhile (:data:`COUNTED`, plus ``other``)."""

    def __init__(self) -> None:
        self.strace = shutil.which("strace")
        if self.strace is None:
            raise StraceMissing("counting system calls needs strace (apt-get install -y strace)")
        self._proc: subprocess.Popen[bytes] | None = None
        self._out = ""

    def begin(self) -> None:
        fd, self._out = tempfile.mkstemp(prefix="hma-strace-", suffix=".txt")
        os.close(fd)
        ready = self._out + ".ready"
        assert self.strace is not None
        # strace prints "Process N attached" per thread on stderr; -o takes the summary.
        self._proc = subprocess.Popen(
            [self.strace, "-f", "-c", "-o", self._out, "-p", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(ready, "wb"),  # noqa: SIM115 - closed with the child
        )
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(ready, "rb") as fh:
                if b"attached" in fh.read():
                    break
            if self._proc.poll() is not None:
                raise RuntimeError(f"strace exited with status {self._proc.returncode}")
            time.sleep(0.01)
        else:
            raise RuntimeError("strace did not attach within 10 s")
        time.sleep(0.05)  # every thread attached (strace attaches the threads one by one)
        os.unlink(ready)

    def end(self) -> dict[str, int]:
        proc = self._proc
        if proc is None:
            raise RuntimeError("end() without begin()")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=ATTACH_TIMEOUT_S)
        self._proc = None
        with open(self._out) as fh:
            text = fh.read()
        os.unlink(self._out)
        return parse_summary(text)


def parse_summary(text: str) -> dict[str, int]:
    """Calls per system call from an ``strace -c`` summary (its rows: ``% time  seconds
    usecs/call  calls  [errors]  syscall``), :data:`COUNTED` by name and the rest as ``other``."""
    counts = {name: 0 for name in (*COUNTED, "other")}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[0].replace(".", "").isdigit() or fields[-1] == "total":
            continue
        name, calls = fields[-1], int(fields[3])
        counts[name if name in counts else "other"] += calls
    return counts
