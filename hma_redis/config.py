"""One validated, immutable configuration for the Redis tier.

Built from vLLM's ``kv_connector_extra_config`` (the keys below, by name) plus the environment
(``HMA_REDIS_URL``, falling back to ``REDIS_URL``). Every bad value raises one ``ValueError`` whose
message names the field; passwords never appear in messages or ``repr``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV_VARS = ("HMA_REDIS_URL", "REDIS_URL")
# Redis Cluster: ``redis+cluster://[user:pw@]host:port[,host:port...]/`` (startup nodes).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# Sentinel: ``redis+sentinel://[user:pw@]host:port[,host:port...]/<service>[/<db>]``.
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
TLS_SCHEMES = ("rediss", "rediss+cluster", "rediss+sentinel")
_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
_CLUSTER_PORT = 6379
_SENTINEL_PORT = 26379
_SERVICE_RE = re.compile(r"^[^\s/]{1,256}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,32}$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

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


def redact_url(url: str) -> str:
    """Return ``url`` with any password (userinfo or query) replaced by ``***`` (safe to log).

    Works on the raw text of the authority, so URLs with several hosts (cluster, sentinel) or a
    bad port are redacted too.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    query = "&".join(
        f"{q.split('=', 1)[0]}=***" if q.lower().startswith("password=") else q
        for q in parts.query.split("&")
        if q
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


@dataclass(frozen=True)
class RedisTierConfig:
    """Everything hma_redis needs to reach Redis and lay out its keys.

    Build it with :meth:`from_extra_config`; the constructor validates too, so an instance is
    always consistent.
    """

    url: str = DEFAULT_URL
    username: str | None = None
    password: str | None = field(default=None, repr=False)
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
    shutdown_timeout_s: float = 30.0
    # Lower Python's GIL switch interval to this in the worker's process (0: leave it).
    gil_switch_interval_ms: float = 0.5
    # TLS (rediss://) options.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    # Accept a random per-process hash seed (sharing across processes then gets no hits).
    allow_random_hash_seed: bool = False

    def __post_init__(self) -> None:
        # Credentials and db written in the URL apply unless given as fields (which win).
        for name, value in _url_parts(self.url).items():
            if getattr(self, name) == _DEFAULTS[name]:
                object.__setattr__(self, name, value)
        _validate(self)

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme in TLS_SCHEMES

    @property
    def topology(self) -> Topology:
        """How to reach Redis: one server, a cluster's startup nodes, or sentinels."""
        return topology(self.url)

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
        return f"RedisTierConfig({', '.join(shown)})"

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RedisTierConfig:
        """Build the config from ``kv_connector_extra_config`` plus the environment.

        The URL comes from ``redis_url`` in ``extra``, else ``HMA_REDIS_URL``, else ``REDIS_URL``,
        else the default. Credentials and the database number may be in the URL or given as
        separate keys (separate keys win). Unknown keys raise ``ValueError``.
        """
        extra = dict(extra or {})
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)} - {"url"}
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
        kwargs: dict[str, Any] = _url_parts(url)
        kwargs["url"] = url
        for name in names:
            if name in extra:
                kwargs[name] = _coerce(name, extra[name])
        return cls(**kwargs)


