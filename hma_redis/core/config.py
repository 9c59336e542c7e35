"""One validated, immutable configuration for the Redis tier.

Built from vLLM's ``kv_connector_extra_config`` (the keys below, by name) plus the environment
(``HMA_REDIS_URL``, falling back to ``REDIS_URL``; ``HMA_REDIS_PASSWORD``; ``HMA_REDIS_AUTH_KEY``;
``HMA_REDIS_ENCRYPTION_KEY`` and ``HMA_REDIS_ENCRYPTION_KEY_PREVIOUS``). Every bad value raises one
``ValueError`` whose message names the field; secrets (password, auth_key, encryption keys) never
appear in messages, logs or ``repr``.

vLLM logs ``kv_connector_extra_config`` at start-up, so secrets have ways in that avoid it: the
password from ``HMA_REDIS_PASSWORD``, ``password_file`` or the URL in ``HMA_REDIS_URL``; the
auth_key and the encryption keys only from their environment variables or ``*_file`` options
(refused in the extra config).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit, urlunsplit

import blake3

from hma_redis.core.deadline import MAX_READ_TIMEOUT_S, MIN_WAIT_S
from hma_redis.core.sealing import Keyring, SealingUnavailable, require_cipher

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV_VARS = ("HMA_REDIS_URL", "REDIS_URL")
PASSWORD_ENV = "HMA_REDIS_PASSWORD"
AUTH_KEY_ENV = "HMA_REDIS_AUTH_KEY"
ENCRYPTION_KEY_ENV = "HMA_REDIS_ENCRYPTION_KEY"
ENCRYPTION_KEY_PREVIOUS_ENV = "HMA_REDIS_ENCRYPTION_KEY_PREVIOUS"
# The secrets that never come from the extra config (vLLM logs it), by the ways they do come.
SECRETS_NOT_IN_EXTRA = {
    "auth_key": (AUTH_KEY_ENV, "auth_key_file"),
    "encryption_key": (ENCRYPTION_KEY_ENV, "encryption_key_file"),
    "encryption_key_previous": (ENCRYPTION_KEY_PREVIOUS_ENV, "encryption_key_previous_file"),
}
# A shorter shared secret is too easy to guess from a value's MAC (or the namespace's key id).
MIN_AUTH_KEY_BYTES = 16
# blake3 key-derivation context of auth_key_id (the MAC key has its own, in the codec).
_AUTH_KEY_ID_CONTEXT = "hma_redis 2026-11 auth_key id"
# Redis Cluster: ``redis+cluster://[user:pw@]host:port[,host:port...]/`` (startup nodes).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# Sentinel: ``redis+sentinel://[user:pw@]host:port[,host:port...]/<service>[/<db>]``.
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
TLS_SCHEMES = ("rediss", "rediss+cluster", "rediss+sentinel")
_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
# Schemes other Redis KV backends (LMCache) accept, refused with the spelling used here.
_OTHER_SPELLINGS = {
    scheme.replace("+", "-"): scheme for scheme in (*CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
}
_SINGLE_PORT = _CLUSTER_PORT = 6379
_SENTINEL_PORT = 26379
# Matched whole (fullmatch): a trailing newline or any other control character is refused.
_SERVICE_RE = re.compile(r"[^\s/\x00-\x1f\x7f-\x9f]{1,256}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-]{1,32}")
# A Linux congestion control's name (TCP_CA_NAME_MAX is 16 with its NUL), or "".
_CONGESTION_RE = re.compile(r"[a-z0-9_]{0,15}")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# connections_per_job: more connections than this per job only add Redis clients.
MAX_CONNECTIONS_PER_JOB = 64
# connections_per_thread: the C job's limit is 64; past a few, only more Redis clients.
MAX_CONNECTIONS_PER_THREAD = 8
MAX_IDLE_WAIT_MS = 100.0
# Every timeout and interval: the native path's poll() takes at most a day (int milliseconds),
# and a longer wait is a hang, not a timeout. read_timeout_s, which the data paths wait with
# and budget their jobs from, has the narrower range they take (hma_redis.core.deadline).
MAX_TIMEOUT_S = 86400.0
# ttl_s and admission_window_s go to Redis as SET ... EX: 100 years, far below Redis' own
# limit (an EX whose milliseconds overflow is refused, and then nothing is ever stored).
MAX_EXPIRE_S = 100 * 365 * 86400
# gil_switch_interval_ms: Python keeps the interval in whole microseconds (less is 0, a switch
# at every chance); above a second it no longer lowers anything.
MIN_GIL_SWITCH_INTERVAL_MS = 0.001
MAX_GIL_SWITCH_INTERVAL_MS = 1000.0
# redis-py's blocking pool allocates a slot per connection up front; threads per worker.
MAX_POOL_SIZE = 1024
MAX_IO_THREADS = 256
MAX_INFLIGHT_BYTES = 1 << 40
MAX_PIN_BUDGET_BYTES = 1 << 40
MAX_TENANT_BUDGET_BYTES = 1 << 50
# Admission policies (option ``admission``): store every computed chunk, or only one that some
# instance of the deployment already looked up (the second sighting).
ADMISSION_POLICIES = ("always", "second_sighting")

# Keys of kv_connector_extra_config that belong to vLLM's OffloadingConnector, not to us.
VLLM_OWNED_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "self_describing_kv_events",
        "offload_prompt_only",
    }
)


def split_userinfo(url: str) -> tuple[str, str | None, str]:
    """``(head, userinfo, rest)`` with ``url == head + userinfo + "@" + rest`` (``userinfo``
    ``None`` and ``url == head + rest`` when there is none).

    ``head`` is ``scheme://``. The userinfo is everything from there to the **last** ``@`` of
    the URL, whatever it contains: a password with unencoded ``/``, ``?``, ``#``, ``@``, ``:``,
    ``[`` ... is never mistaken for part of the host, path or query (an ``@`` elsewhere, e.g. in
    a sentinel service name, must be percent-encoded). A ``unix://`` URL's socket path starts
    with ``/``, so there the userinfo ends at the last ``@`` that a ``/`` follows (if any; else
    at the last ``@``). Text without ``://`` is all userinfo up to its last ``@``, so even a
    mistyped URL is redacted.
    """
    scheme, sep, tail = url.partition("://")
    head = scheme + sep if sep else ""
    if not sep:
        tail = url
    if tail.startswith("/"):
        return head, None, tail  # no authority (unix:///path, or a URL without a host)
    at = tail.rfind("@/") if scheme == "unix" else -1
    if at < 0:
        at = tail.rfind("@")
    if at < 0:
        return head, None, tail
    return head, tail[:at], tail[at + 1 :]


def strip_userinfo(url: str) -> str:
    """``url`` without user name and password; safe to hand to ``urlsplit`` (and to log, but
    for a ``password=`` query parameter: use :func:`redact_url` for that)."""
    head, _userinfo, rest = split_userinfo(url)
    return head + rest


def redact_url(url: str) -> str:
    """``url`` with nothing secret left in it, safe to show in any message. Never raises.

    Only what is known to be safe is shown: the scheme (letters, digits, ``+ . -``), the
    authority when it is a list of ``host[:digits]`` (IPv6 in brackets), the path when it has
    no ``:``, query keys and their numeric values. The userinfo (user name and password,
    whatever characters they hold) becomes ``***@``; an authority that is not a host list
    (``redis://user:password`` without ``@host``, a port that is not a number) hides all after
    ``scheme://``; a ``password=`` query value, any other non-numeric one, a path with a ``:``
    and a fragment become ``***``. Characters that are not printable are written as escapes,
    so the result is one line.
    """
    head, userinfo, rest = split_userinfo(url)
    if head and not _SCHEME_RE.fullmatch(head[: -len("://")]):
        return "***"
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, remainder = rest[:cut], rest[cut:]
    if not all(_HOST_ITEM_RE.fullmatch(item) for item in authority.split(",")):
        return head + "***"
    shown = head + ("***@" if userinfo is not None else "") + authority
    return _escaped(shown + _redact_remainder(remainder))


_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
# One entry of a host list: a name or IPv4 address, or an IPv6 address in brackets; a port.
_HOST_ITEM_RE = re.compile(r"(?:[A-Za-z0-9_.\-]*|\[[0-9A-Fa-f:.]*(?:%[A-Za-z0-9]+)?\])(?::[0-9]*)?")
_QUERY_KEY_RE = re.compile(r"[A-Za-z0-9_.\-]*")
_QUERY_VALUE_RE = re.compile(r"[0-9.]*")


def _redact_remainder(remainder: str) -> str:
    """Path, query and fragment of a URL (what follows the authority), redacted."""
    before, hash_sign, _fragment = remainder.partition("#")
    path, question, query = before.partition("?")
    if ":" in path:  # "user:password" typed where the host or the path should be
        path = "/***"
    return path + question + _redact_query(query) + ("#***" if hash_sign else "")


def _redact_query(query: str) -> str:
    """``query`` with every key that is not a plain word and every value that is not a
    number (a ``password=`` value whatever it holds) replaced by ``***``."""
    shown = []
    for pair in query.split("&") if query else ():
        key, equals, value = pair.partition("=")
        if not _QUERY_KEY_RE.fullmatch(key):
            key = "***"
        if equals and (key.lower() == "password" or not _QUERY_VALUE_RE.fullmatch(value)):
            value = "***"
        shown.append(key + equals + value)
    return "&".join(shown)


def _escaped(text: str) -> str:
    """``text`` with each character that is not printable written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def has_url_password(url: str) -> bool:
    """Whether ``url`` carries a password (in its userinfo or a ``password=`` query)."""
    _head, userinfo, rest = split_userinfo(url)
    if userinfo is not None and userinfo.partition(":")[2]:
        return True
    return "password=" in rest.lower()


def _split_url(url: str) -> SplitResult:
    """``urlsplit`` of ``url`` without its userinfo; a redacted ``ValueError`` if malformed."""
    try:
        return urlsplit(strip_userinfo(url))
    except ValueError:
        raise ValueError(
            f"hma_redis: redis_url has an invalid host or port: {redact_url(url)}"
        ) from None


@dataclass(frozen=True)
class RedisTierConfig:
    """Everything hma_redis needs to reach Redis and lay out its keys.

    Build it with :meth:`from_extra_config`; the constructor validates too, so an instance is
    always consistent.
    """

    url: str = DEFAULT_URL
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    # A file whose content (one trailing newline stripped) is the password.
    password_file: str | None = None
    db: int = 0
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 2.0
    pool_size: int = 8
    ttl_s: int | None = None
    key_prefix: str = "hma"
    namespace: str | None = None
    max_inflight_bytes: int = 256 * 1024 * 1024
    # Circuit breaker: after a failure, one probe per this interval until Redis answers.
    retry_interval_s: float = 2.0
    # Worker: threads doing Redis I/O, and how long shutdown waits for scheduled stores.
    io_threads: int = 4
    # Worker: connections one transfer job's chunks are split over, each driven by its own
    # thread running the native fast path (more for many cores, Redis io-threads).
    connections_per_job: int = 1
    # Worker: connections each of those threads spreads its values over from one call of the
    # fast path (value i on connection i mod N); jobs whose values may exceed 3 MiB use one.
    connections_per_thread: int = 2
    # Worker: the TCP congestion control of the connections values travel on ("": the
    # system's). bbr paces each connection below what Redis takes on a LAN or loopback.
    tcp_congestion: str = "cubic"
    shutdown_timeout_s: float = 30.0
    # Lower Python's GIL switch interval to this in the worker's process (0: leave it).
    gil_switch_interval_ms: float = 0.5
    # Worker: a step with nothing to compute waits for a running load to finish instead of
    # returning at once (0: never waits; vLLM's loop then spins); up to this long where the
    # worker cannot see requests reach the engine core (hma_redis.adapter.arrivals).
    idle_wait_ms: float = 2.0
    # Scheduler: a chunk this instance is storing answers HIT_PENDING for at most this long
    # (vLLM never completes stores it dropped, e.g. on reset_prefix_cache).
    store_pending_timeout_s: float = 30.0
    # TLS (rediss://) options.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    # Accept a random per-process hash seed (sharing across processes then gets no hits).
    allow_random_hash_seed: bool = False
    # Shared secret: every value carries a keyed MAC (codec). Never in repr, str or logs.
    auth_key: bytes | None = field(default=None, repr=False)
    # A file whose content (one trailing newline stripped) is the auth_key.
    auth_key_file: str | None = None
    # Secret: every value's body is sealed with it (AES-256-GCM, core/sealing.py), replacing
    # the auth_key's MAC; never in repr, str or logs. The previous key is accepted for reads
    # during a rotation (docs/security.md). Each also from a file, like the auth_key.
    encryption_key: bytes | None = field(default=None, repr=False)
    encryption_key_file: str | None = None
    encryption_key_previous: bytes | None = field(default=None, repr=False)
    encryption_key_previous_file: str | None = None
    # Scheduler, with vLLM's KV events on: watch Redis' keyspace notifications and emit removal
    # events for chunks Redis evicted, expired or deleted (turns the notify-keyspace-events
    # flags it needs on with CONFIG SET where allowed, keeping the others).
    removal_events: bool = True
    # Which computed chunks are stored: "always", or "second_sighting" (only a chunk some
    # instance of the deployment already looked up within admission_window_s).
    admission: str = "always"
    admission_window_s: int = 3600
    # Pins (a request's kv_transfer_params {"hma_redis_pin_s": N}; see hma_redis.core.redis.pins):
    # vLLM's OpenAI server passes kv_transfer_params from any API client, so pinning is the
    # operator's decision, off unless turned on (it needs ttl_s); a pin asking for more than
    # pin_max_s gets pin_max_s, and a namespace's pins hold at most pin_budget_bytes (chunks
    # beyond it are served unpinned).
    pinning: bool = False
    pin_max_s: int = 86400
    pin_budget_bytes: int = 1 << 30
    # Scheduler: how often pins whose deadline passed get their TTL back.
    pin_sweep_interval_s: float = 60.0
    # Per-tenant quotas (a tenant: a request's cache_salt; see hma_redis.core.redis.quotas and
    # docs/operations.md): account the bytes each tenant stores, and refuse a tenant's stores
    # while it holds its budget: tenant_budget_bytes (salted tenants; None: no default budget)
    # or the operator's override (hma-redis quota set). Off by default.
    tenant_quotas: bool = False
    tenant_budget_bytes: int | None = None
    # Scheduler: how often the tenants' bytes and budgets are read (the refusal's staleness),
    # and how often the account is checked against the chunks Redis still holds.
    quota_refresh_interval_s: float = 1.0
    quota_reconcile_interval_s: float = 300.0
    # Where to connect: parsed once from ``url`` when the config is built (never passed in).
    endpoint: Endpoint = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A secret file is read once, when the secret itself is not set: a copy made with
        # dataclasses.replace keeps the secret read by the original.
        if self.password_file is not None and self.password is None:
            secret = _read_secret(self.password_file, "password_file")
            try:
                object.__setattr__(self, "password", secret.decode())
            except UnicodeDecodeError:
                raise ValueError(
                    f"hma_redis: password_file is not UTF-8 text: {self.password_file}"
                ) from None
        for name in SECRETS_NOT_IN_EXTRA:
            path = getattr(self, f"{name}_file")
            if path is not None and getattr(self, name) is None:
                object.__setattr__(self, name, _read_secret(path, f"{name}_file"))
        # Credentials and db written in the URL apply unless given as fields (which win).
        for name, value in _url_parts(self.url).items():
            if getattr(self, name) == _DEFAULTS[name]:
                object.__setattr__(self, name, value)
        object.__setattr__(self, "endpoint", _validate(self))

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    @property
    def tls(self) -> bool:
        return self.endpoint.tls

    @property
    def auth_key_id(self) -> str:
        """A short, non-secret id of the auth_key ("" without one): 16 hex digits of a keyed
        BLAKE3 hash of a constant label. Equal keys give equal ids; the id reveals nothing
        about the key, so it may go into the namespace fingerprint and the logs."""
        if self.auth_key is None:
            return ""
        key = blake3.blake3(self.auth_key, derive_key_context=_AUTH_KEY_ID_CONTEXT).digest()
        return blake3.blake3(b"hma_redis auth_key id", key=key).hexdigest()[:16]

    @property
    def encryption_key_id(self) -> str:
        """The non-secret id of the encryption key that names the namespace ("" without
        encryption): the previous key's during a rotation, else the encryption key's
        (:attr:`hma_redis.core.sealing.Keyring.namespace_key_id`)."""
        keyring = self.keyring()
        return keyring.namespace_key_id if keyring is not None else ""

    @property
    def tenant_secret(self) -> bytes | None:
        """The secret tenant ids are keyed with (:func:`hma_redis.core.tenants.tenant_id`):
        the auth_key, else the encryption key that names the namespace (the previous one
        during a rotation, so ids change only with the namespace), else None."""
        return self.auth_key or self.encryption_key_previous or self.encryption_key

    def keyring(self) -> Keyring | None:
        """The keys values are sealed and opened with (None without an encryption_key)."""
        if self.encryption_key is None:
            return None
        return Keyring.from_secrets(self.encryption_key, self.encryption_key_previous)

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "url":
                value = self.redacted_url
            shown.append(f"{f.name}={value!r}")
        if self.password is not None:
            shown.append("password='***'")
        if self.auth_key is not None:
            shown.append(f"auth_key_id={self.auth_key_id!r}")
        if self.encryption_key is not None:
            shown.append(f"encryption_key_id={self.encryption_key_id!r}")
        return f"RedisTierConfig({', '.join(shown)})"

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        warn_credentials: bool = True,
    ) -> RedisTierConfig:
        """Build the config from ``kv_connector_extra_config`` plus the environment.

        The URL comes from ``redis_url`` in ``extra``, else ``HMA_REDIS_URL``, else ``REDIS_URL``,
        else the default. The password comes from ``password`` or ``password_file`` in ``extra``
        (not both), else ``HMA_REDIS_PASSWORD``, else the URL; the user name and database from
        the separate keys, else the URL. The auth_key comes from ``auth_key_file``, else
        ``HMA_REDIS_AUTH_KEY``; ``auth_key`` itself in ``extra`` is refused, because vLLM logs
        that dictionary. Unknown keys raise ``ValueError``. A password in ``extra`` (``password``
        or in ``redis_url``) is accepted with one WARNING naming the safe ways in, unless
        ``warn_credentials`` is false (tools whose options are not logged).
        """
        extra = dict(extra or {})
        env = os.environ if env is None else env
        for secret, (env_name, file_option) in SECRETS_NOT_IN_EXTRA.items():
            if secret in extra:
                raise ValueError(
                    f"hma_redis: {secret} must not be in kv_connector_extra_config (vLLM logs it "
                    f"at start-up); set the {env_name} environment variable or {file_option} "
                    "instead"
                )
        names = {f.name for f in dataclasses.fields(cls) if f.init} - {
            "url",
            *SECRETS_NOT_IN_EXTRA,
        }
        known = names | {"redis_url"} | VLLM_OWNED_KEYS
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ValueError(
                f"hma_redis: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known keys: {sorted(names | {'redis_url'})}"
            )
        url = extra.get("redis_url")
        if url is None:
            url = next((env[v] for v in URL_ENV_VARS if env.get(v)), DEFAULT_URL)
        if not isinstance(url, str):
            raise ValueError("hma_redis: redis_url must be a string")
        if extra.get("password") is not None and extra.get("password_file") is not None:
            raise ValueError("hma_redis: give password or password_file, not both")
        if warn_credentials:
            _warn_credentials_in_extra(extra)
        kwargs: dict[str, Any] = {"url": url}
        for name in names:
            if name in extra:
                kwargs[name] = _coerce(name, extra[name])
        explicit = kwargs.get("password") is not None or kwargs.get("password_file") is not None
        if not explicit and env.get(PASSWORD_ENV):
            kwargs["password"] = env[PASSWORD_ENV]
        for secret, (env_name, file_option) in SECRETS_NOT_IN_EXTRA.items():
            if kwargs.get(file_option) is None and env.get(env_name):
                kwargs[secret] = env[env_name].encode()
        return cls(**kwargs)


def _warn_credentials_in_extra(extra: Mapping[str, Any]) -> None:
    """One WARNING (without the secret) when a password arrives in the extra config."""
    where = []
    if extra.get("password") is not None:
        where.append("password")
    url = extra.get("redis_url")
    if isinstance(url, str) and has_url_password(url):
        where.append("a password in redis_url")
    if where:
        logger.warning(
            "hma_redis: kv_connector_extra_config holds %s, and vLLM logs that dictionary at "
            "start-up; give the password through %s, password_file or the URL in "
            "HMA_REDIS_URL instead (docs/security.md)",
            " and ".join(where),
            PASSWORD_ENV,
        )


def _read_secret(path: str, name: str) -> bytes:
    """The content of a secret file without one trailing newline; errors name the option and
    the path, never the content."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(
            f"hma_redis: {name} cannot be read: {path} ({exc.strerror or type(exc).__name__})"
        ) from None
    if data.endswith(b"\n"):  # one line ending, as editors and `echo` write it
        data = data[:-1].removesuffix(b"\r")
    if not data:
        raise ValueError(f"hma_redis: {name} is empty: {path}")
    return data


_DEFAULTS: dict[str, Any] = {"username": None, "password": None, "db": 0}
# Field kinds, from the annotations: a new option is coerced and checked like its kind.
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(RedisTierConfig) if f.init}
_INT_FIELDS = {n for n, t in _FIELD_TYPES.items() if t in ("int", "int | None")}
_FLOAT_FIELDS = {n for n, t in _FIELD_TYPES.items() if t in ("float", "float | None")}
_BOOL_FIELDS = {n for n, t in _FIELD_TYPES.items() if t == "bool"}


def _coerce(name: str, value: Any) -> Any:
    """Convert strings from JSON/CLI into the field's type; leave validation to ``_validate``."""
    if value is None:
        return None
    try:
        if name in _INT_FIELDS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if name in _FLOAT_FIELDS:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if name in _BOOL_FIELDS:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            raise TypeError
    except (TypeError, ValueError):
        kind = (
            "integer" if name in _INT_FIELDS else "number" if name in _FLOAT_FIELDS else "boolean"
        )
        raise ValueError(f"hma_redis: {name} must be a {kind}, got {value!r}") from None
    if not isinstance(value, str):
        raise ValueError(f"hma_redis: {name} must be a string, got {type(value).__name__}")
    return value


def _url_parts(url: str) -> dict[str, Any]:
    """Credentials and db found in the URL (validated later with the rest).

    The user name is the userinfo up to its first ``:``, the password all after it (see
    :func:`split_userinfo`), both percent-decoded.
    """
    head, userinfo, _rest = split_userinfo(url)
    if not head:
        raise ValueError(
            "hma_redis: redis_url must have the form scheme://[user:password@]host[:port][/db]: "
            f"{redact_url(url)}"
        )
    try:
        parts = urlsplit(strip_userinfo(url))
    except ValueError:
        raise ValueError(f"hma_redis: redis_url is not a URL: {redact_url(url)}") from None
    out: dict[str, Any] = {}
    user, _colon, password = (userinfo or "").partition(":")
    if user:
        out["username"] = unquote(user)
    if password:
        out["password"] = unquote(password)
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - {"db"})
    if unknown:
        raise ValueError(
            f"hma_redis: redis_url query parameter(s) {unknown} are not supported; use the "
            f"kv_connector_extra_config keys instead: {redact_url(url)}"
        )
    db_text = query.get("db", [None])[0]
    if parts.scheme in ("redis", "rediss", *CLUSTER_SCHEMES) and parts.path.strip("/"):
        db_text = parts.path.strip("/")
    if parts.scheme in SENTINEL_SCHEMES:
        segments = parts.path.strip("/").split("/")
        if len(segments) > 2:
            raise ValueError(
                "hma_redis: a sentinel redis_url has the form "
                f"redis+sentinel://host:port[,host:port]/<service>[/<db>]: {redact_url(url)}"
            )
        if len(segments) == 2:
            db_text = segments[1]
    if db_text is not None:
        if not db_text.isdigit():
            raise ValueError(f"hma_redis: db in redis_url must be an integer: {redact_url(url)}")
        out["db"] = int(db_text)
    return out


