import dataclasses
import logging
import math
import re
import string
from urllib.parse import quote

import pytest

from hma_redis.core.config import (
    MAX_EXPIRE_S,
    NUMERIC_RANGES,
    Endpoint,
    EndpointKind,
    RedisTierConfig,
    redact_url,
)
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.store import RedisBlockStore


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
    assert cfg.redacted_url == "rediss://***@cache.internal:6380/1"  # user name too


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
        ({"idle_wait_ms": -0.5}, "idle_wait_ms"),
        ({"idle_wait_ms": 100.5}, "idle_wait_ms"),
        ({"idle_wait_ms": "nan"}, "idle_wait_ms"),
        ({"tcp_congestion": "Cubic"}, "tcp_congestion"),
        ({"tcp_congestion": "x" * 16}, "tcp_congestion"),
        ({"tcp_congestion": "cubic\n"}, "tcp_congestion"),
        ({"tcp_congestion": "bbr cubic"}, "tcp_congestion"),
        ({"tcp_congestion": 3}, "tcp_congestion"),
    ],
)
def test_bad_values_raise_one_error_naming_the_field(extra, field):
    with pytest.raises(ValueError, match=field) as info:
        RedisTierConfig.from_extra_config(extra, env={})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["", "cubic", "x" * 15, "dctcp_2"])
def test_tcp_congestion_takes_a_name_of_up_to_15_characters_or_nothing(name):
    assert (
        RedisTierConfig.from_extra_config({"tcp_congestion": name}, env={}).tcp_congestion == name
    )


def test_idle_wait_ms_takes_zero_to_its_bound():
    for value in (0, 2.5, 100):
        cfg = RedisTierConfig.from_extra_config({"idle_wait_ms": value}, env={})
        assert cfg.idle_wait_ms == value


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


# ------------------------------------------------------------------ non-finite numbers

_FLOAT_OPTIONS = sorted(
    f.name for f in dataclasses.fields(RedisTierConfig) if str(f.type) in ("float", "float | None")
)


def test_every_float_option_is_covered():
    # Guards the parametrisation below: a new float option is checked like the others.
    assert {"connect_timeout_s", "read_timeout_s", "retry_interval_s"} <= set(_FLOAT_OPTIONS)


@pytest.mark.parametrize("field", _FLOAT_OPTIONS)
@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "Infinity", "NaN"]
)
def test_non_finite_numbers_are_rejected_in_every_float_option(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number") as info:
        RedisTierConfig.from_extra_config({field: value}, env={})
    assert "\n" not in str(info.value)
    if isinstance(value, float):
        with pytest.raises(ValueError, match=field):
            RedisTierConfig(**{field: value})


# ------------------------------------------------------------------ ranges

_NUMERIC_OPTIONS = sorted(
    f.name
    for f in dataclasses.fields(RedisTierConfig)
    if str(f.type) in ("int", "int | None", "float", "float | None")
)


def test_every_numeric_option_has_a_range():
    assert sorted(NUMERIC_RANGES) == _NUMERIC_OPTIONS


def _beyond(value, direction):
    """The next value past ``value`` towards ``direction`` (+1 / -1) in the field's type."""
    if isinstance(value, int):
        return value + direction
    return math.nextafter(value, direction * math.inf)


# Options that take effect only with another one on (given with it here).
_NEEDS: dict[str, dict[str, object]] = {"tenant_budget_bytes": {"tenant_quotas": True}}


@pytest.mark.parametrize("field", sorted(NUMERIC_RANGES))
def test_each_numeric_option_takes_its_bounds_and_refuses_just_beyond(field):
    low, high, low_allowed = NUMERIC_RANGES[field]
    accepted = [high, low] if low_allowed else [high]
    needs = _NEEDS.get(field, {})
    for value in accepted:
        cfg = RedisTierConfig.from_extra_config({field: value, **needs}, env={})
        assert getattr(cfg, field) == value
    refused = [_beyond(high, +1), low if not low_allowed else _beyond(low, -1)]
    for value in refused:
        with pytest.raises(ValueError) as info:
            RedisTierConfig.from_extra_config({field: value, **needs}, env={})
        message = str(info.value)
        assert message.startswith(f"hma_redis: {field} must be ") and "\n" not in message
        shown = str(high) if isinstance(high, int) else f"{high:g}"
        assert f"<= {shown}" in message, message  # the allowed range is in the line


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("read_timeout_s", 86400.5),
        ("connect_timeout_s", 1e10),
        ("shutdown_timeout_s", 9.3e9),
        ("ttl_s", MAX_EXPIRE_S + 1),
        ("ttl_s", 9_300_000_000_000_000),
        ("admission_window_s", 9_300_000_000_000_000),
        ("gil_switch_interval_ms", 0.0005),
        ("gil_switch_interval_ms", -1),
        ("pool_size", 10**9),
        ("io_threads", 10**6),
    ],
)
def test_values_that_would_break_the_tier_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^hma_redis: {field} must be .* got "):
        RedisTierConfig.from_extra_config({field: value}, env={})


