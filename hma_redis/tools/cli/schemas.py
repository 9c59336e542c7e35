"""The JSON Schema (draft 2020-12) of what each ``hma-redis`` command prints under ``--json``,
and of the error object it prints instead when it fails. docs/cli-json.md shows them; the tests
validate every command's output against its schema."""

from __future__ import annotations

import json
import sys
from typing import Any

_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}
_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}


def _object(properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    """An object with exactly these properties, all required."""
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
        **more,
    }


def _map(values: dict[str, Any]) -> dict[str, Any]:
    """An object whose keys are data (group numbers, node addresses, field names)."""
    return {"type": "object", "additionalProperties": values}


_USAGE = _object({"keys": _INT, "value_bytes": _INT, "memory_bytes": _INT})
_NODE_MEMORY = _object({"used_bytes": _INT, "max_bytes": _INT})
_UNUSABLE_GROUP = _object(
    {"unusable_bytes": _INT, "sampled_keys": _INT, "keys": _INT, "sampled_unusable_keys": _INT}
)

INFO = _object(
    {
        "url": _STR,
        "deployment": _STR,
        "nodes": {"type": "array", "items": _STR},
        "prefix": _STR,
        # Redis' used_memory and maxmemory (0: no limit), summed over a Cluster's masters as
        # the Prometheus gauges are, and per node; null and ``not_shown`` (why) when the ACL
        # refuses INFO.
        "memory": _object(
            {
                "used_bytes": _INT_OR_NULL,
                "max_bytes": _INT_OR_NULL,
                "by_node": _map(_NODE_MEMORY),
                "not_shown": _STR_OR_NULL,
            }
        ),
        "namespaces": {
            "type": "array",
            "items": _object(
                {
                    "namespace": _STR,
                    "info": _map(_STR),
                    "groups": _map(_USAGE),
                    "total": _USAGE,
                    "by_node": _map(_USAGE),
                    "other_keys": _INT,
                    "stats": _map({"type": ["integer", "string"]}),
                    # Per group the values no lookup can use; ``not_estimated`` says why
                    # ``groups`` is empty when it is (one group, no info hash, ...).
                    "unusable": _object(
                        {"groups": _map(_UNUSABLE_GROUP), "not_estimated": _STR_OR_NULL}
                    ),
                    # Chunks kept from eviction until a deadline (the namespace's pins set).
                    "pinned_chunks": _INT,
                    # Per tenant id (quotas): the bytes its chunks hold in the account, and
                    # the budget the operator set (null: none set, the tier's default
                    # applies; -1: none at all).
                    "tenants": _map(_object({"used_bytes": _INT, "budget_bytes": _INT_OR_NULL})),
                }
            ),
        },
        "unrecognized_keys": _INT,
    }
)

LS = _object(
    {
        "pattern": _STR,
        "keys": {
            "type": "array",
            "items": _object(
                {
                    "key": _STR,
                    "type": _STR,
                    "value_bytes": _INT_OR_NULL,
                    "memory_bytes": _INT_OR_NULL,
                    "ttl_s": _INT_OR_NULL,
                    "node": _STR,
                    # A pinned chunk's deadline, unix seconds (its ttl_s is then null).
                    "pinned_until": _NUM_OR_NULL,
                }
            ),
        },
        "cursor": _INT,
    }
)

INSPECT = _object(
    {
        "key": _STR,
        "value_bytes": _INT,
        "ttl_s": _INT_OR_NULL,
        "header": {
            "oneOf": [
                {"type": "null"},
                _object(
                    {
                        "key": _STR,
                        "group": _INT,
                        "first_block": _INT,
                        "num_blocks": _INT,
                        "page_bytes": {"type": "array", "items": _INT},
                        "kv_dtype": _STR_OR_NULL,
                        "kv_cache_layout": _STR_OR_NULL,
                        "key_id": _STR_OR_NULL,
                        "body_bytes": _INT,
                    }
                ),
            ]
        },
        "checksum_ok": _BOOL,
        "key_matches": _BOOL,
        "mac": {"enum": ["none", "verified", "unverified", "invalid", "unreadable"]},
        "encryption": {"enum": ["none", "verified", "unverified", "invalid", "unreadable"]},
        "error": _STR_OR_NULL,
        "valid": _BOOL,
    }
)

