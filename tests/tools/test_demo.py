"""The demo's verdict and its default model, without an engine (tests/engine/test_demo.py runs
the demo itself)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.breaker import MISSING_PASSWORD
from hma_redis.tools.demo import openai_example
from hma_redis.tools.demo.demo import DEFAULT_PROMPT_TOKENS, PromptRun, report
from hma_redis.tools.demo.openai_example import VllmServer
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port
from hma_redis.tools.devkit.tiny_models import DEMO_SHAPE, HEAD_DIM

# What the engines here may hold: VLLM_CPU_KVCACHE_SPACE=1 (GiB) in the CPU engine defaults.
CPU_KV_CACHE_BYTES = 2**30


def _run(cached: int, ttft_s: float, tokens: list[int]) -> PromptRun:
    return PromptRun(4097, cached, ttft_s, tokens)


def test_default_demo_model_makes_the_prefill_worth_skipping() -> None:
    # A tiny model's prefill takes milliseconds and shows no gain from Redis (issue 14 part 4):
    # the default must be a few hundred million parameters over a 4k-token prompt.
    hidden, kv_width = DEMO_SHAPE.hidden_size, DEMO_SHAPE.num_kv_heads * HEAD_DIM
    attention = 2 * hidden * hidden + 2 * hidden * kv_width  # q, o; k, v
    params_per_layer = attention + 3 * hidden * DEMO_SHAPE.intermediate_size
    assert DEMO_SHAPE.num_layers * params_per_layer >= 300_000_000
    assert DEFAULT_PROMPT_TOKENS >= 4096
    # ... while the prompt's KV cache fits an engine's CPU KV cache several times over.
    assert DEMO_SHAPE.kv_bytes_per_token() * DEFAULT_PROMPT_TOKENS <= CPU_KV_CACHE_BYTES // 4


def test_verdict_names_tokens_from_redis_and_the_speedup(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert report(_run(0, 7.9, [5, 6]), _run(4096, 0.31, [5, 6])) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        "engine B: 4096 of 4097 prompt tokens from Redis, time to first token 0.31 s vs 7.90 s "
        "cold (25× faster), tokens identical"
    )


def test_verdict_fails_when_engine_b_generates_other_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert report(_run(0, 7.9, [5, 6]), _run(4096, 0.31, [5, 7])) == 1
    assert "tokens DIFFER" in capsys.readouterr().out


def test_verdict_fails_when_nothing_came_from_redis(capsys: pytest.CaptureFixture[str]) -> None:
    assert report(_run(0, 7.9, [5, 6]), _run(0, 7.7, [5, 6])) == 1
    out = capsys.readouterr().out
    assert "(1.0× faster)" in out
    assert "engine B loaded nothing from Redis" in out


def test_verdict_says_when_engine_a_was_not_cold(capsys: pytest.CaptureFixture[str]) -> None:
    assert report(_run(2048, 3.9, [5, 6]), _run(4096, 0.31, [5, 6])) == 0
    assert "its time is not a cold one" in capsys.readouterr().out


@pytest.mark.parametrize(
    "url",
    [
        "redis://tier:s3cret-pw%21@10.0.0.5:6380/2",
        "rediss://tier:s3cret-pw!@cache.internal:6380/2",
        "redis+sentinel://tier:s3cret-pw!@s1:26379,s2:26379/mymaster/2",
    ],
)
def test_vllm_serve_command_line_never_holds_the_redis_password(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HMA_REDIS_PASSWORD", raising=False)
    server = VllmServer("/models/m", url, extra_args=["--enforce-eager"], log_path=tmp_path / "a")
    assert not any("s3cret" in arg for arg in server.args), server.args
    # The server's tier still gets the whole URL, from its environment.
    config = json.loads(server.args[server.args.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    tier = RedisTierConfig.from_extra_config(extra, env=server.env)
    assert (tier.username, tier.password, tier.db) == ("tier", "s3cret-pw!", 2)
    assert tier.url == url


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The demo as a user runs it (``--quick``), in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "hma_redis.tools.demo.demo", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_demo_with_redis_down_says_nothing_reached_redis_and_fails() -> None:
    port = free_port()
    run = _demo("--redis-url", f"redis://127.0.0.1:{port}/0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith(
        f"nothing reached Redis: cannot reach Redis at redis://127.0.0.1:{port}/0: "
    )
    assert "Connection refused" in run.stdout
    # No engine ran, so nothing claims a store or a speed-up.
    assert "stored to Redis" not in run.stdout and "faster" not in run.stdout
    assert "Traceback" not in run.stdout + run.stderr


def test_demo_against_a_redis_that_wants_a_password_names_the_missing_password(
    local_redis: LocalRedis,
) -> None:
    redis.Redis(port=local_redis.port).config_set("requirepass", "s3cret-pw")
    run = _demo("--redis-url", local_redis.url, env={"HMA_REDIS_PASSWORD": ""})
    assert run.returncode == 1, run.stdout + run.stderr
    assert MISSING_PASSWORD in run.stdout
    assert "HELLO" not in run.stdout


def test_verdict_after_a_redis_failure_claims_nothing_stored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = "cannot reach Redis at redis://127.0.0.1:1/0: ConnectionError: refused"
    assert report(_run(0, 7.9, [5, 6]), _run(0, 7.7, [5, 6]), redis_error=error) == 1
    out = capsys.readouterr().out
    assert "stored to Redis" not in out and "PYTHONHASHSEED" not in out
    assert out.strip().splitlines()[-1] == f"nothing reached Redis: {error}"


def test_openai_example_servers_drain_on_sigterm(tmp_path: Path) -> None:
    server = VllmServer("/models/m", "redis://127.0.0.1:1/0", log_path=tmp_path / "a")
    at = server.args.index("--shutdown-timeout")
    assert int(server.args[at + 1]) > 0


def test_openai_example_keeps_the_logs_it_names(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that fails to start: the example names its log, and the log is still there."""
    previous = signal.getsignal(signal.SIGTERM)  # the example installs its own handler
    try:
        with pytest.raises(RuntimeError, match="vllm serve exited"):
            openai_example.main(
                ["--redis-url", redis_url, "--model", "/no/such/model", "--start-timeout", "300"]
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr().out
    logdir = Path(out.split("server logs: ")[1].split(" (kept)")[0])
    try:
        named = [
            Path(line.split("(log ")[1].rstrip(")")) for line in out.splitlines() if "(log " in line
        ]
        assert len(named) == 2
        for log in named:
            assert log.parent == logdir and log.read_text(), log
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
