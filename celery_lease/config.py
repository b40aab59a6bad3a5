"""``lease_*`` settings: defaults, reading, validation. One :class:`Config` per app.

Settings are read once into a ``Config`` cached on the app and validated when
it is built (at worker start, by the worker bootstep, and at first use), with
errors that name the setting, the value and what is accepted. An unknown
``lease_*`` setting (a typo) is reported with the closest valid name.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from celery_lease.exceptions import LeaseConfigError

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "CONFLICT_POLICIES",
    "DEFAULTS",
    "DEFAULT_SQLITE_URL",
    "DUPLICATE_POLICIES",
    "MODES",
    "Config",
    "config",
]

logger = logging.getLogger(__name__)

#: The embedded default: one SQLite file shared by the workers of one machine.
DEFAULT_SQLITE_URL = "sqlite:///celery-lease.sqlite3"

MODES = ("exclusive", "once")
CONFLICT_POLICIES = ("defer", "reject", "wait")
DUPLICATE_POLICIES = ("reject", "return")

#: Every setting, its default, and what it means (the README's table is made from this).
SETTINGS: dict[str, tuple[Any, str]] = {
    "lease_store_url": (
        None,
        "where leases live: redis://, rediss://, postgresql+psycopg://, "
        "sqlite:///, etcd://host:port[,host:port...] or etcds:// (default: the "
        "embedded SQLite file)",
    ),
    "lease_result_url": (
        None,
        "the fenced result table's database: postgresql+psycopg:// or "
        "sqlite:/// (default: the lease store's database if it is SQL, "
        "else the embedded SQLite file)",
    ),
    "lease_ttl": (30.0, "lease length in seconds (at most one year)"),
    "lease_renew_interval": (
        None,
        "seconds between renewals (default: TTL / 3; at most TTL / 2, and interval + "
        "min(interval / 3, 1) < TTL - clock drift)",
    ),
    "lease_mode": ("exclusive", "exclusive | once"),
    "lease_on_conflict": ("defer", "defer | reject | wait"),
    "lease_on_duplicate": ("reject", "once mode: reject | return"),
    "lease_key_prefix": ("celery-lease", "namespace for the store's key names"),
    "lease_send_events": (True, "send LEASE_* / FENCED task events (Flower states)"),
    "lease_clock_drift": (
        None,
        "seconds taken off the local view of a lease (default: 2 % of TTL + 50 ms, at most 1 s)",
    ),
    "lease_result_expires": (
        None,
        "seconds to keep accepted results before `lease sweep` deletes them (default: keep)",
    ),
    "lease_result_max_bytes": (1024 * 1024, "largest JSON result accepted, in bytes"),
    "lease_defer_max": (100, "deferrals behind other tasks' leases before a task is rejected"),
    "lease_wait_timeout": (30.0, "wait policy: seconds to poll before deferring"),
    "lease_store_retry": (
        5.0,
        "seconds to retry a claim while the store is unreachable before deferring",
    ),
    "lease_metrics_port": (None, "serve Prometheus metrics from the worker on this port"),
    "lease_store_options": (
        None,
        "extra keyword arguments for the store's client (e.g. TLS options for rediss:// "
        "or etcds://)",
    ),
}
DEFAULTS = {name: default for name, (default, _) in SETTINGS.items()}


@dataclass(frozen=True)
class Config:
    """Validated ``lease_*`` settings of one app."""

    store_url: str
    result_url: str
    ttl: float
    renew_interval: float | None
    mode: str
    on_conflict: str
    on_duplicate: str
    key_prefix: str
    send_events: bool
    clock_drift: float | None
    result_expires: float | None
    result_max_bytes: int
    defer_max: int
    wait_timeout: float
    store_retry: float
    metrics_port: int | None
    store_options: dict[str, Any]
    visibility_timeout: float | None

    @classmethod
    def from_app(cls, app: Celery) -> Config:
        conf = app.conf
        _warn_unknown(conf)

        def get(name: str) -> Any:
            value = conf.get(name)
            return DEFAULTS[name] if value is None else value

        store_url = _url("lease_store_url", get("lease_store_url") or DEFAULT_SQLITE_URL)
        result_url = get("lease_result_url")
        if result_url is None:
            result_url = store_url if _is_sql(store_url) else DEFAULT_SQLITE_URL
            if not _is_sql(store_url):
                logger.warning(
                    "lease_result_url is not set: accepted results go to the embedded SQLite "
                    "file %s, which workers on other machines cannot see; set "
                    "lease_result_url to a PostgreSQL database shared by all workers",
                    DEFAULT_SQLITE_URL,
                )
        result_url = _url("lease_result_url", result_url)
        if not _is_sql(result_url):
            raise LeaseConfigError(
                f"lease_result_url must be a SQL database (postgresql+psycopg://... or "
                f"sqlite:///...), got {result_url!r}"
            )
        ttl = _number("lease_ttl", get("lease_ttl"), positive=True)
        check_max_ttl(ttl, "lease_ttl")
        renew = conf.get("lease_renew_interval")
        if renew is not None:
            renew = _number("lease_renew_interval", renew, positive=True)
            check_renew_interval(renew, ttl, "lease_renew_interval")
        drift = conf.get("lease_clock_drift")
        if drift is not None:
            drift = _number("lease_clock_drift", drift)
            if not 0 <= drift < ttl:
                raise LeaseConfigError(
                    f"lease_clock_drift must be >= 0 and below lease_ttl ({ttl}), got {drift!r}"
                )
        check_renew_interval(renew, ttl, "lease_renew_interval", drift)
        expires = conf.get("lease_result_expires")
        if expires is not None:
            if hasattr(expires, "total_seconds"):
                expires = expires.total_seconds()
            expires = _number("lease_result_expires", expires, positive=True)
        port = conf.get("lease_metrics_port")
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
        ):
            raise LeaseConfigError(f"lease_metrics_port must be a TCP port number, got {port!r}")
        options = conf.get("lease_store_options") or {}
        if not isinstance(options, dict):
            raise LeaseConfigError(
                f"lease_store_options must be a dict of client options, got {options!r}"
            )
        key_prefix = _string("lease_key_prefix", get("lease_key_prefix"))
        if "{" in key_prefix or "}" in key_prefix:
            # Braces would move the Redis Cluster hash tag off the lease key, so a
            # key's lease and fence counter could land in different slots.
            raise LeaseConfigError(
                f"lease_key_prefix must not contain '{{' or '}}' (Redis Cluster hash tags), "
                f"got {key_prefix!r}"
            )
        _check_store_options(store_url, options, key_prefix)
        transport = conf.get("broker_transport_options") or {}
        vt = transport.get("visibility_timeout")
        broker = str(conf.get("broker_url") or "")
        if vt is None and broker.startswith(("redis", "rediss", "sentinel")):
            vt = 3600.0
        return cls(
            store_url=store_url,
            result_url=result_url,
            ttl=ttl,
            renew_interval=renew,
            mode=choice("lease_mode", get("lease_mode"), MODES),
            on_conflict=choice("lease_on_conflict", get("lease_on_conflict"), CONFLICT_POLICIES),
            on_duplicate=choice(
                "lease_on_duplicate", get("lease_on_duplicate"), DUPLICATE_POLICIES
            ),
            key_prefix=key_prefix,
            send_events=_bool("lease_send_events", get("lease_send_events")),
            clock_drift=drift,
            result_expires=expires,
            result_max_bytes=_count("lease_result_max_bytes", get("lease_result_max_bytes")),
            defer_max=_count("lease_defer_max", get("lease_defer_max")),
            wait_timeout=_number("lease_wait_timeout", get("lease_wait_timeout"), positive=True),
            store_retry=_number("lease_store_retry", get("lease_store_retry")),
            metrics_port=port,
            store_options=dict(options),
            visibility_timeout=float(vt) if vt is not None else None,
        )


def config(app: Celery) -> Config:
    """The app's :class:`Config`, built and validated once, then cached on the app."""
    cfg: Config | None = getattr(app, "_celery_lease_config", None)
    if cfg is None:
        cfg = Config.from_app(app)
        app._celery_lease_config = cfg
    return cfg


