"""The cipher calls of :mod:`hma_redis.core.sealing` against cryptography's one-shot AES-GCM:
in place (through the scratch buffer, as every release of cryptography allows) and from
separate pieces, with bodies that end inside and beyond a scratch piece."""

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hma_redis.core import sealing
from hma_redis.core.sealing import SealKey

KEY = SealKey.derive(b"s" * 32)
NONCE = bytes(range(16))
AAD = (b"signed fields", b"packed header")

SIZES = [1, 4096, sealing.SCRATCH_BYTES - 1, sealing.SCRATCH_BYTES, 3 * sealing.SCRATCH_BYTES + 17]


def _oracle(plain: bytes) -> tuple[bytes, bytes]:
    """Body and tag as the one-shot AEAD computes them (the associated data's parts are one
    stream to GCM)."""
    sealed = AESGCM(KEY.value_key(NONCE, "hma:k")).encrypt(bytes(12), plain, b"".join(AAD))
    return sealed[: -sealing.TAG_BYTES], sealed[-sealing.TAG_BYTES :]


@pytest.mark.parametrize("size", SIZES)
def test_sealing_in_place_and_from_pieces_gives_the_one_shot_ciphertext(size: int) -> None:
    plain = os.urandom(size)
    body, tag = _oracle(plain)
    in_place = bytearray(plain)
    view = memoryview(in_place)
    assert sealing.seal_into(KEY, NONCE, "hma:k", AAD, [view], view) == tag
    assert bytes(in_place) == body
    out = bytearray(size)
    cut = size // 3
    pieces = [plain[:cut], memoryview(bytearray(plain[cut:]))]
    assert sealing.seal_into(KEY, NONCE, "hma:k", AAD, pieces, memoryview(out)) == tag
    assert bytes(out) == body


@pytest.mark.parametrize("size", SIZES)
def test_opening_in_place_gives_the_plaintext_and_refuses_a_changed_body(size: int) -> None:
    plain = os.urandom(size)
    body, tag = _oracle(plain)
    opened = bytearray(body)
    assert sealing.open_in_place(KEY, NONCE, tag, "hma:k", AAD, memoryview(opened))
    assert bytes(opened) == plain
    changed = bytearray(body)
    changed[-1] ^= 0x80
    assert not sealing.open_in_place(KEY, NONCE, tag, "hma:k", AAD, memoryview(changed))
    assert not sealing.open_in_place(KEY, NONCE, tag, "hma:other", AAD, memoryview(bytearray(body)))


def test_buffers_that_overlap_without_being_the_same_bytes_are_refused() -> None:
    buffer = memoryview(bytearray(os.urandom(4096)))
    with pytest.raises(ValueError, match="overlap"):
        sealing.seal_into(KEY, NONCE, "hma:k", AAD, [buffer[:2048]], buffer[16 : 16 + 2048])
