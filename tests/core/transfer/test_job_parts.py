"""A job split over ``connections_per_job`` connections fails whole when one part's Redis call
fails: no chunk of it is reported loaded, and no part's results are matched to another part's
keys."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.key_cutting_proxy import KeyCuttingProxy
from tests.support.kv_pages import DST, KEYSPACE, SRC, Pages, chunks, make_pages


def _heals(rig: Pages) -> bool:
    """Whether a load of DST succeeds within a few of the breaker's probe intervals."""
    for attempt in range(50):
        time.sleep(0.1)  # retry_interval_s: the breaker lets a probe through
        if rig.load_job(10 + attempt, chunks(DST)).ok:
            return True
    return False


@pytest.mark.parametrize("cut", [0, 3], ids=["first-part", "last-part"])
def test_a_job_whose_part_fails_fails_whole(
    redis_client: redis.Redis, redis_url: str, cut: int
) -> None:
    """Four chunks over three connections; the connection that asks for chunk ``cut`` is
    dropped by the network: the load fails (its blocks are recomputed) and counts every chunk
    as failed; once the network is whole again (and the breaker closed) the same load lands
    every byte in its place. (``redis_client``: a freshly flushed Redis.)"""
    proxy = KeyCuttingProxy(urlsplit(redis_url).port or 6379)
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": proxy.url, "connections_per_job": 3, "retry_interval_s": 0.1}, env={}
    )
    store = RedisBlockStore(cfg, stats_key=KEYSPACE.stats_key())
    rig = make_pages(store)
    try:
        assert rig.store.native and "3 thread(s) per job" in rig.engine.data_path
        assert rig.store_job(1, chunks(SRC)).ok
        proxy.cut = chunks(DST)[cut].redis_key.encode()
        failed = rig.load_job(2, chunks(DST))
        assert proxy.cuts >= 1
        assert not failed.ok and failed.nbytes == 0
        counted = store.counters.snapshot()
        assert counted.get("load_failed_chunks") == 4 and not counted.get("loaded_chunks")
        proxy.cut = None
        assert _heals(rig), "loads kept failing after the network was whole again"
        assert rig.moved(SRC, DST)
    finally:
        rig.close()
        store.close()
        proxy.close()
