"""Throughput of LMCache's own Redis connectors, as a peer to compare hma_redis with.

Measures LMCache's ``redis://`` connector (``RedisConnector``, redis-py asyncio) and its
``resp://`` connector (``RESPConnector``, the native C++ RESP client with ``--threads`` worker
threads, default LMCache's own: 8 in 0.5.6), built the way LMCache's ``RemoteBackend`` builds
them (``CreateConnector`` with an ``LMCacheEngineConfig``, ``LMCacheMetadata`` and a
``LocalCPUBackend`` that allocates the values) and called the way it calls them: ``batched_put``
for the puts; ``batched_get`` where the connector supports it (``resp://``), else one concurrent
``get`` per key (``redis://``). For reference ``--connector redis-py`` does the same with plain
redis-py: pipelined SET, then GET, ``--pipeline`` values per pipeline on one connection.

``--connector mp`` measures LMCache's multiprocess (MP) mode, which replaces the in-process one
where ``resp://`` lives: its Redis/Valkey L2 adapter (``resp`` in
``lmcache/v1/distributed/l2_adapters/``, the native C++ RESP client behind
``NativeConnectorL2Adapter``, ``--threads`` workers), built by
``create_l2_adapter_from_registry`` and called the way the MP server's store and prefetch
controllers call it: ``submit_store_task`` of L1 memory objects (from LMCache's own
``L1MemoryManager``), wait on the adapter's store event fd, ``pop_completed_store_tasks``; then
``submit_load_task`` into other L1 objects, wait on the load event fd, ``query_load_result``.
The MP server itself is not run: its store and retrieve take a serving engine's registered GPU
KV cache, so without vLLM the adapter is the part that moves bytes to and from Redis. A release
without the MP mode's adapters ends with exit status 2 and the reason.

It runs in a separate virtual environment with ``lmcache`` installed, not in hma_redis's::

    /tmp/lmc-venv/bin/python benchmarks/lmcache_peer.py --url redis://127.0.0.1:6379/0 \\
        --connector resp --size 2097152 --count 16 --reps 3 --threads 2

After ``--warmup`` untimed repetitions (default 1), each repetition puts ``--count`` fresh random
values of ``--size`` bytes (a multiple of 512: one LMCache chunk of 256 tokens of uint8) under fresh
keys starting ``hma:bench-lmc-<pid>:``, timing the whole batch; checks that Redis holds the expected
number of keys (``batched_put`` only logs its errors; ``redis://`` stores two keys a value,
``kv_bytes`` and ``metadata``); gets them all back, timing that, and compares every byte
(``resp://`` reports a GET of a value of the wrong size as done); then unlinks its keys (never
FLUSHDB). ``resp://`` has no database number, so it needs ``/0`` (or no path) in ``--url``. An
LMCache batch that takes over ``--timeout`` seconds counts as hung: in 0.5.6 ``resp://`` never ends
a GET of a missing key, nor any call to an unreachable server.

``--concurrency N`` (``resp://`` only; used by ``hma-redis bench --concurrency``) runs jobs of
``--count`` values instead, N in flight at once as N coroutines on the connector's event loop,
alternating a ``batched_get`` of one of 16 jobs' worth of values put before the loop and a
``batched_put`` of one of 16 jobs' worth of filled CPU buffers under fresh keys: ``--warmup-jobs``
untimed, then ``--jobs`` timed. Every value's presence and size is checked, the last N loads and
the last put job (every one with ``--check-every-job``) byte for byte, and that Redis holds
every value put. Its JSON line has ``wall_s`` and each job's (submitted, finished) seconds since
the loop began (``load_spans``, ``store_spans``) instead of ``put_s`` and ``get_s``.

Prints one JSON line on stdout: ``client``, ``size``, ``count``, ``put_s`` and ``get_s`` (seconds
per repetition), ``reget_s`` (the same values got again right after the get and its byte check: a
load that follows a load), ``lmcache_version``, ``redis_py_version``, ``threads`` (``resp://``
and ``mp``) and ``pipeline`` (redis-py only). Everything else, LMCache's logs included, goes to
stderr. Any missing or wrong value ends it with exit status 1 and a one-line message. The process
ends with ``os._exit`` and never calls the connector's ``close()``, which deadlocks in LMCache
0.5.6.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import os
import resource
import select
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import lmcache
import redis
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

T = TypeVar("T")

_CHUNK_TOKENS = 256  # LMCache's default chunk size; a value is one chunk
_VALUE_ALIGN = 2 * _CHUNK_TOKENS  # K and V of 256 tokens of uint8: sizes are multiples of this
_SOURCE_JOBS = 16  # jobs' worth of values loaded and put, as hma_redis' concurrent bench
_SCAN_COUNT = 1000
_UNLINK_BATCH = 500
_MESSAGE_CHARS = 200  # error messages are cut to this: redis-py's quote whole commands


class BenchError(Exception):
    """A value came back missing or wrong, Redis holds the wrong number of keys, or a call hung."""


class Client(Protocol):
    """One way of putting values into Redis and getting them back."""

    name: str
    keys_per_value: int  # Redis keys one stored value occupies

    def pattern(self, tag: str) -> str:
        """SCAN pattern matching every Redis key of the repetition ``tag``."""
        ...

    def put(self, tag: str, payloads: list[bytes]) -> float:
        """Store ``payloads`` under the keys of ``tag``; seconds taken by the store calls."""
        ...

    def get(self, tag: str, payloads: list[bytes]) -> float:
        """Fetch the values of ``tag`` and check them against ``payloads``; seconds of the fetch."""
        ...


class _Span:
    """What the timed span of a put or a get cost besides its time, as ``hma-redis bench``
    meters its own clients: CPU seconds of this process's threads and of its live child
    processes (LMCache's MP workers, if any: /proc), redis-server's CPU seconds and the commands
    it ran (one ``INFO cpu commandstats`` before and after; the second INFO not counted)."""

    def __init__(self) -> None:
        self.server: redis.Redis | None = None
        self.counter: Any = None  # --count-syscalls: hma_redis' SyscallCounter
        self.copies: Any = None  # and its CopyCounter, where the bench preloaded it
        self._start: tuple[float, float, int] = (0.0, 0.0, 0)
        self.last: dict[str, Any] = {}

    def _server(self) -> tuple[float, int]:
        if self.server is None:
            return 0.0, 0
        info = self.server.execute_command("INFO", "cpu", "commandstats")
        cpu = float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0))
        calls = sum(int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_"))
        return cpu, calls

    def begin(self) -> None:
        cpu, calls = self._server()
        # The children's CPU first: the /proc scan that reads it (~1 ms of CPU, hundreds of
        # system calls) is then neither in this process's CPU nor in the counters' span.
        children = _children_cpu_s()
        if self.counter is not None:  # after the INFO: its calls are not the span's
            self.counter.begin()
        if self.copies is not None:
            self.copies.begin()
        self._start = (_self_cpu_s() + children, cpu, calls)

    def end(self) -> None:
        mine = _self_cpu_s()
        copies = self.copies.end() if self.copies is not None else None
        syscalls = self.counter.end() if self.counter is not None else None
        mine += _children_cpu_s()
        cpu, calls = self._server()
        self.last = {
            "client_cpu_s": mine - self._start[0],
            "server_cpu_s": cpu - self._start[1],
            "commands": calls - self._start[2] - 1,
            "syscalls": syscalls,
            "copies": copies,
        }


def _bench_module(name: str) -> Any:
    """hma_redis' ``hma_redis/tools/bench/<name>.py``, loaded from this checkout's file (standard
    library only: this interpreter has no hma_redis)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "hma_redis" / "tools" / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"hma_bench_{name}", path)
    if spec is None or spec.loader is None:
        raise BenchError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_cpu_s() -> float:
    """CPU seconds (user + system) of this process (getrusage: every thread, microseconds)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu_s() -> float:
    """CPU seconds of this process's live children (/proc, clock ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


