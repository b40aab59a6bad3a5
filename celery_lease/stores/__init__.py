"""Lease stores, chosen by URL scheme: ``LeaseStore.from_url(url)``."""

from celery_lease.stores.base import Lease, LeaseRecord, LeaseStore

__all__ = ["Lease", "LeaseRecord", "LeaseStore"]