class EndpointKind(StrEnum):
    """How a deployment is reached: one server (``redis://``, ``rediss://``, ``unix://``), a
    Redis Cluster's startup nodes, or the sentinels of a monitored master."""

    SINGLE = "single"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


@dataclass(frozen=True)
class Endpoint:
    """Where to connect, parsed once from the URL (credentials, db and TLS files are config
    fields, never part of it).

    ``address``: a single server's URL without credentials, database or query (``unix://path``
    or ``scheme://host[:port]``), what its connection pool is built from; ``hosts``: the single
    server's ``(host, port)``, a cluster's startup nodes or the sentinels; ``socket_path``: a
    ``unix://`` server's socket; ``service``: the sentinels' master name.
    """

    kind: EndpointKind
    scheme: str
    tls: bool
    address: str = ""
    hosts: tuple[tuple[str, int], ...] = ()
    socket_path: str | None = None
    service: str | None = None


def _endpoint(parts: SplitResult, url: str) -> Endpoint:
    """The :class:`Endpoint` of ``url`` (split into ``parts``); ``ValueError`` (redacted) if
    its host list or service name is malformed."""
    tls = parts.scheme in TLS_SCHEMES
    if parts.scheme in CLUSTER_SCHEMES:
        hosts = _hosts(parts.netloc, _CLUSTER_PORT, url)
        return Endpoint(EndpointKind.CLUSTER, parts.scheme, tls, hosts=hosts)
    if parts.scheme in SENTINEL_SCHEMES:
        service = unquote(parts.path.strip("/").split("/")[0])
        if not _SERVICE_RE.fullmatch(service):
            raise ValueError(
                "hma_redis: a sentinel redis_url needs the master's service name: "
                f"redis+sentinel://host:port[,host:port]/<service>[/<db>]: {redact_url(url)}"
            )
        hosts = _hosts(parts.netloc, _SENTINEL_PORT, url)
        return Endpoint(EndpointKind.SENTINEL, parts.scheme, tls, hosts=hosts, service=service)
    address = _address(parts)
    if parts.scheme == "unix":
        return Endpoint(EndpointKind.SINGLE, "unix", False, address, socket_path=parts.path)
    host = ((parts.hostname or "", parts.port or _SINGLE_PORT),)
    return Endpoint(EndpointKind.SINGLE, parts.scheme, tls, address, hosts=host)