def test_gil_switch_interval_zero_still_means_leave_it_alone():
    assert RedisTierConfig.from_extra_config({"gil_switch_interval_ms": 0}, env={})


def test_ttl_at_its_bound_is_accepted_by_redis(redis_client, redis_url):
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": redis_url, "ttl_s": MAX_EXPIRE_S, "admission_window_s": MAX_EXPIRE_S},
        env={},
    )
    store = RedisBlockStore(cfg)
    try:
        assert store.put_if_absent([("hma:ttl-bound:v", b"x")]) == [PutResult.STORED]
        store.exists_and_mark([["hma:ttl-bound:absent"]], ["hma:ttl-bound:m"], MAX_EXPIRE_S)
    finally:
        store.close()
    assert 0 < redis_client.ttl("hma:ttl-bound:v") <= MAX_EXPIRE_S
    assert 0 < redis_client.ttl("hma:ttl-bound:m") <= MAX_EXPIRE_S
    redis_client.delete("hma:ttl-bound:v", "hma:ttl-bound:m")


@pytest.mark.parametrize("field", ["key_prefix", "namespace"])
@pytest.mark.parametrize("tail", ["\n", "\r\n", "\r", "\x00", "\x1b", "\t", "\x7f", "\x85"])
def test_names_with_a_trailing_newline_or_control_character_are_refused(field, tail):
    with pytest.raises(ValueError, match=f"^hma_redis: {field} must be") as info:
        RedisTierConfig.from_extra_config({field: "tier" + tail}, env={})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=field):
        RedisTierConfig.from_extra_config({field: "ti" + tail + "er"}, env={})


@pytest.mark.parametrize("tail", ["\x00", "\x1b[2J", "\x7f", "\x85"])
def test_sentinel_service_name_with_a_control_character_is_refused(tail):
    url = f"redis+sentinel://s1:26379/mymaster{quote(tail)}"
    with pytest.raises(ValueError, match="service name") as info:
        RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    assert info.value.args[0].isprintable()


# ------------------------------------------------------------------ password sources

SECRET = "pw-Zq9#/?@:%41 x"


def test_password_file_content_is_the_password(tmp_path):
    path = tmp_path / "pw"
    path.write_text(SECRET + "\n")
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": "redis://u:from-url@h:1/0", "password_file": str(path)}, env={}
    )
    assert (cfg.username, cfg.password) == ("u", SECRET)
    assert SECRET not in repr(cfg)
    path.write_text(SECRET + "\r\n\n")  # only one line ending is stripped
    again = RedisTierConfig(password_file=str(path))
    assert again.password == SECRET + "\r\n"
    # A copy keeps the secret that was read, without reading the file again.
    path.unlink()
    assert dataclasses.replace(again, read_timeout_s=9.0).password == SECRET + "\r\n"


@pytest.mark.parametrize("content", [None, b"", b"\n", b"\xff\xfe secret"])
def test_unreadable_or_empty_password_file_is_one_line_without_content(tmp_path, content):
    path = tmp_path / "pw"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="password_file") as info:
        RedisTierConfig.from_extra_config({"password_file": str(path)}, env={})
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "secret" not in message


def test_password_and_password_file_together_are_refused(tmp_path):
    path = tmp_path / "pw"
    path.write_text(SECRET)
    with pytest.raises(ValueError, match="password or password_file, not both"):
        RedisTierConfig.from_extra_config({"password": "x", "password_file": str(path)}, env={})