_SPAN = _Span()


def _stored(result: Any) -> None:
    """BenchError unless an MP store task's result says it succeeded."""
    if not result.is_successful():
        raise BenchError(f"a store task failed ({result.bytes_transferred()} bytes stored)")


def _holds(url: str, names: list[str]) -> int:
    """How many of these Redis keys exist."""
    with redis.Redis.from_url(url) as r:
        return sum(r.exists(*names[i : i + 500]) for i in range(0, len(names), 500))


def _check(index: int, got: memoryview | bytes | None, want: bytes) -> None:
    if got is None:
        raise BenchError(f"value {index}: missing")
    if len(got) != len(want):
        raise BenchError(f"value {index}: {len(got)} bytes, expected {len(want)}")
    if got != want:
        offset = next(i for i, (a, b) in enumerate(zip(bytes(got), want, strict=True)) if a != b)
        raise BenchError(f"value {index}: differs from what was put at byte {offset}")


class LMCacheClient:
    """An LMCache remote connector, with the config, metadata and allocator it needs."""

    keys_per_value = 1

    def __init__(
        self,
        url: str,
        connector: str,
        size: int,
        count: int,
        threads: int | None,
        timeout: float,
        held: int | None = None,
    ) -> None:
        """``threads``: resp:// worker threads (None: LMCache's default); ``held``: the most
        values held in LMCache's CPU buffers at once (default two repetitions' worth)."""
        self.timeout = timeout
        self.url = url
        held = 2 * count if held is None else held
        extra: dict[str, Any] = {"save_chunk_meta": False}
        if threads is not None:
            extra["resp_num_threads"] = threads
        parts = urlsplit(url)
        if connector == "resp":
            if parts.path not in ("", "/", "/0"):
                raise BenchError(f"resp:// always uses database 0, not {parts.path!r}")
            remote_url = f"resp://{parts.hostname}:{parts.port}"
            self.name = "lmcache-resp"
        else:
            remote_url = url
            self.name = "lmcache-redis"
            self.keys_per_value = 2  # "<key>kv_bytes" and "<key>metadata"
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=_CHUNK_TOKENS,
            local_cpu=False,
            max_local_cpu_size=held * size / 2**30 + 0.25,  # plus slack
            remote_url=remote_url,
            remote_serde="naive",
            save_unfull_chunk=False,
            extra_config=extra,
        )
        self.metadata = LMCacheMetadata(
            model_name="hma:bench-lmc",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 2, _CHUNK_TOKENS, 1, size // _VALUE_ALIGN),
            chunk_size=_CHUNK_TOKENS,
        )
        self.backend = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.connector = self._run("CreateConnector", self._create(remote_url))

    async def _create(self, remote_url: str) -> RemoteConnector:
        # On the loop's thread: the RESP client registers its completion fd with the loop.
        return CreateConnector(remote_url, self.loop, self.backend, self.config, self.metadata)

    def _run(self, what: str, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            # e.g. resp:// in LMCache 0.5.6: a GET of a missing key never completes
            raise BenchError(f"{what} did not finish in {self.timeout:g} s") from None

    def keys(self, tag: str, count: int) -> list[CacheEngineKey]:
        return self._keys(tag, count)

    def _keys(self, tag: str, count: int) -> list[CacheEngineKey]:
        # CacheEngineKey.to_string() starts with the model name: "<tag>@1@0@<hash>@uint8".
        return [CacheEngineKey(tag, 1, 0, i, torch.uint8) for i in range(count)]

    def pattern(self, tag: str) -> str:
        return f"{tag}@*"

    def filled(self, payloads: list[bytes]) -> list[MemoryObj]:
        """LMCache CPU buffers holding ``payloads``, as a store finds them after its copy
        from the GPU."""
        objs: list[MemoryObj] = []
        for payload in payloads:
            obj = self.backend.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes())
            if obj is None:
                raise BenchError("LMCache's LocalCPUBackend could not allocate a value")
            memoryview(obj.byte_array).cast("B")[:] = payload
            objs.append(obj)
        return objs

    @property
    def threads(self) -> int | None:
        """The resp:// client's worker threads, as LMCache configured them."""
        inner = getattr(self.connector, "_connector", self.connector)  # CreateConnector wraps
        return getattr(inner, "num_threads", None)

    def put(self, tag: str, payloads: list[bytes]) -> float:
        objs = self.filled(payloads)
        keys = self._keys(tag, len(payloads))
        _SPAN.begin()
        start = time.perf_counter()
        # Hands the objects' references to the connector, which drops them when done.
        self._run("batched_put", self.connector.batched_put(keys, objs))
        seconds = time.perf_counter() - start
        _SPAN.end()
        return seconds

    def run_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the connector's event loop (bounded by ``--timeout``)."""
        return self._run("the concurrent loop", coro)

    def put_keys(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        self._run("batched_put", self.connector.batched_put(keys, objs))

    def get_keys(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return self._run("batched_get", self.connector.batched_get(keys))

    def exists(self, keys: list[CacheEngineKey]) -> int:
        """How many of these keys Redis holds (the peer's own redis-py client)."""
        return _holds(self.url, [key.to_string() for key in keys])

    async def _get_each(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return list(await asyncio.gather(*(self.connector.get(key) for key in keys)))

    def get(self, tag: str, payloads: list[bytes]) -> float:
        keys = self._keys(tag, len(payloads))
        _SPAN.begin()
        start = time.perf_counter()
        if self.connector.support_batched_get():
            objs = self._run("batched_get", self.connector.batched_get(keys))
        else:
            objs = self._run("get of each key", self._get_each(keys))
        seconds = time.perf_counter() - start
        _SPAN.end()
        try:
            for i, (obj, payload) in enumerate(zip(objs, payloads, strict=True)):
                _check(i, None if obj is None else memoryview(obj.byte_array).cast("B"), payload)
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
        return seconds


_MP_NO_MODE_STATUS = 2  # the exit status for "this LMCache has no MP mode"


class NoMPMode(Exception):
    """The installed LMCache has no multiprocess mode with a Redis (RESP) L2 adapter."""


class MPClient:
    """LMCache's MP-mode Redis L2 adapter (``resp``), called as the MP server's storage
    controllers call it, on buffers from the MP server's L1 memory manager."""

    name = "lmcache-mp"
    keys_per_value = 1

    def __init__(
        self,
        url: str,
        size: int,
        count: int,
        threads: int | None,
        timeout: float,
        held: int | None = None,
    ):
        """``held``: the most values held in L1 buffers at once (default two repetitions'
        worth: a put's sources and a get's destinations)."""
        try:
            from lmcache.v1.distributed.api import MemoryLayoutDesc
            from lmcache.v1.distributed.config import L1MemoryManagerConfig
            from lmcache.v1.distributed.l2_adapters.factory import (
                create_l2_adapter_from_registry,
            )
            from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
            from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
        except ImportError as exc:
            version = lmcache.__version__
            raise NoMPMode(f"LMCache {version} has no MP-mode RESP adapter: {exc}") from None
        parts = urlsplit(url)
        if parts.path not in ("", "/", "/0"):
            raise BenchError(f"the MP RESP adapter always uses database 0, not {parts.path!r}")
        self.timeout = timeout
        self.size = size
        self.url = url
        # The values held at once, plus the allocator's alignment slack.
        held = 2 * count if held is None else held
        l1_bytes = held * (size + 0x1000) + (64 << 20)
        self.l1 = L1MemoryManager(
            L1MemoryManagerConfig(size_in_bytes=l1_bytes, use_lazy=False, shm_name="")
        )
        self.layout = MemoryLayoutDesc([torch.Size([size])], [torch.uint8])
        config: dict[str, Any] = {"host": parts.hostname, "port": parts.port or 6379}
        if threads is not None:
            config["num_workers"] = threads
        resp_config = RESPL2AdapterConfig.from_dict(config)
        self.threads = resp_config.num_workers
        self.adapter = create_l2_adapter_from_registry(resp_config)

    def keys(self, tag: str, count: int) -> list[Any]:
        return self._keys(tag, count)

    def _keys(self, tag: str, count: int) -> list[Any]:
        from lmcache.v1.distributed.api import ObjectKey

        # Serialized "<model>@<rank hex>@<group>@<hash hex>": the tag (no "@") as the model.
        return [
            ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=tag, kv_rank=0)
            for i in range(count)
        ]

    def pattern(self, tag: str) -> str:
        return f"{tag}@*"

    def _allocate(self, count: int) -> list[MemoryObj]:
        error, objs = self.l1.allocate(self.layout, count)
        if len(objs) != count:
            raise BenchError(
                f"LMCache's L1MemoryManager could not allocate {count} values ({error})"
            )
        return objs

    def _wait(self, what: str, fd: int, done: Callable[[], T | None]) -> T:
        """Poll ``done`` whenever the adapter signals ``fd``, as the MP server's controllers
        do, until it answers or ``--timeout`` passes."""
        from lmcache.v1.platform.event_notifier import consume_fd

        deadline = time.perf_counter() + self.timeout
        while (result := done()) is None:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise BenchError(f"{what} did not finish in {self.timeout:g} s")
            if select.select([fd], [], [], left)[0]:
                consume_fd(fd)
        return result

    def filled(self, payloads: list[bytes]) -> list[MemoryObj]:
        """L1 buffers holding ``payloads``, as a store finds them after its copy from the
        GPU."""
        objs = self._allocate(len(payloads))
        for obj, payload in zip(objs, payloads, strict=True):
            memoryview(obj.byte_array).cast("B")[:] = payload
        return objs

    def store(self, keys: list[Any], objs: list[MemoryObj]) -> None:
        """One store task, awaited; BenchError unless it succeeded."""
        task = self.adapter.submit_store_task(keys, objs)
        results: dict[Any, Any] = {}

        def finished() -> Any:
            results.update(self.adapter.pop_completed_store_tasks())
            return results.get(task)

        _stored(self._wait("submit_store_task", self.adapter.get_store_event_fd(), finished))

    def load(self, keys: list[Any], objs: list[MemoryObj]) -> Any:
        """One load task into ``objs``, awaited: its bitmap of the values that landed."""
        task = self.adapter.submit_load_task(keys, objs)
        fd = self.adapter.get_load_event_fd()
        return self._wait("submit_load_task", fd, lambda: self.adapter.query_load_result(task))

    def exists(self, keys: list[Any]) -> int:
        """How many of these keys Redis holds (named as the adapter names them)."""
        from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
            _object_key_to_string,
        )

        return _holds(self.url, [_object_key_to_string(key) for key in keys])

    def put(self, tag: str, payloads: list[bytes]) -> float:
        objs = self.filled(payloads)
        keys = self._keys(tag, len(payloads))
        try:
            _SPAN.begin()
            start = time.perf_counter()
            self.store(keys, objs)
            seconds = time.perf_counter() - start
            _SPAN.end()
        finally:
            self.l1.free(objs)
        return seconds

    def get(self, tag: str, payloads: list[bytes]) -> float:
        objs = self._allocate(len(payloads))
        keys = self._keys(tag, len(payloads))
        try:
            _SPAN.begin()
            start = time.perf_counter()
            loaded = self.load(keys, objs)
            seconds = time.perf_counter() - start
            _SPAN.end()
            for i, (obj, payload) in enumerate(zip(objs, payloads, strict=True)):
                got = memoryview(obj.byte_array).cast("B") if loaded.test(i) else None
                _check(i, got, payload)
        finally:
            self.l1.free(objs)
        return seconds


class RedisPyClient:
    """Plain redis-py on one connection: pipelines of SET, then of GET."""

    name = "redis-py"
    keys_per_value = 1

    def __init__(self, url: str, pipeline: int) -> None:
        self.redis = redis.Redis.from_url(url)
        self.pipeline = pipeline

    def pattern(self, tag: str) -> str:
        return f"{tag}:*"

    def put(self, tag: str, payloads: list[bytes]) -> float:
        _SPAN.begin()
        start = time.perf_counter()
        for first in range(0, len(payloads), self.pipeline):
            pipe = self.redis.pipeline(transaction=False)
            for i, payload in enumerate(payloads[first : first + self.pipeline], first):
                pipe.set(f"{tag}:{i}", payload)
            pipe.execute()
        seconds = time.perf_counter() - start
        _SPAN.end()
        return seconds

    def get(self, tag: str, payloads: list[bytes]) -> float:
        got: list[bytes | None] = []
        _SPAN.begin()
        start = time.perf_counter()
        for first in range(0, len(payloads), self.pipeline):
            pipe = self.redis.pipeline(transaction=False)
            for i in range(first, min(first + self.pipeline, len(payloads))):
                pipe.get(f"{tag}:{i}")
            got.extend(pipe.execute())
        seconds = time.perf_counter() - start
        _SPAN.end()
        for i, (value, payload) in enumerate(zip(got, payloads, strict=True)):
            _check(i, value, payload)
        return seconds


class _ClosedLoop:
    """What both ``--concurrency`` loops share: the timed span, then the checks left after it
    (the last N loads byte for byte, that Redis holds every value put, the last put read back
    and compared; every put with ``--check-every-job``)."""

    def __init__(self, client: Any, args: argparse.Namespace, prefix: str) -> None:
        """``client``: an LMCacheClient or an MPClient (``keys``, ``filled``, ``exists``)."""
        self.client = client
        self.args = args
        self.prefix = prefix
        self._serial = 0
        count, size = args.count, args.size
        self.load_payloads = [[os.urandom(size) for _ in range(count)] for _ in range(_SOURCE_JOBS)]
        self.load_keys = [client.keys(self._tag(), count) for _ in range(_SOURCE_JOBS)]
        self.store_payloads = [
            [os.urandom(size) for _ in range(count)] for _ in range(_SOURCE_JOBS)
        ]
        self.store_objs = [client.filled(payloads) for payloads in self.store_payloads]
        self.stored: list[tuple[list[Any], int]] = []  # each put's keys and source index

    def _tag(self) -> str:
        self._serial += 1
        return f"{self.prefix}j{self._serial}"

    def run(
        self,
        jobs: int,
        spans: dict[str, list[tuple[float, float]]] | None,
        span: _Span | None = None,
    ) -> float:
        """Run ``jobs`` jobs (``--concurrency`` in flight); each one's (submitted, finished)
        seconds since the loop began into ``spans`` and, with ``span``, the loop's CPU (this
        process's and redis-server's) into it; the loop's wall seconds."""
        self.stored.clear()
        if span is not None:
            span.begin()
        start = time.perf_counter()
        try:
            recent = self._loop(jobs, spans, start)
        finally:
            wall_s = time.perf_counter() - start
            if span is not None:
                span.end()
        self._compare_recent(recent)
        stored_keys = [key for keys, _ in self.stored for key in keys]
        holds = self.client.exists(stored_keys)
        if holds != len(stored_keys):
            raise BenchError(f"Redis holds {holds} of the {len(stored_keys)} values put")
        checked = self.stored if self.args.check_every_job else self.stored[-1:]
        for keys, source in checked:
            self._read_back(keys, _SOURCE_JOBS + source)
        return wall_s

    def _loop(
        self, jobs: int, spans: dict[str, list[tuple[float, float]]] | None, origin: float
    ) -> Any:
        """Run the jobs; the last loads, still to compare."""
        raise NotImplementedError

    def _compare_recent(self, recent: Any) -> None:
        raise NotImplementedError

    def _read_back(self, keys: list[Any], source: int) -> None:
        """Load what a put stored under ``keys`` and compare it with payloads ``source``
        (counting the stores' sources after the loads')."""
        raise NotImplementedError


class ConcurrentLoop(_ClosedLoop):
    """``--concurrency N``: jobs of ``--count`` values with N in flight at once on one
    ``resp://`` connector (N coroutines on its event loop), alternating a ``batched_get`` of
    one of ``_SOURCE_JOBS`` jobs' worth of values put before the loop and a ``batched_put``
    of one of ``_SOURCE_JOBS`` jobs' worth of filled CPU buffers under fresh keys."""

    def prepare(self) -> None:
        """Put the loads' values (untimed), every job at once."""
        for keys, payloads in zip(self.load_keys, self.load_payloads, strict=True):
            self.client.put_keys(keys, self.client.filled(payloads))

    def _loop(
        self, jobs: int, spans: dict[str, list[tuple[float, float]]] | None, origin: float
    ) -> collections.deque[tuple[list[MemoryObj], int]]:
        recent: collections.deque[tuple[list[MemoryObj], int]] = collections.deque()
        self.client.run_loop(self._jobs(jobs, spans, recent, origin))
        return recent

    def _compare_recent(self, recent: collections.deque[tuple[list[MemoryObj], int]]) -> None:
        for objs, source in recent:
            self._check_load(objs, source, compare=True)

    def _read_back(self, keys: list[Any], source: int) -> None:
        self._check_load(self.client.get_keys(keys), source, compare=True)

    async def _jobs(
        self,
        jobs: int,
        spans: dict[str, list[tuple[float, float]]] | None,
        recent: collections.deque[tuple[list[MemoryObj], int]],
        origin: float,
    ) -> None:
        connector = self.client.connector
        in_flight = asyncio.Semaphore(self.args.concurrency)

        async def job(n: int) -> None:
            source = n // 2 % _SOURCE_JOBS
            if n % 2:  # the connector drops one reference per put value; these are reused
                for obj in self.store_objs[source]:
                    obj.ref_count_up()
            async with in_flight:
                start = time.perf_counter()
                if n % 2 == 0:
                    objs = await connector.batched_get(self.load_keys[source])
                else:
                    keys = self.client.keys(self._tag(), self.args.count)
                    await connector.batched_put(keys, self.store_objs[source])
                end = time.perf_counter()
            op = "load" if n % 2 == 0 else "store"
            if spans is not None:
                spans[op].append((start - origin, end - origin))
            if op == "store":
                self.stored.append((keys, source))
                return
            if self.args.check_every_job:
                self._check_load(objs, source, compare=True)
                return
            self._check_load(objs, source, compare=False)
            recent.append((objs, source))
            while len(recent) > self.args.concurrency:  # keep the last N loads to compare
                old, _ = recent.popleft()
                _release(old)

        await asyncio.gather(*(job(n) for n in range(jobs)))

    def _check_load(self, objs: list[MemoryObj | None], source: int, *, compare: bool) -> None:
        """Every value is there and of its size; with ``compare`` equal to its payload (then
        the buffers are released). ``source`` counts the stores' sources after the loads'."""
        payloads = (self.load_payloads + self.store_payloads)[source]
        try:
            for i, (obj, payload) in enumerate(zip(objs, payloads, strict=True)):
                got = None if obj is None else memoryview(obj.byte_array).cast("B")
                if compare or got is None:
                    _check(i, got, payload)
                elif len(got) != len(payload):
                    raise BenchError(f"value {i}: {len(got)} bytes, expected {len(payload)}")
        finally:
            if compare:
                _release(objs)


def _release(objs: list[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


@dataclasses.dataclass
class _MPTask:
    op: str  # "load" or "store"
    started: float
    source: int  # which of the _SOURCE_JOBS jobs' payloads it loads or stores
    keys: list[Any]
    objs: list[MemoryObj]  # a load's destinations (freed after its check), a store's sources


class MPConcurrentLoop(_ClosedLoop):
    """``--connector mp --concurrency N``: tasks of ``--count`` values with N in flight at once
    on the MP mode's RESP L2 adapter, submitted and awaited as the MP server's controllers do
    (``submit_load_task`` / ``submit_store_task``; ``select`` on the adapter's load and store
    event fds, then ``query_load_result`` and ``pop_completed_store_tasks``), alternating a
    load of one of ``_SOURCE_JOBS`` jobs' worth of values stored before the loop into fresh L1
    buffers and a store of one of ``_SOURCE_JOBS`` jobs' worth of filled L1 buffers under fresh
    keys."""

    def prepare(self) -> None:
        """Store the loads' values (untimed), one task per job, from buffers freed after."""
        for keys, payloads in zip(self.load_keys, self.load_payloads, strict=True):
            objs = self.client.filled(payloads)
            try:
                self.client.store(keys, objs)
            finally:
                self.client.l1.free(objs)

    def _loop(
        self, jobs: int, spans: dict[str, list[tuple[float, float]]] | None, origin: float
    ) -> collections.deque[_MPTask]:
        recent: collections.deque[_MPTask] = collections.deque()
        self._tasks(jobs, spans, recent, origin)
        return recent

    def _compare_recent(self, recent: collections.deque[_MPTask]) -> None:
        try:
            for task in recent:
                self._check_load(task, compare=True)
        finally:
            for task in recent:
                self.client.l1.free(task.objs)

    def _read_back(self, keys: list[Any], source: int) -> None:
        objs = self.client._allocate(len(keys))
        try:
            loaded = self.client.load(keys, objs)
            self._check_load(_MPTask("load", 0.0, source, keys, objs), True, loaded)
        finally:
            self.client.l1.free(objs)

    def _submit(self, n: int) -> tuple[Any, _MPTask]:
        adapter = self.client.adapter
        source = n // 2 % _SOURCE_JOBS
        start = time.perf_counter()
        if n % 2 == 0:
            objs = self.client._allocate(self.args.count)
            task = _MPTask("load", start, source, self.load_keys[source], objs)
            return adapter.submit_load_task(task.keys, objs), task
        keys = self.client.keys(self._tag(), self.args.count)
        task = _MPTask("store", start, source, keys, self.store_objs[source])
        return adapter.submit_store_task(keys, task.objs), task

    def _tasks(
        self,
        jobs: int,
        spans: dict[str, list[tuple[float, float]]] | None,
        recent: collections.deque[_MPTask],
        origin: float,
    ) -> None:
        from lmcache.v1.platform.event_notifier import consume_fd

        adapter = self.client.adapter
        fds = [adapter.get_load_event_fd(), adapter.get_store_event_fd()]
        loads: dict[Any, _MPTask] = {}
        stores: dict[Any, _MPTask] = {}
        submitted = 0
        while submitted < jobs or loads or stores:
            while submitted < jobs and len(loads) + len(stores) < self.args.concurrency:
                task_id, task = self._submit(submitted)
                (loads if task.op == "load" else stores)[task_id] = task
                submitted += 1
            ready = select.select(fds, [], [], self.args.timeout)[0]
            if not ready:
                raise BenchError(f"no MP task finished in {self.args.timeout:g} s")
            for fd in ready:
                consume_fd(fd)
            now = time.perf_counter()
            finished: list[_MPTask] = []
            for task_id, result in adapter.pop_completed_store_tasks().items():
                task = stores.pop(task_id)
                _stored(result)
                self.stored.append((task.keys, task.source))
                finished.append(task)
            for task_id in list(loads):
                loaded = adapter.query_load_result(task_id)
                if loaded is None:
                    continue
                task = loads.pop(task_id)
                finished.append(task)
                if self.args.check_every_job:
                    try:
                        self._check_load(task, True, loaded)
                    finally:
                        self.client.l1.free(task.objs)
                    continue
                self._check_load(task, False, loaded)
                recent.append(task)
                while len(recent) > self.args.concurrency:  # keep the last N loads to compare
                    self.client.l1.free(recent.popleft().objs)
            if spans is not None:
                for task in finished:
                    spans[task.op].append((task.started - origin, now - origin))

    def _check_load(self, task: _MPTask, compare: bool, loaded: Any = None) -> None:
        """Every value of the load task landed (its bitmap) and, with ``compare``, equals its
        payload. ``task.source`` counts the stores' sources after the loads'."""
        payloads = (self.load_payloads + self.store_payloads)[task.source]
        for i, (obj, payload) in enumerate(zip(task.objs, payloads, strict=True)):
            if loaded is not None and not loaded.test(i):
                raise BenchError(f"value {i}: missing")
            if compare:
                _check(i, memoryview(obj.byte_array).cast("B"), payload)


def _measure_concurrent(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    count, level = args.count, args.concurrency
    # The loads' and the stores' sources, the loads in flight and the last N kept to compare.
    held = (2 * _SOURCE_JOBS + 2 * level + 1) * count
    loop: ConcurrentLoop | MPConcurrentLoop
    if args.connector == "mp":
        mp = MPClient(args.url, args.size, count, args.threads, args.timeout, held=held)
        client_name, threads = mp.name, mp.threads
        loop = MPConcurrentLoop(mp, args, prefix)
    else:
        client = LMCacheClient(
            args.url, "resp", args.size, count, args.threads, args.timeout, held=held
        )
        client_name, threads = client.name, client.threads
        loop = ConcurrentLoop(client, args, prefix)
    loop.prepare()
    loop.run(args.warmup_jobs, None)
    spans: dict[str, list[tuple[float, float]]] = {"load": [], "store": []}
    span = _Span()
    span.server = redis.Redis.from_url(args.url)
    wall_s = loop.run(args.jobs, spans, span)
    return {
        "client": client_name,
        "size": args.size,
        "count": count,
        "concurrency": level,
        "jobs": args.jobs,
        "wall_s": wall_s,
        "client_cpu_s": span.last["client_cpu_s"],
        "server_cpu_s": span.last["server_cpu_s"],
        "load_spans": spans["load"],
        "store_spans": spans["store"],
        "lmcache_version": lmcache.__version__,
        "threads": threads,
    }


def _one_line(text: str) -> str:
    text = "".join(c if c.isascii() and c.isprintable() else "?" for c in " ".join(text.split()))
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _unlink(r: redis.Redis, pattern: str) -> None:
    keys = list(r.scan_iter(match=pattern, count=_SCAN_COUNT))
    for first in range(0, len(keys), _UNLINK_BATCH):
        r.unlink(*keys[first : first + _UNLINK_BATCH])


def _measure(args: argparse.Namespace, r: redis.Redis, prefix: str) -> dict[str, Any]:
    client: Client
    if args.connector == "redis-py":
        client = RedisPyClient(args.url, args.pipeline)
    elif args.connector == "mp":
        client = MPClient(args.url, args.size, args.count, args.threads, args.timeout)
    else:
        client = LMCacheClient(
            args.url, args.connector, args.size, args.count, args.threads, args.timeout
        )
    put_s: list[float] = []
    get_s: list[float] = []
    put_cost: list[dict[str, float]] = []
    get_cost: list[dict[str, float]] = []
    reget_s: list[float] = []
    reget_cost: list[dict[str, float]] = []
    _SPAN.server = r
    if args.count_syscalls:
        _SPAN.counter = _bench_module("syscalls").SyscallCounter()
        _SPAN.copies = _bench_module("copies").CopyCounter.attached()
    for rep in range(args.warmup + args.reps):
        tag = f"{prefix}r{rep}"
        payloads = [os.urandom(args.size) for _ in range(args.count)]
        put = client.put(tag, payloads)
        put_spent = _SPAN.last
        stored = sum(1 for _ in r.scan_iter(match=client.pattern(tag), count=_SCAN_COUNT))
        expected = args.count * client.keys_per_value
        if stored != expected:
            raise BenchError(f"repetition {rep}: Redis holds {stored} keys, expected {expected}")
        get = client.get(tag, payloads)
        get_spent = _SPAN.last
        # The same values again at once (after the get's byte check): a burst of loads.
        reget = client.get(tag, payloads)
        reget_spent = _SPAN.last
        _unlink(r, client.pattern(tag))
        if rep >= args.warmup:  # the first ones open connections and touch fresh memory
            put_s.append(put)
            get_s.append(get)
            put_cost.append(put_spent)
            get_cost.append(get_spent)
            reget_s.append(reget)
            reget_cost.append(reget_spent)
    return {
        "client": client.name,
        "size": args.size,
        "count": args.count,
        "put_s": put_s,
        "get_s": get_s,
        "put_cost": put_cost,
        "get_cost": get_cost,
        "reget_s": reget_s,
        "reget_cost": reget_cost,
        "lmcache_version": lmcache.__version__,
        "redis_py_version": redis.__version__,
        "threads": getattr(client, "threads", None),
        "pipeline": args.pipeline if args.connector == "redis-py" else None,
    }


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="redis://host:port/db of the Redis to use")
    parser.add_argument("--connector", required=True, choices=("redis", "resp", "mp", "redis-py"))
    parser.add_argument("--size", type=int, required=True, help="bytes per value")
    parser.add_argument("--count", type=int, required=True, help="values per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument(
        "--threads",
        type=int,
        help="resp:// client (or MP RESP adapter) worker threads (default: LMCache's)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        help="resp:// and mp only: jobs of --count values, this many in flight at once, "
        "alternating a load and a store (instead of --reps of a put then a get)",
    )
    parser.add_argument("--jobs", type=int, default=96, help="timed jobs with --concurrency")
    parser.add_argument(
        "--warmup-jobs", type=int, default=4, help="untimed jobs first with --concurrency"
    )
    parser.add_argument(
        "--check-every-job",
        action="store_true",
        help="with --concurrency: compare every load and every put value, not the last ones",
    )
    parser.add_argument("--pipeline", type=int, default=4, help="redis-py commands per pipeline")
    parser.add_argument(
        "--count-syscalls",
        action="store_true",
        help="count each put's and get's system calls (strace -c -f attached; slow, untimed) "
        "and, where the bench preloaded its copy counter, bytes copied",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds one LMCache batch may take"
    )
    args = parser.parse_args()
    if args.size <= 0 or args.size % _VALUE_ALIGN:
        parser.error(f"--size must be a positive multiple of {_VALUE_ALIGN}")
    if min(args.count, args.reps, args.threads or 1, args.pipeline, args.timeout) <= 0:
        parser.error("--count, --reps, --threads, --pipeline and --timeout must be positive")
    if args.concurrency is not None and args.connector not in ("resp", "mp"):
        parser.error("--concurrency measures the resp:// connector and the MP adapter only")
    if min(args.concurrency or 1, args.jobs, args.warmup_jobs + 1) <= 0:
        parser.error("--concurrency and --jobs must be positive, --warmup-jobs not negative")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    return args


def main() -> None:
    args = _parse_args()
    # Keep stdout for the one JSON line; anything else written to it, native code's included,
    # goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    prefix = f"hma:bench-lmc-{os.getpid()}:"
    r = redis.Redis.from_url(args.url)
    status = 1
    try:
        if args.concurrency is not None:
            result = _measure_concurrent(args, prefix)
        else:
            result = _measure(args, r, prefix)
        out.write(json.dumps(result) + "\n")
        status = 0
    except NoMPMode as exc:
        print(f"lmcache_peer: {args.connector}: {exc}", file=sys.stderr)
        status = _MP_NO_MODE_STATUS
    except BenchError as exc:
        print(f"lmcache_peer: {args.connector}: {exc}", file=sys.stderr)
    except Exception as exc:
        message = _one_line(f"{type(exc).__name__}: {exc}")
        print(f"lmcache_peer: {args.connector}: {message}", file=sys.stderr)
    try:
        _unlink(r, f"{prefix}*")
    except redis.RedisError as exc:
        print(f"lmcache_peer: could not unlink {prefix}*: {_one_line(str(exc))}", file=sys.stderr)
        status = 1
    out.flush()
    sys.stderr.flush()
    # Not close(): LMCache 0.5.6's connector close() deadlocks; its threads end with the process.
    os._exit(status)


if __name__ == "__main__":
    main()