def _hosts(netloc: str, default_port: int, url: str) -> tuple[tuple[str, int], ...]:
    """``host[:port][,host[:port]...]`` of a cluster or sentinel URL (IPv6 in brackets)."""
    out: list[tuple[str, int]] = []
    for item in netloc.split(","):
        if item.startswith("["):
            host, bracket, rest = item[1:].partition("]")
            ok = bool(bracket) and (not rest or rest.startswith(":"))
            port_text = rest[1:]
        else:
            host, colon, port_text = item.partition(":")
            ok = not colon or bool(port_text)
        if not port_text:
            port_text = str(default_port)
        if not (ok and host and port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ValueError(f"hma_redis: redis_url has an invalid host or port: {redact_url(url)}")
        out.append((host, int(port_text)))
    return tuple(out)


def _address(parts: SplitResult) -> str:
    """A single server's URL without credentials, database or query: only where to connect.

    The connection's username, password and db always come from the config fields, so a value
    given as a separate key wins over one in the URL (redis-py would let the URL win).
    """
    if parts.scheme == "unix":
        return f"unix://{parts.path}"  # urlunsplit would drop the empty authority: unix:/path
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, "", "", ""))


def _validate(cfg: RedisTierConfig) -> Endpoint:
    """Check every field; the URL's :class:`Endpoint` (the one parse of the URL)."""
    parts = _split_url(cfg.url)
    if parts.scheme in _OTHER_SPELLINGS:
        right = _OTHER_SPELLINGS[parts.scheme]
        raise ValueError(
            f"hma_redis: redis_url scheme {parts.scheme}:// is spelled {right}:// in "
            f"hma_redis: {cfg.redacted_url}"
        )
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"hma_redis: redis_url scheme must be one of {list(_SCHEMES)}: {cfg.redacted_url}"
        )
    if parts.scheme in CLUSTER_SCHEMES or parts.scheme in SENTINEL_SCHEMES:
        if not parts.netloc:
            raise ValueError(f"hma_redis: redis_url has no host: {cfg.redacted_url}")
        endpoint = _endpoint(parts, cfg.url)  # raises on a bad host list or service name
        if parts.scheme in CLUSTER_SCHEMES and cfg.db != 0:
            raise ValueError(
                f"hma_redis: db must be 0 with Redis Cluster (it has no other), got {cfg.db}"
            )
    else:
        try:
            port = parts.port
        except ValueError:
            raise ValueError(
                f"hma_redis: redis_url has an invalid host or port: {cfg.redacted_url}"
            ) from None
        if parts.scheme == "unix" and not parts.path:
            raise ValueError(f"hma_redis: unix redis_url needs a socket path: {cfg.redacted_url}")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError(f"hma_redis: redis_url has no host: {cfg.redacted_url}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"hma_redis: redis_url port out of range: {cfg.redacted_url}")
        endpoint = _endpoint(parts, cfg.url)
    for name in sorted(_FLOAT_FIELDS):
        _finite(getattr(cfg, name), name)
    _validate_numbers(cfg)
    if not _PREFIX_RE.fullmatch(cfg.key_prefix):
        raise ValueError(
            "hma_redis: key_prefix must be 1-32 characters of [A-Za-z0-9_.-], "
            f"got {cfg.key_prefix!r}"
        )
    if not isinstance(cfg.tcp_congestion, str) or not _CONGESTION_RE.fullmatch(cfg.tcp_congestion):
        raise ValueError(
            "hma_redis: tcp_congestion must be a congestion control's name of up to 15 "
            f'characters of [a-z0-9_] (e.g. "cubic"), or "" for the system\'s, '
            f"got {cfg.tcp_congestion!r}"
        )
    if cfg.namespace is not None and not _NAMESPACE_RE.fullmatch(cfg.namespace):
        raise ValueError(
            f"hma_redis: namespace must be 1-64 characters of [A-Za-z0-9_.-], got {cfg.namespace!r}"
        )
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        path = getattr(cfg, name)
        if path is not None and parts.scheme not in TLS_SCHEMES:
            raise ValueError(
                f"hma_redis: {name} needs a rediss:// (or rediss+cluster://, rediss+sentinel://) "
                f"redis_url: {cfg.redacted_url}"
            )
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"hma_redis: {name} does not exist or is not a file: {path}")
    if (cfg.tls_cert_file is None) != (cfg.tls_key_file is None):
        raise ValueError("hma_redis: tls_cert_file and tls_key_file must be given together")
    _validate_auth_key(cfg.auth_key)
    _validate_encryption(cfg)
    if cfg.pinning and cfg.ttl_s is None:
        raise ValueError(
            "hma_redis: pinning needs ttl_s: a pin keeps a chunk without a TTL among chunks "
            "that have one, which maxmemory-policy volatile-lru / volatile-lfu never evicts"
        )
    if cfg.tenant_budget_bytes is not None and not cfg.tenant_quotas:
        raise ValueError(
            "hma_redis: tenant_budget_bytes needs tenant_quotas: true (without it no tenant's "
            "bytes are counted, and no budget is kept)"
        )
    if cfg.admission not in ADMISSION_POLICIES:
        raise ValueError(
            f"hma_redis: admission must be one of {list(ADMISSION_POLICIES)}, got {cfg.admission!r}"
        )
    return endpoint


