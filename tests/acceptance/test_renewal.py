"""Renewal: a task keeps its lease for many TTLs, and renewals are batched.

* A task running 10x its TTL (TTL 1 s, body 10 s, renewed every TTL / 3)
  keeps its lease the whole time: the store names it as the live holder at
  every sample, another worker's submission of the same key is deferred
  until it ends, and its result is accepted (SUCCESS, not FENCED).
* Batching: a threads-pool worker holding 100 leases at once renews all of
  them in about one EVALSHA per renewal cycle. The round trips are counted
  by the server itself (``INFO commandstats``) on a private Redis used only
  as the lease store.
* The same at unit level: ``Renewer.renew_due`` renews 100 leases in one
  round trip, and the renewal thread brings leases claimed at different
  moments onto one schedule.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_lease.renewal import HeldLease, Renewer, renewer
from celery_lease.stores.redis import RedisLeaseStore
from tests.servers import RedisServer, wait_for
from tests.workers import Worker, read_log, wait_log

pytestmark = pytest.mark.timeout(150)


def evalsha_calls(client: redis.Redis) -> int:
    """Script calls the server has answered (EVALSHA, plus EVAL fallbacks)."""
    stats = client.info("commandstats")
    return sum(
        int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval")
    )


def wait_until(deadline: float, what: str, clock: Any = time.monotonic) -> None:
    """Block until ``clock()`` reaches ``deadline`` (pacing and measurement windows only)."""
    wait_for(
        lambda: clock() >= deadline,
        max(0.0, deadline - clock()) + 5,
        what,
        interval=0.001,
        max_interval=0.02,
    )


@pytest.fixture
def lease_redis(make_redis_server: Any) -> RedisServer:
    """A private Redis used only as the lease store (nothing else talks to it)."""
    server: RedisServer = make_redis_server(appendonly=False)
    return server


def _worker_env(tmp_path: Path, broker: str, store: str, ttl: float) -> dict[str, str]:
    return {
        "CL_BROKER": broker,
        "CL_BACKEND": broker,
        "CL_STORE": store,
        "CL_RESULTS": f"sqlite:///{tmp_path / 'results.sqlite3'}",
        "CL_TTL": str(ttl),
        "CL_LOG": str(tmp_path / "exec.log"),
    }


# --------------------------------------------------------------------------
# unit level: Renewer with the real Redis store
# --------------------------------------------------------------------------


def _claim_many(store: RedisLeaseStore, n: int, ttl: float, prefix: str) -> list[HeldLease]:
    held = []
    for i in range(n):
        sent = time.monotonic()
        lease = store.claim(f"{prefix}-{i}", ttl=ttl, owner_id=f"owner-{i}")
        assert lease is not None
        held.append(HeldLease(store, lease, sent_at=sent))
    return held


def test_renew_due_renews_100_leases_in_one_round_trip(lease_redis: RedisServer) -> None:
    store = RedisLeaseStore(lease_redis.url(0))
    client = redis.Redis.from_url(lease_redis.url(0))
    held: list[HeldLease] = []
    try:
        held = _claim_many(store, 100, ttl=30, prefix="unit")
        before = {h.key: h.lease.expires_at for h in held}
        # The store's clock must move for the new expiry to be visibly later.
        newest = max(h.lease.acquired_at for h in held)
        wait_for(lambda: store.time() > newest + 0.01, 5, "store time")

        # Load the RENEW script into the server's cache first (the very first
        # call of a script is an EVALSHA answered NOSCRIPT, then an EVAL).
        assert store.renew_many([held[0].lease])[0] is not None

        calls = evalsha_calls(client)
        Renewer().renew_due(held)
        evalsha = evalsha_calls(client) - calls

        print(f"renew_due of 100 leases: {evalsha} EVALSHA")
        assert evalsha == 1, f"{evalsha} script calls to renew 100 leases"
        assert all(h.renewals == 1 and h.held for h in held)
        for h in held:
            after = store.inspect(h.key)
            assert after is not None and after.owner_id == h.owner_id
            assert after.expires_at > before[h.key]
            assert h.expires_at == pytest.approx(after.expires_at)
    finally:
        for h in held:
            h.release()
        store.close()
        client.close()


def test_a_renewal_answer_arriving_after_release_moves_nothing(lease_redis: RedisServer) -> None:
    """Invariant 10, local view: the renewer applies a renewal's answer after the
    store call returns; if the lease was released meanwhile, the answer (yes or
    no) changes neither ``held`` nor the expiry, and runs no lost callback."""
    store = RedisLeaseStore(lease_redis.url(0))
    lost: list[str] = []
    try:
        for answer_kind in ("renewed", "refused"):
            lease = store.claim(f"late-{answer_kind}", ttl=30, owner_id="owner-late")
            assert lease is not None
            held = HeldLease(store, lease, on_lost=lambda h, reason: lost.append(reason))
            valid_until = held.valid_until
            since = lease.acquired_at + 0.01
            wait_for(lambda t=since: store.time() > t, 5, "store time")
            sent = time.monotonic()
            # The renewal the renewer sent, answered before the release...
            [answer] = store.renew_many([lease], ttl=60)
            assert answer is not None and answer > lease.expires_at
            assert held.release() is True
            # ...and applied after it (a "refused" answer: what the store says now).
            if answer_kind == "refused":
                [answer] = store.renew_many([lease], ttl=60)
                assert answer is None
            held.renewed(sent, answer)
            assert not held.held
            assert (held.expires_at, held.valid_until, held.renewals) == (
                lease.expires_at,
                valid_until,
                0,
            ), f"the {answer_kind} answer moved the released lease's local view"
            assert held.lost_reason is None and lost == []
    finally:
        store.close()


def test_renewer_thread_batches_leases_claimed_at_different_times(lease_redis: RedisServer) -> None:
    """100 leases claimed spread over a whole renewal interval end up on one schedule."""
    ttl, interval = 1.5, 0.5
    store = RedisLeaseStore(lease_redis.url(0))
    client = redis.Redis.from_url(lease_redis.url(0))
    proc = renewer()
    held: list[HeldLease] = []
    try:
        for i in range(100):
            sent = time.monotonic()
            lease = store.claim(f"spread-{i}", ttl=ttl, owner_id=f"owner-{i}")
            assert lease is not None
            h = HeldLease(store, lease, sent_at=sent)
            held.append(h)
            proc.add(h)
            # claims spread over one interval: a renewer that renews each lease
            # exactly when due would need a round trip per lease per cycle
            target = sent + interval / 100
            wait_until(target, "next claim slot")

        # Let the schedules settle (two cycles), then measure over six.
        settle = time.monotonic() + 2 * interval
        wait_until(settle, "settling")
        calls, cycles, t0 = evalsha_calls(client), proc.cycles, time.monotonic()
        end = t0 + 6 * interval
        wait_until(end, "measurement window")
        evalsha, window = evalsha_calls(client) - calls, time.monotonic() - t0
        renewal_cycles = window / interval
        per_cycle = evalsha / renewal_cycles
        print(
            f"renewer thread, 100 staggered leases: {evalsha} EVALSHA in {window:.2f}s "
            f"= {per_cycle:.2f} per renewal cycle ({proc.cycles - cycles} renewer wake-ups)"
        )
        assert all(h.held for h in held), [h for h in held if not h.held][:3]
        assert per_cycle < 3, f"{per_cycle:.1f} round trips per cycle for 100 leases"
        assert evalsha >= 4, "the leases were not renewed during the window"
    finally:
        for h in held:
            h.release()
        store.close()
        client.close()


# --------------------------------------------------------------------------
# a real worker keeps its lease for 10x the TTL
# --------------------------------------------------------------------------


def test_task_keeps_its_lease_for_ten_ttls(
    lease_redis: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    from tests.apps.leaseapp import build

    ttl, body = 1.0, 10.0
    env = _worker_env(tmp_path, redis_url, lease_redis.url(0), ttl)
    log = tmp_path / "exec.log"
    app, tasks = build(env)
    store = RedisLeaseStore(lease_redis.url(0))
    a = Worker("renew-a", env, tmp_path, extra_args=("-Q", "a"))
    b = Worker("renew-b", env, tmp_path, extra_args=("-Q", "b"))
    try:
        a.start()
        b.start()
        key = f"payment-security-{time.monotonic_ns()}"
        first = tasks.work.apply_async((key,), {"sleep": body, "tag": "first"}, queue="a")
        rows = wait_log(
            log, lambda rs: any(r["event"] == "start" and r["task_id"] == first.id for r in rs), 30,
            "the first task's start",
        )  # fmt: skip
        token1 = next(r["token"] for r in rows if r["task_id"] == first.id)
        second = tasks.work.apply_async((key,), {"tag": "second"}, queue="b")

        # Sample the store while the first task runs: it stays the live holder,
        # long after its TTL would have run out without renewals.
        samples: list[tuple[float, Any]] = []

        def first_ended() -> bool:
            record = store.inspect(key)
            samples.append((time.monotonic(), record))
            return any(r["event"] == "end" and r["task_id"] == first.id for r in read_log(log))

        wait_for(first_ended, body + 20, "the first task's end", interval=0.2, max_interval=0.2)
        span = samples[-1][0] - samples[0][0]
        assert span >= 0.8 * body - 1, f"sampled only {span:.1f}s"
        holders = [r for _, r in samples[:-1]]
        assert holders and all(
            r is not None and r.live and r.task_id == first.id and r.token == token1
            for r in holders
        ), [r for r in holders if r is None or r.task_id != first.id or not r.live][:3]

        # The first is accepted with its own token (not FENCED, not LEASE_LOST).
        assert first.get(timeout=30)["token"] == token1
        assert first.state == "SUCCESS"
        # The second ran only afterwards, with a larger token.
        assert second.get(timeout=60)["token"] > token1
        rows = read_log(log)
        ev = {(r["event"], r["task_id"]): r for r in rows}
        end1, start2 = ev[("end", first.id)], ev[("start", second.id)]
        assert end1["held"] is True, "the first task's lease was not held at the end of its body"
        assert start2["t"] >= end1["t"], "the second submission ran while the first held the key"
        assert start2["token"] > end1["token"]
        starts = [r for r in rows if r["event"] == "start"]
        assert [r["task_id"] for r in starts] == [first.id, second.id]
        # It was deferred throughout: many times, by worker B, from the start.
        deferrals = b.log_text().count(f"LEASE_DEFERRED {second.id}")
        print(f"second submission deferred {deferrals} times over {body}s (TTL {ttl}s)")
        assert deferrals >= 4, b.log_text()[-3000:]
        assert "LEASE_LOST" not in a.log_text() and "FENCED" not in a.log_text()
        # Both results are in the fenced table, each with its own token, in order.
        from celery_lease.task import runtime

        history = runtime(app).results.history(key)
        assert sorted((r.token, r.task_id) for r in history) == [
            (token1, first.id),
            (start2["token"], second.id),
        ]
        accepted = tasks.work.accepted(key)
        assert accepted is not None and accepted.task_id == second.id
    finally:
        a.kill()
        b.kill()
        store.close()
        app.close()


# --------------------------------------------------------------------------
# a threads-pool worker holding 100 leases renews them in one round trip
# --------------------------------------------------------------------------


def test_threads_worker_renews_100_leases_in_one_round_trip_per_cycle(
    lease_redis: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    from tests.apps.leaseapp import build

    n, ttl, body = 100, 1.5, 7.0
    interval = ttl / 3
    env = _worker_env(tmp_path, redis_url, lease_redis.url(0), ttl)
    log = tmp_path / "exec.log"
    app, tasks = build(env)
    client = redis.Redis.from_url(lease_redis.url(0))
    worker = Worker("threads", env, tmp_path, concurrency=n, pool="threads")
    try:
        worker.start()
        results = [tasks.work.delay(f"batch-{i}", sleep=body) for i in range(n)]

        def all_started() -> list[dict[str, Any]] | None:
            starts = [r for r in read_log(log) if r["event"] == "start"]
            return starts if len(starts) == n else None

        starts = wait_for(all_started, 60, f"{n} tasks running at once")
        last_start = max(r["t"] for r in starts)
        first_end = min(r["t"] for r in starts) + body
        assert not any(r["event"] == "end" for r in read_log(log)), "a task ended too early"

        # Measure from just after the last claim to just before the first end.
        begin_at = time.time() + 0.2
        wait_until(begin_at, "window start", clock=time.time)
        calls, t0 = evalsha_calls(client), time.time()
        end_at = first_end - 0.3
        assert end_at - t0 >= 3 * interval, (
            f"window too short ({end_at - t0:.2f}s): starts spread over "
            f"{last_start - min(r['t'] for r in starts):.2f}s"
        )
        wait_until(end_at, "window end", clock=time.time)
        evalsha, window = evalsha_calls(client) - calls, time.time() - t0
        assert not any(r["event"] == "end" for r in read_log(log)), "window overlapped a commit"

        cycles = window / interval
        per_cycle = evalsha / cycles
        print(
            f"threads worker, {n} leases held: {evalsha} EVALSHA in {window:.2f}s "
            f"= {per_cycle:.2f} round trips per renewal cycle (cycle {interval:.2f}s, "
            f"~{cycles:.1f} cycles)"
        )
        assert evalsha >= 1, "no renewals in the window"
        assert per_cycle < 3, f"{per_cycle:.1f} round trips per cycle for {n} leases"

        # And every lease was kept: all results accepted, all held to the end.
        for r in results:
            assert r.get(timeout=60)["key"].startswith("batch-")
        ends = [r for r in read_log(log) if r["event"] == "end"]
        dup = {r["task_id"] for r in ends if sum(e["task_id"] == r["task_id"] for e in ends) > 1}
        # On failure: what the worker said about the tasks that ran twice.
        about_dup = [ln for ln in worker.log_text().splitlines() if any(t in ln for t in dup)]
        assert len(ends) == n and all(r["held"] for r in ends), (
            [r for r in ends if r["task_id"] in dup or not r["held"]],
            about_dup[-60:],
        )
        assert "LEASE_LOST" not in worker.log_text()
    finally:
        worker.kill()
        client.close()
        app.close()


_FROZEN_TTL = 1.5


@contextlib.contextmanager
def _backend_frozen(
    lease_redis: RedisServer, make_redis_server: Any, redis_url: str, tmp_path: Path
) -> Iterator[tuple[RedisServer, Any, RedisLeaseStore, Worker, Path]]:
    """A worker (TTL 1.5 s, STARTED tracked) whose result backend, a private
    Redis, is frozen (SIGSTOP, proven) once the worker is up: its STARTED
    write hangs. Yields (backend, tasks, lease store, worker, exec log)."""
    from tests.apps.leaseapp import build

    backend = make_redis_server(appendonly=False)
    env = {
        **_worker_env(tmp_path, redis_url, lease_redis.url(0), _FROZEN_TTL),
        "CL_BACKEND": backend.url(0),
        "CL_TRACK_STARTED": "1",
    }
    # The client publishes without the frozen backend (a Redis backend
    # subscribes to the task's channel when it is sent).
    app, tasks = build({**env, "CL_BACKEND": redis_url})
    store = RedisLeaseStore(lease_redis.url(0))
    worker = Worker("backend-frozen", env, tmp_path)
    try:
        worker.start()
        backend.pause()
        yield backend, tasks, store, worker, tmp_path / "exec.log"
    finally:
        backend.resume()
        lease_redis.resume()
        worker.kill()
        store.close()
        app.close()


def test_lease_is_renewed_from_the_grant_while_the_started_write_hangs(
    lease_redis: RedisServer, make_redis_server: Any, redis_url: str, tmp_path: Path
) -> None:
    """Renewal starts at the grant, not at the body.

    Between the claim and the body a task still reads the result table and
    writes STARTED to the result backend; on a loaded worker that took longer
    than the TTL (a 100-thread pool on SQLite: 1.4 s against a 1.5 s TTL), and
    the lease lapsed before its first renewal. Here the result backend is
    frozen (SIGSTOP) so the STARTED write hangs for 4 TTLs: the lease must stay
    live and renewed all along, and the body run once, with its lease.
    """
    ttl = _FROZEN_TTL
    with _backend_frozen(lease_redis, make_redis_server, redis_url, tmp_path) as run:
        backend, tasks, store, worker, log = run
        probe = redis.Redis.from_url(backend.url(0), socket_timeout=0.5)
        with pytest.raises(redis.exceptions.TimeoutError):
            probe.ping()  # the fault is in place: the backend answers nothing
        probe.close()

        key = f"hang-{time.monotonic_ns()}"
        sent = tasks.work.delay(key, sleep=0.2)
        granted = wait_for(
            lambda: (r := store.inspect(key)) is not None and r.live and r, 30, "the claim"
        )
        assert granted.task_id == sent.id
        hang_until = time.monotonic() + 4 * ttl
        seen = []
        while time.monotonic() < hang_until:
            rec = store.inspect(key)
            assert rec is not None and rec.live, f"the lease lapsed while STARTED hung: {rec}"
            assert rec.token == granted.token and rec.owner_id == granted.owner_id
            seen.append(rec.renewed_at)
            time.sleep(ttl / 6)
        assert not any(r["task_id"] == sent.id for r in read_log(log)), "the body ran"
        renewals = sorted({s for s in seen if s is not None})
        assert len(renewals) >= 3, f"renewed {len(renewals) - 1} times in {4 * ttl} s"

        backend.resume()
        ends = wait_for(
            lambda: [r for r in read_log(log) if r["event"] == "end"] or None, 30, "the body"
        )
        assert [(r["task_id"], r["token"], r["held"]) for r in ends] == [
            (sent.id, granted.token, True)
        ]
        starts = [r for r in read_log(log) if r["event"] == "start"]
        assert len(starts) == 1
        assert "lease lost" not in worker.log_text()


def test_a_lease_that_lapsed_before_the_body_is_requeued_not_run(
    lease_redis: RedisServer, make_redis_server: Any, redis_url: str, tmp_path: Path
) -> None:
    """The body never starts without its lease.

    The STARTED write hangs (result backend frozen) while the lease store is
    frozen too, past the TTL: renewals fail and the lease lapses before the
    body. That execution must not run the body; the task is re-queued, claimed
    again with a newer token, and its body runs once, holding its lease.
    """
    ttl = _FROZEN_TTL
    with _backend_frozen(lease_redis, make_redis_server, redis_url, tmp_path) as run:
        backend, tasks, store, _, log = run
        key = f"lapse-{time.monotonic_ns()}"
        sent = tasks.work.delay(key, sleep=0.2)
        granted = wait_for(
            lambda: (r := store.inspect(key)) is not None and r.live and r, 30, "the claim"
        )
        lease_redis.pause()
        frozen_at = time.monotonic()
        probe = redis.Redis.from_url(lease_redis.url(0), socket_timeout=0.5)
        with pytest.raises(redis.exceptions.TimeoutError):
            probe.ping()  # the store answers nothing: renewals cannot succeed
        wait_for(lambda: time.monotonic() > frozen_at + 3 * ttl, 10, "three TTLs", interval=0.1)
        lease_redis.resume()
        rec = wait_for(lambda: store.inspect(key) or None, 10, "the store back")
        assert rec.token == granted.token and not rec.live, f"the lease did not lapse: {rec}"
        assert not any(r["task_id"] == sent.id for r in read_log(log)), "the body ran"
        probe.close()

        backend.resume()
        ends = wait_for(
            lambda: [r for r in read_log(log) if r["event"] == "end"] or None, 30, "the body"
        )
        starts = [r for r in read_log(log) if r["event"] == "start"]
        assert len(starts) == 1, f"the body ran {len(starts)} times: {starts}"
        assert [(r["task_id"], r["held"]) for r in ends] == [(sent.id, True)]
        assert ends[0]["token"] > granted.token, "the body ran on the lapsed grant"
        accepted = wait_for(lambda: tasks.work.accepted(key), 30, "the accepted result")
        assert (accepted.task_id, accepted.token) == (sent.id, ends[0]["token"])
