"""The payload envelope: one Redis value = a fixed prefix, a small header and the raw KV bytes
of one chunk.

Byte layout (all integers big-endian)::

    offset 0   4 bytes  magic  b"HMAK"
    offset 4   2 bytes  format version
    offset 6   2 bytes  flags (bit 0: the MAC field holds a keyed MAC; bit 1: the body is
                        sealed, the MAC field holds its AES-GCM tag and value nonce)
    offset 8   4 bytes  header length H
    offset 12  4 bytes  CRC32C of (header ‖ body), the body as stored (sealed: its ciphertext)
    offset 16 32 bytes  MAC: keyed BLAKE3 of (body ‖ header ‖ bytes 0-11) with the auth_key,
                        all zero without one (the body first: BLAKE3 is ~3.5x slower when
                        its big input starts at an offset that is not a multiple of 1 KiB);
                        sealed: the 16-byte tag, then the 16-byte value nonce
    offset 48  H bytes  msgpack header (see :class:`BlockHeader`)
    offset 48+H         body: for each layer, ``num_blocks`` pages of ``page_bytes[layer]`` bytes
                        (sealed: AES-256-GCM of them, the same length; :mod:`.sealing`)

The header echoes the Redis key it was written under, so a value copied onto another key (or
another namespace) is rejected. With an auth_key (:class:`MacKey`) every value carries a MAC,
and a reader with a key accepts only values MAC'd with that key; a reader without one refuses
MAC'd values (and a keyed reader unkeyed ones). With an encryption_key (:class:`~.sealing.Keyring`)
the body is sealed instead: encrypted and authenticated together with the prefix's signed fields
and the header (which names the key's id); a reader with a keyring accepts only sealed values of
its keys, one without refuses them. The MAC field is always there, so a value's size does not
depend on the key. Encoding writes the body once, straight from the KV cache into the
value buffer (or sends the pages in place); decoding returns zero-copy views of the reply. Every
mismatch raises :class:`CorruptBlockError`; partial data is never returned.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TypeVar

import blake3
import crc32c
import msgpack

from hma_redis.core import sealing
from hma_redis.core.sealing import Keyring, SealKey

_Bytes = bytes | bytearray | memoryview

# Version of the value envelope (docs/payload-format.md); part of every namespace.
FORMAT_VERSION = 2

MAGIC = b"HMAK"
MAC_BYTES = 32
# magic, version, flags, header length | CRC32C, MAC. The MAC covers the first four fields
# (after body and header: the body goes first, aligned, as BLAKE3 is fastest that way).
_SIGNED = struct.Struct(">4sHHI")
_PREFIX = struct.Struct(f">4sHHII{MAC_BYTES}s")
PREFIX_BYTES = _PREFIX.size
# Offsets in the prefix (every field big-endian): the header's length is the last signed field,
# the CRC32C follows the signed fields, then the MAC.
HEADER_LEN_AT = _SIGNED.size - 4
CRC_AT = _SIGNED.size
MAC_AT = CRC_AT + 4
FLAG_MAC = 0x0001
FLAG_SEALED = 0x0002
_KNOWN_FLAGS = FLAG_MAC | FLAG_SEALED
MAX_HEADER_BYTES = 64 * 1024
_NO_MAC = bytes(MAC_BYTES)
# blake3 key-derivation context: the MAC key is derived from the shared secret, never used raw.
_MAC_KEY_CONTEXT = "hma_redis 2026-11 value MAC"
_T = TypeVar("_T")


class CorruptBlockError(ValueError):
    """A stored value is not a valid block for the key it was read from."""


class ForeignKeyError(CorruptBlockError):
    """A sealed value names an encryption key this reader does not hold (during a rotation,
    an instance that has not been given the new key yet): it cannot be judged, so it is a miss
    and is left in Redis for the instances that can read it."""


@dataclass(frozen=True)
class MacKey:
    """The key of the values' MAC, derived once from the shared secret (the config's
    ``auth_key``). Its ``repr`` never shows the key."""

    key: bytes = field(repr=False)

    @classmethod
    def derive(cls, secret: bytes) -> MacKey:
        """The MAC key for ``secret``: BLAKE3 in key-derivation mode (32 bytes, whatever the
        secret's length), so the secret itself never keys a hash."""
        return cls(blake3.blake3(secret, derive_key_context=_MAC_KEY_CONTEXT).digest())

    def hasher(self) -> blake3.blake3:
        return blake3.blake3(key=self.key)


@dataclass(frozen=True)
class BlockHeader:
    """What a stored chunk contains.

    ``first_block`` is the offset inside the chunk of the first stored block: a sliding-window
    chunk may be stored without the blocks that had already left the window.
    """

    key: str
    group: int
    first_block: int
    num_blocks: int
    page_bytes: tuple[int, ...]
    kv_dtype: str = ""
    # vLLM's kv_cache_layout of the writer ("" when vLLM reports none), e.g. "NHD" or "HND".
    kv_cache_layout: str = ""
    # The id of the encryption key a sealed value's body is sealed with ("" unsealed; written
    # into the header only when set, so unsealed values keep their bytes).
    key_id: str = ""

    @property
    def body_bytes(self) -> int:
        return self.num_blocks * sum(self.page_bytes)

    def layer_offset(self, layer: int) -> int:
        return self.num_blocks * sum(self.page_bytes[:layer])

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self._fields())

    def _fields(self) -> dict[str, object]:
        """The msgpack map, in its order (``key`` second: :class:`HeaderTemplate` relies on it)."""
        fields: dict[str, object] = {
            "v": FORMAT_VERSION,
            "key": self.key,
            "g": self.group,
            "fb": self.first_block,
            "nb": self.num_blocks,
            "pages": list(self.page_bytes),
            "dt": self.kv_dtype,
            "kl": self.kv_cache_layout,
            "n": self.body_bytes,
        }
        if self.key_id:
            fields["kid"] = self.key_id
        return fields


