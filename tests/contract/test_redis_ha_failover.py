"""Failover under contention on Redis Sentinel and Redis Cluster, with and without WAIT.

Eight client processes (tests/ha_contender.py) contend for four keys and do
what a LeasedTask does with leases in Redis and results in PostgreSQL: claim,
register the token in the key's fence row, work inside the local view of the
lease, commit through the fenced result table. Beside them a real prefork
worker (``-c 2``, tests/apps/leaseapp.py) runs LeasedTasks on the same keys,
published in waves through the run, with its leases on the same deployment
and its results in the same table. Once grants flow, the test
SIGKILLs the master (Sentinel: the one the sentinels name; Cluster: the
master of the first key's slot) and proves the failover happened: a former
replica is master, as the sentinels (or every cluster node) see it.

Redis replicates asynchronously, so a grant the dead master made may never
reach the replica promoted in its place, and the key is granted again while
its first owner still works. Such **overlapping grants** are counted, not
forbidden, and reported; the run is repeated with ``wait_replicas=1``. What
must hold across the failover, from the logs and the result table:

* no token is issued twice for a key; per key, tokens grow in the order the
  grants were used; and every grant the promoted replica made exceeds every
  token the dead master granted (the ``max(counter + 1, TIME)`` floor);
* no stale result is accepted: no commit is accepted after a grant with a
  larger token of the same key was registered, and per key the accepted
  tokens grow in the order they were accepted (the fence row in SQL holds the
  registered token; the ownership check asks the new master);
* every LeasedTask ends either SUCCESS with its own accepted row (the token
its body ran with) or, when its lease was lost to another owner, FAILURE
with StaleFencingToken and no accepted row;
* grants of the dead master's keys resume within a deadline; except with
  ``wait_replicas=1`` on a Cluster of one replica per master: the promoted
  replica has none left to acknowledge, so those grants stay refused (the
  release policy), and the test proves that instead (the LeasedTasks of
  those keys have no accepted row). The figures are printed.

Slow (about 30 s a run): run with ``--slow``.
"""

from __future__ import annotations

import json
import select
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

import celery_lease
from celery_lease import LeaseStore, StaleFencingToken
from celery_lease.results import ResultTable
from tests.acceptance.lease_cluster import Cluster, backend_state
from tests.grant_log import overlaps, read_logs
from tests.redis_ha import SENTINEL_MASTER, ClusterDeployment, SentinelDeployment
from tests.servers import RedisServer, wait_for
from tests.store_fixtures import PYTHON, client_env
from tests.workers import read_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONTENDER = str(Path(__file__).resolve().parents[1] / "ha_contender.py")
CLIENTS = 8
KEYS = 4
TTL = 2.0
#: seconds each client contends; the master is killed once the baseline is in
DURATION = 10.0
#: grants must resume within this many seconds of the kill
RECOVERY_DEADLINE = 15.0
#: seconds between waves of LeasedTasks (one per key), and each body's length
WAVE = 0.5
BODY = 0.2


@dataclass
class Deployment:
    url: str
    options: dict[str, Any]
    #: replicas a promoted master has: Sentinel's other replica; none in a 3 + 3 Cluster
    replicas_after: int
    #: SIGKILL the master of the first key: (old, promoted, the keys that master
    #: served, when it was dead, when the replica was promoted)
    kill: Callable[[list[str]], tuple[RedisServer, RedisServer, list[str], float, float]]
    stop: Callable[[], None]


def _sentinel(tmp_path: Path) -> Deployment:
    d = SentinelDeployment(tmp_path).start()

    def kill(keys: list[str]) -> tuple[RedisServer, RedisServer, list[str], float, float]:
        old = d.kill_master()
        killed = time.monotonic()
        new = d.wait_failover(old)
        assert new in d.nodes[1:] and not old.running, "a former replica is master"
        return old, new, keys, killed, time.monotonic()

    return Deployment(d.url(0), {"master_name": SENTINEL_MASTER}, 1, kill, d.stop)


def _cluster(tmp_path: Path) -> Deployment:
    d = ClusterDeployment(tmp_path).start()

    def kill(keys: list[str]) -> tuple[RedisServer, RedisServer, list[str], float, float]:
        # "{key}": the slot of the key's lease and fence names
        served = [k for k in keys if d.master_of("{" + k + "}") is d.master_of("{" + keys[0] + "}")]
        old, replicas = d.kill_master("{" + keys[0] + "}")
        killed = time.monotonic()
        new = d.wait_failover(old, replicas)
        assert new.port in replicas and old.port not in d.masters(), "its replica is master"
        return old, new, served, killed, time.monotonic()

    return Deployment(d.url(), {}, 0, kill, d.stop)


