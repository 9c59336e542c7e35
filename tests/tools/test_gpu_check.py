"""The GPU check (hma_redis.tools.gpu.check) in CI, with ``--device cpu``: it runs with vLLM
unimportable, moves every byte right through a real redis-server and a real 3-shard cluster,
refuses a corrupted value, exits 1 on a wrong byte; and scripts/gpu_check.sh runs it from a
bundle as it would on an offline GPU host (wheels, a copy of the package with its extension
built there, a redis-server launcher that lends the bundled libraries the host lacks)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hma_redis.tools.gpu import check

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"

# Run in a child: any import of vllm raises, as on a GPU host without it.
_CHECK_WITHOUT_VLLM = """
import sys
from importlib.abc import MetaPathFinder

class NoVllm(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vllm is blocked here: {name}")
        return None

sys.meta_path.insert(0, NoVllm())
from hma_redis.tools.gpu.check import main
sys.exit(main(sys.argv[1:]))
"""


def _rows(table: str) -> list[list[str]]:
    """The table's rows as cells (columns are separated by two spaces or more)."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check "))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_cpu_check_moves_every_byte_and_refuses_a_corrupted_value(tmp_path: Path) -> None:
    out = tmp_path / "table.txt"
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_WITHOUT_VLLM, "--device", "cpu", "--output", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = out.read_text()
    assert table == proc.stdout  # the file holds what was printed
    rows = _rows(table)
    # Connection counts beyond 1 are measured where the deployment's jobs take the native path.
    conns = {
        redis: ["1", "2"] if re.search(rf"^data path \({redis}\): native", table, re.M) else ["1"]
        for redis in ("single", "cluster")
    }
    cells = {(redis, chunk) for redis in ("single", "cluster") for chunk in ("1 blk", "16 blk")}

    def where(check_name: str) -> list[list[str]]:
        return [r for r in rows if r[0] == check_name]

    for name in ("correctness", "corrupt value"):
        assert {(r[1], r[2], r[3]) for r in where(name)} == {(*c, conns[c[0]][-1]) for c in cells}
        assert all(r[-1] == "ok" for r in where(name)), where(name)
    for name in ("store GB/s", "load GB/s"):
        expected = {(*c, n) for c in cells for n in conns[c[0]]}
        assert {(r[1], r[2], r[3]) for r in where(name)} == expected
        assert all(float(r[4].split()[0]) > 0 for r in where(name))
    assert {r[1] for r in where("load timing")} == {"single", "cluster"}
    assert [r[1] for r in where("compute rate")] == ["single"]
    (tiering,) = where("tiering")
    assert tiering[4].startswith("not run: vLLM is not importable here"), tiering
    assert "WRONG" not in table
    assert "RESULT: every byte correct, every corrupted value refused: exit 0" in table


def test_cpu_check_exits_1_when_a_loaded_byte_is_wrong(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "table.txt"
    argv = ["--device", "cpu", "--no-cluster", "--connections", "1", "--output", str(out)]
    assert check.main([*argv, "--no-tiering", "--flip-a-loaded-byte"]) == check.EXIT_WRONG
    table = out.read_text()
    loads = [r for r in _rows(table) if r[0] == "load GB/s"]
    assert loads and all(r[-1] == "WRONG" and "1 WRONG pages" in r[4] for r in loads)
    assert "RESULT: 2 row(s) with a WRONG byte or a failed load: exit 1" in table


@pytest.mark.cpu_platform
def test_tiering_rows_run_vllms_cpu_tier_with_the_redis_tier_and_catch_a_wrong_byte(
    tmp_path: Path,
) -> None:
    """With vLLM importable the check runs vLLM's own CPU tier (its worker over the check's
    KV cache, its copy replaced on the CPU) with the Redis secondary tier: every page comes back
    from Redis through the primary tier into other blocks; a byte flipped in the primary tier
    after the promotion is a WRONG row and exit 1."""
    out = tmp_path / "table.txt"
    argv = ["--device", "cpu", "--no-cluster", "--connections", "1", "--output", str(out)]
    assert check.main(argv) == check.EXIT_OK
    rows = _rows(out.read_text())
    exact = [r for r in rows if r[0] == "tiering bytes"]
    assert [r[2] for r in exact] == ["1 blk", "16 blk"], exact
    assert all(r[-1] == "ok" and "0 page(s) wrong, 0 other" in r[4] for r in exact), exact
    legs = {r[0].removeprefix("tiering GB/s ") for r in rows if r[0].startswith("tiering GB/s")}
    assert legs == {"KV->primary", "cascade", "promotion", "primary->KV", "Redis->KV"}
    assert all(float(r[4]) > 0 for r in rows if r[0].startswith("tiering GB/s"))

    assert check.main([*argv, "--flip-a-loaded-byte"]) == check.EXIT_WRONG
    flipped = [r for r in _rows(out.read_text()) if r[0] == "tiering bytes"]
    assert flipped and all(r[-1] == "WRONG" and "1 page(s) wrong" in r[4] for r in flipped)


# ---------------------------------------------------------------------------------- the script

# A stand-in for the bundled redis-server that needs a library no host has: it links
# libhmafake.so.1 (only in the bundle) and runs the real server under its own name.
_FAKE_LIB = "int hma_fake(void) { return 0; }\n"
_FAKE_SERVER = """
#include <unistd.h>
int hma_fake(void);
int main(int argc, char **argv) {
    (void)argc;
    execv(REAL_SERVER, argv);  /* argv[0] still names redis-server: it runs as the server */
    return 100 + hma_fake();
}
"""


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("the script tests need a C compiler (Debian: apt-get install -y gcc)")
    return cc


def _bundle(tmp_path: Path, python_version: str, lend_library: bool = True) -> Path:
    """A bundle as scripts/gpu_bundle.sh lays it out, built from this machine: no wheels (the
    test's Python has the dependencies), a redis-server that needs a library only the bundle
    has (dropped again when ``lend_library`` is false)."""
    real = shutil.which("redis-server")
    if real is None:
        pytest.fail("redis-server not on PATH (Debian: apt-get install -y redis-server)")
    bundle = tmp_path / "bundle"
    lib_dir = bundle / "redis" / "lib"
    lib_dir.mkdir(parents=True)
    (bundle / "wheels").mkdir()
    (bundle / "MANIFEST.txt").write_text(f"test bundle\npython_version={python_version}\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "fake.c").write_text(_FAKE_LIB)
    (src / "server.c").write_text(_FAKE_SERVER)
    cc = _compiler()
    lib = lib_dir / "libhmafake.so.1"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-Wl,-soname,libhmafake.so.1", "-o", str(lib), src / "fake.c"],
        check=True,
    )  # fmt: skip
    subprocess.run(
        [cc, f'-DREAL_SERVER="{real}"', "-o", str(bundle / "redis" / "redis-server"),
         src / "server.c", str(lib)],
        check=True,
    )  # fmt: skip
    if not lend_library:
        lib.unlink()
    return bundle


def _run_script(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--python", python, *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _this_python() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def test_gpu_check_script_runs_the_check_from_a_bundle(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, _this_python())
    table = tmp_path / "table.txt"
    # A relative --python and table path, as typed at the repository root.
    proc = _run_script(
        str(bundle), os.path.relpath(table, REPO_ROOT),
        "--", "--device", "cpu", "--no-cluster", "--connections", "1",
        python=os.path.relpath(sys.executable, REPO_ROOT),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The extension was built in the script's copy of the package, which the check ran.
    assert "gpu_check: data path: native, built with" in proc.stdout
    assert "bundled libraries: libhmafake.so.1" in proc.stdout
    text = table.read_text()
    assert "extension: native, GIL released" in text
    package = re.search(r"hma_redis from (\S+)", text)
    assert package is not None and "hma-gpu-check." in package.group(1)
    assert not Path(package.group(1)).exists()  # the temporary folder is gone
    assert "RESULT: every byte correct" in text


def test_gpu_check_script_names_a_library_neither_host_nor_bundle_has(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, _this_python(), lend_library=False)
    proc = _run_script(str(bundle), str(tmp_path / "table.txt"), "--", "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "gpu_check: redis-server needs libhmafake.so.1: not on this host, not in the bundle"
    )
    assert not (tmp_path / "table.txt").exists()


def test_gpu_check_script_refuses_a_bundle_built_for_another_python(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, "3.2")
    proc = _run_script(str(bundle), str(tmp_path / "table.txt"))
    assert proc.returncode == 2
    assert f"the bundle's wheels are for Python 3.2, {sys.executable} is {_this_python()}" in (
        proc.stderr
    )


def test_shape_option_sizes_the_jobs_on_any_device() -> None:
    """--shape llama3-8b gives a CPU run the GPU plan's cache and 512 MiB jobs (the scaling
    table on a CPU host), and keeps the CPU's own connections and repetitions."""
    cpu = torch.device("cpu")
    args = check.build_parser().parse_args(["--device", "cpu", "--shape", "llama3-8b"])
    plan = check.choose_plan(args, cpu)
    assert (plan.shape, plan.num_blocks, plan.job_blocks) == (
        check.GPU_PLAN.shape,
        check.GPU_PLAN.num_blocks,
        check.GPU_PLAN.job_blocks,
    )
    assert plan.reps == check.CPU_PLAN.reps and plan.matmul_n == check.CPU_PLAN.matmul_n
    default = check.choose_plan(check.build_parser().parse_args(["--device", "cpu"]), cpu)
    assert default.shape == check.CPU_PLAN.shape
    with pytest.raises(SystemExit):
        check.build_parser().parse_args(["--shape", "huge"])
