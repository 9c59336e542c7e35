"""``hma-redis doctor``: is this Redis set up well for a KV-cache tier?

:func:`doctor_checks` judges the client's setup, the deployment (sentinels, cluster masters) and
every server in turn; each verdict is a :class:`Check`. Every Redis command goes through
:class:`~hma_redis.tools.cli.admin.RedisAdmin`; printing is
:mod:`hma_redis.tools.cli.commands.doctor`'s.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from redis.exceptions import NoPermissionError, RedisError, ResponseError

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.keys import parse_block_key
from hma_redis.core.redis.breaker import MISSING_PASSWORD, needs_password
from hma_redis.core.redis.memory import NodeMemory
from hma_redis.core.redis.notifications import NEEDED_FLAGS, missing_flags
from hma_redis.tools.cli.admin import CLUSTER_SLOTS, GroupOrphans, NodeAdmin, RedisAdmin
from hma_redis.tools.cli.text import ACL_HINT, memory_text, redis_error_message, scrub

MIN_REDIS_VERSION = (7, 0)
# A median PING above this makes the once-per-step lookup round trip show in scheduling time.
SLOW_PING_S = 0.005
# Keys sampled per KV group to estimate what the intersection over groups leaves unusable.
INTERSECTION_SAMPLE = 1000
# Above this share of sampled bytes unusable, doctor recommends a prefix-cache retention interval.
INTERSECTION_LOSS_WARN = 0.25


class Verdict(Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"  # not run: the CLI's ACL user may not run a command the check needs


@dataclass(frozen=True)
class Check:
    """One line of ``doctor``; ``node`` names the server it is about (cluster, sentinel)."""

    name: str
    verdict: Verdict
    detail: str
    node: str | None = None


def doctor_checks(admin: RedisAdmin, env: Mapping[str, str]) -> list[Check]:
    """Every check, in order: the client's setup, the deployment (sentinels, cluster masters),
    then every server in turn (its checks only when it answers PING)."""
    cfg = admin.cfg
    checks = [_check_auth(cfg), _check_transport(cfg), _check_hash_seed(env)]
    if admin.kind is EndpointKind.SENTINEL:
        checks.append(_check_sentinels(admin))
    try:
        nodes = admin.nodes()
    except RedisError as exc:
        return [*_auth_judged_by(exc, checks[:1]), *checks[1:], _unreachable(cfg, exc)]
    if admin.kind is EndpointKind.CLUSTER:
        names = ", ".join(node.name for node in nodes)
        checks.append(Check("masters", Verdict.OK, f"{len(nodes)} in the slot map: {names}"))
    for node in nodes:
        label = None if admin.kind is EndpointKind.SINGLE else node.name
        checks += [dataclasses.replace(c, node=label) for c in _node_checks(admin, node)]
    if all(c.name != "connectivity" or c.verdict is not Verdict.FAIL for c in checks):
        checks += _intersection_checks(admin)
    return _one_auth_verdict(checks)


def _one_auth_verdict(checks: list[Check]) -> list[Check]:
    """``checks`` whose first (the client's auth setup) gives way to a server's FAIL."""
    refused = any(c.name == "auth" and c.verdict is Verdict.FAIL for c in checks[1:])
    return checks[1:] if refused else checks


def _unreachable(cfg: RedisTierConfig, exc: BaseException) -> Check:
    detail = scrub(redis_error_message(exc, cfg), cfg) + " (server checks skipped)"
    return Check("connectivity", Verdict.FAIL, detail)


def _node_checks(admin: RedisAdmin, node: NodeAdmin) -> list[Check]:
    """The checks of one server; only connectivity when it does not answer."""
    try:
        times = node.ping_seconds()
    except RedisError as exc:
        return [*_auth_judged_by(exc, []), _unreachable(admin.cfg, exc)]
    median = statistics.median(times)
    verdict = Verdict.WARN if median > SLOW_PING_S else Verdict.OK
    checks = [
        Check("connectivity", verdict, f"PING {median * 1e3:.2f} ms (median of {len(times)})")
    ]
    return [*checks, *(_allowed(name, check) for name, check in _server_checks(admin, node))]


def _server_checks(admin: RedisAdmin, node: NodeAdmin) -> list[tuple[str, Callable[[], Check]]]:
    """The checks of a server that answers PING, by name, each run by :func:`_allowed`."""
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("version", lambda: _check_version(str(node.info("server").get("redis_version", "0")))),
        ("scripts", lambda: _check_script_flags(node)),
        ("cluster", lambda: _check_cluster(admin, node)),
    ]
    if admin.kind is EndpointKind.SENTINEL:
        steps.append(("role", lambda: _check_role(admin, node.info("replication"))))
    return [
        *steps,
        ("maxmemory", lambda: _check_maxmemory(node.memory())),
        (
            "maxmemory-policy",
            lambda: _check_policy(
                admin, node, str(node.info("memory").get("maxmemory_policy", "?"))
            ),
        ),
        ("evictions", lambda: _check_evictions(node.info("stats"), node.info("errorstats"))),
        ("persistence", lambda: _check_persistence(node)),
        ("notifications", lambda: _check_notifications(node)),
    ]


def _allowed(name: str, check: Callable[[], Check]) -> Check:
    """``check()``; a SKIP naming the command when the ACL user may not run one it needs."""
    try:
        return check()
    except NoPermissionError as exc:
        return _skipped(name, exc)


def _skipped(name: str, exc: NoPermissionError) -> Check:
    return Check(name, Verdict.SKIP, f"not run: {exc} ({ACL_HINT})")


def _check_auth(cfg: RedisTierConfig) -> Check:
    if cfg.password:
        user = cfg.username or "default"
        return Check("auth", Verdict.OK, f"password set (ACL user {user!r})")
    if _is_local(cfg):
        return Check("auth", Verdict.OK, "no password (local server)")
    return Check("auth", Verdict.WARN, "no password for a non-local server")


def _auth_judged_by(exc: BaseException, checks: list[Check]) -> list[Check]:
    """``checks`` with an auth FAIL first (in place of any auth verdict) when ``exc`` is a
    server asking for the password the client did not give (a local server may want one)."""
    if not needs_password(exc):
        return checks
    failed = Check("auth", Verdict.FAIL, MISSING_PASSWORD)
    return [failed, *(c for c in checks if c.name != "auth")]


def _check_transport(cfg: RedisTierConfig) -> Check:
    scheme = cfg.endpoint.scheme
    if scheme == "unix":
        return Check("tls", Verdict.OK, "unix socket")
    if not cfg.tls:
        secure = scheme.replace("redis", "rediss", 1)
        return Check("tls", Verdict.OK, f"not in use ({scheme}://; use {secure}:// for TLS)")
    if not cfg.tls_verify:
        return Check("tls", Verdict.WARN, "TLS without certificate verification")
    return Check("tls", Verdict.OK, "TLS, server certificate verified")


# Seeds anyone would guess first: with xxhash prefix hashes they let a tenant craft collisions.
_WELL_KNOWN_SEEDS = frozenset({"0", "1", "42", "1234", "12345"})


def _check_hash_seed(env: Mapping[str, str]) -> Check:
    """The seed is a secret when it matters (xxhash prefix hashes): never printed."""
    seed = env.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return Check(
            "PYTHONHASHSEED",
            Verdict.OK,
            "unset: right for vLLM's default sha256 prefix hash; with --prefix-caching-hash-algo "
            "xxhash every instance needs the same secret value",
        )
    if seed in _WELL_KNOWN_SEEDS:
        return Check(
            "PYTHONHASHSEED",
            Verdict.WARN,
            "set to a well-known value: with xxhash prefix hashes a tenant can craft colliding "
            "prefixes; use sha256 (vLLM's default) or a secret random seed (docs/security.md)",
        )
    return Check(
        "PYTHONHASHSEED", Verdict.OK, "set (not shown); it must be the same on every instance"
    )


def _check_sentinels(admin: RedisAdmin) -> Check:
    """Do the URL's sentinels answer, and agree on the master?"""
    service = admin.cfg.endpoint.service
    answers = admin.sentinel_answers()
    named = {a.master for a in answers if a.master is not None}
    silent = [f"{a.sentinel} ({a.error})" for a in answers if a.master is None]
    if not named:
        return Check(
            "sentinels", Verdict.FAIL, f"none names a master for {service!r}: {'; '.join(silent)}"
        )
    if len(named) > 1:
        return Check(
            "sentinels",
            Verdict.WARN,
            f"they disagree on the master of {service!r}: {', '.join(sorted(named))} "
            "(a failover in progress?)",
        )
    master = named.pop()
    detail = f"{len(answers) - len(silent)}/{len(answers)} name {master} master of {service!r}"
    if silent:
        return Check("sentinels", Verdict.WARN, f"{detail}; no answer from {'; '.join(silent)}")
    return Check("sentinels", Verdict.OK, detail)


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


def _check_script_flags(node: NodeAdmin) -> Check:
    try:
        node.probe_script_flags()
    except NoPermissionError:
        raise  # the CLI's user may not run EVAL: says nothing of the tier's
    except ResponseError as exc:
        return Check("scripts", Verdict.FAIL, f"EVAL of a '#!lua flags=' script refused: {exc}")
    return Check("scripts", Verdict.OK, "EVAL with '#!lua flags=' works (lookups need it)")


def _check_cluster(admin: RedisAdmin, node: NodeAdmin) -> Check:
    """Cluster mode matches the URL; on a cluster, this master sees every slot served."""
    enabled = bool(int(node.info("cluster").get("cluster_enabled", 0)))
    if admin.kind is not EndpointKind.CLUSTER:
        if enabled:
            return Check(
                "cluster",
                Verdict.FAIL,
                "cluster mode is on: use a redis+cluster://host:port/ URL (a single-node "
                "client is answered MOVED for most keys)",
            )
        return Check("cluster", Verdict.OK, "standalone")
    if not enabled:
        return Check("cluster", Verdict.FAIL, "cluster mode is off on a redis+cluster:// node")
    info = node.cluster_info()
    state = info.get("cluster_state", "?")
    assigned = int(info.get("cluster_slots_assigned", 0))
    failing = int(info.get("cluster_slots_fail", 0))
    pfail = int(info.get("cluster_slots_pfail", 0))
    detail = (
        f"cluster_state:{state}, {assigned}/{CLUSTER_SLOTS} slots assigned, {failing} failed, "
        f"{pfail} possibly failing, {info.get('cluster_known_nodes', '?')} known nodes"
    )
    if state != "ok" or assigned < CLUSTER_SLOTS or failing:
        return Check("cluster", Verdict.FAIL, detail + ": keys in uncovered slots cannot be used")
    if pfail:
        return Check("cluster", Verdict.WARN, detail)
    return Check("cluster", Verdict.OK, detail)


def _check_role(admin: RedisAdmin, replication: Mapping[str, Any]) -> Check:
    """Sentinel: the server the sentinels name is a master, and has a replica to fail over to."""
    role = str(replication.get("role", "?"))
    service = admin.cfg.endpoint.service
    if role != "master":
        return Check("role", Verdict.FAIL, f"named master of {service!r} but its role is {role}")
    replicas = int(replication.get("connected_slaves", 0))
    if replicas == 0:
        return Check(
            "role", Verdict.WARN, f"master of {service!r} with no connected replica to fail over to"
        )
    return Check("role", Verdict.OK, f"master of {service!r}, {replicas} connected replica(s)")


def _check_maxmemory(memory: NodeMemory) -> Check:
    """A limit is set (the figures as ``info`` and the memory gauges give them)."""
    shown = memory_text(memory.used_bytes, memory.max_bytes)
    if memory.max_bytes == 0:
        return Check(
            "maxmemory",
            Verdict.WARN,
            f"{shown}: the cache grows until the host runs out of memory; set maxmemory to "
            "~1.25 x the KV bytes to keep",
        )
    return Check("maxmemory", Verdict.OK, shown)


def _check_policy(admin: RedisAdmin, node: NodeAdmin, policy: str) -> Check:
    if policy in ("allkeys-lru", "allkeys-lfu"):
        return Check(
            "maxmemory-policy", Verdict.OK, f"{policy} (pinning needs volatile-lru/lfu and ttl_s)"
        )
    if policy.startswith("volatile-"):
        sampled = [
            e for e in admin.with_pins(node.sample(admin.pattern(), 100)) if parse_block_key(e.key)
        ]
        # A pinned chunk has no TTL on purpose (pins need volatile-*).
        if sampled and all(e.ttl_s is not None or e.pinned_until is not None for e in sampled):
            return Check(
                "maxmemory-policy",
                Verdict.OK,
                f"{policy}; the sampled blocks have a TTL or are pinned (pins work)",
            )
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


def _check_persistence(node: NodeAdmin) -> Check:
    save = node.config_get("save")
    appendonly = node.config_get("appendonly")
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


def _check_notifications(node: NodeAdmin) -> Check:
    """Removal events (routers) need keyspace notifications for evicted, expired, deleted keys."""
    flags = node.config_get("notify-keyspace-events")
    if flags is None:
        return Check(
            "notifications",
            Verdict.WARN,
            "CONFIG GET refused: cannot tell whether keyspace notifications are on; removal "
            f"events need notify-keyspace-events to include {NEEDED_FLAGS!r}",
        )
    missing = missing_flags(flags)
    if missing:
        return Check(
            "notifications",
            Verdict.WARN,
            f"notify-keyspace-events is {flags!r}, without {missing!r}: routers get no removal "
            "events (evicted, expired chunks) unless the tier may CONFIG SET them at start-up; "
            f"else set: CONFIG SET notify-keyspace-events {flags + missing}",
        )
    return Check("notifications", Verdict.OK, f"notify-keyspace-events {flags!r}: removals seen")


def namespace_groups(info: Mapping[str, str]) -> tuple[list[int], int] | str:
    """The KV groups of a namespace and their common tokens per chunk, from its info hash; a
    reason (text) when the intersection cannot be estimated from key names."""
    if not info:
        return "no info hash (fingerprint unknown)"
    groups = list(range(int(info.get("num_groups", "0") or 0)))
    if len(groups) < 2:
        return "one KV group: every hit is usable"
    chunks = {info.get(f"g{g}.tokens_per_chunk") for g in groups}
    if len(chunks) != 1 or None in chunks:
        return "groups with different chunk sizes (their chunks do not share keys)"
    return groups, int(next(iter(chunks)) or 0)


def intersection_orphans(
    admin: RedisAdmin, namespace: str, info: Mapping[str, str], sample: int
) -> dict[int, GroupOrphans] | str:
    """Per group, a sample of its values and those no lookup can use (another group lacks
    their chunk); a reason (text) when not estimated."""
    found = namespace_groups(info)
    if isinstance(found, str):
        return found
    return admin.orphans(namespace, found[0], sample)


def _intersection_checks(admin: RedisAdmin) -> list[Check]:
    """One check per hybrid namespace: how much of what it stores no lookup can use."""
    try:
        infos = admin.namespace_infos()
    except NoPermissionError as exc:
        return [_skipped("intersection", exc)]
    checks = []
    for namespace, info in infos.items():
        found = namespace_groups(info)
        if isinstance(found, str):
            continue
        try:
            orphans = admin.orphans(namespace, found[0], INTERSECTION_SAMPLE)
        except NoPermissionError as exc:
            checks.append(_skipped("intersection", exc))
            continue
        checks.append(_check_intersection(namespace, orphans, info, found[1]))
    return checks


def _check_intersection(
    namespace: str, orphans: Mapping[int, GroupOrphans], info: Mapping[str, str], chunk: int
) -> Check:
    sampled = sum(o.sampled_bytes for o in orphans.values())
    lost = sum(o.orphaned_bytes for o in orphans.values())
    keys = sum(o.sampled_keys for o in orphans.values())
    if not sampled:
        return Check("intersection", Verdict.OK, f"{namespace}: no values yet")
    share = lost / sampled
    worst = max(orphans.values(), key=lambda o: o.fraction)
    kind = info.get(f"g{worst.group}.kind", "?")
    detail = (
        f"{namespace}: {share:.0%} of the sampled value bytes ({keys} keys) no lookup can use "
        f"(another KV group lacks the chunk); worst g{worst.group} ({kind}) {worst.fraction:.0%}"
    )
    if share < INTERSECTION_LOSS_WARN:
        return Check("intersection", Verdict.OK, detail)
    return Check(
        "intersection",
        Verdict.WARN,
        detail + f": start vLLM with --prefix-cache-retention-interval {chunk} (the tier's "
        "tokens per chunk) so sliding-window layers keep a checkpoint at every chunk",
    )


def _is_local(cfg: RedisTierConfig) -> bool:
    """Every server (or sentinel) the URL names is on this host."""
    if cfg.endpoint.socket_path is not None:
        return True
    return all(_is_loopback(host) for host, _ in cfg.endpoint.hosts)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
