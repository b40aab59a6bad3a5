"""The decisions of a deferral: whether it counts, and whether its copy is published.

Rows ``defer.*`` and ``republish.*`` of the table in :mod:`celery_lease.decide`.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_lease.facts import UNREAD, Act, Failed, Outcome, Read, Unread

__all__ = ["ANY_MARKER", "Defer", "Republish", "decide_defer", "decide_republish"]


# -- deferring -----------------------------------------------------------------------


@dataclass(frozen=True)
class Defer:
    counted: bool
    deferrals: int  # counted deferrals so far
    defer_max: int
    countdown: float
    reason: str


def decide_defer(s: Defer) -> Outcome:
    if s.counted and s.deferrals >= s.defer_max:
        why = f"deferred {s.deferrals} times behind other tasks (lease_defer_max)"
        return Outcome("defer.limit", Act.REJECT, why, countdown=s.countdown)
    if s.counted:
        return Outcome(
            "defer.counted", Act.DEFER, s.reason, True, s.countdown, deferrals=s.deferrals + 1
        )
    deferrals = s.deferrals
    return Outcome("defer.uncounted", Act.DEFER, s.reason, False, s.countdown, deferrals=deferrals)


#: What a copy replaces when its publisher could not read the marker.
ANY_MARKER = "*"


@dataclass(frozen=True)
class Republish:
    """A copy about to defer. Every published copy has its own defer id; the
    store's marker names the newest one, so of two identical copies (a broker
    restore) only the one whose successor took the marker goes on."""

    defer_id: str | None  # this copy's (None: the task's first message)
    #: the marker value this copy's publisher read: the marker this copy
    #: stands for while the publisher's move of it did not land (ANY_MARKER:
    #: its publisher could not read it)
    replaces: str | None = None
    marker: str | Failed | Unread | None = UNREAD  # the defer id the marker names


def decide_republish(s: Republish) -> Outcome | Read:
    if s.marker is UNREAD:
        return Read.MARKER
    # A marker unreadable: a second copy beats losing the work.
    if isinstance(s.marker, Failed):
        return Outcome("republish.publish", Act.PUBLISH, replaces=ANY_MARKER)
    mine = (s.defer_id, s.replaces)
    if s.marker is not None and s.replaces != ANY_MARKER and s.marker not in mine:
        return Outcome("republish.queued", Act.DROP, "a deferred copy is already queued")
    return Outcome("republish.publish", Act.PUBLISH, replaces=s.marker)
