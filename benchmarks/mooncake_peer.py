"""Throughput of Mooncake Store on one host over TCP, as a peer to compare hma_redis with.

Mooncake Store is what vLLM users pick through ``MooncakeStoreConnector``. This script runs in
its own virtual environment (``mooncake-transfer-engine-non-cuda``; Debian's ``libibverbs1``
must be installed), never in hma_redis' and never in CI::

    MC_TCP_BIND_ADDRESS=127.0.0.1 /tmp/mc-venv/bin/python benchmarks/mooncake_peer.py \\
        --size 2097152 --count 16 --reps 3

It starts, on free loopback ports, a ``mooncake_master`` that serves the metadata itself
(``--enable_http_metadata_server=true``, no etcd) and, with ``--segment remote`` (the default),
a ``mooncake_client`` process that mounts the store's memory (``--segment-bytes``): the values
live in another process, as they do in Redis. ``--segment local`` mounts it in this process
instead, as a single vLLM worker's ``MooncakeStoreConnector`` does; a get is then a copy inside
one process. The measuring client (``MooncakeDistributedStore.setup``, protocol ``tcp``)
registers one source and one destination buffer (``register_buffer``) and uses the zero-copy
batch calls: ``batch_put_from`` of ``--count`` values of ``--size`` bytes under fresh keys,
then ``batch_get_into`` of them into the destination buffer, each timed as a whole.

After ``--warmup`` untimed repetitions (default 1), each repetition fills the source buffer
with fresh random bytes (untimed), puts, gets, checks every status code and compares every byte
got with what was put, then removes its keys (``batch_remove``, forced past their lease).

Prints one JSON line on stdout: ``client`` (``mooncake``), ``size``, ``count``, ``put_s`` and
``get_s`` (seconds per repetition), ``mooncake_version`` and ``segment``. Everything else, the
servers' logs included, goes to stderr. A wrong or missing value, a failed call or a server
that does not come up ends it with exit status 1 and a one-line message; the servers it
started are stopped either way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_DIST = "mooncake-transfer-engine-non-cuda"
_HOST = "127.0.0.1"
_LOCAL_BUFFER_BYTES = 16 << 20  # the client's staging buffer; the zero-copy calls bypass it
_START_TIMEOUT_S = 20.0
_MESSAGE_CHARS = 200


class BenchError(Exception):
    """A value came back missing or wrong, a call failed, or a server did not come up."""


@dataclass(frozen=True)
class Servers:
    """Where the measuring client finds the master and its metadata."""

    master: str  # host:port of the master's RPC service
    metadata: str  # URL of the master's HTTP metadata server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with status {proc.returncode} (its log is above)")
        with socket.socket() as s:
            if s.connect_ex((_HOST, port)) == 0:
                return
        time.sleep(0.05)
    raise BenchError(f"{what} did not listen on {_HOST}:{port} in {_START_TIMEOUT_S:g} s")


def _binary(name: str) -> str:
    """A Mooncake binary installed beside this interpreter."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise BenchError(f"{path} not found: is {_DIST} installed in this venv?")
    return str(path)


