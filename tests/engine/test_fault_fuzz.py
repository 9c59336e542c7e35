"""The engine-level fault fuzz (tests/support/fault_fuzz.py), a few seeded rounds.

Each round: random prompts sharing prefixes, a random model (hybrid or one-group), a random
mode (the direct spec, or vLLM's tiering spec with the Redis secondary tier), random data
paths for the engine that stores and the one that loads, and a random fault at a random moment
(random bytes, NaN payload, truncation, swapped values, deletion, FLUSHALL, Redis killed,
paused, or answering one byte at a time). Tokens and logprobs must match an engine without the
tier, and no exception may reach an engine. ``HMA_FUZZ_ROUNDS`` / ``HMA_FUZZ_SEED`` /
``HMA_FUZZ_MODELS`` / ``HMA_FUZZ_MODES`` change the run; ``scripts/fault_fuzz.sh --rounds N``
runs longer ones over every model (the hybrid families too: each has its own engine test in
test_families.py, and every model drawn costs engine starts, so the suite's rounds keep to two).
"""

from __future__ import annotations

import os

import pytest

from tests.support.fault_fuzz import run, summary

pytestmark = pytest.mark.engine


def test_fault_fuzz_rounds_are_exact_or_recomputed() -> None:
    rounds = int(os.environ.get("HMA_FUZZ_ROUNDS", "8"))
    seed = int(os.environ.get("HMA_FUZZ_SEED", "7"))
    models = tuple(os.environ.get("HMA_FUZZ_MODELS", "hybrid,one-group").split(","))
    modes = tuple(os.environ.get("HMA_FUZZ_MODES", "direct,tiering").split(","))
    results, errors = run(rounds, seed, models=models, modes=modes)
    table = summary(results, errors)
    print(table)
    assert not errors, "\n".join(errors)
    assert [r.line() for r in results if r.wrong] == [], table
    # The faults bit: some loads failed and were recomputed, and some rounds still hit.
    assert sum(r.loads_failed for r in results) > 0, table
    assert any(r.cached_tokens for r in results), table
    # Both modes were drawn, and the tiering mode's promotions brought KV from Redis.
    assert {r.mode for r in results} == set(modes), table
    assert any(r.cached_tokens for r in results if r.mode == "tiering"), table
