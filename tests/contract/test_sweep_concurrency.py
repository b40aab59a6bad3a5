"""The PostgreSQL sweep beside multi-key claims: never a deadlock error.

Multi-key claims lock the keys' fence rows in key order, then their lease
rows. A sweep that locked the same rows in another order (the scan's) met
them in a deadlock, and ``celery -A proj lease sweep`` exited 1. Real
PostgreSQL; threads claim overlapping key sets with short TTLs while another
thread sweeps with no grace, so expired rows are swept under the claimers.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

import celery_lease
from celery_lease import LeaseStore
from celery_lease.exceptions import LeaseError
from celery_lease.results import ResultTable
from tests.servers import wait_for

pytestmark = pytest.mark.timeout(120)

KEYS = [f"sweep-dl-{i}" for i in range(6)]


def test_sweeping_beside_multi_key_claims_never_deadlocks(pg_url: str) -> None:
    celery_lease.migrate(pg_url)
    store = LeaseStore.from_url(pg_url)
    table = ResultTable(pg_url)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"claims": 0, "sweeps": 0, "swept": 0}
    lock = threading.Lock()

    def claimer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            keys = rng.sample(KEYS, 3)
            try:
                lease = store.claim(keys, owner_id=f"c{seed}", ttl=0.02)
            except LeaseError as e:  # a claim's own conflict is retried by LeasedTask
                if "deadlock" not in str(e):
                    errors.append(e)
                continue
            if lease is not None:
                with lock:
                    counts["claims"] += 1

    def sweeper() -> None:
        while not stop.is_set():
            try:
                out = table.sweep(None, lease_grace=0.0)
            except LeaseError as e:
                errors.append(e)
                continue
            with lock:
                counts["sweeps"] += 1
                counts["swept"] += out["leases"]

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=sweeper) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 8.0
    while time.monotonic() < deadline and not errors:
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(10)
    # The race really ran: claims granted and expired rows swept under them.
    assert counts["claims"] > 50 and counts["swept"] > 10, counts
    assert errors == [], errors[:3]
    # The fences kept every swept token: the next grant of each key is newer.
    for key in KEYS:
        newest = store.fence_token(key)
        lease = wait_for(lambda k=key: store.claim(k, owner_id="final", ttl=5), 5, f"claim {key}")
        assert lease.token > newest
