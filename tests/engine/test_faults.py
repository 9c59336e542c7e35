"""Never wrong, never stuck: real engines against a real Redis that misbehaves.

Every case compares the tokens of an engine using the tier with a run without it (greedy), and
checks that no exception escapes, that no request waits longer than the Redis timeout plus its
recompute, and that the namespace's counters recorded what failed.

Faults that must land *between the scheduler's lookup and the worker's read* use the worker's
test hook ``HMA_REDIS_TEST_LOAD_DELAY_S`` (a pause before each load's GET): the test waits until
the engine's lookup has reached Redis (``INFO commandstats``), then breaks Redis during the pause.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3, build_llama
from tests.engine.test_corruption import nan_payload, random_middle_half
from tests.support.engine_runner import EngineRun, make_prompts, run_engine, run_engines
from tests.support.tier import tier_config
from tests.support.tls_certs import TlsLocalRedis, make_tls_files

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
LOAD_DELAY_S = 2.0
READ_TIMEOUT_S = 1.0
# Tier options for the fault cases: short timeouts so outages resolve fast.
TIER_OPTIONS = {"read_timeout_s": READ_TIMEOUT_S, "connect_timeout_s": 0.5, "retry_interval_s": 1.0}
# Bound on one request's wall time: the load pause, one Redis timeout, and a recompute (generous:
# the machine has two cores and runs the engine and Redis together).
REQUEST_BOUND_S = LOAD_DELAY_S + READ_TIMEOUT_S + 10.0


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"), sliding_window=32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [make_prompts(70 + i, 1, n, VOCAB_SIZE)[0] for i, n in enumerate((900, 600))]


@pytest.fixture(scope="module")
def baselines(gemma: str, llama: str, prompts: list[list[int]]) -> dict[str, EngineRun]:
    return {
        model: run_engine(model, prompts, MAX_TOKENS, kv_transfer_config=None)
        for model in (gemma, llama)
    }


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


def _client(srv: LocalRedis) -> redis.Redis:
    return redis.Redis(port=srv.port, socket_timeout=5)


def _block_keys(client: redis.Redis) -> list[bytes]:
    return [k for k in client.scan_iter(match="hma:*:g*", count=1000)]


def _stats(client: redis.Redis) -> dict[str, int]:
    """The tier's counters, summed over its namespaces."""
    total: dict[str, int] = {}
    for key in client.scan_iter(match="hma:*:stats"):
        for field, value in client.hgetall(key).items():
            total[field.decode()] = total.get(field.decode(), 0) + int(value)
    return total


def _worker_totals(run: EngineRun) -> dict[str, int]:
    """The counters a worker logs when it shuts down."""
    lines = [ln for ln in run.stderr.splitlines() if "worker rank 0 totals" in ln]
    assert lines, run.stderr_tail
    return dict(json.loads(lines[-1].split("totals", 1)[1]))


def _eval_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))


def _after_next_lookup(srv: LocalRedis, fault: Callable[[], None]) -> threading.Thread:
    """Run ``fault`` as soon as an engine's next lookup has reached Redis."""
    client = _client(srv)
    before = _eval_calls(client)

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _eval_calls(client) == before:
            time.sleep(0.02)
        time.sleep(0.2)  # let the scheduler see the hits and hand the load to the worker
        fault()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _run_with_fault(
    model: str,
    prompts: list[list[int]],
    srv: LocalRedis,
    fault: Callable[[], None] | None,
    delay: bool,
    url: str | None = None,
) -> EngineRun:
    """Engine A stores the prompts; engine B serves them while ``fault`` strikes. The engines
    use ``url`` (default: the server's TCP URL)."""
    config = tier_config(url or srv.url, **TIER_OPTIONS)
    run_engine(model, prompts, MAX_TOKENS, config)
    assert _block_keys(_client(srv)), "engine A stored nothing"
    env = {TEST_LOAD_DELAY_ENV: str(LOAD_DELAY_S)} if delay else None
    watcher = _after_next_lookup(srv, fault) if (fault and delay) else None
    if fault and not delay:
        fault()
    run = run_engine(model, prompts, MAX_TOKENS, config, extra_env=env)
    if watcher is not None:
        watcher.join(30)
    return run