class HeaderTemplate:
    """The msgpack bytes of every header that differs from ``header`` only in its key, made
    by packing the key alone between the map's fixed bytes before and after it: the same bytes
    as ``replace(header, key=key).to_msgpack()`` (a msgpack map is its length, then its keys
    and values packed one after another), at a fraction of the cost. A transfer job builds the
    header of each of its chunks; most chunks of an engine share their shape."""

    __slots__ = ("_after", "_before", "header")

    def __init__(self, header: BlockHeader) -> None:
        fields = header._fields()
        names = list(fields)
        if names[1] != "key" or len(names) > 15:  # a fixmap holds at most 15 pairs
            raise ValueError("a header template needs the key second and at most 15 fields")
        self.header = header
        self._before = bytes([0x80 | len(names)]) + b"".join(
            msgpack.packb(name) + msgpack.packb(fields[name]) for name in names[:1]
        )
        self._before += msgpack.packb("key")
        self._after = b"".join(
            msgpack.packb(name) + msgpack.packb(fields[name]) for name in names[2:]
        )

    def pack(self, key: str) -> bytes:
        """The header's msgpack bytes with ``key`` as its key."""
        return self._before + msgpack.packb(key) + self._after


@dataclass(frozen=True)
class DecodedBlock:
    header: BlockHeader
    # Zero-copy view of the body inside the buffer that was decoded.
    body: memoryview

    def layer(self, layer: int) -> memoryview:
        """Bytes of one layer: ``num_blocks`` pages back to back."""
        start = self.header.layer_offset(layer)
        return self.body[start : start + self.header.num_blocks * self.header.page_bytes[layer]]


@dataclass
class EncodedBlock:
    """A value being built: fill :attr:`body` in place, then call :meth:`seal`."""

    header: BlockHeader
    buffer: memoryview
    header_len: int
    mac_key: MacKey | None = None

    @property
    def body(self) -> memoryview:
        return self.buffer[PREFIX_BYTES + self.header_len :]

    def seal(self) -> memoryview:
        """Compute checksum (and MAC) over header and body; return the complete value (no
        copy)."""
        signed = signed_prefix(self.header_len, self.mac_key)
        crc = crc32c.crc32c(self.buffer[PREFIX_BYTES:])
        mac = _NO_MAC
        if self.mac_key is not None:
            hasher = self.mac_key.hasher()
            hasher.update(self.body)
            hasher.update(self.buffer[PREFIX_BYTES : PREFIX_BYTES + self.header_len])
            hasher.update(signed)
            mac = hasher.digest()
        _PREFIX.pack_into(self.buffer, 0, *_SIGNED.unpack(signed), crc, mac)
        return self.buffer


def value_size(header: BlockHeader) -> int:
    """Bytes of the value that holds ``header`` (the same with or without a MAC)."""
    return PREFIX_BYTES + len(header.to_msgpack()) + header.body_bytes


