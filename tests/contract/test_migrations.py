"""Alembic migrations: applied, checked against the models, undone, packaged.

Every test gets a fresh database: a new PostgreSQL database on the session's
private cluster, or a new SQLite file. ``celery_lease.sql.migrate.check`` is
``alembic check``: it compares the live schema with ``celery_lease.schema``.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import subprocess
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Column, MetaData, Text, create_engine, inspect, text
from sqlalchemy.pool import NullPool

import celery_lease
import celery_lease.schema
from celery_lease.schema import VERSION_TABLE, metadata
from celery_lease.sql import database, functions
from celery_lease.sql import migrate as q
from celery_lease.sql.queries import CLAIM_LOOKUP_FN, REGISTER_LOOKUP_FN

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TABLES = {
    "celery_lease_leases",
    "celery_lease_results",
    "celery_lease_fences",
    "celery_lease_task_meta",
    "celery_lease_registrations",
}


def head_revision() -> str:
    cfg = q._alembic_config("sqlite:///unused")
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


@pytest.fixture(params=["pg", "sqlite"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
        return
    server = request.getfixturevalue("pg_server")
    server.ensure_running()
    name = f"test_migrations_{uuid.uuid4().hex[:10]}"
    url: str = server.create_database(name)
    yield url
    database(url).dispose()
    server.drop_database(name)


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def versions(url: str) -> list[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))]
    finally:
        engine.dispose()


def test_migrate_then_check_reports_no_drift(fresh_url: str) -> None:
    assert not {t for t in table_names(fresh_url) if t.startswith("celery_lease_")}
    celery_lease.migrate(fresh_url)
    assert TABLES | {VERSION_TABLE} <= table_names(fresh_url)
    assert versions(fresh_url) == [head_revision()]
    q.check(fresh_url)  # raises on any difference from celery_lease.schema
    # And the same comparison done by hand finds nothing either.
    engine = create_engine(fresh_url, poolclass=NullPool)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "include_name": _ours})
        assert compare_metadata(ctx, metadata) == []
    engine.dispose()


def _ours(name: str | None, type_: str, parent_names: object) -> bool:
    if type_ == "table":
        return bool(name and name.startswith("celery_lease_") and name != VERSION_TABLE)
    return True


def test_migrate_is_idempotent_and_ignores_application_tables(fresh_url: str) -> None:
    engine = create_engine(fresh_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE app_orders (id INTEGER PRIMARY KEY, note TEXT)"))
        conn.execute(text("INSERT INTO app_orders (id, note) VALUES (1, 'keep me')"))
    engine.dispose()
    celery_lease.migrate(fresh_url)
    store = celery_lease.LeaseStore.from_url(fresh_url)
    lease = store.claim("survives-remigration", ttl=30, owner_id="w")
    assert lease is not None
    celery_lease.migrate(fresh_url)
    celery_lease.migrate(fresh_url, "head")
    assert versions(fresh_url) == [head_revision()]
    q.check(fresh_url)  # the application's own table is not drift
    record = store.inspect("survives-remigration")
    assert record is not None and record.live and record.token == lease.token
    engine = create_engine(fresh_url, poolclass=NullPool)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT note FROM app_orders")).scalar() == "keep me"
    engine.dispose()
    store.close()


def test_downgrade_to_base_removes_the_tables(fresh_url: str) -> None:
    engine = create_engine(fresh_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE app_orders (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    celery_lease.migrate(fresh_url)
    q.downgrade(fresh_url, "base")
    left = table_names(fresh_url)
    assert not {t for t in left if t.startswith("celery_lease_")}, left  # version table too
    assert "app_orders" in left, "downgrade must not touch the application's tables"
    # Up again from nothing, in the same process (no stale "already migrated" state).
    celery_lease.migrate(fresh_url)
    assert TABLES | {VERSION_TABLE} <= table_names(fresh_url)
    assert versions(fresh_url) == [head_revision()]
    q.check(fresh_url)
    if fresh_url.startswith("sqlite"):
        # The embedded default migrates itself on first use, also after a downgrade
        # in the same process.
        assert celery_lease.LeaseStore.from_url(fresh_url).claim("before", ttl=30)
        q.downgrade(fresh_url, "base")
        store = celery_lease.LeaseStore.from_url(fresh_url)
        lease = store.claim("after", ttl=30)
        assert lease is not None and store.inspect("after") is not None
        store.close()


def our_functions(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT proname FROM pg_proc WHERE proname LIKE 'celery_lease_%'")
            )
            return {r[0] for r in rows}
    finally:
        engine.dispose()


def test_a_postgresql_database_one_revision_behind_says_to_migrate(fresh_url: str) -> None:
    """0002 adds the PL/pgSQL functions the per-task path calls: a database left
    at 0001 fails with the fix named (not a bare "function does not exist"),
    and works once migrated; a downgrade removes the functions again."""
    if fresh_url.startswith("sqlite"):
        pytest.skip("the functions are PostgreSQL's (SQLite needs none)")
    from celery_lease.exceptions import LeaseConfigError
    from celery_lease.results import ResultTable
    from celery_lease.stores.sql import SQLLeaseStore

    celery_lease.migrate(fresh_url, "0001")
    assert our_functions(fresh_url) == set()
    store = SQLLeaseStore(fresh_url)
    table = ResultTable(fresh_url, store)
    claim = {"ttl": 30, "owner_id": "w", "meta": {}, "task_id": "t1", "once": False}
    with pytest.raises(LeaseConfigError, match="lease migrate"):
        table.claim_prepared("behind", **claim)
    celery_lease.migrate(fresh_url, "0002")  # the unversioned functions: still behind
    assert our_functions(fresh_url) == {"celery_lease_claim_lookup", "celery_lease_register_lookup"}
    with pytest.raises(LeaseConfigError, match="lease migrate"):
        table.claim_prepared("behind", **claim)
    celery_lease.migrate(fresh_url, "0005")  # register_lookup_v1 only: a v2 worker is behind
    elsewhere = celery_lease.LeaseStore.from_url("memory://")
    remote = ResultTable(fresh_url, elsewhere)
    lease = elsewhere.claim("remote", ttl=30, owner_id="w")
    assert lease is not None
    with pytest.raises(LeaseConfigError, match="lease migrate"):
        remote.prepare(lease, "t1", once=False)
    celery_lease.migrate(fresh_url)
    # v1 stays installed beside v2, for the previous release's workers in a rolling upgrade.
    v1 = "celery_lease_register_lookup_v1"
    assert our_functions(fresh_url) == {CLAIM_LOOKUP_FN, v1, REGISTER_LOOKUP_FN}
    lease, prepared = table.claim_prepared("behind", **claim)
    assert lease is not None and prepared is not None and prepared.task_token is None
    q.downgrade(fresh_url, "0005")
    assert our_functions(fresh_url) == {CLAIM_LOOKUP_FN, v1}
    assert "celery_lease_registrations" not in table_names(fresh_url)
    q.downgrade(fresh_url, "0002")
    assert our_functions(fresh_url) == {"celery_lease_claim_lookup", "celery_lease_register_lookup"}
    q.downgrade(fresh_url, "0001")
    assert our_functions(fresh_url) == set()
    store.close()


def _migration(name: str) -> Any:
    path = ROOT / "migrations" / "versions" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_migration_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _words(sql: str) -> list[str]:
    return sql.split()


def test_the_migrations_function_texts_are_the_packages() -> None:
    """The functions the per-task path calls by name are the ones the migration
    created: its frozen texts are celery_lease.sql.functions' (whitespace aside),
    so an edit of either without a new versioned function fails here."""
    m = _migration("0003_versioned_functions")
    assert _words(m.CREATE_CLAIM_LOOKUP) == _words(functions.CREATE_CLAIM_LOOKUP)
    assert f"FUNCTION {CLAIM_LOOKUP_FN}(" in m.CREATE_CLAIM_LOOKUP
    m6 = _migration("0006_registrations")
    assert _words(m6.CREATE_REGISTER_LOOKUP) == _words(functions.CREATE_REGISTER_LOOKUP)
    assert f"FUNCTION {REGISTER_LOOKUP_FN}(" in m6.CREATE_REGISTER_LOOKUP
    # v1 (0003) is never edited: it stays installed for the previous release's workers.
    assert "FUNCTION celery_lease_register_lookup_v1(" in m.CREATE_REGISTER_LOOKUP


@pytest.mark.parametrize(
    ("table", "column"), [("celery_lease_results", "root_id"), ("celery_lease_task_meta", "token")]
)
def test_check_catches_a_column_dropped_by_hand(fresh_url: str, table: str, column: str) -> None:
    celery_lease.migrate(fresh_url)
    engine = create_engine(fresh_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
    engine.dispose()
    with pytest.raises(CommandError, match=rf"{column}|upgrade operations"):
        q.check(fresh_url)


def test_check_catches_models_that_disagree_with_the_migrations(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model change without a migration is drift: compare a modified copy of
    the MetaData with a freshly migrated database, as ``alembic check`` does."""
    celery_lease.migrate(fresh_url)
    changed = MetaData(naming_convention=metadata.naming_convention)
    for table in metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["celery_lease_leases"].append_column(Column("region", Text, nullable=True))
    engine = create_engine(fresh_url, poolclass=NullPool)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "include_name": _ours})
        diff = compare_metadata(ctx, changed)
        assert compare_metadata(ctx, metadata) == []
    engine.dispose()
    assert [(d[0], d[3].name) for d in diff] == [("add_column", "region")], diff
    # And `alembic check` itself (what celery_lease.sql.migrate.check runs) fails on it.
    monkeypatch.setattr(celery_lease.schema, "metadata", changed)
    with pytest.raises(CommandError, match=r"add_column|upgrade operations"):
        q.check(fresh_url)
    monkeypatch.undo()
    q.check(fresh_url)


