"""The CI-sized chaos run with the ``lease+`` result backend (``--backend lease``).

The backend is on the result database, which the faults restart, make
read-only and stop; a leased task's SUCCESS is written in its commit's
transaction, and the checker reads every write the backend made, with its
token (``chaos_meta_history``), for ``stale_backend_write``. With the leases
in Redis (the fence-row lock and the Redis ownership check), and in the same
PostgreSQL database (one statement per step; the Redis store's fault kinds
left out). With chords too (``--chords``): six chords of three leased members, whose
callbacks must each end with what their header gives (tests/chaos/chord_checks.py).
Reproduce one outside pytest with::

    python -m tests.chaos --duration 100 --seed 20240 --workers 3 --tasks 120 \\
        --keys 8 --fault-rate 0.25 --settle 150 --backend lease --store pg --chords 6
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


#: chords per run, of three ``chaos.exclusive`` members each
CHORDS = 6


@pytest.mark.parametrize("store", ["redis", "pg"])
def test_chaos_ci_run_with_the_lease_backend(tmp_path: Path, store: str) -> None:
    kinds = KINDS if store == "redis" else tuple(k for k in KINDS if k not in REDIS_STORE_KINDS)
    f = run_and_check(tmp_path, backend="lease", store=store, kinds=kinds, chords=CHORDS)
    # The check saw the leased tasks' writes, each with its token.
    assert f["backend_writes_tokened"] >= f["accepted"], f["table"]
    # And every chord judged (a callback that got its header, or a failed one), but
    # those with a member the Redis transport lost (run_and_check: none by the plugin).
    judged = f["chords_succeeded"] + f["chords_failed"]
    assert f["chords"] == CHORDS and judged + f["chords_member_lost"] == CHORDS, f["table"]
    assert f["chords_member_lost"] <= f["lost_broker"] and judged >= CHORDS // 2, f["table"]
