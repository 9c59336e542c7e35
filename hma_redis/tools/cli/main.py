"""``hma-redis``: look at and clean up what hma_redis keeps in Redis.

    hma-redis info [--by-node]          namespaces: fingerprint, sizes per group, counters
    hma-redis ls [--namespace NS]       keys with size and TTL, one SCAN page at a time
    hma-redis inspect KEY               a block's header, checksum and key echo
    hma-redis purge --namespace NS      UNLINK a namespace (or --all) after confirmation
    hma-redis doctor                    is this Redis set up well for a KV-cache tier?
    hma-redis bench [--quick|--smoke]   the tier benchmark (hma_redis.tools.bench.tier)

The connection is configured as the tier's (``--url`` else ``HMA_REDIS_URL`` else ``REDIS_URL``,
validated by :class:`~hma_redis.core.config.RedisTierConfig`): one server, a Redis Cluster (every
master is scanned, sizes are summed; ``--by-node`` shows each master's share) or Sentinel (the
master the sentinels name). The options may come before or after the command. Every Redis
command goes through :class:`~hma_redis.tools.cli.admin.RedisAdmin` and ``doctor`` judges in
:mod:`~hma_redis.tools.cli.doctor`; this module parses arguments and formats. Everything printed
as text passes :func:`~hma_redis.tools.cli.text.printable` (what Redis holds may contain
terminal escape sequences); errors are one line on stderr, with any password redacted, and a
non-zero exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from redis.exceptions import RedisError

from hma_redis.core.codec import (
    CorruptBlockError,
    MacCheck,
    MacKey,
    check_mac,
    decode,
    decode_header,
)
from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.counters import FIELDS as COUNTER_FIELDS
from hma_redis.core.keys import parse_block_key
from hma_redis.core.redis.memory import MemoryRefused, TierMemory
from hma_redis.tools.cli.admin import (
    GroupOrphans,
    GroupUsage,
    KeyEntry,
    NamespaceUsage,
    PurgeRefused,
    PurgeResult,
    RedisAdmin,
)
from hma_redis.tools.cli.doctor import (
    INTERSECTION_SAMPLE,
    Verdict,
    doctor_checks,
    intersection_orphans,
)
from hma_redis.tools.cli.text import memory_text, printable, redis_error_message, scrub, size, table

PROG = "hma-redis"
PASSWORD_ENV = "HMA_REDIS_PASSWORD"
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
LS_LIMIT = 50

_EPILOG = """\
connection: --url, else $HMA_REDIS_URL, else $REDIS_URL, else redis://127.0.0.1:6379/0;
  redis+cluster://host:port[,host:port]/ reaches every master of a Redis Cluster,
  redis+sentinel://host:port[,host:port]/<service> the master the sentinels name;
  prefer $HMA_REDIS_PASSWORD to --password (command lines are visible to other users).
options may be given before or after the command (hma-redis info --json).
exit codes: 0 success; 1 Redis error, a doctor FAIL, an invalid block, a purge cancelled
  or of a namespace without keys; 2 usage or configuration error."""


class StdoutClosed(Exception):
    """Whoever reads our stdout has closed it (``hma-redis info | head -1``)."""


class CliError(Exception):
    """A failure reported as one line on stderr, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and args.command != "bench":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # argparse has printed usage and the error already
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == "bench":
        return _bench(args, rest)
    fail = functools.partial(_fail, as_json=args.json)
    try:
        cfg = build_config(args, os.environ)
    except ValueError as exc:
        return fail(_config_message(exc, args.url is not None), EXIT_USAGE)
    return _run(cfg, args, fail)


def _run(cfg: RedisTierConfig, args: argparse.Namespace, fail: Callable[[str, int], int]) -> int:
    """Run the command ``args`` names against the Redis ``cfg`` names; every failure is one
    message through ``fail``, with its exit code."""
    admin: RedisAdmin | None = None
    try:
        admin = RedisAdmin(cfg)
        handler: Callable[[RedisAdmin, argparse.Namespace], int] = args.handler
        if args.command != "doctor":  # doctor reports it among its checks
            _refuse_one_cluster_master(admin)
        return handler(admin, args)
    except StdoutClosed:
        _silence_stdout()
        return EXIT_OK
    except CliError as exc:
        return fail(scrub(str(exc), cfg), exc.code)
    except PurgeRefused as exc:
        return fail(scrub(str(exc), cfg), EXIT_FAIL)
    except ValueError as exc:  # an option re-validated by RedisTierConfig (e.g. --namespace)
        return fail(_config_message(exc), EXIT_USAGE)
    except (RedisError, OSError) as exc:
        return fail(scrub(redis_error_message(exc, cfg), cfg), EXIT_FAIL)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    finally:
        if admin is not None:
            admin.close()


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line and a hint instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {printable(message)} (see: {self.prog} --help)\n")


