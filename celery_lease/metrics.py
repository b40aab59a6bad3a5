"""Counters, gauges and histograms (prometheus-client, when installed).

Metrics are created on first use, so a worker's bootstep can set
``PROMETHEUS_MULTIPROC_DIR`` before prometheus-client is imported (prefork
children then write their samples where the main process's HTTP server
collects them). Without the ``prometheus`` extra every metric is a no-op,
so the code that counts never checks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "backend_writes_refused",
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


_make_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _make_lock
    _make_lock = threading.Lock()  # a copy held by another thread at fork never frees


os.register_at_fork(after_in_child=_reset_after_fork)


class _Lazy:
    """A metric made on first use (or a no-op without prometheus-client)."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self._make = make
        self._metric: Any = None
        #: ``labels(...)`` children by label values: prometheus-client validates
        #: and locks on every ``labels()`` call, and a task counts on every run.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _get(self) -> Any:
        if self._metric is None:
            # Made once per process even when two threads count at once for the
            # first time (a ``-P threads`` pool, a task and the renewal thread):
            # made twice, the second registration raised DuplicateTimeseries
            # inside the task.
            with _make_lock:
                if self._metric is None:
                    metric = self._create()
                    # Later counts call the metric's own methods, not this
                    # wrapper's: a task counts several times on every run.
                    for name in ("inc", "dec", "set", "observe"):
                        if hasattr(metric, name):
                            setattr(self, name, getattr(metric, name))
                    self._metric = metric
        return self._metric

    def _create(self) -> Any:
        try:
            import prometheus_client
            from prometheus_client import values
        except ImportError:
            return _Noop()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass is values.MutexValue:
            # prometheus-client picks its value class when first imported;
            # something (Flower's celery command plugin) may have imported
            # it before the worker set the multiprocess directory.
            values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        return self._make(prometheus_client)

    def labels(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            return self._get().labels(*args, **kwargs)
        child = self._children.get(args)
        if child is None:
            # The same child prometheus-client keeps for these values (it caches
            # them too), so a cached one counts where a fresh lookup would.
            child = self._children[args] = self._get().labels(*args)
        return child

    def inc(self, amount: float = 1) -> None:
        self._get().inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._get().dec(amount)

    def set(self, value: float) -> None:
        self._get().set(value)

    def observe(self, value: float) -> None:
        self._get().observe(value)


#: Claims by outcome: granted, deferred, rejected, duplicate, redelivery, store_unavailable.
claims = _Lazy(lambda p: p.Counter("celery_lease_claims", "Lease claims by outcome", ["outcome"]))
#: Renewals by outcome: renewed, lost, error.
renewals = _Lazy(
    lambda p: p.Counter("celery_lease_renewals", "Lease renewals by outcome", ["outcome"])
)
leases_lost = _Lazy(
    lambda p: p.Counter("celery_lease_leases_lost", "Leases lost while the body ran")
)
stale_commits = _Lazy(
    lambda p: p.Counter("celery_lease_stale_commits", "Commits refused for a stale token")
)
backend_writes_refused = _Lazy(
    lambda p: p.Counter(
        "celery_lease_backend_writes_refused",
        "Result-backend writes of leased tasks refused (a newer token, or over a SUCCESS)",
    )
)
force_releases = _Lazy(
    lambda p: p.Counter("celery_lease_force_releases", "Leases evicted by an operator")
)
held_leases = _Lazy(
    lambda p: p.Gauge(
        "celery_lease_held_leases", "Leases held by this process", multiprocess_mode="livesum"
    )
)
claim_latency = _Lazy(
    lambda p: p.Histogram(
        "celery_lease_claim_seconds",
        "Claim latency (one store round trip)",
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    )
)
