"""This process's stores for an app: the lease store, the result table, the clock.

Built on first use in each process (a forked worker child builds its own),
and shared by the task, the CLI and the signal handlers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from celery_lease.appstate import app_state
from celery_lease.config import Config, config
from celery_lease.results import ResultTable
from celery_lease.stores.base import LeaseStore

__all__ = ["Runtime", "runtime"]


class Runtime:
    """This process's stores for one app (new after fork)."""

    def __init__(self, cfg: Config) -> None:
        self.store: LeaseStore = LeaseStore.from_settings(cfg)
        self.results = ResultTable(cfg.result_url, self.store, max_bytes=cfg.result_max_bytes)
        #: Renew a lease until its commit has answered (not only until the body
        #: ended): a commit that waits for the result database's lock longer
        #: than the lease has left would otherwise find it expired and re-queue
        #: work that was done. Not with leases in the same PostgreSQL database:
        #: there the commit locks the lease rows, and the process's one renewal
        #: statement would wait behind it, every other lease's renewal with it.
        self.renew_through_commit = not (self.results.colocated and not self.results.db.is_sqlite)
        #: The clock of deferral ETAs, which every worker must read alike: the
        #: lease store's, or, for a store without a clock of its own (etcd),
        #: a PostgreSQL result database's. Only a deployment with neither
        #: (etcd with SQLite results) falls back to the deferring worker's.
        self.clock: Callable[[], float] = self.store.time
        if not self.store.server_clock and not self.results.db.is_sqlite:
            self.clock = self.results.db.now


_runtimes_lock = threading.Lock()


def runtime(app: Any) -> Runtime:
    """The process's :class:`Runtime` for ``app`` (a new one after fork)."""
    pid = os.getpid()
    state = app_state(app)
    entry = state.runtime
    if entry is not None and entry[0] == pid:
        return entry[1]  # the common case, on every task: no lock
    with _runtimes_lock:
        entry = state.runtime
        if entry is None or entry[0] != pid:
            entry = state.runtime = (pid, Runtime(config(app)))
        return entry[1]
