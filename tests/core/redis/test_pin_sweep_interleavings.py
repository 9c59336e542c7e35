"""A pin renewed while a sweep runs stays persistent, however the two interleave.

The sweep (``pins.sweep``) and a renewal (``pins.pin`` with a later deadline, as another
instance sends it on its own connection) each make a few round trips to a real Redis. The test
runs the renewal on a thread that may make its next round trip only when the sweep reaches a
planned point, and tries every placement of the renewal's round trips among the sweep's: in
each, the renewed chunk must end without a TTL (``volatile-*`` never evicts it) and listed with
its new deadline, and the chunk not renewed must get its TTL back."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis

from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import pins

TTL_S = 3600
KEYSPACE = KeySpace("hma", "pin-interleavings")
PINS = KEYSPACE.pins_key()
# Placements run the renewal's n-th round trip before the sweep's round trip of this index at
# the latest; one past the sweep's last round trip means after the sweep has returned.
MOST_SWEEP_CALLS = 6
TURN_S = 10.0  # how long one side waits for the other's round trip before the test fails


class _Stepped:
    """A real redis-py client whose every round trip (a command, or a pipeline's ``execute``)
    calls ``before`` first and ``after`` once Redis has answered; each is named in ``trace``
    (``"<label> <command>"``) as it is made."""

    def __init__(
        self,
        client: Any,
        before: Callable[[], None],
        after: Callable[[], None],
        trace: list[str] | None = None,
        label: str = "",
    ) -> None:
        self._client, self._before, self._after = client, before, after
        self._trace, self._label = trace, label

    def pipeline(self, *args: Any, **kwargs: Any) -> _Stepped:
        pipe = self._client.pipeline(*args, **kwargs)
        return _Stepped(pipe, self._before, self._after, self._trace, self._label)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or name in _QUEUED_ONLY:
            return attr

        def round_trip(*args: Any, **kwargs: Any) -> Any:
            if isinstance(self._client, redis.client.Pipeline) and name != "execute":
                return attr(*args, **kwargs)  # queued in the pipeline: no round trip yet
            self._before()
            if self._trace is not None:
                self._trace.append(f"{self._label} {_command_names(self._client, name)}")
            try:
                return attr(*args, **kwargs)
            finally:
                self._after()

        return round_trip


_QUEUED_ONLY = frozenset({"__enter__", "__exit__"})


def _command_names(client: Any, name: str) -> str:
    """The command a round trip sends (a pipeline's: its queued commands)."""
    if name != "execute":
        return name.upper()
    queued = {str(command[0][0]) for command in client.command_stack}
    return "pipeline of " + "/".join(sorted(queued))


class _Renewal:
    """``pins.pin`` of ``deadlines`` on a thread of its own, one round trip per :meth:`let`."""

    def __init__(self, client: redis.Redis, deadlines: dict[str, float], trace: list[str]) -> None:
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self.calls = 0
        self.error: BaseException | None = None
        stepped = _Stepped(client, self._wait_turn, self._done.release, trace, "renewal")
        self._thread = threading.Thread(target=self._run, args=(stepped, deadlines), daemon=True)
        self._thread.start()

    def _run(self, stepped: _Stepped, deadlines: dict[str, float]) -> None:
        try:
            pins.pin(stepped, PINS, deadlines)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def _wait_turn(self) -> None:
        if not self._go.acquire(timeout=TURN_S):
            raise TimeoutError("the renewal was never let through")
        self.calls += 1

    def let(self, calls: int) -> None:
        """Let the renewal make ``calls`` round trips, and wait until Redis answered them."""
        for _ in range(calls):
            self._go.release()
            assert self._done.acquire(timeout=TURN_S), "a renewal round trip did not return"

    def finish(self) -> None:
        self._thread.join(TURN_S)
        assert not self._thread.is_alive(), "the renewal made more round trips than planned"
        if self.error is not None:
            raise self.error


def _renewal_calls(client: redis.Redis) -> int:
    """How many round trips one renewal makes (counted on a chunk no test looks at)."""
    calls = [0]
    counting = _Stepped(client, lambda: None, lambda: calls.__setitem__(0, calls[0] + 1))
    pins.pin(counting, PINS, {KEYSPACE.block_key(0, b"\xff" * 32): time.time() + 60})
    return calls[0]


def _placements(renewal_calls: int) -> Iterator[tuple[int, ...]]:
    """Every non-decreasing placement of the renewal's round trips among the sweep's."""
    return itertools.combinations_with_replacement(range(MOST_SWEEP_CALLS + 1), renewal_calls)


def _sweep_with_renewal(
    client: redis.Redis, renewal: _Renewal, placement: Sequence[int], trace: list[str]
) -> None:
    """Sweep on ``client``, letting the renewal's round trips in where ``placement`` says."""
    sweep_calls = [0]

    def before_sweep_call() -> None:
        renewal.let(list(placement).count(sweep_calls[0]))
        sweep_calls[0] += 1

    pins.sweep(_Stepped(client, before_sweep_call, lambda: None, trace, "sweep"), PINS, TTL_S)
    renewal.let(sum(1 for at in placement if at >= sweep_calls[0]))


@pytest.fixture
def two_clients(redis_url: str, redis_client: redis.Redis) -> Iterator[list[redis.Redis]]:
    """Two connections to the flushed session Redis: the sweeping instance's and the
    renewing one's."""
    clients = [redis.Redis.from_url(redis_url) for _ in range(2)]
    yield clients
    for client in clients:
        client.close()


def test_a_pin_renewed_at_any_point_of_a_sweep_stays_persistent(
    two_clients: list[redis.Redis],
) -> None:
    sweeper, renewer = two_clients
    renewal_calls = _renewal_calls(renewer)
    assert renewal_calls >= 1
    renewed = KEYSPACE.block_key(0, b"\x01" * 32)
    ended = KEYSPACE.block_key(0, b"\x02" * 32)
    tried = 0
    for placement in _placements(renewal_calls):
        sweeper.delete(PINS, renewed, ended)
        sweeper.set(renewed, b"v", ex=TTL_S)
        sweeper.set(ended, b"v", ex=TTL_S)
        now = time.time()
        pins.pin(sweeper, PINS, {renewed: now - 1, ended: now - 1})  # both due
        later = now + 600
        trace: list[str] = []
        renewal = _Renewal(renewer, {renewed: later}, trace)
        _sweep_with_renewal(sweeper, renewal, placement, trace)
        renewal.finish()
        assert renewal.calls == renewal_calls, placement
        where = "round trips in this order: " + ", ".join(trace)
        assert sweeper.ttl(renewed) == -1, f"the renewed chunk has a TTL again ({where})"
        assert sweeper.zscore(PINS, renewed) == pytest.approx(later, abs=0.01), where
        assert 0 < sweeper.ttl(ended) <= TTL_S, f"the ended pin kept its chunk ({where})"
        assert sweeper.zscore(PINS, ended) is None, where
        tried += 1
    assert tried == len(list(_placements(renewal_calls)))
