"""What the chaos run reads of the Celery result backend: Redis, or the ``lease`` backend.

``--backend redis`` (the default): Celery's Redis backend on a Redis of its
own that no fault touches; :class:`BackendMonitor` sees every write through
the backend's pub/sub channels. ``--backend lease``: the ``lease+`` backend on
the fenced result table's PostgreSQL database (the one the faults restart,
make read-only and stop), so a leased task's SUCCESS is written in its
commit's transaction; a trigger the harness installs (``META_HISTORY_DDL``)
copies every row the backend writes, with the writer's token and the
database's time, into ``chaos_meta_history``, which is how the checker sees
every write and which token made it (``stale_backend_write``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text

from tests.chaos.history import Backend

__all__ = [
    "META_HISTORY_DDL",
    "BackendMonitor",
    "LeaseBackendView",
    "RedisBackendView",
    "backend_of",
    "view_of",
]

#: Every row the lease backend writes (insert, or an update it was not refused),
#: copied in the same statement: a refused write changes no row, so it is not here.
META_HISTORY_DDL = [
    """CREATE TABLE chaos_meta_history (
        id bigserial PRIMARY KEY,
        key text NOT NULL,
        value text,
        token bigint,
        written_at double precision NOT NULL
    )""",
    """CREATE FUNCTION chaos_meta_history() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO chaos_meta_history (key, value, token, written_at)
        VALUES (NEW.key, NEW.value, NEW.token, extract(epoch FROM clock_timestamp()));
        RETURN NEW;
    END $$""",
    """CREATE TRIGGER chaos_meta_history AFTER INSERT OR UPDATE ON celery_lease_task_meta
    FOR EACH ROW EXECUTE FUNCTION chaos_meta_history()""",
]

_META = "celery-task-meta-"


class BackendMonitor:
    """Every state the result backend stores, as it is stored.

    Celery's Redis backend publishes each stored meta on the channel named
    like its key (``celery-task-meta-<id>``); subscribing to the pattern
    shows every write, not only the last one, so a final state that is
    later overwritten (FAILURE, then SUCCESS) is seen.
    """

    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self.path = path
        self.states: dict[str, list[Backend]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-monitor", daemon=True)
        self.subscribed = threading.Event()

    def start(self) -> None:
        self._thread.start()
        if not self.subscribed.wait(30):
            raise RuntimeError("could not subscribe to the result backend")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            client = redis.Redis.from_url(self.url)
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.psubscribe("celery-task-meta-*")
                self.subscribed.set()
                with open(self.path, "a") as fh:
                    while not self._stop.is_set():
                        msg = pubsub.get_message(timeout=0.5)
                        if msg is None or msg.get("type") != "pmessage":
                            continue
                        meta = json.loads(msg["data"])
                        tid = meta.get("task_id") or msg["channel"].decode()[17:]
                        b = backend_of(meta)
                        self.states.setdefault(tid, []).append(b)
                        fh.write(
                            json.dumps(
                                {"task_id": tid, "state": b.state, "exc": b.exc_type,
                                 "t": time.time()}
                            ) + "\n"
                        )  # fmt: skip
                        fh.flush()
            except redis.RedisError:
                time.sleep(0.5)
            finally:
                client.close()


def backend_of(meta: dict[str, Any]) -> Backend:
    """The checker's view of one stored meta (Celery's JSON)."""
    state = meta.get("status") or "PENDING"
    result = meta.get("result")
    if state == "FAILURE" and isinstance(result, dict):
        args = result.get("exc_message")
        if not isinstance(args, (list, tuple)):
            args = [args]
        return Backend(state, result.get("exc_type"), tuple(args))
    if state == "SUCCESS":
        return Backend(state, result=result)
    return Backend(state)


class RedisBackendView:
    """Celery's Redis backend: the states by ``MGET``, every write by pub/sub."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.url = url
        self.monitor = BackendMonitor(url, workdir / "backend_states.jsonl")

    def start(self) -> None:
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.stop()

    def states(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        client = redis.Redis.from_url(self.url)
        out: dict[str, dict[str, Any]] = {}
        try:
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                for tid, raw in zip(chunk, client.mget([f"{_META}{t}" for t in chunk])):
                    if raw is not None:
                        out[tid] = json.loads(raw)
        finally:
            client.close()
        return out

    def history(self) -> dict[str, list[Backend]]:
        return {k: list(v) for k, v in self.monitor.states.items()}


class LeaseBackendView:
    """The ``lease`` backend: the states from ``celery_lease_task_meta``, every
    write (with its token and time) from ``chaos_meta_history``."""

    def __init__(self, db_url: str) -> None:
        self.engine = create_engine(db_url, pool_pre_ping=True)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.engine.dispose()

    def states(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        keys = [f"{_META}{t}" for t in ids]
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT key, value FROM celery_lease_task_meta WHERE key = ANY(:keys) "
                    "AND (expires_at IS NULL OR expires_at > extract(epoch FROM now()))"
                ),
                {"keys": keys},
            )
            return {r.key[len(_META) :]: json.loads(r.value) for r in rows}

    def history(self) -> dict[str, list[Backend]]:
        out: dict[str, list[Backend]] = {}
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT key, value, token, written_at FROM chaos_meta_history "
                    "WHERE key LIKE :meta ORDER BY id"
                ),
                {"meta": f"{_META}%"},
            )
            for r in rows:
                b = backend_of(json.loads(r.value))
                written = Backend(b.state, b.exc_type, b.exc_args, b.result,
                                  r.token, float(r.written_at))  # fmt: skip
                out.setdefault(r.key[len(_META) :], []).append(written)
        return out


def view_of(kind: str, env: dict[str, str], results_url: str, workdir: Path) -> Any:
    """The run's view of its result backend (``--backend``)."""
    if kind == "lease":
        return LeaseBackendView(results_url)
    return RedisBackendView(env["CHAOS_BACKEND"], workdir)