def start_encode(
    header: BlockHeader, buffer: memoryview | None = None, mac_key: MacKey | None = None
) -> EncodedBlock:
    """Lay out the header in ``buffer`` (or a new one) and return the block to fill.

    ``buffer`` must be exactly :func:`value_size` bytes; passing one lets callers reuse
    (pinned) staging memory. The body is left for the caller to write once. With ``mac_key``,
    :meth:`EncodedBlock.seal` also writes the MAC.
    """
    packed = header.to_msgpack()
    total = PREFIX_BYTES + len(packed) + header.body_bytes
    if buffer is None:
        buffer = memoryview(bytearray(total))
    elif buffer.nbytes != total:
        raise ValueError(f"buffer is {buffer.nbytes} bytes, the value needs {total}")
    buffer = buffer.cast("B")
    buffer[PREFIX_BYTES : PREFIX_BYTES + len(packed)] = packed
    return EncodedBlock(header=header, buffer=buffer, header_len=len(packed), mac_key=mac_key)


def encode_parts(
    header: BlockHeader, body: Sequence[memoryview], mac_key: MacKey | None = None
) -> list[memoryview]:
    """The value as pieces to send back to back, the body's pieces not copied.

    Returns the prefix and header in one new buffer, followed by ``body``: the pages, read in
    place (from the KV cache), whose sizes must add up to the header's body size. The checksum
    (and, with ``mac_key``, the MAC, computed piece by piece) covers them as they are now; they
    must not change until the value has been sent.
    """
    size = sum(piece.nbytes for piece in body)
    if size != header.body_bytes:
        raise ValueError(f"body pieces hold {size} bytes, the header says {header.body_bytes}")
    packed = header.to_msgpack()
    signed = signed_prefix(len(packed), mac_key)
    crc = crc32c.crc32c(packed)
    hasher = mac_key.hasher() if mac_key is not None else None
    for piece in body:
        crc = crc32c.crc32c(piece, crc)
        if hasher is not None:
            hasher.update(piece)
    mac = _NO_MAC
    if hasher is not None:
        hasher.update(packed)
        hasher.update(signed)
        mac = hasher.digest()
    head = bytearray(PREFIX_BYTES + len(packed))
    _PREFIX.pack_into(head, 0, *_SIGNED.unpack(signed), crc, mac)
    head[PREFIX_BYTES:] = packed
    return [memoryview(head), *body]


def encode(
    header: BlockHeader,
    body: bytes | memoryview,
    mac_key: MacKey | None = None,
    keyring: Keyring | None = None,
) -> memoryview:
    """Encode a whole value from an existing body (one copy). Mostly for tests and tools.
    With ``keyring`` the body is sealed with its write key (a fresh random value nonce)."""
    if keyring is None:
        block = start_encode(header, mac_key=mac_key)
        block.body[:] = memoryview(body).cast("B")
        return block.seal()
    header = replace(header, key_id=keyring.write.key_id)
    block = start_encode(header)
    block.body[:] = memoryview(body).cast("B")
    signed = signed_prefix(block.header_len, None, sealed=True)
    packed = block.buffer[PREFIX_BYTES : PREFIX_BYTES + block.header_len]
    head = seal_head(
        signed, bytes(packed), header.key, keyring.write, os.urandom(16), [block.body], block.body
    )
    block.buffer[: len(head)] = head
    crc = crc32c.crc32c(block.buffer[PREFIX_BYTES:])
    struct.pack_into(">I", block.buffer, CRC_AT, crc)
    return block.buffer


def seal_head(
    signed: bytes,
    packed: bytes,
    redis_key: str,
    key: SealKey,
    nonce: bytes,
    pieces: Sequence[_Bytes],
    out: memoryview,
) -> bytearray:
    """Seal a value's body: encrypt ``pieces`` (the plaintext in order; they may be ``out``
    itself) into ``out`` under ``key`` and ``nonce`` for ``redis_key``, the prefix's
    ``signed`` fields (the sealed flag set) and the ``packed`` header (naming ``key``'s id)
    as associated data. Returns the prefix and header with a zero CRC32C (the store job
    writes it over the sealed body) and the tag and nonce in the MAC field."""
    tag = sealing.seal_into(key, nonce, redis_key, (signed, packed), pieces, out)
    return head_without_crc(signed, packed, tag + nonce)


