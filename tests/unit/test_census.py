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
    assert census["cycles"] == {"celery_lease.exceptions.LeaseError": 1}
    assert take()["cycles"] == {}, "counted cycles are freed, not kept"


def test_holding_cycles_switches_the_collector_off_until_the_next_census() -> None:
    try:
        take(hold_cycles=True)
        assert not gc.isenabled()
    finally:
        take()
    assert gc.isenabled()