def _assert_served_correctly(run: EngineRun, baseline: EngineRun) -> None:
    assert run.token_ids == baseline.token_ids, run.stderr_tail
    slowest = max(r.wall_s for r in run.results)
    assert slowest < REQUEST_BOUND_S, f"a request took {slowest:.1f}s"


# ------------------------------------------------------------------ corrupted values


def _corrupt_in_place(client: redis.Redis) -> None:
    """Random bytes over the middle half of every value (a single flipped byte leaves a page
    holding almost the right KV, which hides a page that is read without being rewritten)."""
    rng = random.Random(3)
    for key in _block_keys(client):
        length = client.strlen(key)
        client.setrange(key, length // 4, rng.randbytes(length // 2))


def _truncate(client: redis.Redis) -> None:
    for key in _block_keys(client):
        value = client.get(key)
        assert value is not None
        client.set(key, value[: len(value) - 100])


def _swap_values(client: redis.Redis) -> None:
    """Every key gets another key's perfectly valid value."""
    keys = sorted(_block_keys(client))
    values = [client.get(k) for k in keys]
    for key, value in zip(keys, values[1:] + values[:1], strict=True):
        assert value is not None
        client.set(key, value)


def _mixed_faults(client: redis.Redis) -> None:
    """Each value, by key in turn: random bytes over its middle half, a NaN/Inf body after its
    first 256 bytes, cut by 100 bytes, or another key's valid value."""
    rng = random.Random(9)
    keys = sorted(_block_keys(client))
    values = [client.get(k) for k in keys]
    for idx, (key, value) in enumerate(zip(keys, values, strict=True)):
        assert value is not None
        damaged = (
            random_middle_half({key: value}, rng)[key],
            nan_payload({key: value}, rng)[key],
            value[: len(value) - 100],
            values[(idx + 1) % len(values)],
        )[idx % 4]
        client.set(key, damaged)


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_in_place, _truncate, _swap_values],
    ids=["bytes-corrupted", "truncated", "other-keys-value"],
)
def test_corrupted_values_are_recomputed_and_dropped(
    gemma: str,
    prompts: list[list[int]],
    baselines: dict[str, EngineRun],
    server: LocalRedis,
    corrupt: Callable[[redis.Redis], None],
) -> None:
    client = _client(server)
    run = _run_with_fault(gemma, prompts, server, lambda: corrupt(client), delay=False)
    _assert_served_correctly(run, baselines[gemma])
    assert run.num_cached_tokens == [0, 0]  # nothing bad was used
    stats = _stats(client)
    assert stats["load_failed_jobs"] >= 1
    # Bad values were removed and the recompute stored good ones: a third engine now hits.
    again = run_engine(gemma, prompts, MAX_TOKENS, tier_config(server.url, **TIER_OPTIONS))
    _assert_served_correctly(again, baselines[gemma])
    assert all(n > 0 for n in again.num_cached_tokens), again.stderr_tail


def test_value_from_another_namespace_is_rejected(
    gemma: str,
    llama: str,
    prompts: list[list[int]],
    baselines: dict[str, EngineRun],
    server: LocalRedis,
) -> None:
    """A valid Llama chunk copied over a Gemma key of the same hash is never loaded."""
    client = _client(server)
    run_engine(llama, prompts, MAX_TOKENS, tier_config(server.url, **TIER_OPTIONS))
    llama_keys = {k.decode().split(":", 2)[2]: k for k in _block_keys(client)}
    llama_ns = next(iter(llama_keys.values())).decode().split(":")[1]

    def copy_llama_values() -> None:
        for key in _block_keys(client):
            ns, rest = key.decode().split(":")[1], key.decode().split(":", 2)[2]
            if ns != llama_ns and rest in llama_keys:
                client.set(key, client.get(llama_keys[rest]) or b"")

    run = _run_with_fault(gemma, prompts, server, copy_llama_values, delay=False)
    _assert_served_correctly(run, baselines[gemma])
    assert run.num_cached_tokens == [0, 0]
    assert _stats(client)["load_failed_jobs"] >= 1


