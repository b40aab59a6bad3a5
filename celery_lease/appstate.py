"""What celery-lease keeps per Celery app, beside the app rather than on it.

One :class:`AppState` per app in a ``WeakKeyDictionary``: nothing is set on
the app object, and an app that is dropped (tests make many) takes its state
with it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_lease.config import Config
    from celery_lease.runtime import Runtime

__all__ = ["AppState", "app_state"]


@dataclass
class AppState:
    """Each field is filled on first use and kept for the app's life."""

    #: The validated ``lease_*`` settings (:func:`celery_lease.config.config`).
    config: Config | None = None
    #: Whether :func:`celery_lease.signals.install` ran for the app.
    installed: bool = False
    #: The broker's connection and channel errors (:func:`celery_lease.events.broker_errors`).
    broker_errors: tuple[type[BaseException], ...] | None = None
    #: Whether the broker flags redelivered messages (``celery_lease.reads``).
    marks_redeliveries: bool | None = None
    #: ``(pid, Runtime)``: the stores of the process that built them (``celery_lease.runtime``).
    runtime: tuple[int, Runtime] | None = None


_states: weakref.WeakKeyDictionary[Any, AppState] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def app_state(app: Any) -> AppState:
    """The :class:`AppState` of ``app`` (a Celery app, or a proxy of one)."""
    # celery.local.Proxy (current_app) cannot be weakly referenced: key the real app.
    unwrap = getattr(app, "_get_current_object", None)
    if unwrap is not None:
        app = unwrap()
    state = _states.get(app)
    if state is None:
        with _lock:
            state = _states.setdefault(app, AppState())
    return state
