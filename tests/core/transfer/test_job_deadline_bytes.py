"""A job's deadline grows with its bytes: a large load over a link slower than loopback but
faster than 16 MiB/s (:data:`~hma_redis.core.deadline.MIN_RATE_BYTES_S`) completes, though it
takes longer than the read timeouts alone allow; over a link slower than that rate it fails at
the deadline its bytes give it (as docs/configuration.md states it), not before and not much
after. The per-byte allowance is read only through the transfer engine's real path: a wrong
rate, or a budget that leaves out the job's bytes (in the formula, the store or the transfer
engine), fails a test here.

A real Redis behind a proxy that paces the server's replies to a given rate (all connections
together: one link), and a transfer engine over CPU KV pages of 1 MiB, on the native path and on
its Python twin."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.wire import NATIVE_ENV
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import ChunkTransfer, JobResult, ValueFormat, group_chunks
from hma_redis.core.transfer.pages import LayerSource
from tests.support.kv_pages import store_at
from tests.support.tcp_proxy import BreakingProxy

READ_TIMEOUT_S = 0.25
# What docs/configuration.md promises (read_timeout_s): an operation may take 2 x read_timeout_s
# plus its bytes at 16 MiB/s, a transfer job 3 x read_timeout_s plus its bytes from its
# submission. Written out here, so that a change to the formula's rate fails the test too.
FLOOR_BYTES_S = 16 << 20
PAGE = 1 << 20  # one block's page in one layer
LAYERS = 2
BPC = 4  # blocks per chunk: 8 MiB values
CHUNKS = 4  # a 32 MiB load
SRC_IDS = list(range(BPC * CHUNKS))
DST_IDS = [i + BPC * CHUNKS for i in SRC_IDS]
KEYSPACE = KeySpace("hma", "deadline-bytes")
MARGIN_S = 1.0  # scheduling slack on a loaded test machine
PATHS = ["native", "python"]
# How much earlier than its budget a load may end: none (the test's clock starts first), but
# the budget's bytes are those stored, the data path's the bound each value may reach.
EARLY = 0.9


class _Link(BreakingProxy):
    """The proxy, its replies paced to at most ``rate_bytes_s`` over every connection together
    (None: as fast as it forwards)."""

    PIECE = 16 << 10

    def __init__(self, upstream_port: int) -> None:
        self.rate_bytes_s: float | None = None
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has sent what it was given so far
        super().__init__(upstream_port)

    def _forward(self, dst: socket.socket, data: bytes, replies: bool) -> None:
        rate = self.rate_bytes_s
        if not replies or rate is None:
            super()._forward(dst, data, replies)
            return
        for at in range(0, len(data), self.PIECE):
            piece = data[at : at + self.PIECE]
            with self._lock:
                self._free_at = max(time.monotonic(), self._free_at) + len(piece) / rate
                until = self._free_at
            time.sleep(max(0.0, until - time.monotonic()))
            dst.sendall(piece)


class _Rig:
    """A transfer engine over one KV group of ``LAYERS`` layers of 1 MiB pages, its store on
    the link."""

    def __init__(self, url: str) -> None:
        self.store = store_at(
            url,
            read_timeout_s=READ_TIMEOUT_S,
            connect_timeout_s=1.0,
            retry_interval_s=0.1,
        )
        self.stored_bytes = 0  # what a load of the rig's chunks moves (set once stored)
        gen = torch.Generator().manual_seed(3)
        blocks = len(SRC_IDS) + len(DST_IDS)
        self.tensors = [
            torch.randint(-128, 128, (blocks, PAGE), dtype=torch.int8, generator=gen)
            for _ in range(LAYERS)
        ]
        self.engine = TransferEngine(
            self.store,
            [[LayerSource.of(t, PAGE) for t in self.tensors]],
            ValueFormat(kv_dtype="int8"),
            blocks_per_chunk=BPC,
            io_threads=2,
            max_inflight_bytes=1 << 27,
            shutdown_timeout_s=1.0,
        )

    def chunks(self, ids: list[int]) -> list[ChunkTransfer]:
        keys = [KEYSPACE.block_key(0, bytes([i + 1]) * 16) for i in range(CHUNKS)]
        out = group_chunks(0, 0, ids, 0, keys, BPC)
        assert out is not None
        return out

    def run(self, job_id: int, load: bool, within_s: float) -> JobResult:
        """Submit a load (else a store) of the rig's chunks and wait up to ``within_s``."""
        if load:
            self.engine.submit_load(job_id, self.chunks(DST_IDS))
        else:
            self.engine.submit_store(job_id, self.chunks(SRC_IDS))
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for result in self.engine.finished():
                if result.job_id == job_id:
                    return result
            time.sleep(0.005)
        raise AssertionError(f"job {job_id} outlived {within_s:.2f} s")

    def loaded(self) -> bool:
        return all(torch.equal(t[DST_IDS], t[SRC_IDS]) for t in self.tensors)

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()


