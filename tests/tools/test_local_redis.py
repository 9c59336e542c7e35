"""The devkit's private redis-server takes variables for its environment (e.g. its allocator's
options, for benchmarks/allocator_ab.py) and leaves this process's environment alone."""

from __future__ import annotations

import os

import pytest
import redis

from hma_redis.tools.devkit.local_redis import LocalRedis


def _malloc_stats(server: LocalRedis) -> str:
    client = redis.Redis(port=server.port)
    try:
        stats = client.execute_command("MEMORY MALLOC-STATS")
    finally:
        client.close()
    return stats.decode() if isinstance(stats, bytes) else str(stats)


def test_env_reaches_the_server_and_only_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_CONF", raising=False)  # a caller's own setting is not the test's
    plain = LocalRedis().start()
    tuned = LocalRedis(env={"MALLOC_CONF": "dirty_decay_ms:-1"}).start()
    try:
        assert "opt.dirty_decay_ms: -1" in _malloc_stats(tuned)
        assert "opt.dirty_decay_ms: -1" not in _malloc_stats(plain)
        assert "MALLOC_CONF" not in os.environ
    finally:
        tuned.stop()
        plain.stop()


def test_cpu_and_page_faults_count_the_servers_own_work() -> None:
    server = LocalRedis().start()
    client = redis.Redis(port=server.port)
    try:
        cpu, faults = server.cpu_ms(), server.minor_faults()
        client.set("big", b"x" * (32 << 20))  # 32 MiB the server has never touched
        assert server.minor_faults() - faults > 4000
        assert server.cpu_ms() > cpu
    finally:
        client.close()
        server.stop()
