"""The ``hma-redis`` CLI against a real Redis holding real encoded blocks."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import jsonschema
import pytest
import redis

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace, RedisKey
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.sealing import Keyring, SealKey
from hma_redis.tools.cli.main import main
from hma_redis.tools.cli.schemas import SCHEMAS
from hma_redis.tools.cli.schemas import markdown as schema_markdown
from hma_redis.tools.devkit.local_redis import free_port
from tests.support.cli_run import (
    FINGERPRINT,
    assert_one_line_error,
    block_header,
    cli_command,
    run_script,
    write_blocks,
)
from tests.support.doc_examples import shape

OTHER_NS = "other-deployment"
FOREIGN_KEYS = {"user:session:1": b"keep me", "hmax:not-ours": b"keep me too"}
SECRET = "s3cret-Pw"
MISSING_PASSWORD = "Redis requires a password: set HMA_REDIS_PASSWORD or password_file"


@dataclass(frozen=True)
class Populated:
    ns: str  # the namespace under test: 3 chunks in group 0, 1 in group 1, info, stats
    blocks: dict[int, list[RedisKey]]
    other_blocks: list[RedisKey]  # OTHER_NS: 2 chunks in group 0, and its info


@pytest.fixture
def populated(redis_client: redis.Redis, redis_url: str) -> Iterator[Populated]:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    ns = FINGERPRINT.namespace_id()
    keys = KeySpace("hma", ns)
    written = write_blocks(store, keys, [(0, 16), (0, 16), (0, 16), (1, 8)])
    assert store.write_info(keys.info_key(), FINGERPRINT.info_fields())
    redis_client.hset(keys.stats_key(), mapping={"lookups": 7, "hit_chunks": 5})
    other = KeySpace("hma", OTHER_NS)
    other_blocks = write_blocks(store, other, [(0, 16), (0, 16)])
    assert store.write_info(other.info_key(), {"model": "another-model"})
    redis_client.mset(FOREIGN_KEYS)
    store.close()
    yield Populated(ns, {0: written[:3], 1: written[3:]}, other_blocks)


# ---------------------------------------------------------------------------------- info


def test_info_shows_each_namespace_with_group_counts_and_bytes(populated, cli, redis_client):
    g0_bytes = sum(redis_client.strlen(k) for k in populated.blocks[0])
    g1_bytes = sum(redis_client.strlen(k) for k in populated.blocks[1])

    text = cli("info")
    assert text.code == 0, text.err
    assert f"namespace {populated.ns}" in text.out
    assert f"namespace {OTHER_NS}" in text.out
    assert "/models/tiny-gemma3" in text.out
    rows = _sizes_rows(_section(text.out, populated.ns))
    assert rows["g0"][1:4] == ["full attention", "3", str(g0_bytes)]
    assert rows["g1"][1:4] == ["sliding window 512", "1", str(g1_bytes)]
    assert rows["total"][1:3] == ["4", str(g0_bytes + g1_bytes)]
    assert "lookups" in text.out and "hit_chunks" in text.out

    data = cli("--json", "info").json()
    by_ns = {ns["namespace"]: ns for ns in data["namespaces"]}
    assert set(by_ns) == {populated.ns, OTHER_NS}
    mine = by_ns[populated.ns]
    assert mine["info"] == FINGERPRINT.info_fields()
    assert mine["groups"]["0"]["keys"] == 3
    assert mine["groups"]["0"]["value_bytes"] == g0_bytes
    assert mine["groups"]["1"] == {
        "keys": 1,
        "value_bytes": g1_bytes,
        "memory_bytes": redis_client.memory_usage(populated.blocks[1][0]),
    }
    assert mine["total"]["keys"] == 4
    assert mine["stats"] == {"lookups": 7, "hit_chunks": 5}
    assert by_ns[OTHER_NS]["groups"]["0"]["keys"] == 2
    assert by_ns[OTHER_NS]["stats"] == {}


def _section(out: str, namespace: str) -> str:
    """``info``'s text about one namespace."""
    return out.split(f"namespace {namespace}\n")[1].split("\nnamespace ")[0]


def _sizes_rows(section: str) -> dict[str, list[str]]:
    """The sizes table of one namespace's section: {group: cells}."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["group", "attention"])
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells if cells[0] != "total" else [cells[0], *cells[1:]]
    return rows


def _fields(section: str) -> list[tuple[str, str]]:
    """The fingerprint lines of one namespace's section, in order: (label, value)."""
    out = []
    for line in section.splitlines():
        if not line.strip():
            break
        label, _, value = line.strip().partition("  ")
        out.append((label, value.strip()))
    return out


