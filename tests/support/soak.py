"""A multi-engine soak: three engines at once on one evicting Redis, faults on a timer.

Two hybrid (Gemma-3-shaped) engines in one namespace (same model directory and configuration)
and one Llama-shaped engine serve, each from its own thread, a Zipf-like stream of prompts: a
few hot system prompts and many cold ones, each followed by a fresh user suffix. They share one
``redis-server`` with a small ``maxmemory`` and ``allkeys-lru``, so values are evicted all the
time. Every few seconds a fault strikes (random bytes over stored values, deletion, FLUSHALL,
Redis paused, Redis killed and restarted empty), from the fault fuzz's toolbox
(:mod:`tests.support.fault_fuzz`). Every request's greedy tokens (and their logprobs) are
compared with an engine of the same model without the tier. Engines are the fuzz's long-lived
children (:mod:`tests.support.fuzz_child`), which empty vLLM's own prefix cache before every
prompt: every cached token came from Redis.

With ``modes`` holding ``tiering`` (``--modes direct,tiering``), a hybrid and a Llama engine of
the tiering mode join them (vLLM's tiering spec with the Redis secondary tier behind its CPU
tier, hma_redis/tools/devkit/cpu_tiering.py; each empties its CPU tier before every prompt
too, so its hits are promotions from the same Redis).

``python -m tests.support.soak --duration-s S`` (``scripts/soak.sh``) prints one table;
``tests/engine/test_soak.py`` runs a bounded one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from hma_redis.tools.devkit.cpu_tiering import cpu_tiering_config
from hma_redis.tools.devkit.engine import kv_transfer_config
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import FAMILIES, VOCAB_SIZE
from tests.support.engine_runner import make_prompts
from tests.support.fault_fuzz import (
    ENGINE_MODELS,
    LOGPROB_TOLERANCE,
    MODES,
    TIER_OPTIONS,
    TIERING_PRIMARY_BYTES,
    Engine,
    damage,
    engine_errors,
    engine_job,
    live_fault,
)

FAULT_KINDS = ("random-bytes", "deleted", "flushall", "paused", "killed")
LIVE = ("paused", "killed")
KEY_PATTERN = "hma:*:g*"
# Keys a static fault touches at most (a sample of what is stored).
FAULT_KEYS = 16
SAMPLE_EVERY_S = 1.0
MiB = 1 << 20
# The hybrid engines' prefix_cache_retention_interval: one of the tier's chunks (128 tokens
# here; vLLM refuses a value that is not a multiple of it).
RETENTION_TOKENS = 128


@dataclass(frozen=True)
class SoakConfig:
    """One soak run's knobs. ``request_bound_s``: a request slower than this counts as over
    its bound (Redis paused or killed must cost at most a few read timeouts)."""

    duration_s: float
    seed: int = 1
    maxmemory: str = "6mb"
    fault_every_s: float = 5.0
    hot_prompts: int = 4
    cold_prompts: int = 300
    zipf_s: float = 1.1
    request_bound_s: float = 60.0
    max_inflight_bytes: int = 8 * MiB
    # Each engine's own KV cache (vLLM's CPU default, 1 GiB, times five engines is too much
    # for a small host).
    kv_cache_bytes: int = 256 * MiB
    # More models, one tier engine (and one without the tier) each, from the fault fuzz's
    # ENGINE_MODELS (the hybrid families: gdn, mla, short-conv, chunked-local).
    families: tuple[str, ...] = ()
    # The modes of the tier engines: "direct" (the engines above), "tiering" (one hybrid and
    # one Llama engine more, in vLLM's tiering mode).
    modes: tuple[str, ...] = ("direct",)


class Workload:
    """Prompts drawn Zipf-like over system prompts (rank 0..hot-1 are the hot ones, longer),
    each followed by a user suffix of its own."""

    def __init__(self, cfg: SoakConfig) -> None:
        self._seed = cfg.seed
        self._hot = cfg.hot_prompts
        ranks = cfg.hot_prompts + cfg.cold_prompts
        self._ranks = list(range(ranks))
        self._weights = [1.0 / (r + 1) ** cfg.zipf_s for r in self._ranks]
        self._prefixes: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def _prefix(self, rank: int) -> list[int]:
        with self._lock:
            if rank not in self._prefixes:
                rng = random.Random(self._seed * 7919 + rank)
                length = rng.randrange(384, 700) if rank < self._hot else rng.randrange(96, 500)
                (self._prefixes[rank],) = make_prompts(
                    rng.randrange(1 << 30), 1, length, VOCAB_SIZE
                )
            return self._prefixes[rank]

    def prompt(self, rng: random.Random) -> list[int]:
        """One request's prompt: a system prompt by Zipf rank, then 4-64 fresh tokens."""
        (rank,) = rng.choices(self._ranks, self._weights)
        (suffix,) = make_prompts(rng.randrange(1 << 30), 1, rng.randrange(4, 64), VOCAB_SIZE)
        return self._prefix(rank) + suffix


