"""A worker stopped while a leased body runs: real prefork workers, real signals.

A cold shutdown (SIGQUIT, or a second Ctrl+C) does not wait for the running
body: Celery terminates the pool's children and, with ``acks_late``, gives
the message back to the broker. The body unwinds and its lease is released
on the way out, so the copy delivered next claims at once, with a newer
token, and the work is redone once. The test proves the body was cut short
(no end, the child gone) and the lease released, not expired (free while its
TTL still ran), before it asserts the redo.

A warm shutdown (SIGTERM) waits for the body: it commits, its lease is
released, its message is acked, and nothing is left for another worker.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
import redis

from tests.acceptance.lease_cluster import Cluster, gone, new_key
from tests.workers import signal_when_active

pytestmark = pytest.mark.timeout(120)


def test_a_warm_shutdown_mid_body_lets_it_commit_and_leaves_nothing_to_redo(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster("redis", ttl=6.0)
    a = c.worker("a")
    c.start(a)
    key = new_key("warm")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 2.0, "tag": "x"})
    s1 = c.wait_start(t1.id)
    assert signal_when_active(c.app, a, [t1.id], signal.SIGTERM) == 0
    assert len(c.ends(t1.id)) == 1, "the body ran to its end"
    value = t1.get(timeout=10)
    assert value["token"] == s1["token"]
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(s1["token"], t1.id)]
    rec = c.store.inspect(key)
    assert rec is None or rec.owner_id is None, f"released: {rec}"
    broker = redis.Redis.from_url(c.env["CL_BROKER"])
    try:
        assert broker.llen("celery") == 0 and broker.hlen("unacked") == 0, "the message acked"
    finally:
        broker.close()


def test_a_cold_shutdown_mid_body_releases_the_lease_and_the_work_is_redone_once(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster("redis", ttl=6.0)
    a, b = c.worker("a"), c.worker("b")
    c.start(a)
    key = new_key("cold")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 4.0, "tag": "x"})
    s1 = c.wait_start(t1.id)
    signal_when_active(c.app, a, [t1.id], signal.SIGQUIT)
    assert gone(s1["pid"]) and not c.ends(t1.id), "the body was cut short"
    rec = c.store.inspect(key)
    assert rec is not None and rec.token == s1["token"], rec
    assert rec.owner_id is None and rec.expires_at > rec.now, f"released, not expired: {rec}"

    c.start(b)
    s2 = c.wait_start(t1.id, n=2, timeout=c.ttl + 20)
    assert s2["hostname"] == b.hostname and s2["token"] > s1["token"]
    value = t1.get(timeout=30)
    assert value["token"] == s2["token"]
    history = c.table.history(key)
    assert [(r.token, r.task_id) for r in history] == [(s2["token"], t1.id)]
    assert len(c.starts(t1.id)) == 2 and len(c.ends(t1.id)) == 1
