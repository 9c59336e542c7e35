"""The multi-engine soak (tests/support/soak.py), bounded: three engines with the tier at once
on one Redis that evicts (small ``maxmemory``, ``allkeys-lru``), faults on a timer, every
request checked against an engine without the tier. ``HMA_SOAK_SECONDS`` / ``HMA_SOAK_SEED``
change the run; ``scripts/soak.sh --duration-s S`` runs longer ones.
"""

from __future__ import annotations

import os

import pytest

from tests.support.soak import SoakConfig, run, table

pytestmark = pytest.mark.engine


def test_soak_under_eviction_and_faults_is_exact_bounded_and_hits() -> None:
    cfg = SoakConfig(
        duration_s=float(os.environ.get("HMA_SOAK_SECONDS", "45")),
        seed=int(os.environ.get("HMA_SOAK_SEED", "1")),
        # Fewer faults than the default and fewer prompts, so that even on a slow host (a few
        # requests per engine) some prompt is served twice between two faults that wipe Redis.
        fault_every_s=8.0,
        hot_prompts=2,
        cold_prompts=40,
    )
    result = run(cfg)
    report = table(result)
    print(report)
    notes = [f"{s.name}: {n}" for s in result.served for n in s.notes[:3]]
    assert result.wrong == 0, "\n".join([report, *notes])
    assert result.errored == 0, "\n".join([report, *notes, *result.errors])
    # Redis evicted while the engines ran, and engines still loaded from it.
    assert result.evicted > 0, report
    assert result.hits > 0, report
    # Every tier engine logged its memory at shutdown, within its bound.
    assert result.memory_within_bound(), report
