"""Worker clocks do not matter (invariant 6): a client under libfaketime sees the
same grants and expiries as an unskewed one, because the store's clock decides.

The skewed client is ``tests/lease_client.py`` run as ``faketime -f "+1h"``
(and ``-1h``) with ``FAKETIME_DONT_FAKE_MONOTONIC=1``: the wall clock is off
by an hour, the monotonic clock is the machine's (as with a badly set clock
in real life: NTP steps the wall clock, never CLOCK_MONOTONIC).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_lease import LeaseStore
from celery_lease.stores.base import LeaseRecord
from tests import faketime
from tests.store_fixtures import (
    CLIENT,
    PYTHON,
    client_env,
    new_key,
    store_url,
    wait_until_expired,
)

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed"),
]

SKEWS = {"+1h": 3600.0, "-1h": -3600.0}
TTL = 3.0
EPS = 0.005
HOLDER = "unskewed-holder:1:h"

STORES = [
    "redis",
    "postgres",
    pytest.param(
        "sqlite",
        marks=pytest.mark.skip(
            reason="SQLite is embedded: its clock (julianday('now')) is the calling process's "
            "own, so a skewed worker skews the store clock too; there is no independent "
            "store clock to prove anything against"
        ),
    ),
]


def client(skew: str | None, *args: str) -> list[str]:
    argv = [PYTHON, CLIENT, *args]
    return faketime.command(skew, argv) if skew else argv


def run_clients(*runs: tuple[str | None, list[str]]) -> list[dict[str, Any]]:
    """Run client processes side by side (skew, args) and return their answers."""
    procs = [
        subprocess.Popen(
            client(skew, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=client_env(FAKETIME_DONT_FAKE_MONOTONIC="1"),
            text=True,
        )
        for skew, args in runs
    ]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"client failed ({proc.returncode}):\n{err}"
        answers.append(json.loads(out.splitlines()[-1]))
    return answers


def run_client(skew: str | None, *args: str) -> dict[str, Any]:
    [answer] = run_clients((skew, list(args)))
    return answer


def claim_args(store: LeaseStore, key: str, owner: str, ttl: float = TTL) -> list[str]:
    return ["claim", store.url, key, "--ttl", str(ttl), "--owner", owner]


def is_free(record: LeaseRecord | None) -> bool:
    return record is None or not record.live


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    s = LeaseStore.from_url(store_url(request, request.param))
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_the_skew_is_real(skew: str) -> None:
    before = time.time()
    skewed = run_client(skew, "time")
    after = time.time()
    offset = SKEWS[skew]
    assert before + offset - 1 <= skewed["time"] <= after + offset + 1, (skewed, before)
    # Only the wall clock is off: the monotonic clock is the machine's.
    assert abs(skewed["monotonic"] - time.monotonic()) < 60
    unskewed = run_client(None, "time")
    assert before - 1 <= unskewed["time"] <= time.time() + 1


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_a_skewed_claim_expires_in_store_time(store: LeaseStore, skew: str) -> None:
    results = {}
    for who in ("unskewed", "skewed"):  # the skewed lease last: it is examined below
        key = new_key(who)
        store_before = store.time()
        answer = run_client(
            skew if who == "skewed" else None, *claim_args(store, key, f"{who}:1:x")
        )
        store_after = store.time()
        lease = answer["lease"]
        assert lease is not None, answer
        # Granted at store time, for exactly the TTL, however wrong the client's clock.
        assert store_before - EPS <= lease["acquired_at"] <= store_after + EPS
        assert lease["expires_at"] == pytest.approx(lease["acquired_at"] + TTL, abs=1e-3)
        assert 0 < answer["record_remaining"] <= TTL
        results[who] = (key, lease, answer)

    key, lease, answer = results["skewed"]
    # The client really ran an hour off, in the very process that claimed.
    assert abs(answer["local_time"] - (lease["acquired_at"] + SKEWS[skew])) < 30

    # The store's view equals the client's lease; an unskewed claimer is
    # refused while it is live and granted once it expired in store time.
    record = store.inspect(key)
    assert record is not None and record.live, record
    assert (record.owner_id, record.token) == ("skewed:1:x", lease["token"])
    assert record.expires_at == pytest.approx(lease["expires_at"], abs=1e-3)
    assert store.claim(key, owner_id=HOLDER, ttl=TTL) is None
    assert store.time() < lease["expires_at"], "the refusal above came while it was live"
    assert is_free(wait_until_expired(store, key, lease["expires_at"]))
    taken = store.claim(key, owner_id=HOLDER, ttl=TTL)
    assert taken is not None and taken.token > lease["token"]

    # Same shape as the unskewed client's grant.
    _, control, control_answer = results["unskewed"]
    assert (lease["expires_at"] - lease["acquired_at"]) == pytest.approx(
        control["expires_at"] - control["acquired_at"], abs=1e-3
    )
    assert answer["record_remaining"] == pytest.approx(control_answer["record_remaining"], abs=0.5)


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_a_skewed_claimer_is_refused_and_granted_like_an_unskewed_one(
    store: LeaseStore, skew: str
) -> None:
    whos = ("skewed", "unskewed")
    # The clients must claim while the holder's lease lives; on a loaded machine
    # starting them can take longer than TTL: then try again with a longer lease
    # (set-up, not the property under test).
    for ttl in (TTL, 3 * TTL, 10 * TTL):
        key = new_key()
        held = store.claim(key, owner_id=HOLDER, ttl=ttl)
        assert held is not None
        answers = run_clients(
            *((skew if w == "skewed" else None, claim_args(store, key, f"{w}:1:x")) for w in whos)
        )
        # (and the record below is read while the lease still lives)
        if all(a["store_after"] < held.expires_at for a in answers) and (
            store.time() < held.expires_at - 0.5
        ):
            break
        store.release(held)
    refused = dict(zip(whos, answers))
    for who, answer in refused.items():
        assert answer["store_after"] < held.expires_at, f"{who} claimed too late to matter"
        assert answer["lease"] is None, f"{who} client granted a live lease: {answer}"
        assert answer["record_owner"] == HOLDER
        assert 0 < answer["record_remaining"] <= ttl, answer  # not an hour more or less
    record = store.inspect(key)
    assert record is not None and (record.owner_id, record.token) == (HOLDER, held.token)

    assert is_free(wait_until_expired(store, key, held.expires_at))
    granted = run_client(skew, *claim_args(store, key, "skewed:2:y"))
    lease = granted["lease"]
    assert lease is not None, granted
    assert lease["token"] > held.token
    assert lease["acquired_at"] >= held.expires_at - EPS
    assert lease["expires_at"] == pytest.approx(lease["acquired_at"] + TTL, abs=1e-3)


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_a_skewed_holder_renews_in_store_time(store: LeaseStore, skew: str) -> None:
    key = new_key()
    # Renewed every TTL/3: at 3 s a renewal may come up to 2 s late before the
    # lease lapses, slack a loaded two-core machine needs (1 s leaves 0.67 s).
    ttl = 3.0
    proc = subprocess.Popen(
        client(skew, "hold", store.url, key, "--ttl", str(ttl), "--owner", "skewed:1:x"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=client_env(FAKETIME_DONT_FAKE_MONOTONIC="1"),
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def ask(line: str) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        assert answer, f"holder died: {proc.stderr.read() if proc.stderr else ''}"
        result: dict[str, Any] = json.loads(answer)
        return result

    try:
        first = proc.stdout.readline()
        assert first, f"holder did not start: {proc.stderr.read() if proc.stderr else ''}"
        holding = json.loads(first)
        assert holding["event"] == "holding"
        assert abs(holding["local_time"] - (holding["acquired_at"] + SKEWS[skew])) < 30
        token = holding["token"]
        expiries = set()
        while store.time() < holding["acquired_at"] + 3.5 * ttl:
            record = store.inspect(key)
            assert record is not None and record.live, record
            assert (record.owner_id, record.token) == ("skewed:1:x", token)
            # Renewed in store time: never more than one TTL ahead (not an hour).
            assert 0 < record.expires_at - record.now <= ttl + EPS, record
            expiries.add(record.expires_at)
            assert store.claim(key, owner_id=HOLDER, ttl=ttl) is None
            status = ask("status")
            assert status["held"] is True, status
            # The holder's local view never outlives the store's lease, and its
            # last renewal set the expiry one TTL from a store time (not an hour off).
            assert status["store_before"] < status["expires_at"], status
            assert status["expires_at"] <= status["store_after"] + ttl + EPS, status
            time.sleep(0.1)
        assert len(expiries) >= 3, "the store saw the skewed holder renew"
        bye = ask("exit")
        assert bye["event"] == "released" and bye["renewals"] >= 3, bye
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert is_free(store.inspect(key)), "the holder released on leaving hold()"
    after = store.claim(key, owner_id=HOLDER, ttl=ttl)
    assert after is not None and after.token > token
