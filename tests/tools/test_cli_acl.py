"""The ``hma-redis`` CLI under the ACL users docs/security.md gives (read from the doc itself):
the tier's, an operator's and a read-only one, on a real redis-server."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.cli.main import main
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.cli_run import FINGERPRINT, Run, assert_one_line_error, write_blocks

SECURITY_MD = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def documented_acl_users() -> dict[str, list[str]]:
    """Every ``ACL SETUSER`` line of docs/security.md: {user: rules}, passwords as given."""
    users = {}
    for line in SECURITY_MD.read_text().splitlines():
        match = re.fullmatch(r"ACL SETUSER (\S+) (.+)", line.strip())
        if match:
            users[match.group(1)] = shlex.split(match.group(2))
    return users


def _password(user: str) -> str:
    return f"pw-{user}"


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[tuple[LocalRedis, list[str]]]:
    """A redis-server with the documented users (each password ``pw-<user>``) and one
    namespace of real blocks (3 in group 0, 1 in group 1)."""
    server = LocalRedis().start()
    admin = redis.Redis(port=server.port)
    for user, rules in documented_acl_users().items():
        rules = [f">{_password(user)}" if r.startswith(">") else r for r in rules]
        admin.execute_command("ACL", "SETUSER", user, *rules)
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": server.url}, env={}))
    keys = KeySpace("hma", FINGERPRINT.namespace_id())
    blocks = [str(k) for k in write_blocks(store, keys, [(0, 16), (0, 16), (0, 16), (1, 8)])]
    assert store.write_info(keys.info_key(), FINGERPRINT.info_fields())
    store.close()
    admin.close()
    yield server, blocks
    server.stop()


@pytest.fixture
def cli_as(acl_redis, capsys: pytest.CaptureFixture[str]) -> Any:
    """Run ``hma-redis ARGS`` as one of the documented users."""
    server, _ = acl_redis

    def run(user: str, *args: str) -> Run:
        code = main(["--url", server.url, "--username", user, "--password", _password(user), *args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


def _checks(run: Run) -> dict[str, tuple[str, str]]:
    return {c["check"]: (c["verdict"], c["detail"]) for c in run.json()["checks"]}


def test_security_md_gives_the_tier_an_operator_and_a_read_only_user():
    assert set(documented_acl_users()) == {"hma-tier", "hma-admin", "hma-reader"}


def test_doctor_under_the_tiers_acl_runs_every_check_it_may_and_names_the_rest(cli_as):
    run = cli_as("hma-tier", "--json", "doctor")
    assert run.code == 0, run.err
    checks = _checks(run)
    assert checks["connectivity"][0] == "OK"
    assert checks["scripts"][0] == "OK"
    for name in ("version", "maxmemory", "maxmemory-policy", "evictions"):
        verdict, detail = checks[name]
        assert verdict == "SKIP" and "'info'" in detail and "docs/security.md" in detail
    assert checks["intersection"][0] == "SKIP" and "'scan'" in checks["intersection"][1]


def test_info_and_ls_under_the_tiers_acl_name_the_refused_command(cli_as):
    for command in (["info"], ["ls"]):
        run = cli_as("hma-tier", *command)
        assert_one_line_error(run)
        assert "no permissions to run the 'scan' command" in run.err
        assert "docs/security.md" in run.err


def test_info_without_info_rights_says_why_memory_is_not_shown(acl_redis, cli_as):
    """A reader whose ACL lacks ``+info``: ``info`` works and says why Redis' memory is
    missing, in text and JSON."""
    server, _ = acl_redis
    rules = [r for r in documented_acl_users()["hma-reader"] if r != "+info"]
    rules = [f">{_password('no-info')}" if r.startswith(">") else r for r in rules]
    with redis.Redis(port=server.port) as admin:
        admin.execute_command("ACL", "SETUSER", "no-info", *rules)
    run = cli_as("no-info", "--json", "info")
    assert run.code == 0, run.err
    memory = run.json()["memory"]
    assert (memory["used_bytes"], memory["max_bytes"], memory["by_node"]) == (None, None, {})
    assert "'info'" in memory["not_shown"]
    text = cli_as("no-info", "info")
    assert text.code == 0, text.err
    assert text.out.splitlines()[1].startswith("Redis memory: not shown (")


def test_the_operator_acl_runs_every_command(acl_redis, cli_as):
    _, blocks = acl_redis
    doctor = cli_as("hma-admin", "--json", "doctor")
    assert "SKIP" not in {verdict for verdict, _ in _checks(doctor).values()}, doctor.out
    info = cli_as("hma-admin", "--json", "info")
    assert info.code == 0, info.err
    assert info.json()["namespaces"][0]["total"]["keys"] == 4
    ls = cli_as("hma-admin", "--json", "ls", "--limit", "100")
    assert {e["key"] for e in ls.json()["keys"]} >= set(blocks)
    assert cli_as("hma-admin", "inspect", blocks[0]).code == 0
    dry = cli_as("hma-admin", "--json", "purge", "--all", "--dry-run")
    assert dry.json()["matching"] >= 4


def test_the_read_only_acl_reads_and_cannot_purge(acl_redis, cli_as):
    _, blocks = acl_redis
    doctor = _checks(cli_as("hma-reader", "--json", "doctor"))
    skipped = {name for name, (verdict, _) in doctor.items() if verdict == "SKIP"}
    assert skipped == {"scripts"}, doctor
    assert "'eval'" in doctor["scripts"][1]
    assert cli_as("hma-reader", "info").code == 0
    assert cli_as("hma-reader", "ls").code == 0
    assert cli_as("hma-reader", "inspect", blocks[0]).code == 0
    purge = cli_as("hma-reader", "purge", "--all", "--yes")
    assert_one_line_error(purge)
    assert "no permissions to run the 'unlink' command" in purge.err
    assert redis.Redis(port=acl_redis[0].port).exists(*blocks) == len(blocks)
