"""The servers and databases a benchmark run uses, and the machine it runs on."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The servers and databases a run uses


@dataclass
class Env:
    """Where the benchmarks run: a broker Redis, a lease-store Redis, PostgreSQL, a tmpdir.

    Private servers (started from ``tests/servers/``) unless URLs were given.
    The broker and the lease store are separate Redis servers when private;
    with ``--redis-url`` they are separate database numbers of that server.
    """

    tmpdir: Path
    quick: bool
    broker_redis: str  # redis://host:port  (no db)
    store_redis: str
    pg_base: str | None  # postgresql+psycopg://user@host:port  (no db)
    pg_admin_db: str = "postgres"
    pg_stat_statements: bool = False
    redis_db_base: int = 0
    servers: list[Any] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    #: --rounds: rounds for the drain sections (2 and 9) instead of their default
    rounds: int | None = None
    #: --contenders: section 2 runs only these (and plain, its baseline)
    contenders: tuple[str, ...] = ()
    _next_db: int = 0
    _pg_dbs: list[str] = field(default_factory=list)

    def server_groups(self) -> dict[str, set[int]]:
        """The private servers' process groups by kind, for :class:`CpuSampler`
        (empty for servers given by URL: their CPU shows only in the machine's)."""
        from tests.servers import PostgresServer, RedisServer

        groups: dict[str, set[int]] = {"PostgreSQL": set(), "Redis": set()}
        for server in self.servers:
            name = "PostgreSQL" if isinstance(server, PostgresServer) else (
                "Redis" if isinstance(server, RedisServer) else None)  # fmt: skip
            if name and server.pid is not None:
                groups[name].add(server.pid)  # started in a session of its own: pgid = pid
            if name == "PostgreSQL":  # the postmaster (its backends are its children)
                with contextlib.suppress(OSError, ValueError, IndexError):
                    pidfile = Path(server.data_dir) / "postmaster.pid"
                    groups[name].add(int(pidfile.read_text().split()[0]))
        return groups

    # -- Redis ----------------------------------------------------------
    def redis_db(self) -> int:
        """A fresh database number (on both Redis servers), emptied."""
        import redis

        n = self.redis_db_base + self._next_db
        self._next_db += 1
        if n > 63:
            raise RuntimeError("out of Redis database numbers")
        for base in {self.broker_redis, self.store_redis}:
            redis.Redis.from_url(f"{base}/{n}").flushdb()
        return n

    def broker_url(self, db: int) -> str:
        return f"{self.broker_redis}/{db}"

    def store_url(self, db: int) -> str:
        return f"{self.store_redis}/{db}"

    # -- PostgreSQL -------------------------------------------------------
    @property
    def has_pg(self) -> bool:
        return self.pg_base is not None

    def pg_dsn(self, db: str) -> str:
        assert self.pg_base is not None
        return self.pg_base.replace("postgresql+psycopg://", "postgresql://") + "/" + db

    def pg_url(self, db: str) -> str:
        assert self.pg_base is not None
        return f"{self.pg_base}/{db}"

    def pg_admin(self) -> Any:
        import psycopg

        return psycopg.connect(self.pg_dsn(self.pg_admin_db), autocommit=True)

    def pg_database(self, prefix: str, migrate: bool = True) -> str:
        """A fresh database (celery-lease tables applied); returns its SQLAlchemy URL."""
        name = f"bench_{prefix}_{uuid.uuid4().hex[:6]}"
        with self.pg_admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self._pg_dbs.append(name)
        url = self.pg_url(name)
        if migrate:
            import celery_lease

            celery_lease.migrate(url)
        return url

    def pg_drop(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        from celery_lease.sql import driver as q

        if q.normalize_sql_url(url) in q._databases:
            q._databases.pop(q.normalize_sql_url(url)).dispose()
        with self.pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        with contextlib.suppress(ValueError):
            self._pg_dbs.remove(name)

    def sqlite_url(self, name: str) -> str:
        path = self.tmpdir / f"{name}-{uuid.uuid4().hex[:6]}.sqlite3"
        return f"sqlite:///{path}"

    def close(self) -> None:
        if self.has_pg:
            for name in list(self._pg_dbs):
                with contextlib.suppress(Exception):
                    self.pg_drop(self.pg_url(name))
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.kill()
            with contextlib.suppress(Exception):
                server.cleanup()


def start_env(
    tmpdir: Path, quick: bool, redis_url: str | None, pg_url: str | None, need_pg: bool = True
) -> Env:
    servers: list[Any] = []
    from tests.servers import PostgresServer, RedisServer

    if redis_url:
        base, _, db = redis_url.rstrip("/").rpartition("/")
        if not db.isdigit():
            base, db = redis_url.rstrip("/"), "0"
        broker = store = base
        db_base = int(db)
    else:
        b = RedisServer(tmpdir, appendonly=False)
        b.start()
        s = RedisServer(tmpdir, appendonly=False)
        s.start()
        servers += [b, s]
        broker, store, db_base = b.url(0)[:-2], s.url(0)[:-2], 0
    pg_base: str | None = None
    admin_db = "postgres"
    if pg_url:
        from celery_lease.sql import normalize_sql_url

        pg_url = normalize_sql_url(pg_url)
        pg_base, _, admin_db = pg_url.rpartition("/")
        admin_db = admin_db or "postgres"
    elif need_pg:
        p = PostgresServer(
            tmpdir,
            settings={
                "shared_preload_libraries": "pg_stat_statements",
                "pg_stat_statements.track": "all",
                "pg_stat_statements.max": 10000,
                "max_connections": 200,
                "shared_buffers": "256MB",
            },
        )
        p.start()
        servers.append(p)
        pg_base = p.url("postgres").rsplit("/", 1)[0]
    env = Env(
        tmpdir=tmpdir,
        quick=quick,
        broker_redis=broker,
        store_redis=store,
        pg_base=pg_base,
        pg_admin_db=admin_db,
        redis_db_base=db_base,
        servers=servers,
    )
    if pg_base is not None:
        try:
            with env.pg_admin() as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.execute("SELECT pg_stat_statements_reset()")
            env.pg_stat_statements = True
        except Exception as e:  # noqa: BLE001 - reported in the tables instead
            log(f"pg_stat_statements unavailable ({e}); PostgreSQL round trips not counted")
    env.versions = versions(env)
    return env


# ---------------------------------------------------------------------------
# The machine


def versions(env: Env) -> dict[str, str]:
    import celery
    import kombu
    import redis
    import sqlalchemy

    out = {
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "redis-py": redis.__version__,
        "SQLAlchemy": sqlalchemy.__version__,
    }
    with contextlib.suppress(Exception):
        import psycopg

        out["psycopg"] = psycopg.__version__
    import sqlite3

    out["SQLite"] = sqlite3.sqlite_version
    with contextlib.suppress(Exception):
        out["Redis server"] = str(
            redis.Redis.from_url(env.store_redis).info("server")["redis_version"]
        )
    if env.has_pg:
        with contextlib.suppress(Exception), env.pg_admin() as conn:
            row = conn.execute("SHOW server_version").fetchone()
            out["PostgreSQL server"] = str(row[0]) if row else "?"
    from importlib.metadata import PackageNotFoundError, version

    for dist in (
        "celery-lease",
        "celery-once",
        "celery-singleton",
        "fencekit",
        "python-redis-lock",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def machine() -> dict[str, str]:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    load = ""
    with contextlib.suppress(OSError):
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return {
        "nproc": nproc or str(os.cpu_count()),
        "CPU": model,
        "memory": mem,
        "kernel": platform.release(),
        "OS": _os_name(),
        "load average at start": load,
    }


def _os_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return platform.platform()
