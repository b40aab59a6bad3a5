"""Fault injection: seeded, logged, each fault on a target nobody else is faulting.

Kinds (``KINDS``):

``worker_stop``       SIGSTOP a whole worker (process group) for TTL + 0.5..3 s, then SIGCONT
``child_kill``        SIGKILL one prefork child (preferably one running a body)
``worker_kill``       SIGKILL a whole worker, then start it again
``clock_skew``        restart a worker under ``faketime -f '+1h'`` or ``'-1h'``
                      (``FAKETIME_DONT_FAKE_MONOTONIC=1``); it is restarted with
                      the true clock 10..30 s later (a heal, not counted)
``broker_conn_kill``  Redis: ``CLIENT KILL TYPE normal|pubsub``; RabbitMQ: close every connection
``broker_restart``    stop (SIGTERM or SIGKILL) and start the broker
``store_restart``     stop (SIGTERM or SIGKILL) and start the lease store's Redis
``pg_restart``        restart PostgreSQL (results, protected table), fast or immediate
``store_unreachable`` SIGSTOP the lease store's Redis or PostgreSQL for 2..5 s, then SIGCONT

and the kinds of :mod:`tests.chaos.server_faults` (``store_oom``,
``store_readonly``, ``results_readonly``, ``store_long_outage``,
``results_long_outage``, ``kill_after_commit``, ``publish_error``) and of
:mod:`tests.chaos.expiry_faults` (``store_expiry_lag``), each proven before
it counts.

The next kind is always one of the least injected so far (ties broken by the
seeded RNG), so a run of n faults has every kind n / 17 times, give or take
one. Every fault is appended to ``faults.jsonl`` with its real start and end
time.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.chaos.cluster import ChaosWorker, Cluster
from tests.chaos.expiry_faults import EXPIRY_KINDS, ExpiryFaults
from tests.chaos.server_faults import SERVER_KINDS, ServerFaults

__all__ = ["KINDS", "Injector"]

KINDS = (
    "worker_stop",
    "child_kill",
    "worker_kill",
    "clock_skew",
    "broker_conn_kill",
    "broker_restart",
    "store_restart",
    "pg_restart",
    "store_unreachable",
    *SERVER_KINDS,
    *EXPIRY_KINDS,
)
SKEWS = ("+1h", "-1h")
#: the kinds that act on the Redis lease store only: left out when the leases are in
#: PostgreSQL (``--store pg``), whose faults are ``pg_restart``, ``results_*`` and
#: ``store_unreachable`` on ``pg``
REDIS_STORE_KINDS = (
    "store_restart", "store_oom", "store_readonly", "store_long_outage", "store_expiry_lag",
)  # fmt: skip
#: the kinds that also hold the broker's lock (no broker fault while they last)
LONG_OUTAGES = ("store_long_outage", "results_long_outage")
#: the kinds that act on one worker (its lock taken)
WORKER_KINDS = (
    "worker_stop", "child_kill", "worker_kill", "clock_skew", "kill_after_commit", "publish_error",
)  # fmt: skip
#: the kinds that fire only inside a task's execution on the armed worker: they
#: need tasks still coming, so among kinds applied equally often they go first
#: (the workload is published over the first 70 % of the run; armed near its
#: end, such a kind waits for a commit that never comes)
ARMED_KINDS = ("kill_after_commit", "publish_error")


class Injector(ServerFaults, ExpiryFaults):
    def __init__(
        self,
        cluster: Cluster,
        rng: random.Random,
        *,
        rate: float,
        kinds: tuple[str, ...] = KINDS,
        log: Any = print,
    ) -> None:
        self.c = cluster
        self.rng = rng
        self.rate = rate
        self.kinds = kinds
        self.log = log
        self.counts: Counter[str] = Counter()  # applied
        self.failed: Counter[str] = Counter()
        self.path = cluster.workdir / "faults.jsonl"
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._unskew_at: dict[str, float] = {}
        self._stop = threading.Event()
        self.running: dict[int, str] = {}  # pid -> task id, from the history's tail
        self._history_pos = 0
        self.publish_probe = None
        #: publishes a batch of work for the cover phase; set by the runner
        self.publish_work: Callable[[], None] | None = None
        self._probes: list[str] = []

    # -- the loop ----------------------------------------------------------

    def run(self, until: float, cover_within: float = 0.0) -> None:
        """Inject faults until ``until`` (monotonic); then, for up to ``cover_within``
        seconds more, only the kinds never applied yet (on a loaded machine a kind
        can fail to apply at every try of a short run); then wait for them and heal."""
        self._inject_until(until, self.kinds)
        missing = tuple(k for k in self.kinds if not self.counts[k])
        if missing and cover_within > 0:
            self.log(f"faults never applied: {list(missing)}; trying them {cover_within:.0f}s more")
            self._inject_until(time.monotonic() + cover_within, missing)
        self.heal()

    def _inject_until(self, until: float, kinds: tuple[str, ...]) -> None:
        while time.monotonic() < until and not self._stop.is_set():
            pause = min(self.rng.expovariate(self.rate), max(0.0, until - time.monotonic()))
            self._stop.wait(pause)
            self._unskew_due()
            if time.monotonic() >= until:
                break
            if kinds is not self.kinds and all(self.counts[k] for k in kinds):
                break  # every kind applied
            if kinds is not self.kinds and self.publish_work is not None:
                self.publish_work()  # the plan is all published: give the fault work
            self._inject_one(kinds)

    def _inject_one(self, kinds: tuple[str, ...]) -> None:
        # The kind applied least often goes first; an attempt that failed to
        # apply (a worker between restarts has no pool child to kill) does not
        # count as applied, so that kind is tried again soon: a short run must
        # apply every kind, not merely try it.
        launched = Counter({k: self.counts[k] for k in kinds})
        for k in self._inflight_kinds():
            if k in launched:
                launched[k] += 1
        order = sorted(
            kinds,
            key=lambda k: (launched[k], self.failed[k], k not in ARMED_KINDS, self.rng.random()),
        )
        for kind in order:
            target = self._target(kind)
            if target is None:
                continue
            t = threading.Thread(
                target=self._apply, args=(kind, target), name=f"fault-{kind}", daemon=True
            )
            t.kind = kind  # type: ignore[attr-defined]
            t.start()
            self._threads.append(t)
            return

    def _inflight_kinds(self) -> list[str]:
        self._threads = [t for t in self._threads if t.is_alive()]
        return [t.kind for t in self._threads]  # type: ignore[attr-defined]

    def _target(self, kind: str) -> Any:
        """A free target for ``kind``, its lock taken (released by ``_apply``)."""
        if kind in WORKER_KINDS:
            candidates = [w for w in self.c.workers if w.alive()]
            if kind in ("child_kill", "kill_after_commit", "publish_error"):
                candidates = [w for w in candidates if w.pool == "prefork" and not w.stopped()]
            if kind == "clock_skew":
                candidates = [w for w in candidates if not w.skew]
            self.rng.shuffle(candidates)
            for w in candidates:
                if w.lock.acquire(blocking=False):
                    return w
            return None
        name = {
            "broker_conn_kill": "broker",
            "broker_restart": "broker",
            "store_restart": "store",
            "pg_restart": "pg",
            "store_unreachable": (
                "pg" if self.c.store_kind == "pg" else self.rng.choice(("store", "pg"))
            ),
            "store_oom": "store",
            "store_expiry_lag": "store",
            "store_readonly": "store",
            "store_long_outage": "store",
            "results_readonly": "pg",
            "results_long_outage": "pg",
        }[kind]
        lock = self.c.locks[name]
        if not lock.acquire(blocking=False):
            return None
        if kind in LONG_OUTAGES:
            # The broker stays up through a long outage: its probe must be
            # delivered, again and again, to prove the outage outlasted the
            # deferral budget; broker faults meanwhile lost or delayed it.
            if not self.c.locks["broker"].acquire(blocking=False):
                lock.release()
                return None
        return name

    def _apply(self, kind: str, target: Any) -> None:
        start = time.time()
        entry: dict[str, Any] = {"kind": kind, "start": start}
        try:
            detail = getattr(self, f"_f_{kind}")(target)
            entry.update(ok=True, detail=detail)
            with self._lock:
                self.counts[kind] += 1
        except Exception as e:  # noqa: BLE001 - a fault that failed is logged, not fatal
            entry.update(ok=False, error=f"{type(e).__name__}: {e}")
            with self._lock:
                self.failed[kind] += 1
        finally:
            if isinstance(target, ChaosWorker):
                target.lock.release()
            else:
                self.c.locks[target].release()
                if kind in LONG_OUTAGES:
                    self.c.locks["broker"].release()
        entry["end"] = time.time()
        entry["target"] = target.name if isinstance(target, ChaosWorker) else target
        self._append(entry)
        self.log(
            f"fault {kind} on {entry['target']}: "
            + (json.dumps(entry.get("detail")) if entry["ok"] else entry["error"])
        )

    def _append(self, entry: dict[str, Any]) -> None:
        with self._lock, open(self.path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")

    # -- heal --------------------------------------------------------------

    def heal(self) -> None:
        """Wait for in-flight faults, undo skews, bring every server and worker back."""
        for t in list(self._threads):
            t.join(120)
        for name in list(self._unskew_at):
            self._unskew(name)
        for s in self.c.servers():
            s.ensure_running()
        for w in self.c.workers:
            with w.lock:
                if w.alive():
                    w.cont_group()
                else:
                    w.kill()
                    w.launch(w.skew)

    def _unskew_due(self) -> None:
        now = time.monotonic()
        for name, at in list(self._unskew_at.items()):
            if at <= now:
                self._unskew_at[name] = math.inf  # taken care of by the thread
                t = threading.Thread(target=self._unskew, args=(name,), daemon=True)
                t.kind = "heal_clock"  # type: ignore[attr-defined]
                t.start()
                self._threads.append(t)

    def _unskew(self, name: str) -> None:
        w = next(w for w in self.c.workers if w.name == name)
        if not w.lock.acquire(timeout=60):
            return
        try:
            self._unskew_at.pop(name, None)
            w.terminate(grace=10.0)
            w.launch(None)
            self._append({"kind": "heal_clock", "target": name, "start": time.time()})
            self.log(f"heal: {name} restarted with the true clock")
        finally:
            w.lock.release()

    # -- the faults ----------------------------------------------------------

    def _f_worker_stop(self, w: ChaosWorker) -> dict[str, Any]:
        hold = self.c.ttl + self.rng.uniform(0.5, 3.0)
        w.stop_group()
        try:
            time.sleep(hold)
        finally:
            w.cont_group()
        return {"seconds": round(hold, 2)}

    def _f_child_kill(self, w: ChaosWorker) -> dict[str, Any]:
        import os
        import signal

        children = w.pool_children()
        if not children:
            raise RuntimeError(f"{w.name} has no pool children")
        self._tail_history()
        busy = [p for p in children if p in self.running]
        pid = self.rng.choice(busy or children)
        os.kill(pid, signal.SIGKILL)
        return {"pid": pid, "busy": pid in busy, "task_id": self.running.get(pid)}

    def _f_worker_kill(self, w: ChaosWorker) -> dict[str, Any]:
        w.kill()
        w.launch(w.skew)
        return {"skew": w.skew}

    def _f_clock_skew(self, w: ChaosWorker) -> dict[str, Any]:
        skew = self.rng.choice(SKEWS)
        w.terminate(grace=10.0)
        w.launch(skew)
        hold = self.rng.uniform(10.0, 30.0)
        self._unskew_at[w.name] = time.monotonic() + hold
        return {"skew": skew, "for": round(hold, 1)}

    def _f_broker_conn_kill(self, _: str) -> dict[str, Any]:
        # Right after a broker restart nobody may have reconnected yet: wait
        # (a little) for connections, and count the fault only if it hit one.
        deadline = time.monotonic() + 10.0
        while True:
            if self.c.broker_redis is not None:
                killed = 0
                for kind in ("normal", "pubsub"):
                    reply = self.c.broker_redis.command("CLIENT", "KILL", "TYPE", kind)
                    killed += int(reply[1:]) if reply[:1] == b":" else 0
            else:
                assert self.c.rabbit is not None
                killed = len(self.c.rabbit.list_connections())
                if killed:
                    self.c.rabbit.close_all_connections("chaos")
            if killed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not killed:
            raise RuntimeError("no client connection to kill")
        return {"killed": killed}

    def _f_broker_restart(self, _: str) -> dict[str, Any]:
        hard = self.rng.random() < 0.5
        server = self.c.broker_redis or self.c.rabbit
        assert server is not None
        server.restart(hard=hard)
        return {"hard": hard}

    def _f_store_restart(self, _: str) -> dict[str, Any]:
        hard = self.rng.random() < 0.5
        assert self.c.store is not None
        self.c.store.restart(hard=hard)
        return {"hard": hard}

    def _f_pg_restart(self, _: str) -> dict[str, Any]:
        mode = self.rng.choice(("fast", "immediate"))
        assert self.c.pg is not None
        self.c.pg.restart(mode=mode)
        return {"mode": mode}

    def _f_store_unreachable(self, name: str) -> dict[str, Any]:
        server = self.c.store if name == "store" else self.c.pg
        assert server is not None
        hold = self.rng.uniform(2.0, 5.0)
        server.pause()
        try:
            time.sleep(hold)
        finally:
            server.resume()
        return {"server": "lease store (Redis)" if name == "store" else "PostgreSQL",
                "seconds": round(hold, 2)}  # fmt: skip

    # -- which pids run a body ------------------------------------------------

    def _tail_history(self) -> None:
        path = Path(self.c.history)
        if not path.exists():
            return
        with open(path, "rb") as fh:
            fh.seek(self._history_pos)
            data = fh.read()
        cut = data.rfind(b"\n") + 1
        self._history_pos += cut
        for line in data[:cut].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("ev") == "start":
                self.running[rec["pid"]] = rec["task_id"]
            elif rec.get("ev") == "end":
                self.running.pop(rec["pid"], None)
