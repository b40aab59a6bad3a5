"""Celery signal handlers and the worker bootstep, installed once per app.

- worker start (bootstep, main process): validate every ``lease_*`` setting,
  and every leased task's options against them (a task's own
  ``lease_renew_interval`` against the app's ``lease_ttl``, the app's
  ``lease_clock_drift`` against a task's own ``lease_ttl``), so a wrong one
  stops the worker with a one-line message naming it; then the store and
  database checks and the banner (:mod:`celery_lease.startup`);
- worker start and stop (bootstep, main process): with a ``lease+`` result
  backend, the thread that finishes the chords whose last member's worker died
  before publishing the callback (:class:`celery_lease.backend_chords.ChordWatch`);
- each prefork child builds its own stores: the app's runtime is kept with the
  pid that made it (``task.runtime``), and connection pools are reset by
  ``os.register_at_fork`` hooks, so nothing is shared with the parent;
- ``worker_process_init`` (each prefork child): forget any live metrics gauge a
  dead process of the same pid left;
- ``worker_process_shutdown`` (a child's warm exit): release the leases it holds;
- ``task_revoked`` with ``terminate=True`` (main process): the child is killed
  mid-body, so release its lease on its behalf (evict the lease read, if it
  still names that task id: only that token's lease, never a newer owner's).
  A child killed with SIGKILL otherwise leaves its lease to expire after its
  TTL: nothing can run in the dead child.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery.signals import task_revoked, worker_process_init, worker_process_shutdown

from celery_lease.appstate import app_state
from celery_lease.exceptions import LeaseConfigError, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Iterable

    from celery_lease.config import Config
    from celery_lease.stores.base import LeaseStore

__all__ = ["LeaseBootstep", "install", "release_terminated"]

logger = logging.getLogger(__name__)


class LeaseBootstep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Validates the settings when the worker starts (a bad one stops the worker)."""

    label = "celery-lease"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        from celery_lease import startup
        from celery_lease.config import config

        try:
            cfg = config(worker.app)
            check_tasks(worker.app, cfg)
            startup.run(worker.app, cfg)
        except LeaseConfigError as e:
            raise startup.refusal(e) from e
        warn_unconfirmed_publish(worker.app)
        if cfg.metrics_port is not None:
            from celery_lease import metrics_server

            metrics_server.prepare(cfg.metrics_port)
        super().__init__(worker, **kwargs)

    def start(self, worker: Any) -> None:
        from celery_lease.config import config

        cfg = config(worker.app)
        if cfg.metrics_port is not None:
            from celery_lease import metrics_server

            metrics_server.start(cfg.metrics_port, cfg.metrics_addr)
        from celery_lease.backend import LeaseBackend

        if isinstance(worker.app.backend, LeaseBackend):
            from celery_lease.backend_chords import ChordWatch

            self._chords = ChordWatch(worker.app.backend)
            self._chords.start()

    def stop(self, worker: Any) -> None:
        chords = getattr(self, "_chords", None)
        if chords is not None:
            chords.stop()


def warn_unconfirmed_publish(app: Any) -> bool:
    """Warn (and return True) for an AMQP broker without publisher confirms.

    A deferral re-publishes the task, then acks the message it came in: the
    work moves from one message to the other. RabbitMQ may lose a message it
    has not confirmed (a crash right after the publish), and with it the
    task; ``broker_transport_options={"confirm_publish": True}`` makes the
    publish return only once the broker has it.
    """
    url = str(app.conf.broker_url or "")
    options = app.conf.broker_transport_options or {}
    if not url.startswith(("amqp", "pyamqp")) or options.get("confirm_publish"):
        return False
    logger.warning(
        "celery-lease: the AMQP broker runs without publisher confirms; a deferred task "
        "can be lost if RabbitMQ crashes right after its re-publish. Set "
        'broker_transport_options = {"confirm_publish": True}',
        extra={"action": "config_warning"},
    )
    return True