@pytest.fixture(params=["sentinel", "cluster"])
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    made = (_sentinel if request.param == "sentinel" else _cluster)(tmp_path)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture(scope="module")
def pg_results(pg_url: str) -> str:
    celery_lease.migrate(pg_url)
    return pg_url


def _start(d: Deployment, results: str, keys: list[str], logs: list[Path], wait: int) -> list[Any]:
    options = dict(d.options)
    if wait:
        options.update(wait_replicas=wait, wait_timeout_ms=200)
    procs = []
    for i, log in enumerate(logs):
        argv = [PYTHON, CONTENDER, d.url, str(log), "--results", results]
        argv += ["--keys", ",".join(keys), "--ttl", str(TTL), "--duration", str(DURATION)]
        argv += ["--index", str(i), "--options", json.dumps(options)]
        procs.append(
            subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=client_env(), text=True
            )
        )
    deadline = time.monotonic() + 30
    for p in procs:
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready and p.stdout.readline().strip() == "ready", "a contender did not start"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def token_faults(
    grants: list[dict[str, Any]], served: list[str], killed: float, promoted: float
) -> tuple[int, int]:
    """(tokens issued twice for a key, tokens out of order): per key, in the order
    the grants were used, a token below an earlier one's; and a grant of a key of
    the dead master claimed after the promotion whose token is not above every
    token that master granted before the kill."""
    reused = decreasing = 0
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for g in grants:
        by_key[g["key"]].append(g)
    for key, rows in by_key.items():
        tokens = [g["token"] for g in rows]
        reused += len(tokens) - len(set(tokens))
        rows.sort(key=lambda g: g["enter"])
        highest = 0
        for g in rows:
            decreasing += g["token"] < highest
            highest = max(highest, g["token"])
        if key in served:
            old = max((g["token"] for g in rows if g["granted"] < killed), default=0)
            decreasing += sum(g["token"] <= old for g in rows if g["sent"] > promoted)
    return reused, decreasing


def stale_accepted(grants: list[dict[str, Any]], table: ResultTable, keys: list[str]) -> int:
    """Accepted commits that a larger token's registration preceded, plus accepted
    results whose tokens do not grow in the order they were accepted."""
    stale = 0
    for g in grants:
        if g["outcome"] != "accepted":
            continue
        key, token, started = g["key"], g["token"], g["commit_started"]
        stale += any(
            o["key"] == key and o["token"] > token and o["registered"] < started for o in grants
        )
    for key in keys:
        history = sorted(table.history(key, limit=100_000), key=lambda r: r.accepted_at)
        tokens = [r.token for r in history]
        stale += sum(1 for a, b in pairwise(tokens) if b <= a)
    return stale


