"""``hma-redis quota``: the per-tenant byte budgets (option ``tenant_quotas``) and what each
tenant holds.

    hma-redis quota ls [--namespace NS]                      tenants: bytes held, budget set
    hma-redis quota get --namespace NS (--salt S | --tenant ID)
    hma-redis quota set --namespace NS (--salt S | --tenant ID) BYTES|none
    hma-redis quota unset --namespace NS (--salt S | --tenant ID)
    hma-redis quota reconcile --namespace NS                 drop records of chunks gone

A tenant is a request's ``cache_salt``; Redis knows it only by its tenant id (16 hex digits of a
keyed hash, :func:`~hma_redis.core.tenants.tenant_id`; ``default`` for requests without a salt).
``--salt`` hashes the salt as the tier does (the key prefix, and the ``auth_key`` from
``HMA_REDIS_AUTH_KEY`` when the deployment signs its values), ``--salt -`` reads it from stdin
(a command line is visible to other users). ``set ... none`` exempts the tenant from the
default budget; ``unset`` lets the default apply again. The tier reads the budgets every
``quota_refresh_interval_s``.
"""

from __future__ import annotations

import argparse
import sys

from hma_redis.core.redis.quotas import NO_BUDGET
from hma_redis.core.tenants import is_tenant_id, tenant_id
from hma_redis.tools.cli.admin import RedisAdmin
from hma_redis.tools.cli.options import checked_namespace
from hma_redis.tools.cli.output import EXIT_OK, EXIT_USAGE, CliError, emit, print_json
from hma_redis.tools.cli.text import table

NAME = "quota"
HELP = "per-tenant byte budgets (tenant_quotas) and the bytes each tenant holds"
ACTIONS = ("ls", "get", "set", "unset", "reconcile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ACTION``, ``--namespace``, ``--salt`` / ``--tenant`` and, for ``set``, the budget."""
    parser.add_argument("action", choices=ACTIONS)
    parser.add_argument("budget", nargs="?", help="set: bytes (an integer >= 0), or none")
    parser.add_argument("--namespace", help="the namespace (every one with quotas for ls)")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--salt", help="the tenant's cache_salt ('-': read it from stdin)")
    who.add_argument("--tenant", help="the tenant id (as quota ls shows it), or default")


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Run the action; exit 0 (a usage error raises :class:`CliError` with exit code 2)."""
    namespace = checked_namespace(admin, args.namespace)
    if args.action == "ls":
        return _ls(admin, namespace, args.json)
    if namespace is None:
        raise CliError(f"quota {args.action} needs --namespace", EXIT_USAGE)
    if args.action == "reconcile":
        freed = admin.reconcile_quota(namespace)
        out = {"namespace": namespace, "dropped": freed.records, "freed_bytes": freed.bytes}
        _say(args.json, out, f"dropped {freed.records} records ({freed.bytes} bytes)")
        return EXIT_OK
    tenant = _tenant(admin, args)
    if args.action == "set":
        budget = _budget(args.budget)
        admin.set_quota(namespace, tenant, budget)
    elif args.budget is not None:
        raise CliError(f"quota {args.action} takes no budget", EXIT_USAGE)
    if args.action == "unset":
        admin.unset_quota(namespace, tenant)
    entry = _entry(admin, namespace, tenant)
    _say(args.json, entry, _line(entry))
    return EXIT_OK


def _ls(admin: RedisAdmin, namespace: str | None, as_json: bool) -> int:
    entries = []
    for ns in admin.quota_namespaces(namespace):
        used, budgets = admin.quota_usage(ns), admin.quota_budgets(ns)
        for tenant in sorted(set(used) | set(budgets)):
            entries.append(_row(ns, tenant, used.get(tenant, 0), budgets.get(tenant)))
    if as_json:
        print_json({"tenants": entries})
        return EXIT_OK
    if not entries:
        emit("no tenants accounted and no budgets set")
        return EXIT_OK
    rows = [[e["namespace"], e["tenant"], e["used_bytes"], _budget_text(e)] for e in entries]
    emit(*table(["namespace", "tenant", "used bytes", "budget"], rows, {2}))
    return EXIT_OK


def _entry(admin: RedisAdmin, namespace: str, tenant: str) -> dict[str, object]:
    used = admin.quota_usage(namespace).get(tenant, 0)
    return _row(namespace, tenant, used, admin.quota_budgets(namespace).get(tenant))


def _row(namespace: str, tenant: str, used: int, budget: int | None) -> dict[str, object]:
    """One tenant: ``budget`` None when none is set (the tier's default applies), -1 for
    none at all."""
    return {"namespace": namespace, "tenant": tenant, "used_bytes": used, "budget_bytes": budget}


def _budget_text(entry: dict[str, object]) -> str:
    budget = entry["budget_bytes"]
    if budget is None:
        return "(the default)"
    return "none" if budget == NO_BUDGET else str(budget)


def _line(entry: dict[str, object]) -> str:
    return (
        f"{entry['namespace']} tenant {entry['tenant']}: {entry['used_bytes']} bytes held, "
        f"budget {_budget_text(entry)}"
    )


def _say(as_json: bool, data: dict[str, object], line: str) -> None:
    if as_json:
        print_json(data)
    else:
        emit(line)


def _tenant(admin: RedisAdmin, args: argparse.Namespace) -> str:
    """The tenant id ``--tenant`` names or ``--salt`` hashes to."""
    if args.tenant is not None:
        if not is_tenant_id(args.tenant):
            raise CliError(
                f"--tenant must be 16 hex digits (as quota ls shows) or default, got "
                f"{args.tenant!r:.40}",
                EXIT_USAGE,
            )
        return str(args.tenant)
    if args.salt is None:
        raise CliError(f"quota {args.action} needs --salt or --tenant", EXIT_USAGE)
    salt = sys.stdin.readline().rstrip("\r\n") if args.salt == "-" else args.salt
    return tenant_id(salt, admin.cfg.key_prefix, admin.cfg.tenant_secret)


def _budget(text: str | None) -> int:
    if text is None:
        raise CliError("quota set needs a budget: bytes (an integer >= 0), or none", EXIT_USAGE)
    if text.lower() == "none":
        return NO_BUDGET
    if not text.isdigit():
        raise CliError(f"a budget is bytes (an integer >= 0) or none, got {text!r:.40}", EXIT_USAGE)
    return int(text)