def check_tasks(app: Any, cfg: Config) -> None:
    """Check each leased task's effective options, its own merged with the app's.

    Registration checks a task's options alone; only here are the app's
    settings known too. Without this, a mismatch surfaced in every execution,
    after the claim (or as renewals too rare to survive one failure).
    """
    for name in sorted(app.tasks):
        task = app.tasks[name]
        # A LeasedTask (every one has the class attribute), without importing
        # the task module here.
        if hasattr(type(task), "_lease_keyspec"):
            task._options(cfg)  # merges and checks them (LeasedTask._make_options)


def install(app: Any) -> None:
    """Add the bootstep and connect the handlers (idempotent)."""
    state = app_state(app)
    if state.installed:
        return
    state.installed = True
    app.steps["worker"].add(LeaseBootstep)
    worker_process_init.connect(_process_init, weak=False, dispatch_uid="celery_lease.init")
    worker_process_shutdown.connect(
        _process_shutdown, weak=False, dispatch_uid="celery_lease.shutdown"
    )
    task_revoked.connect(_revoked, weak=False, dispatch_uid="celery_lease.revoked")


def _process_init(**kwargs: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        try:
            from celery_lease import metrics_server

            metrics_server.process_init()
        except ImportError:
            pass  # no prometheus-client: nothing counts, nothing to forget


def _process_shutdown(**kwargs: Any) -> None:
    from celery_lease.renewal import renewer

    for held in renewer().leases:
        try:
            held.release()
        except StoreUnavailable as e:
            logger.warning(
                "could not release at shutdown (it will expire): key=%s token=%s reason=%s",
                held.key,
                held.token,
                e,
                extra={"action": "release_failed", "lease_key": held.key, "token": held.token},
            )


def _revoked(request: Any = None, terminated: bool = False, **kwargs: Any) -> None:
    if not terminated or request is None:
        return
    from celery_lease.config import config
    from celery_lease.exceptions import LeaseError
    from celery_lease.runtime import runtime
    from celery_lease.scope import HEADER_KEYS, HEADER_TENANT, resolve

    task = getattr(request, "task", None)
    app = getattr(task, "app", None)
    if task is None or app is None or not hasattr(type(task), "_lease_keyspec"):
        return  # not a leased task: no stores to build for it
    headers = getattr(request, "_request_dict", {}) or {}
    try:
        # The keys the execution claimed, resolved as it resolved them.
        keys, tenant = resolve(
            task,
            request.args or (),
            request.kwargs or {},
            headers.get(HEADER_KEYS),
            headers.get(HEADER_TENANT),
            config(app).limits,
        )
    except LeaseError:
        return  # the execution refused the same message: it claimed nothing
    release_terminated(runtime(app).store, keys, tenant, request.id)


def release_terminated(
    store: LeaseStore, keys: Iterable[Any], tenant: str | None, task_id: str
) -> list[str]:
    """Evict the leases a terminated task ``task_id`` still holds; the keys evicted.

    ``keys`` and ``tenant`` as :func:`celery_lease.scope.resolve` gives them.

    Only the lease read here, by its token: SIGTERM went out before this
    runs, so the child may still have committed and released, and a new
    owner claimed, between the read and the evict; an unconditional evict
    would take the key from that new owner.
    """
    from celery_lease.keys import scoped

    evicted = []
    for key in keys:
        full = scoped(str(key), tenant)
        try:
            record = store.inspect(full)
            if record is None or not record.live or record.task_id != task_id:
                continue
            if store.evict(full, token=record.token) is not None:
                evicted.append(full)
                logger.info(
                    "released the lease of a terminated task: key=%s token=%s task=%s",
                    full,
                    record.token,
                    task_id,
                    extra={
                        "action": "revoke_release",
                        "lease_key": full,
                        "token": record.token,
                        "task_id": task_id,
                    },
                )
        except StoreUnavailable as e:
            logger.warning(
                "could not release after revoke (it will expire): key=%s task=%s reason=%s",
                full,
                task_id,
                e,
                extra={"action": "release_failed", "lease_key": full, "task_id": task_id},
            )
    return evicted
