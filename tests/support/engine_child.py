"""The engine fork server of the tests: ``python -m tests.support.engine_child --serve``.

It imports torch and vLLM once (most of an engine's start-up time on a small CPU), then for each
job line on stdin forks a fresh child that runs the job with
:func:`hma_redis.tools.devkit.engine.run_job` (the one engine process of the demo, benchmarks
and tests), its stdout/stderr sent to the files the request names. The server never builds an
engine itself, so each forked child is a new vLLM instance; it only skips the interpreter start
and the imports. A run without the fork server is ``python -m hma_redis.tools.devkit.engine``.

A request with ``connect`` (a loopback port) starts a long-lived engine instead (the fault
fuzz's and the soak's, :mod:`tests.support.fuzz_child`): the child connects to that port and
serves requests over the connection until it closes, and the server answers with its pid at
once, without waiting for it (it reaps such children as it goes).

Not a test module (pytest does not collect it).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from hma_redis.tools.devkit.engine import emit_result, run_job

READY_LINE = "@@HMA_FORKSERVER_READY@@"

# What the fork server imports before forking: the slow part of an engine's start-up. Only
# libraries, nothing that builds state for an engine (none of hma_redis' tier, whose modules
# read the environment: children import it fresh).
PRELOAD = (
    "torch",
    "transformers",
    "vllm",
    "vllm.config",
    "vllm.inputs",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.gemma3",
)


def run_forked(request: dict[str, Any]) -> None:
    """In the forked child: redirect stdio, take the job's environment, run it, exit."""
    code = 1
    try:
        # A long-lived engine's connection first: its parent waits for it.
        conn = None
        if "connect" in request:
            conn = socket.create_connection(("127.0.0.1", request["connect"]))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["stdout_path"]), (2, request["stderr_path"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request.get("cwd") or os.getcwd())
        if request.get("salted"):
            from tests.support.salt_child import install_salt

            install_salt()
        if conn is None:
            emit_result(run_job(request["job"]))
        else:
            from tests.support.fuzz_child import serve_job

            # (left open: the exit closes it after a traceback is in the log)
            serve_job(request["job"], conn.makefile("r"), conn.makefile("w"))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # What a normal interpreter exit does, in order: wait for non-daemon threads, run atexit
        # handlers, flush. (A forked child must not return into the server's loop.)
        try:
            for t in threading.enumerate():
                if t is not threading.current_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
            code = code or 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve() -> int:
    """Fork server loop: one JSON request per stdin line, two reply lines per request."""
    t0 = time.monotonic()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a child imports it again and reports the real error
            sys.stderr.write(f"fork server: preloading {name} failed: {exc!r}\n")

    sys.stderr.write(f"fork server imports took {time.monotonic() - t0:.1f}s\n")
    sys.stderr.flush()
    reply = sys.stdout
    reply.write(READY_LINE + "\n")
    reply.flush()
    detached: set[int] = set()  # long-lived engines, reaped once they have exited
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_forked(request)  # never returns
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        if "connect" in request:
            detached.add(pid)
        else:
            _, status = os.waitpid(pid, 0)
            reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
            reply.flush()
        for child in list(detached):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(child, os.WNOHANG)[0] == 0:
                    continue
            detached.discard(child)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python -m tests.support.engine_child --serve")
    sys.exit(serve())
