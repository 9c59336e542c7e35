"""A vLLM logits processor that holds an engine between two steps until the test lets it go.

Some engine tests need something to happen *while the engine still steps* (a value expiring in
Redis, for example) and must not rely on how long a decode takes on the machine that runs
them. Passed as ``llm_kwargs={"logits_processors": [QUALNAME]}`` with ``extra_env={ENV: path}``:
from the ``HOLD_AT_STEP``-th step on, each step waits while ``path`` exists (at most
``MAX_HOLD_S`` in all), so the test creates the file before the run and removes it once what it
waits for has happened; the steps after that run as usual. When it starts holding it creates
``path + ".held"``, so that the test can tell the hold took place. It never changes a logit.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

if TYPE_CHECKING:
    from vllm.config import VllmConfig

QUALNAME = "tests.support.step_hold:HoldWhileFileExists"
ENV = "HMA_TEST_HOLD_FILE"
HOLD_AT_STEP = int(os.environ.get("HMA_TEST_HOLD_AT_STEP", "200"))
MAX_HOLD_S = 120.0


class HoldWhileFileExists(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._path = os.environ.get(ENV, "")
        self._steps = 0
        self._held_s = 0.0

    def is_argmax_invariant(self) -> bool:
        return False  # so that vLLM calls it on greedy batches too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self._steps += 1
        if not self._path or self._steps < HOLD_AT_STEP:
            return
        if self._held_s == 0.0 and os.path.exists(self._path):
            open(self._path + ".held", "w").close()
        start = time.monotonic()
        while os.path.exists(self._path) and self._held_s + time.monotonic() - start < MAX_HOLD_S:
            time.sleep(0.02)
        self._held_s += time.monotonic() - start

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
