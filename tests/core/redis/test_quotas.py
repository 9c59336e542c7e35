"""The per-tenant byte account against a real Redis: it counts only the chunks a store wrote,
takes each removal off once however many instances hear it, and stays equal to the bytes the
tenants' chunks really hold under eviction, expiry, FLUSHALL, lost notifications and a restart
from a snapshot (once the removals heard are applied and a reconcile pass has run: the bound
docs/operations.md states); budgets come from the config and the operator's hash."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import quotas
from hma_redis.core.redis.notifications import RemovalWatcher
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.tenants import DEFAULT_TENANT, is_tenant_id, tenant_id
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port

KEYSPACE = KeySpace("hma", "quota")
VALUE = 64 * 1024
A = tenant_id("salt-a", "hma")
B = tenant_id("salt-b", "hma")


def _store(url: str) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": url, "tenant_quotas": True, "read_timeout_s": 1.0}, env={}
    )
    return RedisBlockStore(cfg, quota_space=KEYSPACE)


def _key(i: int) -> str:
    return KEYSPACE.block_key(0, i.to_bytes(32, "big"))


class _Tier:
    """Chunks stored the way a worker stores them (SET NX, then its account), and the truth:
    the bytes each tenant's chunks hold in Redis now."""

    def __init__(self, client: redis.Redis, store: RedisBlockStore) -> None:
        self.client = client
        self.store = store
        self.owner: dict[str, str] = {}

    def put(self, tenant: str, ids: range, ttl_s: int | None = None, size: int = VALUE) -> int:
        """Store chunks ``ids`` for ``tenant``; how many were written (not there before)."""
        written = [k for k in map(_key, ids) if self.client.set(k, b"x" * size, nx=True, ex=ttl_s)]
        self.store.account_stored(tenant, written, [size] * len(written))
        for key in written:
            self.owner[key] = tenant
        return len(written)

    def truth(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, tenant in self.owner.items():
            size = int(self.client.strlen(key))
            if size:
                out[tenant] = out.get(tenant, 0) + size
        return out

    def account(self) -> dict[str, int]:
        return quotas.usage(self.client, KEYSPACE.tenants_key())


@pytest.fixture
def tier(redis_client: redis.Redis, redis_url: str) -> Iterator[_Tier]:
    store = _store(redis_url)
    yield _Tier(redis_client, store)
    store.close()


def _until(what: str, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _apply_removals(watcher: RemovalWatcher, store: RedisBlockStore) -> int:
    removed, _overflowed = watcher.drain()
    freed = store.account_removed([k for k in removed if KEYSPACE.is_block_key(k)])
    assert freed is not None
    return freed.records


def test_tenant_ids_are_keyed_hashes_never_the_salt() -> None:
    assert is_tenant_id(A) and len(A) == 16 and "salt" not in A
    assert tenant_id("salt-a", "hma") == A != tenant_id("salt-a", "other-prefix")
    assert tenant_id("salt-a", "hma", b"k" * 32) != A  # an auth_key keys it too
    assert tenant_id(None, "hma") == tenant_id("", "hma") == DEFAULT_TENANT


def test_only_chunks_a_store_wrote_are_counted_and_each_removal_is_taken_off_once(
    tier: _Tier,
) -> None:
    assert tier.put(A, range(5)) == 5
    assert tier.put(B, range(10, 13)) == 3
    assert tier.put(A, range(5)) == 0  # existed: not counted again
    assert tier.account() == {A: 5 * VALUE, B: 3 * VALUE}
    tier.client.delete(_key(0), _key(1), _key(10))
    gone = [_key(0), _key(1), _key(10)]
    # Every instance's watcher hears every removal: only the first application counts.
    assert tier.store.account_removed(gone) == quotas.Freed(3, 3 * VALUE)
    assert tier.store.account_removed(gone) == quotas.Freed(0, 0)
    assert tier.account() == tier.truth() == {A: 3 * VALUE, B: 2 * VALUE}
    # A chunk stored anew before its old removal is applied keeps its (new) record.
    tier.client.delete(_key(2))
    tier.put(B, range(2, 3))
    assert tier.store.account_removed([_key(2)]) == quotas.Freed(0, 0)
    assert tier.account() == tier.truth() == {A: 2 * VALUE, B: 3 * VALUE}


def test_the_account_follows_eviction_and_expiry_through_notifications() -> None:
    server = LocalRedis(
        extra_args=["--maxmemory", "3mb", "--maxmemory-policy", "volatile-lru"]
    ).start()
    store = _store(server.url)
    watcher = RemovalWatcher(store.cfg, KEYSPACE.block_pattern()).start()
    try:
        assert watcher.wait_subscribed(10.0)
        with redis.Redis(port=server.port) as client:
            tier = _Tier(client, store)
            tier.put(A, range(0, 60), ttl_s=3600)  # ~3.8 MiB: Redis evicts some
            tier.put(B, range(100, 110), ttl_s=1)  # these expire
            evicted = 70 - sum(1 for k in tier.owner if client.exists(k))
            assert evicted > 0
            time.sleep(1.5)
            _until(
                "expiry of B's chunks",
                lambda: not any(client.exists(_key(i)) for i in range(100, 110)),
            )
            applied = 0

            def settled() -> bool:
                nonlocal applied
                applied += _apply_removals(watcher, store)
                return tier.account() == tier.truth()

            _until("the account to equal the truth", settled)
            assert B not in tier.account() and tier.account()[A] > 0
            assert applied >= evicted
    finally:
        watcher.close()
        store.close()
        server.stop()


def test_flushall_empties_the_account_with_the_chunks(tier: _Tier) -> None:
    tier.put(A, range(4))
    tier.client.flushall()
    assert tier.account() == tier.truth() == {}
    tier.put(A, range(4))
    assert tier.account() == {A: 4 * VALUE}


def test_removals_nobody_heard_are_found_by_the_reconcile(tier: _Tier) -> None:
    tier.put(A, range(quotas.RECONCILE_BATCH + 40), size=100)  # more than one round
    tier.put(B, range(1000, 1005), size=100)
    for i in range(0, 40, 2):
        tier.client.delete(_key(i))  # no watcher: lost notifications
    # A record that names no chunk of the namespace (written by hand, say): dropped too.
    quotas.record_stored(tier.client, KEYSPACE.tenants_key(), A, {"hma:quota:info": 5})
    assert tier.account() != tier.truth()
    freed = quotas.reconcile(tier.client, KEYSPACE)
    assert freed.records == 21
    assert tier.account() == tier.truth()


def test_a_restart_from_a_snapshot_is_reconciled_to_the_truth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    args = ["--save", "3600 1", "--dir", str(tmp_path)]
    server = LocalRedis(port=port, extra_args=args).start()
    try:
        store = _store(server.url)
        with redis.Redis(port=port) as client:
            tier = _Tier(client, store)
            tier.put(A, range(5), ttl_s=3600)
            tier.put(B, range(10, 15), ttl_s=1)
            client.save()
        server.kill()
        time.sleep(1.5)  # B's chunks expire while Redis is down: dropped at load, unheard
        server = LocalRedis(port=port, extra_args=args).start()
        with redis.Redis(port=port) as client:
            tier.client = client
            assert tier.account() == {A: 5 * VALUE, B: 5 * VALUE}  # as the snapshot had it
            assert tier.truth() == {A: 5 * VALUE}
            quotas.reconcile(client, KEYSPACE)
            assert tier.account() == tier.truth()
        store.close()
    finally:
        server.stop()


def test_the_keeper_refuses_a_tenant_over_its_budget_and_the_operator_overrides(
    tier: _Tier,
) -> None:
    keeper = quotas.QuotaKeeper(
        tier.store.quota_snapshot,
        tier.store.account_removed,
        tier.store.reconcile_quota,
        default_budget=3 * VALUE,
        refresh_s=0.0,
        reconcile_s=3600.0,
    )
    try:
        for tenant in (A, B, DEFAULT_TENANT):
            keeper.note(tenant)
        tier.put(A, range(3))
        tier.put(B, range(10, 12))
        tier.put(DEFAULT_TENANT, range(20, 30))

        def refreshed() -> None:
            keeper.tick()
            assert keeper.wait(5.0)
            keeper.tick()  # the one after the job that may have started before the change
            assert keeper.wait(5.0)

        refreshed()
        assert keeper.over_budget(A) and not keeper.over_budget(B)
        assert not keeper.over_budget(DEFAULT_TENANT)  # no default budget for it
        quotas.set_budget(tier.client, KEYSPACE.quotas_key(), A, quotas.NO_BUDGET)
        quotas.set_budget(tier.client, KEYSPACE.quotas_key(), B, VALUE)
        quotas.set_budget(tier.client, KEYSPACE.quotas_key(), DEFAULT_TENANT, 5 * VALUE)
        refreshed()
        assert not keeper.over_budget(A) and keeper.over_budget(B)
        assert keeper.over_budget(DEFAULT_TENANT)
        assert keeper.used(DEFAULT_TENANT) == 10 * VALUE
        # Removals queued by the scheduler leave the account at the next tick.
        tier.client.delete(_key(10), _key(11))
        keeper.removed([_key(10), _key(11)])
        refreshed()
        assert not keeper.over_budget(B) and keeper.used(B) == 0
    finally:
        keeper.close()


def test_a_budget_that_is_not_bytes_is_ignored_with_one_warning(
    tier: _Tier, caplog: pytest.LogCaptureFixture
) -> None:
    monkey = {"x": "lots", "y": "-5", "z": "7", "w": b"\xff\xfe"}
    tier.client.hset(KEYSPACE.quotas_key(), mapping=monkey)  # type: ignore[arg-type]
    quotas._said_bad_budget = False
    with caplog.at_level(logging.WARNING):
        assert quotas.budgets(tier.client, KEYSPACE.quotas_key()) == {"z": 7}
        assert quotas.budgets(tier.client, KEYSPACE.quotas_key()) == {"z": 7}
    assert sum("not bytes" in r.getMessage() for r in caplog.records) == 1


def test_an_account_redis_does_not_answer_is_no_exception(
    tier: _Tier, caplog: pytest.LogCaptureFixture
) -> None:
    """A usage field that is no integer reads as none (one WARNING, the breaker stays
    closed: lookups go on); an unreachable Redis: the store's calls answer None (the keeper
    keeps its last snapshot), never raise."""
    tier.put(B, range(2))
    tier.client.hset(KEYSPACE.tenants_key(), "=" + A, "many")
    quotas._said_bad_usage = False
    with caplog.at_level(logging.WARNING):
        taken = tier.store.quota_snapshot([A, B])
        assert taken is not None and dict(taken.used) == {B: 2 * VALUE}
        assert tier.account() == {B: 2 * VALUE}
    assert sum("not an integer" in r.getMessage() for r in caplog.records) == 1
    assert tier.store.breaker.state.name == "CLOSED"
    down = _store(f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert down.quota_snapshot([A]) is None
        assert down.account_removed([_key(1)]) is None
        assert down.reconcile_quota(0) is None
        down.account_stored(A, [_key(1)], [VALUE])  # dropped, never raised
    finally:
        down.close()


def test_tenant_ids_are_keyed_with_the_deployments_secret() -> None:
    """With an auth_key or an encryption key a salt's id is another (nobody without the key
    can test a guessed salt); during a rotation the id follows the previous key, which names
    the namespace."""
    from hma_redis.core.config import RedisTierConfig

    old, new = b"quota-test-encryption-key-old-0001", b"quota-test-encryption-key-new-0001"
    plain = RedisTierConfig()
    sealed = RedisTierConfig(encryption_key=old)
    rotating = RedisTierConfig(encryption_key=new, encryption_key_previous=old)
    keyed = RedisTierConfig(auth_key=new)
    ids = {
        name: tenant_id("salt-a", "hma", cfg.tenant_secret)
        for name, cfg in {
            "plain": plain,
            "sealed": sealed,
            "rotating": rotating,
            "keyed": keyed,
        }.items()
    }
    assert ids["plain"] == A
    assert ids["sealed"] == ids["rotating"]
    assert len({ids["plain"], ids["sealed"], ids["keyed"]}) == 3


@pytest.mark.parametrize("salt", ["\ud800 lone surrogate", "\x00" * 3, "x" * 1_000_000, "ü:*?[]"])
def test_any_salt_an_api_client_sends_gets_a_plain_tenant_id(salt: str) -> None:
    """vLLM passes the API client's cache_salt through: whatever it holds, the tenant is 16
    hex digits (nothing of the salt, no key pattern characters) and never an exception."""
    ident = tenant_id(salt, "hma")
    assert is_tenant_id(ident) and ident != DEFAULT_TENANT
