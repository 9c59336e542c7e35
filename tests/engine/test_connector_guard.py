"""Only ``RedisOffloadingConnector`` may drive the spec (see tests/adapter/test_connector_guard.py):
a real engine configured with vLLM's stock ``OffloadingConnector`` does not start."""

from __future__ import annotations

from pathlib import Path

import pytest

from hma_redis.adapter.spec import CONNECTOR_CONFIG
from hma_redis.tools.devkit.engine import kv_transfer_config
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_llama
from tests.support.engine_runner import EngineFailed, make_prompts, run_engine

pytestmark = pytest.mark.engine


def test_engine_refuses_the_stock_offloading_connector(tmp_path: Path, redis_url: str) -> None:
    """A user who writes ``"kv_connector": "OffloadingConnector"`` with the spec gets an engine
    that does not start, and one line saying which connector to use."""
    model = build_llama(tmp_path / "llama")
    config = kv_transfer_config(redis_url)
    config["kv_connector"] = "OffloadingConnector"
    del config["kv_connector_module_path"]

    with pytest.raises(EngineFailed) as failed:
        run_engine(model, make_prompts(0, 1, 40, VOCAB_SIZE), 2, config)

    lines = [ln for ln in failed.value.stderr.splitlines() if "RedisOffloadingSpec needs" in ln]
    assert lines, failed.value.stderr[-3000:]
    assert "kv_connector is 'OffloadingConnector'" in lines[0]
    assert CONNECTOR_CONFIG in lines[0]