@pytest.fixture
def link(local_redis: Any) -> Iterator[_Link]:
    proxy = _Link(local_redis.port)
    yield proxy
    proxy.close()


@pytest.fixture(params=PATHS)
def rig(
    link: _Link, local_redis: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[_Rig]:
    """A rig on the path ``request.param`` names whose Redis holds the chunks (stored at full
    speed)."""
    if request.param == "python":
        monkeypatch.setenv(NATIVE_ENV, "0")
    rig = _Rig(link.url)
    try:
        assert rig.store.native == (request.param == "native"), rig.engine.data_path
        assert rig.run(1, load=False, within_s=30).ok
        rig.stored_bytes = _stored_bytes(local_redis.port)
        yield rig
    finally:
        link.rate_bytes_s = None
        rig.close()


def _stored_bytes(port: int) -> int:
    """The bytes of every value the rig stored (what its load moves, replies' framing aside)."""
    with redis.Redis(port=port) as client:
        keys = list(client.scan_iter(f"{KEYSPACE.base}:g*"))
        assert len(keys) == CHUNKS
        return sum(int(client.strlen(key)) for key in keys)


def _operation_s(nbytes: int) -> float:
    """The documented deadline of one operation moving ``nbytes``."""
    return 2 * READ_TIMEOUT_S + nbytes / FLOOR_BYTES_S


def _job_s(nbytes: int) -> float:
    """The documented deadline of a transfer job moving ``nbytes``, from its submission."""
    return 3 * READ_TIMEOUT_S + nbytes / FLOOR_BYTES_S


def test_a_load_slower_than_its_read_timeouts_allow_completes_when_faster_than_the_floor(
    rig: _Rig, link: _Link
) -> None:
    """A 32 MiB load over a link of twice the minimum rate (32 MiB/s, about 1 s) lasts longer
    than three read timeouts (0.75 s) and completes: every page lands."""
    nbytes = rig.stored_bytes
    link.rate_bytes_s = 2 * FLOOR_BYTES_S
    started = time.monotonic()
    result = rig.run(2, load=True, within_s=_job_s(nbytes) + MARGIN_S)
    elapsed = time.monotonic() - started
    assert result.ok, f"a {nbytes >> 20} MiB load was cut after {elapsed:.2f} s"
    assert rig.loaded()
    # The premise: the link was slow enough that read timeouts alone would have cut it.
    assert elapsed > _job_s(0) + 0.1, elapsed


def test_a_load_slower_than_the_floor_fails_at_the_deadline_its_bytes_give_it(
    rig: _Rig, link: _Link
) -> None:
    """A 32 MiB load over a link of half the minimum rate (8 MiB/s, about 4 s) fails once its
    round trip's budget has run out, two read timeouts plus its bytes at 16 MiB/s (2.5 s; the
    job's own, three read timeouts plus its bytes from its submission, comes later): not
    before, and not much after."""
    nbytes = rig.stored_bytes
    link.rate_bytes_s = FLOOR_BYTES_S / 2
    started = time.monotonic()
    result = rig.run(2, load=True, within_s=_job_s(nbytes) + MARGIN_S)
    elapsed = time.monotonic() - started
    assert not result.ok, f"a load at half the floor rate completed in {elapsed:.2f} s"
    bound = _operation_s(nbytes)
    assert elapsed >= EARLY * bound, f"cut after {elapsed:.2f} s, its budget is {bound:.2f} s"