class LeasedTasks:
    """A real prefork worker running leaseapp's ``work`` task with its leases on
    the deployment, and a thread publishing one task per key every WAVE seconds."""

    def __init__(self, cluster: Cluster, keys: list[str]) -> None:
        self.c = cluster
        self.keys = keys
        self.worker = cluster.worker("leased", concurrency=2)
        self.sent: list[Any] = []  # (key, AsyncResult)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish, daemon=True)
        # CLOCK_MONOTONIC is one clock for every process of the machine; the
        # execution log has wall-clock times.
        self.offset = time.time() - time.monotonic()

    def start(self) -> None:
        self.c.start(self.worker)
        self._thread.start()

    def _publish(self) -> None:
        wave = 0
        while not self._stop.wait(WAVE):
            for key in self.keys:
                result = self.c.tasks.work.apply_async((key,), {"sleep": BODY, "tag": str(wave)})
                self.sent.append((key, result))
            wave += 1

    def stop_publishing(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def grants(self) -> list[dict[str, Any]]:
        """Each body run as a grant record in the contenders' form (monotonic times).

        The claim and registration happened before the body's start record, so
        ``sent``, ``granted`` and ``registered`` are that start: later than the
        truth, which only makes the stale-result check more lenient toward the
        worker's rivals, never toward the worker's own commits (``commit_started``
        is the body's end, before the commit)."""
        rows = read_log(self.c.exec_log)
        ends = {(r["task_id"], r["token"]): r for r in rows if r["event"] == "end"}
        out = []
        for r in rows:
            end = ends.get((r["task_id"], r["token"])) if r["event"] == "start" else None
            if end is None:
                continue
            accepted = self.c.table.for_task(r["task_id"])
            ok = accepted is not None and accepted.token == r["token"]
            start, leave = r["t"] - self.offset, end["t"] - self.offset
            out.append(
                {
                    "key": r["key"], "token": r["token"], "owner": f"task:{r['task_id']}",
                    "sent": start, "granted": start, "registered": start, "enter": start,
                    "leave": leave, "commit_started": leave,
                    "outcome": "accepted" if ok else "fenced", "task_id": r["task_id"],
                },
            )  # fmt: skip
        return out

    def outcomes(self, stranded: list[str], killed: float, timeout: float) -> dict[str, int]:
        """Wait for every task not on a stranded key: SUCCESS with its accepted row,
        or FAILURE(StaleFencingToken) with none. A task of a stranded key has no
        accepted row, or one accepted before the kill (``killed``, monotonic)."""
        counts = {"succeeded": 0, "fenced": 0, "stranded": 0}
        deadline = time.monotonic() + timeout
        for key, result in self.sent:
            if key in stranded:
                accepted = self.c.table.for_task(result.id)
                if accepted is None:
                    counts["stranded"] += 1
                else:
                    assert accepted.accepted_at < killed + self.offset, "unreplicated grant"
                    counts["succeeded"] += 1
                continue
            try:
                value = result.get(timeout=max(1.0, deadline - time.monotonic()))
            except StaleFencingToken:
                assert self.c.table.for_task(result.id) is None, "a fenced copy has a result"
                assert backend_state(self.c, result.id)[0] == "FAILURE"
                counts["fenced"] += 1
                continue
            accepted = self.c.table.for_task(result.id)
            assert accepted is not None and accepted.token == value["token"], (result.id, value)
            counts["succeeded"] += 1
        return counts


@dataclass
class Run:
    rows: list[dict[str, Any]]  # every contender's log lines
    old: RedisServer
    new: RedisServer
    served: list[str]  # the dead master's keys
    started: float
    killed: float
    promoted: float

    @property
    def grants(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if "enter" in r]


def _contend(
    d: Deployment, results: str, keys: list[str], tmp_path: Path, wait: int, tasks: LeasedTasks
) -> Run:
    """Start the worker and the contenders, SIGKILL the master once 40 grants are
    in, let them finish."""
    logs = [tmp_path / f"contender-{i}.log" for i in range(CLIENTS)]
    tasks.start()
    procs = _start(d, results, keys, logs, wait)
    try:
        started = time.monotonic()
        grants_in = lambda: sum("enter" in r for r in read_logs(logs)) >= 40  # noqa: E731
        wait_for(grants_in, 15, "40 grants before the kill")
        old, new, served, killed, promoted = d.kill(keys)
        for p in procs:
            p.wait(DURATION + 60)
            assert p.returncode == 0, f"a contender failed ({p.returncode})"
    finally:
        tasks.stop_publishing()
        for p in procs:
            if p.poll() is None:
                p.kill()
    return Run(read_logs(logs), old, new, served, started, killed, promoted)


@pytest.fixture
def make_tasks(
    make_redis_server: Callable[..., RedisServer], tmp_path: Path, pg_results: str
) -> Iterator[Callable[[Deployment, list[str], int], LeasedTasks]]:
    made: list[Cluster] = []

    def make(d: Deployment, keys: list[str], wait: int) -> LeasedTasks:
        broker = make_redis_server(appendonly=False)
        options = dict(d.options)
        if wait:
            options.update(wait_replicas=wait, wait_timeout_ms=200)
        cluster = Cluster(
            tmp_path,
            broker=broker.url(0),
            backend=broker.url(1),
            store_url=d.url,
            results_url=pg_results,
            ttl=TTL,
            store_options=options,
            # A claim the store cannot grant (no replica left to acknowledge it)
            # is retried in the pool slot for this long before it defers: kept
            # short so those tasks do not starve the other keys' tasks.
            settings={"lease_store_retry": 0.5},
        )
        made.append(cluster)
        return LeasedTasks(cluster, keys)

    yield make
    for cluster in made:
        cluster.close()


@pytest.mark.parametrize("wait", [0, 1], ids=["no-wait", "wait_replicas=1"])
def test_master_sigkill_while_eight_processes_and_a_worker_contend(
    deployment: Deployment,
    pg_results: str,
    tmp_path: Path,
    wait: int,
    make_tasks: Callable[[Deployment, list[str], int], LeasedTasks],
) -> None:
    keys = [f"failover-{i}-{uuid.uuid4().hex[:8]}" for i in range(KEYS)]
    tasks = make_tasks(deployment, keys, wait)
    run = _contend(deployment, pg_results, keys, tmp_path, wait, tasks)
    killed = run.killed
    assert len([r for r in run.rows if r.get("summary")]) == CLIENTS
    stranded = run.served if wait > deployment.replicas_after else []
    task_counts = tasks.outcomes(stranded, killed, timeout=90)
    assert task_counts["succeeded"] > 0, task_counts
    worker_grants = tasks.grants()
    grants = run.grants + worker_grants
    store = LeaseStore.from_url(deployment.url, **deployment.options)
    try:
        reused, decreasing = token_faults(grants, run.served, killed, run.promoted)
        stale = stale_accepted(grants, ResultTable(pg_results, store), keys)
    finally:
        store.close()

    assert reused == 0 and decreasing == 0, f"tokens: {reused} reused, {decreasing} decreasing"
    assert stale == 0, f"{stale} stale results accepted"
    assert [g for g in grants if g["sent"] < killed], "no grants before the kill"
    # Grants of the dead master's keys claimed after the kill: the promoted replica's.
    after = [g for g in run.grants if g["sent"] > killed and g["key"] in run.served]
    refused = sum("replicas within" in r.get("error", "") for r in run.rows)
    recovery: float | None = None
    worker_after = [g for g in worker_grants if g["sent"] > killed and g["key"] in run.served]
    worker_recovery: float | None = None
    if stranded:
        # No replica is left to acknowledge a grant of those keys: they stay refused
        # (on_unreplicated="release") until a replica rejoins.
        assert not after and refused > 0, f"{len(after)} unreplicated grants, {refused} refused"
        assert not worker_after, f"{len(worker_after)} unreplicated grants used by LeasedTasks"
    else:
        assert after, "no grants of the dead master's keys after the failover"
        recovery = min(g["registered"] for g in after) - killed
        assert recovery < RECOVERY_DEADLINE
        assert worker_after, "no LeasedTask of the dead master's keys ran after the failover"
        worker_recovery = min(g["registered"] for g in worker_after) - killed
    print(_figures(deployment, wait, run, len(after), recovery, (reused, decreasing, stale)))
    resumed = "never" if worker_recovery is None else f"+{worker_recovery:.3f}s"
    print(
        f"  LeasedTasks: {len(tasks.sent)} published, {task_counts}; body runs: "
        f"{len(worker_grants)}; first run of the dead master's keys after the kill: "
        f"{resumed}; overlaps involving a task: "
        f"{sum('task_id' in a or 'task_id' in b for a, b in overlaps(grants))}"
    )


def _figures(
    d: Deployment,
    wait: int,
    run: Run,
    after: int,
    recovery: float | None,
    faults: tuple[int, int, int],
) -> str:
    summaries = [r for r in run.rows if r.get("summary")]
    grants = run.grants  # the contenders'
    refused = sum("replicas within" in r.get("error", "") for r in run.rows)
    resumed = "never (no replica left)" if recovery is None else f"+{recovery:.3f}s"
    outcomes = {o: sum(g["outcome"] == o for g in grants) for o in ("accepted", "fenced", "error")}
    return (
        f"\n{d.url.split(':', 1)[0]} failover, wait_replicas={wait}: {CLIENTS} clients x "
        f"{KEYS} keys, TTL {TTL}s, run {DURATION}s\n"
        f"  killed master :{run.old.port} at +{run.killed - run.started:.2f}s; :{run.new.port} "
        f"promoted after {run.promoted - run.killed:.2f}s; first grant of its "
        f"{len(run.served)} key(s) claimed after the kill: {resumed}\n"
        f"  grants: {len(grants)} ({after} of its keys after the kill); overlapping grants: "
        f"{len(overlaps(grants))}; reused tokens: {faults[0]}; decreasing tokens: {faults[1]}\n"
        f"  commits: {outcomes}; stale results accepted: {faults[2]}; store errors seen: "
        f"{sum(x['errors'] for x in summaries)} ({refused} unreplicated grants refused); late "
        f"grants: {sum(x['late'] for x in summaries)}"
    )
