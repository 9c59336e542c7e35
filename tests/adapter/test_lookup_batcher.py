"""The lookup batcher on its own, against a real Redis: what vLLM's per-key lookups cost (no
call until the step ends, then one for every key), how long its answers live, and how it
marks sightings under ``second_sighting``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest
import redis
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

from hma_redis.adapter.lookups import FRESH_STEPS, LookupBatcher
from hma_redis.adapter.stats import SchedulerStats
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.redis_server import command_calls, command_delta

KEYSPACE = KeySpace("hma", "batcher")


class Built(NamedTuple):
    lookups: LookupBatcher
    stats: SchedulerStats
    store: RedisBlockStore


Make = Callable[..., Built]


def _hash(n: int) -> bytes:
    return bytes([n]) * 32


def _key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(_hash(n), group)


def _put(client: redis.Redis, *numbers: int, group: int = 0) -> None:
    for n in numbers:
        client.set(KEYSPACE.block_key(group, _hash(n)), b"x")


@pytest.fixture
def batcher(redis_url: str, redis_client: redis.Redis) -> Iterator[Make]:
    """Build batchers over the session Redis (each with its store and stats); shut down at
    teardown. Keyword arguments override the batcher's defaults."""
    made: list[Built] = []

    def make(**kwargs: object) -> Built:
        cfg = RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={})
        store = RedisBlockStore(cfg, stats_key=KEYSPACE.stats_key())
        stats = SchedulerStats(store.counters)
        options: dict[str, object] = {
            "answer_ttl_s": 60.0,
            "max_answers": 1000,
            "wait_s": 2.0,
            "second_sighting": False,
            "admission_window_s": 60,
            **kwargs,
        }
        lookups = LookupBatcher(store, KEYSPACE, stats, **options)  # type: ignore[arg-type]
        made.append(Built(lookups, stats, store))
        return made[-1]

    yield make
    for built in made:
        built.lookups.shutdown()
        built.store.close()


def test_lookups_make_no_call_and_the_step_end_makes_one_for_every_key(
    batcher: Make, redis_client: redis.Redis
) -> None:
    lookups, stats, _ = batcher()
    _put(redis_client, 1, 3)
    _put(redis_client, 3, group=1)
    keys = [_key(1), _key(2), _key(3), _key(3, group=1), _key(4, group=1)]
    assert lookups.lookup(_key(9), "warm") is None
    lookups.flush()  # the connection is set up and warm
    before = command_calls(redis_client)
    assert [lookups.lookup(k, "r") for k in keys] == [None] * len(keys)
    assert lookups.has_pending_work()
    assert command_delta(before, command_calls(redis_client)) == {}
    lookups.flush()
    assert command_delta(before, command_calls(redis_client)).get("eval") == 1
    answers = [lookups.lookup(k, "r") for k in keys]
    assert [a is not None and a.present for a in answers] == [True, False, True, True, False]
    assert not lookups.has_pending_work()
    assert (stats.totals.lookup_round_trips, stats.totals.keys_looked_up) == (2, 6)
    assert (stats.totals.hit_keys, stats.totals.miss_keys) == (3, 3)


def test_a_key_asked_again_in_its_step_is_sent_once(batcher: Make) -> None:
    lookups, stats, _ = batcher()
    for req in ("a", "b", "a"):
        assert lookups.lookup(_key(1), req) is None
    lookups.flush()
    assert stats.totals.keys_looked_up == 1
    assert stats.totals.lookup_round_trips == 1


def test_answers_outlive_their_ttl_for_two_steps_then_are_asked_again(
    batcher: Make, redis_client: redis.Redis
) -> None:
    """A request that waited a step for its answer finds it even when steps are slower than
    answer_ttl_s; after that the key goes to Redis again."""
    lookups, stats, _ = batcher(answer_ttl_s=0.0)
    _put(redis_client, 1)
    assert lookups.lookup(_key(1), "r") is None
    lookups.flush()
    for _ in range(1 + FRESH_STEPS):  # the step right after the batch, and two more
        answer = lookups.lookup(_key(1), "r")
        assert answer is not None and answer.present
        lookups.flush()
    assert lookups.lookup(_key(1), "r") is None
    assert stats.totals.lookup_round_trips == 1


def test_the_cache_keeps_the_newest_answers_within_its_bound(batcher: Make) -> None:
    lookups, _, _ = batcher(max_answers=3)
    for n in range(5):
        lookups.lookup(_key(n), "r")
    lookups.flush()
    assert list(lookups.answers) == [_key(2), _key(3), _key(4)]


def test_forgotten_and_missing_answers_are_what_the_next_lookup_sees(
    batcher: Make, redis_client: redis.Redis
) -> None:
    lookups, stats, _ = batcher()
    _put(redis_client, 1, 2)
    lookups.lookup(_key(1), "r")
    lookups.lookup(_key(2), "r")
    lookups.flush()
    lookups.forget([_key(1)])
    lookups.remember_missing([_key(2)])
    assert lookups.lookup(_key(1), "r") is None  # asked of Redis again
    answer = lookups.lookup(_key(2), "r")
    assert answer is not None and not answer.present  # a failed load's answer, no call
    lookups.forget_all()
    assert lookups.known(_key(2)) is None
    assert stats.totals.lookup_round_trips == 1


def test_another_requests_sighting_is_answered_at_once_and_marked_in_the_next_batch(
    batcher: Make, redis_client: redis.Redis
) -> None:
    """second_sighting: the first request's miss is a first sighting (not admitted); a second
    request asking is answered from the cache, and the next batch marks its sighting, which
    admits the chunk. The first request asking again is no new sighting."""
    lookups, stats, _ = batcher(second_sighting=True)
    assert lookups.lookup(_key(1), "first") is None
    lookups.flush()
    answer = lookups.lookup(_key(1), "first")
    assert answer is not None and not answer.present and not answer.admitted
    assert not lookups.has_pending_work()  # the same request: nothing to mark

    answer = lookups.lookup(_key(1), "second")
    assert answer is not None and not answer.admitted  # answered now, from the cache
    assert lookups.has_pending_work()
    lookups.flush()
    admitted = lookups.known(_key(1))
    assert admitted is not None and admitted.admitted
    assert stats.totals.lookup_round_trips == 2
    assert redis_client.exists(KEYSPACE.sighting_key(0, _hash(1))) == 1


def test_each_batch_reaches_the_stats_hash_once_answered(
    batcher: Make, redis_client: redis.Redis
) -> None:
    """A batch's counts ride on a later call (never on its own EVAL): they are in the
    process's counters once it is answered."""
    lookups, _, store = batcher()
    _put(redis_client, 1)
    lookups.lookup(_key(1), "r")
    lookups.lookup(_key(2), "r")
    lookups.flush()
    totals = store.counters.snapshot()
    assert {k: totals.get(k) for k in ("lookups", "lookup_keys", "hit_chunks", "miss_chunks")} == {
        "lookups": 1,
        "lookup_keys": 2,
        "hit_chunks": 1,
        "miss_chunks": 1,
    }