def _version() -> str:
    try:
        return importlib.metadata.version("hma_redis")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; the global options are accepted after the command too."""
    parser = _Parser(
        prog=PROG,
        description="Inspect and maintain the hma_redis KV-cache tier in Redis.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    _add_global_options(parser, after_command=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        _add_global_options(cmd, after_command=True)
        return cmd

    info = command("info", "namespaces: fingerprint, keys and bytes per group, counters")
    info.add_argument("--by-node", action="store_true", help="each node's share (Redis Cluster)")
    info.add_argument(
        "--sample",
        type=_positive,
        default=INTERSECTION_SAMPLE,
        help="keys sampled per KV group for the bytes no lookup can use (default: "
        f"{INTERSECTION_SAMPLE}; a group with fewer keys is counted exactly)",
    )
    info.set_defaults(handler=cmd_info)

    ls = command("ls", "keys with size and TTL, one SCAN page at a time")
    ls.add_argument("--namespace", help="only this namespace")
    ls.add_argument(
        "--group", type=_group, metavar="g<N>", help="only this KV group (g1, or just 1)"
    )
    ls.add_argument(
        "--limit",
        type=_positive,
        default=LS_LIMIT,
        help=f"stop after at least N keys (default {LS_LIMIT})",
    )
    ls.add_argument("--cursor", type=_non_negative, default=0, help="continue a previous page")
    ls.set_defaults(handler=cmd_ls)

    inspect = command("inspect", "decode a block's header and verify it")
    inspect.add_argument("key", metavar="KEY")
    inspect.set_defaults(handler=cmd_inspect)

    purge = command("purge", "UNLINK a namespace's keys, or all under the prefix")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", help="the namespace to delete")
    which.add_argument("--all", action="store_true", help="every key under the prefix")
    purge.add_argument("--dry-run", action="store_true", help="only count the keys")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.add_argument("--by-node", action="store_true", help="the count of each node")
    purge.set_defaults(handler=cmd_purge)

    pins_cmd = command("pins", "pinned chunks and their deadlines (kv_transfer_params pins)")
    pins_cmd.add_argument("--namespace", help="only this namespace")
    pins_cmd.set_defaults(handler=cmd_pins)

    unpin = command("unpin", "give pinned chunks their TTL back: ended pins, or every pin")
    unpin.add_argument("--namespace", help="only this namespace (default: every namespace)")
    unpin.add_argument(
        "--ttl",
        type=_positive,
        required=True,
        metavar="SECONDS",
        help="the TTL the chunks get back: the tier's ttl_s",
    )
    unpin.add_argument(
        "--all", action="store_true", help="end every pin, also those before their deadline"
    )
    unpin.add_argument("--yes", action="store_true", help="do not ask for confirmation (--all)")
    unpin.set_defaults(handler=cmd_unpin)

    command("doctor", "check every server's setup for a cache tier").set_defaults(
        handler=cmd_doctor
    )
    # bench's own options (``--json FILE``, --help, ...) are the tier benchmark's; only the
    # connection options are the CLI's.
    bench = sub.add_parser(
        "bench",
        add_help=False,
        allow_abbrev=False,
        help="tier benchmark vs redis-py and redis-benchmark (see hma-redis bench --help)",
    )
    _add_connection_options(bench, after_command=True)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, after_command: bool) -> None:
    _add_connection_options(parser, after_command)
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if after_command else False,
        help="machine-readable output",
    )


def _add_connection_options(parser: argparse.ArgumentParser, after_command: bool) -> None:
    """The connection options; after the command they default to SUPPRESS, so that they do not
    overwrite what was given before it."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if after_command else value

    conn = parser.add_argument_group("connection (as the tier's kv_connector_extra_config)")
    conn.add_argument(
        "--url",
        default=default(None),
        help="redis://, rediss:// (TLS), unix://, redis+cluster:// or redis+sentinel:// URL",
    )
    conn.add_argument("--prefix", default=default("hma"), help="key_prefix (default: hma)")
    conn.add_argument("--username", default=default(None), help="ACL user name")
    conn.add_argument(
        "--password", default=default(None), help=f"password (default: ${PASSWORD_ENV})"
    )
    conn.add_argument("--password-file", default=default(None), help="a file holding the password")
    conn.add_argument(
        "--db", type=int, default=default(None), help="database number (overrides the URL's)"
    )
    conn.add_argument("--tls-ca-file", default=default(None), help="CA bundle for rediss://")
    conn.add_argument(
        "--tls-cert-file", default=default(None), help="client certificate for rediss://"
    )
    conn.add_argument("--tls-key-file", default=default(None), help="client key for rediss://")
    conn.add_argument(
        "--no-tls-verify",
        action="store_true",
        default=default(False),
        help="do not verify the server certificate",
    )
    conn.add_argument(
        "--auth-key-file",
        default=default(None),
        help="the tier's auth_key, to verify MACs (default: $HMA_REDIS_AUTH_KEY)",
    )
    conn.add_argument(
        "--connect-timeout", type=float, default=default(None), help="seconds (default 1)"
    )
    conn.add_argument(
        "--read-timeout", type=float, default=default(None), help="seconds per command (default 2)"
    )


