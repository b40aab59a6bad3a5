"""The ledger story: fencing a write where it lands, in the user's own table.

DESIGN.md: an account row carries ``balance`` and ``last_fencing_token``. A
worker applies a balance delta only inside a transaction that locks the row
and checks that its token is greater than ``last_fencing_token``, then stores
its token there. A stalled worker's delta with an older token is refused, so
the balance is never double-applied.

Here the check goes through :func:`celery_lease.fencing.guard` (the fence row
in ``celery_lease_fences``, locked until the caller's transaction ends) plus
the account row's own ``last_fencing_token``. The account table lives in
PostgreSQL or SQLite; the leases in the SQL store of that database or in
Redis. The two-process tests interleave real transactions.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.pool import NullPool

import celery_lease
from celery_lease import LeaseConfigError, LeaseStore, StaleFencingToken, fencing
from celery_lease.results import ResultTable
from tests.results_helpers import migrated_pg_url, new_key, wait_for, wait_until_expired

TTL = 1.0
LONG_TTL = 30.0

pytestmark = pytest.mark.timeout(90)


# --------------------------------------------------------------------------
# the user's own code: an accounts table and a fenced delta
# --------------------------------------------------------------------------


class AlreadyApplied(Exception):
    """The account row already carries this token: this delta was applied before."""


def user_engine(url: str) -> Engine:
    """The application's own engine (not celery-lease's). SQLite: BEGIN IMMEDIATE."""
    if not url.startswith("sqlite"):
        return create_engine(url, poolclass=NullPool)
    engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA busy_timeout=30000")

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def create_accounts(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS ledger_accounts (id TEXT PRIMARY KEY, "
                "balance BIGINT NOT NULL, last_fencing_token BIGINT NOT NULL DEFAULT 0)"
            )
        )


def open_account(engine: Engine, balance: int) -> str:
    account = new_key("acct")
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO ledger_accounts (id, balance) VALUES (:id, :b)"),
            {"id": account, "b": balance},
        )
    return account


def apply_delta_in(conn: Connection, resource: str, account: str, token: int, delta: int) -> None:
    """The fenced write, inside the caller's transaction: fence, lock, check, write."""
    fencing.guard(conn, resource, token)  # fence row first (the documented lock order)
    lock = "" if conn.dialect.name == "sqlite" else " FOR UPDATE"
    last = conn.execute(
        text(f"SELECT last_fencing_token FROM ledger_accounts WHERE id = :id{lock}"),
        {"id": account},
    ).scalar_one()
    if token <= last:
        raise AlreadyApplied(f"token {token} <= last_fencing_token {last}")
    conn.execute(
        text(
            "UPDATE ledger_accounts SET balance = balance + :d, last_fencing_token = :t "
            "WHERE id = :id"
        ),
        {"d": delta, "t": token, "id": account},
    )


def apply_delta(engine: Engine, resource: str, account: str, token: int, delta: int) -> None:
    with engine.begin() as conn:
        apply_delta_in(conn, resource, account, token, delta)


def account_row(engine: Engine, account: str) -> tuple[int, int]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT balance, last_fencing_token FROM ledger_accounts WHERE id = :id"),
            {"id": account},
        ).one()
    return int(row[0]), int(row[1])


def current_fence(engine: Engine, resource: str) -> int | None:
    with engine.connect() as conn:
        return fencing.current(conn, resource)


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@dataclass
class Ledger:
    kind: str
    url: str  # the ledger's database (also celery-lease's tables)
    store: LeaseStore
    table: ResultTable
    engine: Engine


@pytest.fixture(params=["redis+pg", "pg", "sqlite"])
def ledger(request: pytest.FixtureRequest) -> Iterator[Ledger]:
    kind = request.param
    if kind == "sqlite":
        url = request.getfixturevalue("sqlite_url")
        celery_lease.migrate(url)
    else:
        url = migrated_pg_url(request)
    store_url = request.getfixturevalue("redis_url") if kind == "redis+pg" else url
    store = LeaseStore.from_url(store_url)
    engine = user_engine(url)
    create_accounts(engine)
    yield Ledger(kind, url, store, ResultTable(url, store), engine)
    engine.dispose()
    store.close()


