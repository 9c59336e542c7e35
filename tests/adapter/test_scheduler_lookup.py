"""Scheduler-level tests: a REAL vLLM Scheduler + RedisOffloadingConnector + hma_redis spec.

Nothing is mocked: vLLM's scheduler asks the hma_redis manager about offload keys, the manager
asks a real Redis (conftest's session server, flushed per test). Tests put chunks in Redis by
writing their keys (lookups only check existence) and check what the scheduler decides.

Layout (tests/scheduler_harness.py): GPU block = 16 tokens, one block per chunk, three KV cache
groups: g0 full attention, g1 sliding window of 3 blocks (48 tokens), g2 full attention.

The numbers below follow vLLM 0.32's offloading scheduler
(``OffloadingConnectorScheduler._lookup_complete_chunks``):

- Only full blocks have hashes, so a prompt of ``n`` tokens has ``n // 16`` chunks per group.
- With a sliding-window group present, the last prompt token is always recomputed: the hit is
  capped at ``n - 1`` tokens (then at the number of whole chunks).
- Full-attention groups: the longest prefix of present chunks.
- Sliding-window groups: scanning back from the cap, the last run of ``window`` consecutive
  present chunks (3 for g1); the hit ends where that run ends. Older chunks are not needed.
- The request's hit is the minimum over groups (re-checked until stable).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.request import Request, RequestStatus

from hma_redis.adapter.spec import CONNECTOR_CONFIG
from tests.support.redis_server import LocalRedis, command_calls, command_delta
from tests.support.scheduler_harness import (
    SchedulerHarness,
    StepResult,
    worker_spec,
)

BLOCK = 16
WINDOW_CHUNKS = 3  # g1's sliding window: 48 tokens = 3 chunks of 16
PROMPT_LEN = 12 * BLOCK + 5  # 197 tokens: 12 full chunks (0..11) + a 5-token tail
ALL_CHUNKS = range(12)

_prompt_seeds = itertools.count(1)


def prompt(num_tokens: int = PROMPT_LEN) -> list[int]:
    """A prompt unlike any other (no shared first block, so no shared block hashes), with
    tokens in the tiny vocab's range."""
    rng = random.Random(next(_prompt_seeds))
    return [rng.randrange(4, 500) for _ in range(num_tokens)]


# The scheduler-side lookup logic is vLLM's OffloadingConnector's; hma_redis' subclass only adds
# failed-load handling and a flushing shutdown (the spec refuses the stock connector).


@pytest.fixture
def make_harness(
    redis_url: str, redis_client: redis.Redis, model_dir: str
) -> Iterator[Callable[..., SchedulerHarness]]:
    """Build harnesses on the session Redis (flushed by ``redis_client``); closed at teardown."""
    made: list[SchedulerHarness] = []

    def make(**kwargs: object) -> SchedulerHarness:
        kwargs.setdefault("redis_url", redis_url)
        kwargs.setdefault("counter", redis_client)
        h = SchedulerHarness(model_dir=model_dir, **kwargs)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def harness(make_harness: Callable[..., SchedulerHarness]) -> SchedulerHarness:
    return make_harness()


def put(
    h: SchedulerHarness,
    client: redis.Redis,
    req: Request,
    chunks_by_group: dict[int, Sequence[int]],
) -> None:
    for group, chunks in chunks_by_group.items():
        h.put_chunks(client, req, group, chunks)


def scheduled_computed_tokens(step: StepResult, req: Request) -> int:
    """num_computed_tokens the scheduler handed the worker when it scheduled ``req``."""
    out = step.output
    for new in out.scheduled_new_reqs:
        if new.req_id == req.request_id:
            return new.num_computed_tokens
    cached = out.scheduled_cached_reqs
    for req_id, num in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        if req_id == req.request_id:
            return num
    raise AssertionError(f"{req.request_id} not scheduled in this step")


# Server-side commands that each mean one lookup batch (the store sends one EVAL per batch).
BATCH_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def round_trips(step: StepResult) -> int:
    """Lookup batches the Redis server ran during ``step``."""
    return sum(step.redis_calls.get(name, 0) for name in BATCH_COMMANDS)


def assert_first_step_waits(step: StepResult, req: Request) -> None:
    """Right after step 1: every key is unknown, the manager answered RETRY, vLLM keeps the
    request waiting (not failed, not scheduled)."""
    assert req.request_id not in step.scheduled
    assert not step.load_jobs
    assert req.status == RequestStatus.WAITING
    assert req.num_computed_tokens == 0
    assert not step.output.finished_req_ids