def test_info_reads_like_a_report(populated, cli, redis_client):
    info_key = KeySpace("hma", populated.ns).info_key()
    redis_client.hset(info_key, mapping={"revision": "0123abcd", "quantization": "fp8"})
    redis_client.hset(info_key, mapping={"g1.kind": "sliding_window:4096", "new_field": "x"})
    run = cli("info")
    assert run.code == 0, run.err
    fields = _fields(_section(run.out, populated.ns))
    labels = [label for label, _ in fields]
    order = ["model", "revision", "kv dtype", "layout", "parallel", "hash", "format", "g0", "g1"]
    assert [label for label in labels if label in order] == order
    values = dict(fields)
    assert values["model"] == "/models/tiny-gemma3"
    assert values["revision"] == "0123abcd"
    assert values["quantization"] == "fp8"
    assert values["kv dtype"] == "bfloat16" and values["layout"] == "NHD"
    assert values["parallel"] == "tp 1, pp 1, dcp 1, pcp 1, world size 1"
    assert values["g0"].startswith("full attention, 256 tokens per chunk, 2 layers")
    assert values["g1"].startswith("sliding window 4096, 256 tokens per chunk")
    # A field this version does not know is shown, never dropped.
    assert labels[-2:] == ["other", "new_field"] and values["new_field"] == "x"
    rows = _sizes_rows(_section(run.out, populated.ns))
    assert rows["g1"][1] == "sliding window 4096"
    data = cli("info", "--json").json()
    mine = next(ns for ns in data["namespaces"] if ns["namespace"] == populated.ns)
    assert mine["info"]["new_field"] == "x" and mine["info"]["revision"] == "0123abcd"
    assert set(FINGERPRINT.info_fields()) <= set(mine["info"])


def test_info_shows_what_an_old_namespace_recorded(populated, cli, redis_client):
    """Namespaces written before attention kinds were recorded say kv_group_<N>."""
    info_key = KeySpace("hma", populated.ns).info_key()
    redis_client.hset(info_key, mapping={"g0.kind": "kv_group_0", "g1.kind": "kv_group_1"})
    redis_client.hdel(info_key, "revision")
    run = cli("info")
    values = dict(_fields(_section(run.out, populated.ns)))
    assert values["revision"] == "(not recorded)"
    assert values["g0"].startswith("kv_group_0 (attention kind not recorded)")
    assert _sizes_rows(_section(run.out, populated.ns))["g1"][1] == "kv_group_1"


def test_info_lists_a_namespace_whose_info_hash_was_evicted(populated, cli, redis_client):
    redis_client.delete(KeySpace("hma", OTHER_NS).info_key())
    data = cli("--json", "info").json()
    orphan = next(ns for ns in data["namespaces"] if ns["namespace"] == OTHER_NS)
    assert orphan["info"] == {}
    assert orphan["groups"]["0"]["keys"] == 2
    assert "fingerprint unknown" in cli("info").out


# ---------------------------------------------------------------------------------- ls


def test_ls_pages_through_every_key_exactly_once(populated, cli, redis_client):
    expected = {k.decode() for k in redis_client.scan_iter(match=f"hma:{populated.ns}:*")}
    seen: list[str] = []
    cursor, pages = 0, 0
    while True:
        run = cli(
            "--json", "ls", "--namespace", populated.ns, "--limit", "2", "--cursor", str(cursor)
        )
        assert run.code == 0, run.err
        page = run.json()
        seen += [entry["key"] for entry in page["keys"]]
        pages += 1
        cursor = page["cursor"]
        if cursor == 0:
            break
    assert pages > 1
    assert sorted(seen) == sorted(expected)  # 4 blocks + info + stats, none twice
    sizes = {e["key"]: e for e in cli("--json", "ls", "--limit", "100").json()["keys"]}
    block = populated.blocks[0][0]
    assert sizes[block]["value_bytes"] == redis_client.strlen(block)
    assert sizes[block]["ttl_s"] is None
    assert "user:session:1" not in sizes and "hmax:not-ours" not in sizes


def test_ls_shows_sizes_ttls_and_the_next_cursor(populated, cli, redis_client):
    key = populated.blocks[1][0]
    redis_client.expire(key, 3600)
    run = cli("ls", "--namespace", populated.ns, "--group", "1")
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    assert lines[0].split() == ["type", "value", "bytes", "memory", "ttl", "key"]
    row = next(line.split() for line in lines if key in line)
    assert row[0] == "string" and row[1] == str(redis_client.strlen(key))
    assert row[3] in ("3600s", "3599s")
    assert all(populated.blocks[0][0] not in line for line in lines)
    assert lines[-1] == "end of scan (cursor 0)"
    first = cli("ls", "--limit", "1")
    assert "next cursor:" in first.out.splitlines()[-1]


# ---------------------------------------------------------------------------------- inspect


def test_inspect_verifies_a_good_block(populated, cli):
    key = populated.blocks[1][0]
    run = cli("inspect", key)
    assert run.code == 0, run.err
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in run.out.splitlines())
    assert fields["header.group"] == "1"
    assert fields["first_block"] == "8" and fields["num_blocks"] == "8"
    assert fields["page_bytes"] == "1024,1024" and fields["kv_dtype"] == "bfloat16"
    assert fields["kv_cache_layout"] == "-" and fields["mac"].startswith("none")
    assert fields["body_bytes"] == str(8 * 2048)
    assert fields["checksum"] == "OK" and fields["key echo"] == "OK"
    assert fields["verdict"].startswith("OK")
    data = cli("--json", "inspect", key).json()
    assert data["valid"] and data["checksum_ok"] and data["key_matches"]
    assert data["header"]["key"] == key


