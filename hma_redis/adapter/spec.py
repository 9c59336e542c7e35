"""The vLLM glue: an out-of-tree offloading spec that puts KV chunks in Redis.

Enable with ``kv_connector_extra_config = {"spec_name": "RedisOffloadingSpec",
"spec_module_path": "hma_redis.spec", "redis_url": ...}`` under ``"kv_connector":
"RedisOffloadingConnector"`` (the only connector the spec starts under, see
:func:`failure_reporting_connector`). vLLM builds one spec per process: the scheduler asks for
the manager, each worker for its worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hma_redis.adapter import compat
from hma_redis.adapter.manager import CONFIG_INFO_KEYS, RedisOffloadingManager
from hma_redis.adapter.metrics import metric_definitions
from hma_redis.adapter.namespace import Mode, deployment_fingerprint, namespace_name
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.notifications import RemovalWatcher
from hma_redis.core.redis.quotas import QuotaKeeper
from hma_redis.core.redis.store import RedisBlockStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

logger = init_logger(__name__)

# vLLM's non-cryptographic prefix hashes use a random per-process root unless PYTHONHASHSEED is
# set; blocks hashed that way can never be shared between instances.
_RANDOM_ROOT_HASHES = frozenset({"xxhash", "xxhash_cbor"})

CONNECTOR_CONFIG = (
    '"kv_connector": "RedisOffloadingConnector", "kv_connector_module_path": "hma_redis.connector"'
)


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector that reports failed loads tells the specs vLLM builds for it."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig


_CONNECTOR_CONTEXT: ContextVar[ConnectorContext | None] = ContextVar(
    "hma_redis_connector_context", default=None
)


@contextlib.contextmanager
def failure_reporting_connector(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> Iterator[None]:
    """Build specs inside this block as the spec of a connector that reports failed loads.

    Entered by :class:`hma_redis.adapter.connector.RedisOffloadingConnector` while vLLM's connector
    constructor builds the spec (scheduler and worker side alike). A
    :class:`RedisOffloadingSpec` built outside it refuses to start: under any other connector
    a load that fails (a value evicted, expired or corrupt between lookup and load) would leave
    the destination blocks holding whatever they held, and the request would be served from
    them. The context also gives the spec vLLM's config (the model's identity, the prefix-hash
    algorithm) and KV-cache config (each group's attention kind), which the stock
    ``OffloadingConfig`` does not carry.
    """
    token = _CONNECTOR_CONTEXT.set(ConnectorContext(vllm_config, kv_cache_config))
    try:
        yield
    finally:
        _CONNECTOR_CONTEXT.reset(token)


def connector_context(what: str) -> ConnectorContext:
    """The context :func:`failure_reporting_connector` set; ``ValueError`` (one line, naming the
    connector to use) when ``what`` (the spec, the secondary tier) is built under any other
    connector."""
    context = _CONNECTOR_CONTEXT.get()
    if context is not None:
        return context
    raise ValueError(
        f"hma_redis: {what} needs RedisOffloadingConnector{_configured_connector()}: "
        f"{_WHY_OUR_CONNECTOR.get(what, _WHY_OUR_CONNECTOR[SPEC])}; set {CONNECTOR_CONFIG} in "
        "the kv-transfer-config"
    )


SPEC = "RedisOffloadingSpec"
SECONDARY_TIER = "the Redis secondary tier (RedisSecondaryTier)"
_WHY_OUR_CONNECTOR = {
    SPEC: (
        "it is the only connector that turns a failed load (a chunk evicted or corrupted in "
        "Redis between lookup and load) into a recompute, any other would serve the stale KV "
        "blocks"
    ),
    SECONDARY_TIER: (
        "it is the only connector that gives the tier vLLM's model config (revision, "
        "quantization, dtype, hf_overrides), without which two deployments of one model path "
        "that compute different KV would share one namespace and load each other's bytes"
    ),
}


def _configured_connector() -> str:
    """`` (kv_connector is '<name>')`` where this process can see vLLM's config, else ""."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    transfer = vllm_config.kv_transfer_config if vllm_config is not None else None
    if transfer is None or not transfer.kv_connector:
        # vLLM's stock OffloadingConnector builds its scheduler side outside the config context.
        return ""
    return f" (kv_connector is {transfer.kv_connector!r})"


class RedisOffloadingSpec(OffloadingSpec):
    """Offloading spec whose medium is a (shared) Redis."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """hma_redis' Prometheus metrics (see :mod:`hma_redis.adapter.metrics`)."""
        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of vLLM's ``vllm:kv_offload_config_info`` metric (vLLM 0.33+) that the
        manager fills (:meth:`RedisOffloadingManager.config_info`)."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        adopt_vllm_logging()
        context = connector_context(SPEC)
        self.vllm_config = context.vllm_config
        compat.refuse_unsupported_options(config.extra_config)
        self.tier_config = RedisTierConfig.from_extra_config(config.extra_config)
        check_hash_seed(context.vllm_config, self.tier_config)
        self.fingerprint = deployment_fingerprint(
            config,
            context.vllm_config,
            context.kv_cache_config,
            kv_cache_layout=config.kv_cache_layout or "",
            auth_key_id=self.tier_config.auth_key_id,
            encryption_key_id=self.tier_config.encryption_key_id,
        )
        namespace = namespace_name(self.tier_config, self.fingerprint, Mode.DIRECT)
        self.keyspace = KeySpace(self.tier_config.key_prefix, namespace, config.parallel.world_size)
        self._store: RedisBlockStore | None = None

    @property
    def store(self) -> RedisBlockStore:
        if self._store is None:
            self._store = RedisBlockStore(
                self.tier_config,
                stats_key=self.keyspace.stats_key(),
                quota_space=self.keyspace if self.tier_config.tenant_quotas else None,
            )
        return self._store

    def get_manager(self) -> OffloadingManager:
        store = self.store
        if not store.write_info(self.keyspace.info_key(), self.fingerprint.info_fields()):
            logger.warning(
                "hma_redis: Redis at %s is not reachable at start-up; serving without the "
                "tier until it is",
                self.tier_config.redacted_url,
            )
        logger.info(
            "hma_redis: namespace %s (%s) at %s",
            self.keyspace.base,
            self.fingerprint.model,
            self.tier_config.redacted_url,
        )
        _warn_if_failed_loads_fail_requests(self.vllm_config)
        return lookup_manager(self, store, self.keyspace, self.tier_config, self.vllm_config)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        cfg = self.tier_config
        if cfg.gil_switch_interval_ms:
            lower_gil_switch_interval(cfg.gil_switch_interval_ms / 1e3)
        return RedisOffloadingWorker(
            store=self.store,
            keyspace=self.keyspace,
            rank=self.config.parallel.rank,
            kv_caches=kv_caches,
            group_ids=[g.group_id for g in self.config.groups],
            blocks_per_chunk=self.blocks_per_chunk,
            kv_dtype=self.config.model.dtype,
            io_threads=cfg.io_threads,
            max_inflight_bytes=cfg.max_inflight_bytes,
            shutdown_timeout_s=cfg.shutdown_timeout_s,
            auth_key=cfg.auth_key,
            kv_cache_layout=self.config.kv_cache_layout or "",
            encryption_key=cfg.encryption_key,
            encryption_key_previous=cfg.encryption_key_previous,
            idle_wait_s=cfg.idle_wait_ms / 1e3,
        )


def lookup_manager(
    spec: OffloadingSpec,
    store: RedisBlockStore,
    keyspace: KeySpace,
    cfg: RedisTierConfig,
    vllm_config: VllmConfig,
) -> RedisOffloadingManager:
    """The scheduler side's manager over ``store`` for ``spec``'s groups, in both modes (the
    direct spec's manager; the secondary tier's lookups). With vLLM's KV events on and
    ``removal_events``, a removal watcher (Redis' keyspace notifications) feeds it the chunks
    Redis removed (docs/operations.md); with ``tenant_quotas`` too (they leave the tenants'
    account), and a :class:`~hma_redis.core.redis.quotas.QuotaKeeper` keeps the budgets.
    Where the engine cannot resume a prompt from cached KV (:func:`no_resume_reason`) it
    finds nothing: every lookup is a miss, stores go on."""
    reason = no_resume_reason(vllm_config)
    if reason is not None:
        logger.warning(
            "hma_redis: %s; the engine cannot resume a prompt from cached KV, so the tier "
            "loads nothing into it (every lookup is a miss; its stores go on)",
            reason,
        )
    emit_events = spec.kv_events_config.enable_kv_cache_events
    removals = None
    quotas = quota_keeper(store, cfg)
    # Quotas take removals off the tenants' account (without notifications: the reconcile).
    if cfg.removal_events and (emit_events or quotas is not None):
        removals = RemovalWatcher(cfg, keyspace.block_pattern()).start()
    return RedisOffloadingManager(
        store,
        keyspace,
        emit_events=emit_events,
        store_pending_timeout_s=cfg.store_pending_timeout_s,
        removals=removals,
        group_chunk_tokens=tuple(
            group.tokens_per_block * spec.blocks_per_chunk for group in spec.config.groups
        ),
        admission=cfg.admission,
        admission_window_s=cfg.admission_window_s,
        pin_sweep_interval_s=cfg.pin_sweep_interval_s,
        loads=reason is None,
        quotas=quotas,
    )


def quota_keeper(store: RedisBlockStore, cfg: RedisTierConfig) -> QuotaKeeper | None:
    """The scheduler's view of the tenants' bytes and budgets over ``store`` (whose
    ``quota_space`` names the account), with ``tenant_quotas``; else None."""
    if not cfg.tenant_quotas or store.quota_space is None:
        return None
    return QuotaKeeper(
        store.quota_snapshot,
        store.account_removed,
        store.reconcile_quota,
        default_budget=cfg.tenant_budget_bytes,
        refresh_s=cfg.quota_refresh_interval_s,
        reconcile_s=cfg.quota_reconcile_interval_s,
    ).start()


def no_resume_reason(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot take a prompt's prefix from cached KV, or None when it can.

    vLLM turns prefix caching off where its attention cannot start a prefill after computed
    tokens (MLA on a CPU without AMX, whose reference backend has no prefill with context;
    models with non-causal layers): KV loaded there gives other tokens than a recompute. The
    connector sees only the result, so prefix caching off (by vLLM or by the operator) means
    no loads: exact or nothing.

    Where vLLM keeps prefix caching on for MLA on a CPU (an AMX host: its AMX_MLA backend with
    the CPU_SDPA_MLA prefill), a prefill after computed tokens gives other greedy tokens than a
    recompute: vLLM's own prefix cache does too (docs/hybrid-families.md), so KV loaded there
    cannot be exact either, and the tier loads nothing into such an engine."""
    mla = _uses_mla(vllm_config)
    if not vllm_config.cache_config.enable_prefix_caching:
        why = " (an MLA model: on this platform vLLM runs it so)" if mla else ""
        return f"vLLM runs this deployment without prefix caching{why}"
    if mla and _on_cpu():
        return (
            "vLLM's CPU MLA backend gives other tokens after cached KV than a recompute "
            "(its own prefix cache does too)"
        )
    return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _uses_mla(vllm_config: VllmConfig) -> bool:
    model = vllm_config.model_config
    return bool(getattr(model, "use_mla", False)) if model is not None else False


def lower_gil_switch_interval(seconds: float) -> None:
    """Make a thread that holds the GIL hand it over after ``seconds`` (Python's default: 5 ms)
    when another thread waits for it; never raises the interval.

    The engine's step loop holds the GIL almost all the time, also while a request only waits
    for its KV from Redis. A transfer thread gives the GIL up at every socket call and then
    waits a whole interval to get it back: a 128 MiB load took 1.0-1.3 s inside vLLM on the
    CPU with the default against 0.25 s with 0.5 ms (docs/performance.md).
    """
    before = sys.getswitchinterval()
    if seconds < before:
        sys.setswitchinterval(seconds)
        logger.info(
            "hma_redis: Python's GIL switch interval lowered from %.1f to %.2f ms so transfer "
            "threads are not starved by the engine loop (option gil_switch_interval_ms)",
            before * 1e3,
            seconds * 1e3,
        )


def adopt_vllm_logging() -> None:
    """Send hma_redis' log lines through vLLM's handlers and level (vLLM configures only its own
    ``vllm`` logger, so INFO lines of other packages would be dropped)."""
    ours, theirs = logging.getLogger("hma_redis"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def _warn_if_failed_loads_fail_requests(vllm_config: VllmConfig) -> None:
    """One WARNING at start-up (scheduler side) when vLLM fails requests on a failed load."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_load_failure_policy != "fail":
        return
    logger.warning(
        'hma_redis: kv_load_failure_policy is "fail" (vLLM\'s default): a chunk evicted, '
        "expired or corrupted in Redis between lookup and load fails the user's request with "
        'an error. Set "kv_load_failure_policy": "recompute" in the kv-transfer-config to '
        "recompute those tokens instead (same output, a slower first token)."
    )


def check_hash_seed(vllm_config: VllmConfig, cfg: RedisTierConfig) -> None:
    """Refuse (``ValueError``, one line) a prefix hash whose root is random per process unless
    ``allow_random_hash_seed``: no instance could ever load another's blocks."""
    hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if hash_algo not in _RANDOM_ROOT_HASHES or os.environ.get("PYTHONHASHSEED") is not None:
        return
    message = (
        f"hma_redis: prefix_caching_hash_algo={hash_algo} with PYTHONHASHSEED unset gives every "
        "vLLM process a random block-hash root, so no instance could ever load another's "
        "blocks. Use vLLM's default --prefix-caching-hash-algo sha256 (recommended), or set "
        "PYTHONHASHSEED to the same secret random value on every instance (not a well-known one "
        "such as 0: it lets a tenant craft colliding prefixes; see docs/security.md)."
    )
    if not cfg.allow_random_hash_seed:
        raise ValueError(message)
    logger.warning("%s (allowed by allow_random_hash_seed)", message)
