"""The faults where a server answers errors, stays away long, or a child dies after commit.

Each one proves it happened (a probe's error reply, a refused connection, a
history line and the child's death) before it counts, and heals itself after
a bounded spell; the proof goes into ``faults.jsonl`` with the fault.

``store_oom``           the lease store's Redis answers OOM: ``maxmemory`` below
                        ``used_memory`` with ``noeviction``, for 1..3 s
``store_readonly``      the lease store's Redis answers READONLY: ``FAILOVER`` to
                        the spare replica, 2..4 s, ``FAILOVER`` back
``results_readonly``    PostgreSQL refuses writes: ``default_transaction_read_only``
                        on the result database and its backends terminated, 2..4 s
``store_long_outage``   the lease store stopped until a probe task was delivered
                        more than ``lease_defer_max`` times (bounded)
``results_long_outage`` likewise PostgreSQL (the fenced result table); no broker
                        fault runs during either (the probe must be delivered)
``kill_after_commit``   a prefork child SIGKILLs itself between the accepted fenced
                        commit and the result-backend write (armed, one shot)
``publish_error``       a worker's next deferral re-publish fails inside kombu (a
                        header its encoder refuses: no connection or channel
                        error; armed, one shot)

Why READONLY by ``FAILOVER``: ``REPLICAOF`` alone makes the store drop its
data and load the master's, leases and fencing counters gone (a failover with
data loss, another fault). ``FAILOVER`` is Redis's own planned switch-over:
it pauses writes, waits for the replica to hold every write, then swaps the
roles, and the old master continues from the same replication stream
(partial resync) with its data; clients still connected to it (ours: nobody
re-resolves the address) get ``READONLY``, as after a managed-Redis
maintenance failover. ``failovers_full_syncs`` in the proof says whether the
store reloaded a dataset (it must stay 0).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from tests.chaos.app import KILL_ARM, PUBLISH_ARM
from tests.chaos.cluster import DEFER_MAX, STORE_RETRY, ChaosWorker
from tests.servers import LOOPBACK

__all__ = ["SERVER_KINDS", "ServerFaults"]

SERVER_KINDS = (
    "store_oom",
    "store_readonly",
    "results_readonly",
    "store_long_outage",
    "results_long_outage",
    "kill_after_commit",
    "publish_error",
)
#: PostgreSQL's reply to a write in a read-only transaction (SQLSTATE 25006)
READ_ONLY_PROBE = "UPDATE celery_lease_fences SET fencing_token = fencing_token WHERE false"
#: the longest a long outage lasts when the probe does not come round enough
LONG_OUTAGE_MAX = 40.0
#: ``chaos.probe``'s lease TTL (tests/chaos/app.py)
PROBE_TTL = 1.0
#: how long a long outage waits for the earlier probes to end before it starts
PROBE_SETTLE = 60.0
#: a probe not delivered this long after its publish is taken as lost (broker fault)
PROBE_UNSEEN = 8.0
#: how long ``kill_after_commit`` waits for a commit on the armed worker: an
#: outage of the lease store or the result database (another fault, maybe a
#: long one) stops every commit meanwhile
KILL_WINDOW = 90.0


def _error_of(fn: Any) -> str | None:
    """The error ``fn()`` raised, as text (None: it succeeded)."""
    try:
        fn()
    except (redis.RedisError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _refused(port: int) -> str:
    """Proof that nothing listens on ``port`` (raises if something does)."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=2.0):
            pass
    except ConnectionRefusedError as e:
        return f"{type(e).__name__}: {e}"
    raise RuntimeError(f"port {port} still accepts connections")


