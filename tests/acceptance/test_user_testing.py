"""How a project tests its own leased tasks: celery_lease.testing + pytest-celery.

Written as a user would (docs/testing.md shows the same file): pytest-celery's
in-process ``celery_app`` fixture, configured through its ``celery_config``
fixture from the plugin's ``lease_settings`` (a memory:// lease store, a
temporary SQLite result file, nothing in the current directory), and a real
worker thread (``celery.contrib.testing.worker.start_worker``), never eager
mode. The lease store is celery_lease.testing's in-memory one: this proves the
helpers and the task's outcomes as a user sees them, not a store invariant
(those are in tests/contract/store_contract/ and the worker suites).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from celery_lease import LeasedTask, StaleFencingToken
from celery_lease.testing import take_over, wait_until_held
from celery_lease.testing.events import record_events


@pytest.fixture
def celery_config(lease_settings: dict[str, Any]) -> dict[str, Any]:
    # pytest-celery's fixture (session-scoped there), per test here: a fresh
    # store and result file for each test.
    return {**lease_settings, "task_acks_late": True}


@pytest.fixture
def worker(celery_app: Any) -> Iterator[Any]:
    # The tasks are registered by each test before the worker starts.
    celery_app.loader.import_task_module("celery.contrib.testing.tasks")  # its ping
    yield lambda: start_worker(celery_app, pool="solo", perform_ping_check=True)


def test_a_taken_over_task_ends_fenced(celery_app: Any, worker: Any, lease_store: Any) -> None:
    started, resume = threading.Event(), threading.Event()

    @celery_app.task(base=LeasedTask, bind=True, lease_key="report-{n}", lease_ttl=30)
    def build_report(self: LeasedTask, n: int) -> dict[str, int]:
        started.set()
        assert resume.wait(30)  # the test takes the key over meanwhile
        return {"n": n, "token": self.lease.token}

    with worker(), record_events(celery_app) as events:
        result = build_report.delay(n=7)
        assert started.wait(30)
        held = wait_until_held(lease_store, "report-7")
        assert held.task_id == result.id
        new_owner = take_over(lease_store, "report-7")  # the worker "stalled past its TTL"
        resume.set()
        with pytest.raises(StaleFencingToken) as info:
            result.get(timeout=30)
        event = events.wait_for("FENCED", task_id=result.id)
    assert info.value.token == held.token
    assert new_owner.token > held.token
    assert event["lease_key"] == "report-7"
    assert result.state == "FAILURE"
    assert build_report.accepted(n=7) is None, "a fenced result must not be accepted"


def test_a_redelivered_accepted_task_is_lease_rejected(celery_app: Any, worker: Any) -> None:
    runs: list[int] = []

    @celery_app.task(base=LeasedTask, bind=True, lease_key="invoice-{n}")
    def send_invoice(self: LeasedTask, n: int) -> int:
        runs.append(self.lease.token)
        return n * 10

    with worker(), record_events(celery_app) as events:
        first = send_invoice.delay(n=3)
        assert first.get(timeout=30) == 30
        # The broker delivers the same task id again (a restored message).
        again = send_invoice.apply_async(kwargs={"n": 3}, task_id=first.id)
        event = events.wait_for("LEASE_REJECTED", task_id=first.id)
    assert "redelivery" in event["reason"]
    assert len(runs) == 1, f"the body ran again: {runs}"
    assert again.get(timeout=5) == 30, "the accepted result still stands"
    accepted = send_invoice.accepted(n=3)
    assert accepted is not None and (accepted.value, accepted.token) == (30, runs[0])


def test_the_plugin_writes_nothing_to_the_current_directory(
    lease_settings: dict[str, Any], celery_app: Any, worker: Any
) -> None:
    before = set(os.listdir("."))

    @celery_app.task(base=LeasedTask, bind=True, lease_key="k-{n}")
    def noop(self: LeasedTask, n: int) -> int:
        return n

    with worker():
        assert noop.delay(n=1).get(timeout=30) == 1
    assert lease_settings["lease_store_url"].startswith("memory://")
    assert set(os.listdir(".")) == before


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_the_docs_example_runs(pytester: pytest.Pytester, request: Any, store: str) -> None:
    """docs/testing.md's example, run as a project's own test file would be: on
    the default memory store, and with --lease-store-url naming a real Redis
    (where take_over evicts, the server's clock being out of reach)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    pytester.makepyfile(test_example=example)
    # -p: in a checkout whose installed metadata predates the pytest11 entry point.
    args = ["-p", "celery_lease.testing.pytest_plugin", "-q"]
    if store == "redis":
        url = request.getfixturevalue("redis_url")
        args.append(f"--lease-store-url={url}")
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(passed=2)
    if store == "redis":
        import redis

        client = redis.Redis.from_url(url)
        names = [k.decode() for k in client.keys("*")]
        client.close()
        assert any("report-7" in k for k in names), f"the leases were not in Redis: {names}"