def build_config(args: argparse.Namespace, env: Mapping[str, str]) -> RedisTierConfig:
    """The tier's config from the global options, through the tier's own validation."""
    extra: dict[str, Any] = {"key_prefix": args.prefix}
    if args.url is not None:
        extra["redis_url"] = args.url
    password = args.password
    if password is None and args.password_file is None:
        password = env.get(PASSWORD_ENV)
    options = {
        "username": args.username,
        "password": password or None,
        "password_file": args.password_file,
        "db": args.db,
        "tls_ca_file": args.tls_ca_file,
        "tls_cert_file": args.tls_cert_file,
        "tls_key_file": args.tls_key_file,
        "auth_key_file": args.auth_key_file,
        "connect_timeout_s": args.connect_timeout,
        "read_timeout_s": args.read_timeout,
    }
    extra.update({name: value for name, value in options.items() if value is not None})
    if args.no_tls_verify:
        extra["tls_verify"] = False
    # The CLI's options are never logged, so no warning about credentials in them.
    return RedisTierConfig.from_extra_config(extra, env=env, warn_credentials=False)


# ---------------------------------------------------------------------------------- info


def cmd_info(admin: RedisAdmin, args: argparse.Namespace) -> int:
    usage = admin.usage()
    deployment = admin.deployment()
    memory = admin.memory()
    orphans = {
        name: intersection_orphans(admin, name, ns.info, args.sample)
        for name, ns in usage.namespaces.items()
    }
    pinned = {name: admin.pin_count(name) for name in usage.namespaces}
    if args.json:
        _print_json(
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
                    }
                    for name, ns in usage.namespaces.items()
                ],
                "unrecognized_keys": usage.unrecognized_keys,
            }
        )
        return EXIT_OK
    count = len(usage.namespaces)
    _emit(
        f"{admin.cfg.redacted_url} ({deployment}), prefix {admin.prefix!r}: "
        f"{count} namespace{'' if count == 1 else 's'}"
    )
    _emit(*_memory_lines(memory, admin.kind == "cluster"))
    if usage.unrecognized_keys:
        _emit(f"({usage.unrecognized_keys} other keys under '{admin.prefix}:' are not hma_redis's)")
    for name, ns in usage.namespaces.items():
        _emit("", *namespace_report(ns, usage.nodes if args.by_node else None, orphans[name]))
        if pinned[name]:
            _emit(f"  pinned chunks: {pinned[name]} (hma-redis pins --namespace {name})")
    return EXIT_OK


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
    ("format", "format_version", True),
)
_GROUP_FIELD = re.compile(r"^g(\d+)\.(kind|tokens_per_chunk|layers|page_bytes)$")
_KNOWN_FIELDS = frozenset(
    {name for _, name, _ in _FINGERPRINT_ORDER if name} | set(_PARALLEL) | {"num_groups"}
)
_EMPTY_TEXT = {"auth_key_id": "none (values carry no MAC)"}
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


# ---------------------------------------------------------------------------------- ls


