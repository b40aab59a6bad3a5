"""What ``celery -A proj lease ...`` changes and says, run as the real command.

* ``release KEY --force`` on a key with no live lease (never claimed, or its
  lease expired) changes nothing, fence included, says so and exits 3; on a
  live lease it evicts it and advances the fence (exit 0);
* its help says the evicted body keeps running and that its commit is refused;
* ``sweep`` warns on stderr when ``lease_result_expires`` is unset;
* times are printed in UTC, ISO 8601 with the zone.

The commands run from this checkout (``tests.apps.leaseapp``) against a
SQLite store file; leases are made with the library, in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_lease import LeaseStore
from tests.servers import wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CL_BROKER": "memory://",
        "CL_BACKEND": "cache+memory://",
        "CL_STORE": url,
        "CL_RESULTS": url,
    }


def lease_cmd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.leaseapp", "lease", *args],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _store(env: dict[str, str]) -> LeaseStore:
    return LeaseStore.from_url(env["CL_STORE"])


def test_release_of_a_key_never_claimed_changes_nothing(cli_env: dict[str, str]) -> None:
    store = _store(cli_env)
    out = lease_cmd(cli_env, "release", "never-claimed", "--force")
    assert out.returncode == 3, out
    assert out.stdout.strip() == "never-claimed: no live lease; nothing changed", out
    assert store.fence_token("never-claimed") == 0
    assert store.inspect("never-claimed") is None


def test_release_of_an_expired_lease_changes_nothing(cli_env: dict[str, str]) -> None:
    store = _store(cli_env)
    lease = store.claim("lapsed", ttl=0.2, owner_id="owner-1")
    assert lease is not None
    wait_for(lambda: not store.inspect("lapsed").live, 10, "the lease to expire")  # type: ignore[union-attr]
    out = lease_cmd(cli_env, "release", "lapsed", "--force", "--json")
    assert out.returncode == 3, out
    assert json.loads(out.stdout) == {"key": "lapsed", "evicted": None, "fence": None}
    assert store.fence_token("lapsed") == lease.token
    # Nothing was fenced: the next claim gets the very next token.
    again = store.claim("lapsed", ttl=5, owner_id="owner-2")
    assert again is not None and again.token == lease.token + 1


def test_release_of_a_live_lease_evicts_it_and_advances_the_fence(
    cli_env: dict[str, str],
) -> None:
    store = _store(cli_env)
    lease = store.claim("busy", ttl=60, owner_id="owner-1")
    assert lease is not None
    out = lease_cmd(cli_env, "release", "busy", "--force")
    assert out.returncode == 0, out
    assert f"evicted owner-1 (token {lease.token}" in out.stdout
    assert "its commit will be refused" in out.stdout
    record = store.inspect("busy")
    assert record is not None and not record.live
    assert store.fence_token("busy") > lease.token


def test_release_help_says_what_happens_to_the_evicted_body(cli_env: dict[str, str]) -> None:
    out = lease_cmd(cli_env, "release", "--help")
    assert out.returncode == 0, out
    text = " ".join(out.stdout.split())
    assert "keeps running until it next checks its lease" in text, text
    assert "its commit is then refused (FENCED)" in text, text
    assert "A key with no live lease is left as it is (exit 3, nothing changed)" in text, text


@pytest.mark.parametrize(
    ("settings", "warned"), [({}, True), ({"lease_result_expires": 60}, False)]
)
def test_sweep_warns_when_results_never_expire(
    cli_env: dict[str, str], settings: dict[str, Any], warned: bool
) -> None:
    env = {**cli_env, "CL_SETTINGS": json.dumps(settings)}
    out = lease_cmd(env, "sweep")
    assert out.returncode == 0, out
    assert "swept 0 result(s), 0 lease row(s)" in out.stdout
    warning = "Warning: lease_result_expires is not set: accepted results are kept forever"
    assert (warning in out.stderr) is warned, out.stderr


def test_times_are_utc_iso_8601_with_the_zone(cli_env: dict[str, str]) -> None:
    store = _store(cli_env)
    assert store.claim("shown", ttl=60, owner_id="owner-1") is not None
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00"
    shown = lease_cmd(cli_env, "show", "shown")
    assert shown.returncode == 0, shown
    assert re.search(rf"acquired\s+{stamp} \(\d+\.\ds ago\)", shown.stdout), shown.stdout
    assert re.search(rf"expires\s+{stamp} \(in \d+\.\ds\)", shown.stdout), shown.stdout
    listed = lease_cmd(cli_env, "list")
    assert re.search(rf"shown\s+\d+\s+owner-1\s+-\s+{stamp}", listed.stdout), listed.stdout
