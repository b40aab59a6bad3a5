"""``tests/apps/leaseapp.py`` plus tasks for the tenant, outage and bad-input tests.

``celery -A tests.apps.tenantapp worker`` runs every task of ``leaseapp`` (same
``CL_*`` settings, same execution log) and:

- ``tenantapp.work_for(key, tenant, sleep=0, tag="")``: ``lease_key="{key}"``,
  ``lease_tenant="{tenant}"``: the same key string is a different lease per tenant;
- ``tenantapp.checked(key, sleep=0, tag="")``: like ``work`` but the body calls
  ``self.lease.ensure()`` every 50 ms, and logs ``lost`` (and re-raises) the
  moment the lease is gone, so a test sees *when* the body learnt of it;
- ``tenantapp.keyed(key)``: any key string; returns the key's SHA-256.
- ``tenantapp.report_for(doc, tenant, tag="")``: ``once`` + ``return`` over
  ``lease_key="{doc}"``, ``lease_tenant="{tenant}"``;
- ``tenantapp.guarded(doc, tenant, caller, tag="")``: the same, with a
  ``lease_authorize`` hook that allows a caller only into its own tenant;
- ``tenantapp.once_for(doc, tenant, sleep=0, tag="")``: ``once`` over
  ``lease_key="{doc}"``, ``lease_tenant="{tenant}"``, rejecting both a conflict
  and a duplicate (the failure messages a tenant's caller sees);
- ``tenantapp.plain(x)``: no templates at all (default key; headers scope it);
- ``tenantapp.many(n)``: a key callable giving ``n`` keys.
- ``tenantapp.retry_scoped(doc, tenant, tries=0, to_doc="", to_tenant="")``
  (``lease_key="{doc}"``, ``lease_tenant="{tenant}"``), ``tenantapp.retry_keyed``
  (the same without ``lease_tenant``: a header scopes it) and
  ``tenantapp.retry_plain(doc, tries=0, to_doc="")`` (no templates): the first
  run retries once with ``doc`` / ``tenant`` replaced by ``to_doc`` /
  ``to_tenant``; the retry returns the keys it held.
- ``tenantapp.sleep_plain(x, sleep)``: no templates; logs ``start`` with the
  store key it holds, then sleeps.
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

    def report(self: Any, doc: str, tenant: str, tag: str) -> Any:
        value = _body(self, doc, 0.0, tag, log)
        return {**value, "tenant": tenant, "doc": doc}

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tenantapp.report_for",
        lease_key="{doc}",
        lease_tenant="{tenant}",
        lease_mode="once",
        lease_on_duplicate="return",
    )
    def report_for(self: Any, doc: str, tenant: str, tag: str = "") -> Any:
        return report(self, doc, tenant, tag)

    def own_tenant_only(
        self: Any,
        tenant: str | None,
        keys: list[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> bool:
        record(log, "authorize", task_id=self.request.id, tenant=tenant, keys=keys)
        return kwargs.get("caller") == tenant

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tenantapp.guarded",
        lease_key="{doc}",
        lease_tenant="{tenant}",
        lease_mode="once",
        lease_on_duplicate="return",
        lease_authorize=own_tenant_only,
    )
    def guarded(self: Any, doc: str, tenant: str, caller: str, tag: str = "") -> Any:
        return report(self, doc, tenant, tag)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tenantapp.plain")
    def plain(self: Any, x: str) -> Any:
        record(log, "start", task_id=self.request.id, token=self.lease.token)
        return {"x": x, "keys": list(self.lease.keys)}

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tenantapp.many",
        lease_key=lambda n: [f"many-{i}" for i in range(n)],
    )
    def many(self: Any, n: int) -> Any:
        return len(self.lease.keys)

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tenantapp.once_for",
        lease_key="{doc}",
        lease_tenant="{tenant}",
        lease_mode="once",
        lease_on_conflict="reject",
        lease_on_duplicate="reject",
    )
    def once_for(self: Any, doc: str, tenant: str, sleep: float = 0.0, tag: str = "") -> Any:
        return {**_body(self, doc, sleep, tag, log), "tenant": tenant}

    def retry_once(self: Any, tries: int, **changes: Any) -> Any:
        if tries == 0:
            moved = {k: v for k, v in changes.items() if v}
            kwargs = {**self.request.kwargs, **moved, "tries": 1}
            raise self.retry(args=(), kwargs=kwargs, countdown=0)
        record(log, "start", task_id=self.request.id, token=self.lease.token)
        return {"keys": list(self.lease.keys), "tries": tries}

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tenantapp.retry_scoped",
        lease_key="{doc}",
        lease_tenant="{tenant}",
    )
    def retry_scoped(
        self: Any, doc: str, tenant: str, tries: int = 0, to_doc: str = "", to_tenant: str = ""
    ) -> Any:
        return retry_once(self, tries, doc=to_doc, tenant=to_tenant)

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tenantapp.retry_keyed", lease_key="{doc}"
    )
    def retry_keyed(self: Any, doc: str, tries: int = 0, to_doc: str = "") -> Any:
        return retry_once(self, tries, doc=to_doc)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tenantapp.retry_plain")
    def retry_plain(self: Any, doc: str, tries: int = 0, to_doc: str = "") -> Any:
        return retry_once(self, tries, doc=to_doc)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tenantapp.sleep_plain")
    def sleep_plain(self: Any, x: str, sleep: float) -> Any:
        record(log, "start", task_id=self.request.id, lease_key=self.lease.key)
        time.sleep(sleep)
        return x

    tasks.sleep_plain = sleep_plain
    tasks.retry_scoped = retry_scoped
    tasks.retry_keyed = retry_keyed
    tasks.retry_plain = retry_plain
    tasks.once_for = once_for
    tasks.report_for = report_for
    tasks.guarded = guarded
    tasks.plain = plain
    tasks.many = many
    tasks.work_for = work_for
    tasks.keyed = keyed
    tasks.checked = checked
    return app, tasks


app, tasks = build_tenant(os.environ)