@pytest.fixture(params=["pg", "sqlite"])
def ledger_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        url: str = request.getfixturevalue("sqlite_url")
        celery_lease.migrate(url)
        return url
    return migrated_pg_url(request)


# --------------------------------------------------------------------------
# the story, in one process
# --------------------------------------------------------------------------


def test_stalled_worker_refused_after_newer_one_wrote(ledger: Ledger) -> None:
    engine, store = ledger.engine, ledger.store
    account = open_account(engine, 1000)
    resource = f"account:{account}"
    key = f"deposit-42-{account}"  # the unit of work: deposit 100 once

    a = store.claim(key, ttl=TTL, owner_id="worker-A")
    assert a is not None
    # A reads, computes its delta... and stalls past its lease (proven lapsed).
    wait_until_expired(store, a)
    b = store.claim(key, ttl=LONG_TTL, owner_id="worker-B")
    assert b is not None and b.token > a.token
    apply_delta(engine, resource, account, b.token, +100)
    assert account_row(engine, account) == (1100, b.token)

    # A resumes and applies the same deposit with its older token: refused.
    with pytest.raises(StaleFencingToken) as refused:
        apply_delta(engine, resource, account, a.token, +100)
    assert refused.value.key == resource
    assert refused.value.token == a.token and refused.value.current == b.token
    assert account_row(engine, account) == (1100, b.token), "A's delta must not land"

    # B's own retry (same token, reply lost) passes the fence but not the row check.
    with pytest.raises(AlreadyApplied):
        apply_delta(engine, resource, account, b.token, +100)
    assert account_row(engine, account) == (1100, b.token), "never double-applied"
    assert current_fence(engine, resource) == b.token


def test_lease_key_as_resource_fences_before_new_owner_writes(ledger: Ledger) -> None:
    """With the lease key as the resource, the new owner's claim (SQL store) or
    registration (leases in Redis) alone fences the old owner out."""
    engine, store = ledger.engine, ledger.store
    account = open_account(engine, 500)
    key = f"ledger-{account}"
    a = store.claim(key, ttl=TTL, owner_id="worker-A")
    assert a is not None
    ledger.table.register(a)
    apply_delta(engine, key, account, a.token, -50)  # A writes while it owns the key
    wait_until_expired(store, a)
    b = store.claim(key, ttl=LONG_TTL, owner_id="worker-B")
    assert b is not None
    ledger.table.register(b)  # a no-op for the SQL store: its claim registered already
    assert current_fence(engine, key) == b.token

    with pytest.raises(StaleFencingToken):
        apply_delta(engine, key, account, a.token, -50)
    assert account_row(engine, account) == (450, a.token)
    apply_delta(engine, key, account, b.token, -50)
    assert account_row(engine, account) == (400, b.token)


def test_guard_rolled_back_with_the_callers_transaction(ledger_url: str) -> None:
    """The fence moves only with a committed write: a newer token whose
    transaction rolled back does not fence the older owner out."""
    engine = user_engine(ledger_url)
    create_accounts(engine)
    account = open_account(engine, 0)
    resource = f"account:{account}"
    apply_delta(engine, resource, account, 5, +1)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), engine.begin() as conn:
        apply_delta_in(conn, resource, account, 9, +1000)
        raise Boom
    assert current_fence(engine, resource) == 5
    assert account_row(engine, account) == (1, 5)
    apply_delta(engine, resource, account, 6, +1)  # 6 is still the newest that committed
    assert account_row(engine, account) == (2, 6)
    # The same token may pass the guard again (a retry of the same grant).
    with engine.begin() as conn:
        fencing.guard(conn, resource, 6)
    with pytest.raises(StaleFencingToken), engine.begin() as conn:
        fencing.guard(conn, resource, 5)
    engine.dispose()