def run_to_hit(h: SchedulerHarness, req: Request) -> tuple[int, list[bytes], list[StepResult]]:
    """Drive ``req`` until it is scheduled; return (external hit tokens, loaded keys, steps).

    A hit shows as a load job (request parked in WAITING_FOR_REMOTE_KVS), reported finished by
    the harness, then the request is scheduled from the hit point. No hit: scheduled from 0.
    """
    first = h.step()
    assert_first_step_waits(first, req)
    steps = [first, *h.run_until_scheduled(req)]
    loads = [s for s in steps if s.load_keys(req.request_id)]
    assert len(loads) <= 1, "more than one load job for one request"
    keys = loads[0].load_keys(req.request_id) if loads else []
    hit = scheduled_computed_tokens(steps[-1], req)
    assert steps[-1].scheduled[req.request_id] == req.num_prompt_tokens - hit
    if hit:
        assert keys, "tokens counted as computed without a load job"
    return hit, keys, steps


def keys_of(
    h: SchedulerHarness, req: Request, chunks_by_group: dict[int, Sequence[int]]
) -> list[bytes]:
    """Offload keys in vLLM's load order: group by group, chunk by chunk."""
    return [
        h.offload_key(req, group, chunk)
        for group in sorted(chunks_by_group)
        for chunk in chunks_by_group[group]
    ]


# --------------------------------------------------------------------------- 1. intersection


INTERSECTION_CASES = {
    # g0 has chunks 0..9 (prefix 160 tokens), g2 only 0..5 (96), g1 only the window just before
    # chunk 6 (chunks 3, 4, 5). Minimum over groups: 6 chunks = 96 tokens; g1's window before 96
    # is exactly 3..5, so it agrees. Loads: g0 0..5, g1 3..5 (earlier window blocks are not
    # needed by any token >= 96), g2 0..5.
    "full10-third6-window-before-6": (
        PROMPT_LEN,
        {0: range(10), 1: range(3, 6), 2: range(6)},
        6 * BLOCK,
        {0: range(6), 1: range(3, 6), 2: range(6)},
    ),
    # The sliding-window group sets the hit point: g0 and g2 hold 0..9, g1 only 4..6 (nothing
    # at 7..9). Scanning back from chunk 9, the last run of 3 present chunks ends after chunk 6:
    # hit = 7 chunks = 112 tokens.
    "window-decides-7": (
        PROMPT_LEN,
        {0: range(10), 1: range(4, 7), 2: range(10)},
        7 * BLOCK,
        {0: range(7), 1: range(4, 7), 2: range(7)},
    ),
    # A run shorter than the window does not count: g1 has 2..4 and 7..8 (a run of 2). The last
    # run of 3 ends after chunk 4: hit = 5 chunks = 80 tokens.
    "short-run-skipped": (
        PROMPT_LEN,
        {0: ALL_CHUNKS, 1: [2, 3, 4, 7, 8], 2: ALL_CHUNKS},
        5 * BLOCK,
        {0: range(5), 1: range(2, 5), 2: range(5)},
    ),
    # Last prompt token recomputed: a 192-token prompt (exactly 12 chunks) with every chunk of
    # every group present hits 191 tokens, not 192. All 12 chunks of the full groups are loaded
    # (the 12th only partly used); g1 loads the window of the token at 191 (chunks 9..11).
    "aligned-prompt-minus-one": (
        12 * BLOCK,
        {0: ALL_CHUNKS, 1: ALL_CHUNKS, 2: ALL_CHUNKS},
        12 * BLOCK - 1,
        {0: ALL_CHUNKS, 1: range(9, 12), 2: ALL_CHUNKS},
    ),
}


@pytest.mark.parametrize(
    ("prompt_len", "present", "expected_hit", "expected_loads"),
    list(INTERSECTION_CASES.values()),
    ids=list(INTERSECTION_CASES),
)
def test_hit_is_intersection_over_groups(
    harness: SchedulerHarness,
    redis_client: redis.Redis,
    prompt_len: int,
    present: dict[int, Sequence[int]],
    expected_hit: int,
    expected_loads: dict[int, Sequence[int]],
) -> None:
    req = harness.add_request(prompt(prompt_len))
    put(harness, redis_client, req, present)

    hit, loaded, _ = run_to_hit(harness, req)

    assert hit == expected_hit
    assert loaded == keys_of(harness, req, expected_loads)
    # Every chunk the scheduler asked the workers to load is really in Redis.
    for group, chunks in expected_loads.items():
        for chunk in chunks:
            assert redis_client.exists(harness.redis_key(req, group, chunk))


