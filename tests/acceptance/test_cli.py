"""``celery -A example_project lease ...`` from a non-editable install, exit codes and output.

The package is installed into a fresh virtualenv (``installed_venv``); the
example project is copied next to a temporary working directory and runs on
its embedded default (SQLite), so nothing here needs a server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# A fresh virtualenv per pytest worker: a long run of .ci/run (-m ci), outside the
# default suite's 15 minutes.
pytestmark = [pytest.mark.packaging, pytest.mark.slow, pytest.mark.ci]

ROOT = Path(__file__).resolve().parents[2]

# Runs in the installed venv: claim a key as "the owner" and print the lease.
OWNER_CLAIM = """
import json, sys
from celery_lease import LeaseStore
from example_project.tasks import app
from celery_lease.config import config
cfg = config(app)
lease = LeaseStore.from_url(cfg.store_url).claim(sys.argv[1], ttl=300, owner_id="owner-1",
    meta={"task_id": "task-1", "task_name": "example_project.tasks.generate_security_suite"})
print(json.dumps({"key": lease.key, "keys": lease.keys, "owner_id": lease.owner_id,
    "token": lease.token, "expires_at": lease.expires_at, "acquired_at": lease.acquired_at,
    "ttl": lease.ttl}))
"""
# Runs in the installed venv: the evicted owner tries to commit.
OWNER_COMMIT = """
import json, sys
import celery_lease
from celery_lease import Lease, LeaseStore, StaleFencingToken
from celery_lease.config import config
from celery_lease.results import ResultTable
from example_project.tasks import app
cfg = config(app)
d = json.loads(sys.argv[1])
d["keys"] = tuple(d["keys"])
lease = Lease(**d)
store = LeaseStore.from_url(cfg.store_url)
print("module", celery_lease.__file__)
try:
    ResultTable(cfg.result_url, store).commit(lease, {"suite": "late"})
except StaleFencingToken as e:
    print("FENCED", e)
else:
    print("ACCEPTED")
