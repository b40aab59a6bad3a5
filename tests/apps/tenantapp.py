"""``tests/apps/leaseapp.py`` plus tasks for the tenant, outage and bad-input tests.

``celery -A tests.apps.tenantapp worker`` runs every task of ``leaseapp`` (same
``CL_*`` settings, same execution log) and:

- ``tenantapp.work_for(key, tenant, sleep=0, tag="")``: ``lease_key="{key}"``,
  ``lease_tenant="{tenant}"``: the same key string is a different lease per tenant;
- ``tenantapp.checked(key, sleep=0, tag="")``: like ``work`` but the body calls
  ``self.lease.ensure()`` every 50 ms, and logs ``lost`` (and re-raises) the
  moment the lease is gone, so a test sees *when* the body learnt of it;
- ``tenantapp.keyed(key)``: any key string; returns the key's SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from celery_lease import LeasedTask, LeaseLost
from tests.apps.leaseapp import _body, build, record


def build_tenant(environ: Any) -> tuple[Any, Any]:
    app, tasks = build(environ)
    log = environ.get("CL_LOG")

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tenantapp.work_for",
        lease_key="{key}",
        lease_tenant="{tenant}",
    )
    def work_for(self: Any, key: str, tenant: str, sleep: float = 0.0, tag: str = "") -> Any:
        return {**_body(self, key, sleep, tag, log), "tenant": tenant}

    @app.task(base=LeasedTask, bind=True, shared=False, name="tenantapp.checked", lease_key="{key}")
    def checked(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> Any:
        lease = self.lease
        record(log, "start", task_id=self.request.id, key=key, token=lease.token, tag=tag)
        deadline = time.monotonic() + sleep
        while time.monotonic() < deadline:
            try:
                lease.ensure()
            except LeaseLost as e:
                record(
                    log, "lost", task_id=self.request.id, key=key, token=lease.token, reason=str(e)
                )
                raise
            time.sleep(0.05)
        record(log, "end", task_id=self.request.id, key=key, token=lease.token, held=lease.held)
        return {"key": key, "token": lease.token, "tag": tag, "pid": os.getpid()}

    @app.task(base=LeasedTask, bind=True, shared=False, name="tenantapp.keyed", lease_key="{key}")
    def keyed(self: Any, key: str) -> Any:
        """Any key at all; returns the key's SHA-256 (a NUL in a result is refused, not a key)."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        record(log, "start", task_id=self.request.id, sha=digest, token=self.lease.token)
        return {"sha": digest, "token": self.lease.token, "lease_key": self.lease.key}

    tasks.work_for = work_for
    tasks.keyed = keyed
    tasks.checked = checked
    return app, tasks


app, tasks = build_tenant(os.environ)
