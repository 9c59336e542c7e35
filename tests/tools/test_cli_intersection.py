"""``hma-redis info`` / ``doctor`` on what the intersection over KV groups leaves unusable, and
on keyspace notifications (removal events), against a real Redis (issue 14, parts 1-2)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace, RedisKey
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.cli_run import FINGERPRINT, write_blocks

NS = FINGERPRINT.namespace_id()  # two groups of 256 tokens per chunk


@pytest.fixture
def store(redis_url: str, redis_client: redis.Redis) -> Iterator[RedisBlockStore]:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    assert store.write_info(KeySpace("hma", NS).info_key(), FINGERPRINT.info_fields())
    yield store
    store.close()


def _write(store: RedisBlockStore, group: int, serials: range) -> list[RedisKey]:
    """One real chunk of ``group`` per serial (the serial is its block hash)."""
    keys = KeySpace("hma", NS)
    written = write_blocks(store, keys, [(group, 4)] * len(serials))
    # write_blocks numbers chunks from 0: rename them to the serials asked for, through
    # temporary names (a direct rename could land on a key not yet renamed and replace it).
    out = []
    for index, key in enumerate(written):
        store.client.rename(key, f"{key}.tmp{index}")
    for index, (key, serial) in enumerate(zip(written, serials, strict=True)):
        target = keys.block_key(group, serial.to_bytes(32, "big"))
        store.client.rename(f"{key}.tmp{index}", target)
        out.append(target)
    return out


def _unusable_rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["group", "unusable"])
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells
    return rows


def test_info_shows_per_group_bytes_no_lookup_can_use(
    store: RedisBlockStore, redis_client: redis.Redis, cli: Any
) -> None:
    """Group 0 (full attention) holds chunks 0-5, group 1 (sliding window) only 0-1: the four
    full-attention chunks past the last sliding-window chunk can never be a usable hit."""
    full = _write(store, 0, range(6))
    _write(store, 1, range(2))
    lost = sum(redis_client.strlen(k) for k in full[2:])

    run = cli("info")
    assert run.code == 0, run.err
    rows = _unusable_rows(run.out)
    assert rows["g0"][1] == str(lost) and rows["g0"][4] == "all of 6 keys"
    assert rows["g1"][1] == "0"

    data = cli("--json", "info").json()
    (mine,) = [ns for ns in data["namespaces"] if ns["namespace"] == NS]
    assert mine["unusable"]["groups"]["0"] == {
        "unusable_bytes": lost,
        "sampled_keys": 6,
        "keys": 6,
        "sampled_unusable_keys": 4,
    }
    assert mine["unusable"]["groups"]["1"]["unusable_bytes"] == 0


def test_info_samples_big_groups_and_says_how_many(
    store: RedisBlockStore, redis_client: redis.Redis, cli: Any
) -> None:
    """600 chunks in group 0, half of them in group 1: a sample of ~200 keys estimates the
    unusable bytes (about half; the bounds are > 5 standard deviations of a 200-key sample, so
    the test does not depend on which keys SCAN happens to return first) and the sample size
    is shown."""
    _write(store, 0, range(600))
    _write(store, 1, range(0, 600, 2))
    data = cli("--json", "info", "--sample", "200").json()
    (mine,) = [ns for ns in data["namespaces"] if ns["namespace"] == NS]
    g0 = mine["unusable"]["groups"]["0"]
    assert 200 <= g0["sampled_keys"] < 600 and g0["keys"] == 600
    share = g0["unusable_bytes"] / mine["groups"]["0"]["value_bytes"]
    assert 0.3 < share < 0.7
    text = cli("info", "--sample", "200").out
    assert f"{g0['sampled_keys']} of 600 keys" in text


def _checks(cli: Any) -> dict[str, dict[str, str]]:
    data = cli("--json", "doctor").json()
    return {c["check"]: c for c in data["checks"]}


def test_doctor_recommends_a_retention_interval_when_the_intersection_loses_much(
    store: RedisBlockStore, cli: Any
) -> None:
    _write(store, 0, range(8))
    _write(store, 1, range(2))
    check = _checks(cli)["intersection"]
    assert check["verdict"] == "WARN"
    assert "--prefix-cache-retention-interval 256" in check["detail"]
    assert NS in check["detail"]


def test_doctor_is_content_when_every_group_holds_the_same_chunks(
    store: RedisBlockStore, cli: Any
) -> None:
    _write(store, 0, range(4))
    _write(store, 1, range(4))
    check = _checks(cli)["intersection"]
    assert check["verdict"] == "OK" and "0%" in check["detail"]


def test_doctor_says_when_keyspace_notifications_are_off(
    redis_client: redis.Redis, cli: Any
) -> None:
    redis_client.config_set("notify-keyspace-events", "")
    check = _checks(cli)["notifications"]
    assert check["verdict"] == "WARN"
    assert "CONFIG SET notify-keyspace-events Kgxe" in check["detail"]
    redis_client.config_set("notify-keyspace-events", "AK")
    try:
        assert _checks(cli)["notifications"]["verdict"] == "OK"
    finally:
        redis_client.config_set("notify-keyspace-events", "")
