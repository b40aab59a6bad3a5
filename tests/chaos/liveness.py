"""A liveness check for the chaos workers: restart a worker whose consumer stopped.

A worker is stalled when messages of the queue it consumes have been held
(ready, or delivered and not acked) for :data:`STALL` seconds and it started
no task in that time (no ``prerun`` of its hostname in the history).

Long runs here (Redis broker, Celery 5.7, kombu 5.7, billiard 4.3) left the
probe worker, the only consumer of its queue, in that state twice. Once it
reconnected after a broker connection loss, logged its tasks received and
started none of them for forty minutes. Once it hit kombu's unrecoverable
``AttributeError`` ('NoneType' object has no attribute 'hostname') while
restoring unacked messages, began its warm shutdown and never finished it:
its stacks show billiard's result handler blocked on a pool child's result
pipe, waiting for the rest of a "message" of some 21 MB (most likely a
frame's length read from the middle of another), so the process never
exits and a supervisor that waits for an exit never restarts it. No
message was lost either time, but nothing would ever run them. A process
manager with a liveness check restarts such a worker; so does the
supervisor (:mod:`tests.chaos.cluster`), after taking its stacks, and the
report counts these restarts apart from the faults.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

__all__ = ["STALL", "Liveness", "held_in_rabbitmq", "held_in_redis"]

#: seconds a worker may leave its queue's messages held without starting a task
STALL = 120.0


class Liveness:
    """Tracks, per worker hostname, when it last started a task and since when
    its queue has held messages; :meth:`stalled` says whether it stopped."""

    def __init__(self, history: Path, held: Callable[[str], int], stall: float = STALL) -> None:
        self.history = history
        self.held = held
        self.stall = stall
        self._offset = 0
        self._partial = b""
        self.last_start: dict[str, float] = {}
        self.held_since: dict[str, float] = {}

    def read(self, now: float) -> None:
        """Take in the history's new ``prerun`` lines (stamped ``now``: the
        record's own wall time may come from a worker under faketime)."""
        try:
            with open(self.history, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            record = _parse(line)
            if record is not None and record.get("ev") == "prerun" and record.get("host"):
                self.last_start[str(record["host"])] = now

    def stalled(self, hostname: str, queue: str, now: float) -> bool:
        if self.held(queue) == 0:
            self.held_since.pop(hostname, None)
            return False
        since = max(
            self.held_since.setdefault(hostname, now), self.last_start.get(hostname, now - 1e9)
        )
        return now - since >= self.stall

    def restarted(self, hostname: str, now: float) -> None:
        """The worker starts afresh: its stall is measured from ``now``."""
        self.held_since[hostname] = now
        self.last_start[hostname] = now


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def held_in_redis(url: str) -> Callable[[str], int]:
    """Messages of a queue held by kombu's Redis transport: its lists (one per
    priority) and its ``unacked`` entries, less those kombu restores only in
    about an hour (an ``unacked_index`` score from a clock an hour ahead)."""

    def held(queue: str) -> int:
        client = redis.Redis.from_url(url)
        try:
            ready = sum(
                int(client.llen(k))
                for k in client.scan_iter(match=f"{queue}*")
                if k.decode().split("\x06", 1)[0] == queue and client.type(k) == b"list"
            )
            stranded = set(client.zrangebyscore("unacked_index", time.time() + 60, "+inf"))
            unacked = 0
            for tag, value in client.hscan_iter("unacked"):
                if tag in stranded:
                    continue
                # an entry that is not kombu's [payload, exchange, routing_key]: skip it
                with contextlib.suppress(ValueError, IndexError, TypeError):
                    if json.loads(value)[2] == queue:
                        unacked += 1
            return ready + unacked
        finally:
            client.close()

    return held


def held_in_rabbitmq(rabbit: Any) -> Callable[[str], int]:
    """Messages of a queue in RabbitMQ, ready and unacknowledged."""

    def held(queue: str) -> int:
        out = rabbit.ctl("list_queues", "name", "messages", "--quiet", "--no-table-headers")
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == queue:
                return int(parts[1])
        return 0

    return held
