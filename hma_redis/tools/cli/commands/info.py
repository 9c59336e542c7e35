"""``hma-redis info``: every namespace under the prefix, with its fingerprint (the info hash:
model, dtype, layout, parallel layout, hash, format, one line per KV group), the keys and bytes
of each group, the bytes no lookup can use (values whose chunk another group lacks), pinned
chunks, the bytes each tenant holds and its budget (``tenant_quotas``), each node's share
(``--by-node``) and the tier's counters; and Redis' memory."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hma_redis.core.counters import FIELDS as COUNTER_FIELDS
from hma_redis.core.redis.memory import MemoryRefused, TierMemory
from hma_redis.tools.cli.admin import GroupOrphans, GroupUsage, NamespaceUsage, RedisAdmin
from hma_redis.tools.cli.doctor import INTERSECTION_SAMPLE, intersection_orphans
from hma_redis.tools.cli.options import positive
from hma_redis.tools.cli.output import EXIT_OK, emit, print_json
from hma_redis.tools.cli.text import memory_text, size, table

NAME = "info"
HELP = "namespaces: fingerprint, keys and bytes per group, counters"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--by-node``, ``--sample``."""
    parser.add_argument("--by-node", action="store_true", help="each node's share (Redis Cluster)")
    parser.add_argument(
        "--sample",
        type=positive,
        default=INTERSECTION_SAMPLE,
        help="keys sampled per KV group for the bytes no lookup can use (default: "
        f"{INTERSECTION_SAMPLE}; a group with fewer keys is counted exactly)",
    )


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Report every namespace (as text, or ``--json``); exit 0."""
    usage = admin.usage()
    deployment = admin.deployment()
    memory = admin.memory()
    orphans = {
        name: intersection_orphans(admin, name, ns.info, args.sample)
        for name, ns in usage.namespaces.items()
    }
    pinned = {name: admin.pin_count(name) for name in usage.namespaces}
    tenants = {name: _tenants(admin, name) for name in usage.namespaces}
    if args.json:
        print_json(
            {
                "url": admin.cfg.redacted_url,
                "deployment": deployment,
                "nodes": usage.nodes,
                "prefix": admin.prefix,
                "memory": _memory_json(memory),
                "namespaces": [
                    {
                        **_namespace_json(ns),
                        "unusable": _unusable_json(ns, orphans[name]),
                        "pinned_chunks": pinned[name],
                        "tenants": tenants[name],
                    }
                    for name, ns in usage.namespaces.items()
                ],
                "unrecognized_keys": usage.unrecognized_keys,
            }
        )
        return EXIT_OK
    count = len(usage.namespaces)
    emit(
        f"{admin.cfg.redacted_url} ({deployment}), prefix {admin.prefix!r}: "
        f"{count} namespace{'' if count == 1 else 's'}"
    )
    emit(*_memory_lines(memory, admin.kind == "cluster"))
    if usage.unrecognized_keys:
        emit(f"({usage.unrecognized_keys} other keys under '{admin.prefix}:' are not hma_redis's)")
    for name, ns in usage.namespaces.items():
        emit("", *namespace_report(ns, usage.nodes if args.by_node else None, orphans[name]))
        if pinned[name]:
            emit(f"  pinned chunks: {pinned[name]} (hma-redis pins --namespace {name})")
        emit(*_tenant_lines(name, tenants[name]))
    return EXIT_OK


# Tenants ``info`` shows per namespace (the most bytes first); ``quota ls`` shows every one.
SHOWN_TENANTS = 10


def _tenants(admin: RedisAdmin, namespace: str) -> dict[str, dict[str, int | None]]:
    """Per tenant id: the bytes the account says it holds, and the budget set for it."""
    used, budgets = admin.quota_usage(namespace), admin.quota_budgets(namespace)
    return {
        t: {"used_bytes": used.get(t, 0), "budget_bytes": budgets.get(t)}
        for t in sorted(set(used) | set(budgets))
    }


def _tenant_lines(namespace: str, tenants: Mapping[str, Mapping[str, int | None]]) -> list[str]:
    if not tenants:
        return []
    top = sorted(tenants.items(), key=lambda kv: -(kv[1]["used_bytes"] or 0))[:SHOWN_TENANTS]
    rows = [
        [t, e["used_bytes"], size(e["used_bytes"] or 0), _budget_text(e["budget_bytes"])]
        for t, e in top
    ]
    more = len(tenants) - len(top)
    lines = [f"  tenants: {len(tenants)} (hma-redis quota ls --namespace {namespace})"]
    lines += table(["tenant", "used bytes", "used", "budget"], rows, {1, 2}, indent="    ")
    if more:
        lines.append(f"    ... {more} more")
    return lines


def _budget_text(budget: int | None) -> str:
    if budget is None:
        return "(the default)"
    return "none" if budget < 0 else size(budget)


def _memory_lines(memory: TierMemory | MemoryRefused, per_node: bool) -> list[str]:
    """``info``'s Redis memory: one line; on a Cluster, the total and a table by master."""
    if isinstance(memory, MemoryRefused):
        return [f"Redis memory: not shown ({memory.reason})"]
    lines = [f"Redis memory: {memory_text(memory.used_bytes, memory.max_bytes)}"]
    if per_node:
        rows = [
            [n.node, n.used_bytes, size(n.used_bytes), n.max_bytes, _max_text(n.max_bytes)]
            for n in memory.nodes
        ]
        header = ["node", "used bytes", "used", "max bytes", "max"]
        lines += table(header, rows, right={1, 2, 3, 4}, indent="  ")
    return lines


