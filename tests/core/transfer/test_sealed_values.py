"""Encrypted values (``encryption_key``) through the transfer engine, on both data paths and
both page paths (CPU pages sealed in place of a send; a GPU-style cache gathered into buffers)
against a real Redis: what Redis holds reads as random bytes, and every value that is not this
deployment's sealed value for its key (tampered, truncated, moved to another key, unsealed,
sealed with a key this reader lacks) never reaches a page: the load fails and the tokens are
recomputed."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import crc32c
import msgpack
import numpy as np
import pytest
import redis
import torch

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.sealing import NonceSource, SealKey
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

KEY = b"sealed-values-test-key-000000001"
OTHER_KEY = b"sealed-values-test-key-000000002"


def _rig(
    url: str,
    path: str,
    *,
    key: bytes | None = KEY,
    previous: bytes | None = None,
    gathered: bool = False,
) -> Iterator[Pages]:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    rig = make_pages(store, encryption_key=key, encryption_key_previous=previous, gathered=gathered)
    assert rig.store.native == (path == "native")
    try:
        yield rig
    finally:
        rig.close()
        store.close()


def _body(value: bytes) -> bytes:
    header_len = int.from_bytes(value[codec.HEADER_LEN_AT : codec.HEADER_LEN_AT + 4], "big")
    return value[codec.PREFIX_BYTES + header_len :]


def _fix_crc(value: bytearray) -> bytes:
    value[codec.CRC_AT : codec.CRC_AT + 4] = crc32c.crc32c(
        bytes(value[codec.PREFIX_BYTES :])
    ).to_bytes(4, "big")
    return bytes(value)


def _refused(rig: Pages, client: redis.Redis, bad: ChunkTransfer, *, deleted: bool) -> None:
    """Load DST: the job fails and ``bad``'s blocks hold what they held (or zeros), never a
    byte of the value; the value is deleted when it is corrupt, kept when it is only
    another key's."""
    group = bad.group_pos
    ids = list(bad.block_ids)
    before = [rig.tensors[i][ids, : PAGES[group]].clone() for i in LAYERS[group]]
    assert not rig.load_job(50, chunks(DST)).ok
    assert client.exists(bad.redis_key) == (0 if deleted else 1)
    after = [rig.tensors[i][ids, : PAGES[group]].clone() for i in LAYERS[group]]
    assert as_before_or_cleared(before, after)


@pytest.mark.parametrize("gathered", [False, True], ids=["cpu-pages", "gathered"])
def test_sealed_values_round_trip_and_read_as_random_bytes_in_redis(
    redis_url: str, redis_client: redis.Redis, path: str, gathered: bool
) -> None:
    """KV pages of zeros are stored sealed: each body in Redis is incompressible, its bytes
    spread evenly, two chunks of the same (zero) plaintext differ, no value holds a page in
    clear; the load gives back the zeros."""
    for rig in _rig(redis_url, path, gathered=gathered):
        for tensor in rig.tensors:
            tensor[SRC[0] + SRC[1]] = 0
        assert rig.store_job(1, chunks(SRC)).ok
        bodies = []
        for chunk in chunks(SRC):
            value = redis_client.get(chunk.redis_key)
            assert value is not None and codec.is_sealed(value) and not codec.has_mac(value)
            body = _body(value)
            assert len(zlib.compress(body, 9)) > len(body)  # random bytes do not compress
            counts = np.bincount(np.frombuffer(body, dtype=np.uint8), minlength=256)
            expected = len(body) / 256
            chi2 = float(((counts - expected) ** 2 / expected).sum())
            assert chi2 < 400, chi2  # 255 degrees of freedom: p < 1e-7 above 400
            bodies.append(body)
        assert len({b[:64] for b in bodies}) == len(bodies)
        assert rig.load_job(2, chunks(DST)).ok
        assert rig.moved(SRC, DST)


