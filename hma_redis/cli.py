"""``hma-redis``: look at and clean up what hma_redis keeps in Redis.

    hma-redis info                      namespaces, fingerprints, sizes per group, counters
    hma-redis ls [--namespace NS]       keys with size and TTL, one SCAN page at a time
    hma-redis inspect KEY               a block's header, checksum and key echo
    hma-redis purge --namespace NS      UNLINK a namespace (or --all) after confirmation
    hma-redis doctor                    is this Redis set up well for a KV-cache tier?
    hma-redis bench [--quick|--smoke]   the tier benchmark (hma_redis.bench_tier)

The connection is configured as the tier's (``--url`` else ``HMA_REDIS_URL`` else ``REDIS_URL``,
validated by :class:`~hma_redis.config.RedisTierConfig`). Every Redis command goes through
:class:`~hma_redis.admin.RedisAdmin`; this module parses arguments, judges and formats. Errors
are one line on stderr, with any password redacted, and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import (
    AuthenticationError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hma_redis.admin import KeyEntry, NamespaceUsage, RedisAdmin
from hma_redis.codec import CorruptBlockError, decode, decode_header
from hma_redis.config import RedisTierConfig
from hma_redis.counters import FIELDS as COUNTER_FIELDS
from hma_redis.keys import parse_block_key

PROG = "hma-redis"
PASSWORD_ENV = "HMA_REDIS_PASSWORD"
MIN_REDIS_VERSION = (7, 0)
# A median PING above this makes the once-per-step lookup round trip show in scheduling time.
SLOW_PING_S = 0.005
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

_EPILOG = """\
connection: --url, else $HMA_REDIS_URL, else $REDIS_URL, else redis://127.0.0.1:6379/0;
  prefer $HMA_REDIS_PASSWORD to --password (command lines are visible to other users).
exit codes: 0 success; 1 Redis error, a doctor FAIL or an invalid block; 2 usage or
  configuration error."""


class CliError(Exception):
    """A failure reported as one line on stderr, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


