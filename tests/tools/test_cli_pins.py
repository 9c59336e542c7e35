"""``hma-redis pins`` / ``unpin``, and pins in ``ls`` and ``info``, against a real Redis."""

from __future__ import annotations

import time
from typing import Any

import jsonschema
import pytest
import redis

from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import pins
from hma_redis.tools.cli.schemas import SCHEMAS
from tests.support.cli_run import Run

NS = "pinned-ns"
KEYSPACE = KeySpace("hma", NS)
TTL_S = 3600


@pytest.fixture
def pinned(redis_client: redis.Redis) -> dict[str, list[str]]:
    """Two chunks whose pin ended, one pinned for 10 minutes, one plain chunk."""
    keys = [KEYSPACE.block_key(0, bytes([i]) * 32) for i in range(4)]
    for key in keys:
        redis_client.set(key, b"v", ex=TTL_S)
    now = time.time()
    pins.pin(redis_client, KEYSPACE.pins_key(), dict.fromkeys(keys[:2], now - 5))
    pins.pin(redis_client, KEYSPACE.pins_key(), {keys[2]: now + 600})
    return {"ended": keys[:2], "lasting": keys[2:3], "plain": keys[3:]}


def _valid(command: str, run: Run) -> dict[str, Any]:
    assert run.code == 0, run
    data = run.json()
    jsonschema.Draft202012Validator(SCHEMAS[command]).validate(data)
    return data


def test_pins_lists_every_pin_with_its_deadline(cli, pinned):
    data = _valid("pins", cli("--json", "pins"))
    by_key = {p["key"]: p for p in data["pins"]}
    assert set(by_key) == {*pinned["ended"], *pinned["lasting"]}
    assert by_key[pinned["lasting"][0]]["remaining_s"] > 590
    assert by_key[pinned["ended"][0]]["remaining_s"] == 0
    text = cli("pins", "--namespace", NS)
    assert text.code == 0 and "(ended)" in text.out and "s left)" in text.out


def test_ls_shows_a_pinned_chunks_deadline_in_its_ttl_column(cli, pinned):
    data = _valid("ls", cli("--json", "ls", "--namespace", NS))
    by_key = {k["key"]: k for k in data["keys"]}
    assert by_key[pinned["lasting"][0]]["pinned_until"] > time.time() + 590
    assert by_key[pinned["lasting"][0]]["ttl_s"] is None
    assert by_key[pinned["plain"][0]]["pinned_until"] is None
    row = next(
        line
        for line in cli("ls", "--namespace", NS).out.splitlines()
        if pinned["lasting"][0] in line
    )
    assert "pinned 59" in row


def test_info_counts_the_pinned_chunks(cli, pinned):
    data = _valid("info", cli("--json", "info"))
    (ns,) = [n for n in data["namespaces"] if n["namespace"] == NS]
    assert ns["pinned_chunks"] == 3
    assert "pinned chunks: 3" in cli("info").out


def test_unpin_ends_only_pins_past_their_deadline(cli, pinned, redis_client):
    data = _valid("unpin", cli("--json", "unpin", "--ttl", str(TTL_S)))
    assert data["namespaces"] == {NS: {"unpinned": 2, "renewed": 0, "dropped": 0}}
    for key in pinned["ended"]:
        assert 0 < redis_client.ttl(key) <= TTL_S
    assert redis_client.ttl(pinned["lasting"][0]) == -1
    assert redis_client.zcard(KEYSPACE.pins_key()) == 1


def test_unpin_all_needs_yes_off_a_terminal_and_then_ends_every_pin(cli, pinned, redis_client):
    refused = cli("unpin", "--all", "--ttl", str(TTL_S))
    assert refused.code == 2 and redis_client.zcard(KEYSPACE.pins_key()) == 3
    done = cli("unpin", "--all", "--yes", "--namespace", NS, "--ttl", "60")
    assert done.code == 0 and "3 chunks unpinned" in done.out
    assert redis_client.zcard(KEYSPACE.pins_key()) == 0
    assert all(0 < redis_client.ttl(k) <= 60 for k in pinned["lasting"])


def test_unpin_of_a_namespace_without_pins_exits_non_zero(cli, redis_client):
    run = cli("unpin", "--namespace", "nothing-here", "--ttl", "60")
    assert run.code == 1 and "no pins in namespace" in run.err


def test_unpin_all_leaves_every_key_but_the_namespaces_chunks_alone_and_says_so(
    cli, pinned, redis_client
):
    other_chunk = KeySpace("hma", "another-ns").block_key(0, b"\x09" * 32)
    redis_client.set(other_chunk, b"theirs")
    redis_client.set("app:session:42", b"session")
    redis_client.hset(KEYSPACE.info_key(), "model", "m")
    foreign = [other_chunk, "app:session:42", KEYSPACE.info_key()]
    redis_client.zadd(KEYSPACE.pins_key(), dict.fromkeys(foreign, time.time() + 600))
    listed = _valid("pins", cli("--json", "pins", "--namespace", NS))
    assert {p["key"] for p in listed["pins"]} == {*pinned["ended"], *pinned["lasting"]}
    run = cli("unpin", "--all", "--yes", "--namespace", NS, "--ttl", "60")
    assert run.code == 0, run
    assert [redis_client.ttl(k) for k in foreign] == [-1, -1, -1]
    assert all(0 < redis_client.ttl(k) <= 60 for k in pinned["lasting"])
    assert "3 members of the pins set were not chunk keys" in run.out
    assert redis_client.zcard(KEYSPACE.pins_key()) == 0


def test_a_pins_member_that_is_not_text_fails_neither_pins_nor_unpin_all(cli, pinned, redis_client):
    redis_client.zadd(KEYSPACE.pins_key(), {b"\xff\xfe": time.time() + 600})
    listed = cli("--json", "pins")
    assert listed.code == 0, listed
    assert len(_valid("pins", listed)["pins"]) == 3
    data = _valid("unpin", cli("--json", "unpin", "--all", "--yes", "--ttl", "60"))
    assert data["namespaces"] == {NS: {"unpinned": 3, "renewed": 0, "dropped": 1}}
    assert redis_client.zcard(KEYSPACE.pins_key()) == 0
