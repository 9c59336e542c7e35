"""The vLLM glue: an out-of-tree offloading spec that puts KV chunks in Redis.

Enable with ``kv_connector_extra_config = {"spec_name": "RedisOffloadingSpec",
"spec_module_path": "hma_redis.spec", "redis_url": ...}`` under ``"kv_connector":
"RedisOffloadingConnector"`` (the only connector the spec starts under, see
:func:`failure_reporting_connector`). vLLM builds one spec per process: the scheduler asks for
the manager, each worker for its worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config.utils import normalize_value
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
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core.codec import FORMAT_VERSION
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import GroupLayout, KeySpace, NamespaceFingerprint
from hma_redis.core.notifications import RemovalWatcher
from hma_redis.core.store import RedisBlockStore

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

logger = init_logger(__name__)

# vLLM's non-cryptographic prefix hashes use a random per-process root unless PYTHONHASHSEED is
# set; blocks hashed that way can never be shared between instances.
_RANDOM_ROOT_HASHES = frozenset({"xxhash", "xxhash_cbor"})

CONNECTOR_CONFIG = (
    '"kv_connector": "RedisOffloadingConnector", "kv_connector_module_path": "hma_redis.connector"'
)

# ModelConfig fields that change KV bytes, besides model, revision, quantization and dtype
# (fingerprint fields of their own). vLLM's ModelConfig.compute_hash hashes them too, with much
# that changes only the compute graph; it leaves hf_overrides out because it hashes their
# effect on hf_config, which the workers may modify while they load the model (so a hash of it
# could differ between the scheduler and the workers).
_MODEL_FACTORS = (
    "model_weights",
    "code_revision",
    "quantization_config",
    "hf_overrides",
    "model_impl",
    "disable_sliding_window",
)
# CacheConfig fields that change KV bytes (block sizes and the KV dtype are fingerprint fields).
_CACHE_FACTORS = ("cache_dtype", "kv_cache_dtype_skip_layers", "sliding_window")
# The same for models with Mamba groups only: vLLM resolves them per host (on the CPU by the
# instruction set), and they would split the namespace of attention-only models for nothing.
_MAMBA_CACHE_FACTORS = ("mamba_cache_dtype", "mamba_ssm_cache_dtype")
# The checkpoint's own config, read from disk (never from the live hf_config, see above).
_CHECKPOINT_CONFIG_FILES = ("config.json", "params.json")


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


def _connector_context() -> ConnectorContext:
    """The context :func:`failure_reporting_connector` set; ``ValueError`` (one line, naming the
    connector to use) when the spec is built under any other connector."""
    context = _CONNECTOR_CONTEXT.get()
    if context is not None:
        return context
    raise ValueError(
        f"hma_redis: RedisOffloadingSpec needs RedisOffloadingConnector{_configured_connector()}:"
        " it is the only connector that turns a failed load (a chunk evicted or corrupted in "
        "Redis between lookup and load) into a recompute, any other would serve the stale KV "
        f"blocks; set {CONNECTOR_CONFIG} in the kv-transfer-config"
    )


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
        _adopt_vllm_logging()
        context = _connector_context()
        self.vllm_config = context.vllm_config
        compat.refuse_unsupported_options(config.extra_config)
        self.tier_config = RedisTierConfig.from_extra_config(config.extra_config)
        self.hash_algo = str(context.vllm_config.cache_config.prefix_caching_hash_algo)
        _check_hash_seed(self.hash_algo, self.tier_config)
        self.fingerprint = build_fingerprint(
            config,
            self.hash_algo,
            vllm_config=context.vllm_config,
            kv_cache_config=context.kv_cache_config,
            auth_key_id=self.tier_config.auth_key_id,
        )
        namespace = explicit_namespace(self.tier_config, self.fingerprint)
        namespace = namespace or self.fingerprint.namespace_id()
        self.keyspace = KeySpace(self.tier_config.key_prefix, namespace, config.parallel.world_size)
        self._store: RedisBlockStore | None = None

    @property
    def store(self) -> RedisBlockStore:
        if self._store is None:
            self._store = RedisBlockStore(self.tier_config, stats_key=self.keyspace.stats_key())
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
        return lookup_manager(self, store, self.keyspace, self.tier_config)

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
            idle_wait_s=cfg.idle_wait_ms / 1e3,
        )


def lookup_manager(
    spec: OffloadingSpec, store: RedisBlockStore, keyspace: KeySpace, cfg: RedisTierConfig
) -> RedisOffloadingManager:
    """The scheduler side's manager over ``store`` for ``spec``'s groups, in both modes (the
    direct spec's manager; the secondary tier's lookups). With vLLM's KV events on and
    ``removal_events``, a removal watcher (Redis' keyspace notifications) feeds it the chunks
    Redis removed (docs/operations.md)."""
    emit_events = spec.kv_events_config.enable_kv_cache_events
    removals = None
    if emit_events and cfg.removal_events:
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


def build_fingerprint(
    config: OffloadingConfig,
    hash_algo: str,
    *,
    vllm_config: VllmConfig | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    auth_key_id: str = "",
) -> NamespaceFingerprint:
    """Everything that makes KV bytes incompatible: vLLM's offloading config (groups, KV dtype,
    parallel and KV-cache layout), the prefix-hash algorithm, the model's identity from vLLM's
    model and cache config (``vllm_config``), each group's attention kind (``kv_cache_config``)
    and the auth key's id. The same inputs give the same fingerprint in every process."""
    bpc = config.cache.blocks_per_chunk
    parallel = config.parallel
    groups = tuple(
        GroupLayout(
            tokens_per_chunk=group.tokens_per_block * bpc,
            layer_names=group.layer_names,
            page_bytes=(config.worker_kv_bytes_per_block,),
            kind=(
                group_kind(kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec)
                if kv_cache_config is not None
                else f"kv_group_{group.group_id}"
            ),
        )
        for group in config.groups
    )
    model = vllm_config.model_config if vllm_config is not None else None
    mamba = any(group.kind == "mamba" for group in groups)
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
        revision=(model.revision or "") if model is not None else "",
        quantization=(model.quantization or "") if model is not None else "",
        model_dtype=str(model.dtype).removeprefix("torch.") if model is not None else "",
        model_config=model_config_factors(vllm_config, mamba) if vllm_config is not None else "",
        auth_key_id=auth_key_id,
        format_version=FORMAT_VERSION,
    )