def _validate_auth_key(key: object, name: str = "auth_key") -> None:
    if key is None:
        return
    if not isinstance(key, bytes):
        raise ValueError(f"hma_redis: {name} must be bytes, got {type(key).__name__}")
    if len(key) < MIN_AUTH_KEY_BYTES:
        raise ValueError(
            f"hma_redis: {name} must be at least {MIN_AUTH_KEY_BYTES} bytes, got {len(key)} "
            "(generate one with: openssl rand -hex 32)"
        )


def _validate_encryption(cfg: RedisTierConfig) -> None:
    """The encryption keys: bytes of at least the auth_key's minimum, a previous key only
    with a current one (and another), never with an auth_key (the cipher's tag authenticates:
    one check, not two), and the cipher's package installed."""
    for name in ("encryption_key", "encryption_key_previous"):
        _validate_auth_key(getattr(cfg, name), name)
    if cfg.encryption_key is None:
        if cfg.encryption_key_previous is not None:
            raise ValueError(
                "hma_redis: encryption_key_previous needs an encryption_key (the key values "
                f"are sealed with: {ENCRYPTION_KEY_ENV} or encryption_key_file)"
            )
        return
    if cfg.encryption_key_previous == cfg.encryption_key:
        raise ValueError("hma_redis: encryption_key_previous is the encryption_key itself")
    if cfg.auth_key is not None:
        raise ValueError(
            "hma_redis: encryption_key and auth_key are both set; give only the encryption_key "
            "(its cipher authenticates every value: the auth_key's MAC would be a second check)"
        )
    try:
        require_cipher()
    except SealingUnavailable as exc:
        raise ValueError(str(exc)) from None