def cmd_ls(admin: RedisAdmin, args: argparse.Namespace) -> int:
    namespace = _checked_namespace(admin, args.namespace)
    pattern = admin.pattern(namespace, args.group)
    page = admin.page(pattern, cursor=args.cursor, limit=args.limit)
    if args.json:
        _print_json(
            {
                "pattern": pattern,
                "keys": [dataclasses.asdict(e) for e in page.entries],
                "cursor": page.cursor,
            }
        )
        return EXIT_OK
    with_node = admin.kind is EndpointKind.CLUSTER
    rows = [_key_row(e, with_node) for e in sorted(page.entries, key=lambda e: e.key)]
    header = ["type", "value bytes", "memory", "ttl", *(["node"] if with_node else []), "key"]
    if rows:
        _emit(*table(header, rows, {1, 2, 3}))
    else:
        _emit(f"no keys matching {pattern!r} in this page")
    if page.cursor:
        _emit(f"next cursor: {page.cursor} (continue with: {_ls_again(args, page.cursor)})")
    else:
        _emit("end of scan (cursor 0)")
    return EXIT_OK


def _ls_again(args: argparse.Namespace, cursor: int) -> str:
    """The ``ls`` command line that shows the next page: the same filters, the next cursor."""
    words = ["ls"]
    if args.namespace is not None:
        words += ["--namespace", shlex.quote(args.namespace)]
    if args.group is not None:
        words += ["--group", f"g{args.group}"]
    if args.limit != LS_LIMIT:
        words += ["--limit", str(args.limit)]
    return " ".join([*words, "--cursor", str(cursor)])


def _key_row(entry: KeyEntry, with_node: bool) -> list[object]:
    return [
        entry.type,
        "-" if entry.value_bytes is None else entry.value_bytes,
        "?" if entry.memory_bytes is None else entry.memory_bytes,
        _ttl_text(entry),
        *([entry.node] if with_node else []),
        entry.key,
    ]


def _ttl_text(entry: KeyEntry) -> str:
    """The ttl column: seconds, ``-`` (none), or a pinned chunk's deadline."""
    if entry.pinned_until is not None:
        left = int(entry.pinned_until - time.time())
        return f"pinned {left}s" if left > 0 else "pinned (ended)"
    return "-" if entry.ttl_s is None else f"{entry.ttl_s}s"


# ---------------------------------------------------------------------------------- inspect


def cmd_inspect(admin: RedisAdmin, args: argparse.Namespace) -> int:
    key: str = args.key
    kind = admin.key_type(key)
    if kind == "none":
        raise CliError(f"no such key: {key}")
    if kind != "string":
        raise CliError(f"{key} is a {kind}, not a block (blocks are strings)")
    value = admin.get(key)
    if value is None:
        raise CliError(f"no such key: {key} (deleted or expired just now)")
    report = inspect_value(key, value, admin.cfg.auth_key)
    report["ttl_s"] = admin.ttl(key)
    if args.json:
        _print_json(report)
    else:
        _print_inspect(report)
    return EXIT_OK if report["valid"] else EXIT_FAIL


def inspect_value(key: str, value: bytes, auth_key: bytes | None = None) -> dict[str, Any]:
    """What ``inspect`` reports about one stored value (no Redis involved): the decoded header,
    checksum, key echo and MAC (verified with ``auth_key``, the tier's shared secret), and
    whether the tier would use the value."""
    report: dict[str, Any] = {"key": key, "value_bytes": len(value)}
    mac_key = MacKey.derive(auth_key) if auth_key is not None else None
    try:
        decode(value, expected_key=key, expected_group=_group_of(key), mac_key=mac_key)
        report["error"] = None
    except CorruptBlockError as exc:
        report["error"] = str(exc)
    report["mac"] = _mac_state(check_mac(value, mac_key), mac_key is not None)
    try:
        header, checksum_ok = decode_header(value)
    except CorruptBlockError:
        report.update(header=None, checksum_ok=False, key_matches=False, valid=False)
        return report
    report["header"] = {
        "key": header.key,
        "group": header.group,
        "first_block": header.first_block,
        "num_blocks": header.num_blocks,
        "page_bytes": list(header.page_bytes),
        "kv_dtype": header.kv_dtype,
        "kv_cache_layout": header.kv_cache_layout,
        "body_bytes": header.body_bytes,
    }
    report["checksum_ok"] = checksum_ok
    report["key_matches"] = header.key == key
    report["valid"] = report["error"] is None
    return report


