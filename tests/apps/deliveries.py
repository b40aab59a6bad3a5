"""``leaseapp`` plus an independent record of every message a worker receives.

The ``task_received`` signal (worker main process) appends a ``received``
row to the execution log (``CL_LOG``) with the broker's ``redelivered`` flag
and the plugin's deferral header, so a test can prove that a broker
redelivered a message without trusting the plugin's own logs.
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import task_received

from tests.apps.leaseapp import app, record, tasks

__all__ = ["app", "tasks"]


@task_received.connect(weak=False, dispatch_uid="tests.apps.deliveries")
def _received(request: Any = None, **kwargs: Any) -> None:
    if request is None:
        return
    info = request.delivery_info or {}
    headers = getattr(request, "_request_dict", {}) or {}
    record(
        os.environ.get("CL_LOG"),
        "received",
        task_id=request.id,
        hostname=request.hostname,
        redelivered=bool(info.get("redelivered")),
        deferrals=int(headers.get("lease_deferrals") or 0),
    )
