"""Run a vLLM engine in a fresh subprocess (one call = one separate vLLM instance).

``run_engine`` runs a JSON job in the engine process of :mod:`hma_redis.tools.devkit.engine` and
parses the one result line it prints. Every call is a new process with a new engine, so the
engine's own prefix cache starts empty and a shared external KV tier is the only thing two runs
have in common.

Start-up on a 2-core CPU is dominated by importing torch + vLLM (~15-25 s of a ~35 s run). By
default the new process is therefore forked from a *fork server* (:mod:`tests.support.engine_child`)
that has done those imports once and never builds an engine itself: each run is still its own
process and its own vLLM instance, it just starts with the modules already loaded (~8 s per run).
Set ``HMA_ENGINE_FORKSERVER=0`` (or pass ``fresh_interpreter=True``) for a new interpreter per run.
A run whose environment differs from the server's in variables that take effect at interpreter
start or import time (``PYTHON*``, ``VLLM_LOGGING_*``, ``LD_*``, ``OMP_*``, ...) gets its own
fork server started with that environment, so ``extra_env`` always behaves as for a fresh process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hma_redis.tools.devkit.engine import (
    CPU_ENGINE_ENV,
    IN_PROCESS_ENGINE_ENV,
    EngineProcessError,
    ProcessOutput,
    parse_result,
    run_engine_process,
)
from tests.support.engine_child import READY_LINE

REPO_ROOT = str(Path(__file__).resolve().parents[2])
STDERR_TAIL_CHARS = 3000
FORKSERVER_START_TIMEOUT_S = 300.0

# The CPU engine defaults, plus what makes test runs reproducible and their stdout parseable.
DEFAULT_ENV: dict[str, str] = {
    **CPU_ENGINE_ENV,
    **IN_PROCESS_ENGINE_ENV,
    "PYTHONHASHSEED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM logs to stdout by default; keep stdout for the result line only.
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}

# Variables read at interpreter start or while importing torch/vLLM: a forked child cannot change
# them, so runs that differ in any of them use a fork server started with their values.
_IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "VLLM_LOGGING",
    "VLLM_CONFIGURE_LOGGING",
    "LD_",
    "OMP_",
    "KMP_",
    "MKL_",
    "TORCH",
    "CUDA",
    "HF_",
    "TRANSFORMERS",
)

# Token ids below this are special in the tiny models (pad/eos/bos); prompts avoid them.
FIRST_PLAIN_TOKEN = 4


class EngineFailed(AssertionError):
    """A vLLM child failed, timed out or printed no result (an assertion of the test that ran
    it); ``stderr`` is its whole stderr."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


@dataclass
class PromptResult:
    token_ids: list[int]
    num_cached_tokens: int
    # First-token latency from RequestOutput.metrics (arrival → first token); falls back to the
    # wall time of the prompt's generate call when metrics are missing.
    ttft_s: float
    # Wall time of the whole generate call for this prompt (prefill + all decode steps).
    wall_s: float
    finish_reason: str | None = None


@dataclass
class KVCacheGroupInfo:
    spec: str
    block_size: int
    page_size_bytes: int
    sliding_window: int | None
    layers: list[str]


@dataclass
class EngineRun:
    results: list[PromptResult]
    stderr_tail: str  # last ~3000 chars of the child's stderr (vLLM's log goes there)
    startup_s: float  # LLM(...) constructor time inside the child
    shutdown_s: float
    process_s: float  # the child process, start (exec or fork) to exit
    block_size: int  # KV cache block size in tokens (cache_config.block_size)
    num_kv_cache_groups: int | None
    kv_cache_groups: list[KVCacheGroupInfo] = field(default_factory=list)
    num_gpu_blocks: int | None = None
    stderr: str = ""  # the child's whole stderr, for tests that look for log lines
    forked: bool = False  # started from the fork server

    @property
    def token_ids(self) -> list[list[int]]:
        return [r.token_ids for r in self.results]

    @property
    def num_cached_tokens(self) -> list[int]:
        return [r.num_cached_tokens for r in self.results]

    @property
    def ttft_s(self) -> list[float]:
        return [r.ttft_s for r in self.results]


