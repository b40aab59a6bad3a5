"""Bad ``lease_*`` settings, task options and key templates stop a real worker at
start, naming the fault.

Real ``celery worker`` processes (``tests/workers.py``) started with a bad
setting exit non-zero at start, and their log names the setting, the value
and what is accepted; a typo only warns, naming the right setting; a task
whose ``lease_key`` names an argument it does not have stops the worker while
the task is registered (``tests/apps/badapp.py``). Every message of the
checks themselves, in process: tests/unit/test_config_errors.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.workers import Worker

pytestmark = pytest.mark.timeout(90)


# --------------------------------------------------------------------------
# real workers
# --------------------------------------------------------------------------


def _env(
    fresh_redis: Callable[[], str], tmp_path: Path, settings: dict[str, Any]
) -> dict[str, str]:
    return {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": f"sqlite:///{tmp_path / 'lease.sqlite3'}",
        "CL_RESULTS": f"sqlite:///{tmp_path / 'lease.sqlite3'}",
        "CL_SETTINGS": json.dumps(settings),
    }


#: setting -> what the worker's log must say (the setting, the value, what is accepted)
BAD_SETTINGS: list[tuple[dict[str, Any], list[str]]] = [
    ({"lease_ttl": -1}, ["lease_ttl must be greater than 0", "-1"]),
    ({"lease_ttl": "thirty"}, ["lease_ttl must be a number of seconds", "'thirty'"]),
    ({"lease_mode": "sometimes"}, ["lease_mode must be one of exclusive, once", "'sometimes'"]),
    (
        {"lease_on_conflict": "queue"},
        ["lease_on_conflict must be one of defer, reject, wait", "'queue'"],
    ),
    (
        {"lease_on_duplicate": "ignore"},
        ["lease_on_duplicate must be one of reject, return", "'ignore'"],
    ),
    (
        {"lease_store_url": "mongodb://x"},
        ["lease_store_url", "unknown URL scheme 'mongodb'", "redis", "sqlite", "postgresql"],
    ),
    (
        {"lease_result_url": "redis://127.0.0.1:1/0"},
        ["lease_result_url must be a SQL database", "postgresql+psycopg://", "sqlite:///"],
    ),
    (
        {"lease_renew_interval": 100},
        ["lease_renew_interval (100", "at most half the TTL (3.0)"],
    ),
    ({"lease_clock_drift": 99}, ["lease_clock_drift must be >= 0 and below lease_ttl (3.0)", "99"]),
    (
        {"lease_clock_drift": 2.5},
        ["less lease_clock_drift (2.5): the local view of a lease ends 0.5 s after its claim"],
    ),
    ({"lease_ttl": 1e11}, ["lease_ttl must be at most 31536000 (one year)"]),
]


@pytest.mark.parametrize(
    ("settings", "expected"), BAD_SETTINGS, ids=[json.dumps(s) for s, _ in BAD_SETTINGS]
)
def test_worker_refuses_to_start_with_a_bad_setting(
    settings: dict[str, Any], expected: list[str], fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    worker = Worker("bad", _env(fresh_redis, tmp_path, settings), tmp_path)
    code, log = worker.run_to_exit(timeout=60)
    assert code != 0, f"the worker accepted {settings} and exited {code}:\n{log[-3000:]}"
    assert " ready." not in log, f"the worker started with {settings}:\n{log[-3000:]}"
    assert "LeaseConfigError" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]  # one line, not a traceback
    for text in expected:
        assert text in log, f"{text!r} not in the log of a worker with {settings}:\n{log[-3000:]}"


def test_worker_warns_about_a_typo_naming_the_setting(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    worker = Worker("typo", _env(fresh_redis, tmp_path, {"lease_tll": 5}), tmp_path)
    try:
        worker.start(timeout=60)  # a typo is a warning, not a refusal
        log = worker.log_text()
    finally:
        worker.kill()
    assert "unknown celery-lease setting 'lease_tll'; did you mean 'lease_ttl'?" in log, log[-3000:]
    assert "WARNING" in log


def test_worker_refuses_a_key_template_naming_a_missing_argument(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    worker = Worker("badkey", _env(fresh_redis, tmp_path, {}), tmp_path, app="tests.apps.badapp")
    code, log = worker.run_to_exit(timeout=60)
    assert code != 0, log[-3000:]
    assert " ready." not in log, log[-3000:]
    # Refused while the task is registered (bound to the app), not at its first call.
    assert "on_bound" in log, log[-3000:]
    assert (
        "LeaseConfigError: task 'badapp.suite': lease_key template names argument 'api', "
        "which the task does not have (its arguments: api_id)"
    ) in log, log[-3000:]


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (
            "renew",
            "LeaseConfigError: task 'badapp.suite': lease_renew_interval (20) must be at most "
            "half the TTL (30.0)",
        ),
        (
            "drift",
            "LeaseConfigError: task 'badapp.suite': lease_clock_drift (2.0) must be below "
            "the task's lease_ttl (2.0)",
        ),
    ],
)
def test_worker_refuses_task_options_that_do_not_fit_the_app_settings(
    bad: str, expected: str, fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    """Each setting is fine alone; only the task's options and the app's together are wrong.

    Without the check at start, the worker ran and every execution of the task
    failed after claiming its lease (or renewed too rarely), so it must fail here.
    """
    env = {**_env(fresh_redis, tmp_path, {}), "CL_BAD": bad}
    worker = Worker(f"bad{bad}", env, tmp_path, app="tests.apps.badapp")
    try:
        code, log = worker.run_to_exit(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker started with a bad task ({bad}):\n{worker.log_text()[-3000:]}")
    assert code != 0, log[-3000:]
    assert " ready." not in log, log[-3000:]
    assert expected in log, log[-3000:]