_DEFAULTS: dict[str, Any] = {"username": None, "password": None, "db": 0}
_INT_FIELDS = {"db", "pool_size", "ttl_s", "max_inflight_bytes", "io_threads"}
_FLOAT_FIELDS = {
    "connect_timeout_s",
    "read_timeout_s",
    "retry_interval_s",
    "shutdown_timeout_s",
    "gil_switch_interval_ms",
}
_BOOL_FIELDS = {"tls_verify", "allow_random_hash_seed"}


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
    """Credentials and db found in the URL (validated later with the rest)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError(f"hma_redis: redis_url is not a URL: {redact_url(url)}") from None
    out: dict[str, Any] = {}
    if parts.username:
        out["username"] = unquote(parts.username)
    if parts.password:
        out["password"] = unquote(parts.password)
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


@dataclass(frozen=True)
class Topology:
    """Where to connect, parsed from the URL (credentials, db and TLS files are config fields).

    ``kind`` is ``"single"`` (``redis://``, ``rediss://``, ``unix://``: use :func:`endpoint_url`),
    ``"cluster"`` (``hosts`` are startup nodes) or ``"sentinel"`` (``hosts`` are the sentinels,
    ``service`` the name of the monitored master).
    """

    kind: str
    hosts: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    tls: bool = False


def topology(url: str) -> Topology:
    """Parse ``url`` into a :class:`Topology`; ``ValueError`` (redacted) if it is malformed."""
    parts = urlsplit(url)
    tls = parts.scheme in TLS_SCHEMES
    if parts.scheme in CLUSTER_SCHEMES:
        return Topology("cluster", _hosts(url, _CLUSTER_PORT), tls=tls)
    if parts.scheme in SENTINEL_SCHEMES:
        service = unquote(parts.path.strip("/").split("/")[0])
        if not _SERVICE_RE.match(service):
            raise ValueError(
                "hma_redis: a sentinel redis_url needs the master's service name: "
                f"redis+sentinel://host:port[,host:port]/<service>[/<db>]: {redact_url(url)}"
            )
        return Topology("sentinel", _hosts(url, _SENTINEL_PORT), service=service, tls=tls)
    return Topology("single", tls=tls)


def _hosts(url: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """``host[:port][,host[:port]...]`` of a cluster or sentinel URL (IPv6 in brackets)."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
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


def endpoint_url(url: str) -> str:
    """``url`` without credentials, database or query: only where to connect.

    The connection's username, password and db always come from the config fields, so a value
    given as a separate key wins over one in the URL (redis-py would let the URL win).
    """
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return urlunsplit(("unix", "", parts.path, "", ""))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, "", "", ""))


def _validate(cfg: RedisTierConfig) -> None:
    try:
        parts = urlsplit(cfg.url)
    except ValueError:
        raise ValueError(
            f"hma_redis: redis_url has an invalid host or port: {cfg.redacted_url}"
        ) from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"hma_redis: redis_url scheme must be one of {list(_SCHEMES)}: {cfg.redacted_url}"
        )
    if parts.scheme in CLUSTER_SCHEMES or parts.scheme in SENTINEL_SCHEMES:
        if not parts.netloc.rpartition("@")[2]:
            raise ValueError(f"hma_redis: redis_url has no host: {cfg.redacted_url}")
        topology(cfg.url)  # raises on a bad host list or a missing service name
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
    _positive(cfg.connect_timeout_s, "connect_timeout_s")
    _positive(cfg.read_timeout_s, "read_timeout_s")
    _positive(cfg.retry_interval_s, "retry_interval_s")
    _positive(cfg.shutdown_timeout_s, "shutdown_timeout_s", allow_zero=True)
    _positive(cfg.gil_switch_interval_ms, "gil_switch_interval_ms", allow_zero=True)
    _positive(cfg.pool_size, "pool_size")
    _positive(cfg.io_threads, "io_threads")
    _positive(cfg.max_inflight_bytes, "max_inflight_bytes")
    if not 0 <= cfg.db <= 10_000:
        raise ValueError(f"hma_redis: db must be between 0 and 10000, got {cfg.db}")
    if cfg.ttl_s is not None:
        _positive(cfg.ttl_s, "ttl_s")
    if not _PREFIX_RE.match(cfg.key_prefix):
        raise ValueError(
            "hma_redis: key_prefix must be 1-32 characters of [A-Za-z0-9_.-], "
            f"got {cfg.key_prefix!r}"
        )
    if cfg.namespace is not None and not _NAMESPACE_RE.match(cfg.namespace):
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


def _positive(value: float, name: str, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"hma_redis: {name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(
            f"hma_redis: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value}"
        )
