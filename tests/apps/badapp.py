"""An app whose task's ``lease_key`` names an argument the task does not have.

``celery -A tests.apps.badapp worker`` must fail while registering the task,
naming the task and the argument (tests/test_settings.py).
"""

from __future__ import annotations

import os

from celery import Celery

from celery_lease import LeasedTask

app = Celery(
    "badapp",
    broker=os.environ.get("CL_BROKER", "redis://127.0.0.1:6379/10"),
    backend=os.environ.get("CL_BACKEND", "redis://127.0.0.1:6379/11"),
)
app.conf.update(
    lease_store_url=os.environ.get("CL_STORE", "sqlite:///celery-lease-test.sqlite3"),
    lease_result_url=os.environ.get("CL_RESULTS") or None,
    worker_hijack_root_logger=False,
)


@app.task(base=LeasedTask, bind=True, name="badapp.suite", lease_key="payment-security-{api}")
def suite(self, api_id: int) -> int:
    return api_id
