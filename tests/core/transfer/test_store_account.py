"""A store job that names an owner (a tenant, with ``tenant_quotas``) records in the
namespace's account exactly the chunks its ``SET NX`` wrote, with their values' lengths:
never a chunk Redis held already, whether the job asked first (EXISTS) or was told the chunk
was absent and found it there (the SET NX refused); a job without an owner records nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis import quotas
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.kv_pages import KEYSPACE, SRC, Pages, chunks, make_pages

OWNER = "0123456789abcdef"


@pytest.fixture
def rig(redis_client: redis.Redis, redis_url: str) -> Iterator[Pages]:
    cfg = RedisTierConfig.from_extra_config({"redis_url": redis_url, "tenant_quotas": True}, env={})
    store = RedisBlockStore(cfg, quota_space=KEYSPACE)
    pages = make_pages(store)
    yield pages
    pages.close()
    store.close()


def _records(client: redis.Redis) -> dict[str, str]:
    raw = client.hgetall(KEYSPACE.tenants_key())
    return {k.decode(): v.decode() for k, v in raw.items() if not k.startswith(b"=")}


@pytest.mark.parametrize("told_absent", [False, True], ids=["asks-first", "told-absent"])
def test_only_the_chunks_a_job_wrote_are_recorded_for_its_owner(
    rig: Pages, redis_client: redis.Redis, told_absent: bool
) -> None:
    job = chunks(SRC)
    first, rest = job[:1], job[1:]
    assert rig.store_job(1, first).ok  # no owner: written, not recorded
    assert _records(redis_client) == {}
    absent = {c.redis_key for c in job} if told_absent else set()
    submit = lambda jid, c: rig.engine.submit_store(jid, c, absent, owner=OWNER)  # noqa: E731
    assert rig.run(2, submit, job).ok
    sizes = {c.redis_key: int(redis_client.strlen(c.redis_key)) for c in rest}
    assert all(sizes.values())
    assert _records(redis_client) == {key: f"{OWNER} {size}" for key, size in sizes.items()}
    assert quotas.usage(redis_client, KEYSPACE.tenants_key()) == {OWNER: sum(sizes.values())}
