"""vLLM's real Scheduler over TieringOffloadingSpec with the Redis tier (no model, no worker)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.support.scheduler_harness import SchedulerHarness, StepResult
from tests.support.tiering import TieringInstance, payloads, tiering_extra_config

BLOCK = 16
PROMPT_LEN = 12 * BLOCK + 5


@pytest.fixture
def scheduler(redis_url: str, model_dir: str) -> Iterator[SchedulerHarness]:
    harness = SchedulerHarness(
        redis_url,
        model_dir,
        extra_config=tiering_extra_config(redis_url),
    )
    yield harness
    harness.close()


def _prompt(seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 7) % 500 for i in range(PROMPT_LEN)]


def _cascade(
    writer: TieringInstance, h: SchedulerHarness, req: object, present: dict[int, Sequence[int]]
) -> dict[bytes, bytes]:
    """Another instance computed and cascaded these chunks of ``req`` (group -> chunks)."""
    keys = [h.offload_key(req, g, c) for g, chunks in present.items() for c in chunks]  # type: ignore[arg-type]
    data = payloads(len(keys), len(keys), writer.payload_bytes)
    writer.gpu_store(keys, data, writer.context())  # type: ignore[arg-type]
    writer.settle()
    return dict(zip(keys, data, strict=True))


def _run_until_scheduled(h: SchedulerHarness, req_id: str) -> list[StepResult]:
    steps = []
    for _ in range(200):
        steps.append(h.step())
        if req_id in steps[-1].scheduled:
            return steps
    raise AssertionError("request never scheduled")


@pytest.mark.parametrize(
    ("present", "expected_hit_chunks", "expected_loads"),
    [
        # g0 chunks 0..9, g2 only 0..5, g1 (window of 3) 3..5: the intersection is 6 chunks.
        (
            {0: range(10), 1: range(3, 6), 2: range(6)},
            6,
            {0: range(6), 1: range(3, 6), 2: range(6)},
        ),
        # g2 has nothing: no hit at all, whatever the other groups hold.
        ({0: range(12), 1: range(12)}, 0, {}),
    ],
    ids=["intersection-6", "group-without-hits"],
)
def test_scheduler_promotes_the_intersection_over_groups_byte_for_byte(
    scheduler: SchedulerHarness,
    instance: Callable[..., TieringInstance],
    present: dict[int, Sequence[int]],
    expected_hit_chunks: int,
    expected_loads: dict[int, Sequence[int]],
) -> None:
    h = scheduler
    req = h.add_request(_prompt(len(present) + expected_hit_chunks))
    stored = _cascade(instance(), h, req, present)

    steps = _run_until_scheduled(h, req.request_id)
    hit = PROMPT_LEN - steps[-1].scheduled[req.request_id]
    assert hit == expected_hit_chunks * BLOCK

    loads = [job for s in steps for job in s.load_jobs.values() if job.req_id == req.request_id]
    want = [h.offload_key(req, g, c) for g, chunks in expected_loads.items() for c in chunks]
    if not want:
        assert loads == []
        return
    (job,) = loads
    assert isinstance(job.src_spec, CPULoadStoreSpec)
    assert h.tiering is not None
    rows = np.asarray(h.tiering.primary_tier.get_kv_memoryview()).view(np.uint8)
    payload = len(next(iter(stored.values())))
    got = [rows[int(r), :payload].tobytes() for r in job.src_spec.block_ids]
    assert got == [stored[k] for k in want]
