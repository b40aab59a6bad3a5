"""Retention of the result table: deleting old results, long-expired lease rows
and registrations past the same grace."""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any

from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.keys import INTERNAL_PREFIX
from celery_lease.sql import Database
from celery_lease.sql import queries as q
from celery_lease.sql.meta_queries import SWEEP_REGISTRATIONS

__all__ = ["sweep"]

# The result table's logger: these records are the table's, wherever the code lives.
logger = logging.getLogger("celery_lease.results")

_SWEEP_ATTEMPTS = 5


def sweep(db: Database, result_expires: float | None, lease_grace: float) -> dict[str, int]:
    """:meth:`celery_lease.results.ResultTable.sweep` in ``db``."""
    _check_seconds("lease_grace", lease_grace)
    if result_expires is not None:
        _check_seconds("result_expires", result_expires)
    delay, attempts = 0.05, 1
    while True:
        try:
            return _sweep_once(db, result_expires, lease_grace)
        except StoreUnavailable:
            # A deadlock with a claim: single-key claims lock a lease row,
            # then its fence row; multi-key claims the fence rows first. No
            # order of the sweep's avoids both, so it gives way and retries.
            if attempts >= _SWEEP_ATTEMPTS:
                raise
            attempts += 1
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay *= 2


def _sweep_once(db: Database, result_expires: float | None, lease_grace: float) -> dict[str, int]:
    with db.transaction() as conn:
        now = conn.now()
        swept_results = 0
        if result_expires is not None:
            swept_results = conn.execute(q.SWEEP_RESULTS, {"cutoff": now - result_expires}).rowcount
            conn.execute(q.SWEEP_ENDED, {"cutoff": now - result_expires})
        cutoff = now - lease_grace
        internal = {"internal": INTERNAL_PREFIX, "internal_len": len(INTERNAL_PREFIX)}
        conn.execute(q.SWEEP_KEEP_FENCES, {"cutoff": cutoff, "now": now, **internal})
        conn.execute(q.SWEEP_INTERNAL_FENCES, {"cutoff": cutoff, **internal})
        swept_leases = conn.execute(q.SWEEP_LEASES, {"cutoff": cutoff}).rowcount
        conn.execute(SWEEP_REGISTRATIONS, {"cutoff": cutoff})
    logger.info(
        "swept %d result(s), %d lease row(s)",
        swept_results,
        swept_leases,
        extra={"action": "sweep", "results": swept_results, "leases": swept_leases},
    )
    return {"results": swept_results, "leases": swept_leases}


def _check_seconds(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise LeaseConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