def group_kind(spec: KVCacheSpec) -> str:
    """A KV-cache group's attention kind as vLLM's group spec says it: ``full_attention``,
    ``sliding_window:<tokens>``, ``chunked_local_attention:<tokens>``, ``mamba``, else the
    spec's class name in snake case (``mla_attention``, ``cross_attention``, ...).

    A worker's group may hold one spec per layer (``UniformTypeKVCacheSpecs``) where the
    scheduler's holds the first of them: both sides name the first, so they agree.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window:{spec.sliding_window}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked_local_attention:{spec.attention_chunk_size}"
    if isinstance(spec, MambaSpec):
        return "mamba"
    if type(spec) is FullAttentionSpec:
        # Without the hybrid allocator, sliding-window layers are full-attention groups that
        # record their window.
        if spec.sliding_window is not None:
            return f"full_attention(sliding_window:{spec.sliding_window})"
        if spec.attention_chunk_size is not None:
            return f"full_attention(chunked_local_attention:{spec.attention_chunk_size})"
        return "full_attention"
    name = type(spec).__name__.removesuffix("Spec")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def model_config_factors(vllm_config: VllmConfig, mamba: bool = False) -> str:
    """Canonical JSON of the model and cache options that change KV bytes and have no
    fingerprint field of their own (docs/key-layout.md lists them); the Mamba cache dtypes
    only when the model has ``mamba`` groups.

    Read only from fields the workers never modify and from the checkpoint's config file on
    disk, so the scheduler and every worker derive the same text.
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    factors: dict[str, Any] = {name: _normalized(getattr(model, name)) for name in _MODEL_FACTORS}
    cache_factors = _CACHE_FACTORS + (_MAMBA_CACHE_FACTORS if mamba else ())
    factors.update({name: _normalized(getattr(cache, name)) for name in cache_factors})
    factors["checkpoint_config"] = _checkpoint_config_digest(model)
    return json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)


def _normalized(value: Any) -> Any:
    """vLLM's canonical, JSON-able form of a config value (as its config hashes use it); a
    function (``hf_overrides`` may be one) by its qualified name."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '?')}"
    return normalize_value(value)


def _checkpoint_config_digest(model: ModelConfig) -> str:
    """SHA-256 (16 hex digits) of the checkpoint's config file as canonical JSON; "" when there
    is none on this host (a Hub model not in the local cache is pinned by its revision)."""
    path = _checkpoint_config_path(model)
    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning("hma_redis: cannot read the model's config %s: %s", path, exc)
        return ""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _checkpoint_config_path(model: ModelConfig) -> str | None:
    source = model.hf_config_path or model.model
    for name in _CHECKPOINT_CONFIG_FILES:
        if os.path.isdir(source):
            candidate = os.path.join(source, name)
            if os.path.isfile(candidate):
                return candidate
            continue
        cached = _hub_cached_file(source, name, model.revision)
        if cached is not None:
            return cached
    return None


def _hub_cached_file(repo_id: str, name: str, revision: str | None) -> str | None:
    """``name`` of a Hub repo from the local cache (never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, name, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return found if isinstance(found, str) else None


def explicit_namespace(cfg: RedisTierConfig, fingerprint: NamespaceFingerprint) -> str | None:
    """The namespace an operator named, if any: the name, ``.`` and the fingerprint's id.

    A name alone could put two deployments whose KV bytes differ in one namespace, and the
    values' headers cannot tell them apart where only the weights differ (two fine-tunes of one
    base model have the same layout): one would load the other's KV and answer wrong. With the
    id, deployments share a named namespace exactly when they would share a computed one. The
    fingerprint holds the ``auth_key``'s id, so instances with different shared secrets never
    meet either (each would find the other's values corrupt and delete them).
    """
    if cfg.namespace is None:
        return None
    return f"{cfg.namespace}.{fingerprint.namespace_id()}"


def _check_hash_seed(hash_algo: str, cfg: RedisTierConfig) -> None:
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