def test_inspect_flags_a_corrupted_block(populated, cli, redis_client):
    key = populated.blocks[0][1]
    offset = redis_client.strlen(key) - 10  # a byte of the KV body
    byte = redis_client.getrange(key, offset, offset)
    redis_client.setrange(key, offset, bytes([byte[0] ^ 0xFF]))
    run = cli("inspect", key)
    assert run.code == 1
    assert re.search(r"^checksum +MISMATCH$", run.out, re.M)
    assert "INVALID: checksum mismatch" in run.out
    data = cli("--json", "inspect", key).json()
    assert not data["valid"] and not data["checksum_ok"] and data["key_matches"]


def test_inspect_flags_a_block_copied_under_another_key(populated, cli, redis_client):
    source = populated.blocks[0][0]
    copy = KeySpace("hma", populated.ns).block_key(0, b"\xee" * 32)
    redis_client.set(copy, redis_client.get(source))
    data = cli("--json", "inspect", copy).json()
    assert data["checksum_ok"] and not data["key_matches"] and not data["valid"]
    assert re.search(r"^key echo +MISMATCH$", cli("inspect", copy).out, re.M)


def test_inspect_of_a_missing_key_or_a_hash_is_one_line(populated, cli):
    assert_one_line_error(cli("inspect", "hma:nope:g0:00"))
    run = cli("inspect", str(KeySpace("hma", populated.ns).info_key()))
    assert_one_line_error(run)
    assert "is a hash, not a block" in run.err


# ---------------------------------------------------------------------------------- purge


def test_purge_dry_run_deletes_nothing(populated, cli, redis_client):
    before = redis_client.dbsize()
    run = cli("purge", "--namespace", populated.ns, "--dry-run")
    assert run.code == 0, run.err
    assert "6 keys match" in run.out
    assert cli("--json", "purge", "--all", "--dry-run").json()["matching"] == 6 + 3
    assert redis_client.dbsize() == before


def test_purge_namespace_deletes_only_that_namespace(populated, cli, redis_client):
    run = cli("--json", "purge", "--namespace", populated.ns, "--yes")
    assert run.code == 0, run.err
    assert run.json()["deleted"] == 6
    assert list(redis_client.scan_iter(match=f"hma:{populated.ns}:*")) == []
    assert all(redis_client.exists(k) for k in populated.other_blocks)
    assert redis_client.exists(KeySpace("hma", OTHER_NS).info_key())
    assert all(redis_client.get(k) == v for k, v in FOREIGN_KEYS.items())


def test_purge_all_touches_only_keys_under_the_prefix(populated, cli, redis_client):
    run = cli("purge", "--all", "--yes")
    assert run.code == 0, run.err
    assert "deleted 9 keys" in run.out
    assert sorted(k.decode() for k in redis_client.scan_iter()) == sorted(FOREIGN_KEYS)


def test_purge_without_yes_refuses_when_stdin_is_not_a_terminal(populated, redis_url, redis_client):
    before = redis_client.dbsize()
    run = run_script("--url", redis_url, "purge", "--namespace", populated.ns)
    assert_one_line_error(run)
    assert "--yes" in run.err
    assert redis_client.dbsize() == before


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "deleted"), [("n\n", False), ("", False), ("yes\n", True)])
def test_purge_asks_on_a_terminal_and_obeys_the_answer(
    populated, cli, redis_client, monkeypatch, answer, deleted
):
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    run = cli("purge", "--namespace", populated.ns)
    assert "UNLINK 6 keys matching" in run.err
    assert (run.code == 0) == deleted
    assert redis_client.exists(*populated.blocks[0]) == (0 if deleted else 3)
    assert redis_client.exists(*populated.other_blocks) == 2


def test_purge_rejects_a_namespace_the_tier_would_reject(populated, cli, redis_client):
    run = cli("purge", "--namespace", "*", "--yes")
    assert_one_line_error(run)
    assert run.code == 2 and "namespace must be" in run.err
    # 4 blocks + info + stats, the other namespace's 2 blocks + info, 2 foreign keys.
    assert redis_client.dbsize() == 4 + 2 + 2 + 1 + 2


# ---------------------------------------------------------------------------------- doctor