def open_sealed(
    head: memoryview | bytearray, body: memoryview, key: SealKey, redis_key: str
) -> bool:
    """Decrypt in place a sealed ``body`` whose prefix and header are ``head`` (sealed with
    ``key`` for ``redis_key``, as the header the caller expected says); whether its tag
    holds. On False ``body`` holds garbage."""
    view = memoryview(head).cast("B")
    header_len = _SIGNED.unpack_from(view, 0)[3]
    field = bytes(view[MAC_AT:PREFIX_BYTES])
    aad = (view[: _SIGNED.size], view[PREFIX_BYTES : PREFIX_BYTES + header_len])
    tag, nonce = field[: sealing.TAG_BYTES], field[sealing.TAG_BYTES :]
    return sealing.open_in_place(key, nonce, tag, redis_key, aad, body)


def decode(
    value: bytes | bytearray | memoryview,
    expected_key: str | None = None,
    expected_group: int | None = None,
    mac_key: MacKey | None = None,
    keyring: Keyring | None = None,
) -> DecodedBlock:
    """Validate ``value`` and return views of its parts.

    Raises :class:`CorruptBlockError` on any mismatch: wrong magic or version, unknown flags,
    bad lengths, checksum failure, a MAC that is missing (``mac_key`` given), unexpected (none
    given) or wrong, a sealed value without a ``keyring`` or an unsealed one with it, a sealed
    body that fails authentication, undecodable header, or a key/group other than the expected
    one; :class:`ForeignKeyError` for a value sealed with a key ``keyring`` does not hold. The
    header is parsed only once checksum and MAC hold (a sealed value's before its tag is
    checked: it names the key). A sealed body is decrypted in place when ``value`` is writable
    (else into a copy): the returned body is the plaintext, and a failed ``value`` holds garbage.
    """
    view = memoryview(value).cast("B")
    _magic, version, flags, header_len, crc, mac = _prefix(view)
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if flags & ~_KNOWN_FLAGS or flags == _KNOWN_FLAGS:
        raise CorruptBlockError(f"unknown flags {flags:#06x}")
    raw_header = _header_bytes(view, header_len)
    if crc32c.crc32c(view[PREFIX_BYTES:]) != crc:
        raise CorruptBlockError("checksum mismatch")
    if flags & FLAG_SEALED:
        header = _parse_header(raw_header)
        body = _open(view, header, header_len, mac, keyring)
    else:
        if keyring is not None:
            raise CorruptBlockError(
                "value is not encrypted, but this reader requires it (encryption_key)"
            )
        _check_mac(view, flags, mac, mac_key)
        header = _parse_header(raw_header)
        body = view[PREFIX_BYTES + header_len :]
    if body.nbytes != header.body_bytes:
        raise CorruptBlockError(f"body is {body.nbytes} bytes, header says {header.body_bytes}")
    if expected_key is not None and header.key != expected_key:
        raise CorruptBlockError(f"value belongs to key {header.key!r}, read from {expected_key!r}")
    if expected_group is not None and header.group != expected_group:
        raise CorruptBlockError(f"value is for group {header.group}, expected {expected_group}")
    return DecodedBlock(header=header, body=body)


def _open(
    view: memoryview, header: BlockHeader, header_len: int, field: bytes, keyring: Keyring | None
) -> memoryview:
    """The plaintext body of a sealed value (decrypted in place where ``view`` is writable),
    or CorruptBlockError / ForeignKeyError."""
    if keyring is None:
        raise CorruptBlockError(
            "value is encrypted (written with an encryption_key); this reader has none"
        )
    key = keyring.find(header.key_id)
    if key is None:
        raise ForeignKeyError(
            f"value is sealed with encryption key {header.key_id!r}, which this reader does "
            "not hold"
        )
    body = view[PREFIX_BYTES + header_len :]
    if body.readonly:
        body = memoryview(bytearray(body))
    tag, nonce = field[: sealing.TAG_BYTES], field[sealing.TAG_BYTES :]
    aad = (view[: _SIGNED.size], view[PREFIX_BYTES : PREFIX_BYTES + header_len])
    if not sealing.open_in_place(key, nonce, tag, header.key, aad, body):
        raise CorruptBlockError(
            "decryption failed: sealed with another key of the same id, or tampered with"
        )
    return body


