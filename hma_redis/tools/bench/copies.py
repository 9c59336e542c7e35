"""Bytes a span of this process's work copies in user space and moves through the kernel,
counted by the bench's copy counter (``_copycount.c``, preloaded; the bench's counting run,
``--syscalls``): the ``memcpy`` family's bytes, and the bytes ``read``/``write``/``send``/
``recv`` and their vector and message forms returned.

The counter must be in the process from its start (``LD_PRELOAD``), so ``hma-redis bench
--syscalls`` starts itself again with it (:func:`reexec_preloaded`) and hands it to the
LMCache peer's process (:func:`preload_env`). What it cannot see: copies a compiler inlined and
copies done by loops of a library's own (torch's copy kernels, for one).

Standard library only: ``benchmarks/lmcache_peer.py`` loads this file from the checkout with
LMCache's interpreter (which has no hma_redis) and counts its own spans the same way.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import tempfile
from pathlib import Path

COUNTERS_ENV = "HMA_COPY_COUNTERS"  # the counters' file, read by the library as it loads
# The file's 64-bit words, in _copycount.c's order: a switch, then the totals.
WORDS = ("on", "copied", "copy_calls", "kernel_in", "kernel_out")
FILE_BYTES = 4096


def library_path() -> Path | None:
    """The built counter library next to this file, or None (not built: no C compiler when
    hma_redis was installed)."""
    found = sorted(Path(__file__).resolve().parent.glob("_copycount*.so"))
    return found[0] if found else None


def new_counters_file() -> str:
    """A fresh zeroed counters file (the caller removes it)."""
    fd, path = tempfile.mkstemp(prefix="hma-copies-", suffix=".bin")
    with os.fdopen(fd, "wb") as fh:
        fh.write(bytes(FILE_BYTES))
    return path


def preload_env(environ: dict[str, str], library: Path, counters: str) -> dict[str, str]:
    """``environ`` for a process that loads the counter (first in ``LD_PRELOAD``) with its
    totals in the file ``counters``."""
    preload = " ".join(p for p in (str(library), environ.get("LD_PRELOAD", "")) if p)
    return {**environ, "LD_PRELOAD": preload, COUNTERS_ENV: counters}


def _is_counter(path: str) -> bool:
    return Path(path).name.startswith("_copycount")


def _loaded() -> bool:
    """Whether a copy counter library is mapped in this process (whichever install built it)."""
    with open("/proc/self/maps") as fh:
        return any(_is_counter(line.split()[-1]) for line in fh if line.count("/"))


def reexec_preloaded() -> None:
    """Start this program again, the same command line, with the counter preloaded; returns
    only where it is loaded already or cannot be (not built, or not Linux), and in the process
    started again even if the loader refused the library (never a second time)."""
    library = library_path()
    if library is None or not os.path.exists("/proc/self/maps") or _loaded():
        return
    if COUNTERS_ENV in os.environ:  # started again already: the preload did not take
        return
    env = preload_env(dict(os.environ), library, new_counters_file())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


class CopyCounter:
    """``begin()`` zeroes the totals and turns counting on; ``end()`` turns it off and returns
    the bytes counted meanwhile by every thread of this process: ``copied`` (user space),
    ``copy_calls``, ``kernel_in`` and ``kernel_out``."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as fh:
            self._map = mmap.mmap(fh.fileno(), FILE_BYTES)

    @classmethod
    def attached(cls) -> CopyCounter | None:
        """The counter of this process, if it was started with the library preloaded and a
        counters file; None otherwise. Takes both out of the environment, so that what this
        process starts (redis-server, redis-benchmark) is not counted into its totals."""
        path = os.environ.pop(COUNTERS_ENV, None)
        kept = [p for p in os.environ.get("LD_PRELOAD", "").split() if not _is_counter(p)]
        if kept:
            os.environ["LD_PRELOAD"] = " ".join(kept)
        else:
            os.environ.pop("LD_PRELOAD", None)
        if path is None:
            return None
        try:
            if not os.path.exists("/proc/self/maps") or not _loaded():
                return None
            return cls(path)
        finally:
            # Mapped by the library and by the counter (or by neither): no one else needs it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def begin(self) -> None:
        struct.pack_into(f"{len(WORDS)}Q", self._map, 0, *([0] * len(WORDS)))
        struct.pack_into("Q", self._map, 0, 1)

    def end(self) -> dict[str, int]:
        struct.pack_into("Q", self._map, 0, 0)
        values = struct.unpack_from(f"{len(WORDS)}Q", self._map, 0)
        return dict(zip(WORDS[1:], values[1:], strict=True))
