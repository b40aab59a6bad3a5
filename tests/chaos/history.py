"""The records the chaos checker decides from, as plain data.

Plain data, so the checker (:mod:`tests.chaos.checker`) is tested on
hand-made histories in ``tests/chaos/test_chaos_checker.py``:

* **submissions** -- what the harness published: task id, key, policy
  (``exclusive``, ``once``, ``once_return``);
* **attempts** -- one per task body that started, from the history file the
  task bodies append to (fsync'd, outside the plugin): task id, key, token,
  the grant's store time (``acquired_at``), the body's start and end in real
  time (the harness machine's clock, derived from ``CLOCK_MONOTONIC``, which
  libfaketime does not skew), the newest lease expiry (store time) the body
  saw confirmed by the grant or a renewal, and the outcome of its guarded
  write;
* **accepted** -- the rows of ``celery_lease_results`` (key, token, task id,
  ``accepted_at`` in the database's clock, the accepted value);
* **protected** -- the rows of the task bodies' own ``chaos_protected`` table,
  each written through ``celery_lease.fencing.guard(conn, key, token)``
  (``written_at`` in the database's clock, taken while the guard holds the
  key's fence row);
* **backend** -- each task id's state in the Celery result backend (and, for
  ``FAILURE``, the exception's type and arguments; for ``SUCCESS``, the value);
* **transport_lost** -- task ids of which the broker transport itself lost a
  message, proven from the Redis broker's append-only file
  (:mod:`tests.chaos.aof`): popped from a queue and never recorded as unacked.

Every clock involved (Redis ``TIME``, PostgreSQL ``clock_timestamp()``, the
harness's ``time.time()``) is the same machine's ``CLOCK_REALTIME``; worker
wall clocks (possibly skewed by libfaketime) are never used. ``EPS`` absorbs
the conversion between ``CLOCK_MONOTONIC`` and ``CLOCK_REALTIME``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EPS",
    "FINAL",
    "LEASE_ERRORS",
    "UNKNOWN",
    "Accepted",
    "Attempt",
    "Backend",
    "Chord",
    "History",
    "Protected",
    "Report",
    "Submission",
    "Violation",
]

#: Seconds of tolerance between clocks of one machine (monotonic vs real time).
EPS = 0.05
FINAL = ("SUCCESS", "FAILURE")
LEASE_ERRORS = ("StaleFencingToken", "LeaseLost")


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: a value the records do not hold (not compared)
UNKNOWN: Any = _Unknown()


@dataclass(frozen=True)
class Submission:
    task_id: str
    key: str
    policy: str  # exclusive | once | once_return

    @property
    def mode(self) -> str:
        return "exclusive" if self.policy == "exclusive" else "once"


@dataclass
class Attempt:
    attempt: str
    task_id: str
    key: str
    token: int
    acquired_at: float
    start: float
    end: float | None = None
    expires: float = 0.0
    write: str | None = None  # ok | refused | error | None (never reached)
    hostname: str = ""
    pid: int = 0
    skew: str = ""

    @property
    def valid_lb(self) -> float:
        """Until when (store time) this grant was provably valid."""
        return min(self.expires, self.end) if self.end is not None else self.expires


@dataclass(frozen=True)
class Accepted:
    key: str
    token: int
    task_id: str | None
    accepted_at: float
    id: int = 0
    value: Any = field(default=UNKNOWN, compare=False)


@dataclass(frozen=True)
class Protected:
    key: str
    token: int
    task_id: str | None
    written_at: float
    id: int = 0


@dataclass(frozen=True)
class Backend:
    state: str
    exc_type: str | None = None
    exc_args: tuple[Any, ...] = ()
    #: the stored value of a ``SUCCESS``
    result: Any = field(default=UNKNOWN, compare=False)
    #: the writer's lease token and the write's database time, where the
    #: backend records them (the ``lease`` backend's history); None: unknown
    token: int | None = field(default=None, compare=False)
    written_at: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Chord:
    """A chord a run submitted: its callback's task id and its header's task ids,
    in header order (each header member is also a :class:`Submission`)."""

    callback_id: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class Violation:
    kind: str
    key: str | None
    detail: str

    def __str__(self) -> str:
        where = f" [{self.key}]" if self.key else ""
        return f"{self.kind}{where}: {self.detail}"


@dataclass
class History:
    submissions: list[Submission]
    attempts: list[Attempt]
    accepted: list[Accepted]
    protected: list[Protected]
    backend: dict[str, Backend]
    transport_lost: dict[str, str] = field(default_factory=dict)
    broker: str = "redis"
    #: every state the backend stored per task id, in order (None: not observed)
    backend_history: dict[str, list[Backend]] | None = None
    #: the end marks, task id -> the token that ended it
    ended: dict[str, int] = field(default_factory=dict)
    #: the chords submitted (``--chords``), their callbacks' final states and
    #: each callback run's values (tests/chaos/chord_checks.py)
    chords: list[Chord] = field(default_factory=list)
    callbacks: dict[str, Backend] = field(default_factory=dict)
    collected: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class Report:
    violations: list[Violation]
    lost_plugin: list[str]
    lost_broker: list[str]
    lost_keys_broker: list[str]
    figures: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not self.violations and not self.lost_plugin

    def by_kind(self) -> Counter[str]:
        return Counter(v.kind for v in self.violations)
