"""The bench's system-call counter (hma_redis/tools/bench/syscalls.py): a real ``strace -c -f``
attached to this process counts what a span's threads called, and nothing from before or
after the span."""

from __future__ import annotations

import shutil
import socket
import threading

import pytest

from hma_redis.tools.bench.syscalls import COUNTED, SyscallCounter, parse_summary

SENDS = 25


def _counter() -> SyscallCounter:
    if shutil.which("strace") is None:
        pytest.fail("strace is not installed (Debian: apt-get install -y strace)", pytrace=False)
    return SyscallCounter()


def test_a_span_counts_every_thread_and_only_the_span() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"before the span")  # not counted
        right.recv(100)
        counter = _counter()
        counter.begin()

        def send() -> None:
            for _ in range(SENDS):
                left.send(b"x")

        sender = threading.Thread(target=send)
        sender.start()
        sender.join()
        counts = counter.end()
        left.sendall(b"after the span")  # not counted either
    sends = counts["sendto"] + counts["sendmsg"] + counts["write"]
    assert sends == SENDS, counts
    assert set(counts) == {*COUNTED, "other"}


def test_the_summary_parser_reads_rows_with_and_without_errors() -> None:
    text = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 60.00    0.000600          20        30           recvfrom
 30.00    0.000300          10        30         4 futex
 10.00    0.000100           5        20           openat
------ ----------- ----------- --------- --------- ----------------
100.00    0.001000          12        80         4 total
"""
    counts = parse_summary(text)
    assert counts["recvfrom"] == 30 and counts["futex"] == 30 and counts["other"] == 20
    assert sum(counts.values()) == 80
