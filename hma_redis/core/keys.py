"""Namespace fingerprints and the Redis key layout.

Layout (readable in ``redis-cli --scan``)::

    <prefix>:<ns>:info                         hash: the fingerprint fields, plain text
    <prefix>:<ns>:g<group>:<block-hash-hex>    one chunk of one KV-cache group (single worker)
    <prefix>:<ns>:g<group>:<block-hash-hex>:r<rank>   the same, for worker ``rank`` of several
    <prefix>:<ns>:seen:g<group>:<block-hash-hex>      admission marker (second_sighting only)
    <prefix>:<ns>:tenants                      hash: the per-tenant byte account (tenant_quotas)
    <prefix>:<ns>:quotas                       hash: per-tenant byte budgets set by the operator

``<ns>`` is a short id derived from everything that makes KV bytes incompatible, so two
deployments can share one Redis only where their bytes are interchangeable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import NamedTuple, NewType

RedisKey = NewType("RedisKey", str)

NAMESPACE_ID_CHARS = 12


@dataclass(frozen=True)
class GroupLayout:
    """What one KV-cache group's chunk looks like in bytes."""

    tokens_per_chunk: int
    layer_names: tuple[str, ...]
    # Un-padded bytes per block for each layer (same order as ``layer_names`` refs).
    page_bytes: tuple[int, ...]
    # The group's attention kind as vLLM's KV-cache spec says it: "full_attention",
    # "sliding_window:<tokens>", "chunked_local_attention:<tokens>", "mamba", ... (shown by
    # ``hma-redis info``, and part of the fingerprint).
    kind: str = "full_attention"


@dataclass(frozen=True)
class NamespaceFingerprint:
    """Everything that makes stored KV bytes incompatible between deployments."""

    model: str
    kv_dtype: str
    groups: tuple[GroupLayout, ...]
    tp_size: int = 1
    pp_size: int = 1
    world_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1
    hash_algo: str = "sha256"
    kv_cache_layout: str = ""
    # The model's identity beyond its name: vLLM's resolved revision (a commit id for Hub
    # models), the weight quantization, the compute dtype, and the other model/cache options
    # that change KV bytes as canonical JSON (see docs/key-layout.md).
    revision: str = ""
    quantization: str = ""
    model_dtype: str = ""
    model_config: str = ""
    # Which auth_key signs this namespace's values ("" when none): instances with different
    # keys never share a namespace.
    auth_key_id: str = ""
    format_version: int = 1
    # Which encryption key names this namespace ("" when values are not encrypted): the
    # previous key's during a rotation, else the key values are sealed with.
    encryption_key_id: str = ""

    def namespace_id(self) -> str:
        """A short stable id: the first hex digits of a SHA-256 of the canonical fields.
        Fields added since (``encryption_key_id``) enter only when set, so the namespaces of
        deployments without them keep their ids."""
        fields = asdict(self)
        if not self.encryption_key_id:
            del fields["encryption_key_id"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:NAMESPACE_ID_CHARS]

    def info_fields(self) -> dict[str, str]:
        """Plain-text fields for the ``<prefix>:<ns>:info`` hash."""
        fields: dict[str, str] = {
            "model": self.model,
            "revision": self.revision,
            "quantization": self.quantization,
            "model_dtype": self.model_dtype,
            "model_config": self.model_config,
            "auth_key_id": self.auth_key_id,
            "kv_dtype": self.kv_dtype,
            "tp_size": str(self.tp_size),
            "pp_size": str(self.pp_size),
            "world_size": str(self.world_size),
            "dcp_size": str(self.dcp_size),
            "pcp_size": str(self.pcp_size),
            "hash_algo": self.hash_algo,
            "kv_cache_layout": self.kv_cache_layout,
            "format_version": str(self.format_version),
            "num_groups": str(len(self.groups)),
        }
        for idx, group in enumerate(self.groups):
            fields[f"g{idx}.kind"] = group.kind
            fields[f"g{idx}.tokens_per_chunk"] = str(group.tokens_per_chunk)
            fields[f"g{idx}.layers"] = ",".join(group.layer_names)
            fields[f"g{idx}.page_bytes"] = ",".join(str(b) for b in group.page_bytes)
        if self.encryption_key_id:
            fields["encryption_key_id"] = self.encryption_key_id
        return fields


