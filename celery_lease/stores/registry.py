"""Which store class serves a URL scheme: one table, the way Celery resolves result backends.

``ALIASES`` names the built-in stores by dotted path (imported only when a URL
of theirs is used); the ``celery_lease.stores`` entry-point group adds
third-party ones. A built-in alias wins over an entry point of the same name,
so a package cannot take over ``redis://`` by registering it. Everything that
needs to know about schemes asks here; every error listing the known schemes
lists :func:`known_schemes`.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from celery_lease.exceptions import LeaseConfigError
from celery_lease.urls import redact_url, scheme_of

if TYPE_CHECKING:
    from celery_lease.stores.base import LeaseStore

__all__ = ["ALIASES", "ENTRY_POINT_GROUP", "is_sql_url", "known_schemes", "resolve", "store_class"]

#: Entry-point group third-party stores register under (``scheme = module:Class``).
ENTRY_POINT_GROUP = "celery_lease.stores"

_REDIS = "celery_lease.stores.redis:RedisLeaseStore"
_SENTINEL = "celery_lease.stores.redis_sentinel:SentinelLeaseStore"
_CLUSTER = "celery_lease.stores.redis_cluster:ClusterLeaseStore"
_SQL = "celery_lease.stores.sql:SQLLeaseStore"
_ETCD = "celery_lease.stores.etcd:EtcdLeaseStore"

#: The extra that brings each built-in store's driver.
_EXTRAS = {_REDIS: "redis", _SENTINEL: "redis", _CLUSTER: "redis", _SQL: "postgres", _ETCD: "etcd"}

#: Built-in schemes, in the order errors list them.
ALIASES: dict[str, str] = {
    "redis": _REDIS,
    "rediss": _REDIS,
    "unix": _REDIS,
    "sentinel": _SENTINEL,
    "redis+cluster": _CLUSTER,
    "rediss+cluster": _CLUSTER,
    "sqlite": _SQL,
    "postgresql": _SQL,
    "postgres": _SQL,
    "postgresql+psycopg": _SQL,
    "etcd": _ETCD,
    "etcds": _ETCD,
    "memory": "celery_lease.testing.memory:MemoryLeaseStore",  # for users' tests only
}


def aliases() -> dict[str, str]:
    """Every known scheme and the dotted path of its store class."""
    table = dict(ALIASES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        table.setdefault(ep.name, ep.value)
    return table


def known_schemes() -> tuple[str, ...]:
    """The schemes :func:`store_class` resolves: built-in first, then entry points."""
    return tuple(aliases())


def resolve(url: object, name: str) -> type[LeaseStore]:
    """The store class for ``url``, or a :class:`LeaseConfigError` naming ``name``
    (the setting, or the call, that gave the URL) and the known schemes."""
    if not isinstance(url, str) or not scheme_of(url):
        # Not quoted: without its scheme, or in a list, its password escapes redaction.
        got = "a string with no scheme://" if isinstance(url, str) else type(url).__name__
        raise LeaseConfigError(
            f"{name} must be a URL such as redis://host:6379/1, "
            f"postgresql+psycopg://host/db or sqlite:///path; got {got}"
        )
    scheme = scheme_of(url)
    store_cls = store_class(scheme)
    if store_cls is None:
        raise LeaseConfigError(
            f"{name}: unknown URL scheme {scheme!r} in {redact_url(url)!r}; "
            f"known: {', '.join(known_schemes())}"
        )
    return store_cls


def store_class(scheme: str) -> type[LeaseStore] | None:
    """The store class for ``scheme`` (lower case), imported now; None if unknown."""
    path = aliases().get(scheme)
    if path is None:
        return None
    try:
        store_cls: type[LeaseStore] = EntryPoint(scheme, path, ENTRY_POINT_GROUP).load()
    except ImportError as e:
        # A store whose driver is an optional dependency: say which extra brings it.
        extra = _EXTRAS.get(path)
        hint = f"pip install 'celery-lease[{extra}]'" if extra else "install its driver"
        raise LeaseConfigError(
            f"the {scheme}:// lease store needs {e.name or 'a driver'}, which is not "
            f"installed: {hint}"
        ) from e
    return store_cls


def is_sql_url(url: str) -> bool:
    """True if ``url`` is a SQL database's (it can also hold the fenced result table)."""
    store_cls = store_class(scheme_of(url))
    return store_cls is not None and store_cls.is_sql
