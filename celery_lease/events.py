"""Custom task states, sent as task events so Flower shows them.

Flower turns an unknown event ``task-<SUBJECT>`` into the task state
``SUBJECT`` (upper-cased), so the event types are ``task-LEASE_REJECTED`` etc.
A custom state replaces STARTED/RECEIVED but is itself replaced by a later
``task-succeeded``/``task-failed``; so where a custom state must be final,
the task records its result-backend state itself, sends the event last, and
raises ``Ignore`` (no further events).

Custom states never go into the result backend: Celery does not count them
as ready, and ``AsyncResult.get()`` would block on them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

from kombu.exceptions import KombuError

from celery_lease.appstate import app_state

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "FENCED",
    "LEASE_DEFERRED",
    "LEASE_LOST",
    "LEASE_REJECTED",
    "STATES",
    "send",
    "send_later",
]

logger = logging.getLogger(__name__)

#: A redelivery or duplicate that was not executed.
LEASE_REJECTED = "LEASE_REJECTED"
#: Re-published for later because a live owner holds the key.
LEASE_DEFERRED = "LEASE_DEFERRED"
#: Renewal failed or the lease ran out while the body was running.
LEASE_LOST = "LEASE_LOST"
#: The commit was refused: a stale fencing token.
FENCED = "FENCED"

STATES = (LEASE_REJECTED, LEASE_DEFERRED, LEASE_LOST, FENCED)


def send(app: Celery, state: str, *, task_id: str, hostname: str | None, **fields: Any) -> None:
    """Send ``task-<state>`` for ``task_id``. Never raises for a broker hiccup: it logs."""
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(f"task-{state}", uuid=task_id, **fields)
    except broker_errors(app) as e:
        # A pooled connection that breaks mid-publish (the broker restarted)
        # raises the transport's own error (redis-py's ConnectionError), not
        # kombu's: that must not fail a task whose outcome is decided already.
        # (The tuple is only computed once something was raised.)
        logger.warning(
            "could not send %s event for %s: %s",
            state,
            task_id,
            e,
            extra={"action": "event_failed", "task_id": task_id},
        )


class _Sender:
    """One thread per process that publishes events handed over by :func:`send_later`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.SimpleQueue[tuple[Celery, str, str, str | None, dict[str, Any]]] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name="celery-lease-events", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            app, state, task_id, hostname, fields = self.queue.get()
            send(app, state, task_id=task_id, hostname=hostname, **fields)


_sender: _Sender | None = None
_sender_lock = threading.Lock()


def send_later(
    app: Celery, state: str, *, task_id: str, hostname: str | None, **fields: Any
) -> None:
    """:func:`send`, from a thread of its own: for the renewal thread, which
    must not wait for a slow broker while every lease of the process is due."""
    global _sender
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid():
            _sender = _Sender()  # threads do not survive fork
        sender = _sender
    sender.queue.put((app, state, task_id, hostname, fields))


def broker_errors(app: Celery) -> tuple[type[BaseException], ...]:
    """Errors of a broker hiccup: kombu's, the OS's and the transport's own."""
    state = app_state(app)
    errors = state.broker_errors
    if errors is None:
        conn = app.connection_for_write()
        try:
            errors = (KombuError, OSError, *conn.connection_errors, *conn.channel_errors)
        finally:
            conn.release()
        state.broker_errors = errors
    return errors
