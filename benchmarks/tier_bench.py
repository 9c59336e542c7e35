"""The tier's worker and lookups vs redis-benchmark and redis-py, in one run (also
``hma-redis bench``); see hma_redis/tools/bench/tier.py."""

from hma_redis.tools.bench.tier import main

if __name__ == "__main__":
    raise SystemExit(main())
