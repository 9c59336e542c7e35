"""Removal events reach a router: a real engine, vLLM's real ZMQ KV-event publisher, a real Redis
that evicts (maxmemory) and expires (ttl_s) the tier's values, and a ZMQ subscriber here.

A router that learns what each instance can serve from KV events must hear when Redis drops
a chunk; otherwise it keeps routing to a prefix that is gone (issue 14, part 1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from hma_redis.core.keys import parse_block_key
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3
from tests.support.engine_runner import make_prompts, run_engine
from tests.support.kv_subscriber import KVSubscriber
from tests.support.redis_server import LocalRedis
from tests.support.step_hold import ENV as HOLD_ENV
from tests.support.step_hold import QUALNAME as HOLD_PROCESSOR
from tests.support.tier import tier_config

pytestmark = pytest.mark.engine

TTL_S = 3


class _RedisRemovals:
    """The test's own record of what Redis evicted and expired (keyevent channels)."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe("__keyevent@0__:evicted", "__keyevent@0__:expired")
        self.keys: dict[str, set[str]] = {"evicted": set(), "expired": set()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None:
                kind = message["channel"].decode().rsplit(":", 1)[1]
                self.keys[kind].add(message["data"].decode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()
        self._client.close()


@pytest.fixture
def evicting_redis() -> Iterator[LocalRedis]:
    server = LocalRedis(extra_args=["--maxmemory-policy", "allkeys-lru"]).start()
    yield server
    server.stop()


def _lower_maxmemory_once_filled(url: str, min_keys: int, done: threading.Event) -> None:
    """Once the engine stored ``min_keys`` values, cap memory below what they use: the next
    stores make Redis evict the oldest ones."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not done.is_set():
        if client.dbsize() >= min_keys:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", int(used * 0.7))
            break
        time.sleep(0.05)
    client.close()


def _release_after_an_expiry(hold: Path, removals: _RedisRemovals, done: threading.Event) -> None:
    """Let the held engine step again once Redis expired a value and the tier had a moment to
    hear of it: the steps after that publish the removal."""
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline and not done.is_set() and not removals.keys["expired"]:
        time.sleep(0.05)
    time.sleep(1.0)
    hold.unlink(missing_ok=True)


def _hashes_of(keys: set[str]) -> dict[int, set[int]]:
    """Block hash (as vLLM's events carry it: its low 64 bits) -> groups, of block keys."""
    out: dict[int, set[int]] = {}
    for key in keys:
        parts = parse_block_key(key)
        if parts is not None:
            as_event = int(parts.hash_hex, 16) & ((1 << 64) - 1)
            out.setdefault(as_event, set()).add(parts.group)
    return out


def test_router_hears_of_evicted_and_expired_chunks(
    tmp_path_factory: pytest.TempPathFactory, evicting_redis: LocalRedis
) -> None:
    # The test's own record needs keyevent channels (E); the tier adds its flags to these.
    admin = redis.Redis.from_url(evicting_redis.url)
    admin.config_set("notify-keyspace-events", "Exe")
    model = build_gemma3(tmp_path_factory.mktemp("gemma3"), sliding_window=32)
    router = KVSubscriber()
    endpoint = router.endpoint
    removals = _RedisRemovals(evicting_redis.url)
    done = threading.Event()
    capper = threading.Thread(
        target=_lower_maxmemory_once_filled, args=(evicting_redis.url, 12, done), daemon=True
    )
    capper.start()
    # Four prompts are stored; while the last one decodes, the engine is held between two steps
    # (tests/support/step_hold.py) until Redis has expired a value (ttl_s), then it steps on and
    # publishes. A decode long enough on its own was not: a fast machine finished 1400 tokens
    # before the first expiry and the router heard of none.
    hold = tmp_path_factory.mktemp("hold") / "hold"
    hold.touch()
    releaser = threading.Thread(
        target=_release_after_an_expiry, args=(hold, removals, done), daemon=True
    )
    releaser.start()
    prompts = [make_prompts(70 + i, 1, 600, VOCAB_SIZE)[0] for i in range(5)]
    try:
        run = run_engine(
            model,
            prompts,
            [8, 8, 8, 8, 1000],  # the hold comes at the 200th step: in the last prompt's decode
            tier_config(evicting_redis.url, ttl_s=TTL_S),
            extra_env={HOLD_ENV: str(hold)},
            llm_kwargs={
                "logits_processors": [HOLD_PROCESSOR],
                "kv_events_config": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": endpoint,
                    "topic": "kv",
                },
            },
        )
    finally:
        done.set()
        time.sleep(0.5)
        router.close()
        removals.close()
    assert run.num_kv_cache_groups == 2, run.stderr_tail
    assert Path(f"{hold}.held").exists(), "the engine was never held (the hold processor unused)"
    flags = str(admin.config_get("notify-keyspace-events")["notify-keyspace-events"])
    admin.close()
    assert "E" in flags and "K" in flags  # the tier kept the flags it found

    events = router.events()
    stored = {
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == "STORAGE"
        for h in e.block_hashes
    }
    removed: dict[int, set[int]] = {}
    for event in events:
        if isinstance(event, BlockRemoved) and event.medium == "STORAGE":
            for block_hash in event.block_hashes:
                assert isinstance(block_hash, int)
                removed.setdefault(block_hash, set()).add(int(event.group_idx or 0))
    assert not router.seen.errors, router.seen.errors[:3]
    assert stored, f"no stored events from the tier\n{run.stderr_tail}"
    evicted, expired = _hashes_of(removals.keys["evicted"]), _hashes_of(removals.keys["expired"])
    assert evicted and expired, f"Redis evicted {len(evicted)}, expired {len(expired)} chunks"
    # Redis dropped these while the engine was stepping: the router heard of them, for BOTH
    # groups of each chunk, although each key held one group's value.
    heard_evicted = set(evicted) & set(removed)
    heard_expired = set(expired) & set(removed)
    assert heard_evicted, f"no removal event for {len(evicted)} evicted chunks"
    assert heard_expired, f"no removal event for {len(expired)} expired chunks"
    assert all(removed[h] == {0, 1} for h in heard_evicted | heard_expired)
    assert set(removed) <= stored | set(evicted) | set(expired)
