"""A chord header member whose worker dies between the fenced commit and Celery's
SUCCESS write still completes its chord: real prefork workers.

Celery counts a header member in the call that stores its SUCCESS
(``mark_as_done``, then ``on_chord_part_return``), and acknowledges without a
count a message whose worker died after its SUCCESS was stored. So the
member's SUCCESS must not be stored before Celery's own write: then a death
after the commit leaves no SUCCESS, the message comes back
(``task_reject_on_worker_lost``), and the copy, which never runs the body
again, stores the accepted value through ``mark_as_done``, which counts the
member. With the SUCCESS in the commit's transaction (the ``lease+`` backend's
one-transaction commit), the chord waited forever.

The fault is ``DieAfterCommit`` (tests/apps/leaseapp.py): the armed member's
pool process SIGKILLs itself right after the commit, before the tracer's
write. A second fault kills the header task that counted last just before it
publishes the callback: Celery then acknowledges that task's message (its
SUCCESS is stored), for a leased header task as for a plain one, and only the
``lease+`` backend's look for chords due their callback
(celery_lease/backend_chords.py) publishes it, once the publish window has
passed (``result_chord_join_timeout`` 0.5 s here: a 6 s window). Each
deployment: Celery's Redis backend, and the ``lease+`` backend on the result
database with the leases in Redis and in that database.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import chord

import celery_lease
from tests.apps.leaseapp import build
from tests.servers import PostgresServer, RedisServer, wait_for
from tests.workers import Worker, _state, read_log

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis]

DEPLOYMENTS = ["redis-backend", "lease-backend+redis-leases", "lease-backend+pg-leases"]


@pytest.fixture(params=DEPLOYMENTS)
def deployment(
    request: pytest.FixtureRequest,
    make_redis_server: Callable[..., RedisServer],
    pg_server: PostgresServer,
    pg_url: str,
    tmp_path: Path,
) -> Iterator[tuple[dict[str, str], Any, Worker]]:
    celery_lease.migrate(pg_url)
    redis = make_redis_server(appendonly=False)
    arm = tmp_path / "arm"
    arm.mkdir()
    env = {
        "CL_BROKER": redis.url(0),
        "CL_STORE": pg_url if request.param.endswith("pg-leases") else redis.url(1),
        "CL_LOG": str(tmp_path / "exec.log"),
        "CL_ARM_DIR": str(arm),
        "CL_TTL": "30",
        # The lease+ backend's publish window, 2 x this + 5 s (backend_chords.publish_window)
        "CL_SETTINGS": '{"result_chord_join_timeout": 0.5}',
    }
    if request.param == "redis-backend":
        env |= {"CL_BACKEND": redis.url(2), "CL_RESULTS": pg_url}
    else:
        env["CL_BACKEND"] = f"lease+{pg_url}"  # the result table's database
    app, tasks = build(env)
    worker = Worker("chord", env, tmp_path).start()
    try:
        yield env, tasks, worker
    finally:
        worker.kill()
        app.close()


def test_a_member_killed_after_its_commit_still_completes_the_chord(
    deployment: tuple[dict[str, str], Any, Worker],
) -> None:
    env, tasks, worker = deployment
    keys = [f"chord-crash-{uuid.uuid4().hex}" for _ in range(3)]
    ids = [str(uuid.uuid4()) for _ in keys]
    (Path(env["CL_ARM_DIR"]) / ids[1]).touch()
    header = [
        tasks.die_after_commit.s(k, 0.0, f"m{i}").set(task_id=t)
        for i, (k, t) in enumerate(zip(keys, ids))
    ]
    joined = chord(header, tasks.collect.s()).apply_async()

    # The fault happened: the armed member committed, then its process died.
    committed = wait_for(
        lambda: [r for r in read_log(Path(env["CL_LOG"])) if r["event"] == "committed"] or None,
        60,
        "the armed member's commit",
    )[0]
    assert committed["task_id"] == ids[1]
    wait_for(lambda: _state(committed["pid"]) in ("?", "Z"), 30, "the committing child to die")

    values = joined.get(timeout=90)
    assert [v["key"] for v in values] == keys
    assert values[1] == committed["value"], "the callback got the accepted value"
    starts = [r for r in read_log(Path(env["CL_LOG"])) if r["event"] == "start"]
    assert sorted(r["task_id"] for r in starts) == sorted(ids), "a body ran twice"
    accepted = tasks.die_after_commit.accepted(key=keys[1])
    assert accepted is not None and accepted.value == committed["value"]
    assert f"LEASE_REJECTED {ids[1]}" in worker.log_text(), "the copy ran instead of ending"


@pytest.mark.slow  # about 20 s a deployment: one of .ci/run's long runs (-m ci)
@pytest.mark.ci
@pytest.mark.parametrize("member", ["leased", "plain"])
# Not on Celery's Redis backend: its result consumer, left subscribed in this
# process after the servers stop, broke the interpreter's parser for the rest
# of the session (CPython 3.11's "AST constructor recursion depth mismatch").
@pytest.mark.parametrize("deployment", DEPLOYMENTS[1:], indirect=True)
def test_a_member_killed_between_the_last_count_and_the_callbacks_publish(
    deployment: tuple[dict[str, str], Any, Worker], member: str
) -> None:
    env, tasks, worker = deployment
    keys = [f"chord-publish-{uuid.uuid4().hex}" for _ in range(3)]
    ids = [str(uuid.uuid4()) for _ in keys]
    (Path(env["CL_ARM_DIR"]) / f"publish-{tasks.collect.name}").touch()
    header = [
        (tasks.work.s(k, 0.0, f"m{i}") if member == "leased" else tasks.add.s(i, 1)).set(task_id=t)
        for i, (k, t) in enumerate(zip(keys, ids))
    ]
    # Only the callback's id is kept: an AsyncResult never fulfilled would unsubscribe
    # from Celery's Redis backend when collected, after the test stopped that server.
    callback_id = chord(header, tasks.collect.s()).apply_async().id

    # The fault happened: the header task that counted last died publishing the
    # callback, and the worker acknowledged its message, its SUCCESS being stored.
    dying = wait_for(
        lambda: (
            [r for r in read_log(Path(env["CL_LOG"])) if r["event"] == "dying_before_publish"]
            or None
        ),
        60,
        "the last-counted header task's death before the callback's publish",
    )[0]
    assert dying["member"] in ids
    wait_for(lambda: _state(dying["pid"]) in ("?", "Z"), 30, "the publishing child to die")
    wait_for(
        lambda: f"{dying['member']}] succeeded before the worker was lost" in worker.log_text(),
        60,
        "the worker to acknowledge the killed task's message",
    )
    if member == "leased":
        starts = [r for r in read_log(Path(env["CL_LOG"])) if r["event"] == "start"]
        assert sorted(r["task_id"] for r in starts) == sorted(ids), "a body ran twice"

    callback = tasks.collect.AsyncResult(callback_id)
    wait_for(callback.ready, 60, "the callback, published by the look for chords due")
    assert "was not published (that worker died?): publishing it now" in worker.log_text()
    values = callback.get(timeout=5)
    if member == "leased":
        assert [v["key"] for v in values] == keys, "the header's values, in order"
    else:
        assert values == [1, 2, 3]
    callbacks = [r for r in read_log(Path(env["CL_LOG"])) if r["event"] == "collected"]
    assert len(callbacks) == 1, f"the callback ran {len(callbacks)} times"
