"""The options every ``hma-redis`` command shares: the connection options (the tier's
``kv_connector_extra_config``) and ``--json``, the tier's config built from them
(:func:`build_config`, through the tier's own validation) and its messages in the CLI's words
(:func:`config_message`), and the argument types the commands' options use."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.cli.admin import RedisAdmin

PASSWORD_ENV = "HMA_REDIS_PASSWORD"


def add_global_options(parser: argparse.ArgumentParser, after_command: bool) -> None:
    """The connection options and ``--json``; after the command they default to SUPPRESS (see
    :func:`add_connection_options`)."""
    add_connection_options(parser, after_command)
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if after_command else False,
        help="machine-readable output",
    )


def add_connection_options(parser: argparse.ArgumentParser, after_command: bool) -> None:
    """The connection options; after the command they default to SUPPRESS, so that they do not
    overwrite what was given before it."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if after_command else value

    conn = parser.add_argument_group("connection (as the tier's kv_connector_extra_config)")
    conn.add_argument(
        "--url",
        default=default(None),
        help="redis://, rediss:// (TLS), unix://, redis+cluster:// or redis+sentinel:// URL",
    )
    conn.add_argument("--prefix", default=default("hma"), help="key_prefix (default: hma)")
    conn.add_argument("--username", default=default(None), help="ACL user name")
    conn.add_argument(
        "--password", default=default(None), help=f"password (default: ${PASSWORD_ENV})"
    )
    conn.add_argument("--password-file", default=default(None), help="a file holding the password")
    conn.add_argument(
        "--db", type=int, default=default(None), help="database number (overrides the URL's)"
    )
    conn.add_argument("--tls-ca-file", default=default(None), help="CA bundle for rediss://")
    conn.add_argument(
        "--tls-cert-file", default=default(None), help="client certificate for rediss://"
    )
    conn.add_argument("--tls-key-file", default=default(None), help="client key for rediss://")
    conn.add_argument(
        "--no-tls-verify",
        action="store_true",
        default=default(False),
        help="do not verify the server certificate",
    )
    conn.add_argument(
        "--auth-key-file",
        default=default(None),
        help="the tier's auth_key, to verify MACs (default: $HMA_REDIS_AUTH_KEY)",
    )
    conn.add_argument(
        "--encryption-key-file",
        default=default(None),
        help="the tier's encryption_key, to open sealed values (default: "
        "$HMA_REDIS_ENCRYPTION_KEY)",
    )
    conn.add_argument(
        "--encryption-key-previous-file",
        default=default(None),
        help="a previous encryption key, during a rotation (default: "
        "$HMA_REDIS_ENCRYPTION_KEY_PREVIOUS)",
    )
    conn.add_argument(
        "--connect-timeout", type=float, default=default(None), help="seconds (default 1)"
    )
    conn.add_argument(
        "--read-timeout", type=float, default=default(None), help="seconds per command (default 2)"
    )


def build_config(args: argparse.Namespace, env: Mapping[str, str]) -> RedisTierConfig:
    """The tier's config from the global options, through the tier's own validation."""
    extra: dict[str, Any] = {"key_prefix": args.prefix}
    if args.url is not None:
        extra["redis_url"] = args.url
    password = args.password
    if password is None and args.password_file is None:
        password = env.get(PASSWORD_ENV)
    options = {
        "username": args.username,
        "password": password or None,
        "password_file": args.password_file,
        "db": args.db,
        "tls_ca_file": args.tls_ca_file,
        "tls_cert_file": args.tls_cert_file,
        "tls_key_file": args.tls_key_file,
        "auth_key_file": args.auth_key_file,
        "encryption_key_file": args.encryption_key_file,
        "encryption_key_previous_file": args.encryption_key_previous_file,
        "connect_timeout_s": args.connect_timeout,
        "read_timeout_s": args.read_timeout,
    }
    extra.update({name: value for name, value in options.items() if value is not None})
    if args.no_tls_verify:
        extra["tls_verify"] = False
    # The CLI's options are never logged, so no warning about credentials in them.
    return RedisTierConfig.from_extra_config(extra, env=env, warn_credentials=False)


# The config keys the CLI's options set, by the option that sets them.
_FLAG_OF_KEY = {
    "key_prefix": "--prefix",
    "username": "--username",
    "password_file": "--password-file",
    "password": "--password",
    "db": "--db",
    "tls_ca_file": "--tls-ca-file",
    "tls_cert_file": "--tls-cert-file",
    "tls_key_file": "--tls-key-file",
    "tls_verify": "--no-tls-verify",
    "auth_key_file": "--auth-key-file",
    "encryption_key_file": "--encryption-key-file",
    "encryption_key_previous_file": "--encryption-key-previous-file",
    "connect_timeout_s": "--connect-timeout",
    "read_timeout_s": "--read-timeout",
    "namespace": "--namespace",
}
# A key the message is about: redis_url anywhere, another key as the message's subject (a word
# like "password" or "db" elsewhere is just a word).
_CONFIG_KEY = re.compile(
    r"\b(redis_url)\b|^(" + "|".join(_FLAG_OF_KEY) + r")(?= (?:must|cannot|does|is|has)\b)"
)


def config_message(exc: ValueError, url_flag: bool = True) -> str:
    """The tier's validation message with each config key it names written as the CLI option
    that sets it (the URL: ``--url``, or the variable it came from when ``url_flag`` is
    False)."""

    def flag(match: re.Match[str]) -> str:
        key = match.group(1) or match.group(2)
        if key == "redis_url":
            return "--url" if url_flag else "the URL ($HMA_REDIS_URL or $REDIS_URL)"
        return _FLAG_OF_KEY[key]

    return _CONFIG_KEY.sub(flag, str(exc).removeprefix("hma_redis: "))


def checked_namespace(admin: RedisAdmin, namespace: str | None) -> str | None:
    """``namespace`` validated as the tier validates its ``namespace`` option."""
    if namespace is not None:
        dataclasses.replace(admin.cfg, namespace=namespace)
    return namespace


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def positive(text: str) -> int:
    """An argument type: an integer > 0."""
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative(text: str) -> int:
    """An argument type: an integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def kv_group(text: str) -> int:
    """A KV group as ``info`` and ``ls`` name it (``g1``), or its number (``1``)."""
    match = re.fullmatch(r"g?(\d+)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"a KV group is g<N> (e.g. g1), got {text!r}")
    return int(match.group(1))