@dataclass
class Served:
    """What one tier engine's driver saw."""

    name: str
    requests: int = 0
    tokens: int = 0
    wrong: int = 0
    errored: int = 0
    over_bound: int = 0
    hit_requests: int = 0
    cached_tokens: int = 0
    max_latency_s: float = 0.0
    max_logprob_diff: float = 0.0
    notes: list[str] = field(default_factory=list)


class Baseline:
    """An engine without the tier, shared by the drivers of its model (one request at a time)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()

    def serve(self, prompt: list[int]) -> dict[str, Any]:
        with self._lock:
            return self.engine.serve([prompt])[0]


class Sampler:
    """Samples every second: RSS of each process, Redis' evicted keys (summed over restarts:
    a killed Redis starts again from 0)."""

    def __init__(self, server: LocalRedis, engines: dict[str, Engine]) -> None:
        self._server = server
        self._engines = engines
        self.rss: dict[str, list[int]] = {name: [] for name in [*engines, "redis-server"]}
        self._evicted_before = 0  # of servers already killed
        self._evicted_last = 0
        self.used_memory_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def evicted(self) -> int:
        return self._evicted_before + self._evicted_last

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.sample()

    def sample(self) -> None:
        for name, engine in self._engines.items():
            self._rss(name, engine.pid)
        proc = self._server.proc
        if proc is not None:
            self._rss("redis-server", proc.pid)
        self._redis_stats()

    def _rss(self, name: str, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.rss[name].append(psutil.Process(pid).memory_info().rss)

    def _redis_stats(self) -> None:
        client = redis.Redis(port=self._server.port, socket_timeout=0.5)
        try:
            evicted = int(client.info("stats")["evicted_keys"])
            self.used_memory_peak = max(
                self.used_memory_peak, int(client.info("memory")["used_memory"])
            )
        except redis.RedisError:
            return  # paused or down: the next sample counts
        finally:
            client.close()
        if evicted < self._evicted_last:  # a restarted server
            self._evicted_before += self._evicted_last
        self._evicted_last = evicted


class Faults:
    """A fault every ``fault_every_s`` (± half), drawn from :data:`FAULT_KINDS`."""

    def __init__(self, server: LocalRedis, cfg: SoakConfig) -> None:
        self._server = server
        self._every = cfg.fault_every_s
        self._rng = random.Random(cfg.seed * 31 + 5)
        self.count: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self._rng.uniform(0.5, 1.5) * self._every):
            kind = self._rng.choice(FAULT_KINDS)
            try:
                self._strike(kind)
            except redis.RedisError:
                continue  # e.g. the values were evicted under the fault: nothing to damage
            self.count[kind] += 1

    def _strike(self, kind: str) -> None:
        if kind in LIVE:
            live_fault(self._server, kind, self._rng)
            return
        client = redis.Redis(port=self._server.port, socket_timeout=5)
        try:
            keys = list(client.scan_iter(match=KEY_PATTERN, count=500))
            sample = self._rng.sample(keys, min(len(keys), FAULT_KEYS))
            damage(client, kind, sample, self._rng)
        finally:
            client.close()


@dataclass
class SoakResult:
    served: list[Served]
    faults: Counter[str]
    evicted: int
    rss: dict[str, list[int]]
    redis_used_memory_peak: int
    worker_totals: dict[str, dict[str, int]]
    worker_memory: dict[str, dict[str, int]]
    loads_failed_jobs: dict[str, int]
    errors: list[str]
    duration_s: float

    @property
    def wrong(self) -> int:
        return sum(s.wrong for s in self.served)

    @property
    def errored(self) -> int:
        """Requests that errored or exceeded their bound, and exceptions that reached vLLM."""
        return sum(s.errored + s.over_bound for s in self.served) + len(self.errors)

    @property
    def hits(self) -> int:
        """Chunks loaded from Redis, over all engines."""
        return sum(t.get("loaded_chunks", 0) for t in self.worker_totals.values())

    def memory_within_bound(self) -> bool:
        """Every engine with the tier logged its transfers' peak at shutdown, within bound."""
        return bool(self.worker_memory) and all(
            m and m["peak_budget_bytes"] <= m["max_inflight_bytes"]
            for m in self.worker_memory.values()
        )


