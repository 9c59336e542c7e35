"""One vLLM instance without a model: the real loop between scheduler and worker, in seconds.

vLLM's ``Scheduler`` runs with ``RedisOffloadingConnector`` on its side; a second
``RedisOffloadingConnector`` in the worker role owns CPU KV-cache tensors, as a GPU worker owns
its KV cache. Each :meth:`ConnectorHarness.step` does what an engine step does with a connector
(``vllm/v1/worker/kv_connector_model_runner_mixin.py``): schedule, hand the metadata to the
worker connector, run the "forward", start the loads, queue the stores, collect the transfer
results and feed them back to the scheduler. Only the model is missing: its forward writes, into
every KV block it completes, bytes derived from the block's hash and group
(:func:`page_pattern`), so a load can be checked page by page (:attr:`StepRecord.bad_pages`).

Layout (shared with ``scheduler_harness``): 16-token blocks, one block per chunk, three KV cache
groups (full attention, sliding window of ``sliding_window_blocks``, full attention).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hma_redis.adapter.connector import RedisOffloadingConnector
from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.spec import RedisOffloadingSpec
from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.core.keys import KeySpace
from tests.support.scheduler_harness import (
    HEAD_SIZE,
    make_request,
    make_vllm_config,
    three_group_kv_cache_config,
)

BLOCK_SIZE = 16
SAMPLED_TOKEN = 7
# Between steps (the model forward's time): lets a lookup batch or a transfer land.
STEP_PAUSE_S = 0.01


def page_pattern(block_hash: bytes, group: int, nbytes: int) -> torch.Tensor:
    """The bytes the fake forward writes into a block: a function of what the block holds."""
    digest = hashlib.shake_256(bytes(block_hash) + bytes([group])).digest(nbytes)
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


@dataclass
class StepRecord:
    output: SchedulerOutput
    scheduled: dict[str, int]  # req_id -> tokens computed this step
    load_jobs: dict[int, TransferJob]
    store_jobs: dict[int, TransferJob]
    finished_recving: set[str]
    failed_recving: set[str]
    # What the worker connector's get_transfer_results returned, as it returned it.
    transfer_results: KVConnectorTransferResults
    # (req_id, group, block index) of loaded blocks whose bytes are not the computed ones.
    bad_pages: list[tuple[str, int, int]] = field(default_factory=list)


class ConnectorHarness:
    """A Scheduler + RedisOffloadingConnector (both roles) over CPU KV tensors and a real Redis."""

    def __init__(
        self,
        redis_url: str,
        model_dir: str,
        *,
        num_blocks: int = 256,
        sliding_window_blocks: int = 3,
        kv_load_failure_policy: Literal["recompute", "fail"] = "recompute",
        extra_config: dict[str, object] | None = None,
    ) -> None:
        self.vllm_config = make_vllm_config(
            model_dir,
            redis_url,
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            extra_config=extra_config,
            kv_load_failure_policy=kv_load_failure_policy,
        )
        self.kv_cache_config = three_group_kv_cache_config(
            BLOCK_SIZE, num_blocks, sliding_window_blocks
        )
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, RedisOffloadingConnector), type(connector)
        manager = connector.scheduler.manager
        assert isinstance(manager, RedisOffloadingManager), type(manager)
        self.manager = manager

        # The worker process' side: vLLM builds it inside the config context.
        with set_current_vllm_config(self.vllm_config):
            self.worker = RedisOffloadingConnector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
        self.kv_caches = {
            name: torch.zeros(num_blocks, 2, BLOCK_SIZE, 1, HEAD_SIZE, dtype=torch.float32)
            for group in self.kv_cache_config.kv_cache_groups
            for name in group.layer_names
        }
        self.worker.register_kv_caches(self.kv_caches)
        connector_worker = self.worker.connector_worker
        assert connector_worker is not None
        spec = connector_worker.spec
        assert isinstance(spec, RedisOffloadingSpec)
        self.keyspace: KeySpace = spec.keyspace

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.requests: dict[str, Request] = {}
        self.load_jobs_of: dict[str, list[TransferJob]] = {}
        self._loads_in_flight: dict[str, TransferJob] = {}
        self._closed = False

    # ------------------------------------------------------------------ requests

    def add_request(
        self, token_ids: list[int], max_tokens: int = 1, cache_salt: str | None = None
    ) -> Request:
        req = make_request(token_ids, max_tokens, self._block_hasher, cache_salt)
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        self.load_jobs_of[req.request_id] = []
        return req

    def redis_key(self, req: Request, group: int, block: int) -> str:
        """The Redis key of block ``block`` (= chunk) of ``group`` of ``req``."""
        return self.keyspace.block_key(group, bytes(req.block_hashes[block]))

    # ------------------------------------------------------------------ driving

    def step(self) -> StepRecord:
        """One engine step, the worker connector's calls in the model runner's order."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata), type(meta)
        load_jobs, store_jobs = dict(meta.load_jobs), dict(meta.store_jobs)
        for job in load_jobs.values():
            self.load_jobs_of[job.req_id].append(job)
            self._loads_in_flight[job.req_id] = job

        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self._forward(output)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]  # (unused by this connector)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(output.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=set(results.failed_recving),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()

        record = StepRecord(
            output=output,
            scheduled=dict(output.num_scheduled_tokens),
            load_jobs=load_jobs,
            store_jobs=store_jobs,
            finished_recving=set(results.finished_recving),
            failed_recving=set(results.failed_recving),
            transfer_results=results,
        )
        for req_id in record.finished_recving - record.failed_recving:
            record.bad_pages += self._check_loaded(self._loads_in_flight.pop(req_id))
        req_ids = list(record.scheduled)
        self.scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=[[SAMPLED_TOKEN] for _ in req_ids],
                kv_connector_output=kv_output,
            ),
        )
        time.sleep(STEP_PAUSE_S)
        return record

    def run(self, max_steps: int = 100) -> list[StepRecord]:
        """Step until every request has finished and every transfer job is done."""
        steps: list[StepRecord] = []
        for _ in range(max_steps):
            steps.append(self.step())
            done = all(r.is_finished() for r in self.requests.values())
            connector = self.scheduler.connector
            assert connector is not None
            if done and not connector.has_pending_push_work():
                return steps
        raise AssertionError(
            f"not done after {max_steps} steps: "
            f"{ {rid: r.status.name for rid, r in self.requests.items()} }"
        )

    def close(self) -> None:
        """Shut down as an engine does: the worker connector first, then the scheduler."""
        if self._closed:
            return
        self._closed = True
        self.worker.shutdown()
        self.scheduler.shutdown()

    # ------------------------------------------------------------------ the fake model

    def _forward(self, output: SchedulerOutput) -> None:
        """Write the pages of every block this step completes (all its tokens computed)."""
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            first, last = (end - num_tokens) // BLOCK_SIZE, end // BLOCK_SIZE
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for group, ids in enumerate(block_ids):
                for block in range(first, min(last, len(ids))):
                    if ids[block] != 0:  # 0: the null block (out of a sliding window)
                        self._write(group, ids[block], req.block_hashes[block])

    def _layers(self, group: int) -> list[torch.Tensor]:
        names = self.kv_cache_config.kv_cache_groups[group].layer_names
        return [
            self.kv_caches[n].view(torch.uint8).view(self.kv_caches[n].shape[0], -1) for n in names
        ]

    def _write(self, group: int, block_id: int, block_hash: bytes) -> None:
        for layer in self._layers(group):
            layer[block_id] = page_pattern(block_hash, group, layer.shape[1])

    def _check_loaded(self, job: TransferJob) -> list[tuple[str, int, int]]:
        """Blocks of a finished load whose bytes are not what the forward computed."""
        spec = job.dst_spec
        assert isinstance(spec, GPULoadStoreSpec) and isinstance(job.src_spec, RedisLoadStoreSpec)
        req = self.requests[job.req_id]
        block_ids = spec.block_ids.tolist()
        bad: list[tuple[str, int, int]] = []
        offset = 0
        for group, (size, first) in enumerate(
            zip(spec.group_sizes, spec.block_indices, strict=True)
        ):
            for i, block_id in enumerate(block_ids[offset : offset + size]):
                block = first + i
                want = page_pattern(req.block_hashes[block], group, self._layers(group)[0].shape[1])
                if any(not torch.equal(layer[block_id], want) for layer in self._layers(group)):
                    bad.append((job.req_id, group, block))
            offset += size
        return bad
