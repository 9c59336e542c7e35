import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scheduler_harness import (
    make_vllm_config,
    three_group_kv_cache_config,
    worker_spec,
    write_tiny_model_config,
)

from hma_redis.core.keys import GroupLayout, KeySpace, NamespaceFingerprint, parse_block_key


def _fp(**changes):
    base = NamespaceFingerprint(
        model="tiny-gemma",
        kv_dtype="float32",
        groups=(
            GroupLayout(64, ("l0", "l2"), (4096, 4096), "full_attention"),
            GroupLayout(64, ("l1", "l3"), (4096, 4096), "sliding_window:32"),
        ),
    )
    return dataclasses.replace(base, **changes)


def test_namespace_is_stable_and_short():
    assert _fp().namespace_id() == _fp().namespace_id()
    assert len(_fp().namespace_id()) == 12


def test_namespace_changes_with_everything_that_changes_bytes():
    base = _fp().namespace_id()
    other_groups = (GroupLayout(128, ("l0", "l2"), (4096, 4096)), _fp().groups[1])
    other_pages = (GroupLayout(64, ("l0", "l2"), (2048, 2048)), _fp().groups[1])
    variants = {
        "model": _fp(model="other"),
        "revision": _fp(revision="v2"),
        "quantization": _fp(quantization="fp8_per_tensor"),
        "model dtype": _fp(model_dtype="bfloat16"),
        "model config": _fp(model_config='{"hf_overrides":[["rope_theta",1.0]]}'),
        "auth key": _fp(auth_key_id="0123456789abcdef"),
        "dtype": _fp(kv_dtype="bfloat16"),
        "kind": _fp(groups=(_fp().groups[0], dataclasses.replace(_fp().groups[1], kind="mamba"))),
        "chunk size": _fp(groups=other_groups),
        "page layout": _fp(groups=other_pages),
        "tp": _fp(tp_size=2, world_size=2),
        "pp": _fp(pp_size=2, world_size=2),
        "hash": _fp(hash_algo="xxhash"),
        "format": _fp(format_version=2),
    }
    ids = {name: fp.namespace_id() for name, fp in variants.items()}
    assert base not in ids.values()
    assert len(set(ids.values())) == len(ids)


def test_block_keys_are_readable_and_parse_back():
    ks = KeySpace("hma", "abc123", world_size=1)
    key = ks.block_key(1, bytes.fromhex("00ff"))
    assert key == "hma:abc123:g1:00ff"
    parts = parse_block_key(key)
    assert parts is not None and (parts.group, parts.hash_hex, parts.rank) == (1, "00ff", 0)
    sharded = KeySpace("hma", "abc123", world_size=2)
    assert sharded.block_keys_all_ranks(0, b"\x01") == [
        "hma:abc123:g0:01:r0",
        "hma:abc123:g0:01:r1",
    ]
    assert parse_block_key("hma:abc123:info") is None


def test_info_fields_are_plain_text():
    fields = _fp().info_fields()
    assert fields["model"] == "tiny-gemma"
    assert fields["g1.kind"] == "sliding_window:32"
    assert all(isinstance(v, str) for v in fields.values())


# ----------------------------------------------------------------- from vLLM's configuration

REDIS_URL = "redis://127.0.0.1:1/0"  # never contacted: building a spec needs no Redis


def _namespace(model_dir: str, **model_kwargs: object) -> str:
    """The namespace a worker's spec derives from a real VllmConfig of the tiny model."""
    vllm_config = make_vllm_config(model_dir, REDIS_URL, model_kwargs=model_kwargs)
    return worker_spec(vllm_config, three_group_kv_cache_config(16, 1000, 3)).keyspace.namespace


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    return write_tiny_model_config(tmp_path / "tiny-llama")


def test_namespace_identifies_the_models_bytes(model_dir: str) -> None:
    """Two deployments of one model path share KV only when vLLM computes the same bytes:
    another revision, weight quantization or rope override is another namespace."""
    bf16 = {"dtype": "bfloat16"}
    variants = {
        "base": _namespace(model_dir, **bf16),
        "revision": _namespace(model_dir, revision="v2", **bf16),
        "quantization": _namespace(model_dir, quantization="fp8_per_tensor", **bf16),
        "rope override": _namespace(
            model_dir, hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, **bf16
        ),
        "model dtype": _namespace(model_dir, dtype="float16"),
    }
    assert len(set(variants.values())) == len(variants), variants
    assert _namespace(model_dir, **bf16) == variants["base"]


def test_namespace_changes_with_the_checkpoint_config(model_dir: str) -> None:
    """A checkpoint replaced in place (same path, another config.json) is another namespace."""
    before = _namespace(model_dir)
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = 500000.0
    config_path.write_text(json.dumps(config))
    assert _namespace(model_dir) != before


def test_namespace_includes_the_auth_key(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    without = _namespace(model_dir)
    monkeypatch.setenv("HMA_REDIS_AUTH_KEY", "k" * 32)
    keyed = _namespace(model_dir)
    monkeypatch.setenv("HMA_REDIS_AUTH_KEY", "j" * 32)
    assert len({without, keyed, _namespace(model_dir)}) == 3


def test_identical_configs_in_two_processes_get_the_same_namespace(model_dir: str) -> None:
    """The namespace is a pure function of the configuration: another process (with another
    hash seed) derives the same one, or no instance could load another's chunks."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_keys; "
        "print('NS=' + test_keys._namespace(sys.argv[2], revision='v2'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), model_dir],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    (line,) = [ln for ln in out.splitlines() if ln.startswith("NS=")]
    assert line == "NS=" + _namespace(model_dir, revision="v2")


def test_info_records_each_groups_attention_kind(model_dir: str) -> None:
    """``g<N>.kind`` says which group is full attention and which a sliding window (tokens)."""
    vllm_config = make_vllm_config(model_dir, REDIS_URL, model_kwargs={"revision": "v2"})
    kv_cache_config = three_group_kv_cache_config(16, 1000, 3, third_group="sliding")
    fields = worker_spec(vllm_config, kv_cache_config).fingerprint.info_fields()
    kinds = [fields[f"g{i}.kind"] for i in range(3)]
    assert kinds == ["full_attention", "sliding_window:48", "sliding_window:32"]
    assert fields["revision"] == "v2"
    assert fields["model_dtype"] == "float32"
    assert json.loads(fields["model_config"])["hf_overrides"] == []


def test_an_explicit_namespace_is_split_by_auth_key() -> None:
    """Instances with different shared secrets never meet in a named namespace (each would find
    the other's values corrupt and delete them); without a secret the name is used as given."""
    from hma_redis.adapter.spec import explicit_namespace
    from hma_redis.core.config import RedisTierConfig

    def named(env: dict[str, str]) -> str | None:
        return explicit_namespace(
            RedisTierConfig.from_extra_config({"namespace": "team-a"}, env=env)
        )

    plain = named({})
    first = named({"HMA_REDIS_AUTH_KEY": "first-secret-0123456789"})
    second = named({"HMA_REDIS_AUTH_KEY": "second-secret-0123456789"})
    assert plain == "team-a"
    assert first is not None and first.startswith("team-a.")
    assert len({plain, first, second}) == 3
    assert first == named({"HMA_REDIS_AUTH_KEY": "first-secret-0123456789"})