# --------------------------------------------------------------------------
# concurrency
# --------------------------------------------------------------------------


def _migrate_in_child(url: str, barrier: object) -> None:
    barrier.wait(60)  # type: ignore[attr-defined]
    celery_lease.migrate(url)


@pytest.mark.parametrize("kind", ["sqlite", "pg"])
def test_migrate_from_four_processes_at_once(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    else:
        url = request.getfixturevalue("fresh_url_pg")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_migrate_in_child, args=(url, barrier)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert versions(url) == [head_revision()]
    assert TABLES <= table_names(url)
    q.check(url)


def test_a_failed_migration_raises_its_own_error_and_frees_the_lock(fresh_url: str) -> None:
    """A step that fails (here: a table of ours made by hand, which the first
    migration cannot create) is the error raised, not its clean-up's (on
    PostgreSQL the advisory unlock, in a transaction the failure aborted); and
    the lock is free after it, so the next migrate is not blocked."""
    engine = create_engine(fresh_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE celery_lease_leases (x integer)"))
        with pytest.raises(celery_lease.LeaseError, match="already exists"):
            celery_lease.migrate(fresh_url)
        if fresh_url.startswith("postgresql"):
            with engine.connect() as conn:  # another session takes the lock at once
                assert conn.execute(text("SELECT pg_try_advisory_lock(7244231)")).scalar()
                conn.execute(text("SELECT pg_advisory_unlock(7244231)"))
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE celery_lease_leases"))
    finally:
        engine.dispose()
    celery_lease.migrate(fresh_url)
    assert versions(fresh_url) == [head_revision()]


@pytest.fixture
def fresh_url_pg(request: pytest.FixtureRequest) -> Iterator[str]:
    server = request.getfixturevalue("pg_server")
    server.ensure_running()
    name = f"test_migrations_{uuid.uuid4().hex[:10]}"
    yield server.create_database(name)
    server.drop_database(name)


# --------------------------------------------------------------------------
# packaging: the migrations ship in the wheel
# --------------------------------------------------------------------------

INSTALLED_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import celery_lease
    from celery_lease.sql import migrate as db
    from importlib import resources
    out = {"file": celery_lease.__file__,
           "migrations": [p.name for p in resources.files("celery_lease.migrations")
                          .joinpath("versions").iterdir()]}
    for url in sys.argv[1:]:
        celery_lease.migrate(url)
        db.check(url)
        celery_lease.migrate(url)  # idempotent from the wheel too
        store = celery_lease.LeaseStore.from_url(url)
        lease = store.claim("packaged", ttl=30)
        out[url.split(":")[0]] = lease.token
    print(json.dumps(out))
    """
)


@pytest.mark.packaging  # a fresh virtualenv: .ci/run's long runs (-m ci)
@pytest.mark.slow
@pytest.mark.ci
def test_non_editable_install_applies_migrations(
    installed_venv: Path, tmp_path: Path, fresh_url_pg: str
) -> None:
    """``pip install .`` into a fresh virtualenv, then migrate from the installed wheel."""
    python = installed_venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    workdir = tmp_path / "elsewhere"  # not the repository: its source must not be importable
    workdir.mkdir()
    sqlite_url = f"sqlite:///{workdir / 'installed.sqlite3'}"
    run = subprocess.run(
        [str(python), "-c", INSTALLED_SCRIPT, sqlite_url, fresh_url_pg],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=workdir,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=workdir,
    ).stdout.strip()
    assert Path(out["file"]).resolve().is_relative_to(Path(purelib).resolve()), out["file"]
    assert not Path(out["file"]).resolve().is_relative_to(ROOT), "imported the repo's source"
    assert "0001_initial.py" in out["migrations"]
    assert out["sqlite"] >= 1 and out["postgresql+psycopg"] >= 1
    assert TABLES <= table_names(sqlite_url) and TABLES <= table_names(fresh_url_pg)
    assert versions(sqlite_url) == versions(fresh_url_pg) == [head_revision()]
