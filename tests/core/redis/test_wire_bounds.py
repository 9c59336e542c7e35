"""Every length check of the fast path (``hma_redis/core/redis/_wire.c`` and its Python twin
``hma_redis/core/redis/wire.py``) at bound-1, bound and bound+1, through both paths against a
server that answers canned bytes over a real socket: the same results (or the same exception
type), the same bytes in every buffer and the same bytes on the wire. Buffers are exact
allocations, so the AddressSanitizer stage (``scripts/asan.sh``) sees any write past one."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np
import pytest

from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader
from hma_redis.core.medium import Landed, LoadResult, LoadStatus, LoadTarget, PageLayout, Pages
from hma_redis.core.redis import wire
from hma_redis.core.redis.wire import StoreResult, StoreStatus, StoreValue
from tests.support.canned_redis import bulk, exact_buffer, load_both, store_both

PREFIX = codec.PREFIX_BYTES
GET = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
NIL = b"$-1\r\n"
MAX_VALUE = 512 << 20  # the largest bulk length either path accepts
MAX_LINE = 64 * 1024 - 2  # the longest reply line (without its CRLF) either path accepts
SCRATCH = 256 * 1024  # bytes dropped (or only checksummed) per receive
MAX_IOV = 1024  # iovecs per sendmsg / recvmsg


def chunk(blocks: int = 2, page: int = 256, key: str = "k", seed: int = 1) -> tuple[bytes, bytes]:
    """A valid value of ``blocks`` blocks (two layers of ``page`` bytes) and its header."""
    header = BlockHeader(
        key=key,
        group=0,
        first_block=0,
        num_blocks=blocks,
        page_bytes=(page, page),
        kv_dtype="float16",
    )
    body = random.Random(seed).randbytes(header.body_bytes)
    return bytes(codec.encode(header, body)), header.to_msgpack()


def body_of(value: bytes) -> bytes:
    return value[PREFIX + int.from_bytes(value[8:12], "big") :]


def one_target(
    expected: bytes,
    body_len: int,
    head_len: int = PREFIX + 200,
    staging_len: int | None = None,
    max_len: int = 1 << 20,
    prefix: bytes | None = None,
) -> tuple[list[LoadTarget], list[Any]]:
    """One target with exact buffers: a head, one destination of ``body_len`` bytes and an
    optional staging buffer."""
    head, dest = exact_buffer(head_len, 1), exact_buffer(body_len, 2)
    staging = None if staging_len is None else exact_buffer(staging_len, 3)
    target = LoadTarget(head, expected, [dest], staging, max_len, prefix)
    return [target], [head, dest] + ([] if staging is None else [staging])


def landed(result: LoadResult) -> tuple[LoadStatus, Landed | None]:
    return result.status, result.landed


# ------------------------------------------------------------------------------- value lengths


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["max_len-1", "max_len", "max_len+1"])
def test_a_value_one_byte_over_max_len_is_oversized(delta: int) -> None:
    """``max_len`` is the longest value received: one byte more is oversized (drained, nothing
    written), exactly ``max_len`` lands."""
    value, expected = chunk()
    body = body_of(value)

    def make() -> tuple[list[LoadTarget], list[Any]]:
        targets, buffers = one_target(expected, len(body), max_len=len(value) + delta)
        return [*targets, LoadTarget(exact_buffer(PREFIX, 9), b"", [], None, 0)], buffers

    outcome = load_both(bulk(value) + NIL, [GET, GET], make)
    assert outcome.results is not None
    want = (LoadStatus.OVERSIZED, None) if delta < 0 else (LoadStatus.OK, Landed.PAGES)
    assert landed(outcome.results[0]) == want
    assert outcome.results[1].status is LoadStatus.MISSING  # the stream stayed in step
    assert (outcome.buffers[1] == body) == (delta >= 0)


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["value-1", "value", "value+1"])
def test_staging_is_used_only_when_it_holds_the_whole_value(delta: int) -> None:
    """A value that does not match goes to ``staging`` only if staging holds all of it: one
    byte short and it is drained (``layout-mismatch``, staging untouched); otherwise the value
    lands at the start and the bytes after it are untouched."""
    value, _ = chunk(key="theirs")
    _, expected = chunk(key="mine")
    outcome = load_both(
        bulk(value), [GET], lambda: one_target(expected, 1024, staging_len=len(value) + delta)
    )
    assert outcome.results is not None
    staging, untouched = outcome.buffers[2], bytes(exact_buffer(len(value) + delta, 3))
    if delta < 0:
        assert landed(outcome.results[0]) == (LoadStatus.LAYOUT_MISMATCH, None)
        assert staging == untouched
    else:
        assert landed(outcome.results[0]) == (LoadStatus.OK, Landed.STAGING)
        assert outcome.results[0].crc_ok
        assert staging[: len(value)] == value and staging[len(value) :] == untouched[len(value) :]


@pytest.mark.parametrize("length", [PREFIX - 1, PREFIX, PREFIX + 1])
@pytest.mark.parametrize("header_len", [0, 0x7FFFFFFF], ids=["hlen-0", "hlen-huge"])
def test_values_around_the_prefix_length(length: int, header_len: int) -> None:
    """A value shorter than the prefix has no header length (-1) and no valid checksum; from
    48 bytes on the prefix's header length is read and the checksum checked (a 48-byte value
    checksums nothing after its prefix), and a header that does not fit the value is not
    received as one. An empty header matches an empty expected one."""
    value = bytearray(random.Random(length).randbytes(length))
    if length >= PREFIX:
        value[8:12] = header_len.to_bytes(4, "big")
        value[12:16] = crc32c.crc32c(bytes(value[PREFIX:])).to_bytes(4, "big")
    outcome = load_both(
        bulk(bytes(value)), [GET], lambda: one_target(b"", 0, staging_len=PREFIX + 2)
    )
    assert outcome.results is not None
    result = outcome.results[0]
    assert result.header_len == (-1 if length < PREFIX else header_len)
    if length < PREFIX or header_len:
        assert landed(result) == (LoadStatus.OK, Landed.STAGING)
    elif length == PREFIX:  # an empty header and nothing after it: what was expected
        assert landed(result) == (LoadStatus.OK, Landed.PAGES) and result.crc_ok
    else:  # the expected (empty) header with a byte too many
        assert landed(result) == (LoadStatus.LAYOUT_MISMATCH, None)
    if result.landed is not None:  # the checksum field holds the right CRC
        assert result.crc_ok == (length >= PREFIX)
    assert outcome.buffers[0][: min(length, PREFIX)] == bytes(value[:PREFIX])


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["header-1", "header", "header+1"])
def test_a_value_that_ends_around_its_header(delta: int) -> None:
    """A value that ends one byte inside its header is not matched (staging); one that ends
    exactly after it matches a job with no body; one byte more is the expected header with
    another length (``layout-mismatch``, never staging)."""
    value, expected = chunk(blocks=0)
    assert len(value) == PREFIX + len(expected)
    cut = value[: len(value) + delta] if delta <= 0 else value + b"x"
    outcome = load_both(bulk(cut), [GET], lambda: one_target(expected, 0, staging_len=4096))
    assert outcome.results is not None
    want = {
        -1: (LoadStatus.OK, Landed.STAGING),
        0: (LoadStatus.OK, Landed.PAGES),
        1: (LoadStatus.LAYOUT_MISMATCH, None),
    }[delta]
    assert landed(outcome.results[0]) == want


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["head-1", "head", "head+1"])
def test_the_head_must_hold_prefix_and_header(delta: int) -> None:
    """A head one byte too short for prefix and header never matches (the value goes to
    staging); a head of exactly that size, or more, matches and the body lands."""
    value, expected = chunk()
    body = body_of(value)
    head_len = PREFIX + len(expected) + delta
    outcome = load_both(
        bulk(value),
        [GET],
        lambda: one_target(expected, len(body), head_len=head_len, staging_len=len(value)),
    )
    assert outcome.results is not None
    if delta < 0:
        assert landed(outcome.results[0]) == (LoadStatus.OK, Landed.STAGING)
        assert outcome.buffers[2] == value
    else:
        assert landed(outcome.results[0]) == (LoadStatus.OK, Landed.PAGES)
        assert outcome.buffers[1] == body
        assert outcome.buffers[0][: len(value) - len(body)] == value[: len(value) - len(body)]


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["body-1", "body", "body+1"])
def test_a_body_one_byte_short_or_long_never_reaches_the_pages(delta: int) -> None:
    """With the expected header, only a body of exactly the destinations' size lands; one byte
    less or more is ``layout-mismatch`` and the destinations stay untouched."""
    value, expected = chunk()
    body = body_of(value)
    outcome = load_both(
        bulk(value), [GET], lambda: one_target(expected, len(body) - delta, staging_len=None)
    )
    assert outcome.results is not None
    if delta:
        assert landed(outcome.results[0]) == (LoadStatus.LAYOUT_MISMATCH, None)
        assert outcome.buffers[1] == bytes(exact_buffer(len(body) - delta, 2))
    else:
        assert landed(outcome.results[0]) == (LoadStatus.OK, Landed.PAGES)
        assert outcome.buffers[1] == body and outcome.results[0].crc_ok


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["expected-1", "expected", "expected+1"])
def test_only_an_expected_header_of_the_same_length_matches(delta: int) -> None:
    """An expected header one byte shorter (a prefix of the value's) or longer does not match."""
    value, header = chunk()
    expected = header[:-1] if delta < 0 else header + b"\x00" * delta
    outcome = load_both(
        bulk(value),
        [GET],
        lambda: one_target(expected, len(body_of(value)), staging_len=len(value)),
    )
    assert outcome.results is not None
    want = Landed.PAGES if delta == 0 else Landed.STAGING
    assert landed(outcome.results[0]) == (LoadStatus.OK, want)


@pytest.mark.parametrize("prefix_len", [PREFIX - 1, PREFIX, PREFIX + 1])
def test_expected_prefix_of_at_most_48_bytes(prefix_len: int) -> None:
    """``expected_prefix`` may hold the whole prefix (48 bytes), not more (ValueError)."""
    value, expected = chunk()
    prefix = (value + b"\x00")[:prefix_len]
    outcome = load_both(
        bulk(value),
        [GET],
        lambda: one_target(expected, len(body_of(value)), prefix=prefix),
    )
    if prefix_len > PREFIX:
        assert outcome.error is ValueError
    else:
        assert outcome.results is not None
        assert landed(outcome.results[0]) == (LoadStatus.OK, Landed.PAGES)


# --------------------------------------------------------------------------- reply lines


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (b"$536870911", ConnectionError),  # accepted: drained, then the server closes
        (b"$536870912", ConnectionError),
        (b"$536870913", wire.ProtocolError),
        (b"$-1", None),
        (b"_", None),  # the RESP3 null, and one character more
        (b"_x", wire.ProtocolError),
        (b"$-2", wire.ProtocolError),
        (b"$" + b"0" * 17 + b"1", ConnectionError),  # 18 characters
        (b"$" + b"0" * 18 + b"1", wire.ProtocolError),  # 19 characters
        (b"$-" + b"0" * 16 + b"1", None),  # 18 characters
        (b"$-" + b"0" * 17 + b"1", wire.ProtocolError),  # 19 characters
        (b"$1:", wire.ProtocolError),  # the characters around the digits
        (b"$/1", wire.ProtocolError),
        (b"$", wire.ProtocolError),
        (b"$-", wire.ProtocolError),
    ],
)
def test_bulk_length_bounds(line: bytes, want: type[BaseException] | None) -> None:
    """Bulk lengths up to 512 MiB (Redis' proto-max-bulk-len) and 18 characters are read (an
    oversized value is then drained until the server closes: ConnectionError), more is a
    protocol error; -1 is nil, below it a protocol error."""
    outcome = load_both(line + b"\r\n", [GET], lambda: one_target(b"", 0, max_len=0))
    assert outcome.error is want
    if want is None:
        assert outcome.results is not None and outcome.results[0].status is LoadStatus.MISSING


