"""RedisBlockStore vs redis-benchmark on the same server; see hma_redis/tools/bench/store.py."""

from hma_redis.tools.bench.store import main

if __name__ == "__main__":
    raise SystemExit(main())