def test_guard_rejects_malformed_arguments(ledger_url: str) -> None:
    engine = user_engine(ledger_url)
    with engine.begin() as conn:
        for resource, token in [("", 1), (None, 1), ("r", -1), ("r", True), ("r", 1.5)]:
            with pytest.raises(LeaseConfigError):
                fencing.guard(conn, resource, token)  # type: ignore[arg-type]
        assert fencing.current(conn, f"never-guarded-{new_key()}") is None
    engine.dispose()


def test_guard_names_an_unsupported_database(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = user_engine(sqlite_url)
    with engine.connect() as conn:
        monkeypatch.setattr(conn.dialect, "name", "mysql")
        with pytest.raises(LeaseConfigError, match="not 'mysql'"):
            fencing.guard(conn, "resource", 1)
    engine.dispose()


def test_headers_carry_the_fence(sqlite_url: str) -> None:
    store = LeaseStore.from_url(sqlite_url)
    key = new_key("http")
    lease = store.claim(key, ttl=LONG_TTL, owner_id="w1")
    assert lease is not None
    assert fencing.headers(lease) == {"Fencing-Token": str(lease.token), "Fencing-Key": key}
    store.release(lease)
    with store.hold(key, ttl=LONG_TTL) as held:
        headers = fencing.headers(held)
        assert headers == {"Fencing-Token": str(held.token), "Fencing-Key": key}
        assert int(headers["Fencing-Token"]) > lease.token
    # A service keeping the highest token per resource refuses the older one.
    seen: dict[str, int] = {}

    def service(h: dict[str, str]) -> bool:
        token = int(h["Fencing-Token"])
        if token < seen.get(h["Fencing-Key"], 0):
            return False
        seen[h["Fencing-Key"]] = token
        return True

    assert service(headers) and not service(fencing.headers(lease))
    store.close()


# --------------------------------------------------------------------------
# two real processes, interleaved
# --------------------------------------------------------------------------


def _stamp(path: Path, value: object = "") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(value))
    os.replace(tmp, path)


def _wait_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.005)


def guarded_writer(
    url: str, account: str, resource: str, token: int, delta: int, ctl: str, name: str
) -> None:
    """A worker in its own process: one fenced delta, committing when told to."""
    d = Path(ctl)
    engine = user_engine(url)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                _stamp(d / f"{name}.pid", conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())
                conn.commit()
            _stamp(d / f"{name}.attempt", time.time())
            try:
                with conn.begin():
                    apply_delta_in(conn, resource, account, token, delta)
                    _stamp(d / f"{name}.guarded", time.time())
                    _wait_file(d / f"{name}.commit")
                    commit_start = time.time()
                _stamp(d / f"{name}.outcome", f"committed {commit_start}")
            except StaleFencingToken:
                _stamp(d / f"{name}.outcome", f"stale {time.time()}")
    finally:
        engine.dispose()


def _died(*procs: Any) -> Any:
    """For wait_for(abort=...): stop waiting at once if a writer process died."""

    def check() -> str | None:
        dead = [p.name for p in procs if p.exitcode not in (None, 0)]
        return f"writer died: {dead}" if dead else None

    return check


def _outcome(ctl: Path, name: str) -> tuple[str, float]:
    path = ctl / f"{name}.outcome"
    wait_for(path.exists, 30, f"{name}'s outcome")
    word, stamp = path.read_text().split()
    return word, float(stamp)


def _wait_blocked(url: str, ctl: Path, name: str) -> None:
    """PostgreSQL: prove ``name`` waits on a row lock. SQLite: it started its transaction."""
    _wait_file(ctl / f"{name}.attempt")
    if url.startswith("sqlite"):
        return
    _wait_file(ctl / f"{name}.pid")
    pid = int((ctl / f"{name}.pid").read_text())
    engine = create_engine(url, poolclass=NullPool)

    def waiting_on_lock() -> bool:
        with engine.connect() as conn:
            kind = conn.execute(
                text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).scalar()
        return kind == "Lock"

    wait_for(waiting_on_lock, 30, f"{name} blocked on the fence row")
    engine.dispose()
    assert not (ctl / f"{name}.outcome").exists()


