"""The transfer engine's own checks of a value it loads, on both data paths against a real
Redis: a value must hold every block its chunk's load needs, and with an ``auth_key`` carry
this engine's MAC. A value that fails either is corrupt: the load fails, the value is deleted
(SET NX would never replace it) and the chunk's blocks in the KV cache are not written."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import crc32c
import pytest
import redis
import torch

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.jobs import ChunkTransfer
from tests.support.kv_pages import (
    DST,
    LAYERS,
    PAGES,
    SRC,
    Pages,
    as_before_or_cleared,
    chunks,
    make_pages,
)

AUTH_KEY = b"transfer-checks-secret-000001"


def _rig(url: str, path: str, auth_key: bytes | None = None) -> Iterator[Pages]:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    rig = make_pages(store, auth_key=auth_key)
    assert rig.store.native == (path == "native")
    try:
        yield rig
    finally:
        rig.close()
        store.close()


def _chunk_pages(rig: Pages, chunk: ChunkTransfer) -> list[torch.Tensor]:
    """Copies of the pages of ``chunk``'s blocks in every layer of its group."""
    group = chunk.group_pos
    ids = list(chunk.block_ids)
    return [rig.tensors[i][ids, : PAGES[group]].clone() for i in LAYERS[group]]


def _fails_and_is_deleted(rig: Pages, client: redis.Redis, bad: ChunkTransfer) -> None:
    """Load DST: the job fails, ``bad``'s value is gone and its blocks hold what they held or
    zeros (an in-place load zeroes the pages of a failed job), never a byte of the value."""
    before = _chunk_pages(rig, bad)
    assert not rig.load_job(50, chunks(DST)).ok
    assert client.exists(bad.redis_key) == 0, "a corrupt value must be deleted"
    after = _chunk_pages(rig, bad)
    assert as_before_or_cleared(before, after)


@pytest.mark.parametrize("short", ["last-block", "first-block"])
def test_a_value_one_block_short_of_its_load_is_corrupt(
    redis_url: str, redis_client: redis.Redis, path: str, short: str
) -> None:
    """A chunk's value written without its last block (or starting one block later) is a
    valid value of another load, not of this one: the load fails and the value is deleted."""
    for rig in _rig(redis_url, path):
        assert rig.store_job(1, chunks(SRC)).ok
        whole = chunks(DST)[0]
        src = chunks(SRC)[0]
        narrow = (
            replace(src, block_ids=src.block_ids[:-1])
            if short == "last-block"
            else replace(src, start=src.start + 1, block_ids=src.block_ids[1:])
        )
        redis_client.unlink(whole.redis_key)
        assert rig.store_job(2, [narrow]).ok
        assert redis_client.exists(whole.redis_key) == 1
        _fails_and_is_deleted(rig, redis_client, whole)


def _forge(value: bytes, how: str) -> bytes:
    """``value`` with one MAC byte flipped, or with a body byte flipped and the CRC32C fixed
    (what someone who can write to Redis but lacks the key can do)."""
    out = bytearray(value)
    if how == "mac-byte":
        out[codec.PREFIX_BYTES - 1] ^= 0x01
        return bytes(out)
    out[-1] ^= 0x01
    out[12:16] = crc32c.crc32c(bytes(out[codec.PREFIX_BYTES :])).to_bytes(4, "big")
    return bytes(out)


@pytest.mark.parametrize("how", ["mac-byte", "body-with-crc"])
def test_a_value_without_this_engines_mac_is_corrupt(
    redis_url: str, redis_client: redis.Redis, path: str, how: str
) -> None:
    """With an ``auth_key``, a value whose MAC does not verify (a flipped MAC byte, or a body
    changed with a valid checksum) is corrupt on both paths: the native path compares the
    MAC over the pages the value landed in (the job's pages are zeroed when it fails), the
    twin over its buffer before anything reaches the KV cache."""
    for rig in _rig(redis_url, path, auth_key=AUTH_KEY):
        assert rig.store_job(1, chunks(SRC)).ok
        bad = chunks(DST)[1]
        value = redis_client.get(bad.redis_key)
        assert value is not None and codec.has_mac(value)
        redis_client.set(bad.redis_key, _forge(value, how))
        _fails_and_is_deleted(rig, redis_client, bad)
        assert rig.store_job(2, chunks(SRC)).ok  # the recompute's store heals it
        assert rig.load_job(3, chunks(DST)).ok and rig.moved(SRC, DST)