# --------------------------------------------------------------------------- 2. zero hits


@pytest.mark.parametrize("empty_group", [0, 1, 2, None], ids=["g0", "g1-window", "g2", "all"])
def test_group_without_hits_gives_zero(
    harness: SchedulerHarness, redis_client: redis.Redis, empty_group: int | None
) -> None:
    req = harness.add_request(prompt())
    if empty_group is not None:
        put(harness, redis_client, req, {g: ALL_CHUNKS for g in range(3) if g != empty_group})

    hit, loaded, steps = run_to_hit(harness, req)

    # Full groups miss at chunk 0; the window group finds no run of 3: no hit at all, and the
    # request is scheduled from token 0 right after the lookup answer (step 2), nothing loaded.
    assert hit == 0
    assert loaded == []
    assert len(steps) == 2
    assert steps[-1].scheduled[req.request_id] == PROMPT_LEN


# --------------------------------------------------------------------------- 3. window only


@pytest.mark.parametrize("third_group", ["full", "sliding"])
def test_sliding_window_needs_only_the_window_before_the_hit(
    make_harness: Callable[..., SchedulerHarness],
    redis_client: redis.Redis,
    third_group: str,
) -> None:
    h = make_harness(third_group=third_group)
    req = h.add_request(prompt())
    # Full groups: everything. g1 (window 3): only chunks 9..11, the window just before the
    # full hit point (12 chunks = 192 tokens, all of the prompt's whole chunks); 0..8 absent.
    # With third_group="sliding", g2 is a 2-chunk window: only chunks 10..11.
    present: dict[int, Sequence[int]] = {0: ALL_CHUNKS, 1: range(9, 12)}
    present[2] = ALL_CHUNKS if third_group == "full" else range(10, 12)
    put(h, redis_client, req, present)

    hit, loaded, _ = run_to_hit(h, req)

    assert hit == 12 * BLOCK  # the full hit length: only the 5-token tail is computed
    assert loaded == keys_of(h, req, present)
    assert h.offload_key(req, 1, 0) not in loaded


# --------------------------------------------------------------------------- 4. waiting


def test_request_waits_while_lookup_in_flight(
    harness: SchedulerHarness, redis_client: redis.Redis
) -> None:
    req = harness.add_request(prompt())
    put(harness, redis_client, req, {0: range(10), 1: range(3, 6), 2: range(6)})

    first = harness.step(expect_calls=True)

    # Not scheduled, not failed, still owned by the scheduler; its lookups went out in one batch.
    assert_first_step_waits(first, req)
    assert harness.scheduler.get_num_unfinished_requests() == 1
    assert req.request_id in harness.scheduler.requests
    assert round_trips(first) == 1, first.redis_calls

    # Next step: answers are in; the scheduler issues the load of 6 chunks and parks the request.
    second = harness.step()
    assert req.request_id not in second.scheduled
    assert len(second.load_keys(req.request_id)) == 6 + WINDOW_CHUNKS + 6
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == 6 * BLOCK
    assert round_trips(second) == 0, second.redis_calls

    # The load is reported finished; the request runs from token 96.
    third = harness.step()
    assert third.scheduled == {req.request_id: PROMPT_LEN - 6 * BLOCK}
    assert scheduled_computed_tokens(third, req) == 6 * BLOCK
    assert req.status == RequestStatus.RUNNING


def test_request_waits_while_redis_is_stalled(local_redis: LocalRedis, model_dir: str) -> None:
    """A Redis that does not answer (SIGSTOP) keeps the request waiting, steps stay fast, and
    it is scheduled with its hit once Redis answers again."""
    client = redis.Redis.from_url(local_redis.url)
    h = SchedulerHarness(local_redis.url, model_dir, counter=client)
    try:
        req = h.add_request(prompt())
        put(h, client, req, {0: range(10), 1: range(3, 6), 2: range(6)})

        h.counter = None  # INFO would block on a stopped server
        local_redis.pause()
        try:
            stalled = [h.step() for _ in range(5)]
        finally:
            local_redis.resume()
        h.counter = client

        for step in stalled:
            assert req.request_id not in step.scheduled
            assert not step.load_jobs
            assert not step.output.finished_req_ids
            # The manager waits at most a few ms for Redis inside a step.
            assert step.elapsed_s < 0.5, step.elapsed_s
        assert req.status == RequestStatus.WAITING
        assert h.scheduler.get_num_unfinished_requests() == 1
        assert h.manager.has_pending_work()  # the batch is still out

        steps = h.run_until_scheduled(req, max_steps=20)
        assert scheduled_computed_tokens(steps[-1], req) == 6 * BLOCK
        assert sum(len(s.load_keys(req.request_id)) for s in steps) == 6 + WINDOW_CHUNKS + 6
        for step in steps:
            assert round_trips(step) <= 1, step.redis_calls
    finally:
        h.close()
        client.close()