def test_password_from_environment_and_precedence(tmp_path):
    env = {"HMA_REDIS_PASSWORD": SECRET, "HMA_REDIS_URL": "redis://u:from-url@h:1/0"}
    cfg = RedisTierConfig.from_extra_config({}, env=env)
    assert (cfg.username, cfg.password) == ("u", SECRET)  # the variable wins over the URL
    path = tmp_path / "pw"
    path.write_text("from-file")
    for extra, want in (({"password": "from-key"}, "from-key"),
                        ({"password_file": str(path)}, "from-file")):  # fmt: skip
        assert RedisTierConfig.from_extra_config(extra, env=env).password == want
    assert RedisTierConfig.from_extra_config({}, env={"HMA_REDIS_URL": env["HMA_REDIS_URL"]}) \
        .password == "from-url"  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        ({"password": SECRET}, True),
        ({"redis_url": f"redis://u:{quote(SECRET, safe='')}@h:1/0"}, True),
        ({"redis_url": f"redis://u:{SECRET}@h:1/0"}, True),
        ({"redis_url": "redis://u@h:1/0"}, False),  # a user name is no secret
        ({"redis_url": "redis://h:1/0"}, False),
        ({}, False),  # HMA_REDIS_PASSWORD / HMA_REDIS_URL below: vLLM never prints them
    ],
)
def test_credentials_in_extra_config_log_one_warning_without_the_secret(extra, warned, caplog):
    caplog.set_level(logging.DEBUG, logger="hma_redis")
    env = {"HMA_REDIS_PASSWORD": "env-" + SECRET, "HMA_REDIS_URL": f"redis://u:{SECRET}@h:2"}
    RedisTierConfig.from_extra_config(extra, env=env)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == int(warned)
    for record in warnings:
        text = record.getMessage()
        assert "HMA_REDIS_PASSWORD" in text and "password_file" in text and "HMA_REDIS_URL" in text
        assert SECRET not in text and quote(SECRET, safe="") not in text and "%41" not in text


# ------------------------------------------------------------------ URLs and redaction

# Every printable character but whitespace, unencoded: the userinfo runs to the URL's last '@'.
PRINTABLE = "".join(c for c in string.printable if not c.isspace())

URL_FORMS = [
    ("redis://u:{pw}@cache.internal:6380/3", "redis://***@cache.internal:6380/3", 3),
    ("rediss://u:{pw}@cache.internal/2", "rediss://***@cache.internal/2", 2),
    ("unix://u:{pw}@/run/redis@6379.sock?db=4", "unix://***@/run/redis@6379.sock?db=4", 4),
    ("redis+cluster://u:{pw}@h1:7000,[::1]:7001/", "redis+cluster://***@h1:7000,[::1]:7001/", 0),
    ("redis+sentinel://u:{pw}@s1:26379,s2/mymaster/5",
     "redis+sentinel://***@s1:26379,s2/mymaster/5", 5),
]  # fmt: skip


def _leaks(text: str, secret: str) -> list[str]:
    """Pieces of ``secret`` (any 6 characters in a row) found in ``text``."""
    return [secret[i : i + 6] for i in range(len(secret) - 5) if secret[i : i + 6] in text]


@pytest.mark.parametrize(("form", "redacted", "db"), URL_FORMS)
@pytest.mark.parametrize("encode", [False, True], ids=["raw", "percent-encoded"])
def test_password_of_every_printable_character_parses_and_never_shows(form, redacted, db, encode):
    url = form.format(pw=quote(PRINTABLE, safe="") if encode else PRINTABLE)
    cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env={}, warn_credentials=False)
    assert (cfg.username, cfg.password, cfg.db) == ("u", PRINTABLE, db)
    assert cfg.redacted_url == redacted
    shown = [repr(cfg), str(cfg), cfg.redacted_url, repr(cfg.endpoint)]
    if cfg.endpoint.kind is EndpointKind.SINGLE:
        shown.append(cfg.endpoint.address)
    for text in shown:
        assert not _leaks(text, PRINTABLE), text
    if cfg.endpoint.kind is EndpointKind.CLUSTER:
        assert cfg.endpoint.hosts == (("h1", 7000), ("::1", 7001))
    if cfg.endpoint.kind is EndpointKind.SENTINEL:
        assert cfg.endpoint.hosts == (("s1", 26379), ("s2", 26379))
        assert cfg.endpoint.service == "mymaster"