def decode_header(value: bytes | memoryview) -> tuple[BlockHeader, bool]:
    """Header of a value and whether its checksum (CRC32C) holds, for inspection tools: the MAC
    is not checked (see :func:`check_mac`). Raises :class:`CorruptBlockError` only when no
    header can be read at all."""
    view = memoryview(value).cast("B")
    _magic, _version, _flags, header_len, crc, _mac = _prefix(view)
    header = _parse_header(_header_bytes(view, header_len))
    body_ok = view.nbytes == PREFIX_BYTES + header_len + header.body_bytes
    return header, body_ok and crc32c.crc32c(view[PREFIX_BYTES:]) == crc


class MacCheck(Enum):
    """What :func:`check_mac` found."""

    ABSENT = "absent"  # the value says it was written without an auth_key
    OK = "ok"  # checked with the key given: it matches
    BAD = "bad"  # checked with the key given: it does not (another key, or tampered with)
    UNCHECKED = "unchecked"  # the value carries a MAC, and no key was given to check it with
    UNREADABLE = "unreadable"  # no prefix or header length to check it over (too short, ...)


def check_mac(value: bytes | memoryview, mac_key: MacKey | None) -> MacCheck:
    """The MAC of ``value`` checked on its own, for inspection tools that report each check:
    whatever else is wrong with the value (a bad checksum, an undecodable header, another
    key's echo), the MAC is compared whenever it can be. :func:`decode` stops at the first
    failed check instead."""
    view = memoryview(value).cast("B")
    try:
        _magic, _version, flags, header_len, _crc, mac = _prefix(view)
        _header_bytes(view, header_len)
    except CorruptBlockError:
        return MacCheck.UNREADABLE
    if not flags & FLAG_MAC:
        return MacCheck.ABSENT
    if mac_key is None:
        return MacCheck.UNCHECKED
    return MacCheck.OK if _mac_matches(view, header_len, mac, mac_key) else MacCheck.BAD


def check_seal(value: bytes | memoryview, keyring: Keyring | None) -> MacCheck:
    """A value's encryption checked on its own, for inspection tools: ABSENT (not sealed),
    UNCHECKED (sealed, and no key here for it), OK (its tag holds with the key its header
    names), BAD (it does not), UNREADABLE (no prefix or header to check it with)."""
    view = memoryview(value).cast("B")
    try:
        _magic, _version, flags, header_len, _crc, _field = _prefix(view)
        header = _parse_header(_header_bytes(view, header_len))
    except CorruptBlockError:
        return MacCheck.UNREADABLE
    if not flags & FLAG_SEALED:
        return MacCheck.ABSENT
    key = keyring.find(header.key_id) if keyring is not None else None
    if key is None:
        return MacCheck.UNCHECKED
    copy = bytearray(view)  # decrypted in place: never the caller's bytes
    body = memoryview(copy)[PREFIX_BYTES + header_len :]
    return MacCheck.OK if open_sealed(copy, body, key, header.key) else MacCheck.BAD


def is_sealed(value: bytes | memoryview) -> bool:
    """Whether a value says its body is sealed (written with an encryption_key); not
    verified."""
    view = memoryview(value).cast("B")
    if view.nbytes < PREFIX_BYTES:
        return False
    return bool(_PREFIX.unpack_from(view, 0)[2] & FLAG_SEALED)


def has_mac(value: bytes | memoryview) -> bool:
    """Whether a value says it carries a MAC (written with an auth_key); not verified."""
    view = memoryview(value).cast("B")
    if view.nbytes < PREFIX_BYTES:
        return False
    return bool(_PREFIX.unpack_from(view, 0)[2] & FLAG_MAC)


def _prefix(view: memoryview) -> tuple[bytes, int, int, int, int, bytes]:
    """The fixed prefix of a value (magic, version, flags, header length, CRC32C, MAC);
    CorruptBlockError unless the value is long enough for one and says it is ours."""
    if view.nbytes < PREFIX_BYTES:
        raise CorruptBlockError(f"value too short ({view.nbytes} bytes)")
    fields: tuple[bytes, int, int, int, int, bytes] = _PREFIX.unpack_from(view, 0)
    if fields[0] != MAGIC:
        raise CorruptBlockError("bad magic: not an hma_redis block")
    return fields


def _header_bytes(view: memoryview, header_len: int) -> memoryview:
    """The msgpack header that follows the prefix; CorruptBlockError if it cannot fit."""
    if header_len > MAX_HEADER_BYTES or PREFIX_BYTES + header_len > view.nbytes:
        raise CorruptBlockError(f"header length {header_len} does not fit the value")
    return view[PREFIX_BYTES : PREFIX_BYTES + header_len]