# ------------------------------------------------------------------ between lookup and load


@pytest.mark.parametrize("model_name", ["gemma", "llama"])
def test_blocks_deleted_between_lookup_and_load_are_recomputed(
    model_name: str,
    gemma: str,
    llama: str,
    prompts: list[list[int]],
    baselines: dict[str, EngineRun],
    server: LocalRedis,
) -> None:
    model = gemma if model_name == "gemma" else llama
    client = _client(server)
    run = _run_with_fault(
        model, prompts, server, lambda: client.delete(*_block_keys(client)), delay=True
    )
    _assert_served_correctly(run, baselines[model])
    assert run.num_cached_tokens[0] == 0
    assert _stats(client)["load_failed_jobs"] >= 1


def test_flushall_mid_run(
    gemma: str, prompts: list[list[int]], baselines: dict[str, EngineRun], server: LocalRedis
) -> None:
    client = _client(server)
    run = _run_with_fault(gemma, prompts, server, client.flushall, delay=True)
    _assert_served_correctly(run, baselines[gemma])
    assert run.num_cached_tokens[0] == 0


def test_redis_killed_during_loads_then_restarted(
    gemma: str, prompts: list[list[int]], baselines: dict[str, EngineRun], server: LocalRedis
) -> None:
    def kill_and_restart() -> None:
        server.kill()
        time.sleep(1.0)
        server.start()  # same port, empty (persistence off)

    run = _run_with_fault(gemma, prompts, server, kill_and_restart, delay=True)
    _assert_served_correctly(run, baselines[gemma])
    assert run.num_cached_tokens[0] == 0
    # The tier resumed by itself: the engine stored again after the restart.
    assert _block_keys(_client(server)), run.stderr_tail


def test_redis_paused_longer_than_the_timeout(
    gemma: str, prompts: list[list[int]], baselines: dict[str, EngineRun], server: LocalRedis
) -> None:
    def pause() -> None:
        server.pause()
        # Covers the worker's load pause, its GET and that GET's timeout.
        time.sleep(LOAD_DELAY_S + READ_TIMEOUT_S + 1.0)
        server.resume()

    run = _run_with_fault(gemma, prompts, server, pause, delay=True)
    _assert_served_correctly(run, baselines[gemma])
    assert run.num_cached_tokens[0] == 0
    assert _stats(_client(server))["load_failed_jobs"] >= 1


def test_redis_down_when_the_engine_starts_and_for_the_whole_run(
    gemma: str, prompts: list[list[int]], baselines: dict[str, EngineRun], server: LocalRedis
) -> None:
    """The README's configuration pointed at a Redis that is down before the engine starts
    and stays down: the engine starts, serves every prompt (twice, so the second round would
    have hit) with the tokens of a run without the tier, each request within the bound, says
    why the tier is idle and logs no error of the tier's."""
    server.kill()
    config = tier_config(server.url, **TIER_OPTIONS)
    run = run_engine(gemma, prompts + prompts, MAX_TOKENS, config)
    assert run.token_ids == baselines[gemma].token_ids * 2, run.stderr_tail
    slowest = max(r.wall_s for r in run.results)
    assert slowest < REQUEST_BOUND_S, f"a request took {slowest:.1f}s"
    assert run.num_cached_tokens == [0] * len(run.results), run.stderr_tail
    tier_lines = [ln for ln in run.stderr.splitlines() if "hma_redis" in ln]
    assert any("not reachable at start-up" in ln for ln in tier_lines), run.stderr_tail
    assert not [ln for ln in tier_lines if " ERROR " in ln], run.stderr_tail
    # The worker counted the stores it could not make, and made none.
    assert _worker_totals(run).get("store_failed_chunks", 0) > 0, run.stderr_tail


# ------------------------------------------------------------------ other transports


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[tuple[LocalRedis, str]]:
    """A server on a Unix socket (the engines' URL) and a TCP port (the test's own client)."""
    path = tmp_path / "redis.sock"
    srv = LocalRedis(extra_args=["--unixsocket", str(path), "--unixsocketperm", "700"]).start()
    yield srv, f"unix://{path}?db=0"
    srv.stop()


