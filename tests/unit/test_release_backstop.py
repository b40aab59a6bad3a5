"""A release is best effort: whatever a store's ``release_later`` raises, the task's
own outcome stands and the failure is logged (the lease expires at its TTL).

No real store raises there today (their contract hands every failure to the
answer: tests/contract/test_store_down.py); this pins the executor's backstop
with the in-memory store, whose ``release_later`` is made to raise.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeasedTask
from celery_lease.testing import MemoryLeaseStore


class Defect(RuntimeError):
    pass


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_a_release_that_raises_never_replaces_the_tasks_outcome(
    outcome: str,
    lease_settings: dict[str, str],
    lease_store: MemoryLeaseStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery("backstop", broker="memory://", set_as_current=False)
    app.conf.update(lease_settings, task_store_eager_result=False)
    calls: list[str] = []

    def release_later(self: MemoryLeaseStore, lease: Any, answer: Any) -> None:
        calls.append(lease.keys[0])
        raise Defect("release_later broke its contract")

    monkeypatch.setattr(MemoryLeaseStore, "release_later", release_later)

    @app.task(base=LeasedTask, lease_key="acct-{n}", lease_commit=False)
    def work(n: int) -> int:
        if outcome == "raises":
            raise ValueError(f"the body's own error {n}")
        return n * 2

    with caplog.at_level(logging.WARNING, logger="celery_lease"):
        result = work.apply(kwargs={"n": 21})

    assert calls == ["acct-21"], "the release was never attempted: the fault did not happen"
    if outcome == "returns":
        assert result.state == "SUCCESS" and result.result == 42
    else:
        assert result.state == "FAILURE" and isinstance(result.result, ValueError)
        assert "the body's own error 21" in str(result.result)
    warned = [r for r in caplog.records if "could not release (it will expire)" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert warned[0].exc_info is not None and isinstance(warned[0].exc_info[1], Defect)
    # The lease was not released: it is still there, to lapse at its TTL.
    record = lease_store.inspect("acct-21")
    assert record is not None and record.live
