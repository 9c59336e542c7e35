"""``hma-redis inspect KEY``: decode one stored block's header and verify it (checksum, key
echo, MAC with the tier's auth_key, decryption with its encryption keys), and say whether the
tier would use it; exit 1 when it would not."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hma_redis.core.codec import (
    CorruptBlockError,
    MacCheck,
    MacKey,
    check_mac,
    check_seal,
    decode,
    decode_header,
)
from hma_redis.core.keys import parse_block_key
from hma_redis.core.sealing import Keyring
from hma_redis.tools.cli.admin import RedisAdmin
from hma_redis.tools.cli.output import EXIT_FAIL, EXIT_OK, CliError, emit, print_json

NAME = "inspect"
HELP = "decode a block's header and verify it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``KEY``."""
    parser.add_argument("key", metavar="KEY")


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Report on the block (as text, or ``--json``): exit 0 when valid, 1 when not; a key that
    is missing or not a string is a :class:`CliError`."""
    key: str = args.key
    kind = admin.key_type(key)
    if kind == "none":
        raise CliError(f"no such key: {key}")
    if kind != "string":
        raise CliError(f"{key} is a {kind}, not a block (blocks are strings)")
    value = admin.get(key)
    if value is None:
        raise CliError(f"no such key: {key} (deleted or expired just now)")
    report = inspect_value(key, value, admin.cfg.auth_key, admin.cfg.keyring())
    report["ttl_s"] = admin.ttl(key)
    if args.json:
        print_json(report)
    else:
        _print_inspect(report)
    return EXIT_OK if report["valid"] else EXIT_FAIL


def inspect_value(
    key: str, value: bytes, auth_key: bytes | None = None, keyring: Keyring | None = None
) -> dict[str, Any]:
    """What ``inspect`` reports about one stored value (no Redis involved): the decoded header,
    checksum, key echo, MAC (verified with ``auth_key``, the tier's shared secret) and
    encryption (opened with ``keyring``, the tier's encryption keys), and whether the tier
    would use the value."""
    report: dict[str, Any] = {"key": key, "value_bytes": len(value)}
    mac_key = MacKey.derive(auth_key) if auth_key is not None else None
    try:
        decode(
            value,
            expected_key=key,
            expected_group=_group_of(key),
            mac_key=mac_key,
            keyring=keyring,
        )
        report["error"] = None
    except CorruptBlockError as exc:
        report["error"] = str(exc)
    report["mac"] = _mac_state(check_mac(value, mac_key), mac_key is not None)
    report["encryption"] = _mac_state(check_seal(value, keyring), keyring is not None)
    try:
        header, checksum_ok = decode_header(value)
    except CorruptBlockError:
        report.update(header=None, checksum_ok=False, key_matches=False, valid=False)
        return report
    report["header"] = {
        "key": header.key,
        "group": header.group,
        "first_block": header.first_block,
        "num_blocks": header.num_blocks,
        "page_bytes": list(header.page_bytes),
        "kv_dtype": header.kv_dtype,
        "kv_cache_layout": header.kv_cache_layout,
        "key_id": header.key_id or None,
        "body_bytes": header.body_bytes,
    }
    report["checksum_ok"] = checksum_ok
    report["key_matches"] = header.key == key
    report["valid"] = report["error"] is None
    return report


def _mac_state(check: MacCheck, have_key: bool) -> str:
    """``none`` (written without an auth_key, or unencrypted), ``verified`` (checked with the
    key: it holds), ``invalid`` (checked: it does not; or missing where the key requires one),
    ``unverified`` (a MAC or encryption and no key here to check it) or ``unreadable`` (the
    value's prefix cannot be read, so nothing was checked)."""
    if check is MacCheck.ABSENT:
        return "invalid" if have_key else "none"
    return {
        MacCheck.OK: "verified",
        MacCheck.BAD: "invalid",
        MacCheck.UNCHECKED: "unverified",
        MacCheck.UNREADABLE: "unreadable",
    }[check]


def _group_of(key: str) -> int | None:
    parts = parse_block_key(key)
    return None if parts is None else parts.group


_MAC_TEXT = {
    "none": "none (written without an auth_key)",
    "verified": "OK (checked with the auth_key)",
    "unverified": "present, not checked (no auth_key: give it with --auth-key-file or "
    "$HMA_REDIS_AUTH_KEY)",
    "invalid": "BAD (checked with the auth_key: missing, written with another key, or altered)",
    "unreadable": "not checked (decoding stopped before the MAC: the value's prefix is unreadable)",
}
_ENCRYPTION_TEXT = {
    "none": "none (written without an encryption_key)",
    "verified": "OK (decrypted and authenticated with the encryption key it names)",
    "unverified": "sealed, not checked (no key of its id here: give it with "
    "--encryption-key-file or $HMA_REDIS_ENCRYPTION_KEY)",
    "invalid": "BAD (not sealed where the key requires it, or failed authentication: altered)",
    "unreadable": "not checked (the value's prefix or header is unreadable)",
}


def _print_inspect(report: Mapping[str, Any]) -> None:
    rows: list[tuple[str, object]] = [("key", report["key"])]
    ttl = report["ttl_s"]
    rows.append(("value", f"{report['value_bytes']} bytes, ttl {'-' if ttl is None else ttl}"))
    header = report["header"]
    if header is not None:
        rows += [
            ("header.key", header["key"]),
            ("header.group", header["group"]),
            ("first_block", header["first_block"]),
            ("num_blocks", header["num_blocks"]),
            ("page_bytes", ",".join(str(p) for p in header["page_bytes"])),
            ("kv_dtype", header["kv_dtype"] or "-"),
            ("kv_cache_layout", header["kv_cache_layout"] or "-"),
            ("key_id", header["key_id"] or "-"),
            ("body_bytes", header["body_bytes"]),
        ]
        rows.append(("checksum", "OK" if report["checksum_ok"] else "MISMATCH"))
        rows.append(("key echo", "OK" if report["key_matches"] else "MISMATCH"))
    else:
        rows.append(("header", "undecodable"))
    rows.append(("mac", _MAC_TEXT[report["mac"]]))
    rows.append(("encryption", _ENCRYPTION_TEXT[report["encryption"]]))
    verdict = "OK: a valid block" if report["valid"] else f"INVALID: {report['error']}"
    rows.append(("verdict", verdict))
    width = max(len(name) for name, _ in rows)
    emit(*(f"{name:<{width}}  {value}" for name, value in rows))
