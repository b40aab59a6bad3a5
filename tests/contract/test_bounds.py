"""Bounds that keep a lease workable: renewal schedule, TTL range, sweep grace.

* Renewal schedule: a (TTL, renew interval, clock drift) is either refused
  where a lease is made (settings, task options at worker start, ``hold()``,
  ``HeldLease``), or the first renewal and one retry of it are due before the
  lease's local view ends. A hypothesis property over the pure logic, and a
  sample on real stores (SQLite, Redis): refused combinations claim nothing,
  accepted ones really renew before the local view ends.
* Redis scripts check a TTL before their first write, so a bad one can never
  leave a hash without its expiry (the Python check refuses it earlier; here
  the scripts are sent the bad value directly, to the real server).
* ``ResultTable.sweep`` refuses a negative (or non-finite) ``lease_grace``,
  which would delete the rows of live leases.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

import celery_lease
from celery_lease import LeaseConfigError, LeaseStore
from celery_lease.config import Config
from celery_lease.renewal import HeldLease, check_schedule
from celery_lease.results import ResultTable
from celery_lease.setting_readers import check_renew_interval
from celery_lease.stores.base import MAX_TTL, make_lease
from celery_lease.stores.redis import RedisLeaseStore
from tests.results_helpers import sweep_past_now
from tests.store_fixtures import new_key, store_url, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeaseStore]:
    store = LeaseStore.from_url(f"sqlite:///{tmp_path_factory.mktemp('bounds')}/l.sqlite3")
    yield store
    store.close()


def _schedule(store: LeaseStore, ttl: float, renew: float | None, drift: float | None) -> HeldLease:
    """A HeldLease for a grant of ``ttl`` (no claim needed: only its schedule is looked
    at), sent an hour from now so the real clock never reaches its local view's end."""
    lease = make_lease("k", ("k",), "owner", 1, 0.0, 0.0, ttl, {})
    start = time.monotonic() + 3600
    return HeldLease(store, lease, renew_interval=renew, clock_drift=drift, sent_at=start)


seconds = st.floats(min_value=0.01, max_value=1e5, allow_nan=False)


@settings(max_examples=400, deadline=None)
@given(
    ttl=seconds,
    renew=st.one_of(st.none(), seconds, st.floats(0.0, 1.0).map(lambda f: f * 1e3)),
    drift=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e5)),
)
def test_a_schedule_is_refused_or_renews_and_retries_before_the_local_view_ends(
    sqlite_store: LeaseStore, ttl: float, renew: float | None, drift: float | None
) -> None:
    try:
        held = _schedule(sqlite_store, ttl, renew, drift)
    except LeaseConfigError:
        # Refused by HeldLease: refused the same by the settings' check (and hold()).
        with pytest.raises(LeaseConfigError):
            check_renew_interval(renew, ttl, "lease_renew_interval", drift)
        with pytest.raises(LeaseConfigError):
            check_schedule(ttl, renew, drift)
        return
    check_renew_interval(renew, ttl, "lease_renew_interval", drift)  # accepted everywhere
    assert held.next_renewal < held.valid_until, "the local view ends before the first renewal"
    # The first renewal fails (the store did not answer): its retry is still in time.
    held.renew_failed(held.next_renewal)
    assert held.lost_reason is None
    assert held.next_renewal < held.valid_until, "no time left for one retry of the renewal"
    assert held.renew_interval <= ttl / 2


def test_the_reported_combination_is_refused_naming_the_settings(
    sqlite_store: LeaseStore, sqlite_url: str
) -> None:
    """lease_ttl=30 with lease_clock_drift=21: the local view ended at 9 s, before the
    first renewal at 10 s, so every lease was lost without a renewal tried."""
    app = Celery("bounds", set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, lease_ttl=30, lease_clock_drift=21)
    with pytest.raises(LeaseConfigError) as info:
        Config.from_app(app)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "lease_renew_interval (10 = TTL / 3, the default) does not fit lease_ttl (30) less "
        "lease_clock_drift (21): the local view of a lease ends 9 s after its claim"
    ), message
    with pytest.raises(LeaseConfigError, match=r"less clock drift \(21\): the local view"):
        _schedule(sqlite_store, 30, None, 21)


# --------------------------------------------------------------------------
# a sample on real stores
# --------------------------------------------------------------------------

#: Refused: (ttl, renew interval, drift). Each was accepted before: the first
#: two lost every lease before any renewal (the local view ended first), the
#: last two renewed once in time but left no room to retry a failed renewal.
REFUSED = [(3.0, 1.0, 2.5), (30.0, None, 21.0), (10.0, 5.0, 4.5), (4.0, 1.0, 2.7)]
#: Accepted, with room for a slow machine between the renewal and the view's end.
ACCEPTED = [(3.0, None, None), (6.0, 1.0, 2.5)]


@pytest.fixture(params=["sqlite", "redis"])
def real_store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    store = LeaseStore.from_url(store_url(request, request.param))
    yield store
    store.close()


