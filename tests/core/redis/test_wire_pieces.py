"""Values read in pieces (``STRLEN`` then ``GETRANGE`` commands, :func:`wire.load_command`) on
both paths: on a real Redis they land exactly as a GET lands them, and every odd or changing
reply (a scripted server) gives the same result and the same bytes on both paths."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence

import pytest
import redis

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.medium import Landed, LoadResult, LoadStatus, LoadTarget
from hma_redis.core.redis import wire
from hma_redis.core.redis.store import RedisBlockStore
from tests.core.redis.test_wire import (
    PATHS,
    TIMEOUT_S,
    Cache,
    Job,
    body_of,
    bulk_reply,
    expected_layers,
    header_for,
    headerless_value,
    page_job,
    pattern,
    run_both,
)
from tests.support.acl import documented_tier_rules
from tests.support.error_server import CommandServer

MISSING = LoadResult(LoadStatus.MISSING, 0, -1, False, None, None)


def getrange_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_getrange", {})
    return int(stats.get("calls", 0))


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_a_job_is_read_in_pieces_only_past_the_bound(
    delta: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``HMA_REDIS_PIECE_BYTES``, a job whose largest value may exceed
    :data:`wire.PIECED_ABOVE` bytes is read in pieces of :data:`wire.PIECE_BYTES`, one at the
    bound or under it with GETs; the pieces are smaller than the bound (a piece never holds
    what a GET would)."""
    monkeypatch.delenv(wire.PIECES_ENV, raising=False)
    expected = wire.PIECE_BYTES if delta > 0 else 0
    assert wire.piece_bytes_for(wire.PIECED_ABOVE + delta) == expected
    assert 0 < wire.PIECE_BYTES < wire.PIECED_ABOVE


def test_load_command_asks_for_each_piece_up_to_max_len() -> None:
    """A target up to ``piece_bytes`` is one GET; a longer one STRLEN and one GETRANGE per
    piece of ``max_len`` bytes, the last ending at ``max_len - 1``."""
    assert wire.load_command("k", 100, 0) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    assert wire.load_command("k", 100, 100) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    command = wire.load_command("k", 250, 100)
    assert command == (
        b"*2\r\n$6\r\nSTRLEN\r\n$1\r\nk\r\n"
        b"*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$1\r\n0\r\n$2\r\n99\r\n"
        b"*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$3\r\n100\r\n$3\r\n199\r\n"
        b"*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$3\r\n200\r\n$3\r\n249\r\n"
    )
    assert wire.pieces_of(250, 100) == 3
    assert [wire.pieces_of(n, 100) for n in (99, 100, 101)] == [0, 0, 2]


@pytest.mark.parametrize("piece", [1000, 4096, 29_999], ids=["odd", "page", "whole"])
@pytest.mark.parametrize("lanes", [1, 3], ids=["1-conn", "3-conns"])
@pytest.mark.parametrize("window", [0, 1])
@pytest.mark.parametrize("form", ["views", "pages"])
def test_values_read_in_pieces_land_as_gets_land_them(
    redis_url: str, redis_client: redis.Redis, piece: int, lanes: int, window: int, form: str
) -> None:
    """Pieces that cut pages anywhere (1000 bytes), on page bounds, or one piece holding the
    whole value (and an empty last one): the same results and the same bytes as GETs,
    identical on both paths."""
    cache = Cache.make(num_layers=2, num_blocks=16, page=4096, row=4096, seed=31)
    chunks = [("p0", [1, 2, 3]), ("p1", [7]), ("p2", [9, 12]), ("p3", [14, 15])]
    job, bodies = page_job(redis_client, 3, chunks, cache, form, max_len=30_000)
    got, buffers = run_both(redis_url, job, window, lanes=lanes)
    before = getrange_calls(redis_client)
    pieced, pieced_buffers = run_both(redis_url, job, window, lanes=lanes, piece_bytes=piece)
    per_path = len(chunks) * wire.pieces_of(30_000, piece)
    assert (
        getrange_calls(redis_client) - before == (3 if lanes > 1 else 2) * per_path
    )  # each path once
    assert pieced == got
    assert [bytes(b) for b in pieced_buffers] == [bytes(b) for b in buffers]
    assert all(r.status is LoadStatus.OK and r.landed is Landed.PAGES and r.crc_ok for r in got)
    assert [bytes(b) for b in buffers[:2]] == expected_layers(cache, chunks, bodies)


