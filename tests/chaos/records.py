"""What the chaos run records itself, read back: the bodies' history file (their
monotonic clock mapped to real time) and the states the workers logged."""

from __future__ import annotations

import bisect
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.chaos.history import Attempt


class ClockMap:
    """Real time from monotonic time, with the offset in force at that moment.

    Samples ``time.time() - time.monotonic()`` every ``interval`` seconds from
    a thread; :meth:`real` uses the last sample at or before the given
    monotonic time (a step of the real-time clock moves the mapping within
    ``interval`` of it).
    """

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-clock", daemon=True)
        self._sample()

    def _sample(self) -> None:
        mono = time.monotonic()
        self.samples.append((mono, time.time() - mono))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._sample()

    def real(self, mono: float) -> float:
        i = bisect.bisect_right(self.samples, (mono, float("inf"))) - 1
        return mono + self.samples[max(i, 0)][1]


def read_history(
    path: Path, real_time: Callable[[float], float]
) -> tuple[list[Attempt], Counter[str]]:
    """Attempts from the bodies' history file (``real_time`` maps their monotonic clock)."""
    attempts: dict[str, Attempt] = {}
    events: Counter[str] = Counter()
    if not path.exists():
        return [], events
    for line in path.read_bytes().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line of a killed process
        ev = rec.get("ev")
        events[ev] += 1
        real = real_time(rec["mono"])
        if ev == "start":
            attempts[rec["attempt"]] = Attempt(
                attempt=rec["attempt"],
                task_id=rec["task_id"],
                key=rec["key"],
                token=int(rec["token"]),
                acquired_at=float(rec["acquired_at"]),
                start=real,
                expires=float(rec["expires"]),
                hostname=rec.get("host") or "",
                pid=rec["pid"],
                skew=rec.get("skew") or "",
            )
        elif ev in ("renewed", "end"):
            a = attempts.get(rec["attempt"])
            if a is None:
                continue
            a.expires = max(a.expires, float(rec["expires"]))
            if ev == "end":
                a.end = real
                a.write = rec.get("write")
    return list(attempts.values()), events


_STATE_LINE = re.compile(r"\] (LEASE_DEFERRED|LEASE_REJECTED|FENCED|LEASE_LOST) [0-9a-f-]{36}")


def count_log_states(logdir: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in logdir.glob("worker-*.log"):
        for m in _STATE_LINE.finditer(path.read_text(errors="replace")):
            counts[m.group(1)] += 1
    return counts
