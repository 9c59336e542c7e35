"""The native fast path against its pure-Python oracle, on a real Redis: every job runs through
both, and results, exceptions and every byte of every buffer must be the same (and right)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import crc32c as crc32c_package
import pytest
import redis

from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader
from hma_redis.core.medium import Landed, LoadResult, LoadStatus, LoadTarget, PageLayout, Pages
from hma_redis.core.redis import _wire as native_module
from hma_redis.core.redis import wire
from hma_redis.core.redis.wire import StoreResult, StoreStatus, StoreValue

LoadFn = Callable[..., list[LoadResult]]
StoreFn = Callable[..., list[StoreResult]]
PATHS: dict[str, tuple[LoadFn, StoreFn]] = {
    "native": (wire.native_load_values, wire.native_store_values),
    "python": (wire.python_load_values, wire.python_store_values),
}
TIMEOUT_S = 5.0


# ------------------------------------------------------------------------------------- helpers


def resp(*args: bytes | str | int) -> bytes:
    """One command in RESP framing."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def connect(url: str, resp3: bool = False) -> socket.socket:
    """A plain socket to ``url``; with ``resp3``, switched by HELLO 3 (replies read off)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S)
    if resp3:
        sock.sendall(resp("HELLO", 3) + resp("PING"))
        seen = b""
        while not seen.endswith(b"+PONG\r\n"):
            chunk = sock.recv(65536)
            assert chunk, "Redis closed the connection during HELLO 3"
            seen += chunk
        assert seen.startswith(b"%"), "HELLO 3 did not answer with a RESP3 map"
    return sock


def pattern(nbytes: int, seed: int) -> bytearray:
    """Deterministic junk: a buffer's content before a job writes into it."""
    return bytearray(random.Random(seed).randbytes(nbytes))


