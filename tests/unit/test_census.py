"""The memory census (tests/census.py) sees what it says it counts."""

from __future__ import annotations

import gc

from celery_lease.exceptions import LeaseError
from tests.census import take


def test_the_census_counts_celery_leases_objects_in_reference_cycles() -> None:
    gc.collect()
    looped = LeaseError("in a cycle")
    looped.self = looped  # type: ignore[attr-defined]
    del looped
    census = take(hold_cycles=False)
    # Only this cycle's own entry: a background thread an earlier test of this
    # process left (a renewer retrying a stopped server) can make garbage of
    # its own between the collect above and the census.
    assert census["cycles"].get("celery_lease.exceptions.LeaseError") == 1, census["cycles"]
    again = take()["cycles"]
    assert "celery_lease.exceptions.LeaseError" not in again, "counted cycles are freed, not kept"


def test_holding_cycles_switches_the_collector_off_until_the_next_census() -> None:
    try:
        take(hold_cycles=True)
        assert not gc.isenabled()
    finally:
        take()
    assert gc.isenabled()