def _finite(value: object, name: str) -> None:
    """Reject nan and +-inf (a timeout of inf never fires, nan compares false to everything)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"hma_redis: {name} must be a finite number, got {value}")


# Numeric options: (low, high, whether low itself is allowed). Every int and float field is
# here (tests/core/test_config.py checks it), so a new option gets a range with its field.
NUMERIC_RANGES: dict[str, tuple[float, float, bool]] = {
    "db": (0, 10_000, True),
    "connect_timeout_s": (0.0, MAX_TIMEOUT_S, False),
    "read_timeout_s": (MIN_WAIT_S, MAX_READ_TIMEOUT_S, True),
    "retry_interval_s": (0.0, MAX_TIMEOUT_S, False),
    "shutdown_timeout_s": (0.0, MAX_TIMEOUT_S, True),
    "store_pending_timeout_s": (0.0, MAX_TIMEOUT_S, False),
    "idle_wait_ms": (0.0, MAX_IDLE_WAIT_MS, True),
    "gil_switch_interval_ms": (MIN_GIL_SWITCH_INTERVAL_MS, MAX_GIL_SWITCH_INTERVAL_MS, True),
    "pool_size": (1, MAX_POOL_SIZE, True),
    "io_threads": (1, MAX_IO_THREADS, True),
    "connections_per_job": (1, MAX_CONNECTIONS_PER_JOB, True),
    "connections_per_thread": (1, MAX_CONNECTIONS_PER_THREAD, True),
    "max_inflight_bytes": (1, MAX_INFLIGHT_BYTES, True),
    "ttl_s": (1, MAX_EXPIRE_S, True),
    "admission_window_s": (1, MAX_EXPIRE_S, True),
    "pin_sweep_interval_s": (0.0, MAX_TIMEOUT_S, False),
    "pin_max_s": (1, MAX_EXPIRE_S, True),
    "pin_budget_bytes": (1, MAX_PIN_BUDGET_BYTES, True),
    "tenant_budget_bytes": (0, MAX_TENANT_BUDGET_BYTES, True),
    "quota_refresh_interval_s": (0.0, MAX_TIMEOUT_S, False),
    "quota_reconcile_interval_s": (0.0, MAX_TIMEOUT_S, False),
}
# Numeric options that may also be None (no expiry, no default budget).
_NONE_ALSO = frozenset({"ttl_s", "tenant_budget_bytes"})
# Options for which 0 also means something ("leave Python's interval alone").
_ZERO_ALSO = frozenset({"gil_switch_interval_ms"})


def _validate_numbers(cfg: RedisTierConfig) -> None:
    """Every numeric option within its range (those of ``_NONE_ALSO`` may also be ``None``)."""
    for name, (low, high, low_allowed) in NUMERIC_RANGES.items():
        value = getattr(cfg, name)
        if value is None and name in _NONE_ALSO:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"hma_redis: {name} must be a number, got {value!r}")
        if value == 0 and name in _ZERO_ALSO:
            continue
        if value < low or value > high or (value == low and not low_allowed):
            raise ValueError(f"hma_redis: {name} must be {_range_text(name)}, got {_num(value)}")


def _range_text(name: str) -> str:
    """The allowed range of a numeric option, as its error line says it."""
    low, high, low_allowed = NUMERIC_RANGES[name]
    text = f"{'>=' if low_allowed else '>'} {_num(low)} and <= {_num(high)}"
    if name in _ZERO_ALSO:
        text = f"0 or {text}"
    return text


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