def _growth(samples: list[int], since: int = 0) -> float | None:
    """Mean of the last third of ``samples`` over the mean of third ``since`` (0: the first,
    1: the middle), minus one."""
    third = len(samples) // 3
    if third == 0:
        return None
    base, last = samples[since * third : (since + 1) * third], samples[-third:]
    return (sum(last) / len(last)) / (sum(base) / len(base)) - 1.0


def _compare(got: dict[str, Any], want: dict[str, Any], served: Served) -> None:
    served.tokens += len(got["token_ids"])
    if got["token_ids"] != want["token_ids"]:
        served.wrong += 1
        served.notes.append(f"tokens {got['token_ids']} != {want['token_ids']}")
        return
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            served.wrong += 1
            served.notes.append(f"logprob {a} vs {b}")
            return
        served.max_logprob_diff = max(served.max_logprob_diff, abs(a - b))
    if served.max_logprob_diff > LOGPROB_TOLERANCE:
        served.wrong += 1
        served.notes.append(f"logprob differs by {served.max_logprob_diff:.3g}")


def _drive(
    engine: Engine,
    baseline: Baseline,
    workload: Workload,
    served: Served,
    until: float,
    cfg: SoakConfig,
    seed: int,
) -> None:
    """Serve prompts on ``engine`` until the monotonic time ``until``, each checked against
    ``baseline``. An engine that stops answering ends its driver (one error)."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        prompt = workload.prompt(rng)
        t0 = time.monotonic()
        try:
            (got,) = engine.serve([prompt])
        except (RuntimeError, ValueError, OSError) as exc:
            served.errored += 1
            served.notes.append(f"request failed: {str(exc)[:300]}")
            return
        latency = time.monotonic() - t0
        served.requests += 1
        served.max_latency_s = max(served.max_latency_s, latency)
        served.over_bound += latency > cfg.request_bound_s
        served.cached_tokens += got["num_cached_tokens"]
        served.hit_requests += got["num_cached_tokens"] > 0
        _compare(got, baseline.serve(prompt), served)


_TOTALS = re.compile(r"(?:worker rank \d+|secondary tier) totals (\{.*\})")
_MEMORY = re.compile(r"(?:worker rank \d+|secondary tier) memory (\{.*\})")


def _last_json(pattern: re.Pattern[str], text: str) -> dict[str, int]:
    found = pattern.findall(text)
    return dict(json.loads(found[-1])) if found else {}


class Soak:
    """The soak's Redis, models and engines (three with the tier, one without per model)."""

    def __init__(self, cfg: SoakConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.redis = LocalRedis(
            extra_args=["--maxmemory", cfg.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        ).start()
        # model -> its ENGINE_MODELS name and checkpoint.
        names = {"hybrid": "hybrid", "llama": "one-group", **{f: f for f in cfg.families}}
        self.models = {m: (n, ENGINE_MODELS[n].build(workdir / m)) for m, n in names.items()}
        # name -> model; the two hybrid engines share one namespace.
        self.tiered = {"hybrid-a": "hybrid", "hybrid-b": "hybrid", "llama": "llama"}
        self.tiered.update({f: f for f in cfg.families})
        if "tiering" in cfg.modes:
            self.tiered.update({"hybrid-tiering": "hybrid", "llama-tiering": "llama"})
        self.engines: dict[str, Engine] = {}

    def start_engines(self) -> None:
        """Start every engine at once (each start takes tens of seconds)."""
        options = {**TIER_OPTIONS, "max_inflight_bytes": self.cfg.max_inflight_bytes}
        jobs = {
            name: {
                **engine_job(*self.models[model]),
                "kv_transfer_config": kv_transfer_config(self.redis.url, **options),
            }
            for name, model in self.tiered.items()
        }
        for name, job in jobs.items():
            if name.endswith("-tiering"):
                job["kv_transfer_config"] = cpu_tiering_config(
                    self.redis.url, TIERING_PRIMARY_BYTES, **options
                )
                job["reset_connector"] = True
        for model, (family, path) in self.models.items():
            jobs[f"{model}-no-tier"] = engine_job(family, path)
        for name, job in jobs.items():
            job["llm_kwargs"]["kv_cache_memory_bytes"] = self.cfg.kv_cache_bytes
            if name.startswith("hybrid"):
                # Sliding-window chunks are kept (so stored and hit) only at retained
                # checkpoints: without periodic ones, prompts that share only a system prompt
                # (a fresh user suffix each) never hit on the hybrid model (README).
                job["llm_kwargs"]["prefix_cache_retention_interval"] = RETENTION_TOKENS
        failures: list[BaseException] = []

        def start(name: str, job: dict[str, Any]) -> None:
            try:
                self.engines[name] = Engine(job, {}, self.workdir / f"engine-{name}.log")
            except BaseException as exc:  # reported below, after every start has ended
                failures.append(exc)

        _in_threads([lambda n=n, j=j: start(n, j) for n, j in jobs.items()])
        if failures:
            raise failures[0]

    def run(self) -> SoakResult:
        cfg = self.cfg
        workload = Workload(cfg)
        baselines = {m: Baseline(self.engines[f"{m}-no-tier"]) for m in self.models}
        served = {name: Served(name) for name in self.tiered}
        sampler = Sampler(self.redis, self.engines)
        faults = Faults(self.redis, cfg)
        t0 = time.monotonic()
        until = t0 + cfg.duration_s
        sampler.start()
        faults.start()
        drivers = [
            lambda name=name, i=i: _drive(
                self.engines[name],
                baselines[self.tiered[name]],
                workload,
                served[name],
                until,
                cfg,
                cfg.seed * 101 + i,
            )
            for i, name in enumerate(self.tiered)
        ]
        try:
            _in_threads(drivers)
        finally:
            faults.stop()
            sampler.stop()
        duration = time.monotonic() - t0
        self.close_engines()
        return self._result(list(served.values()), faults, sampler, duration)

    def _result(
        self, served: list[Served], faults: Faults, sampler: Sampler, duration: float
    ) -> SoakResult:
        logs = {name: self.engines[name].log_text() for name in self.tiered}
        return SoakResult(
            served=served,
            faults=faults.count,
            evicted=sampler.evicted,
            rss=sampler.rss,
            redis_used_memory_peak=sampler.used_memory_peak,
            worker_totals={n: _last_json(_TOTALS, text) for n, text in logs.items()},
            worker_memory={n: _last_json(_MEMORY, text) for n, text in logs.items()},
            loads_failed_jobs={n: text.count("will be recomputed") for n, text in logs.items()},
            errors=engine_errors(self.engines.values()),
            duration_s=duration,
        )

    def close_engines(self) -> None:
        """Shut every engine down (EOF); their workers log totals and memory as they stop."""
        _in_threads([engine.close for engine in self.engines.values()])

    def close(self) -> None:
        self.close_engines()
        self.redis.stop()


def _in_threads(calls: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run(cfg: SoakConfig, workdir: Path | None = None) -> SoakResult:
    """Start everything, soak for ``cfg.duration_s``, stop everything; the result."""
    with tempfile.TemporaryDirectory(prefix="hma-soak-") as tmp:
        soak = Soak(cfg, workdir or Path(tmp))
        try:
            soak.start_engines()
            return soak.run()
        finally:
            soak.close()


# ---------------------------------------------------------------------------------- the table


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def _rss_cells(samples: list[int]) -> tuple[str, str]:
    """Peak RSS, and the last third's mean against the first and the middle third's."""
    if not samples:
        return "-", "-"
    growth = [_growth(samples, since) for since in (0, 1)]
    cells = " / ".join("-" if g is None else f"{g:+.1%}" for g in growth)
    return _mib(max(samples)), cells


def _tier_memory(memory: dict[str, int]) -> str:
    if not memory:
        return "not logged"
    return (
        f"{_mib(memory['peak_budget_bytes'])} / {_mib(memory['peak_buffer_bytes'])} "
        f"of {_mib(memory['max_inflight_bytes'])}"
    )


def table(result: SoakResult) -> str:
    """One row per process and a total row (Markdown)."""
    rows = [
        "| process | requests | tokens compared | wrong | errored / over bound "
        "| loads failed (jobs / chunks), recomputed | hits: requests / tokens / chunks loaded "
        "| max latency s | peak RSS MiB | RSS, last third vs first / vs middle "
        "| tier peak budget / buffers of bound, MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result.served:
        totals = result.worker_totals.get(s.name, {})
        peak, growth = _rss_cells(result.rss.get(s.name, []))
        rows.append(
            f"| {s.name} | {s.requests} | {s.tokens} | {s.wrong} | {s.errored} / {s.over_bound} "
            f"| {result.loads_failed_jobs.get(s.name, 0)} / "
            f"{totals.get('load_failed_chunks', 0)} "
            f"| {s.hit_requests} / {s.cached_tokens} / {totals.get('loaded_chunks', 0)} "
            f"| {s.max_latency_s:.1f} | {peak} | {growth} "
            f"| {_tier_memory(result.worker_memory.get(s.name, {}))} |"
        )
    for name in sorted(set(result.rss) - {s.name for s in result.served}):
        peak, growth = _rss_cells(result.rss[name])
        extra = (
            f"evicted keys {result.evicted}, used_memory peak "
            f"{_mib(result.redis_used_memory_peak)} MiB"
            if name == "redis-server"
            else "baseline (no tier)"
        )
        rows.append(f"| {name} | | | | | | {extra} | | {peak} | {growth} | |")
    s = result.served
    rows.append(
        f"| **total** ({result.duration_s:.0f} s; faults: "
        + ", ".join(f"{k} {result.faults[k]}" for k in FAULT_KINDS if result.faults[k])
        + f") | {sum(x.requests for x in s)} | {sum(x.tokens for x in s)} "
        f"| **{result.wrong}** | {result.errored} "
        f"| {sum(result.loads_failed_jobs.values())} / "
        f"{sum(t.get('load_failed_chunks', 0) for t in result.worker_totals.values())} "
        f"| {sum(x.hit_requests for x in s)} / {sum(x.cached_tokens for x in s)} / "
        f"{result.hits} | | | | |"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--maxmemory", default=SoakConfig.maxmemory)
    parser.add_argument("--fault-every-s", type=float, default=SoakConfig.fault_every_s)
    parser.add_argument("--workdir", type=Path, help="keep the engines' logs here")
    parser.add_argument(
        "--families",
        default="",
        help="comma-separated hybrid families to add, one tier engine each "
        "(gdn, mla, short-conv, chunked-local, fp8-e4m3, fp8-e5m2; 'all': every one this "
        "host runs)",
    )
    parser.add_argument(
        "--modes",
        default="direct",
        help="comma-separated: direct (always), tiering (a hybrid and a Llama engine of vLLM's "
        "tiering mode join)",
    )
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    families = tuple(
        (f for f, family in FAMILIES.items() if family.refused() is None)
        if args.families == "all"
        else (f for f in args.families.split(",") if f)
    )
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    cfg = SoakConfig(
        duration_s=args.duration_s,
        seed=args.seed,
        maxmemory=args.maxmemory,
        fault_every_s=args.fault_every_s,
        families=families,
        modes=modes,
    )
    result = run(cfg, args.workdir)
    if args.workdir:  # the RSS samples (bytes, one per second per process), for plots
        (args.workdir / "rss.json").write_text(json.dumps(result.rss))
    print(table(result))
    for s in result.served:
        for note in s.notes[:5]:
            print(f"{s.name}: {note}")
    for error in result.errors:
        print(error)
    ok = result.wrong == 0 and result.errored == 0 and result.memory_within_bound()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
