"""``lease_*`` settings: defaults, reading, validation. One :class:`Config` per app.

Settings are read once into a ``Config`` cached on the app and validated when
it is built (at worker start, by the worker bootstep, and at first use), with
errors that name the setting, the value and what is accepted. An unknown
``lease_*`` setting (a typo) is reported with the closest valid name.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from celery_lease import setting_readers as read
from celery_lease.appstate import app_state
from celery_lease.exceptions import LeaseConfigError
from celery_lease.keys import KeyLimits
from celery_lease.setting_readers import check_renew_interval
from celery_lease.stores.registry import is_sql_url, resolve
from celery_lease.urls import redact_url

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "CONFLICT_POLICIES",
    "DEFAULTS",
    "DEFAULT_SQLITE_URL",
    "DUPLICATE_POLICIES",
    "MODES",
    "SETTINGS",
    "Config",
    "Setting",
    "config",
]

logger = logging.getLogger(__name__)

#: The embedded default: one SQLite file shared by the workers of one machine.
DEFAULT_SQLITE_URL = "sqlite:///celery-lease.sqlite3"

MODES = ("exclusive", "once")
CONFLICT_POLICIES = ("defer", "reject", "wait")
DUPLICATE_POLICIES = ("reject", "return")


def _store_url(name: str, value: Any) -> str:
    return read.url(name, value or DEFAULT_SQLITE_URL)


@dataclass(frozen=True)
class Setting:
    """One ``lease_*`` setting: its name, default, reader and meaning.

    ``parse(name, value)`` gets the app's value, or ``default`` when the app
    sets none, and returns the :class:`Config` field or raises
    :class:`LeaseConfigError`; checks across settings are in
    :meth:`Config.from_app`. ``shown`` is the default column of docs/settings.md when
    ``default`` (None) stands for a value worked out from other settings.
    """

    name: str
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str
    shown: str = ""

    @property
    def field(self) -> str:
        """The :class:`Config` attribute it fills."""
        return self.name.removeprefix("lease_")

    @property
    def readme_default(self) -> str:
        """The default as docs/settings.md's table writes it."""
        if self.shown:
            return self.shown
        if isinstance(self.default, str):
            return f'`"{self.default}"`'
        if isinstance(self.default, float) and self.default.is_integer():
            return f"`{int(self.default)}`"
        return f"`{self.default!r}`"


