"""CI smoke of the benchmarks: every measured path must move the right bytes (speed is not
checked here; see docs/performance.md); and ``hma-redis bench`` keeps credentials off every
command line and reports any failure as one line."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis import wire
from hma_redis.tools.bench import common
from hma_redis.tools.bench import concurrency as bench_concurrency
from hma_redis.tools.bench import store as bench_store
from hma_redis.tools.bench import tier as bench_tier
from hma_redis.tools.bench.common import (
    PASSWORD_SKIP_NOTE,
    RedisBenchmarkSkipped,
    redis_benchmark_args,
)
from hma_redis.tools.cli.main import main
from hma_redis.tools.devkit.local_redis import LocalRedis

SECRET = "bench-Pw#/?s3cret"


def test_tier_benchmark_smoke_round_trips_its_bytes(capsys) -> None:  # type: ignore[no-untyped-def]
    bench_tier.main(["--smoke"])  # raises if a round trip came back wrong
    out = capsys.readouterr().out
    assert "smoke: every measured path round-tripped its bytes and answered right" in out
    assert "redis-benchmark -h 127.0.0.1 -p " in out  # it ran, told where by host and port


def test_the_cost_columns_meter_every_in_process_client(capsys) -> None:  # type: ignore[no-untyped-def]
    """Each metered client's row of the JSON report holds its CPU and redis-server's CPU
    (positive: it did work) and exactly the commands its job needs: one GET or SET per value of
    the job, 8 MiB in 512 KiB to 8 MiB values (the tiering cascade also checks which values
    Redis holds already, so at least that many; hma_redis reads values over 1 MiB from Redis in
    pieces); the worker's second load of the same job (``reload``) too."""
    assert main(["--json", "bench", "--smoke"]) == 0
    report = json.loads(capsys.readouterr().out)
    costs = report["median_cost"]
    job = report["plan"]["job_bytes"]
    for client in ("redis-py", "hma_redis", "hma-python", "hma-tiering"):
        reload = ("reload",) if client in ("hma_redis", "hma-python") else ()
        for op in ("load", "store", *reload):
            for size in report["plan"]["sizes"]:
                cost = costs[f"{client} {op} {size}"]
                assert cost["client_cpu_s"] > 0 and cost["server_cpu_s"] > 0, (client, cost)
                values = job // size
                if client == "hma-tiering" and op == "store":
                    assert cost["commands"] >= values, (client, op, size, cost)
                elif client != "redis-py" and op != "store" and size > wire.PIECED_ABOVE:
                    # Read in pieces: STRLEN, then a GETRANGE per piece of the value's bound
                    # (the value, its header and the slack: one piece more than the value).
                    per_value = 2 + size // wire.PIECE_BYTES
                    assert cost["commands"] == values * per_value, (client, op, size, cost)
                else:
                    assert cost["commands"] == values, (client, op, size, cost)
    assert not any(name.startswith("redis-benchmark") for name in costs)


def test_store_benchmark_smoke_round_trips_its_bytes(capsys) -> None:  # type: ignore[no-untyped-def]
    assert bench_store.main(["--smoke"]) == 0  # raises if a round trip came back wrong
    out = capsys.readouterr().out
    assert "smoke: every store call round-tripped its bytes and answered right" in out
    assert "redis-benchmark -h 127.0.0.1 -p " in out
    assert "put_if_absent / SET" in out and "get / GET" in out


@pytest.mark.parametrize(
    ("url", "extra", "target"),
    [
        ("redis://10.0.0.7:6390/3", {}, ["-h", "10.0.0.7", "-p", "6390", "--dbnum", "3"]),
        ("redis://u@h:1/0", {}, ["-h", "h", "-p", "1"]),
        ("unix:///run/redis.sock", {}, ["-s", "/run/redis.sock"]),
        ("rediss://h:6380/0", {"tls_verify": False},
         ["-h", "h", "-p", "6380", "--tls", "--insecure"]),
    ],
)  # fmt: skip
def test_redis_benchmark_is_told_where_never_a_url(url: str, extra: dict, target: list[str]):
    cfg = RedisTierConfig.from_extra_config({"redis_url": url, **extra}, env={})
    args = redis_benchmark_args(cfg, bench_tier.SMOKE, 512 * 1024)
    assert args[1 : 1 + len(target)] == target
    assert not any("://" in arg for arg in args)
    assert "-a" not in args and "-u" not in args and "--user" not in args


@pytest.mark.parametrize("url", [f"redis://u:{quote(SECRET, safe='')}@h:1/0", "redis://h:1/0"])
def test_redis_benchmark_is_skipped_rather_than_given_a_password(url: str):
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": url}, env={"HMA_REDIS_PASSWORD": SECRET}, warn_credentials=False
    )
    assert cfg.password == SECRET
    with pytest.raises(RedisBenchmarkSkipped, match="only on its command line"):
        redis_benchmark_args(cfg, bench_tier.SMOKE, 512 * 1024)


