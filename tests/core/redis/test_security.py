"""Security features against real Redis servers (no mocks, no skips).

* TLS: a private TLS-only ``redis-server`` (client certificates required) with a throwaway CA;
  the store works with the right files, fails with one clear line without them, and
  ``tls_verify: false`` turns verification off.
* ACL: a private ``redis-server`` whose default user is disabled; the store works as a user
  restricted to ``hma:*``, Redis refuses other keys, and the password never shows up in
  messages, logs, ``repr`` or ``str`` - also one of every printable character, unencoded in
  the URL, or one given through ``HMA_REDIS_PASSWORD`` / ``password_file`` / ``HMA_REDIS_URL``.
* Values a reader must refuse, through real transfer engines in one (explicit) namespace:
  another KV dtype or kv_cache_layout, no MAC / another auth_key's MAC, a forged body with a
  fixed CRC.

Tenants kept apart by ``cache_salt`` and ``auth_key`` across real vLLM engines:
tests/engine/test_tenants.py.
"""

from __future__ import annotations

import logging
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.retry import Retry

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.breaker import MISSING_PASSWORD
from hma_redis.core.redis.store import RedisBlockStore, RedisUnavailableError
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import ChunkTransfer, ValueFormat
from hma_redis.core.transfer.pages import LayerSource
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.kv_pages import as_before_or_cleared
from tests.support.tls_certs import TlsFiles, TlsLocalRedis, make_tls_files

# Raw clients that are expected to fail: fail at once (redis-py retries with backoff by default).
NO_RETRY = Retry(NoBackoff(), 0)


def _store(extra: dict[str, Any]) -> RedisBlockStore:
    return RedisBlockStore(RedisTierConfig.from_extra_config(extra, env={}))


def _ping_error(store: RedisBlockStore) -> str:
    """The message of the RedisUnavailableError that ``store.ping()`` must raise."""
    with pytest.raises(RedisUnavailableError) as info:
        store.ping()
    store.close()
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    assert message.startswith("hma_redis: cannot reach Redis at "), message
    return message


def _round_trip(store: RedisBlockStore, key: str, value: bytes) -> None:
    """put_if_absent / exists / get / delete through ``store`` on a key nobody else uses."""
    store.ping()
    assert store.put_if_absent([(key, value)]) == [PutResult.STORED]
    assert store.put_if_absent([(key, b"other bytes")]) == [PutResult.EXISTED]
    assert store.exists([key, key + ":absent"]) == [True, False]
    assert store.get([key, key + ":absent"]) == [value, None]
    assert store.delete([key]) == 1
    assert store.exists([key]) == [False]