#: Every setting, once: docs/settings.md's table is checked against these
#: (tests/acceptance/test_readme.py), and :meth:`Config.from_app` reads them in this order.
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "lease_store_url",
            None,
            _store_url,
            "where leases live: redis://, rediss://, postgresql+psycopg://, "
            "sqlite:///, etcd://host:port[,host:port...] or etcds:// (default: the "
            "embedded SQLite file)",
            shown=f"`{DEFAULT_SQLITE_URL}`",
        ),
        Setting(
            "lease_result_url",
            None,
            read.optional(read.url),
            "the fenced result table's database: postgresql+psycopg:// or "
            "sqlite:/// (default: the lease+ result backend's database, else the "
            "lease store's if it is SQL, else the embedded SQLite file)",
            shown="the lease+ backend's database, else the store's if SQL, else the SQLite file",
        ),
        Setting("lease_ttl", 30.0, read.ttl_seconds, "lease length in seconds (at most one year)"),
        Setting(
            "lease_renew_interval",
            None,
            read.optional(read.positive),
            "seconds between renewals (default: TTL / 3; at most TTL / 2, and interval + "
            "min(interval / 3, 1) < TTL - clock drift)",
            shown="TTL / 3",
        ),
        Setting("lease_mode", "exclusive", read.one_of(MODES), "exclusive | once"),
        Setting(
            "lease_on_conflict", "defer", read.one_of(CONFLICT_POLICIES), "defer | reject | wait"
        ),
        Setting(
            "lease_on_duplicate",
            "reject",
            read.one_of(DUPLICATE_POLICIES),
            "once mode: reject | return",
        ),
        Setting(
            "lease_key_prefix",
            "celery-lease",
            read.key_prefix,
            "namespace for the store's key names",
        ),
        Setting(
            "lease_send_events",
            True,
            read.flag,
            "send LEASE_* / FENCED task events (Flower states)",
        ),
        Setting(
            "lease_clock_drift",
            None,
            read.optional(read.number),
            "seconds taken off the local view of a lease (default: 2 % of TTL + 50 ms, "
            "at most 1 s)",
            shown="2 % of TTL + 50 ms, at most 1 s",
        ),
        Setting(
            "lease_result_expires",
            None,
            read.optional(read.seconds_or_timedelta),
            "seconds to keep accepted results before `lease sweep` deletes them (default: keep)",
            shown="keep",
        ),
        Setting(
            "lease_result_max_bytes",
            1024 * 1024,
            read.count,
            "largest JSON result accepted, in bytes",
        ),
        Setting(
            "lease_defer_max",
            100,
            read.count,
            "deferrals behind other tasks' leases before a task is rejected",
        ),
        Setting(
            "lease_wait_timeout",
            30.0,
            read.positive,
            "wait policy: seconds to poll before deferring",
        ),
        Setting(
            "lease_store_retry",
            5.0,
            read.number,
            "seconds to retry a claim while the store is unreachable before deferring",
        ),
        Setting(
            "lease_max_keys",
            100,
            read.count,
            "most lease keys one call may name (checked at publish and in the worker)",
        ),
        Setting(
            "lease_max_key_length",
            16384,
            read.count,
            "longest lease key or tenant, in characters, before shortening (checked at "
            "publish and in the worker)",
        ),
        Setting(
            "lease_metrics_port",
            None,
            read.optional(read.port),
            "serve Prometheus metrics from the worker on this port",
            shown="off",
        ),
        Setting(
            "lease_metrics_addr",
            "127.0.0.1",
            read.bind_address,
            "the address the metrics server listens on (loopback: only this machine can "
            "scrape; 0.0.0.0 or :: for every interface)",
        ),
        Setting(
            "lease_store_options",
            None,
            read.options,
            "extra keyword arguments for the store's client (e.g. TLS options for rediss:// "
            "or etcds://)",
            shown="none",
        ),
    )
}
DEFAULTS = {name: setting.default for name, setting in SETTINGS.items()}


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
    max_keys: int = 100
    max_key_length: int = 16384
    metrics_addr: str = "127.0.0.1"

    @cached_property  # read on every execution; a frozen Config's limits never change
    def limits(self) -> KeyLimits:
        return KeyLimits(self.max_keys, self.max_key_length)

    @classmethod
    def from_app(cls, app: Celery) -> Config:
        conf = app.conf
        _warn_unknown(conf)
        values: dict[str, Any] = {}
        for setting in SETTINGS.values():
            value = conf.get(setting.name)
            values[setting.field] = setting.parse(
                setting.name, setting.default if value is None else value
            )
        store_url = values["store_url"]
        if values["result_url"] is None:
            from celery_lease.backend_url import lease_backend_database

            # The lease+ backend's database first: the commit then writes the
            # accepted row and the task's state in one transaction.
            default = lease_backend_database(app) or (
                store_url if is_sql_url(store_url) else DEFAULT_SQLITE_URL
            )
            values["result_url"] = read.url("lease_result_url", default)
            if default == DEFAULT_SQLITE_URL and not is_sql_url(store_url):
                logger.warning(
                    "lease_result_url is not set: accepted results go to the embedded SQLite "
                    "file %s, which workers on other machines cannot see; set "
                    "lease_result_url to a PostgreSQL database shared by all workers",
                    DEFAULT_SQLITE_URL,
                )
        if not is_sql_url(values["result_url"]):
            raise LeaseConfigError(
                f"lease_result_url must be a SQL database (postgresql+psycopg://... or "
                f"sqlite:///...), got {redact_url(values['result_url'])!r}"
            )
        ttl, renew, drift = values["ttl"], values["renew_interval"], values["clock_drift"]
        if renew is not None:
            check_renew_interval(renew, ttl, "lease_renew_interval")
        if drift is not None and not 0 <= drift < ttl:
            raise LeaseConfigError(
                f"lease_clock_drift must be >= 0 and below lease_ttl ({ttl}), got {drift!r}"
            )
        check_renew_interval(renew, ttl, "lease_renew_interval", drift)
        resolve(store_url, "lease_store_url").check_options(
            store_url, values["store_options"], values["key_prefix"]
        )
        values["visibility_timeout"] = _visibility_timeout(conf)
        return cls(**values)


def config(app: Celery) -> Config:
    """The app's :class:`Config`, built and validated once, then kept with the app."""
    state = app_state(app)
    cfg = state.config
    if cfg is None:
        cfg = state.config = Config.from_app(app)
    return cfg


def limits(app: Celery) -> KeyLimits:
    """The app's key limits, without building its whole :class:`Config` (for publishers)."""
    cfg = app_state(app).config
    if cfg is not None:
        return cfg.limits
    conf = app.conf

    def get(name: str) -> Any:
        value = conf.get(name)
        return DEFAULTS[name] if value is None else value

    return KeyLimits(
        read.count("lease_max_keys", get("lease_max_keys")),
        read.count("lease_max_key_length", get("lease_max_key_length")),
    )


def _visibility_timeout(conf: Any) -> float | None:
    """The broker's visibility timeout: set, or the Redis transport's default of an hour."""
    transport = conf.get("broker_transport_options") or {}
    vt = transport.get("visibility_timeout")
    broker = str(conf.get("broker_url") or "")
    if vt is None and broker.startswith(("redis", "rediss", "sentinel")):
        vt = 3600.0
    return float(vt) if vt is not None else None


def _warn_unknown(conf: Any) -> None:
    known = set(SETTINGS)
    for name in list(conf.keys()):
        if isinstance(name, str) and name.lower().startswith("lease_") and name not in known:
            close = difflib.get_close_matches(name.lower(), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"unknown celery-lease setting {name!r}{hint}"
            logger.warning(message)
            warnings.warn(message, stacklevel=3)
