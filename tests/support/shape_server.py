"""A stand-in for Redis over a real socket that answers the scheduler side's commands with
replies of the wrong shape: the lookup scripts (both admission modes), INFO, HGETALL, the pins
set's commands, CONFIG, CLIENT SETNAME, the counters and pub/sub. Every other command of the
connection set-up is answered as Redis answers it.

While :attr:`ShapeServer.hostile`, each of those commands gets a reply drawn from a seeded
``random.Random``: for a lookup always one of a shape Redis never sends for it (an integer, a
status, too few or too many flags, nested arrays, flags out of range, RESP3 types), for the
others mostly one. Set ``hostile`` to False and it answers like a Redis that holds every chunk
(every lookup flag 1), so a test sees the tier recover: its lookups then HIT. Its honest
replies are RESP3's (maps for HGETALL and CONFIG GET): redis-py asks for RESP3 with HELLO.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable

from tests.support.error_server import CommandServer

_PATTERN_AT = 1  # PSUBSCRIBE's argument


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _array(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


# Replies of a shape no command below has in Redis (an error reply is a refusal, LOADING an
# outage: both are answers Redis gives, and the tier must take them too).
WRONG_ANYWHERE = [
    b"+OK\r\n",
    b"+QUEUED\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b"$3\r\nabc\r\n",
    b"*1\r\n*1\r\n:1\r\n",
    b"*2\r\n+OK\r\n+OK\r\n",
    b"_\r\n",
    b"#t\r\n",
    b"#f\r\n",
    b",1.5\r\n",
    b"%1\r\n+a\r\n:1\r\n",
    b"~1\r\n:1\r\n",
    b"=8\r\ntxt:abcd\r\n",
    b"-ERR not this\r\n",
    b"-LOADING Redis is loading the dataset in memory\r\n",
]
# Integers: the wrong shape for everything but the integer replies (counters, ZADD ...).
WRONG_INTEGERS = [b":7\r\n", b":-1\r\n", b"(123456789012345678901234567890\r\n"]
_INTEGER_REPLIES = {b"HINCRBY", b"HSET", b"ZADD", b"PERSIST", b"EXPIRE"}


def wrong_flags(rng: random.Random, count: int, top: int) -> bytes:
    """An array a lookup script never returns for ``count`` chunks whose flags are 0..``top``:
    the wrong length, or one element of another type or out of range."""
    flags = [b":%d\r\n" % rng.randint(0, top) for _ in range(count)]
    kind = rng.randrange(9)
    if kind == 0:
        return _array(flags[:-1])
    if kind == 1:
        return _array([*flags, b":1\r\n"])
    if kind == 2:
        return _array([b":1\r\n"] * rng.choice([0, count + 5, 2 * count]))
    bad = [
        b":%d\r\n" % (top + 1 + rng.randrange(5)),
        b":-1\r\n",
        b"+OK\r\n",
        b"*1\r\n:1\r\n",
        b"$1\r\n1\r\n",
        b"#t\r\n",
        b",1\r\n",
    ][kind - 2]
    flags[rng.randrange(count)] = bad
    return _array(flags)


def wrong_info(rng: random.Random) -> bytes:
    """INFO memory with figures Redis never writes."""
    field = rng.choice(
        [
            b"used_memory:12GB",
            b"used_memory:-5",
            b"used_memory:",
            b"maxmemory:1.5",
            b"maxmemory:4mb",
            b"used_memory:1e9",
        ]
    )
    return _bulk(b"# Memory\r\n" + field + b"\r\n")


def wrong_push(rng: random.Random, pattern: bytes) -> bytes:
    """A message on a pub/sub connection that is no keyspace event of ``pattern``."""
    return rng.choice(
        [
            b":7\r\n",
            b"+OK\r\n",
            _array([_bulk(b"pmessage"), _bulk(pattern), _bulk(b"nocolon"), _bulk(b"del")]),
            _array([_bulk(b"pmessage"), _bulk(pattern), _bulk(b"__keyspace@0__:k"), b":7\r\n"]),
            _array([_bulk(b"pmessage"), _bulk(pattern), b":7\r\n", _bulk(b"del")]),
            _array([_bulk(b"pmessage"), _bulk(b"x")]),
            _array([b":1\r\n", b":2\r\n", b":3\r\n"]),
        ]
    )


class ShapeServer(CommandServer):
    """See the module docstring. ``counts`` tallies the commands answered, by name; ``fixed``
    holds a reply per command name (or name and subcommand: ``b"CONFIG SET"``) that replaces the
    drawn ones."""

    def __init__(self, seed: int = 0, hostile: bool = True) -> None:
        self.rng = random.Random(seed)
        self.hostile = hostile
        self.fixed: dict[bytes, bytes] = {}
        self.counts: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        super().__init__()

    def reseed(self, seed: int) -> None:
        with self._lock:
            self.rng = random.Random(seed)

    def _answer(self, command: list[bytes]) -> bytes:
        name = command[0].upper()
        sub = command[1].upper() if len(command) > 1 else b""
        with self._lock:
            self.counts[name] += 1
            for fixed in (name + b" " + sub, name):
                if fixed in self.fixed:
                    return self.fixed[fixed]
            honest = self._honest(name, sub, command)
            if honest is None:  # the connection set-up and the probe: always as Redis
                return self._set_up(name, command)
            hostile = self._hostile(name, sub, command)
            if not self.hostile or hostile is None:
                return honest
            return hostile

    @staticmethod
    def _set_up(name: bytes, command: list[bytes]) -> bytes:
        if name == b"HELLO":
            proto = command[1] if len(command) > 1 else b"2"
            return b"%1\r\n$5\r\nproto\r\n:" + proto + b"\r\n"
        return b"+PONG\r\n" if name == b"PING" else b"+OK\r\n"

    def _honest(self, name: bytes, sub: bytes, command: list[bytes]) -> bytes | None:
        """What a Redis holding every chunk answers (None: a set-up command)."""
        if name == b"EVAL":
            script, numkeys = command[1], int(command[2])
            if b"ZSCORE" in script:  # the sweep's removal: nothing renewed
                return b"*0\r\n"
            count = numkeys // (int(command[4 + numkeys]) + 1) if b"ranks" in script else numkeys
            return _array([b":1\r\n"] * count)
        answers: dict[bytes, Callable[[], bytes]] = {
            b"EXISTS": lambda: b":1\r\n",
            b"SET": lambda: b"+OK\r\n",
            b"INFO": lambda: _bulk(b"# Memory\r\nused_memory:1000\r\nmaxmemory:0\r\n"),
            b"HGETALL": lambda: b"%1\r\n" + _bulk(b"model") + _bulk(b"m"),
            b"UNLINK": lambda: b":1\r\n",
            b"ZRANGEBYSCORE": lambda: b"*0\r\n",
            b"ZRANGE": lambda: b"*0\r\n",
            b"PSUBSCRIBE": lambda: self._confirm(command[_PATTERN_AT]),
        }
        if name in _INTEGER_REPLIES:
            return b":1\r\n"
        if name == b"CONFIG":
            flags = b"%1\r\n" + _bulk(b"notify-keyspace-events") + _bulk(b"Kgxe")
            return flags if sub == b"GET" else b"+OK\r\n"
        if name == b"CLIENT" and sub == b"SETNAME":
            return b"+OK\r\n"
        return answers[name]() if name in answers else None

    @staticmethod
    def _confirm(pattern: bytes) -> bytes:
        return _array([_bulk(b"psubscribe"), _bulk(pattern), b":1\r\n"])

    def _hostile(self, name: bytes, sub: bytes, command: list[bytes]) -> bytes | None:
        """A reply of the wrong shape for the command (None: answer it honestly this time)."""
        rng = self.rng
        if name == b"EVAL" and b"ZSCORE" not in command[1]:  # a lookup: always wrong
            honest = self._honest(name, sub, command)
            assert honest is not None
            count = int(honest.split(b"\r\n", 1)[0][1:])
            if rng.random() < 0.5:
                return wrong_flags(rng, count, 2 if b"ranks" in command[1] else 1)
            return rng.choice([*WRONG_ANYWHERE, *WRONG_INTEGERS])
        if rng.random() < 0.3:
            return None
        if name == b"INFO" and rng.random() < 0.5:
            return wrong_info(rng)
        if name == b"PSUBSCRIBE":
            # The confirmation, then a message of the wrong shape; or a wrong confirmation.
            pattern = command[_PATTERN_AT]
            if rng.random() < 0.5:
                return self._confirm(pattern) + wrong_push(rng, pattern)
            return wrong_push(rng, pattern)
        pool = list(WRONG_ANYWHERE)
        if name not in _INTEGER_REPLIES:
            pool += WRONG_INTEGERS
        return rng.choice(pool)
