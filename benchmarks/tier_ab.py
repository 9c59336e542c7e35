"""Interleaved A/B of the tier benchmark's jobs (``hma-redis bench``: the real worker, 8 layers
of 16 KiB pages at random block ids, fresh keys, timed from submit until ``get_finished``
reports the job) on two workers against one Redis, their jobs alternated (a, b, b, a, ...) so
that both meet the same machine, each job on new connections (a connection's speed on this host
is a draw that lasts its life). Prints, per value size and operation, the median GB/s of
each, their ratio, and in how many pairs b was faster; then the median client CPU seconds per
GB of each (this process's threads, as the bench meters them) and in how many pairs b used
less. What differs (``--compare``):

* ``connections``: A runs ``--a`` connections per thread, B ``--b``;
* ``pages``: A hands the data path every page as a buffer of its own (one view per page and
  layer, built in Python per chunk: how jobs ran before ``medium.Pages``), B describes each
  chunk's pages by block ids (``Pages``: the data path cuts them);
* ``congestion``: A's value connections run the system's TCP congestion control
  (``tcp_congestion`` ""), B's ``--congestion`` (default cubic);
* ``threads``: A runs each job on one thread with two connections (the defaults,
  ``connections_per_job`` 1, ``connections_per_thread`` 2), B on two threads with one
  connection each (``connections_per_job`` 2, ``connections_per_thread`` 1: LMCache's shape);
* ``landing``: A's loads land in the KV cache's pages (the C job, in place), B's in one
  contiguous buffer per value, copied into the pages once valid (as with an
  encryption_key; ``--auth-key``: both MAC'd, as loads with an auth_key ran before 2026-12-06);
* ``window``: A's loads keep ``wire.window_for``'s GETs in flight per connection, B's
  ``--window`` (B's jobs run with ``window_for`` replaced; the two never run at once);
* ``lanes``: A's C load jobs read their connections on the calling thread, in turn (the
  ``one_thread`` switch of ``wire.native_load_values``: how loads ran before), B's on a thread
  per connection (the default);
* ``pieces``: A's loads ask for each value with one GET (``HMA_REDIS_PIECE_BYTES=0``), B's as
  ``wire.piece_bytes_for`` says (the default: pieces of 256 KiB for values over 1 MiB), or in
  pieces of ``--piece-bytes`` for values over that; ``--a-piece-bytes`` makes A read in pieces
  too (``default``: the default rule).

    .venv/bin/python benchmarks/tier_ab.py [--url redis://...] [--pairs 10]
        [--compare connections --a 1 --b 2 | --compare pages | --compare congestion
         | --compare threads | --compare landing | --compare window --window 2
         | --compare lanes | --compare pieces [--piece-bytes N] [--a-piece-bytes N|default]]
        [--auth-key]

Without ``--url`` it starts a private ``redis-server`` (persistence off). Benchmarks print
tables; they assert nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis import wire
from hma_redis.tools.bench.common import Samples, server_config
from hma_redis.tools.bench.tier import FULL, TierBench, _warm_then_timed, size_label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Redis to use (default: a private redis-server)")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument(
        "--compare",
        choices=(
            "connections",
            "pages",
            "congestion",
            "threads",
            "landing",
            "window",
            "lanes",
            "pieces",
        ),
        default="connections",
    )
    parser.add_argument("--congestion", default="cubic", help="B's tcp_congestion")
    parser.add_argument("--a", type=int, default=1, help="connections_per_thread of A")
    parser.add_argument("--b", type=int, default=2, help="connections_per_thread of B")
    parser.add_argument("--window", type=int, default=2, help="B's commands in flight per socket")
    parser.add_argument("--piece-bytes", type=int, help="B's HMA_REDIS_PIECE_BYTES (pieces)")
    parser.add_argument(
        "--a-piece-bytes",
        default="0",
        help="A's HMA_REDIS_PIECE_BYTES (pieces; default 0: GETs; 'default': wire's rule)",
    )
    parser.add_argument(
        "--auth-key", action="store_true", help="both workers MAC their values (a random auth_key)"
    )
    args = parser.parse_args()
    if args.compare != "connections":
        args.a = args.b = RedisTierConfig().connections_per_thread
    congestion = {"a": "", "b": args.congestion} if args.compare == "congestion" else {}
    # connections_per_job by worker (threads: B splits each job over two threads).
    per_job = {"a": 1, "b": 2} if args.compare == "threads" else {}
    if args.compare == "threads":
        args.a, args.b = 2, 1
    cfg = RedisTierConfig.from_extra_config({"redis_url": args.url}, env={}) if args.url else None
    auth_key = os.urandom(32) if args.auth_key else None
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with server_config(cfg) as (target, where):
        benches = {
            name: TierBench(
                dataclasses.replace(
                    target,
                    connections_per_thread=n,
                    connections_per_job=per_job.get(name, target.connections_per_job),
                    tcp_congestion=congestion.get(name, target.tcp_congestion),
                    auth_key=auth_key,
                ),
                FULL,
                f"ab-{name}-{os.getpid()}",
                name=name,
            )
            for name, n in (("a", args.a), ("b", args.b))
        }
        if args.compare == "pages":
            _pages_as_views(benches["a"])
        if args.compare == "landing":
            for worker in benches["b"].workers.values():
                worker._engine._land_in_place = False
        try:
            keyed = "; values MAC'd (auth_key)" if auth_key else ""
            print(f"{_describe(args)}{keyed}; {where}; {args.pairs} pairs")
            print(f"data path: {benches['a'].data_path} / {benches['b'].data_path}")
            print(f"each job moves {FULL.job_bytes >> 20} MiB; GB/s = 10^9 payload bytes/s")
            print(
                f"{'value':>8} {'op':>6} {'A GB/s':>8} {'B GB/s':>8} {'B/A':>6} {'b>a':>6}"
                f" {'A CPU s/GB':>11} {'B CPU s/GB':>11} {'b<a':>6}"
            )
            for size in FULL.sizes:
                for bench in benches.values():  # untimed: first touch of pages and keys
                    bench.run(size, Samples())
                samples = Samples()
                for pair in range(args.pairs):
                    order = "ab" if pair % 2 == 0 else "ba"
                    for name in order:
                        with (
                            _window(
                                args.window if args.compare == "window" and name == "b" else None
                            ),
                            _one_thread(args.compare == "lanes" and name == "a"),
                            _pieces(args, name),
                        ):
                            # As the bench: new connections, a warm job, then the timed one.
                            _warm_then_timed(benches[name], size, samples)
                for op in ("load", "store"):
                    a = samples.values[f"a {op} {size}"]
                    b = samples.values[f"b {op} {size}"]
                    wins = sum(tb < ta for ta, tb in zip(a, b, strict=True))
                    gbs_a = FULL.job_bytes / statistics.median(a) / 1e9
                    gbs_b = FULL.job_bytes / statistics.median(b) / 1e9
                    cpu_a = [c.client_cpu_s for c in samples.costs[f"a {op} {size}"]]
                    cpu_b = [c.client_cpu_s for c in samples.costs[f"b {op} {size}"]]
                    fewer = sum(cb < ca for ca, cb in zip(cpu_a, cpu_b, strict=True))
                    per_gb = FULL.job_bytes / 1e9
                    print(
                        f"{size_label(size):>8} {op:>6} {gbs_a:8.2f} {gbs_b:8.2f} "
                        f"{gbs_b / gbs_a:6.2f} {wins:>3}/{len(a)}"
                        f" {statistics.median(cpu_a) / per_gb:11.3f}"
                        f" {statistics.median(cpu_b) / per_gb:11.3f} {fewer:>3}/{len(a)}"
                    )
        finally:
            for bench in benches.values():
                bench.close()
    print(
        f"load average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"{time.perf_counter() - started:.0f} s"
    )


@contextlib.contextmanager
def _window(window: int | None) -> Iterator[None]:
    """Loads inside the block keep ``window`` commands in flight per connection (None: as
    ``wire.window_for`` says)."""
    if window is None:
        yield
        return
    saved = wire.window_for
    wire.window_for = lambda *args, **kwargs: window
    try:
        yield
    finally:
        wire.window_for = saved


@contextlib.contextmanager
def _one_thread(enabled: bool) -> Iterator[None]:
    """C load jobs inside the block read every connection on the calling thread, in turn."""
    if not enabled:
        yield
        return
    saved = wire.native_load_values
    wire.native_load_values = functools.partial(saved, one_thread=True)  # type: ignore[assignment]
    try:
        yield
    finally:
        wire.native_load_values = saved


@contextlib.contextmanager
def _pieces(args: argparse.Namespace, name: str) -> Iterator[None]:
    """With ``--compare pieces``: A's loads inside the block are GETs (or pieces of
    ``--a-piece-bytes``, or the default rule for ``default``), B's in pieces (the default
    rule, or ``--piece-bytes``)."""
    if args.compare != "pieces":
        yield
        return
    a = None if args.a_piece_bytes == "default" else args.a_piece_bytes
    value = a if name == "a" else args.piece_bytes
    saved = os.environ.get(wire.PIECES_ENV)
    if value is None:
        os.environ.pop(wire.PIECES_ENV, None)
    else:
        os.environ[wire.PIECES_ENV] = str(value)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(wire.PIECES_ENV, None)
        else:
            os.environ[wire.PIECES_ENV] = saved


def _describe(args: argparse.Namespace) -> str:
    if args.compare == "pieces":
        b = f"pieces of {args.piece_bytes} B" if args.piece_bytes else "wire.piece_bytes_for"
        a = {"0": "one GET per value", "default": "wire.piece_bytes_for"}.get(
            args.a_piece_bytes, f"pieces of {args.a_piece_bytes} B"
        )
        return f"A: {a}, B: {b}"
    if args.compare == "lanes":
        return "A: C loads read their connections on one thread, B: a thread per connection"
    if args.compare == "landing":
        return "A: loads land in the pages, B: in a buffer per value, then copied"
    if args.compare == "window":
        return f"A: wire.window_for's GETs in flight per connection, B: {args.window}"
    if args.compare == "pages":
        return "A: a view per page, B: Pages (block ids)"
    if args.compare == "congestion":
        return f"A: the system's TCP congestion control, B: {args.congestion}"
    if args.compare == "threads":
        return "A: one thread, two connections per job; B: two threads, one connection each"
    return f"connections_per_thread A={args.a} B={args.b}"


def _pages_as_views(bench: TierBench) -> None:
    """Make ``bench``'s workers hand every page to the data path as a view of its own."""
    for worker in bench.workers.values():
        engine: Any = worker._engine
        describe = engine._pages_of
        engine._pages_of = lambda chunk, describe=describe: describe(chunk).views()


if __name__ == "__main__":
    main()
