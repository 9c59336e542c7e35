"""The main job (``scripts/demo.sh``) end to end, on its small ``--quick`` shape: two engine
processes, a real Redis, the lines a user reads."""

from __future__ import annotations

import re

import pytest

from hma_redis.tools.demo.demo import main

pytestmark = pytest.mark.engine

VERDICT = re.compile(
    r"engine B: (\d+) of (\d+) prompt tokens from Redis, time to first token [\d.]+ s "
    r"vs [\d.]+ s cold \([\d.]+× faster\), tokens identical"
)


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "gemma3"])
def test_demo_engine_b_loads_the_whole_prompt_from_redis_with_identical_tokens(
    hybrid: bool, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--quick", "--seed", "0", "--redis-url", redis_url] + (["--hybrid"] if hybrid else [])
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    # Which model ran, and the start-up phases while the engines start.
    assert ("model: Gemma-3-style hybrid" if hybrid else "model: Llama-shaped") in out
    for engine in ("A", "B"):
        assert f"engine {engine}: loading the model weights (" in out
        assert f"engine {engine}: ready; serving the prompts (" in out
    assert "engine A: 0 of 1025 prompt tokens from Redis (cold prefill" in out
    verdict = VERDICT.fullmatch(lines[-1])
    assert verdict is not None, out
    # Every whole chunk before the last token (vLLM computes that one itself).
    assert (int(verdict[1]), int(verdict[2])) == (1024, 1025)
