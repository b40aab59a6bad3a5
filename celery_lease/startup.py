"""What the worker checks and says when it starts (called by the bootstep).

- a ``lease+`` result backend is built first: a wrong setting of it (its URL,
  ``result_serializer``) refuses the start;
- the lease store answers a read: if not, one loud WARNING naming the
  (redacted) URL and the error. The worker starts anyway: a leased task that
  finds the store down retries for ``lease_store_retry``, then defers (its
  message goes back to the broker), so work waits for the store, it is not lost;
- each PostgreSQL database celery-lease writes (``lease_result_url``, a SQL
  ``lease_store_url`` if another, the ``lease+`` result backend's) has its
  tables at the current schema: if not, the worker refuses to start, naming
  the database and the command that creates them. SQLite files are migrated
  on first use, so they pass;
- then ONE banner line: store and results (redacted), key prefix, TTL.

:func:`refusal` turns a configuration error into the one-line exit Celery's
command line prints (``Error: ...``, exit 1) instead of a traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from celery.exceptions import CeleryCommandException

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.keys import INTERNAL_PREFIX
from celery_lease.stores.registry import is_sql_url
from celery_lease.urls import redact_url

if TYPE_CHECKING:
    from celery_lease.config import Config

__all__ = [
    "SchemaNotCurrent",
    "banner",
    "check_backend",
    "check_schema",
    "databases",
    "probe_store",
    "refusal",
    "run",
]

logger = logging.getLogger("celery_lease.startup")

#: The store key the start-up read asks for (an internal key: no user key can equal it).
PROBE_KEY = f"{INTERNAL_PREFIX}start-probe"


class SchemaNotCurrent(LeaseConfigError):
    """A database celery-lease writes lacks its tables, or has an older schema."""


def run(app: Any, cfg: Config) -> None:
    """The start-up checks and the banner; raises :class:`LeaseConfigError` to refuse."""
    check_backend(app)
    store_state = probe_store(cfg)
    results_state = check_schema(app, cfg)
    logger.info(
        banner(cfg, store_state, results_state),
        extra={"action": "start", "store": redact_url(cfg.store_url)},
    )


def check_backend(app: Any) -> None:
    """Build a ``lease+`` result backend now: its settings (URL, ``result_serializer``)
    are checked when it is built, and a wrong one then refuses the start in one
    line instead of failing later, while Celery prints its banner."""
    from celery_lease.backend_url import lease_backend_url

    if lease_backend_url(app) is not None:
        backend = app.backend
        logger.debug("celery-lease: result backend %s", backend.as_uri())


def probe_store(cfg: Config) -> str:
    """``"reachable"``, or ``"UNREACHABLE"`` after a WARNING naming the URL and the error."""
    from celery_lease.stores.base import LeaseStore

    store = LeaseStore.from_settings(cfg)
    try:
        store.inspect(PROBE_KEY)
    except StoreUnavailable as e:
        logger.warning(
            "celery-lease: the lease store %s is unreachable at start (%s); the worker "
            "starts anyway: leased tasks retry for lease_store_retry (%gs), then defer "
            "until the store is back (their work waits, it is not lost)",
            redact_url(cfg.store_url),
            e,
            cfg.store_retry,
            extra={"action": "store_unreachable", "store": redact_url(cfg.store_url)},
        )
        return "UNREACHABLE"
    finally:
        try:
            store.close()
        except StoreUnavailable:
            pass
    return "reachable"


def databases(app: Any, cfg: Config) -> list[str]:
    """The SQL databases celery-lease writes for ``app``: ``lease_result_url``, a
    SQL ``lease_store_url`` if another, and the ``lease+`` result backend's if
    another (``lease migrate`` migrates them; the worker checks them at start).

    Raises :class:`LeaseConfigError` for a ``lease+`` backend URL that names no
    PostgreSQL or SQLite database.
    """
    from celery_lease.backend_url import check_backend_url, lease_backend_url
    from celery_lease.sql.driver import normalize_sql_url

    urls = [cfg.result_url]
    if is_sql_url(cfg.store_url) and normalize_sql_url(cfg.store_url) != normalize_sql_url(
        cfg.result_url
    ):
        urls.append(cfg.store_url)
    backend = lease_backend_url(app)
    if backend is not None:
        check_backend_url(backend)
        if normalize_sql_url(backend) not in {normalize_sql_url(u) for u in urls}:
            urls.append(backend)
    return urls


def check_schema(app: Any, cfg: Config) -> str:
    """The results database's state for the banner; raises :class:`SchemaNotCurrent`."""
    from celery_lease.sql.driver import database
    from celery_lease.sql.migrate import HEAD, current

    state = "schema at head"
    for url in databases(app, cfg):
        db = database(url)
        if db.is_sqlite:
            if url == cfg.result_url:
                state = "SQLite, migrated on first use"
            continue
        try:
            at = current(db)
        except StoreUnavailable as e:
            logger.warning(
                "celery-lease: the database %s is unreachable at start (%s); the worker "
                "starts anyway: commits wait (the task is re-queued) until it is back",
                redact_url(url),
                e,
                extra={"action": "results_unreachable", "database": redact_url(url)},
            )
            if url == cfg.result_url:
                state = "UNREACHABLE"
            continue
        if at is not None and at > HEAD:  # revisions are zero-padded numbers
            raise SchemaNotCurrent(
                f"the database {redact_url(url)} is at revision {at}, newer than this "
                f"version of celery-lease knows ({HEAD}): upgrade celery-lease on this worker"
            )
        if at != HEAD:
            raise SchemaNotCurrent(
                f"the database {redact_url(url)} has no celery-lease tables or an older "
                f"schema (at revision {at or 'none'}, this version needs {HEAD}): "
                f"run celery -A {_app_argument(app)} lease migrate"
            )
    return state


def _app_argument(app: Any) -> str:
    """The worker's ``-A``/``--app`` value, for a command the operator can paste."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg in ("-A", "--app") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--app="):
            return arg.split("=", 1)[1]
        if arg.startswith("-A") and len(arg) > 2:
            return arg[2:]
    return str(getattr(app, "main", None) or "proj")


def banner(cfg: Config, store_state: str, results_state: str) -> str:
    return (
        f"celery-lease: store {redact_url(cfg.store_url)} ({store_state}), "
        f"results {redact_url(cfg.result_url)} ({results_state}), "
        f"key prefix {cfg.key_prefix!r}, TTL {cfg.ttl:g}s"
    )


def refusal(e: LeaseError) -> CeleryCommandException:
    """The exception that makes ``celery worker`` print ``Error: <one line>`` and exit 1.

    Celery's command line shows a ClickException as its message alone; any
    other exception raised while the worker is built ends in a traceback.
    """
    return CeleryCommandException(f"celery-lease: {type(e).__name__}: {e}", exit_code=1)
