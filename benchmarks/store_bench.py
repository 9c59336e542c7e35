"""RedisBlockStore vs redis-benchmark on the same server; see hma_redis/bench_store.py."""

from hma_redis.bench_store import main

if __name__ == "__main__":
    main()
