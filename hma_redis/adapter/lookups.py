"""The scheduler's lookups, batched: one Redis round trip per step for every key asked.

In the shape of vLLM's ``vllm/v1/kv_offload/tiering/async_lookup.py``: vLLM asks key by key and
keeps scanning past RETRY, so :meth:`LookupBatcher.lookup` answers from recent answers or queues
the key and says "not yet"; :meth:`LookupBatcher.flush`, once per scheduler step, sends every
queued key to Redis in ONE call on a thread of its own; the next step's lookups find the
answers. Nothing on the per-key path ever waits for Redis.

With ``admission: second_sighting`` the same call sets each missing chunk's sighting marker
(:meth:`~hma_redis.core.redis.store.RedisBlockStore.exists_and_mark`): a chunk some lookup saw
before is answered missing but *admitted* (worth storing). Another request asking for a
first-sighting miss is a sighting of its own: it is answered at once from the cache and its
marker rides in the next batch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx

from hma_redis.adapter.stats import SchedulerStats
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore, Sighting

# An answer stays fresh until this many more scheduler steps have ended after its batch's,
# however slow they are: a request that waited a step for its lookup must find the answer.
FRESH_STEPS = 2


@dataclass
class Answer:
    """What Redis said of one chunk, and when."""

    present: bool
    fetched_at: float  # time.monotonic()
    fetched_step: int
    # second_sighting: the chunk is missing but some instance looked it up before (store it).
    admitted: bool = False
    # The request whose lookup fetched the answer (second_sighting: another request asking
    # for the same missing chunk is a sighting of its own).
    req_id: str = ""


class LookupBatcher:
    """Queues the keys vLLM asks about, sends one batch per step, keeps the answers.

    Every method runs on the scheduler's thread; only the batch itself runs on the
    ``hma-lookup`` thread, and at most one batch is in flight (keys asked meanwhile wait for
    the next). The cache holds at most ``max_answers`` answers (the oldest go first); an answer
    is fresh for ``answer_ttl_s`` seconds, and always for :data:`FRESH_STEPS` more steps. The
    store never raises for Redis' failures: a failed batch answers every key missing (and is
    counted as such). Each batch is counted once sent and once answered
    (:class:`~hma_redis.adapter.stats.SchedulerStats`).
    """

    def __init__(
        self,
        store: RedisBlockStore,
        keyspace: KeySpace,
        stats: SchedulerStats,
        *,
        answer_ttl_s: float,
        max_answers: int,
        wait_s: float,
        second_sighting: bool,
        admission_window_s: int,
    ) -> None:
        """``wait_s``: how long :meth:`flush` waits for its batch's answer. ``second_sighting``
        and ``admission_window_s`` (the markers' TTL): see
        :class:`~hma_redis.core.config.RedisTierConfig`'s ``admission``."""
        self._store = store
        self._keyspace = keyspace
        self._stats = stats
        self._answer_ttl_s = answer_ttl_s
        self._max_answers = max_answers
        self._wait_s = wait_s
        self._second_sighting = second_sighting
        self._admission_window_s = admission_window_s
        self._answers: OrderedDict[OffloadKey, Answer] = OrderedDict()
        self._step = 0
        # Keys asked about this step and not yet known (an ordered set).
        self._queued: dict[OffloadKey, None] = {}
        # second_sighting: keys answered from the cache whose sighting the next batch marks,
        # and which request asked for each queued key.
        self._resight: dict[OffloadKey, None] = {}
        self._asked_by: dict[OffloadKey, str] = {}
        self._inflight: Future[list[Sighting]] | None = None
        self._inflight_keys: list[OffloadKey] = []
        self._inflight_set: set[OffloadKey] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hma-lookup")
        # The lookups' thread and connection, started now: the first request's lookup would
        # otherwise wait for them (in_engine_timeline.py: 1-5 ms). Best effort, never waited on.
        self._executor.submit(self._store.warm_lookups)

    @property
    def answers(self) -> Mapping[OffloadKey, Answer]:
        """The cached answers, oldest first (read only)."""
        return self._answers

    def lookup(self, key: OffloadKey, req_id: str) -> Answer | None:
        """The fresh answer for ``key``, or None: not known yet, queued for the next batch
        (the caller answers RETRY). Never blocks, never a round trip.

        Takes in a finished batch's answers first. Under second_sighting, a cached
        first-sighting miss asked for by another request is answered and queued for marking.
        """
        self._absorb_finished_batch()
        answer = self._answers.get(key)
        if answer is not None and self.is_fresh(answer):
            if self._is_new_sighting(answer, req_id) and key not in self._inflight_set:
                self._resight[key] = None
            return answer
        if key not in self._inflight_set:
            self._queued[key] = None
            self._asked_by[key] = req_id
        return None

    def known(self, key: OffloadKey) -> Answer | None:
        """The cached answer for ``key``, fresh or not (a finished batch taken in first); None
        if there is none. Queues nothing."""
        self._absorb_finished_batch()
        return self._answers.get(key)

    def is_fresh(self, answer: Answer) -> bool:
        """Whether ``answer`` may still be given: no more than :data:`FRESH_STEPS` steps
        ended since its batch's, or at most ``answer_ttl_s`` seconds old."""
        return (
            self._step - answer.fetched_step <= FRESH_STEPS
            or time.monotonic() - answer.fetched_at <= self._answer_ttl_s
        )

    def flush(self) -> None:
        """The scheduler step ends: send every key queued in it (and every sighting to mark)
        in one round trip, unless a batch is still in flight (they wait for the next step).

        Waits up to ``wait_s`` for the answer so the next step usually has it; a slow or dead
        Redis never holds the scheduler longer than that."""
        self._step += 1
        self._absorb_finished_batch()
        if self._inflight is None and (self._queued or self._resight):
            self._start_batch()
        if self._inflight is None:
            return
        try:
            self._inflight.result(timeout=self._wait_s)
        except FutureTimeout:
            return
        self._absorb_finished_batch()

    def has_pending_work(self) -> bool:
        """Whether keys wait for a batch or a batch is in flight (vLLM keeps stepping)."""
        return bool(self._queued) or bool(self._resight) or self._inflight is not None

    def remember_missing(self, keys: Iterable[OffloadKey]) -> None:
        """Answer missing for ``keys`` until the answer ages out (a load found them missing or
        invalid), as if a batch had just said so."""
        now = time.monotonic()
        for key in keys:
            self._remember(key, False, now)

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """Drop the answers for ``keys``: the next lookup asks Redis again."""
        for key in keys:
            self._answers.pop(key, None)

    def forget_all(self) -> None:
        """Drop every cached answer (a batch in flight still lands)."""
        self._answers.clear()

    def shutdown(self) -> None:
        """Stop the lookups' thread without waiting for a batch in flight (Redis may hang)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the batch

    def _is_new_sighting(self, answer: Answer, req_id: str) -> bool:
        """second_sighting: a cached first-sighting miss asked for by another request."""
        return (
            self._second_sighting
            and not answer.present
            and not answer.admitted
            and answer.req_id != req_id
        )

    def _start_batch(self) -> None:
        keys = [k for k in self._queued if not self._known_fresh(k)]
        keys += [k for k in self._resight if k not in self._queued]
        self._queued.clear()
        self._resight.clear()
        self._asked_by = {k: self._asked_by[k] for k in keys if k in self._asked_by}
        if not keys:
            return
        self._inflight_keys = keys
        self._inflight_set = set(keys)
        self._stats.lookup_batch_sent(len(keys))
        self._inflight = self._executor.submit(self._resolve, keys)

    def _resolve(self, keys: list[OffloadKey]) -> list[Sighting]:
        """The batch's one round trip (the lookups' thread)."""
        ranks = self._keyspace.world_size
        redis_keys = [
            rk
            for k in keys
            for rk in self._keyspace.block_keys_all_ranks(
                get_offload_group_idx(k), get_offload_block_hash(k)
            )
        ]
        if self._second_sighting:
            chunks = [redis_keys[i * ranks : (i + 1) * ranks] for i in range(len(keys))]
            markers = [
                self._keyspace.sighting_key(get_offload_group_idx(k), get_offload_block_hash(k))
                for k in keys
            ]
            sightings = self._store.exists_and_mark(chunks, markers, self._admission_window_s)
        else:
            found = self._store.exists(redis_keys)
            # A chunk is a hit only when every rank's shard is there.
            sightings = [
                Sighting.PRESENT if all(found[i * ranks : (i + 1) * ranks]) else Sighting.FIRST
                for i in range(len(keys))
            ]
        self._stats.lookup_batch_answered(len(keys), sum(s is Sighting.PRESENT for s in sightings))
        return sightings

    def _absorb_finished_batch(self) -> None:
        future = self._inflight
        if future is None or not future.done():
            return
        self._inflight = None
        sightings = future.result()  # the store never raises: failures are misses
        now = time.monotonic()
        for key, sighting in zip(self._inflight_keys, sightings, strict=True):
            self._remember(
                key,
                sighting is Sighting.PRESENT,
                now,
                admitted=sighting is Sighting.AGAIN,
                req_id=self._asked_by.pop(key, ""),
            )
        self._inflight_keys = []
        self._inflight_set = set()

    def _known_fresh(self, key: OffloadKey) -> bool:
        answer = self._answers.get(key)
        return answer is not None and self.is_fresh(answer)

    def _remember(
        self, key: OffloadKey, present: bool, now: float, admitted: bool = False, req_id: str = ""
    ) -> None:
        self._answers[key] = Answer(present, now, self._step, admitted, req_id)
        self._answers.move_to_end(key)
        while len(self._answers) > self._max_answers:
            self._answers.popitem(last=False)