def test_every_outcome_of_a_get_is_the_same_in_pieces(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Another writer's value (staging), a truncated one and one longer than ``max_len``, a
    corrupted body, a missing key, a key of another type (WRONGTYPE on STRLEN): each is what
    a GET makes of it, on both paths. The one difference: an empty value is missing (STRLEN
    answers 0 for both)."""
    cache = Cache.make(num_layers=2, num_blocks=8, page=2048, row=2048, seed=32)
    header = header_for("mine", 2, cache)
    other = header_for("theirs", 3, cache)
    body = body_of(header, 1)
    values = {
        "mine": bytes(codec.encode(header, body)),
        "theirs": bytes(codec.encode(other, body_of(other, 2))),
        "truncated": bytes(codec.encode(header, body))[:-100],
        "long": bytes(codec.encode(other, body_of(other, 2))) + bytes(40_000),
        "corrupt": bytearray(codec.encode(header, body)),
        "empty": b"",
    }
    values["corrupt"][3000] ^= 0xFF
    for key, value in values.items():
        redis_client.set(key, bytes(value))
    redis_client.delete("gone")
    redis_client.rpush("a-list", "x")
    keys = [*values, "gone", "a-list", "mine"]

    def make(_: int) -> tuple[list[LoadTarget], list[bytearray]]:
        targets: list[LoadTarget] = []
        buffers: list[bytearray] = []
        for idx in range(len(keys)):
            layers = [pattern(8 * 2048, 100 * idx + i) for i in range(2)]
            dests = [
                memoryview(layer)[2048 * b : 2048 * (b + 1)] for layer in layers for b in (3, 6)
            ]
            head = pattern(codec.PREFIX_BYTES + 120, idx)
            staging = pattern(40_000, 1000 + idx)
            targets.append(LoadTarget(head, header.to_msgpack(), dests, staging, 40_000))
            buffers += [*layers, head, staging]
        return targets, buffers

    job = Job(keys, make)
    got, buffers = run_both(redis_url, job, window=1)
    pieced, pieced_buffers = run_both(redis_url, job, window=1, piece_bytes=997)
    empty = keys.index("empty")
    assert got[empty].landed is Landed.STAGING and pieced[empty] == MISSING
    assert pieced[:empty] + pieced[empty + 1 :] == got[:empty] + got[empty + 1 :]
    assert [bytes(b) for b in pieced_buffers] == [bytes(b) for b in buffers]
    assert [r.status for r in got] == [
        LoadStatus.OK,
        LoadStatus.OK,
        LoadStatus.LAYOUT_MISMATCH,
        LoadStatus.OVERSIZED,
        LoadStatus.OK,
        LoadStatus.OK,
        LoadStatus.MISSING,
        LoadStatus.ERROR,
        LoadStatus.OK,
    ]
    assert [r.landed for r in got[:3]] == [Landed.PAGES, Landed.STAGING, None]
    assert not got[4].crc_ok and got[-1].crc_ok
    assert pieced[7].error is not None and pieced[7].error.startswith("WRONGTYPE")


# ------------------------------------------------------------------------- a scripted server

PIECE = 1000
VALUE = headerless_value(bytes(range(256)) * 9)  # 48 + 2304 bytes: three pieces


def value_target(max_len: int = 3000) -> tuple[LoadTarget, list[bytearray]]:
    """A target VALUE lands in (its body into one buffer), with staging."""
    head, body, staging = pattern(200, 1), pattern(len(VALUE) - 48, 2), pattern(max_len, 3)
    return LoadTarget(head, b"", [memoryview(body)], staging, max_len), [head, body, staging]


def pieces_of(value: bytes, max_len: int = 3000) -> list[bytes]:
    """What Redis answers to the pieces of a ``max_len`` target holding ``value``."""
    return [value[at : min(at + PIECE, max_len)] for at in range(0, max_len, PIECE)]


def replies(strlen: bytes, pieces: Sequence[bytes | None]) -> bytes:
    """STRLEN's reply line, then each piece as a bulk string (None: a nil in its place)."""
    return strlen + b"".join(bulk_reply(p) if p is not None else b"$-1\r\n" for p in pieces)


def run_scripted(script: bytes) -> tuple[list[LoadResult], list[bytes]]:
    """A job of two targets (a value read in pieces, then the same value read in pieces
    again) against ``script``: the reply bytes of the first, then a correct reply of the
    second; both paths must agree on results and bytes; returns them."""
    whole = script + replies(b":%d\r\n" % len(VALUE), pieces_of(VALUE))
    outcome: dict[str, tuple[list[LoadResult], list[bytes]]] = {}
    for name, (load, _) in PATHS.items():
        first, first_buffers = value_target()
        second, second_buffers = value_target()
        commands = [wire.load_command("k", 3000, PIECE)] * 2
        server, client = socket.socketpair()
        with server, client:
            server.sendall(whole)
            results = load(client, commands, [first, second], TIMEOUT_S, piece_bytes=PIECE)
        outcome[name] = (results, [bytes(b) for b in first_buffers + second_buffers])
    assert outcome["native"] == outcome["python"]
    return outcome["native"]


def test_a_value_read_in_pieces_lands_from_a_scripted_server() -> None:
    """The scripted replies of a correct value land it (the oracle for the cases below)."""
    results, buffers = run_scripted(replies(b":%d\r\n" % len(VALUE), pieces_of(VALUE)))
    assert results[0] == results[1]
    assert results[0] == LoadResult(LoadStatus.OK, len(VALUE), 0, False, Landed.PAGES, None)
    assert buffers[1] == VALUE[48:] and buffers[4] == VALUE[48:]


@pytest.mark.parametrize(
    "script",
    [
        # Shorter than STRLEN said: the key was replaced by a shorter value.
        replies(b":%d\r\n" % len(VALUE), pieces_of(VALUE[:1500])),
        # Longer: its pieces are full where the last should be short.
        replies(b":%d\r\n" % len(VALUE), pieces_of(VALUE + bytes(600))),
        # Deleted after STRLEN: empty pieces.
        replies(b":%d\r\n" % len(VALUE), [b"", b"", b""]),
        # Written after STRLEN answered 0.
        replies(b":0\r\n", pieces_of(VALUE)),
        # A nil in a piece's place: deleted since STRLEN.
        replies(b":%d\r\n" % len(VALUE), [VALUE[:1000], None, VALUE[2000:]]),
        # The first piece of another length: the prefix never lands.
        replies(b":%d\r\n" % len(VALUE), [VALUE[:10], VALUE[1000:2000], VALUE[2000:]]),
    ],
    ids=["shrank", "grew", "deleted", "appeared", "nil-piece", "short-first"],
)
def test_a_value_that_changes_between_its_pieces_is_missing(script: bytes) -> None:
    """A piece of another length than STRLEN announced, or a nil or an error in its place, is
    a value that changed while read: ``missing`` (recomputed, never deleted), every piece read
    to its end, and the next value on the connection lands."""
    results, buffers = run_scripted(script)
    assert results[0] == MISSING
    assert results[1] == LoadResult(LoadStatus.OK, len(VALUE), 0, False, Landed.PAGES, None)
    assert buffers[4] == VALUE[48:]


@pytest.mark.parametrize(
    "error",
    [b"-MOVED 1 127.0.0.1:1", b"-NOPERM this user has no permissions to run the 'getrange'"],
)
def test_an_error_in_a_pieces_place_is_the_targets_error(error: bytes) -> None:
    """An error reply in a piece's place (a key that moved, a user without GETRANGE) is the
    target's ``error`` with that text, so the store counts and follows it as a GET's; the
    next value still lands."""
    script = b":%d\r\n" % len(VALUE) + bulk_reply(VALUE[:1000]) + error + b"\r\n" + error + b"\r\n"
    results, buffers = run_scripted(script)
    assert results[0] == LoadResult(LoadStatus.ERROR, 0, -1, False, None, error[1:].decode())
    assert results[1].status is LoadStatus.OK and buffers[4] == VALUE[48:]


def test_strlen_errors_oversized_and_missing_values_in_pieces() -> None:
    """An error reply to STRLEN is ``error`` (its pieces' errors read past); a value longer
    than ``max_len`` is ``oversized`` (only ``max_len`` bytes asked for, drained); STRLEN 0
    is missing."""
    wrongtype = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    results, _ = run_scripted(wrongtype + wrongtype * 3)
    assert results[0].status is LoadStatus.ERROR and results[0].error == wrongtype[1:-2].decode()
    big = bytes(5000)
    results, buffers = run_scripted(replies(b":5000\r\n", pieces_of(big)))
    assert results[0] == LoadResult(LoadStatus.OVERSIZED, 5000, -1, False, None, None)
    assert buffers[1] == bytes(pattern(len(VALUE) - 48, 2))  # nothing landed
    results, _ = run_scripted(replies(b":0\r\n", [b"", b"", b""]))
    assert results[0] == MISSING


@pytest.mark.parametrize(
    "script",
    [
        b"+OK\r\n",
        b"$3\r\nabc\r\n",
        b":-1\r\n",
        b":12x\r\n",
        b":%d\r\n" % len(VALUE) + b":1\r\n",
        b":%d\r\n" % len(VALUE) + b"+OK\r\n",
        b":%d\r\n" % len(VALUE) + b"$1000\r\n" + VALUE[:1000] + b"XX",
    ],
    ids=["status", "bulk", "negative", "not-a-number", "int-piece", "status-piece", "no-crlf"],
)
def test_replies_that_fit_no_piece_raise_on_both_paths(script: bytes) -> None:
    """A reply to STRLEN that is not an integer or an error, a negative or malformed one, a
    piece that is not a bulk string, nil or error, or one not ended by CRLF: ProtocolError on
    both paths (the caller drops the connection)."""
    for load, _ in PATHS.values():
        target, _ = value_target()
        server, client = socket.socketpair()
        with server, client:
            server.sendall(script)
            server.shutdown(socket.SHUT_WR)
            with pytest.raises(wire.ProtocolError):
                load(
                    client, [wire.load_command("k", 3000, PIECE)], [target], 1.0, piece_bytes=PIECE
                )


# ------------------------------------------------------------- which servers get pieces


class ValueServer(CommandServer):
    """A stand-in for a server holding ``values``: GET, STRLEN and GETRANGE as Redis answers
    them, INFO server answered with ``info`` (bytes: a bulk string of it; None: a NOPERM
    error), every command it receives kept in ``seen``."""

    def __init__(self, values: dict[bytes, bytes], info: bytes | None) -> None:
        self.values = values
        self.info = info
        self.seen: list[bytes] = []
        super().__init__()

    def _answer(self, command: list[bytes]) -> bytes:
        name = command[0].upper()
        if name == b"HELLO":
            proto = command[1] if len(command) > 1 else b"2"
            return b"%1\r\n$5\r\nproto\r\n:" + proto + b"\r\n"
        if name in (b"PING", b"CLIENT", b"SELECT", b"AUTH"):
            return b"+PONG\r\n" if name == b"PING" else b"+OK\r\n"
        self.seen.append(name)
        value = self.values.get(command[1], b"") if len(command) > 1 else b""
        if name == b"INFO":
            if self.info is None:
                return b"-NOPERM this user has no permissions to run the 'info' command\r\n"
            return bulk_reply(self.info)
        if name == b"GET":
            return bulk_reply(value) if command[1] in self.values else b"$-1\r\n"
        if name == b"STRLEN":
            return b":%d\r\n" % len(value)
        if name == b"GETRANGE":
            return bulk_reply(value[int(command[2]) : int(command[3]) + 1])
        return b"-ERR unknown command\r\n"


@pytest.mark.parametrize(
    ("info", "pieces"),
    [
        (b"# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n", True),
        (
            b"# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n",
            False,
        ),
        (None, True),  # INFO refused (an ACL without +info): Redis' rule
        (b"no colon here at all\r\n:::\r\n", True),
    ],
    ids=["redis", "valkey", "info-refused", "odd-info"],
)
def test_large_values_are_read_in_pieces_unless_the_server_is_valkey(
    info: bytes | None, pieces: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose values may exceed 1 MiB reads them in pieces from Redis (it copies a GET's
    whole value into its reply) and with one GET each from Valkey (it writes large values from
    the value itself): one INFO per store tells them apart; refused or odd, Redis' rule. The
    values land either way, and smaller jobs never ask."""
    monkeypatch.delenv(wire.PIECES_ENV, raising=False)
    value = headerless_value(bytes(range(256)) * 40)
    server = ValueServer({b"k": value, b"j": value}, info)
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": server.url}, env={}))
    try:
        for max_len in (wire.PIECED_ABOVE, 7 << 20, 7 << 20):
            body = bytearray(len(value) - 48)
            target = LoadTarget(bytearray(300), b"", [memoryview(body)], None, max_len)
            results = store.load_values(["k"], [target])
            assert results is not None and results[0].status is LoadStatus.OK, results
            assert body == value[48:]
    finally:
        store.close()
        server.close()
    assert server.seen.count(b"INFO") == 1
    ranges = (7 << 20) // wire.PIECE_BYTES
    expected_large = [b"STRLEN", *[b"GETRANGE"] * ranges] if pieces else [b"GET"]
    assert [c for c in server.seen if c != b"INFO"] == [b"GET", *expected_large * 2]


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_strlen_at_the_bound_of_max_len(delta: int) -> None:
    """STRLEN one byte under, at and over the target's bound: the first two are received
    (here the header is the expected one and the length is not: layout-mismatch), the last is
    oversized (only the bound's bytes asked for and drained); both paths alike."""
    n = 3000 + delta
    value = headerless_value(bytes(pattern(n - 48, 9)))
    results, _ = run_scripted(replies(b":%d\r\n" % n, pieces_of(value)))
    status = LoadStatus.OVERSIZED if delta > 0 else LoadStatus.LAYOUT_MISMATCH
    assert (results[0].status, results[0].value_len) == (status, n)


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_a_middle_piece_one_byte_off_is_a_changed_value(delta: int) -> None:
    """The second piece one byte shorter, exact, one byte longer than STRLEN's length says:
    only the exact one lands; the others are missing, and the next value still lands."""
    middle = VALUE[1000:2000] + bytes(max(delta, 0))
    middle = middle[: len(middle) + min(delta, 0)]
    results, buffers = run_scripted(
        replies(b":%d\r\n" % len(VALUE), [VALUE[:1000], middle, VALUE[2000:]])
    )
    assert (results[0].status is LoadStatus.OK) == (delta == 0)
    assert results[1].status is LoadStatus.OK and buffers[4] == VALUE[48:]


@pytest.mark.parametrize("delta", [0, 1])
def test_a_strlen_past_the_longest_value_redis_takes_is_a_protocol_error(delta: int) -> None:
    """STRLEN of 512 MiB (Redis' proto-max-bulk-len default) is oversized; one byte more is a
    reply no Redis sends: ProtocolError on both paths."""
    n = (512 << 20) + delta
    script = replies(
        b":%d\r\n" % n, [VALUE[:1000], VALUE[1000:2000], VALUE[2000:2352] + bytes(648)]
    )
    if delta:
        test_replies_that_fit_no_piece_raise_on_both_paths(script)
        return
    results, _ = run_scripted(script)
    assert (results[0].status, results[0].value_len) == (LoadStatus.OVERSIZED, n)


@pytest.mark.parametrize("getrange", [True, False], ids=["documented-acl", "no-getrange"])
def test_under_the_documented_acl_large_values_load_in_pieces_and_without_getrange_with_gets(
    redis_url: str,
    redis_client: redis.Redis,
    getrange: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tier's user as docs/security.md gives it (no INFO: Redis' rule) loads values that
    may exceed 1 MiB in pieces at once. A user without GETRANGE gets its first such load
    refused (NOPERM, counted; its chunks would be recomputed), one warning, and every later
    load with one GET, which lands."""
    monkeypatch.delenv(wire.PIECES_ENV, raising=False)
    rules = [r for r in documented_tier_rules() if getrange or r != "+getrange"]
    user = f"hma-pieces-{getrange}"
    redis_client.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", *rules)
    port = redis_client.connection_pool.connection_kwargs["port"]
    url = f"redis://{user}:pw@127.0.0.1:{port}/0"
    value = headerless_value(bytes(pattern(5000, 4)))
    redis_client.set("hma:pieces:k", value)
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    statuses = []
    try:
        with caplog.at_level(logging.WARNING, logger="hma_redis"):
            for _ in range(3):
                body = bytearray(len(value) - 48)
                target = LoadTarget(bytearray(300), b"", [memoryview(body)], None, 7 << 20)
                results = store.load_values(["hma:pieces:k"], [target])
                assert results is not None
                statuses.append(results[0].status)
                if results[0].status is LoadStatus.OK:
                    assert body == value[48:]
        refused = store.counters.snapshot().get("refused_noperm", 0)
    finally:
        store.close()
        redis_client.execute_command("ACL", "DELUSER", user)
    warned = [r for r in caplog.records if "refused STRLEN or GETRANGE" in r.getMessage()]
    if getrange:
        assert statuses == [LoadStatus.OK] * 3 and not warned and not refused
    else:
        assert statuses == [LoadStatus.ERROR, LoadStatus.OK, LoadStatus.OK]
        assert len(warned) == 1 and "+getrange" in warned[0].getMessage() and refused >= 1


def test_a_job_in_pieces_keeps_at_most_window_commands_unanswered() -> None:
    """Redis builds a reply for every command it has read, so the job's window bounds what its
    output buffer holds: a job of two values in three pieces each (eight commands) with the
    window :func:`wire.window_for` gives it never has more than that many commands unanswered,
    on either path, each next one sent as a reply's first line arrives (a whole value's
    commands sent at once would leave four). A scripted server answers one command at a time,
    after giving the client time to send whatever it would."""
    targets_max_len = 3000
    window = wire.window_for([value_target(targets_max_len)[0]] * 2, 1, PIECE)
    assert window == wire.PIECE_WINDOW == 2
    script = [b":%d\r\n" % len(VALUE), *(bulk_reply(p) for p in pieces_of(VALUE))] * 2
    for name, (load, _) in PATHS.items():
        server, client = socket.socketpair()
        unanswered: list[int] = []

        def serve(server: socket.socket = server, unanswered: list[int] = unanswered) -> None:
            received = b""
            for answered, reply in enumerate(script):
                received += server.recv(65536) if not received else b""
                time.sleep(0.05)  # whatever the client sends before this reply, it has sent
                server.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    while chunk := server.recv(65536):
                        received += chunk
                server.setblocking(True)
                commands = received.count(b"\r\n*") + received.startswith(b"*")
                unanswered.append(commands - answered)
                server.sendall(reply)

        thread = threading.Thread(target=serve, daemon=True)
        with server, client:
            thread.start()
            first, _ = value_target(targets_max_len)
            second, _ = value_target(targets_max_len)
            commands = [wire.load_command("k", targets_max_len, PIECE)] * 2
            results = load(client, commands, [first, second], TIMEOUT_S, window, piece_bytes=PIECE)
            thread.join(TIMEOUT_S)
        assert [r.status for r in results] == [LoadStatus.OK] * 2, name
        assert len(unanswered) == len(script), name
        assert max(unanswered) == window, (name, unanswered)