# --------------------------------------------------------------------------- 5. one round trip


def test_one_redis_round_trip_per_step_for_all_lookups(
    harness: SchedulerHarness, redis_client: redis.Redis
) -> None:
    # Three waiting requests (12, 6 and 9 whole chunks), different hit patterns.
    a = harness.add_request(prompt(PROMPT_LEN))
    b = harness.add_request(prompt(6 * BLOCK + 4))
    c = harness.add_request(prompt(9 * BLOCK + 1))
    put(harness, redis_client, a, {0: range(10), 1: range(3, 6), 2: range(6)})
    put(harness, redis_client, c, {0: range(9), 1: range(6, 9), 2: range(9)})
    # b: nothing in Redis.

    first = harness.step(expect_calls=True)

    # Step 1: every key of every group of every request is unknown. vLLM keeps scanning past
    # RETRY, so the manager sees all of them: 3 groups x (12 + 6 + 9) chunks = 81 keys, all in
    # ONE EVAL (its EXISTS calls show in commandstats too).
    for req in (a, b, c):
        assert_first_step_waits(first, req)
    assert round_trips(first) == 1, first.redis_calls
    assert first.redis_calls.get("exists") == 3 * (12 + 6 + 9), first.redis_calls

    # Step 2: all three decided from the cached answers, without any Redis command.
    second = harness.step()
    assert round_trips(second) == 0 and "exists" not in second.redis_calls, second.redis_calls
    assert len(second.load_keys(a.request_id)) == 6 + WINDOW_CHUNKS + 6  # a: hit 96 tokens
    assert second.scheduled.get(b.request_id) == b.num_prompt_tokens  # b: no hit
    # c: 9 chunks everywhere, 145 tokens: the cap is 144 tokens -> full hit of 9 chunks.
    assert len(second.load_keys(c.request_id)) == 9 + WINDOW_CHUNKS + 9

    third = harness.step()
    assert scheduled_computed_tokens(third, a) == 6 * BLOCK
    assert scheduled_computed_tokens(third, c) == 9 * BLOCK
    assert round_trips(third) == 0 and "exists" not in third.redis_calls, third.redis_calls

    # New requests arriving later get their own single batch in the step that queues them.
    d = harness.add_request(prompt())
    e = harness.add_request(prompt())
    put(harness, redis_client, d, {0: ALL_CHUNKS, 1: range(9, 12), 2: ALL_CHUNKS})
    fourth = harness.step(expect_calls=True)
    assert round_trips(fourth) == 1, fourth.redis_calls
    assert fourth.redis_calls.get("exists") == 2 * 3 * 12, fourth.redis_calls
    fifth = harness.step()
    assert round_trips(fifth) == 0, fifth.redis_calls
    assert len(fifth.load_keys(d.request_id)) == 12 + WINDOW_CHUNKS + 12
    assert fifth.scheduled.get(e.request_id) == PROMPT_LEN
    assert harness.manager.stats.lookup_round_trips == 2


def test_eval_count_matches_manager_round_trips(
    harness: SchedulerHarness, redis_client: redis.Redis
) -> None:
    """The server-side count and the manager's own count agree over a longer run."""
    before = command_calls(redis_client)
    reqs = [harness.add_request(prompt(n * BLOCK + 3)) for n in (4, 7, 12)]
    for req in reqs:
        put(harness, redis_client, req, {0: range(3), 1: range(3), 2: range(3)})
    for req in reqs:
        harness.run_until_scheduled(req)
    # Let a few decode steps run too: they need no lookups.
    for _ in range(3):
        harness.step()
    time.sleep(0.05)
    delta = command_delta(before, command_calls(redis_client))
    assert delta.get("eval") == harness.manager.stats.lookup_round_trips == 1, delta


# --------------------------------------------------------------------------- chunk size


def test_two_blocks_per_chunk(
    make_harness: Callable[..., SchedulerHarness], redis_client: redis.Redis
) -> None:
    """Chunks of 2 blocks (32 tokens): keys use each chunk's last block hash; g1's 48-token
    window spans 2 chunks. 197 tokens = 6 whole chunks; g0 holds 0..4, g2 0..2, g1 only 1..2
    (the 2-chunk window before chunk 3): hit = 3 chunks = 96 tokens. g1 loads chunks 1..2."""
    h = make_harness(blocks_per_chunk=2)
    req = h.add_request(prompt())
    put(h, redis_client, req, {0: range(5), 1: range(1, 3), 2: range(3)})

    hit, loaded, _ = run_to_hit(h, req)

    assert hit == 3 * 2 * BLOCK
    assert loaded == keys_of(h, req, {0: range(3), 1: range(1, 3), 2: range(3)})


