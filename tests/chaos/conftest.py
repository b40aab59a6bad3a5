"""Fixtures of the chaos regression tests (:mod:`tests.chaos.regression_cell`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.chaos.regression_cell import Cell
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.servers import RedisServer


@pytest.fixture
def cell(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> Iterator[Cell]:
    c = Cell(tmp_path, make_redis_server(), pg_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def etcd_cell(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    pg_url: str,
    request: pytest.FixtureRequest,
) -> Iterator[Cell]:
    """A cell whose leases live in etcd, a store with no clock a client can read."""
    c = Cell(tmp_path, make_redis_server(), pg_url, store_url=request.getfixturevalue("etcd_url"))
    try:
        yield c
    finally:
        c.close()
