"""The celery-lease pytest plugin: fixtures for testing code that uses leased tasks.

Registered as the ``pytest11`` entry point ``celery_lease.testing.pytest_plugin``
(so ``pytest_plugins = ["celery_lease.testing.pytest_plugin"]`` in a conftest is
harmless when it is installed, and works when it is not); ``-p
no:celery_lease.testing.pytest_plugin`` turns it off. It is inert unless a test
asks for one of its fixtures: it touches no store, file or setting otherwise.

Fixtures (none clashes with pytest-celery's ``celery_*`` names):

``lease_store_url``
    A fresh ``memory://`` space per test (dropped after it), or the URL given
    by ``--lease-store-url`` / ``CELERY_LEASE_TEST_STORE_URL``.
``lease_result_url``
    ``sqlite:///`` a file in the test's ``tmp_path``, or ``--lease-result-url``
    / ``CELERY_LEASE_TEST_RESULT_URL`` (a PostgreSQL URL is migrated first).
``lease_settings``
    ``{"lease_store_url": ..., "lease_result_url": ...}`` for ``app.conf.update``
    or pytest-celery's ``celery_config``: nothing is written to the current
    directory.
``lease_store``
    The store ``lease_store_url`` names (a :class:`MemoryLeaseStore` by
    default: ``advance``, ``expire``, ``take_over``).
``lease_session_store_url``, ``lease_session_result_url``, ``lease_session_settings``,
``lease_session_store``
    The same, one per session, for ``celery_session_app`` /
    ``celery_session_worker`` (which are session-scoped).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_lease.stores.base import LeaseStore
from celery_lease.testing.memory import MemoryLeaseStore

__all__ = [
    "lease_result_url",
    "lease_session_result_url",
    "lease_session_settings",
    "lease_session_store",
    "lease_session_store_url",
    "lease_settings",
    "lease_store",
    "lease_store_url",
]

STORE_ENV = "CELERY_LEASE_TEST_STORE_URL"
RESULT_ENV = "CELERY_LEASE_TEST_RESULT_URL"

_migrated: set[str] = set()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-lease")
    group.addoption(
        "--lease-store-url",
        default=None,
        help=f"lease store for the lease_* fixtures (default: memory://; env {STORE_ENV})",
    )
    group.addoption(
        "--lease-result-url",
        default=None,
        help=f"result database for the lease_* fixtures (default: a temporary SQLite file; "
        f"env {RESULT_ENV})",
    )


def _given(config: pytest.Config, option: str, env: str) -> str | None:
    value = config.getoption(option, default=None) or os.environ.get(env) or None
    if value and value.split("://", 1)[0].lower().startswith("postgres") and value not in _migrated:
        import celery_lease

        celery_lease.migrate(value)
        _migrated.add(value)
    return value


def _store_url(config: pytest.Config) -> Iterator[str]:
    given = _given(config, "--lease-store-url", STORE_ENV)
    if given:
        yield given
        return
    url = f"memory://pytest-{uuid.uuid4().hex}"
    try:
        yield url
    finally:
        MemoryLeaseStore(url).drop()


def _result_url(config: pytest.Config, folder: Path) -> str:
    given = _given(config, "--lease-result-url", RESULT_ENV)
    return given or f"sqlite:///{folder / 'results.sqlite3'}"


def _settings(store_url: str, result_url: str) -> dict[str, Any]:
    return {"lease_store_url": store_url, "lease_result_url": result_url}


def _store(url: str) -> Iterator[LeaseStore]:
    store = LeaseStore.from_url(url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def lease_store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh ``memory://`` space for this test, or the URL given on the command line."""
    yield from _store_url(request.config)


@pytest.fixture
def lease_result_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A SQLite file in this test's ``tmp_path``, or the URL given on the command line."""
    return _result_url(request.config, tmp_path)


@pytest.fixture
def lease_settings(lease_store_url: str, lease_result_url: str) -> dict[str, Any]:
    """The ``lease_*`` settings of this test's store and result database."""
    return _settings(lease_store_url, lease_result_url)


@pytest.fixture
def lease_store(lease_store_url: str) -> Iterator[LeaseStore]:
    """The store of :func:`lease_settings` (a :class:`MemoryLeaseStore` by default)."""
    yield from _store(lease_store_url)


@pytest.fixture(scope="session")
def lease_session_store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from _store_url(request.config)


@pytest.fixture(scope="session")
def lease_session_result_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> str:
    return _result_url(request.config, tmp_path_factory.mktemp("celery-lease"))


@pytest.fixture(scope="session")
def lease_session_settings(
    lease_session_store_url: str, lease_session_result_url: str
) -> dict[str, Any]:
    return _settings(lease_session_store_url, lease_session_result_url)


@pytest.fixture(scope="session")
def lease_session_store(lease_session_store_url: str) -> Iterator[LeaseStore]:
    yield from _store(lease_session_store_url)