def _tamper(value: bytes, how: str) -> bytes:
    """What a writer without the key can do to a sealed value, CRC32C fixed each time."""
    out = bytearray(value)
    header_len = int.from_bytes(value[codec.HEADER_LEN_AT : codec.HEADER_LEN_AT + 4], "big")
    body_at = codec.PREFIX_BYTES + header_len
    if how == "random-bytes":  # most of the body overwritten
        rng = np.random.default_rng(7)
        end = body_at + (len(value) - body_at) * 9 // 10
        out[body_at:end] = rng.integers(0, 256, end - body_at, dtype=np.uint8).tobytes()
    elif how == "nan-payload":  # a plaintext of NaNs where the ciphertext was
        nans = torch.full(((len(value) - body_at) // 2,), float("nan"), dtype=torch.float16)
        out[body_at:] = nans.view(torch.uint8).numpy().tobytes()
    elif how == "tag":
        out[codec.MAC_AT] ^= 0x80
    elif how == "nonce":
        out[codec.PREFIX_BYTES - 1] ^= 0x01
    elif how == "header":  # another first block in the header (its length kept)
        fields = msgpack.unpackb(value[codec.PREFIX_BYTES : body_at])
        fields["fb"] = fields["fb"] + 1 if fields["fb"] < 100 else 0
        packed = msgpack.packb(fields)
        if len(packed) != header_len:
            raise AssertionError("the test's header edit changed its length")
        out[codec.PREFIX_BYTES : body_at] = packed
    elif how == "truncated":
        del out[-4096:]
    return _fix_crc(out)


@pytest.mark.parametrize(
    "how", ["random-bytes", "nan-payload", "tag", "nonce", "header", "truncated"]
)
def test_a_tampered_sealed_value_is_refused_deleted_and_healed(
    redis_url: str, redis_client: redis.Redis, path: str, how: str
) -> None:
    """A sealed value altered by someone without the key (a valid CRC32C each time) fails
    authentication (or its length) on both data paths: the load fails, no page holds its
    bytes, the value is deleted, and the recompute's store heals it."""
    for rig in _rig(redis_url, path):
        assert rig.store_job(1, chunks(SRC)).ok
        bad = chunks(DST)[1]
        value = redis_client.get(bad.redis_key)
        assert value is not None
        redis_client.set(bad.redis_key, _tamper(value, how))
        _refused(rig, redis_client, bad, deleted=True)
        assert rig.store_job(2, chunks(SRC)).ok
        assert rig.load_job(3, chunks(DST)).ok and rig.moved(SRC, DST)


def test_a_sealed_value_under_another_key_is_refused(
    redis_url: str, redis_client: redis.Redis, path: str
) -> None:
    """A valid sealed value copied onto another chunk's key (a replay): its header echoes
    its own key, and its value key and tag are bound to it, so it is refused and deleted."""
    for rig in _rig(redis_url, path):
        assert rig.store_job(1, chunks(SRC)).ok
        first, second = chunks(DST)[0], chunks(DST)[1]
        assert first.group == second.group
        value = redis_client.get(first.redis_key)
        assert value is not None
        redis_client.set(second.redis_key, value)
        _refused(rig, redis_client, second, deleted=True)


@pytest.mark.parametrize("writer", ["unsealed", "sealed"])
def test_a_reader_refuses_values_of_the_other_kind(
    redis_url: str, redis_client: redis.Redis, path: str, writer: str
) -> None:
    """An unsealed value (valid, checksummed) is refused by an encrypting reader, and a
    sealed one by a reader without a key: a valid value of another configuration under
    the right key never reaches a page."""
    write_key, read_key = (None, KEY) if writer == "unsealed" else (KEY, None)
    for rig in _rig(redis_url, path, key=write_key):
        assert rig.store_job(1, chunks(SRC)).ok
    for rig in _rig(redis_url, path, key=read_key):
        _refused(rig, redis_client, chunks(DST)[0], deleted=True)


def test_a_value_sealed_with_a_key_this_reader_lacks_is_a_miss_left_in_redis(
    redis_url: str, redis_client: redis.Redis, path: str
) -> None:
    """A reader whose key is another (a rotation under way, the new key not given to it yet)
    cannot judge the value: the load fails (recompute) and the value stays for the
    instances that hold its key."""
    for rig in _rig(redis_url, path, key=OTHER_KEY):
        assert rig.store_job(1, chunks(SRC)).ok
    for rig in _rig(redis_url, path, key=KEY):
        _refused(rig, redis_client, chunks(DST)[0], deleted=False)


def test_a_rotation_reads_the_previous_keys_values_and_seals_with_the_new_key(
    redis_url: str, redis_client: redis.Redis, path: str
) -> None:
    """Values sealed with the old key load on an instance given the new key and the old one
    as previous; what that instance stores is sealed with the new key, which an instance of
    the old key alone cannot read (a miss, kept) until it is given the new key."""
    for rig in _rig(redis_url, path, key=KEY):
        assert rig.store_job(1, chunks(SRC)).ok
    for rig in _rig(redis_url, path, key=OTHER_KEY, previous=KEY):
        assert rig.load_job(2, chunks(DST)).ok and rig.moved(SRC, DST)
        redis_client.unlink(*[c.redis_key for c in chunks(SRC)])
        assert rig.store_job(3, chunks(SRC)).ok
        value = redis_client.get(chunks(SRC)[0].redis_key)
        assert value is not None
        header, _ = codec.decode_header(value)
        assert header.key_id == SealKey.derive(OTHER_KEY).key_id
    for rig in _rig(redis_url, path, key=KEY):
        _refused(rig, redis_client, chunks(DST)[0], deleted=False)


def test_value_nonces_never_repeat_within_a_source_and_differ_between_sources() -> None:
    """A source's nonces are its random prefix and a counter; two sources (two instances)
    draw different prefixes."""
    one, two = NonceSource(), NonceSource()
    nonces = [one.next() for _ in range(10_000)]
    assert len(set(nonces)) == len(nonces)
    assert {n[:8] for n in nonces} == {nonces[0][:8]}
    assert two.next()[:8] != nonces[0][:8]