def _mac_state(check: MacCheck, have_key: bool) -> str:
    """``none`` (written without an auth_key), ``verified`` (checked with the auth_key: it
    matches), ``invalid`` (checked: it does not match; or missing where the key requires one),
    ``unverified`` (a MAC and no auth_key here to check it) or ``unreadable`` (the value's
    prefix cannot be read, so nothing was checked)."""
    if check is MacCheck.ABSENT:
        return "invalid" if have_key else "none"
    return {
        MacCheck.OK: "verified",
        MacCheck.BAD: "invalid",
        MacCheck.UNCHECKED: "unverified",
        MacCheck.UNREADABLE: "unreadable",
    }[check]


def _group_of(key: str) -> int | None:
    parts = parse_block_key(key)
    return None if parts is None else parts.group


_MAC_TEXT = {
    "none": "none (written without an auth_key)",
    "verified": "OK (checked with the auth_key)",
    "unverified": "present, not checked (no auth_key: give it with --auth-key-file or "
    "$HMA_REDIS_AUTH_KEY)",
    "invalid": "BAD (checked with the auth_key: missing, written with another key, or altered)",
    "unreadable": "not checked (decoding stopped before the MAC: the value's prefix is unreadable)",
}


def _print_inspect(report: Mapping[str, Any]) -> None:
    rows: list[tuple[str, object]] = [("key", report["key"])]
    ttl = report["ttl_s"]
    rows.append(("value", f"{report['value_bytes']} bytes, ttl {'-' if ttl is None else ttl}"))
    header = report["header"]
    if header is not None:
        rows += [
            ("header.key", header["key"]),
            ("header.group", header["group"]),
            ("first_block", header["first_block"]),
            ("num_blocks", header["num_blocks"]),
            ("page_bytes", ",".join(str(p) for p in header["page_bytes"])),
            ("kv_dtype", header["kv_dtype"] or "-"),
            ("kv_cache_layout", header["kv_cache_layout"] or "-"),
            ("body_bytes", header["body_bytes"]),
        ]
        rows.append(("checksum", "OK" if report["checksum_ok"] else "MISMATCH"))
        rows.append(("key echo", "OK" if report["key_matches"] else "MISMATCH"))
    else:
        rows.append(("header", "undecodable"))
    rows.append(("mac", _MAC_TEXT[report["mac"]]))
    verdict = "OK: a valid block" if report["valid"] else f"INVALID: {report['error']}"
    rows.append(("verdict", verdict))
    width = max(len(name) for name, _ in rows)
    _emit(*(f"{name:<{width}}  {value}" for name, value in rows))


# ---------------------------------------------------------------------------------- purge


