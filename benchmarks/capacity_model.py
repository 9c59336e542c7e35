"""The capacity model of docs/capacity.md: bytes per token of prefix, Redis memory per cached
token and per hot system prompt, and shards for a fleet. Pure arithmetic, no Redis.

``python -m benchmarks.capacity_model [--engines 1000 --requests-per-s 2 --hit-rate 0.6
--prefix-tokens 4096 --keys-per-shard-s K --gbps-per-shard G]`` prints the tables.
``--keys-per-shard-s`` and ``--gbps-per-shard`` are measurements (``benchmarks/fleet_sim.py``,
``benchmarks/store_bench.py``); the defaults are this project's loopback figures.

Model shapes are from the models' public ``config.json``; KV in bf16 (2 bytes). What Redis
holds per group follows vLLM 0.32's offloading connector: full-attention layers keep every
chunk of the prefix; sliding-window layers only the chunks of the window before a hit
boundary; linear-attention (Mamba-style) layers one fixed-size state per boundary.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# Per key beyond the value: the key (~90 bytes), Redis' dict entry and object headers.
KEY_OVERHEAD = 160
ENVELOPE = 48 + 256  # payload-format.md: fixed prefix + msgpack header (with a layer list)


@dataclass(frozen=True)
class Shape:
    """The KV-relevant fields of a model's public config, and how vLLM groups its layers:
    every KV group holds ``group_layers`` layers (vLLM's hybrid manager gives all groups one
    page size), one Redis value per group and chunk of ``chunk_tokens`` tokens."""

    name: str
    full_layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    group_layers: int
    sliding_layers: int = 0
    window: int = 0
    linear_layers: int = 0
    linear_state_bytes: int = 0  # per linear-attention layer, one sequence
    dtype_bytes: int = 2

    @property
    def per_layer_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def full_bytes_per_token(self) -> int:
        return self.full_layers * self.per_layer_token

    @property
    def sliding_bytes_per_token(self) -> int:
        return self.sliding_layers * self.per_layer_token

    def groups(self) -> tuple[int, int, int]:
        """KV groups: full attention, sliding window, linear attention."""
        g = self.group_layers
        return (
            math.ceil(self.full_layers / g),
            math.ceil(self.sliding_layers / g),
            math.ceil(self.linear_layers / g),
        )

    def chunks(self, tokens: int) -> tuple[int, int]:
        """Chunks of a ``tokens`` prefix kept by full-attention and by sliding-window groups."""
        chunks = math.ceil(tokens / self.chunk_tokens)
        window = min(chunks, math.ceil(self.window / self.chunk_tokens) + 1) if self.window else 0
        return chunks, window

    def prefix_bytes(self, tokens: int) -> int:
        """Payload bytes Redis holds for one stored prefix of ``tokens`` tokens (and a hit on
        all of it reads): every chunk of the full-attention layers, the window's chunks of
        the sliding-window layers, one state of the linear-attention layers."""
        chunks, window = self.chunks(tokens)
        return (
            chunks * self.chunk_tokens * self.full_bytes_per_token
            + window * self.chunk_tokens * self.sliding_bytes_per_token
            + self.linear_layers * self.linear_state_bytes
        )

    def values(self, tokens: int) -> tuple[int, int]:
        """Redis values of one stored ``tokens`` prefix, and the attention value's size."""
        full, sliding, linear = self.groups()
        chunks, window = self.chunks(tokens)
        size = self.group_layers * self.per_layer_token * self.chunk_tokens + ENVELOPE
        return chunks * full + window * sliding + linear, size

    def redis_memory(self, tokens: int) -> int:
        """Redis memory of one stored prefix: values rounded up by jemalloc, keys."""
        _, size = self.values(tokens)
        chunks, window = self.chunks(tokens)
        full, sliding, linear = self.groups()
        attention = (chunks * full + window * sliding) * redis_bytes(size)
        state = self.linear_layers * self.linear_state_bytes
        return attention + (redis_bytes(state // linear + ENVELOPE) * linear if linear else 0)


def _gdn_state(value_heads: int, k_dim: int, v_dim: int, conv: int, conv_dim: int) -> int:
    """Gated DeltaNet state of one layer, bf16 (vLLM's ``mamba_ssm_cache_dtype`` "auto"): the
    recurrent state and the convolution's last ``conv - 1`` inputs."""
    return value_heads * k_dim * v_dim * 2 + (conv - 1) * conv_dim * 2


SHAPES = (
    # meta-llama/Meta-Llama-3-8B: 32 layers, 8 KV heads, head_dim 128. One group; 16-token
    # chunks (vLLM's GPU block) make 2 MiB values.
    Shape("Llama-3-8B", full_layers=32, kv_heads=8, head_dim=128, chunk_tokens=16, group_layers=32),
    # google/gemma-3-27b: 62 layers, 16 KV heads, head_dim 128, sliding_window 1024, one
    # full-attention layer in 6 (10 of 62). vLLM groups 10 layers per group: 1 full, 6 sliding.
    Shape(
        "Gemma-3-27B",
        full_layers=10,
        kv_heads=16,
        head_dim=128,
        chunk_tokens=16,
        group_layers=10,
        sliding_layers=52,
        window=1024,
    ),
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4 (12 gated-attention layers,
    # 2 KV heads, head_dim 256); 36 Gated DeltaNet layers (32 value heads, 16 key heads,
    # head dims 128, conv kernel 4). 12 layers per group: 1 attention, 3 linear. vLLM raises
    # the attention block to 544 tokens so its page is as large as a layer's state: one chunk
    # is at least one such block.
    Shape(
        "Qwen3-Next-80B-A3B",
        full_layers=12,
        kv_heads=2,
        head_dim=256,
        chunk_tokens=544,
        group_layers=12,
        linear_layers=36,
        linear_state_bytes=_gdn_state(32, 128, 128, 4, 2 * 16 * 128 + 32 * 128),
    ),
)


def redis_bytes(value: int) -> int:
    """Memory Redis (jemalloc) takes for one value of ``value`` bytes plus its key: jemalloc
    rounds a large allocation up to one of four size classes per power of two (a 2 MiB body
    plus its ~300-byte envelope takes 2.5 MiB; measured, docs/capacity.md)."""
    if value <= 16 * KIB:
        return value + KEY_OVERHEAD
    power = 1 << (value - 1).bit_length() - 1  # the power of two below
    step = power // 4
    return math.ceil(value / step) * step + KEY_OVERHEAD


@dataclass(frozen=True)
class Fleet:
    engines: int
    requests_per_s: float  # new requests per engine
    prefix_tokens: int  # tokens of each prompt that could come from the tier
    keys_per_shard_s: float  # measured: lookup keys/s one shard answers
    gbps_per_shard: float  # measured: GB/s of values one shard moves (loads + stores)


def lookup_keys(shape: Shape, tokens: int) -> int:
    """Keys one request's lookup asks about: every chunk of the full-attention groups, the
    window's chunks of the sliding-window groups, one state per linear group."""
    full, sliding, linear = shape.groups()
    chunks, window = shape.chunks(tokens)
    return chunks * full + window * sliding + linear


def fleet_row(shape: Shape, fleet: Fleet) -> str:
    """Shards a fleet needs. Every request looks its prefix up; a hit reads the prefix's
    values and a miss writes them (once per fleet: a store checks EXISTS, then SET NX), so at
    any hit rate about one prefix of bytes crosses per request."""
    requests = fleet.engines * fleet.requests_per_s
    keys_s = requests * lookup_keys(shape, fleet.prefix_tokens)
    gbps = requests * shape.prefix_bytes(fleet.prefix_tokens) / 1e9
    by_keys = keys_s / fleet.keys_per_shard_s
    by_bytes = gbps / fleet.gbps_per_shard
    shards = max(1, math.ceil(max(by_keys, by_bytes)))
    return (
        f"| {shape.name} | {keys_s:,.0f} | {by_keys:.1f} | {gbps:,.0f} | {by_bytes:,.0f} "
        f"| **{shards}** |"
    )


def hottest_shard_factor(values: int, shards: int, trials: int = 200) -> float:
    """How much more of one prompt's values the busiest shard holds than the mean: keys hash
    to slots at random, so with few values per shard some shards get several and others none
    (mean over ``trials`` random placements)."""
    rng = random.Random(0)
    mean = values / shards
    total = 0.0
    for _ in range(trials):
        counts = [0] * shards
        for _ in range(values):
            counts[rng.randrange(shards)] += 1
        total += max(counts) / mean
    return total / trials


def skew_row(shape: Shape, fleet: Fleet, hot_share: float) -> str:
    """One prompt with ``hot_share`` of the fleet's tier requests: the bytes/s it asks of the
    busiest shard, against what that shard moves."""
    requests = fleet.engines * fleet.requests_per_s * hot_share
    count, _ = shape.values(fleet.prefix_tokens)
    shards = max(1, math.ceil(fleet_shards(shape, fleet)))
    factor = hottest_shard_factor(count, shards)
    gbps = requests * shape.prefix_bytes(fleet.prefix_tokens) / 1e9
    busiest = gbps / shards * factor
    return (
        f"| {shape.name} | {count:,} | {shards} | {gbps:,.1f} | {factor:.1f}x "
        f"| {busiest:,.2f} ({busiest / fleet.gbps_per_shard:.0%} of a shard) |"
    )


def fleet_shards(shape: Shape, fleet: Fleet) -> float:
    requests = fleet.engines * fleet.requests_per_s
    keys_s = requests * lookup_keys(shape, fleet.prefix_tokens)
    gbps = requests * shape.prefix_bytes(fleet.prefix_tokens) / 1e9
    return max(keys_s / fleet.keys_per_shard_s, gbps / fleet.gbps_per_shard)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--requests-per-s", type=float, default=1.0)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--keys-per-shard-s", type=float, default=130_000)
    parser.add_argument("--gbps-per-shard", type=float, default=2.0)
    parser.add_argument("--hot-share", type=float, default=0.2)
    args = parser.parse_args(argv)
    t = args.prefix_tokens
    print(
        "| model | KV groups (full / sliding / linear) | chunk tokens | full-attention KiB/token "
        "| sliding-window KiB/token (window) | linear state per boundary MiB "
        f"| payload of a {t:,}-token prefix MiB | per token KiB | values "
        "| attention value → in Redis MiB | Redis memory of the prefix MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in SHAPES:
        prefix = s.prefix_bytes(t)
        count, size = s.values(t)
        print(
            f"| {s.name} | {' / '.join(map(str, s.groups()))} | {s.chunk_tokens} "
            f"| {s.full_bytes_per_token / KIB:,.0f} "
            f"| {s.sliding_bytes_per_token / KIB:,.0f} ({s.window or '-'}) "
            f"| {s.linear_layers * s.linear_state_bytes / MIB:,.1f} "
            f"| {prefix / MIB:,.0f} | {prefix / t / KIB:,.0f} | {count:,} "
            f"| {size / MIB:,.2f} → {redis_bytes(size) / MIB:,.2f} "
            f"| {s.redis_memory(t) / MIB:,.0f} |"
        )
    fleet = Fleet(
        engines=args.engines,
        requests_per_s=args.requests_per_s,
        prefix_tokens=t,
        keys_per_shard_s=args.keys_per_shard_s,
        gbps_per_shard=args.gbps_per_shard,
    )
    print(f"\n{fleet}\n")
    print(
        "| model | lookup keys/s | shards for lookups | GB/s (loads + stores) "
        "| shards for bytes | shards |"
    )
    print("|---|---|---|---|---|---|")
    for s in SHAPES:
        print(fleet_row(s, fleet))
    print(
        f"\none system prompt with {args.hot_share:.0%} of those requests:\n\n"
        "| model | its values | shards | its GB/s | busiest shard vs mean | busiest shard GB/s |"
    )
    print("|---|---|---|---|---|---|")
    for s in SHAPES:
        print(skew_row(s, fleet, args.hot_share))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
