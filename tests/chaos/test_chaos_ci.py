"""The fault-injection suite, CI-sized: about three minutes, a fixed seed, every fault kind.

The same run as ``python -m tests.chaos`` (see ``tests/chaos/runner.py``),
smaller: 3 workers (one ``-P threads``) and the probe worker, 120 tasks over
8 keys, 100 s of faults at 0.25/s, so each of the sixteen fault kinds
happens at least once (the kind chosen next is always a least-injected one).
Reproduce it outside pytest with::

    python -m tests.chaos --duration 100 --seed 20240 --workers 3 --tasks 120 \\
        --keys 8 --fault-rate 0.25 --settle 150

and once more with ``--backend lease``: the ``lease+`` result backend on the
faulted result database, every one of its writes checked for a stale token
(``stale_backend_write``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.chaos.faults import KINDS
from tests.chaos.runner import Options, run

pytestmark = [
    # In the default suite. (It sat behind --slow while a backend_flip,
    # FAILURE DuplicateTimeseries -> SUCCESS, was undiagnosed: two threads of
    # the -P threads worker made one Prometheus metric at once; fixed in
    # celery_lease/metrics.py, regression test in tests/chaos/test_regressions.py.)
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed"),
]

OPTIONS = {
    "duration": 100.0,
    "seed": 20240,
    "workers": 3,
    "tasks": 120,
    "keys": 8,
    "fault_rate": 0.25,
    "settle": 150.0,
}


@pytest.mark.parametrize("backend", ["redis", "lease"])
def test_chaos_ci_run(tmp_path: Path, backend: str) -> None:
    opts = Options(**OPTIONS, backend=backend, workdir=tmp_path / "chaos", quiet=True)  # type: ignore[arg-type]
    try:
        result = run(opts)
    except FileNotFoundError as exc:  # a server binary missing on a developer machine
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    print(result.table)
    f = result.figures
    missing = [k for k in KINDS if not f["faults"].get(k)]
    assert not missing, f"fault kinds never injected: {missing}\n{result.table}"
    assert result.report.violations == [], result.table
    assert result.report.lost_plugin == [], result.table
    assert f["executions"] >= f["keys"] and f["accepted"] >= f["keys"]
    if backend == "lease":  # the check saw the leased tasks' writes, with their tokens
        assert f["backend_writes_tokened"] >= f["accepted"], result.table
