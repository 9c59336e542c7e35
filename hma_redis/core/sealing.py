"""Authenticated encryption of values (the config's ``encryption_key``): AES-256-GCM.

Each value is sealed under a key of its own, derived from the encryption key, a 16-byte value
nonce and the Redis key the value is written under::

    value key = BLAKE3(keyed with the encryption key's derived key, nonce ‖ redis key)
    body'     = AES-256-GCM(value key, 96-bit nonce 0, body, associated data)

so a value key encrypts exactly one value. The value nonce is 8 random bytes drawn once per
:class:`NonceSource` (one per transfer engine: per process and worker) followed by an 8-byte
counter: within a source it never repeats by construction, across instances a repeat needs two
sources to draw the same 64 random bits and reach the same count, and even then the two values'
keys differ unless they are also written under the same Redis key. AES-GCM's own limits on
random 96-bit nonces (2^32 messages per key) do not apply: no key is used twice.

The associated data is the value's signed prefix fields and its msgpack header (which echoes the
Redis key and names the encryption key's id), so a header that was altered, or a value replayed
under another key, fails authentication. The tag replaces the keyed BLAKE3 MAC: a sealed value
carries one check, not two. The layout of the tag and nonce inside a value is the codec's.

``cryptography`` does the cipher (OpenSSL's AES-NI / VAES code; it releases the GIL over the
bytes). A sealed value is decrypted inside its staging buffer and reaches the KV cache only once
its tag holds. ``update_into`` refuses buffers that share memory from cryptography 51 on (older
releases took exact in-place calls), so in-place work goes through a per-thread scratch buffer of
:data:`SCRATCH_BYTES`, one cache-sized piece at a time: the same bytes on every release.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

TAG_BYTES = 16
NONCE_BYTES = 16
_GCM_NONCE = bytes(12)  # every value key seals one value: a constant GCM nonce is safe
# blake3 key-derivation contexts: the cipher key and the key's public id come from the secret
# by different derivations, so neither reveals the other (nor the auth_key's, another context).
_KEY_CONTEXT = "hma_redis 2026-12 value encryption key"
_ID_CONTEXT = "hma_redis 2026-12 encryption key id"
_COUNTER_LIMIT = 1 << 64
SCRATCH_BYTES = 256 * 1024  # in-place pieces: small enough to stay in the core's cache
_scratch = threading.local()


class SealingUnavailable(RuntimeError):
    """The ``cryptography`` package is not installed (an encryption key needs it)."""


@dataclass(frozen=True)
class SealKey:
    """One encryption key, derived from the operator's secret. Its ``repr`` shows only its
    id: 16 hex digits that say which secret it is and nothing about it."""

    key: bytes = field(repr=False)
    key_id: str

    @classmethod
    def derive(cls, secret: bytes) -> SealKey:
        """The key for ``secret`` (any length; the config requires 16 bytes or more)."""
        key = blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()
        ident = blake3.blake3(secret, derive_key_context=_ID_CONTEXT).hexdigest()[:16]
        return cls(key, ident)

    def value_key(self, nonce: bytes, redis_key: str) -> bytes:
        """The AES-256 key of the one value sealed with ``nonce`` under ``redis_key``."""
        hasher = blake3.blake3(key=self.key)
        hasher.update(nonce)
        hasher.update(redis_key.encode())
        return hasher.digest()


@dataclass(frozen=True)
class Keyring:
    """The keys of one instance: ``write`` seals every value it stores; values sealed with it
    or with ``previous`` (a key being rotated out) are read."""

    write: SealKey
    previous: SealKey | None = None

    @classmethod
    def from_secrets(cls, secret: bytes, previous: bytes | None = None) -> Keyring:
        old = SealKey.derive(previous) if previous is not None else None
        return cls(SealKey.derive(secret), old)

    def find(self, key_id: str) -> SealKey | None:
        """The key whose id is ``key_id``, if this instance holds it."""
        for key in (self.write, self.previous):
            if key is not None and key.key_id == key_id:
                return key
        return None

    @property
    def namespace_key_id(self) -> str:
        """The id that names the namespace: the previous key's during a rotation, else the
        write key's. Instances being moved to a new key keep sharing the namespace of the old
        one (they read both keys' values); dropping the previous key moves to the new key's
        namespace (docs/security.md: key rotation)."""
        return (self.previous or self.write).key_id


class NonceSource:
    """Value nonces that never repeat within the source: 8 random bytes drawn at creation,
    then a counter. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._draw()

    def _draw(self) -> None:
        self._prefix = os.urandom(8)
        self._count = itertools.count()

    def next(self) -> bytes:
        with self._lock:
            count = next(self._count)
            if count >= _COUNTER_LIMIT:  # 2^64 values: never in practice, but never a repeat
                self._draw()
                count = next(self._count)
            return self._prefix + count.to_bytes(8, "big")


def _address(view: memoryview) -> int | None:
    """Where a writable view's bytes start; None for a read-only one (it cannot be written
    through, so it is never an output)."""
    if view.readonly or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _update_into(context: Any, src: memoryview, dst: memoryview) -> None:
    """``context.update_into(src, dst)`` (a stream mode: ``dst`` holds ``src.nbytes``), also
    in place (``src`` and ``dst`` the same bytes): then one :data:`SCRATCH_BYTES` piece at a
    time through this thread's scratch buffer, each piece read before it is written over.
    ValueError for buffers that overlap otherwise (no caller makes them)."""
    start, out = _address(src), _address(dst)
    if start is None or out is None or not (start < out + dst.nbytes and out < start + src.nbytes):
        context.update_into(src, dst)
        return
    if start != out or src.nbytes != dst.nbytes:
        raise ValueError("sealing: input and output overlap without being the same bytes")
    scratch: memoryview | None = getattr(_scratch, "view", None)
    if scratch is None:
        scratch = _scratch.view = memoryview(bytearray(SCRATCH_BYTES))
    for offset in range(0, src.nbytes, SCRATCH_BYTES):
        piece = src[offset : offset + SCRATCH_BYTES]
        context.update_into(piece, scratch[: piece.nbytes])
        dst[offset : offset + piece.nbytes] = scratch[: piece.nbytes]


def _cipher(value_key: bytes, tag: bytes | None = None) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:
        raise SealingUnavailable(
            "hma_redis: encryption_key needs the cryptography package "
            "(pip install 'hma_redis[encryption]')"
        ) from None
    return Cipher(algorithms.AES(value_key), modes.GCM(_GCM_NONCE, tag))


def require_cipher() -> None:
    """Raise :class:`SealingUnavailable` now (at start-up) rather than at the first value."""
    _cipher(bytes(32))


def seal_into(
    key: SealKey,
    nonce: bytes,
    redis_key: str,
    aad: Iterable[bytes | memoryview],
    pieces: Sequence[Any],
    out: memoryview,
) -> bytes:
    """Encrypt ``pieces`` (the plaintext body in order) into ``out`` back to back; return the
    tag. ``out`` must hold the body exactly; a piece may be ``out``'s own bytes at the same
    offset (encryption in place)."""
    encryptor = _cipher(key.value_key(nonce, redis_key)).encryptor()
    for part in aad:
        encryptor.authenticate_additional_data(bytes(part))
    offset = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        _update_into(encryptor, view, out[offset : offset + view.nbytes])
        offset += view.nbytes
    if offset != out.nbytes:
        raise ValueError(f"body pieces hold {offset} bytes, the sealed body {out.nbytes}")
    encryptor.finalize()
    tag: bytes = encryptor.tag
    return tag


def open_in_place(
    key: SealKey,
    nonce: bytes,
    tag: bytes,
    redis_key: str,
    aad: Iterable[bytes | memoryview],
    body: memoryview,
) -> bool:
    """Decrypt ``body`` in place and check its tag; False (the body's bytes then garbage: the
    caller must not use them) when the tag does not hold: another key, altered or truncated
    bytes, another header, or a value moved from another Redis key."""
    from cryptography.exceptions import InvalidTag

    decryptor = _cipher(key.value_key(nonce, redis_key), tag).decryptor()
    for part in aad:
        decryptor.authenticate_additional_data(bytes(part))
    if body.nbytes:
        _update_into(decryptor, body, body)
    try:
        decryptor.finalize()
    except InvalidTag:
        return False
    return True
