"""Tenants: who a request's KV bytes are counted against, without the salt in Redis.

A tenant is a request's ``cache_salt`` (vLLM keeps prefixes of different salts apart: the salt
is part of the first block's hash, so every chunk of a salted prompt is that tenant's own).
Redis never sees the salt: a tenant is named by :func:`tenant_id`, 16 hex digits of a keyed
BLAKE3 hash of the salt, keyed by the key prefix and, when the deployment has one, the
``auth_key`` or the encryption key (``RedisTierConfig.tenant_secret``: then nobody without the
key can tell which salt an id stands for, nor test a guess). Requests without a salt are the
tenant :data:`DEFAULT_TENANT`.
"""

from __future__ import annotations

import functools
import re

import blake3

# Requests without a cache_salt (the default budget does not apply to it: see
# docs/operations.md, "Per-tenant quotas").
DEFAULT_TENANT = "default"
TENANT_ID_CHARS = 16
_CONTEXT = "hma_redis 2026-12 tenant id"
_TENANT_RE = re.compile(rf"[0-9a-f]{{{TENANT_ID_CHARS}}}|{DEFAULT_TENANT}")


def tenant_id(salt: str | None, key_prefix: str, secret: bytes | None = None) -> str:
    """The tenant id of a request with ``cache_salt`` ``salt`` (None or "": the default
    tenant) under ``key_prefix``; equal inputs give equal ids in every process (the scheduler,
    ``hma-redis quota``)."""
    if not salt:
        return DEFAULT_TENANT
    key = _hash_key(key_prefix, secret)
    return blake3.blake3(salt.encode("utf-8", "surrogatepass"), key=key).hexdigest()[
        :TENANT_ID_CHARS
    ]


@functools.lru_cache(maxsize=8)
def _hash_key(key_prefix: str, secret: bytes | None) -> bytes:
    """The 32-byte BLAKE3 key tenant ids are hashed with (derived once per deployment)."""
    material = key_prefix.encode() + b"\0" + (secret or b"")
    return blake3.blake3(material, derive_key_context=_CONTEXT).digest()


def is_tenant_id(text: str) -> bool:
    """Whether ``text`` is a tenant id as :func:`tenant_id` writes it (or the default's)."""
    return _TENANT_RE.fullmatch(text) is not None
