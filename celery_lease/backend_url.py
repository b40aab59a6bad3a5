"""The ``lease+`` result backend's URL, read from an app's settings and checked.

Apart from :mod:`celery_lease.backend` so that the settings (``config``,
``startup``) can read it without building the backend.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import ImproperlyConfigured

from celery_lease.exceptions import LeaseConfigError
from celery_lease.stores.registry import is_sql_url
from celery_lease.urls import check_sql_url, redact_url, scheme_of

__all__ = [
    "SCHEME",
    "LeaseBackendConfigError",
    "check_backend_url",
    "lease_backend_database",
    "lease_backend_url",
]

#: The backend's name in ``result_backend`` (``lease+<database URL>``).
SCHEME = "lease"

_FORMS = "lease+postgresql+psycopg://host/db, lease+postgresql://host/db or lease+sqlite:///path"


class LeaseBackendConfigError(LeaseConfigError, ImproperlyConfigured):  # type: ignore[misc]
    """The ``lease+`` result backend is misconfigured (its URL, its serializer).

    Both a :class:`~celery_lease.exceptions.LeaseConfigError` and Celery's
    ``ImproperlyConfigured``, so either family's handler catches it.
    """


def lease_backend_url(app: Any) -> str | None:
    """The database URL of ``app``'s result backend if it is this one, else None.

    Read from the settings (``result_backend``), without building the backend.
    """
    setting = app.backend_cls or app.conf.result_backend
    if isinstance(setting, str) and setting.lower().startswith(SCHEME + "+"):
        return setting.split("+", 1)[1]
    return None


def lease_backend_database(app: Any) -> str | None:
    """:func:`lease_backend_url` if it is an SQL database URL (``lease_result_url``'s
    default), else None (a wrong one fails when the backend is built)."""
    url = lease_backend_url(app)
    return url if url is not None and is_sql_url(url) else None


def check_backend_url(url: str | None) -> str:
    """``url`` (the part after ``lease+``) if it names a PostgreSQL or SQLite
    database, else a :class:`LeaseBackendConfigError` saying the URL forms."""
    if not url or "://" not in url:
        raise LeaseBackendConfigError(
            f"result_backend: the lease backend needs a database URL after 'lease+': {_FORMS}"
        )
    if scheme_of(url) == SCHEME or not is_sql_url(url):
        raise LeaseBackendConfigError(
            f"result_backend: lease+{redact_url(url)} is not a PostgreSQL or SQLite "
            f"database URL: {_FORMS}"
        )
    try:
        check_sql_url("result_backend", url)
    except LeaseConfigError as e:
        raise LeaseBackendConfigError(str(e)) from e
    return url