_SINGLE, _CLUSTER, _SENTINEL = EndpointKind.SINGLE, EndpointKind.CLUSTER, EndpointKind.SENTINEL


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("redis://h:7000/2", Endpoint(_SINGLE, "redis", False, "redis://h:7000", (("h", 7000),))),
        ("rediss://[::1]/0", Endpoint(_SINGLE, "rediss", True, "rediss://[::1]", (("::1", 6379),))),
        (
            "unix:///run/redis.sock?db=3",
            Endpoint(
                _SINGLE, "unix", False, "unix:///run/redis.sock", socket_path="/run/redis.sock"
            ),
        ),
        (
            "rediss+cluster://a:7000,b/",
            Endpoint(_CLUSTER, "rediss+cluster", True, hosts=(("a", 7000), ("b", 6379))),
        ),
        (
            "redis+sentinel://s1,s2:5000/mymaster/1",
            Endpoint(
                _SENTINEL,
                "redis+sentinel",
                False,
                hosts=(("s1", 26379), ("s2", 5000)),
                service="mymaster",
            ),
        ),
    ],
)
def test_the_url_is_parsed_once_into_an_endpoint(url: str, want: Endpoint) -> None:
    """Every user of the config reads ``cfg.endpoint``, parsed when the config was built: the
    kind (an enum), the scheme, TLS, where to connect; never credentials, db or query."""
    cfg = RedisTierConfig(url=url)
    assert cfg.endpoint == want
    assert cfg.tls is want.tls
    # A copy with another URL gets its own endpoint; the field is no option.
    other = dataclasses.replace(cfg, url="redis://elsewhere:1")
    assert other.endpoint.hosts == (("elsewhere", 1),)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        RedisTierConfig.from_extra_config({"endpoint": "x"}, env={})


def test_password_with_unencoded_delimiters_ends_at_the_last_at():
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": "redis://user:p@ss/w#?rd@host:6379/0"}, env={}, warn_credentials=False
    )
    assert (cfg.username, cfg.password, cfg.db) == ("user", "p@ss/w#?rd", 0)
    assert cfg.redacted_url == "redis://***@host:6379/0"
    assert cfg.endpoint.address == "redis://host:6379"


@pytest.mark.parametrize(
    "bad",
    [
        "redis://u:{pw}@h:99999/0",
        "redis://u:{pw}@h:6379/x",
        "ftp://u:{pw}@h:6379/0",
        "u:{pw}@h:6379",
        "redis://u:{pw}@[::1/0",
        "redis://u:{pw}@h:6379/0?password={pw}",
        "redis://u:{pw}&password=x@h:6379/0?password=1",
        "redis://u:{pw}@h:6379/0?socket_timeout=1",
        "redis+cluster://u:{pw}@h1:x,h2/",
        "redis+sentinel://u:{pw}@s1:26379/",
        "redis+sentinel://u:{pw}@s1:26379/svc/0/1",
        "unix://u:{pw}@",
        "redis://u:{pw}@",
    ],
)
def test_errors_for_urls_with_a_printable_password_never_show_it(bad):
    url = bad.format(pw=PRINTABLE)
    with pytest.raises(ValueError) as info:
        RedisTierConfig.from_extra_config({"redis_url": url}, env={}, warn_credentials=False)
    message = str(info.value)
    assert "redis_url" in message and "\n" not in message, message
    assert not _leaks(message, PRINTABLE), message
    assert not _leaks(redact_url(url), PRINTABLE)


