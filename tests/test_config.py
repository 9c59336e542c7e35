import pytest

from hma_redis.config import RedisTierConfig, redact_url


def test_url_from_extra_config_wins_over_environment():
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": "redis://a:6379/2"}, env={"HMA_REDIS_URL": "redis://b:1/0"}
    )
    assert cfg.url == "redis://a:6379/2"
    assert cfg.db == 2


def test_environment_url_order():
    env = {"HMA_REDIS_URL": "redis://first:1/0", "REDIS_URL": "redis://second:2/0"}
    assert RedisTierConfig.from_extra_config({}, env=env).url == "redis://first:1/0"
    assert RedisTierConfig.from_extra_config({}, env={"REDIS_URL": "redis://s:2"}).url == (
        "redis://s:2"
    )


def test_credentials_in_url_are_parsed_and_never_shown():
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": "rediss://tier:s3cret%21@cache.internal:6380/1"}, env={}
    )
    assert (cfg.username, cfg.password, cfg.db, cfg.tls) == ("tier", "s3cret!", 1, True)
    assert "s3cret" not in repr(cfg)
    assert "s3cret" not in str(cfg)
    assert cfg.redacted_url == "rediss://tier:***@cache.internal:6380/1"


def test_unix_socket_url():
    cfg = RedisTierConfig.from_extra_config({"redis_url": "unix:///run/redis.sock?db=3"}, env={})
    assert cfg.db == 3


def test_vllm_owned_keys_are_accepted():
    cfg = RedisTierConfig.from_extra_config(
        {"spec_name": "RedisOffloadingSpec", "spec_module_path": "hma_redis.spec",
         "blocks_per_chunk": 4},
        env={},
    )  # fmt: skip
    assert cfg.key_prefix == "hma"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"redis_ulr": "redis://x"}, "redis_ulr"),
        ({"redis_url": "http://x:1"}, "scheme"),
        ({"redis_url": "redis://:pw@"}, "host"),
        ({"redis_url": "redis://h:99999"}, "port"),
        ({"read_timeout_s": "soon"}, "read_timeout_s"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"pool_size": 2.5}, "pool_size"),
        ({"ttl_s": -1}, "ttl_s"),
        ({"key_prefix": "a b"}, "key_prefix"),
        ({"namespace": "x" * 65}, "namespace"),
        ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
        ({"tls_ca_file": "/nonexistent/ca.pem"}, "tls_ca_file"),
        ({"allow_random_hash_seed": "maybe"}, "allow_random_hash_seed"),
        ({"gil_switch_interval_ms": -1}, "gil_switch_interval_ms"),
    ],
)
def test_bad_values_raise_one_error_naming_the_field(extra, field):
    with pytest.raises(ValueError, match=field) as info:
        RedisTierConfig.from_extra_config(extra, env={})
    assert "\n" not in str(info.value)


def test_bad_url_error_redacts_password():
    with pytest.raises(ValueError) as info:
        RedisTierConfig.from_extra_config({"redis_url": "redis://u:hunter2@h:1/notadb"}, env={})
    assert "hunter2" not in str(info.value)
    assert "***" in str(info.value)


def test_config_is_immutable():
    cfg = RedisTierConfig()
    with pytest.raises(AttributeError):
        cfg.url = "redis://other"  # type: ignore[misc]


def test_redact_url_without_password_is_unchanged():
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_url_query_options_are_rejected_and_redacted():
    with pytest.raises(ValueError, match="query parameter") as info:
        RedisTierConfig.from_extra_config(
            {"redis_url": "redis://h:1/0?socket_timeout=60&password=s3cret"}, env={}
        )
    assert "s3cret" not in str(info.value)


def test_tls_files_need_a_tls_url(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValueError, match="tls_ca_file needs a rediss://"):
        RedisTierConfig.from_extra_config(
            {"redis_url": "redis://h:1", "tls_ca_file": str(ca)}, env={}
        )
