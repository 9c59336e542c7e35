"""What an idle engine step may assume about requests arriving while it sleeps
(:mod:`hma_redis.adapter.arrivals`), found from the calling frames against vLLM's own engine
core classes (instances made without their engine: only their type and input queue are read).
The wait that ends when a request arrives: tests/core/transfer/test_counts_waits_shutdown.py;
in engines: test_sharing (in-process) and test_metrics_serve (``vllm serve``)."""

from __future__ import annotations

import queue
from collections.abc import Callable

from vllm.v1.engine.core import EngineCore, EngineCoreProc

from hma_redis.adapter import arrivals


def _step_of(core: object) -> Callable[[], arrivals.Arrivals]:
    """A call made from inside ``core``'s step, through a frame of another object, as the
    connector's hook is called from vLLM's EngineCore.step through the executor and worker."""

    class Worker:
        def execute_model(self) -> arrivals.Arrivals:
            return arrivals.arrivals_here()

    def step(self: object) -> arrivals.Arrivals:
        return Worker().execute_model()

    return lambda: step(core)


def test_an_in_process_engine_core_lets_idle_steps_sleep_until_the_load_ends() -> None:
    found = _step_of(object.__new__(EngineCore))()
    assert found.kind == "in-process"
    assert "no request arrives during a step" in found.describe()


def test_the_engine_core_process_input_queue_is_watched() -> None:
    core = object.__new__(EngineCoreProc)
    core.input_queue = queue.Queue()
    found = _step_of(core)()
    assert found.kind == "watched" and found.arrived is not None
    assert not found.arrived()
    core.input_queue.put_nowait(("ADD", None))
    assert found.arrived()


def test_without_an_engine_core_above_it_the_worker_keeps_idle_wait_ms() -> None:
    assert arrivals.arrivals_here() is arrivals.UNSEEN
    core = object.__new__(EngineCoreProc)  # no input_queue: a vLLM that renamed it
    assert _step_of(core)().kind == "unseen"
    assert "idle_wait_ms bounds each idle step" in arrivals.UNSEEN.describe()
