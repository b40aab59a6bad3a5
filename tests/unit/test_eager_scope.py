"""``Task.apply()`` and ``task_always_eager``: the ``lease_*`` headers scope the call.

Celery's ``apply()`` puts a caller's headers in ``request.headers``, where a
worker puts them on the request itself. Users' own tests run tasks this way,
so an eager call must read the same headers and hold them to the same checks
(:mod:`celery_lease.scope`) as a worker does. Every way to call a task
eagerly with headers is covered: ``apply``, a signature's ``apply``, and
``apply_async`` under ``task_always_eager``.

The in-memory lease store and an SQLite result table: eager here is the
subject, not a shortcut for a worker.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_lease
from celery_lease import LeaseConfigError, LeasedTask, LeaseScopeMismatch
from celery_lease.keys import scoped
from celery_lease.runtime import runtime

Call = Callable[[Any, tuple[Any, ...], dict[str, Any], dict[str, Any]], Any]


def _apply(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], headers: Any) -> Any:
    return task.apply(args, kwargs, headers=headers).get()


def _signature_apply(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], headers: Any) -> Any:
    return task.s(*args, **kwargs).apply(headers=headers).get()


def _always_eager(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], headers: Any) -> Any:
    task.app.conf.task_always_eager = True
    return task.apply_async(args, kwargs, headers=headers).get()


CALLS = pytest.mark.parametrize(
    "call", [_apply, _signature_apply, _always_eager], ids=["apply", "sig.apply", "always_eager"]
)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = f"memory://eager-{uuid.uuid4().hex}"
    app.conf.lease_result_url = f"sqlite:///{tmp_path}/results.db"
    app.conf.task_eager_propagates = True
    celery_lease.migrate(app.conf.lease_result_url)
    yield app
    app.close()


def _tasks(app: Celery) -> tuple[Any, Any]:
    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        lease_key="doc-{doc}",
        lease_mode="once",
        lease_on_duplicate="return",
    )
    def report(self: Any, doc: str, tag: str = "") -> Any:
        return {"tag": tag, "key": self.lease.key}

    @app.task(base=LeasedTask, bind=True, shared=False, lease_mode="once")
    def plain(self: Any, x: str) -> Any:
        return {"x": x, "keys": list(self.lease.keys)}

    return report, plain


@CALLS
def test_a_tenant_header_scopes_an_eager_call(app: Celery, call: Call) -> None:
    report, _ = _tasks(app)
    got = {t: call(report, ("1",), {"tag": t}, {"lease_tenant": t}) for t in ("acme", "globex")}
    assert got["acme"] == {"tag": "acme", "key": scoped("doc-1", "acme")}
    assert got["globex"] == {"tag": "globex", "key": scoped("doc-1", "globex")}, got
    table = runtime(app).results
    accepted = table.accepted(scoped("doc-1", "acme"), "acme")
    assert accepted is not None and accepted.value["tag"] == "acme"
    assert table.accepted("doc-1", None) is None, "nothing stored unscoped"


@CALLS
def test_a_keys_header_keys_an_eager_call_of_a_task_without_lease_key(
    app: Celery, call: Call
) -> None:
    _, plain = _tasks(app)
    got = call(plain, ("x",), {}, {"lease_keys": ["k-1", "k-2"], "lease_tenant": "acme"})
    assert got["keys"] == [scoped("k-1", "acme"), scoped("k-2", "acme")]


@CALLS
@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"lease_keys": ["doc-2"]}, LeaseScopeMismatch),  # disagrees with the template
        ({"lease_keys": "doc-1"}, LeaseScopeMismatch),  # a template's cache must agree
        ({"lease_tenant": ""}, LeaseScopeMismatch),  # malformed
        ({"lease_tenant": 7}, LeaseScopeMismatch),
    ],
)
def test_eager_headers_are_held_to_the_workers_checks(
    app: Celery, call: Call, headers: dict[str, Any], error: type[Exception]
) -> None:
    report, _ = _tasks(app)
    with pytest.raises(error):
        call(report, ("1",), {"tag": "t"}, headers)
    assert runtime(app).results.accepted("doc-1", None) is None


@CALLS
def test_an_eager_keys_header_cannot_reach_a_reserved_key(app: Celery, call: Call) -> None:
    _, plain = _tasks(app)
    with pytest.raises(LeaseConfigError, match="reserved"):
        call(plain, ("x",), {}, {"lease_keys": ["celery-lease/defer/x"]})
