"""The payload envelope: one Redis value = a small header + the raw KV bytes of one chunk.

Byte layout (all integers big-endian)::

    offset 0   4 bytes  magic  b"HMAK"
    offset 4   2 bytes  format version
    offset 6   4 bytes  header length H
    offset 10  4 bytes  CRC32C of (header ‖ body)
    offset 14  H bytes  msgpack header (see :class:`BlockHeader`)
    offset 14+H         body: for each layer, ``num_blocks`` pages of ``page_bytes[layer]`` bytes

The header echoes the Redis key it was written under, so a value copied onto another key (or
another namespace) is rejected. Encoding writes the body once, straight from the KV cache into the
value buffer; decoding returns zero-copy views of the reply. Every mismatch raises
:class:`CorruptBlockError`; partial data is never returned.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import crc32c
import msgpack

from hma_redis import FORMAT_VERSION

MAGIC = b"HMAK"
_PREFIX = struct.Struct(">4sHII")
PREFIX_BYTES = _PREFIX.size
MAX_HEADER_BYTES = 64 * 1024
_T = TypeVar("_T")


class CorruptBlockError(ValueError):
    """A stored value is not a valid block for the key it was read from."""


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

    @property
    def body_bytes(self) -> int:
        return self.num_blocks * sum(self.page_bytes)

    def layer_offset(self, layer: int) -> int:
        return self.num_blocks * sum(self.page_bytes[:layer])

    def to_msgpack(self) -> bytes:
        return msgpack.packb(
            {
                "v": FORMAT_VERSION,
                "key": self.key,
                "g": self.group,
                "fb": self.first_block,
                "nb": self.num_blocks,
                "pages": list(self.page_bytes),
                "dt": self.kv_dtype,
                "n": self.body_bytes,
            }
        )


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

    @property
    def body(self) -> memoryview:
        return self.buffer[PREFIX_BYTES + self.header_len :]

    def seal(self) -> memoryview:
        """Compute the checksum over header and body; return the complete value (no copy)."""
        crc = crc32c.crc32c(self.buffer[PREFIX_BYTES:])
        _PREFIX.pack_into(self.buffer, 0, MAGIC, FORMAT_VERSION, self.header_len, crc)
        return self.buffer


def value_size(header: BlockHeader) -> int:
    return PREFIX_BYTES + len(header.to_msgpack()) + header.body_bytes


def start_encode(header: BlockHeader, buffer: memoryview | None = None) -> EncodedBlock:
    """Lay out the header in ``buffer`` (or a new one) and return the block to fill.

    ``buffer`` must be exactly :func:`value_size` bytes; passing one lets callers reuse
    (pinned) staging memory. The body is left for the caller to write once.
    """
    packed = header.to_msgpack()
    total = PREFIX_BYTES + len(packed) + header.body_bytes
    if buffer is None:
        buffer = memoryview(bytearray(total))
    elif buffer.nbytes != total:
        raise ValueError(f"buffer is {buffer.nbytes} bytes, the value needs {total}")
    buffer = buffer.cast("B")
    buffer[PREFIX_BYTES : PREFIX_BYTES + len(packed)] = packed
    return EncodedBlock(header=header, buffer=buffer, header_len=len(packed))


def encode_parts(header: BlockHeader, body: Sequence[memoryview]) -> list[memoryview]:
    """The value as pieces to send back to back, the body's pieces not copied.

    Returns the prefix and header in one new buffer, followed by ``body``: the pages, read in
    place (from the KV cache), whose sizes must add up to the header's body size. The checksum
    covers them as they are now; they must not change until the value has been sent.
    """
    size = sum(piece.nbytes for piece in body)
    if size != header.body_bytes:
        raise ValueError(f"body pieces hold {size} bytes, the header says {header.body_bytes}")
    packed = header.to_msgpack()
    crc = crc32c.crc32c(packed)
    for piece in body:
        crc = crc32c.crc32c(piece, crc)
    head = bytearray(PREFIX_BYTES + len(packed))
    _PREFIX.pack_into(head, 0, MAGIC, FORMAT_VERSION, len(packed), crc)
    head[PREFIX_BYTES:] = packed
    return [memoryview(head), *body]


def encode(header: BlockHeader, body: bytes | memoryview) -> memoryview:
    """Encode a whole value from an existing body (one copy). Mostly for tests and tools."""
    block = start_encode(header)
    block.body[:] = memoryview(body).cast("B")
    return block.seal()


def decode(
    value: bytes | bytearray | memoryview,
    expected_key: str | None = None,
    expected_group: int | None = None,
) -> DecodedBlock:
    """Validate ``value`` and return views of its parts.

    Raises :class:`CorruptBlockError` on any mismatch: wrong magic or version, bad lengths,
    checksum failure, undecodable header, or a key/group other than the expected one.
    """
    view = memoryview(value).cast("B")
    if view.nbytes < PREFIX_BYTES:
        raise CorruptBlockError(f"value too short ({view.nbytes} bytes)")
    magic, version, header_len, crc = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptBlockError("bad magic: not an hma_redis block")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or PREFIX_BYTES + header_len > view.nbytes:
        raise CorruptBlockError(f"header length {header_len} does not fit the value")
    if crc32c.crc32c(view[PREFIX_BYTES:]) != crc:
        raise CorruptBlockError("checksum mismatch")
    header = _parse_header(view[PREFIX_BYTES : PREFIX_BYTES + header_len])
    body = view[PREFIX_BYTES + header_len :]
    if body.nbytes != header.body_bytes:
        raise CorruptBlockError(f"body is {body.nbytes} bytes, header says {header.body_bytes}")
    if expected_key is not None and header.key != expected_key:
        raise CorruptBlockError(f"value belongs to key {header.key!r}, read from {expected_key!r}")
    if expected_group is not None and header.group != expected_group:
        raise CorruptBlockError(f"value is for group {header.group}, expected {expected_group}")
    return DecodedBlock(header=header, body=body)


def decode_header(value: bytes | memoryview) -> tuple[BlockHeader, bool]:
    """Header of a value and whether its checksum holds (for inspection tools)."""
    view = memoryview(value).cast("B")
    try:
        return decode(view).header, True
    except CorruptBlockError:
        if view.nbytes < PREFIX_BYTES:
            raise
        _magic, _version, header_len, _crc = _PREFIX.unpack_from(view, 0)
        return _parse_header(view[PREFIX_BYTES : PREFIX_BYTES + header_len]), False


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