def check_renew_interval(
    renew: float | None,
    ttl: float,
    name: str,
    clock_drift: float | None = None,
    *,
    ttl_name: str = "lease_ttl",
    drift_name: str = "lease_clock_drift",
) -> None:
    """Refuse a renew interval (None: TTL / 3) that cannot keep a lease of ``ttl``.

    At most half the TTL, and, with ``clock_drift`` (None: the default drift)
    taken off, the first renewal and one retry of it must come before the local
    view of the lease ends (:func:`celery_lease.renewal.check_schedule`).
    ``name`` is the interval's name in the error, ``ttl_name`` and
    ``drift_name`` the others'.
    """
    from celery_lease.renewal import check_schedule

    if renew is not None and renew > ttl / 2:
        raise LeaseConfigError(
            f"{name} ({renew}) must be at most half the TTL ({ttl}) so a renewal can fail "
            "once and still be retried before the lease runs out"
        )
    check_schedule(ttl, renew, clock_drift, names=(ttl_name, name, drift_name))


def check_max_ttl(ttl: float, name: str) -> None:
    """Refuse a TTL over :data:`celery_lease.stores.base.MAX_TTL` (one year)."""
    from celery_lease.stores.base import MAX_TTL

    if ttl > MAX_TTL:
        raise LeaseConfigError(f"{name} must be at most {MAX_TTL:.0f} (one year), got {ttl!r}")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise LeaseConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return str(value)


