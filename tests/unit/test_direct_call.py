"""A direct call ``task(...)`` of a leased task: the body runs with a LocalLease.

The README's body (``self.lease.ensure()``, ``self.lease.token``) must run in
a direct call too, without touching any store, file or setting.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine

import celery_lease
from celery_lease import LeasedTask, StaleFencingToken, fencing
from celery_lease.local import LocalLease


def make_app() -> Celery:
    # No lease_* settings at all: a direct call must not need them.
    return Celery("direct", broker="memory://", set_as_current=False)


def test_self_lease_in_a_direct_call_is_a_local_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    app = make_app()
    seen: dict[str, Any] = {}

    @app.task(base=LeasedTask, bind=True, lease_key="payment-security-{api_id}", lease_ttl=30)
    def generate(self: LeasedTask, api_id: int) -> dict[str, Any]:
        lease = self.lease
        lease.ensure()
        seen.update(
            lease=lease,
            same=self.lease is lease,
            token=lease.token,
            key=lease.key,
            keys=lease.keys,
            held=lease.held,
            headers=fencing.headers(lease),
        )
        return {"suite": api_id}

    assert generate(api_id=42) == {"suite": 42}
    assert isinstance(seen["lease"], LocalLease) and seen["same"]
    assert seen["token"] == 0 and seen["held"] is True
    assert seen["key"] == "payment-security-42" and seen["keys"] == ("payment-security-42",)
    assert seen["headers"] == {"Fencing-Token": "0", "Fencing-Key": "payment-security-42"}
    assert seen["lease"].renew() is True and math.isinf(seen["lease"].remaining)
    # Outside a body there is no lease, and nothing was written anywhere.
    assert generate.lease is None
    assert os.listdir(tmp_path) == []


def test_a_direct_calls_guard_is_the_bare_token_zero(tmp_path: Path) -> None:
    """Accepted for a resource no leased execution wrote; refused once one did."""
    url = f"sqlite:///{tmp_path / 'own.sqlite3'}"
    celery_lease.migrate(url)
    engine = create_engine(url)
    app = make_app()

    @app.task(base=LeasedTask, bind=True, lease_key="acct-{n}")
    def write(self: LeasedTask, n: int) -> None:
        with engine.begin() as conn:
            fencing.guard(conn, f"account:{n}", self.lease)

    write(n=1)  # a fresh resource: the direct call writes
    with engine.begin() as conn:
        fencing.guard(conn, "account:1", 5)  # a leased execution with token 5 wrote since
    with pytest.raises(StaleFencingToken):
        write(n=1)
    engine.dispose()