# --------------------------------------------------------------------------- namespace


@pytest.mark.parametrize("hash_algo", ["sha256", "sha256_cbor", "xxhash"])
def test_scheduler_reads_the_namespace_workers_write(
    redis_url: str,
    model_dir: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    hash_algo: str,
) -> None:
    """Chunks written under the key space a worker's spec computes are hits for the scheduler,
    whatever ``prefix_caching_hash_algo`` is.

    vLLM builds the worker-side spec inside ``set_current_vllm_config`` but EngineCore builds the
    Scheduler (and so the scheduler-side spec) outside it. Both sides must still agree on the
    namespace, or every chunk a worker stores is invisible to the scheduler (0 % hits).
    """
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # xxhash needs a fixed seed to be shareable
    h = SchedulerHarness(
        model_dir=model_dir, redis_url=redis_url, counter=redis_client, hash_algo=hash_algo
    )
    req = h.add_request(prompt())
    put(h, redis_client, req, {0: ALL_CHUNKS, 1: range(9, 12), 2: ALL_CHUNKS})

    hit, _, _ = run_to_hit(h, req)

    assert hit == 12 * BLOCK, (
        f"scheduler found no chunk stored under the workers' namespace {h.keyspace.namespace} "
        f"(hash algo {hash_algo})"
    )
    h.close()


# --------------------------------------------------------------------------- connector guard


def test_stock_offloading_connector_is_refused(redis_url: str, model_dir: str) -> None:
    """vLLM's stock OffloadingConnector cannot turn a failed load into a recompute (it would
    serve the stale blocks): the spec refuses to start under it, with one line naming the
    connector to use."""
    with pytest.raises(ValueError) as refused:
        SchedulerHarness(
            redis_url, model_dir, kv_connector="OffloadingConnector", kv_connector_module_path=None
        )
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("hma_redis: RedisOffloadingSpec needs RedisOffloadingConnector")
    assert CONNECTOR_CONFIG in message


# --------------------------------------------------------------------------- reset


def test_reset_prefix_cache_mid_store_does_not_hang_the_next_request(
    harness: SchedulerHarness,
) -> None:
    """vLLM drops in-flight jobs on reset_prefix_cache and never completes their stores; the
    manager must not answer HIT_PENDING for their chunks for ever."""
    tokens = prompt(4 * BLOCK + 3)
    first = harness.add_request(tokens, max_tokens=2)
    harness.run_until(
        lambda _: first.is_finished() and bool(harness.held_store_jobs),
        max_steps=20,
        complete_stores=False,
    )
    probe = ReqContext(req_id="probe")
    stored_key = harness.offload_key(first, 0, 0)
    assert harness.manager.lookup(stored_key, probe) is LookupResult.HIT_PENDING  # in flight

    assert harness.scheduler.reset_prefix_cache(reset_connector=True)

    again = harness.add_request(tokens, max_tokens=2)
    steps = harness.run_until_scheduled(again, max_steps=10)
    # Nothing reached Redis (the harness transfers nothing): the request runs from token 0.
    assert scheduled_computed_tokens(steps[-1], again) == 0


# --------------------------------------------------------------------------- failure policy


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize(("policy", "warnings"), [("fail", 1), ("recompute", 0)])
def test_fail_policy_warns_once_at_start_up(
    make_harness: Callable[..., SchedulerHarness], policy: str, warnings: int
) -> None:
    """vLLM's default kv_load_failure_policy "fail" turns an eviction between lookup and load
    into a failed request: say so once at start-up, and how to choose "recompute"."""
    records = _Records()
    # hma_redis' loggers may not propagate (they use vLLM's handlers): listen on ours.
    logger = logging.getLogger("hma_redis")
    logger.addHandler(records)
    try:
        h = make_harness(kv_load_failure_policy=policy)
        worker_spec(h.vllm_config, h.kv_cache_config)  # a worker's spec says nothing
    finally:
        logger.removeHandler(records)
    found = [
        r.getMessage()
        for r in records.records
        if r.levelno == logging.WARNING and "kv_load_failure_policy" in r.getMessage()
    ]
    assert len(found) == warnings, found
    if found:
        assert '"recompute"' in found[0] and "fails the user's request" in found[0]