def _max_text(max_bytes: int) -> str:
    return size(max_bytes) if max_bytes else "no limit"


def _memory_json(memory: TierMemory | MemoryRefused) -> dict[str, Any]:
    """``info --json``'s ``memory``: the sums (as the Prometheus gauges), each node's, or why
    not shown."""
    if isinstance(memory, MemoryRefused):
        return {"used_bytes": None, "max_bytes": None, "by_node": {}, "not_shown": memory.reason}
    return {
        "used_bytes": memory.used_bytes,
        "max_bytes": memory.max_bytes,
        "by_node": {
            n.node: {"used_bytes": n.used_bytes, "max_bytes": n.max_bytes} for n in memory.nodes
        },
        "not_shown": None,
    }


# Fingerprint fields in report order: (label, info-hash field, shown when absent). The model's
# identity first, then the KV bytes' layout, then how keys are made. The parallel layout
# (None) is one line of several fields; groups follow, one line each, then "other": every field
# this version does not know (none is ever dropped).
_PARALLEL = ("tp_size", "pp_size", "dcp_size", "pcp_size", "world_size")
_FINGERPRINT_ORDER: tuple[tuple[str, str | None, bool], ...] = (
    ("model", "model", True),
    ("revision", "revision", True),
    ("quantization", "quantization", False),
    ("model dtype", "model_dtype", False),
    ("model config", "model_config", False),
    ("kv dtype", "kv_dtype", True),
    ("layout", "kv_cache_layout", True),
    ("parallel", None, True),
    ("hash", "hash_algo", True),
    ("auth key", "auth_key_id", False),
    ("encryption key", "encryption_key_id", False),
    ("format", "format_version", True),
)
_GROUP_FIELD = re.compile(r"^g(\d+)\.(kind|tokens_per_chunk|layers|page_bytes)$")
_KNOWN_FIELDS = frozenset(
    {name for _, name, _ in _FINGERPRINT_ORDER if name} | set(_PARALLEL) | {"num_groups"}
)
_EMPTY_TEXT = {
    "auth_key_id": "none (values carry no MAC)",
    "encryption_key_id": "none (values are not encrypted)",
}
_LAYERS_SHOWN = 4