"""


@pytest.fixture
def project(installed_venv: Path, tmp_path: Path) -> dict[str, object]:
    work = tmp_path / "work"
    shutil.copytree(ROOT / "example_project", work / "example_project")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{installed_venv / 'bin'}:{env.get('PATH', '')}",
        EXAMPLE_DATA=str(tmp_path / "data"),
        PYTHONPATH=str(work),
    )
    return {"cwd": work, "env": env, "venv": installed_venv}


def run(project: dict[str, object], *args: str) -> subprocess.CompletedProcess[str]:
    venv = project["venv"]
    assert isinstance(venv, Path)
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=project["cwd"],  # type: ignore[arg-type]
        env=project["env"],  # type: ignore[arg-type]
        capture_output=True,
        text=True,
        timeout=120,
    )


def lease_cmd(project: dict[str, object], *args: str) -> subprocess.CompletedProcess[str]:
    return run(project, "celery", "-A", "example_project", "lease", *args)


def test_cli_from_installed_package(project: dict[str, object]) -> None:
    venv = project["venv"]
    assert isinstance(venv, Path)
    where = run(project, "python", "-c", "import celery_lease; print(celery_lease.__file__)")
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout, where.stdout  # the wheel, not the checkout

    migrate = lease_cmd(project, "migrate")
    assert migrate.returncode == 0, migrate.stderr
    assert "migrated sqlite:///" in migrate.stdout

    empty = lease_cmd(project, "list")
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout.strip() == "no leases"

    key = "payment-security-42"
    claimed = run(project, "python", "-c", OWNER_CLAIM, key)
    assert claimed.returncode == 0, claimed.stderr
    lease = json.loads(claimed.stdout)

    listed = lease_cmd(project, "list")
    assert listed.returncode == 0, listed.stderr
    assert key in listed.stdout and "owner-1" in listed.stdout and "task-1" in listed.stdout
    as_json = json.loads(lease_cmd(project, "list", "--json", "--prefix", "payment-").stdout)
    assert [r["key"] for r in as_json] == [key]
    assert as_json[0]["token"] == lease["token"] and as_json[0]["live"] is True

    shown = lease_cmd(project, "show", key)
    assert shown.returncode == 0, shown.stderr
    assert "held" in shown.stdout and str(lease["token"]) in shown.stdout

    unknown = lease_cmd(project, "show", "no-such-key")
    assert unknown.returncode == 3
    assert "no lease on record for 'no-such-key'" in unknown.stderr

    refused = lease_cmd(project, "release", key)
    assert refused.returncode == 2 and "--force" in refused.stderr

    released = lease_cmd(project, "release", key, "--force")
    assert released.returncode == 0, released.stderr
    assert f"evicted owner-1 (token {lease['token']}" in released.stdout
    after = json.loads(lease_cmd(project, "show", key, "--json").stdout)
    assert after["live"] is False and after["token"] > lease["token"]

    # The evicted owner's commit is refused.
    late = run(project, "python", "-c", OWNER_COMMIT, json.dumps(lease))
    assert late.returncode == 0, late.stderr
    assert str(venv) in late.stdout
    assert "FENCED" in late.stdout, late.stdout
    results = lease_cmd(project, "results", key)
    assert results.returncode == 3 and "no accepted result" in results.stderr

    again = lease_cmd(project, "release", key, "--force")
    assert again.returncode == 3 and "no live lease" in again.stdout

    swept = lease_cmd(project, "sweep", "--lease-grace", "0")
    assert swept.returncode == 0, swept.stderr
    assert "swept 0 result(s), 1 lease row(s)" in swept.stdout
    # The sweep never lowers a fence: a new claim still gets a larger token.
    reclaimed = json.loads(run(project, "python", "-c", OWNER_CLAIM, key).stdout)
    assert reclaimed["token"] > after["token"]


def test_cli_unreachable_store_is_a_clear_error(project: dict[str, object]) -> None:
    env = project["env"]
    assert isinstance(env, dict)
    env["EXAMPLE_LEASE_STORE_URL"] = "redis://127.0.0.1:1/0"
    env["EXAMPLE_LEASE_RESULT_URL"] = f"sqlite:///{env['EXAMPLE_DATA']}/results.db"
    out = lease_cmd(project, "list")
    assert out.returncode == 1
    assert out.stderr.startswith("Error: Redis redis://127.0.0.1:1/0 unavailable"), out.stderr
    assert "Traceback" not in out.stderr


def test_cli_bad_setting_is_a_clear_error(project: dict[str, object]) -> None:
    env = project["env"]
    assert isinstance(env, dict)
    env["EXAMPLE_LEASE_STORE_URL"] = "mongodb://127.0.0.1/x"
    out = lease_cmd(project, "list")
    assert out.returncode == 1
    assert "lease_store_url: unknown URL scheme 'mongodb'" in out.stderr, out.stderr


def test_cli_sweep_refuses_a_negative_lease_grace(project: dict[str, object]) -> None:
    """A negative grace put the cutoff in the future: the sweep deleted live leases."""
    assert lease_cmd(project, "migrate").returncode == 0
    key = "payment-security-7"
    claimed = run(project, "python", "-c", OWNER_CLAIM, key)
    assert claimed.returncode == 0, claimed.stderr
    lease = json.loads(claimed.stdout)

    negative = lease_cmd(project, "sweep", "--lease-grace", "-3600")
    assert negative.returncode == 2, negative.stdout + negative.stderr
    assert "Invalid value for '--lease-grace'" in negative.stderr, negative.stderr
    nan = lease_cmd(project, "sweep", "--lease-grace", "nan")
    assert nan.returncode == 1, nan.stdout + nan.stderr
    assert "Error: lease_grace must be a finite number of seconds >= 0" in nan.stderr
    assert "Traceback" not in negative.stderr + nan.stderr

    shown = json.loads(lease_cmd(project, "show", key, "--json").stdout)
    assert shown["live"] is True and shown["token"] == lease["token"], shown
    swept = lease_cmd(project, "sweep", "--lease-grace", "0")
    assert swept.returncode == 0 and "0 lease row(s)" in swept.stdout, swept.stdout
