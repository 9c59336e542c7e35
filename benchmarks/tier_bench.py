"""The tier's worker and lookups vs redis-benchmark and redis-py, in one run (also
``hma-redis bench``); see hma_redis/bench_tier.py."""

from hma_redis.bench_tier import main

if __name__ == "__main__":
    raise SystemExit(main())
