"""The namespace a spec derives from vLLM's configuration: it names the model's KV bytes, is the
same in every process, and an explicit namespace is split by the auth key."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scheduler_harness import (
    make_vllm_config,
    three_group_kv_cache_config,
    worker_spec,
    write_tiny_model_config,
)

REPO_ROOT = str(Path(__file__).resolve().parents[2])
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
        "import sys; from tests.adapter.test_namespace import _namespace; "
        "print('NS=' + _namespace(sys.argv[1], revision='v2'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, model_dir],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
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


def test_an_explicit_namespace_carries_the_fingerprint_id() -> None:
    """A named namespace is the name, ``.`` and the fingerprint's id: deployments share it
    exactly when they would share a computed one. Two models of one layout whose weights
    differ (another revision, another checkpoint config) never meet under one name, where the
    values' headers could not tell their KV apart; nor do instances with different shared
    secrets (each would find the other's values corrupt and delete them)."""
    from dataclasses import replace

    from hma_redis.adapter.namespace import Mode, namespace_name
    from hma_redis.core.config import RedisTierConfig
    from hma_redis.core.keys import GroupLayout, NamespaceFingerprint

    base = NamespaceFingerprint(
        model="/models/llama",
        kv_dtype="bfloat16",
        groups=(GroupLayout(16, ("layers.0",), (4096,)),),
    )

    def named(fingerprint: NamespaceFingerprint, env: dict[str, str] | None = None) -> str:
        cfg = RedisTierConfig.from_extra_config({"namespace": "team-a"}, env=env or {})
        return namespace_name(cfg, fingerprint, Mode.DIRECT)

    assert named(base) == f"team-a.{base.namespace_id()}"
    assert named(base) == named(replace(base))  # the same deployment: the same namespace
    others = [
        replace(base, revision="v2"),  # the same layout, other weights
        replace(base, model_config='{"checkpoint_config":"other"}'),
        replace(base, model="/models/llama-finetune"),
    ]
    secrets = ["first-secret-0123456789", "second-secret-0123456789"]
    keyed = [
        named(
            replace(
                base,
                auth_key_id=RedisTierConfig.from_extra_config(
                    {}, env={"HMA_REDIS_AUTH_KEY": secret}
                ).auth_key_id,
            )
        )
        for secret in secrets
    ]
    names = [named(base), *(named(f) for f in others), *keyed]
    assert len(set(names)) == len(names)
    assert all(n.startswith("team-a.") for n in names)
    no_name = RedisTierConfig.from_extra_config({}, env={})
    assert namespace_name(no_name, base, Mode.DIRECT) == base.namespace_id()
    assert namespace_name(no_name, base, Mode.TIERING) == f"{base.namespace_id()}.tiering"