def namespace_report(
    ns: NamespaceUsage,
    nodes: Sequence[str] | None = None,
    orphans: Mapping[int, GroupOrphans] | str | None = None,
) -> list[str]:
    """``info``'s text for one namespace: the fingerprint in a fixed order (model, revision,
    dtype, layout, parallel layout, hash, format, one line per group, then any field this
    version does not know), the sizes table, the bytes no lookup can use (``orphans`` given:
    per group, or why not estimated), each node's share (``nodes`` given) and the counters."""
    lines = [f"namespace {ns.namespace}"]
    lines += (
        _fingerprint_lines(ns.info)
        if ns.info
        else ["  (no info hash: fingerprint unknown, e.g. evicted)"]
    )
    lines.append("")
    lines += _sizes_table(ns)
    if isinstance(orphans, Mapping) and orphans:
        lines += ["", *_unusable_table(ns, orphans)]
    if ns.other_keys:
        lines.append(f"  ({ns.other_keys} other keys in this namespace)")
    if nodes is not None:
        lines.append("")
        lines += _nodes_table(ns.by_node, nodes)
    if ns.stats:
        stats = _ordered_counters(ns.stats)
        width = max(len(k) for k in stats)
        lines += ["", "  counters", *(f"    {k:<{width}}  {v}" for k, v in stats.items())]
    return lines


def _fingerprint_lines(info: Mapping[str, str]) -> list[str]:
    rows: list[tuple[str, str]] = []
    for label, name, always in _FINGERPRINT_ORDER:
        if name is not None and name not in info and not always:
            continue
        value = _parallel_layout(info) if name is None else info.get(name, "")
        empty = "(not recorded)" if always else _EMPTY_TEXT.get(name or "", "-")
        rows.append((label, value or empty))
    for group in _group_indices(info):
        rows.append((f"g{group}", _group_line(info, group)))
    width = max(len(label) for label, _ in rows)
    lines = [f"  {label:<{width}}  {value}" for label, value in rows]
    other = {k: v for k, v in info.items() if k not in _KNOWN_FIELDS and not _GROUP_FIELD.match(k)}
    if other:
        key_width = max(len(k) for k in other)
        lines.append("  other")
        lines += [f"    {k:<{key_width}}  {other[k] or '-'}" for k in sorted(other)]
    return lines


def _parallel_layout(info: Mapping[str, str]) -> str:
    sizes = [
        f"{name.removesuffix('_size')} {info[name]}" for name in _PARALLEL[:-1] if name in info
    ]
    if "world_size" in info:
        sizes.append(f"world size {info['world_size']}")
    return ", ".join(sizes)


def _group_indices(info: Mapping[str, str]) -> list[int]:
    """Groups the info hash describes: ``num_groups`` of them and any ``g<N>.`` field."""
    seen = {int(m.group(1)) for k in info if (m := _GROUP_FIELD.match(k))}
    declared = info.get("num_groups", "")
    if declared.isdigit():
        seen |= set(range(int(declared)))
    return sorted(seen)


def _group_line(info: Mapping[str, str], group: int) -> str:
    """One group of the fingerprint: attention kind, chunk size, layers, page sizes."""
    kind = info.get(f"g{group}.kind")
    parts = [attention_kind(kind) if kind else "attention kind not recorded"]
    if kind is not None and _is_unrecorded_kind(kind):
        parts[0] += " (attention kind not recorded)"
    tokens = info.get(f"g{group}.tokens_per_chunk")
    if tokens:
        parts.append(f"{tokens} tokens per chunk")
    layers = [name for name in info.get(f"g{group}.layers", "").split(",") if name]
    if layers:
        shown = layers if len(layers) <= _LAYERS_SHOWN else [layers[0], "...", layers[-1]]
        parts.append(f"{len(layers)} layer{'' if len(layers) == 1 else 's'} ({', '.join(shown)})")
    pages = [p for p in info.get(f"g{group}.page_bytes", "").split(",") if p]
    if len(pages) > 1 and len(set(pages)) == 1:
        parts.append(f"page bytes {len(pages)} x {pages[0]}")
    elif pages:
        parts.append(f"page bytes {','.join(pages)}")
    return ", ".join(parts)


def attention_kind(kind: str) -> str:
    """A group's ``g<N>.kind`` for people: ``full_attention`` -> ``full attention``,
    ``sliding_window:512`` -> ``sliding window 512``; anything else as recorded."""
    if kind in ("full", "full_attention"):
        return "full attention"
    name, _, arg = kind.partition(":")
    if name == "sliding_window" and arg:
        return f"sliding window {arg}"
    return kind


