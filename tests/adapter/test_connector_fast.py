"""RedisOffloadingConnector's own logic in seconds: vLLM's real Scheduler and the connector's
worker half over CPU KV tensors, a real Redis, no model (tests/connector_harness.py).

The engine tests (test_faults.py) stay the end-to-end proof; these pin the connector's three
behaviours one by one: a failed load is recomputed, its chunks are forgotten (answered MISS) and
stored again, and the stores queued in the last step are flushed at shutdown.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import redis
from vllm.v1.request import Request, RequestStatus

from hma_redis.core import codec
from tests.support.connector_harness import BLOCK_SIZE, ConnectorHarness, StepRecord

NUM_BLOCKS = 5
PROMPT_LEN = NUM_BLOCKS * BLOCK_SIZE + 3  # five whole chunks and a tail


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(PROMPT_LEN)]


def _store_prompt(harness: ConnectorHarness, prompt: list[int]) -> list[str]:
    """Compute ``prompt`` on ``harness`` until its chunks are in Redis; their group-0 keys."""
    req = harness.add_request(prompt)
    harness.run()
    return [harness.redis_key(req, 0, block) for block in range(NUM_BLOCKS)]


def test_another_instance_loads_exactly_the_computed_pages(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """The harness itself: what one instance computed, another loads, byte for byte."""
    prompt = _prompt(1)
    keys = _store_prompt(instance(), prompt)
    assert redis_client.exists(*keys) == NUM_BLOCKS

    second = instance()
    req = second.add_request(prompt)
    steps = second.run()
    assert len(second.load_jobs_of[req.request_id]) == 1
    assert not any(step.failed_recving for step in steps)
    assert [bad for step in steps for bad in step.bad_pages] == []
    assert _computed(steps, req.request_id)[0] == PROMPT_LEN - NUM_BLOCKS * BLOCK_SIZE
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED


def _computed(steps: list[StepRecord], req_id: str) -> list[int]:
    """Tokens computed for ``req_id`` in each step that scheduled it."""
    return [step.scheduled[req_id] for step in steps if req_id in step.scheduled]


def _corrupt(client: redis.Redis, key: str) -> None:
    value = bytearray(client.get(key))
    value[-1] ^= 0xFF
    client.set(key, bytes(value))


def test_failed_load_is_recomputed_whole(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """A load that meets a corrupt chunk is reported failed, and vLLM recomputes the whole
    request (not the tail only, on top of blocks that were never written)."""
    prompt = _prompt(2)
    keys = _store_prompt(instance(), prompt)
    _corrupt(redis_client, keys[2])

    second = instance()
    req = second.add_request(prompt)
    steps = second.run()
    failed = [i for i, step in enumerate(steps) if req.request_id in step.failed_recving]
    assert failed, "the load of a corrupt chunk was not reported failed"
    failed_at = failed[0]
    assert _computed(steps[failed_at:], req.request_id)[0] == PROMPT_LEN
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert redis_client.exists(keys[2]) == 1  # dropped by the load, stored by the recompute


def test_failed_chunks_are_forgotten_not_loaded_again(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """After a failed load the manager answers MISS for its chunks, so the recompute does not
    walk back into the failure (one load job, not one per retry)."""
    prompt = _prompt(3)
    keys = _store_prompt(instance(), prompt)
    _corrupt(redis_client, keys[0])

    second = instance()
    req = second.add_request(prompt)
    second.run()
    assert len(second.load_jobs_of[req.request_id]) == 1
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_recompute_after_a_failed_load_stores_the_chunks_again(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """vLLM marks chunks it loads as offloaded; after a failed load the recompute must store
    them again, or the bad chunk (deleted by the load) would stay missing for everyone."""
    prompt = _prompt(4)
    keys = _store_prompt(instance(), prompt)
    _corrupt(redis_client, keys[1])

    second = instance()
    req = second.add_request(prompt)
    second.run()
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    value = redis_client.get(keys[1])
    assert value is not None
    codec.decode(value, expected_key=keys[1], expected_group=0)  # a valid value again

    third = instance()
    again = third.add_request(prompt)
    steps = third.run()
    assert not any(step.failed_recving for step in steps)
    assert [bad for step in steps for bad in step.bad_pages] == []
    assert _computed(steps, again.request_id)[0] == PROMPT_LEN - NUM_BLOCKS * BLOCK_SIZE


def test_shutdown_flushes_the_stores_queued_in_the_last_step(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """vLLM defers a step's stores to the next step; an engine that stops right after the step
    must still store them (the stock connector drops them)."""
    harness = instance()
    req = harness.add_request(_prompt(5))
    step = harness.step()
    while req.request_id not in step.scheduled:  # the lookup's round trip
        step = harness.step()
    # That was the prefill: the request finished, its stores are queued for the next step.
    assert req.is_finished() and step.store_jobs
    keys = [harness.redis_key(req, 0, block) for block in range(NUM_BLOCKS)]
    assert redis_client.exists(*keys) == 0
    harness.close()
    assert redis_client.exists(*keys) == NUM_BLOCKS


def test_failed_load_under_the_fail_policy_fails_only_that_request(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """``kv_load_failure_policy="fail"``: the request whose load failed ends in error, the
    engine (here: the scheduler loop) keeps serving the others."""
    prompt = _prompt(6)
    keys = _store_prompt(instance(), prompt)
    _corrupt(redis_client, keys[3])

    second = instance(kv_load_failure_policy="fail")
    broken = second.add_request(prompt)
    fine = second.add_request(_prompt(7))
    second.run()
    assert broken.status is RequestStatus.FINISHED_ERROR
    assert fine.status is RequestStatus.FINISHED_LENGTH_CAPPED


def _prefill(harness: ConnectorHarness, *reqs: Request) -> StepRecord:
    """Step until one step prefills all of ``reqs`` (after the lookups' round trip): its
    stores are then queued for the next step."""
    step = harness.step()
    while not any(req.request_id in step.scheduled for req in reqs):
        step = harness.step()
    assert all(req.request_id in step.scheduled for req in reqs), "not prefilled together"
    assert all(req.is_finished() for req in reqs)
    return step


def _keys(harness: ConnectorHarness, req: Request) -> list[str]:
    return [harness.redis_key(req, 0, block) for block in range(NUM_BLOCKS)]


def test_shutdown_flushes_each_queued_store_under_its_own_job_id(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """Two stores queued in the last step are both submitted at shutdown, each under the job
    id vLLM gave it: the worker flushes both (it tracks a job by its id) and reports exactly
    those jobs finished."""
    harness = instance()
    reqs = [harness.add_request(_prompt(seed)) for seed in (16, 17)]
    step = _prefill(harness, *reqs)
    assert len(step.store_jobs) == 2
    harness.close()
    for req in reqs:
        assert redis_client.exists(*_keys(harness, req)) == NUM_BLOCKS
    connector_worker = harness.worker.connector_worker
    assert connector_worker is not None and connector_worker.worker is not None
    finished = connector_worker.worker.get_finished()
    assert Counter(result.job_id for result in finished) == Counter(step.store_jobs.keys())
    assert all(result.success for result in finished)


def test_a_second_shutdown_submits_nothing(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """The exit hook calls shutdown again after vLLM's own call: the second call is a no-op.
    Even stores queued on the connector after the first (a last ``wait_for_save`` racing the
    engine's shutdown) are not sent from a worker that has closed."""
    harness = instance()
    req = harness.add_request(_prompt(18))
    step = _prefill(harness, req)
    harness.worker.shutdown()
    keys = _keys(harness, req)
    assert redis_client.exists(*keys) == NUM_BLOCKS
    redis_client.delete(*keys)

    harness.worker.bind_connector_metadata(step.output.kv_connector_metadata)
    harness.worker.wait_for_save()  # the step's stores, queued once more
    harness.worker.shutdown()
    assert redis_client.exists(*keys) == 0


def test_transfer_results_are_sets_in_every_step(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """``get_transfer_results`` returns what ``KVConnectorTransferResults`` promises, three
    sets, in steps that store, load or do neither: vLLM's model runner passes them on as they
    are, and its multi-worker aggregator unions them (``|=``), which ``None`` would break."""
    prompt = _prompt(19)
    first = instance()
    first.add_request(prompt)
    steps = first.run()
    second = instance()
    req = second.add_request(prompt)
    steps += second.run()
    assert any(step.store_jobs for step in steps)
    assert len(second.load_jobs_of[req.request_id]) == 1
    for step in steps:
        results = step.transfer_results
        assert isinstance(results.finished_sending, set), results
        assert isinstance(results.finished_recving, set), results
        assert isinstance(results.failed_recving, set), results