@pytest.mark.parametrize("length", [MAX_LINE - 1, MAX_LINE, MAX_LINE + 1])
@pytest.mark.parametrize("delivery", ["at-once", "in-pieces"])
def test_reply_line_length_bounds(length: int, delivery: str) -> None:
    """A reply line of up to 65 534 bytes (64 KiB with its CRLF) is read, one byte more is a
    protocol error, however the bytes arrive (at once, or the line's first 65 535 bytes
    first)."""
    line = b"-" + b"E" * (length - 1)
    pieces = [MAX_LINE + 1] if delivery == "in-pieces" else []
    outcome = load_both(line + b"\r\n", [GET], lambda: one_target(b"", 0), pieces=pieces)
    if length > MAX_LINE:
        assert outcome.error is wire.ProtocolError
    else:
        assert outcome.results is not None
        assert outcome.results[0].status is LoadStatus.ERROR
        assert outcome.results[0].error == line[1:].decode()


def test_a_reply_that_straddles_the_read_buffer_lands() -> None:
    """A value whose length line and first bytes straddle the end of the 64 KiB read buffer
    (an error reply before it fills the buffer to 15 bytes short of full, ..., to full)
    lands whole."""
    value, expected = chunk(blocks=1, page=64)
    for filler in range(MAX_LINE - 15, MAX_LINE + 1):
        reply = b"-" + b"E" * (filler - 1) + b"\r\n" + bulk(value)

        def make() -> tuple[list[LoadTarget], list[Any]]:
            targets, buffers = one_target(expected, len(body_of(value)))
            spare = LoadTarget(exact_buffer(PREFIX, 9), b"", [], None, 0)
            return [spare, *targets], buffers

        outcome = load_both(reply, [GET, GET], make)
        assert outcome.results is not None, filler
        assert landed(outcome.results[1]) == (LoadStatus.OK, Landed.PAGES), filler
        assert outcome.buffers[1] == body_of(value), filler