@pytest.fixture
def server_config(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """Lets a test change the session server's memory settings; restores them afterwards."""
    saved = redis_client.config_get("maxmemory*")
    yield redis_client
    redis_client.config_set("maxmemory", saved["maxmemory"])
    redis_client.config_set("maxmemory-policy", saved["maxmemory-policy"])


def _verdicts(out: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def test_doctor_prints_one_verdict_per_check_and_warns_on_unbounded_memory(
    cli, server_config, monkeypatch
):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    server_config.config_set("maxmemory", 0)
    run = cli("doctor")
    assert run.code == 0, run.out + run.err
    assert all(line.split()[0] in ("OK", "WARN", "FAIL") for line in run.out.splitlines())
    verdicts = _verdicts(run.out)
    assert verdicts["connectivity"] == "OK" and verdicts["version"] == "OK"
    assert verdicts["scripts"] == "OK" and verdicts["cluster"] == "OK"
    assert verdicts["maxmemory"] == "WARN"
    assert verdicts["PYTHONHASHSEED"] == "OK"  # vLLM's default sha256 needs no seed
    assert {"auth", "tls", "maxmemory-policy", "evictions", "persistence"} <= set(verdicts)


def test_info_and_doctor_show_redis_used_and_max_memory(cli, server_config):
    """What INFO memory says, in ``info`` (text and JSON, as the Prometheus gauges count it)
    and in doctor's maxmemory check, in the same words."""
    server_config.config_set("maxmemory", 512 * 1024 * 1024)
    data = cli("--json", "info").json()
    used = server_config.info("memory")["used_memory"]
    memory = data["memory"]
    assert memory["max_bytes"] == 512 * 1024 * 1024 and memory["not_shown"] is None
    assert abs(memory["used_bytes"] - used) < 64 * 1024
    assert memory["by_node"] == {
        data["nodes"][0]: {"used_bytes": memory["used_bytes"], "max_bytes": 512 * 1024 * 1024}
    }
    header = cli("info").out.splitlines()[1]
    assert re.fullmatch(r"Redis memory: used \d+\.\d MiB of max 512\.0 MiB \(\d+%\)", header)
    doctor = {c["check"]: c["detail"] for c in cli("--json", "doctor").json()["checks"]}
    assert re.fullmatch(r"used \d+\.\d MiB of max 512\.0 MiB \(\d+%\)", doctor["maxmemory"])
    server_config.config_set("maxmemory", 0)
    assert cli("--json", "info").json()["memory"]["max_bytes"] == 0
    assert "max 0 (no limit)" in cli("info").out.splitlines()[1]


def test_doctor_accepts_a_bounded_lru_cache(cli, server_config, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "3141592653")
    server_config.config_set("maxmemory", 512 * 1024 * 1024)
    server_config.config_set("maxmemory-policy", "allkeys-lru")
    data = cli("--json", "doctor").json()
    verdicts = {c["check"]: c["verdict"] for c in data["checks"]}
    assert verdicts["maxmemory"] == "OK"
    assert verdicts["maxmemory-policy"] == "OK"
    assert verdicts["PYTHONHASHSEED"] == "OK"
    assert "3141592653" not in json.dumps(data)  # a seed is a secret: never printed
    assert data["failed"] is False


def test_doctor_warns_about_a_well_known_hash_seed(cli, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert _verdicts(cli("doctor").out)["PYTHONHASHSEED"] == "WARN"


def test_doctor_fails_when_redis_is_unreachable(cli):
    run = cli("doctor", url=f"redis://127.0.0.1:{free_port()}/0")
    assert run.code == 1
    assert _verdicts(run.out)["connectivity"] == "FAIL"
    assert "Traceback" not in run.out + run.err


# ---------------------------------------------------------------------------------- errors


def test_unreachable_redis_is_one_line_with_the_password_redacted(cli):
    url = f"redis://admin:{SECRET}@127.0.0.1:{free_port()}/0"
    for command in (["info"], ["ls"], ["inspect", "hma:x:g0:00"], ["purge", "--all", "--yes"]):
        run = cli(*command, url=url)
        assert_one_line_error(run)
        assert run.code == 1
        assert "cannot reach Redis at redis://***@127.0.0.1:" in run.err
        assert SECRET not in run.err + run.out


def test_bench_without_a_usable_lmcache_interpreter_is_one_line(cli, tmp_path):
    missing = tmp_path / "no-such-python"
    run = cli("bench", "--smoke", "--lmcache-python", str(missing))
    assert_one_line_error(run)
    assert run.err == f"hma-redis: bench: --lmcache-python {missing} is not an executable\n"


def test_unreachable_redis_from_the_installed_script():
    port = free_port()
    run = run_script(
        "info",
        env={"HMA_REDIS_URL": f"redis://admin@127.0.0.1:{port}/0", "HMA_REDIS_PASSWORD": SECRET},
    )
    assert_one_line_error(run)
    assert f"cannot reach Redis at redis://***@127.0.0.1:{port}/0" in run.err
    assert SECRET not in run.err + run.out


def test_wrong_password_is_one_line_without_the_password(cli):
    run = cli("--username", "nobody", "--password", SECRET, "info")
    assert_one_line_error(run)
    assert "refused the credentials" in run.err
    assert SECRET not in run.err + run.out


def test_bad_url_is_a_configuration_error(cli):
    run = cli("info", url=f"http://admin:{SECRET}@host:1/0")
    assert_one_line_error(run)
    assert run.code == 2
    assert "--url scheme must be one of" in run.err and SECRET not in run.err
    assert_one_line_error(cli("info", url="redis://host:99999/0"))
    assert_one_line_error(cli("--prefix", "bad prefix!", "info"))


def test_json_output_of_the_installed_script_parses(populated, redis_url):
    run = run_script("--url", redis_url, "--json", "info")
    assert run.code == 0, run.err
    assert {ns["namespace"] for ns in run.json()["namespaces"]} == {populated.ns, OTHER_NS}
    for command in (["ls", "--limit", "3"], ["purge", "--all", "--dry-run"], ["doctor"]):
        run = run_script("--url", redis_url, "--json", *command)
        assert run.code == 0, run.err
        assert isinstance(run.json(), dict)


def test_prefix_selects_another_tree(populated, cli, redis_client):
    redis_client.set("team2:ns:g0:" + "ab" * 32, b"x")
    data = cli("--prefix", "team2", "--json", "info").json()
    assert [ns["namespace"] for ns in data["namespaces"]] == ["ns"]
    assert data["namespaces"][0]["groups"]["0"]["keys"] == 1


# ---------------------------------------------------------------------------------- tls, auth


def test_tls_and_password_options_reach_the_server(tmp_path, cli):
    from tests.support.tls_certs import TlsLocalRedis, make_tls_files

    files = make_tls_files(tmp_path)
    server = TlsLocalRedis(files)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start a TLS redis-server: {exc}", pytrace=False)
    try:
        server.tls_client().config_set("requirepass", SECRET)
        tls = ["--tls-ca-file", files.ca_cert]
        tls += ["--tls-cert-file", files.client_cert, "--tls-key-file", files.client_key]
        run = cli(*tls, "--password", SECRET, "doctor", url=server.url)
        verdicts = _verdicts(run.out)
        assert verdicts["tls"] == "OK" and "certificate verified" in run.out
        assert verdicts["auth"] == "OK" and verdicts["connectivity"] == "OK"
        assert SECRET not in run.out + run.err

        refused = cli(*tls, "info", url=server.url)  # no password
        assert_one_line_error(refused)
        assert MISSING_PASSWORD in refused.err
        unverified = cli(
            "--tls-cert-file",
            files.client_cert,
            "--tls-key-file",
            files.client_key,
            "--password",
            SECRET,
            "info",
            url=server.url,
        )
        assert_one_line_error(unverified)
        assert "CERTIFICATE_VERIFY_FAILED" in unverified.err and SECRET not in unverified.err
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- conventions


def test_global_options_are_accepted_after_the_command(populated, cli, redis_url):
    before = cli("--json", "info").json()
    after = run_script("info", "--json", "--url", redis_url, "--prefix", "hma")
    assert after.code == 0, after.err
    assert after.json()["namespaces"] == before["namespaces"]
    page = cli("ls", "--json", "--limit", "3", "--namespace", populated.ns, url=None)
    assert page.code == 1  # without --url: the default URL, where nothing listens
    page = cli("ls", "--url", redis_url, "--json", "--limit", "3", url=None)
    assert page.code == 0, page.err
    assert len(page.json()["keys"]) >= 3
    doctor = cli("doctor", "--json")
    assert doctor.code == 0 and doctor.json()["failed"] is False
    # Given on both sides, the one after the command wins.
    run = cli("--prefix", "nope", "purge", "--all", "--dry-run", "--prefix", "hma", "--json")
    assert run.json()["matching"] == 9


# ---------------------------------------------------------------------------------- hostile input

HOSTILE = "\x1b]0;owned\x07\x1b[2J\ninjected line\x00\x9b\u202e"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _assert_inert(text: str) -> None:
    """No control character and no line beyond the ones the CLI meant to print."""
    assert not CONTROL.search(text), repr(text)
    assert "\ninjected line" not in text


def test_hostile_strings_from_redis_are_escaped_in_every_output(populated, cli, redis_client):
    ns = KeySpace("hma", populated.ns)
    key = ns.block_key(0, b"\xab" * 32)
    header = codec.BlockHeader(
        key=f"{key}{HOSTILE}", group=0, first_block=0, num_blocks=1, page_bytes=(64,),
        kv_dtype=f"bf16{HOSTILE}",
    )  # fmt: skip
    redis_client.set(key, codec.encode(header, os.urandom(64)))
    redis_client.hset(ns.info_key(), mapping={"model": f"m{HOSTILE}", f"x{HOSTILE}": HOSTILE})
    redis_client.set(f"hma:{populated.ns}:weird{HOSTILE}".encode(), b"v")

    inspect = cli("inspect", key)
    assert inspect.code == 1  # the key echo does not match
    _assert_inert(inspect.out)
    assert "\\x1b]0;owned\\x07\\x1b[2J\\ninjected line\\x00\\x9b\\u202e" in inspect.out
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in inspect.out.splitlines())
    assert lines["kv_dtype"] == "bf16\\x1b]0;owned\\x07\\x1b[2J\\ninjected line\\x00\\x9b\\u202e"
    assert inspect.out.count("\n") == len(lines)

    for command in (["info"], ["info", "--by-node"], ["ls", "--limit", "100"]):
        run = cli(*command)
        assert run.code == 0, run.err
        _assert_inert(run.out)
        assert "\\x1b]0;owned" in run.out
    for command in (["info"], ["inspect", key], ["ls", "--limit", "100"]):
        raw = cli("--json", *command).out
        _assert_inert(raw)
        json.loads(raw)  # and the JSON keeps the strings exactly
    assert cli("--json", "inspect", key).json()["header"]["kv_dtype"] == f"bf16{HOSTILE}"

    error = cli("inspect", f"hma:nope{HOSTILE}")
    assert_one_line_error(error)
    _assert_inert(error.err)


def test_inspect_verifies_the_mac_with_the_tier_auth_key(populated, cli, redis_client, tmp_path):
    secret = b"an auth key of at least 16 bytes"
    key = KeySpace("hma", populated.ns).block_key(0, b"\xcd" * 32)
    header = block_header(key, 0, 4)
    value = codec.encode(header, os.urandom(header.body_bytes), mac_key=codec.MacKey.derive(secret))
    redis_client.set(key, value)
    key_file = tmp_path / "auth_key"
    key_file.write_bytes(secret)

    unverified = cli("--json", "inspect", key).json()
    assert unverified["mac"] == "unverified" and not unverified["valid"]
    assert "not checked (no auth_key" in cli("inspect", key).out
    verified = cli("inspect", key, "--auth-key-file", str(key_file), "--json").json()
    assert verified["mac"] == "verified" and verified["valid"] and verified["checksum_ok"]
    other = tmp_path / "other_key"
    other.write_bytes(b"another key, also 16 bytes or more")
    wrong = cli("--auth-key-file", str(other), "--json", "inspect", key).json()
    assert wrong["mac"] == "invalid" and not wrong["valid"]
    plain = cli("--auth-key-file", str(key_file), "--json", "inspect", populated.blocks[0][0])
    assert plain.json()["mac"] == "invalid"  # a keyed tier refuses values without a MAC


def test_inspect_opens_sealed_values_with_the_tier_encryption_key(
    populated, cli, redis_client, tmp_path
):
    """A sealed value: unverified without the key (never OK), verified and valid with it or
    with it as the previous key of a rotation, invalid when altered; the key never printed."""
    secret = b"an encryption key of at least 16 bytes"
    key = KeySpace("hma", populated.ns).block_key(0, b"\xcf" * 32)
    header = block_header(key, 0, 4)
    body = os.urandom(header.body_bytes)
    value = bytes(codec.encode(header, body, keyring=Keyring.from_secrets(secret)))
    redis_client.set(key, value)
    key_file = tmp_path / "encryption_key"
    key_file.write_bytes(secret)
    new_file = tmp_path / "new_key"
    new_file.write_bytes(b"the next encryption key, 16 bytes or more")

    unkeyed = cli("--json", "inspect", key).json()
    assert unkeyed["encryption"] == "unverified" and not unkeyed["valid"]
    assert unkeyed["header"]["key_id"] == SealKey.derive(secret).key_id
    run = cli("--encryption-key-file", str(key_file), "inspect", key)
    assert run.code == 0 and "OK (decrypted" in run.out, run
    assert secret.decode() not in run.out + run.err
    rotating = cli(
        "--encryption-key-file",
        str(new_file),
        "--encryption-key-previous-file",
        str(key_file),
        "--json",
        "inspect",
        key,
    ).json()
    assert rotating["encryption"] == "verified" and rotating["valid"]
    damaged = bytearray(value)
    damaged[-10] ^= 0xFF
    damaged[12:16] = crc32c.crc32c(bytes(damaged[codec.PREFIX_BYTES :])).to_bytes(4, "big")
    redis_client.set(key, bytes(damaged))
    bad = cli("--encryption-key-file", str(key_file), "--json", "inspect", key).json()
    assert bad["encryption"] == "invalid" and not bad["valid"] and bad["checksum_ok"]
    plain = cli("--encryption-key-file", str(key_file), "--json", "inspect", populated.blocks[0][0])
    assert plain.json()["encryption"] == "invalid"  # an encrypting tier refuses plain values


def _mac_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("mac "))


@pytest.mark.parametrize(
    ("damage", "mac", "shown"),
    [
        # A KV byte flipped: the checksum fails first, and the MAC, checked anyway, fails too.
        ("body", "invalid", "BAD"),
        # Only the CRC field altered: the MAC over header and body still matches.
        ("crc", "verified", "OK (checked"),
        # Too short for a prefix: nothing can be checked, and the line says so.
        ("truncated", "unreadable", "not checked (decoding stopped"),
    ],
)
def test_inspect_says_whether_the_mac_was_checked_whatever_else_failed(
    populated, cli, redis_client, tmp_path, damage, mac, shown
):
    secret = b"an auth key of at least 16 bytes"
    key = KeySpace("hma", populated.ns).block_key(0, b"\xce" * 32)
    header = block_header(key, 0, 4)
    value = bytearray(
        codec.encode(header, os.urandom(header.body_bytes), mac_key=codec.MacKey.derive(secret))
    )
    if damage == "body":
        value[-10] ^= 0xFF
    elif damage == "crc":
        value[12] ^= 0xFF
    else:
        value = value[:20]
    redis_client.set(key, bytes(value))
    key_file = tmp_path / "auth_key"
    key_file.write_bytes(secret)

    run = cli("--auth-key-file", str(key_file), "inspect", key)
    assert run.code == 1  # never a valid block
    assert _mac_line(run.out).split(None, 1)[1].startswith(shown), run.out
    data = cli("--auth-key-file", str(key_file), "--json", "inspect", key).json()
    assert data["mac"] == mac and not data["valid"]
    if damage != "truncated":
        assert "checksum mismatch" in data["error"] and not data["checksum_ok"]
    # Without the key the MAC is never said to be OK.
    unkeyed = _mac_line(cli("inspect", key).out)
    assert "OK" not in unkeyed and ("not checked" in unkeyed), unkeyed


# ---------------------------------------------------------------------------------- README

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_commands() -> list[list[str]]:
    """Every ``hma-redis ...`` command line in the README's code blocks, as argv."""
    commands = []
    in_code = False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = re.match(r"^(?:\$ |\.venv/bin/)?hma-redis(?P<args>(?: .*)?)$", line.split("  #")[0])
        if in_code and match:
            commands.append(shlex.split(match.group("args")))
    return commands


def test_every_command_the_readme_shows_exists_with_the_flags_shown():
    from hma_redis.tools.bench import tier as bench_tier
    from hma_redis.tools.cli.main import build_parser

    commands = _readme_commands()
    assert {argv[0] for argv in commands} >= {"info", "ls", "inspect", "doctor", "purge", "bench"}
    for argv in commands:
        try:
            args, rest = build_parser().parse_known_args(argv)
            if args.command == "bench":
                bench_tier.build_parser().parse_args(rest)
            else:
                assert rest == [], f"README: hma-redis {' '.join(argv)}: unknown {rest}"
        except SystemExit:
            pytest.fail(f"README shows a command the CLI rejects: hma-redis {' '.join(argv)}")


def test_password_file_reaches_the_server(local_redis, cli, tmp_path):
    redis.Redis(port=local_redis.port).config_set("requirepass", SECRET)
    secret_file = tmp_path / "password"
    secret_file.write_text(SECRET + "\n")
    run = cli("info", "--password-file", str(secret_file), url=local_redis.url)
    assert run.code == 0, run.err
    refused = cli("info", url=local_redis.url)
    assert_one_line_error(refused)
    assert MISSING_PASSWORD in refused.err


def test_console_script_is_this_cli() -> None:
    """The ``hma-redis`` command pip installs (pyproject.toml's entry point) runs this main."""
    scripts = tomllib.loads((README.parent / "pyproject.toml").read_text())
    module, _, name = scripts["project"]["scripts"]["hma-redis"].partition(":")
    assert getattr(importlib.import_module(module), name) is main


def test_each_command_is_a_module_named_for_it() -> None:
    """Every command the parser knows lives in ``hma_redis.tools.cli.commands.<name>``, which
    says in its docstring what the command does; main.py only assembles and dispatches."""
    from hma_redis.tools.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in sub.choices:
        module = importlib.import_module(f"hma_redis.tools.cli.commands.{name}")
        assert name == module.NAME
        assert (module.__doc__ or "").startswith(f"``hma-redis {name}"), name
    main_py = Path(importlib.import_module("hma_redis.tools.cli.main").__file__ or "")
    assert len(main_py.read_text().splitlines()) < 300


def test_missing_password_is_one_clear_line(local_redis, cli, monkeypatch):
    monkeypatch.delenv("HMA_REDIS_PASSWORD", raising=False)
    redis.Redis(port=local_redis.port).config_set("requirepass", SECRET)
    for command in (["info"], ["ls"], ["purge", "--all", "--yes"]):
        run = cli(*command, url=local_redis.url)
        assert_one_line_error(run)
        assert run.err.startswith(f"hma-redis: {MISSING_PASSWORD}"), run.err
        assert "HELLO" not in run.err


def test_doctor_fails_auth_when_redis_wants_a_password_it_did_not_get(
    local_redis, cli, monkeypatch
):
    monkeypatch.delenv("HMA_REDIS_PASSWORD", raising=False)
    redis.Redis(port=local_redis.port).config_set("requirepass", SECRET)
    run = cli("doctor", url=local_redis.url)
    assert run.code == 1
    auth = [line for line in run.out.splitlines() if line.split()[1] == "auth"]
    assert auth == [f"FAIL  auth            {MISSING_PASSWORD}"]
    assert "HELLO" not in run.out


def test_ls_takes_a_group_as_info_names_it(populated, cli):
    named = cli("--json", "ls", "--namespace", populated.ns, "--group", "g1", "--limit", "100")
    assert named.code == 0, named.err
    assert sorted(e["key"] for e in named.json()["keys"]) == sorted(populated.blocks[1])
    numbered = cli("--json", "ls", "--namespace", populated.ns, "--group", "1", "--limit", "100")
    assert numbered.json()["keys"] == named.json()["keys"]
    assert cli("ls", "--group", "x1").code == 2


def test_a_closed_stdout_ends_quietly(populated, redis_url):
    """``hma-redis info | head -1``: the reader went away; that is no Redis error."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        proc = subprocess.run(
            [*cli_command(), "--url", redis_url, "info"],
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize(
    ("given", "ours"),
    [
        ("redis-cluster://127.0.0.1:7000/", "redis+cluster"),
        ("rediss-cluster://127.0.0.1:7000/", "rediss+cluster"),
        ("redis-sentinel://127.0.0.1:26379/mymaster", "redis+sentinel"),
    ],
)
def test_other_backends_url_spellings_are_refused_with_ours(cli, given, ours):
    run = cli("info", url=given)
    assert_one_line_error(run)
    assert run.code == 2
    scheme = given.split("://")[0]
    assert f"--url scheme {scheme}:// is spelled {ours}:// in hma_redis" in run.err


# ---------------------------------------------------------------------------------- small ones


def test_version_names_the_installed_package():
    run = run_script("--version")
    assert run.code == 0, run.err
    assert run.out == f"hma-redis {importlib.metadata.version('hma_redis')}\n"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["lss"], "invalid choice: 'lss'"),
        ([], "the following arguments are required: COMMAND"),
        (["ls", "--limit", "x"], "argument --limit: not an integer: 'x'"),
        (["purge"], "one of the arguments --namespace --all is required"),
    ],
)
def test_usage_errors_are_one_line_with_a_hint(cli, argv, says):
    run = cli(*argv, url=None)
    assert run.code == 2
    assert run.err.count("\n") == 1, run.err
    assert says in run.err
    assert run.err.rstrip().endswith("--help)")
    assert "usage:" not in run.err


def test_purge_of_a_namespace_without_keys_exits_non_zero(populated, cli, redis_client):
    before = redis_client.dbsize()
    for extra in (["--yes"], ["--dry-run"]):
        run = cli("purge", "--namespace", "no-such-namespace", *extra)
        assert run.code == 1
        assert "no keys in namespace 'no-such-namespace'" in run.err
    assert redis_client.dbsize() == before
    assert cli("purge", "--namespace", populated.ns, "--yes").code == 0


def test_ls_continuation_hint_keeps_the_filters(populated, cli):
    seen: list[str] = []
    args = ["ls", "--namespace", populated.ns, "--group", "g0", "--limit", "1"]
    for _ in range(100):
        run = cli(*args)
        assert run.code == 0, run.err
        seen += [line.split()[-1] for line in run.out.splitlines() if line.startswith("string")]
        last = run.out.splitlines()[-1]
        if last == "end of scan (cursor 0)":
            break
        hint = last.split("(continue with: ")[1].rstrip(")")
        assert hint.startswith(f"ls --namespace {populated.ns} --group g0 --limit 1 --cursor ")
        args = shlex.split(hint)
    assert sorted(seen) == sorted(populated.blocks[0])


def test_info_header_shows_the_db_chosen(populated, cli, redis_url):
    run = cli("--db", "5", "info")
    assert run.code == 0, run.err
    assert run.out.splitlines()[0].startswith(f"{redis_url} (one server, db 5)")


# ---------------------------------------------------------------------------------- --json schemas


def _validate(command: str, data: Any) -> None:
    jsonschema.Draft202012Validator(SCHEMAS[command]).validate(data)


def test_every_commands_json_output_matches_its_schema(populated, cli, redis_client):
    for command in (["info"], ["info", "--by-node"], ["ls", "--limit", "100"], ["doctor"]):
        run = cli("--json", *command)
        _validate(command[0], run.json())
    namespaces = {ns["namespace"]: ns for ns in cli("--json", "info").json()["namespaces"]}
    # A hybrid namespace has per-group estimates; one without an info hash says why not.
    assert set(namespaces[populated.ns]["unusable"]["groups"]) == {"0", "1"}
    assert namespaces[OTHER_NS]["unusable"]["groups"] == {}
    assert namespaces[OTHER_NS]["unusable"]["not_estimated"]
    good, bad = populated.blocks[0][:2]
    redis_client.setrange(bad, 100, b"\x00garbage")
    redis_client.set("hma:junk:g0:00", b"not a block")
    for key in (good, bad, "hma:junk:g0:00"):
        _validate("inspect", cli("--json", "inspect", key).json())
    _validate("purge", cli("--json", "purge", "--all", "--dry-run").json())
    _validate("purge", cli("--json", "purge", "--namespace", OTHER_NS, "--yes").json())


def test_errors_under_json_are_json(cli):
    for url, code in ((f"redis://127.0.0.1:{free_port()}/0", 1), ("http://h:1/0", 2)):
        for command in (["info"], ["ls"], ["purge", "--all", "--yes"]):
            run = cli("--json", *command, url=url)
            assert (run.code, run.err) == (code, ""), run
            _validate("error", run.json())
            assert run.json()["error"]["exit_code"] == code


def test_cli_json_doc_is_the_schemas_of_the_code():
    doc = README.parent / "docs" / "cli-json.md"
    assert doc.read_text() == schema_markdown(), (
        "regenerate: python -m hma_redis.tools.cli.schemas > docs/cli-json.md"
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--url", "http://h:1/0"], "--url scheme must be one of"),
        (["--prefix", "bad prefix!"], "--prefix must be"),
        (["--connect-timeout", "-1"], "--connect-timeout must be"),
        (["--read-timeout", "0"], "--read-timeout must be"),
        (["--password-file", "/no/such/file"], "--password-file cannot be read"),
        (["--url", "redis+cluster://h:1/", "--db", "2"], "--db must be 0 with Redis Cluster"),
    ],
)
def test_configuration_errors_name_the_cli_option(cli, argv, says):
    run = cli(*argv, "info", url=None)
    assert_one_line_error(run)
    assert run.code == 2
    assert says in run.err
    assert not re.search(r"redis_url|key_prefix|_timeout_s|password_file", run.err), run.err


def test_a_url_from_the_environment_is_named_by_its_variable(cli, monkeypatch):
    monkeypatch.setenv("HMA_REDIS_URL", "http://h:1/0")
    run = cli("info", url=None)
    assert "the URL ($HMA_REDIS_URL or $REDIS_URL) scheme must be one of" in run.err


def test_operations_md_shows_the_notifications_warning_doctor_prints(local_redis, cli):
    """docs/operations.md's doctor line for a Redis without keyspace events is the one doctor
    prints on a fresh server (numbers and addresses aside)."""
    out = cli("doctor", url=f"redis://127.0.0.1:{local_redis.port}/0").out
    (line,) = [x for x in out.splitlines() if x.split()[1:2] == ["notifications"]]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    blocks = doc.split("```")[1::2]
    (shown,) = [b for b in blocks if "notifications" in b and b.lstrip().startswith("WARN")]
    assert shape(shown) == shape(line), line
