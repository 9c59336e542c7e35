"""One router hears two engines' stores through ``hma-redis events``: two vLLM instances (a
hybrid model, two KV-cache groups) store their prompts' chunks in one Redis, and a subscriber
built on vLLM's event classes, connected to the fleet publisher only, hears every chunk of both
(per group), and in the usable view every chunk both groups hold, each once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from vllm.distributed.kv_events import BlockStored

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import parse_block_key
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3
from hma_redis.tools.events.batches import View, block_hash
from tests.support.engine_runner import make_prompts, run_engine
from tests.support.kv_subscriber import KVSubscriber, RunningPublisher, wait_connected
from tests.support.redis_server import LocalRedis
from tests.support.tier import tier_config

pytestmark = pytest.mark.engine


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


def _chunks_in_redis(client: redis.Redis) -> dict[tuple[str, int], set[int]]:
    """(namespace, hash as events carry it) -> groups, of every chunk key in Redis."""
    out: dict[tuple[str, int], set[int]] = {}
    for raw in client.scan_iter(match="hma:*:g*", count=1000):
        parts = parse_block_key(raw.decode())
        if parts is not None and parts.namespace != "probe":
            ident = (parts.namespace, int(block_hash(parts.hash_hex, True)))
            out.setdefault(ident, set()).add(parts.group)
    return out


def _stored(sub: KVSubscriber) -> dict[tuple[int, int | None], int]:
    counts: dict[tuple[int, int | None], int] = {}
    for event in sub.events():
        if isinstance(event, BlockStored) and event.ownership != "hma_redis:probe":
            for h in event.block_hashes:
                assert isinstance(h, int)
                counts[(h, event.group_idx)] = counts.get((h, event.group_idx), 0) + 1
    return counts


def test_one_subscriber_hears_the_stores_of_two_engines(
    tmp_path_factory: pytest.TempPathFactory, server: LocalRedis
) -> None:
    model = build_gemma3(tmp_path_factory.mktemp("gemma3"), sliding_window=32)
    client = redis.Redis.from_url(server.url)
    cfg = RedisTierConfig(url=server.url)
    per_group, usable = KVSubscriber(), KVSubscriber()
    engines = KVSubscriber()  # the engines' own KV events, to compare hashes with
    publishers = [
        RunningPublisher(cfg, per_group),
        RunningPublisher(cfg, usable, view=View.USABLE),
    ]
    try:
        wait_connected(client, per_group)
        wait_connected(client, usable)
        groups_after: list[dict[tuple[str, int], set[int]]] = []
        for seed in (11, 12):  # engine A, then engine B (a fresh process), other prompts
            run = run_engine(
                model,
                make_prompts(seed, 2, 600, VOCAB_SIZE),
                4,
                tier_config(server.url),
                llm_kwargs={
                    "kv_events_config": {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": engines.endpoint,
                    }
                },
            )
            assert run.num_kv_cache_groups == 2, run.stderr_tail
            groups_after.append(_chunks_in_redis(client))
            expected = sum(len(g) for g in groups_after[-1].values())
            per_group.wait_for("every chunk key", lambda n=expected: len(_stored(per_group)) >= n)
        namespaces = {ns for ns, _ in groups_after[-1]}
        usable_expected = {h for (_, h), g in groups_after[-1].items() if g == {0, 1}}
        usable.wait_for(
            "every usable chunk",
            lambda: {h for h, _ in _stored(usable)} >= usable_expected,
        )
    finally:
        for publisher in publishers:
            publisher.close()
        per_group.close()
        usable.close()
        engines.close()
        client.close()
    assert len(namespaces) == 1, namespaces  # both engines share one namespace
    from_a = set(groups_after[0])
    from_b = set(groups_after[1]) - from_a
    assert from_a and from_b, "an engine stored nothing"
    heard = _stored(per_group)
    assert heard == {(h, g): 1 for (_, h), gs in groups_after[-1].items() for g in gs}
    assert _stored(usable) == {(h, None): 1 for h in usable_expected}
    assert usable_expected, "no chunk held by both groups"
    assert not per_group.seen.errors and not usable.seen.errors
    # What the engines announced for the tier (medium STORAGE) is what the fleet announced.
    own = {
        (h, e.group_idx)
        for e in engines.events()
        if isinstance(e, BlockStored) and e.medium == "STORAGE"
        for h in e.block_hashes
    }
    assert own and own <= set(heard)  # <=: ZMQ may drop what an engine sent before it connected