# ---------------------------------------------------------------------------- drained bytes


@pytest.mark.parametrize("length", [SCRATCH - 1, SCRATCH, SCRATCH + 1])
def test_drains_and_skips_around_the_scratch_size(length: int) -> None:
    """A value dropped whole (oversized), and body bytes skipped by an ``int`` destination,
    around the 256 KiB scratch size: the stream stays in step and the checksum still covers
    the skipped bytes."""
    oversized = random.Random(length).randbytes(length)
    value, expected = chunk(blocks=1, page=(length + 11) // 2)
    body = body_of(value)
    kept = len(body) - length

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head, tail = exact_buffer(PREFIX + 200, 4), exact_buffer(kept, 5)
        skipping = LoadTarget(head, expected, [length, tail], None, 1 << 20)
        dropping = LoadTarget(exact_buffer(PREFIX, 6), b"", [], None, length - 1)
        return [dropping, skipping], [head, tail]

    outcome = load_both(bulk(oversized) + bulk(value), [GET, GET], make)
    assert outcome.results is not None
    assert outcome.results[0] == LoadResult(LoadStatus.OVERSIZED, length, -1, False, None, None)
    assert landed(outcome.results[1]) == (LoadStatus.OK, Landed.PAGES)
    assert outcome.results[1].crc_ok and outcome.buffers[1] == body[length:]


@pytest.mark.parametrize("count", [MAX_IOV - 2, MAX_IOV - 1, MAX_IOV, MAX_IOV + 1])
def test_destinations_around_the_iovec_limit(count: int) -> None:
    """A body spread over about as many destinations as one receive takes (1024 iovecs, one of
    them the read buffer) lands in order."""
    page = 8
    value, expected = chunk(blocks=count, page=page // 2)
    body = body_of(value)
    assert len(body) == count * page

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head = exact_buffer(PREFIX + len(expected), 7)
        dests = [exact_buffer(page, 100 + i) for i in range(count)]
        return [LoadTarget(head, expected, dests, None, 1 << 20)], [head, *dests]

    outcome = load_both(bulk(value), [GET], make)
    assert outcome.results is not None and outcome.results[0].crc_ok
    assert b"".join(outcome.buffers[1:]) == body


@pytest.mark.parametrize("count", [MAX_IOV - 1, MAX_IOV, MAX_IOV + 1])
def test_commands_around_the_iovec_limit(count: int) -> None:
    """All of a job's commands around one sendmsg's 1024 iovecs reach the server in order."""
    commands = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%d\r\n" % (len(str(i)), i) for i in range(count)]

    def make() -> tuple[list[LoadTarget], list[Any]]:
        return [LoadTarget(exact_buffer(PREFIX, 8), b"", [], None, 0)] * count, []

    outcome = load_both(NIL * count, commands, make)
    assert outcome.results is not None and len(outcome.results) == count
    assert outcome.sent == b"".join(commands)


@pytest.mark.parametrize("pages", [MAX_IOV - 4, MAX_IOV - 3, MAX_IOV - 2])
def test_store_pieces_around_the_iovec_limit(pages: int) -> None:
    """A stored value of framing, head, pages and tail around 1024 pieces is sent whole, in
    order, with its checksum filled in."""
    value, _ = chunk(blocks=pages, page=4)
    cut = len(value) - len(body_of(value))
    body = body_of(value)

    def make() -> tuple[list[StoreValue], list[Any]]:
        head = exact_buffer(cut, 9)
        head[:] = memoryview(value[:cut])
        head[12:16] = 0
        parts = [body[i * 8 : (i + 1) * 8] for i in range(pages)]
        framing = b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % len(value)
        return [StoreValue(framing, head, parts, b"\r\n$2\r\nNX\r\n")], [head]

    outcome = store_both(b"+OK\r\n", make)
    assert outcome.results == [StoreResult(StoreStatus.STORED, None)]
    assert value in outcome.sent


# ------------------------------------------------------------------------------ described pages

ROW = 128  # the row of a described layout's block (pages of 128 fill it, of 100 are padded)


def _layers(rows: int, page: int, cut: int) -> list[Any]:
    """Two exact layers of ``rows`` blocks whose last row ends with its page (the end of a KV
    tensor), the second ``cut`` bytes shorter."""
    size = (rows - 1) * ROW + page
    return [exact_buffer(size, 40), exact_buffer(size - cut, 41)]


def _layout(layers: Sequence[Any], page: int) -> PageLayout:
    return PageLayout(tuple(layers), (page,) * len(layers), (ROW,) * len(layers))


BLOCK_BOUNDS = [
    ([9], 0, True),  # the last block: its page ends at the layer's end (bound - 1)
    ([10], 0, False),  # one past (bound)
    ([11], 0, False),  # two past (bound + 1)
    ([7, 8, 9], 0, True),  # a run that ends at the end
    ([8, 9, 10], 0, False),  # a run that crosses it
    ([0], 0, True),
    ([-1], 0, False),
    ([9], 1, False),  # the second layer one byte short of the last page
    ([8], 1, True),
    ([1 << 62], 0, False),  # an offset that overflows 64 bits
]


@pytest.mark.parametrize(("ids", "cut", "fits"), BLOCK_BOUNDS, ids=repr)
@pytest.mark.parametrize("page", [100, ROW], ids=["padded", "dense"])
def test_a_load_into_pages_past_a_layers_end_is_refused(
    ids: list[int], cut: int, fits: bool, page: int
) -> None:
    """A load into Pages whose block id puts a page outside its layer (past the end, by one
    byte too, or before the start) is refused with ValueError by both paths before anything
    is sent; the bounds themselves land, each page at its block's row."""
    value, expected = chunk(blocks=len(ids), page=page)
    body = body_of(value)

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head, layers = exact_buffer(PREFIX + len(expected), 7), _layers(10, page, cut)
        target = LoadTarget(head, expected, Pages(_layout(layers, page), ids), None, 1 << 20)
        return [target], [head, *layers]

    outcome = load_both(bulk(value), [GET], make)
    if not fits:
        assert outcome.error is ValueError and outcome.sent == b""
        return
    assert outcome.results is not None and outcome.results[0].crc_ok
    for layer_idx, layer in enumerate(outcome.buffers[1:]):
        for pos, block in enumerate(ids):
            at = (layer_idx * len(ids) + pos) * page
            assert layer[block * ROW : block * ROW + page] == body[at : at + page]


@pytest.mark.parametrize(("ids", "cut", "fits"), BLOCK_BOUNDS, ids=repr)
@pytest.mark.parametrize("page", [100, ROW], ids=["padded", "dense"])
def test_a_store_of_pages_past_a_layers_end_is_refused(
    ids: list[int], cut: int, fits: bool, page: int
) -> None:
    """A store of Pages whose block id puts a page outside its layer is refused with
    ValueError by both paths before anything is sent; the bounds are sent whole, each page
    read from its block's row."""
    value, _ = chunk(blocks=len(ids), page=page)
    cut_at = len(value) - len(body_of(value))
    framing = b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % len(value)
    layers = _layers(10, page, cut)

    def make() -> tuple[list[StoreValue], list[Any]]:
        head = exact_buffer(cut_at, 9)
        head[:] = memoryview(value[:cut_at])
        pages = Pages(_layout([np.copy(layer) for layer in layers], page), ids)
        return [StoreValue(framing, head, pages, b"\r\n$2\r\nNX\r\n")], [head]

    outcome = store_both(b"+OK\r\n", make)
    if not fits:
        assert outcome.error is ValueError and outcome.sent == b""
        return
    assert outcome.results == [StoreResult(StoreStatus.STORED, None)]
    pages = b"".join(bytes(layer[b * ROW : b * ROW + page]) for layer in layers for b in ids)
    assert outcome.sent.endswith(pages + b"\r\n$2\r\nNX\r\n")


@pytest.mark.parametrize("blocks", [MAX_IOV - 1, MAX_IOV, MAX_IOV + 1])
def test_described_pages_around_the_iovec_limit(blocks: int) -> None:
    """Padded pages cut from a layout, about as many as one receive or send takes (1024
    iovecs), land and are sent in order on both paths."""
    page, rows = 4, MAX_IOV + 8
    value, expected = chunk(blocks=blocks, page=page)
    body = body_of(value)
    ids = list(range(rows - blocks, rows))

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head = exact_buffer(PREFIX + len(expected), 7)
        layers = [exact_buffer(rows * 8, 50), exact_buffer(rows * 8, 51)]
        layout = PageLayout(tuple(layers), (page, page), (8, 8))
        return [LoadTarget(head, expected, Pages(layout, ids), None, 1 << 20)], [head, *layers]

    outcome = load_both(bulk(value), [GET], make)
    assert outcome.results is not None and outcome.results[0].crc_ok
    got = b"".join(layer[b * 8 : b * 8 + page] for layer in outcome.buffers[1:] for b in ids)
    assert got == body


# ----------------------------------------------------------------------------- argument bounds


def _missing_job(head_len: int = PREFIX, **changes: Any) -> Any:
    """A job of one target (``changes`` replace its fields) whose key is missing."""

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head = exact_buffer(head_len, 10)
        return [LoadTarget(head, b"", [], None, 0)._replace(**changes)], [head]

    return make


@pytest.mark.parametrize(
    ("changes", "ok"),
    [
        ({"head_len": PREFIX - 1}, False),
        ({"head_len": PREFIX}, True),
        ({"head_len": PREFIX + 1}, True),
        ({"max_len": -1}, False),
        ({"max_len": 0}, True),
        ({"max_len": 1}, True),
        ({"dests": [-1]}, False),
        ({"dests": [0]}, True),
        ({"dests": [MAX_VALUE]}, True),
        ({"dests": [MAX_VALUE + 1]}, False),
    ],
    ids=repr,
)
def test_target_argument_bounds(changes: dict[str, Any], ok: bool) -> None:
    """A head shorter than the prefix, a negative ``max_len`` and a skip outside
    [0, 512 MiB] are refused with ValueError before anything is sent; their bounds are
    accepted."""
    outcome = load_both(NIL, [GET], _missing_job(**changes))
    if ok:
        assert outcome.results is not None and outcome.results[0].status is LoadStatus.MISSING
    else:
        assert outcome.error is ValueError and outcome.sent == b""


@pytest.mark.parametrize(
    ("timeout_s", "window", "ok"),
    [
        (0.0, 0, False),
        (0.5, 0, True),
        (86400.0, 0, True),
        (86400.001, 0, False),
        (1.0, -1, False),
        (1.0, 1, True),
    ],
)
def test_timeout_and_window_bounds(timeout_s: float, window: int, ok: bool) -> None:
    """``timeout_s`` in (0, one day] and ``window`` >= 0, else ValueError before anything is
    sent."""
    outcome = load_both(NIL, [GET], _missing_job(), window=window, timeout_s=timeout_s)
    if ok:
        assert outcome.results is not None
    else:
        assert outcome.error is ValueError and outcome.sent == b""


@pytest.mark.parametrize("head_len", [PREFIX - 1, PREFIX, PREFIX + 1])
def test_store_head_of_at_least_the_prefix(head_len: int) -> None:
    """A store's head must hold the 48-byte prefix (ValueError before anything is sent)."""

    def make() -> tuple[Sequence[StoreValue], list[Any]]:
        head = exact_buffer(head_len, 11)
        framing = b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % head_len
        return [StoreValue(framing, head, [], b"\r\n$2\r\nNX\r\n")], [head]

    outcome = store_both(b"+OK\r\n", make)
    if head_len < PREFIX:
        assert outcome.error is ValueError and outcome.sent == b""
    else:
        assert outcome.results == [StoreResult(StoreStatus.STORED, None)]


def test_an_error_text_ends_at_a_nul_byte() -> None:
    """An error reply's text is cut at a NUL byte on both paths (a C string ends there)."""
    outcome = load_both(b"-ERR bad\x00more\r\n", [GET], _missing_job())
    assert outcome.results is not None and outcome.results[0].error == "ERR bad"


@pytest.mark.parametrize(
    "ending", [b"\r\n", b"\rX", b"X\n", b"XX"], ids=["crlf", "cr-only", "lf-only", "neither"]
)
def test_a_bulk_string_must_end_with_crlf(ending: bytes) -> None:
    """A value is followed by exactly CRLF; anything else is a protocol error."""
    value, expected = chunk()
    outcome = load_both(
        b"$%d\r\n%s%s" % (len(value), value, ending),
        [GET],
        lambda: one_target(expected, len(body_of(value))),
    )
    if ending == b"\r\n":
        assert outcome.results is not None and outcome.results[0].status is LoadStatus.OK
    else:
        assert outcome.error is wire.ProtocolError


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        (b"+OK\r\n", StoreResult(StoreStatus.STORED, None)),
        (b"$-1\r\n", StoreResult(StoreStatus.EXISTED, None)),
        (b"_\r\n", StoreResult(StoreStatus.EXISTED, None)),
        (
            b"-OOM command not allowed\r\n",
            StoreResult(StoreStatus.ERROR, "OOM command not allowed"),
        ),
        (b"+QUEUED\r\n", wire.ProtocolError),  # a status that is not OK
        (b"$2\r\nOK\r\n", wire.ProtocolError),  # a bulk string
        (b"+OK\r\n+OK\r\n", wire.ProtocolError),  # a reply more than values
        (b"", ConnectionError),  # none at all
    ],
)
def test_store_replies(reply: bytes, want: Any) -> None:
    """A SET NX answers +OK (stored), nil (existed) or an error; another status, a bulk
    string, or bytes after the last reply are protocol errors, on both paths."""

    def make() -> tuple[Sequence[StoreValue], list[Any]]:
        head = exact_buffer(PREFIX, 12)
        framing = b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % PREFIX
        return [StoreValue(framing, head, [], b"\r\n$2\r\nNX\r\n")], [head]

    outcome = store_both(reply, make)
    if isinstance(want, StoreResult):
        assert outcome.results == [want]
    else:
        assert outcome.error is want


