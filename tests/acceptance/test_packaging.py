"""The published metadata: what `pip install celery-lease[EXTRA]` brings, and no more."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.wheel_venv import build_wheel, clean_env, fresh_venv, pip

# Fresh virtualenvs from a built wheel: minutes of CPU on two cores, so these are
# long runs of .ci/run (-m ci), outside the default suite's 15 minutes.
pytestmark = [
    pytest.mark.packaging,
    pytest.mark.slow,
    pytest.mark.ci,
    pytest.mark.timeout(1200),
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def installed(venv: Path) -> set[str]:
    out = pip(venv, "list", "--format", "json")
    assert out.returncode == 0, out.stderr
    return {row["name"].lower().replace("_", "-") for row in json.loads(out.stdout)}


def test_postgres_extra_installs_no_redis_and_pip_check_is_clean(
    wheel: Path, tmp_path: Path
) -> None:
    """A PostgreSQL-only user's install: no redis-py, consistent, and it works."""
    venv = fresh_venv(tmp_path / "venv", f"celery-lease[postgres] @ {wheel.as_uri()}")
    names = installed(venv)
    assert {"celery-lease", "celery", "psycopg", "sqlalchemy", "alembic"} <= names, names
    assert "redis" not in names, f"redis-py came with celery-lease[postgres]: {sorted(names)}"
    # nor the test suite's or the benchmarks' tools
    assert not names & {"pytest", "hypothesis", "mypy", "celery-once", "fencekit"}, names
    check = pip(venv, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    # and the install is usable: a lease in SQLite from the installed wheel
    script = (
        "import importlib.util, celery_lease;"
        "assert importlib.util.find_spec('redis') is None;"
        "s = celery_lease.LeaseStore.from_url('sqlite:///pkg.sqlite3');"
        "print(s.claim('pkg', ttl=30).token, celery_lease.__file__)"
    )
    run = run_python(venv, script, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    token, where = run.stdout.split()
    assert int(token) >= 1 and str(venv) in where, run.stdout
    # and a Redis URL without the extra is a one-line error naming the extra
    script = (
        "import celery_lease\n"
        "try:\n"
        "    celery_lease.LeaseStore.from_url('redis://127.0.0.1:1/0')\n"
        "except celery_lease.LeaseConfigError as e:\n"
        "    print(e)\n"
    )
    run = run_python(venv, script, tmp_path)
    assert "pip install 'celery-lease[redis]'" in run.stdout, run.stdout + run.stderr


def test_redis_extra_brings_redis_py(wheel: Path, tmp_path: Path) -> None:
    """The other side: `celery-lease[redis]` is what installs redis-py."""
    venv = fresh_venv(tmp_path / "venv", f"celery-lease[redis] @ {wheel.as_uri()}")
    names = installed(venv)
    assert "redis" in names and "psycopg" not in names, sorted(names)
    check = pip(venv, "check")
    assert check.returncode == 0, check.stdout + check.stderr


def test_wheel_metadata_names_license_and_python_versions(wheel: Path) -> None:
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta).decode()
        assert any(n.endswith("LICENSE") for n in zf.namelist()), zf.namelist()
    assert "License :: OSI Approved :: BSD License" in text
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in text
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("Requires-Dist: celery>=5.3") for r in core), core
    assert not [r for r in core if "redis" in r], core


def test_wheel_registers_the_result_backend_and_ships_its_migration(wheel: Path) -> None:
    """Celery finds ``lease+...`` through the wheel's entry points, and the table it
    needs comes with the wheel's migrations."""
    import configparser
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        (points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(points).decode())
        names = zf.namelist()
    assert dict(entry_points["celery.result_backends"]) == {
        "lease": "celery_lease.backend:LeaseBackend"
    }
    assert "celery_lease/backend.py" in names
    assert "celery_lease/migrations/versions/0004_task_meta.py" in names
    assert "celery_lease/migrations/versions/0005_ended.py" in names


@pytest.mark.redis  # a version-matrix cell
def test_redis_extra_with_the_oldest_celery_gets_a_working_redis_transport(
    wheel: Path, tmp_path: Path, make_redis_server: object
) -> None:
    """`celery-lease[redis]` with Celery 5.3: kombu's Redis transport takes the redis-py it got.

    Celery 5.3's redis extra bounds redis-py below 6 but not kombu, whose newest
    Redis transport refuses redis-py below 6.4 at the first connection, with
    `pip check` clean. A message through a real Redis proves the pair works.
    """
    server = make_redis_server()  # type: ignore[operator]
    venv = fresh_venv(tmp_path / "venv", f"celery-lease[redis] @ {wheel.as_uri()}", "celery~=5.3.0")
    check = pip(venv, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    script = (
        "import sys, celery, kombu, redis;"
        "c = kombu.Connection(sys.argv[1]);"
        "q = c.SimpleQueue('packaging');"
        "q.put({'n': 1}); m = q.get(timeout=10); m.ack();"
        "print(celery.__version__, kombu.__version__, redis.__version__, m.payload['n'])"
    )
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, server.url(0)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(venv),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    celery_version, _kombu, _redis, n = run.stdout.split()
    assert celery_version.startswith("5.3.") and n == "1", run.stdout


def run_python(venv: Path, script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run by the fresh virtualenv's interpreter, outside the checkout."""
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(venv),
        cwd=cwd,
    )
