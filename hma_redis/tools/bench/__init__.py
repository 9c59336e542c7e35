"""Benchmarks: the tier against redis-benchmark and redis-py (``tier``, also ``hma-redis bench``),
the block store's calls alone (``store``), on one shared core (``common``)."""
