"""The Sentinel and Cluster URL forms and store options, checked without a server.

URLs and options are refused at worker start (``check_url`` /
``check_options``) with the setting's name; the stores are built without I/O
(redis-py connects on first use; the Cluster client is made on first use).
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_lease import LeaseConfigError, LeaseStore
from celery_lease.stores.redis_cluster import ClusterLeaseStore
from celery_lease.stores.redis_sentinel import SentinelLeaseStore
from celery_lease.stores.registry import store_class
from celery_lease.urls import parse_cluster_url, parse_sentinel_url

S = "lease_store_url"


def test_the_schemes_resolve_to_the_ha_stores() -> None:
    assert store_class("sentinel") is SentinelLeaseStore
    assert store_class("redis+cluster") is ClusterLeaseStore
    assert store_class("rediss+cluster") is ClusterLeaseStore


@pytest.mark.parametrize(
    ("url", "addresses", "db", "password"),
    [
        ("sentinel://h1:26379;sentinel://h2:26380;sentinel://h3/1",
         [("h1", 26379), ("h2", 26380), ("h3", 26379)], 1, None),
        ("sentinel://:pw@h1:26379/2;sentinel://:pw@h2:26379/2",
         [("h1", 26379), ("h2", 26379)], 2, "pw"),
        ("sentinel://h1", [("h1", 26379)], 0, None),
        ("SENTINEL://h1:1;sentinel://h2:2/", [("h1", 1), ("h2", 2)], 0, None),
    ],
)  # fmt: skip
def test_sentinel_urls_in_kombus_form(
    url: str, addresses: list[tuple[str, int]], db: int, password: str | None
) -> None:
    nodes = parse_sentinel_url(S, url)
    assert (list(nodes.addresses), nodes.db, nodes.password) == (addresses, db, password)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sentinel://h1/1;sentinel://h2/2", "different databases"),
        ("sentinel://h1;redis://h2", "must start with sentinel://"),
        ("sentinel://h1/x", "database number"),
        ("sentinel://h1:99999", "cannot parse"),
        ("sentinel://:26379", "naming no host"),
        ("sentinel://h1?master_name=m", "lease_store_options"),
    ],
)
def test_bad_sentinel_urls_are_refused_with_the_settings_name(url: str, message: str) -> None:
    with pytest.raises(LeaseConfigError, match=message) as info:
        SentinelLeaseStore.check_url(S, url)
    assert str(info.value).startswith(S)


def test_cluster_urls() -> None:
    nodes = parse_cluster_url(S, "redis+cluster://u:pw@h1:7000,h2:7001,h3")
    assert list(nodes.addresses) == [("h1", 7000), ("h2", 7001), ("h3", 6379)]
    assert (nodes.db, nodes.username, nodes.password) == (0, "u", "pw")
    assert parse_cluster_url(S, "rediss+cluster://h1:7000/0").addresses == (("h1", 7000),)
    with pytest.raises(LeaseConfigError, match="database 0 only"):
        ClusterLeaseStore.check_url(S, "redis+cluster://h1:7000/3")
    with pytest.raises(LeaseConfigError, match="naming no host"):
        ClusterLeaseStore.check_url(S, "redis+cluster://h1:7000,")


def test_sentinel_needs_a_master_name() -> None:
    url = "sentinel://127.0.0.1:1/0"
    for options in ({}, {"master_name": ""}, {"master_name": 7}):
        with pytest.raises(LeaseConfigError, match=r"lease_store_options\['master_name'\]"):
            SentinelLeaseStore.check_options(url, options, "celery-lease")
    SentinelLeaseStore.check_options(url, {"master_name": "m"}, "celery-lease")


@pytest.mark.parametrize(
    "options",
    [
        {"master_name": "m", "sentinel_kwargs": "pw"},
        {"master_name": "m", "sentinel_kwargs": {"ssl_ca_certs": "/no/such/ca.pem"}},
        {"master_name": "m", "sentinel_kwargs": {"no_such_option": 1}},
        {"master_name": "m", "no_such_option": 1},
    ],
)
def test_bad_sentinel_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(LeaseConfigError):
        SentinelLeaseStore.check_options("sentinel://127.0.0.1:1/0", options, "celery-lease")


def test_a_cluster_store_is_built_without_reaching_the_cluster() -> None:
    # Port 1 answers nothing: building (and closing) the store must not try.
    store = LeaseStore.from_url("redis+cluster://127.0.0.1:1,127.0.0.1:2")
    store.close()
    with pytest.raises(LeaseConfigError, match="read from the masters"):
        LeaseStore.from_url("redis+cluster://127.0.0.1:1", read_from_replicas=True)
    with pytest.raises(LeaseConfigError):
        LeaseStore.from_url("redis+cluster://127.0.0.1:1", no_such_option=1)


@pytest.mark.parametrize(
    "options",
    [
        {"wait_replicas": -1},
        {"wait_replicas": "1"},
        {"wait_replicas": True},
        {"wait_replicas": 1, "wait_timeout_ms": 0},
        {"wait_replicas": 1, "on_unreplicated": "ignore"},
        {"wait_timeout_ms": 100},
    ],
)
@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1"])
def test_bad_wait_options_are_refused(url: str, options: dict[str, Any]) -> None:
    with pytest.raises(LeaseConfigError, match="lease_store_options"):
        LeaseStore.from_url(url, **options)


def test_secrets_in_sentinel_urls_and_options_are_not_shown() -> None:
    store = LeaseStore.from_url(
        "sentinel://:hunter2@127.0.0.1:1;sentinel://:hunter2@127.0.0.1:2/0",
        master_name="m",
        sentinel_kwargs={"password": "sesame"},
    )
    assert "hunter2" not in repr(store) and "sesame" not in repr(store)
    store.close()


def test_worker_settings_are_checked_at_start() -> None:
    from celery import Celery

    from celery_lease.config import Config

    app = Celery("ha-settings", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = "sentinel://127.0.0.1:1;sentinel://127.0.0.1:2/1"
    with pytest.raises(LeaseConfigError, match="master_name"):
        Config.from_app(app)
    app.conf.lease_store_options = {"master_name": "m", "wait_replicas": 1}
    assert Config.from_app(app).store_options["wait_replicas"] == 1
    app.conf.lease_store_url = "redis+cluster://127.0.0.1:1/2"
    with pytest.raises(LeaseConfigError, match="lease_store_url"):
        Config.from_app(app)
