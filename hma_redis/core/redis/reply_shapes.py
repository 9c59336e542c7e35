"""The shapes the tier accepts in the replies it reads outside the data path.

Lookups, ``INFO``, the info hash, the pins set, ``CLIENT`` / ``CONFIG`` and keyspace
notifications are read through redis-py, which hands back whatever the server sent: a proxy or a
Redis-compatible server may answer a lookup script with an integer, ``+OK`` or an array of the
wrong length, and ``INFO`` with ``used_memory:12GB``. Each check here takes one reply and
returns what it means, or raises :class:`WrongReply`. That is a ``RedisError`` that
:func:`~hma_redis.core.redis.breaker.classify` calls an outage (as an unreadable reply): the store's
guard turns the call into its degraded answer (a miss, a dropped counter) and the breaker
opens, so a reply of the wrong shape is never an exception in vLLM's threads and never a hit.
(``INFO``'s figures are optional: the store takes odd ones as none, as when INFO is refused.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from redis.exceptions import InvalidResponse

__all__ = [
    "WrongReply",
    "flag",
    "flags",
    "integer",
    "is_ok",
    "members",
    "parsed",
    "scored_members",
    "text_map",
]

_T = TypeVar("_T")

# What redis-py's reply parsers (a command's callback, pub/sub's message handling) raise on a
# reply of a shape they do not expect.
_PARSER_ERRORS = (TypeError, ValueError, AttributeError, IndexError, KeyError)


class WrongReply(InvalidResponse):
    """A reply of a shape the command never has in Redis: an outage of the call."""


def _wrong(command: str, reply: Any, what: str) -> WrongReply:
    return WrongReply(f"{command} answered {_short(reply)}, not {what}")


def _short(reply: Any) -> str:
    text = repr(reply)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(command: str, reply: Any, allowed: Collection[int] | None = None) -> int:
    """``reply`` as an integer reply (one of ``allowed``, when given); a boolean, a string, an
    array or another integer is :class:`WrongReply`."""
    if type(reply) is not int or (allowed is not None and reply not in allowed):
        raise _wrong(command, reply, "an integer" if allowed is None else f"one of {allowed}")
    return reply


def flag(command: str, reply: Any) -> bool:
    """One ``EXISTS`` of one key: ``:0`` or ``:1``."""
    return integer(command, reply, (0, 1)) == 1


def flags(command: str, reply: Any, count: int, allowed: Collection[int]) -> list[int]:
    """A script's array of exactly ``count`` integers, each one of ``allowed``."""
    if not isinstance(reply, list) or len(reply) != count:
        raise _wrong(command, reply, f"an array of {count} integers")
    return [integer(command, v, allowed) for v in reply]


def is_ok(command: str, reply: Any, nil: bool = False) -> bool:
    """A status reply ``OK`` (True; as redis-py's callbacks give it, or raw), or with ``nil``
    a nil (False: ``SET NX`` of a key that exists)."""
    if reply is True or reply in (b"OK", "OK"):
        return True
    if nil and reply is None:
        return False
    raise _wrong(command, reply, "OK" + (" or nil" if nil else ""))


def members(command: str, reply: Any) -> list[bytes | str]:
    """A sorted set's members (``ZRANGEBYSCORE``, a script's array of them): strings only."""
    if not isinstance(reply, list) or not all(isinstance(m, bytes | str) for m in reply):
        raise _wrong(command, reply, "an array of members")
    return reply


def scored_members(command: str, reply: Any) -> list[tuple[bytes | str, float]]:
    """``ZRANGE ... WITHSCORES`` as redis-py's callback gives it: (member, score) pairs."""
    if not isinstance(reply, list):
        raise _wrong(command, reply, "an array of members and scores")
    for pair in reply:
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        if not ok or not isinstance(pair[0], bytes | str) or type(pair[1]) is not float:
            raise _wrong(command, reply, "an array of members and scores")
    return [(m, s) for m, s in reply]


def text_map(command: str, reply: Any) -> dict[str, str]:
    """A hash's fields (``HGETALL``) or ``CONFIG GET``'s pairs, as redis-py's callbacks give
    them: strings to strings, decoded as UTF-8 (anything else is :class:`WrongReply`)."""
    if not isinstance(reply, Mapping):
        raise _wrong(command, reply, "a map of strings")
    out: dict[str, str] = {}
    for key, value in reply.items():
        if not isinstance(key, bytes | str) or not isinstance(value, bytes | str):
            raise _wrong(command, reply, "a map of strings")
        try:
            out[_text(key)] = _text(value)
        except UnicodeDecodeError:
            raise _wrong(command, reply, "a map of UTF-8 strings") from None
    return out


def parsed(command: str, call: Callable[[], _T]) -> _T:
    """``call()``, one redis-py command (or pub/sub read) whose reply redis-py parses: its
    parser failing on a reply of the wrong shape is :class:`WrongReply`. Keep ``call`` to that
    one command, so that no error of the caller's own is taken for the server's."""
    try:
        return call()
    except _PARSER_ERRORS as exc:
        raise WrongReply(f"{command}: redis-py could not parse the reply ({exc})") from None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
