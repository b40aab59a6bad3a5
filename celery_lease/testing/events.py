"""Record an app's task events as Flower would receive them, for assertions.

celery-lease's own outcomes (``LEASE_REJECTED``, ``LEASE_DEFERRED``,
``LEASE_LOST``, ``FENCED``) are task events, never result-backend states
(Celery would not count them as ready); a test observes them here::

    with record_events(app) as events:
        ...
        event = events.wait_for("FENCED", task_id=result.id)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["EventLog", "record_events"]


class EventLog:
    """The events received so far (each a dict: ``type``, ``uuid``, fields)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def append(self, event: dict[str, Any]) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, state: str, task_id: str | None = None) -> list[dict[str, Any]]:
        """Events ``task-<state>`` (``state`` as in ``celery_lease.events``), for ``task_id``."""
        kind = state if state.startswith("task-") else f"task-{state}"
        with self._cond:
            return [
                e
                for e in self.events
                if e.get("type") == kind and (task_id is None or e.get("uuid") == task_id)
            ]

    def wait_for(
        self, state: str, task_id: str | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        """The first ``task-<state>`` event (for ``task_id``); ``TimeoutError`` if none comes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self.of(state, task_id)
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = sorted({str(e.get("type")) for e in self.events})
                    raise TimeoutError(f"no {state} event for {task_id} in {timeout}s; saw {seen}")
                self._cond.wait(left)


@contextmanager
def record_events(app: Any, ready_timeout: float = 10.0) -> Iterator[EventLog]:
    """Receive ``app``'s events in a thread for the block; yields the :class:`EventLog`.

    Returns once the receiver consumes, so no event sent in the block is missed.
    The broker must deliver fanout messages (Redis, AMQP, ``memory://``,
    ``filesystem://``; not ``sqla+``).
    """
    log = EventLog()
    ready = threading.Event()
    failed: list[BaseException] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": log.append})
        receiver.on_consume_ready = lambda *args, **kwargs: ready.set()

        def run() -> None:
            try:
                receiver.capture(limit=None, timeout=None, wakeup=False)
            except OSError as e:  # the connection went away: say so in the test
                failed.append(e)
                ready.set()

        thread = threading.Thread(target=run, name="celery-lease-events-recorder", daemon=True)
        thread.start()
        if not ready.wait(ready_timeout) or failed:
            receiver.should_stop = True
            raise TimeoutError(f"the event receiver did not start: {failed}")
        try:
            yield log
        finally:
            receiver.should_stop = True
            thread.join(ready_timeout)