class Verdict(Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One line of ``doctor``."""

    name: str
    verdict: Verdict
    detail: str


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
    try:
        cfg = build_config(args, os.environ)
    except ValueError as exc:
        return _fail(_config_message(exc), EXIT_USAGE)
    admin: RedisAdmin | None = None
    try:
        admin = RedisAdmin(cfg)
        handler: Callable[[RedisAdmin, argparse.Namespace], int] = args.handler
        return handler(admin, args)
    except CliError as exc:
        return _fail(_scrub(str(exc), cfg), exc.code)
    except ValueError as exc:  # an option re-validated by RedisTierConfig (e.g. --namespace)
        return _fail(_config_message(exc), EXIT_USAGE)
    except (RedisError, OSError) as exc:
        return _fail(_scrub(redis_error_message(exc, cfg), cfg), EXIT_FAIL)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    finally:
        if admin is not None:
            admin.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and maintain the hma_redis KV-cache tier in Redis.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conn = parser.add_argument_group("connection (as the tier's kv_connector_extra_config)")
    conn.add_argument("--url", help="redis://, rediss:// (TLS) or unix:// URL")
    conn.add_argument("--prefix", default="hma", help="key_prefix (default: hma)")
    conn.add_argument("--username", help="ACL user name")
    conn.add_argument("--password", help=f"password (default: ${PASSWORD_ENV})")
    conn.add_argument("--db", type=int, help="database number (overrides the URL's)")
    conn.add_argument("--tls-ca-file", help="CA bundle for rediss://")
    conn.add_argument("--tls-cert-file", help="client certificate for rediss://")
    conn.add_argument("--tls-key-file", help="client key for rediss://")
    conn.add_argument(
        "--no-tls-verify", action="store_true", help="do not verify the server certificate"
    )
    conn.add_argument("--connect-timeout", type=float, help="seconds (default 1)")
    conn.add_argument("--read-timeout", type=float, help="seconds per command (default 2)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "info", help="namespaces: fingerprint, keys and bytes per group, counters"
    ).set_defaults(handler=cmd_info)

    ls = sub.add_parser("ls", help="keys with size and TTL, one SCAN page at a time")
    ls.add_argument("--namespace", help="only this namespace")
    ls.add_argument("--group", type=_non_negative, help="only this KV group (g<N>)")
    ls.add_argument(
        "--limit", type=_positive, default=50, help="stop after at least N keys (default 50)"
    )
    ls.add_argument("--cursor", type=_non_negative, default=0, help="continue a previous page")
    ls.set_defaults(handler=cmd_ls)

    inspect = sub.add_parser("inspect", help="decode a block's header and verify it")
    inspect.add_argument("key", metavar="KEY")
    inspect.set_defaults(handler=cmd_inspect)

    purge = sub.add_parser("purge", help="UNLINK a namespace's keys, or all under the prefix")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", help="the namespace to delete")
    which.add_argument("--all", action="store_true", help="every key under the prefix")
    purge.add_argument("--dry-run", action="store_true", help="only count the keys")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(handler=cmd_purge)

    sub.add_parser("doctor", help="check the server's setup for a cache tier").set_defaults(
        handler=cmd_doctor
    )
    sub.add_parser(
        "bench",
        add_help=False,
        help="tier benchmark vs redis-py and redis-benchmark (args go to hma_redis.bench_tier)",
    )
    return parser


def build_config(args: argparse.Namespace, env: Mapping[str, str]) -> RedisTierConfig:
    """The tier's config from the global options, through the tier's own validation."""
    extra: dict[str, Any] = {"key_prefix": args.prefix}
    if args.url is not None:
        extra["redis_url"] = args.url
    password = args.password if args.password is not None else env.get(PASSWORD_ENV)
    options = {
        "username": args.username,
        "password": password or None,
        "db": args.db,
        "tls_ca_file": args.tls_ca_file,
        "tls_cert_file": args.tls_cert_file,
        "tls_key_file": args.tls_key_file,
        "connect_timeout_s": args.connect_timeout,
        "read_timeout_s": args.read_timeout,
    }
    extra.update({name: value for name, value in options.items() if value is not None})
    if args.no_tls_verify:
        extra["tls_verify"] = False
    return RedisTierConfig.from_extra_config(extra, env=env)


# ---------------------------------------------------------------------------------- info


def cmd_info(admin: RedisAdmin, args: argparse.Namespace) -> int:
    usage = admin.usage()
    if args.json:
        _print_json(
            {
                "url": admin.cfg.redacted_url,
                "prefix": admin.prefix,
                "namespaces": [_namespace_json(ns) for ns in usage.namespaces.values()],
                "unrecognized_keys": usage.unrecognized_keys,
            }
        )
        return EXIT_OK
    count = len(usage.namespaces)
    print(
        f"{admin.cfg.redacted_url}, prefix {admin.prefix!r}: "
        f"{count} namespace{'' if count == 1 else 's'}"
    )
    if usage.unrecognized_keys:
        print(f"({usage.unrecognized_keys} other keys under '{admin.prefix}:' are not hma_redis's)")
    for ns in usage.namespaces.values():
        print()
        print("\n".join(_namespace_lines(ns)))
    return EXIT_OK


def _namespace_lines(ns: NamespaceUsage) -> list[str]:
    lines = [f"namespace {ns.namespace}"]
    if ns.info:
        width = max(len(k) for k in ns.info)
        lines += [f"  {k:<{width}}  {v}".rstrip() for k, v in ns.info.items()]
    else:
        lines.append("  (no info hash: fingerprint unknown, e.g. evicted)")
    rows: list[list[object]] = []
    for group, g in sorted(ns.groups.items()):
        kind = ns.info.get(f"g{group}.kind", "")
        rows.append(
            [f"g{group}", kind, g.keys, g.value_bytes, _size(g.value_bytes), _size(g.memory_bytes)]
        )
    total = ns.total
    rows.append(
        [
            "total",
            "",
            total.keys,
            total.value_bytes,
            _size(total.value_bytes),
            _size(total.memory_bytes),
        ]
    )
    header = ["group", "kind", "keys", "value bytes", "size", "memory"]
    lines.append("")
    lines += _table(header, rows, right={2, 3, 4, 5}, indent="  ")
    if ns.other_keys:
        lines.append(f"  ({ns.other_keys} other keys in this namespace)")
    if ns.stats:
        lines.append("")
        lines.append("  counters")
        stats = _ordered_counters(ns.stats)
        width = max(len(k) for k in stats)
        lines += [f"    {k:<{width}}  {v}" for k, v in stats.items()]
    return lines


def _namespace_json(ns: NamespaceUsage) -> dict[str, Any]:
    return {
        "namespace": ns.namespace,
        "info": ns.info,
        "groups": {str(g): dataclasses.asdict(u) for g, u in sorted(ns.groups.items())},
        "total": dataclasses.asdict(ns.total),
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
    rows = [_key_row(e) for e in sorted(page.entries, key=lambda e: e.key)]
    if rows:
        print("\n".join(_table(["type", "value bytes", "memory", "ttl", "key"], rows, {1, 2, 3})))
    else:
        print(f"no keys matching {pattern!r} in this page")
    if page.cursor:
        print(f"next cursor: {page.cursor} (continue with: ls --cursor {page.cursor})")
    else:
        print("end of scan (cursor 0)")
    return EXIT_OK


def _key_row(entry: KeyEntry) -> list[object]:
    return [
        entry.type,
        "-" if entry.value_bytes is None else entry.value_bytes,
        "?" if entry.memory_bytes is None else entry.memory_bytes,
        "-" if entry.ttl_s is None else f"{entry.ttl_s}s",
        entry.key,
    ]


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
    report = inspect_value(key, value)
    report["ttl_s"] = admin.ttl(key)
    if args.json:
        _print_json(report)
    else:
        _print_inspect(report)
    return EXIT_OK if report["valid"] else EXIT_FAIL


def inspect_value(key: str, value: bytes) -> dict[str, Any]:
    """What ``inspect`` reports about one stored value (no Redis involved)."""
    report: dict[str, Any] = {"key": key, "value_bytes": len(value)}
    try:
        decode(value, expected_key=key, expected_group=_group_of(key))
        report["error"] = None
    except CorruptBlockError as exc:
        report["error"] = str(exc)
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
        "body_bytes": header.body_bytes,
    }
    report["checksum_ok"] = checksum_ok
    report["key_matches"] = header.key == key
    report["valid"] = report["error"] is None
    return report


def _group_of(key: str) -> int | None:
    parts = parse_block_key(key)
    return None if parts is None else parts.group


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
            ("body_bytes", header["body_bytes"]),
        ]
        rows.append(("checksum", "OK" if report["checksum_ok"] else "MISMATCH"))
        rows.append(("key echo", "OK" if report["key_matches"] else "MISMATCH"))
    else:
        rows.append(("header", "undecodable"))
    verdict = "OK: a valid block" if report["valid"] else f"INVALID: {report['error']}"
    rows.append(("verdict", verdict))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


# ---------------------------------------------------------------------------------- purge


def cmd_purge(admin: RedisAdmin, args: argparse.Namespace) -> int:
    namespace = None if args.all else _checked_namespace(admin, args.namespace)
    pattern = admin.pattern(namespace)
    if args.dry_run:
        _purge_report(args, pattern, admin.purge(namespace, dry_run=True), dry_run=True)
        return EXIT_OK
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError(
                "purge needs --yes when stdin is not a terminal (nothing deleted)", EXIT_USAGE
            )
        matching = admin.purge(namespace, dry_run=True)
        if matching == 0:
            _purge_report(args, pattern, 0, dry_run=False)
            return EXIT_OK
        if not _confirm(
            f"UNLINK {matching} keys matching {pattern!r} on {admin.cfg.redacted_url}?"
        ):
            raise CliError("purge cancelled (nothing deleted)")
    _purge_report(args, pattern, admin.purge(namespace), dry_run=False)
    return EXIT_OK


def _confirm(question: str) -> bool:
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _purge_report(args: argparse.Namespace, pattern: str, count: int, dry_run: bool) -> None:
    if args.json:
        key = "matching" if dry_run else "deleted"
        _print_json({"pattern": pattern, "dry_run": dry_run, key: count})
    elif dry_run:
        print(f"{count} keys match {pattern!r} (dry run: nothing deleted)")
    else:
        print(f"deleted {count} keys matching {pattern!r}")


# ---------------------------------------------------------------------------------- doctor


def cmd_doctor(admin: RedisAdmin, args: argparse.Namespace) -> int:
    checks = doctor_checks(admin, os.environ)
    failed = any(c.verdict is Verdict.FAIL for c in checks)
    if args.json:
        _print_json(
            {
                "url": admin.cfg.redacted_url,
                "checks": [
                    {"check": c.name, "verdict": c.verdict.value, "detail": c.detail}
                    for c in checks
                ],
                "failed": failed,
            }
        )
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.verdict.value:<4}  {c.name:<{width}}  {c.detail}")
    return EXIT_FAIL if failed else EXIT_OK


def doctor_checks(admin: RedisAdmin, env: Mapping[str, str]) -> list[Check]:
    """Every check, in order; the server checks only when PING succeeds."""
    cfg = admin.cfg
    checks = [_check_auth(cfg), _check_transport(cfg), _check_hash_seed(env)]
    try:
        times = admin.ping_seconds()
    except RedisError as exc:
        detail = _scrub(redis_error_message(exc, cfg), cfg) + " (server checks skipped)"
        return [*checks, Check("connectivity", Verdict.FAIL, detail)]
    median = statistics.median(times)
    verdict = Verdict.WARN if median > SLOW_PING_S else Verdict.OK
    checks.append(
        Check("connectivity", verdict, f"PING {median * 1e3:.2f} ms (median of {len(times)})")
    )
    server = admin.info("server")
    memory = admin.info("memory")
    checks += [
        _check_version(str(server.get("redis_version", "0"))),
        _check_script_flags(admin),
        _check_cluster(admin.info("cluster")),
        _check_maxmemory(memory),
        _check_policy(admin, str(memory.get("maxmemory_policy", "?"))),
        _check_evictions(admin.info("stats"), admin.info("errorstats")),
        _check_persistence(admin),
    ]
    return checks


def _check_auth(cfg: RedisTierConfig) -> Check:
    if cfg.password:
        user = cfg.username or "default"
        return Check("auth", Verdict.OK, f"password set (ACL user {user!r})")
    if _is_local(cfg.url):
        return Check("auth", Verdict.OK, "no password (local server)")
    return Check("auth", Verdict.WARN, "no password for a non-local server")


def _check_transport(cfg: RedisTierConfig) -> Check:
    scheme = urlsplit(cfg.url).scheme
    if scheme == "unix":
        return Check("tls", Verdict.OK, "unix socket")
    if not cfg.tls:
        return Check("tls", Verdict.OK, f"not in use ({scheme}://; use rediss:// for TLS)")
    if not cfg.tls_verify:
        return Check("tls", Verdict.WARN, "TLS without certificate verification")
    return Check("tls", Verdict.OK, "TLS, server certificate verified")


def _check_hash_seed(env: Mapping[str, str]) -> Check:
    seed = env.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return Check(
            "PYTHONHASHSEED",
            Verdict.WARN,
            "unset here: instances using --prefix-caching-hash-algo xxhash must all set the "
            "same value (e.g. 0) to share blocks; irrelevant for sha256",
        )
    return Check("PYTHONHASHSEED", Verdict.OK, f"{seed} (use the same value on every instance)")


def _check_version(version: str) -> Check:
    try:
        parsed = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return Check("version", Verdict.WARN, f"cannot parse redis_version {version!r}")
    if parsed < MIN_REDIS_VERSION:
        return Check(
            "version",
            Verdict.FAIL,
            f"Redis {version}: hma_redis needs >= 7.0 (lookups use '#!lua flags=' scripts)",
        )
    return Check("version", Verdict.OK, f"Redis {version}")


def _check_script_flags(admin: RedisAdmin) -> Check:
    try:
        admin.probe_script_flags()
    except ResponseError as exc:
        return Check("scripts", Verdict.FAIL, f"EVAL of a '#!lua flags=' script refused: {exc}")
    return Check("scripts", Verdict.OK, "EVAL with '#!lua flags=' works (lookups need it)")


def _check_cluster(cluster: Mapping[str, Any]) -> Check:
    if int(cluster.get("cluster_enabled", 0)):
        return Check(
            "cluster",
            Verdict.FAIL,
            "cluster mode is on: hma_redis connects with a single-node client",
        )
    return Check("cluster", Verdict.OK, "standalone")


def _check_maxmemory(memory: Mapping[str, Any]) -> Check:
    limit = int(memory.get("maxmemory", 0))
    used = int(memory.get("used_memory", 0))
    if limit == 0:
        return Check(
            "maxmemory",
            Verdict.WARN,
            f"0 (unbounded; {_size(used)} used): the cache grows until the host runs out "
            "of memory; set maxmemory to ~1.25 x the KV bytes to keep",
        )
    return Check("maxmemory", Verdict.OK, f"{_size(limit)} ({used / limit:.0%} used)")


def _check_policy(admin: RedisAdmin, policy: str) -> Check:
    if policy in ("allkeys-lru", "allkeys-lfu"):
        return Check("maxmemory-policy", Verdict.OK, policy)
    if policy.startswith("volatile-"):
        sampled = [
            e for e in admin.page(admin.pattern(), limit=100).entries if parse_block_key(e.key)
        ]
        if sampled and all(e.ttl_s is not None for e in sampled):
            return Check("maxmemory-policy", Verdict.OK, f"{policy}; the sampled blocks have a TTL")
        return Check(
            "maxmemory-policy",
            Verdict.WARN,
            f"{policy} only evicts keys with a TTL: set ttl_s, or use allkeys-lru",
        )
    return Check(
        "maxmemory-policy",
        Verdict.WARN,
        f"{policy}: use allkeys-lru or allkeys-lfu for a cache tier"
        + (" (a full Redis refuses new blocks)" if policy == "noeviction" else ""),
    )


def _check_evictions(stats: Mapping[str, Any], errorstats: Mapping[str, Any]) -> Check:
    evicted = int(stats.get("evicted_keys", 0))
    oom = errorstats.get("errorstat_OOM", {})
    refused = int(oom.get("count", 0)) if isinstance(oom, Mapping) else 0
    if refused:
        return Check(
            "evictions",
            Verdict.WARN,
            f"{refused} writes refused for lack of memory (OOM); {evicted} keys evicted",
        )
    return Check("evictions", Verdict.OK, f"{evicted} keys evicted since the server started")


def _check_persistence(admin: RedisAdmin) -> Check:
    save = admin.config_get("save")
    appendonly = admin.config_get("appendonly")
    if save is None or appendonly is None:
        return Check("persistence", Verdict.WARN, "CONFIG GET refused: cannot tell")
    on = []
    if save.strip():
        on.append(f"RDB snapshots (save {save!r})")
    if appendonly == "yes":
        on.append("AOF (appendonly yes)")
    if on:
        return Check(
            "persistence",
            Verdict.WARN,
            " and ".join(on) + ": persisting a cache tier costs disk I/O and fork time",
        )
    return Check("persistence", Verdict.OK, "off (right for a cache)")


def _is_local(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    """Forward to the store benchmark; an explicit global ``--url`` is passed along."""
    from hma_redis import bench_store

    forwarded = list(rest)
    if args.url is not None and "--url" not in forwarded:
        forwarded += ["--url", args.url]
    try:
        bench_store.main(forwarded)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        return _fail(f"bench: {str(exc.code).removeprefix('bench: ')}", EXIT_FAIL)
    except (RedisError, OSError) as exc:
        return _fail(f"bench: {type(exc).__name__}: {exc}", EXIT_FAIL)
    return EXIT_OK


# ---------------------------------------------------------------------------------- helpers


def redis_error_message(exc: BaseException, cfg: RedisTierConfig) -> str:
    """One line saying what went wrong talking to Redis (the URL redacted)."""
    url = cfg.redacted_url
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AuthenticationError):
        return f"Redis at {url} refused the credentials: {detail}"
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
        return f"cannot reach Redis at {url}: {detail}"
    if isinstance(exc, ResponseError):
        return f"Redis at {url} answered with an error: {exc}"
    return f"Redis error at {url}: {detail}"


def _checked_namespace(admin: RedisAdmin, namespace: str | None) -> str | None:
    """``namespace`` validated as the tier validates its ``namespace`` option."""
    if namespace is not None:
        dataclasses.replace(admin.cfg, namespace=namespace)
    return namespace


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    return code


def _config_message(exc: ValueError) -> str:
    return str(exc).removeprefix("hma_redis: ")


def _scrub(text: str, cfg: RedisTierConfig) -> str:
    """Belt and braces: no message may carry the password, whatever produced it."""
    return text.replace(cfg.password, "***") if cfg.password else text


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2))


def _int_or_text(value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value


def _size(n: int) -> str:
    """Bytes for people: 1023 B, 1.0 KiB, 512.1 KiB, 1.3 MiB, ..."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _table(
    header: Sequence[str], rows: Sequence[Sequence[object]], right: set[int], indent: str = ""
) -> list[str]:
    """Aligned columns; ``right`` holds the indices of right-aligned (numeric) columns."""
    cells = [list(header), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
