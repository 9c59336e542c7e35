"""Namespaces and the readable Redis key layout (hma_redis.core.keys)."""

import dataclasses

import pytest

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


@pytest.mark.parametrize(
    "key",
    [
        "hma:ns:g01:abcd",  # a group with a leading zero
        "hma:ns:g0:abcd:x1",  # something other than a rank after the hash
        "hma:ns:g0:abcd:r01",
        "hma:ns:g0:ABCD",  # block_key writes lowercase hex
        "hma:ns:g0:abc",  # odd hex
        "hma:ns:g0:abcd:r1:extra",
    ],
)
def test_parse_block_key_refuses_what_block_key_never_writes(key: str) -> None:
    """The parser and :meth:`KeySpace.is_block_key` agree: a key block_key would not write is
    no block key (before, ``g01`` parsed as group 1 and ``:x1`` as rank 0)."""
    assert parse_block_key(key) is None
    assert not KeySpace("hma", "ns", 2).is_block_key(key)


def test_parse_block_key_reads_what_block_key_writes() -> None:
    space = KeySpace("hma", "ns", 2)
    parts = parse_block_key(space.block_key(3, b"\xab\xcd", rank=1))
    assert parts == ("hma", "ns", 3, "abcd", 1)
