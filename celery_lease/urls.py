"""Store and database URLs: their scheme, redaction for logs, and start-time parsing.

The checks parse a URL the way its client will (redis-py, SQLAlchemy), so a
malformed ``lease_store_url`` or ``lease_result_url`` fails at worker start
with the setting's name, not at the first claim. Stores call them from their
:meth:`~celery_lease.stores.base.LeaseStore.check_url`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from celery_lease.exceptions import LeaseConfigError

__all__ = ["check_redis_url", "check_sql_url", "redact_url", "scheme_of"]


def scheme_of(url: str) -> str:
    """The lower-case scheme of ``url`` (``"postgresql+psycopg"``, ``"etcds"``)."""
    return url.split("://", 1)[0].lower()


def redact_url(url: str) -> str:
    """``url`` with its password and password-like query parameters masked
    (:func:`celery_lease.redaction.redact`), for logs, errors and CLI output."""
    from celery_lease.redaction import redact

    return redact(url)


def check_redis_url(name: str, url: str) -> None:
    """Refuse a ``redis://``, ``rediss://`` or ``unix://`` URL redis-py cannot use."""
    from redis.connection import parse_url

    shown = redact_url(url)
    try:
        parsed = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as e:
        raise LeaseConfigError(f"{name}: cannot parse {shown}: {e}") from e
    if scheme_of(url) == "unix":
        if not parsed.get("path"):
            raise LeaseConfigError(f"{name}: {shown} names no socket path (unix:///path)")
        return
    path = urlsplit(url).path.strip("/")
    if path and not path.isdigit():
        raise LeaseConfigError(
            f"{name}: the path of {shown} must be a Redis database number "
            f"(redis://host:6379/1), got {path!r}"
        )


def check_sql_url(name: str, url: str) -> None:
    """Refuse a PostgreSQL or SQLite URL SQLAlchemy cannot parse, or one naming no database."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    shown = redact_url(url)
    scheme = scheme_of(url)
    try:
        parsed = make_url(url)
        port = parsed.port
    except (ArgumentError, ValueError) as e:
        raise LeaseConfigError(f"{name}: cannot parse {shown}: {e}") from e
    if port is not None and not 0 < port < 65536:
        raise LeaseConfigError(f"{name}: port {port} of {shown} is not a TCP port (1-65535)")
    if scheme.startswith("sqlite") and (parsed.database or "") in ("", ":memory:"):
        raise LeaseConfigError(
            f"{name}: {shown} names no file; an SQLite store needs a file shared by all "
            "processes: sqlite:///path (for tests: celery_lease.testing, memory:// leases "
            "and a temporary SQLite file)"
        )
    if scheme.startswith("postgres") and not parsed.database:
        raise LeaseConfigError(
            f"{name}: {shown} names no database (postgresql+psycopg://host/dbname)"
        )
