"""Shared plumbing: the servers, interleaving, statistics, counters, tables, profiles."""

from __future__ import annotations

import contextlib
import cProfile
import itertools
import math
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
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

    Private servers (started from ``tests/servers.py``) unless URLs were given.
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


# ---------------------------------------------------------------------------
# Statistics


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_interval(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``xs`` (one value per round),
    or None when there are too few values for one at this ``confidence``.

    The rounds' order statistics: the true median lies below the k-th smallest
    value with probability P(Binomial(n, 1/2) < k), so [x(k), x(n+1-k)] with the
    largest k whose two tails together stay within 1 - ``confidence`` covers it
    at least that often. No assumption about how the noise is distributed,
    which on a shared machine is anything but normal.
    """
    n = len(xs)
    tail = (1.0 - confidence) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2**n
        if nxt > tail:
            break
        k, below = k + 1, nxt
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


def percentile(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt_rate(x: float) -> str:
    if x != x:
        return "n/a"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def fmt_ratio(x: float | None) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:.2f}\u00d7"


def fmt_us(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    us = seconds * 1e6
    if us >= 10000:
        return f"{us / 1000:,.1f} ms"
    return f"{us:,.0f} µs"


def fmt_ms(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    return f"{seconds * 1000:,.2f} ms"


def interleave(
    contenders: Sequence[str],
    rounds: int,
    measure: Callable[[str, int], float | None],
) -> dict[str, list[float]]:
    """Run ``measure(name, round)`` for every contender in turn, ``rounds`` times:
    A, B, C, A, B, C, ... (the order rotates each round so no contender always
    follows the same one). Returns the samples per contender (None is skipped)."""
    samples: dict[str, list[float]] = {c: [] for c in contenders}
    n = len(contenders)
    for r in range(rounds):
        order = [contenders[(i + r) % n] for i in range(n)] if n else []
        for c in order:
            value = measure(c, r)
            if value is not None:
                samples[c].append(value)
    return samples


def paired_ratios(samples: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Median over rounds of (contender / baseline in the same round)."""
    base = samples.get(baseline, [])
    out: dict[str, float] = {}
    for c, xs in samples.items():
        pairs = [x / b for x, b in zip(xs, base) if b]
        out[c] = median(pairs) if pairs and len(xs) == len(base) else float("nan")
    return out


# ---------------------------------------------------------------------------
# Counting round trips on the server side


class RedisMonitor:
    """Counts the commands clients send to one Redis database, with ``MONITOR``.

    ``INFO commandstats`` also counts the commands a Lua script runs inside
    the server, so it cannot tell round trips from work; ``MONITOR`` marks
    those as ``lua``. ``top`` counts commands from network clients (round
    trips; a pipeline's commands count one each), ``inner`` those run by scripts.
    """

    def __init__(self, url: str, db: int) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.db = db
        self.top = 0
        self.inner = 0
        self.by_command: dict[str, int] = {}
        self._seen: set[str] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.marker = f"bench-monitor-{uuid.uuid4().hex}"

    def _run(self) -> None:
        with self.client.monitor() as m:
            self._ready.set()
            for cmd in m.listen():
                text = str(cmd.get("command", ""))
                if self.marker in text:
                    self._seen.add(text.split(" ", 1)[-1].strip("\"'"))
                    if text.endswith("-stop") or text.endswith('-stop"'):
                        return
                    continue
                if int(cmd.get("db", -1)) != self.db:
                    continue
                if cmd.get("client_type") == "lua":
                    self.inner += 1
                else:
                    self.top += 1
                    parts = text.split(" ", 2)
                    name = parts[0].upper()
                    if name in ("EVALSHA", "EVALSHA_RO") and len(parts) > 1:
                        name = f"{name} {script_name(parts[1])}"
                    self.by_command[name] = self.by_command.get(name, 0) + 1

    def __enter__(self) -> RedisMonitor:
        self._thread.start()
        self._ready.wait(5)
        self.sync()
        return self

    def sync(self) -> None:
        """Wait until MONITOR has shown every command sent before this call."""
        token = f"{self.marker}-sync-{uuid.uuid4().hex}"
        self.client.get(token)
        deadline = time.monotonic() + 10
        while token not in self._seen and time.monotonic() < deadline:
            time.sleep(0.005)

    def reset(self) -> None:
        self.sync()
        self.top = self.inner = 0
        self.by_command = {}

    def snapshot(self) -> tuple[int, int, dict[str, int]]:
        self.sync()
        return self.top, self.inner, dict(self.by_command)

    def __exit__(self, *exc: object) -> None:
        self.client.get(f"{self.marker}-stop")
        self._thread.join(5)
        self.client.close()


def redis_commandstats(url: str) -> dict[str, int]:
    import redis

    info = redis.Redis.from_url(url).info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def pg_statements(env: Env, db_url: str) -> dict[str, int]:
    """pg_stat_statements calls per statement text, for one database."""
    name = db_url.rsplit("/", 1)[1]
    with env.pg_admin() as conn:
        rows = conn.execute(
            "SELECT s.query, sum(s.calls) FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s GROUP BY s.query",
            (name,),
        ).fetchall()
    return {str(q): int(c) for q, c in rows}


def pg_reset_statements(env: Env) -> None:
    with env.pg_admin() as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


_scripts: dict[str, str] = {}


def script_name(sha: str) -> str:
    """The name of a celery-lease Lua script (``CLAIM``, ``RELEASE``, ...) from its SHA1."""
    if not _scripts:
        import hashlib

        from celery_lease.stores import redis as module

        for name, value in vars(module).items():
            if name.isupper() and isinstance(value, str) and "redis.call" in value:
                _scripts[hashlib.sha1(value.encode()).hexdigest()] = name
    name = _scripts.get(sha.strip("\"'"))
    return f"({name} script)" if name else f"({sha[:8]}…)"


def _norm_sql(sql: str) -> str:
    s = re.sub(r"\$\d+|(?<![:\w]):\w+|'[^']*'|\b\d+(?:\.\d+)?\b|\?", "?", sql)
    return re.sub(r"\s+", " ", s).strip().lower()


_sql_names: list[tuple[str, str]] = []


def sql_name(query: str) -> str | None:
    """The name of the ``celery_lease/sql`` statement a statement comes from, if any."""
    if not _sql_names:
        from celery_lease.sql.dialects import DIALECTS, rendered

        for dialect in DIALECTS:
            for name, text in rendered(dialect):
                _sql_names.append((_norm_sql(text), name))
    n = _norm_sql(query)
    for text, name in _sql_names:
        if n == text:
            return name
    for text, name in _sql_names:
        k = min(len(text), len(n), 80)
        if k > 30 and n[:k] == text[:k]:
            return name
    return None


def short_sql(q: str, width: int = 70) -> str:
    one = re.sub(r"\s+", " ", q).strip()
    return one if len(one) <= width else one[: width - 1] + "…"


# ---------------------------------------------------------------------------
# Profiles: where the time goes, by package

_CATEGORIES = (
    ("celery_lease", "celery-lease (own code)"),
    ("sqlalchemy", "SQLAlchemy"),
    ("psycopg", "psycopg"),
    ("redis", "redis-py"),
    ("kombu", "kombu (broker)"),
    ("celery", "Celery"),
    ("billiard", "billiard"),
    ("alembic", "alembic"),
    ("prometheus_client", "prometheus-client"),
    ("sqlite3", "sqlite3"),
)


def _category(filename: str, funcname: str) -> str:
    if filename == "~":
        lowered = funcname.lower()
        if "sqlite3" in lowered:
            return "sqlite3 C calls (SQLite work, fsync at COMMIT)"
        if "sleep" in lowered:
            return "time.sleep"
        if any(
            w in lowered
            for w in ("recv", "send", "select", "poll", "connect", "sendall", "read", "write")
        ):
            return "sockets / poll / file I/O (waiting on servers)"
        return "builtins"
    parts = Path(filename).parts
    for marker, label in _CATEGORIES:
        if marker in parts or any(p.startswith(marker) for p in parts[-3:]):
            return label
    if "benchmarks" in parts:
        return "benchmark harness"
    return "stdlib / other"


def profile_summary(stats: pstats.Stats, per: int, unit: str = "task", top: int = 8) -> str:
    """A markdown summary of self time by package, and the heaviest functions."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1e-9
    by_cat: dict[str, float] = {}
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
        cat = _category(filename, func)
        by_cat[cat] = by_cat.get(cat, 0.0) + tt
    lines = [
        f"Self time by package (cProfile; {per} {unit}s; µs per {unit}, share of profiled time):",
        "",
        f"| package | µs per {unit} | share |",
        "|---|---:|---:|",
    ]
    for cat, tt in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        if tt / total < 0.01:
            continue
        lines.append(f"| {cat} | {tt / per * 1e6:,.0f} | {tt / total:.0%} |")
    lines += [
        "",
        f"Heaviest functions by cumulative time (µs per {unit}, calls per {unit}):",
        "",
        f"| function | cumulative µs per {unit} | calls per {unit} |",
        "|---|---:|---:|",
    ]
    ranked = sorted(raw.items(), key=lambda kv: -kv[1][3])
    shown = 0
    for (filename, line, func), (_cc, nc, _tt, ct, _callers) in ranked:
        if not any(m in filename for m in ("celery_lease", "sqlalchemy", "psycopg", "redis")):
            continue
        where = _short_path(filename)
        lines.append(f"| `{where}:{line}({func})` | {ct / per * 1e6:,.0f} | {nc / per:.1f} |")
        shown += 1
        if shown >= top:
            break
    return "\n".join(lines)


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    for i, p in enumerate(parts):
        if p in ("celery_lease", "sqlalchemy", "psycopg", "redis", "kombu", "celery"):
            return "/".join(parts[i:])
    return Path(filename).name


@contextlib.contextmanager
def profiled() -> Iterator[cProfile.Profile]:
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


# ---------------------------------------------------------------------------
# Markdown


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    align: str = ""  # one char per column: l or r

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        align = self.align or ("l" + "r" * (len(self.columns) - 1))
        sep = ["---:" if a == "r" else "---" for a in align]
        out = ["| " + " | ".join(self.columns) + " |", "| " + " | ".join(sep) + " |"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(out)


@dataclass
class Section:
    """One benchmark's part of BENCHMARKS.md."""

    name: str
    title: str
    intro: str = ""
    blocks: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: one-line headline results for the summary at the top of BENCHMARKS.md
    summary: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.blocks.append(text.strip("\n"))

    def markdown(self) -> str:
        parts = [f"## {self.title}", ""]
        if self.intro:
            parts += [self.intro.strip(), ""]
        for b in self.blocks:
            parts += [b, ""]
        parts.append(f"_Benchmark wall time: {self.seconds:.1f} s._")
        return "\n".join(parts)


def mark(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "missed")


def target_line(met: bool | None, text: str) -> str:
    shown = mark(met) if met is None else f"**{mark(met)}**"
    return f"Target: {text}: {shown}."


def profile_compare(profiles: dict[str, tuple[pstats.Stats, int]], unit: str = "task") -> str:
    """Self time by package, µs per ``unit``, one column per profiled contender."""
    cats: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    for name, (stats, per) in profiles.items():
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
            cat = _category(filename, func)
            cats.setdefault(cat, {})
            cats[cat][name] = cats[cat].get(name, 0.0) + tt / per
        totals[name] = sum(v[2] for v in raw.values()) / per
    names = list(profiles)
    table = Table(["package (self time)", *[f"{n}: µs per {unit}" for n in names]])
    for cat, per_name in sorted(cats.items(), key=lambda kv: -max(kv[1].values())):
        if max(per_name.values()) < 0.01 * max(totals.values()):
            continue
        table.add(cat, *[f"{per_name.get(n, 0.0) * 1e6:,.0f}" for n in names])
    table.add("**total profiled**", *[f"**{totals[n] * 1e6:,.0f}**" for n in names])
    return table.markdown()


def top_functions(
    stats: pstats.Stats, per: int, marker: str, unit: str = "task", top: int = 10
) -> str:
    """The heaviest functions (cumulative) whose file path contains ``marker``."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    table = Table([f"function ({marker})", f"cumulative µs per {unit}", f"calls per {unit}"])
    ranked = sorted(raw.items(), key=lambda kv: -kv[1][3])
    for (filename, line, func), (_cc, nc, _tt, ct, _callers) in ranked:
        if marker not in filename:
            continue
        table.add(
            f"`{_short_path(filename)}:{line}({func})`", f"{ct / per * 1e6:,.0f}", f"{nc / per:.1f}"
        )
        if len(table.rows) >= top:
            break
    return table.markdown()


def by_package(stats: pstats.Stats, per: int) -> dict[str, float]:
    """Self time per package, seconds per unit."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
        cat = _category(filename, func)
        out[cat] = out.get(cat, 0.0) + tt / per
    return out


def cumulative(stats: pstats.Stats, per: int, path_part: str, func: str) -> float | None:
    """Cumulative seconds per unit of ``func`` in files whose path contains ``path_part``;
    None if no such function ran under the profile (a renamed or moved one reads as
    missing, never as 0)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    found = [v[3] for (f, _l, fn), v in raw.items() if fn == func and path_part in f]
    return sum(found) / per if found else None


# ---------------------------------------------------------------------------
# CPU accounting: which processes spent the machine's CPU during a drain

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_cpu() -> tuple[float, float]:
    """(busy, iowait) CPU seconds since boot, all cores (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    busy = sum(fields[:3]) + sum(fields[5:8])
    return busy / _TICK, fields[4] / _TICK


def _group_cpu(groups: dict[str, set[int]]) -> dict[str, float]:
    """CPU seconds (user + system, with reaped children) by named groups of
    processes: a process belongs to a group that names its process group, its
    parent or itself (PostgreSQL's backends each start a session of their own,
    so they are found as the postmaster's children)."""
    out = dict.fromkeys(groups, 0.0)
    owner = {pid: name for name, pids in groups.items() for pid in pids}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                stat = fh.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        rest = stat[stat.rfind(")") + 2 :].split()
        for pid in (int(entry.name), int(rest[1]), int(rest[2])):  # itself, parent, group
            name = owner.get(pid)
            if name is not None:
                out[name] += sum(int(x) for x in rest[11:15]) / _TICK  # utime stime cutime cstime
                break
    return out


class CpuSampler:
    """Samples, every ``interval`` s, the CPU time of named process groups and of
    the whole machine; :meth:`between` interpolates the counters at two instants
    (e.g. a drain's first and last completion, whose timestamps the workers write).
    Linux only; elsewhere :meth:`between` returns None."""

    def __init__(self, groups: dict[str, set[int]], interval: float = 0.1) -> None:
        self.groups = {name: set(pgids) for name, pgids in groups.items()}
        self.interval = interval
        #: name -> pid: that one process's own CPU (no children), e.g. a worker's
        #: main process apart from its pool processes
        self.alone: dict[str, int] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, pgid: int) -> None:
        with self._lock:
            self.groups.setdefault(name, set()).add(pgid)

    def watch_alone(self, name: str, pid: int) -> None:
        with self._lock:
            self.alone[name] = pid

    def _sample(self) -> None:
        with self._lock:
            groups = {name: set(p) for name, p in self.groups.items()}
            alone = dict(self.alone)
        t = time.time()
        values = _group_cpu(groups)
        for name, pid in alone.items():
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/stat") as fh:
                    rest = fh.read().rsplit(")", 1)[1].split()
                values[name] = (int(rest[11]) + int(rest[12])) / _TICK  # utime stime
        values["machine"], values["iowait"] = _machine_cpu()
        self.samples.append((t, values))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                self._sample()
                return

    def start(self) -> CpuSampler:
        if os.path.exists("/proc/stat"):
            self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        """CPU seconds each group (and ``machine``: all processes, ``iowait``) spent
        from ``t0`` to ``t1``, counters interpolated linearly between samples."""
        s = self.samples
        if len(s) < 2 or not (s[0][0] <= t0 < t1 <= s[-1][0]):
            return None
        # a group's first sample may predate its processes: counters only grow
        return {name: self._at(t1, name) - self._at(t0, name) for name in s[-1][1]}

    def _at(self, t: float, name: str) -> float:
        s = self.samples
        for (ta, va), (tb, vb) in itertools.pairwise(s):
            if ta <= t <= tb:
                a, b = va.get(name, 0.0), vb.get(name, 0.0)
                return a + (b - a) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
        raise ValueError(f"{t} outside the samples")