def _tail(text: str, n: int = STDERR_TAIL_CHARS) -> str:
    return text[-n:]


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def child_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a child runs with: ours, then the defaults, then ``extra_env``."""
    env = dict(os.environ)
    env.update(DEFAULT_ENV)
    env.update(extra_env or {})
    # The child must import the same hma_redis / tests modules as the parent.
    parts = [REPO_ROOT, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env


def _import_time_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)))


class _ForkServer:
    """One ``python -m tests.support.engine_child --serve`` process; one job at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in close())
            prefix="hma-forkserver-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.engine_child", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=REPO_ROOT,
        )
        self._buf = b""
        line = self._read_line(FORKSERVER_START_TIMEOUT_S)
        if line != READY_LINE:
            self.close()
            raise AssertionError(
                f"engine fork server did not start (got {line!r}); log tail:\n{self.log_tail()}"
            )

    def log_tail(self) -> str:
        return _tail(Path(self.log.name).read_text(errors="replace"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read_line(self, timeout_s: float) -> str | None:
        """One reply line, or None on timeout / EOF."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def run(
        self, job: dict[str, Any], env: dict[str, str], timeout_s: float, **extra: Any
    ) -> tuple[int | None, str, str]:
        """Fork a child for ``job`` (``extra``: more fields of the request, e.g. ``salted``);
        return (exit code or None on timeout, stdout, stderr)."""
        with tempfile.TemporaryDirectory(prefix="hma-engine-") as tmp:
            out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            pid = self._fork(job, env, out_path, err_path, **extra)
            done = self._read_line(timeout_s)
            returncode: int | None
            if done is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # the child we forked for this job
                done = self._read_line(30.0)
                returncode = None
            else:
                returncode = int(json.loads(done)["returncode"])
            if done is None:
                self.close()  # out of step with its replies: never reuse it
            return returncode, _read_text(out_path), _read_text(err_path)

    def start(self, job: dict[str, Any], env: dict[str, str], port: int, log_path: str) -> int:
        """Fork a long-lived engine child (:mod:`tests.support.fuzz_child`) that connects to
        ``port`` on loopback and serves there, its stderr in ``log_path``; its pid, at once."""
        return self._fork(job, env, os.devnull, log_path, connect=port)

    def _fork(
        self, job: dict[str, Any], env: dict[str, str], out: str, err: str, **extra: Any
    ) -> int:
        """Send one request (the child's stdout and stderr go to ``out`` and ``err``); the
        forked child's pid."""
        assert self.proc.stdin is not None
        request = {
            "job": job,
            "env": env,
            "cwd": REPO_ROOT,
            "stdout_path": out,
            "stderr_path": err,
            **extra,
        }
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        started = self._read_line(30.0)
        if started is None:
            raise AssertionError(f"engine fork server died; log tail:\n{self.log_tail()}")
        return int(json.loads(started)["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


class _ForkServerPool:
    """Idle fork servers keyed by their import-time environment; one job per server at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[tuple[str, str], ...], list[_ForkServer]] = {}
        self._all: list[_ForkServer] = []
        atexit.register(self.close)

    def acquire(self, env: dict[str, str]) -> _ForkServer:
        key = _import_time_key(env)
        with self._lock:
            idle = self._idle.setdefault(key, [])
            while idle:
                server = idle.pop()
                if server.alive():
                    return server
        server = _ForkServer(env)
        with self._lock:
            self._all.append(server)
        return server

    def release(self, env: dict[str, str], server: _ForkServer) -> None:
        if not server.alive():
            return
        with self._lock:
            self._idle.setdefault(_import_time_key(env), []).append(server)

    def close(self) -> None:
        with self._lock:
            servers, self._all, self._idle = self._all, [], {}
        for server in servers:
            server.close()


_POOL = _ForkServerPool()


def use_forkserver(fresh_interpreter: bool | None) -> bool:
    if fresh_interpreter is not None:
        return not fresh_interpreter
    return os.environ.get("HMA_ENGINE_FORKSERVER", "1").lower() not in ("0", "false", "no")


def run_forked_job(
    job: dict[str, Any], env: dict[str, str], timeout_s: float, **extra: Any
) -> tuple[float, ProcessOutput]:
    """A :func:`hma_redis.tools.devkit.engine.run_job` job in a child forked from the fork
    server of ``env`` (a :func:`child_env`; the first call per environment starts one,
    ~15-25 s): when the fork was asked (``time.monotonic()``) and the child's output.
    ``extra``: more fields of the request (``salted=True``: the prompts carry ``cache_salt``,
    :mod:`tests.support.salt_child`)."""
    server = _POOL.acquire(env)
    try:
        asked = time.monotonic()
        return asked, ProcessOutput(*server.run(job, env, timeout_s, **extra))
    finally:
        _POOL.release(env, server)


def fork_long_lived(job: dict[str, Any], env: dict[str, str], port: int, log_path: str) -> int:
    """A long-lived engine (:mod:`tests.support.fuzz_child`'s ``serve_job``) forked from the
    fork server of ``env`` (a :func:`child_env`), serving on a connection to ``port``; its pid.
    The server answers at once: the caller waits for the connection and the ready line. One
    at a time, so that engines started together (the soak's) share one server rather than each
    starting its own."""
    with _LONG_LIVED_LOCK:
        server = _POOL.acquire(env)
        try:
            return server.start(job, env, port, log_path)
        finally:
            _POOL.release(env, server)


_LONG_LIVED_LOCK = threading.Lock()


def run_engine(
    model_dir: str,
    prompts: list[list[int]],
    max_tokens: int,
    kv_transfer_config: dict[str, Any] | None,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 600,
    block_size: int | None = None,
    reset_prefix_cache_between: bool = True,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    llm_kwargs: dict[str, Any] | None = None,
    fresh_interpreter: bool | None = None,
    kv_transfer_params: list[dict[str, Any] | None] | None = None,
) -> EngineRun:
    """Start one vLLM instance in a new process, run ``prompts`` one at a time, greedy.

    ``kv_transfer_config`` is passed as ``KVTransferConfig(**kv_transfer_config)``. With
    ``reset_prefix_cache_between`` the engine's own prefix cache is emptied before every prompt
    but the first, so any cached tokens must come from the KV connector. ``llm_kwargs`` are
    extra ``vllm.LLM`` arguments (they override the defaults). ``fresh_interpreter`` forces
    (True) or forbids (False) a new interpreter instead of a fork of the fork server; None
    follows ``HMA_ENGINE_FORKSERVER``. ``kv_transfer_params``: one dict (or None) per prompt,
    the request's ``kv_transfer_params``. Raises :class:`EngineFailed` (an ``AssertionError``)
    with the child's stderr tail when the child fails, times out or prints no result.
    """
    job = {
        "model": model_dir,
        "prompts": [[int(t) for t in p] for p in prompts],
        "max_tokens": max_tokens,
        "kv_transfer_config": kv_transfer_config,
        "block_size": block_size,
        "reset_prefix_cache_between": reset_prefix_cache_between,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "llm_kwargs": llm_kwargs or {},
        "kv_transfer_params": kv_transfer_params,
    }
    env = child_env(extra_env)
    forked = use_forkserver(fresh_interpreter)

    t0 = time.monotonic()
    if forked:
        t0, out = run_forked_job(job, env, timeout_s)
    else:
        out = run_engine_process(job, env, timeout_s, cwd=REPO_ROOT)
    process_s = time.monotonic() - t0
    try:
        payload = parse_result(out, timeout_s)
    except EngineProcessError as exc:
        raise EngineFailed(str(exc), exc.stderr) from None
    stderr = out.stderr
    kv = payload["kv_cache"]
    return EngineRun(
        results=[PromptResult(**r) for r in payload["results"]],
        stderr_tail=_tail(stderr),
        startup_s=float(payload["startup_s"]),
        shutdown_s=float(payload["shutdown_s"]),
        process_s=process_s,
        block_size=int(payload["block_size"]),
        num_kv_cache_groups=kv["num_groups"],
        kv_cache_groups=[KVCacheGroupInfo(**g) for g in kv["groups"]],
        num_gpu_blocks=kv["num_blocks"],
        stderr=stderr,
        forked=forked,
    )


def run_engines(
    jobs: list[dict[str, Any]], max_parallel: int | None = None, **common: Any
) -> list[EngineRun]:
    """Several independent ``run_engine`` calls, at most ``max_parallel`` at a time.

    Each job is a dict of ``run_engine`` keyword arguments, merged over ``common``. Results come
    back in job order. Only for runs that do not depend on each other: a tier test that stores
    in one instance and loads in the next must call ``run_engine`` in sequence. ``max_parallel``
    defaults to ``HMA_ENGINE_PARALLEL`` or 1 (on 2 cores running engines side by side saves
    little; each parallel slot also costs its own fork server).
    """
    if max_parallel is None:
        max_parallel = int(os.environ.get("HMA_ENGINE_PARALLEL", "1"))
    merged = [{**common, **job} for job in jobs]
    if max_parallel <= 1 or len(merged) <= 1:
        return [run_engine(**kw) for kw in merged]
    with ThreadPoolExecutor(max_workers=max_parallel) as pool:
        futures = [pool.submit(run_engine, **kw) for kw in merged]
        return [f.result() for f in futures]


def make_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` independent random prompts of ``length`` tokens in ``[4, vocab)``."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(
    seed: int, n: int, prefix_len: int, suffix_len: int, vocab: int
) -> list[list[int]]:
    """``n`` prompts that share their first ``prefix_len`` tokens and differ after it.

    Each suffix starts with a token different from every other prompt's first suffix token, so
    the prompts share exactly ``prefix_len`` tokens (requires ``n <= vocab - 4`` when
    ``suffix_len > 0``).
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(prefix_len)]
    if suffix_len <= 0:
        return [list(prefix) for _ in range(n)]
    prompts: list[list[int]] = []
    for first in rng.sample(range(FIRST_PLAIN_TOKEN, vocab), n):
        rest = [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(suffix_len - 1)]
        prompts.append([*prefix, first, *rest])
    return prompts