def _is_unrecorded_kind(kind: str) -> bool:
    """Namespaces written before kinds were recorded say ``kv_group_<N>``."""
    return re.fullmatch(r"kv_group_\d+", kind) is not None


def _sizes_table(ns: NamespaceUsage) -> list[str]:
    rows: list[list[object]] = []
    for group, usage in sorted(ns.groups.items()):
        kind = ns.info.get(f"g{group}.kind")
        rows.append([f"g{group}", attention_kind(kind) if kind else "?", *_size_cells(usage)])
    rows.append(["total", "", *_size_cells(ns.total)])
    header = ["group", "attention", "keys", "value bytes", "size", "memory"]
    return table(header, rows, right={2, 3, 4, 5}, indent="  ")


def unusable_bytes(usage: GroupUsage, orphans: GroupOrphans) -> int:
    """The group's value bytes no lookup can use: exact when every key was sampled, else the
    sample's share scaled to the group."""
    if orphans.sampled_keys >= usage.keys:
        return orphans.orphaned_bytes
    return round(usage.value_bytes * orphans.fraction)


def _unusable_table(ns: NamespaceUsage, orphans: Mapping[int, GroupOrphans]) -> list[str]:
    rows: list[list[object]] = []
    for group, found in sorted(orphans.items()):
        usage = ns.groups.get(group, GroupUsage())
        lost = unusable_bytes(usage, found)
        sampled = "all" if found.sampled_keys >= usage.keys else f"{found.sampled_keys}"
        share = f"{lost / usage.value_bytes:.0%}" if usage.value_bytes else "-"
        rows.append([f"g{group}", lost, size(lost), share, f"{sampled} of {usage.keys} keys"])
    header = ["group", "unusable bytes", "size", "share", "sampled"]
    title = "  unusable: values whose chunk another group lacks (no lookup can use them)"
    return [title, *table(header, rows, right={1, 2, 3}, indent="  ")]


def _unusable_json(ns: NamespaceUsage, orphans: Mapping[int, GroupOrphans] | str) -> dict[str, Any]:
    """Per group the values no lookup can use (``groups``), or why not estimated."""
    if isinstance(orphans, str):
        return {"groups": {}, "not_estimated": orphans}
    out: dict[str, Any] = {}
    for group, found in sorted(orphans.items()):
        usage = ns.groups.get(group, GroupUsage())
        out[str(group)] = {
            "unusable_bytes": unusable_bytes(usage, found),
            "sampled_keys": found.sampled_keys,
            "keys": usage.keys,
            "sampled_unusable_keys": found.orphaned_keys,
        }
    return {"groups": out, "not_estimated": None}


def _nodes_table(by_node: Mapping[str, GroupUsage], nodes: Sequence[str]) -> list[str]:
    rows = [[node, *_size_cells(by_node.get(node, GroupUsage()))] for node in nodes]
    return table(["node", "keys", "value bytes", "size", "memory"], rows, {1, 2, 3, 4}, "  ")


def _size_cells(usage: GroupUsage) -> list[object]:
    return [usage.keys, usage.value_bytes, size(usage.value_bytes), size(usage.memory_bytes)]


def _namespace_json(ns: NamespaceUsage) -> dict[str, Any]:
    return {
        "namespace": ns.namespace,
        "info": ns.info,
        "groups": {str(g): dataclasses.asdict(u) for g, u in sorted(ns.groups.items())},
        "total": dataclasses.asdict(ns.total),
        "by_node": {node: dataclasses.asdict(u) for node, u in sorted(ns.by_node.items())},
        "other_keys": ns.other_keys,
        "stats": {k: _int_or_text(v) for k, v in _ordered_counters(ns.stats).items()},
    }


def _ordered_counters(stats: Mapping[str, str]) -> dict[str, str]:
    """Known counters in their documented order, then any others by name."""
    known = [k for k in COUNTER_FIELDS if k in stats]
    extra = sorted(k for k in stats if k not in COUNTER_FIELDS)
    return {k: stats[k] for k in known + extra}


def _int_or_text(value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value
