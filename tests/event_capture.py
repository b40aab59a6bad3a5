"""Task events read from the broker, as Flower reads them (a real event receiver).

``with EventCapture(app) as events:`` binds a receiver to the broker's event
exchange in a thread, and returns once a probe event it sent itself came
back (so nothing sent after that is missed); ``events.of(task_id)`` are the
events received for that task.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from tests.servers import wait_for


class EventCapture:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="event-capture", daemon=True)

    def _on(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(dict(event))

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> EventCapture:
        self._thread.start()
        probe = uuid.uuid4().hex

        def seen() -> bool:
            with self.app.events.default_dispatcher() as d:
                d.send("test-probe", uuid=probe)
            return any(e.get("uuid") == probe for e in self.snapshot())

        wait_for(seen, 30, "the event receiver to see its probe")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def of(self, task_id: str) -> list[dict[str, Any]]:
        return [e for e in self.snapshot() if e.get("uuid") == task_id]
