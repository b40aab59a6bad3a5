"""Counting round trips on the servers' side: Redis MONITOR and commandstats,
pg_stat_statements, and the names of celery-lease's own scripts and statements."""

from __future__ import annotations

import re
import threading
import time
import uuid

from benchmarks.env import Env


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
