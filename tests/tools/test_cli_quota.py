"""``hma-redis quota`` against a real Redis: budgets set by salt (hashed as the tier hashes it)
or by tenant id, listed with the bytes each tenant holds, unset, and a reconcile that drops the
records of chunks gone; bad input is one line and exit code 2."""

from __future__ import annotations

from typing import Any

import jsonschema
import redis

from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import quotas
from hma_redis.core.tenants import tenant_id
from hma_redis.tools.cli.schemas import SCHEMAS
from tests.support.cli_run import Run, assert_one_line_error

NS = "quota-ns"
KEYSPACE = KeySpace("hma", NS)
TENANT = tenant_id("acme", "hma")


def _valid(run: Run) -> dict[str, Any]:
    assert run.code == 0, run
    data = run.json()
    jsonschema.Draft202012Validator(SCHEMAS["quota"]).validate(data)
    return data


def test_set_get_ls_unset_a_budget(cli, redis_client: redis.Redis) -> None:
    key = KEYSPACE.block_key(0, b"\x01" * 32)
    redis_client.set(key, b"v" * 100)
    quotas.record_stored(redis_client, KEYSPACE.tenants_key(), TENANT, {key: 100})
    data = _valid(cli("--json", "quota", "set", "5000", "--namespace", NS, "--salt", "acme"))
    assert data == {"namespace": NS, "tenant": TENANT, "used_bytes": 100, "budget_bytes": 5000}
    assert "acme" not in str(redis_client.hgetall(KEYSPACE.quotas_key()))
    _valid(cli("--json", "quota", "set", "none", "--namespace", NS, "--tenant", "default"))
    listed = _valid(cli("--json", "quota", "ls"))["tenants"]
    assert {(e["tenant"], e["budget_bytes"]) for e in listed} == {
        (TENANT, 5000),
        ("default", quotas.NO_BUDGET),
    }
    text = cli("quota", "ls")
    assert text.code == 0 and TENANT in text.out and "none" in text.out
    info = cli("--json", "info")
    assert info.code == 0, info
    jsonschema.Draft202012Validator(SCHEMAS["info"]).validate(info.json())
    (ns,) = [n for n in info.json()["namespaces"] if n["namespace"] == NS]
    assert ns["tenants"][TENANT] == {"used_bytes": 100, "budget_bytes": 5000}
    assert TENANT in cli("info").out
    gone = _valid(cli("--json", "quota", "unset", "--namespace", NS, "--tenant", TENANT))
    assert gone["budget_bytes"] is None and gone["used_bytes"] == 100
    redis_client.delete(key)
    dropped = _valid(cli("--json", "quota", "reconcile", "--namespace", NS))
    assert dropped == {"namespace": NS, "dropped": 1, "freed_bytes": 100}
    assert (
        _valid(cli("--json", "quota", "get", "--namespace", NS, "--tenant", TENANT))["used_bytes"]
        == 0
    )


def test_bad_input_is_one_line_and_a_usage_error(cli) -> None:
    for args in (
        ("quota", "set", "lots", "--namespace", NS, "--tenant", TENANT),
        ("quota", "set", "--namespace", NS, "--tenant", TENANT),
        ("quota", "get", "--namespace", NS, "--tenant", "not-an-id"),
        ("quota", "get", "--namespace", NS),
        ("quota", "get", "--tenant", TENANT),
        ("quota", "get", "10", "--namespace", NS, "--tenant", TENANT),
    ):
        run = cli(*args)
        assert run.code == 2, (args, run)
        assert_one_line_error(run)
