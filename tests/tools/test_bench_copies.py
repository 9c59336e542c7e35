"""The bench's copy counter (hma_redis/tools/bench/_copycount.c, preloaded, read by
copies.py): a process started with it counts the bytes every thread copies and moves through
the kernel during a span, and nothing before or after; ``hma-redis bench --syscalls`` starts
itself again with it and prints what each client copies per payload byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hma_redis.core.redis import wire
from hma_redis.tools.bench import copies

COPIED = 3_000_000  # bytes the span copies (bytes() of a bytearray: one memcpy)
SENT = 200_000  # bytes the span sends over a socket pair and receives back

CHILD = f"""
import json, os, socket, sys, threading
sys.path.insert(0, {str(Path(copies.__file__).parent)!r})
import copies
counter = copies.CopyCounter.attached()
source = bytearray({COPIED})
before = bytes(source)  # not counted: before the span
left, right = socket.socketpair()
counter.begin()

def work():
    copied = bytes(source)
    left.sendall(b"x" * {SENT})
    got = 0
    while got < {SENT}:
        got += len(right.recv(65536))

worker = threading.Thread(target=work)
worker.start()
worker.join()
totals = counter.end()
after = bytes(source)  # not counted either
print(json.dumps({{"totals": totals, "preload": os.environ.get("LD_PRELOAD", ""),
                   "counters": os.environ.get(copies.COUNTERS_ENV)}}))
"""


def _library() -> Path:
    library = copies.library_path()
    if library is None:
        pytest.fail(
            "the bench's copy counter was not built (pip install -e . builds it with the "
            "system C compiler: apt-get install -y gcc python3-dev)",
            pytrace=False,
        )
    return library


def test_a_span_counts_the_copies_and_kernel_bytes_of_every_thread_and_only_the_span() -> None:
    env = copies.preload_env(dict(os.environ), _library(), copies.new_counters_file())
    counters = env[copies.COUNTERS_ENV]
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        if os.path.exists(counters):
            os.unlink(counters)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    totals = result["totals"]
    # One copy of COPIED bytes and the b"x" * SENT build; the rest is the interpreter's small
    # copies while the thread starts and stops.
    assert COPIED <= totals["copied"] < COPIED + SENT + 100_000, totals
    assert totals["kernel_out"] == SENT and totals["kernel_in"] == SENT, totals
    # Neither the preload nor the counters' file reach what the counted process starts.
    assert "_copycount" not in result["preload"] and result["counters"] is None


def test_a_process_started_without_the_counter_has_none() -> None:
    env = {k: v for k, v in os.environ.items() if k != copies.COUNTERS_ENV}
    code = "from hma_redis.tools.bench import copies; print(copies.CopyCounter.attached())"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"


def test_bench_syscalls_prints_what_each_client_copies_per_payload_byte() -> None:
    """The command line a user runs: it starts itself again with the counter preloaded. The
    worker's stores send from the KV cache's pages (no copy of a payload byte in user space)
    and its loads land in them: a load copies only what its read buffer took past a reply's
    line (at most its 64 KiB per reply: the next reply's line and the first bytes of the next
    value or piece), never the job through a buffer; redis-py copies every payload byte at
    least once more."""
    _library()
    hma = Path(sys.executable).with_name("hma-redis")
    proc = subprocess.run(
        [str(hma), "--json", "bench", "--smoke", "--syscalls"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert "bytes per payload byte" in proc.stderr
    job = report["plan"]["job_bytes"]
    for size in report["plan"]["sizes"]:
        for op in ("load", "store"):
            ours = report["copies"][f"hma_redis {op} {size}"]
            plain = report["copies"][f"redis-py {op} {size}"]
            # Every payload byte crosses the kernel once (plus commands, replies, headers).
            assert job <= ours["kernel_in"] + ours["kernel_out"] < 1.05 * job, (op, size, ours)
            assert plain["copied"] >= job, (op, size, plain)
            if op == "store":
                assert ours["copied"] < 0.01 * job, (op, size, ours)
                continue
            replies = report["median_cost"][f"hma_redis {op} {size}"]["commands"]
            read_buffer = replies * (wire.MAX_REPLY_LINE + 16 * 1024)  # the buffer, heads, lines
            assert ours["copied"] < min(read_buffer, job // 2), (op, size, replies, ours)


def test_a_preload_the_loader_refuses_is_not_tried_again(tmp_path: Path) -> None:
    """The process started again finds no counter (the loader ignored the library): it runs on
    without one instead of starting itself over and over."""
    broken = tmp_path / "_copycount-broken.so"
    broken.write_bytes(b"not a library")
    code = (
        "from hma_redis.tools.bench import copies\n"
        "copies.reexec_preloaded()\n"
        "print('ran on:', copies.CopyCounter.attached())\n"
    )
    env = copies.preload_env(dict(os.environ), broken, copies.new_counters_file())
    counters = env[copies.COUNTERS_ENV]
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran on: None"
    assert not os.path.exists(counters)  # removed by attached(), counter or not


def test_a_counters_file_too_short_leaves_the_process_uncounted_not_crashed(
    tmp_path: Path,
) -> None:
    """A counters file shorter than the counters (empty, here) would fault on the first count
    if mapped: the library leaves it alone and the process runs as without it."""
    short = tmp_path / "short.bin"
    short.write_bytes(b"")
    env = copies.preload_env(dict(os.environ), _library(), str(short))
    code = "import mmap, struct; print(len(bytes(bytearray(1 << 20))))"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(1 << 20)
    assert short.read_bytes() == b""
