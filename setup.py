"""Build of the optional native fast path; every other setting lives in pyproject.toml.

``hma_redis.core.redis._wire`` is plain C built with the system compiler (no downloads at build
time). It is optional: where it cannot be built (no compiler, no Python headers) the install
still succeeds and hma_redis runs its pure-Python data path (``hma_redis.core.redis.wire`` logs
which path runs). The SSE4.2 CRC code is compiled for that target per function and chosen at
run time from cpuid, so the module runs on any x86-64 (and elsewhere with the portable CRC).
"""

from setuptools import Extension, setup

C_FLAGS = ["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "hma_redis.core.redis._wire",
            sources=["hma_redis/core/redis/_wire.c"],
            extra_compile_args=C_FLAGS,
            # A load job's connections each run on a thread of their own (POSIX threads).
            extra_link_args=["-pthread"],
            optional=True,
        ),
        # The bench's copy counter: a library the bench preloads (LD_PRELOAD) into the clients
        # it measures, never imported (hma_redis/tools/bench/copies.py).
        Extension(
            "hma_redis.tools.bench._copycount",
            sources=["hma_redis/tools/bench/_copycount.c"],
            extra_compile_args=C_FLAGS,
            extra_link_args=["-pthread"],
            libraries=["dl"],
            optional=True,
        ),
    ]
)