# A dry run counts the keys ``matching``; a purge the keys ``deleted``.
PURGE = {
    "oneOf": [
        _object(
            {"pattern": _STR, "dry_run": {"const": True}, "matching": _INT, "by_node": _map(_INT)}
        ),
        _object(
            {"pattern": _STR, "dry_run": {"const": False}, "deleted": _INT, "by_node": _map(_INT)}
        ),
    ]
}

# Deadlines are unix seconds; ``remaining_s`` is 0 for a pin past its deadline (the next sweep
# ends it).
PINS = _object(
    {
        "now": _NUM,
        "pins": {
            "type": "array",
            "items": _object(
                {"namespace": _STR, "key": _STR, "deadline": _NUM, "remaining_s": _INT}
            ),
        },
    }
)

# Per namespace: chunks given their TTL back, pins found renewed meanwhile (kept), and members
# that were not chunk keys of the namespace (removed from the set, the keys untouched).
UNPIN = _object(
    {
        "all": _BOOL,
        "namespaces": _map(_object({"unpinned": _INT, "renewed": _INT, "dropped": _INT})),
    }
)

# quota: one tenant (get, set, unset; ``budget_bytes`` null: none set, the tier's default
# applies; -1: none at all), every tenant (ls), or what a reconcile dropped.
_QUOTA_ENTRY = _object(
    {
        "namespace": _STR,
        "tenant": _STR,
        "used_bytes": _INT,
        "budget_bytes": _INT_OR_NULL,
    }
)
QUOTA = {
    "oneOf": [
        _QUOTA_ENTRY,
        _object({"tenants": {"type": "array", "items": _QUOTA_ENTRY}}),
        _object({"namespace": _STR, "dropped": _INT, "freed_bytes": _INT}),
    ]
}

DOCTOR = _object(
    {
        "url": _STR,
        "checks": {
            "type": "array",
            "items": _object(
                {
                    "check": _STR,
                    "verdict": {"enum": ["OK", "WARN", "FAIL", "SKIP"]},
                    "detail": _STR,
                    "node": _STR_OR_NULL,
                }
            ),
        },
        "failed": _BOOL,
    }
)

# What any command prints on stdout under --json when it fails (nothing else is printed).
ERROR = _object({"error": _object({"message": _STR, "exit_code": _INT})})

SCHEMAS: dict[str, dict[str, Any]] = {
    "info": INFO,
    "ls": LS,
    "inspect": INSPECT,
    "purge": PURGE,
    "pins": PINS,
    "unpin": UNPIN,
    "quota": QUOTA,
    "doctor": DOCTOR,
    "error": ERROR,
}


def markdown() -> str:
    """docs/cli-json.md: every schema, as ``python -m hma_redis.tools.cli.schemas`` prints it."""
    parts = [
        "# `hma-redis --json`: one schema per command",
        "",
        "Generated by `python -m hma_redis.tools.cli.schemas > docs/cli-json.md` from",
        "`hma_redis/tools/cli/schemas.py` (JSON Schema, draft 2020-12); the tests validate every",
        "command's output against its schema and fail when this file differs from the code.",
        "Under `--json` a failing command prints the `error` object on stdout (nothing on stderr)",
        "and exits with the code it names. `bench --json` prints the benchmark report's JSON on",
        "stdout (its tables go to stderr); `bench --json FILE` writes it to FILE.",
    ]
    for name, schema in SCHEMAS.items():
        parts += ["", f"## {name}", "", "```json", json.dumps(schema, indent=2), "```"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
