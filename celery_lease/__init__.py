"""celery-lease: lease ownership with fencing tokens for Celery tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_lease.exceptions import (
    DuplicateResult,
    KeyLimitExceeded,
    LeaseConfigError,
    LeaseError,
    LeaseLost,
    LeaseNotAcquired,
    LeaseScopeMismatch,
    LeaseUnauthorized,
    ResultNotSerializable,
    ResultTooLarge,
    StaleFencingToken,
    StoreUnavailable,
)
from celery_lease.renewal import HeldLease
from celery_lease.sql.migrate import migrate
from celery_lease.stores.base import Lease, LeaseRecord, LeaseStore

if TYPE_CHECKING:
    from celery_lease.task import LeasedTask

__all__ = [
    "DuplicateResult",
    "HeldLease",
    "KeyLimitExceeded",
    "Lease",
    "LeaseConfigError",
    "LeaseError",
    "LeaseLost",
    "LeaseNotAcquired",
    "LeaseRecord",
    "LeaseScopeMismatch",
    "LeaseStore",
    "LeaseUnauthorized",
    "LeasedTask",
    "ResultNotSerializable",
    "ResultTooLarge",
    "StaleFencingToken",
    "StoreUnavailable",
    "migrate",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LeasedTask imports Celery; keep `import celery_lease` light for store-only users.
    if name == "LeasedTask":
        from celery_lease.task import LeasedTask

        return LeasedTask
    raise AttributeError(name)
