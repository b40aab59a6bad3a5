"""The CI-sized chaos run with the ``lease+`` result backend (``--backend lease``).

The backend is on the result database, which the faults restart, make
read-only and stop; a leased task's SUCCESS is written in its commit's
transaction, and the checker reads every write the backend made, with its
token (``chaos_meta_history``), for ``stale_backend_write``. With the leases
in Redis (the fence-row lock and the Redis ownership check), and in the same
PostgreSQL database (one statement per step; the Redis store's fault kinds
left out). Reproduce one outside pytest with::

    python -m tests.chaos --duration 100 --seed 20240 --workers 3 --tasks 120 \\
        --keys 8 --fault-rate 0.25 --settle 150 --backend lease --store pg
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.chaos.ci import run_and_check
from tests.chaos.faults import KINDS, REDIS_STORE_KINDS

pytestmark = [
    pytest.mark.slow,  # .ci/run's long runs (-m ci), as test_chaos_ci.py
    pytest.mark.ci,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed"),
]


@pytest.mark.parametrize("store", ["redis", "pg"])
def test_chaos_ci_run_with_the_lease_backend(tmp_path: Path, store: str) -> None:
    kinds = KINDS if store == "redis" else tuple(k for k in KINDS if k not in REDIS_STORE_KINDS)
    f = run_and_check(tmp_path, backend="lease", store=store, kinds=kinds)
    # The check saw the leased tasks' writes, each with its token.
    assert f["backend_writes_tokened"] >= f["accepted"], f["table"]