def _number(name: str, value: Any, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LeaseConfigError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise LeaseConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise LeaseConfigError(f"{name} must be greater than 0, got {value!r}")
    if not positive and value < 0:
        raise LeaseConfigError(f"{name} must not be negative, got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    """A whole number >= 1 (a float like 0.5 must not become 0, which means "off")."""
    number = _number(name, value, positive=True)
    if number != int(number):
        raise LeaseConfigError(f"{name} must be a whole number (1, 2, ...), got {value!r}")
    return int(number)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LeaseConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise LeaseConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _url(name: str, value: Any) -> str:
    if not isinstance(value, str) or "://" not in value:
        raise LeaseConfigError(
            f"{name} must be a URL such as redis://host:6379/1, "
            f"postgresql+psycopg://host/db or sqlite:///path; got {value!r}"
        )
    from celery_lease.stores.base import redact_url

    scheme = value.split("://", 1)[0].lower()
    known = ("redis", "rediss", "unix", "sqlite", "postgresql", "postgres", "postgresql+psycopg")
    if scheme not in known:
        from importlib.metadata import entry_points

        stores = {"memory"} | {ep.name for ep in entry_points(group="celery_lease.stores")}
        if scheme not in stores:
            raise LeaseConfigError(
                f"{name}: unknown URL scheme {scheme!r} in {redact_url(value)!r}; "
                f"known: {', '.join(known)}"
            )
        return value
    _parse_url(name, value, scheme)
    return value


def _parse_url(name: str, value: str, scheme: str) -> None:
    """Parse ``value`` as its client will, so a malformed URL fails at start, naming ``name``."""
    from celery_lease.stores.base import redact_url

    shown = redact_url(value)
    if scheme in ("redis", "rediss", "unix"):
        from redis.connection import parse_url

        try:
            parsed = parse_url(value)  # type: ignore[no-untyped-call]
        except ValueError as e:
            raise LeaseConfigError(f"{name}: cannot parse {shown}: {e}") from e
        if scheme == "unix":
            if not parsed.get("path"):
                raise LeaseConfigError(f"{name}: {shown} names no socket path (unix:///path)")
            return
        path = urlsplit(value).path.strip("/")
        if path and not path.isdigit():
            raise LeaseConfigError(
                f"{name}: the path of {shown} must be a Redis database number "
                f"(redis://host:6379/1), got {path!r}"
            )
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(value)
        port = url.port
    except (ArgumentError, ValueError) as e:
        raise LeaseConfigError(f"{name}: cannot parse {shown}: {e}") from e
    if port is not None and not 0 < port < 65536:
        raise LeaseConfigError(f"{name}: port {port} of {shown} is not a TCP port (1-65535)")
    if scheme.startswith("sqlite") and (url.database or "") in ("", ":memory:"):
        raise LeaseConfigError(
            f"{name}: {shown} names no file; an SQLite store needs a file shared by all "
            "processes: sqlite:///path (for tests: celery_lease.testing, memory:// leases "
            "and a temporary SQLite file)"
        )
    if scheme.startswith("postgres") and not url.database:
        raise LeaseConfigError(
            f"{name}: {shown} names no database (postgresql+psycopg://host/dbname)"
        )


def _check_store_options(store_url: str, options: dict[str, Any], key_prefix: str) -> None:
    """``lease_store_options`` are the Redis client's keyword arguments; check them now.

    An etcd store is built (no I/O) even without options, so a malformed
    ``etcd://`` URL or a missing certificate file fails at worker start.
    """
    if store_url.split("://", 1)[0].lower() in ("etcd", "etcds"):
        from celery_lease.stores.base import LeaseStore

        if "key_prefix" in options:
            raise LeaseConfigError("set lease_key_prefix, not lease_store_options['key_prefix']")
        LeaseStore.from_url(store_url, key_prefix=key_prefix, **options).close()
        return
    if not options:
        return
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise LeaseConfigError(f"lease_store_options keys must be strings, got {bad!r}")
    scheme = store_url.split("://", 1)[0].lower()
    if scheme not in ("redis", "rediss", "unix"):
        if _is_sql(store_url):
            raise LeaseConfigError(
                "lease_store_options applies to Redis lease stores only; for PostgreSQL put "
                "connection options in lease_store_url's query (?sslmode=verify-full&"
                f"sslrootcert=/path/ca.crt), got {sorted(options)}"
            )
        return  # a third-party store: its own options
    if "key_prefix" in options:
        raise LeaseConfigError("set lease_key_prefix, not lease_store_options['key_prefix']")
    for option in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path"):
        path = options.get(option)
        if path is not None and not (isinstance(path, str) and os.path.exists(path)):
            raise LeaseConfigError(f"lease_store_options[{option!r}]: no such file {path!r}")
    from celery_lease.stores.base import LeaseStore

    LeaseStore.from_url(store_url, key_prefix=key_prefix, **options).close()


def _is_sql(url: str) -> bool:
    return url.split("://", 1)[0].lower().startswith(("sqlite", "postgres"))


def _warn_unknown(conf: Any) -> None:
    known = set(SETTINGS)
    for name in list(conf.keys()):
        if isinstance(name, str) and name.lower().startswith("lease_") and name not in known:
            close = difflib.get_close_matches(name.lower(), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"unknown celery-lease setting {name!r}{hint}"
            logger.warning(message)
            warnings.warn(message, stacklevel=3)
