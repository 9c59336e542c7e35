"""Whether a request can reach vLLM's engine core while a step waits for a load, and how to see one.

An engine step that schedules nothing (a request waits for its KV, nothing else runs) sleeps on
the worker until a running load finishes (:meth:`RedisOffloadingWorker.wait_while_idle`), so
vLLM's step loop does not spin on a core the transfer needs. A request that reaches the engine
core meanwhile is scheduled only when that step ends. How long a step may sleep depends on what
the worker can see of the engine core that called it, found once from the calling frames:

- **in-process engine core** (``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
  plain ``EngineCore``, driven by the caller's thread between steps): no request can arrive
  during a step, so the step sleeps until a load finishes (:data:`WATCHED_WAIT_S` at most);
- **engine core process with the worker in it** (``EngineCoreProc`` with the one-process
  executor, vLLM's default on one GPU): new requests land in its ``input_queue``, which the
  sleep looks at every :data:`ARRIVAL_CHECK_S`, so a new request waits at most that long;
- **anything else** (the worker in a process of its own: the multiprocess executor, tensor
  parallel, vLLM's CPU build when it runs in processes): the sleep is bounded by
  ``idle_wait_ms`` alone, which is also the most a new request waits there.

Only vLLM's own classes are recognised (``isinstance`` against ``vllm.v1.engine.core``), and a
version that has moved them falls back to the last case.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

# The longest one idle step sleeps where arrivals are watched or cannot happen: the step
# returns the moment a load finishes, so this only bounds how long a lost wake-up could cost.
WATCHED_WAIT_S = 0.1
# How often a watched sleep looks for a request that reached the engine core.
ARRIVAL_CHECK_S = 0.001
# Frames searched above the caller for the engine core's step (vLLM's call chain from
# EngineCore.step to the connector is about a dozen frames deep).
_MAX_FRAMES = 64


@dataclass(frozen=True)
class Arrivals:
    """What an idle step may assume about requests arriving while it sleeps."""

    kind: str  # "in-process", "watched" or "unseen"
    arrived: Callable[[], bool] | None = None  # "watched": whether a request is waiting

    def describe(self) -> str:
        if self.kind == "in-process":
            return "in-process engine core: no request arrives during a step"
        if self.kind == "watched":
            return (
                "the engine core's input queue is watched every "
                f"{ARRIVAL_CHECK_S * 1e3:g} ms: a new request waits at most that long"
            )
        return "the engine core is in another process: idle_wait_ms bounds each idle step"


UNSEEN = Arrivals("unseen")


def _engine_core_classes() -> tuple[type, type] | None:
    try:
        from vllm.v1.engine.core import EngineCore, EngineCoreProc
    except Exception:  # a vLLM that moved them: the worker keeps idle_wait_ms
        return None
    return EngineCore, EngineCoreProc


def _nonempty(inputs: queue.Queue[object]) -> Callable[[], bool]:
    return lambda: inputs.qsize() > 0


def arrivals_of(frame: FrameType | None) -> Arrivals:
    """What the engine core whose step runs ``frame`` (or a frame above it) lets an idle step
    assume: the first vLLM engine core found as ``self`` of a calling frame decides."""
    classes = _engine_core_classes()
    if classes is None:
        return UNSEEN
    core_cls, proc_cls = classes
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, core_cls):
            if not isinstance(owner, proc_cls):
                return Arrivals("in-process")
            inputs = getattr(owner, "input_queue", None)
            if isinstance(inputs, queue.Queue):
                return Arrivals("watched", _nonempty(inputs))
            return UNSEEN
        frame = frame.f_back
    return UNSEEN


def arrivals_here() -> Arrivals:
    """:func:`arrivals_of` the caller's frame."""
    return arrivals_of(sys._getframe(1))
