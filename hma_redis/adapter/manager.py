"""Scheduler side: answers vLLM's per-key lookups without a Redis round trip per key.

vLLM's offloading scheduler asks ``lookup(key)`` key by key, group by group, and keeps scanning
past RETRY. The manager answers from a small cache of recent Redis answers; an unknown key is
queued and answered RETRY. At the end of the step (``on_schedule_end``) every queued key of every
group and every waiting request goes to Redis in ONE round trip (one EVAL); the next step's
lookups find the answers. The request simply waits a step, it never fails. The batching is
:class:`~hma_redis.adapter.lookups.LookupBatcher`'s; every count the manager keeps is
:class:`~hma_redis.adapter.stats.SchedulerStats`'.

Three more duties ride on the same calls, never on a round trip of their own:

* removals (with vLLM's KV events on): a :class:`~hma_redis.core.redis.notifications.RemovalWatcher`
  queues the block keys Redis evicted, expired or deleted; each step the manager drains it,
  forgets its answers for them and emits ``OffloadingEvent(removed=True)`` for the chunk in
  every KV group (a chunk one group lost is no usable hit in any);
* the intersection's cost: per request, how far each group's hits reach and how far all of
  them do (vLLM can use only the latter), counted per group when the request finishes;
* admission (``admission: second_sighting``): the lookup round trip also sets a sighting
  marker per missing chunk, and only a chunk seen before is stored.

Pins (a request's ``kv_transfer_params`` ``{"hma_redis_pin_s": N}``, with the option
``pinning`` on): every chunk of the request's prefix, the ones it hit and the ones it stored, is
kept from eviction for N seconds, at most ``pin_max_s``, while the namespace's pins hold at most
``pin_budget_bytes`` (:mod:`hma_redis.core.redis.pins`). Any API client can send
``kv_transfer_params``, so every pin refused, shortened or left over the budget is counted. The
manager only queues the chunks; a :class:`~hma_redis.core.redis.pins.PinKeeper` pins them,
and sweeps ended pins, on its own thread.

Quotas (option ``tenant_quotas``): a request's tenant is its ``cache_salt``, named by
:func:`~hma_redis.core.tenants.tenant_id` (the connector tells the manager the salt). While a
tenant holds its budget, :meth:`prepare_store` stores none of its chunks (counted per tenant):
they are recomputed when needed, nothing else changes. A
:class:`~hma_redis.core.redis.quotas.QuotaKeeper` reads the tenants' bytes and budgets, applies
removals to the account and reconciles it, on its own thread; the workers count what they store.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

from hma_redis.adapter.lookups import Answer, LookupBatcher
from hma_redis.adapter.metrics import ManagerDetailStats
from hma_redis.adapter.stats import GroupReach, SchedulerStats
from hma_redis.adapter.types import ManagerStats, RedisLoadStoreSpec
from hma_redis.core.codec import FORMAT_VERSION
from hma_redis.core.keys import KeySpace, parse_block_key
from hma_redis.core.redis.breaker import BreakerState, RateLimitedLog
from hma_redis.core.redis.memory import MEMORY_POLL_INTERVAL_S, MemoryPoller
from hma_redis.core.redis.notifications import RemovalWatcher
from hma_redis.core.redis.pins import (
    PIN_PARAM,
    PIN_SWEEP_INTERVAL_S,
    PinKeeper,
    PinResult,
    SweepResult,
    parse_pin_seconds,
)
from hma_redis.core.redis.quotas import QuotaKeeper
from hma_redis.core.redis.store import REFUSAL_LOG_INTERVAL_S, RedisBlockStore
from hma_redis.core.tenants import tenant_id

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

logger = init_logger(__name__)

# Removed keys one step handles at most; more waiting is an overflow (every cached answer is
# forgotten), so a flood of removals never holds a scheduler step for long.
MAX_REMOVALS_PER_STEP = 2048

# Salts noted for requests vLLM has not handed the manager yet, at most (each is taken at once
# by on_new_request; a bound all the same).
MAX_NOTED_SALTS = 4096

# Labels of vLLM's vllm:kv_offload_config_info metric (0.33+), filled by config_info().
CONFIG_INFO_KEYS = ("key_prefix", "namespace", "redis_url", "format_version")


class _RequestHits:
    """The last answer given to one request for each of its keys, by group and end token
    (vLLM records each key's end token in the request context)."""

    def __init__(self) -> None:
        self.by_group: dict[int, dict[int, bool]] = {}

    def record(self, group: int, end_token: int, hit: bool) -> None:
        self.by_group.setdefault(group, {})[end_token] = hit

    def reach(self, group: int) -> int:
        """How far ``group``'s hits reach, in tokens: the last hit before the first miss.

        This is what vLLM's scans find: a prefix scan (full attention) stops at the first
        miss, a window scan (sliding window) walks back from the end to the window below it.
        """
        answers = self.by_group.get(group, {})
        first_miss = min((p for p, hit in answers.items() if not hit), default=None)
        return max(
            (p for p, hit in answers.items() if hit and (first_miss is None or p < first_miss)),
            default=0,
        )


@dataclass(frozen=True)
class _PinRequest:
    """A request's pin (kept in its ``ReqContext`` state): its chunks stay until ``deadline``
    (unix seconds)."""

    deadline: float


@dataclass(frozen=True)
class _Tenant:
    """A request's tenant id (kept in its ``ReqContext`` state, with ``tenant_quotas``)."""

    tenant: str


@dataclass
class _StoreMark:
    """Stores of one key this instance has in flight, and since when."""

    count: int
    since: float


class RedisOffloadingManager(OffloadingManager):
    """Tracks what is in Redis for the scheduler, with bounded memory.

    Answers are cached for ``answer_ttl_s`` seconds, and always for at least two scheduler steps
    so a request that waited for its lookup finds the answer even when steps are slow.
    A chunk this instance is storing answers HIT_PENDING until vLLM completes the store, for at
    most ``store_pending_timeout_s`` (vLLM drops jobs, e.g. on ``reset_prefix_cache``, and never
    completes them; a request must never wait on such a store for ever).
    """

    def __init__(
        self,
        store: RedisBlockStore,
        keyspace: KeySpace,
        *,
        answer_ttl_s: float = 2.0,
        max_answers: int = 200_000,
        lookup_wait_s: float = 0.005,
        emit_events: bool = False,
        store_pending_timeout_s: float = 30.0,
        removals: RemovalWatcher | None = None,
        group_chunk_tokens: tuple[int, ...] = (),
        admission: str = "always",
        admission_window_s: int = 3600,
        memory_poll_interval_s: float = MEMORY_POLL_INTERVAL_S,
        pin_sweep_interval_s: float = PIN_SWEEP_INTERVAL_S,
        loads: bool = True,
        quotas: QuotaKeeper | None = None,
    ) -> None:
        """``removals``: a started watcher of this namespace's block keys (its removals become
        events when ``emit_events``, and always forget cached answers); the manager closes it.
        ``group_chunk_tokens``: tokens per chunk of each KV group, in group order (removals
        fan out to every group; the intersection is counted per group). ``admission`` and
        ``admission_window_s``: see :class:`~hma_redis.core.config.RedisTierConfig`.
        ``memory_poll_interval_s``: Redis' memory figures (gauges) are asked at most this
        often, on a thread of their own, only when vLLM collects stats.
        ``pin_sweep_interval_s``: ended pins get their TTL back at most this often (only with
        the store's ``ttl_s`` set: pinning needs it). Whether requests may pin, for how long
        and how many bytes: the store's config (``pinning``, ``pin_max_s``,
        ``pin_budget_bytes``). ``loads`` False: every lookup is a miss, asked of nobody (an
        engine that cannot resume from cached KV); stores go on. ``quotas``: the tenants'
        bytes and budgets (option ``tenant_quotas``; the manager closes it); None: no
        quotas, every request is stored as if it had no tenant."""
        self._store = store
        self._keyspace = keyspace
        self._loads = loads
        self._emit_events = emit_events
        self._store_pending_timeout_s = store_pending_timeout_s
        self._stats = SchedulerStats(store.counters)
        self._lookups = LookupBatcher(
            store,
            keyspace,
            self._stats,
            answer_ttl_s=answer_ttl_s,
            max_answers=max_answers,
            wait_s=lookup_wait_s,
            second_sighting=admission == "second_sighting",
            admission_window_s=admission_window_s,
        )
        self._storing: dict[OffloadKey, _StoreMark] = {}
        self._warned_stale_store = False
        # Keys each request is loading, so a failed load can be forgotten.
        self._loading: dict[str, list[OffloadKey]] = {}
        self._events: list[OffloadingEvent] = []
        self._removals = removals
        self._group_chunk_tokens = group_chunk_tokens
        self._second_sighting = admission == "second_sighting"
        self._request_hits: dict[str, _RequestHits] = {}
        self._memory = MemoryPoller(self._store.memory, memory_poll_interval_s)
        self._ttl_s = store.cfg.ttl_s
        self._pins = PinKeeper(self._pin, self._sweep, pin_sweep_interval_s)
        # Chunks a pinned request waits for a store of (its own or another's): pinned once
        # the store lands, with the latest deadline asked for.
        self._pin_after_store: dict[OffloadKey, float] = {}
        # Pins refused or over the budget repeat with every request that asks: one line per
        # kind and interval.
        self._pin_log = RateLimitedLog(REFUSAL_LOG_INTERVAL_S)
        self._quotas = quotas
        self._salts: dict[str, str | None] = {}
        self._reported_refreshes = 0

    # ------------------------------------------------------------------ lookups

    @property
    def stats(self) -> ManagerStats:
        """The scheduler side's cumulative counts (live: read them, never write them)."""
        return self._stats.totals

    @property
    def detail_stats(self) -> ManagerDetailStats:
        """Removals, admission and the intersection, cumulative (live, likewise)."""
        return self._stats.detail

    @property
    def _answers(self) -> Mapping[OffloadKey, Answer]:
        """The batcher's cached answers (their bound is tested)."""
        return self._lookups.answers

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Answer from the cache; queue unknown keys and answer RETRY (never blocks)."""
        if not self._loads:
            return LookupResult.MISS
        if self._store_pending(key):
            self._record_answer(key, req_context, hit=True)
            self._pin_once_stored(key, req_context)
            return LookupResult.HIT_PENDING
        answer = self._lookups.lookup(key, req_context.req_id)
        if answer is None:
            return LookupResult.RETRY
        self._record_answer(key, req_context, hit=answer.present)
        if not answer.present:
            return LookupResult.MISS
        self._pin_now((key,), req_context)
        return LookupResult.HIT

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send every key queued this step to Redis in one round trip.

        Waits up to ``lookup_wait_s`` for the answer so the next step usually has it; a slow or
        dead Redis never holds the scheduler longer than that.
        """
        self._pins.tick()
        self._absorb_removals()
        if self._quotas is not None:
            self._quotas.tick()
        self._lookups.flush()

    def has_pending_work(self) -> bool:
        return self._lookups.has_pending_work()

    def _store_pending(self, key: OffloadKey) -> bool:
        """Whether this instance is storing ``key``. A mark older than store_pending_timeout_s
        is dropped: vLLM will not complete it, and the key is asked of Redis again."""
        mark = self._storing.get(key)
        if mark is None:
            return False
        if time.monotonic() - mark.since <= self._store_pending_timeout_s:
            return True
        del self._storing[key]
        self._stats.stale_store_mark()
        if not self._warned_stale_store:
            self._warned_stale_store = True
            logger.warning(
                "hma_redis: a store was not completed within store_pending_timeout_s=%.1fs; "
                "its chunks are looked up in Redis again (logged once)",
                self._store_pending_timeout_s,
            )
        return False

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """The keys to fetch, in vLLM's order. Redis needs no pinning: values are immutable and a
        value evicted before the worker reads it fails validation and is recomputed.

        A request may have several loads in flight: their keys accumulate, so a failed load
        forgets every one of them (:meth:`on_load_failed`)."""
        self._loading.setdefault(req_context.req_id, []).extend(keys)
        return RedisLoadStoreSpec(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Stop tracking the keys of one finished load of the request (not its other loads)."""
        loading = self._loading.get(req_context.req_id)
        if loading is None:
            return
        done = set(keys)
        remaining = [k for k in loading if k not in done]
        if remaining:
            self._loading[req_context.req_id] = remaining
        else:
            del self._loading[req_context.req_id]

    def on_load_failed(self, req_id: str) -> None:
        """A worker could not load this request's chunks: answer MISS for them from now on
        (until the answer ages out), so the recompute does not walk back into the failure."""
        self.forget_as_missing(self._loading.pop(req_id, ()))
        self._stats.load_failed()

    def forget_as_missing(self, keys: Iterable[OffloadKey]) -> None:
        """Answer MISS for ``keys`` until the answer ages out: a load found them missing or
        invalid, and a lookup must not walk straight back into the failure."""
        self._lookups.remember_missing(keys)

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Store the chunks Redis is not known to hold and nobody here is storing already
        (with ``second_sighting``: only those some lookup saw before). Chunks a fresh answer
        says are missing go in the spec's ``known_absent``: their store skips the EXISTS
        round trip."""
        to_store: list[OffloadKey] = []
        known_absent: list[OffloadKey] = []
        skipped = deferred = 0
        for key in keys:
            answer = self._lookups.known(key)
            if self._store_pending(key):
                skipped += 1
                self._pin_once_stored(key, req_context)
                continue
            if answer is not None and answer.present:
                skipped += 1
                self._pin_now((key,), req_context)
                continue
            if self._second_sighting and (answer is None or not answer.admitted):
                # Seen once (or never looked up): its marker lets the next sighting store it.
                deferred += 1
                continue
            to_store.append(key)
            if answer is not None and self._lookups.is_fresh(answer):
                known_absent.append(key)
        self._stats.stores_skipped(skipped)
        if self._second_sighting:
            self._stats.admission_decided(deferred, len(to_store))
        tenant = self._tenant_of(req_context)
        if to_store and tenant is not None and self._over_budget(tenant):
            self._stats.quota_refused(tenant, len(to_store))
            to_store, known_absent = [], []
        now = time.monotonic()
        for key in to_store:
            self._pin_once_stored(key, req_context)
            mark = self._storing.get(key)
            if mark is None:
                self._storing[key] = _StoreMark(1, now)
            else:
                mark.count += 1
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=RedisLoadStoreSpec(to_store, known_absent, tenant),
            evicted_keys=[],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Forget the in-flight marks. Presence is learned from Redis, never assumed: a store
        the worker had to drop (Redis down, OOM) must not turn into a hit here."""
        self._lookups.forget(keys)
        for key in keys:
            mark = self._storing.get(key)
            if mark is not None:
                mark.count -= 1
                if mark.count <= 0:
                    del self._storing[key]
            deadline = self._pin_after_store.pop(key, None)
            if success and deadline is not None:
                self._pins.add(self._redis_keys(key), deadline)
        if success and self._emit_events and keys:
            self._events.append(
                OffloadingEvent(
                    keys=list(keys), medium=Medium.STORAGE, removed=False, locality=Locality.REMOTE
                )
            )

    # ------------------------------------------------------------------ lifecycle

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request that asks for a pin (and may have one) is stored at request level: vLLM
        then offers every chunk of its prefix to :meth:`prepare_store`, its hits (local or in
        Redis) included, so each can be pinned (chunks Redis holds are not written again).
        With quotas, the request's tenant (from the salt :meth:`note_cache_salt` noted) is
        kept in its context."""
        self._take_tenant(req_context)
        if self._parse_pin(req_context) is None:
            return RequestOffloadingContext()
        return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request; count how far its hits reached per group and together."""
        self._loading.pop(req_context.req_id, None)
        hits = self._request_hits.pop(req_context.req_id, None)
        if hits is not None:
            self._count_intersection(hits)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored events (from ``complete_store``) and removal events (from Redis'
        notifications, drained here too so a router hears of them within a step)."""
        self._absorb_removals()
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ quotas

    def note_cache_salt(self, req_id: str, cache_salt: str | None) -> None:
        """The connector, before vLLM calls :meth:`on_new_request` for ``req_id``: the
        request's ``cache_salt`` (its tenant). Ignored without quotas."""
        if self._quotas is None:
            return
        if len(self._salts) >= MAX_NOTED_SALTS:
            self._salts.pop(next(iter(self._salts)))
        self._salts[req_id] = cache_salt

    def _take_tenant(self, req_context: ReqContext) -> None:
        """Keep the request's tenant id (of the salt noted for it; none: the default tenant)
        in its context, and have the keeper read that tenant's bytes."""
        if self._quotas is None:
            return
        salt = self._salts.pop(req_context.req_id, None)
        cfg = self._store.cfg
        tenant = tenant_id(salt, cfg.key_prefix, cfg.tenant_secret)
        req_context.set_state(_Tenant(tenant))
        self._quotas.note(tenant)

    def _tenant_of(self, req_context: ReqContext) -> str | None:
        """The request's tenant id with quotas (the default tenant for a request the manager
        met only now), else None."""
        if self._quotas is None:
            return None
        state = req_context.get_state(_Tenant)
        if state is None:
            self._take_tenant(req_context)
            state = req_context.get_state(_Tenant)
        return state.tenant if state is not None else None

    def _over_budget(self, tenant: str) -> bool:
        assert self._quotas is not None
        if not self._quotas.over_budget(tenant):
            return False
        self._say_limited(
            "quota",
            "tenant %s holds %d bytes, its budget is %s; its chunks are not stored",
            tenant,
            self._quotas.used(tenant),
            self._quotas.budget(tenant),
        )
        return True

    @property
    def quotas(self) -> QuotaKeeper | None:
        """The tenants' bytes and budgets (None without ``tenant_quotas``)."""
        return self._quotas

    # ------------------------------------------------------------------ pins

    def _parse_pin(self, req_context: ReqContext) -> _PinRequest | None:
        """The request's pin from its ``kv_transfer_params`` (kept in its state), or None: not
        asked for, pinning off, or not a positive integer of seconds (counted; one WARNING per
        kind and interval). A pin longer than ``pin_max_s`` is shortened to it (counted):
        the client asked for the prefix to stay, and gets the longest stay the operator
        allows (a later request renews it)."""
        params = req_context.kv_transfer_params
        if not params or PIN_PARAM not in params:
            return None
        cfg = self._store.cfg
        if not cfg.pinning:
            self._stats.pin_off()
            self._say_limited(
                "off",
                "request %s asks for a pin (kv_transfer_params %s) but pinning is off (the "
                "operator's option pinning); served unpinned",
                req_context.req_id,
                PIN_PARAM,
            )
            return None
        raw = params[PIN_PARAM]
        seconds = parse_pin_seconds(raw)
        if seconds is None:
            self._stats.pin_invalid()
            self._say_limited(
                "invalid",
                "request %s: kv_transfer_params %s must be a positive integer of seconds, got "
                "%.80r; served unpinned",
                req_context.req_id,
                PIN_PARAM,
                raw,
            )
            return None
        if seconds > cfg.pin_max_s:
            self._stats.pin_clamped()
            seconds = cfg.pin_max_s
        pin = _PinRequest(time.time() + seconds)
        req_context.set_state(pin)
        return pin

    def _say_limited(self, kind: str, message: str, *args: object) -> None:
        """One WARNING per ``kind`` and interval, with how many were held back since."""
        held = self._pin_log.admit(kind)
        if held is None:
            return
        logger.warning(
            "hma_redis: " + message + " (%d more since the last report; at most one per %.0fs)",
            *args,
            held,
            self._pin_log.interval_s,
        )

    def _pin_now(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Queue ``keys`` (in Redis) for the request's pin, if it has one."""
        pin = req_context.get_state(_PinRequest)
        if pin is None:
            return
        for key in keys:
            self._pins.add(self._redis_keys(key), pin.deadline)

    def _pin_once_stored(self, key: OffloadKey, req_context: ReqContext) -> None:
        """Pin ``key`` for the request (if pinned) when the store in flight lands."""
        pin = req_context.get_state(_PinRequest)
        if pin is not None:
            self._pin_after_store[key] = max(pin.deadline, self._pin_after_store.get(key, 0.0))

    def _redis_keys(self, key: OffloadKey) -> list[str]:
        return list(
            self._keyspace.block_keys_all_ranks(
                get_offload_group_idx(key), get_offload_block_hash(key)
            )
        )

    def _pin(self, deadlines: Mapping[str, float]) -> PinResult | None:
        """Pin queued chunks within the namespace's budget (the keeper's thread); chunks left
        over it are counted and said (one WARNING per interval)."""
        budget = self._store.cfg.pin_budget_bytes
        result = self._store.pin(self._keyspace.pins_key(), deadlines, budget)
        if result is None:
            return None
        self._stats.pins_taken(result.pinned, result.over_budget)
        if result.over_budget:
            self._say_limited(
                "budget",
                "%d chunks served unpinned: the namespace's pins hold pin_budget_bytes (%d)",
                result.over_budget,
                budget,
            )
        return result

    def _sweep(self) -> SweepResult | None:
        if self._ttl_s is None:
            return None
        return self._store.sweep_pins(self._keyspace.pins_key(), self._ttl_s)

    # ------------------------------------------------------------------ removals

    def _absorb_removals(self) -> None:
        """Drain the watcher: forget the answers for removed chunks (every group: a chunk one
        group lost is no usable hit), and queue one removal event for all of them. More than
        ``MAX_REMOVALS_PER_STEP`` waiting is handled as an overflow."""
        if self._removals is None:
            return
        removed, overflowed = self._removals.drain(limit=MAX_REMOVALS_PER_STEP)
        if overflowed:
            # Some removals were lost (queue full, or a notification connection dropped):
            # nothing believed present can be trusted, ask Redis again.
            self._lookups.forget_all()
            self._stats.removal_overflow()
            if self._quotas is not None:
                self._quotas.reconcile_soon()
        if self._quotas is not None and removed:
            self._quotas.removed(k for k in removed if self._keyspace.is_block_key(k))
        keys = self._removed_offload_keys(removed)
        if not keys:
            return
        self._lookups.forget(keys)
        self._stats.chunks_removed(len(keys))
        if self._emit_events:
            self._events.append(
                OffloadingEvent(
                    keys=keys, medium=Medium.STORAGE, removed=True, locality=Locality.REMOTE
                )
            )

    def _removed_offload_keys(self, redis_keys: Iterable[str]) -> list[OffloadKey]:
        """The offload keys (every group) of the removed block keys of this namespace, each once."""
        groups = range(max(1, len(self._group_chunk_tokens)))
        out: dict[OffloadKey, None] = {}
        for redis_key in redis_keys:
            parts = parse_block_key(redis_key)
            if parts is None or f"{parts.prefix}:{parts.namespace}" != self._keyspace.base:
                continue
            block_hash = bytes.fromhex(parts.hash_hex)
            for group in groups:
                out[make_offload_key(block_hash, group)] = None
        return list(out)

    # ------------------------------------------------------------------ intersection

    def _record_answer(self, key: OffloadKey, req_context: ReqContext, hit: bool) -> None:
        end = req_context.get_offload_key_position(key)
        if end is None:
            return
        hits = self._request_hits.get(req_context.req_id)
        if hits is None:
            hits = self._request_hits[req_context.req_id] = _RequestHits()
        hits.record(get_offload_group_idx(key), end, hit)

    def _count_intersection(self, hits: _RequestHits) -> None:
        """Per group: the chunks its hits reached, and those inside every group's reach (the
        only ones vLLM can use)."""
        groups = sorted(hits.by_group)
        usable = min(hits.reach(g) for g in groups)
        self._stats.request_reached(
            GroupReach(g, hits.reach(g) // self._chunk_tokens(g), usable // self._chunk_tokens(g))
            for g in groups
        )

    def _chunk_tokens(self, group: int) -> int:
        if group < len(self._group_chunk_tokens):
            return max(1, self._group_chunk_tokens[group])
        return 1

    def reset_cache(self) -> None:
        """vLLM's ``reset_prefix_cache`` (with the connector): forget every cached answer and
        every in-flight store mark. vLLM drops its in-flight jobs here and never completes
        them, so a kept mark would answer HIT_PENDING for ever. Redis itself is shared and
        left alone."""
        self._lookups.forget_all()
        self._storing.clear()
        self._pin_after_store.clear()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33+: the workers have reported every job in flight at the last
        ``reset_cache``. The stores among them may have landed in Redis after an answer of
        this step said MISS: forget the answers, so the chunks are asked of Redis again."""
        self._lookups.forget_all()

    def config_info(self) -> list[dict[str, str]]:
        """vLLM 0.33+ publishes this once as ``vllm:kv_offload_config_info``: the key prefix and
        namespace this instance reads and writes (what ``hma-redis --prefix P ls --namespace NS``
        takes), the Redis URL without its password, and the value format version."""
        return [
            {
                "key_prefix": self._keyspace.prefix,
                "namespace": self._keyspace.namespace,
                "redis_url": self._store.cfg.redacted_url,
                "format_version": str(FORMAT_VERSION),
            }
        ]

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Prometheus counters since the last call (see :mod:`hma_redis.adapter.metrics`)."""
        breaker = self._store.breaker
        return self._stats.report(
            errors=breaker.failures,
            available=breaker.state is BreakerState.CLOSED,
            latency=self._store.latency,
            memory=self._memory.take(),
            tenant_used=self._new_tenant_usage(),
        )

    def _new_tenant_usage(self) -> Mapping[str, int] | None:
        """The tenants' bytes when a snapshot came in since the last report, else None."""
        quotas = self._quotas
        if quotas is None or quotas.counts.refreshes == self._reported_refreshes:
            return None
        self._reported_refreshes = quotas.counts.refreshes
        return quotas.snapshot.used

    def shutdown(self) -> None:
        """Stop, then deliver the counters. Requests vLLM has not reported finished by now
        (it reports a request once its stores are done, which an engine shutting down after
        its last request never waits for) are counted here, so their per-group hit counters
        reach the stats hash too."""
        self._lookups.shutdown()
        self._memory.close(2 * self._store.cfg.read_timeout_s)
        # The pins of the last requests (best effort, bounded like one Redis call).
        self._pins.flush(2 * self._store.cfg.read_timeout_s)
        self._pins.close()
        if self._removals is not None:
            self._removals.close()
        if self._quotas is not None:
            self._quotas.close()
        for hits in self._request_hits.values():
            self._count_intersection(hits)
        self._request_hits.clear()
        self._store.flush()
