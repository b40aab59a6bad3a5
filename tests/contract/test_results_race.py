"""Eight real processes race for one key; an independent log judges the table.

Each process (``multiprocessing`` spawn, so nothing is shared but the
servers) loops: claim the key with a short TTL, register the token, "work"
(three of the eight sometimes pause past the TTL on purpose), commit. Every
grant and every commit attempt is appended to the process's own log file and
fsync'd before the next step, with ``time.time()`` stamps: all processes run
on this machine, so the stamps are on one clock.

The checker reads those logs, not only the table, and asserts:

* every row in the table is a commit its process logged as accepted, with
  the token that process was granted, and vice versa;
* **no stale token accepted / newest at its commit**: for an accepted token
  ``t``, no grant of a token ``t' > t`` had *completed* (``claim_end``) before
  the accepted commit *started* (``commit_start``). That is the strongest
  claim the design makes: the commit checks ownership after it starts, while
  holding the lock every newer owner's registration (or claim) needs, and a
  commit that releases the lease lets the next claim in before its own
  transaction ends, so a newer grant may legitimately complete before the
  accepted commit *ends*;
* leases and results in one database: no newer token was granted, in store
  time, before the accepted commit's own store timestamp (taken in its
  transaction, before the ownership check that locks the lease row);
* an accepted commit started before its lease expired (in store time; the
  stores' clocks are this machine's clock too);
* tokens only grow with grant time, and the table's tokens strictly increase
  in commit (row id) order;
* ``once`` mode: exactly one row. Both modes: the race really happened (some
  commits were refused as stale, some grants followed a lapsed lease).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import random
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from celery_lease import DuplicateResult, LeaseStore, StaleFencingToken
from celery_lease.results import MODES, ResultTable
from celery_lease.sql import database
from tests.results_helpers import Pairing, make_pairing, new_key, wait_for

PROCESSES = 8
PAUSERS = 3  # processes 0..2 sometimes pause past the TTL before committing
TTL = 0.5
DURATION = 3.0
#: After DURATION, racers go on (up to this long) until every pauser has been
#: overtaken once: on a slow machine a pauser may win no grant in DURATION.
OVERTIME = 20.0
#: Clock-reading resolution between time.time() and the stores' clocks
#: (SQLite's julianday('now') has millisecond resolution).
EPS = 0.005

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------
# the worker process
# --------------------------------------------------------------------------


def _log(fh: Any, **record: Any) -> None:
    fh.write(json.dumps(record) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def _wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout}s")
        time.sleep(0.002)


def race_worker(cfg: dict[str, Any]) -> int:
    """One racer, run in a warm pool process; returns its pid."""
    index = cfg["index"]
    owner = f"racer-{index}-{os.getpid()}"
    rng = random.Random(cfg["seed"] + index)
    store = LeaseStore.from_url(cfg["store_url"])
    table = ResultTable(cfg["result_url"], store)
    key, mode, ttl = cfg["key"], cfg["mode"], cfg["ttl"]
    pauses = 0
    with open(cfg["log"], "a", encoding="utf-8") as fh:
        store.time()  # connect before the start line
        table.fence(key)
        Path(cfg["log"] + ".ready").touch()
        _wait_for_file(Path(cfg["go"]), 60)
        end = time.time() + cfg["duration"]
        overtaken = [Path(f"{log}.overtaken") for log in cfg["pauser_logs"]]

        def racing() -> bool:
            now = time.time()
            return now < end or (now < end + OVERTIME and not all(p.exists() for p in overtaken))

        while racing():
            claim_start = time.time()
            lease = store.claim(key, ttl=ttl, owner_id=owner)
            claim_end = time.time()
            if lease is None:
                time.sleep(rng.uniform(0.005, 0.03))  # backoff with jitter, not synchronisation
                continue
            _log(
                fh,
                ev="grant",
                owner=owner,
                token=lease.token,
                claim_start=claim_start,
                claim_end=claim_end,
                acquired_at=lease.acquired_at,
                expires_at=lease.expires_at,
            )
            try:
                table.register(lease)
            except StaleFencingToken:
                _log(
                    fh,
                    ev="commit",
                    owner=owner,
                    token=lease.token,
                    outcome="register_refused",
                    commit_start=time.time(),
                    commit_end=time.time(),
                    paused=False,
                )
                continue
            # Pausers always pause on their first grant, then now and then.
            paused = index < PAUSERS and (pauses == 0 or rng.random() < 0.3)
            pauses += paused
            time.sleep(ttl + 0.25 if paused else rng.uniform(0.0, ttl / 5))
            commit_start = time.time()
            accepted_at = None
            try:
                accepted = table.commit(
                    lease, {"owner": owner, "token": lease.token}, mode=mode, task_id=owner
                )
                outcome = "accepted"
                accepted_at = accepted.accepted_at
            except StaleFencingToken:
                outcome = "stale"
                if paused:
                    Path(cfg["log"] + ".overtaken").touch()
            except DuplicateResult:
                outcome = "duplicate"
            except Exception:  # noqa: BLE001 - logged, and the checker fails on it
                outcome = "error: " + traceback.format_exc()
            _log(
                fh,
                ev="commit",
                owner=owner,
                token=lease.token,
                outcome=outcome,
                commit_start=commit_start,
                commit_end=time.time(),
                accepted_at=accepted_at,
                paused=paused,
            )
    store.close()
    return os.getpid()


# --------------------------------------------------------------------------
# the checker
# --------------------------------------------------------------------------


def read_logs(paths: list[Path]) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    grants: dict[int, dict[str, Any]] = {}
    commits: dict[int, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            target = grants if rec["ev"] == "grant" else commits
            assert rec["token"] not in target, f"token {rec['token']} logged twice: {rec}"
            target[rec["token"]] = rec
    return grants, commits


def table_rows(url: str, key: str) -> list[dict[str, Any]]:
    with database(url).single() as conn:
        rows = conn.execute(
            text(
                "SELECT id, fencing_token, owner_id, accepted_at FROM celery_lease_results "
                "WHERE lease_key = :key ORDER BY id"
            ),
            {"key": key},
        ).all()
    return [
        {"id": r[0], "token": int(r[1]), "owner": r[2], "accepted_at": float(r[3])} for r in rows
    ]


def check(
    grants: dict[int, dict[str, Any]],
    commits: dict[int, dict[str, Any]],
    rows: list[dict[str, Any]],
    mode: str,
    colocated: bool,
) -> dict[str, int]:
    errors = [c for c in commits.values() if c["outcome"].startswith("error")]
    assert not errors, errors[0]["outcome"]
    for token, c in commits.items():
        assert token in grants and grants[token]["owner"] == c["owner"], c

    # Tokens only grow with grant time (store time).
    by_token = sorted(grants.values(), key=lambda g: g["token"])
    acquired = [g["acquired_at"] for g in by_token]
    assert acquired == sorted(acquired), "a larger token was granted earlier"

    # The table is exactly what the processes logged as accepted.
    accepted = {t: c for t, c in commits.items() if c["outcome"] == "accepted"}
    assert {(r["token"], r["owner"]) for r in rows} == {
        (t, c["owner"]) for t, c in accepted.items()
    }
    assert len(rows) == len(accepted)

    # Commit order: row ids are assigned under the key's lock, so id order is
    # commit order; tokens strictly increase in it, and so does the DB clock.
    tokens = [r["token"] for r in rows]
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    stamps = [r["accepted_at"] for r in rows]
    assert stamps == sorted(stamps), stamps

    for t, c in accepted.items():
        g = grants[t]
        # Newest at its commit: no larger grant had completed before the commit started.
        newer = [n for n in by_token if n["token"] > t and n["claim_end"] < c["commit_start"]]
        assert not newer, (
            f"token {t} (commit started {c['commit_start']:.6f}) accepted although token "
            f"{newer[0]['token']} was granted by {newer[0]['claim_end']:.6f}"
        )
        if colocated:
            # Same database: the commit decides at accepted_at (store time, before its
            # ownership check) and every newer grant is at or after that moment.
            early = [n for n in by_token if n["token"] > t and n["acquired_at"] < c["accepted_at"]]
            assert not early, (t, c["accepted_at"], early[0])
        # Held at its commit: the commit started before the lease expired.
        assert c["commit_start"] < g["expires_at"] + EPS, (t, c, g)
        assert not c["paused"], f"a commit paused past its TTL was accepted: {c}"

    if mode == "once":
        assert len(rows) == 1, rows
    else:
        assert len(rows) >= 2, rows
    outcomes = [c["outcome"] for c in commits.values()]
    assert outcomes.count("stale") >= 1, "no commit was refused: the race did not happen"
    # The canonical overlap happened: an owner paused, a newer owner was granted
    # the key, and the old owner's commit came afterwards (and was refused).
    takeovers = [
        c
        for t, c in commits.items()
        if c["paused"]
        and any(n["token"] > t and n["claim_end"] < c["commit_start"] for n in by_token)
    ]
    assert takeovers, "no paused owner was overtaken: the race did not happen"
    assert all(c["outcome"] == "stale" for c in takeovers), takeovers
    if mode == "once":
        assert outcomes.count("duplicate") >= 1
    return {o: outcomes.count(o) for o in set(outcomes)}


# --------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    """Eight warm spawned processes, reused by every race (spawning costs seconds)."""
    with mp.get_context("spawn").Pool(PROCESSES, maxtasksperchild=None) as p:
        yield p


@pytest.fixture(params=["redis+pg", "sqlite+sqlite", "pg+pg", "redis+sqlite", "sqlite+pg"])
def pairing(request: pytest.FixtureRequest) -> Iterator[Pairing]:
    p = make_pairing(request, request.param)
    yield p
    p.close()


@pytest.mark.parametrize("mode", MODES)
def test_eight_processes_race_for_one_key(
    pairing: Pairing, mode: str, tmp_path: Path, pool: Any
) -> None:
    key = new_key("race")
    logs = [tmp_path / f"racer-{i}.jsonl" for i in range(PROCESSES)]
    go = tmp_path / "go"
    seed = random.randrange(1 << 30)
    jobs = [
        pool.apply_async(
            race_worker,
            (
                {
                    "index": i,
                    "seed": seed,
                    "store_url": pairing.store_url,
                    "result_url": pairing.result_url,
                    "key": key,
                    "mode": mode,
                    "ttl": TTL,
                    "duration": DURATION,
                    "log": str(logs[i]),
                    "go": str(go),
                    "pauser_logs": [str(log) for log in logs[:PAUSERS]],
                },
            ),
        )
        for i in range(PROCESSES)
    ]
    # Every racer connected and is at the start line (8 at once: one per process).
    wait_for(
        lambda: (
            all(Path(f"{log}.ready").exists() for log in logs)
            or any(j.ready() and not j.successful() for j in jobs)
        ),
        60,
        "all racers ready",
    )
    go.touch()
    pids = {j.get(DURATION + OVERTIME + 60) for j in jobs}
    assert len(pids) == PROCESSES, f"the racers did not run in {PROCESSES} processes: {pids}"

    grants, commits = read_logs(logs)
    rows = table_rows(pairing.result_url, key)
    counts = check(grants, commits, rows, mode, pairing.table.colocated)
    print(f"seed={seed} grants={len(grants)} outcomes={counts} rows={len(rows)}")


def _history(a_commit_start: float) -> tuple[Any, Any, Any]:
    """A (token 1) commits at ``a_commit_start``; its lease ends at 10.5, B is
    granted token 2 at 10.6 and commits at 13.0; C (token 3) pauses past its
    lease, D takes over (token 4) and C's late commit is refused."""
    spec = [
        # token, owner, granted, expires, commit_start, outcome, paused
        (1, "A", 0.0, 10.5, a_commit_start, "accepted", False),
        (2, "B", 10.6, 20.6, 13.0, "accepted", False),
        (3, "C", 30.0, 31.0, 32.0, "stale", True),
        (4, "D", 31.1, 41.1, 33.0, "accepted", False),
    ]
    grants, commits = {}, {}
    for token, owner, granted, expires, start, outcome, paused in spec:
        grants[token] = {
            "token": token,
            "owner": owner,
            "claim_start": granted - 0.01,
            "claim_end": granted + 0.01,
            "acquired_at": granted,
            "expires_at": expires,
        }
        commits[token] = {
            "token": token,
            "owner": owner,
            "outcome": outcome,
            "commit_start": start,
            "commit_end": start + 0.01,
            "accepted_at": start + 0.005 if outcome == "accepted" else None,
            "paused": paused,
        }
    accepted = sorted(
        (c for c in commits.values() if c["outcome"] == "accepted"),
        key=lambda c: c["commit_start"],
    )
    rows = [
        {"id": i, "token": c["token"], "owner": c["owner"], "accepted_at": c["accepted_at"]}
        for i, c in enumerate(accepted)
    ]
    return grants, commits, rows


def test_the_checker_accepts_a_clean_history_and_catches_a_stale_acceptance() -> None:
    """The checker is only worth its assertions: a clean history passes, and the
    canonical violation (A resumes after B's grant and is accepted) is caught."""
    for colocated in (False, True):
        assert check(*_history(5.0), "exclusive", colocated)["accepted"] == 3
        with pytest.raises(AssertionError, match="accepted although"):
            check(*_history(12.0), "exclusive", colocated)
