"""The scheduler side's calls end by their deadline and hold a bounded number of bytes, against
scripted servers over real sockets: a server that drips its handshake holds the connection
warm-ups (``warm_lookups``, ``warm_up``) and the lookups queued behind them no longer than a
call's deadline (2 x ``read_timeout_s``), not dozens of read timeouts; a lookup reply line that
never ends is refused after 64 KiB (as the data paths refuse one), at once, instead of being
buffered until the deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.error_server import read_command
from tests.support.loopback import LoopbackServer

READ_TIMEOUT_S = 0.5
# A call's deadline (deadline.budget_s of no bytes), and what a test allows on top of it.
DEADLINE_S = 2 * READ_TIMEOUT_S
SLACK_S = 1.0
MIB = 1 << 20


class DripServer(LoopbackServer):
    """Answers the first command of every connection (its handshake) with a 400-byte bulk
    string, one byte every 0.6 x ``READ_TIMEOUT_S``: no single wait on the socket times out,
    and the whole reply would take 2 minutes."""

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        try:
            if read_command(stream) is None:
                return
            for byte in b"$400\r\n" + b"x" * 400 + b"\r\n":
                conn.sendall(bytes([byte]))
                time.sleep(0.6 * READ_TIMEOUT_S)
        except OSError:
            pass


class EndlessLineServer(LoopbackServer):
    """Answers the set-up as Redis and a lookup script with ``:`` and then digits without
    end, as fast as the client takes them; ``sent`` counts the bytes sent."""

    def __init__(self) -> None:
        self.sent = 0
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        chunk = b"7" * (256 << 10)
        try:
            while command := read_command(stream):
                if command[0].upper() == b"HELLO":
                    conn.sendall(b"%1\r\n$5\r\nproto\r\n:" + command[1] + b"\r\n")
                    continue
                if command[0].upper() != b"EVAL":
                    conn.sendall(b"+OK\r\n")
                    continue
                conn.sendall(b":")
                while True:
                    conn.sendall(chunk)
                    self.sent += len(chunk)
        except OSError:
            pass


def _store(url: str) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": url, "read_timeout_s": READ_TIMEOUT_S, "retry_interval_s": 60}, env={}
    )
    return RedisBlockStore(cfg)


@pytest.fixture
def drip() -> Iterator[DripServer]:
    server = DripServer()
    yield server
    server.close()


def _seconds(call: Callable[[], object], limit_s: float) -> float:
    """How long ``call`` took; fails (without waiting for it) past ``limit_s``."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    started = time.monotonic()
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(limit_s), f"still running after {limit_s}s"
    return time.monotonic() - started


@pytest.mark.parametrize("warm", ["warm_lookups", "warm_up"])
def test_a_warm_up_against_a_dripping_handshake_ends_by_its_deadline(
    drip: DripServer, warm: str
) -> None:
    store = _store(drip.url)
    try:
        call = store.warm_lookups if warm == "warm_lookups" else lambda: store.warm_up(4)
        assert _seconds(call, DEADLINE_S + SLACK_S) >= DEADLINE_S * 0.9
    finally:
        store.close()


def test_lookups_queued_behind_a_warm_up_are_answered_within_two_deadlines(
    drip: DripServer,
) -> None:
    """The manager warms its lookup connection on the lookups' thread at start: the first
    request's lookups wait for that warm-up's deadline and their own, then answer MISS."""
    keyspace = KeySpace("hma", "drip")
    manager = RedisOffloadingManager(_store(drip.url), keyspace, lookup_wait_s=0.01)
    try:
        keys = [make_offload_key(bytes([n]) * 32, 0) for n in range(3)]
        ctx = ReqContext(req_id="first")
        end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        started = time.monotonic()
        while [manager.lookup(k, ctx) for k in keys] != [LookupResult.MISS] * len(keys):
            assert time.monotonic() - started < 2 * DEADLINE_S + SLACK_S, "lookups still wait"
            manager.on_schedule_end(end)
            time.sleep(0.01)
    finally:
        manager.shutdown()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_lookup_reply_line_without_end_is_refused_after_64_kib_not_buffered() -> None:
    """The lookup fails at once (an outage: misses, the breaker opens) having taken little
    more than the bound off the socket; the process' resident memory grows by under 4 MiB
    meanwhile (it grew by tens of MiB while such a line was buffered until the deadline)."""
    server = EndlessLineServer()
    store = _store(server.url)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    keys = [f"hma:bound:g0:{n:064x}" for n in range(8)]
    try:
        store.ping()
        before = _rss_bytes()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        assert store.exists(keys) == [False] * len(keys)
        seconds = time.monotonic() - started
        stop.set()
        sampler.join()
        print(
            f"\nendless lookup line: refused after {seconds:.3f}s, server sent "
            f"{server.sent / MIB:.1f} MiB, RSS +{(peak[0] - before) / MIB:.1f} MiB"
        )
        assert store.breaker.state is BreakerState.OPEN
        assert seconds < DEADLINE_S / 2
        assert peak[0] - before < 4 * MIB
    finally:
        stop.set()
        store.close()
        server.close()