@contextlib.contextmanager
def _servers(segment: str, segment_bytes: int) -> Iterator[Servers]:
    """A ``mooncake_master`` (metadata served over HTTP by the master) and, for a remote
    segment, a ``mooncake_client`` holding ``segment_bytes``; both stopped on exit."""
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    servers = Servers(master=f"{_HOST}:{rpc}", metadata=f"http://{_HOST}:{http}/metadata")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        master = [
            _binary("mooncake_master"), "--enable_http_metadata_server=true",
            f"--rpc_address={_HOST}", f"--rpc_port={rpc}",
            f"--http_metadata_server_host={_HOST}", f"--http_metadata_server_port={http}",
            f"--metrics_port={metrics}", "--enable_metric_reporting=false",
        ]  # fmt: skip
        procs.append(subprocess.Popen(master, stdout=sys.stderr, stderr=sys.stderr))
        _wait_listening(rpc, procs[-1], "mooncake_master")
        _wait_listening(http, procs[-1], "mooncake_master's metadata server")
        if segment == "remote":
            port = _free_port()
            holder = [
                _binary("mooncake_client"), f"--host={_HOST}", f"--port={port}",
                f"--master_server_address={servers.master}",
                f"--metadata_server={servers.metadata}", "--protocol=tcp",
                f"--global_segment_size={segment_bytes}", "--local_buffer_size=0",
            ]  # fmt: skip
            procs.append(subprocess.Popen(holder, stdout=sys.stderr, stderr=sys.stderr))
            _wait_listening(port, procs[-1], "mooncake_client")
        yield servers
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class MooncakeClient:
    """One ``MooncakeDistributedStore`` with a registered source and destination buffer of
    ``count`` values of ``size`` bytes each."""

    def __init__(self, servers: Servers, size: int, count: int, segment_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.size = size
        self.count = count
        self.store = MooncakeDistributedStore()
        status = self.store.setup(
            _HOST,
            servers.metadata,
            segment_bytes,  # 0 with a remote segment: this client stores nothing itself
            _LOCAL_BUFFER_BYTES,
            "tcp",
            "",
            servers.master,
        )
        if status != 0:
            raise BenchError(f"MooncakeDistributedStore.setup returned {status}")
        self.src = np.zeros(size * count, dtype=np.uint8)
        self.dst = np.zeros(size * count, dtype=np.uint8)
        for name, array in (("source", self.src), ("destination", self.dst)):
            status = self.store.register_buffer(array.ctypes.data, array.nbytes)
            if status != 0:
                raise BenchError(f"register_buffer of the {name} buffer returned {status}")

    def _pointers(self, array: np.ndarray[Any, Any]) -> list[int]:
        return [array.ctypes.data + i * self.size for i in range(self.count)]

    def repetition(self, tag: str) -> tuple[float, float]:
        """Put ``count`` fresh values under fresh keys, get them back, check them, remove
        them; the put's and the get's seconds."""
        self.src[:] = np.frombuffer(os.urandom(self.src.nbytes), dtype=np.uint8)
        self.dst[:] = 0
        keys = [f"{tag}:{i}" for i in range(self.count)]
        sizes = [self.size] * self.count
        start = time.perf_counter()
        put = self.store.batch_put_from(keys, self._pointers(self.src), sizes)
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        got = self.store.batch_get_into(keys, self._pointers(self.dst), sizes)
        get_s = time.perf_counter() - start
        try:
            self._check(put, got)
        finally:
            self.store.batch_remove(keys, True)  # force: past the values' read lease
        return put_s, get_s

    def _check(self, put: list[int], got: list[int]) -> None:
        for i, status in enumerate(put):
            if status != 0:
                raise BenchError(f"value {i}: batch_put_from returned {status}")
        for i, status in enumerate(got):
            if status != self.size:
                raise BenchError(f"value {i}: batch_get_into returned {status}, not {self.size}")
        if np.array_equal(self.src, self.dst):
            return
        offset = int(np.flatnonzero(self.src != self.dst)[0])
        raise BenchError(
            f"value {offset // self.size}: differs from what was put at byte {offset % self.size}"
        )

    def close(self) -> None:
        self.store.close()


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    local_bytes = args.segment_bytes if args.segment == "local" else 0
    with _servers(args.segment, args.segment_bytes) as servers:
        client = MooncakeClient(servers, args.size, args.count, local_bytes)
        try:
            put_s: list[float] = []
            get_s: list[float] = []
            for rep in range(args.warmup + args.reps):
                put, get = client.repetition(f"hma:bench-mc-{os.getpid()}:r{rep}")
                if rep >= args.warmup:  # the first ones open connections, touch fresh memory
                    put_s.append(put)
                    get_s.append(get)
        finally:
            client.close()
    return {
        "client": "mooncake",
        "size": args.size,
        "count": args.count,
        "put_s": put_s,
        "get_s": get_s,
        "mooncake_version": importlib.metadata.version(_DIST),
        "segment": args.segment,
    }


def _one_line(text: str) -> str:
    text = "".join(c if c.isascii() and c.isprintable() else "?" for c in " ".join(text.split()))
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, required=True, help="bytes per value")
    parser.add_argument("--count", type=int, required=True, help="values per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument(
        "--segment",
        choices=("remote", "local"),
        default="remote",
        help="remote: a mooncake_client process holds the values (default); local: this one",
    )
    parser.add_argument(
        "--segment-bytes",
        type=int,
        default=1 << 30,
        help="bytes of the store's memory segment (default 1 GiB)",
    )
    args = parser.parse_args()
    if min(args.size, args.count, args.reps) <= 0 or args.warmup < 0:
        parser.error("--size, --count and --reps must be positive, --warmup not negative")
    if args.segment_bytes < 2 * args.size * args.count:
        parser.error("--segment-bytes must hold two repetitions' worth of values")
    return args


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", _HOST)  # read by the transfer engine
    # Keep stdout for the one JSON line; anything else written to it, native code's included,
    # goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    status = 1
    try:
        out.write(json.dumps(_measure(args)) + "\n")
        status = 0
    except BenchError as exc:
        print(f"mooncake_peer: {exc}", file=sys.stderr)
    except Exception as exc:
        print(f"mooncake_peer: {_one_line(f'{type(exc).__name__}: {exc}')}", file=sys.stderr)
    out.flush()
    sys.stderr.flush()
    # Not a normal exit: the store's native threads may outlive close(); the servers it
    # started were stopped above.
    os._exit(status)


if __name__ == "__main__":
    main()
