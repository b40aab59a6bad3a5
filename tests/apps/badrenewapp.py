"""An app whose task renews every 20 s while the app's ``lease_ttl`` is 3 s.

The task's options pass on their own (no ``lease_ttl`` of its own); only with
the app's TTL is the renew interval above half the TTL.
``celery -A tests.apps.badrenewapp worker`` must refuse to start, naming the
task and the option (tests/acceptance/test_bad_input.py); a direct ``apply()`` must fail
before claiming.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_lease import LeasedTask

app = Celery(
    "badrenewapp",
    broker=os.environ.get("CL_BROKER", "memory://"),
    backend=os.environ.get("CL_BACKEND", "cache+memory://"),
)
app.conf.update(
    lease_store_url=os.environ.get("CL_STORE", "sqlite:///celery-lease-test.sqlite3"),
    lease_result_url=os.environ.get("CL_RESULTS") or None,
    lease_ttl=3.0,
    lease_send_events=False,
    worker_hijack_root_logger=False,
)


@app.task(
    base=LeasedTask,
    bind=True,
    shared=False,
    name="badrenewapp.suite",
    lease_key="{key}",
    lease_renew_interval=20,
)
def suite(self: Any, key: str) -> str:
    return key