@pytest.mark.parametrize(("ttl", "renew", "drift"), REFUSED)
def test_hold_refuses_a_schedule_that_cannot_keep_the_lease_and_claims_nothing(
    real_store: LeaseStore, ttl: float, renew: float | None, drift: float
) -> None:
    key = new_key("refused")
    with pytest.raises(LeaseConfigError, match=r"the local view of a lease ends"):
        with real_store.hold(key, ttl=ttl, renew_interval=renew, clock_drift=drift) as held:
            wait_for(lambda: not held.held or held.renewals > 0, 2 * ttl, "a renewal or a loss")
            pytest.fail(f"hold() accepted it; held={held.held} after {held.renewals} renewal(s)")
    assert real_store.inspect(key) is None, "a refused hold() claimed the key"
    assert real_store.fence_token(key) == 0


@pytest.mark.parametrize(("ttl", "renew", "drift"), ACCEPTED)
def test_an_accepted_schedule_renews_before_the_local_view_ends(
    real_store: LeaseStore, ttl: float, renew: float | None, drift: float | None
) -> None:
    key = new_key("accepted")
    with real_store.hold(key, ttl=ttl, renew_interval=renew, clock_drift=drift) as held:
        first_view_end = held.valid_until
        wait_for(lambda: held.renewals >= 1 or not held.held, 2 * ttl, "the first renewal")
        assert held.renewals >= 1 and held.lost_reason is None, held.lost_reason
        assert held.valid_until > first_view_end, "the renewal did not extend the local view"
        record = real_store.inspect(key)
        assert record is not None and record.live and record.token == held.token
        assert record.renewed_at is not None and record.acquired_at is not None
        assert record.renewed_at > record.acquired_at


# --------------------------------------------------------------------------
# Redis: the scripts check the TTL before writing
# --------------------------------------------------------------------------


def test_redis_scripts_refuse_a_bad_ttl_before_any_write(redis_url: str) -> None:
    store = RedisLeaseStore(redis_url)
    try:
        key = new_key("lua-ttl")
        names = [store.lease_name(key), store.fence_name(key)]
        # 1e16 s: PEXPIRE refuses the ms value; the old script had run HSET first.
        for ms in (10**19, round(MAX_TTL * 1000) + 1, 0, "1.5", "x"):
            with pytest.raises(ResponseError, match=r"celery-lease: ttl_ms out of range"):
                store._run(store._claim, names, ["owner", ms])
            assert store.client.exists(*names) == 0, f"a refused claim (ttl_ms={ms}) wrote"
        lease = store.claim(key, ttl=30, owner_id="owner")
        assert lease is not None
        raw = store.client.hgetall(names[0])
        # One good lease and one bad TTL in one renewal: nothing is renewed.
        args = [2, 1, "owner", str(lease.token), 60_000, 1, "owner", str(lease.token), 10**19]
        with pytest.raises(ResponseError, match=r"celery-lease: ttl_ms out of range"):
            store._run(store._renew, [names[0], names[0]], args)
        assert store.client.hgetall(names[0]) == raw, "a refused renewal wrote"
        assert 0 < store.client.pttl(names[0]) <= 30_000
        # The maximum is written as digits and reads back exactly.
        top = store.claim(new_key("lua-max"), ttl=MAX_TTL, owner_id="owner")
        assert top is not None
        fields = store.client.hgetall(store.lease_name(top.key))
        assert fields[b"expires"].isdigit() and fields[b"acquired"].isdigit()
        assert int(fields[b"expires"]) - int(fields[b"acquired"]) == MAX_TTL * 1_000_000
        assert store.client.pttl(store.lease_name(top.key)) > (MAX_TTL - 60) * 1000
    finally:
        store.close()


# --------------------------------------------------------------------------
# sweep: lease_grace
# --------------------------------------------------------------------------


@pytest.mark.parametrize("grace", [-1, -3600.0, math.nan, math.inf, "60", True])
def test_sweep_refuses_a_bad_lease_grace_and_keeps_live_leases(
    sqlite_url: str, grace: object
) -> None:
    celery_lease.migrate(sqlite_url)
    store = LeaseStore.from_url(sqlite_url)
    try:
        key = new_key("live")
        lease = store.claim(key, ttl=30, owner_id="holder")
        assert lease is not None
        table = ResultTable(sqlite_url, store)
        with pytest.raises(LeaseConfigError, match=r"lease_grace must be a finite number"):
            table.sweep(None, grace)  # type: ignore[arg-type]
        with pytest.raises(LeaseConfigError, match=r"result_expires must be a finite number"):
            table.sweep(-5, 0)
        record = store.inspect(key)
        assert record is not None and record.live and record.token == lease.token
        assert sweep_past_now(table, None, 0) == {"results": 0, "leases": 0}
        after = store.inspect(key)
        assert after is not None and after.live, "the sweep deleted a live lease"
        assert (after.owner_id, after.token) == ("holder", lease.token)
    finally:
        store.close()