# A password typed where a host, port or path should be (no "@host", no "@" at all), odd
# schemes, ports that do not parse, control characters: the URL cannot be parsed, so nothing
# tells a host from a password, and the message must still not show it.
MALFORMED_URLS = [
    "redis://default:{pw}",
    "redis://default:{pw}/0",
    "redis://default:{pw}?db=1",
    "redis://default:{pw}#x",
    "redis://:{pw}",
    "rediss://default:{pw}",
    "REDIS://default:{pw}",
    "redis+cluster://default:{pw}",
    "redis+cluster://h1:7000,default:{pw}",
    "redis+sentinel://default:{pw}/mymaster",
    "unix://default:{pw}",
    "unix://default:{pw}/run/redis.sock",
    "redis:default:{pw}",
    "redis:/default:{pw}",
    "redis:///default:{pw}",
    "redis//default:{pw}",
    "default:{pw}",
    "default:{pw}@",
    "ftp://default:{pw}",
    "http://default:{pw}@",
    "re dis://default:{pw}",
    " redis://default:{pw}",
    "redis://h:{pw}",
    "redis://h:6379:{pw}",
    "redis://[default:{pw}]",
    "redis://[::1]:{pw}",
    "redis://default:{pw}\n",
    "redis://default:{pw}\x1b[2J",
    "redis://default:\n{pw}",
    "redis://h:6379/0?password={pw}",
    "redis://h:6379/0?token={pw}",
    "redis://h:6379/{pw}:x",
]


@pytest.mark.parametrize("form", MALFORMED_URLS)
def test_malformed_url_error_is_one_line_without_the_password(form):
    url = form.format(pw="s3cretZq9")
    with pytest.raises(ValueError, match="redis_url") as info:
        RedisTierConfig.from_extra_config({"redis_url": url}, env={}, warn_credentials=False)
    message = str(info.value)
    assert "s3cret" not in message and "\n" not in message and "\x1b" not in message, message
    assert "s3cret" not in redact_url(url) and redact_url(url).isprintable()


def test_redact_url_shows_what_is_safe_of_a_malformed_url():
    assert redact_url("redis://default:s3cret") == "redis://***"
    assert redact_url("redis://default:s3cret@") == "redis://***@"
    assert redact_url("redis://h:1/0?password=s3cret&db=2") == "redis://h:1/0?password=***&db=2"
    assert redact_url("localhost:6379") == "localhost:6379"
    assert redact_url("redis://h:1/0\n") == "redis://h:1/0\\n"


# ------------------------------------------------------------------ auth_key

KEY = b"0123456789abcdef-shared-secret"


def test_auth_key_in_extra_config_is_refused_saying_what_to_use():
    with pytest.raises(ValueError, match=r"HMA_REDIS_AUTH_KEY.*auth_key_file") as info:
        RedisTierConfig.from_extra_config({"auth_key": KEY.decode()}, env={})
    assert KEY.decode() not in str(info.value) and "\n" not in str(info.value)
    assert "logs it" in str(info.value)


def test_auth_key_from_environment_or_file(tmp_path):
    from_env = RedisTierConfig.from_extra_config({}, env={"HMA_REDIS_AUTH_KEY": KEY.decode()})
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    from_file = RedisTierConfig.from_extra_config({"auth_key_file": str(path)}, env={})
    assert from_env.auth_key == from_file.auth_key == KEY
    # The file, an explicit option, wins over the environment.
    other = RedisTierConfig.from_extra_config(
        {"auth_key_file": str(path)}, env={"HMA_REDIS_AUTH_KEY": "another-key-0123456789"}
    )
    assert other.auth_key == KEY
    path.unlink()
    assert dataclasses.replace(other, namespace="copy").auth_key == KEY
    with pytest.raises(ValueError, match="auth_key_file cannot be read"):
        RedisTierConfig.from_extra_config({"auth_key_file": str(tmp_path / "nope")}, env={})


def test_auth_key_id_identifies_the_key_without_showing_it():
    cfg = RedisTierConfig(auth_key=KEY)
    assert RedisTierConfig().auth_key_id == ""
    assert re.fullmatch(r"[0-9a-f]{16}", cfg.auth_key_id)
    assert cfg.auth_key_id == RedisTierConfig(auth_key=KEY).auth_key_id
    assert cfg.auth_key_id != RedisTierConfig(auth_key=KEY + b"!").auth_key_id
    for text in (repr(cfg), str(cfg)):
        assert KEY.decode() not in text and KEY.hex() not in text and "auth_key=" not in text
    assert f"auth_key_id='{cfg.auth_key_id}'" in repr(cfg)


def test_short_auth_key_is_refused():
    with pytest.raises(ValueError, match="auth_key must be at least 16 bytes, got 5"):
        RedisTierConfig.from_extra_config({}, env={"HMA_REDIS_AUTH_KEY": "short"})