def cmd_purge(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Delete on every node, with the same guards everywhere: the namespace validated as the
    tier validates it, only keys under the prefix, confirmation (or ``--yes``), and every node
    reached before the first key goes."""
    namespace = None if args.all else _checked_namespace(admin, args.namespace)
    pattern = admin.pattern(namespace)
    if args.dry_run:
        matching = admin.purge(namespace, dry_run=True)
        _purge_report(args, pattern, matching, dry_run=True)
        return _purge_exit(namespace, matching)
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError(
                "purge needs --yes when stdin is not a terminal (nothing deleted)", EXIT_USAGE
            )
        matching = admin.purge(namespace, dry_run=True)
        if matching.count == 0:
            _purge_report(args, pattern, matching, dry_run=False)
            return _purge_exit(namespace, matching)
        if not _confirm(
            f"UNLINK {matching.count} keys matching {pattern!r} on {admin.cfg.redacted_url} "
            f"({admin.deployment()})?"
        ):
            raise CliError("purge cancelled (nothing deleted)")
    deleted = admin.purge(namespace)
    _purge_report(args, pattern, deleted, dry_run=False)
    return _purge_exit(namespace, deleted)


def _purge_exit(namespace: str | None, result: PurgeResult) -> int:
    """1 when a named namespace has no key (a typo, or purged already): nothing was there to
    delete; else 0. ``--all`` on an empty prefix is a success."""
    if namespace is not None and result.count == 0:
        print(f"{PROG}: no keys in namespace {printable(namespace)!r}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _confirm(question: str) -> bool:
    print(f"{printable(question)} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _purge_report(
    args: argparse.Namespace, pattern: str, result: PurgeResult, dry_run: bool
) -> None:
    if args.json:
        key = "matching" if dry_run else "deleted"
        _print_json(
            {"pattern": pattern, "dry_run": dry_run, key: result.count, "by_node": result.by_node}
        )
        return
    if dry_run:
        _emit(f"{result.count} keys match {pattern!r} (dry run: nothing deleted)")
    else:
        _emit(f"deleted {result.count} keys matching {pattern!r}")
    if args.by_node:
        rows = [[node, count] for node, count in result.by_node.items()]
        _emit(*table(["node", "keys"], rows, {1}, "  "))


# ---------------------------------------------------------------------------------- pins


def cmd_pins(admin: RedisAdmin, args: argparse.Namespace) -> int:
    namespace = _checked_namespace(admin, args.namespace)
    entries = admin.pins(namespace)
    now = time.time()
    if args.json:
        _print_json(
            {
                "now": now,
                "pins": [
                    {**dataclasses.asdict(e), "remaining_s": max(0, int(e.deadline - now))}
                    for e in entries
                ],
            }
        )
        return EXIT_OK
    if not entries:
        _emit("no pinned chunks")
        return EXIT_OK
    rows = [[_deadline_text(e.deadline, now), e.namespace, e.key] for e in entries]
    _emit(*table(["pinned until", "namespace", "key"], rows, set()))
    return EXIT_OK


def _deadline_text(deadline: float, now: float) -> str:
    """A pin's deadline in UTC, and how long is left (``ended`` once past: the next sweep
    gives the chunk its TTL back)."""
    when = datetime.datetime.fromtimestamp(deadline, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    left = int(deadline - now)
    return f"{when} ({left}s left)" if left > 0 else f"{when} (ended)"


def cmd_unpin(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """End pins like the tier's sweep (past their deadline), or every pin with ``--all``
    (asks first, like ``purge``). Exit 1 when a named namespace has no pins."""
    namespace = _checked_namespace(admin, args.namespace)
    namespaces = admin.pinned_namespaces(namespace)
    if args.all and not args.yes and namespaces:
        if not sys.stdin.isatty():
            raise CliError(
                "unpin --all needs --yes when stdin is not a terminal (nothing changed)",
                EXIT_USAGE,
            )
        count = sum(admin.pin_count(ns) for ns in namespaces)
        if not _confirm(f"end {count} pins in {len(namespaces)} namespace(s)?"):
            raise CliError("unpin cancelled (nothing changed)")
    results = admin.unpin(namespaces, args.ttl, every=args.all)
    if args.json:
        _print_json(
            {
                "all": bool(args.all),
                "namespaces": {
                    ns: {"unpinned": r.expired, "renewed": r.renewed, "dropped": r.dropped}
                    for ns, r in results.items()
                },
            }
        )
    else:
        for ns, r in results.items():
            _emit(f"{ns}: {r.expired} chunks unpinned (TTL {args.ttl}s), {r.renewed} renewed")
            if r.dropped:
                _emit(
                    f"{ns}: {r.dropped} members of the pins set were not chunk keys of the "
                    "namespace: removed from the set, the keys they name left alone"
                )
        if not results:
            _emit("no pinned chunks")
    if namespace is not None and not namespaces:
        print(f"{PROG}: no pins in namespace {printable(namespace)!r}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


# ---------------------------------------------------------------------------------- doctor


def cmd_doctor(admin: RedisAdmin, args: argparse.Namespace) -> int:
    checks = doctor_checks(admin, os.environ)
    failed = any(c.verdict is Verdict.FAIL for c in checks)
    if args.json:
        _print_json(
            {
                "url": admin.cfg.redacted_url,
                "checks": [
                    {
                        "check": c.name,
                        "verdict": c.verdict.value,
                        "detail": c.detail,
                        "node": c.node,
                    }
                    for c in checks
                ],
                "failed": failed,
            }
        )
    else:
        width = max(len(c.name) for c in checks)
        _emit(
            *(
                f"{c.verdict.value:<4}  {c.name:<{width}}  "
                f"{'' if c.node is None else c.node + ': '}{c.detail}"
                for c in checks
            )
        )
    return EXIT_FAIL if failed else EXIT_OK


# ---------------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the tier benchmark; the connection options (``--url``, ``--password``, TLS, ...)
    are the CLI's and reach the benchmark as a config, never on a command line. Any failure is
    one line without the password."""
    from hma_redis.tools.bench import tier

    cfg: RedisTierConfig | None = None
    if args.url is not None:
        try:
            cfg = build_config(args, os.environ)
        except ValueError as exc:
            return _fail(_config_message(exc, args.url is not None), EXIT_USAGE)
    if args.json and not any(arg.split("=")[0] == "--json" for arg in rest):
        rest = [*rest, "--json", "-"]  # hma-redis --json bench: the report's JSON on stdout
    try:
        return tier.main(rest, cfg=cfg)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        message = f"bench: {str(exc.code).removeprefix('bench: ')}"
        return _fail(scrub(message, cfg), EXIT_FAIL)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:
        return _fail(scrub(f"bench: {type(exc).__name__}: {exc}", cfg), EXIT_FAIL)


