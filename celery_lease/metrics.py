"""Counters, gauges and histograms (prometheus-client, when installed).

Without the ``prometheus`` extra every metric is a no-op, so the task code
never checks. Under prefork, set ``PROMETHEUS_MULTIPROC_DIR`` (the worker
bootstep does it when ``lease_metrics_port`` is set) so children's samples
are collected by the server in the main process.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "claim_latency",
    "claims",
    "force_releases",
    "held_leases",
    "leases_lost",
    "renewals",
    "stale_commits",
]


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        return None

    def dec(self, amount: float = 1) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def observe(self, value: float) -> None:
        return None


try:
    from prometheus_client import Counter, Gauge, Histogram
except ImportError:  # the prometheus extra is not installed
    claims: Any = _Noop()
    renewals: Any = _Noop()
    leases_lost: Any = _Noop()
    stale_commits: Any = _Noop()
    force_releases: Any = _Noop()
    held_leases: Any = _Noop()
    claim_latency: Any = _Noop()
else:
    claims = Counter("celery_lease_claims", "Lease claims by outcome", ["outcome"])
    renewals = Counter("celery_lease_renewals", "Lease renewals by outcome", ["outcome"])
    leases_lost = Counter("celery_lease_leases_lost", "Leases lost while the body ran")
    stale_commits = Counter("celery_lease_stale_commits", "Commits refused for a stale token")
    force_releases = Counter("celery_lease_force_releases", "Leases evicted by an operator")
    held_leases = Gauge(
        "celery_lease_held_leases", "Leases held by this process", multiprocess_mode="livesum"
    )
    claim_latency = Histogram(
        "celery_lease_claim_seconds",
        "Claim latency (one store round trip)",
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    )
