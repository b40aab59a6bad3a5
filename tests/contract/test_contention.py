"""Many real processes fight over ONE key; an independent detector checks exclusion.

For each store, 12 client processes (``tests/lease_client.py contend``) claim
the same key in a loop with a short TTL, work inside each grant for less than
the TTL, and release it (or now and then abandon it, so it has to expire).

The detector does not trust the store:

* an ``inside`` counter on a separate Redis key: INCR on entering a grant,
  DECR on leaving; a holder that sees anything but 1 overlapped someone;
* a log of (token, enter, leave) in CLOCK_MONOTONIC, which is system-wide on
  Linux, so intervals from different processes compare directly.

The checker asserts: no two holding intervals overlap, no grant came before
an abandoned lease's TTL ran out, no token was granted twice, tokens strictly
grow in grant order, and every holder that stayed within its TTL could
release (it really was still the owner).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_lease import LeaseStore
from tests.store_fixtures import CLIENT, PYTHON, STORE_KINDS, client_env, new_key, store_url

pytestmark = pytest.mark.timeout(120)

PROCESSES = 12
DURATION = 10.0  # seconds of contention per store
TTL = 0.6
WORK = (0.02, 0.12)  # seconds of work per grant, well under the TTL
ABANDON = 0.1  # share of grants left to expire instead of released
#: Tolerance between the store's clock and CLOCK_MONOTONIC on this machine
#: (both read the same kernel clock; only the reading points differ).
EPS = 0.01


def contender_argv(url: str, key: str, counter_url: str, counter_key: str, i: int) -> list[str]:
    options = {
        "--ttl": TTL,
        "--counter-url": counter_url,
        "--counter-key": counter_key,
        "--duration": DURATION,
        "--work-min": WORK[0],
        "--work-max": WORK[1],
        "--abandon": ABANDON,
        "--index": i,
    }
    flags = itertools.chain.from_iterable((k, str(v)) for k, v in options.items())
    return [PYTHON, CLIENT, "contend", url, key, *flags]


def run_contenders(url: str, key: str, counter_url: str, counter_key: str) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen(
            contender_argv(url, key, counter_url, counter_key, i),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=client_env(),
            text=True,
        )
        for i in range(PROCESSES)
    ]
    try:
        # Start barrier: every process is connected before anyone claims.
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != '"ready"':
                p.kill()
                _, err = p.communicate()
                pytest.fail(f"contender did not start: {line!r}\n{err}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=DURATION + 60)
            assert p.returncode == 0, f"contender failed ({p.returncode}):\n{err}"
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    grants: list[dict[str, Any]] = []
    summaries = []
    for out in outputs:
        for line in out.splitlines():
            rec = json.loads(line)
            (summaries if "summary" in rec else grants).append(rec)
    assert len(summaries) == PROCESSES
    assert sum(s["errors"] for s in summaries) == 0, summaries
    return grants


def check_exclusion(grants: list[dict[str, Any]]) -> dict[str, int]:
    grants = sorted(grants, key=lambda g: g["enter"])
    tokens = [g["token"] for g in grants]

    # No token granted twice; tokens strictly grow in grant order.
    assert len(set(tokens)) == len(tokens), "a token was granted twice"
    bad_order = [(a, b) for a, b in itertools.pairwise(tokens) if b <= a]
    assert not bad_order, f"tokens not increasing in grant order: {bad_order[:5]}"

    # A holder may only count on its lease until t0 + TTL (t0: before its
    # claim was sent; the store granted later, so its expiry is later still).
    # Clip every interval there: a holder descheduled past its TTL is not
    # the store's fault, and clipping keeps the check sound.
    overran = [g for g in grants if g["leave"] > g["t0"] + TTL]
    end_so_far, longest = float("-inf"), None
    overlaps = []
    for i, g in enumerate(grants):
        if g["enter"] < end_so_far - EPS:
            overlaps.append((longest, g))
        before = grants[i - 1] if i else None
        if before is not None and before["abandoned"]:
            # The abandoned lease had to expire in store time before this grant.
            assert g["enter"] >= before["t0"] + TTL - EPS, (
                f"granted {before['t0'] + TTL - g['enter']:.3f}s before the abandoned "
                f"lease expired: {before} -> {g}"
            )
        end = min(g["leave"], g["t0"] + TTL)
        if end > end_so_far:
            end_so_far, longest = end, g
    assert not overlaps, f"{len(overlaps)} overlapping grants, e.g. {overlaps[:3]}"

    # The INCR/DECR detector: everyone found the room empty, unless someone
    # who overran their TTL was still inside (then the clipped check above
    # already proved the store had let that lease go).
    for g in grants:
        if g["inside"] != 1:
            culprits = [
                h
                for h in overran
                if h is not g and h["enter"] <= g["leave"] and g["enter"] <= h["leave"]
            ]
            assert culprits, f"counter saw {g['inside']} holders inside at once: {g}"

    # A release answered before t0 + TTL reached the store while the lease was
    # still valid: the holder was still the owner, so it must have said yes.
    for g in grants:
        if not g["abandoned"] and g["released_by"] < g["t0"] + TTL:
            assert g["released"] is True, f"release refused for a holder within its TTL: {g}"
    return {
        "grants": len(grants),
        # contender-<i>:<pid>:<generation>; a new generation after each abandon
        "processes": len({g["owner"].rsplit(":", 1)[0] for g in grants}),
        "abandoned": sum(1 for g in grants if g["abandoned"]),
        "overran": len(overran),
    }


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_one_owner_at_a_time_under_contention(
    kind: str, request: pytest.FixtureRequest, fresh_redis: Callable[[], str]
) -> None:
    url = store_url(request, kind)
    key = new_key("contended")
    counter_url = fresh_redis()
    counter_key = f"contention-inside-{uuid.uuid4().hex}"
    store = LeaseStore.from_url(url)  # migrates SQLite once, before the crowd arrives
    try:
        started = time.monotonic()
        grants = run_contenders(url, key, counter_url, counter_key)
        elapsed = time.monotonic() - started
        stats = check_exclusion(grants)
        print(f"{kind}: {stats} in {elapsed:.1f}s")

        # The run was a real contest: many grants, many winners, expiries too.
        assert stats["grants"] >= 30, stats
        assert stats["processes"] >= PROCESSES // 3, stats
        assert stats["abandoned"] >= 1, stats
        # The counter is back to zero: every INCR met its DECR.
        assert int(redis.Redis.from_url(counter_url).get(counter_key) or 0) == 0
        # And the store's fence knows the newest token.
        assert store.fence_token(key) == max(g["token"] for g in grants)
    finally:
        store.close()


def _grant(token: int, enter: float, leave: float, **kw: Any) -> dict[str, Any]:
    return {
        "owner": f"o{token}",
        "token": token,
        "t0": enter - 0.001,
        "enter": enter,
        "leave": leave,
        "inside": 1,
        "abandoned": False,
        "released": True,
        "released_by": leave + 0.001,
        **kw,
    }


def test_the_checker_itself_catches_violations() -> None:
    """The detector is not vacuous: each kind of violation fails the check."""
    good = [_grant(1, 0.0, 0.1), _grant(2, 0.2, 0.3), _grant(3, 0.4, 0.5)]
    assert check_exclusion(good)["grants"] == 3
    bad_runs = {
        "overlap": [_grant(1, 0.0, 0.3), _grant(2, 0.2, 0.4)],
        "token twice": [_grant(1, 0.0, 0.1), _grant(1, 0.2, 0.3)],
        "token order": [_grant(2, 0.0, 0.1), _grant(1, 0.2, 0.3)],
        "early grant": [_grant(1, 0.0, 0.1, abandoned=True, released=None), _grant(2, 0.2, 0.3)],
        "counter": [_grant(1, 0.0, 0.1), _grant(2, 0.2, 0.3, inside=2)],
        "release refused": [_grant(1, 0.0, 0.1, released=False)],
        "lost counter": [_grant(1, 0.0, 0.1, inside=0)],
    }
    for name, grants in bad_runs.items():
        with pytest.raises(AssertionError):
            check_exclusion(grants)
            pytest.fail(f"checker missed: {name}")