# ---------------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def _start_tls_redis(files: TlsFiles) -> TlsLocalRedis:
    try:
        return TlsLocalRedis(files).start()
    except RuntimeError as exc:
        pytest.fail(
            f"cannot start a TLS redis-server (needs redis-server built with TLS): {exc}",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def tls_redis(tls_files: TlsFiles) -> Iterator[TlsLocalRedis]:
    server = _start_tls_redis(tls_files)
    yield server
    server.stop()


def _tls_extra(server: TlsLocalRedis, **overrides: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "redis_url": server.url,
        "tls_ca_file": server.files.ca_cert,
        "tls_cert_file": server.files.client_cert,
        "tls_key_file": server.files.client_key,
    }
    extra.update(overrides)
    return {k: v for k, v in extra.items() if v is not None}


def test_tls_server_accepts_no_plaintext(tls_redis: TlsLocalRedis) -> None:
    # The server really is TLS-only, so the store below can only have talked TLS to it.
    plain = redis.Redis(
        port=tls_redis.port, socket_timeout=1, socket_connect_timeout=1, retry=NO_RETRY
    )
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    plain.close()


def test_tls_store_round_trip_with_ca_and_client_cert(tls_redis: TlsLocalRedis) -> None:
    cfg = RedisTierConfig.from_extra_config(_tls_extra(tls_redis), env={})
    assert cfg.tls
    store = RedisBlockStore(cfg)
    key = "hma:tls-test:g0:" + "ab" * 16
    store.ping()
    assert store.put_if_absent([(key, b"kv bytes over tls")]) == [PutResult.STORED]
    assert store.exists([key, key + "x"]) == [True, False]
    assert store.get([key]) == [b"kv bytes over tls"]
    store.close()
    raw = tls_redis.tls_client()
    assert raw.get(key) == b"kv bytes over tls"  # really stored on the TLS server
    raw.delete(key)
    raw.close()


def test_tls_verify_false_accepts_a_server_cert_from_an_unknown_ca(
    tls_redis: TlsLocalRedis,
) -> None:
    store = _store(_tls_extra(tls_redis, tls_ca_file=None, tls_verify=False))
    _round_trip(store, "hma:tls-test:noverify", b"unverified but encrypted")
    store.close()


@pytest.mark.parametrize(
    ("case", "overrides", "expected"),
    [
        # tls_verify defaults to true: the test CA is not in the system store.
        pytest.param("no CA file", {"tls_ca_file": None}, "CERTIFICATE_VERIFY_FAILED", id="no-ca"),
        # The server requires client certificates (tls-auth-clients yes).
        pytest.param(
            "no client cert",
            {"tls_cert_file": None, "tls_key_file": None},
            "ConnectionError",
            id="no-client-cert",
        ),
    ],
)
def test_tls_misconfiguration_fails_with_one_clear_line(
    tls_redis: TlsLocalRedis, case: str, overrides: dict[str, Any], expected: str
) -> None:
    store = _store(_tls_extra(tls_redis, **overrides))
    message = _ping_error(store)
    assert f"rediss://127.0.0.1:{tls_redis.port}/0" in message, message
    assert expected in message, f"{case}: {message}"
    # At run time the same failure degrades instead of raising.
    store = _store(_tls_extra(tls_redis, **overrides))
    assert store.exists(["hma:tls-test:k"]) == [False]
    assert store.put_if_absent([("hma:tls-test:k", b"v")]) == [PutResult.FAILED]
    assert store.get(["hma:tls-test:k"]) == [None]
    store.close()


def test_plain_url_against_a_tls_port_fails_with_one_line(tls_redis: TlsLocalRedis) -> None:
    message = _ping_error(_store({"redis_url": f"redis://127.0.0.1:{tls_redis.port}/0"}))
    assert f"redis://127.0.0.1:{tls_redis.port}/0" in message


def test_tls_verify_checks_the_host_name(tmp_path: Path) -> None:
    # A certificate from the trusted CA, but issued for another host: verification must fail
    # on the name alone; tls_verify=false accepts it.
    files = make_tls_files(tmp_path, server_names=("redis.other.example",))
    server = _start_tls_redis(files)
    try:
        message = _ping_error(_store(_tls_extra(server)))
        assert "CERTIFICATE_VERIFY_FAILED" in message and "mismatch" in message, message
        store = _store(_tls_extra(server, tls_verify=False))
        _round_trip(store, "hma:tls-test:hostname", b"v")
        store.close()
    finally:
        server.stop()


def test_tls_files_need_a_rediss_url(tls_files: TlsFiles) -> None:
    with pytest.raises(ValueError, match="tls_ca_file needs a rediss://"):
        RedisTierConfig.from_extra_config(
            {"redis_url": "redis://127.0.0.1:6379/0", "tls_ca_file": tls_files.ca_cert}, env={}
        )


# ---------------------------------------------------------------------------------------- ACL

USER = "tier"
PASSWORD = "Tier-s3cret-7f2b9c"  # distinctive, so a leak is easy to find in any text
WRONG_PASSWORD = "Wrong-s3cret-41d8e0"
SPECIAL_USER = "tier-special"
SPECIAL_PASSWORD = "p@ss:w/rd?#%&=+ ü"
# Every printable character but whitespace, written into URLs unencoded.
PRINTABLE_USER = "tier-printable"
PRINTABLE_PASSWORD = "".join(c for c in string.printable if not c.isspace())
MIN_USER = "tier-min"
ADMIN_USER = "admin"
ADMIN_PASSWORD = "Admin-s3cret-0a1b2c"
# Exactly the commands RedisBlockStore sends (least privilege an operator can grant).
STORE_COMMANDS = ("ping", "eval", "exists", "set", "get", "unlink", "hset", "hgetall", "hincrby")


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[LocalRedis]:
    """A private redis-server: users ``tier`` (``~hma:* +@all -@dangerous``), ``tier-special``
    (same rights, a password full of URL metacharacters), ``tier-min`` (only the store's
    commands), ``admin``; the default user is off."""
    try:
        server = LocalRedis().start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    setup = redis.Redis(port=server.port, socket_timeout=2)
    acl = ["resetkeys", "~hma:*", "resetchannels"]
    for user, password in (
        (USER, PASSWORD),
        (SPECIAL_USER, SPECIAL_PASSWORD),
        (PRINTABLE_USER, PRINTABLE_PASSWORD),
    ):
        setup.execute_command(
            "ACL", "SETUSER", user, "on", f">{password}", *acl, "+@all", "-@dangerous"
        )
    setup.execute_command(
        "ACL", "SETUSER", MIN_USER, "on", f">{PASSWORD}", *acl, "-@all",
        *(f"+{c}" for c in STORE_COMMANDS),
    )  # fmt: skip
    setup.execute_command(
        "ACL", "SETUSER", ADMIN_USER, "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all"
    )
    setup.execute_command("ACL", "SETUSER", "default", "off")
    setup.close()
    yield server
    server.stop()


@pytest.fixture
def admin(acl_redis: LocalRedis) -> Iterator[redis.Redis]:
    client = redis.Redis(
        port=acl_redis.port, username=ADMIN_USER, password=ADMIN_PASSWORD, socket_timeout=2
    )
    client.flushall()
    yield client
    client.close()


def _url(server: LocalRedis, user: str | None = None, password: str | None = None) -> str:
    auth = ""
    if user is not None:
        auth = quote(user, safe="")
        if password is not None:
            auth += ":" + quote(password, safe="")
        auth += "@"
    return f"redis://{auth}127.0.0.1:{server.port}/0"


def test_acl_user_in_url_can_use_hma_keys(acl_redis: LocalRedis, admin: redis.Redis) -> None:
    store = _store({"redis_url": _url(acl_redis, USER, PASSWORD)})
    _round_trip(store, "hma:acl-test:g0:" + "cd" * 16, b"acl bytes")
    assert store.write_info("hma:acl-test:info", {"model": "m"})
    assert store.read_hash("hma:acl-test:info") == {"model": "m"}
    assert store.put_if_absent([("hma:acl-test:kept", b"v")]) == [PutResult.STORED]
    store.close()
    assert admin.get("hma:acl-test:kept") == b"v"
    assert admin.acl_whoami() == ADMIN_USER


def test_redis_refuses_keys_outside_the_user_pattern(
    acl_redis: LocalRedis, admin: redis.Redis
) -> None:
    raw = redis.Redis(port=acl_redis.port, username=USER, password=PASSWORD, socket_timeout=2)
    assert raw.acl_whoami() == USER
    raw.set("hma:acl-test:allowed", b"v")
    for attempt in (
        lambda: raw.set("other:key", b"v"),
        lambda: raw.get("other:key"),
        lambda: raw.exists("other:key"),
    ):
        with pytest.raises(NoPermissionError):
            attempt()
    with pytest.raises(NoPermissionError):  # -@dangerous
        raw.flushall()
    raw.close()

    # Through the store: a refused SET is FAILED for that key only, a refused GET is None.
    store = _store({"redis_url": _url(acl_redis, USER, PASSWORD)})
    assert store.put_if_absent([("other:key", b"v"), ("hma:acl-test:ok", b"v")]) == [
        PutResult.FAILED,
        PutResult.STORED,
    ]
    assert store.get(["other:key", "hma:acl-test:ok"]) == [None, b"v"]
    store.close()
    assert admin.exists("other:key") == 0
    assert admin.get("hma:acl-test:ok") == b"v"

    # Without credentials the default user is off: nothing at all.
    anonymous = redis.Redis(port=acl_redis.port, socket_timeout=2, retry=NO_RETRY)
    with pytest.raises(AuthenticationError):
        anonymous.get("hma:acl-test:ok")
    anonymous.close()


def test_least_privilege_acl_is_enough_for_the_store(
    acl_redis: LocalRedis, admin: redis.Redis
) -> None:
    store = _store({"redis_url": _url(acl_redis, MIN_USER, PASSWORD)})
    _round_trip(store, "hma:acl-test:g0:" + "ef" * 16, b"least privilege")
    assert store.write_info("hma:acl-test:info", {"model": "m"})
    assert store.read_hash("hma:acl-test:info") == {"model": "m"}
    assert store.breaker.failures == 0
    store.close()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(
            {"url_user": USER, "url_password": WRONG_PASSWORD}, id="wrong-password-in-url"
        ),
        pytest.param({"username": USER, "password": WRONG_PASSWORD}, id="wrong-password-key"),
        pytest.param({}, id="no-credentials"),
    ],
)
def test_bad_credentials_fail_with_one_line_and_never_show_a_password(
    acl_redis: LocalRedis, extra: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    keys = {k: v for k, v in extra.items() if not k.startswith("url_")}
    config: dict[str, Any] = {
        "redis_url": _url(acl_redis, extra.get("url_user"), extra.get("url_password")),
        "retry_interval_s": 0.05,
        **keys,
    }
    message = _ping_error(_store(config))
    # A wrong password is the server's refusal; none at all is named as what to set.
    expected = "AuthenticationError" if extra else MISSING_PASSWORD
    assert expected in message, message
    # Run time: the store degrades, the breaker logs the failure (redacted).
    store = _store(config)
    assert store.exists(["hma:acl-test:k"]) == [False]
    time.sleep(0.1)
    assert store.put_if_absent([("hma:acl-test:k", b"v")]) == [PutResult.FAILED]
    store.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "hma_redis" in logged, "the failure was not logged"
    cfg = RedisTierConfig.from_extra_config(config, env={})
    for text in (message, logged, repr(cfg), str(cfg), f"{cfg}", cfg.redacted_url):
        for secret in (PASSWORD, WRONG_PASSWORD, quote(WRONG_PASSWORD, safe="")):
            assert secret not in text, f"password leaked into: {text}"


def test_config_repr_and_errors_never_contain_the_password(acl_redis: LocalRedis) -> None:
    for extra in (
        {"redis_url": _url(acl_redis, USER, PASSWORD)},
        {"redis_url": _url(acl_redis, SPECIAL_USER, SPECIAL_PASSWORD)},
        {"redis_url": _url(acl_redis), "username": USER, "password": PASSWORD},
    ):
        cfg = RedisTierConfig.from_extra_config(extra, env={})
        assert cfg.password in (PASSWORD, SPECIAL_PASSWORD)
        for text in (repr(cfg), str(cfg), f"{cfg!r}", cfg.redacted_url):
            assert cfg.password not in text and quote(cfg.password, safe="") not in text, text
        assert "password='***'" in repr(cfg)
    # Bad configurations that carry a password: the one-line error names the field only.
    bad = [
        {"redis_url": f"redis://{USER}:{PASSWORD}@127.0.0.1:99999/0"},
        {"redis_url": f"redis://{USER}:{PASSWORD}@127.0.0.1:6379/0?password={PASSWORD}"},
        {"redis_url": f"ftp://{USER}:{PASSWORD}@127.0.0.1:6379/0"},
        {"redis_url": f"redis://{USER}:{PASSWORD}@127.0.0.1:6379/x"},
        {"redis_url": _url(acl_redis, USER, PASSWORD), "pool_size": 0},
    ]
    for extra in bad:
        with pytest.raises(ValueError) as info:
            RedisTierConfig.from_extra_config(extra, env={})
        message = str(info.value)
        assert PASSWORD not in message and "\n" not in message, message
    # HMA_REDIS_URL from the environment is redacted the same way.
    env = {"HMA_REDIS_URL": _url(acl_redis, USER, PASSWORD)}
    env_cfg = RedisTierConfig.from_extra_config({}, env=env)
    assert env_cfg.password == PASSWORD and PASSWORD not in repr(env_cfg)


def test_credentials_as_separate_keys(acl_redis: LocalRedis, admin: redis.Redis) -> None:
    store = _store({"redis_url": _url(acl_redis), "username": USER, "password": PASSWORD})
    _round_trip(store, "hma:acl-test:separate", b"v")
    store.close()
    # Separate keys win over credentials in the URL.
    store = _store({"redis_url": _url(acl_redis, USER, WRONG_PASSWORD), "password": PASSWORD})
    _round_trip(store, "hma:acl-test:separate-wins", b"v")
    store.close()


def test_password_with_url_metacharacters(acl_redis: LocalRedis, admin: redis.Redis) -> None:
    # Percent-encoded in the URL, or given raw as a separate key: the same password either way.
    for extra in (
        {"redis_url": _url(acl_redis, SPECIAL_USER, SPECIAL_PASSWORD)},
        {"redis_url": _url(acl_redis), "username": SPECIAL_USER, "password": SPECIAL_PASSWORD},
    ):
        store = _store(extra)
        _round_trip(store, "hma:acl-test:special", b"v")
        store.close()


def test_unencoded_password_of_every_printable_character_authenticates(
    acl_redis: LocalRedis, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://{PRINTABLE_USER}:{PRINTABLE_PASSWORD}@127.0.0.1:{acl_redis.port}/0"
    cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    assert cfg.password == PRINTABLE_PASSWORD
    store = RedisBlockStore(cfg)
    _round_trip(store, "hma:acl-test:printable", b"v")
    store.close()
    # A wrong port: the failure is one redacted line, and nothing logged shows the password.
    bad = RedisTierConfig.from_extra_config(
        {"redis_url": url.replace(str(acl_redis.port), "1"), "connect_timeout_s": 0.2}, env={}
    )
    message = _ping_error(RedisBlockStore(bad))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for text in (message, logged, repr(cfg), cfg.redacted_url, bad.redacted_url):
        leaks = [
            PRINTABLE_PASSWORD[i : i + 6]
            for i in range(len(PRINTABLE_PASSWORD) - 5)
            if PRINTABLE_PASSWORD[i : i + 6] in text
        ]
        assert not leaks, text


def test_password_from_environment_or_file_authenticates_and_is_never_logged(
    acl_redis: LocalRedis, admin: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(PASSWORD + "\n")
    url = _url(acl_redis, USER)  # a user name, no password
    for extra, env in (
        ({"redis_url": url}, {"HMA_REDIS_PASSWORD": PASSWORD}),
        ({"redis_url": url, "password_file": str(secret_file)}, {}),
        ({}, {"HMA_REDIS_URL": _url(acl_redis, USER, PASSWORD)}),
    ):
        store = RedisBlockStore(RedisTierConfig.from_extra_config(extra, env=env))
        _round_trip(store, "hma:acl-test:secret-source", b"v")
        store.close()
    # None of those ways in put a password into the extra config: no warning, no leak.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert PASSWORD not in "\n".join(r.getMessage() for r in caplog.records)


# ------------------------------------------------------- values a reader must refuse (engine)

NUM_BLOCKS, PAGE, BPC = 16, 512, 4
NAMESPACE = "fixed-namespace"  # the explicit namespace option: no fingerprint check at all
AUTH_KEY = b"instances-shared-secret-0001"
BLOCKS = [1, 2, 3, 4, 9, 10, 11, 12]
CHUNKS = [
    ChunkTransfer(
        KeySpace("hma", NAMESPACE).block_key(0, bytes([n]) * 16), 0, 0, 0, tuple(BLOCKS[i : i + 4])
    )
    for n, i in ((1, 0), (2, 4))
]


@dataclass
class _Reader:
    engine: TransferEngine
    tensors: list[torch.Tensor]


@pytest.fixture
def make_engine(redis_url: str, redis_client: redis.Redis) -> Iterator[Any]:
    """Builds transfer engines over CPU KV caches (two layers, one group) on the session Redis,
    all in the same namespace; shuts them down after the test."""
    built: list[tuple[TransferEngine, RedisBlockStore]] = []

    def make(seed: int, **options: Any) -> _Reader:
        gen = torch.Generator().manual_seed(seed)
        tensors = [
            torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
            for _ in range(2)
        ]
        store = RedisBlockStore(RedisTierConfig(url=redis_url))
        value_format = ValueFormat(**{"kv_dtype": "float16", "kv_cache_layout": "NHD", **options})
        engine = TransferEngine(
            store,
            [[LayerSource.of(t, PAGE) for t in tensors]],
            value_format,
            blocks_per_chunk=BPC,
            io_threads=1,
            max_inflight_bytes=1 << 22,
            shutdown_timeout_s=1.0,
        )
        built.append((engine, store))
        return _Reader(engine, tensors)

    yield make
    for engine, store in built:
        engine.shutdown()
        store.close()


def _job(reader: _Reader, job_id: int, load: bool) -> bool:
    """Store or load CHUNKS; True unless it is a failed load."""
    submit = reader.engine.submit_load if load else reader.engine.submit_store
    submit(job_id, CHUNKS)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for result in reader.engine.finished():
            if result.job_id == job_id:
                return result.ok
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish")


def _same_pages(a: _Reader, b: _Reader) -> bool:
    return all(torch.equal(x[BLOCKS], y[BLOCKS]) for x, y in zip(a.tensors, b.tensors, strict=True))


def _stored_keys(client: redis.Redis) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(f"hma:{NAMESPACE}:g*"))


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        pytest.param({"kv_dtype": "float16"}, {"kv_dtype": "bfloat16"}, id="dtype"),
        pytest.param({"kv_cache_layout": "NHD"}, {"kv_cache_layout": "HND"}, id="kv_cache_layout"),
        pytest.param({"auth_key": AUTH_KEY}, {}, id="keyed-value-unkeyed-reader"),
        pytest.param({}, {"auth_key": AUTH_KEY}, id="unkeyed-value-keyed-reader"),
        pytest.param({"auth_key": AUTH_KEY}, {"auth_key": b"another-secret-0002-xyz"},
                     id="other-auth-key"),
    ],
)  # fmt: skip
def test_value_of_another_writer_is_corrupt_even_in_a_shared_namespace(
    make_engine: Any, redis_client: redis.Redis, writer: dict[str, Any], reader: dict[str, Any]
) -> None:
    source = make_engine(1, **writer)
    assert _job(source, 1, load=False)
    keys = _stored_keys(redis_client)
    assert len(keys) == 2
    # A reader configured like the writer loads the chunks: the values themselves are good.
    twin = make_engine(2, **writer)
    assert _job(twin, 2, load=True) and _same_pages(twin, source)

    other = make_engine(3, **reader)
    before = [t.clone() for t in other.tensors]
    assert not _job(other, 3, load=True), "a value of another writer was loaded"
    assert as_before_or_cleared(before, other.tensors), "a page holds bytes of a refused value"
    assert _stored_keys(redis_client) == []  # deleted, so the recompute can store its own
    # The recompute's store heals the keys for readers like it.
    assert _job(other, 4, load=False)
    fresh = make_engine(4, **reader)
    assert _job(fresh, 5, load=True) and _same_pages(fresh, other)