def _tokens(url: str, key: str) -> tuple[int, int]:
    store = LeaseStore.from_url(url)
    first = store.claim(key, ttl=LONG_TTL, owner_id="old")
    assert first is not None and store.release(first)
    second = store.claim(key, ttl=LONG_TTL, owner_id="new")
    assert second is not None and second.token > first.token
    return first.token, second.token


def test_two_processes_newer_holds_fence_older_waits_then_refused(
    ledger_url: str, tmp_path: Path
) -> None:
    """The newer writer holds the fence row; the older one's guard waits for it,
    then sees the newer token and is refused: a stale write never lands after."""
    engine = user_engine(ledger_url)
    create_accounts(engine)
    account = open_account(engine, 100)
    resource = f"account:{account}"
    t_old, t_new = _tokens(ledger_url, new_key("tok"))
    ctx = mp.get_context("spawn")
    new = ctx.Process(
        target=guarded_writer,
        args=(ledger_url, account, resource, t_new, +20, str(tmp_path), "new"),
        name="new",
    )
    old = ctx.Process(
        target=guarded_writer,
        args=(ledger_url, account, resource, t_old, +7, str(tmp_path), "old"),
        name="old",
    )
    try:
        new.start()
        wait_for(
            (tmp_path / "new.guarded").exists,
            30,
            "the newer writer inside its guard",
            abort=_died(new, old),
        )
        old.start()
        _wait_blocked(ledger_url, tmp_path, "old")
        _stamp(tmp_path / "new.commit")
        word_new, new_commit_start = _outcome(tmp_path, "new")
        word_old, old_done = _outcome(tmp_path, "old")
        assert (word_new, word_old) == ("committed", "stale")
        assert old_done > new_commit_start, "the older writer waited for the newer's commit"
        new.join(30)
        old.join(30)
        assert (new.exitcode, old.exitcode) == (0, 0)
    finally:
        for p in (new, old):
            if p.is_alive():
                p.kill()
    assert account_row(engine, account) == (120, t_new)
    assert current_fence(engine, resource) == t_new
    engine.dispose()


def test_two_processes_older_first_then_newer_in_order(ledger_url: str, tmp_path: Path) -> None:
    """The older writer holds the fence row (it is still the newest): the newer
    one waits, then lands after it. Afterwards the older token is refused."""
    engine = user_engine(ledger_url)
    create_accounts(engine)
    account = open_account(engine, 100)
    resource = f"account:{account}"
    t_old, t_new = _tokens(ledger_url, new_key("tok"))
    ctx = mp.get_context("spawn")
    old = ctx.Process(
        target=guarded_writer,
        args=(ledger_url, account, resource, t_old, +7, str(tmp_path), "old"),
        name="old",
    )
    new = ctx.Process(
        target=guarded_writer,
        args=(ledger_url, account, resource, t_new, +20, str(tmp_path), "new"),
        name="new",
    )
    try:
        old.start()
        wait_for(
            (tmp_path / "old.guarded").exists,
            30,
            "the older writer inside its guard",
            abort=_died(new, old),
        )
        new.start()
        _wait_blocked(ledger_url, tmp_path, "new")
        _stamp(tmp_path / "old.commit")
        assert _outcome(tmp_path, "old")[0] == "committed"
        wait_for(
            (tmp_path / "new.guarded").exists,
            30,
            "the newer writer inside its guard",
            abort=_died(new, old),
        )
        old_commit_start = _outcome(tmp_path, "old")[1]
        assert float((tmp_path / "new.guarded").read_text()) > old_commit_start
        _stamp(tmp_path / "new.commit")
        assert _outcome(tmp_path, "new")[0] == "committed"
        old.join(30)
        new.join(30)
        assert (old.exitcode, new.exitcode) == (0, 0)
    finally:
        for p in (new, old):
            if p.is_alive():
                p.kill()
    assert account_row(engine, account) == (127, t_new)
    with pytest.raises(StaleFencingToken):
        apply_delta(engine, resource, account, t_old, +7)
    assert account_row(engine, account) == (127, t_new)
    engine.dispose()
