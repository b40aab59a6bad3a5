"""Fixtures of the ``LeasedTask`` acceptance tests (:mod:`tests.acceptance.lease_cluster`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import celery_lease
from tests.acceptance.lease_cluster import (
    TTL,
    Cluster,
)
from tests.servers import RedisServer


@pytest.fixture(scope="module")
def pg_results(pg_url: str) -> str:
    """The module's PostgreSQL database with celery-lease's tables."""
    celery_lease.migrate(pg_url)
    return pg_url


@pytest.fixture
def make_cluster(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_results: str
) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(store="redis"|"pg", ttl=, vt=, results_url=)``: a private Redis
    (broker db 0, backend db 1, lease store db 2 when ``store="redis"``), results in
    PostgreSQL (or ``results_url``); every worker is killed after the test."""
    made: list[Cluster] = []

    def make(
        store: str = "redis",
        *,
        ttl: float = TTL,
        vt: float | None = None,
        results_url: str | None = None,
    ) -> Cluster:
        redis = make_redis_server(appendonly=False)
        cluster = Cluster(
            tmp_path,
            broker=redis.url(0),
            backend=redis.url(1),
            store_url=redis.url(2) if store == "redis" else pg_results,
            results_url=results_url or pg_results,
            ttl=ttl,
            vt=vt,
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