def test_forged_value_with_valid_checksum_is_refused_only_with_an_auth_key(
    make_engine: Any, redis_client: redis.Redis
) -> None:
    """Someone who can write to Redis (no secret) replaces a chunk's KV and fixes the CRC32C:
    without an auth_key the instance serves their bytes; with one it refuses them, and no
    page holds a byte of them afterwards (keyed values land in the pages on the C job and
    their MAC is checked there: a refused load's pages are zeroed)."""
    import crc32c

    attacker = 0x5A  # the attacker's KV: every byte 0x5A

    def forge(key: str) -> None:
        value = bytearray(redis_client.get(key))
        header_len = int.from_bytes(value[8:12], "big")
        body_at = codec.PREFIX_BYTES + header_len
        value[body_at:] = bytes([attacker]) * (len(value) - body_at)
        value[12:16] = crc32c.crc32c(bytes(value[codec.PREFIX_BYTES :])).to_bytes(4, "big")
        redis_client.set(key, bytes(value))

    for options, served in (({}, True), ({"auth_key": AUTH_KEY}, False)):
        redis_client.flushall()
        assert _job(make_engine(1, **options), 1, load=False)
        for key in _stored_keys(redis_client):
            forge(key)
        reader = make_engine(2, **options)
        before = [t.clone() for t in reader.tensors]
        loaded = _job(reader, 2, load=True)
        forged = all(bool((t[BLOCKS] == attacker).all()) for t in reader.tensors)
        assert (loaded, forged) == (served, served), options
        if not served:
            assert as_before_or_cleared(before, reader.tensors), "a page holds forged bytes"
