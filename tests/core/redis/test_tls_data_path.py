"""The pure-Python twin of the C job is the data path of TLS connections (``rediss://``): against
a real TLS-only Redis, the engine's jobs leave the same bytes in Redis and in the KV cache as the
C job does over plain TCP, a value that does not match its chunk's expected header lands in
staging in the same round trip, and a damaged value fails its load without writing a page."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.kv_pages import DST, SRC, chunks, make_pages, store_load_and_narrow_load
from tests.support.tls_certs import TlsLocalRedis, make_tls_files

AUTH_KEY = b"tls-twin-secret-0001"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsLocalRedis]:
    try:
        server = TlsLocalRedis(make_tls_files(tmp_path_factory.mktemp("tls"))).start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start a TLS redis-server: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def tls_client(tls_redis: TlsLocalRedis) -> Iterator[redis.Redis]:
    client = tls_redis.tls_client()
    client.flushall()
    yield client
    client.close()


def _tls_store(server: TlsLocalRedis, **options: object) -> RedisBlockStore:
    extra = {
        "redis_url": server.url,
        "tls_ca_file": server.files.ca_cert,
        "tls_cert_file": server.files.client_cert,
        "tls_key_file": server.files.client_key,
        **options,
    }
    return RedisBlockStore(RedisTierConfig.from_extra_config(extra, env={}))


def _plain_store(url: str, **options: object) -> RedisBlockStore:
    return RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url, **options}, env={}))


@pytest.mark.parametrize("connections", [1, 3])
@pytest.mark.parametrize("auth_key", [None, AUTH_KEY], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "buffered"])
def test_the_twin_over_tls_leaves_the_bytes_the_c_job_leaves_over_tcp(
    tls_redis: TlsLocalRedis,
    tls_client: redis.Redis,
    redis_client: redis.Redis,
    redis_url: str,
    strided: bool,
    auth_key: bytes | None,
    connections: int,
) -> None:
    outcome = {}
    for path in ("native", "tls"):
        if path == "tls":
            store, client = _tls_store(tls_redis, connections_per_job=connections), tls_client
        else:
            redis_client.flushall()
            store, client = _plain_store(redis_url, connections_per_job=connections), redis_client
        rig = make_pages(store, strided=strided, auth_key=auth_key)
        try:
            assert rig.store.native == (path == "native"), rig.engine.data_path
            if path == "tls":
                assert rig.engine.data_path.startswith("pure Python (TLS")
                assert f"{connections} thread(s) per job" in rig.engine.data_path
            outcome[path] = store_load_and_narrow_load(rig, client)
        finally:
            rig.close()
            store.close()
    assert outcome["native"][0] == outcome["tls"][0], "Redis holds other bytes after a TLS store"
    for got, want in zip(outcome["native"][2], outcome["tls"][2], strict=True):
        assert torch.equal(got, want), "the KV cache differs after a TLS load"


@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "buffered"])
@pytest.mark.parametrize("where", ["header", "body"])
def test_a_damaged_value_over_tls_fails_its_load_and_no_page_keeps_a_byte_of_it(
    tls_redis: TlsLocalRedis, tls_client: redis.Redis, strided: bool, where: str
) -> None:
    store = _tls_store(tls_redis)
    rig = make_pages(store, strided=strided)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        victim = chunks(SRC)[1].redis_key
        value = bytearray(tls_client.get(victim) or b"")
        at = 60 if where == "header" else len(value) - 5  # the key echo, or the last page
        value[at] ^= 0xFF
        tls_client.set(victim, bytes(value))
        before = [t.clone() for t in rig.tensors]

        assert not rig.load_job(2, chunks(DST)).ok
        # The twin receives into buffers: a failed load writes no page at all.
        assert not rig.engine.loads_land_in_place
        assert all(torch.equal(a, b) for a, b in zip(before, rig.tensors, strict=True))
        assert tls_client.exists(victim) == 0  # deleted, so the recompute's store heals it
        assert rig.store_job(3, chunks(SRC)).ok
        assert rig.load_job(4, chunks(DST)).ok
        assert rig.moved(SRC, DST)
    finally:
        rig.close()
        store.close()
