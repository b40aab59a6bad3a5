"""Two security-test agents are ready to generate the official security suite
for payment API 42. The lease on ``payment-security-42`` decides which one may,
and the fenced result table decides whose suite is the accepted one.

Runs on the embedded default (kombu's ``filesystem://`` broker, SQLite for
leases and results, a file result backend) unless these are set:
``EXAMPLE_BROKER_URL``, ``EXAMPLE_RESULT_BACKEND``, ``EXAMPLE_LEASE_STORE_URL``,
``EXAMPLE_LEASE_RESULT_URL`` (e.g. redis://, postgresql+psycopg://, amqp://).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lease import LeasedTask

DATA = Path(os.environ.get("EXAMPLE_DATA", ".example-data")).resolve()
BROKER = os.environ.get("EXAMPLE_BROKER_URL", "filesystem://")

app = Celery("example_project")
app.conf.update(
    broker_url=BROKER,
    result_backend=os.environ.get("EXAMPLE_RESULT_BACKEND", f"file://{DATA / 'backend'}"),
    lease_store_url=os.environ.get("EXAMPLE_LEASE_STORE_URL", f"sqlite:///{DATA / 'leases.db'}"),
    lease_result_url=os.environ.get("EXAMPLE_LEASE_RESULT_URL") or None,
    lease_ttl=float(os.environ.get("EXAMPLE_LEASE_TTL", "4")),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
if BROKER.startswith("filesystem://"):
    for folder in ("broker", "processed", "backend", "control"):
        (DATA / folder).mkdir(parents=True, exist_ok=True)
    app.conf.broker_transport_options = {
        "data_folder_in": str(DATA / "broker"),
        "data_folder_out": str(DATA / "broker"),
        "processed_folder": str(DATA / "processed"),
        "control_folder": str(DATA / "control"),
        "polling_interval": 0.1,
    }


def progress(**fields: Any) -> None:
    """One JSON line per step, for the demo to narrate (independent of the plugin)."""
    path = DATA / "progress.jsonl"
    with open(path, "a") as fh:
        fh.write(json.dumps({"t": time.time(), **fields}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


@app.task(base=LeasedTask, bind=True, lease_key="payment-security-{api_id}")
def generate_security_suite(self: Any, api_id: int, seconds: float = 3.0) -> dict[str, Any]:
    """Long work outside any database transaction (think: an LLM generating tests)."""
    agent = self.request.hostname
    progress(step="start", agent=agent, task_id=self.request.id, token=self.lease.token)
    cases = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        cases.append(f"case-{len(cases) + 1}")
    progress(step="done", agent=agent, task_id=self.request.id, token=self.lease.token)
    suite = {"api_id": api_id, "cases": len(cases), "agent": agent, "token": self.lease.token}
    suite["digest"] = hashlib.sha256(json.dumps(suite, sort_keys=True).encode()).hexdigest()[:12]
    return suite