@dataclass
class Cache:
    """A CPU KV cache of one group: per layer, ``num_blocks`` rows of ``row_bytes`` (pages of
    ``page_bytes``, the rest padding), as the worker sees it."""

    layers: list[bytearray]
    page_bytes: int
    row_bytes: int

    @classmethod
    def make(cls, num_layers: int, num_blocks: int, page: int, row: int, seed: int) -> Cache:
        layers = [pattern(num_blocks * row, seed + i) for i in range(num_layers)]
        return cls(layers, page, row)

    def spans(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(offset in a layer, bytes) of the blocks' pages in order: one span per run of
        consecutive ids where rows are unpadded, else one per page (as the worker's _spans)."""
        if self.row_bytes != self.page_bytes:
            return [(b * self.row_bytes, self.page_bytes) for b in block_ids]
        spans: list[tuple[int, int]] = []
        for block in block_ids:
            if spans and spans[-1][0] + spans[-1][1] == block * self.row_bytes:
                spans[-1] = (spans[-1][0], spans[-1][1] + self.page_bytes)
            else:
                spans.append((block * self.row_bytes, self.page_bytes))
        return spans

    def dests(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Destination views of a chunk's body: layer-major, the blocks' pages in order."""
        return [
            memoryview(layer)[at : at + nbytes]
            for layer in self.layers
            for at, nbytes in self.spans(block_ids)
        ]

    def pages(self, block_ids: Sequence[int]) -> list[bytes]:
        return [bytes(view) for view in self.dests(block_ids)]

    def layout(self) -> PageLayout:
        n = len(self.layers)
        return PageLayout(tuple(self.layers), (self.page_bytes,) * n, (self.row_bytes,) * n)

    def body(self, block_ids: Sequence[int], form: str) -> list[memoryview] | Pages:
        """A chunk's body in either form the data path takes: a view per span, or Pages."""
        return self.dests(block_ids) if form == "views" else Pages(self.layout(), block_ids)


def header_for(key: str, num_blocks: int, cache: Cache, group: int = 0) -> BlockHeader:
    return BlockHeader(
        key=key,
        group=group,
        first_block=0,
        num_blocks=num_blocks,
        page_bytes=(cache.page_bytes,) * len(cache.layers),
        kv_dtype="float16",
    )


def body_of(header: BlockHeader, seed: int) -> bytes:
    return bytes(pattern(header.body_bytes, seed))


@dataclass
class Job:
    """A load job, rebuilt identically for each path: fresh buffers with the same junk."""

    keys: list[str]
    make: Callable[[int], tuple[list[LoadTarget], list[bytearray]]]

    def commands(self, targets: Sequence[LoadTarget] = (), piece_bytes: int = 0) -> list[bytes]:
        """GETs, or with ``piece_bytes`` each target's commands (:func:`wire.load_command`)."""
        if not piece_bytes:
            return [resp("GET", key) for key in self.keys]
        return [
            wire.load_command(key, target.max_len, piece_bytes)
            for key, target in zip(self.keys, targets, strict=True)
        ]


@contextlib.contextmanager
def connections(url: str, lanes: int, resp3: bool = False) -> Iterator[list[socket.socket]]:
    """``lanes`` fresh plain sockets to ``url``, each still in step when the block ends (a PING
    answers PONG on every one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connect(url, resp3)) for _ in range(lanes)]
        yield socks
        for sock in socks:
            sock.sendall(resp("PING"))
            assert sock.recv(100) == b"+PONG\r\n"


def on(socks: list[socket.socket]) -> socket.socket | list[socket.socket]:
    """One socket as itself (the single-connection form), several as the list."""
    return socks[0] if len(socks) == 1 else socks


def run_both(
    url: str,
    job: Job,
    window: int = 0,
    resp3: bool = False,
    lanes: int = 1,
    piece_bytes: int = 0,
) -> tuple[list[LoadResult], list[bytearray]]:
    """Run ``job`` through both paths on ``lanes`` fresh connections (on several, the native
    path also with every connection read on the calling thread, ``one_thread``); with
    ``piece_bytes``, targets longer than that read in pieces; assert identical results and
    identical bytes in every buffer; return the native results and buffers."""
    outcome: dict[str, tuple[list[LoadResult], list[bytes]]] = {}
    native_buffers: list[bytearray] = []
    paths = {name: load for name, (load, _) in PATHS.items()}
    if lanes > 1:
        paths["native-one-thread"] = functools.partial(wire.native_load_values, one_thread=True)
    for name, load in paths.items():
        targets, buffers = job.make(0)
        with connections(url, lanes, resp3) as socks:
            commands = job.commands(targets, piece_bytes)
            results = load(on(socks), commands, targets, TIMEOUT_S, window, piece_bytes=piece_bytes)
        outcome[name] = (results, [bytes(b) for b in buffers])
        if name == "native":
            native_buffers = buffers
    for name in paths:
        assert outcome[name][0] == outcome["python"][0], name
        for idx, (a, b) in enumerate(zip(outcome[name][1], outcome["python"][1], strict=True)):
            assert a == b, f"buffer {idx} differs between the {name} and the Python path"
    return outcome["native"][0], native_buffers


def page_job(
    client: redis.Redis,
    cache_seed: int,
    chunks: list[tuple[str, list[int]]],
    cache: Cache,
    form: str = "views",
    max_len: int = 64 << 20,
) -> tuple[Job, dict[str, bytes]]:
    """Store one value per chunk (random body) and build a job that loads them into a copy of
    ``cache`` (destinations in ``form``: "views" or "pages"); returns the job and each key's
    body."""
    bodies: dict[str, bytes] = {}
    headers: dict[str, BlockHeader] = {}
    for idx, (key, ids) in enumerate(chunks):
        headers[key] = header_for(key, len(ids), cache)
        bodies[key] = body_of(headers[key], cache_seed * 1000 + idx)
        client.set(key, bytes(codec.encode(headers[key], bodies[key])))

    def make(_: int) -> tuple[list[LoadTarget], list[bytearray]]:
        fresh = Cache(
            [bytearray(layer) for layer in cache.layers], cache.page_bytes, cache.row_bytes
        )
        targets: list[LoadTarget] = []
        buffers: list[bytearray] = list(fresh.layers)
        for idx, (key, ids) in enumerate(chunks):
            head = pattern(codec.PREFIX_BYTES + 200, 7 + idx)
            buffers.append(head)
            expected = headers[key].to_msgpack()
            targets.append(LoadTarget(head, expected, fresh.body(ids, form), None, max_len))
        return targets, buffers

    return Job([key for key, _ in chunks], make), bodies


def expected_layers(
    cache: Cache, chunks: list[tuple[str, list[int]]], bodies: dict[str, bytes]
) -> list[bytes]:
    """The cache's layers after a correct load of ``chunks``."""
    layers = [bytearray(layer) for layer in cache.layers]
    for key, ids in chunks:
        body = memoryview(bodies[key])
        spans = cache.spans(ids)
        offset = 0
        for layer in layers:
            for at, nbytes in spans:
                layer[at : at + nbytes] = body[offset : offset + nbytes]
                offset += nbytes
    return [bytes(layer) for layer in layers]


def raw_key(url: str, key: str, value: bytes) -> None:
    with redis.Redis.from_url(url) as client:
        client.set(key, value)


# ------------------------------------------------------------------------------------- tests


def test_native_extension_is_built_and_chosen(caplog: pytest.LogCaptureFixture) -> None:
    """The install built the extension; plain sockets use it and say so once."""
    assert wire.available(), wire.unavailable_reason()
    caplog.set_level("INFO", logger="hma_redis.core.redis.wire")
    wire._announced = False
    sock = socket.socket()
    try:
        assert wire._native_for(sock)
        assert wire._native_for(sock)
    finally:
        sock.close()
    lines = [r.getMessage() for r in caplog.records if "transfer data path" in r.getMessage()]
    assert len(lines) == 1 and "native" in lines[0], lines


@pytest.mark.parametrize(("page", "row"), [(4096, 4096), (3000, 4096)], ids=["dense", "padded"])
@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("lanes", [1, 4], ids=["1-conn", "4-conns"])
@pytest.mark.parametrize("form", ["views", "pages"])
def test_values_land_in_their_pages(
    redis_url: str,
    redis_client: redis.Redis,
    page: int,
    row: int,
    window: int,
    lanes: int,
    form: str,
) -> None:
    """Values of several sizes land exactly in their blocks' pages (random block ids, runs and
    padded rows), the rest of the cache untouched, CRC checked, identically on both paths,
    on one connection and on four (value i on connection i mod 4; six values, so two
    connections carry two), the pages given as views or described (Pages)."""
    rng = random.Random(page + window)
    cache = Cache.make(num_layers=8, num_blocks=400, page=page, row=row, seed=1)
    free = list(range(400))
    rng.shuffle(free)
    # Blocks per value: up to 4.8 MiB values of 1200 pages (more than one recvmsg's iovecs).
    sizes = [1, 3, 16, 64, 7, 150]
    chunks: list[tuple[str, list[int]]] = []
    for idx, size in enumerate(sizes):
        ids, free = free[:size], free[size:]
        if idx % 2:  # some chunks with consecutive ids (runs)
            ids = sorted(ids)
        chunks.append((f"k{idx}", ids))
    job, bodies = page_job(redis_client, 3, chunks, cache, form)
    results, buffers = run_both(redis_url, job, window=window, lanes=lanes)
    assert [r.status for r in results] == [LoadStatus.OK] * len(chunks)
    assert all(r.landed is Landed.PAGES and r.crc_ok for r in results)
    assert [bytes(b) for b in buffers[: len(cache.layers)]] == expected_layers(
        cache, chunks, bodies
    )
    for idx, (key, ids) in enumerate(chunks):
        head = buffers[len(cache.layers) + idx]
        header = header_for(key, len(ids), cache)
        stored = bytes(codec.encode(header, bodies[key]))
        end = codec.PREFIX_BYTES + len(header.to_msgpack())
        assert head[:end] == stored[:end]
        assert results[idx].value_len == len(stored)
        assert results[idx].header_len == end - codec.PREFIX_BYTES


def test_a_job_of_values_over_3_mib_runs_one_get_at_a_time() -> None:
    """Two replies over 3 MiB would overflow the kernel's usual largest send buffer (4 MiB):
    such a job keeps one GET in flight, others two; the bound of a value (``max_len``)
    decides, so one large value among small ones is enough."""

    def targets(*max_lens: int) -> list[LoadTarget]:
        return [LoadTarget(bytearray(64), b"", [], None, n) for n in max_lens]

    assert wire.window_for(targets()) == wire.DEFAULT_WINDOW == 2
    assert wire.window_for(targets(512 << 10, 2 << 20)) == 2
    assert wire.window_for(targets(3 << 20)) == 2
    assert wire.window_for(targets(4096, (3 << 20) + 1)) == 1
    assert wire.window_for(targets(8 << 20)) == 1


@pytest.mark.parametrize("lanes", [1, 2, 4, 7])
@pytest.mark.parametrize("window", [0, 2, 1 << 62], ids=["all", "2", "huge"])
def test_many_small_values_in_one_job(
    redis_url: str, redis_client: redis.Redis, lanes: int, window: int
) -> None:
    """Hundreds of small values: several replies arrive in one receive and are split right,
    also spread over connections (600 values over 7: some carry one value more). A window
    past the job's size (whose product with the connections would overflow 64 bits) sends
    every command first, as 0 does."""
    cache = Cache.make(num_layers=2, num_blocks=600, page=64, row=64, seed=5)
    chunks = [(f"s{i}", [i]) for i in range(600)]
    job, bodies = page_job(redis_client, 11, chunks, cache)
    results, buffers = run_both(redis_url, job, window=window, lanes=lanes)
    assert all(r.status is LoadStatus.OK and r.crc_ok for r in results)
    assert [bytes(b) for b in buffers[:2]] == expected_layers(cache, chunks, bodies)


def test_skipped_blocks_are_checksummed_but_not_written(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """An int in ``dests`` drops that many body bytes (a value holding more blocks than the
    load needs) and still checksums them."""
    cache = Cache.make(num_layers=2, num_blocks=8, page=1024, row=1024, seed=9)
    header = header_for("wide", 4, cache)
    body = body_of(header, 99)
    redis_client.set("wide", bytes(codec.encode(header, body)))
    big = header_for("huge", 600, Cache.make(2, 1, 1024, 1024, 0))
    big_body = body_of(big, 98)
    redis_client.set("huge", bytes(codec.encode(big, big_body)))

    def make(_: int) -> tuple[list[LoadTarget], list[bytearray]]:
        layers = [pattern(8 * 1024, 40 + i) for i in range(2)]
        heads = [pattern(300, 50), pattern(300, 51)]
        huge_dest = bytearray(1024)
        # Per layer: skip block 0, take blocks 1-2 into cache blocks 5 and 2, skip block 3.
        dests: list[Any] = []
        for layer in layers:
            dests += [1024, memoryview(layer)[5 * 1024 : 6 * 1024]]
            dests += [memoryview(layer)[2 * 1024 : 3 * 1024], 1024]
        # A skip longer than the scratch buffer, then the last page.
        huge_dests: list[Any] = [big.body_bytes - 1024, memoryview(huge_dest)]
        targets = [
            LoadTarget(heads[0], header.to_msgpack(), dests, None, 1 << 20),
            LoadTarget(heads[1], big.to_msgpack(), huge_dests, None, 2 << 20),
        ]
        return targets, [*layers, *heads, huge_dest]

    results, buffers = run_both(redis_url, Job(["wide", "huge"], make))
    assert all(r.status is LoadStatus.OK and r.landed is Landed.PAGES and r.crc_ok for r in results)
    for idx in range(2):
        layer = buffers[idx]
        base = idx * 4 * 1024
        assert layer[5 * 1024 : 6 * 1024] == body[base + 1024 : base + 2048]
        assert layer[2 * 1024 : 3 * 1024] == body[base + 2048 : base + 3072]
        untouched = pattern(8 * 1024, 40 + idx)
        assert layer[:2048] == untouched[:2048] and layer[6144:] == untouched[6144:]
    assert buffers[4] == big_body[-1024:]


@pytest.mark.parametrize("lanes", [1, 3, 6])
def test_missing_keys_and_error_replies(
    redis_url: str, redis_client: redis.Redis, lanes: int
) -> None:
    """A missing key is ``missing``, an error reply (GET of a list) is ``error`` with Redis'
    message, the values around them land, and every connection stays in step (also with more
    connections than values: the spare ones carry nothing)."""
    cache = Cache.make(num_layers=1, num_blocks=4, page=512, row=512, seed=2)
    job, bodies = page_job(redis_client, 5, [("a", [0]), ("b", [1])], cache)
    redis_client.rpush("a-list", "x")
    inner = job.make

    def make(seed: int) -> tuple[list[LoadTarget], list[bytearray]]:
        targets, buffers = inner(seed)
        head = pattern(100, 3)
        spare = LoadTarget(head, b"", [], None, 1000)
        return [targets[0], spare, spare, targets[1]], [*buffers, head]

    job = Job(["a", "nope", "a-list", "b"], make)
    results, buffers = run_both(redis_url, job, window=1, lanes=lanes)
    assert [r.status for r in results] == [
        LoadStatus.OK,
        LoadStatus.MISSING,
        LoadStatus.ERROR,
        LoadStatus.OK,
    ]
    assert results[2].error is not None and results[2].error.startswith("WRONGTYPE")
    assert results[1] == LoadResult(LoadStatus.MISSING, 0, -1, False, None, None)
    assert bytes(buffers[0]) == expected_layers(cache, [("a", [0]), ("b", [1])], bodies)[0]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_oversized_value_is_drained_and_the_connection_stays_usable(
    redis_url: str, redis_client: redis.Redis, resp3: bool
) -> None:
    """A value over ``max_len`` is dropped as it arrives (nothing of it lands past the
    prefix-free head), the next value on the same connection lands, RESP2 and RESP3 alike
    (RESP3: a missing key is ``_``)."""
    cache = Cache.make(num_layers=2, num_blocks=40, page=16384, row=16384, seed=3)
    job, bodies = page_job(redis_client, 8, [("big", list(range(32))), ("after", [35])], cache)
    inner = job.make

    def make(seed: int) -> tuple[list[LoadTarget], list[bytearray]]:
        targets, buffers = inner(seed)
        head = pattern(200, 77)
        missing = LoadTarget(head, b"", [], None, 10)
        return [targets[0]._replace(max_len=1000), targets[1], missing], [*buffers, head]

    results, buffers = run_both(redis_url, Job(["big", "after", "gone"], make), resp3=resp3)
    assert results[0].status is LoadStatus.OVERSIZED and results[0].landed is None
    assert results[0].value_len > 1 << 20
    assert results[1].status is LoadStatus.OK and results[1].crc_ok
    assert results[2].status is LoadStatus.MISSING
    untouched = Cache.make(num_layers=2, num_blocks=40, page=16384, row=16384, seed=3)
    for idx in range(2):
        layer, before = buffers[idx], untouched.layers[idx]
        assert layer[: 32 * 16384] == before[: 32 * 16384]  # the oversized value wrote nothing
        offset = idx * 16384
        assert layer[35 * 16384 : 36 * 16384] == bodies["after"][offset : offset + 16384]


def test_another_header_goes_to_staging_or_is_refused(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A value whose header is not the expected one lands whole in ``staging`` (or, without
    one, is drained as ``layout-mismatch``); a value with the expected header but another
    length is ``layout-mismatch``; a short or non-hma value goes to staging too; a header of
    the same length and layout but another key is not the expected one; a staging buffer
    shorter than the value is not used; a corrupted body lands with ``crc_ok`` False."""
    cache = Cache.make(num_layers=2, num_blocks=8, page=2048, row=2048, seed=4)
    header = header_for("mine", 2, cache)
    other = header_for("theirs", 3, cache)
    twin = header_for("mime", 2, cache)  # same header length, same body length
    body, other_body = body_of(header, 1), body_of(other, 2)
    values = {
        "theirs": bytes(codec.encode(other, other_body)),
        "truncated": bytes(codec.encode(header, body))[:-100],
        "short": b"not a block",
        "empty": b"",
        "corrupt": bytearray(codec.encode(header, body)),
        "mime": bytes(codec.encode(twin, body)),
    }
    values["corrupt"][-5] ^= 0xFF
    for key, value in values.items():
        redis_client.set(key, bytes(value))
    keys = ["theirs", "theirs", "truncated", "short", "short", "empty", "corrupt", "mime", "theirs"]
    staging_sizes = [65536, None, 65536, 65536, None, 65536, None, 65536, 1000]

    def make(_: int) -> tuple[list[LoadTarget], list[bytearray]]:
        targets: list[LoadTarget] = []
        buffers: list[bytearray] = []
        for idx, staging_size in enumerate(staging_sizes):
            layers = [pattern(8 * 2048, 100 * idx + i) for i in range(2)]
            dests = [
                memoryview(layer)[2048 * b : 2048 * (b + 1)] for layer in layers for b in (3, 6)
            ]
            head = pattern(codec.PREFIX_BYTES + 120, idx)
            staging = None if staging_size is None else pattern(staging_size, 1000 + idx)
            targets.append(LoadTarget(head, header.to_msgpack(), dests, staging, 1 << 20))
            buffers += [*layers, head] + ([staging] if staging is not None else [])
        return targets, buffers

    results, buffers = run_both(redis_url, Job(keys, make))
    statuses = [(r.status, r.landed) for r in results]
    assert statuses == [
        (LoadStatus.OK, Landed.STAGING),
        (LoadStatus.LAYOUT_MISMATCH, None),
        (LoadStatus.LAYOUT_MISMATCH, None),
        (LoadStatus.OK, Landed.STAGING),
        (LoadStatus.LAYOUT_MISMATCH, None),
        (LoadStatus.OK, Landed.STAGING),
        (LoadStatus.OK, Landed.PAGES),
        (LoadStatus.OK, Landed.STAGING),
        (LoadStatus.LAYOUT_MISMATCH, None),
    ]
    assert results[0].crc_ok and not results[6].crc_ok
    assert results[3].header_len == -1 and results[5].value_len == 0
    # The staged values are byte for byte what Redis holds, and decode as usual.
    staging_theirs = buffers[3]
    assert staging_theirs[: len(values["theirs"])] == values["theirs"]
    assert codec.decode(staging_theirs[: len(values["theirs"])], "theirs").header == other
    staging_short = next(b for b in buffers if len(b) == 64 * 1024 and b.startswith(b"not a"))
    assert staging_short[:11] == b"not a block"
    staging_twin = buffers[-5]
    assert staging_twin[: len(values["mime"])] == values["mime"]
    assert buffers[-1] == pattern(1000, 1008)  # too short for the value: untouched


def test_a_value_whose_prefix_is_not_the_expected_one_never_reaches_the_pages(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With ``expected_prefix``, a value whose header is the expected one but whose prefix is
    not (here: flagged as MAC'd) goes to staging, or without one is drained; the matching
    value lands; identically on both paths."""
    cache = Cache.make(num_layers=2, num_blocks=4, page=1024, row=1024, seed=21)
    header = header_for("p", 2, cache)
    value = bytes(codec.encode(header, body_of(header, 3)))
    flagged = bytearray(value)
    flagged[7] |= codec.FLAG_MAC
    redis_client.set("plain", value)
    redis_client.set("flagged", bytes(flagged))
    prefix = value[:12]

    def make(_: int) -> tuple[list[LoadTarget], list[bytearray]]:
        layers = [pattern(4 * 1024, 60 + i) for i in range(2)]
        staging = pattern(len(value), 61)
        dests = [memoryview(layer)[:2048] for layer in layers]
        targets = [
            LoadTarget(pattern(300, 62), header.to_msgpack(), dests, None, 1 << 20, prefix),
            LoadTarget(pattern(300, 63), header.to_msgpack(), dests, staging, 1 << 20, prefix),
            LoadTarget(pattern(300, 64), header.to_msgpack(), dests, None, 1 << 20, prefix),
        ]
        return targets, [*layers, staging]

    results, buffers = run_both(redis_url, Job(["flagged", "flagged", "plain"], make))
    assert [(r.status, r.landed) for r in results] == [
        (LoadStatus.LAYOUT_MISMATCH, None),
        (LoadStatus.OK, Landed.STAGING),
        (LoadStatus.OK, Landed.PAGES),
    ]
    assert results[1].crc_ok and results[2].crc_ok
    assert bytes(buffers[2]) == bytes(flagged)
    body = body_of(header, 3)
    assert bytes(buffers[0][:2048]) == body[:2048]  # only the plain value reached the pages
    assert bytes(buffers[1][:2048]) == body[2048:]


def test_described_pages_of_several_layouts_land_in_one_job(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """One job whose chunks belong to two groups (a dense and a padded layout, each shared by
    its chunks, as a hybrid model's groups): every value lands in its own group's pages,
    identically on both paths."""
    caches = [
        Cache.make(num_layers=3, num_blocks=40, page=2048, row=2048, seed=21),
        Cache.make(num_layers=2, num_blocks=30, page=1000, row=1536, seed=31),
    ]
    layouts = [cache.layout() for cache in caches]
    chunks = [(0, "g0-a", [3, 4, 5]), (1, "g1-a", [29, 0]), (0, "g0-b", [39]), (1, "g1-b", [7, 8])]
    bodies: dict[str, bytes] = {}
    for group, key, ids in chunks:
        header = header_for(key, len(ids), caches[group], group=group)
        bodies[key] = body_of(header, len(bodies))
        redis_client.set(key, bytes(codec.encode(header, bodies[key])))
    outcome: dict[str, tuple[list[LoadResult], list[bytes]]] = {}
    for name, (load, _) in PATHS.items():
        fresh = [
            PageLayout(tuple(bytearray(m) for m in lay.layers), lay.page_bytes, lay.row_bytes)
            for lay in layouts
        ]
        targets = [
            LoadTarget(
                bytearray(codec.PREFIX_BYTES + 200),
                header_for(key, len(ids), caches[group], group=group).to_msgpack(),
                Pages(fresh[group], ids),
                None,
                1 << 20,
            )
            for group, key, ids in chunks
        ]
        with connections(redis_url, 2) as socks:
            results = load(socks, [resp("GET", key) for _, key, _ in chunks], targets, TIMEOUT_S)
        outcome[name] = (results, [bytes(m) for lay in fresh for m in lay.layers])
    assert outcome["native"] == outcome["python"]
    assert all(r.status is LoadStatus.OK and r.crc_ok for r in outcome["native"][0])
    want = []
    for group, cache in enumerate(caches):
        mine = [(key, ids) for g, key, ids in chunks if g == group]
        want += expected_layers(cache, mine, bodies)
    assert outcome["native"][1] == want


@pytest.mark.parametrize(
    ("layout", "error", "match"),
    [
        (PageLayout((bytearray(64),), (16, 16), (16,)), ValueError, "one page size and one row"),
        (PageLayout((bytearray(64),), (0,), (16,)), ValueError, "a page must be 1 to row_bytes"),
        (PageLayout((bytearray(64),), (17,), (16,)), ValueError, "a page must be 1 to row_bytes"),
        (PageLayout((bytes(64),), (16,), (16,)), TypeError, "a layer must be a writable"),
    ],
    ids=["lengths", "empty-page", "page-over-row", "read-only"],
)
def test_a_bad_page_layout_is_refused_alike(
    redis_url: str, layout: PageLayout, error: type[Exception], match: str
) -> None:
    """Layouts that do not describe pages (sizes that do not match the layers, a page of no
    bytes or longer than its row, memory that cannot be written) are refused by both paths
    with the same exception, loads and stores, before anything is sent."""
    for load, store in PATHS.values():
        target = LoadTarget(bytearray(256), b"", Pages(layout, [0]), None, 1 << 20)
        value = StoreValue(b"", bytearray(48), Pages(layout, [0]), b"")
        with connections(redis_url, 1) as socks:
            with pytest.raises(error, match=match):
                load(socks[0], [resp("GET", "x")], [target], TIMEOUT_S)
            with pytest.raises(error, match=match):
                store(socks[0], [value], TIMEOUT_S)


def test_zero_byte_bodies_land(redis_url: str, redis_client: redis.Redis) -> None:
    """A value with an empty body (no blocks) lands as ``pages`` with nothing to write."""
    cache = Cache.make(num_layers=3, num_blocks=1, page=64, row=64, seed=6)
    header = header_for("nothing", 0, cache)
    redis_client.set("nothing", bytes(codec.encode(header, b"")))

    def make(_: int) -> tuple[list[LoadTarget], list[bytearray]]:
        head = pattern(150, 1)
        return [LoadTarget(head, header.to_msgpack(), [], None, 1000)], [head]

    results, _ = run_both(redis_url, Job(["nothing"], make))
    assert results[0].status is LoadStatus.OK and results[0].landed is Landed.PAGES
    assert results[0].crc_ok


@pytest.mark.parametrize("lanes", [1, 2, 4])
@pytest.mark.parametrize("form", ["views", "pages"])
def test_stores_fill_the_checksum_and_send_pages_in_place(
    redis_url: str, redis_client: redis.Redis, lanes: int, form: str
) -> None:
    """SET NX of values given as (framing, head, pages, tail), the pages as views or
    described (Pages): the CRC32C field is filled (header ‖ pages), Redis then holds exactly
    the codec's encoding, and stored, existed and error replies are reported alike by both
    paths, each in its value's place whichever connection carried it."""
    cache = Cache.make(num_layers=3, num_blocks=64, page=8192, row=9000, seed=12)
    outcome: dict[str, list[StoreResult]] = {}
    for name, (_, store) in PATHS.items():
        redis_client.flushall()
        redis_client.set(f"{name}-there", b"old")
        values: list[StoreValue] = []
        expected: dict[str, bytes] = {}
        for idx, ids in enumerate([[1, 2, 3], [10], list(range(20, 60)), [0], []]):
            key = f"{name}-{idx}" if idx != 1 else f"{name}-there"
            header = header_for(key, len(ids), cache)
            pages = cache.dests(ids)
            encoded = codec.encode_parts(header, pages)
            head = bytearray(encoded[0])
            head[12:16] = b"\xa5" * 4  # the CRC field: to be filled by the job
            size = len(head) + header.body_bytes
            framing = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key.encode(), size)
            body = cache.body(ids, form)
            values.append(StoreValue(framing, head, body, b"\r\n$2\r\nNX\r\n"))
            expected[key] = b"".join(bytes(p) for p in encoded)
        # A syntax error (NX with XX).
        bad = b"*5\r\n$3\r\nSET\r\n$3\r\nbad\r\n$48\r\n"
        values.append(StoreValue(bad, bytearray(48), [], b"\r\n$2\r\nNX\r\n$2\r\nXX\r\n"))
        with connections(redis_url, lanes) as socks:
            outcome[name] = store(on(socks), values, TIMEOUT_S)
        for key, value in expected.items():
            if key.endswith("-there"):
                assert redis_client.get(key) == b"old"
            else:
                assert redis_client.get(key) == value
    assert outcome["native"] == outcome["python"]
    statuses = [r.status for r in outcome["native"]]
    assert statuses == [
        StoreStatus.STORED,
        StoreStatus.EXISTED,
        StoreStatus.STORED,
        StoreStatus.STORED,
        StoreStatus.STORED,
        StoreStatus.ERROR,
    ]
    assert outcome["native"][5].error is not None and "syntax" in outcome["native"][5].error


class CuttingProxy:
    """One connection to a real Redis through a proxy that forwards the request, then only the
    first ``limit`` bytes of the reply, and then closes the connection (shutdown: an EOF the
    client sees at once)."""

    def __init__(self, upstream: tuple[str, int], limit: int) -> None:
        self._upstream = upstream
        self._limit = limit
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        with client, socket.create_connection(self._upstream) as server:
            server.sendall(client.recv(65536))  # the test's one small GET
            sent = 0
            while sent < self._limit:
                chunk = server.recv(min(65536, self._limit - sent))
                if not chunk:
                    break
                client.sendall(chunk)
                sent += len(chunk)
            client.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        self._thread.join(10)


def test_server_closing_mid_value_raises(redis_url: str, redis_client: redis.Redis) -> None:
    """An EOF in the middle of a value raises ConnectionError (not a timeout, not a protocol
    error) on both paths."""
    cache = Cache.make(num_layers=1, num_blocks=64, page=65536, row=65536, seed=0)
    header = header_for("cut", 64, cache)
    redis_client.set("cut", bytes(codec.encode(header, body_of(header, 5))))
    parts = urlsplit(redis_url)
    for name, (load, _) in PATHS.items():
        proxy = CuttingProxy((parts.hostname or "127.0.0.1", parts.port or 6379), 1 << 20)
        try:
            head, layer = bytearray(200), bytearray(64 * 65536)
            target = LoadTarget(head, header.to_msgpack(), [memoryview(layer)], None, 8 << 20)
            with (
                socket.create_connection(proxy.address, timeout=TIMEOUT_S) as sock,
                pytest.raises(ConnectionError) as info,
            ):
                load(sock, [resp("GET", "cut")], [target], TIMEOUT_S)
            assert not isinstance(info.value, wire.ProtocolError), name
            assert not isinstance(info.value, TimeoutError), name
        finally:
            proxy.close()


@pytest.mark.parametrize("cut_lane", [0, 1])
def test_one_connection_of_a_job_closing_mid_value_raises(
    redis_url: str, redis_client: redis.Redis, cut_lane: int
) -> None:
    """A job on two connections, one of which Redis closes in the middle of its value: the
    whole job raises ConnectionError on both paths, whichever connection it was (the caller
    then drops both)."""
    cache = Cache.make(num_layers=1, num_blocks=128, page=65536, row=65536, seed=0)
    header = header_for("cut", 64, cache)
    redis_client.set("cut", bytes(codec.encode(header, body_of(header, 5))))
    parts = urlsplit(redis_url)
    keys = ["cut", "cut"]
    for name, (load, _) in PATHS.items():
        proxy = CuttingProxy((parts.hostname or "127.0.0.1", parts.port or 6379), 1 << 20)
        try:
            layer = bytearray(128 * 65536)
            targets = [
                LoadTarget(
                    bytearray(200),
                    header.to_msgpack(),
                    [memoryview(layer)[idx * (64 << 16) : (idx + 1) * (64 << 16)]],
                    None,
                    8 << 20,
                )
                for idx in range(2)
            ]
            with (
                socket.create_connection(proxy.address, timeout=TIMEOUT_S) as cut,
                connect(redis_url) as whole,
                pytest.raises(ConnectionError) as info,
            ):
                socks = [whole, cut] if cut_lane else [cut, whole]
                load(socks, [resp("GET", key) for key in keys], targets, TIMEOUT_S, 1)
            assert not isinstance(info.value, wire.ProtocolError), name
            assert not isinstance(info.value, TimeoutError), name
        finally:
            proxy.close()


class HeldServer:
    """A stand-in for Redis on one connection: it counts the GETs it receives, answers each with
    ``value`` once ``release`` is set (at once when it is None), or closes the connection on the
    first GET when ``value`` is None; ``second_get`` is set when a second GET arrives."""

    def __init__(
        self, value: bytes | None, release: threading.Event | None = None, wait_s: float = TIMEOUT_S
    ) -> None:
        self._value = value
        self._release = release
        self._wait_s = wait_s
        self.second_get = threading.Event()
        self.released_in_time = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            seen, answered = b"", 0
            while chunk := conn.recv(65536):
                seen += chunk
                asked = seen.count(b"GET")
                if asked >= 2:
                    self.second_get.set()
                if self._value is None:
                    conn.shutdown(socket.SHUT_RDWR)
                    return
                if self._release is not None and answered == 0:
                    self.released_in_time = self._release.wait(self._wait_s)
                while answered < asked:
                    conn.sendall(bulk_reply(self._value))
                    answered += 1

    def close(self) -> None:
        self._listener.close()
        self._thread.join(TIMEOUT_S)


def bulk_reply(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def headerless_value(body: bytes) -> bytes:
    """A value whose prefix announces an empty header (it matches ``expected_header`` b"")."""
    prefix = bytearray(codec.PREFIX_BYTES)
    prefix[codec.HEADER_LEN_AT : codec.HEADER_LEN_AT + 4] = (0).to_bytes(4, "big")
    return bytes(prefix) + body


def test_each_connection_of_a_native_load_job_is_read_on_its_own_thread() -> None:
    """The C job reads each connection on a thread of its own: while connection 0 has not
    answered, connection 1's values are received and its next GET goes out. Connection 0's
    server answers only once connection 1's server has seen its second GET (which a job that
    read its connections in turn, on one thread, would send only after connection 0's reply),
    and the job's four values all land."""
    body = bytes(range(256)) * 64
    value = headerless_value(body)
    second = HeldServer(value)
    first = HeldServer(value, release=second.second_get)
    try:
        layer = bytearray(4 * len(body))
        targets = [
            LoadTarget(
                bytearray(64),
                b"",
                [memoryview(layer)[idx * len(body) : (idx + 1) * len(body)]],
                None,
                1 << 20,
            )
            for idx in range(4)
        ]
        with (
            socket.create_connection(first.address, timeout=TIMEOUT_S) as a,
            socket.create_connection(second.address, timeout=TIMEOUT_S) as b,
        ):
            results = wire.native_load_values([a, b], [resp("GET", "k")] * 4, targets, TIMEOUT_S, 1)
        assert first.released_in_time, "connection 1 waited for connection 0's reply"
        assert [r.landed for r in results] == [Landed.PAGES] * 4
        assert bytes(layer) == body * 4
    finally:
        first.close()
        second.close()


def test_a_native_load_job_stops_at_once_when_one_connection_fails() -> None:
    """One connection of a C job closes while another waits on a server that never answers:
    the job raises the closed connection's ConnectionError at once instead of waiting out the
    other's 20 s timeout (its thread is woken by shutting that connection down; the caller drops
    every connection of a failed job)."""
    never = threading.Event()
    silent = HeldServer(b"x", release=never, wait_s=40)
    closing = HeldServer(None)
    try:
        targets = [LoadTarget(bytearray(64), b"", [bytearray(16)], None, 1 << 20) for _ in range(2)]
        with (
            socket.create_connection(silent.address, timeout=20) as a,
            socket.create_connection(closing.address, timeout=20) as b,
            pytest.raises(ConnectionError) as info,
        ):
            started = time.monotonic()
            wire.native_load_values([a, b], [resp("GET", "k")] * 2, targets, 20.0, 1)
        assert time.monotonic() - started < 10.0, "the job waited on the silent connection"
        assert not isinstance(info.value, TimeoutError)
        assert "closed" in str(info.value)
    finally:
        never.set()
        silent.close()
        closing.close()


def test_a_job_on_the_same_socket_twice_or_on_none_is_refused(redis_url: str) -> None:
    """Two readers of one stream would split its replies: a job's connections must be
    distinct, 1 to 64 of them, on both paths, before anything is sent."""
    target = LoadTarget(bytearray(64), b"", [], None, 100)
    value = StoreValue(resp("SET", "x")[:-2], bytearray(48), [], b"\r\n")
    with connect(redis_url) as sock:
        for load, store in PATHS.values():
            for socks, why in (([sock, sock], "distinct"), ([], "1 to 64")):
                with pytest.raises(ValueError, match=why):
                    load(socks, [resp("GET", "k")], [target], TIMEOUT_S)
                with pytest.raises(ValueError, match=why):
                    store(socks, [value], TIMEOUT_S)
        many = [socket.socket() for _ in range(wire.MAX_JOB_CONNECTIONS + 1)]
        try:
            for load, _ in PATHS.values():
                with pytest.raises(ValueError, match="1 to 64"):
                    load(many, [resp("GET", "k")], [target], TIMEOUT_S)
        finally:
            for spare in many:
                spare.close()
        # Nothing was sent: the connection answers its first command.
        sock.sendall(resp("PING"))
        assert sock.recv(100) == b"+PONG\r\n"


def test_jobs_whose_values_may_exceed_3_mib_run_on_one_connection() -> None:
    """A job takes ``connections_per_thread`` connections, never more than it has values, and
    one when a value may be longer than 3 MiB (two such replies at once overflow the kernel's
    usual largest send buffer) unless each connection has a reader of its own (the C load
    job); on several connections each keeps one GET in flight."""
    assert wire.job_connections(512 << 10, 64, 2) == 2
    assert wire.job_connections(3 << 20, 64, 4) == 4
    assert wire.job_connections((3 << 20) + 1, 64, 4) == 1
    assert wire.job_connections((3 << 20) + 1, 64, 4, reader_per_connection=True) == 4
    assert wire.job_connections(8 << 20, 1, 4, reader_per_connection=True) == 1
    assert wire.job_connections(512 << 10, 1, 2) == 1
    assert wire.job_connections(512 << 10, 3, 8) == 3
    assert wire.job_connections(512 << 10, 0, 2) == 1
    small = [LoadTarget(bytearray(64), b"", [], None, 512 << 10)]
    assert wire.window_for(small, 1) == 2
    assert wire.window_for(small, 2) == 1


@pytest.mark.parametrize("blocking", [False, True], ids=["socket-timeout", "blocking-socket"])
def test_stalled_server_times_out_within_the_bound(local_redis: Any, blocking: bool) -> None:
    """A server that stops answering (SIGSTOP) mid-job raises TimeoutError after about
    ``timeout_s`` on both paths, loads and stores, whatever the socket's own mode."""
    client = redis.Redis(port=local_redis.port)
    cache = Cache.make(num_layers=1, num_blocks=4, page=1024, row=1024, seed=0)
    header = header_for("k", 1, cache)
    client.set("k", bytes(codec.encode(header, body_of(header, 1))))
    bound = 0.4
    socks = {name: connect(local_redis.url) for name in PATHS}
    local_redis.pause()
    try:
        for name, (load, store) in PATHS.items():
            sock = socks[name]
            if blocking:
                sock.settimeout(None)
            head, layer = bytearray(200), bytearray(4096)
            target = LoadTarget(head, header.to_msgpack(), [memoryview(layer)[:1024]], None, 10_000)
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                load(sock, [resp("GET", "k")], [target], bound)
            assert bound * 0.9 <= time.monotonic() - started < bound + 1.0, name
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                value = StoreValue(
                    b"*4\r\n$3\r\nSET\r\n$1\r\nx\r\n$48\r\n", bytearray(48), [], b"\r\n$2\r\nNX\r\n"
                )
                store(sock, [value], bound)
            assert bound * 0.9 <= time.monotonic() - started < bound + 1.0, name
    finally:
        local_redis.resume()
        for sock in socks.values():
            sock.close()
        client.close()


def test_native_wait_releases_the_gil(local_redis: Any) -> None:
    """While a native load waits on a stalled server, other Python threads run."""
    cache = Cache.make(num_layers=1, num_blocks=1, page=64, row=64, seed=0)
    header = header_for("k", 1, cache)
    sock = connect(local_redis.url)
    local_redis.pause()
    errors: list[BaseException] = []

    def load() -> None:
        target = LoadTarget(bytearray(200), header.to_msgpack(), [bytearray(64)], None, 1000)
        try:
            wire.native_load_values(sock, [resp("GET", "k")], [target], 3.0)
        except TimeoutError as exc:
            errors.append(exc)

    thread = threading.Thread(target=load)
    try:
        thread.start()
        time.sleep(0.2)  # the load is now inside its wait
        started = time.monotonic()
        count = 0
        while count < 200_000:
            count += 1
        elapsed = time.monotonic() - started
        assert thread.is_alive(), "the load should still be waiting"
        assert elapsed < 1.5, f"a Python loop took {elapsed:.2f}s: the GIL was held"
    finally:
        local_redis.resume()
        thread.join(10)
        sock.close()


def test_protocol_errors_raise_on_both_paths() -> None:
    """Bytes that are not a RESP reply raise ProtocolError (a ConnectionError) on both paths."""
    for reply in [b"*1\r\n$1\r\nx\r\n", b"$abc\r\n", b"$5\r\nhelloXX", b"+OK\r\n"]:
        for name, (load, _) in PATHS.items():
            server, client = socket.socketpair()
            with server, client:
                server.sendall(reply)
                target = LoadTarget(bytearray(100), b"", [], bytearray(100), 100)
                with pytest.raises(wire.ProtocolError):
                    load(client, [b""], [target], 1.0)
            assert issubclass(wire.ProtocolError, ConnectionError), name


def test_crc32c_equals_the_crc32c_package() -> None:
    """crc32c (the folding loop, the CRC-instruction loop and the portable table) and
    crc32c_parts give the package's result on random buffers of many sizes (around the folding
    loop's 256-byte rounds and 1 KiB threshold too), alignments and start values."""
    rng = random.Random(0)
    base = bytearray(os.urandom(300_000))
    view = memoryview(base)
    sizes = [0, 1, 2, 7, 8, 9, 15, 16, 63, 64, 1000, 8191, 8192, 24575, 24576, 24577, 49153]
    sizes += [255, 256, 257, 511, 512, 1023, 1024, 1025, 1279, 1280, 1281, 1535, 2065, 65539]
    sizes += [rng.randrange(1, 300_000 - 16) for _ in range(20)]
    for size in sizes:
        for offset in (0, 1, 3, 8, 13):
            if offset + size > len(base):
                continue
            data = view[offset : offset + size]
            start = rng.getrandbits(32)
            want = crc32c_package.crc32c(data, start)
            assert native_module.crc32c(data, start) == want, (size, offset)
            assert native_module._crc32c_portable(data, start) == want, (size, offset)
            assert native_module._crc32c_no_fold(data, start) == want, (size, offset)
            cuts = sorted(rng.randrange(0, size + 1) for _ in range(3))
            parts = [
                data[: cuts[0]],
                data[cuts[0] : cuts[1]],
                data[cuts[1] : cuts[2]],
                data[cuts[2] :],
            ]
            assert native_module.crc32c_parts(parts, start) == want, (size, offset)
            assert wire.crc32c_parts(parts, start) == want
    assert native_module.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    # Every byte of a long run counts on the folding path: a flip anywhere changes the CRC.
    run = bytearray(os.urandom(70_000))
    whole = native_module.crc32c(run)
    for at in (0, 3, 255, 256, 4097, 69_743, 69_999):
        run[at] ^= 0x10
        assert native_module.crc32c(run) != whole, at
        assert native_module.crc32c(run) == crc32c_package.crc32c(run), at
        run[at] ^= 0x10


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
        for line in info:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_the_folding_crc_runs_where_the_cpu_has_it_and_can_be_turned_off() -> None:
    """crc_engine() names the folding loop on a CPU with AVX-512 and VPCLMULQDQ, the CRC
    instruction on one with SSE4.2 only; HMA_REDIS_CRC_NO_FOLD (read when the module loads)
    turns the folding off, with the same CRCs."""
    flags = _cpu_flags()
    if {"avx512f", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= flags:
        expected = "VPCLMULQDQ folding"
    elif "sse4_2" in flags:
        expected = "SSE4.2"
    else:
        expected = ""
    assert native_module.crc_engine() == expected
    assert wire.crc_engine() == expected
    data = os.urandom(100_000)
    script = (
        "import sys; from hma_redis.core.redis import _wire as w; "
        "print(w.crc_engine()); print(w.crc32c(sys.stdin.buffer.read()))"
    )
    env = {**os.environ, "HMA_REDIS_CRC_NO_FOLD": "1"}
    out = (
        subprocess.run(
            [sys.executable, "-c", script], input=data, capture_output=True, env=env, check=True
        )
        .stdout.decode()
        .split("\n")
    )
    assert out[0] == ("SSE4.2" if "sse4_2" in flags else "")
    assert int(out[1]) == native_module.crc32c(data) == crc32c_package.crc32c(data)


@pytest.fixture(autouse=True)
def _native_required() -> Iterator[None]:
    """Every test here compares the two paths: the extension must be built."""
    assert wire.available(), f"native fast path unavailable: {wire.unavailable_reason()}"
    yield
