"""One table says which store serves a URL scheme (``celery_lease.stores.registry``).

Every consumer asks it: ``LeaseStore.from_url``, the settings' URL checks, the
runtime's store options and the CLI. So every error listing the known schemes
lists all of them, every scheme the settings accept builds a store, and the
per-app state lives beside the app, not on it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from celery import Celery

import celery_lease
from celery_lease import LeaseConfigError
from celery_lease.config import Config, config
from celery_lease.events import broker_errors
from celery_lease.signals import install
from celery_lease.stores import registry
from celery_lease.stores.base import LeaseStore
from celery_lease.stores.sql import SQLLeaseStore
from celery_lease.task import Runtime

pytestmark = pytest.mark.timeout(120)


def _app(**settings: Any) -> Celery:
    app = Celery("registry", broker="memory://", set_as_current=False)
    app.conf.update(settings)
    return app


def test_every_known_scheme_resolves_to_a_store_class() -> None:
    known = registry.known_schemes()
    assert set(registry.ALIASES) <= set(known)
    assert {"etcd", "etcds", "postgres"} <= set(known)
    for scheme in known:
        store_cls = registry.store_class(scheme)
        assert isinstance(store_cls, type) and issubclass(store_cls, LeaseStore), scheme
    assert registry.store_class("mongodb") is None


def _known_in(message: str) -> list[str]:
    found = re.search(r"known: ([^;)]*)", message)
    assert found, message
    return found.group(1).split(", ")


def test_from_url_error_lists_every_known_scheme() -> None:
    with pytest.raises(LeaseConfigError) as e:
        LeaseStore.from_url("mongodb://127.0.0.1/leases")
    assert _known_in(str(e.value)) == list(registry.known_schemes())


@pytest.mark.parametrize("name", ["lease_store_url", "lease_result_url"])
def test_settings_error_lists_every_known_scheme(name: str) -> None:
    with pytest.raises(LeaseConfigError) as e:
        Config.from_app(_app(**{name: "mongodb://127.0.0.1/leases"}))
    assert str(e.value).startswith(f"{name}: unknown URL scheme 'mongodb'"), e.value
    assert _known_in(str(e.value)) == list(registry.known_schemes())


def test_postgres_scheme_is_postgresql_with_psycopg(pg_url: str) -> None:
    plain = "postgres://" + pg_url.split("://", 1)[1]
    celery_lease.migrate(pg_url)
    cfg = Config.from_app(_app(lease_store_url=plain))
    rt = Runtime(cfg)
    try:
        assert isinstance(rt.store, SQLLeaseStore)
        assert rt.store.url.startswith("postgresql+psycopg://")
        lease = rt.store.claim("registry-postgres", ttl=5, owner_id="a")
        assert lease is not None and rt.store.release(lease)
        assert rt.results.db.dialect == "postgresql"
    finally:
        rt.store.close()


def test_key_prefix_goes_only_to_stores_that_take_it() -> None:
    redis_cls = registry.store_class("redis")
    etcd_cls = registry.store_class("etcd")
    assert redis_cls is not None and etcd_cls is not None
    assert redis_cls.options_from_settings({}, "p") == {"key_prefix": "p"}
    assert etcd_cls.options_from_settings({"timeout": 2}, "p") == {"timeout": 2, "key_prefix": "p"}
    assert SQLLeaseStore.options_from_settings({}, "p") == {}


def test_per_app_state_is_not_stored_on_the_app(sqlite_url: str) -> None:
    app = _app(lease_store_url=sqlite_url)
    before = set(vars(app))
    assert config(app) is config(app)
    install(app)
    install(app)  # idempotent: the bootstep is added once
    assert broker_errors(app) is broker_errors(app)
    added = {name for name in set(vars(app)) - before if "lease" in name}
    assert not added, f"celery-lease state set on the app: {sorted(added)}"
    assert len([s for s in app.steps["worker"] if s.__name__ == "LeaseBootstep"]) == 1
