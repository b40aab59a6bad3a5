"""A store fault in ``hold()``'s release, with the block's exception in flight.

The fault class: a cleanup step that talks to the store fails while the code it
cleans up after is already raising. The block's exception is what its caller
must see (a payment API's error, a ``LeaseLost``); a release error raised in its
place would hide it, and the caller would act on the wrong failure. After a
block that ended, the release's failure is the only news, so it is raised.

Each test stops a private server inside the block, proves the store is down,
then leaves the block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

import celery_lease
from celery_lease import LeaseStore, StoreUnavailable
from tests.servers import PostgresServer, RedisServer
from tests.store_fixtures import new_key

pytestmark = pytest.mark.timeout(120)


class BlockError(Exception):
    """The block's own failure."""


@pytest.fixture(params=["redis", "postgresql"])
def stoppable(
    request: pytest.FixtureRequest,
    make_redis_server: Callable[..., RedisServer],
    make_pg_server: Callable[..., PostgresServer],
) -> tuple[Callable[[], None], LeaseStore]:
    """A store on a private server, and how to stop that server."""
    if request.param == "redis":
        redis = make_redis_server(appendonly=False)
        return redis.kill, LeaseStore.from_url(redis.url(0))
    pg = make_pg_server()
    url = pg.create_database("leases")
    celery_lease.migrate(url)
    return (lambda: pg.stop("immediate")), LeaseStore.from_url(url)


def test_a_failed_release_never_replaces_the_blocks_exception(
    stoppable: tuple[Callable[[], None], LeaseStore], caplog: pytest.LogCaptureFixture
) -> None:
    stop, store = stoppable
    key = new_key()
    caplog.set_level(logging.WARNING, logger="celery_lease")
    with pytest.raises(BlockError, match="the block's own error"):
        with store.hold(key, ttl=60) as lease:
            stop()
            with pytest.raises(StoreUnavailable):  # the fault is real: the store is down
                store.inspect(key)
            raise BlockError("the block's own error")
    failed = [r for r in caplog.records if getattr(r, "action", None) == "release_failed"]
    assert len(failed) == 1, caplog.text  # the release was tried, and its failure said
    assert (failed[0].lease_key, failed[0].token) == (key, lease.token)
    assert "it will expire" in failed[0].getMessage()


def test_a_failed_release_after_a_block_that_ended_is_raised(
    stoppable: tuple[Callable[[], None], LeaseStore],
) -> None:
    stop, store = stoppable
    with pytest.raises(StoreUnavailable):
        with store.hold(new_key(), ttl=60) as lease:
            stop()
    assert lease.released  # it was tried: the error is the release's, not the claim's