def signed_prefix(header_len: int, mac_key: MacKey | None, *, sealed: bool = False) -> bytes:
    """The prefix fields the MAC (or a sealed value's tag) covers (all but CRC and MAC):
    magic, version, flags (the MAC flag with a key, the sealed flag for a sealed value) and
    the header's length."""
    flags = FLAG_MAC if mac_key is not None else FLAG_SEALED if sealed else 0
    return _SIGNED.pack(MAGIC, FORMAT_VERSION, flags, header_len)


def value_mac(mac_key: MacKey, body: Iterable[_Bytes], packed: _Bytes, signed: _Bytes) -> bytes:
    """The keyed BLAKE3 MAC of a value: over its body (pieces in order), its msgpack header
    and its signed prefix fields, in that order."""
    hasher = mac_key.hasher()
    for piece in body:
        hasher.update(piece)
    hasher.update(packed)
    hasher.update(signed)
    return hasher.digest()


def head_without_crc(signed: bytes, packed: bytes, mac: bytes | None) -> bytearray:
    """A value's prefix and header with a zero CRC32C (a store job that checksums as it sends
    writes it in place at :data:`CRC_AT`) and ``mac`` (zeros without one)."""
    head = bytearray(PREFIX_BYTES + len(packed))
    _PREFIX.pack_into(head, 0, *_SIGNED.unpack(signed), 0, mac or _NO_MAC)
    head[PREFIX_BYTES:] = packed
    return head


def head_mac_matches(head: memoryview | bytearray, body: Iterable[_Bytes], mac_key: MacKey) -> bool:
    """Whether the MAC in ``head`` (a value's prefix and header, its body elsewhere) is this
    key's MAC of ``body`` (the body's pieces in order: a buffer, or the KV cache's pages a
    value landed in) (constant time)."""
    view = memoryview(head).cast("B")
    want = value_mac(mac_key, body, view[PREFIX_BYTES:], view[: _SIGNED.size])
    return hmac.compare_digest(want, bytes(view[MAC_AT:PREFIX_BYTES]))


def _check_mac(view: memoryview, flags: int, mac: bytes, mac_key: MacKey | None) -> None:
    """The value's MAC state must match the reader's: MAC'd with ``mac_key``, or no MAC for a
    reader without one. Constant-time comparison."""
    if not flags & FLAG_MAC:
        if mac_key is not None:
            raise CorruptBlockError("value has no MAC, but this reader requires one (auth_key)")
        return
    if mac_key is None:
        raise CorruptBlockError("value has a MAC (written with an auth_key); this reader has none")
    if not _mac_matches(view, _SIGNED.unpack_from(view, 0)[3], mac, mac_key):
        raise CorruptBlockError("MAC mismatch: written with another auth_key, or tampered with")


def _mac_matches(view: memoryview, header_len: int, mac: bytes, mac_key: MacKey) -> bool:
    """Whether ``mac`` is the keyed BLAKE3 of body, header and signed prefix (constant time)."""
    body = view[PREFIX_BYTES + header_len :]
    want = value_mac(
        mac_key, (body,), view[PREFIX_BYTES : PREFIX_BYTES + header_len], view[: _SIGNED.size]
    )
    return hmac.compare_digest(want, mac)


def _parse_header(raw: memoryview) -> BlockHeader:
    try:
        fields = msgpack.unpackb(raw)
        header = BlockHeader(
            key=_typed(fields["key"], str),
            group=_typed(fields["g"], int),
            first_block=_typed(fields["fb"], int),
            num_blocks=_typed(fields["nb"], int),
            page_bytes=tuple(_typed(p, int) for p in fields["pages"]),
            kv_dtype=_typed(fields["dt"], str),
            kv_cache_layout=_typed(fields["kl"], str),
            key_id=_typed(fields.get("kid", ""), str),
        )
        declared = _typed(fields["n"], int)
        version = _typed(fields["v"], int)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise CorruptBlockError(f"undecodable header: {exc}") from None
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"header format version {version}, expected {FORMAT_VERSION}")
    if declared != header.body_bytes:
        raise CorruptBlockError("header body length disagrees with its layer layout")
    if header.num_blocks < 0 or header.first_block < 0 or any(p < 0 for p in header.page_bytes):
        raise CorruptBlockError("negative sizes in header")
    return header


def _typed(value: object, kind: type[_T]) -> _T:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value
