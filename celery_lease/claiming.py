"""Claiming a task's lease: the store's retries, lease_on_conflict's wait, early copies.

:func:`claim` loops until :func:`celery_lease.decide.decide_claim` grants,
retries or waits no more; a deferral or rejection it decides raises (Ignore).
A deferred copy that arrived before its store-clock ETA waits it out first.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import time
from typing import TYPE_CHECKING, Any

from celery_lease import decide, metrics
from celery_lease.decide import Act
from celery_lease.exceptions import StoreUnavailable
from celery_lease.renewal import HeldLease
from celery_lease.scope import HEADER_DELAY, HEADER_NOT_BEFORE, header
from celery_lease.stores.base import new_owner_id

if TYPE_CHECKING:
    from celery_lease.execution import Execution

__all__ = ["claim", "jitter"]

logger = logging.getLogger(__name__)


def claim(ex: Execution) -> HeldLease:
    _wait_until_not_before(ex)
    start = time.monotonic()
    deadline = start + ex.cfg.store_retry
    waited_until = start + ex.cfg.wait_timeout
    delay = 0.05
    owner_id = _new_owner_id()
    while True:
        sent = time.monotonic()
        started = time.perf_counter()
        lease, error = None, None
        try:
            lease = _claim_once(ex, owner_id)
        except StoreUnavailable as e:
            error = str(e)
        now = time.monotonic()
        facts = decide.Claim(
            ex.task_id,
            ex.opts.ttl,
            ex.opts.on_conflict,
            granted=lease is not None,
            error=error,
            retry_left=now < deadline,
            wait_left=now < waited_until,
            commit=ex.opts.commit,
        )
        if error is None:
            metrics.claim_latency.observe(time.perf_counter() - started)
        outcome = ex.decide(decide.decide_claim, facts)
        if outcome.act is Act.RUN:
            assert lease is not None
            return _granted(ex, lease, sent)
        if outcome.act is Act.RETRY:
            time.sleep(jitter(delay))
            delay = min(delay * 2, 1.0)
            continue
        if outcome.act is Act.WAIT:
            time.sleep(min(jitter(delay), max(0.0, waited_until - time.monotonic())))
            delay = min(delay * 2, 2.0)
            continue
        if error is not None:
            metrics.claims.labels("store_unavailable").inc()
        ex.carry_out(outcome)


def _claim_once(ex: Execution, owner_id: str) -> Any:
    if ex.opts.commit and ex.rt.results.colocated:
        lease, ex.prepared = ex.rt.results.claim_prepared(
            ex.scoped,
            ttl=ex.opts.ttl,
            owner_id=owner_id,
            meta=ex.meta,
            task_id=ex.task_id,
            once=ex.opts.mode == "once",
        )
        return lease
    return ex.rt.store.claim(ex.scoped, ttl=ex.opts.ttl, owner_id=owner_id, meta=ex.meta)


def _granted(ex: Execution, lease: Any, sent: float) -> HeldLease:
    metrics.claims.labels("granted").inc()
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "lease granted key=%s token=%s task=%s",
            ex.key,
            lease.token,
            ex.task_id,
            extra={
                "action": "claim",
                "lease_key": ex.key,
                "token": lease.token,
                "task_id": ex.task_id,
            },
        )
    return HeldLease(
        ex.rt.store,
        lease,
        renew_interval=ex.opts.renew_interval,
        clock_drift=ex.cfg.clock_drift,
        sent_at=sent,
    )


def _wait_until_not_before(ex: Execution) -> None:
    """A deferred copy that arrived early (this worker's clock runs ahead of
    the store's, so Celery's ETA passed too soon) waits out the rest here,
    before claiming, instead of deferring again at once, over and over."""
    delay = header(ex.req, HEADER_DELAY)
    if isinstance(delay, (int, float)) and not isinstance(delay, bool) and delay > 0:
        time.sleep(min(float(delay), ex.opts.ttl + 1.0))
        return
    not_before = header(ex.req, HEADER_NOT_BEFORE)
    if not isinstance(not_before, (int, float)) or isinstance(not_before, bool):
        return
    try:
        early = float(not_before) - ex.rt.clock()
    except StoreUnavailable:
        return
    if early > 0:
        time.sleep(min(early, ex.opts.ttl + 1.0))


#: (pid, "hostname:pid:") of this process, for owner ids.
_owner_prefix: tuple[int, str] | None = None


def _new_owner_id() -> str:
    """``hostname:pid:random``, as :func:`new_owner_id` makes it, without a
    ``gethostname()`` call per task."""
    global _owner_prefix
    pid = os.getpid()
    prefix = _owner_prefix
    if prefix is None or prefix[0] != pid:
        prefix = _owner_prefix = (pid, new_owner_id().rsplit(":", 1)[0] + ":")
    return prefix[1] + secrets.token_hex(8)


def jitter(delay: float) -> float:
    return delay * random.uniform(0.5, 1.5)