class ServerFaults:
    """Mixed into :class:`tests.chaos.faults.Injector` (``self.c``, ``self.rng``, ...)."""

    c: Any
    rng: Any
    log: Any
    #: publishes a probe task (task id, key) on the probe queue; set by the runner
    publish_probe: Any
    #: the probes of the long outages that ended (task ids)
    _probes: list[str]

    # -- Redis answers errors ------------------------------------------------

    def _store_client(self, port: int | None = None) -> redis.Redis:
        assert self.c.store is not None
        return redis.Redis(
            host=LOOPBACK, port=port or self.c.store.port, socket_timeout=5,
            socket_connect_timeout=5,
        )  # fmt: skip

    def _f_store_oom(self, _: str) -> dict[str, Any]:
        r = self._store_client()
        try:
            policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
            used = int(r.info("memory")["used_memory"])
            limit = max(1, int(used * 0.8))
            hold = self.rng.uniform(1.0, 3.0)
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", limit)
            try:
                first = _error_of(lambda: r.set("chaos:probe:oom", "1"))
                if first is None or "OutOfMemoryError" not in first:
                    raise RuntimeError(f"a probe write was not refused with OOM: {first}")
                time.sleep(hold)
                last = _error_of(lambda: r.set("chaos:probe:oom", "1"))
            finally:
                r.config_set("maxmemory", 0)
                r.config_set("maxmemory-policy", policy)
            healed = _error_of(lambda: r.delete("chaos:probe:oom"))
            if healed is not None:
                raise RuntimeError(f"the store still refuses writes after the spell: {healed}")
            return {"used_memory": used, "maxmemory": limit, "seconds": round(hold, 2),
                    "probe": first, "probe_at_end": last}  # fmt: skip
        finally:
            r.close()

    def _f_store_readonly(self, _: str) -> dict[str, Any]:
        assert self.c.spare is not None
        store, spare = self._store_client(), self._store_client(self.c.spare.port)
        try:
            self._wait_replica_up(spare, "the spare")
            full_before = int(spare.info("stats")["sync_full"])
            hold = self.rng.uniform(2.0, 4.0)
            store.execute_command("FAILOVER", "TIMEOUT", 5000)
            try:
                self._wait_role(store, "slave", "the store demoted")
                probe = _error_of(lambda: store.set("chaos:probe:readonly", "1"))
                if probe is None or "ReadOnlyError" not in probe:
                    raise RuntimeError(f"a probe write was not refused with READONLY: {probe}")
                time.sleep(hold)
                last = _error_of(lambda: store.set("chaos:probe:readonly", "1"))
                self._wait_replica_up(store, "the store as a replica")
            finally:
                self._fail_back(store, spare)
            full_syncs = int(spare.info("stats")["sync_full"]) - full_before
            healed = _error_of(lambda: store.delete("chaos:probe:readonly"))
            if healed is not None:
                raise RuntimeError(f"the store still refuses writes after the spell: {healed}")
            return {"seconds": round(hold, 2), "probe": probe, "probe_at_end": last,
                    "failovers_full_syncs": full_syncs}  # fmt: skip
        finally:
            store.close()
            spare.close()

    def _fail_back(self, store: redis.Redis, spare: redis.Redis) -> None:
        """Make the store the master again, keeping its data whatever happens."""
        try:
            if store.info("replication")["role"] == "slave":
                spare.execute_command("FAILOVER", "TIMEOUT", 5000)
                self._wait_role(store, "master", "the store promoted back")
        except (redis.RedisError, RuntimeError) as e:
            # A promotion never discards data: take the store back by force.
            self.log(f"store_readonly: FAILOVER back failed ({e!r}); REPLICAOF NO ONE")
            store.execute_command("REPLICAOF", "NO", "ONE")
        if spare.info("replication")["role"] != "slave":
            spare.execute_command("REPLICAOF", LOOPBACK, str(self.c.store.port))

    @staticmethod
    def _wait_role(r: redis.Redis, role: str, what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while r.info("replication")["role"] != role:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: role not {role} after {timeout:.0f}s")
            time.sleep(0.05)

    @staticmethod
    def _wait_replica_up(r: redis.Redis, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while r.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: replication link not up after {timeout:.0f}s")
            time.sleep(0.1)

    # -- PostgreSQL refuses writes --------------------------------------------

    def _pg_admin(self) -> Any:
        import psycopg

        assert self.c.pg is not None
        return psycopg.connect(self.c.pg.dsn("postgres"), autocommit=True, connect_timeout=10)

    def _terminate_results_backends(self, admin: Any) -> int:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (self._results_db(),),
        ).fetchall()
        return len(rows)

    def _results_db(self) -> str:
        return str(self.c.results_url).rsplit("/", 1)[1]

    def _results_probe(self) -> str | None:
        import psycopg

        assert self.c.pg is not None
        try:
            with psycopg.connect(self.c.pg.dsn(self._results_db()), connect_timeout=10) as conn:
                conn.execute(READ_ONLY_PROBE)
        except psycopg.Error as e:
            return f"{type(e).__name__}: {e}".strip()
        return None

    def _f_results_readonly(self, _: str) -> dict[str, Any]:
        db = self._results_db()
        hold = self.rng.uniform(2.0, 4.0)
        with self._pg_admin() as admin:
            admin.execute(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
            try:
                killed = self._terminate_results_backends(admin)
                probe = self._results_probe()
                if probe is None or "read-only transaction" not in probe:
                    raise RuntimeError(f"a probe write was not refused as read-only: {probe}")
                time.sleep(hold)
                last = self._results_probe()
            finally:
                admin.execute(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
                # Sessions opened during the spell stay read-only: end them too.
                reopened = self._terminate_results_backends(admin)
        healed = self._results_probe()
        if healed is not None:
            raise RuntimeError(f"the result database still refuses writes: {healed}")
        return {"seconds": round(hold, 2), "terminated": killed, "terminated_at_end": reopened,
                "probe": probe, "probe_at_end": last}  # fmt: skip

    # -- long outages -----------------------------------------------------------

    def _f_store_long_outage(self, _: str) -> dict[str, Any]:
        assert self.c.store is not None
        return self._long_outage(self.c.store, "lease store (Redis)", self.c.store.stop)

    def _f_results_long_outage(self, _: str) -> dict[str, Any]:
        assert self.c.pg is not None
        pg = self.c.pg
        return self._long_outage(pg, "PostgreSQL", lambda: pg.stop("fast"))

    def _long_outage(self, server: Any, what: str, stop: Any) -> dict[str, Any]:
        """Stop ``server`` until a probe task has been delivered more than
        ``lease_defer_max`` times while it was away (each delivery, after the
        first, comes from a deferral: the outage outlasted the budget), or
        ``LONG_OUTAGE_MAX`` seconds; then start it again."""
        # The probe must find the probe worker free: an earlier probe still
        # being delivered (its outage ended mid-deferral) would hold a slot,
        # and this probe would wait behind it and prove nothing.
        self._probes_settled(PROBE_SETTLE)
        started = time.monotonic()
        stop()
        probes: list[str] = []
        try:
            refused = _refused(server.port)
            if self.publish_probe is None:
                raise RuntimeError("no probe publisher")
            deliveries, published = 0, 0.0
            while time.monotonic() - started < LONG_OUTAGE_MAX:
                if not probes or (deliveries == 0 and time.monotonic() - published > PROBE_UNSEEN):
                    # A probe never delivered was lost with a broker fault
                    # (a hard restart drops what its AOF had not synced): publish
                    # another one.
                    probes.append(str(uuid.uuid4()))
                    self.publish_probe(probes[-1], f"p-{probes[-1][:8]}")
                    published = time.monotonic()
                deliveries = self._probe_counts(probes[-1:])[0].get(probes[-1], 0)
                if deliveries > DEFER_MAX:
                    # The last delivery must meet the outage too, to its end: past
                    # its claim's retries (store) or its lease (result database).
                    time.sleep(max(STORE_RETRY, PROBE_TTL) + 1.5)
                    break
                time.sleep(0.25)
            refused_at_end = _refused(server.port)
        finally:
            server.start()
            self._probes.extend(probes)  # each must end before the next outage starts
        seconds = time.monotonic() - started
        probe_id = probes[-1]
        if deliveries <= DEFER_MAX:
            # The server was away, but not for as long as the kind says: not counted.
            raise RuntimeError(
                f"{what} down {seconds:.1f}s, probe {probe_id} delivered only {deliveries} "
                f"time(s), not more than lease_defer_max={DEFER_MAX}"
            )
        return {"server": what, "seconds": round(seconds, 2), "refused": refused,
                "refused_at_end": refused_at_end, "probe": probe_id,
                "probe_key": f"p-{probe_id[:8]}", "probes_published": len(probes),
                "probe_deliveries": deliveries, "lease_defer_max": DEFER_MAX,
                "lease_store_retry": STORE_RETRY,
                "outlasted_budget": deliveries > DEFER_MAX
                and seconds > DEFER_MAX * STORE_RETRY}  # fmt: skip

    def _probes_settled(self, timeout: float) -> None:
        """Wait until every delivered probe of an ended outage ended (SUCCESS or
        FAILURE in the history), for at most ``timeout`` s.

        A probe never delivered was lost by the broker: nothing to wait for. A
        probe that has not ended by then is no longer waited for (logged): its
        last copy went with a broker fault after the outage (a hard restart
        drops what the AOF had not synced), and waiting for it would refuse
        every later long outage. The checker still judges it at the end: lost
        by the transport, or a violation.
        """
        deadline = time.monotonic() + timeout
        while True:
            delivered, ended = self._probe_counts(self._probes)
            open_ = set(delivered) - ended
            if not open_:
                return
            if time.monotonic() > deadline:
                self._probes = [p for p in self._probes if p not in open_]
                self.log(
                    f"probe(s) {sorted(open_)} not ended within {timeout:.0f}s: "
                    "no longer waited for (the checker judges them)"
                )
                return
            time.sleep(0.25)

    def _probe_counts(self, task_ids: list[str]) -> tuple[dict[str, int], set[str]]:
        """Per probe, its deliveries (``prerun`` lines) and whether it ended."""
        delivered: dict[str, int] = {}
        ended: set[str] = set()
        path = Path(self.c.history)
        if not task_ids or not path.exists():
            return delivered, ended
        wanted = {t.encode(): t for t in task_ids}
        with open(path, "rb") as fh:
            for line in fh:
                prerun = b'"ev": "prerun"' in line
                final = b'"ev": "postrun"' in line and (
                    b'"SUCCESS"' in line or b'"FAILURE"' in line
                )
                if not (prerun or final):
                    continue
                for needle, task_id in wanted.items():
                    if needle in line:
                        if prerun:
                            delivered[task_id] = delivered.get(task_id, 0) + 1
                        else:
                            ended.add(task_id)
        return delivered, ended

    # -- a child dies between the commit and the backend write ----------------------

    def _fire_armed(self, w: ChaosWorker, arm_file: str, event: str, what: str) -> dict[str, Any]:
        """Arm ``w`` (the one-shot file ``arm_file``), wait for an execution to
        take the shot (``what``: what it waits for) and return its history line."""
        arm = Path(arm_file.format(history=self.c.history, hostname=w.hostname))
        nonce = uuid.uuid4().hex
        arm.write_text(nonce)
        deadline = time.monotonic() + KILL_WINDOW
        while arm.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            arm.unlink()
            raise RuntimeError(f"no {what} on {w.name} within {KILL_WINDOW:.0f}s: disarmed")
        except FileNotFoundError:
            pass  # an execution took the shot
        rec = None
        deadline = time.monotonic() + 10.0
        while rec is None and time.monotonic() < deadline:
            rec = self._history_record(event, nonce)
            time.sleep(0.1)
        if rec is None:
            raise RuntimeError(f"armed {w.name}, the shot was taken, no history line")
        return rec

    def _f_kill_after_commit(self, w: ChaosWorker) -> dict[str, Any]:
        rec = self._fire_armed(w, KILL_ARM, "kill_after_commit", "commit")
        pid = int(rec["pid"])
        deadline = time.monotonic() + 10.0
        while _alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"child {pid} still alive after kill_after_commit")
            time.sleep(0.1)
        accepted = self._accepted_token(rec["task_id"])
        if accepted is None:
            raise RuntimeError(f"{rec['task_id']}: no accepted row behind kill_after_commit")
        return {"task_id": rec["task_id"], "pid": pid, "token": rec.get("token"),
                "accepted_token": accepted, "child_dead": True}  # fmt: skip

    def _f_publish_error(self, w: ChaosWorker) -> dict[str, Any]:
        offset = len(w.log_text().encode())
        rec = self._fire_armed(w, PUBLISH_ARM, "publish_error", "re-publish")
        # The proof: the worker logged the failed publish of that task id
        # (requeued; or, on code that lets it escape, the task's error).
        lines = (f"could not re-publish {rec['task_id']}", f"[{rec['task_id']}] raised unexpected")
        deadline = time.monotonic() + 10.0
        while not any(x in w.log_text(offset) for x in lines):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rec['task_id']}: its failed re-publish was not logged")
            time.sleep(0.1)
        return {"task_id": rec["task_id"], "pid": rec["pid"], "publish_failed": True}

    def _history_record(self, event: str, nonce: str) -> dict[str, Any] | None:
        needle = nonce.encode()
        with open(self.c.history, "rb") as fh:
            for line in fh:
                if needle in line:
                    try:
                        rec: dict[str, Any] = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("ev") == event:
                        return rec
        return None

    def _accepted_token(self, task_id: str) -> int | None:
        import psycopg

        assert self.c.pg is not None
        deadline = time.monotonic() + 30.0
        while True:
            try:
                with psycopg.connect(self.c.pg.dsn(self._results_db()), connect_timeout=5) as conn:
                    row = conn.execute(
                        "SELECT fencing_token FROM celery_lease_results WHERE task_id = %s",
                        (task_id,),
                    ).fetchone()
                return int(row[0]) if row else None
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")
