"""A bounded fuzz of the fast path's reply reader: a hostile server over a real socket answers
load jobs with random RESP (bulk lengths that lie, values cut short, damaged prefixes and
headers, error and status lines, too few or too many replies, bad length lines). Both paths
must give the same results or raise the same exception type, leave the same bytes in every
buffer, and never write outside them (``scripts/asan.sh`` runs this under AddressSanitizer).

``HMA_FUZZ_CASES`` sets the number of random jobs (default 150); each is reproducible from its
seed (the test id)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader
from hma_redis.core.medium import LoadTarget
from hma_redis.core.redis import wire
from tests.support.canned_redis import bulk, exact_buffer, load_both

CASES = int(os.environ.get("HMA_FUZZ_CASES", "150"))
PREFIX = codec.PREFIX_BYTES
GET = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


def _chunk(rng: random.Random) -> tuple[bytes, bytes]:
    """A valid value (random key, blocks and page size) and its msgpack header."""
    page = rng.choice([1, 7, 64, 512])
    header = BlockHeader(
        key=f"k{rng.randrange(1000)}",
        group=rng.randrange(3),
        first_block=0,
        num_blocks=rng.randrange(0, 5),
        page_bytes=(page,) * rng.randrange(1, 3),
        kv_dtype="float16",
    )
    body = rng.randbytes(header.body_bytes)
    return bytes(codec.encode(header, body)), header.to_msgpack()


def _damaged(rng: random.Random, value: bytes) -> bytes:
    """``value`` unchanged, cut, grown, with a flipped byte or a lying header length."""
    kind = rng.randrange(10)  # 0 and 6-9: unchanged
    out = bytearray(value)
    if kind == 1 and out:
        del out[rng.randrange(len(out)) :]
    elif kind == 2:
        out += rng.randbytes(rng.randrange(1, 40))
    elif kind == 3 and out:
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif kind == 4 and len(out) >= PREFIX:
        hlen = rng.choice([0, 1, len(out), 0xFFFFFFFF, rng.randrange(1 << 32)])
        out[8:12] = hlen.to_bytes(4, "big")
    elif kind == 5:
        out = bytearray(rng.randbytes(rng.randrange(0, 120)))
    return bytes(out)


def _reply(rng: random.Random, value: bytes) -> bytes:
    """One reply to a GET: mostly the value, sometimes anything else a hostile server sends."""
    kind = rng.randrange(28)  # 7-27: the value
    if kind == 0:
        return b"$-1\r\n"
    if kind == 1:
        return b"_\r\n"
    if kind == 2:
        return b"-ERR " + rng.randbytes(rng.randrange(0, 30)).replace(b"\r\n", b"") + b"\r\n"
    if kind == 3:
        return b"+OK\r\n"
    if kind == 4:  # a bulk length that lies
        told = max(-3, len(value) + rng.choice([-2, -1, 1, 2, 1000, -len(value) - 1]))
        return b"$%d\r\n" % told + value + b"\r\n"
    if kind == 5:  # a bad length line
        return rng.choice([b"$\r\n", b"$x\r\n", b"$1x\r\n", b"$99999999999999999999\r\n"])
    if kind == 6:  # another type, or a missing CRLF after the body
        return rng.choice([b"*1\r\n", b":1\r\n", b"%0\r\n", b"$%d\r\n%sXX" % (len(value), value)])
    return bulk(value)


def _targets(rng: random.Random, expected: bytes, body_len: int) -> tuple[list[Any], list[Any]]:
    """One target with exact buffers: a head of random size, the body split into random
    destinations (some skipped: ints), maybe a staging buffer, a random ``max_len``."""
    head = exact_buffer(PREFIX + max(0, len(expected) + rng.randrange(-2, 40)), rng.randrange(99))
    cuts = sorted(rng.randrange(body_len + 1) for _ in range(rng.randrange(4)))
    dests: list[Any] = []
    buffers: list[Any] = [head]
    for start, end in zip([0, *cuts], [*cuts, body_len], strict=True):
        if rng.random() < 0.2:
            dests.append(end - start)
        else:
            dests.append(exact_buffer(end - start, rng.randrange(99)))
            buffers.append(dests[-1])
    staging = None
    if rng.random() < 0.6:
        staging = exact_buffer(rng.randrange(0, PREFIX + len(expected) + body_len + 60), 5)
        buffers.append(staging)
    max_len = rng.choice([1 << 20, PREFIX + len(expected) + body_len, rng.randrange(0, 200)])
    prefix = None
    if rng.random() < 0.3:
        prefix = codec.MAGIC + bytes(rng.randrange(2) for _ in range(4))
    return [LoadTarget(head, expected, dests, staging, max_len, prefix)], buffers


def _job(seed: int) -> tuple[bytes, list[bytes], Any]:
    """A random job: its reply stream, its commands and its target maker."""
    rng = random.Random(seed)
    count = rng.randrange(1, 6)
    chunks = [_chunk(rng) for _ in range(count)]
    replies = [_reply(rng, _damaged(rng, value)) for value, _ in chunks]
    if rng.random() < 0.1:
        replies = replies[: rng.randrange(count)]  # too few
    if rng.random() < 0.1:
        replies.append(rng.choice([b"$-1\r\n", b"+OK\r\n", b"x"]))  # too many
    stream = b"".join(replies)
    if rng.random() < 0.1 and stream:
        stream = stream[: rng.randrange(len(stream))]  # the server stops mid-stream
    specs = [(expected, len(value) - PREFIX - len(expected)) for value, expected in chunks]

    def make() -> tuple[list[Any], list[Any]]:
        inner = random.Random(seed + 1)
        targets: list[Any] = []
        buffers: list[Any] = []
        for expected, body_len in specs:
            more, held = _targets(inner, expected, body_len)
            targets += more
            buffers += held
        return targets, buffers

    return stream, [GET] * count, make


@pytest.mark.parametrize("seed", range(CASES))
def test_random_replies_give_the_same_outcome_on_both_paths(seed: int) -> None:
    """A random, often hostile, reply stream: the same results or exception type, and the same
    bytes in every buffer, on both paths."""
    stream, commands, make = _job(seed)
    load_both(stream, commands, make, window=random.Random(seed).randrange(3))


def _strlen_reply(rng: random.Random, length: int) -> bytes:
    """STRLEN's reply: mostly the length, sometimes a lie, an error or another type."""
    kind = rng.randrange(12)  # 5-11: the length
    if kind == 0:
        return b":%d\r\n" % max(0, length + rng.choice([-1, 1, 7]))
    if kind == 1:
        return b":0\r\n"
    if kind == 2:
        return b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    if kind == 3:
        return rng.choice([b":-1\r\n", b":x\r\n", b"+OK\r\n", b"$1\r\n1\r\n", b"_\r\n"])
    if kind == 4:
        return b":%d\r\n" % rng.randrange(1 << 30)
    return b":%d\r\n" % length


