"""RedisBlockStore vs redis-benchmark on the same server; see hma_redis/bench_store.py."""

from hma_redis.bench_store import store_main

if __name__ == "__main__":
    store_main()
