"""Apps whose leased task is wrong in a way only registration can tell.

``CL_BAD`` picks the fault (``celery -A tests.apps.badapp worker`` must fail
at start, naming the task and what is wrong; tests/acceptance/test_settings.py):

* ``key`` (default): the ``lease_key`` template names an argument the task
  does not have;
* ``renew``: the task's ``lease_renew_interval`` is over half the app's
  ``lease_ttl`` (the task sets no TTL of its own);
* ``drift``: the app's ``lease_clock_drift`` is not below the task's own
  ``lease_ttl``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_lease import LeasedTask

BAD = os.environ.get("CL_BAD", "key")

app = Celery(
    "badapp",
    broker=os.environ.get("CL_BROKER", "redis://127.0.0.1:6379/10"),
    backend=os.environ.get("CL_BACKEND", "redis://127.0.0.1:6379/11"),
)
app.conf.update(
    lease_store_url=os.environ.get("CL_STORE", "sqlite:///celery-lease-test.sqlite3"),
    lease_result_url=os.environ.get("CL_RESULTS") or None,
    lease_ttl=30,
    worker_hijack_root_logger=False,
)

options: dict[str, Any] = {"lease_key": "payment-security-{api_id}"}
if BAD == "key":
    options["lease_key"] = "payment-security-{api}"
elif BAD == "renew":
    options["lease_renew_interval"] = 20  # app TTL 30: at most 15
elif BAD == "drift":
    app.conf.lease_clock_drift = 2.0  # below the app's TTL, not below the task's
    options["lease_ttl"] = 2
else:
    raise ValueError(f"CL_BAD={BAD!r}")


@app.task(base=LeasedTask, bind=True, name="badapp.suite", **options)
def suite(self: Any, api_id: int) -> int:
    return api_id