# -------------------------------------------------------------------- bodies after their head

# Destinations one receive takes: MAX_IOV iovecs, one of them kept for the read buffer.
IOV_DESTS = MAX_IOV - 1
AFTER_HEAD_COUNTS = [
    IOV_DESTS - 1,
    IOV_DESTS,
    IOV_DESTS + 1,
    IOV_DESTS + 2,
    2 * IOV_DESTS - 1,
    2 * IOV_DESTS,
    2 * IOV_DESTS + 1,
]


def _head_bytes(value: bytes, expected: bytes) -> int:
    """The bytes of ``value``'s reply up to the end of its header: its length line, prefix and
    header."""
    return len(b"$%d\r\n" % len(value)) + PREFIX + len(expected)


@pytest.mark.parametrize("count", AFTER_HEAD_COUNTS)
@pytest.mark.parametrize("skip_at", [None, IOV_DESTS - 1], ids=["buffers", "skip-at-the-limit"])
def test_destinations_around_the_iovec_limit_arriving_after_the_head(
    count: int, skip_at: int | None
) -> None:
    """The server sends a value's length line, prefix and header, then (a pause later) its
    body and the next reply: nothing of the body is buffered when its destinations are
    received, so the C job receives straight into them, at most 1023 per receive with the read
    buffer as the 1024th once the list reaches the value's end. Around those bounds (and with
    a skipped destination, which ends a receive's list, at the limit), both paths land every
    byte in order, leave the skipped bytes out, and stay in step for the next value."""
    page = 8
    value, expected = chunk(blocks=count, page=page // 2)
    body = body_of(value)
    assert len(body) == count * page
    after, after_expected = chunk(blocks=1, page=page, key="next", seed=2)

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head = exact_buffer(PREFIX + len(expected), 7)
        dests = [page if i == skip_at else exact_buffer(page, 100 + i) for i in range(count)]
        next_head = exact_buffer(PREFIX + len(after_expected), 8)
        next_dest = exact_buffer(len(body_of(after)), 9)
        targets = [
            LoadTarget(head, expected, dests, None, 1 << 20),
            LoadTarget(next_head, after_expected, [next_dest], None, 1 << 20),
        ]
        buffers = [head, *(d for d in dests if not isinstance(d, int)), next_head, next_dest]
        return targets, buffers

    outcome = load_both(
        bulk(value) + bulk(after), [GET, GET], make, pieces=[_head_bytes(value, expected)]
    )
    assert outcome.results is not None
    assert [landed(r) for r in outcome.results] == [(LoadStatus.OK, Landed.PAGES)] * 2
    assert all(r.crc_ok for r in outcome.results)
    kept = [body[i * page : (i + 1) * page] for i in range(count) if i != skip_at]
    assert b"".join(outcome.buffers[1 : 1 + len(kept)]) == b"".join(kept)
    assert outcome.buffers[-1] == body_of(after)


@pytest.mark.parametrize("blocks", [IOV_DESTS // 2, IOV_DESTS // 2 + 1, IOV_DESTS])
def test_described_pages_around_the_iovec_limit_arriving_after_the_head(blocks: int) -> None:
    """Padded pages cut from a layout (one piece per block and layer: 1022, 1024 and 2046
    pieces) whose body arrives after the head land in order on both paths."""
    page, rows = 4, 2 * MAX_IOV
    value, expected = chunk(blocks=blocks, page=page)
    body = body_of(value)
    ids = list(range(rows - blocks, rows))

    def make() -> tuple[list[LoadTarget], list[Any]]:
        head = exact_buffer(PREFIX + len(expected), 7)
        layers = [exact_buffer(rows * 8, 50), exact_buffer(rows * 8, 51)]
        layout = PageLayout(tuple(layers), (page, page), (8, 8))
        return [LoadTarget(head, expected, Pages(layout, ids), None, 1 << 20)], [head, *layers]

    outcome = load_both(bulk(value), [GET], make, pieces=[_head_bytes(value, expected)])
    assert outcome.results is not None
    assert landed(outcome.results[0]) == (LoadStatus.OK, Landed.PAGES)
    assert outcome.results[0].crc_ok
    got = b"".join(layer[b * 8 : b * 8 + page] for layer in outcome.buffers[1:] for b in ids)
    assert got == body