# ------------------------------------------------------------------ encryption keys

ENC_KEY = b"encryption-key-for-the-config-tests-01"
OLD_KEY = b"encryption-key-for-the-config-tests-00"


@pytest.mark.parametrize("name", ["encryption_key", "encryption_key_previous"])
def test_encryption_keys_in_extra_config_are_refused_saying_what_to_use(name):
    env_name = "HMA_REDIS_ENCRYPTION_KEY" + ("_PREVIOUS" if name.endswith("previous") else "")
    with pytest.raises(ValueError, match=rf"{env_name}.*{name}_file") as info:
        RedisTierConfig.from_extra_config({name: ENC_KEY.decode()}, env={})
    assert ENC_KEY.decode() not in str(info.value)


def test_encryption_keys_from_environment_or_file(tmp_path):
    path = tmp_path / "enc"
    path.write_bytes(ENC_KEY + b"\n")
    old = tmp_path / "old"
    old.write_bytes(OLD_KEY)
    env = {
        "HMA_REDIS_ENCRYPTION_KEY": ENC_KEY.decode(),
        "HMA_REDIS_ENCRYPTION_KEY_PREVIOUS": OLD_KEY.decode(),
    }
    from_env = RedisTierConfig.from_extra_config({}, env=env)
    from_file = RedisTierConfig.from_extra_config(
        {"encryption_key_file": str(path), "encryption_key_previous_file": str(old)}, env={}
    )
    assert from_env.encryption_key == from_file.encryption_key == ENC_KEY
    assert from_env.encryption_key_previous == from_file.encryption_key_previous == OLD_KEY
    with pytest.raises(ValueError, match="encryption_key_file cannot be read"):
        RedisTierConfig.from_extra_config({"encryption_key_file": str(tmp_path / "no")}, env={})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"encryption_key": b"short"}, "encryption_key must be at least 16 bytes"),
        (
            {"encryption_key": ENC_KEY, "encryption_key_previous": b"short"},
            "encryption_key_previous must be at least",
        ),
        ({"encryption_key_previous": OLD_KEY}, "encryption_key_previous needs an encryption_key"),
        (
            {"encryption_key": ENC_KEY, "encryption_key_previous": ENC_KEY},
            "is the encryption_key itself",
        ),
        ({"encryption_key": ENC_KEY, "auth_key": KEY}, "encryption_key and auth_key are both set"),
    ],
)
def test_bad_encryption_settings_fail_with_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        RedisTierConfig(**fields)
    assert "\n" not in str(info.value)
    for secret in (ENC_KEY, OLD_KEY, KEY):
        assert secret.decode() not in str(info.value)


def test_the_encryption_key_id_names_the_previous_key_during_a_rotation():
    """Never the key itself in repr or str; the id that names the namespace is the write
    key's, and the previous key's while one is given (instances moving to a new key keep
    the namespace they share with those still on the old one)."""
    old = RedisTierConfig(encryption_key=OLD_KEY)
    rotating = RedisTierConfig(encryption_key=ENC_KEY, encryption_key_previous=OLD_KEY)
    new = RedisTierConfig(encryption_key=ENC_KEY)
    assert RedisTierConfig().encryption_key_id == ""
    assert re.fullmatch(r"[0-9a-f]{16}", new.encryption_key_id)
    assert rotating.encryption_key_id == old.encryption_key_id != new.encryption_key_id
    for cfg in (old, rotating, new):
        for text in (repr(cfg), str(cfg)):
            assert ENC_KEY.decode() not in text and OLD_KEY.decode() not in text
            assert ENC_KEY.hex() not in text and "encryption_key=" not in text
    assert f"encryption_key_id='{new.encryption_key_id}'" in repr(new)


def test_a_tenant_budget_without_quotas_is_refused_naming_both_options():
    with pytest.raises(ValueError) as info:
        RedisTierConfig.from_extra_config({"tenant_budget_bytes": 1 << 30}, env={})
    assert "tenant_budget_bytes needs tenant_quotas" in str(info.value)
    cfg = RedisTierConfig.from_extra_config({"tenant_quotas": "true"}, env={})
    assert cfg.tenant_quotas and cfg.tenant_budget_bytes is None
