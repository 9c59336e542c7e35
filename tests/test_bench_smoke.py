"""CI smoke of the benchmarks: every measured path must move the right bytes (speed is not
checked here; see docs/performance.md)."""

from __future__ import annotations

from hma_redis import bench_tier


def test_tier_benchmark_smoke_round_trips_its_bytes(capsys) -> None:  # type: ignore[no-untyped-def]
    bench_tier.main(["--smoke"])  # raises if a round trip came back wrong
    out = capsys.readouterr().out
    assert "smoke: every measured path round-tripped its bytes and answered right" in out