@dataclass(frozen=True)
class KeySpace:
    """Builds the Redis keys of one namespace."""

    prefix: str
    namespace: str
    world_size: int = 1

    @property
    def base(self) -> str:
        return f"{self.prefix}:{self.namespace}"

    def info_key(self) -> RedisKey:
        return RedisKey(f"{self.base}:info")

    def stats_key(self) -> RedisKey:
        return RedisKey(f"{self.base}:stats")

    def pins_key(self) -> RedisKey:
        """The sorted set of this namespace's pinned chunks (member: the chunk's key; score:
        the pin's deadline, unix seconds). See :mod:`hma_redis.core.redis.pins`."""
        return RedisKey(f"{self.base}:pins")

    def tenants_key(self) -> RedisKey:
        """The hash of this namespace's per-tenant byte account (field ``<chunk key>``: the
        tenant and bytes it is counted against; field ``=<tenant>``: the tenant's bytes). See
        :mod:`hma_redis.core.redis.quotas`."""
        return RedisKey(f"{self.base}:tenants")

    def quotas_key(self) -> RedisKey:
        """The hash of per-tenant byte budgets the operator set (field: tenant id; value:
        bytes, ``-1`` for none), read by the scheduler, written by ``hma-redis quota``."""
        return RedisKey(f"{self.base}:quotas")

    def block_key(self, group: int, block_hash: bytes, rank: int = 0) -> RedisKey:
        """Key of one chunk of ``group`` whose last block has ``block_hash``, for ``rank``."""
        key = f"{self.base}:g{group}:{block_hash.hex()}"
        if self.world_size > 1:
            key += f":r{rank}"
        return RedisKey(key)

    def is_block_key(self, key: bytes | str) -> bool:
        """Whether ``key`` is a chunk key of this namespace as :meth:`block_key` writes it (any
        group, block hash and rank): not another namespace's, not its ``info``, ``stats``,
        ``pins`` or sighting keys, not a key of anyone else's (bytes that are not text
        included)."""
        raw = key.encode() if isinstance(key, str) else key
        return _block_key_re(self.base).fullmatch(raw) is not None

    def block_keys_all_ranks(self, group: int, block_hash: bytes) -> list[RedisKey]:
        """The keys every rank stores for one chunk (a chunk is a hit only if all exist)."""
        return [self.block_key(group, block_hash, r) for r in range(self.world_size)]

    def sighting_key(self, group: int, block_hash: bytes) -> RedisKey:
        """The admission marker of one chunk of ``group`` (``admission: second_sighting``):
        set by the first lookup that missed it, it lets the second one store it."""
        return RedisKey(f"{self.base}:seen:g{group}:{block_hash.hex()}")

    def block_pattern(self, group: int | None = None) -> str:
        """A SCAN MATCH pattern for this namespace's block keys (all groups or one)."""
        return f"{self.base}:g{'*' if group is None else group}:*"


@functools.lru_cache(maxsize=64)
def _block_key_re(base: str) -> re.Pattern[bytes]:
    """What :meth:`KeySpace.block_key` writes under ``base``, whole: ``:g<group>:<hash hex>``
    and ``:r<rank>`` for a worker of several (numbers without leading zeros, hex as
    ``bytes.hex()`` writes it)."""
    number = rb"(?:0|[1-9][0-9]*)"
    return re.compile(
        re.escape(base.encode()) + rb":g" + number + rb":(?:[0-9a-f]{2})+(?::r" + number + rb")?"
    )


class BlockKeyParts(NamedTuple):
    prefix: str
    namespace: str
    group: int
    hash_hex: str
    rank: int


_NUMBER = "(?:0|[1-9][0-9]*)"
_BLOCK_KEY_PARTS = re.compile(
    rf"([^:]*):([^:]*):g({_NUMBER}):((?:[0-9a-f]{{2}})+)(?::r({_NUMBER}))?"
)


def parse_block_key(key: str) -> BlockKeyParts | None:
    """Split a block key into its parts; None if ``key`` is not a block key as
    :meth:`KeySpace.block_key` writes it (the same rules as :meth:`KeySpace.is_block_key`:
    numbers without leading zeros, lowercase hex, ``:r<rank>`` or nothing after it)."""
    match = _BLOCK_KEY_PARTS.fullmatch(key)
    if match is None:
        return None
    prefix, namespace, group, hash_hex, rank = match.groups()
    return BlockKeyParts(prefix, namespace, int(group), hash_hex, int(rank or 0))
