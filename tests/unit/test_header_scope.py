"""Keys and tenants from the ``lease_keys`` / ``lease_tenant`` headers meet the same
normalisation (:func:`celery_lease.keys.user_key`) as those the templates give.

Invariant 12 for every source of a scope: a key or tenant crafted in the shortened
shape (``...~<sha256 hex>``) never equals another's shortened form, whether a
template or a header names it; and the same key and tenant reach the same store
key from either source. A message published by ``LeasedTask.apply_async``
resolves in the worker to the keys resolved at publish (a round trip).

Pure logic over ``celery_lease.scope``: no store, no worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeasedTask
from celery_lease.config import limits
from celery_lease.keys import scoped, shorten, user_key
from celery_lease.scope import HEADER_KEYS, HEADER_TENANT, publish_headers, resolve_scoped

LONG = "victim-" + "x" * 300
#: Every shape of key or tenant: ordinary, long, in the shortened shape, unstorable.
SHAPES = {
    "plain": "doc-1",
    "long": LONG,
    "shortened-shape": shorten(LONG),
    "nul": "a\x00b",
}


@pytest.fixture(scope="module")
def tasks() -> Iterator[dict[str, Any]]:
    app = Celery("headers", broker="memory://", set_as_current=False)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="{doc}", lease_tenant="{org}")
    def both(self: Any, doc: str, org: str) -> None: ...

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="{doc}")
    def keyed(self: Any, doc: str) -> None: ...

    @app.task(base=LeasedTask, bind=True, shared=False)
    def plain(self: Any, doc: str) -> None: ...

    yield {
        "both": both._get_current_object(),
        "keyed": keyed._get_current_object(),
        "plain": plain._get_current_object(),
        "limits": limits(app),
    }
    app.close()


def _store_keys(tasks: dict[str, Any], name: str, doc: str, org: str) -> list[str]:
    """The store keys of (doc, org), with each named by a template or by a header."""
    task, lim = tasks[name], tasks["limits"]
    if name == "both":
        return resolve_scoped(task, (doc, org), {}, None, None, lim)[2]
    if name == "keyed":
        return resolve_scoped(task, (doc,), {}, None, org, lim)[2]
    return resolve_scoped(task, ("x",), {}, [doc], org, lim)[2]


@pytest.mark.parametrize("org", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("doc", SHAPES.values(), ids=SHAPES.keys())
def test_a_template_and_a_header_reach_the_same_store_key(
    tasks: dict[str, Any], doc: str, org: str
) -> None:
    want = [scoped(user_key(doc), user_key(org))]
    for name in ("both", "keyed", "plain"):
        assert _store_keys(tasks, name, doc, org) == want, name


@pytest.mark.parametrize("source", ["keyed", "plain"])
def test_a_header_key_in_the_shortened_shape_never_meets_the_key_it_imitates(
    tasks: dict[str, Any], source: str
) -> None:
    lim = tasks["limits"]
    victim = resolve_scoped(tasks["keyed"], (LONG,), {}, None, None, lim)[2]
    forged = shorten(LONG)
    if source == "keyed":
        got = resolve_scoped(tasks["keyed"], (forged,), {}, None, None, lim)[2]
    else:
        got = resolve_scoped(tasks["plain"], ("x",), {}, [forged], None, lim)[2]
    assert got != victim


@pytest.mark.parametrize("source", ["both", "keyed", "plain"])
def test_a_header_tenant_in_the_shortened_shape_never_meets_the_tenant_it_imitates(
    tasks: dict[str, Any], source: str
) -> None:
    long_org = "acme-" + "o" * 300
    victim = _store_keys(tasks, "both", "doc-1", long_org)
    assert _store_keys(tasks, source, "doc-1", user_key(long_org)) != victim


@pytest.mark.parametrize("org", [None, *SHAPES.values()], ids=["no-tenant", *SHAPES])
@pytest.mark.parametrize("doc", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("name", ["both", "keyed", "plain", "plain-default"])
def test_a_published_message_resolves_in_the_worker_to_the_keys_resolved_at_publish(
    tasks: dict[str, Any], name: str, doc: str, org: str | None
) -> None:
    task, lim = tasks[name.split("-")[0]], tasks["limits"]
    if name == "both":
        if org is None:
            return
        args: tuple[Any, ...] = (doc, org)
        given: dict[str, Any] = {}
    elif name == "keyed":
        args, given = (doc,), {HEADER_TENANT: org}
    elif name == "plain":
        args, given = ("x",), {HEADER_KEYS: [doc], HEADER_TENANT: org}
    else:
        args, given = (doc,), {HEADER_TENANT: org}
    at_publish = resolve_scoped(
        task, args, {}, given.get(HEADER_KEYS), given.get(HEADER_TENANT), lim
    )
    sent = publish_headers(task, args, {}, dict(given), lim)
    in_worker = resolve_scoped(task, args, {}, sent.get(HEADER_KEYS), sent.get(HEADER_TENANT), lim)
    assert in_worker == at_publish