def test_over_a_unix_socket_redis_killed_during_loads_then_restarted(
    gemma: str,
    prompts: list[list[int]],
    baselines: dict[str, EngineRun],
    unix_server: tuple[LocalRedis, str],
) -> None:
    """The native path on a Unix socket: Redis killed while a load waits, restarted on the
    same socket; the request is recomputed and the tier stores again."""
    server, url = unix_server

    def kill_and_restart() -> None:
        server.kill()
        time.sleep(1.0)
        server.start()  # same socket and port, empty

    run = _run_with_fault(gemma, prompts, server, kill_and_restart, delay=True, url=url)
    _assert_served_correctly(run, baselines[gemma])
    assert run.num_cached_tokens[0] == 0
    assert "transfer data path: native" in run.stderr, run.stderr_tail
    assert _block_keys(_client(server)), run.stderr_tail


def test_over_tls_corrupted_values_are_recomputed(
    gemma: str,
    prompts: list[list[int]],
    baselines: dict[str, EngineRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The Python path (TLS): values damaged in Redis in every way of :func:`_mixed_faults`
    are refused, the requests recomputed with the cold run's tokens, and a third engine loads
    the good values stored again."""
    try:
        server = TlsLocalRedis(make_tls_files(tmp_path_factory.mktemp("tls"))).start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start a TLS redis-server (needs TLS support): {exc}", pytrace=False)
    try:
        files = server.files
        config = tier_config(
            server.url,
            tls_ca_file=files.ca_cert,
            tls_cert_file=files.client_cert,
            tls_key_file=files.client_key,
            **TIER_OPTIONS,
        )
        run_engine(gemma, prompts, MAX_TOKENS, config)
        with server.tls_client() as client:
            assert len(_block_keys(client)) >= 4, "engine A stored too little to mix faults"
            _mixed_faults(client)
            run = run_engine(gemma, prompts, MAX_TOKENS, config)
            _assert_served_correctly(run, baselines[gemma])
            assert run.num_cached_tokens == [0, 0]
            assert "transfer data path: pure Python (TLS" in run.stderr, run.stderr_tail
            assert _stats(client)["load_failed_jobs"] >= 1
        again = run_engine(gemma, prompts, MAX_TOKENS, config)
        _assert_served_correctly(again, baselines[gemma])
        assert all(n > 0 for n in again.num_cached_tokens), again.stderr_tail
    finally:
        server.stop()


# ------------------------------------------------------------------ eviction soak


def test_soak_two_engines_under_constant_eviction(llama: str, tmp_path: Path) -> None:
    """>= 100 requests over two concurrent engines, maxmemory far below the working set."""
    srv = LocalRedis(extra_args=["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"])
    srv.start()
    try:
        docs = [make_prompts(100 + d, 1, 520, VOCAB_SIZE)[0] for d in range(8)]
        questions = [make_prompts(200 + q, 1, 40, VOCAB_SIZE)[0] for q in range(13)]
        requests = [docs[i % 8] + questions[i % 13] for i in range(104)]
        halves = [requests[0::2], requests[1::2]]
        baseline = run_engine(llama, requests, 4, kv_transfer_config=None)
        runs = run_engines(
            [{"prompts": halves[0]}, {"prompts": halves[1]}],
            max_parallel=2,
            model_dir=llama,
            max_tokens=4,
            kv_transfer_config=tier_config(srv.url, **TIER_OPTIONS),
        )
        got = [None] * len(requests)
        for offset, run in enumerate(runs):
            for i, tokens in enumerate(run.token_ids):
                got[offset + 2 * i] = tokens
        assert got == baseline.token_ids
        client = _client(srv)
        assert int(client.info("stats")["evicted_keys"]) > 0
        # The stats hash itself can be evicted here; the workers log their totals at exit.
        totals = [_worker_totals(run) for run in runs]
        assert sum(t.get("loaded_chunks", 0) for t in totals) > 0, "nothing came from Redis"
        assert sum(t.get("stored_chunks", 0) for t in totals) > 0
        assert sum(sum(r.num_cached_tokens) for r in runs) > 0
    finally:
        srv.stop()