# ---------------------------------------------------------------------------------- helpers


def _refuse_one_cluster_master(admin: RedisAdmin) -> None:
    """A ``redis://`` URL at one master of a Redis Cluster would show (or purge) that master's
    share as if it were everything: refused, with the URL to use."""
    if not admin.is_one_cluster_master():
        return
    host = admin.nodes()[0].name
    raise CliError(
        f"{admin.cfg.redacted_url} is one master of a Redis Cluster (cluster mode is on): "
        f"use redis+cluster://{host}/ to reach every master",
        EXIT_USAGE,
    )


def _checked_namespace(admin: RedisAdmin, namespace: str | None) -> str | None:
    """``namespace`` validated as the tier validates its ``namespace`` option."""
    if namespace is not None:
        dataclasses.replace(admin.cfg, namespace=namespace)
    return namespace


def _emit(*lines: str) -> None:
    """Print text lines, each through :func:`printable` (the one way text reaches stdout)."""
    for line in lines:
        _write(printable(line))


def _write(text: str) -> None:
    """One line to stdout, flushed; :class:`StdoutClosed` when the reader has gone."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise StdoutClosed from None


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _fail(message: str, code: int, as_json: bool = False) -> int:
    """Report a failure: one line on stderr, or under ``--json`` the error object
    (:data:`~hma_redis.tools.cli.schemas.ERROR`) on stdout; returns ``code``."""
    line = " ".join(message.split())
    if as_json:
        try:
            _print_json({"error": {"message": line, "exit_code": code}})
        except StdoutClosed:
            _silence_stdout()
        return code
    print(f"{PROG}: {printable(line)}", file=sys.stderr)
    return code


# The config keys the CLI's options set, by the option that sets them.
_FLAG_OF_KEY = {
    "key_prefix": "--prefix",
    "username": "--username",
    "password_file": "--password-file",
    "password": "--password",
    "db": "--db",
    "tls_ca_file": "--tls-ca-file",
    "tls_cert_file": "--tls-cert-file",
    "tls_key_file": "--tls-key-file",
    "tls_verify": "--no-tls-verify",
    "auth_key_file": "--auth-key-file",
    "connect_timeout_s": "--connect-timeout",
    "read_timeout_s": "--read-timeout",
    "namespace": "--namespace",
}
# A key the message is about: redis_url anywhere, another key as the message's subject (a word
# like "password" or "db" elsewhere is just a word).
_CONFIG_KEY = re.compile(
    r"\b(redis_url)\b|^(" + "|".join(_FLAG_OF_KEY) + r")(?= (?:must|cannot|does|is|has)\b)"
)


def _config_message(exc: ValueError, url_flag: bool = True) -> str:
    """The tier's validation message with each config key it names written as the CLI option
    that sets it (the URL: ``--url``, or the variable it came from when ``url_flag`` is
    False)."""

    def flag(match: re.Match[str]) -> str:
        key = match.group(1) or match.group(2)
        if key == "redis_url":
            return "--url" if url_flag else "the URL ($HMA_REDIS_URL or $REDIS_URL)"
        return _FLAG_OF_KEY[key]

    return _CONFIG_KEY.sub(flag, str(exc).removeprefix("hma_redis: "))


def _print_json(data: object) -> None:
    # json.dumps escapes every control character (and, ensure_ascii, all non-ASCII).
    _write(json.dumps(data, indent=2))


def _int_or_text(value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _group(text: str) -> int:
    """A KV group as ``info`` and ``ls`` name it (``g1``), or its number (``1``)."""
    match = re.fullmatch(r"g?(\d+)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"a KV group is g<N> (e.g. g1), got {text!r}")
    return int(match.group(1))


def _non_negative(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
