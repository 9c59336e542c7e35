"""The vLLM glue: an out-of-tree offloading spec that puts KV chunks in Redis.

Enable with ``kv_connector_extra_config = {"spec_name": "RedisOffloadingSpec",
"spec_module_path": "hma_redis.spec", "redis_url": ...}``. vLLM builds one spec per process:
the scheduler asks for the manager, each worker for its worker.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hma_redis import FORMAT_VERSION
from hma_redis.config import RedisTierConfig
from hma_redis.keys import GroupLayout, KeySpace, NamespaceFingerprint
from hma_redis.store import RedisBlockStore

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

logger = init_logger(__name__)

# vLLM's non-cryptographic prefix hashes use a random per-process root unless PYTHONHASHSEED is
# set; blocks hashed that way can never be shared between instances.
_RANDOM_ROOT_HASHES = frozenset({"xxhash", "xxhash_cbor"})


class RedisOffloadingSpec(OffloadingSpec):
    """Offloading spec whose medium is a (shared) Redis."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """hma_redis' Prometheus metrics (see :mod:`hma_redis.metrics`)."""
        from hma_redis.metrics import metric_definitions

        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        _adopt_vllm_logging()
        self.tier_config = RedisTierConfig.from_extra_config(config.extra_config)
        self.hash_algo = _prefix_hash_algo()
        _check_hash_seed(self.hash_algo, self.tier_config)
        self.fingerprint = build_fingerprint(config, self.hash_algo)
        namespace = self.tier_config.namespace or self.fingerprint.namespace_id()
        self.keyspace = KeySpace(self.tier_config.key_prefix, namespace, config.parallel.world_size)
        self._store: RedisBlockStore | None = None

    @property
    def store(self) -> RedisBlockStore:
        if self._store is None:
            self._store = RedisBlockStore(self.tier_config, stats_key=self.keyspace.stats_key())
        return self._store

    def get_manager(self) -> OffloadingManager:
        from hma_redis.manager import RedisOffloadingManager

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
        return RedisOffloadingManager(
            store, self.keyspace, emit_events=self.kv_events_config.enable_kv_cache_events
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from hma_redis.worker import RedisOffloadingWorker

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
        )


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


def _adopt_vllm_logging() -> None:
    """Send hma_redis' log lines through vLLM's handlers and level (vLLM configures only its own
    ``vllm`` logger, so INFO lines of other packages would be dropped)."""
    ours, theirs = logging.getLogger("hma_redis"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def build_fingerprint(config: OffloadingConfig, hash_algo: str) -> NamespaceFingerprint:
    """Everything in vLLM's offloading config that makes KV bytes incompatible."""
    bpc = config.cache.blocks_per_chunk
    parallel = config.parallel
    groups = tuple(
        GroupLayout(
            tokens_per_chunk=group.tokens_per_block * bpc,
            layer_names=group.layer_names,
            page_bytes=(config.worker_kv_bytes_per_block,),
            kind=f"kv_group_{group.group_id}",
        )
        for group in config.groups
    )
    return NamespaceFingerprint(
        model=config.model.name,
        kv_dtype=config.model.dtype,
        groups=groups,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        world_size=parallel.world_size,
        dcp_size=parallel.dcp_size,
        pcp_size=parallel.pcp_size,
        hash_algo=hash_algo,
        kv_cache_layout=config.kv_cache_layout or "",
        format_version=FORMAT_VERSION,
    )


def _prefix_hash_algo() -> str:
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        # vLLM's stock OffloadingConnector builds the scheduler side outside the config
        # context; RedisOffloadingConnector does not. Assume vLLM's default.
        return "sha256"
    return str(vllm_config.cache_config.prefix_caching_hash_algo)


def _check_hash_seed(hash_algo: str, cfg: RedisTierConfig) -> None:
    if hash_algo not in _RANDOM_ROOT_HASHES or os.environ.get("PYTHONHASHSEED") is not None:
        return
    message = (
        f"hma_redis: prefix_caching_hash_algo={hash_algo} with PYTHONHASHSEED unset gives every "
        "vLLM process a random block-hash root, so no instance could ever load another's "
        "blocks. Set PYTHONHASHSEED to the same value on every instance (e.g. "
        "PYTHONHASHSEED=0), or use --prefix-caching-hash-algo sha256."
    )
    if not cfg.allow_random_hash_seed:
        raise ValueError(message)
    logger.warning("%s (allowed by allow_random_hash_seed)", message)