def _pieces_job(seed: int) -> tuple[bytes, list[bytes], Any, int]:
    """A random job whose longer targets are read in pieces (the targets and values of the GET
    job of this seed, bounds over 64 pieces cut to 64): each one's STRLEN reply and its pieces'
    replies (mostly the value's slices, sometimes anything :func:`_reply` sends), the others
    one GET's reply; its stream, commands, target maker and piece size."""
    rng = random.Random(seed)
    values = [_chunk(rng)[0] for _ in range(rng.randrange(1, 6))]  # as _job draws them
    _, _, make = _job(seed)
    rng = random.Random(seed + 7)
    piece = rng.choice([1, 5, 64, 200, 4096])

    def capped() -> tuple[list[Any], list[Any]]:
        targets, buffers = make()
        return [t._replace(max_len=min(t.max_len, 64 * piece)) for t in targets], buffers

    replies: list[bytes] = []
    commands: list[bytes] = []
    for target, value in zip(capped()[0], values, strict=True):
        value = _damaged(rng, value)
        count = wire.pieces_of(target.max_len, piece)
        commands.append(wire.load_command("k", target.max_len, piece))
        if not count:
            replies.append(_reply(rng, value))
            continue
        replies.append(_strlen_reply(rng, len(value)))
        for idx in range(count):
            part = value[idx * piece : min((idx + 1) * piece, target.max_len)]
            replies.append(_reply(rng, part) if rng.random() < 0.03 else bulk(part))
    out = b"".join(replies)
    if rng.random() < 0.1 and out:
        out = out[: rng.randrange(len(out))]  # the server stops mid-stream
    return out, commands, capped, piece


@pytest.mark.parametrize("seed", range(CASES // 2))
def test_random_replies_to_values_read_in_pieces_give_the_same_outcome_on_both_paths(
    seed: int,
) -> None:
    """STRLEN and GETRANGE replies as a hostile server sends them (lying lengths, values that
    change between pieces, errors, nils and other types in a piece's place, a stream cut
    short): the same results or exception type, and the same bytes in every buffer, on both
    paths (under AddressSanitizer with ``scripts/asan.sh``)."""
    stream, commands, make, piece = _pieces_job(seed)
    load_both(stream, commands, make, window=random.Random(seed).randrange(3), piece_bytes=piece)