@pytest.fixture
def protected() -> Iterator[LocalRedis]:
    """A private redis-server whose default user needs SECRET (set after start-up, so the
    password is not on the server's own command line either)."""
    server = LocalRedis().start()
    with redis.Redis(port=server.port) as client:
        client.config_set("requirepass", SECRET)
    yield server
    server.stop()


class _CommandLineWatch:
    """Every command line of this user's processes, sampled while a block runs."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _CommandLineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        raw = (entry / "cmdline").read_bytes()
                    except OSError:
                        continue  # gone, or not ours to read
                    self.seen.add(raw.replace(b"\0", b" ").decode(errors="replace"))
            self._stop.wait(0.005)


def test_bench_with_a_password_keeps_it_off_every_command_line(protected, capsys) -> None:
    url = f"redis://127.0.0.1:{protected.port}/0"
    with _CommandLineWatch() as watch:
        code = main(["--url", url, "bench", "--smoke", "--password", SECRET])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert PASSWORD_SKIP_NOTE in out
    assert "smoke: every measured path round-tripped its bytes" in out
    assert SECRET not in out + err
    assert [c for c in watch.seen if SECRET in c] == []
    assert any("redis-server" in c for c in watch.seen)  # the watch did watch


def test_a_failing_bench_is_one_line_without_the_password(protected, capsys) -> None:
    url = f"redis://127.0.0.1:{protected.port}/0"
    code = main(["--url", url, "--password", f"wrong-{SECRET}", "bench", "--smoke"])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.startswith("hma-redis: bench: ") and err.count("\n") == 1, err
    assert SECRET not in out + err and "Traceback" not in out + err


def test_a_failing_redis_benchmark_is_one_line(capsys) -> None:
    """redis-benchmark refused (an ACL that keeps the default user to the tier's keys): one
    line saying so, never a traceback with its command line."""
    server = LocalRedis().start()
    try:
        with redis.Redis(port=server.port) as client:
            client.acl_setuser(
                "default", enabled=True, nopass=True, reset_keys=True, keys=["hma:*"]
            )
        code = main(["--url", server.url, "bench", "--smoke"])
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("hma-redis: bench: redis-benchmark exited with status 1: ")
    assert "NOPERM" in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--json", "bench", "--smoke"], ["bench", "--smoke", "--json"]])
def test_bench_json_is_the_report_on_stdout(argv, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # nothing but the JSON on stdout
    assert report and isinstance(report, dict)
    assert "smoke: every measured path round-tripped its bytes" in captured.err


def test_concurrent_bench_smoke_loads_what_it_stored(capsys) -> None:  # type: ignore[no-untyped-def]
    """--concurrency: N jobs in flight on one transfer engine, loads and stores mixed; every
    load's blocks equal the pages its values were stored from and every stored value reads
    back equal (the bench raises otherwise); the JSON carries each level's figures."""
    assert main(["bench", "--smoke", "--concurrency", "1,4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "smoke: every concurrent job moved its bytes" in captured.err
    report = json.loads(captured.out)
    assert report["mode"] == "concurrency"
    rows = {(row["size"], row["concurrency"]): row for row in report["rows"]}
    assert set(rows) == {(s, n) for s in (512 * 1024, 2 * 1024 * 1024) for n in (1, 4)}
    for row in rows.values():
        hma = row["hma_redis"]
        assert hma["jobs"] == report["plan"]["jobs"]  # every timed job finished and counted
        assert hma["all_gbps"] > 0 and hma["p99_ms"] >= hma["p50_ms"] > 0
        # What each GB cost the client process and redis-server over the timed loop.
        assert hma["client_cpu_s_per_gb"] > 0 and hma["server_cpu_s_per_gb"] > 0
        assert row["lmcache-resp"] is None and row["lmcache-mp"] is None  # no --lmcache-python


def test_a_missing_mooncake_interpreter_is_one_line_before_anything_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    """--mooncake-python is off unless given (CI never has the venv); a wrong one stops the
    bench with one line naming it, before any server starts or anything is measured."""
    assert bench_tier.build_parser().parse_args([]).mooncake_python is None
    code = main(["bench", "--smoke", "--mooncake-python", "/nonexistent/mc-venv/bin/python"])
    out, err = capsys.readouterr()
    assert code == 1
    assert err == (
        "hma-redis: bench: --mooncake-python /nonexistent/mc-venv/bin/python is not an executable\n"
    )
    assert out == ""


@pytest.mark.parametrize(
    "option", [["--mooncake-python", "/usr/bin/python3"], ["--syscalls"]], ids=lambda o: o[0]
)
def test_what_the_concurrent_mode_does_not_measure_is_refused(capsys, option) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        bench_tier.main(["--concurrency", "1", *option])
    assert exc.value.code == 2
    assert option[0] in capsys.readouterr().err


def test_per_op_gbps_counts_the_time_that_op_was_in_flight() -> None:
    """Loads and stores alternate, so their counts are equal: each op's GB/s is its bytes
    over the time one of its jobs ran, the total over the loop's wall time."""
    run = bench_concurrency.LevelRun(
        "hma_redis", 2 * 1024 * 1024, 2, wall_s=4.0, job_bytes=10**9,
        spans={"load": [(0.0, 1.0), (0.5, 1.5)], "store": [(1.5, 2.0), (2.0, 4.0)]},
    )  # fmt: skip
    assert run.gbps("load") == pytest.approx(2 / 1.5)
    assert run.gbps("store") == pytest.approx(2 / 2.5)
    assert run.gbps() == pytest.approx(4 / 4.0)
    assert run.latencies("load") == [1.0, 1.0]
    costed = bench_concurrency.LevelRun(
        "hma_redis", 2 * 1024 * 1024, 2, wall_s=4.0, job_bytes=10**9,
        spans=run.spans, client_cpu_s=1.0, server_cpu_s=2.0,
    )  # fmt: skip
    assert costed.cpu_per_gb() == pytest.approx((0.25, 0.5))  # 4 jobs of 1 GB


def test_the_concurrent_table_sets_hma_redis_against_each_lmcache_client() -> None:
    """With LMCache's peers, the table has a ratio row against resp:// and one against the MP
    adapter, from each one's own figures; a connector found absent is named with its reason."""
    plan = bench_concurrency.ConcurrencyPlan((2,), (512 * 1024,), 10**9, 2, 1)
    spans = {"load": [(0.0, 1.0)], "store": [(1.0, 3.0)]}
    report = bench_concurrency.ConcurrencyReport(plan, "here", "Redis 7", "native", 0.1)
    report.lmcache = {
        "version": "9.9",
        "threads": {"lmcache-resp": 8},
        "absent": {"lmcache-mp": "no MP mode here"},
    }
    for client, wall_s in (("hma_redis", 2.0), ("lmcache-resp", 4.0)):
        report.runs.append(
            bench_concurrency.LevelRun(client, 512 * 1024, 2, wall_s, 10**9, spans, 1.0, 1.0)
        )
    text = bench_concurrency.format_concurrency(report)
    assert "lmcache-mp absent: no MP mode here" in text
    (hma_row,) = [line for line in text.splitlines() if line.split()[3:4] == ["hma_redis"]]
    assert hma_row.split()[9:11] == ["1000.0", "2000.0"]  # p99 of the loads, of the stores
    assert "hma/lmc-mp" not in text
    (resp_row,) = [line for line in text.splitlines() if "hma/lmc-resp" in line]
    assert resp_row.split()[6] == "2.00"  # all GB/s: 2 GB in 2 s against 2 GB in 4 s

    report.lmcache = {"version": "9.9", "threads": {"lmcache-resp": 8, "lmcache-mp": 8}}
    report.lmcache["absent"] = {}
    report.runs.append(
        bench_concurrency.LevelRun("lmcache-mp", 512 * 1024, 2, 1.0, 10**9, spans, 1.0, 4.0)
    )
    text = bench_concurrency.format_concurrency(report)
    (mp_row,) = [line for line in text.splitlines() if "hma/lmc-mp" in line]
    assert mp_row.split()[6] == "0.50"  # 2 GB in 2 s against 2 GB in 1 s
    assert mp_row.split()[-1] == "0.25"  # redis-server CPU per GB: 0.5 against 2.0
    rows = bench_concurrency.ConcurrencyReport.to_json(report)["rows"]
    assert rows[0]["lmcache-mp"]["all_gbps"] == pytest.approx(2.0)


def test_a_peer_without_the_mp_mode_is_told_apart_from_a_failed_one() -> None:
    """The LMCache peer's exit status 2 means "no MP mode" for the mp connector only (its reason
    without the peer's prefix); any other failure keeps its last stderr line."""

    def proc(code: int, err: str) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["peer"], code, "", err)

    no_mp = proc(common.NO_MP_MODE_STATUS, "noise\nlmcache_peer: mp: LMCache 0.4 has none\n")
    assert common.peer_outcome("mp", no_mp) == ("LMCache 0.4 has none", True)
    assert common.peer_outcome("resp", no_mp) == ("lmcache_peer: mp: LMCache 0.4 has none", False)
    assert common.peer_outcome("mp", proc(1, "lmcache_peer: mp: hung")) == (
        "lmcache_peer: mp: hung",
        False,
    )
    assert common.peer_outcome("mp", proc(1, "")) == ("no output", False)


@pytest.mark.parametrize("text", ["", "0", "1,65", "4,x"])
def test_concurrency_levels_are_refused_outside_1_to_64(text: str) -> None:
    with pytest.raises(ValueError, match="from 1 to 64"):
        bench_concurrency.parse_levels(text)
