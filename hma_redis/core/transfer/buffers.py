"""Memory and ordering of the transfer threads: the byte budget (:class:`ByteBudget`), the
pooled value buffers (:class:`BufferPool`) and, on CUDA, the streams and events that order
every copy after the work queued before it (:class:`TransferStreams`)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class ByteBudget:
    """Bounds the bytes held in transfer buffers, fairly.

    A waiting load goes first: while one waits, no store acquires (a request waits on a load;
    stores are background work). Loads are served in arrival order, stores likewise, so a
    steady stream of small requests cannot starve a large one. A request larger than the whole
    limit proceeds alone once nothing else holds budget (those behind it wait).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self.peak = 0  # the most bytes held at once
        self._cond = threading.Condition()
        # Tickets of the requests waiting, in arrival order: loads, stores.
        self._waiting: dict[bool, deque[object]] = {True: deque(), False: deque()}

    def acquire(self, nbytes: int, *, load: bool) -> None:
        """Block until ``nbytes`` may be held; the caller must :meth:`release` them."""
        ticket = object()
        with self._cond:
            line = self._waiting[load]
            line.append(ticket)
            try:
                self._cond.wait_for(lambda: self._may_take(ticket, nbytes, load))
                self._used += nbytes
                self.peak = max(self.peak, self._used)
            finally:
                line.remove(ticket)
                self._cond.notify_all()  # the next in line may go now

    def _may_take(self, ticket: object, nbytes: int, load: bool) -> bool:
        if self._waiting[load][0] is not ticket or (not load and self._waiting[True]):
            return False
        return self._used == 0 or self._used + nbytes <= self._limit

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()


class BufferPool:
    """Value buffers kept for reuse, so a transfer neither allocates nor page-faults a fresh
    buffer per value (a new 2 MiB ``bytearray`` costs ~0.3 ms, as much as its CRC32C).
    Holds at most ``limit`` idle bytes; buffers are pinned when the KV cache is on a GPU.

    Only buffers taken from the pool may be given back (anything else, a read-only view of a
    reply say, would be handed to the next writer). ``peak_bytes`` is the most bytes ever out
    of the pool at once: what the transfers held, for the memory bound's tests and stats.
    """

    def __init__(self, limit: int, pinned: bool) -> None:
        self._limit = limit
        self._pinned = pinned
        self._idle = 0
        self._free: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()
        self._out = 0
        self.peak_bytes = 0

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            self._out += nbytes
            self.peak_bytes = max(self.peak_bytes, self._out)
            free = self._free.get(nbytes)
            if free:
                self._idle -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned).numpy().data

    def give(self, buffers: Sequence[memoryview]) -> None:
        """Return buffers that :meth:`take` gave and nobody uses any more."""
        with self._lock:
            for buf in buffers:
                self._out -= buf.nbytes
                if self._idle + buf.nbytes <= self._limit:
                    self._free.setdefault(buf.nbytes, []).append(buf)
                    self._idle += buf.nbytes


class TransferStreams:
    """Device and stream ordering of the transfer threads. Every method is a no-op for a CPU
    KV cache, so the CPU runs the same code as a GPU.

    On CUDA: each transfer thread selects the KV cache's device (a TP rank's GPU, not device
    0) and copies on a stream of its own; a transfer starts only after an event recorded on
    the submitting (compute) stream at submit, so it reads what the model wrote (stores) and
    overwrites blocks only once the work queued before it is done with them (loads); and a
    transfer is over only once an event recorded after its copies has completed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._local = threading.local()

    def init_thread(self) -> None:
        """Executor initializer of every transfer thread."""
        if self._cuda:
            torch.cuda.set_device(self.device)
            self._local.stream = torch.cuda.Stream(self.device)

    def mark_submit(self) -> torch.cuda.Event | None:
        """On the submitting thread: an event after everything queued so far on its current
        (compute) stream."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def ordered(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """Run the block's copies on this thread's stream, after ``after``; on leaving (also
        by an exception) wait until they have completed, so their host buffers may be read,
        reused or freed."""
        if not self._cuda:
            yield
            return
        stream = getattr(self._local, "stream", None)
        if stream is None:  # a thread the executors did not start (store at interpreter exit)
            stream = self._local.stream = torch.cuda.Stream(self.device)
        if after is not None:
            stream.wait_event(after)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                yield
        finally:
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
